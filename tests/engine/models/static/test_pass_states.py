"""engine/models/static/pass_states.py: the aux states a sequence's forwards leave, taken by position."""

import torch

from engine.models.static.pass_states import PassStates


class Model:  # what PassStates reads of a StaticLlama
    def keep_aux(self, layers, rows, width):
        self.aux_layers = layers


def states(first, n):  # [n, 2]: each row names its position and the piece it came from
    return torch.tensor([[first + i, first] for i in range(n)], dtype=torch.float32)


def test_a_later_piece_at_the_same_positions_wins_and_runs_are_contiguous():
    kept = PassStates(Model(), 4, 8)
    kept.keep_aux((0,))
    kept._record("a", 0, states(0, 5))  # a prompt
    kept._record("a", 4, states(4, 4))  # a verify window: positions 4-7 (5-7 rejected drafts)
    kept._record("a", 5, states(5, 2))  # the next window rewrites 5-6
    [(start, got)] = kept.take_aux("a", 7)  # committed: positions 0-6 have states
    assert start == 0 and got[:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6]
    assert got[:, 1].tolist() == [0, 0, 0, 0, 4, 5, 5]
    assert kept.take_aux("a", 7) == [], "taken: nothing kept"


def test_gaps_split_runs_and_old_positions_go_past_the_cap():
    kept = PassStates(Model(), 4, 8, max_aux_positions=6)
    kept.keep_aux((0,))
    kept._record("b", 0, states(0, 3))
    kept._record("b", 10, states(10, 2))  # positions 3-9 read from a prefix cache: no states
    runs = kept.take_aux("b", 12)
    assert [(s, len(t)) for s, t in runs] == [(0, 3), (10, 2)]
    for first in range(0, 12, 3):
        kept._record("c", first, states(first, 3))
    runs = kept.take_aux("c", 12)
    assert [(s, len(t)) for s, t in runs] == [(6, 6)], "at most 6 positions kept: the oldest pieces went"
    kept._record("d", 0, states(0, 2))
    kept.forget("d")
    assert kept.take_aux("d", 2) == []
