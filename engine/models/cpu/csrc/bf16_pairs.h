// Activations as bf16 pairs for the bf16 products (bf16_gemm.cpp, amx_gemm.cpp): fp32 rows rounded to bf16 as
// torch's .bfloat16() rounds, two consecutive k per uint32 (k even in the low half), the layout both VDPBF16PS's
// broadcast operand and an AMX A tile read.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "simd.h"

namespace specserve {

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
