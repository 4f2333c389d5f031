// Residual add + LayerNorm for a float32 residual stream fed by bfloat16 sublayers, built at
// run time by qkv/native/build.py and called through the operator qkv::add_norm_bf16
// (qkv/native/add_norm_bf16.py).
//
// A post-LN encoder block in mixed precision ends each sublayer with
//   x = LayerNorm(x + y)      x float32 (the residual stream), y bfloat16 (the sublayer)
//   x_low = bf16(x)           the next matrix product's input
// which eager PyTorch runs as four passes over (rows, D): y converted to float32, the sum,
// the LayerNorm, the cast. Here one pass per row: the sum is kept in a row buffer (float32),
// its mean, then a pass over the deviations from it that corrects the mean and gives the
// variance about it (the buffer is in cache; no E[x^2] - E[x]^2 cancellation), then
//   out[j] = (s[j] - mean) * rstd * gamma[j] + beta[j]     float32
//   low[j] = bf16(out[j])                                  round to nearest even
// D may be any size (the tail of a row is a masked vector).
//
// Shapes: x (R, D) float32, y (R, D) bfloat16, gamma, beta (D,) float32, all contiguous;
// out (R, D) float32 and low (R, D) bfloat16, written.

// No torch header at all (a cold build in a few seconds): bfloat16 is handled as its bits,
// the threads are OpenMP's, the entry point is extern "C" on raw pointers.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;      // float32 lanes of one AVX-512 vector
constexpr int64_t kRowsPerTask = 8;  // rows per share of a thread, at least: rows of 384-1024 floats each

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1u);
}

// bfloat16 as its 16 bits: the top half of a float32
using bf16_bits = uint16_t;

// x rounded to the nearest bfloat16, ties to even; a NaN stays a quiet NaN (as
// _mm512_cvtneps_pbh and c10::BFloat16 round)
inline bf16_bits round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return 0x7FC0;
  return static_cast<bf16_bits>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// 16 bfloat16 values (masked) widened to float32: a bfloat16 is the top half of a float32
inline __m512 load_bf16(const bf16_bits* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One row of LayerNorm in float64, from its float32 sums: for rows whose float32 statistics
// overflow (|x - mean| beyond ~1.8e19 squares to inf), which would otherwise come out as the
// bias alone, finite and wrong. A row holding inf or NaN still comes out NaN, as in eager.
void normalize_row_in_double(const float* row, int64_t D, const float* g, const float* b, float epsilon, float* orow,
                             bf16_bits* lrow) {
  double sum = 0.0;
  for (int64_t j = 0; j < D; ++j) sum += row[j];
  const double mean = sum / double(D);
  double squares = 0.0;
  for (int64_t j = 0; j < D; ++j) squares += (row[j] - mean) * (row[j] - mean);
  const double rstd = 1.0 / std::sqrt(squares / double(D) + double(epsilon));
  for (int64_t j = 0; j < D; ++j) {
    const float o = float((row[j] - mean) * rstd * g[j] + b[j]);
    orow[j] = o;
    lrow[j] = round_to_bf16(o);
  }
}

}  // namespace

// out = LayerNorm(x + y) (float32) and low = bf16(out) for R rows of D values: x, out float32,
// y, low bfloat16, gamma, beta (D,) float32, all contiguous (Python checks it). Runs on up to
// `threads` OpenMP threads, each a contiguous share of rows. Returns 0, or 1 when memory ran out.
extern "C" int qkv_add_norm_bf16(const float* xs, const bf16_bits* ys, const float* g, const float* b, int64_t R,
                                 int64_t D, double eps, float* os, bf16_bits* ls, int64_t num_threads) {
  if (R == 0 || D == 0) return 0;
  const float inv_d = 1.0f / float(D);
  const float epsilon = float(eps);
  // the split of at::parallel_for: at most one share per kRowsPerTask rows, contiguous shares
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, (R + kRowsPerTask - 1) / kRowsPerTask));
  const int64_t share = (R + threads - 1) / threads;
  bool failed = false;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1) reduction(|| : failed)
  for (int64_t worker = 0; worker < threads; ++worker) try {
    const int64_t begin = worker * share, end = std::min(R, begin + share);
    std::vector<float> row(D);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * D;
      const bf16_bits* yr = ys + r * D;
      __m512 total = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += kLanes) {
        __mmask16 m = tail_mask(D - j);
        __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, xr + j), load_bf16(yr + j, m));
        _mm512_mask_storeu_ps(row.data() + j, m, s);
        total = _mm512_add_ps(total, s);  // masked lanes are zero
      }
      // the mean of float32 sums carries their rounding (a row of values near 1e3); the pass
      // over the deviations corrects it (mean + their mean) and takes the variance about the
      // corrected mean: sum d^2 / D - (sum d / D)^2, the second term tiny
      const float rough = _mm512_reduce_add_ps(total) * inv_d;
      const __m512 rough_v = _mm512_set1_ps(rough);
      __m512 deviations = _mm512_setzero_ps();
      __m512 squares = _mm512_setzero_ps();
      for (int64_t j = 0; j < D; j += kLanes) {
        __mmask16 m = tail_mask(D - j);
        __m512 d = _mm512_maskz_sub_ps(m, _mm512_maskz_loadu_ps(m, row.data() + j), rough_v);
        deviations = _mm512_add_ps(deviations, d);
        squares = _mm512_add_ps(squares, _mm512_mul_ps(d, d));
      }
      const float shift = _mm512_reduce_add_ps(deviations) * inv_d;
      const float mean = rough + shift;
      const float variance = std::max(_mm512_reduce_add_ps(squares) * inv_d - shift * shift, 0.0f);
      float* orow = os + r * D;
      bf16_bits* lrow = ls + r * D;
      if (!std::isfinite(mean) || !std::isfinite(variance)) {
        normalize_row_in_double(row.data(), D, g, b, epsilon, orow, lrow);
        continue;
      }
      const float rstd = 1.0f / std::sqrt(variance + epsilon);
      const __m512 mean_v = _mm512_set1_ps(mean);
      const __m512 rstd_v = _mm512_set1_ps(rstd);
      for (int64_t j = 0; j < D; j += kLanes) {
        __mmask16 m = tail_mask(D - j);
        __m512 normed = _mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row.data() + j), mean_v), rstd_v);
        __m512 o = _mm512_add_ps(_mm512_mul_ps(normed, _mm512_maskz_loadu_ps(m, g + j)), _mm512_maskz_loadu_ps(m, b + j));
        _mm512_mask_storeu_ps(orow + j, m, o);
        __m256bh rounded = _mm512_cvtneps_pbh(o);  // round to nearest even, NaN stays NaN
        _mm256_mask_storeu_epi16(lrow + j, m, (__m256i)rounded);
      }
    }
  } catch (...) {  // nothing may leave an OpenMP region or an extern "C" function
    failed = true;
  }
  return failed ? 1 : 0;
}
