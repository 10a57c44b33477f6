"""The served peer benchmark's pure parts: dataset file, client argv, result parsing, targets, config overrides."""

import json

import pytest
import yaml

from bench import peer_report, peer_serve, peer_servers, server_counters
from bench.load_bench import load_prompts

# the shape of `vllm bench serve --save-result` output (vllm 0.32), trimmed
RAW = {"duration": 10.0, "completed": 12, "failed": 0, "total_output_tokens": 768, "output_throughput": 76.8,
       "median_ttft_ms": 101.0, "p50_ttft_ms": 100.0, "p99_ttft_ms": 180.0, "median_tpot_ms": 12.5,
       "p50_tpot_ms": 12.0, "p50_itl_ms": 11.0, "p99_itl_ms": 30.0, "p50_e2el_ms": 900.0,
       "errors": ["", "", None], "generated_texts": ["a", "b"], "output_lens": [64, 64, 60, 0]}


def run(tok_s, ttft=100.0, failed=0, completed=12):
    return {"tok_s": tok_s, "ttft_p50_ms": ttft, "failed": failed, "completed": completed}


def test_dataset_has_one_rendered_prompt_per_conversation(tmp_path):
    conversations = load_prompts("bench/prompts.jsonl")
    path = tmp_path / "d.jsonl"
    render = lambda messages: "<user>" + messages[-1]["content"] + "<assistant>"  # noqa: E731
    assert peer_serve.write_dataset(conversations, render, path) == len(conversations) == 12
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(set(r) == {"prompt"} for r in rows)  # vLLM's custom loader requires "prompt"
    assert rows[0]["prompt"] == render(conversations[0])
    assert "\n" in rows[4]["prompt"], "multi-line prompts survive as JSON strings"


def test_client_argv_asks_for_the_issue_setup(tmp_path):
    argv = peer_serve.client_argv("http://127.0.0.1:8000", "m", "/dir", tmp_path / "d.jsonl", 8, 16, 64, 8,
                                  tmp_path, "x.json", 0)
    pairs = dict(zip(argv, argv[1:]))
    assert argv[2:4] == ["bench", "serve"] and argv[1].endswith("vllm_cli.py")
    assert pairs["--backend"] == "openai" and pairs["--endpoint"] == "/v1/completions"
    assert pairs["--dataset-name"] == "custom" and pairs["--custom-output-len"] == "64"
    assert pairs["--max-concurrency"] == "8" and pairs["--num-prompts"] == "16" and pairs["--temperature"] == "0"
    assert {"--ignore-eos", "--save-result", "--skip-chat-template"} <= set(argv)
    assert "50" in pairs["--metric-percentiles"].split(",")
    assert [peer_serve.default_num_prompts(c) for c in (1, 8, 16)] == [12, 16, 32]
    chat = peer_serve.client_argv("http://h", "m", "/dir", tmp_path / "d.jsonl", 1, 2, 8, 1, tmp_path, "y.json", 0,
                                  backend="openai-chat")
    chat_pairs = dict(zip(chat, chat[1:]))
    assert chat_pairs["--backend"] == "openai-chat" and chat_pairs["--endpoint"] == "/v1/chat/completions"


def test_summarize_reads_p50s_and_falls_back_to_medians():
    s = peer_report.summarize(RAW)
    assert (s["tok_s"], s["ttft_p50_ms"], s["tpot_p50_ms"], s["itl_p50_ms"]) == (76.8, 100.0, 12.0, 11.0)
    assert s["completed"] == 12 and s["failed"] == 0 and s["errors"] == [] and s["short_outputs"] is None
    assert peer_report.summarize(RAW, max_tokens=64)["short_outputs"] == 1  # a failed request has 0 tokens
    no_p50 = {k: v for k, v in RAW.items() if not k.startswith("p50")} | {"errors": ["boom", "boom", ""]}
    s = peer_report.summarize(no_p50)
    assert s["ttft_p50_ms"] == 101.0 and s["tpot_p50_ms"] == 12.5 and s["errors"] == ["boom"]
    assert s["spec_acceptance_rate"] is None


def test_targets_pass_fail_and_missing():
    runs = {"ours-plain": {1: run(50.0), 8: run(100.0)},
            "ours-default": {1: run(90.0, ttft=160.0), 8: run(200.0), 16: run(150.0, failed=2)},
            "vllm-plain": {1: run(40.0, ttft=100.0), 8: run(180.0), 16: run(140.0)},
            "vllm-ngram": {1: run(80.0)}}
    got = {(t["target"], t["concurrency"]): t for t in peer_report.evaluate_targets(runs)}
    assert len(got) == len(peer_report.TARGETS) == 7
    plain1 = got[("ours plain / vLLM plain, tok/s", 1)]
    assert plain1["ratio"] == pytest.approx(1.25) and plain1["status"] == "PASS"
    assert got[("ours plain / vLLM plain, tok/s", 8)]["status"] == "FAIL"  # 100 / 180
    assert got[("ours default / vLLM plain, tok/s", 1)]["ratio"] == pytest.approx(2.25)
    spec = got[("ours default / vLLM best speculative, tok/s", 1)]
    assert spec["denominator"] == "vllm-ngram" and spec["ratio"] == pytest.approx(1.125) and spec["status"] == "FAIL"
    assert got[("ours default / vLLM plain, tok/s", 8)]["status"] == "PASS"
    c16 = got[("ours default / vLLM plain, tok/s", 16)]
    assert c16["ratio"] > 1.0 and c16["status"] == "FAIL" and c16["note"] == "failed requests"
    ttft = got[("ours default / vLLM plain, TTFT p50", 1)]
    assert ttft["ratio"] == pytest.approx(1.6) and ttft["status"] == "FAIL"  # lower is better: 160 > 1.5 x 100
    del runs["vllm-ngram"]
    assert peer_report.evaluate_targets(runs)[3]["status"] == "n/a"
    assert "n/a" in peer_report.table(runs, peer_report.evaluate_targets(runs))


def test_same_text_fraction():
    assert peer_report.same_text_fraction(["a", "b"], ["a", "c"]) == 0.5
    assert peer_report.same_text_fraction(["a"], ["a", "b"]) is None


def test_peer_dtype_follows_ours():
    assert peer_serve.peer_dtype("float32") == "float32"
    assert peer_serve.peer_dtype("bf16") == "bfloat16" and peer_serve.peer_dtype("bfloat16") == "bfloat16"
    assert peer_serve.peer_dtype("int8") == "float32"
    with pytest.raises(ValueError):
        peer_serve.peer_dtype("auto")  # resolved by engine.models.runner.resolve_dtype first


def test_derived_config_overrides_and_validates():
    from deployments.config import SpecServeConfig

    base = yaml.safe_load(open("serve_config.yaml"))
    over = peer_servers.parse_overrides(["speculation.num_speculative_tokens=2", "model.target=/x"])
    assert over == {"speculation.num_speculative_tokens": 2, "model.target": "/x"}
    cfg = peer_servers.derive_ours_config(base, {**over, **peer_serve.OURS_VARIANTS["ours-plain"]}, 8123)
    args = cfg["applications"][0]["args"]
    assert cfg["http_options"]["port"] == 8123 and args["model"]["draft"] == "none"
    assert args["speculation"]["num_speculative_tokens"] == 2
    assert base["applications"][0]["args"]["model"]["draft"] != "none", "the base config is not modified"
    SpecServeConfig.model_validate(args)
    runner = peer_servers.derive_ours_config(base, {"runner.kind": "transformers"}, 8000)  # a section made
    assert SpecServeConfig.model_validate(runner["applications"][0]["args"]).runner.kind == "transformers"
    typo = peer_servers.derive_ours_config(base, {"modle.draft": "none"}, 8000)
    with pytest.raises(ValueError):  # pydantic's ValidationError: the config forbids unknown keys
        SpecServeConfig.model_validate(typo["applications"][0]["args"])
    with pytest.raises(KeyError):
        peer_servers.derive_ours_config(base, {"model.target.x": 1}, 8000)
    with pytest.raises(ValueError):
        peer_servers.parse_overrides(["model.draft"])


def test_vllm_serve_argv():
    plain = peer_servers.vllm_serve_argv("/m", "float32", "name", 8001, 2048, None)
    assert plain[2:4] == ["serve", "/m"] and "--speculative-config" not in plain
    pairs = dict(zip(plain, plain[1:]))
    assert pairs["--dtype"] == "float32" and pairs["--served-model-name"] == "name" and pairs["--port"] == "8001"
    ngram = peer_servers.vllm_serve_argv("/m", "float32", "name", 8001, 2048, peer_servers.NGRAM_CONFIG)
    assert json.loads(ngram[ngram.index("--speculative-config") + 1]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    extra = peer_servers.vllm_serve_argv("/m", "float32", "name", 8001, 2048, None, ["--block-size", "32"])
    assert extra[-2:] == ["--block-size", "32"] and extra[:-2] == plain


def test_log_notes_keep_vllm_core_and_thread_lines():
    log = ("(EngineCore pid=1) INFO 11-23 08:58:50 [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0]\n"
           "(EngineCore pid=1) INFO 11-23 08:58:50 [ompmultiprocessing.py:185] \treserved_cpus=[1]\n"
           "(APIServer pid=2) INFO 11-23 08:59:00 [api_server.py:1] Starting vLLM API server\n"
           "(EngineCore pid=1) INFO 11-23 08:59:10 [torch_utils.py:295] Reducing Torch threads from 2 to 1\n"
           "(EngineCore pid=1) INFO 11-23 09:00:11 [shm_broadcast.py:871] No available shared memory broadcast "
           "block found in 60 seconds (e.g. compilation)\n")
    assert peer_servers.log_notes(log) == ["local_rank=0, core ids=[0]", "reserved_cpus=[1]",
                                           "Reducing Torch threads from 2 to 1"]


def test_plot_writes_png(tmp_path):
    runs = {"ours-default": {1: run(20.0), 8: run(50.0)}, "vllm-plain": {1: run(40.0)}}
    path = peer_report.plot(runs, tmp_path / "p.png")
    assert path.stat().st_size > 1000


def test_round_timings_cover_only_the_rounds_between_two_stats():
    before = {"rounds": 100, "mean_batch": 1.0, "verify_ms_per_round": 10.0, "verify_compute_ms_per_round": 8.0}
    after = {"rounds": 300, "mean_batch": 5.0, "verify_ms_per_round": 20.0, "verify_compute_ms_per_round": 14.0}
    got = server_counters.round_timings(before, after)
    # 200 new rounds: batch (1500 - 100) / 200, verify (6000 - 1000) / 200, compute (4200 - 800) / 200
    assert got["rounds"] == 200 and got["mean_batch"] == 7.0
    assert got["verify_ms_per_round"] == 25.0 and got["verify_compute_ms_per_round"] == 17.0
    assert got["draft_ms_per_round"] == 0.0
    assert server_counters.round_timings(after, after) == {"rounds": 0}


def test_prefix_cache_counts_from_vllms_metrics_and_the_delta_between_two_reads():
    from bench.server_counters import prefix_cache_delta, prometheus_total

    text = ('# HELP vllm:prefix_cache_queries_total Prefix cache queries\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 120.0\n'
            'vllm:prefix_cache_queries_total{engine="1",model_name="m"} 30.0\n'
            'vllm:prefix_cache_queries_created{engine="0"} 1.7e9\n'
            'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 48.0\n')
    assert prometheus_total(text, "vllm:prefix_cache_queries_total") == 150.0
    assert prometheus_total(text, "vllm:prefix_cache_hits_total") == 48.0
    assert prefix_cache_delta((100.0, 10.0), (300.0, 60.0)) == {"queried_tokens": 200, "hit_tokens": 50,
                                                                "hit_rate": 0.25}
    assert prefix_cache_delta(None, (1.0, 1.0)) is None
    assert prefix_cache_delta((5.0, 1.0), (5.0, 1.0))["hit_rate"] is None
