// The score terms the fused interval kernels apply (interval_bf16.cpp and its backward), in
// qkv.scores' order on a raw score s (a product q . k): u = s * scale, then a softcap,
// cap * tanh(u / cap) (Gemma 2's logit cap), then a bias that depends on the head and on the
// distance between query and key only (ALiBi, T5's relative buckets: `Bias.shift_invariant`),
// read from a table of its values per diagonal.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace qkv_terms {

// tanh of 16 floats (finite), within about 2e-7 of it relative: below kPolynomialBelow an odd
// polynomial x (1 + z Q(z)), z = x^2, where 1 - e below would cancel; above it (1 - e) / (1 + e)
// with e = exp(-2 |x|) = 2^y, y = -2 |x| log2(e) <= 0, from 2^floor(y) (vscalefps) times 2^f,
// 0 <= f < 1, by a polynomial of degree 5; the sign is restored last. The coefficients are
// least-squares fits of our own on Chebyshev nodes (relative errors of the result in float32:
// 8e-8 for |x| in [0, 0.625], 2^f 1.6e-7 for f in [0, 1)). |x| is clamped at 9, where tanh
// rounds to 1, so that an infinite argument (a tiny cap) gives +-1. About a third of SLEEF's
// instructions (through at::vec, softcapped bf16 attention spent more time in tanh than in
// both products).
constexpr float kPolynomialBelow = 0.625f;

inline __m512 tanh_ps(__m512 x) {
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(x), _mm512_set1_ps(9.0f)), z = _mm512_mul_ps(a, a), one = _mm512_set1_ps(1.0f);
  __m512 q = _mm512_set1_ps(-5.704042501747608e-3f);
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(2.0637862384319305e-2f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(-5.373915657401085e-2f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(1.33314311504364e-1f));
  q = _mm512_fmadd_ps(q, z, _mm512_set1_ps(-3.333328068256378e-1f));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(a, z), q, a);
  const __m512 y = _mm512_mul_ps(a, _mm512_set1_ps(-2.0f * 1.4426950408889634f));
  const __m512 f = _mm512_reduce_ps(y, 0x09);  // y - floor(y): 0 fraction bits, round down, no exception
  __m512 p = _mm512_set1_ps(1.8762329127639532e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.99258442223072e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.582360550761223e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015453457832336e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931529641151428e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.999999403953552e-1f));
  const __m512 e = _mm512_scalef_ps(p, y);  // 2^f 2^floor(y); 0 once y is below the float range
  const __m512 large = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  const __m512 magnitude = _mm512_mask_mov_ps(large, _mm512_cmp_ps_mask(a, _mm512_set1_ps(kPolynomialBelow), _CMP_LT_OQ), small);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}

// below this |u / cap| tanh(x) rounds to x in float32 (x^3 / 3 is under half an ulp of x);
// there the capped score is u itself, exact: for a cap so large that scale / cap (or u / cap)
// is a denormal, cap * tanh(u / cap) would have lost u's digits (or all of them, where the
// CPU flushes denormals).
constexpr float kIdentityBelow = 1.0f / 4096.0f;

struct Cap {
  __m512 scale, scale_over_cap, cap;
  Cap(float scale_, double scale_over_cap_, float cap_)
      : scale(_mm512_set1_ps(scale_)), scale_over_cap(_mm512_set1_ps(static_cast<float>(scale_over_cap_))), cap(_mm512_set1_ps(cap_)) {}

  // the capped score of raw scores s, and t = tanh(u / cap) for the backward's slope 1 - t^2
  // (where |u / cap| < kIdentityBelow, 1 to float32 precision whatever t is)
  __m512 apply(__m512 s, __m512& t) const {
    const __m512 u = _mm512_mul_ps(s, scale), x = _mm512_mul_ps(s, scale_over_cap);
    t = tanh_ps(x);
    const __mmask16 identity = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(kIdentityBelow), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(_mm512_mul_ps(t, cap), identity, u);
  }
};

// A bias by diagonal: head h's values at table + h * length, where the pair (query at key
// position p, key t) reads entry p - t + offset. Python sizes the table so that every pair a
// kernel reads (query blocks padded to 64 rows, key chunks to 32 keys) is inside it.
struct Diagonals {
  const float* table;  // (heads, length) float32, contiguous; null: no bias
  int64_t heads, length, offset;  // offset: the entry of p - t = 0

  const float* head(int64_t h) const { return table + (heads > 1 ? h : 0) * length; }

  // the bias of 16 queries (positions p[0..15]) against key t of one head's table;
  // `consecutive`: p[i] = p[0] + i, so the 16 entries are one contiguous load
  static __m512 load(const float* row, const int32_t* p, bool consecutive, int64_t key_minus_offset) {
    if (consecutive) return _mm512_loadu_ps(row + (p[0] - key_minus_offset));
    const __m512i index = _mm512_sub_epi32(_mm512_loadu_si512(p), _mm512_set1_epi32(static_cast<int32_t>(key_minus_offset)));
    return _mm512_i32gather_ps(index, row, 4);
  }
};

// Whether p[0..15] are consecutive positions.
inline bool consecutive16(const int32_t* p) {
  const __m512i want = _mm512_add_epi32(_mm512_set1_epi32(p[0]), _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  return _mm512_cmpneq_epi32_mask(_mm512_loadu_si512(p), want) == 0;
}

}  // namespace qkv_terms
