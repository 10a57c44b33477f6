"""Counter-based random numbers (engine/spec/randomness.py): pure functions of (seed, position, purpose[, token]), fixed
values, the 32-bit arithmetic checked against Python's unbounded integers, uniform and independent enough."""

import math

import pytest
import torch

from engine.spec.randomness import (
    ACCEPT,
    DRAFT,
    GUMBEL,
    RESIDUAL,
    draw_seed,
    gumbel,
    hash32,
    inverse_cdf,
    seeds_tensor,
    uniforms,
)

M = 0xFFFFFFFF


def reference_hash(seed: int, position: int, purpose: int, token: int | None = None) -> int:
    """The same hash in Python integers (no overflow possible): what the tensor version must equal bit for bit."""
    def mix(x):
        x ^= x >> 16
        x = (x * 0x21F0AAAD) & M
        x ^= x >> 15
        x = (x * 0x735A2D97) & M
        return x ^ (x >> 15)

    def absorb(h, v):
        return mix(h ^ (((v & M) + 0x9E3779B9) & M))

    seed &= (1 << 64) - 1
    h = mix((seed & M) ^ purpose)
    h = absorb(h, seed >> 32)
    h = absorb(h, position)
    return h if token is None else mix(mix((token + 0x9E3779B9) & M) ^ h)


def test_the_hash_equals_the_unbounded_integer_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    seeds = [0, 1, 2**31 - 1, 2**32, 2**63 - 1, -1, -(2**40) + 7]
    seeds += torch.randint(0, 2**62, (20,), generator=gen).tolist()
    positions = torch.randint(0, 2**31, (len(seeds),), generator=gen)
    got = hash32(seeds_tensor(seeds), positions, ACCEPT).tolist()
    assert got == [reference_hash(s, int(p), ACCEPT) for s, p in zip(seeds, positions)]
    tokens = torch.arange(0, 130_000, 4099)
    got = hash32(seeds_tensor([seeds[3]])[:, None], positions[3:4, None], GUMBEL, tokens).tolist()[0][0]
    assert got == [reference_hash(seeds[3], int(positions[3]), GUMBEL, int(t)) for t in tokens]


def test_fixed_values_on_cpu():
    """Pinned: a change of the hash changes every seeded text, so it must be deliberate."""
    assert hash32(seeds_tensor([0, 1, 2**40 + 3, -5]), torch.tensor([0, 1, 2, 3]), ACCEPT).tolist() == [
        3256956166, 1732583959, 2487795523, 3130011272]
    got = uniforms(seeds_tensor([1234]), torch.tensor([[0, 1, 2]]), DRAFT)[0].tolist()
    assert got == pytest.approx([0.13318780064582825, 0.3762263357639313, 0.8314903974533081], abs=0)
    noise = gumbel(seeds_tensor([7]), torch.tensor([[5]]), 4)[0, 0].tolist()
    assert noise == pytest.approx([1.0853253602981567, 1.3901532888412476, 0.7279713153839111, 0.2387409657239914],
                                  rel=1e-6)


def test_deterministic_and_different_by_seed_position_and_purpose():
    seeds, positions = seeds_tensor([3, 4]), torch.tensor([[10, 11], [10, 11]])
    a = uniforms(seeds, positions, ACCEPT)
    assert torch.equal(a, uniforms(seeds, positions, ACCEPT))
    assert not torch.equal(a, uniforms(seeds, positions, RESIDUAL))
    assert a[0, 0] != a[1, 0] and a[0, 0] != a[0, 1]
    # a row's numbers do not depend on the batch it is computed in
    assert torch.equal(uniforms(seeds[1:], positions[1:], ACCEPT), a[1:])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_gives_the_cpu_values():
    seeds, positions = seeds_tensor(list(range(64))), torch.arange(64 * 5).view(64, 5)
    assert torch.equal(uniforms(seeds, positions, DRAFT), uniforms(seeds.cuda(), positions.cuda(), DRAFT).cpu())
    cpu, cuda = gumbel(seeds, positions, 1000), gumbel(seeds.cuda(), positions.cuda(), 1000).cpu()
    assert torch.allclose(cpu, cuda, rtol=1e-6, atol=1e-6) and torch.equal(cpu.argmax(-1), cuda.argmax(-1))


def test_uniforms_are_uniform_and_uncorrelated():
    n = 200_000
    u = uniforms(torch.arange(n), torch.tensor([[5, 6]]).expand(n, -1), ACCEPT)  # consecutive seeds: a hard case
    assert 0 < float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u[:, 0], bins=20, min=0, max=1)
    chi2 = float(((counts - n / 20) ** 2 / (n / 20)).sum())
    assert chi2 < 45, f"chi-square {chi2} with 19 degrees of freedom (p < 1e-3 above 43.8)"
    # the two positions of one seed are independent: correlation near 0 (sd 1/sqrt(n) ~ 0.002)
    corr = torch.corrcoef(u.T.double())[0, 1].item()
    assert abs(corr) < 0.01
    # a failing control: a hash that ignored the position would give correlation 1
    assert torch.corrcoef(torch.stack([u[:, 0], u[:, 0]]).double())[0, 1] > 0.99


def test_gumbel_noise_is_the_token_hash_of_its_position():
    seeds, positions = seeds_tensor([5, 2**50]), torch.tensor([[3, 4], [0, 9]])
    u = ((hash32(seeds[:, None], positions, GUMBEL, torch.arange(300)) >> 8).float() + 0.5) / (1 << 24)
    assert torch.allclose(gumbel(seeds, positions, 300), -torch.log(-torch.log(u)))


def test_gumbel_noise_has_the_standard_gumbel_mean_and_variance():
    g = gumbel(torch.arange(2000), torch.zeros(2000, 1, dtype=torch.long), 100).flatten().double()
    assert abs(g.mean().item() - 0.5772) < 0.01 and abs(g.var().item() - math.pi**2 / 6) < 0.03


def test_inverse_cdf_draws_by_mass_and_never_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.8, 0.0]]).expand(50_000, -1)
    u = uniforms(torch.arange(50_000), torch.zeros(50_000, 1, dtype=torch.long), RESIDUAL)[:, 0]
    ids = inverse_cdf(probs, u)
    assert set(ids.tolist()) == {1, 3}
    assert abs((ids == 1).float().mean().item() - 0.2) < 0.01
    assert inverse_cdf(torch.tensor([[0.3, 0.7, 0.0]]), torch.tensor([1.0 - 1e-9])).tolist() == [1]


def test_drawn_seeds_differ():
    assert len({draw_seed() for _ in range(100)}) == 100
