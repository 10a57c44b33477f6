// Y[M, N] = bf16(X[M, K]) W[N, K]^T (+ bias[N]) on x86 CPUs with AMX (AMX-TILE, AMX-BF16): the same product as
// bf16_gemm.cpp, over the same packed weights, computed by TDPBF16PS on tiles, and batch invariant the same way.
//
// The packed weight (engine/models/cpu/linear.pack_bf16: [N/16, K/2, 16, 2]) is already what a B tile holds: for
// one 16-column vector, 16 consecutive k pairs are 16 rows of 64 bytes. An A tile is up to 16 activation rows by
// 16 k pairs of packed_bf16.h's layout; a C tile 16 rows by 16 fp32 columns. A panel is one A tile (tmm3) against
// up to three column vectors (B tiles tmm4-6 into C tiles tmm0-2): K/32 steps of four tile loads and three
// TDPBF16PS, then the C tiles go through a small buffer into Y with the bias.
//
// Batch invariance: every output element is accumulated in its C tile over the k blocks in increasing order, the
// k blocks fixed by K alone (16 pairs, the last one what remains), whatever M is, whichever row block its row falls
// in and whichever thread computes it. A row's result is the same bits alone or beside other rows, in a decode
// step, a verify step or a prompt chunk. It is not VDPBF16PS's (bf16_gemm.cpp) bit for bit: TDPBF16PS pairs and
// rounds its products in its own way (the SDM's revisions describe it differently), so engine/models/cpu/
// bf16_products.py mixes the two only where a probe finds them equal, and otherwise runs one of them for every row
// count.
//
// The tile program is written once against a `Tiles` interface with two implementations: the CPU's tiles
// (`HardwareTiles`, only where the CPU has AMX and Linux grants the process the tile state: `amx_status`), and
// `EmulatedTiles`, plain C++ following the SDM's TDPBF16PS pseudocode (sequential round-to-nearest-even FMAs, even k
// of a pair first, denormals flushed), which checks every tile shape as the hardware would (#UD) and lets the
// program's layouts, tails and blocking be tested on any x86 CPU (`amx_bf16_gemm_emulated`).
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "packed_bf16.h"
#include "pool.h"

namespace {

constexpr int64_t kTileRows = 16;   // activation rows per A and C tile
constexpr int64_t kTilePairs = 16;  // k pairs per A tile row (64 bytes) and B tile rows
constexpr int64_t kLanes = 16;      // output columns per packed vector, per C tile row
constexpr int64_t kCols = 3;        // column vectors per panel (C tiles 0-2, A tile 3, B tiles 4-6)

// LDTILECFG's 64-byte operand, palette 1
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// `rows` activation rows (1..16) by `pairs` k pairs (1..16) per A tile
TileConfig config_for(int64_t rows, int64_t pairs) {
  TileConfig config;
  for (int t = 0; t < kCols; ++t) {
    config.rows[t] = static_cast<uint8_t>(rows);  // C
    config.colsb[t] = kLanes * 4;
    config.rows[4 + t] = static_cast<uint8_t>(pairs);  // B
    config.colsb[4 + t] = kLanes * 4;
  }
  config.rows[3] = static_cast<uint8_t>(rows);  // A
  config.colsb[3] = static_cast<uint16_t>(pairs * 4);
  return config;
}

// ---- the CPU's tiles ----------------------------------------------------------------------------------------------

// AMX intrinsics need GCC 11 or Clang 12; an older compiler builds the rest of the library, and amx_status says why
// the tiles are absent
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11)
#define SPECSERVE_AMX_BUILT 1

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

struct HardwareTiles {
  static void configure(const TileConfig& config) { _tile_loadconfig(&config); }
  static void release() { _tile_release(); }
  template <int t> static void zero();
  template <int t> static void load(const void* base, int64_t stride);
  template <int t> static void store(void* base, int64_t stride);
  template <int c, int b> static void dot();  // C tile c += A tile 3 x B tile b
};

// the intrinsics name their tile by a literal (GCC pastes it into the instruction), so one specialization per tile
#define SPECSERVE_TILE(t)                                                                                        \
  template <> void HardwareTiles::zero<t>() { _tile_zero(t); }                                                    \
  template <> void HardwareTiles::load<t>(const void* base, int64_t stride) { _tile_loadd(t, base, stride); }     \
  template <> void HardwareTiles::store<t>(void* base, int64_t stride) { _tile_stored(t, base, stride); }
SPECSERVE_TILE(0)
SPECSERVE_TILE(1)
SPECSERVE_TILE(2)
SPECSERVE_TILE(3)
SPECSERVE_TILE(4)
SPECSERVE_TILE(5)
SPECSERVE_TILE(6)
#undef SPECSERVE_TILE
template <> void HardwareTiles::dot<0, 4>() { _tile_dpbf16ps(0, 3, 4); }
template <> void HardwareTiles::dot<1, 5>() { _tile_dpbf16ps(1, 3, 5); }
template <> void HardwareTiles::dot<2, 6>() { _tile_dpbf16ps(2, 3, 6); }

#pragma GCC pop_options
#endif  // SPECSERVE_AMX_BUILT

// ---- tiles in plain C++ (tests on CPUs without AMX) ---------------------------------------------------------------

struct EmulatedTiles {
  struct State {
    TileConfig config;
    bool configured = false;
    uint8_t data[8][kTileRows][64];
  };
  static State& state() {
    thread_local State s;
    return s;
  }
  static void configure(const TileConfig& config) {
    State& s = state();
    s.config = config;
    s.configured = true;
    std::memset(s.data, 0, sizeof(s.data));  // LDTILECFG zeroes the tiles
  }
  static void release() { state().configured = false; }
  static State& shaped(int t) {
    State& s = state();
    if (!s.configured || s.config.rows[t] == 0 || s.config.rows[t] > kTileRows || s.config.colsb[t] > 64)
      throw std::logic_error("emulated AMX: tile " + std::to_string(t) + " used without a valid configuration");
    return s;
  }
  template <int t> static void zero() { std::memset(shaped(t).data[t], 0, sizeof(state().data[t])); }
  template <int t> static void load(const void* base, int64_t stride) {
    State& s = shaped(t);
    std::memset(s.data[t], 0, sizeof(s.data[t]));
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(s.data[t][r], static_cast<const uint8_t*>(base) + r * stride, s.config.colsb[t]);
  }
  template <int t> static void store(void* base, int64_t stride) {
    State& s = shaped(t);
    for (int r = 0; r < s.config.rows[t]; ++r)
      std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[t][r], s.config.colsb[t]);
  }
  static float flushed(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.0f, v) : v; }
  static float widened(const uint8_t* bf16) {
    uint32_t bits = static_cast<uint32_t>(bf16[0] | (bf16[1] << 8)) << 16;
    float v;
    std::memcpy(&v, &bits, sizeof(v));
    return flushed(v);
  }
  template <int c, int b> static void dot() {
    State& s = shaped(c);
    shaped(3);
    shaped(b);
    const TileConfig& k = s.config;
    if (k.rows[3] != k.rows[c] || k.colsb[3] / 4 != k.rows[b] || k.colsb[b] != k.colsb[c] || k.colsb[3] % 4)
      throw std::logic_error("emulated AMX: TDPBF16PS on tiles of mismatched shapes (#UD)");
    for (int m = 0; m < k.rows[c]; ++m)
      for (int p = 0; p < k.colsb[3] / 4; ++p)
        for (int n = 0; n < k.colsb[c] / 4; ++n) {
          float acc;
          std::memcpy(&acc, s.data[c][m] + 4 * n, 4);
          for (int half = 0; half < 2; ++half)  // the even k of the pair, then the odd: two roundings
            acc = flushed(acc + widened(s.data[3][m] + 4 * p + 2 * half) * widened(s.data[b][p] + 4 * n + 2 * half));
          std::memcpy(s.data[c][m] + 4 * n, &acc, 4);
        }
  }
};

// ---- the tile program ---------------------------------------------------------------------------------------------

// the tiles configured for `rows` activation rows by `pairs` k pairs, unless the thread's tiles are already
// (`current`: the configuration loaded, -1 none): LDTILECFG takes time and zeroes every tile, so a run of panels of
// one shape loads it once
template <class Tiles>
void configure(int64_t& current, int64_t rows, int64_t pairs) {
  const int64_t key = rows * (kTilePairs + 1) + pairs;
  if (key != current) {
    Tiles::configure(config_for(rows, pairs));
    current = key;
  }
}

// rows [m0, m0 + rows) of Y's columns [v0 * 16, (v0 + cols) * 16) (clipped to N): K / 32 steps of one A tile
// against `cols` B tiles, then the C tiles through `out` into Y with the bias
template <class Tiles>
void panel(const uint32_t* x, const uint32_t* w, const float* bias, float* y, int64_t m0, int64_t rows, int64_t v0,
           int64_t cols, int64_t pairs, int64_t n_size, int64_t& configured) {
  alignas(64) float out[kCols][kTileRows][kLanes];
  const int64_t whole = pairs / kTilePairs * kTilePairs, tail = pairs - whole;
  const int64_t vector_stride = pairs * kLanes;  // uint32 per packed column vector
  const uint32_t* xs = x + m0 * pairs;
  auto step = [&](int64_t p) {  // k pairs [p, p + the configured pairs)
    Tiles::template load<3>(xs + p, pairs * 4);
    Tiles::template load<4>(w + v0 * vector_stride + p * kLanes, kLanes * 4);
    Tiles::template dot<0, 4>();
    if (cols > 1) {
      Tiles::template load<5>(w + (v0 + 1) * vector_stride + p * kLanes, kLanes * 4);
      Tiles::template dot<1, 5>();
    }
    if (cols > 2) {
      Tiles::template load<6>(w + (v0 + 2) * vector_stride + p * kLanes, kLanes * 4);
      Tiles::template dot<2, 6>();
    }
  };
  auto store = [&]() {
    Tiles::template store<0>(out[0], kLanes * 4);
    if (cols > 1) Tiles::template store<1>(out[1], kLanes * 4);
    if (cols > 2) Tiles::template store<2>(out[2], kLanes * 4);
  };
  configure<Tiles>(configured, rows, whole > 0 ? kTilePairs : tail);
  Tiles::template zero<0>();  // a configuration kept from the panel before holds that panel's sums
  Tiles::template zero<1>();
  Tiles::template zero<2>();
  if (whole > 0) {
    for (int64_t p = 0; p < whole; p += kTilePairs) step(p);
    if (tail > 0) {  // a new configuration zeroes the tiles: the sums so far wait in `out`
      store();
      configure<Tiles>(configured, rows, tail);
      Tiles::template load<0>(out[0], kLanes * 4);
      if (cols > 1) Tiles::template load<1>(out[1], kLanes * 4);
      if (cols > 2) Tiles::template load<2>(out[2], kLanes * 4);
    }
  }
  if (tail > 0) step(whole);
  store();
  for (int64_t j = 0; j < cols; ++j) {
    const int64_t n0 = (v0 + j) * kLanes, valid = std::min(kLanes, n_size - n0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < valid; ++c)
        y[(m0 + r) * n_size + n0 + c] = bias != nullptr ? out[j][r][c] + bias[n0 + c] : out[j][r][c];
  }
}

// every panel of Y: (column panels) x (row blocks of 16), panel-major; on the pool's threads for the CPU's tiles
template <class Tiles>
void gemm(const uint32_t* x, const uint32_t* w, const float* bias, float* y, int64_t m_size, int64_t pairs,
          int64_t n_size, int64_t vectors, bool threaded) {
  const int64_t panels = (vectors + kCols - 1) / kCols, row_blocks = (m_size + kTileRows - 1) / kTileRows;
  auto run = [&](int64_t first, int64_t last) {
    int64_t configured = -1;  // this thread's tile configuration, loaded by the first panel that needs it
    for (int64_t t = first; t < last; ++t) {
      const int64_t v0 = t / row_blocks * kCols, m0 = t % row_blocks * kTileRows;
      panel<Tiles>(x, w, bias, y, m0, std::min(kTileRows, m_size - m0), v0, std::min(kCols, vectors - v0), pairs,
                   n_size, configured);
    }
    Tiles::release();
  };
  if (!threaded) return run(0, panels * row_blocks);
  // a run of panels should stream at least ~64 KiB of weights, as in bf16_gemm.cpp
  const int64_t panel_bytes = kCols * pairs * kLanes * 4;
  specserve::parallel_for(0, panels * row_blocks, std::max<int64_t>(1, (64 * 1024) / std::max<int64_t>(1, panel_bytes)),
                          run);
}

// ---- availability -------------------------------------------------------------------------------------------------

constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

// "" where the CPU's tiles can run in this process, else why not (asked once: the permission is the process's)
const std::string& status() {
  static const std::string reason = []() -> std::string {
#ifndef SPECSERVE_AMX_BUILT
    return "built without AMX: the compiler is older than GCC 11 / Clang 12";
#endif
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22)))
      return "the CPU lacks AMX-TILE/AMX-BF16";
    if (!__builtin_cpu_supports("avx512bw")) return "the CPU lacks AVX512BW (the activations' conversion)";
    if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0)
      return std::string("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM: ") + std::strerror(errno) +
             ")";
    unsigned long granted = 0;
    if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &granted) != 0 || !(granted & (1ul << kXfeatureXtiledata)))
      return "Linux did not grant the AMX tile state (arch_prctl ARCH_GET_XCOMP_PERM)";
    return "";
  }();
  return reason;
}

std::string amx_status() { return status(); }

at::Tensor product(const at::Tensor& x, const at::Tensor& packed, int64_t n_size,
                   const std::optional<at::Tensor>& bias, bool emulated) {
  TORCH_CHECK(emulated || status().empty(), "amx_bf16_gemm: ", status());
  const auto p = specserve::PackedProduct::checked("amx_bf16_gemm", x, packed, n_size, bias);
  at::Tensor y = at::empty({p.m, p.n}, x.options());
  if (p.m == 0) return y;
  std::vector<uint32_t> pairs_x(static_cast<size_t>(p.m * p.pairs));
  if (emulated) {
    specserve::to_bf16_pairs_scalar(x.data_ptr<float>(), p.m, p.k, p.pairs, pairs_x.data());
    try {
      gemm<EmulatedTiles>(pairs_x.data(), p.weight, p.bias, y.data_ptr<float>(), p.m, p.pairs, p.n, p.vectors, false);
    } catch (const std::logic_error& error) {
      EmulatedTiles::release();
      TORCH_CHECK(false, error.what());
    }
  } else {
#ifdef SPECSERVE_AMX_BUILT
    specserve::to_bf16_pairs(x.data_ptr<float>(), p.m, p.k, p.pairs, pairs_x.data());
    gemm<HardwareTiles>(pairs_x.data(), p.weight, p.bias, y.data_ptr<float>(), p.m, p.pairs, p.n, p.vectors, true);
#endif
  }
  return y;
}

at::Tensor amx_bf16_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                         const std::optional<at::Tensor>& bias) {
  return product(x, packed, n, bias, false);
}

at::Tensor amx_bf16_gemm_emulated(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                                  const std::optional<at::Tensor>& bias) {
  return product(x, packed, n, bias, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specserve, m) {
  m.def("amx_bf16_gemm(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.impl("amx_bf16_gemm", c10::DispatchKey::CPU, TORCH_FN(amx_bf16_gemm));
  m.def("amx_bf16_gemm_emulated(Tensor x, Tensor packed, int n, Tensor? bias=None) -> Tensor");
  m.impl("amx_bf16_gemm_emulated", c10::DispatchKey::CPU, TORCH_FN(amx_bf16_gemm_emulated));
  m.def("amx_status() -> str", &amx_status);
}
