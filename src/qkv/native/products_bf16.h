// The bf16 x bf16 -> float32 matrix products of the fused interval kernels (interval_bf16.cpp
// and interval_bf16_backward.cpp), in one shape: C (M x 64, row stride ldc) = A B, or C += A B
// with `add`, where A is M x K bfloat16 row-major (row stride lda) and B is K x 64 in the VNNI
// layout (rows paired: the 32-bit word w * 64 + j holds B[2w][j] and B[2w + 1][j]); K is even.
//
// Two builds of one source (qkv/native/interval_bf16.py chooses by the CPU tier):
// - amx: oneDNN's micro-kernel (at::native::cpublas::brgemm), which runs on the AMX tiles;
// - avx512 (QKV_DPBF16_PRODUCTS): our own micro-kernel on AVX-512 BF16's vdpbf16ps, for CPUs
//   with AVX-512 BF16 but no AMX (AMD Zen 4 and 5, Intel Cooper Lake), where PyTorch's oneDNN
//   offers no bf16 micro-kernel (cpublas::could_pack is false) and its flash kernel reaches a
//   fifth of the bf16 matrix-multiply rate. Both compute every bf16 x bf16 product exactly in
//   float32 and sum in float32 with denormal inputs and results flushed to zero; the two
//   products of a pair may be added in another order, so the builds agree to float32
//   rounding, not bit for bit (each is deterministic).
#pragma once

#include <ATen/native/CPUBlas.h>

#include <immintrin.h>

#include <cstdint>
#include <cstring>

// an anonymous namespace inside: each library keeps its own copy (the two builds differ)
namespace qkv_products {
namespace {

using at::BFloat16;

#if defined(QKV_DPBF16_PRODUCTS)

// R rows of A against all of B: R x 4 accumulators of 16 columns (R = 6 keeps 24 of the 32
// vector registers for them, 4 for B's words and one for A's broadcast pair).
template <int R>
inline void rows_times_b(int64_t K, int64_t lda, int64_t ldc, bool add, const BFloat16* A, const BFloat16* B, float* C) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) acc[r][x] = add ? _mm512_loadu_ps(C + r * ldc + 16 * x) : _mm512_setzero_ps();
  const char* b = reinterpret_cast<const char*>(B);
  for (int64_t w = 0; w < K / 2; ++w) {
    __m512bh bw[4];
    for (int x = 0; x < 4; ++x) bw[x] = (__m512bh)_mm512_loadu_si512(b + (w * 64 + 16 * x) * 4);
    for (int r = 0; r < R; ++r) {
      int32_t pair;  // A[r][2w], A[r][2w + 1] as one word (memcpy: lda may be odd)
      std::memcpy(&pair, A + r * lda + 2 * w, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int x = 0; x < 4; ++x) acc[r][x] = _mm512_dpbf16_ps(acc[r][x], a, bw[x]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < 4; ++x) _mm512_storeu_ps(C + r * ldc + 16 * x, acc[r][x]);
}

inline void products(int64_t M, int64_t K, int64_t lda, int64_t ldc, bool add, const BFloat16* A, const BFloat16* B, float* C) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) rows_times_b<6>(K, lda, ldc, add, A + i * lda, B, C + i * ldc);
  const BFloat16* a = A + i * lda;
  float* c = C + i * ldc;
  switch (M - i) {
    case 5: rows_times_b<5>(K, lda, ldc, add, a, B, c); break;
    case 4: rows_times_b<4>(K, lda, ldc, add, a, B, c); break;
    case 3: rows_times_b<3>(K, lda, ldc, add, a, B, c); break;
    case 2: rows_times_b<2>(K, lda, ldc, add, a, B, c); break;
    case 1: rows_times_b<1>(K, lda, ldc, add, a, B, c); break;
    default: break;
  }
}

inline void release() {}

#else

inline void products(int64_t M, int64_t K, int64_t lda, int64_t ldc, bool add, const BFloat16* A, const BFloat16* B, float* C) {
  at::native::cpublas::brgemm(M, 64, K, lda, 64, ldc, add, A, B, C);
}

// the AMX tile configuration oneDNN left on this thread
inline void release() { at::native::cpublas::brgemm_release(); }

#endif

}  // namespace
}  // namespace qkv_products
