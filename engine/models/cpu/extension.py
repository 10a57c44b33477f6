"""specserve's CPU operators (engine/models/cpu/csrc/*.cpp), built on first use into one library:
`torch.ops.specserve.*`.

- `small_gemm` (small_gemm.cpp): a small-batch matrix product for x86 CPUs with AVX2/FMA, below: fp32 activations
  times fp32, bf16 (a bf16 product: activations rounded to bf16, fp32 sums) or int8 weights (per-channel scales),
  the narrow weights widened in registers so a memory-bound step reads their bytes only;
- `bf16_gemm` (bf16_gemm.cpp): the bf16 product of bf16 models on CPUs with AVX512_BF16 (VDPBF16PS over weights
  packed once in its VNNI layout), batch invariant at any row count, prompt chunks included;
- `amx_bf16_gemm` (amx_gemm.cpp): the same product by AMX tiles (TDPBF16PS) over the same packed weights, batch
  invariant too, where the CPU has AMX and Linux grants the tile state (`amx_unavailable` says why not);
  `amx_bf16_gemm_emulated` runs its tile program on tiles emulated in plain C++ (tests on CPUs without AMX);
- `rms_norm`, `add_rms_norm`, `silu_mul`, `rope_to_cache`, `cache_attention` (layer_ops.cpp): fused fp32 operators
  for the static runner's eager layer, each replacing several ATen calls whose dispatch cost dominates at decode sizes
  (the KV cache they write and read holds fp32 or bf16).

All of them split their work over torch's thread count with `specserve::parallel_for` (pool.h), not OpenMP's
at::parallel_for: the calling thread claims chunks along with helper threads and waits only for chunks a helper has
claimed, so a helper that another process displaced from its core does not hold the step up (on this
project's 2-core machine, alternating server runs, it served more tokens/s than at::parallel_for in most runs at
8 and 16 streams: bench/RESULTS.md). `SPECSERVE_POOL=openmp` chooses at::parallel_for
(A/B measurements), `SPECSERVE_POOL_SPIN_US` how long idle helpers spin (default 50); the results are the same
bits.

Decode and verify steps multiply a few rows (1..16) by every weight matrix. MKL's sgemm is slow at these shapes on
this project's 2-core AVX2 machine (torch 2.13, SmolLM2-135M's 30 layers' projections, weights in cache, 2
threads): at 8 rows it computes at a fraction of the rate the same MKL reaches at 1,024 rows. The kernel here
keeps 12 accumulators in registers over a 3-column weight panel and prefetches the next panel while computing,
and beats MKL at these shapes with the weights in cache and from DRAM alike (bench/RESULTS.md, "A small-batch CPU
matrix product", has the figures and the served effect).

Its results are batch invariant: a row's outputs are the same bits whatever rows share the call (each dot product
is summed in one fixed order), which MKL does not promise.

The shared library (every source in engine/models/cpu/csrc) is compiled with the system's C++ compiler (`CXX`, default
g++) against the installed torch's headers into `SPECSERVE_KERNEL_CACHE` (default ~/.cache/specserve/kernels), once per
source, torch version and flags (slow on a small machine); `make install` builds it ahead (`main()`). Where it cannot
be used (no AVX2, not x86, no compiler, a failed build) `op(name)` returns None, the reason is logged once as a
warning, and callers keep their ATen code. `SPECSERVE_CPU_OPS=aten` turns it off (A/B measurements).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.cpp"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))  # included by the sources: part of the cache key
OPS = ("small_gemm", "bf16_gemm", "bf16_gemm_supported", "amx_bf16_gemm", "amx_bf16_gemm_emulated", "amx_status",
       "rms_norm", "add_rms_norm", "silu_mul", "rope_to_cache", "cache_attention")
FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-std=c++17", "-shared", "-fPIC", "-w"]
MAX_ROWS = 64  # callers that cannot tell steps from prompt chunks use the kernel up to here (it beat MKL there)
DEFAULT_CACHE = "~/.cache/specserve/kernels"


class KernelUnavailable(RuntimeError):
    """The kernel cannot be built or loaded on this machine; the message says why."""


def why_unavailable() -> str | None:
    """None where the kernel can run here, else the reason (before any build is tried)."""
    if os.environ.get("SPECSERVE_CPU_OPS", "auto") == "aten":
        return "turned off (SPECSERVE_CPU_OPS=aten)"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"not an x86-64 CPU ({platform.machine()})"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2/FMA (torch reports {capability})"
    if shutil.which(_compiler()) is None:
        return f"no C++ compiler ({_compiler()!r}; set CXX)"
    return None


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def library_path() -> Path:
    """Where the shared library for this source, torch build and flags lives."""
    key = hashlib.sha256()
    for part in (*[source.read_bytes() for source in SOURCES + HEADERS], torch.__version__.encode(),
                 " ".join(FLAGS).encode(), _compiler().encode(), str(torch._C._GLIBCXX_USE_CXX11_ABI).encode()):
        key.update(part)
    root = Path(os.environ.get("SPECSERVE_KERNEL_CACHE", DEFAULT_CACHE)).expanduser()
    return root / f"specserve_ops-{key.hexdigest()[:16]}.so"


def build() -> Path:
    """Compile the library if it is not in the cache yet (atomically: concurrent workers may build it at once)."""
    target = library_path()
    if target.exists():
        return target
    from torch.utils.cpp_extension import include_paths

    target.parent.mkdir(parents=True, exist_ok=True)
    torch_lib = Path(torch.__file__).parent / "lib"
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    command = [_compiler(), *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
               *[f"-I{p}" for p in include_paths()], *map(str, SOURCES), "-o", tmp,
               f"-L{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            names = ", ".join(source.name for source in SOURCES)
            raise KernelUnavailable(f"building {names} failed ({result.returncode}): {result.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@functools.cache
def _namespace():
    """`torch.ops.specserve` with the library loaded, or None (the reason logged once)."""
    reason = why_unavailable()
    if reason is None:
        try:
            if not hasattr(torch.ops.specserve, OPS[0]):
                torch.ops.load_library(str(build()))
            return torch.ops.specserve
        except (KernelUnavailable, OSError, RuntimeError) as error:
            reason = str(error)
    log.warning("specserve CPU operators: not used (%s); fp32 CPU steps use ATen's operators", reason)
    return None


def op(name: str) -> Callable | None:
    """`torch.ops.specserve.<name>` (one of `OPS`), or None where the library is unavailable."""
    assert name in OPS, name
    namespace = _namespace()
    return None if namespace is None else getattr(namespace, name)


def identity() -> str:
    """Which operators steps run on: the library's file name (its source, torch and flags hash), or "aten"."""
    return library_path().name if _namespace() is not None else "aten"


def small_gemm() -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """`small_gemm(x [M, K], weight [N, K], bias [N] | None) -> [M, N]`, or None (unavailable)."""
    return op("small_gemm")


@functools.cache
def bf16_gemm() -> Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor] | None:
    """`bf16_gemm(x [M, K], packed [N/16, K/2, 16, 2], n, bias [N] | None) -> [M, N]` (bf16_gemm.cpp; `packed` from
    linear.pack_bf16), or None where the library is unavailable or the CPU lacks AVX512_BF16."""
    supported = op("bf16_gemm_supported")
    return op("bf16_gemm") if supported is not None and supported() else None


@functools.cache
def amx_unavailable() -> str | None:
    """None where amx_bf16_gemm can run here, else why not (no library, no AVX512_BF16, no AMX, Linux refused the tile
    state)."""
    status = op("amx_status")
    if status is None:
        return f"specserve's CPU operators are unavailable ({why_unavailable() or 'the build failed'})"
    if bf16_gemm() is None:
        return "the CPU lacks AVX512_BF16 (the packed bf16 weights)"
    return status() or None


def amx_bf16_gemm() -> Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None], torch.Tensor] | None:
    """`amx_bf16_gemm(x [M, K], packed [N/16, K/2, 16, 2], n, bias [N] | None) -> [M, N]` (amx_gemm.cpp, the packed
    weights bf16_gemm reads), or None where `amx_unavailable` gives a reason."""
    return op("amx_bf16_gemm") if amx_unavailable() is None else None


def main() -> int:
    """`make install`'s step: build (or find) the library and say where, exit 0; exit 1 with the reason if a build
    that should work failed (0 where the machine cannot run the operators at all)."""
    reason = why_unavailable()
    if reason is not None:
        print(f"specserve CPU operators not built: {reason}")
        return 0 if reason.startswith(("turned off", "not an x86", "the CPU lacks")) else 1
    try:
        print(f"specserve CPU operators: {build()}")
    except KernelUnavailable as error:
        print(error, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
