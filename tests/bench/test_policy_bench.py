"""bench/policy_bench.py's arithmetic: ratios of paired modes and the per-cycle interval (no server)."""

import pytest

from bench.policy_bench import ratios


def high(values: dict[str, list[float]]) -> dict:
    return {mode: {"tokens_per_s": sum(v) / len(v), "runs": [{"output_tokens_per_s": x} for x in v]}
            for mode, v in values.items()}


def test_high_concurrency_ratios_pair_each_cycle():
    results = {"default": {"c16": high({"plain": [60.0, 80.0, 70.0], "adaptive": [66.0, 80.0, 63.0]})}}
    out = ratios(results, 16)
    assert out["default_c16_adaptive_vs_plain"] == pytest.approx(209 / 210)
    per_cycle = [1.1, 1.0, 0.9]
    assert out["default_c16_adaptive_vs_plain_per_cycle_mean"] == pytest.approx(1.0)
    half = 1.96 * 0.1 / 3 ** 0.5  # stdev of per_cycle is 0.1
    assert out["default_c16_adaptive_vs_plain_per_cycle_95ci_low"] == pytest.approx(1.0 - half)
    assert out["default_c16_adaptive_vs_plain_per_cycle_95ci_high"] == pytest.approx(1.0 + half)
    assert "default_c16_fixed_vs_plain" not in out and sum(per_cycle) == pytest.approx(3.0)


def test_concurrency_one_ratios_when_present():
    c1 = {m: {"tokens_per_s": t} for m, t in {"plain": 10.0, "fixed": 12.0, "adaptive": 11.0}.items()}
    out = ratios({"default": {"c1": c1}}, 16)
    assert out["default_c1_fixed_vs_plain"] == pytest.approx(1.2)
    assert out["default_c1_adaptive_speedup_over_fixed_speedup"] == pytest.approx(11 / 12)
