"""Speculation statistics as plain dataclasses (Prometheus export lives in deployments/).

Names and meanings follow vLLM's spec-decode metrics so numbers compare: a *draft* is one round that proposed at
least one token (`num_drafts`), `num_draft_tokens` and `num_accepted_tokens` count tokens, and the mean
acceptance length counts the bonus/recovered token: 1 + accepted / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    rounds: int = 0  # target verify passes this sequence took part in (drafted or not)
    num_drafts: int = 0  # rounds with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # tokens appended to the output (accepted + recovered/bonus, after stops)
    accepted_per_position: list[int] = field(default_factory=list)  # [k] times draft position k was accepted
    tree_rounds: int = 0  # drafting rounds whose drafts were a token tree (counted as a chain as deep as the tree)

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        self.rounds += 1
        self.num_emitted_tokens += num_emitted
        if num_draft == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for pos in range(num_accepted):
            self.accepted_per_position[pos] += 1

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        self.tree_rounds += other.tree_rounds
        if len(self.accepted_per_position) < len(other.accepted_per_position):
            self.accepted_per_position.extend([0] * (len(other.accepted_per_position) - len(self.accepted_per_position)))
        for pos, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[pos] += count

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_acceptance_length": round(self.mean_acceptance_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "tree_rounds": self.tree_rounds,
        }


@dataclass
class EngineTimings:
    """Wall-clock seconds spent per phase, summed over rounds, and the batch sizes seen."""

    rounds: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    sample_seconds: float = 0.0
    batch_rows: int = 0  # sum of batch sizes over rounds
    max_batch: int = 0

    def record(self, batch: int, draft_s: float, verify_s: float, sample_s: float) -> None:
        self.rounds += 1
        self.draft_seconds += draft_s
        self.verify_seconds += verify_s
        self.sample_seconds += sample_s
        self.batch_rows += batch
        self.max_batch = max(self.max_batch, batch)

    @property
    def mean_batch(self) -> float:
        return self.batch_rows / self.rounds if self.rounds else 0.0
