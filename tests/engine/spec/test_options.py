"""engine/spec/options.py: a request's own speculation settings, from the API's `speculative` field to its row."""

import pytest

from engine.spec.options import SpeculationOptions


def test_the_requests_k_or_the_servers_and_pinning():
    assert SpeculationOptions().k_or(4) == 4 and SpeculationOptions(k=0).k_or(4) == 0
    assert SpeculationOptions(k=2, adaptive=False).fixed and not SpeculationOptions(adaptive=True).fixed
    assert not SpeculationOptions().fixed, "None: the server's policy"
    with pytest.raises(ValueError, match="k must be >= 0"):
        SpeculationOptions(k=-1)
