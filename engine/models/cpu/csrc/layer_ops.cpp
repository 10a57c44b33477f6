// Fused fp32 CPU operators for the static runner's eager layer (engine/models/static/layer_ops.py), each replacing several
// ATen calls whose dispatch cost dominates at decode sizes (one or a few rows of 576 values: the arithmetic is
// tiny, the per-call overhead is not). Semantics are those of the Python code they replace:
//
//   rms_norm(x, w, eps)               x * rsqrt(mean(x^2) + eps) * w                  (_rms_norm)
//   add_rms_norm(h, d, w, eps)        h += d (in place), then rms_norm(h, w, eps)      (residual + next norm)
//   silu_mul(gate_up)                 silu(gate) * up, gate_up = [gate | up]           (the SwiGLU MLP; e^x: simd.h)
//   cache_attention(q, k_cache, v_cache, first_slot, positions, kv_len, scale, ancestors=None)
//       causal GQA attention of each row's queries over its cached keys, read in place (below); with `ancestors`
//       (a token tree's step) each node attends to the committed keys and its own path's only (`attend_tree`)
//   rope_to_cache(qkv, cos, sin, positions, k_cache, v_cache, first_slot, heads, kv_heads, rope_positions=None)
//       q [B, H, W, D] RoPE'd (rotate-half form, `apply_rope` in engine/models/static/rope.py); k RoPE'd and v
//       written into the caches at (first_slot + b, :, positions[b, w]), what the Python step does with index
//       assignments; rotated at rope_positions[b, w] where given (a tree node: its committed length plus its depth),
//       else at positions[b, w]
//
// The KV caches are fp32 or bf16 (runner.kv_cache_dtype): written rounded to nearest even, widened exactly as read.
//
// Compiled with -std=c++17 (ISO: no floating-point contraction), so products and sums round as ATen's separate
// elementwise operators do; reductions may sum in another order (fp32 tolerance).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include <immintrin.h>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "pool.h"
#include "simd.h"

namespace {

void check_float(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// a KV cache: float32 or bfloat16 (held as its bits), contiguous on the CPU; both caches of one call alike
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK((t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) && t->device().is_cpu() &&
                    t->is_contiguous(),
                "KV caches must be contiguous float32 or bfloat16 CPU tensors");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k_cache and v_cache must have the same dtype");
}

// f(k, v) with the caches' data as stored: float, or bf16 bits (uint16_t)
template <typename F>
void with_cache_data(const at::Tensor& k_cache, const at::Tensor& v_cache, F&& f) {
  if (k_cache.scalar_type() == at::kBFloat16)
    f(reinterpret_cast<uint16_t*>(k_cache.data_ptr()), reinterpret_cast<uint16_t*>(v_cache.data_ptr()));
  else
    f(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
}

// 8 cached values as floats (bf16 widens exactly: its bits are a float's upper half)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// a float as a cache stores it: itself, or its nearest bf16 (ties to even: torch's .bfloat16())
inline void store(float value, float* out) { *out = value; }
inline void store(float value, uint16_t* out) { *out = specserve::bf16_bits(value); }

// positions [B, W] of rows first_slot .. first_slot + B - 1 of `cache` ([slots, KVH, capacity, D]): a contiguous
// int64 CPU tensor whose every entry is in [0, limit) (`name`: the argument, for the messages)
const int64_t* checked_positions(const at::Tensor& positions, int64_t batch, int64_t width, int64_t first_slot,
                                 const at::Tensor& cache, int64_t limit, const char* name = "positions") {
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.device().is_cpu() && positions.is_contiguous() &&
                  positions.dim() == 2,
              name, " must be a contiguous int64 CPU tensor [B, W]");
  TORCH_CHECK(positions.size(0) == batch && positions.size(1) == width, name, " must be [B, W]");
  TORCH_CHECK(first_slot >= 0 && first_slot + batch <= cache.size(0), "rows past the cache's slots");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < batch * width; ++i)
    TORCH_CHECK(pos[i] >= 0 && pos[i] < limit, "position ", pos[i], " out of range (", name, ")");
  return pos;
}

inline void norm_row(const float* x, const float* w, float eps, int64_t size, float* out) {
  float sum = 0.0f;
  for (int64_t i = 0; i < size; ++i) sum += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(size) + eps);
  for (int64_t i = 0; i < size; ++i) out[i] = (x[i] * scale) * w[i];
}

int64_t rows_of(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 1 && x.size(-1) == w.size(0), "norm weight [H] must match x's last dimension");
  return x.numel() / w.size(0);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_float(x, "x");
  check_float(weight, "weight");
  const int64_t size = weight.size(0), rows = rows_of(x, weight);
  at::Tensor out = at::empty_like(x);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  specserve::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) norm_row(xp + r * size, wp, static_cast<float>(eps), size, op + r * size);
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  check_float(hidden, "hidden");
  check_float(delta, "delta");
  check_float(weight, "weight");
  TORCH_CHECK(hidden.sizes() == delta.sizes(), "hidden and delta must have the same shape");
  const int64_t size = weight.size(0), rows = rows_of(hidden, weight);
  at::Tensor out = at::empty_like(hidden);
  float* hp = hidden.data_ptr<float>();
  const float *dp = delta.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  specserve::parallel_for(0, rows, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      float* h = hp + r * size;
      const float* d = dp + r * size;
      for (int64_t i = 0; i < size; ++i) h[i] = h[i] + d[i];
      norm_row(h, wp, static_cast<float>(eps), size, op + r * size);
    }
  });
  return out;
}

inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 e = specserve::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1);
  TORCH_CHECK(width % 2 == 0, "gate_up's last dimension must be even");
  const int64_t half = width / 2, rows = gate_up.numel() / width;
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = half;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  specserve::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float* g = gp + r * width;
      const float* u = g + half;
      float* o = op + r * half;
      // silu(g) = g / (1 + e^-g), 8 lanes at a time; the last partial vector goes through the same lanes
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) _mm256_storeu_ps(o + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      if (i < half) {
        float gv[8] = {0}, uv[8] = {0}, ov[8];
        std::copy(g + i, g + half, gv);
        std::copy(u + i, u + half, uv);
        _mm256_storeu_ps(ov, silu_mul8(_mm256_loadu_ps(gv), _mm256_loadu_ps(uv)));
        std::copy(ov, ov + (half - i), o + i);
      }
    }
  });
  return out;
}

template <typename T>
inline void rope_row(const float* x, const float* cos, const float* sin, int64_t dim, T* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < half; ++d) store(x[d] * cos[d] + (-x[d + half]) * sin[d], out + d);
  for (int64_t d = half; d < dim; ++d) store(x[d] * cos[d] + x[d - half] * sin[d], out + d);
}

// token t = b * W + w: rotated at rotate[t] (positions, or a tree step's rope_positions), written at pos[t]
template <typename T>
void rope_rows(const float* xp, const float* cp, const float* sp, const int64_t* pos, const int64_t* rotate,
               int64_t batch, int64_t width, int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t capacity,
               int64_t first_slot, float* qp, T* kp, T* vp) {
  const int64_t row = (num_heads + 2 * num_kv_heads) * dim;
  specserve::parallel_for(0, batch * width, 8, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t b = t / width, w = t % width, p = pos[t], r = rotate[t];
      const float* x = xp + t * row;
      const float *c = cp + r * dim, *s = sp + r * dim;
      for (int64_t h = 0; h < num_heads; ++h)
        rope_row(x + h * dim, c, s, dim, qp + ((b * num_heads + h) * width + w) * dim);
      for (int64_t g = 0; g < num_kv_heads; ++g) {
        const int64_t at_cache = (((first_slot + b) * num_kv_heads + g) * capacity + p) * dim;
        rope_row(x + (num_heads + g) * dim, c, s, dim, kp + at_cache);
        const float* v = x + (num_heads + num_kv_heads + g) * dim;
        for (int64_t d = 0; d < dim; ++d) store(v[d], vp + at_cache + d);
      }
    }
  });
}

at::Tensor rope_to_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& positions, at::Tensor k_cache, at::Tensor v_cache, int64_t first_slot,
                         int64_t num_heads, int64_t num_kv_heads, const std::optional<at::Tensor>& rope_positions) {
  check_float(qkv, "qkv");
  check_float(cos, "cos");
  check_float(sin, "sin");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(qkv.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "qkv [B, W, (H + 2 KVH) D], caches [slots, KVH, capacity, D]");
  const int64_t batch = qkv.size(0), width = qkv.size(1), dim = k_cache.size(3);
  const int64_t capacity = k_cache.size(2);
  TORCH_CHECK(k_cache.size(1) == num_kv_heads && qkv.size(2) == (num_heads + 2 * num_kv_heads) * dim,
              "qkv's width does not match the heads");
  TORCH_CHECK(cos.size(1) == dim && sin.sizes() == cos.sizes() && dim % 2 == 0, "cos/sin [capacity, D], D even");
  const int64_t* pos = checked_positions(positions, batch, width, first_slot, k_cache,
                                         std::min(capacity, cos.size(0)));
  const int64_t* rotate = rope_positions.has_value()
                              ? checked_positions(*rope_positions, batch, width, first_slot, k_cache, cos.size(0),
                                                  "rope_positions")
                              : pos;
  at::Tensor q = at::empty({batch, num_heads, width, dim}, qkv.options());
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  with_cache_data(k_cache, v_cache, [&](auto* kp, auto* vp) {
    rope_rows(xp, cp, sp, pos, rotate, batch, width, num_heads, num_kv_heads, dim, capacity, first_slot, qp, kp, vp);
  });
  return q;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) hidden, Tensor delta, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_to_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor positions, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, int first_slot, int num_heads, int num_kv_heads, Tensor? rope_positions=None) -> Tensor");
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("silu_mul", c10::DispatchKey::CPU, TORCH_FN(silu_mul));
  m.impl("rope_to_cache", c10::DispatchKey::CPU, TORCH_FN(rope_to_cache));
}

namespace {

using specserve::exp8;
using specserve::lane_sum;

// attention of a few queries per row (decode, verify) over the rows' own cached keys, read in place:
// out[b, h, w] = softmax_t<=positions[b, w](scale * q[b, h, w] . k[slot_b, g, t]) . v[slot_b, g, t], g = h / (H / KVH),
// t < kv_len too (a padding row's position lies past every real key). Unlike `visible_keys` + SDPA, a row reads only
// its own keys, and nothing is materialized.
// The caches are float32 or bfloat16 (rope_to_cache rounds what it writes; loads widen exactly). Each query's
// arithmetic is fixed by its own length alone, not by its task or the step's width, so its result never depends on
// how a sequence's tokens were split into steps or chunks: the keys and values a prompt writes are the same bits
// whether it was fed whole, in chunks, or after a prefix another sequence computed (engine/models/static/prefix_cache.py relies
// on it).
constexpr int64_t QUERY_BLOCK = 8;

// A task computes the queries of one row, a block of up to QUERY_BLOCK step positions and `heads_per_task` heads
// that share a key/value head (all of the group where there are enough tasks to go round, else one): it reads each
// key and value once for all of them, bf16 ones widened once into a float block, and scores and weighs them for up
// to QUERY_TILE queries at a time in registers (each key or value vector loaded once per tile, not per query). Each
// query's arithmetic is the same fixed sequence in every layout (below), alone or in a tile, so its result does not
// depend on its task or the step's width, and it is the same bits for a float cache and for a bf16 cache holding the
// same values.
constexpr int64_t KEY_BLOCK = 8;  // keys scored together (eight accumulators)
constexpr int64_t VALUE_BLOCK = 16;  // values widened at a time

// asks for `bytes` from `p` on into the cache ahead of their use (the step's keys and values come from DRAM)
inline void prefetch(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}
constexpr int64_t PREFETCH_KEYS = 32;  // how far ahead, in keys (or values)

// keys [n, D] as floats: in place for a float cache, else widened into `buffer`
inline const float* as_floats(const float* keys, int64_t, int64_t, float*) { return keys; }
inline const float* as_floats(const uint16_t* keys, int64_t n, int64_t dim, float* buffer) {
  for (int64_t i = 0; i < n * dim; i += 8) _mm256_storeu_ps(buffer + i, load8(keys + i));
  return buffer;
}

// a vector's 8 lanes summed as ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): the order `sums8` gives each
inline float pairwise_sum(__m256 v) {
  const __m256 quads = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_setzero_ps());
  return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(quads), _mm256_extractf128_ps(quads, 1)));
}

// the 8 vectors' sums (lane k: a[k]'s lanes added as pairwise_sum adds them), by six horizontal adds
inline __m256 sums8(const __m256* a) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));  // [a0 a1 a2 a3 | ...]
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  // low 128 bits hold each vector's lanes 0-3, high its lanes 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// scores[k] = (q . keys[k]) * s for k < n (n <= KEY_BLOCK): per key, 8-lane FMAs over the head dimension in ascending
// order, then its lanes summed pairwise, whether the keys are scored eight together or one by one
inline void key_scores(const float* qv, const float* keys, int64_t dim, int64_t n, float s, float* scores) {
  if (n == KEY_BLOCK) {
    __m256 a[KEY_BLOCK];
    for (int k = 0; k < KEY_BLOCK; ++k) a[k] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 x = _mm256_loadu_ps(qv + d);
      for (int k = 0; k < KEY_BLOCK; ++k) a[k] = _mm256_fmadd_ps(x, _mm256_loadu_ps(keys + k * dim + d), a[k]);
    }
    _mm256_storeu_ps(scores, _mm256_mul_ps(sums8(a), _mm256_set1_ps(s)));
    return;
  }
  for (int64_t k = 0; k < n; ++k) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qv + d), _mm256_loadu_ps(keys + k * dim + d), a);
    scores[k] = pairwise_sum(a) * s;
  }
}

// key_scores of ROWS queries against four keys, each pair's arithmetic exactly key_scores' (8-lane FMAs over the
// head dimension in ascending order, the lanes summed pairwise: sums8's order), each key read once for all the
// queries (a register tile: ROWS x 4 accumulators, the queries' vectors and one key's)
template <int ROWS>
inline void key_scores_tile(const float* const* qs, const float* keys, int64_t dim, float s, float* const* out) {
  __m256 a[ROWS][4];
  for (int i = 0; i < ROWS; ++i)
    for (int k = 0; k < 4; ++k) a[i][k] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    __m256 x[ROWS];
    for (int i = 0; i < ROWS; ++i) x[i] = _mm256_loadu_ps(qs[i] + d);
    for (int k = 0; k < 4; ++k) {
      const __m256 key = _mm256_loadu_ps(keys + k * dim + d);
      for (int i = 0; i < ROWS; ++i) a[i][k] = _mm256_fmadd_ps(x[i], key, a[i][k]);
    }
  }
  for (int i = 0; i < ROWS; ++i) {  // each key's lanes 0-3 summed in the low half, 4-7 in the high, then the halves
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[i][0], a[i][1]), _mm256_hadd_ps(a[i][2], a[i][3]));
    const __m128 sum = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    _mm_storeu_ps(out[i], _mm_mul_ps(sum, _mm_set1_ps(s)));
  }
}

// scores [0, length) -> softmax weights in place: the max over 8 lanes, e^(score - max) on 8 lanes (simd.h exp8)
// summed per lane over whole blocks then across lanes (lane_sum), the last partial block's values added in order,
// each weight divided by the sum: a fixed sequence for each length
inline void softmax_in_place(float* scores, int64_t length) {
  __m256 top8 = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= length; i += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(scores + i));
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = -INFINITY;
  for (float lane : lanes) top = std::max(top, lane);
  for (int64_t j = i; j < length; ++j) top = std::max(top, scores[j]);
  const __m256 shift = _mm256_set1_ps(top);
  __m256 sum8 = _mm256_setzero_ps();
  for (i = 0; i + 8 <= length; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + i), shift));
    _mm256_storeu_ps(scores + i, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = lane_sum(sum8);
  if (i < length) {  // the tail through the same routine (lanes are independent), the padding lanes dropped
    float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(scores + i, scores + length, tail);
    _mm256_storeu_ps(tail, exp8(_mm256_sub_ps(_mm256_loadu_ps(tail), shift)));
    std::copy(tail, tail + (length - i), scores + i);
    for (int64_t j = i; j < length; ++j) total += scores[j];
  }
  const __m256 divisor = _mm256_set1_ps(total);
  for (i = 0; i + 8 <= length; i += 8) _mm256_storeu_ps(scores + i, _mm256_div_ps(_mm256_loadu_ps(scores + i), divisor));
  for (; i < length; ++i) scores[i] /= total;
}

// out[d] += sum over k < n of weights[k] * values[k][d], k ascending (one FMA chain per lane, carried in `out` from
// one block of values to the next): 64 dimensions at a time in 8 registers, a remainder one 8-lane block at a time
inline void add_weighted_values(const float* weights, const float* values, int64_t dim, int64_t n, float* out) {
  int64_t d0 = 0;
  for (; d0 + 64 <= dim; d0 += 64) {
    __m256 acc[8];
    for (int k = 0; k < 8; ++k) acc[k] = _mm256_loadu_ps(out + d0 + 8 * k);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 p = _mm256_set1_ps(weights[t]);
      const float* v = values + t * dim + d0;
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * k), acc[k]);
    }
    for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + d0 + 8 * k, acc[k]);
  }
  for (; d0 < dim; d0 += 8) {
    __m256 acc = _mm256_loadu_ps(out + d0);
    for (int64_t t = 0; t < n; ++t)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(weights[t]), _mm256_loadu_ps(values + t * dim + d0), acc);
    _mm256_storeu_ps(out + d0, acc);
  }
}

// add_weighted_values of ROWS queries over the same n values: each output lane's FMA chain exactly
// add_weighted_values' (k ascending, carried in out), each value read once for all the queries (a register tile:
// ROWS x 16 dimensions, then ROWS x 8 for a remainder)
template <int ROWS>
inline void add_weighted_values_tile(const float* const* weights, const float* values, int64_t dim, int64_t n,
                                     float* const* outs) {
  int64_t d0 = 0;
  for (; d0 + 16 <= dim; d0 += 16) {
    __m256 acc[ROWS][2];
    for (int i = 0; i < ROWS; ++i) {
      acc[i][0] = _mm256_loadu_ps(outs[i] + d0);
      acc[i][1] = _mm256_loadu_ps(outs[i] + d0 + 8);
    }
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v0 = _mm256_loadu_ps(values + t * dim + d0), v1 = _mm256_loadu_ps(values + t * dim + d0 + 8);
      for (int i = 0; i < ROWS; ++i) {
        const __m256 p = _mm256_set1_ps(weights[i][t]);
        acc[i][0] = _mm256_fmadd_ps(p, v0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(p, v1, acc[i][1]);
      }
    }
    for (int i = 0; i < ROWS; ++i) {
      _mm256_storeu_ps(outs[i] + d0, acc[i][0]);
      _mm256_storeu_ps(outs[i] + d0 + 8, acc[i][1]);
    }
  }
  if (d0 < dim) {  // dim is a multiple of 8: one vector left
    __m256 acc[ROWS];
    for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_loadu_ps(outs[i] + d0);
    for (int64_t t = 0; t < n; ++t) {
      const __m256 v = _mm256_loadu_ps(values + t * dim + d0);
      for (int i = 0; i < ROWS; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(weights[i][t]), v, acc[i]);
    }
    for (int i = 0; i < ROWS; ++i) _mm256_storeu_ps(outs[i] + d0, acc[i]);
  }
}

constexpr int64_t QUERY_TILE = 3;  // the most queries in a register tile
static_assert(QUERY_TILE == 3, "attend() instantiates the tiles of 3 and of 2 queries");

// how many of queries j, j + 1, ... (at most QUERY_TILE) read every key before `end`: a tile when 2 or more, else 1
// (query j alone, whatever its length)
inline int64_t tile_queries(const std::vector<int64_t>& lengths, int64_t j, int64_t queries, int64_t end) {
  int64_t rows = 0;
  while (rows < QUERY_TILE && j + rows < queries && lengths[j + rows] >= end) ++rows;
  return std::max<int64_t>(rows, 1);
}

// scores[j][t] for t < lengths[j] of queries j < `queries` (q at qp + at[j]) over `keys` (as stored), KEY_BLOCK keys at
// a time, each block widened once and scored for up to QUERY_TILE queries per register tile where they all read it
// (`tile_queries`), else one by one up to each query's length; the values' first keys are prefetched as the keys end
template <typename T>
void score_keys(const float* qp, const int64_t* at, const std::vector<int64_t>& lengths, int64_t queries, int64_t longest,
                const T* keys, const T* values, int64_t dim, float s, float* scores, int64_t stride, float* buffer) {
  for (int64_t t = 0; t < longest; t += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, longest - t);
    if (t + PREFETCH_KEYS < longest)
      prefetch(keys + (t + PREFETCH_KEYS) * dim, std::min(KEY_BLOCK, longest - t - PREFETCH_KEYS) * dim * sizeof(T));
    else if (t + PREFETCH_KEYS < longest + KEY_BLOCK)  // the values' first keys
      prefetch(values, std::min(PREFETCH_KEYS, longest) * dim * sizeof(T));
    const float* block = as_floats(keys + t * dim, n, dim, buffer);
    for (int64_t j = 0, rows; j < queries; j += rows) {
      rows = n == KEY_BLOCK ? tile_queries(lengths, j, queries, t + KEY_BLOCK) : 1;
      if (rows == 1) {
        if (t < lengths[j])
          key_scores(qp + at[j], block, dim, std::min(n, lengths[j] - t), s, scores + j * stride + t);
        continue;
      }
      const float* qs[QUERY_TILE];
      float* out[QUERY_TILE];
      for (int64_t i = 0; i < rows; ++i) qs[i] = qp + at[j + i], out[i] = scores + (j + i) * stride + t;
      for (int64_t half = 0; half < KEY_BLOCK; half += 4) {
        if (rows == 3) key_scores_tile<3>(qs, block + half * dim, dim, s, out);
        else key_scores_tile<2>(qs, block + half * dim, dim, s, out);
        for (int64_t i = 0; i < rows; ++i) out[i] += 4;
      }
    }
  }
}

// op + at[j] += the weights scores[j][t] times values t, t < lengths[j], in ascending t (one FMA chain per lane, carried
// in the output), VALUE_BLOCK values widened at a time and weighed for up to QUERY_TILE queries per register tile
template <typename T>
void weigh_values(const int64_t* at, const std::vector<int64_t>& lengths, int64_t queries, int64_t longest,
                  const T* values, int64_t dim, const float* scores, int64_t stride, float* op, float* buffer) {
  for (int64_t t = 0; t < longest; t += VALUE_BLOCK) {
    const int64_t n = std::min(VALUE_BLOCK, longest - t);
    if (t + PREFETCH_KEYS < longest)
      prefetch(values + (t + PREFETCH_KEYS) * dim, std::min(VALUE_BLOCK, longest - t - PREFETCH_KEYS) * dim * sizeof(T));
    const float* block = as_floats(values + t * dim, n, dim, buffer);
    for (int64_t j = 0, rows; j < queries; j += rows) {
      rows = tile_queries(lengths, j, queries, t + n);
      if (rows == 1) {
        if (t < lengths[j])
          add_weighted_values(scores + j * stride + t, block, dim, std::min(n, lengths[j] - t), op + at[j]);
        continue;
      }
      const float* w[QUERY_TILE];
      float* out[QUERY_TILE];
      for (int64_t i = 0; i < rows; ++i) w[i] = scores + (j + i) * stride + t, out[i] = op + at[j + i];
      if (rows == 3) add_weighted_values_tile<3>(w, block, dim, n, out);
      else add_weighted_values_tile<2>(w, block, dim, n, out);
    }
  }
}

// How attend and attend_tree split a step: a task is one row, a block of up to QUERY_BLOCK of its positions and
// `heads_per_task` heads sharing a key/value head (all of the group where there are enough tasks to go round, about
// four a thread, else one)
struct QueryTasks {
  int64_t width, group, blocks, heads_per_task, per_row;

  QueryTasks(int64_t batch, int64_t heads, int64_t kv_heads, int64_t width)
      : width(width), group(heads / kv_heads), blocks((width + QUERY_BLOCK - 1) / QUERY_BLOCK) {
    heads_per_task = batch * kv_heads * blocks >= 4 * at::get_num_threads() ? group : 1;
    per_row = heads / heads_per_task * blocks;
  }

  int64_t most_queries() const { return heads_per_task * QUERY_BLOCK; }

  struct Task {
    int64_t b, h0, w0, w1, g;  // row, first head, positions [w0, w1), key/value head
  };

  Task operator[](int64_t task) const {
    const int64_t b = task / per_row, h0 = (task % per_row) / blocks * heads_per_task;
    const int64_t w0 = (task % blocks) * QUERY_BLOCK;
    return {b, h0, w0, std::min(width, w0 + QUERY_BLOCK), h0 / group};
  }
};

template <typename T>
void attend(const float* qp, const T* kp, const T* vp, const int64_t* pos, int64_t batch, int64_t heads,
            int64_t kv_heads, int64_t width, int64_t dim, int64_t capacity, int64_t first_slot, int64_t kv_len,
            float s, float* op) {
  const QueryTasks tasks(batch, heads, kv_heads, width);
  const int64_t heads_per_task = tasks.heads_per_task;
  specserve::parallel_for(0, batch * tasks.per_row, 1, [&](int64_t first, int64_t last) {
    const int64_t most = tasks.most_queries();
    std::unique_ptr<float[]> scores(new float[most * kv_len]), buffer(new float[VALUE_BLOCK * dim]);  // uninitialized
    std::vector<int64_t> lengths(most), at(most);
    for (int64_t task = first; task < last; ++task) {
      const auto [b, h0, w0, w1, g] = tasks[task];
      const T* keys = kp + ((first_slot + b) * kv_heads + g) * capacity * dim;
      const T* values = vp + ((first_slot + b) * kv_heads + g) * capacity * dim;
      int64_t queries = 0, longest = 0;
      for (int64_t w = w0; w < w1; ++w)  // position-major: a group's heads at one position have one length
        for (int64_t h = h0; h < h0 + heads_per_task; ++h, ++queries) {
          lengths[queries] = std::min(pos[b * width + w] + 1, kv_len);  // padding rows: at most kv_len keys
          at[queries] = ((b * heads + h) * width + w) * dim;
          longest = std::max(longest, lengths[queries]);
        }
      score_keys(qp, at.data(), lengths, queries, longest, keys, values, dim, s, scores.get(), kv_len, buffer.get());
      for (int64_t j = 0; j < queries; ++j) {
        softmax_in_place(scores.get() + j * kv_len, lengths[j]);
        std::fill(op + at[j], op + at[j] + dim, 0.0f);
      }
      weigh_values(at.data(), lengths, queries, longest, values, dim, scores.get(), kv_len, op, buffer.get());
    }
  });
}

// A token tree's verify step (`ancestors` given): step node w of row b, written at s_b + w (s_b = positions[b, 0], the
// row's committed length), attends to the committed keys [0, s_b) and to the step keys s_b + j of its
// ancestors-or-self j (the set bits of ancestors[b, w]) in ascending j, its path from the root: the keys plain decoding
// of that path puts before it, in the same order. Its arithmetic is the sequence `attend` runs for that query at
// position s_b + depth over a slot holding the committed keys followed by the path's: each key scored as key_scores
// scores it (alone, in a block of eight or in a tile: the same bits), the scores in path order (the committed keys',
// then the path's) through softmax_in_place over their count, then the values FMA'd in that order into one chain per
// lane carried in `out` (the committed values by blocks and tiles as attend weighs them, then the path's one at a
// time), so a node's result is the bits plain decoding of its path gives. Keys at or past kv_len are not read (a
// padding row: its positions lie past every real key and it reads kv_len committed keys, as attend clamps it; its
// output is unused). Tasks split rows, query blocks and heads as attend's do.
template <typename T>
void attend_tree(const float* qp, const T* kp, const T* vp, const int64_t* pos, const int64_t* ancestors,
                 int64_t batch, int64_t heads, int64_t kv_heads, int64_t width, int64_t dim, int64_t capacity,
                 int64_t first_slot, int64_t kv_len, float s, float* op) {
  const QueryTasks tasks(batch, heads, kv_heads, width);
  const int64_t heads_per_task = tasks.heads_per_task;
  specserve::parallel_for(0, batch * tasks.per_row, 1, [&](int64_t first, int64_t last) {
    const int64_t most = tasks.most_queries();
    std::unique_ptr<float[]> scores(new float[most * kv_len]), buffer(new float[VALUE_BLOCK * dim]);  // uninitialized
    std::unique_ptr<float[]> step_buffer(new float[width * dim]);  // the step's keys, then its values, as floats
    std::vector<int64_t> lengths(most), at(most);
    for (int64_t task = first; task < last; ++task) {
      const auto [b, h0, w0, w1, g] = tasks[task];
      const T* keys = kp + ((first_slot + b) * kv_heads + g) * capacity * dim;
      const T* values = vp + ((first_slot + b) * kv_heads + g) * capacity * dim;
      const int64_t start = pos[b * width];  // s_b: the root's slot, the row's committed length
      const int64_t committed = std::min(start, kv_len);  // every query's first keys
      // the step keys these queries' paths can hold (j < w1) that lie before kv_len
      const int64_t steps = std::max<int64_t>(0, std::min(w1, kv_len - start));
      int64_t queries = 0;
      for (int64_t w = w0; w < w1; ++w)  // position-major, as attend orders them
        for (int64_t h = h0; h < h0 + heads_per_task; ++h, ++queries) {
          at[queries] = ((b * heads + h) * width + w) * dim;
          lengths[queries] = committed;  // the keys score_keys and weigh_values give every query
        }
      // the committed keys' scores: every query reads all of them, as attend scores them
      score_keys(qp, at.data(), lengths, queries, committed, keys, values, dim, s, scores.get(), kv_len, buffer.get());
      // each query's path keys' scores after them, root first, then its softmax over the whole path
      const float* step_keys = as_floats(keys + start * dim, steps, dim, step_buffer.get());
      for (int64_t j = 0; j < queries; ++j) {
        float* row_scores = scores.get() + j * kv_len;
        int64_t length = committed;
        for (uint64_t bits = static_cast<uint64_t>(ancestors[b * width + w0 + j / heads_per_task]); bits != 0;
             bits &= bits - 1) {
          const int64_t k = __builtin_ctzll(bits);
          if (k >= steps) break;  // at or past kv_len, and so is every later node
          key_scores(qp + at[j], step_keys + k * dim, dim, 1, s, row_scores + length++);
        }
        softmax_in_place(row_scores, length);
        std::fill(op + at[j], op + at[j] + dim, 0.0f);
      }
      // the committed values, weighed for every query as attend weighs them
      weigh_values(at.data(), lengths, queries, committed, values, dim, scores.get(), kv_len, op, buffer.get());
      // then each query's path values in path order, the chains carried on in `out`
      const float* step_values = as_floats(values + start * dim, steps, dim, step_buffer.get());
      for (int64_t j = 0; j < queries; ++j) {
        const float* row_scores = scores.get() + j * kv_len;
        int64_t length = committed;
        for (uint64_t bits = static_cast<uint64_t>(ancestors[b * width + w0 + j / heads_per_task]); bits != 0;
             bits &= bits - 1) {
          const int64_t k = __builtin_ctzll(bits);
          if (k >= steps) break;
          add_weighted_values(row_scores + length++, step_values + k * dim, dim, 1, op + at[j]);
        }
      }
    }
  });
}

// ancestors [B, W] of a tree step: a contiguous int64 CPU tensor, W <= 63, each ancestors[b, w] a bitmask holding
// bit w (the node itself) and no bit above it
const int64_t* checked_ancestors(const at::Tensor& ancestors, int64_t batch, int64_t width) {
  TORCH_CHECK(ancestors.scalar_type() == at::kLong && ancestors.device().is_cpu() && ancestors.is_contiguous() &&
                  ancestors.dim() == 2,
              "ancestors must be a contiguous int64 CPU tensor [B, W]");
  TORCH_CHECK(ancestors.size(0) == batch && ancestors.size(1) == width, "ancestors must be [B, W]");
  TORCH_CHECK(width <= 63, "ancestors: a tree step has at most 63 nodes per row, got ", width);
  const int64_t* bits = ancestors.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t w = 0; w < width; ++w) {
      const uint64_t mask = static_cast<uint64_t>(bits[b * width + w]);
      TORCH_CHECK((mask >> w) & 1, "ancestors[", b, ", ", w, "] must hold bit ", w, " (the node itself)");
      TORCH_CHECK((mask >> w) >> 1 == 0, "ancestors[", b, ", ", w, "] holds a bit above ", w,
                  " (a later node: nodes must be in topological order)");
    }
  return bits;
}

at::Tensor cache_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           int64_t first_slot, const at::Tensor& positions, int64_t kv_len, double scale,
                           const std::optional<at::Tensor>& ancestors) {
  check_float(q, "q");
  check_caches(k_cache, v_cache);
  TORCH_CHECK(q.dim() == 4 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "q [B, H, W, D], caches [slots, KVH, capacity, D]");
  const int64_t batch = q.size(0), heads = q.size(1), width = q.size(2), dim = q.size(3);
  const int64_t kv_heads = k_cache.size(1), capacity = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim && heads % kv_heads == 0, "head sizes do not match");
  TORCH_CHECK(dim % 8 == 0, "cache_attention: head_dim must be a multiple of 8, got ", dim);
  TORCH_CHECK(kv_len >= 1 && kv_len <= capacity, "kv_len ", kv_len, " out of range");
  const int64_t* pos = checked_positions(positions, batch, width, first_slot, k_cache, capacity);
  const int64_t* tree = ancestors.has_value() ? checked_ancestors(*ancestors, batch, width) : nullptr;
  at::Tensor out = at::empty_like(q);
  const float s = static_cast<float>(scale);
  with_cache_data(k_cache, v_cache, [&](auto* kp, auto* vp) {
    if (tree != nullptr)
      attend_tree(q.data_ptr<float>(), kp, vp, pos, tree, batch, heads, kv_heads, width, dim, capacity, first_slot,
                  kv_len, s, out.data_ptr<float>());
    else
      attend(q.data_ptr<float>(), kp, vp, pos, batch, heads, kv_heads, width, dim, capacity, first_slot, kv_len, s,
             out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("cache_attention(Tensor q, Tensor k_cache, Tensor v_cache, int first_slot, Tensor positions, int kv_len, "
        "float scale, Tensor? ancestors=None) -> Tensor");
  m.impl("cache_attention", c10::DispatchKey::CPU, TORCH_FN(cache_attention));
}
