"""Each row's draft length for one round, chosen for the batch as a whole.

The rows of a round share its time: one draft call (K steps over the rows that draft) and one verify pass as wide
as the widest row. So a row's drafts pay only if the tokens they add outweigh what the longer round costs *every*
row. Leviathan et al. 2022 (arXiv 2211.17192, Sec. 3.4) give one sequence's expected tokens per round,
E(a, K) = (1 - a^(K+1)) / (1 - a); for a batch the plan maximizes the round's expected tokens per second,

    (sum over drafting rows of E(a_b, K) + the other rows' one token each) / (K draft steps over the m drafting rows + a
    verify of the batch at width K+1 + the round's overhead),

over K in 1..k_max and the m rows with the best acceptance, against plain decoding (every K = 0). A rule per row
(each row's own E against the round's cost) lets one request with good acceptance, or one probing request, make a
whole batch wait for a draft call that pays only for itself.

Three refinements: a row whose draft model is behind (it has not drafted yet, or drafted nothing for a while) must
first read those tokens, a stall every row of the round waits through, so it joins only if its remaining tokens
repay the stall for the whole batch; and a request whose drafts kept failing probes with K = 1 only where that is
cheap: when the round drafts anyway, or when the load would let a row that drafts perfectly pay; and where drafts
lag a round (a drafter inside the target drafts a row's next round in the call that verifies this one), a row that
starts drafting verifies nothing of its own in its first round, so its gain is counted over `START_HORIZON` rounds
with the first one empty: `(H - 1) / H` of a drafting row's, which keeps a row whose drafts barely pay from switching
on and off (each switch pays draft steps that buy nothing).

`plan_ks` is the one entry point, for the in-process engine (engine/speculative.py) and the served round
(deployments/router/round.py) alike: without a cost profile it falls back to `policy.load_adjusted_k`'s fixed
threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.request.sequence import SequenceState
from engine.spec.options import SpeculationOptions
from engine.spec.policy import AcceptanceTracker, CostProfile, expected_tokens, load_adjusted_k, worth_starting
from engine.spec.tree import MAX_TREE_NODES, TOP_CANDIDATES

TIE = 1.001  # a plan must beat the cheaper one by this factor (ties go to fewer drafts)
START_HORIZON = 5  # rounds a drafting stretch started now is counted over (the acceptance estimate's memory)


@dataclass
class SpecRow:
    """A live request's speculation state, one object in both round loops: the in-process engine keeps one per
    request, and the served loop's LiveRequest (deployments/router/live.py) extends it with its leases."""

    seq: SequenceState
    tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)  # the request's own acceptance
    options: SpeculationOptions = field(default_factory=SpeculationOptions)  # the request's own (K, pinned, overlap)
    draft_sent: int = 0  # committed tokens its draft holds (a draft model reads the rest before drafting)
    target_sent: int = 0  # committed tokens its target holds (the next verify delta starts there)
    # the request's acceptance in rounds whose drafts were a tree, per level of the tree (engine/spec/tree.py)
    tree_tracker: AcceptanceTracker = field(default_factory=AcceptanceTracker)
    drafted_last: bool = False  # its last round asked for drafts (a drafter inside the target made them for this one)

    def trackers(self, verdict, population: AcceptanceTracker,
                 tree_population: AcceptanceTracker | None = None) -> tuple[AcceptanceTracker, ...]:
        """Where a round's acceptance is recorded: a chain's in the request's and the population's trackers, a
        tree's (a verdict with a depth) in the request's and the population's tree trackers."""
        if verdict.depth is None:
            return self.tracker, population
        return (self.tree_tracker,) if tree_population is None else (self.tree_tracker, tree_population)

    def takes_tree(self) -> bool:
        """Whether the row's drafts may be a tree: not where the request turned trees off, its history differs per
        node (logits processors, a grammar) or prompt tokens are still scored."""
        seq = self.seq
        return (self.options.tree is not False and seq.params.grammar is None and not seq.processors
                and not seq.wants_prompt_logprobs())

    def outlook(self, cap: int, reads_context: bool, drafts_lag: bool = False) -> RowOutlook:
        """The row as the plan sees it: at most `cap` drafts; `reads_context`: its draft reads the tokens it lacks
        first (a draft model does; n-gram lookup reads nothing); `drafts_lag`: its drafts are made in the round before
        the one that verifies them (a drafter inside the target)."""
        return RowOutlook(acceptance=self.tracker.acceptance, cap=cap,
                          behind=self.seq.num_tokens - self.draft_sent if reads_context else 0,
                          remaining=self.seq.remaining(), fixed=self.options.fixed,
                          wants_probe=self.tracker.wants_probe, starting=drafts_lag and not self.drafted_last)


@dataclass(frozen=True)
class RowOutlook:
    """What the plan knows of one row of the round."""

    acceptance: float  # the request's estimated per-token acceptance (policy.AcceptanceTracker)
    cap: int  # the most drafts this row may take (0: no draft model for it, or the request turned drafts off)
    behind: int = 0  # committed tokens its draft model has not read yet
    remaining: int = 1 << 30  # tokens the request may still generate
    fixed: bool = False  # the request pinned its K: exactly `cap` drafts, whatever the costs
    wants_probe: bool = False  # its drafts kept failing and it has drafted nothing for a while
    starting: bool = False  # its drafts lag a round and it asked for none last round: this round verifies none

    def gain_share(self) -> float:
        """The share of its expected extra tokens a round that drafts for this row is credited with: all of them,
        or for a row `starting` to draft, its stretch's over `START_HORIZON` rounds (or what it has left) with the
        first round empty."""
        if not self.starting:
            return 1.0
        horizon = min(START_HORIZON, max(self.remaining, 1))
        return (horizon - 1) / horizon


def plan_rows(profile: CostProfile | None, rows: Sequence[SpecRow], caps: Sequence[int], reads_context: bool,
              batch: int, live_now: int, max_batch_for_speculation: int | None, drafts_lag: bool = False
              ) -> list[int]:
    """Each row's draft length this round (the in-process engine's and the served round's plan): `plan_ks` over the
    rows' outlooks, each capped at `caps[b]` drafts (0: it may not draft), cut to what the row may still emit.
    `reads_context`: a row's draft reads the tokens it lacks first (a draft model; n-gram lookup reads nothing);
    `drafts_lag`: the drafts a round asks for are verified in the next (a drafter inside the target)."""
    outlooks = [row.outlook(cap, reads_context, drafts_lag) for row, cap in zip(rows, caps)]
    ks = plan_ks(profile, outlooks, batch, live_now, max_batch_for_speculation)
    return [row.seq.draft_len(k) for row, k in zip(rows, ks)]


def plan_ks(profile: CostProfile | None, rows: Sequence[RowOutlook], batch: int, live_now: int,
            max_batch_for_speculation: int | None) -> list[int]:
    """K for every row of a round: `plan_round` at `batch` with a cost profile; without one (uncalibrated) each
    row's cap up to `max_batch_for_speculation` live sequences (`live_now`) and 0 above, a pinned row its cap."""
    if profile is not None:
        return plan_round(profile, rows, batch)
    return [row.cap if row.fixed else load_adjusted_k(row.cap, live_now, max_batch_for_speculation) for row in rows]


def plan_round(profile: CostProfile, rows: Sequence[RowOutlook], batch: int | None = None) -> list[int]:
    """K for every row of a round. `batch` (at least len(rows)) is the batch the costs are taken at: it may count
    requests about to join, since a draft started now pays only at the size they make."""
    n = len(rows)
    batch = max(batch or n, n)
    ks = [row.cap if row.fixed else 0 for row in rows]
    fixed_rows = [b for b, k in enumerate(ks) if k > 0]
    fixed_k = max(ks, default=0)
    fixed_tokens = sum(expected_tokens(rows[b].acceptance, ks[b]) for b in fixed_rows)

    def can_catch_up(row: RowOutlook, acceptance: float) -> bool:
        """A row whose draft model is behind joins only if its remaining tokens repay the stall of reading them,
        which every row of the batch waits through."""
        return row.behind <= row.cap + 1 or worth_starting(profile, batch, acceptance, row.cap, row.behind * batch,
                                                           row.remaining)

    candidates = sorted((b for b, row in enumerate(rows)
                         if not row.fixed and row.cap > 0 and can_catch_up(row, row.acceptance)),
                        key=lambda b: -rows[b].acceptance)  # best acceptance first
    base_tokens = fixed_tokens + n - len(fixed_rows)  # with no candidate drafting: fixed rows' E, 1 per other row
    best_rate = base_tokens / profile.round_seconds(batch, fixed_k, drafting=len(fixed_rows))
    best_k, best_m = 0, 0
    for k in range(1, max((rows[b].cap for b in candidates), default=0) + 1):
        gained = 0.0  # expected tokens of the first m candidates beyond the one each would emit anyway
        for m, b in enumerate(candidates, start=1):
            gained += (expected_tokens(rows[b].acceptance, min(k, rows[b].cap)) - 1.0) * rows[b].gain_share()
            tokens = base_tokens + gained
            rate = tokens / profile.round_seconds(batch, max(k, fixed_k), drafting=len(fixed_rows) + m)
            if rate > best_rate * TIE:
                best_rate, best_k, best_m = rate, k, m
    for b in candidates[:best_m]:
        ks[b] = min(best_k, rows[b].cap)

    # a probe (K = 1 for a request whose drafts kept failing) is cheap when the round drafts anyway, and worth its
    # cost only where the load would let a row whose drafts all agree pay; never a long catch-up on a hunch
    drafting = any(ks)
    for b, row in enumerate(rows):
        if row.wants_probe and ks[b] == 0 and row.cap > 0 and not row.fixed and can_catch_up(row, 1.0) and (
                drafting or _a_perfect_row_pays(profile, batch, n, row.cap)):
            ks[b] = 1
    return ks


def _a_perfect_row_pays(profile: CostProfile, batch: int, n: int, cap: int) -> bool:
    """Whether one row whose drafts are all accepted would make this round beat plain decoding."""
    plain = n / profile.round_seconds(batch, 0)
    return any((n + k) / profile.round_seconds(batch, k, drafting=1) > plain * TIE for k in range(1, cap + 1))


TREE_MODES = ("auto", "on", "off")


@dataclass(frozen=True)
class TreeSettings:
    """`speculation.tree`: whether rounds may verify token trees (engine/spec/tree.py) and how large."""

    mode: str = "off"  # "auto": where the costs and acceptance say a tree pays; "on": every drafting row; "off"
    nodes: int = 8  # draft nodes a row's tree may hold (the verify pass scores nodes + 1 positions per row)

    def __post_init__(self) -> None:
        if self.mode not in TREE_MODES:
            raise ValueError(f"speculation.tree must be one of {TREE_MODES}, got {self.mode!r}")
        if not 1 <= self.nodes <= MAX_TREE_NODES:
            raise ValueError(f"speculation.tree_nodes must be in 1..{MAX_TREE_NODES}, got {self.nodes}")


def plan_trees(profile: CostProfile | None, rows: Sequence[SpecRow], ks: Sequence[int], batch: int,
               settings: TreeSettings, population: AcceptanceTracker | None = None) -> list[int]:
    """Each row's tree budget this round (0: its K drafts stay a chain), given the plan's K per row (`plan_rows`).

    A tree of N nodes drafts as deep as the chain (its drafter's K steps, or the expansion's measured cost:
    `CostProfile.tree_draft`) but widens the verify pass from K+1 to N+1 positions per row, for every row of the
    round. With a cost profile (`auto`) the round goes to trees when the rows' expected tokens under their tree
    acceptance (per level of the tree, measured per request) over the round's seconds at that verify width beat the
    chain's: trees where verifying more positions is nearly free (few rows, memory-bound), chains under load. A request with few tree rounds of its own is taken at the `population`'s
    tree acceptance (every request's tree rounds); before any tree round was measured it is assumed to miss half as
    often as its chains (a probe: the first tree rounds measure it). Without a profile `auto` is `on`."""
    out = [0] * len(rows)
    eligible = [b for b, (row, k) in enumerate(zip(rows, ks)) if k > 0 and row.takes_tree()]
    if settings.mode == "off" or not eligible:
        return out
    # a tree as deep as the row's K holds at most TOP_CANDIDATES nodes a level (a drafter offers no more), and no
    # more nodes than the context window has positions after the row's tokens (each node takes one in the pass)
    nodes = [min(settings.nodes, k * TOP_CANDIDATES, row.seq.max_model_len - row.seq.num_tokens)
             for row, k in zip(rows, ks)]
    if settings.mode == "auto" and profile is not None:
        k_max = max(ks)
        drafting = sum(1 for k in ks if k > 0)
        chain_seconds = profile.round_seconds(batch, k_max, drafting=drafting)
        widest = max(max(nodes[b] for b in eligible), k_max)
        tree_seconds = (chain_seconds - profile.verify(batch, k_max) + profile.verify(batch, widest)
                        - profile.draft(drafting, k_max) + profile.tree_draft(drafting, k_max))
        chain_tokens = tree_tokens = float(len(rows) - drafting)
        for b, (row, k) in enumerate(zip(rows, ks)):
            if k <= 0:
                continue
            chain = expected_tokens(row.tracker.acceptance, k)
            chain_tokens += chain
            tree_tokens += expected_tokens(_tree_acceptance(row, population), k) if b in eligible else chain
        if tree_tokens / tree_seconds <= chain_tokens / chain_seconds * TIE:
            return out
    for b in eligible:
        out[b] = nodes[b]
    return out


OWN_TREE_ROUNDS = 4  # a request's own tree rounds before its tree acceptance is its own rather than the population's


def _tree_acceptance(row: SpecRow, population: AcceptanceTracker | None) -> float:
    """The row's tree acceptance per level: its own once measured over a few rounds, else the population's, else
    (nothing measured yet) its chain's with half the misses."""
    own, measured = row.tree_tracker.rounds, population is not None and population.rounds > 0
    if own >= OWN_TREE_ROUNDS or (own and not measured):
        return row.tree_tracker.acceptance
    if measured:
        return population.acceptance
    chain = row.tracker.acceptance
    return chain + (1.0 - chain) / 2
