// Y[M, N] = X[M, K] W[N, K]^T (+ bias[N]) for a few fp32 rows (decode and verify steps) on x86 CPUs with AVX2/FMA.
//
// Python side, with the measurements that motivate it: engine/cpu_extension.py. Built by engine/cpu_extension.py with
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

#include "simd.h"

namespace {

constexpr int64_t kCols = 3;      // weight rows (output columns) per panel
constexpr int64_t kRows = 4;      // activation rows per block
constexpr int64_t kMaxRows = 64;  // Python sends at most this many (engine/cpu_extension.py)

using specserve::lane_sum;

// one panel of `cols` (<= kCols) weight rows times rows [m0, m0 + rows) of x
template <int64_t rows, int64_t cols>
inline void block(const float* x, const float* w, int64_t k_size, float* acc_out, const float* prefetch) {
  __m256 acc[rows][cols];
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < k_size; k += 8) {
    if (prefetch != nullptr && (k & 15) == 0)
      for (int64_t j = 0; j < kCols; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(prefetch + j * k_size + k), _MM_HINT_T0);
    __m256 wv[cols];
    for (int64_t j = 0; j < cols; ++j) wv[j] = _mm256_loadu_ps(w + j * k_size + k);
    for (int64_t i = 0; i < rows; ++i) {
      const __m256 xv = _mm256_loadu_ps(x + i * k_size + k);
      for (int64_t j = 0; j < cols; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) acc_out[i * kCols + j] = lane_sum(acc[i][j]);
}

template <int64_t cols>
inline void panel_rows(const float* x, const float* w, int64_t k_size, int64_t m0, int64_t rows, float* out,
                       const float* prefetch) {
  const float* xr = x + m0 * k_size;
  switch (rows) {
    case 1: block<1, cols>(xr, w, k_size, out, prefetch); break;
    case 2: block<2, cols>(xr, w, k_size, out, prefetch); break;
    case 3: block<3, cols>(xr, w, k_size, out, prefetch); break;
    default: block<4, cols>(xr, w, k_size, out, prefetch); break;
  }
}

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "small_gemm: x [M, K] and weight [N, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "small_gemm: float32 only");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "small_gemm: CPU tensors only");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "small_gemm: contiguous x and weight");
  const int64_t m_size = x.size(0), k_size = x.size(1), n_size = weight.size(0);
  TORCH_CHECK(weight.size(1) == k_size, "small_gemm: x has ", k_size, " columns, weight ", weight.size(1));
  TORCH_CHECK(k_size % 8 == 0, "small_gemm: K must be a multiple of 8, got ", k_size);
  TORCH_CHECK(m_size <= kMaxRows, "small_gemm: at most ", kMaxRows, " rows, got ", m_size);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n_size,
                "small_gemm: bias must be a contiguous float32 [N]");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({m_size, n_size}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t panels = (n_size + kCols - 1) / kCols;
  // a thread's share should stream at least ~64 KiB of weights, else the split costs more than it saves
  const int64_t grain = std::max<int64_t>(1, (64 * 1024) / (kCols * k_size * 4));
  at::parallel_for(0, panels, grain, [&](int64_t first, int64_t last) {
    float out[kRows * kCols];
    for (int64_t p = first; p < last; ++p) {
      const int64_t n0 = p * kCols;
      const int64_t cols = std::min(kCols, n_size - n0);
      const float* w = wp + n0 * k_size;
      const float* next = (p + 1 < last && cols == kCols) ? w + kCols * k_size : nullptr;
      if (next != nullptr && n0 + 2 * kCols > n_size) next = nullptr;  // the next panel is a partial one
      for (int64_t m0 = 0; m0 < m_size; m0 += kRows) {
        const int64_t rows = std::min(kRows, m_size - m0);
        const float* pf = m0 == 0 ? next : nullptr;
        if (cols == 3) panel_rows<3>(xp, w, k_size, m0, rows, out, pf);
        else if (cols == 2) panel_rows<2>(xp, w, k_size, m0, rows, out, pf);
        else panel_rows<1>(xp, w, k_size, m0, rows, out, pf);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < cols; ++j)
            yp[(m0 + i) * n_size + n0 + j] = b != nullptr ? out[i * kCols + j] + b[n0 + j] : out[i * kCols + j];
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specserve, m) {
  m.def("small_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.impl("small_gemm", c10::DispatchKey::CPU, TORCH_FN(small_gemm));
}
