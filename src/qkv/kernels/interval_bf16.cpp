// The fused bfloat16 forward of the CPU block engine for masks given as one key interval per
// query row (lo[i] <= key <= hi[i]), built at run time by qkv/kernels/interval_bf16.py.
//
// Per (batch row, head, block of kBlockQ queries), over that block's keys only:
//   S = Q_blk K^T        one AMX micro-kernel call per 64 keys (cpublas::brgemm, float32 out)
//   online softmax       float32, vectorized; each row keeps only the keys of its own interval
//   O += P V             P rounded to bfloat16, one brgemm per 64 value columns
// then O / l and lse = m + log l (FlashAttention-2, algorithm 1, with its m_i, l_i, acc).
// Keys and values are first packed once per head into the VNNI panels that the micro-kernel
// reads (64 columns per panel, the widths oneDNN packs; written here directly, which is
// several times faster than a transpose plus cpublas::pack per panel, and checked against
// cpublas::pack by `pack_matches` before the module is used).
//
// Shapes: q (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev) bfloat16 with a contiguous last
// dim and E a multiple of 32; lo, hi (N | 1, L) int64; out (N, H, L, Ev) and lse (N, H, L)
// float32. A row with no visible key gets out = 0 and lse = -inf.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

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

constexpr int64_t kPanel = 64;       // keys (or value columns) per packed panel: oneDNN packs N <= 64
constexpr int64_t kBlockQ = 64;      // query rows per task: four 16-row AMX tiles
constexpr int64_t kChunkPanels = 8;  // key panels per softmax step: P V runs with K = 512 (11-15 % faster than 4, 1 thread)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// The micro-kernel reads B (K x 64, K even) in the VNNI layout: row pairs interleaved,
// element (r, c) at (r / 2) * 128 + c * 2 + r % 2 (what cpublas::pack writes here; the
// module's self-check compares the two, `pack_matches`).

// Keys of one head (S, E), row stride ld, as S_pad / 64 panels of K^T (E x 64) in VNNI:
// panel p at out + p * E * 64. With rows of K^T being head dims, a pair of them is one
// 32-bit word of a key row, so each panel is a 32-bit transpose. Missing keys are zeros.
void pack_keys(const BFloat16* k, int64_t ld, int64_t S, int64_t S_pad, int64_t E, BFloat16* out) {
  const int64_t words = E / 2;
  uint32_t* dst = reinterpret_cast<uint32_t*>(out);
  for (int64_t key0 = 0; key0 < S_pad; key0 += kPanel) {
    uint32_t* panel = dst + key0 / kPanel * words * kPanel;
    for (int64_t j = 0; j < kPanel; ++j) {
      const int64_t key = key0 + j;
      if (key >= S) {
        for (int64_t w = 0; w < words; ++w) panel[w * kPanel + j] = 0;
        continue;
      }
      const BFloat16* row = k + key * ld;
      for (int64_t w = 0; w < words; ++w) {
        uint32_t pair;
        std::memcpy(&pair, row + 2 * w, sizeof(pair));
        panel[w * kPanel + j] = pair;
      }
    }
  }
}

// Values of one head (S, Ev), row stride ld, as Ev_pad / 64 column panels of S_pad x 64 in
// VNNI: panel c at out + c * S_pad * 64, keys key0.. (key0 even) at + key0 * 64, so any run
// of whole 64-key pieces is one contiguous B. Missing keys and columns are zeros.
void pack_values(const BFloat16* v, int64_t ld, int64_t S, int64_t Ev, int64_t S_pad, BFloat16* out) {
  const uint16_t* src = reinterpret_cast<const uint16_t*>(v);
  uint16_t* dst = reinterpret_cast<uint16_t*>(out);
  for (int64_t c0 = 0; c0 < Ev; c0 += kPanel) {
    const int64_t cols = std::min(kPanel, Ev - c0);
    uint16_t* panel = dst + c0 / kPanel * S_pad * kPanel;
    for (int64_t key = 0; key < S_pad; key += 2) {
      uint16_t* pair = panel + key * kPanel;
      const uint16_t* a = src + key * ld + c0;
      const uint16_t* b = a + ld;
      if (key + 1 < S && cols == kPanel) {
        for (int64_t c = 0; c < kPanel; ++c) {
          pair[2 * c] = a[c];
          pair[2 * c + 1] = b[c];
        }
        continue;
      }
      for (int64_t c = 0; c < kPanel; ++c) {
        pair[2 * c] = key < S && c < cols ? a[c] : 0;
        pair[2 * c + 1] = key + 1 < S && c < cols ? b[c] : 0;
      }
    }
  }
}

// The lanes j..j+15 that lie in a..b-1, as a bit mask.
__mmask16 lanes(int64_t j, int64_t a, int64_t b) {
  const int64_t from = std::clamp<int64_t>(a - j, 0, 16), to = std::clamp<int64_t>(b - j, 0, 16);
  return static_cast<__mmask16>(((1u << to) - 1u) & ~((1u << from) - 1u));
}

// One softmax step of one row over a chunk of `width` keys (a multiple of 64) whose visible
// columns are a..b-1 (a < b): scores s (float32, unscaled) -> p (bfloat16, zero outside
// a..b-1), updating the running max m and sum l; returns the factor exp(m_old - m_new) by
// which the row's accumulator must be multiplied (0 when the row had seen no key yet).
float softmax_step(const float* s, BFloat16* p, int64_t width, int64_t a, int64_t b, float scale, float& m, float& l) {
  constexpr int64_t V = 16;  // floats per AVX-512 vector
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(kNegInf);
  const int64_t first = a / V * V, stop = round_up(b, V);  // the vectors that touch a..b-1
  __m512 vmax = ninf;
  for (int64_t j = first; j < stop; j += V) {
    __m512 x = _mm512_mul_ps(_mm512_loadu_ps(s + j), vscale);
    if (j < a || j + V > b) x = _mm512_mask_mov_ps(ninf, lanes(j, a, b), x);  // an edge vector
    vmax = _mm512_max_ps(vmax, x);
  }
  const float m_new = std::max(m, _mm512_reduce_max_ps(vmax));
  const Vec vm(m_new);
  const __m512 zero = _mm512_setzero_ps();
  __m512 vsum = zero;
  for (int64_t j = 0; j < width; j += 2 * V) {
    __m512 e[2] = {zero, zero};
    for (int64_t u = 0; u < 2; ++u) {
      const int64_t col = j + u * V;
      if (col + V <= first || col >= stop) continue;  // no visible key in these lanes
      const Vec x(_mm512_fmsub_ps(_mm512_loadu_ps(s + col), vscale, vm));
      e[u] = x.exp_u20();
      if (col < a || col + V > b) e[u] = _mm512_maskz_mov_ps(lanes(col, a, b), e[u]);
      vsum = _mm512_add_ps(vsum, e[u]);
    }
    _mm512_storeu_si512(p + j, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0]));  // round to nearest even
  }
  const float alpha = m == kNegInf ? 0.0f : std::exp(m - m_new);
  l = l * alpha + _mm512_reduce_add_ps(vsum);
  m = m_new;
  return alpha;
}

std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& lo, const at::Tensor& hi, double scale_) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (N, H, T, D)");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "q, k, v must be bfloat16");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "q, k, v need a contiguous last dim");
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), E = q.size(3);
  const int64_t S = k.size(2), Ev = v.size(3);
  TORCH_CHECK(k.size(0) == N && v.size(0) == N && k.size(1) == H && v.size(1) == H && v.size(2) == S && k.size(3) == E,
              "q, k, v shapes do not match");
  TORCH_CHECK(E % 32 == 0 && E > 0, "E must be a positive multiple of 32");
  TORCH_CHECK(lo.scalar_type() == at::kLong && hi.scalar_type() == at::kLong && lo.dim() == 2 && hi.sizes() == lo.sizes() &&
              lo.size(1) == L && (lo.size(0) == 1 || lo.size(0) == N), "lo, hi must be int64 (N | 1, L)");
  const at::Tensor lo_c = lo.contiguous(), hi_c = hi.contiguous();
  const int64_t* lo_p = lo_c.data_ptr<int64_t>();
  const int64_t* hi_p = hi_c.data_ptr<int64_t>();
  const bool per_batch = lo.size(0) > 1;
  const float scale = static_cast<float>(scale_);

  const int64_t S_pad = round_up(std::max<int64_t>(S, 1), kPanel);
  const int64_t Ev_pad = round_up(std::max<int64_t>(Ev, 1), kPanel);
  const int64_t panels = S_pad / kPanel, col_panels = Ev_pad / kPanel;
  auto opts = q.options();
  at::Tensor out = at::empty({N, H, L, Ev}, opts.dtype(at::kFloat));
  at::Tensor lse = at::empty({N, H, L}, opts.dtype(at::kFloat));
  if (N * H * L == 0) return {out, lse};
  at::Tensor k_packed = at::empty({N * H, panels * E * kPanel}, opts);
  at::Tensor v_packed = at::empty({N * H, col_panels * S_pad * kPanel}, opts);

  const BFloat16* q_p = q.const_data_ptr<BFloat16>();
  const BFloat16* k_p = k.const_data_ptr<BFloat16>();
  const BFloat16* v_p = v.const_data_ptr<BFloat16>();
  BFloat16* kp_p = k_packed.data_ptr<BFloat16>();
  BFloat16* vp_p = v_packed.data_ptr<BFloat16>();
  float* out_p = out.data_ptr<float>();
  float* lse_p = lse.data_ptr<float>();

  at::parallel_for(0, N * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nh = begin; nh < end; ++nh) {
      const int64_t n = nh / H, h = nh % H;
      pack_keys(k_p + n * k.stride(0) + h * k.stride(1), k.stride(2), S, S_pad, E, kp_p + nh * panels * E * kPanel);
      pack_values(v_p + n * v.stride(0) + h * v.stride(1), v.stride(2), S, Ev, S_pad, vp_p + nh * col_panels * S_pad * kPanel);
    }
  });

  const int64_t q_blocks = (L + kBlockQ - 1) / kBlockQ;
  constexpr int64_t kChunk = kChunkPanels * kPanel;
  at::parallel_for(0, N * H * q_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s(kBlockQ * kChunk), acc(kBlockQ * Ev_pad), m(kBlockQ), l(kBlockQ);
    std::vector<BFloat16> p(kBlockQ * kChunk);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / (H * q_blocks), h = (task / q_blocks) % H, r0 = (task % q_blocks) * kBlockQ;
      const int64_t rows = std::min(kBlockQ, L - r0);
      const int64_t* row_lo = lo_p + (per_batch ? n * L : 0) + r0;
      const int64_t* row_hi = hi_p + (per_batch ? n * L : 0) + r0;
      int64_t first = S, last = -1;  // the block's keys: the union of its rows' intervals
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t a = std::max<int64_t>(row_lo[r], 0), b = std::min<int64_t>(row_hi[r], S - 1);
        if (a <= b) {
          first = std::min(first, a);
          last = std::max(last, b);
        }
      }
      std::fill(m.begin(), m.end(), kNegInf);
      std::fill(l.begin(), l.end(), 0.0f);
      std::fill(acc.begin(), acc.end(), 0.0f);
      const BFloat16* q_blk = q_p + n * q.stride(0) + h * q.stride(1) + r0 * q.stride(2);
      const BFloat16* k_head = kp_p + (n * H + h) * panels * E * kPanel;
      const BFloat16* v_head = vp_p + (n * H + h) * col_panels * S_pad * kPanel;
      for (int64_t c0 = first / kPanel * kPanel; c0 <= last; c0 += kChunk) {
        const int64_t width = std::min(kChunk, round_up(last + 1, kPanel) - c0);
        for (int64_t j = 0; j < width; j += kPanel)
          cpublas::brgemm(rows, kPanel, E, q.stride(2), kPanel, width, false, q_blk, k_head + (c0 + j) / kPanel * E * kPanel,
                          s.data() + j);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t a = std::max<int64_t>(row_lo[r], c0) - c0;
          const int64_t b = std::min<int64_t>(std::min<int64_t>(row_hi[r], S - 1), c0 + width - 1) - c0 + 1;
          BFloat16* p_row = p.data() + r * width;
          if (a >= b) {  // this row sees none of the chunk's keys
            std::fill(p_row, p_row + width, BFloat16(0.0f));
            continue;
          }
          const bool seen = m[r] != kNegInf;  // else the accumulator row is still zero
          const float alpha = softmax_step(s.data() + r * width, p_row, width, a, b, scale, m[r], l[r]);
          if (seen && alpha != 1.0f) {
            float* row = acc.data() + r * Ev_pad;
            at::vec::map([alpha](Vec x) { return x * Vec(alpha); }, row, row, Ev_pad);
          }
        }
        for (int64_t c = 0; c < col_panels; ++c)
          cpublas::brgemm(rows, kPanel, width, width, kPanel, Ev_pad, true, p.data(),
                          v_head + c * S_pad * kPanel + c0 * kPanel, acc.data() + c * kPanel);
      }
      for (int64_t r = 0; r < rows; ++r) {
        float* dst = out_p + ((n * H + h) * L + r0 + r) * Ev;
        const float* row = acc.data() + r * Ev_pad;
        if (l[r] > 0.0f) {
          const float inv = 1.0f / l[r];
          at::vec::map([inv](Vec x) { return x * Vec(inv); }, dst, row, Ev);
          lse_p[(n * H + h) * L + r0 + r] = m[r] + std::log(l[r]);
        } else {
          std::fill(dst, dst + Ev, 0.0f);
          lse_p[(n * H + h) * L + r0 + r] = kNegInf;
        }
      }
    }
    cpublas::brgemm_release();
  });
  return {out, lse};
}

bool micro_kernel_available() { return cpublas::could_pack(at::kBFloat16); }

// Whether this file's VNNI layout is what oneDNN packs on this machine, on panels of keys
// and values of a random head (S = 100: a tail panel too).
bool pack_matches() {
  const int64_t S = 100, E = 64, S_pad = 128;
  const at::Tensor x = at::randn({S, E}).to(at::kBFloat16);
  const BFloat16* src = x.const_data_ptr<BFloat16>();
  std::vector<BFloat16> ours(S_pad * E), theirs(S_pad * E), panel(S_pad * E, BFloat16(0.0f));
  auto same = [&]() { return std::memcmp(ours.data(), theirs.data(), ours.size() * sizeof(BFloat16)) == 0; };
  pack_keys(src, E, S, S_pad, E, ours.data());  // K^T panels
  for (int64_t key0 = 0; key0 < S_pad; key0 += kPanel) {
    std::fill(panel.begin(), panel.end(), BFloat16(0.0f));
    for (int64_t j = 0; j < kPanel && key0 + j < S; ++j)
      for (int64_t e = 0; e < E; ++e) panel[e * kPanel + j] = src[(key0 + j) * E + e];
    cpublas::pack(E, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, panel.data(), theirs.data() + key0 / kPanel * E * kPanel);
  }
  if (!same()) return false;
  pack_values(src, E, S, E, S_pad, ours.data());  // V: one column panel of S_pad keys
  std::fill(panel.begin(), panel.end(), BFloat16(0.0f));
  std::copy(src, src + S * E, panel.begin());
  cpublas::pack(S_pad, kPanel, kPanel, kPanel, at::kBFloat16, at::kBFloat16, panel.data(), theirs.data());
  return same();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("forward", &forward, "fused bfloat16 interval attention forward: (out, lse)");
  module.def("micro_kernel_available", &micro_kernel_available, "whether oneDNN packs bfloat16 for brgemm here");
  module.def("pack_matches", &pack_matches, "whether this kernel's VNNI panels equal oneDNN's packing here");
}
