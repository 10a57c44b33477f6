"""The costs a Draft/Target replica pairing's rounds are planned with; engine/spec/plan.py chooses K from them.

With the adaptive policy a pairing's costs are those its replicas measured at start (engine/calibration/measure.py),
corrected online by what its steady-state rounds really cost (engine.spec.policy.CostCorrection: the workers' compute
in rounds that carry no prompt, and the per-round overhead outside the models); or a calibration file's costs,
taken as given. Without the adaptive policy there are none, and K follows `max_batch_for_speculation`.

Where the target decodes plain rows ahead (deployments/workers/decode_ahead.py), plain decoding that goes on costs
less than its verify passes, and only plain rounds answered from a step decoded ahead show by how much. A pairing
whose rounds draft, or go plain only a round at a time, would never see one, and keep drafting where plain decoding
serves faster: after `PLAIN_SAMPLE_FIRST` rounds with none seen yet (then every `PLAIN_SAMPLE_EVERY` rounds without
one), its next `PLAIN_SAMPLE_ROUNDS` rounds are plain (`plain_sample`), so the plan weighs drafting against what
plain decoding really costs here.
"""

from __future__ import annotations

import logging

from deployments.transport.messages import CostObservation
from engine.calibration.measure import profile_from_costs
from engine.spec.policy import CostCorrection, CostProfile

logger = logging.getLogger("ray.serve")

PLAIN_SAMPLE_FIRST = 16  # rounds before a pairing that has seen no round decoded ahead samples plain ones
PLAIN_SAMPLE_EVERY = 256  # the same once it has: rounds without one before plain rounds are sampled again
PLAIN_SAMPLE_ROUNDS = 4  # plain rounds a sample takes (the first has no step decoded ahead, the others do)


def pair_key(draft, target) -> tuple:
    """A pairing's key: the leased Draft replica's (None without one) and the Target replica's."""
    return (draft.key if draft is not None else None, target.key)


class RoundCosts:
    def __init__(self, adaptive: bool, remote_draft: bool, calibration: CostProfile | None = None) -> None:
        self.adaptive = adaptive
        self.remote_draft = remote_draft  # drafts come from Draft workers, whose costs the plan needs
        self.calibration = calibration
        self._measured: dict[tuple, CostProfile | None] = {}
        self._corrections: dict[tuple, CostCorrection] = {}
        self._products: dict[tuple, dict] = {}  # per pairing: which operator computes each side's bf16 products
        self._since_ahead: dict[tuple, int] = {}  # per pairing: rounds since its last one decoded ahead
        self._sample_left: dict[tuple, int] = {}  # per pairing: rounds of a plain sample still to run

    @property
    def corrects(self) -> bool:
        """Whether rounds feed cost corrections: with the adaptive policy on measured costs (a calibration file is
        taken as given)."""
        return self.adaptive and self.calibration is None

    def policy_profile(self, draft, target, ahead: bool = False) -> CostProfile | None:
        """The costs a pairing's K is chosen by: the calibration file's, else the replicas' own as corrected;
        `ahead`: for a round whose rows the last round marked for decoding ahead (CostCorrection.apply)."""
        if not self.adaptive:
            return None
        if self.calibration is not None:
            return self.calibration
        profile = self.measured(draft, target)
        return None if profile is None else self._correction(draft, target).apply(profile, ahead)

    def measured(self, draft, target) -> CostProfile | None:
        """The costs the leased replicas measured at start (None: none reported, or no Draft lease taken yet)."""
        if draft is None and self.remote_draft:
            return None  # the router has not leased a Draft replica yet: nothing known of the draft's costs
        key = pair_key(draft, target)
        if key not in self._measured:
            # a Draft replica's costs; without one, those of a drafter inside the target (its own measurement)
            draft_costs = draft.costs if draft is not None else (target.costs or {}).get("drafter")
            profile = None
            if target.costs is not None and (draft_costs is not None or not self.remote_draft):
                profile = profile_from_costs(target.costs, draft_costs)
            if profile is None:
                logger.warning("no measured costs for replicas %s; K follows max_batch_for_speculation", key)
            self._measured[key] = profile
            self._products[key] = {"target": (target.costs or {}).get("bf16_products"),
                                   "draft": (draft.costs or {}).get("bf16_products") if draft is not None else None}
        return self._measured[key]

    def observe(self, seen: CostObservation) -> None:
        """Feed a round's measured draft or verify seconds to the pairing's correction.

        Calls that carry a prompt (a new or re-sent sequence: a prefill) are not a round's steady-state cost and
        are left out.
        """
        if not self.corrects or not seen.seconds or any(len(call.seq.tokens) > seen.k + 2 for call in seen.calls):
            return
        profile = self.measured(seen.draft, seen.target)
        if profile is not None:
            correction = self._correction(seen.draft, seen.target)
            observe = correction.observe_draft if seen.kind == "draft" else correction.observe_verify
            observe(profile, len(seen.calls), seen.k, seen.seconds)

    def observe_overhead(self, draft, target, seconds: float, drafted: bool = False, ahead: bool = False) -> None:
        """A round's time beyond the workers' own compute (RPC, serialization, event-loop hops, the router's n-gram
        lookups, delivering its outputs); `drafted`: whether any row of it drafted; `ahead`: a plain round answered
        from a step decoded ahead (below zero where that step's compute was hidden)."""
        if not self.corrects:
            return
        correction = self._correction(draft, target)
        correction.observe_overhead(seconds, drafted, ahead)
        key = pair_key(draft, target)
        if self._sample_left.get(key, 0) > 0:
            self._sample_left[key] -= 1
        since = self._since_ahead[key] = 0 if ahead else self._since_ahead.get(key, 0) + 1
        due = PLAIN_SAMPLE_EVERY if correction.seen_ahead else PLAIN_SAMPLE_FIRST
        if since >= due and not self._sample_left.get(key):
            self._sample_left[key], self._since_ahead[key] = PLAIN_SAMPLE_ROUNDS, 0

    def plain_sample(self, draft, target) -> int:
        """The rounds of a plain sample the pairing still runs, its next included (0: none; 1: the sample's last
        round): for a router whose target decodes plain rows ahead (the module's docstring)."""
        return self._sample_left.get(pair_key(draft, target), 0) if self.corrects else 0

    def shown(self) -> dict[str, dict | None]:
        """The costs K is chosen by (for /stats), in milliseconds: the calibration file's, or per pairing the
        measured ones with what steady rounds observed against them, and which operator computes the bf16 products
        of each side (engine/models/cpu/bf16_products.py; None: no bf16 product there)."""
        def show(profile: CostProfile | None, correction: CostCorrection | None) -> dict | None:
            if profile is None:
                return None
            return {"batch_sizes": list(profile.batch_sizes),
                    "verify_ms": [[round(1000 * t, 2) for t in row] for row in profile.verify_seconds],
                    "draft_step_ms": [round(1000 * t, 2) for t in profile.draft_step_seconds],
                    "observed_over_profile": None if correction is None else {
                        "draft": round(correction.draft, 3), "verify": round(correction.verify, 3),
                        "verify_wide": round(correction.verify_wide, 3),
                        "draft_overhead_ms": round(1000 * correction.draft_overhead, 2),
                        "round_overhead_ms": round(1000 * correction.overhead, 2)}}
        if self.calibration is not None:
            return {"calibration file": show(self.calibration, None)}
        return {f"{draft} / {target}": {**(show(p, self._corrections.get((draft, target))) or {}),
                                        "bf16_products": self._products.get((draft, target))}
                for (draft, target), p in self._measured.items()}

    def _correction(self, draft, target) -> CostCorrection:
        return self._corrections.setdefault(pair_key(draft, target), CostCorrection())
