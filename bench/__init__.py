"""Benchmarks: bench/engine_bench.py (ours vs HF vs vLLM), bench/vllm_peer.py (run in its own venv)."""
