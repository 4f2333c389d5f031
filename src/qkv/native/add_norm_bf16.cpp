// Residual add + LayerNorm for a float32 residual stream fed by bfloat16 sublayers, built at
// run time by qkv/kernels/add_norm_bf16.py.
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

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;      // float32 lanes of one AVX-512 vector
constexpr int64_t kRowsPerTask = 8;  // at::parallel_for grain: rows of 384-1024 floats each

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << remaining) - 1u);
}

// 16 bfloat16 values (masked) widened to float32: a bfloat16 is the top half of a float32
inline __m512 load_bf16(const at::BFloat16* p, __mmask16 m) {
  __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One row of LayerNorm in float64, from its float32 sums: for rows whose float32 statistics
// overflow (|x - mean| beyond ~1.8e19 squares to inf), which would otherwise come out as the
// bias alone, finite and wrong. A row holding inf or NaN still comes out NaN, as in eager.
void normalize_row_in_double(const float* row, int64_t D, const float* g, const float* b, float epsilon, float* orow,
                             at::BFloat16* lrow) {
  double sum = 0.0;
  for (int64_t j = 0; j < D; ++j) sum += row[j];
  const double mean = sum / double(D);
  double squares = 0.0;
  for (int64_t j = 0; j < D; ++j) squares += (row[j] - mean) * (row[j] - mean);
  const double rstd = 1.0 / std::sqrt(squares / double(D) + double(epsilon));
  for (int64_t j = 0; j < D; ++j) {
    const float o = float((row[j] - mean) * rstd * g[j] + b[j]);
    orow[j] = o;
    lrow[j] = at::BFloat16(o);  // round to nearest even, as _mm512_cvtneps_pbh
  }
}

void add_layer_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma, const at::Tensor& beta,
                    double eps, at::Tensor& out, at::Tensor& low) {
  const int64_t D = x.size(-1);
  const int64_t R = D == 0 ? 0 : x.numel() / D;
  const float* xs = x.data_ptr<float>();
  const at::BFloat16* ys = y.data_ptr<at::BFloat16>();
  const float* g = gamma.data_ptr<float>();
  const float* b = beta.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::BFloat16* ls = low.data_ptr<at::BFloat16>();
  const float inv_d = 1.0f / float(D);
  const float epsilon = float(eps);
  at::parallel_for(0, R, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(D);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xs + r * D;
      const at::BFloat16* yr = ys + r * D;
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
      at::BFloat16* lrow = ls + r * D;
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
  });
}

void forward(const at::Tensor& x, const at::Tensor& y, const at::Tensor& gamma, const at::Tensor& beta, double eps,
             at::Tensor out, at::Tensor low) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && y.scalar_type() == at::kBFloat16, "x float32, y bfloat16");
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat, "gamma, beta float32");
  TORCH_CHECK(out.scalar_type() == at::kFloat && low.scalar_type() == at::kBFloat16, "out float32, low bfloat16");
  TORCH_CHECK(x.is_contiguous() && y.is_contiguous() && gamma.is_contiguous() && beta.is_contiguous() &&
                  out.is_contiguous() && low.is_contiguous(),
              "all tensors contiguous");
  TORCH_CHECK(x.sizes() == y.sizes() && x.sizes() == out.sizes() && x.sizes() == low.sizes(), "x, y, out, low of one shape");
  TORCH_CHECK(x.dim() >= 1 && gamma.numel() == x.size(-1) && beta.numel() == x.size(-1), "gamma, beta (D,)");
  add_layer_norm(x, y, gamma, beta, eps, out, low);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  // the GIL is released while it runs (an encoder's batches run in several Python threads)
  module.def("forward", &forward, "out = LayerNorm(x + y) float32 and low = bf16(out), written in place",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
