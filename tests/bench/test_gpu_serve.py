"""bench/gpu_serve.py: its configs validate, its figures and table come out of fake measurements, the roofline
arithmetic, the bandwidth measurement; and (ray, slow) one served run of the tiny pair on this CPU."""

import json
from pathlib import Path

import pytest
import yaml

from bench import gpu_serve, gpu_serve_report
from bench.gpu_runner_bench import measured_bandwidth
from bench.peer_servers import ROOT, SERVE_CLI_CODE
from bench.synthetic_pair import SHAPES, param_counts


def _args(*extra: str):
    return gpu_serve.parse_args(["--shape", "tiny", *extra])


def _base() -> dict:
    return yaml.safe_load((ROOT / "serve_config.yaml").read_text())


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_both_variants_configs_validate_and_differ_only_in_the_draft(device):
    from deployments.config import SpecServeConfig

    args = _args("--device", device, "--k", "4", "--fixed-k")
    cfgs = {v: gpu_serve.serve_config(_base(), gpu_serve.variant_overrides(v, Path("/t"), Path("/d"), SHAPES["tiny"],
                                                                          args), 8123) for v in gpu_serve.VARIANTS}
    parsed = {v: SpecServeConfig.model_validate(c["applications"][0]["args"]) for v, c in cfgs.items()}
    plain, spec, overlap = parsed["plain"], parsed["speculative"], parsed["speculative_overlap"]
    assert overlap.speculation.overlap and not spec.speculation.overlap
    assert overlap.model_dump(exclude={"speculation"}) == spec.model_dump(exclude={"speculation"})
    assert plain.model.draft == "none" and spec.model.draft == "/d" and spec.model.target == "/t"
    assert spec.model.device == device and spec.model.target_dtype == ("bfloat16" if device == "cuda" else "float32")
    assert spec.runner.compile == gpu_serve.COMPILE == "auto"  # CUDA graphs on CUDA, eager on CPU
    assert spec.speculation.num_speculative_tokens == 4 and not spec.speculation.adaptive
    assert spec.router.max_replicas == 1 and spec.runner.max_num_seqs == 32
    assert spec.target.num_gpus == (0.5 if device == "cuda" else 0.0)
    assert spec.limits.max_prompt_tokens + args.max_tokens <= spec.model.max_model_len
    assert cfgs["plain"]["http_options"]["port"] == 8123
    assert plain.model_dump(exclude={"model"}) == spec.model_dump(exclude={"model"})
    # the drafters inside the target: the pair's draft layers as an early exit, and the heads beside the pair
    assert [parsed[v].model.draft for v in ("self", "medusa", "eagle3")] == ["self:1", "medusa:/medusa",
                                                                           "eagle3:/eagle3"]
    for v in ("self", "medusa", "eagle3"):
        assert parsed[v].model_dump(exclude={"model": {"draft"}}) == spec.model_dump(exclude={"model": {"draft"}})
    own = gpu_serve.variant_overrides("speculative", Path("/t"), Path("/d"), SHAPES["tiny"],
                                      _args("--device", device, "--draft-gpu", "own"))
    assert own["draft.num_gpus"] == own["target.num_gpus"] == (1.0 if device == "cuda" else 0.0)


def test_each_drafting_variant_is_compared_with_plain():
    level = {"tok_s": 10.0}
    variants = {"plain": {"levels": {1: level}}, "speculative": {"levels": {1: {"tok_s": 25.0}}},
                "speculative_overlap": {"levels": {1: {"tok_s": 30.0}}}}
    texts = {"plain": {1: {0: "a", 1: "b"}}, "speculative": {1: {0: "a", 1: "b"}},
             "speculative_overlap": {1: {0: "a", 1: "c"}}}
    equal, speedup = gpu_serve_report.compare_with_plain(variants, texts, [1, 8])
    assert speedup == {"speculative": {1: 2.5}, "speculative_overlap": {1: 3.0}}
    assert equal["speculative"][1]["same"] == 2 and equal["speculative_overlap"][1]["same"] == 1


def test_a_mistyped_override_fails_before_any_server_starts():
    args = _args("--set", "runner.compiel=auto")
    with pytest.raises(ValueError):
        gpu_serve.serve_config(_base(), gpu_serve.variant_overrides("plain", Path("/t"), Path("/d"), SHAPES["tiny"],
                                                                    args), 8000)


def _fake_streams(monkeypatch, seconds_of: dict[int, float]):
    """gpu_serve.one_stream replaced by a request of `seconds_of[index]` that records how many were in flight."""
    import asyncio

    state = {"in_flight": 0, "most": 0, "order": []}

    async def one_stream(client, model, index, prompt, max_tokens):
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        state["order"].append(index)
        await asyncio.sleep(seconds_of[index])
        state["in_flight"] -= 1
        return gpu_serve_report.Record(index, 0.0, [], f"t{index}", max_tokens)

    monkeypatch.setattr(gpu_serve, "one_stream", one_stream)
    return state


def test_streams_keep_c_requests_in_flight_and_do_not_wait_for_the_slowest(monkeypatch):
    """c = 2 streams over 6 prompts, prompt 0 answered only once prompts 1-5 have been: the second stream sends its
    next request as each ends, so it sends prompts 1-5 while prompt 0 runs. (Waves of 2 that wait for the slowest
    would never send prompt 2: the wait below would fail.)"""
    import asyncio

    state = {"in_flight": 0, "most": 0, "order": [], "ended": []}

    async def one_stream(client, model, index, prompt, max_tokens):
        state["in_flight"] += 1
        state["most"] = max(state["most"], state["in_flight"])
        state["order"].append(index)
        await asyncio.sleep(0)
        while index == 0 and len(state["ended"]) < 5:
            await asyncio.sleep(0.001)
        state["in_flight"] -= 1
        state["ended"].append(index)
        return gpu_serve_report.Record(index, 0.0, [], f"t{index}", max_tokens)

    monkeypatch.setattr(gpu_serve, "one_stream", one_stream)
    args = _args("--max-tokens", "4")
    records, wall = asyncio.run(asyncio.wait_for(
        gpu_serve.streams(None, "m", 2, range(6), args, 1000, allowance_s=3600.0), 60))
    assert sorted(r.prompt_index for r in records) == list(range(6)) and state["order"] == list(range(6))
    assert state["ended"] == [1, 2, 3, 4, 5, 0], "prompts 1-5 came and went while prompt 0 ran"
    assert state["most"] == 2  # never more than c in flight, and c at once
    assert wall > 0


def test_streams_take_no_new_prompt_once_the_allowance_is_spent(monkeypatch):
    import asyncio

    state = _fake_streams(monkeypatch, {i: 0.1 for i in range(30)})
    records, _ = asyncio.run(gpu_serve.streams(None, "m", 3, range(30), _args(), 1000, allowance_s=0.15))
    assert 3 <= len(records) < 30  # each stream sent one at least, then stopped within the allowance
    assert len(records) <= 3 * 3 and state["most"] == 3


def test_prompts_are_fixed_random_tokens_above_the_special_ones():
    a = gpu_serve.prompt_ids(3, 16, 49152)
    assert a == gpu_serve.prompt_ids(3, 16, 49152) != gpu_serve.prompt_ids(4, 16, 49152)
    assert len(a) == 16 and min(a) >= gpu_serve.FIRST_PROMPT_ID and max(a) < 49152


def _stats(rounds: int, spec_rounds: int, drafts: int, drafted: int, accepted: int, ms: dict) -> dict:
    return {"rounds": rounds, "mean_batch": 2.0, **ms,
            "speculative": {"rounds": spec_rounds, "num_drafts": drafts, "num_draft_tokens": drafted,
                            "num_accepted_tokens": accepted}}


def _fake_level(**target_drafting) -> dict:
    # two streams, 10 tokens each over 0.5 s; first tokens after 0.1 and 0.3 s
    records = [gpu_serve_report.Record(0, 0.0, [0.1, 0.2, 0.5], "a", 10),
               gpu_serve_report.Record(1, 0.0, [0.3, 0.4, 0.39 + 0.09], "b", 10)]
    before = _stats(10, 10, 5, 15, 10, {"orchestration_ms_per_round": 1.0, "draft_compute_ms_per_round": 1.0,
                                        "verify_compute_ms_per_round": 5.0})
    # 10 more group rounds, 20 more request rounds that drafted 60 tokens (K = 3) and accepted 45
    after = _stats(20, 30, 25, 75, 55, {"orchestration_ms_per_round": 1.5, "draft_compute_ms_per_round": 1.5,
                                        "verify_compute_ms_per_round": 6.0, **target_drafting})
    return gpu_serve_report.level_summary(records, 0.5, before, after)


def test_a_levels_figures_from_its_records_and_the_stats_between():
    level = _fake_level()
    assert level["tok_s"] == 40.0 and level["ttft_p50_ms"] == pytest.approx(200.0)
    assert level["tpot_p50_ms"] == pytest.approx(1e3 * (0.4 / 9 + 0.18 / 9) / 2)
    assert level["acceptance_rate"] == 0.75 and level["mean_accepted_length"] == pytest.approx(1 + 45 / 20)
    assert level["draft_tokens_per_round"] == 3.0
    # the new rounds' means: (20 x 1.5 - 10 x 1.0) / 10 = 2.0 host; (30 - 10) / 10 + (120 - 50) / 10 = 9.0 device
    assert level["host_ms_per_round"] == 2.0 and level["device_ms_per_round"] == 9.0
    assert level["drafting_share"] == pytest.approx(2.0 / 9.0)  # the Draft workers' 2 ms of the 9


def test_drafting_inside_the_target_counts_in_the_drafting_share():
    # 10 new rounds whose target calls spent 2 x 3 ms = 6 ms a round drafting (none before): (60 - 0) / 10 ms a round
    level = _fake_level(target_draft_compute_ms_per_round=3.0)
    assert level["drafting_share"] == pytest.approx((2.0 + 6.0) / 9.0)


def test_roofline_arithmetic():
    shape = SHAPES["1.5b"]
    roof = gpu_serve_report.roofline(shape, bandwidth=2e12)
    assert roof["target_step_ms"] == pytest.approx(1e3 * 2 * param_counts(shape)["target"] / 2e12)
    level = {"tok_s": 500.0, "ttft_p50_ms": 4 * roof["target_step_ms"], "device_ms_per_round": 10.0,
             "draft_tokens_per_round": 3.0, "mean_accepted_length": 3.5}
    got = gpu_serve_report.roofline_ratios(level, 8, roof)
    assert got["roofline_tok_s"] == pytest.approx(8e3 / roof["target_step_ms"])
    assert got["tok_s_vs_roofline"] == pytest.approx(500.0 / got["roofline_tok_s"])
    assert got["ttft_vs_roofline"] == pytest.approx(0.25)
    assert got["roofline_round_ms"] == pytest.approx(roof["target_step_ms"] + 3 * roof["draft_step_ms"])
    assert got["device_round_vs_roofline"] == pytest.approx(got["roofline_round_ms"] / 10.0)
    # speculative: 8 streams x 3.5 tokens per round of roofline_round_ms
    assert got["speculative_roofline_tok_s"] == pytest.approx(8 * 3.5e3 / got["roofline_round_ms"])
    plain = gpu_serve_report.roofline_ratios({"tok_s": 500.0, "ttft_p50_ms": None, "mean_accepted_length": None}, 8, roof)
    assert plain["ttft_vs_roofline"] is None and "speculative_roofline_tok_s" not in plain
    assert plain["roofline_round_ms"] == roof["target_step_ms"]


def test_level_allowance_keeps_the_later_start_ups_and_shares_the_rest():
    # 300 s left; one later variant starting in 40 s (+ the stop estimate); 3 levels here and 3 there
    got = gpu_serve.level_allowance(300.0, 3, 3, 1, 40.0)
    assert got == pytest.approx((300.0 - 40.0 - gpu_serve.STOP_ESTIMATE_S) / 6)
    assert gpu_serve.level_allowance(10.0, 1, 3, 1, 40.0) == 0.0  # spent: each level still runs one wave


def test_greedy_equality_over_the_prompts_both_ran():
    got = gpu_serve_report.greedy_equality({0: "x", 1: "y", 2: "z"}, {0: "x", 1: "q"})
    assert got == {"prompts": 2, "same": 1, "fraction": 0.5, "diverged_at_words": [0]}
    assert gpu_serve_report.greedy_equality({}, {0: "x"})["fraction"] is None


def test_pairs_that_differ_report_the_word_where_they_first_differ():
    plain = {0: "w1 w2 w3 w4", 1: "w1 w2", 2: "w5 w6", 3: "w7"}
    spec = {0: "w1 w2 w9 w4", 1: "w1 w2 w3", 2: "w5 w6", 3: "w8"}
    assert gpu_serve_report.greedy_equality(plain, spec)["diverged_at_words"] == [0, 2, 2]  # sorted; a prefix: its end


def test_table_and_json_from_fake_measurements():
    roof = gpu_serve_report.roofline(SHAPES["tiny"], 1e10)
    level = _fake_level()
    level.update(gpu_serve_report.roofline_ratios(level, 2, roof))
    plain = {**level, "mean_accepted_length": None, "acceptance_rate": None}
    report = {"device_name": "fake GPU", "roofline": roof, "speedup": {"speculative": {2: 1.5}},
              "greedy_equal": {"speculative": {2: {"prompts": 3, "same": 2, "diverged_at_words": [17]}}},
              "pair": {"shape": "tiny", "noise": 0.0, "vocab": 49152, "params": param_counts(SHAPES["tiny"])},
              "variants": {"plain": {"startup": {"health_s": 30.0, "ready_s": 34.0}, "levels": {2: plain}},
                           "speculative": {"startup": {"health_s": 31.0}, "levels": {2: level},
                                           "error": "RuntimeError: late\nmore"}}}
    text = gpu_serve_report.table(report)
    assert "fake GPU: copy bandwidth 10 GB/s" in text and "start-up plain: 30.0 s to /health 200" in text
    assert "error: RuntimeError: late" in text and "speculative / plain tok/s: 2 streams 1.50x" in text
    rows = [line for line in text.splitlines() if line.startswith("| plain") or line.startswith("| speculative")]
    assert rows[0].startswith("| plain | 2 | 40.0 |") and rows[0].endswith("| - |")
    assert "| 3.25 | 0.75 | 2.00 | 9.00 |" in rows[1] and rows[1].endswith("| 2/3 |")
    assert "speculative: first word where a text differs from plain: 2 streams [17]" in text
    assert json.loads(json.dumps(report))["speedup"] == {"speculative": {"2": 1.5}}


def test_bandwidth_on_cpu_is_positive():
    import torch

    assert measured_bandwidth(torch.device("cpu"), gib=0.03) > 0


@pytest.mark.ray
@pytest.mark.slow
def test_served_run_of_the_tiny_pair_on_cpu(tmp_path):
    """Both variants served by `serve run` (started as on the GPU machines, through `python -c`; Serve's own proxy,
    whose ports a concurrent cluster on this machine does not hold): every level measured, every draft of the
    noise-free pair accepted, and plain and speculative greedy texts equal."""
    out = tmp_path / "gpu_serve.json"
    report = gpu_serve.main(["--shape", "tiny", "--device", "cpu", "--concurrency", "1", "2", "--max-tokens", "8",
                             "--prompt-tokens", "16", "--requests-per-stream", "1", "--fixed-k", "--k", "3",
                             "--kv-cache-gib", "0.05", "--pair-root", str(tmp_path / "pairs"), "--port", "8217",
                             "--budget-s", "60", "--ray-serve-proxy", "--serve-cli", "python",
                             "--out", str(out)])
    assert json.loads(out.read_text())["variants"].keys() == {"plain", "speculative"}
    for name, v in report["variants"].items():
        assert v["command"][1:3] == ["-c", SERVE_CLI_CODE]
        assert "error" not in v and not v["leftover_processes"], (name, v.get("error"))
        assert v["startup"]["health_s"] > 0 and set(v["levels"]) == {1, 2}
        for level in v["levels"].values():
            assert level["tok_s"] > 0 and level["output_tokens"] == 8 * level["requests"]
            assert level["host_ms_per_round"] is not None and level["tok_s_vs_roofline"] > 0
    spec = report["variants"]["speculative"]["levels"]
    assert spec[1]["acceptance_rate"] > 0.9 and spec[1]["mean_accepted_length"] > 3.0
    assert report["greedy_equal"]["speculative"][1]["fraction"] == 1.0
