"""What a round costs and how well each request's drafts agree: the inputs of the round plan (engine/spec/plan.py).

Leviathan et al. 2022 (arXiv 2211.17192), section 3.4: with per-token acceptance rate a and K drafts a round
emits E(a, K) = (1 - a^(K+1)) / (1 - a) tokens in expectation, and costs K draft steps plus one verify pass of
K+1 tokens. Speculation pays while E(a, K) / cost(K) beats plain decoding's 1 / cost(0). Both costs depend on the
batch: at batch 1 verifying K+1 tokens costs little more than one decode step (memory-bound), but as the batch
grows the verify pass becomes compute-bound and the drafts stop being free. `CostProfile` holds those costs as
measured on one machine for one model pair (engine/calibration/measure.py); `plan_round` (engine/spec/plan.py) is
the one place that weighs them against the rows' acceptance and picks each round's K, 0 for every row once the
batch is past the point where drafting pays.

`CostCorrection` pulls the profile toward the costs the rounds really see. `AcceptanceTracker` estimates a per
request from recent rounds; a request whose drafts keep failing drops to K = 0 and probes with K = 1 after
`PROBE_EVERY` rounds, so a request whose text turns predictable gets its drafts back; each probe that does not bring
drafting back doubles the wait before the next (up to `MAX_PROBE_EVERY`), since a probe costs draft steps that buy
little (two rounds of them for a drafter inside the target, whose drafts are verified in the round after they are
made). Without a profile, `load_adjusted_k`'s fixed threshold is the (uncalibrated) fallback.
"""

from __future__ import annotations

import json
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

PRIOR_ACCEPTANCE = 0.7  # a new request's assumed per-token acceptance (pulls the estimate for a few rounds)
PRIOR_WEIGHT = 2.0  # in draft tokens: how quickly observations outweigh the prior
DECAY = 0.8  # per round: the weight of older rounds (about the last 5 rounds count)
PROBE_EVERY = 8  # rounds at K = 0 before a request asks for a probing round with K = 1 (engine/spec/plan.py decides)
MAX_PROBE_EVERY = 64  # the longest wait between probes, after probes that kept failing
DRAFTED, PLAIN, AHEAD = "drafted", "plain", "ahead"  # kinds of round whose overhead CostCorrection keeps apart
MIN_ROUND_SHARE = 0.1  # the least share of its verify pass a round costs, whatever overhead credit it was given
CORRECTION_WEIGHT = 0.1  # weight of one round's observed/predicted cost ratio once a few rounds are in


def load_adjusted_k(k: int, num_live: int, max_batch: int | None) -> int:
    """The uncalibrated fallback: K up to `max_batch` live sequences, 0 above."""
    if max_batch is not None and num_live > max_batch:
        return 0
    return k


def expected_tokens(acceptance: float, k: int) -> float:
    """E(a, K): expected tokens one round emits (accepted drafts plus the recovered or bonus token)."""
    if k <= 0:
        return 1.0
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def cost_at(sizes: Sequence[int], values: Sequence[float], batch: int) -> float:
    """A pass's cost at `batch` rows from its costs measured at the ascending batch `sizes`.

    Between measured sizes: linear. Beyond the largest: along the last segment, never below the largest measured
    cost (a bigger batch never costs less, even from a profile that is not monotone, such as a hand-edited
    calibration file). Below the smallest: along the first segment, at least 0. From one measured size (a runner
    of one slot): proportional to the rows.

    A runner measures only the batches its KV cache holds (engine/calibration/measure.py), so a profile can end at 1 or
    2 rows. The last segment is the local slope where the pass is as memory- or compute-bound as just beyond it; the
    per-row cost of the largest measured batch instead would take every bigger pass as wholly compute-bound, which on a
    GPU makes a few more rows look several times dearer than they are and stops speculation early. A single point has no
    slope, and there the per-row reading is the cautious one (it never makes drafting look cheaper than measured). Where
    either errs, `CostCorrection` pulls the costs toward what the rounds really take.
    """
    if len(sizes) != len(values) or not sizes:
        raise ValueError("one cost per measured batch size")
    if len(sizes) == 1:
        return values[0] * batch / sizes[0]
    i = min(max(bisect_left(sizes, batch), 1), len(sizes) - 1)
    b0, b1 = sizes[i - 1], sizes[i]
    v0, v1 = values[i - 1], values[i]
    line = v0 + (v1 - v0) * (batch - b0) / (b1 - b0)
    if batch > sizes[-1]:
        return max(line, v1)
    return max(line, 0.0)


@dataclass(frozen=True)
class CostProfile:
    """Measured seconds per round part, by batch size; the unit every round plan (engine/spec/plan.py) is made
    in."""

    batch_sizes: tuple[int, ...]  # ascending, e.g. (1, 2, 4, 8, 16)
    verify_seconds: tuple[tuple[float, ...], ...]  # [batch][w]: one target pass over w+1 tokens per sequence
    draft_step_seconds: tuple[float, ...]  # [batch]: one draft model step (0 for a proposer without a model)
    draft_prefill_seconds_per_token: float = 0.0  # the draft reading a prompt it has not seen (0: no model)
    round_overhead_seconds: float = 0.0  # per round outside the models (RPC, serialization); observed online
    # more per round when it drafts (the router's n-gram lookups, the draft call's hops); observed online
    draft_overhead_seconds: float = 0.0
    # [batch]: a round's drafting when it makes token trees (engine/spec/tree.py) of the configured size, where it
    # costs more than the chain's K steps (a head's EAGLE-2 expansion); None: measured only as a chain
    tree_draft_seconds: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or not self.batch_sizes:
            raise ValueError("batch_sizes must be distinct and ascending")
        if len(self.verify_seconds) != len(self.batch_sizes) or len(self.draft_step_seconds) != len(self.batch_sizes):
            raise ValueError("one row of costs per batch size")
        if any(len(row) != len(self.verify_seconds[0]) or len(row) < 2 for row in self.verify_seconds):
            raise ValueError("every batch size needs verify costs for widths 1..K+1 (at least 2)")

    @property
    def max_k(self) -> int:
        return len(self.verify_seconds[0]) - 1

    def _at_batch(self, values: list[float], batch: int) -> float:
        return cost_at(self.batch_sizes, values, batch)

    def verify(self, batch: int, k: int) -> float:
        """Seconds of a verify pass over `batch` sequences with k drafts each (k beyond the profile: linear)."""
        widths = self.max_k
        if k <= widths:
            return self._at_batch([row[k] for row in self.verify_seconds], batch)
        last, before = (self._at_batch([row[w] for row in self.verify_seconds], batch) for w in (widths, widths - 1))
        return last + (last - before) * (k - widths)

    def draft(self, batch: int, k: int) -> float:
        return k * self._at_batch(list(self.draft_step_seconds), batch)

    def scaled(self, draft: float, verify: float, overhead: float = 0.0, verify_wide: float | None = None,
               draft_overhead: float = 0.0) -> "CostProfile":
        """Costs times the given ratios: draft steps by `draft`, one-token verify passes by `verify`, wider ones by
        `verify_wide` (default `verify`), never below the one-token pass of the same batch; the overheads given."""
        wide = verify if verify_wide is None else verify_wide
        rows = tuple((row[0] * verify, *(max(t * wide, row[0] * verify) for t in row[1:]))
                     for row in self.verify_seconds)
        trees = None if self.tree_draft_seconds is None else tuple(t * draft for t in self.tree_draft_seconds)
        return CostProfile(self.batch_sizes, rows, tuple(t * draft for t in self.draft_step_seconds),
                           self.draft_prefill_seconds_per_token * draft, overhead, draft_overhead, trees)

    def tree_draft(self, batch: int, k: int) -> float:
        """Seconds of a round's tree drafting over `batch` rows (the chain's K steps where not measured)."""
        if self.tree_draft_seconds is None:
            return self.draft(batch, k)
        return max(self._at_batch(list(self.tree_draft_seconds), batch), self.draft(batch, k))

    def round_seconds(self, batch: int, k: int, drafting: int | None = None) -> float:
        """One round of `batch` sequences verified at width k+1, of which `drafting` (default: all) draft k tokens.

        The round overhead may be below zero (a plain round's step decoded ahead while the router delivered the round
        before: `CostCorrection`); a round never costs less than `MIN_ROUND_SHARE` of its verify pass, so a
        credit observed at one batch size cannot make a round at a smaller one free."""
        drafting = batch if drafting is None else drafting
        draft = self.draft(drafting, k) + self.draft_overhead_seconds if drafting and k else 0.0
        verify = self.verify(batch, k)
        return max(draft + verify + self.round_overhead_seconds, MIN_ROUND_SHARE * verify)

    # ---- files (written by `specserve-calibrate`, deployments/calibrate.py) ------------------------------------
    def to_json(self, path: str | Path, **meta) -> None:
        Path(path).write_text(json.dumps({**asdict(self), "meta": meta}, indent=2) + "\n")

    @classmethod
    def from_json(cls, path: str | Path) -> "CostProfile":
        data = json.loads(Path(path).read_text())
        return cls(batch_sizes=tuple(data["batch_sizes"]),
                   verify_seconds=tuple(tuple(row) for row in data["verify_seconds"]),
                   draft_step_seconds=tuple(data["draft_step_seconds"]),
                   draft_prefill_seconds_per_token=data.get("draft_prefill_seconds_per_token", 0.0),
                   tree_draft_seconds=None if data.get("tree_draft_seconds") is None
                   else tuple(data["tree_draft_seconds"]))


def worth_starting(profile: CostProfile, batch: int, acceptance: float, k: int, context: int,
                   remaining: int) -> bool:
    """Whether a request whose draft model is `context` tokens behind should start (or resume) drafting: the draft
    must first read those tokens (a prefill: the whole context for a request that has not drafted yet, or what
    was generated while it drafted nothing), which pays only if the rest of the request saves more than that at
    the expected rate."""
    if k <= 0:
        return False
    plain = profile.round_seconds(batch, 0)
    speculative = profile.round_seconds(batch, k) / expected_tokens(acceptance, k)
    return remaining * (plain - speculative) > context * profile.draft_prefill_seconds_per_token


def _clamped_ratio(seconds: float, predicted: float) -> float:
    """Observed over predicted, kept within 0.1-10 (one odd round does not swing the plan)."""
    return min(max(seconds / predicted, 0.1), 10.0)


class _RunningMean:
    """A running mean of observations: the first few count as a plain mean, later ones with `CORRECTION_WEIGHT`."""

    def __init__(self, value: float) -> None:
        self.value, self.n = value, 0

    def add(self, x: float) -> None:
        self.value += max(1.0 / (self.n + 1), CORRECTION_WEIGHT) * (x - self.value)
        self.n += 1


class CostCorrection:
    """What the rounds really cost against what the profile predicted, as running ratios.

    A start-up measurement can be off (the machine was busy, the contexts are longer than the measured ones,
    the draft computes alongside the verify): each round's own draft and verify seconds, reported by the
    workers, pull the profile's draft and verify costs toward reality. The first few observations count as a
    plain mean, later ones with weight `CORRECTION_WEIGHT`.

    One-token passes (plain rounds) and wider ones (verifying drafts) have a ratio each once both are observed
    (until then the one observed stands for both): the start-up profile is measured at short contexts, and a
    verify pass's attention grows with its width times the context, so at long contexts verifying costs more
    against a decode step than the profile says (measured with ~950-token prompts: bench/RESULTS.md).
    The time outside the workers' compute is likewise kept per kind of round: a round that drafts also pays the
    router's n-gram lookups and the draft call's hops (a small but steady share of a round at one stream), which
    the profile does not hold; the difference is `draft_overhead_seconds`. Plain rounds come in two kinds: where
    the target decodes a plain row's next token ahead (deployments/workers/decode_ahead.py), a round answered from
    such a step computed while the router delivered the round before, and costs less than its own compute (its
    overhead is below zero); a round after a drafting one (or whose rows cannot be decoded ahead) is computed when
    asked. Which one a plain round is, is settled by the round before it (it marked the rows for decoding ahead, or
    it drafted): the plan prices plain decoding at the first kind's cost for rows marked ahead (a drafting round
    then drops a step already computed) and at the second's for the others, so it goes on as it is unless the other
    way pays with the switch counted.
    """

    def __init__(self) -> None:
        self._draft = _RunningMean(1.0)
        self._verify: dict[bool, _RunningMean] = {}  # by "wider than one token": observed/profile ratio
        # by kind of round (DRAFTED, PLAIN, AHEAD): seconds beyond the workers' compute
        self._overhead: dict[str, _RunningMean] = {}

    @staticmethod
    def _of_kind(means: dict[bool, "_RunningMean"], kind: bool, default: float) -> float:
        """The mean for `kind`, the other kind's until `kind` is observed, `default` before either."""
        seen = means.get(kind, means.get(not kind))
        return default if seen is None else seen.value

    @property
    def draft(self) -> float:
        return self._draft.value

    @property
    def verify(self) -> float:
        """The ratio for one-token (plain) verify passes; the wide passes' until those are observed."""
        return self._of_kind(self._verify, False, 1.0)

    @property
    def verify_wide(self) -> float:
        """The ratio for verify passes over drafts; the plain passes' until those are observed."""
        return self._of_kind(self._verify, True, 1.0)

    @property
    def overhead(self) -> float:
        """Seconds per plain round beyond the workers' compute, for one computed when asked (the first after a
        drafting round): a plain round's, else a drafting round's until one is seen."""
        return self.plain_overhead(ahead=False)

    def plain_overhead(self, ahead: bool) -> float:
        """The same for a round whose rows the last round marked for decoding ahead (`ahead`): such a round's where
        one was seen (below zero: the step's compute hidden)."""
        kinds = (AHEAD, PLAIN, DRAFTED) if ahead else (PLAIN, AHEAD, DRAFTED)
        seen = next((self._overhead[kind] for kind in kinds if kind in self._overhead), None)
        return 0.0 if seen is None else seen.value

    @property
    def seen_ahead(self) -> bool:
        """Whether a plain round answered from a step decoded ahead was observed."""
        return AHEAD in self._overhead

    @property
    def draft_overhead(self) -> float:
        """How much more a drafting round spends beyond the workers' compute than a plain one computed when asked (0
        until both are seen)."""
        return self.draft_overhead_over(ahead=False)

    def draft_overhead_over(self, ahead: bool) -> float:
        """The same against the plain round `plain_overhead(ahead)` prices."""
        if DRAFTED not in self._overhead or len(self._overhead) < 2:
            return 0.0
        return max(self._overhead[DRAFTED].value - self.plain_overhead(ahead), 0.0)

    def observe_draft(self, profile: CostProfile, batch: int, k: int, seconds: float) -> None:
        predicted = profile.draft(batch, k)
        if k > 0 and predicted > 0 and seconds > 0:
            self._draft.add(_clamped_ratio(seconds, predicted))

    def observe_verify(self, profile: CostProfile, batch: int, k: int, seconds: float) -> None:
        predicted = profile.verify(batch, k)
        if predicted > 0 and seconds > 0:
            self._verify.setdefault(k > 0, _RunningMean(1.0)).add(_clamped_ratio(seconds, predicted))

    def observe_overhead(self, seconds: float, drafted: bool = False, ahead: bool = False) -> None:
        """A round's seconds beyond the workers' compute; `drafted`: any row of it drafted; `ahead`: a plain round
        answered from a step decoded ahead (its seconds below zero where that step's compute was hidden)."""
        kind = DRAFTED if drafted else AHEAD if ahead else PLAIN
        self._overhead.setdefault(kind, _RunningMean(0.0)).add(seconds)

    def apply(self, profile: CostProfile, ahead: bool = False) -> CostProfile:
        """The profile as rounds observed it; `ahead`: for a round whose rows the last round marked for decoding
        ahead, whose plain cost is then the step's hidden one, while drafting drops that step."""
        return profile.scaled(self.draft, self.verify, self.plain_overhead(ahead), verify_wide=self.verify_wide,
                              draft_overhead=self.draft_overhead_over(ahead))


class AcceptanceTracker:
    """One request's per-token acceptance estimate (Leviathan et al.'s a, per request) and whether it wants a probe.

    Each round contributes its accepted drafts and whether it ended in a rejection: a = accepted / (accepted +
    rejections) is the maximum-likelihood estimate for the truncated geometric run lengths speculation produces.
    Older rounds decay by `DECAY`, so the estimate follows the request's text as it changes.
    """

    def __init__(self, prior: float = PRIOR_ACCEPTANCE) -> None:
        self.accepted = prior * PRIOR_WEIGHT
        self.rejected = (1.0 - prior) * PRIOR_WEIGHT
        self.rounds_without_drafts = 0
        self.rounds = 0  # rounds with drafts observed
        self.probe_every = PROBE_EVERY  # rounds at K = 0 before the next probe
        self._probed = False  # the last round with drafts was a probe

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_draft: int, num_accepted: int) -> None:
        if num_draft == 0:
            if self._probed:  # the probe did not bring drafting back: wait twice as long for the next one
                self.probe_every = min(2 * self.probe_every, MAX_PROBE_EVERY)
                self._probed = False
            self.rounds_without_drafts += 1
            return
        if self._probed:  # drafting went on after a probe
            self.probe_every = PROBE_EVERY
        self._probed = self.rounds_without_drafts >= self.probe_every
        self.rounds_without_drafts = 0
        self.rounds += 1
        self.accepted = DECAY * self.accepted + num_accepted
        self.rejected = DECAY * self.rejected + (1 if num_accepted < num_draft else 0)

    @property
    def wants_probe(self) -> bool:
        """Drafted nothing for `probe_every` rounds: worth a look with K = 1 where that is cheap
        (engine/spec/plan.py)."""
        return self.rounds_without_drafts >= self.probe_every

    @property
    def probe_due_next(self) -> bool:
        """The next round is the first that may probe (deployments/router/round.py does not decode it ahead)."""
        return self.rounds_without_drafts + 1 == self.probe_every
