"""Counter-based random numbers: every number is a hash of (seed, absolute token position, purpose[, token id]).

No generator state exists anywhere: the sampler on the target's device, the draft worker and the in-process engine
compute the same numbers for the same request and position, and a request re-prefilled on another replica (its seed
travels with it, engine/request/settings.SequenceSettings.seed) continues the same stream. The idea is Philox's (Salmon
et al. 2011, "Parallel random numbers: as easy as 1, 2, 3"): randomness as a pure function of a counter, here a small
integer mixing function (a 32-bit finaliser from Wellons' hash prospector: xor-shift, multiply, xor-shift, multiply,
xor-shift), vectorised over torch integer tensors on whatever device the caller works on.

Integer ops only, so CPU and CUDA give bit-identical hashes and uniforms. Values live in int64 tensors but never
leave 32 bits, and both multipliers are below 2^31, so a product stays below 2^63: no signed 64-bit overflow (its
wraparound is undefined behaviour in C++ and differs between backends in principle). Gumbel noise takes a `log`
of those uniforms, which may differ in the last float32 ulp between backends; an argmax over it could differ only
on an exact tie.

Cost: Gumbel noise is one hash per (row, position, token): the token's own key (hashed once per vocabulary and
device, cached) xor the position's hash, mixed in place: ~11 elementwise passes over [B, K+1, V]. On a CPU at a
large vocabulary that is a visible part of a seeded row's round, though several times less than what a 16-bit-split
multiply cost (measured: bench/RESULTS.md). On a GPU it is negligible; on CPU it is the price of seeded
(drafter-invariant) sampling.

Purposes keep the streams of one position apart (the draft's proposal, the verifier's accept test and its
recovered/bonus draw, the Gumbel noise of seeded rows).
"""

from __future__ import annotations

import secrets

import torch

MASK32 = 0xFFFFFFFF
# one stream per use of a position: never reuse a purpose for two draws that must be independent
DRAFT = 1  # the draft model's sample (unseeded sampled rows, inverse CDF over its compact proposal)
ACCEPT = 2  # the rejection sampler's accept test u < p/q
RESIDUAL = 3  # the recovered (or bonus) token: inverse CDF over norm(max(0, p - q)) or p
GUMBEL = 4  # seeded rows: the Gumbel noise of argmax(log p + G), shared by draft and target
DRAFT_TAIL = 5  # the draft's token within the uniform tail of its compact proposal (engine/spec/proposal.py)

_GOLDEN = 0x9E3779B9  # 2^32 / phi: separates the hashed inputs


def draw_seed() -> int:
    """A seed for a request that brought none: drawn once at admission (the router, the in-process engine) and kept
    with the request, so every replica that serves it draws the same numbers."""
    return secrets.randbits(63)


_C1, _C2 = 0x21F0AAAD, 0x735A2D97  # both odd and below 2^31: x * c < 2^63 for any 32-bit x


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (hash prospector's [16 21f0aaad 15 735a2d97 15]): every input bit flips about half
    the output bits. x in [0, 2^32), int64."""
    x = x ^ (x >> 16)
    x = (x * _C1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _C2) & MASK32
    return x ^ (x >> 15)


def _mix_(x: torch.Tensor) -> torch.Tensor:
    """`_mix` in place (the [B, K+1, V] tensors of Gumbel noise: no temporaries beyond one shift)."""
    x.bitwise_xor_(x >> 16)
    x.mul_(_C1).bitwise_and_(MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_C2).bitwise_and_(MASK32)
    return x.bitwise_xor_(x >> 15)


def _absorb(h: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    return _mix(h ^ (((value & MASK32) + _GOLDEN) & MASK32))


_TOKEN_KEYS: dict[tuple[int, str], torch.Tensor] = {}


def _token_key(token_ids: torch.Tensor) -> torch.Tensor:  # int64: each token id's own hash
    return _mix((token_ids.long() + _GOLDEN) & MASK32)


def _token_keys(vocab: int, device: torch.device) -> torch.Tensor:  # [V] int64: `_token_key` of 0..V-1, cached
    key = (vocab, str(device))
    keys = _TOKEN_KEYS.get(key)
    if keys is None:
        keys = _TOKEN_KEYS[key] = _token_key(torch.arange(vocab, device=device))
    return keys


def hash32(
    seeds: torch.Tensor,  # [...] int64, any 64-bit seed (both halves are hashed)
    positions: torch.Tensor,  # [...] int64, broadcastable with seeds
    purpose: int,
    token_ids: torch.Tensor | None = None,  # [..., V] int64, broadcastable; None: one number per position
) -> torch.Tensor:  # int64 in [0, 2^32)
    """The counter hash of (seed, position, purpose[, token id])."""
    seeds, positions = seeds.long(), positions.long()
    h = _mix((seeds & MASK32) ^ purpose)
    h = _absorb(h, (seeds >> 32) & MASK32)
    h = _absorb(h, positions)
    if token_ids is not None:  # as `gumbel` computes it: the token's key xor the position's hash, mixed
        h = _mix_(_token_key(token_ids) ^ h[..., None])
    return h


def uniforms(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, n] int64: the absolute position each number belongs to
    purpose: int,
) -> torch.Tensor:  # [B, n] float32 in (0, 1), never 0 or 1
    """One uniform per (row, position): 24 bits, centred in their bin (exact in float32 on every device)."""
    assert positions.dim() == 2 and seeds.shape == positions.shape[:1], "seeds [B], positions [B, n]"
    h = hash32(seeds[:, None], positions, purpose)
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def gumbel(
    seeds: torch.Tensor,  # [B] int64
    positions: torch.Tensor,  # [B, n] int64
    vocab: int,
) -> torch.Tensor:  # [B, n, V] float32 standard Gumbel noise, -log(-log u)
    """Gumbel noise per (row, position, token id): argmax(log p + G) is then a sample of p (the Gumbel-max trick),
    and every party that knows the seed and the position draws the same noise."""
    assert positions.dim() == 2 and seeds.shape == positions.shape[:1], "seeds [B], positions [B, n]"
    h = hash32(seeds[:, None], positions, GUMBEL)  # [B, n]
    h = _mix_(_token_keys(vocab, positions.device) ^ h[..., None])  # [B, n, V]: hash32(..., GUMBEL, token ids)
    u = (h >> 8).float().add_(0.5).mul_(1.0 / (1 << 24))
    return u.log_().neg_().log_().neg_()


def seeds_tensor(seeds: list[int], device: torch.device | str = "cpu") -> torch.Tensor:  # [B] int64
    """Python seeds (any int; taken mod 2^64) as an int64 tensor whose two 32-bit halves are the seed's."""
    wrapped = [s & ((1 << 64) - 1) for s in seeds]
    return torch.tensor([s - (1 << 64) if s >= 1 << 63 else s for s in wrapped], dtype=torch.long, device=device)


def inverse_cdf(
    probs: torch.Tensor,  # [B, V] non-negative, each row with positive mass (need not sum to 1)
    u: torch.Tensor,  # [B] uniforms in (0, 1)
) -> torch.Tensor:  # [B] int64
    """One categorical draw per row from one uniform: the first index whose cumulative mass exceeds u * total.
    A token of probability 0 is never drawn. The cumulative sum runs in float64 (128k-token vocabularies)."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u.double() * cdf[:, -1])[:, None]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
    # rounding can leave the target at the total: then take the last token with mass
    bad = probs.gather(-1, idx[:, None]).squeeze(-1) <= 0
    if bool(bad.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        idx = torch.where(bad, last, idx)
    return idx
