// Vectors of float32 for qkv's kernels built per CPU tier (qkv/native/build.py): AVX-512 (16
// lanes) when __AVX512F__, AVX2 + FMA (8 lanes) when __AVX2__, plain C++ otherwise. Loads widen
// bfloat16 (uint16_t) to float32 in registers, a shift of the 16 bits. exp is a polynomial,
// the same in vector and scalar form up to rounding, so a score's exponential does not depend
// on where its vector starts. Included by decode.cpp and short_wide.cpp; its text is part of
// their builds' cache keys (`qkv.native.build.cache_key`).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- vectors of float32 -------------------------------------------------------------------

#if defined(__AVX512F__)
constexpr int W = 16;
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
inline vf lane0(float x) { return _mm512_castps128_ps512(_mm_set_ss(x)); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {  // 2^n for integral n in [-126, 127]
  __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_castsi512_ps(bits);
}
inline vf vzero_below(vf x, vf value, float limit) {  // value where x >= limit, else 0
  __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_GE_OQ);
  return _mm512_maskz_mov_ps(keep, value);
}
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vabs(vf x) { return _mm512_abs_ps(x); }
inline vf vsign_of(vf x, vf magnitude) {  // magnitude (>= 0) with x's sign bit
  __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign));
}
inline vf vpick_below(vf x, float limit, vf low, vf high) {  // low where x < limit, else high
  return _mm512_mask_mov_ps(high, _mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_LT_OQ), low);
}
#elif defined(__AVX2__)
constexpr int W = 8;
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline vf vload(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
inline vf lane0(float x) { return _mm256_castps128_ps256(_mm_set_ss(x)); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vpow2(vf n) {
  __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(bits);
}
inline vf vzero_below(vf x, vf value, float limit) {
  return _mm256_and_ps(_mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_GE_OQ), value);
}
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vabs(vf x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
inline vf vsign_of(vf x, vf magnitude) { return _mm256_or_ps(magnitude, _mm256_and_ps(x, _mm256_set1_ps(-0.0f))); }
inline vf vpick_below(vf x, float limit, vf low, vf high) {
  return _mm256_blendv_ps(high, low, _mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_LT_OQ));
}
#else
constexpr int W = 1;
using vf = float;
inline vf vzero() { return 0.0f; }
inline vf vset(float x) { return x; }
inline vf vload(const float* p) { return *p; }
inline vf vload(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline void vstore(float* p, vf x) { *p = x; }
inline vf lane0(float x) { return x; }
inline vf vfma(vf a, vf b, vf c) { return std::fma(a, b, c); }
inline vf vadd(vf a, vf b) { return a + b; }
inline vf vsub(vf a, vf b) { return a - b; }
inline vf vmul(vf a, vf b) { return a * b; }
inline vf vmax(vf a, vf b) { return std::max(a, b); }
inline float vsum(vf x) { return x; }
inline vf vround(vf x) { return std::nearbyint(x); }
inline vf vpow2(vf n) {
  uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}
inline vf vzero_below(vf x, vf value, float limit) { return x >= limit ? value : 0.0f; }
inline vf vdiv(vf a, vf b) { return a / b; }
inline vf vabs(vf x) { return std::fabs(x); }
inline vf vsign_of(vf x, vf magnitude) { return std::copysign(magnitude, x); }
inline vf vpick_below(vf x, float limit, vf low, vf high) { return x < limit ? low : high; }
#endif

// One float32 of either storage dtype.
inline float scalar(const float* p) { return *p; }
inline float scalar(const uint16_t* p) {
  uint32_t bits = static_cast<uint32_t>(*p) << 16;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

// exp(x) for x <= 0 (scores minus their running max): x = n ln2 + r, |r| <= ln2 / 2, e^r by
// its degree-6 Taylor polynomial (relative error < 2e-7 on that range), times 2^n. Below
// -87.3 (2^-126, the smallest normal float) it gives 0, and so for -inf (a hidden key).
constexpr float kLimit = -87.3f;
inline vf vexp(vf x) {
  vf safe = vmax(x, vset(kLimit));
  vf n = vround(vmul(safe, vset(1.44269504088896341f)));
  vf r = vsub(vsub(safe, vmul(n, vset(0.693145751953125f))), vmul(n, vset(1.428606765330187045e-6f)));
  vf p = vset(1.0f / 720.0f);
  p = vfma(p, r, vset(1.0f / 120.0f));
  p = vfma(p, r, vset(1.0f / 24.0f));
  p = vfma(p, r, vset(1.0f / 6.0f));
  p = vfma(p, r, vset(0.5f));
  p = vfma(p, r, vset(1.0f));
  p = vfma(p, r, vset(1.0f));
  return vzero_below(x, vmul(p, vpow2(n)), kLimit);
}

// n rounded up to whole vectors.
inline int round_up(int n) { return (n + W - 1) / W * W; }

// The largest of s[0..n) (s holds -inf up to round_up(n)).
inline float row_max(const float* s, int n) {
  vf top = vset(kNegInf);
  for (int j = 0; j < n; j += W) top = vmax(top, vload(s + j));
  float lanes[W];
  vstore(lanes, top);
  float best = kNegInf;
  for (int i = 0; i < W; ++i) best = std::max(best, lanes[i]);
  return best;
}

// s[j] = exp(s[j] - shift) for j < round_up(n) (s holds -inf past n); returns the sum of s[0..n)
// (the vectors' tail adds zeros). One vector code for every position.
inline float exp_sum(float* s, int n, float shift) {
  vf total = vzero(), by = vset(shift);
  for (int j = 0; j < n; j += W) {
    vf p = vexp(vsub(vload(s + j), by));
    vstore(s + j, p);
    total = vadd(total, p);
  }
  return vsum(total);
}

}  // namespace
