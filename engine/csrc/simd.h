// AVX2 helpers shared by engine/csrc/*.cpp.
#pragma once

#include <immintrin.h>

namespace specserve {

// the sum of a vector's 8 lanes, always in the same order (results stay bit-for-bit reproducible)
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

}  // namespace specserve
