// Exact bfloat16 attention for short sequences on the CPU, built at run time by
// qkv/native/build.py and called through the operator qkv::short_bf16 (qkv/native/short_bf16.py).
//
// PyTorch's CPU flash kernel spends most of its time on a short sequence (a sentence of
// 20-110 tokens, head dim 32) in per-(batch row, head) set-up, not in products: 15-50 GFLOP/s.
// Here one task is one (batch row, key/value head): its keys and values are packed once into
// the pair-interleaved layout of the AMX bf16 product (B tiles of 16 pairs x 16 columns),
// then, per block of 16 query rows of each query head sharing them:
//   s = q K^T                  AMX, float32, 16 x 16 tiles over all S keys
//   p = exp(scale * s - max)   float32 AVX-512, an exact softmax over the whole row (no online
//                              rescaling: S is short), rounded to bf16 for the product below
//   out = (p V) / sum p        AMX, float32 accumulation, rounded to bf16 once
// Keys a batch row may not see (key padding) are left out of max and sum; a row that sees
// no key gets out = 0 (docs/design.md). q, k, v and out may have any strides with a contiguous
// last dim, so callers can pass views of a fused projection and write heads side by side.
// The tiles are programmed directly (_tile_* intrinsics, one fixed 16 x 64-byte shape):
// oneDNN's brgemm costs a dispatch per call, as much as the product itself at these sizes.
//
// Shapes: q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) bfloat16, H % G == 0; key_valid
// (N | 1, S) bool or an empty tensor (all keys visible); out (N, H, L, Ev) bfloat16.

// Only at::vec (for exp; header-only, no link to libtorch): a cold build in seconds, where
// torch/extension.h took over a minute. extern "C" entry points on raw pointers.
#include <ATen/cpu/vec/vec.h>

#include <omp.h>

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;

constexpr int64_t kLanes = 16;  // float32 lanes of an AVX-512 vector, columns of a tile
constexpr int64_t kTile = 16;   // rows of a tile: query rows per block
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Two bf16 values as one 32-bit word of a B tile (the first in the low half).
uint32_t pair_word(uint16_t low, uint16_t high) { return static_cast<uint32_t>(low) | (static_cast<uint32_t>(high) << 16); }

// Linux hands out the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), once per process; oneDNN asks too, and asking twice is harmless.
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

// K^T of one head (S, E), row stride ld, as `panels` panels of 16 keys in the pair layout
// of the AMX bf16 product's B tile: word (panel p, head-dim pair w, key j) at
// ((p * E2 + w) * 16 + j) holds k[16p + j, 2w], k[16p + j, 2w + 1], for E2 pairs (E padded).
// Keys beyond S and head dims beyond E are zeros.
void pack_keys(const uint16_t* k, int64_t ld, int64_t S, int64_t E, int64_t E2, int64_t panels, uint32_t* out) {
  for (int64_t p = 0; p < panels; ++p) {
    uint32_t* panel = out + p * E2 * kLanes;
    for (int64_t j = 0; j < kLanes; ++j) {
      const int64_t key = p * kLanes + j;
      const uint16_t* row = key < S ? k + key * ld : nullptr;
      for (int64_t w = 0; w < E2; ++w) {
        const uint16_t low = row && 2 * w < E ? row[2 * w] : 0, high = row && 2 * w + 1 < E ? row[2 * w + 1] : 0;
        panel[w * kLanes + j] = pair_word(low, high);
      }
    }
  }
}

// V of one head (S, Ev), row stride ld, by key pairs: word (key pair t, column vector c,
// lane) at ((t * C + c) * 16 + lane) holds v[2t, 16c + lane], v[2t + 1, 16c + lane], for
// T key pairs and C vectors of 16 columns. Missing keys and columns are zeros.
void pack_values(const uint16_t* v, int64_t ld, int64_t S, int64_t Ev, int64_t T, int64_t C, uint32_t* out) {
  for (int64_t t = 0; t < T; ++t) {
    const uint16_t* a = 2 * t < S ? v + 2 * t * ld : nullptr;
    const uint16_t* b = 2 * t + 1 < S ? v + (2 * t + 1) * ld : nullptr;
    uint32_t* dst = out + t * C * kLanes;
    for (int64_t col = 0; col < C * kLanes; ++col) {
      const uint16_t low = a && col < Ev ? a[col] : 0, high = b && col < Ev ? b[col] : 0;
      dst[col] = pair_word(low, high);
    }
  }
}

// The one tile shape this kernel uses: 16 rows of 64 bytes (A: 16 x 32 bf16; B: 16 pair-rows
// x 16 columns; C: 16 x 16 float32): tiles 0, 1 (C), 2, 3 (B), 4 (A). Two C tiles make two
// independent chains of products (one chain waits on each product's latency).
struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 5; ++t) {
    config.colsb[t] = 64;
    config.rows[t] = kTile;
  }
  _tile_loadconfig(&config);
}

// One block of 16 query rows (copied, zero-padded, into q: 16 x E_pad bf16) of one head against
// the packed keys and values; the first `rows` rows of out are written.
void attend_block(const uint16_t* q, int64_t E_pad, int64_t rows, int64_t panels, int64_t C, const uint32_t* keys,
                  const uint32_t* values, const __mmask16* visible, float scale, float* s, uint16_t* p, float* o,
                  BFloat16* out, int64_t out_ld, int64_t Ev) {
  const int64_t E2 = E_pad / 2, width = panels * kLanes;  // width: row stride of s and p (keys, a multiple of 32)
  for (int64_t panel = 0; panel < panels; panel += 2) {  // s = q K^T, 2 x 16 keys at a time (two chains)
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t e0 = 0; e0 < E_pad; e0 += 32) {
      _tile_loadd(4, q + e0, E_pad * 2);
      _tile_loadd(2, keys + (panel * E2 + e0 / 2) * kLanes, 64);
      _tile_loadd(3, keys + ((panel + 1) * E2 + e0 / 2) * kLanes, 64);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
    _tile_stored(0, s + panel * kLanes, width * 4);
    _tile_stored(1, s + (panel + 1) * kLanes, width * 4);
  }
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf), zero = _mm512_setzero_ps();
  float inv_sum[kTile];
  for (int64_t r = 0; r < rows; ++r) {  // p = exp(scale * s - max), over the visible keys only
    float* s_row = s + r * width;
    uint16_t* p_row = p + r * width;
    __m512 vmax = ninf;
    for (int64_t panel = 0; panel < panels; ++panel)
      vmax = _mm512_mask_max_ps(vmax, visible[panel], vmax, _mm512_mul_ps(_mm512_loadu_ps(s_row + panel * kLanes), vscale));
    const Vec vm(_mm512_reduce_max_ps(vmax));
    __m512 vsum = zero;
    for (int64_t panel = 0; panel < panels; ++panel) {
      // the product rounded as in the max pass (built with -ffp-contract=off): the max key
      // gets exp(0) = 1 whatever the scores' size (an fmsub keeps the product's rounding error)
      const Vec x(_mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(s_row + panel * kLanes), vscale), vm));
      const __m512 e = _mm512_maskz_mov_ps(visible[panel], x.exp_u20());
      vsum = _mm512_add_ps(vsum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_row + panel * kLanes), (__m256i)_mm512_cvtneps_pbh(e));
    }
    const float sum = _mm512_reduce_add_ps(vsum);
    inv_sum[r] = sum > 0.0f ? 1.0f / sum : 0.0f;  // 0: a row that sees no key
  }
  for (int64_t r = rows; r < kTile; ++r) std::memset(p + r * width, 0, width * 2);  // rows beyond L: finite zeros
  for (int64_t c = 0; c < C; c += 2) {  // o = p V, 2 x 16 value columns at a time (two chains)
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t key0 = 0; key0 < width; key0 += 32) {
      _tile_loadd(4, p + key0, width * 2);
      _tile_loadd(2, values + (key0 / 2 * C + c) * kLanes, C * 64);
      _tile_loadd(3, values + (key0 / 2 * C + c + 1) * kLanes, C * 64);
      _tile_dpbf16ps(0, 4, 2);
      _tile_dpbf16ps(1, 4, 3);
    }
    _tile_stored(0, o + c * kLanes, C * 64);
    _tile_stored(1, o + (c + 1) * kLanes, C * 64);
  }
  for (int64_t r = 0; r < rows; ++r) {  // out = o / sum, rounded to bf16 once
    const __m512 inv = _mm512_set1_ps(inv_sum[r]);
    for (int64_t c = 0; c * kLanes < Ev; ++c) {
      const int64_t cols = std::min(kLanes, Ev - c * kLanes);
      const __mmask16 keep = static_cast<__mmask16>((1u << cols) - 1u);
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + r * C * kLanes + c * kLanes), inv);
      _mm256_mask_storeu_epi16(out + r * out_ld + c * kLanes, keep, (__m256i)_mm512_cvtneps_pbh(x));
    }
  }
}

}  // namespace

// out (N, H, L, Ev) bfloat16 of q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) bfloat16, each
// given by its data and the strides of its first three dims (last dim contiguous); key_valid
// (valid_rows x S, contiguous, valid_rows 1 or N) or null for all keys; H a multiple of G,
// E, Ev >= 1 (Python checks all of it, and that the tiles are permitted). Returns 0, or 1
// when memory ran out.
extern "C" int qkv_short_bf16_forward(const uint16_t* q_p, const int64_t* qs, const uint16_t* k_p, const int64_t* ks,
                                      const uint16_t* v_p, const int64_t* vs, const bool* valid_p, int64_t valid_rows,
                                      int64_t N, int64_t H, int64_t G, int64_t L, int64_t E, int64_t S, int64_t Ev,
                                      double scale_, BFloat16* out_p, const int64_t* outs, int64_t num_threads) {
  if (N * H * L == 0) return 0;
  const bool masked = valid_p != nullptr;
  const float scale = static_cast<float>(scale_);
  // head dims padded to the tiles' 32, keys to 32 (the products' K step; an even number of
  // panels), value columns to 32 (an even number of 16-column vectors)
  const int64_t E_pad = round_up(E, 32), E2 = E_pad / 2;
  const int64_t panels = round_up(std::max<int64_t>(S, 1), 32) / kLanes, width = panels * kLanes;
  const int64_t T = width / 2, C = round_up(Ev, 2 * kLanes) / kLanes, group = H / G;  // C even: pairs of tiles

  // the split of at::parallel_for with grain 1: contiguous shares of ceil(tasks / threads)
  const int64_t tasks = N * G, threads = std::max<int64_t>(1, std::min(num_threads, tasks));
  const int64_t share = (tasks + threads - 1) / threads;
  bool failed = false;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1) reduction(|| : failed)
  for (int64_t worker = 0; worker < threads; ++worker) try {
    const int64_t begin = worker * share, end = std::min(tasks, begin + share);
    if (begin >= end) continue;
    configure_tiles();  // tile state is per thread
    std::vector<uint32_t> keys(panels * E2 * kLanes), values(T * C * kLanes);
    std::vector<uint16_t> q_block(kTile * E_pad, 0), p(kTile * width);
    std::vector<float> s(kTile * width), o(kTile * C * kLanes);
    std::vector<__mmask16> visible(panels);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / G, g = task % G;
      int64_t seen = 0;
      for (int64_t panel = 0; panel < panels; ++panel) {  // which of each panel's 16 keys this row may see
        uint32_t bits = 0;
        for (int64_t j = 0; j < kLanes; ++j) {
          const int64_t key = panel * kLanes + j;
          const bool ok = key < S && (!masked || valid_p[(valid_rows > 1 ? n : 0) * S + key]);
          bits |= static_cast<uint32_t>(ok) << j;
          seen += ok;
        }
        visible[panel] = static_cast<__mmask16>(bits);
      }
      if (seen == 0) {  // no visible key: every query row of this batch row is zero
        for (int64_t h = g * group; h < (g + 1) * group; ++h)
          for (int64_t i = 0; i < L; ++i) {
            BFloat16* dst = out_p + n * outs[0] + h * outs[1] + i * outs[2];
            std::fill(dst, dst + Ev, BFloat16(0.0f));
          }
        continue;
      }
      pack_keys(k_p + n * ks[0] + g * ks[1], ks[2], S, E, E2, panels, keys.data());
      pack_values(v_p + n * vs[0] + g * vs[1], vs[2], S, Ev, T, C, values.data());
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t i0 = 0; i0 < L; i0 += kTile) {
          const int64_t rows = std::min(kTile, L - i0);
          const uint16_t* q_rows = q_p + n * qs[0] + h * qs[1] + i0 * qs[2];
          for (int64_t r = 0; r < kTile; ++r) {  // the block's rows, zero-padded to E_pad and 16 rows
            uint16_t* dst = q_block.data() + r * E_pad;
            if (r < rows) std::memcpy(dst, q_rows + r * qs[2], E * 2);
            else std::memset(dst, 0, E * 2);
          }
          attend_block(q_block.data(), E_pad, rows, panels, C, keys.data(), values.data(), visible.data(), scale, s.data(),
                       p.data(), o.data(), out_p + n * outs[0] + h * outs[1] + i0 * outs[2], outs[2], Ev);
        }
      }
    }
    _tile_release();
  } catch (...) {  // nothing may leave an OpenMP region or an extern "C" function
    failed = true;
  }
  return failed ? 1 : 0;
}

extern "C" int qkv_short_bf16_tiles_permitted() { return tiles_permitted(); }
