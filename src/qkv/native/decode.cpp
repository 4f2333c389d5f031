// The decode step (a few queries against a long key/value cache) at the memory read rate,
// built at run time by qkv/native/build.py for this machine's tier and called through the
// operator qkv::decode (qkv/native/decode.py).
//
// A decode step reads every key and value once and does little arithmetic per byte: the
// kernel's only job is to stream K and V at the rate memory delivers them. So:
//   - one task is one (batch row, KV head, split of the keys); the R = H / G query heads of
//     the group and their L queries (R*L rows) all take each K/V block while it is in cache;
//   - bfloat16 is widened to float32 in registers (a shift of the 16 bits), never copied;
//     products and sums are float32;
//   - scores of a block of kBlock keys, then an online softmax per row (running max m, sum l,
//     unnormalized output acc), rescaled once per block, not per key;
//   - every split keeps (m, l, acc) per row in the caller's scratch; the splits then merge in
//     a fixed order (split 0 first): the result depends on the split count, never on which
//     thread ran which task, so two runs at one split count give equal bits.
// Registers are blocked by up to kRows rows: a K vector is loaded once for all of them, a V
// vector once per row group, the products accumulate in registers.
//
// The same source is compiled per CPU tier: AVX-512 (16 float lanes) when __AVX512F__, AVX2 +
// FMA (8 lanes) when __AVX2__, plain C++ otherwise; with __AVX512BF16__ (the amx tier) the
// bf16 scores come from vdpbf16ps on the cache's bytes. exp is a polynomial (vectors.h), the same in
// vector and scalar form up to rounding: the score of a key always takes the same form, so
// results do not depend on where a block starts.
//
// Shapes (strides in elements, a contiguous last dim): q (N, H, L, E), k (N, G, S, E),
// v (N, G, S, Ev), same dtype (float32 or bfloat16). Keys start <= t < stop are read, in
// `splits` pieces of ceil((stop - start) / splits) keys; query l of batch row n sees key t
// when lo[n|0][l] <= t <= hi[n|0][l] (no bounds: all) and valid[n|0][t] (no valid: all).
// sinks (N | 1, H) float32 or null. softcap > 0: each score s becomes softcap * tanh(s / softcap)
// (0: none); then ALiBi's bias - slopes[h] * |qpos[n|0][l] - t| where slopes (H,) float32 is not
// null, qpos (N | 1, L) int64; then the mask (qkv's order of score terms). With a block table (N, table_stride) int64, k and v are pools
// (blocks, page, G, E | Ev) and key t of row n lies in block table[n][t / page] at t % page:
// the kernel reads the keys in the same blocks of kBlock positions either way, so a paged
// sequence gives the bits of the same keys in a contiguous cache. Outputs float32: out
// (N, H, L, Ev) contiguous, lse (N, H, L); scratch holds N*G*splits*R*L*(Ev + 2) floats.

#include <omp.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "vectors.h"

namespace {

constexpr int kBlock = 64;  // keys per block: scores kBlock x R*L floats stay in L1
constexpr int kRows = 8;    // rows per register block (8 accumulators + operands fit 16 AVX2 registers)

// bf16 values are read 2W at a time as two float vectors, the even-indexed values (the low
// halves of the 32-bit lanes, shifted up) and the odd ones (the high halves, masked): two
// cheap integer operations for 2W values, where widening W of them costs a cross-lane
// shuffle and a shift. The columns 0 .. paired(n) - 1 are then held in that order, per group
// of 2W: the W even columns, then the W odd ones (`interleave` restores the order).
template <typename T>
constexpr int paired(int n) {
  return std::is_same_v<T, uint16_t> && W > 1 ? n / (2 * W) * (2 * W) : 0;
}

inline void vload_pairs(const uint16_t* p, vf& even, vf& odd) {
#if defined(__AVX512F__)
  __m512i x = _mm512_loadu_si512(p);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
#elif defined(__AVX2__)
  __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
#else
  even = scalar(p);
  odd = scalar(p + 1);
#endif
}

// Columns 0 .. count - 1 of x from the paired order (per 2W: evens, then odds) to the natural
// one (inverse = false), or back (inverse = true).
inline void interleave(float* x, int count, bool inverse) {
  float tmp[2 * W];
  for (int e = 0; e < count; e += 2 * W) {
    for (int i = 0; i < W; ++i) {
      if (inverse) {
        tmp[i] = x[e + 2 * i];
        tmp[W + i] = x[e + 2 * i + 1];
      } else {
        tmp[2 * i] = x[e + i];
        tmp[2 * i + 1] = x[e + W + i];
      }
    }
    std::memcpy(x + e, tmp, sizeof tmp);
  }
}

// tanh(x) to float32 accuracy (within 3 units in the last place of the float64 value, for every
// finite or infinite x): odd, so it works on a = |x| and puts x's sign back. Below kTanhSmall,
// tanh(a) / a is a polynomial in a^2 (degree 5, fitted to relative error 8e-9 on [0, 0.625]), so
// tiny and subnormal x come back as themselves; above it, with t = e^(-2a) <= 0.29 from vexp
// (never an overflow: the argument is <= 0), tanh(a) = (1 - t) / (1 + t), where 1 - t loses no
// digits; for large a, t is too small to count (0 from a = 44) and the result is 1.
constexpr float kTanhSmall = 0.625f;
inline vf vtanh(vf x) {
  vf a = vabs(x);
  vf u = vmul(a, a);
  vf p = vset(-0.005659983964551926f);
  p = vfma(p, u, vset(0.020590983362462182f));
  p = vfma(p, u, vset(-0.05372106626197049f));
  p = vfma(p, u, vset(0.133311275095633f));
  p = vfma(p, u, vset(-0.3333326052530349f));
  p = vfma(p, u, vset(1.0f));
  vf small = vmul(a, p);
  vf t = vexp(vmul(a, vset(-2.0f)));
  vf large = vdiv(vsub(vset(1.0f), t), vadd(vset(1.0f), t));
  return vsign_of(x, vpick_below(a, kTanhSmall, small, large));
}

// s[j] = cap * tanh(s[j] / cap) for j < n (n a multiple of W): a score's softcap, before the
// bias and mask in qkv's order of score terms (qkv/scores.py).
inline void soft_cap(float* s, int n, float cap) {
  const vf c = vset(cap);
  for (int j = 0; j < n; j += W) vstore(s + j, vmul(c, vtanh(vdiv(vload(s + j), c))));
}

// Asks for the cache lines of `bytes` bytes from p (a key's or value's row) ahead of their use.
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// The sums of NR accumulators into scores[r * kBlock] (r < NR), times `scale`: four at a time
// by one transposed reduction (AVX-512: 9 shuffles and adds for four sums, where one
// _mm512_reduce_add_ps costs 8 for one; AVX2: 5 for four).
template <int NR>
inline void store_sums(const vf* acc, float* scores, float scale) {
  int r = 0;
#if defined(__AVX512F__)
  for (; r + 4 <= NR; r += 4) {
    __m512 t0 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r], acc[r + 1], 0x44), _mm512_shuffle_f32x4(acc[r], acc[r + 1], 0xEE));
    __m512 t1 = _mm512_add_ps(_mm512_shuffle_f32x4(acc[r + 2], acc[r + 3], 0x44), _mm512_shuffle_f32x4(acc[r + 2], acc[r + 3], 0xEE));
    // quarters: t0 = [a0, a0, a1, a1], t1 = [a2, a2, a3, a3] (halves of each row's sum)
    __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t0, t1, 0x88), _mm512_shuffle_f32x4(t0, t1, 0xDD));
    // quarter i holds row r + i's four partial sums
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
    u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
    alignas(64) float lanes[16];
    _mm512_store_ps(lanes, u);
    for (int i = 0; i < 4; ++i) scores[(r + i) * kBlock] = lanes[4 * i] * scale;
  }
#elif defined(__AVX2__)
  for (; r + 4 <= NR; r += 4) {  // three hadds and one add for four sums
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[r], acc[r + 1]), _mm256_hadd_ps(acc[r + 2], acc[r + 3]));
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));  // rows r .. r + 3
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, sums);
    for (int i = 0; i < 4; ++i) scores[(r + i) * kBlock] = lanes[i] * scale;
  }
#endif
  for (; r < NR; ++r) scores[r * kBlock] = vsum(acc[r]) * scale;
}

// The rows of a block's keys (or values), row j at [j]: a cache's, `step` apart (the compiler
// sees one stride, as before paging existed), or a paged pool's, one pointer per key.
template <typename T>
struct Strided {
  const T* base;
  int64_t step;
  const T* operator[](int64_t j) const { return base + j * step; }
};
template <typename T>
struct Listed {
  const T* const* rows;
  const T* operator[](int64_t j) const { return rows[j]; }
};

// scores[r * kBlock + j] = q_r . k_j for the NR rows q (rows `q_stride` apart, E floats
// padded with zeros to a multiple of W) and the keys k[0]..k[n-1] (`Strided` or `Listed`). With `ahead` > 0, the keys and
// values k[n..n+ahead), v[n..n+ahead) are prefetched, key by key (without it the value pass,
// which walks the block's rows column by column, waits on memory: one thread, bf16, R = 4,
// E = 128, 256k keys, loaded machine: 175 ns a key without, 91 with).
template <int NR, typename T, typename A>
void score_rows(const float* q, int64_t q_stride, A k, int n, int E, float* scores, A v, int Ev, int ahead) {
  const int body = E / W * W;
  for (int j = 0; j < n; ++j) {
    const T* key = k[j];
    if (j < ahead) {
      prefetch_row(k[n + j], E * static_cast<int64_t>(sizeof(T)));
      prefetch_row(v[n + j], Ev * static_cast<int64_t>(sizeof(T)));
    }
    vf acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = vzero();
    const int two = paired<T>(E);  // q's columns below it are in the paired order
    if constexpr (std::is_same_v<T, uint16_t>) {
      for (int e = 0; e < two; e += 2 * W) {
        vf even, odd;
        vload_pairs(key + e, even, odd);
        for (int r = 0; r < NR; ++r) {
          acc[r] = vfma(vload(q + r * q_stride + e), even, acc[r]);
          acc[r] = vfma(vload(q + r * q_stride + e + W), odd, acc[r]);
        }
      }
    }
    for (int e = two; e < body; e += W) {
      vf kv = vload(key + e);
      for (int r = 0; r < NR; ++r) acc[r] = vfma(vload(q + r * q_stride + e), kv, acc[r]);
    }
    if (body < E) {  // the head dim's last values: into lane 0 (one scalar product each)
      for (int e = body; e < E; ++e) {
        float kv = scalar(key + e);
        for (int r = 0; r < NR; ++r) acc[r] = vadd(acc[r], lane0(q[r * q_stride + e] * kv));
      }
    }
    store_sums<NR>(acc, scores + j, 1.0f);
  }
}

// acc[r] += sum_j p[r * kBlock + j] v[j] for NR rows (acc rows `acc_stride` apart, Ev floats).
// Columns below paired<T>(Ev) are in the paired order (`vload_pairs`).
template <int NR, typename T, typename A>
void accumulate_rows(const float* p, A v, int n, int Ev, float* acc, int64_t acc_stride) {
  const int body = Ev / W * W, two = paired<T>(Ev);
  if constexpr (std::is_same_v<T, uint16_t>) {
    // 2 NR sums + 3 operands: AVX2's 16 registers take four rows at a time
    constexpr int kAt = W == 8 && NR > 4 ? 4 : NR;
    for (int r0 = 0; r0 < NR; r0 += kAt) {
      const int rows = std::min(kAt, NR - r0);
      for (int e = 0; e < two; e += 2 * W) {
        vf even[kAt], odd[kAt];
        for (int r = 0; r < kAt; ++r) {
          if (r < rows) {
            even[r] = vload(acc + (r0 + r) * acc_stride + e);
            odd[r] = vload(acc + (r0 + r) * acc_stride + e + W);
          }
        }
        for (int j = 0; j < n; ++j) {
          vf ve, vo;
          vload_pairs(v[j] + e, ve, vo);
          for (int r = 0; r < kAt; ++r) {
            if (r < rows) {
              vf w = vset(p[(r0 + r) * kBlock + j]);
              even[r] = vfma(w, ve, even[r]);
              odd[r] = vfma(w, vo, odd[r]);
            }
          }
        }
        for (int r = 0; r < kAt; ++r) {
          if (r < rows) {
            vstore(acc + (r0 + r) * acc_stride + e, even[r]);
            vstore(acc + (r0 + r) * acc_stride + e + W, odd[r]);
          }
        }
      }
    }
  }
  for (int e = two; e < body; e += W) {
    vf sum[NR];
    for (int r = 0; r < NR; ++r) sum[r] = vload(acc + r * acc_stride + e);
    for (int j = 0; j < n; ++j) {
      vf vv = vload(v[j] + e);
      for (int r = 0; r < NR; ++r) sum[r] = vfma(vset(p[r * kBlock + j]), vv, sum[r]);
    }
    for (int r = 0; r < NR; ++r) vstore(acc + r * acc_stride + e, sum[r]);
  }
  for (int e = body; e < Ev; ++e) {
    for (int r = 0; r < NR; ++r) {
      float s = acc[r * acc_stride + e];
      for (int j = 0; j < n; ++j) s += p[r * kBlock + j] * scalar(v[j] + e);
      acc[r * acc_stride + e] = s;
    }
  }
}

#if defined(__AVX512BF16__)
// bfloat16 scores with vdpbf16ps (AVX-512 BF16): pairs of bf16 products summed into float32
// lanes, straight from the cache's bytes (no widening); q rows are the unscaled bf16 inputs,
// zero-padded to a multiple of 32, and the scale multiplies the float32 sum. The products of
// two bf16 values are exact in float32, as in the widened path.
constexpr int kPair = 32;  // bf16 values per 512-bit vector
template <int NR, typename A>
void score_rows_bf16(const uint16_t* q, int64_t q_stride, A k, int n, int E, float scale, float* scores, A v, int Ev,
                     int ahead) {
  const int body = E / kPair * kPair;
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (E - body)) - 1);
  for (int j = 0; j < n; ++j) {
    const uint16_t* key = k[j];
    if (j < ahead) {
      prefetch_row(k[n + j], E * 2);
      prefetch_row(v[n + j], Ev * 2);
    }
    __m512 acc[NR];
    for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
    for (int e = 0; e < body; e += kPair) {
      __m512bh kv = (__m512bh)_mm512_loadu_si512(key + e);
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(q + r * q_stride + e), kv);
    }
    if (body < E) {
      __m512bh kv = (__m512bh)_mm512_maskz_loadu_epi16(tail, key + body);
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(q + r * q_stride + body), kv);
    }
    store_sums<NR>(acc, scores + j, scale);
  }
}

template <typename A>
void score_group_bf16(int rows, const uint16_t* q, int64_t qs, A k, int n, int E, float scale, float* s, A v, int Ev,
                      int ahead) {
  switch (rows) {
    case 1: return score_rows_bf16<1, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 2: return score_rows_bf16<2, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 3: return score_rows_bf16<3, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 4: return score_rows_bf16<4, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 5: return score_rows_bf16<5, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 6: return score_rows_bf16<6, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    case 7: return score_rows_bf16<7, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
    default: return score_rows_bf16<8, A>(q, qs, k, n, E, scale, s, v, Ev, ahead);
  }
}
constexpr bool kDotBf16 = true;
#else
constexpr bool kDotBf16 = false;
#endif

// The register-blocked kernels for a row group of `rows` <= kRows rows.
template <typename T, typename A>
void score_group(int rows, const float* q, int64_t qs, A k, int n, int E, float* s, A v, int Ev, int ahead) {
  switch (rows) {
    case 1: return score_rows<1, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 2: return score_rows<2, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 3: return score_rows<3, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 4: return score_rows<4, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 5: return score_rows<5, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 6: return score_rows<6, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    case 7: return score_rows<7, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
    default: return score_rows<8, T, A>(q, qs, k, n, E, s, v, Ev, ahead);
  }
}

template <typename T, typename A>
void accumulate_group(int rows, const float* p, A v, int n, int Ev, float* acc, int64_t as) {
  switch (rows) {
    case 1: return accumulate_rows<1, T, A>(p, v, n, Ev, acc, as);
    case 2: return accumulate_rows<2, T, A>(p, v, n, Ev, acc, as);
    case 3: return accumulate_rows<3, T, A>(p, v, n, Ev, acc, as);
    case 4: return accumulate_rows<4, T, A>(p, v, n, Ev, acc, as);
    case 5: return accumulate_rows<5, T, A>(p, v, n, Ev, acc, as);
    case 6: return accumulate_rows<6, T, A>(p, v, n, Ev, acc, as);
    case 7: return accumulate_rows<7, T, A>(p, v, n, Ev, acc, as);
    default: return accumulate_rows<8, T, A>(p, v, n, Ev, acc, as);
  }
}

// Where the keys (or values) of one (batch row, KV head) lie: key t at base + t * step, or,
// through a block table (a paged pool), at base + table[t / page] * block + (t % page) * step.
template <typename T>
struct Rows {
  const T* base;
  int64_t step, block, page;
  const int64_t* table;  // this batch row's blocks, or null

  // ptr[i] = the row of key first + i, for i < count, through the table (one division per
  // call, not per key); a cache's rows are `Strided` instead
  void fill(int64_t first, int count, const T** ptr) const {
    int64_t b = first / page, at = first % page;
    for (int i = 0; i < count; ++i) {
      ptr[i] = base + table[b] * block + at * step;
      if (++at == page) {
        at = 0;
        ++b;
      }
    }
  }
};

struct Problem {
  const void* q;
  const int64_t* qs;
  const void* k;
  const int64_t* ks;
  const void* v;
  const int64_t* vs;
  int64_t N, H, G, L, E, S, Ev;
  int64_t start, stop, splits;
  float scale;
  const int64_t* lo;  // (bound_rows, L) or null
  const int64_t* hi;
  int64_t bound_rows;
  const uint8_t* valid;  // (valid_rows, S) or null
  int64_t valid_rows;
  float* scratch;  // per task: m (RL), l (RL), acc (RL, Ev)
  float softcap;   // 0: none
  const int64_t* table;  // (N, table_stride) blocks of `page` keys, or null (k, v not paged)
  int64_t table_stride, page;
  const float* slopes;  // ALiBi: (H,) head slopes, or null
  const int64_t* qpos;  // (qpos_rows, L): each query's position among the keys (ALiBi's distances)
  int64_t qpos_rows;
};

// One task: keys [a, b) of (batch row n, KV head g); its state goes to `state`.
template <typename T>
void run_split(const Problem& P, int64_t n, int64_t g, int64_t a, int64_t b, float* state) {
  const int64_t R = P.H / P.G, L = P.L, RL = R * L, E = P.E, Ev = P.Ev;
  const int64_t Ep = (E + W - 1) / W * W;
  float* m = state;
  float* l = state + RL;
  float* acc = state + 2 * RL;
  std::fill(m, m + RL, kNegInf);
  std::fill(l, l + RL, 0.0f);
  std::fill(acc, acc + RL * Ev, 0.0f);
  // the group's query rows (row r*L + i: head g*R + r, query i), scaled, float32, zero-padded
  std::vector<float> qrows(RL * Ep, 0.0f), scores(RL * kBlock);  // kBlock is a multiple of W
  const T* q = static_cast<const T*>(P.q);
  constexpr bool dot = kDotBf16 && std::is_same_v<T, uint16_t>;
  const int64_t Ep2 = (E + 31) / 32 * 32;
  std::vector<uint16_t> qraw(dot ? RL * Ep2 : 0, 0);  // the bf16 rows as they are, for vdpbf16ps
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t i = 0; i < L; ++i) {
      const T* row = q + n * P.qs[0] + (g * R + r) * P.qs[1] + i * P.qs[2];
      for (int64_t e = 0; e < E; ++e) qrows[(r * L + i) * Ep + e] = scalar(row + e) * P.scale;
      if constexpr (dot) std::memcpy(qraw.data() + (r * L + i) * Ep2, row, E * sizeof(uint16_t));
      interleave(qrows.data() + (r * L + i) * Ep, paired<T>(static_cast<int>(E)), true);  // as the keys are read
    }
  }
  // each row's visible keys within [a, b): [first, last)
  std::vector<int64_t> first(RL, a), last(RL, b);
  if (P.lo != nullptr) {
    const int64_t br = P.bound_rows == 1 ? 0 : n;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t i = 0; i < L; ++i) {
        first[r * L + i] = std::max(a, P.lo[br * L + i]);
        last[r * L + i] = std::min(b, P.hi[br * L + i] + 1);
      }
    }
  }
  const uint8_t* valid = P.valid == nullptr ? nullptr : P.valid + (P.valid_rows == 1 ? 0 : n) * P.S;
  const bool masked = P.lo != nullptr || valid != nullptr;
  Rows<T> keys{}, values{};
  if (P.table == nullptr) {  // k (N, G, S, E), v (N, G, S, Ev)
    keys = {static_cast<const T*>(P.k) + n * P.ks[0] + g * P.ks[1], P.ks[2], 0, 1, nullptr};
    values = {static_cast<const T*>(P.v) + n * P.vs[0] + g * P.vs[1], P.vs[2], 0, 1, nullptr};
  } else {  // pools k (blocks, page, G, E), v (blocks, page, G, Ev)
    const int64_t* table = P.table + n * P.table_stride;
    keys = {static_cast<const T*>(P.k) + g * P.ks[2], P.ks[1], P.ks[0], P.page, table};
    values = {static_cast<const T*>(P.v) + g * P.vs[2], P.vs[1], P.vs[0], P.page, table};
  }
  // paged: the rows of this block's keys and values, then of the next block's first `ahead` (prefetched)
  const bool paged = P.table != nullptr;
  const T* krow[2 * kBlock];
  const T* vrow[2 * kBlock];
  const int64_t lowest = *std::min_element(first.begin(), first.end());
  const int64_t highest = *std::max_element(last.begin(), last.end());
  for (int64_t j0 = std::max(a, lowest); j0 < highest; j0 += kBlock) {
    const int cnt = static_cast<int>(std::min<int64_t>(kBlock, highest - j0));
    // the first row group prefetches the next block, key by key, as it reads this one
    const int ahead = static_cast<int>(std::clamp<int64_t>(highest - j0 - kBlock, 0, std::min<int64_t>(kBlock, cnt)));
    auto score = [&](auto kk, auto vv) {
      for (int64_t r0 = 0; r0 < RL; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, RL - r0));
#if defined(__AVX512BF16__)
        if constexpr (dot) {
          score_group_bf16(rows, qraw.data() + r0 * Ep2, Ep2, kk, cnt, static_cast<int>(E), P.scale,
                           scores.data() + r0 * kBlock, vv, static_cast<int>(Ev), r0 == 0 ? ahead : 0);
          continue;
        }
#endif
        score_group<T>(rows, qrows.data() + r0 * Ep, Ep, kk, cnt, static_cast<int>(E), scores.data() + r0 * kBlock, vv,
                       static_cast<int>(Ev), r0 == 0 ? ahead : 0);
      }
    };
    if (paged) {
      keys.fill(j0, cnt + ahead, krow);
      values.fill(j0, cnt + ahead, vrow);
      score(Listed<T>{krow}, Listed<T>{vrow});
    } else {
      score(Strided<T>{keys.base + j0 * keys.step, keys.step}, Strided<T>{values.base + j0 * values.step, values.step});
    }
    for (int64_t r = 0; r < RL; ++r) {
      float* s = scores.data() + r * kBlock;
      if (P.softcap > 0.0f) soft_cap(s, round_up(cnt), P.softcap);  // softcap first, then the bias, then the mask
      if (P.slopes != nullptr) {  // ALiBi: - slope_h * |p_i - t| (a distance below 2^24 is exact in float32)
        const float slope = P.slopes[g * R + r / L];
        const int64_t p = P.qpos[(P.qpos_rows == 1 ? 0 : n) * L + r % L];
        for (int j = 0; j < cnt; ++j) s[j] -= slope * static_cast<float>(std::llabs(p - (j0 + j)));
      }
      if (masked) {
        const int64_t lo = first[r] - j0, hi = last[r] - j0;  // visible: lo <= j < hi
        for (int j = 0; j < cnt; ++j) {
          if (j < lo || j >= hi || (valid != nullptr && !valid[j0 + j])) s[j] = kNegInf;
        }
      }
      for (int j = cnt; j < round_up(cnt); ++j) s[j] = kNegInf;  // the vectors' tail: no weight
      const float next = std::max(m[r], row_max(s, cnt));
      if (next == kNegInf) {  // nothing visible yet: no weight, no rescaling
        std::fill(s, s + cnt, 0.0f);
        continue;
      }
      const float total = exp_sum(s, cnt, next);
      if (next != m[r]) {
        float shrink = m[r] == kNegInf ? 0.0f : std::exp(m[r] - next);
        l[r] *= shrink;
        for (int64_t e = 0; e < Ev; ++e) acc[r * Ev + e] *= shrink;
        m[r] = next;
      }
      l[r] += total;
    }
    auto accumulate = [&](auto vv) {
      for (int64_t r0 = 0; r0 < RL; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, RL - r0));
        accumulate_group<T>(rows, scores.data() + r0 * kBlock, vv, cnt, static_cast<int>(Ev), acc + r0 * Ev, Ev);
      }
    };
    if (paged) {
      accumulate(Listed<T>{vrow});
    } else {
      accumulate(Strided<T>{values.base + j0 * values.step, values.step});
    }
  }
}

template <typename T>
void run_split_ordered(const Problem& P, int64_t n, int64_t g, int64_t a, int64_t b, float* state) {
  run_split<T>(P, n, g, a, b, state);
  const int64_t RL = P.H / P.G * P.L;
  for (int64_t r = 0; r < RL; ++r) interleave(state + 2 * RL + r * P.Ev, paired<T>(static_cast<int>(P.Ev)), false);
}

template <typename T>
void run_all(const Problem& P, const float* sinks, int64_t sink_rows, float* out, float* lse, int threads, int& failed) {
  const int64_t R = P.H / P.G, RL = R * P.L, Ev = P.Ev;
  const int64_t keys = P.stop - P.start;
  const int64_t chunk = keys > 0 ? (keys + P.splits - 1) / P.splits : 0;
  const int64_t tasks = P.N * P.G * P.splits, state = RL * (Ev + 2);
  // tasks are independent and each writes its own state: which thread runs which does not
  // change a bit of the result (dynamic: a thread slowed by the machine's load takes fewer)
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1) reduction(|| : failed)
  for (int64_t t = 0; t < tasks; ++t) {
    try {
      const int64_t c = t % P.splits, ng = t / P.splits;
      const int64_t a = std::min(P.stop, P.start + c * chunk), b = std::min(P.stop, a + chunk);
      run_split_ordered<T>(P, ng / P.G, ng % P.G, a, b, P.scratch + t * state);
    } catch (...) {  // nothing may leave an OpenMP region
      failed = 1;
    }
  }
  if (failed) return;
  // the merge, splits in order: M = max(max_c m_c, sink), den = sum_c e^(m_c - M) l_c + e^(sink - M);
  // on this thread: R*L rows of Ev values per (row, KV head), less than a thread's start-up
  for (int64_t ng = 0; ng < P.N * P.G; ++ng) {
    const int64_t n = ng / P.G, g = ng % P.G;
    const float* states = P.scratch + ng * P.splits * state;
    for (int64_t row = 0; row < RL; ++row) {
      const int64_t r = row / P.L, i = row % P.L, h = g * R + r;
      float* o = out + ((n * P.H + h) * P.L + i) * Ev;
      float top = kNegInf;
      for (int64_t c = 0; c < P.splits; ++c) top = std::max(top, states[c * state + row]);
      if (top == kNegInf) {  // no visible key: zeros and lse -inf, sink or not
        std::fill(o, o + Ev, 0.0f);
        lse[(n * P.H + h) * P.L + i] = kNegInf;
        continue;
      }
      const float sink = sinks == nullptr ? kNegInf : sinks[(sink_rows == 1 ? 0 : n) * P.H + h];
      const float big = std::max(top, sink);
      float den = sinks == nullptr ? 0.0f : std::exp(sink - big);
      std::fill(o, o + Ev, 0.0f);
      for (int64_t c = 0; c < P.splits; ++c) {
        const float* s = states + c * state;
        if (s[row] == kNegInf) continue;
        const float w = std::exp(s[row] - big);
        den += w * s[RL + row];
        const float* part = s + 2 * RL + row * Ev;
        for (int64_t e = 0; e < Ev; ++e) o[e] += w * part[e];
      }
      for (int64_t e = 0; e < Ev; ++e) o[e] /= den;
      lse[(n * P.H + h) * P.L + i] = big + std::log(den);
    }
  }
}

}  // namespace

// Status: 0 done, 1 a task failed (could not allocate), 2 unknown dtype.
extern "C" int qkv_decode_forward(const void* q, const int64_t* qs, const void* k, const int64_t* ks, const void* v,
                                  const int64_t* vs, int64_t bf16, int64_t N, int64_t H, int64_t G, int64_t L,
                                  int64_t E, int64_t S, int64_t Ev, int64_t start, int64_t stop, int64_t splits,
                                  double scale, const int64_t* lo, const int64_t* hi, int64_t bound_rows,
                                  const uint8_t* valid, int64_t valid_rows, const float* sinks, int64_t sink_rows,
                                  float* scratch, float* out, float* lse, int64_t threads, double softcap,
                                  const int64_t* table, int64_t table_stride, int64_t page, const float* slopes,
                                  const int64_t* qpos, int64_t qpos_rows) {
  Problem P{q, qs, k, ks, v, vs, N, H, G, L, E, S, Ev, start, stop, std::max<int64_t>(splits, 1),
            static_cast<float>(scale), lo, hi, bound_rows, valid, valid_rows, scratch,
            static_cast<float>(softcap), table, table_stride, std::max<int64_t>(page, 1), slopes, qpos, qpos_rows};
  int failed = 0;
  const int nthreads = static_cast<int>(std::max<int64_t>(threads, 1));
  if (bf16) {
    run_all<uint16_t>(P, sinks, sink_rows, out, lse, nthreads, failed);
  } else {
    run_all<float>(P, sinks, sink_rows, out, lse, nthreads, failed);
  }
  return failed ? 1 : 0;
}

// The vector width this build was compiled for, in float32 lanes (16 AVX-512, 8 AVX2, 1 plain).
extern "C" int qkv_decode_lanes() { return W; }

// y = tanh(x) for n values by the kernel's vtanh (the softcap's), W at a time and the last
// n % W one by one through a padded vector: for tests against torch.tanh.
extern "C" void qkv_decode_tanh(const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) vstore(y + i, vtanh(vload(x + i)));
  float pad[W];
  for (; i < n; ++i) {
    std::fill(pad, pad + W, 0.0f);
    pad[0] = x[i];
    vstore(pad, vtanh(vload(pad)));
    y[i] = pad[0];
  }
}
