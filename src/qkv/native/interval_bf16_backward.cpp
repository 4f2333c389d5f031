// The fused bfloat16 backward of the CPU block engine for masks given as one key interval per
// query row (lo[i] <= key <= hi[i]), built at run time by qkv/native/build.py and called
// through the operator qkv::interval_bf16_backward (qkv/native/interval_bf16_backward.py).
//
// FlashAttention-2's backward (algorithm 2) from the forward's float32 output O and lse, with
// every score computed transposed (keys as rows), so that P^T and dS^T, the left operands of
// dV and dK, come out of the element-wise pass in the row-major layout the micro-kernel reads:
//   D_i = rowsum(dO_i * O_i) - dlse_i            float32, once per row
//   per 64-key block j, for each 64-query block i whose rows' intervals touch it:
//     S^T  = K_j Q_i^T                           bf16 micro-kernel (products_bf16.h: AMX or
//     dP^T = V_j dO_i^T                          AVX-512 BF16 by build), float32 out
//     P^T  = exp(scale * S^T - lse), 0 outside each query's own interval
//     dS^T = scale * P^T * (dP^T - D)
//   with a softcap c: P^T = exp(c tanh(scale S^T / c) - lse), dS^T times 1 - tanh^2 (the cap's slope);
//   a bias by diagonal joins the exponent (score_terms_bf16.h)
//     dV_j += P^T dO_i,  dK_j += dS^T Q_i         float32 accumulators of the key block
//     dQ_i^T += K_j^T dS^T                        float32 accumulator of the head (E x L)
// dK_j, dV_j are rounded to bfloat16 when their key block is done, dQ when the head is done.
// One task per (batch row, head), on OpenMP threads: every gradient element is written by one
// thread in a fixed order, so two runs give bitwise equal gradients.
//
// Shapes: q (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev), grad_out (N, H, L, Ev) bfloat16 with a
// contiguous last dim, E and Ev multiples of 32; out (N, H, L, Eo) float32 with Eo <= Ev (the
// missing columns count as zeros); lse (N, H, L) float32 (-inf for a row that sees no key);
// grad_lse empty or (N, H, L) float32; lo, hi (N | 1, L) int64. Returns dq (N, H, L, E),
// dk (N, H, S, E), dv (N, H, S, Ev) bfloat16.

// Only the headers it needs (see interval_bf16.cpp): at::vec for exp and the bf16 rounding,
// CPUBlas.h for oneDNN's micro-kernels; extern "C" entry points on raw pointers.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include "products_bf16.h"
#include "score_terms_bf16.h"

#include <omp.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

constexpr int64_t kBlock = 64;  // keys per key block, queries per query block, columns per panel
// query blocks per pass over one key block: dV and dK run with K = 512 queries per call
constexpr int64_t kRunBlocks = 8;
constexpr int64_t kRun = kRunBlocks * kBlock;
constexpr float kInf = std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The micro-kernel reads B (K x 64, K even) in the VNNI layout: row pairs interleaved, element
// (r, c) at (r / 2) * 128 + c * 2 + r % 2 (what cpublas::pack writes; `pack_matches` checks).
// The two packers below are the forward kernel's (interval_bf16.cpp), kept in this file so
// that its build hash covers everything it runs.

// Rows of x (T, D), row stride ld, as T_pad / 64 panels of x^T (D x 64) in VNNI: panel p at
// out + p * D * 64; a pair of head dims is one 32-bit word of a row, so each panel is a 32-bit
// transpose. Rows past T are zeros.
void pack_transposed(const BFloat16* x, int64_t ld, int64_t T, int64_t T_pad, int64_t D, BFloat16* out) {
  const int64_t words = D / 2;
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t t0 = 0; t0 < T_pad; t0 += kBlock) {
    uint32_t* panel = dst + t0 / kBlock * words * kBlock;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int64_t t = t0 + j;
      if (t >= T) {
        for (int64_t w = 0; w < words; ++w) panel[w * kBlock + j] = 0;
        continue;
      }
      const BFloat16* row = x + t * ld;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t pair;
        std::memcpy(&pair, row + 2 * w, sizeof(pair));
        panel[w * kBlock + j] = pair;
      }
    }
  }
}

// x (T, D), row stride ld, as D_pad / 64 column panels of T_pad x 64 in VNNI: panel c at
// out + c * T_pad * 64, rows t0.. (t0 even) at + t0 * 64, so any run of whole rows is one
// contiguous B. Missing rows and columns are zeros.
void pack_rows(const BFloat16* x, int64_t ld, int64_t T, int64_t D, int64_t T_pad, BFloat16* out) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x);
  uint16_t* dst = reinterpret_cast<uint16_t*>(out);
  for (int64_t c0 = 0; c0 < D; c0 += kBlock) {
    const int64_t cols = std::min(kBlock, D - c0);
    uint16_t* panel = dst + c0 / kBlock * T_pad * kBlock;
    for (int64_t t = 0; t < T_pad; t += 2) {
      uint16_t* pair = panel + t * kBlock;
      const uint16_t* a = src + t * ld + c0;
      const uint16_t* b = a + ld;
      if (t + 1 < T && cols == kBlock) {
        for (int64_t c = 0; c < kBlock; ++c) {
          pair[2 * c] = a[c];
          pair[2 * c + 1] = b[c];
        }
        continue;
      }
      for (int64_t c = 0; c < kBlock; ++c) {
        pair[2 * c] = t < T && c < cols ? a[c] : 0;
        pair[2 * c + 1] = t + 1 < T && c < cols ? b[c] : 0;
      }
    }
  }
}

// x (T, D), row stride ld, as x^T (D x T_pad) row-major, zeros past T: the A of dQ^T += K^T dS^T.
// 64 rows at a time, so that the rows being read stay in the first-level cache.
void transpose(const BFloat16* x, int64_t ld, int64_t T, int64_t T_pad, int64_t D, BFloat16* out) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(x);
  uint16_t* dst = reinterpret_cast<uint16_t*>(out);
  for (int64_t t0 = 0; t0 < T_pad; t0 += kBlock) {
    const int64_t rows = std::max<int64_t>(0, std::min(kBlock, T - t0));
    for (int64_t d = 0; d < D; ++d) {
      uint16_t* row = dst + d * T_pad + t0;
      for (int64_t t = 0; t < rows; ++t) row[t] = src[(t0 + t) * ld + d];
      for (int64_t t = rows; t < kBlock; ++t) row[t] = 0;
    }
  }
}

// sum_c g[c] * o[c] over c < D: one row's dO . O, float32
float row_dot(const BFloat16* g, const float* o, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < D; c += 16) {
    const __mmask16 m = D - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (D - c)) - 1u);
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, g + c));
    acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16)), _mm512_maskz_loadu_ps(m, o + c), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

// The element-wise pass of one key block against a run of `width` queries (a multiple of
// 64): from S^T and dP^T (64 x width float32, keys as rows, row stride width) to P^T and
// dS^T (bfloat16, row-major, row stride width) and dS^T in VNNI, one 64 x 64 panel per
// 64 queries (the B of dQ^T += K^T dS^T). `keys` rows are real (the rest are zeroed); query r
// sees key `key0 + c` when lo[r] <= key0 + c <= hi[r] (int32; padded rows see nothing).
void gradient_of_scores(const float* st, const float* dpt, int64_t keys, int64_t key0, int64_t width,
                        const int32_t* lo, const int32_t* hi, const float* lse, const float* delta, float scale,
                        const qkv_terms::Cap* cap, const float* bias_row, int64_t offset, const int32_t* pos,
                        const uint8_t* consecutive, BFloat16* pt, BFloat16* dst, BFloat16* dsv) {
  constexpr int64_t V = 16;  // floats per AVX-512 vector
  const __m512 vscale = _mm512_set1_ps(scale), zero = _mm512_setzero_ps(), one = _mm512_set1_ps(1.0f);
  // interleaves two rows of 16 bf16 (low and high halves of a vector) into VNNI pairs
  alignas(64) static const uint16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t c = 0; c < kBlock; c += 2) {
    for (int64_t r = 0; r < width; r += V) {
      const __m512i vlo = _mm512_loadu_si512(lo + r), vhi = _mm512_loadu_si512(hi + r);
      __m512 ds[2] = {zero, zero};
      for (int64_t u = 0; u < 2; ++u) {
        const int64_t row = c + u;
        BFloat16* p_out = pt + row * width + r;
        BFloat16* ds_out = dst + row * width + r;
        const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(key0 + row));
        const __mmask16 seen = row < keys ? _mm512_cmple_epi32_mask(vlo, key) & _mm512_cmpge_epi32_mask(vhi, key) : 0;
        if (!seen) {  // no query of these lanes sees this key (or it is past the last key): zeros
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_out), _mm256_setzero_si256());
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_out), _mm256_setzero_si256());
          continue;
        }
        const __m512 s = _mm512_loadu_ps(st + row * width + r), row_lse = _mm512_loadu_ps(lse + r);
        // the score's derivative in the raw product: scale, times 1 - tanh^2 under a softcap
        __m512 x, slope = vscale;
        if (cap != nullptr) {
          __m512 t;
          x = cap->apply(s, t);
          slope = _mm512_mul_ps(vscale, _mm512_fnmadd_ps(t, t, one));
        } else {
          x = _mm512_mul_ps(s, vscale);
        }
        if (bias_row != nullptr)  // the bias's own gradient is not asked for (Python checks)
          x = _mm512_add_ps(x, qkv_terms::Diagonals::load(bias_row, pos + r, consecutive[r / V] != 0, key0 + row - offset));
        x = _mm512_sub_ps(x, row_lse);
        const __m512 p = _mm512_maskz_mov_ps(seen, Vec(x).exp_u20());
        const __m512 dp = _mm512_sub_ps(_mm512_loadu_ps(dpt + row * width + r), _mm512_loadu_ps(delta + r));
        ds[u] = _mm512_mul_ps(_mm512_mul_ps(p, dp), slope);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p_out), (__m256i)_mm512_cvtneps_pbh(p));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(ds_out), (__m256i)_mm512_cvtneps_pbh(ds[u]));
      }
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(ds[1], ds[0]);  // rows c, c + 1 as halves
      BFloat16* panel = dsv + r / kBlock * kBlock * kBlock;
      _mm512_storeu_si512(panel + c * kBlock + 2 * (r % kBlock), _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// The same split of tasks over threads as at::parallel_for with grain 1: contiguous shares
// of ceil(tasks / threads), one per thread.
template <typename F>
bool parallel_tasks(int64_t tasks, int64_t num_threads, const F& body) {
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, tasks)), share = (tasks + threads - 1) / threads;
  bool failed = false;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1) reduction(|| : failed)
  for (int64_t t = 0; t < threads; ++t) {
    try {
      if (t * share < tasks) body(t * share, std::min(tasks, (t + 1) * share));
    } catch (...) {  // nothing may leave an OpenMP region or an extern "C" function
      failed = true;
    }
  }
  return !failed;
}

}  // namespace

// dq (N, H, L, E), dk (N, H, S, E), dv (N, H, S, Ev) bfloat16, contiguous, from q, k, v,
// grad_out given by their data and the strides of their first three dims (last dim
// contiguous), out (N, H, L, Eo) float32 with its three strides, lse (N, H, L) float32
// contiguous, grad_lse null or like lse, lo, hi (lo_rows x L) int64 contiguous; E, Ev positive
// multiples of 32, Eo <= Ev (Python checks all of it). Returns 0, or 1 when memory ran out.
extern "C" int qkv_interval_bf16_backward(const BFloat16* g_p, const int64_t* gs, const BFloat16* q_p, const int64_t* qs,
                                          const BFloat16* k_p, const int64_t* ks, const BFloat16* v_p, const int64_t* vs,
                                          const float* o_p, const int64_t* os, const float* lse_p, const float* dlse_p,
                                          const int64_t* lo_p, const int64_t* hi_p, int64_t lo_rows, int64_t N, int64_t H,
                                          int64_t L, int64_t E, int64_t S, int64_t Ev, int64_t Eo, double scale_,
                                          double softcap_, const float* diag_p, int64_t diag_heads, int64_t diag_length,
                                          int64_t diag_offset, const int64_t* pos_p, int64_t pos_rows, BFloat16* dq_p, BFloat16* dk_p, BFloat16* dv_p, int64_t num_threads) {
  if (N * H == 0 || S == 0 || L == 0) {
    std::fill(dq_p, dq_p + N * H * L * E, BFloat16(0.0f));
    std::fill(dk_p, dk_p + N * H * S * E, BFloat16(0.0f));
    std::fill(dv_p, dv_p + N * H * S * Ev, BFloat16(0.0f));
    return 0;
  }
  const bool per_batch = lo_rows > 1;
  const float scale = static_cast<float>(scale_);
  const qkv_terms::Cap softcap(scale, softcap_ > 0.0 ? scale_ / softcap_ : 0.0, static_cast<float>(softcap_));
  const qkv_terms::Cap* cap = softcap_ > 0.0 ? &softcap : nullptr;
  const qkv_terms::Diagonals diagonals{diag_p, diag_heads, diag_length, diag_offset};

  const int64_t L_pad = round_up(L, kBlock), S_pad = round_up(S, kBlock);
  const int64_t E64 = round_up(E, kBlock), Ev64 = round_up(Ev, kBlock);
  const int64_t q_blocks = L_pad / kBlock, k_blocks = S_pad / kBlock;

  const bool done = parallel_tasks(N * H, num_threads, [&](int64_t begin, int64_t end) {
    // this thread's buffers, reused from head to head
    std::vector<BFloat16> q_t(L_pad * E), q_rows(E64 * L_pad), g_t(L_pad * Ev), g_rows(Ev64 * L_pad), k_t(E * S_pad);
    std::vector<float> dq_t(E * L_pad), row_lse(L_pad), delta(L_pad), st(kBlock * kRun), dpt(kBlock * kRun);
    std::vector<float> dk_acc(kBlock * E64), dv_acc(kBlock * Ev64);
    std::vector<BFloat16> pt(kBlock * kRun), dst(kBlock * kRun), dsv(kBlock * kRun);
    std::vector<int32_t> row_lo(L_pad), row_hi(L_pad), block_first(q_blocks), block_last(q_blocks), row_pos(L_pad);
    std::vector<uint8_t> consecutive_(L_pad / 16);  // whether each 16 rows' positions are consecutive
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      const BFloat16* q_h = q_p + n * qs[0] + h * qs[1];
      const BFloat16* k_h = k_p + n * ks[0] + h * ks[1];
      const BFloat16* v_h = v_p + n * vs[0] + h * vs[1];
      const BFloat16* g_h = g_p + n * gs[0] + h * gs[1];
      const float* o_h = o_p + n * os[0] + h * os[1];
      const int64_t k_ld = ks[2], v_ld = vs[2];
      // the rows' intervals (clamped to the keys; padded rows see nothing) and each query
      // block's union of them
      const int64_t* lo_n = lo_p + (per_batch ? n * L : 0);
      const int64_t* hi_n = hi_p + (per_batch ? n * L : 0);
      std::fill(block_first.begin(), block_first.end(), static_cast<int32_t>(S));
      std::fill(block_last.begin(), block_last.end(), -1);
      for (int64_t i = 0; i < L_pad; ++i) {
        const int64_t a = i < L ? std::max<int64_t>(lo_n[i], 0) : 1;
        const int64_t b = i < L ? std::min<int64_t>(hi_n[i], S - 1) : 0;
        row_lo[i] = a <= b ? static_cast<int32_t>(a) : 1;
        row_hi[i] = a <= b ? static_cast<int32_t>(b) : 0;
        if (a <= b) {
          block_first[i / kBlock] = std::min<int32_t>(block_first[i / kBlock], static_cast<int32_t>(a));
          block_last[i / kBlock] = std::max<int32_t>(block_last[i / kBlock], static_cast<int32_t>(b));
        }
      }
      if (diag_p != nullptr) {  // the rows' positions; padded rows continue the last one's
        const int64_t* pos_n = pos_p + (pos_rows > 1 ? n * L : 0);
        for (int64_t i = 0; i < L_pad; ++i) row_pos[i] = static_cast<int32_t>(i < L ? pos_n[i] : pos_n[L - 1] + (i - L + 1));
        for (int64_t g = 0; g < L_pad / 16; ++g) consecutive_[g] = qkv_terms::consecutive16(row_pos.data() + 16 * g);
      }
      // lse (+inf where a row sees no key: exp gives 0) and D = rowsum(dO * O) - dlse
      const float* lse_h = lse_p + nh * L;
      for (int64_t i = 0; i < L_pad; ++i) {
        const bool real = i < L && row_lo[i] <= row_hi[i] && lse_h[i] != -kInf;
        row_lse[i] = real ? lse_h[i] : kInf;
        delta[i] = real ? row_dot(g_h + i * gs[2], o_h + i * os[2], Eo) -
                              (dlse_p != nullptr ? dlse_p[nh * L + i] : 0.0f)
                        : 0.0f;
      }
      pack_transposed(q_h, qs[2], L, L_pad, E, q_t.data());
      pack_rows(q_h, qs[2], L, E, L_pad, q_rows.data());
      pack_transposed(g_h, gs[2], L, L_pad, Ev, g_t.data());
      pack_rows(g_h, gs[2], L, Ev, L_pad, g_rows.data());
      transpose(k_h, k_ld, S, S_pad, E, k_t.data());
      std::fill(dq_t.begin(), dq_t.end(), 0.0f);

      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        const int64_t key0 = kb * kBlock, keys = std::min(kBlock, S - key0);
        std::fill(dk_acc.begin(), dk_acc.end(), 0.0f);
        std::fill(dv_acc.begin(), dv_acc.end(), 0.0f);
        bool touched = false;
        auto touches = [&](int64_t qb) { return block_first[qb] <= key0 + keys - 1 && block_last[qb] >= key0; };
        for (int64_t qb0 = 0; qb0 < q_blocks; ++qb0) {
          if (!touches(qb0)) continue;  // no row of this query block sees these keys
          // a run of up to kRunBlocks query blocks that all touch them, in one pass
          int64_t blocks = 1;
          while (blocks < kRunBlocks && qb0 + blocks < q_blocks && touches(qb0 + blocks)) ++blocks;
          touched = true;
          const int64_t r0 = qb0 * kBlock, width = blocks * kBlock;
          for (int64_t b = 0; b < blocks; ++b) {
            qkv_products::products(keys, E, k_ld, width, false, k_h + key0 * k_ld, q_t.data() + (qb0 + b) * E * kBlock,
                                   st.data() + b * kBlock);
            qkv_products::products(keys, Ev, v_ld, width, false, v_h + key0 * v_ld, g_t.data() + (qb0 + b) * Ev * kBlock,
                                   dpt.data() + b * kBlock);
          }
          gradient_of_scores(st.data(), dpt.data(), keys, key0, width, row_lo.data() + r0, row_hi.data() + r0,
                             row_lse.data() + r0, delta.data() + r0, scale, cap,
                             diag_p != nullptr ? diagonals.head(h) : nullptr, diagonals.offset, row_pos.data() + r0,
                             consecutive_.data() + r0 / 16, pt.data(), dst.data(), dsv.data());
          for (int64_t c = 0; c < Ev64 / kBlock; ++c)
            qkv_products::products(keys, width, width, Ev64, true, pt.data(), g_rows.data() + c * L_pad * kBlock + r0 * kBlock,
                                   dv_acc.data() + c * kBlock);
          for (int64_t c = 0; c < E64 / kBlock; ++c)
            qkv_products::products(keys, width, width, E64, true, dst.data(), q_rows.data() + c * L_pad * kBlock + r0 * kBlock,
                                   dk_acc.data() + c * kBlock);
          for (int64_t b = 0; b < blocks; ++b)
            for (int64_t e0 = 0; e0 < E; e0 += kBlock)
              qkv_products::products(std::min(kBlock, E - e0), kBlock, S_pad, L_pad, true, k_t.data() + e0 * S_pad + key0,
                                     dsv.data() + b * kBlock * kBlock, dq_t.data() + e0 * L_pad + r0 + b * kBlock);
          qb0 += blocks - 1;
        }
        BFloat16* dk_h = dk_p + (nh * S + key0) * E;
        BFloat16* dv_h = dv_p + (nh * S + key0) * Ev;
        for (int64_t c = 0; c < keys; ++c) {
          if (!touched) {
            std::fill(dk_h + c * E, dk_h + (c + 1) * E, BFloat16(0.0f));
            std::fill(dv_h + c * Ev, dv_h + (c + 1) * Ev, BFloat16(0.0f));
            continue;
          }
          at::vec::convert(dk_acc.data() + c * E64, dk_h + c * E, E);
          at::vec::convert(dv_acc.data() + c * Ev64, dv_h + c * Ev, Ev);
        }
      }
      BFloat16* dq_h = dq_p + nh * L * E;
      for (int64_t i0 = 0; i0 < L; i0 += kBlock)  // dQ = (dQ^T)^T, rounded once
        for (int64_t i = i0; i < std::min(L, i0 + kBlock); ++i)
          for (int64_t e = 0; e < E; ++e) dq_h[i * E + e] = BFloat16(dq_t[e * L_pad + i]);
    }
    qkv_products::release();
  });
  return done ? 0 : 1;
}

extern "C" int qkv_interval_bf16_backward_micro_kernel_available() { return cpublas::could_pack(at::kBFloat16); }

// Whether this file's VNNI layouts are what oneDNN packs on this machine, on a random (100, 64)
// matrix (a tail panel too), transposed panels and row panels.
extern "C" int qkv_interval_bf16_backward_pack_matches() {
  const int64_t T = 100, D = 64, T_pad = 128;
  // distinct small integers (exact in bf16), not random numbers: drawing from torch's global
  // generator here would shift the seeded stream of the program that loads the kernel
  std::vector<BFloat16> x(T * D);
  for (int64_t i = 0; i < T * D; ++i) x[i] = BFloat16(static_cast<float>((i + 1) * 37 % 255 - 127));
  const BFloat16* src = x.data();
  std::vector<BFloat16> ours(T_pad * D), theirs(T_pad * D), panel(T_pad * D, BFloat16(0.0f));
  auto same = [&]() { return std::memcmp(ours.data(), theirs.data(), ours.size() * sizeof(BFloat16)) == 0; };
  pack_transposed(src, D, T, T_pad, D, ours.data());
  for (int64_t t0 = 0; t0 < T_pad; t0 += kBlock) {
    std::fill(panel.begin(), panel.end(), BFloat16(0.0f));
    for (int64_t j = 0; j < kBlock && t0 + j < T; ++j)
      for (int64_t e = 0; e < D; ++e) panel[e * kBlock + j] = src[(t0 + j) * D + e];
    cpublas::pack(D, kBlock, kBlock, kBlock, at::kBFloat16, at::kBFloat16, panel.data(), theirs.data() + t0 / kBlock * D * kBlock);
  }
  if (!same()) return false;
  pack_rows(src, D, T, D, T_pad, ours.data());
  std::fill(panel.begin(), panel.end(), BFloat16(0.0f));
  std::copy(src, src + T * D, panel.begin());
  cpublas::pack(T_pad, kBlock, kBlock, kBlock, at::kBFloat16, at::kBFloat16, panel.data(), theirs.data());
  return same();
}

