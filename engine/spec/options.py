"""A request's own speculation settings: one value from the API's `speculative` field to the request's row.

The server's configuration gives the defaults (K, the adaptive plan, drafting ahead); a request may ask for its own K
(0: plain decoding), pin it (`adaptive: false`: exactly K drafts every round, whatever the acceptance or load) or turn
drafting ahead off for itself. The router's request preparation builds it (deployments/router/prepare.py), the
scheduler admits the request with it, and the request's row keeps it (engine/spec/plan.SpecRow), as the in-process
engine's `add_request` does.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpeculationOptions:
    k: int | None = None  # drafts per round; None: the server's K; 0: plain decoding
    adaptive: bool | None = None  # None: the server's K policy; False: exactly k drafts every round
    overlap: bool | None = None  # None: the server's setting; False: no drafting ahead for this request
    tree: bool | None = None  # None: the server's setting (speculation.tree); False: this request's drafts stay chains

    def __post_init__(self) -> None:
        if self.k is not None and self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")

    def k_or(self, default: int) -> int:
        """The request's K: its own, else the server's `default`."""
        return default if self.k is None else self.k

    @property
    def fixed(self) -> bool:
        """The request pinned its K: exactly k drafts per round (no acceptance or load adaptation)."""
        return self.adaptive is False
