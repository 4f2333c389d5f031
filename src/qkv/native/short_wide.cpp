// Exact bfloat16 attention for short sequences on CPUs without bf16 products (AVX2 + FMA, or
// AVX-512 without AMX), built at run time by qkv/native/build.py per CPU tier and called
// through the operator qkv::short_wide (qkv/native/short_wide.py).
//
// There, PyTorch emulates bf16 products (hundreds of times slower than float32), so qkv
// computes bf16 requests in float32. Widening q, k and v to float32 copies first and calling
// PyTorch's CPU flash kernel costs a pass over memory for the copies and one for the rounding.
// This kernel reads the bf16 values themselves, widens them in registers (vectors.h) and keeps
// every product and sum in float32, rounding the output to bf16 once:
//   - one task is one (batch row, key/value head): the keys it may see (key padding leaves the
//     others out entirely) are packed once as float32, K^T in panels of W keys and V by rows,
//     for the R = H / G query heads that share them;
//   - per block of kRows query rows: s = q K^T in registers (kRows rows x kPanels panels of
//     accumulators), scaled, an exact softmax over the whole row (no online rescaling: S is
//     short), then out = (p V) / sum p, rounded to bf16 to nearest even.
// A row that sees no key gets out = 0 (docs/design.md). Each output row is computed by one
// thread in a fixed order, so the result does not depend on the thread count.
//
// Shapes: q (N, H, L, E), k (N, G, S, E), v (N, G, S, Ev) bfloat16, H % G == 0, each given by
// its data and the strides of its first three dims (last dim contiguous); key_valid (N | 1, S)
// bool or null (all keys visible); out (N, H, L, Ev) bfloat16 with its strides.

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "vectors.h"

namespace {

constexpr int kRows = 4;    // query rows per register block
constexpr int kPanels = 3;  // panels of W keys per register block: kRows x kPanels accumulators
constexpr int kColumns = 2; // vectors of W value columns per register block of the product p V

// float32 -> bfloat16, rounded to nearest even (inputs are finite: qkv's NaN rule runs outside).
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// The visible keys of one head, k (S, E) and v (S, Ev) with row strides kld and vld, as float32:
// keys[(p * E + e) * W + j] = k[key_p_j, e] for the j-th visible key of panel p (zeros past the
// last), values[t * Evp + c] = v[key_t, c] (zeros for c >= Ev).
void pack(const uint16_t* k, int64_t kld, const uint16_t* v, int64_t vld, const int32_t* visible, int count, int E,
          int Ev, int Evp, float* keys, float* values) {
  const int panels = (count + W - 1) / W;
  std::fill(keys, keys + static_cast<int64_t>(panels) * E * W, 0.0f);
  for (int t = 0; t < count; ++t) {
    const uint16_t* k_row = k + visible[t] * kld;
    float* panel = keys + static_cast<int64_t>(t / W) * E * W + t % W;
    for (int e = 0; e < E; ++e) panel[e * W] = scalar(k_row + e);
    const uint16_t* v_row = v + visible[t] * vld;
    float* dst = values + static_cast<int64_t>(t) * Evp;
    for (int c = 0; c < Ev; ++c) dst[c] = scalar(v_row + c);
    std::fill(dst + Ev, dst + Evp, 0.0f);
  }
}

// s[r * width + key] = sum_e q[r * E + e] * keys[..] for kRows rows and every panel.
template <int NP>
inline void score_panels(const float* q, int E, const float* keys, float* s, int width) {
  vf acc[kRows][NP];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NP; ++c) acc[r][c] = vzero();
  for (int e = 0; e < E; ++e) {
    vf key[NP];
    for (int c = 0; c < NP; ++c) key[c] = vload(keys + (static_cast<int64_t>(c) * E + e) * W);
    for (int r = 0; r < kRows; ++r) {
      const vf x = vset(q[r * E + e]);
      for (int c = 0; c < NP; ++c) acc[r][c] = vfma(x, key[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NP; ++c) vstore(s + r * width + c * W, acc[r][c]);
}

void scores(const float* q, int E, const float* keys, int panels, float* s, int width) {
  int p = 0;
  for (; p + kPanels <= panels; p += kPanels) score_panels<kPanels>(q, E, keys + static_cast<int64_t>(p) * E * W, s + p * W, width);
  for (; p < panels; ++p) score_panels<1>(q, E, keys + static_cast<int64_t>(p) * E * W, s + p * W, width);
}

// o[r * Evp + c0 + ..] = sum_t p[r * width + t] * values[t * Evp + c0 + ..] for kRows rows and NC vectors.
template <int NC>
inline void mix_columns(const float* p, int width, int count, const float* values, int Evp, int c0, float* o) {
  vf acc[kRows][NC];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = vzero();
  for (int t = 0; t < count; ++t) {
    vf value[NC];
    for (int c = 0; c < NC; ++c) value[c] = vload(values + static_cast<int64_t>(t) * Evp + c0 + c * W);
    for (int r = 0; r < kRows; ++r) {
      const vf weight = vset(p[r * width + t]);
      for (int c = 0; c < NC; ++c) acc[r][c] = vfma(weight, value[c], acc[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < NC; ++c) vstore(o + r * Evp + c0 + c * W, acc[r][c]);
}

}  // namespace

// Returns 0, or 1 when memory ran out. Python checks the arguments (qkv/native/short_wide.py).
extern "C" int qkv_short_wide_forward(const uint16_t* q_p, const int64_t* qs, const uint16_t* k_p, const int64_t* ks,
                                      const uint16_t* v_p, const int64_t* vs, const bool* valid_p, int64_t valid_rows,
                                      int64_t N, int64_t H, int64_t G, int64_t L, int64_t E, int64_t S, int64_t Ev,
                                      double scale_, uint16_t* out_p, const int64_t* outs, int64_t num_threads) {
  if (N * H * L == 0) return 0;
  const float scale = static_cast<float>(scale_);
  const int e_dim = static_cast<int>(E), ev_dim = static_cast<int>(Ev);
  const int Evp = (ev_dim + W - 1) / W * W, width = (static_cast<int>(S) + W - 1) / W * W;
  const int64_t group = H / G, tasks = N * G;
  const vf scaled = vset(scale);
  // contiguous shares of ceil(tasks / threads) tasks, one per worker
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, tasks));
  const int64_t share = (tasks + threads - 1) / threads;
  bool failed = false;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1) reduction(|| : failed)
  for (int64_t worker = 0; worker < threads; ++worker) {
    try {
      std::vector<float> keys(static_cast<int64_t>(width) * e_dim), values(static_cast<int64_t>(S) * Evp);
      std::vector<float> q_block(kRows * e_dim), s(kRows * width), o(kRows * Evp);
      std::vector<int32_t> visible(S);
      for (int64_t task = worker * share; task < std::min(tasks, (worker + 1) * share); ++task) {
        const int64_t n = task / G, g = task % G;
        int count = 0;
        for (int64_t t = 0; t < S; ++t)
          if (valid_p == nullptr || valid_p[(valid_rows > 1 ? n : 0) * S + t]) visible[count++] = static_cast<int32_t>(t);
        if (count == 0) {  // no visible key: every query row of this (batch row, head group) is zero
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            for (int64_t i = 0; i < L; ++i) {
              uint16_t* dst = out_p + n * outs[0] + h * outs[1] + i * outs[2];
              std::fill(dst, dst + Ev, static_cast<uint16_t>(0));
            }
          continue;
        }
        pack(k_p + n * ks[0] + g * ks[1], ks[2], v_p + n * vs[0] + g * vs[1], vs[2], visible.data(), count, e_dim, ev_dim,
             Evp, keys.data(), values.data());
        const int panels = (count + W - 1) / W;
        for (int64_t h = g * group; h < (g + 1) * group; ++h) {
          for (int64_t i0 = 0; i0 < L; i0 += kRows) {
            const int rows = static_cast<int>(std::min<int64_t>(kRows, L - i0));
            for (int r = 0; r < kRows; ++r) {  // the block's rows, zeros past the last
              const uint16_t* src = q_p + n * qs[0] + h * qs[1] + (i0 + r) * qs[2];
              for (int e = 0; e < e_dim; ++e) q_block[r * e_dim + e] = r < rows ? scalar(src + e) : 0.0f;
            }
            scores(q_block.data(), e_dim, keys.data(), panels, s.data(), width);
            float inverse[kRows];
            for (int r = 0; r < kRows; ++r) {  // p = exp(scale * s - max) over the visible keys, in place
              float* row = s.data() + r * width;
              // scaled after the product, as qkv's overflow check bounds it: scale * q may
              // overflow where scale * (q . k) does not
              for (int j = 0; j < panels * W; j += W) vstore(row + j, vmul(vload(row + j), scaled));
              std::fill(row + count, row + panels * W, kNegInf);  // the last panel's unused lanes
              const float top = row_max(row, count);
              inverse[r] = 1.0f / exp_sum(row, count, top);  // the max key gives exp(0) = 1: sum >= 1
            }
            int c0 = 0;
            for (; c0 + kColumns * W <= Evp; c0 += kColumns * W) mix_columns<kColumns>(s.data(), width, count, values.data(), Evp, c0, o.data());
            for (; c0 < Evp; c0 += W) mix_columns<1>(s.data(), width, count, values.data(), Evp, c0, o.data());
            for (int r = 0; r < rows; ++r) {  // out = o / sum, rounded to bf16 once
              uint16_t* dst = out_p + n * outs[0] + h * outs[1] + (i0 + r) * outs[2];
              for (int c = 0; c < ev_dim; ++c) dst[c] = to_bf16(o[r * Evp + c] * inverse[r]);
            }
          }
        }
      }
    } catch (...) {  // nothing may leave an OpenMP region or an extern "C" function
      failed = true;
    }
  }
  return failed ? 1 : 0;
}
