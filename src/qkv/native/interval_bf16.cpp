// The fused bfloat16 forward of the CPU block engine for masks given as one key interval per
// query row (lo[i] <= key <= hi[i]), built at run time by qkv/native/build.py and called
// through the operator qkv::interval_bf16_forward (qkv/native/interval_bf16.py).
//
// Per (batch row, head, block of kBlockQ = 64 queries), over that block's keys only, in the
// transposed layout (keys as rows, the block's 64 queries as columns):
//   S^T = K Q^T          one micro-kernel call per chunk of keys (float32 out; products_bf16.h:
//                        AMX through cpublas::brgemm, or AVX-512 BF16 by build): A is K itself,
//                        B the block's queries packed once (VNNI)
//   softmax              float32, 16 queries per AVX-512 vector, so a row's max and sum live
//                        in lanes (no horizontal reductions); each lane keeps only its own keys
//   O^T += V^T P^T       P rounded to bfloat16 and written straight into the VNNI layout of
//                        the micro-kernel's B; V^T packed 64 keys at a time, when first needed,
//                        into a per-thread buffer (still in cache when used)
// then O / l and lse = m + log l (FlashAttention-2, algorithm 1, with its m_i, l_i, acc).
// A block whose keys span at most kOnePassKeys takes one exact softmax step (a max pass, then
// exp and sum) and never rescales its accumulator; a longer span is online in chunks of
// kChunkKeys. exp is exp2 of s * scale * log2(e) - m with m kept in base 2 (one FMA), by a
// degree-4 polynomial and vscalefps.
// Measured against the previous layout (scores per query row, one brgemm per 64 keys, K and V
// packed for the whole call), one thread, CPU time, interleaved, load 4: sliding_window(256,
// 256) n = 16,384 100 -> 72 ms, varlen causal (64 documents) 60 -> 50 ms, dense n = 4,096
// 162 -> 122 ms; the degree-4 exp2, four max accumulators and vectorized packing: a further
// 0-10 %; huge pages for the output and a vectorized log for lse: 15-20 % on the window and
// varlen problems (their 32 MiB output took one page fault per 4 KiB). Then (s5, one thread,
// interleaved, load 1-1.5, sliding_window n = 16,384): the output in bf16 when no backward
// reads it (16 instead of 32 MiB, no rounding copy), scratch buffers left uninitialized (V^T
// was 2 MiB of zeros per thread and call), the max pass over raw scores and exp2's fraction
// by vreduceps: 1.21x; the keys every lane sees without compares and exp's argument by an
// fmsub while |m| < 2^16: a further 1.03-1.04x. Phase shares after that: packing V^T and
// Q^T 11 %, S^T product 23 %, softmax 40 % (~5.5 cycles per 16 scores, near the
// instruction-throughput bound), O^T product 21 %, output 5 %. Tasks taken in chunks from a
// shared counter instead of two fixed halves: 2 threads at load 4-4.5, 1.12x (window) and
// 1.07x (varlen causal, 64 documents).
//
// Score terms (score_terms_bf16.h): with a softcap (softcap_ > 0) or a bias by diagonal
// (diag_p) each chunk's scores become, in place, s * scale, capped, plus the bias, before its
// softmax step, which then takes them as scaled (c = log2 e).
//
// Shapes: q (N, H, L, E), k (N, H, S, E), v (N, H, S, Ev) bfloat16 with a contiguous last
// dim and E a multiple of 32; lo, hi (N | 1, L) int64; a bias by diagonal (diag_heads | 1,
// diag_length) float32 with query positions (pos_rows = N | 1, L) int64; out (N, H, L, Ev) float32 (bfloat16
// with bf16_out) and lse (N, H, L) float32. A row with no visible key gets out = 0 and
// lse = -inf.

// Only the headers it needs (a cold build in seconds; torch/extension.h alone took over a
// minute): at::vec for the transposes and log, CPUBlas.h for oneDNN's micro-kernels. The
// entry points are extern "C" on raw pointers; Python allocates, checks and dispatches.
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>

#include "products_bf16.h"
#include "score_terms_bf16.h"

#include <omp.h>

#include <immintrin.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using at::BFloat16;
using Vec = at::vec::Vectorized<float>;
namespace cpublas = at::native::cpublas;

constexpr int64_t kPanel = 64;         // keys of V^T packed at a time
constexpr int64_t kBlockQ = 64;        // queries per task: the N of both products (oneDNN packs N <= 64)
constexpr int64_t kKeyAlign = 32;       // a chunk starts at a multiple of this key (the K of P V stays a multiple of 32)
constexpr int64_t kChunkKeys = 512;     // keys per online-softmax step of a long span
constexpr int64_t kOnePassKeys = 1024;  // a span up to this long takes one exact softmax step
constexpr int64_t kChunkTasks = 64;     // at most this many consecutive blocks per share of a thread
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// vreduceps's immediate for y - floor(y): keep 0 fraction bits (bits 7:4), round down (1:0),
// no precision exception (bit 3)
constexpr int kFloorFraction = 0x09;
// below this running max (base 2) exp's argument may come from one fused multiply-subtract
// (group_step): the max key's argument, the rounding error of its product, is then at most
// ulp(m) / 2 <= 2^-9 away from 0, and 2^(+-2^-9) rounds to exactly 1 in bf16 (below 2^20 the
// top key's bf16 probability could come out 1.0078: a one-key row missed its value by an ulp)
constexpr float kFusedArgumentBound = 65536.0f;

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// A per-thread scratch array, 64-byte aligned and not initialized (std::vector zeroes its
// elements: 2 MiB of V^T per thread and call for n = 16,384); data() is null when memory ran out.
template <typename T>
struct Buffer {
  explicit Buffer(int64_t n) : ptr(static_cast<T*>(std::aligned_alloc(64, round_up(n * sizeof(T), 64)))) {}
  ~Buffer() { std::free(ptr); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  T* data() { return ptr; }
  T* ptr;
};

// 2^y (lanes may hold anything; the caller masks them): y = floor(y) + f with 0 <= f < 1 (f
// in one vreduceps), 2^f by a polynomial of degree 4 fitted to its relative error on [0, 1]
// (at most 2.6e-6, far below the bf16 rounding of the probabilities), times 2^floor(y) by
// vscalefps (which floors its exponent itself). y = -inf gives 0.
inline __m512 exp2_ps(__m512 y) {
  const __m512 f = _mm512_reduce_ps(y, kFloorFraction);
  __m512 p = _mm512_set1_ps(1.3534165435058204e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.201146537832498e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275407381763e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.930038349883887e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000025933565264f));
  return _mm512_scalef_ps(p, y);
}

// The score terms on the scores of one chunk (keys c0..c0+keys-1 as rows of 64 queries), in
// place: s * scale, the softcap where `cap`, the bias of `bias_row` (one head's diagonals, or
// null) for queries at positions p (consecutive[g]: group g's 16 positions are consecutive).
void apply_terms(float* s_t, int64_t c0, int64_t keys, float scale, const qkv_terms::Cap* cap, const float* bias_row,
                 int64_t offset, const int32_t* p, const bool* consecutive) {
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t t = c0; t < c0 + keys; ++t)
    for (int64_t g = 0; g < kBlockQ / 16; ++g) {
      float* x = s_t + (t - c0) * kBlockQ + 16 * g;
      __m512 u, tanh_unused;
      u = cap != nullptr ? cap->apply(_mm512_loadu_ps(x), tanh_unused) : _mm512_mul_ps(_mm512_loadu_ps(x), vscale);
      if (bias_row != nullptr) u = _mm512_add_ps(u, qkv_terms::Diagonals::load(bias_row, p + 16 * g, consecutive[g], t - offset));
      _mm512_storeu_ps(x, u);
    }
}

// Values of one head (S, Ev), row stride ld, transposed: keys key0..key0+63 (those below S)
// into columns of vt (Ev rows, stride ld_vt), the A of O^T = V^T P^T.
void pack_values_t(const BFloat16* v, int64_t ld, int64_t S, int64_t Ev, int64_t ld_vt, int64_t key0, BFloat16* vt) {
  for (int64_t j = key0; j < std::min(key0 + kPanel, S); j += 32)
    for (int64_t e = 0; e < Ev; e += 32)
      at::vec::transpose_mxn<BFloat16>(v + j * ld + e, ld, vt + e * ld_vt + j, ld_vt, static_cast<int>(std::min<int64_t>(32, S - j)),
                                       static_cast<int>(std::min<int64_t>(32, Ev - e)));
}

// A 16 x 16 float transpose in registers (r[i] holds row i; afterwards column i).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

// The block's queries (rows of q, stride ld) as B = Q^T (E x 64) in VNNI: a pair of head
// dims of a query is one 32-bit word, so B's row w holds word w of every query (zeros for
// queries past `rows`): 16 x 16 transposes of words.
void pack_queries(const BFloat16* q, int64_t ld, int64_t rows, int64_t E, BFloat16* qt) {
  float* dst = reinterpret_cast<float*>(qt);
  for (int64_t j0 = 0; j0 < kBlockQ; j0 += 16)
    for (int64_t w0 = 0; w0 < E / 2; w0 += 16) {
      __m512 r[16];
      for (int64_t i = 0; i < 16; ++i)
        r[i] = j0 + i < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(q + (j0 + i) * ld) + w0) : _mm512_setzero_ps();
      transpose16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(dst + (w0 + i) * kBlockQ + j0, r[i]);
    }
}

// One 16-query group's softmax step over the chunk's keys c0..c0+width-1 in the transposed
// layout: s_t (width x 64 float32, scores of key t for the block's 64 queries at row t - c0),
// the group's lanes at column offset `col`. Lane i sees keys a[i]..b[i]; keys fa..fb are seen
// by all 16 lanes (no compare needed), keys outside ga..gb by none (no exp). Writes the
// group's bf16 probabilities into p_t (VNNI: key pair u at u * 128, lanes interleaved) and
// updates the running max m (base 2) and sum l; returns the accumulator factors 2^(m_old - m).
// The max pass reads the scores as they are (raw products, or with score terms the terms'
// results, then c = log2 e > 0): the largest scaled score s c is c max(s) for c >= 0 and
// c min(s) for c < 0 (``kLowest``), and rounding that one product gives exactly the largest
// of the rounded products s c, so the row's max key still gets 2^0 below.
template <bool kLowest>
__m512 group_step(const float* s_t, BFloat16* p_t, int64_t col, int64_t c0, int64_t width, __m512i va, __m512i vb,
                  int64_t fa, int64_t fb, int64_t ga, int64_t gb, float c, __m512& m, __m512& l) {
  const __m512 vc = _mm512_set1_ps(c), ninf = _mm512_set1_ps(kNegInf), zero = _mm512_setzero_ps();
  const int64_t t0 = std::max(ga, c0), t1 = std::min(gb, c0 + width - 1);  // keys some lane sees
  auto visible = [&](int64_t t) {
    const __m512i vt = _mm512_set1_epi32(static_cast<int32_t>(t));
    return static_cast<__mmask16>(_mm512_cmple_epi32_mask(va, vt) & _mm512_cmple_epi32_mask(vt, vb));
  };
  // the extreme raw score over the lanes' own keys: edges with compares, the keys all lanes
  // see unmasked with four independent accumulators (a max has a latency of 4 cycles)
  const __m512 none = _mm512_set1_ps(kLowest ? -kNegInf : kNegInf);
  auto pick = [](__m512 a, __m512 b) { return kLowest ? _mm512_min_ps(a, b) : _mm512_max_ps(a, b); };
  __m512 mx[4] = {none, none, none, none};
  const float* col_s = s_t + col - c0 * kBlockQ;  // key t at col_s + t * kBlockQ
  auto edge_max = [&](int64_t from, int64_t to) {
    for (int64_t t = from; t <= to; ++t) {
      const __m512 s = _mm512_loadu_ps(col_s + t * kBlockQ);
      mx[0] = kLowest ? _mm512_mask_min_ps(mx[0], visible(t), mx[0], s) : _mm512_mask_max_ps(mx[0], visible(t), mx[0], s);
    }
  };
  const int64_t u0 = std::max(fa, t0), u1 = std::min(fb, t1);  // keys every lane sees
  if (u0 > u1) {
    edge_max(t0, t1);
  } else {
    edge_max(t0, u0 - 1);
    int64_t t = u0;
    for (; t + 3 <= u1; t += 4)
      for (int64_t i = 0; i < 4; ++i) mx[i] = pick(mx[i], _mm512_loadu_ps(col_s + (t + i) * kBlockQ));
    for (; t <= u1; ++t) mx[1] = pick(mx[1], _mm512_loadu_ps(col_s + t * kBlockQ));
    edge_max(u1 + 1, t1);
  }
  const __m512 extreme = pick(pick(mx[0], mx[1]), pick(mx[2], mx[3]));
  const __mmask16 seen = _mm512_cmp_ps_mask(extreme, none, _CMP_NEQ_UQ);  // a lane with a key (or a NaN)
  const __m512 vmax = _mm512_max_ps(m, _mm512_mask_mul_ps(ninf, seen, extreme, vc));
  const __mmask16 had = _mm512_cmp_ps_mask(m, ninf, _CMP_NEQ_OQ);
  const __m512 alpha = _mm512_maskz_mov_ps(had, exp2_ps(_mm512_sub_ps(m, vmax)));
  m = vmax;
  // pairs (t, t + 1) interleaved lane by lane: bf16 index 2i <- key t, 2i + 1 <- key t + 1
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  __m512 vsum[2] = {zero, zero};
  auto store_pair = [&](int64_t t, __m512 e0, __m512 e1) {
    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // keys t (low half), t + 1 (high half)
    _mm512_storeu_si512(p_t + (t - c0) * kBlockQ + 2 * col, _mm512_permutexvar_epi16(interleave, pair));
  };
  // exp's argument s c - m. Exact mode: the product rounded exactly as in the max pass above
  // (the module is built with -ffp-contract=off), so the row's max key gets 2^0 = 1 whatever
  // the scores' size; an fmsub keeps the product unrounded, and the max key's argument is
  // then m's rounding error, up to ulp(m) / 2: harmless (and one instruction less) while
  // every lane's |m| < kFusedArgumentBound, an overflow of exp past |s c| ~ 1e8
  const bool fused = _mm512_cmp_ps_mask(_mm512_abs_ps(m), _mm512_set1_ps(kFusedArgumentBound), _CMP_LT_OQ) == 0xFFFF;
  auto argument = [&](int64_t key) {
    const __m512 s = _mm512_loadu_ps(s_t + (key - c0) * kBlockQ + col);
    return fused ? _mm512_fmsub_ps(s, vc, m) : _mm512_sub_ps(_mm512_mul_ps(s, vc), m);
  };
  // any key pair: zeros for keys no lane sees, a compare for the edges
  auto general_pair = [&](int64_t t) {
    if (t + 1 < t0 || t > t1) {
      _mm512_storeu_si512(p_t + (t - c0) * kBlockQ + 2 * col, _mm512_setzero_si512());
      return;
    }
    __m512 e[2];
    for (int64_t u = 0; u < 2; ++u) {
      const int64_t key = t + u;
      if (key < t0 || key > t1) {
        e[u] = zero;
        continue;
      }
      e[u] = exp2_ps(argument(key));
      if (key < fa || key > fb) e[u] = _mm512_maskz_mov_ps(visible(key), e[u]);
      vsum[u] = _mm512_add_ps(vsum[u], e[u]);
    }
    store_pair(t, e[0], e[1]);
  };
  // pairs before the keys every lane sees, those keys without compares, the pairs after
  // (t - c0 stays even: pairs are rows of P^T's VNNI layout)
  const int64_t end = c0 + width;
  int64_t t = c0;
  const int64_t fast0 = u0 <= u1 ? std::min(end, c0 + round_up(std::max<int64_t>(u0 - c0, 0), 2)) : end;
  for (; t < fast0; t += 2) general_pair(t);
  for (; t + 1 <= u1 && t < end; t += 2) {
    const __m512 e0 = exp2_ps(argument(t)), e1 = exp2_ps(argument(t + 1));
    vsum[0] = _mm512_add_ps(vsum[0], e0);
    vsum[1] = _mm512_add_ps(vsum[1], e1);
    store_pair(t, e0, e1);
  }
  for (; t < end; t += 2) general_pair(t);
  l = _mm512_fmadd_ps(l, alpha, _mm512_add_ps(vsum[0], vsum[1]));
  return alpha;
}

// Tasks 0..total-1 handed out in chunks of consecutive tasks, to whichever thread asks first.
class TaskQueue {
 public:
  TaskQueue(int64_t total, int64_t chunk) : total_(total), chunk_(chunk) {}
  // the first task of the next chunk (total or more when none is left); end: past its last
  int64_t take(int64_t& end) {
    const int64_t first = next_.fetch_add(chunk_);
    end = std::min(total_, first + chunk_);
    return first;
  }

 private:
  const int64_t total_, chunk_;
  std::atomic<int64_t> next_{0};
};

// A large output is written once, page by page: ask for transparent huge pages (where the
// system grants them on request) so that it takes a few faults instead of one per 4 KiB.
void advise_huge_pages(void* data, int64_t bytes) {
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data), end = begin + bytes;
  const uintptr_t from = (begin + kHuge - 1) / kHuge * kHuge, to = end / kHuge * kHuge;
  if (to > from) madvise(reinterpret_cast<void*>(from), to - from, MADV_HUGEPAGE);
}

}  // namespace

// out (N, H, L, Ev, contiguous; float32, or bfloat16 with bf16_out) and lse (N, H, L,
// contiguous) of q, k, v given by their data and the strides of their first three dims (the
// last is contiguous), lo, hi (lo_rows x L, contiguous, lo_rows 1 or N); E a positive
// multiple of 32, Ev positive, S < 2^30 (Python checks all of it). Runs on `threads` OpenMP
// threads. Returns 0, or 1 when a thread's scratch memory could not be allocated.
extern "C" int qkv_interval_bf16_forward(const BFloat16* q_p, const int64_t* qs, const BFloat16* k_p, const int64_t* ks,
                                         const BFloat16* v_p, const int64_t* vs, const int64_t* lo_p, const int64_t* hi_p,
                                         int64_t lo_rows, int64_t N, int64_t H, int64_t L, int64_t E, int64_t S, int64_t Ev,
                                         double scale_, double softcap_, const float* diag_p, int64_t diag_heads,
                                         int64_t diag_length, int64_t diag_offset, const int64_t* pos_p, int64_t pos_rows,
                                         int bf16_out, void* out, float* lse_p, int64_t num_threads) {
  const bool per_batch = lo_rows > 1;
  // base 2: p = 2^(s c - m); with score terms the chunk's scores are scaled (and more) first
  const bool capped = softcap_ > 0.0, biased = diag_p != nullptr, with_terms = capped || biased;
  const float c = with_terms ? static_cast<float>(M_LOG2E) : static_cast<float>(scale_) * static_cast<float>(M_LOG2E);
  const qkv_terms::Cap softcap(static_cast<float>(scale_), capped ? scale_ / softcap_ : 0.0, static_cast<float>(softcap_));
  const qkv_terms::Diagonals diagonals{diag_p, diag_heads, diag_length, diag_offset};
  const int64_t out_item = bf16_out ? 2 : 4;  // bytes per output value
  advise_huge_pages(out, N * H * L * Ev * out_item);
  if (N * H * L == 0) return 0;
  if (S == 0) {
    std::memset(out, 0, N * H * L * Ev * out_item);  // 0.0 in float32 and bfloat16
    std::fill(lse_p, lse_p + N * H * L, kNegInf);
    return 0;
  }
  const int64_t S_pad = round_up(S, kPanel), panels = S_pad / kPanel, Ev16 = round_up(Ev, 16);
  char* out_p = static_cast<char*>(out);
  const int64_t q_blocks = (L + kBlockQ - 1) / kBlockQ, tasks = N * H * q_blocks;
  // Tasks (blocks, head by head) go to the threads in chunks of consecutive tasks taken from
  // an atomic counter, not in equal shares fixed up front: on a shared machine a thread that
  // loses its core for a while then holds back one chunk, not half the work. A chunk's first
  // block packs all of its keys' V^T panels, later blocks one new panel each (a window).
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(num_threads, tasks));
  TaskQueue queue(tasks, std::clamp<int64_t>(tasks / (8 * threads), 1, kChunkTasks));
  std::atomic<bool> failed{false};

#pragma omp parallel num_threads(static_cast<int>(threads))
  try {
    // per thread: V^T of the current head, packed panel by panel when first needed (so it is
    // still in cache when used), the block's Q^T, scores, probabilities and O^T
    // (left uninitialized: every entry a product reads is written first)
    Buffer<BFloat16> vt(std::max<int64_t>(Ev, 1) * S_pad), qt(E * kBlockQ), p_t(kOnePassKeys * kBlockQ);
    Buffer<float> s_t(kOnePassKeys * kBlockQ), acc_t(Ev16 * kBlockQ);
    if (!vt.data() || !qt.data() || !p_t.data() || !s_t.data() || !acc_t.data()) throw std::bad_alloc();
    for (int64_t e = 0; e < Ev; ++e)  // keys S..S_pad-1 of V^T: a product may read them (times a zero P)
      std::fill(vt.data() + e * S_pad + S, vt.data() + (e + 1) * S_pad, BFloat16(0.0f));
    std::vector<uint8_t> packed(panels);
    int64_t packed_head = -1;
    alignas(64) int32_t a_[kBlockQ], b_[kBlockQ], p_[kBlockQ];  // each row's keys a..b, its position p
    bool consecutive[kBlockQ / 16];
    for (int64_t end = 0, task = queue.take(end); task < tasks; task = task + 1 < end ? task + 1 : queue.take(end)) {
      const int64_t nh = task / q_blocks, n = nh / H, h = nh % H, r0 = (task % q_blocks) * kBlockQ;
      const int64_t rows = std::min(kBlockQ, L - r0);
      const int64_t* row_lo = lo_p + (per_batch ? n * L : 0) + r0;
      const int64_t* row_hi = hi_p + (per_batch ? n * L : 0) + r0;
      int64_t first = S, last = -1;  // the block's keys: the union of its rows' intervals
      for (int64_t r = 0; r < kBlockQ; ++r) {
        const int64_t a = r < rows ? std::max<int64_t>(row_lo[r], 0) : S, b = r < rows ? std::min<int64_t>(row_hi[r], S - 1) : -1;
        a_[r] = static_cast<int32_t>(a <= b ? a : S);  // an empty row: no key in a..b
        b_[r] = static_cast<int32_t>(a <= b ? b : -1);
        if (a <= b) {
          first = std::min(first, a);
          last = std::max(last, b);
        }
      }
      float* dst_lse = lse_p + nh * L + r0;
      char* dst_out = out_p + (nh * L + r0) * Ev * out_item;
      if (last < 0) {  // no row of the block sees a key
        std::memset(dst_out, 0, rows * Ev * out_item);  // 0.0 in float32 and bfloat16
        std::fill(dst_lse, dst_lse + rows, kNegInf);
        continue;
      }
      if (biased) {  // the rows' positions; padded rows continue the last one's (the table's margins hold them)
        const int64_t* row_pos = pos_p + (pos_rows > 1 ? n * L : 0) + r0;
        for (int64_t r = 0; r < kBlockQ; ++r)
          p_[r] = static_cast<int32_t>(r < rows ? row_pos[r] : row_pos[rows - 1] + (r - rows + 1));
        for (int64_t g = 0; g < kBlockQ / 16; ++g) consecutive[g] = qkv_terms::consecutive16(p_ + 16 * g);
      }
      if (nh != packed_head) {
        std::fill(packed.begin(), packed.end(), 0);
        packed_head = nh;
      }
      const BFloat16* k_head = k_p + n * ks[0] + h * ks[1];
      const BFloat16* v_head = v_p + n * vs[0] + h * vs[1];
      for (int64_t pnl = first / kPanel; pnl <= last / kPanel; ++pnl)
        if (!packed[pnl]) {
          pack_values_t(v_head, vs[2], S, Ev, S_pad, pnl * kPanel, vt.data());
          packed[pnl] = 1;
        }
      pack_queries(q_p + n * qs[0] + h * qs[1] + r0 * qs[2], qs[2], rows, E, qt.data());
      __m512 m[kBlockQ / 16], l[kBlockQ / 16];
      int64_t fa[4], fb[4], ga[4], gb[4];
      for (int64_t g = 0; g < kBlockQ / 16; ++g) {
        m[g] = _mm512_set1_ps(kNegInf);
        l[g] = _mm512_setzero_ps();
        fa[g] = *std::max_element(a_ + 16 * g, a_ + 16 * g + 16);
        fb[g] = *std::min_element(b_ + 16 * g, b_ + 16 * g + 16);
        ga[g] = *std::min_element(a_ + 16 * g, a_ + 16 * g + 16);
        gb[g] = *std::max_element(b_ + 16 * g, b_ + 16 * g + 16);
      }
      // keys k0..k1-1 (k0 aligned for the products); a short span in one exact softmax
      // step, a long one online in chunks of kChunkKeys
      const int64_t k0 = first / kKeyAlign * kKeyAlign, k1 = round_up(last + 1, kKeyAlign);
      const int64_t step = k1 - k0 <= kOnePassKeys ? k1 - k0 : kChunkKeys;
      for (int64_t c0 = k0; c0 < k1; c0 += step) {
        const int64_t width = std::min(step, k1 - c0);
        // S^T = K Q^T for the chunk's existing keys (rows past S stay unread: no lane sees them)
        qkv_products::products(std::min(width, S - c0), E, ks[2], kBlockQ, false, k_head + c0 * ks[2], qt.data(), s_t.data());
        if (with_terms)
          apply_terms(s_t.data(), c0, std::min(width, S - c0), static_cast<float>(scale_), capped ? &softcap : nullptr,
                      biased ? diagonals.head(h) : nullptr, diagonals.offset, p_, consecutive);
        for (int64_t g = 0; g < kBlockQ / 16; ++g) {
          const __m512i va = _mm512_load_si512(a_ + 16 * g), vb = _mm512_load_si512(b_ + 16 * g);
          const __m512 alpha = (c < 0 ? group_step<true> : group_step<false>)(s_t.data(), p_t.data(), 16 * g, c0, width, va, vb, fa[g], fb[g], ga[g], gb[g], c, m[g], l[g]);
          if (c0 != k0 && _mm512_cmp_ps_mask(alpha, _mm512_set1_ps(1.0f), _CMP_NEQ_UQ) != 0)
            for (int64_t e = 0; e < Ev; ++e) {
              float* x = acc_t.data() + e * kBlockQ + 16 * g;
              _mm512_storeu_ps(x, _mm512_mul_ps(_mm512_loadu_ps(x), alpha));
            }
        }
        // O^T (+)= V^T P^T: Ev x 64, K = the chunk's keys
        qkv_products::products(Ev, width, S_pad, kBlockQ, c0 != k0, vt.data() + c0, p_t.data(), acc_t.data());
      }
      // out = O / l, lse = m ln 2 + log l; empty rows 0 and -inf
      for (int64_t g = 0; g < kBlockQ / 16 && 16 * g < rows; ++g) {
        alignas(64) float inv[16];
        const int64_t lanes_here = std::min<int64_t>(16, rows - 16 * g);
        const __mmask16 seen = _mm512_cmp_ps_mask(l[g], _mm512_setzero_ps(), _CMP_GT_OQ), here = static_cast<__mmask16>((1u << lanes_here) - 1u);
        _mm512_store_ps(inv, _mm512_maskz_div_ps(seen, _mm512_set1_ps(1.0f), l[g]));
        const __m512 row_lse = _mm512_fmadd_ps(m[g], _mm512_set1_ps(static_cast<float>(M_LN2)), Vec(l[g]).log());
        _mm512_mask_storeu_ps(dst_lse + 16 * g, here, _mm512_mask_mov_ps(_mm512_set1_ps(kNegInf), seen, row_lse));
        for (int64_t e0 = 0; e0 < Ev; e0 += 16) {
          __m512 r[16];
          for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(acc_t.data() + (e0 + i) * kBlockQ + 16 * g);
          transpose16(r);  // r[i]: query 16 g + i, columns e0..e0+15
          const __mmask16 cols = static_cast<__mmask16>((1u << std::min<int64_t>(16, Ev - e0)) - 1u);
          for (int64_t i = 0; i < lanes_here; ++i) {
            const __m512 row = _mm512_mul_ps(r[i], _mm512_set1_ps(inv[i]));
            char* dst = dst_out + ((16 * g + i) * Ev + e0) * out_item;
            if (bf16_out)
              _mm256_mask_storeu_epi16(dst, cols, (__m256i)_mm512_cvtneps_pbh(row));
            else
              _mm512_mask_storeu_ps(dst, cols, row);
          }
        }
      }
    }
    qkv_products::release();
  } catch (...) {  // nothing may leave an OpenMP region or an extern "C" function
    failed = true;
  }
  return failed ? 1 : 0;
}

extern "C" int qkv_interval_bf16_micro_kernel_available() { return cpublas::could_pack(at::kBFloat16); }

// Whether this file's VNNI layout of B is what oneDNN packs on this machine: the queries of a
// random block with a tail (50 of 64 queries), against cpublas::pack of the plain Q^T.
extern "C" int qkv_interval_bf16_pack_matches() {
  const int64_t rows = 50, E = 64;
  // distinct small integers (exact in bf16), not random numbers: drawing from torch's global
  // generator here would shift the seeded stream of the program that loads the kernel
  std::vector<BFloat16> x(rows * E);
  for (int64_t i = 0; i < rows * E; ++i) x[i] = BFloat16(static_cast<float>((i + 1) * 37 % 255 - 127));
  const BFloat16* src = x.data();
  std::vector<BFloat16> ours(E * kBlockQ), theirs(E * kBlockQ), plain(E * kBlockQ, BFloat16(0.0f));
  pack_queries(src, E, rows, E, ours.data());
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t e = 0; e < E; ++e) plain[e * kBlockQ + j] = src[j * E + e];  // Q^T (E x 64), zeros past `rows`
  cpublas::pack(E, kBlockQ, kBlockQ, kBlockQ, at::kBFloat16, at::kBFloat16, plain.data(), theirs.data());
  return std::memcmp(ours.data(), theirs.data(), ours.size() * sizeof(BFloat16)) == 0;
}

