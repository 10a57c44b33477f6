// What the bf16 products over engine/models/cpu/linear.pack_bf16's weights (bf16_gemm.cpp, amx_gemm.cpp) share: their
// arguments' checks, and the activations as bf16 pairs: fp32 rows rounded to bf16 as torch's .bfloat16() rounds, two
// consecutive k per uint32 (k even in the low half), the layout both VDPBF16PS's broadcast operand and an AMX A tile
// read.
#pragma once

#include <immintrin.h>

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "simd.h"

namespace specserve {

// a product's sizes and pointers, its arguments checked: x [M, K] contiguous fp32, packed [N/16, K/2, 16, 2]
// contiguous bf16 (K even or one less), N within the packed column vectors, bias [N] fp32 or none; `name` starts
// every error message
struct PackedProduct {
  int64_t m, k, n, vectors, pairs;
  const uint32_t* weight;  // the packed pairs, 16 columns per 64 bytes
  const float* bias;       // nullptr: none

  static PackedProduct checked(const char* name, const at::Tensor& x, const at::Tensor& packed, int64_t n,
                               const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.device().is_cpu(), name,
                ": x must be a contiguous float32 CPU [M, K]");
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                    packed.size(2) == 16 && packed.size(3) == 2 && packed.device().is_cpu(),
                name, ": packed must be a contiguous bfloat16 CPU [N/16, K/2, 16, 2] (linear.pack_bf16)");
    PackedProduct p{x.size(0), x.size(1), n, packed.size(0), packed.size(1),
                    reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>()), nullptr};
    TORCH_CHECK(p.k == 2 * p.pairs || p.k == 2 * p.pairs - 1, name, ": x has ", p.k, " columns, the packed weight ",
                2 * p.pairs);
    TORCH_CHECK(n > (p.vectors - 1) * 16 && n <= p.vectors * 16, name, ": n = ", n,
                " does not fit the packed weight's ", p.vectors, " column vectors");
    if (bias.has_value()) {
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n, name,
                  ": bias must be a contiguous float32 [N]");
      p.bias = bias->data_ptr<float>();
    }
    return p;
  }
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl")

// rows [0, m) of x [m, k] fp32 as bf16 pairs [m, pairs] (uint32: k even in the low half), rounded to nearest even
// as torch's .bfloat16() (NaN kept NaN); an odd K's last pair is padded with zero
inline void to_bf16_pairs(const float* x, int64_t m, int64_t k, int64_t pairs, uint32_t* out) {
  const __m512i round_bias = _mm512_set1_epi32(0x7fff);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i inf = _mm512_set1_epi32(0x7f800000);
  uint16_t* halves = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < m; ++i) {
    const float* row = x + i * k;
    uint16_t* dst = halves + i * 2 * pairs;
    int64_t j = 0;
    for (; j + 16 <= k; j += 16) {  // 16 floats a vector
      const __m512i bits = _mm512_castps_si512(_mm512_loadu_ps(row + j));
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(round_bias, lsb)), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, abs_mask), inf);
      const __m512i kept = _mm512_mask_mov_epi32(rounded, nan, _mm512_srli_epi32(bits, 16));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j), _mm512_cvtepi32_epi16(kept));
    }
    for (; j < k; ++j) dst[j] = bf16_bits(row[j]);  // the vector loop's rounding, one value at a time
    if (k < 2 * pairs) dst[k] = 0;
  }
}

#pragma GCC pop_options

// the same pairs one value at a time, on any x86 CPU (amx_gemm.cpp's emulated tiles)
inline void to_bf16_pairs_scalar(const float* x, int64_t m, int64_t k, int64_t pairs, uint32_t* out) {
  uint16_t* halves = reinterpret_cast<uint16_t*>(out);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < k; ++j) halves[i * 2 * pairs + j] = bf16_bits(x[i * k + j]);
    if (k < 2 * pairs) halves[i * 2 * pairs + k] = 0;
  }
}

}  // namespace specserve
