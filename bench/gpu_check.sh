#!/usr/bin/env bash
# The GPU checks of the serving path, for a session lent a GPU machine (one H100; no network there; 15 minutes of
# device time in all, 10 a command). Prepare here, once:
#     bash ../shared/gpu/pack_site.sh .gpu && echo /.gpu/ >> .git/info/exclude    # Ray and Serve's wheels, ~45 MB
# then one device run per stage, carry [".gpu"], command `bash bench/gpu_check.sh STAGE` (results under $OUT):
#     tests   the CUDA-only tests (graph capture and replay against eager, the attention and fused elementwise
#             kernels on the GPU, no host sync inside a replay, bf16 greedy) and the in-process runner at the 8B
#             shape with a profile of its graph step (kernels by device time):                         ~3 min
#     1.5b    bench/gpu_serve.py on the 1.5B synthetic pair, plain and speculative at 1, 8 and 32 streams:  ~4 min
#     8b      the same on the Llama-3.1-8B-shaped pair with noise 0.02 (greedy agreement ~0.8 at reduced width on a
#             CPU, bench/RESULTS.md; the report gives the rate measured on the GPU):                       ~7 min
#     exact   the 1.5B pair in float32, plain and speculative at 1 and 8 streams: whether greedy texts are equal
#             where bf16 rounding cannot flip near-ties (in bf16 they differed: bench/RESULTS.md, session 26): ~4 min
#     eagle3  bench/eagle3_cost.py: a random head of EAGLE3-LLaMA3.1-Instruct-8B's shape on the 8B-shaped target
#             (aux states captured inside the graphs): its K drafts' cost against a target step at 1, 8, 32
#             (issue 48: <= 5% of a step per draft token; not yet run):                                     ~3 min
#     trees   the 8b stage with token trees (speculation.tree: on, 8 nodes; the draft model's chain with its best
#             alternatives beside it) after the tree kernels' CUDA tests (issue 49: trees >= 1.2x the chain at
#             one stream, never below it at 32; not yet run):                                                ~8 min
#     sources every draft source on the 8B pair in one call (issue 51, item 5), at noise 0.01 (greedy agreement 0.91
#             at reduced width on a CPU, 0.02 gave 0.64 on the H100 where the CPU said 0.83): plain, the draft model,
#             `self` (the same layers drafting inside the target: issue 47's one-stream >= 2.5x and drafting <= 15%
#             of a round), random Medusa and EAGLE-3 heads of the target's shape (their drafting share; their
#             drafts are random, so the plan should keep them off: never below plain), 1 and 32 streams:      ~9 min
#     amx     the device host's CPU, where it has AMX (Intel Sapphire Rapids and later; issue 50): the AMX product's
#             tests on the CPU's own tiles (batch invariance over 1..64 rows, the product against the exact one, a
#             bf16 runner's rows the same bits in any batch), its speed against VDPBF16PS, and what
#             engine/models/cpu/bf16_products.py chooses for SmolLM2-135M's and Llama-3.1-8B's layer shapes (no
#             GPU used; prints the CPU's AMX flags first, and says so where it has none):                  ~2 min
# gpu_serve runs Serve as `make run` does (throughput mode behind HAProxy, whose wheel the pack carries); add
# --ray-serve-proxy for Serve's own proxy. Measured (bench/RESULTS.md, sessions 26-27): tests 2.5 min, 8b 4.7-5.1, 1.5b 4.3, exact 4.0;
# run back to back (the machine stays warm 30 s after a call), tests + 8b + one more stage fit a session's 15 minutes
# with the machine's start. The servers' configs and logs come back as one runs.tgz (the device returns 8 files).
# Record what they print in bench/RESULTS.md with the commit and the command.
set -u
STAGE=${1:?usage: gpu_check.sh tests|1.5b|8b|exact|eagle3|trees|sources|amx}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
bash .gpu/unpack.sh || { echo "no .gpu/ carried: see this script's header"; exit 2; }
export PYTHONPATH=/tmp/gpusite:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
git log -1 --format='commit %H' 2>/dev/null | tee "$OUT/commit.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
case "$STAGE" in
  tests)
    timeout 240 python3 -m pytest -q -p no:cacheprovider -o addopts="" \
      tests/engine/models/static/test_runner_cuda.py tests/engine/models/static/test_attention.py \
      tests/engine/models/static/test_fused_ops.py tests/engine/models/static/test_tree_kernels.py \
      2>&1 | tee "$OUT/cuda_tests.txt"
    timeout 200 python3 -m bench.gpu_runner_bench --batches 1,8,32 --runners static,eager --reps 10 --profile \
      --out "$OUT/gpu_runner_bench.json" 2>&1 | tee "$OUT/gpu_runner_bench.txt"
    ;;
  1.5b)
    timeout 290 python3 -m bench.gpu_serve --shape 1.5b --budget-s 240 --serve-cli python \
      --pair-root /tmp/pairs --out "$OUT/gpu_serve_1.5b.json" 2>&1 | tee "$OUT/gpu_serve_1.5b.txt"
    ;;
  8b)
    timeout 560 python3 -m bench.gpu_serve --shape 8b --noise 0.02 --budget-s 480 --serve-cli python \
      --pair-root /tmp/pairs --out "$OUT/gpu_serve_8b.json" 2>&1 | tee "$OUT/gpu_serve_8b.txt"
    ;;
  exact)
    timeout 290 python3 -m bench.gpu_serve --shape 1.5b --concurrency 1 8 --budget-s 240 --serve-cli python \
      --set model.target_dtype=float32 --set model.draft_dtype=float32 \
      --pair-root /tmp/pairs --out "$OUT/gpu_serve_exact.json" 2>&1 | tee "$OUT/gpu_serve_exact.txt"
    ;;
  eagle3)
    timeout 300 python3 -m bench.eagle3_cost --out "$OUT/eagle3_cost.json" 2>&1 | tee "$OUT/eagle3_cost.txt"
    ;;
  trees)
    timeout 60 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/models/static/test_runner_cuda.py \
      -k tree 2>&1 | tee "$OUT/cuda_tree_tests.txt"
    timeout 480 python3 -m bench.gpu_serve --shape 8b --noise 0.02 --budget-s 420 --serve-cli python \
      --set speculation.tree=on --set speculation.tree_nodes=8 \
      --pair-root /tmp/pairs --out "$OUT/gpu_serve_8b_trees.json" 2>&1 | tee "$OUT/gpu_serve_8b_trees.txt"
    ;;
  sources)
    timeout 570 python3 -m bench.gpu_serve --shape 8b --noise 0.01 --concurrency 1 32 --budget-s 500 \
      --serve-cli python --variants plain speculative self medusa eagle3 \
      --pair-root /tmp/pairs --out "$OUT/gpu_serve_sources.json" 2>&1 | tee "$OUT/gpu_serve_sources.txt"
    ;;
  amx)
    (lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -w -E "amx_[a-z0-9]+" /proc/cpuinfo | sort -u) | tee "$OUT/cpu.txt"
    timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/engine/models/cpu/test_amx_gemm.py \
      tests/engine/models/cpu/test_bf16_products.py tests/engine/models/cpu/test_bf16_gemm.py \
      "tests/engine/models/static/test_runner.py::test_a_bf16_rows_step_is_the_same_bits_in_any_batch" \
      2>&1 | tee "$OUT/amx_tests.txt"
    timeout 120 python3 -m bench.bf16_products matrix 2>&1 | tee "$OUT/amx_matrix.txt"
    timeout 120 python3 -m bench.bf16_products choice 576x1536 4096x14336 2>&1 | tee "$OUT/amx_choice.txt"
    ;;
  *)
    echo "unknown stage $STAGE"; exit 2 ;;
esac
if compgen -G "$OUT/*_runs" > /dev/null; then
  (cd "$OUT" && tar czf runs.tgz ./*_runs && rm -rf ./*_runs)
fi
