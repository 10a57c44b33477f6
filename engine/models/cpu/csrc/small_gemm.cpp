// Y[M, N] = X[M, K] W[N, K]^T (* scales[N]) (+ bias[N]) for a few fp32 rows (decode and verify steps) on x86 CPUs with
// AVX2/FMA. W is float32, bfloat16, or int8 with per-output-channel scales (weight-only quantization); bf16 and int8
// weights are widened to fp32 in registers as they stream in, so a memory-bound step reads 2x (bf16) or 4x (int8)
// fewer weight bytes, and every sum is fp32. With bf16 weights the product is a bf16 product: X is rounded to bf16
// first (round to nearest even, as torch's .bfloat16()), so each term is an exact product of two bf16 values, as in
// a bf16 GEMM with fp32 accumulation, and the output stays fp32 (not rounded to bf16 as ATen's bf16 GEMM does).
// On CPUs with AVX512_BF16 the static runner's bf16 products run on bf16_gemm.cpp instead, which is faster there
// (bench/RESULTS.md).
//
// Python side, with the measurements that motivate it: engine/models/cpu/extension.py. Built by engine/models/cpu/extension.py with
// g++ -O3 -mavx2 -mfma against torch's headers and registered as torch.ops.specserve.small_gemm.
//
// Each output element is a dot product over K, accumulated in 8-lane vectors in increasing k order and summed
// across lanes the same way, whatever M is and wherever the element's row or column falls: a row's result does
// not depend on the rows beside it (batch invariance; MKL picks different kernels per row count).
//
// The weight is read in its [N, K] layout (no packing): a panel of 3 columns is streamed once and kept in L1 while
// every block of up to 4 rows is multiplied with it (12 accumulators + 3 weight vectors + 1 row vector = 16 ymm
// registers). The next panel is prefetched while the first row block runs, so the DRAM reads of the weights
// overlap the arithmetic. Threads (torch's intra-op pool) take contiguous ranges of panels.
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "pool.h"
#include "simd.h"

namespace {

constexpr int64_t kCols = 3;      // weight rows (output columns) per panel
constexpr int64_t kRows = 4;      // activation rows per block

using specserve::lane_sum;

// the nearest bf16 value (ties to even; NaN stays NaN), as an fp32: what torch's .bfloat16().float() gives
inline float round_to_bf16(float value) {
  const uint32_t bits = static_cast<uint32_t>(specserve::bf16_bits(value)) << 16;
  std::memcpy(&value, &bits, sizeof(bits));
  return value;
}

// 8 consecutive weights as fp32 lanes: bf16 is the upper half of an fp32 (exact), int8 converts exactly
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
inline __m256 load8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}

// one panel of `cols` (<= kCols) weight rows times rows [m0, m0 + rows) of x
template <typename W, int64_t rows, int64_t cols>
inline void block(const float* x, const W* w, int64_t k_size, float* acc_out, const W* prefetch) {
  constexpr int64_t line = 64 / sizeof(W);  // weights per cache line
  __m256 acc[rows][cols];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 8) {
    if (prefetch != nullptr && (k & (line - 1)) == 0)
      for (int64_t j = 0; j < kCols; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * k_size + k), _MM_HINT_T0);
    __m256 wv[cols];
    for (int64_t j = 0; j < cols; ++j) wv[j] = load8(w + j * k_size + k);
    for (int64_t i = 0; i < rows; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k_size + k);
      for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc_out[i * kCols + j] = lane_sum(acc[i][j]);
}

template <typename W, int64_t cols>
inline void panel_rows(const float* x, const W* w, int64_t k_size, int64_t m0, int64_t rows, float* out,
                       const W* prefetch) {
  const float* xr = x + m0 * k_size;
  switch (rows) {
    case 1: block<W, 1, cols>(xr, w, k_size, out, prefetch); break;
    case 2: block<W, 2, cols>(xr, w, k_size, out, prefetch); break;
    case 3: block<W, 3, cols>(xr, w, k_size, out, prefetch); break;
    default: block<W, 4, cols>(xr, w, k_size, out, prefetch); break;
  }
}

// threads (torch's intra-op pool) take contiguous ranges of panels
template <typename W>
void gemm(const float* xp, const W* wp, const float* scales, const float* b, float* yp, int64_t m_size,
          int64_t k_size, int64_t n_size) {
  const int64_t panels = (n_size + kCols - 1) / kCols;
  // a thread's share should stream at least ~64 KiB of weights, else the split costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kCols * k_size * static_cast<int64_t>(sizeof(W))));
  specserve::parallel_for(0, panels, grain, [&](int64_t first, int64_t last) {
    float out[kRows * kCols];
    for (int64_t p = first; p < last; ++p) {
      const int64_t n0 = p * kCols;
      const int64_t cols = std::min(kCols, n_size - n0);
      const W* w = wp + n0 * k_size;
      const W* next = (p + 1 < last && cols == kCols) ? w + kCols * k_size : nullptr;
      if (next != nullptr && n0 + 2 * kCols > n_size) next = nullptr;  // the next panel is a partial one
      for (int64_t m0 = 0; m0 < m_size; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_size - m0);
        const W* pf = m0 == 0 ? next : nullptr;
        if (cols == 3) panel_rows<W, 3>(xp, w, k_size, m0, rows, out, pf);
        else if (cols == 2) panel_rows<W, 2>(xp, w, k_size, m0, rows, out, pf);
        else panel_rows<W, 1>(xp, w, k_size, m0, rows, out, pf);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j) {
            float value = out[i * kCols + j];
            if (scales != nullptr) value *= scales[n0 + j];
            yp[(m0 + i) * n_size + n0 + j] = b != nullptr ? value + b[n0 + j] : value;
          }
      }
    }
  });
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_gemm: x [M, K] and weight [N, K]");
  const auto wtype = weight.scalar_type();
  TORCH_CHECK(x.scalar_type() == at::kFloat, "small_gemm: x must be float32");
  TORCH_CHECK(wtype == at::kFloat || wtype == at::kBFloat16 || wtype == at::kChar,
              "small_gemm: weight must be float32, bfloat16 or int8, got ", wtype);
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_gemm: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_gemm: contiguous x and weight");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_size, "small_gemm: x has ", k_size, " columns, weight ", weight.size(1));
  TORCH_CHECK(k_size % 8 == 0, "small_gemm: K must be a multiple of 8, got ", k_size);
  TORCH_CHECK((wtype == at::kChar) == scales.has_value(), "small_gemm: int8 weights need scales [N], and only they");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_size,
                "small_gemm: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  const float* s = nullptr;
  if (scales.has_value()) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == n_size,
                "small_gemm: scales must be a contiguous float32 [N]");
    s = scales->data_ptr<float>();
  }
  at::Tensor y = at::empty({m_size, n_size}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (wtype == at::kFloat) {
    gemm(xp, weight.data_ptr<float>(), s, b, yp, m_size, k_size, n_size);
  } else if (wtype == at::kBFloat16) {
    std::vector<float> rounded(static_cast<size_t>(m_size * k_size));
    for (size_t i = 0; i < rounded.size(); ++i) rounded[i] = round_to_bf16(xp[i]);
    gemm(rounded.data(), weight.data_ptr<at::BFloat16>(), s, b, yp, m_size, k_size, n_size);
  } else {
    gemm(xp, weight.data_ptr<int8_t>(), s, b, yp, m_size, k_size, n_size);
  }
  return y;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("small_gemm(Tensor x, Tensor weight, Tensor? bias=None, Tensor? scales=None) -> Tensor");
  m.impl("small_gemm", c10::DispatchKey::CPU, TORCH_FN(small_gemm));
}
