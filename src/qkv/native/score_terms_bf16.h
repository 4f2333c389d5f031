// The score terms the fused interval kernels apply (interval_bf16.cpp and its backward), in
// qkv.scores' order on a raw score s (a product q . k): u = s * scale, then a softcap,
// cap * tanh(u / cap) (Gemma 2's logit cap), then a bias that depends on the head and on the
// distance between query and key only (ALiBi, T5's relative buckets: `Bias.shift_invariant`),
// read from a table of its values per diagonal.
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <immintrin.h>

#include <cstdint>

namespace qkv_terms {

// below this |u / cap| tanh(x) rounds to x in float32 (x^3 / 3 is under half an ulp of x);
// there the capped score is u itself. This also covers a cap so large that scale / cap (or
// u / cap) is a denormal, which these kernels, running with denormals flushed, would take as 0.
constexpr float kIdentityBelow = 1.0f / 4096.0f;

struct Cap {
  __m512 scale, scale_over_cap, cap;
  Cap(float scale_, double scale_over_cap_, float cap_)
      : scale(_mm512_set1_ps(scale_)), scale_over_cap(_mm512_set1_ps(static_cast<float>(scale_over_cap_))), cap(_mm512_set1_ps(cap_)) {}

  // the capped score of raw scores s, and t = tanh(u / cap) (t = u / cap where that is below
  // kIdentityBelow: the backward's slope 1 - t^2 is then 1 to float32 precision)
  __m512 apply(__m512 s, __m512& t) const {
    const __m512 u = _mm512_mul_ps(s, scale), x = _mm512_mul_ps(s, scale_over_cap);
    t = __m512(at::vec::Vectorized<float>(x).tanh());
    const __mmask16 identity = _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(kIdentityBelow), _CMP_LT_OQ);
    return _mm512_mask_mov_ps(_mm512_mul_ps(t, cap), identity, u);
  }
};

// A bias by diagonal: head h's values at table + h * length, where the pair (query at key
// position p, key t) reads entry p - t + offset. Python sizes the table so that every pair a
// kernel reads (query blocks padded to 64 rows, key chunks to 32 keys) is inside it.
struct Diagonals {
  const float* table;  // (heads, length) float32, contiguous; null: no bias
  int64_t heads, length, offset;

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
