"""deployments/workers/lease_ledger.py: which released sequences a replica asks its workers to look for."""

from __future__ import annotations

from deployments.workers import lease_ledger
from deployments.workers.lease_ledger import LeaseLedger


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_sequence_is_a_candidate_only_once_its_last_lease_ended():
    ledger = LeaseLedger(Clock())
    ledger.leased("a")
    ledger.leased("b")
    assert ledger.candidates() == []
    ledger.ended("a")
    assert ledger.candidates() == ["a"]
    ledger.leased("b")  # a second lease under the same id (n choices never share one; a re-lease might)
    ledger.ended("b")
    assert ledger.candidates() == ["a"], "b is still leased once"
    ledger.ended("b")
    assert ledger.candidates() == ["a", "b"]


def test_leasing_a_released_id_again_takes_it_off_the_candidates():
    ledger = LeaseLedger(Clock())
    ledger.leased("a")
    ledger.ended("a")
    ledger.leased("a")  # a draft lease taken again on the same replica: its new sequence must be kept
    assert ledger.candidates() == []


def test_released_sequences_are_forgotten_after_a_while_and_past_a_count(monkeypatch):
    clock = Clock()
    ledger = LeaseLedger(clock)
    ledger.leased("old")
    ledger.ended("old")
    clock.now += lease_ledger.REMEMBER_S / 2
    ledger.leased("new")
    ledger.ended("new")
    clock.now += lease_ledger.REMEMBER_S / 2 + 1
    assert ledger.candidates() == ["new"]
    monkeypatch.setattr(lease_ledger, "REMEMBER_MAX", 3)
    for i in range(5):
        ledger.leased(f"s{i}")
        ledger.ended(f"s{i}")
    assert ledger.candidates() == ["s2", "s3", "s4"]
