// Y[M, N] = bf16(X[M, K]) W[N, K]^T (+ bias[N]) on x86 CPUs with AVX512_BF16, for any M: the bf16 product of the
// static runner's bf16 models on CPU (fp32 activations rounded to bf16 with round-to-nearest-even, as torch's
// .bfloat16(); bf16 weights; fp32 sums and output), for decode and verify steps and prompt chunks alike.
//
// The weights are packed once at load (engine/models/cpu/linear.pack_bf16) in the VNNI layout that VDPBF16PS reads:
// [N/16, K/2, 16, 2], 16 output columns by a pair of k per 64-byte vector. One instruction then multiplies a
// broadcast pair of activations by 16 columns' pairs and adds both products to 16 fp32 accumulators (an outer
// product: no horizontal sums), 32 multiply-adds where engine/models/cpu/csrc/small_gemm.cpp's widening kernel does 8.
//
// Batch invariance: every output element is accumulated over the k pairs in increasing order by the same
// instruction, in its own register lane, whatever M is, whichever block its row falls in and whichever thread
// computes it. A row's result is the same bits alone, beside other rows (a batched step, a grouped prefill), in a
// decode step, a verify step or a prompt chunk. MKL and oneDNN choose blockings and k splits by shape, so their
// bits depend on the batch.
//
// Blocking: tiles of up to kRows activation rows by kCols 16-column vectors (24 accumulators + 3 weight vectors
// + 1 broadcast of the 32 registers). A thread's tiles share a weight panel (K/2 x 48 pairs, 54 KiB at K = 576),
// which stays in L2 while every row block of the chunk passes over it. Threads (torch's intra-op pool) take
// contiguous runs of tiles, panel-major.
//
// Compiled for AVX512_BF16 per function (the library's other sources target AVX2), and run only where the CPU
// reports it (`bf16_gemm_supported`; engine/models/cpu/extension.py checks before use).
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "packed_bf16.h"
#include "pool.h"

namespace {

constexpr int64_t kRows = 8;   // activation rows per tile
constexpr int64_t kCols = 3;   // 16-column weight vectors per tile
constexpr int64_t kLanes = 16;

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

// rows x cols tile: rows of x (bf16 pairs, stride `pairs`) times `cols` 16-column vectors of the packed weight
template <int64_t rows, int64_t cols>
inline void tile(const uint32_t* x, const uint32_t* w, int64_t pairs, float* y, int64_t n0, int64_t n_size,
                 const float* bias) {
  __m512 acc[rows][cols];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t vector_stride = pairs * kLanes;  // uint32 pairs per 16-column vector
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[cols];
    for (int64_t j = 0; j < cols; ++j)
      wv[j] = (__m512bh)_mm512_loadu_si512(w + j * vector_stride + p * kLanes);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[i * pairs + p]));
      for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int64_t j = 0; j < cols; ++j) {
    const int64_t n = n0 + j * kLanes;
    const int64_t valid = std::min<int64_t>(kLanes, n_size - n);
    const __mmask16 mask = valid >= kLanes ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << valid) - 1);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 value = bias != nullptr ? _mm512_add_ps(acc[i][j], b) : acc[i][j];
      _mm512_mask_storeu_ps(y + i * n_size + n, mask, value);
    }
  }
}

template <int64_t cols>
inline void tile_rows(const uint32_t* x, const uint32_t* w, int64_t pairs, float* y, int64_t n_size, int64_t n0,
                      int64_t rows, const float* bias) {
  switch (rows) {
    case 1: tile<1, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 2: tile<2, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 3: tile<3, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 4: tile<4, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 5: tile<5, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 6: tile<6, cols>(x, w, pairs, y, n0, n_size, bias); break;
    case 7: tile<7, cols>(x, w, pairs, y, n0, n_size, bias); break;
    default: tile<8, cols>(x, w, pairs, y, n0, n_size, bias); break;
  }
}

void gemm(const uint32_t* x, const uint32_t* w, const float* bias, float* y, int64_t m_size, int64_t pairs,
          int64_t n_size, int64_t vectors) {
  const int64_t panels = (vectors + kCols - 1) / kCols;
  const int64_t row_blocks = (m_size + kRows - 1) / kRows;
  // a run of tiles should stream at least ~64 KiB of weights (or its equivalent in arithmetic), else the split
  // costs more than it saves
  const int64_t tile_bytes = kCols * pairs * kLanes * 4 * std::min<int64_t>(m_size, kRows);
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, tile_bytes));
  specserve::parallel_for(0, panels * row_blocks, grain, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t panel = t / row_blocks, block = t % row_blocks;
      const int64_t v0 = panel * kCols, m0 = block * kRows;
      const int64_t cols = std::min(kCols, vectors - v0), rows = std::min(kRows, m_size - m0);
      const uint32_t* wp = w + v0 * pairs * kLanes;
      const uint32_t* xp = x + m0 * pairs;
      float* yp = y + m0 * n_size;
      const int64_t n0 = v0 * kLanes;
      if (cols == 3) tile_rows<3>(xp, wp, pairs, yp, n_size, n0, rows, bias);
      else if (cols == 2) tile_rows<2>(xp, wp, pairs, yp, n_size, n0, rows, bias);
      else tile_rows<1>(xp, wp, pairs, yp, n_size, n0, rows, bias);
    }
  });
}

#pragma GCC pop_options

bool bf16_gemm_supported() { return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw"); }

at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n_size,
                     const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(bf16_gemm_supported(), "bf16_gemm: this CPU lacks AVX512_BF16");
  const auto p = specserve::PackedProduct::checked("bf16_gemm", x, packed, n_size, bias);
  at::Tensor y = at::empty({p.m, p.n}, x.options());
  if (p.m == 0) return y;
  std::vector<uint32_t> pairs_x(static_cast<size_t>(p.m * p.pairs));
  specserve::to_bf16_pairs(x.data_ptr<float>(), p.m, p.k, p.pairs, pairs_x.data());
  gemm(pairs_x.data(), p.weight, p.bias, y.data_ptr<float>(), p.m, p.pairs, p.n, p.vectors);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("bf16_gemm(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.impl("bf16_gemm", c10::DispatchKey::CPU, TORCH_FN(bf16_gemm));
  m.def("bf16_gemm_supported() -> bool", &bf16_gemm_supported);
}
