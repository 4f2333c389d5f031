
// The largest magnitude of float32, bfloat16 and float16 tensors in one pass, built at run
// time by qkv/native/build.py once per CPU tier (AVX2 + FMA, AVX-512) and called through the
// operator qkv::magnitude (qkv/native/magnitude.py) for the input check of every attention
// call (qkv/attention/problem.py, _check_magnitudes).
//
// An IEEE value is a sign bit and the bits of its magnitude, and those bits, read as an
// unsigned integer, are ordered as the magnitudes are: 0 is zero, the exponent field all ones
// with a zero fraction is infinity, anything above a NaN. So the largest |x| of a tensor, and
// whether it holds an infinity or a NaN, is the largest (bits & ~sign): one AND and one
// unsigned max per vector of values, exact, with no conversion. torch.aminmax converts
// bfloat16 to float32 and keeps a min and a max: about a third of the memory read rate.
//
// A tensor arrives as its data pointer, the width of its values (2 or 4 bytes), the sizes and
// strides (in values) of its rows, and the length of a row: its contiguous innermost dims,
// merged by the caller. All tensors of a call are cut into shares of at least kGrainValues
// values, and the threads split the shares of all of them at once (q, k and v in one
// parallel region).
//
// qkv_widen_bf16 is the same pass over bfloat16 tensors that also writes each value as a
// float32 (its bits shifted up by 16: exact) into a contiguous output, for a CPU that computes
// bfloat16 in float32: the input is read once for the check and the copy together.

// No torch header at all (a cold build in a few seconds); the threads are OpenMP's.
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define QKV_AVX512 1
#elif defined(__AVX2__)
#include <immintrin.h>
#define QKV_AVX2 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kGrainValues = int64_t(1) << 16;  // values per share of a thread, at least
// The scan prefetches every cache line this many bytes ahead of its read: with the hardware
// prefetchers alone a plain loop ran at ~18-20 GB/s (2 threads, inputs in main memory, as
// torch's own reductions), with this at 25-27 GB/s (1, 2, 4 and 8 KiB ahead alike, AVX-512);
// the scan itself, one thread, CPU time: 5-10 % faster. (The widening, which writes twice
// what it reads, gained nothing from it.)
constexpr int64_t kPrefetchBytes = 4096;

inline void prefetch_lines(const void* from, int64_t bytes) {
  const char* p = static_cast<const char*>(from) + kPrefetchBytes;
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 3);
}

// One vector register of the tier, or one 32-bit word where there is none: the operations the
// scan needs on it, lane widths of 16 and 32 bits.
#if QKV_AVX512
using Vec = __m512i;
constexpr int kVecBytes = 64;
inline Vec vzero() { return _mm512_setzero_si512(); }
inline Vec vload(const void* p) { return _mm512_loadu_si512(p); }
inline Vec vand(Vec a, Vec b) { return _mm512_and_si512(a, b); }
inline Vec vmax16(Vec a, Vec b) { return _mm512_max_epu16(a, b); }
inline Vec vmax32(Vec a, Vec b) { return _mm512_max_epu32(a, b); }
inline Vec vset16(uint16_t m) { return _mm512_set1_epi16(static_cast<int16_t>(m)); }
inline Vec vset32(uint32_t m) { return _mm512_set1_epi32(static_cast<int32_t>(m)); }
inline void vstore(void* p, Vec a) { _mm512_storeu_si512(p, a); }
#elif QKV_AVX2
using Vec = __m256i;
constexpr int kVecBytes = 32;
inline Vec vzero() { return _mm256_setzero_si256(); }
inline Vec vload(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline Vec vand(Vec a, Vec b) { return _mm256_and_si256(a, b); }
inline Vec vmax16(Vec a, Vec b) { return _mm256_max_epu16(a, b); }
inline Vec vmax32(Vec a, Vec b) { return _mm256_max_epu32(a, b); }
inline Vec vset16(uint16_t m) { return _mm256_set1_epi16(static_cast<int16_t>(m)); }
inline Vec vset32(uint32_t m) { return _mm256_set1_epi32(static_cast<int32_t>(m)); }
inline void vstore(void* p, Vec a) { _mm256_storeu_si256(static_cast<__m256i*>(p), a); }
#else
using Vec = uint32_t;
constexpr int kVecBytes = 4;
inline Vec vzero() { return 0; }
inline Vec vload(const void* p) {
  Vec v;
  std::memcpy(&v, p, 4);
  return v;
}
inline Vec vand(Vec a, Vec b) { return a & b; }
// two 16-bit lanes in one word: each lane's max on its own
inline Vec vmax16(Vec a, Vec b) {
  return std::max(a & 0xFFFFu, b & 0xFFFFu) | std::max(a & 0xFFFF0000u, b & 0xFFFF0000u);
}
inline Vec vmax32(Vec a, Vec b) { return std::max(a, b); }
inline Vec vset16(uint16_t m) { return uint32_t(m) * 0x10001u; }
inline Vec vset32(uint32_t m) { return m; }
inline void vstore(void* p, Vec a) { std::memcpy(p, &a, 4); }
#endif

// The magnitude field of a value `Width` bytes wide, its lanes and its max.
template <int Width>
struct Field;

template <>
struct Field<2> {
  using Bits = uint16_t;
  static constexpr Bits kMagnitude = 0x7FFF;
  static Vec mask() { return vset16(kMagnitude); }
  static Vec max(Vec a, Vec b) { return vmax16(a, b); }
};

template <>
struct Field<4> {
  using Bits = uint32_t;
  static constexpr Bits kMagnitude = 0x7FFFFFFF;
  static Vec mask() { return vset32(kMagnitude); }
  static Vec max(Vec a, Vec b) { return vmax32(a, b); }
};

// The largest lane of acc, lanes of Width bytes.
template <int Width>
uint32_t lanes_max(Vec acc) {
  using Bits = typename Field<Width>::Bits;
  Bits lanes[kVecBytes / Width];
  vstore(lanes, acc);
  return *std::max_element(lanes, lanes + kVecBytes / Width);
}

// acc = max(acc, bits & magnitude) lane by lane over n values at x, and the values left over
// past the last whole vector into tail; no horizontal reduction here (a share reduces its
// accumulator once: rows may hold only 32 or 64 values)
template <int Width>
inline void row_max(const typename Field<Width>::Bits* x, int64_t n, Vec& acc, uint32_t& tail) {
  using F = Field<Width>;
  constexpr int64_t lanes = kVecBytes / Width;
  const Vec magnitude = F::mask();
  // four chains: a max has a latency, and more loads in flight keep the reads streaming
  Vec a1 = vzero(), a2 = vzero(), a3 = vzero();
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    prefetch_lines(x + i, 4 * kVecBytes);
    acc = F::max(acc, vand(vload(x + i), magnitude));
    a1 = F::max(a1, vand(vload(x + i + lanes), magnitude));
    a2 = F::max(a2, vand(vload(x + i + 2 * lanes), magnitude));
    a3 = F::max(a3, vand(vload(x + i + 3 * lanes), magnitude));
  }
  for (; i + lanes <= n; i += lanes) acc = F::max(acc, vand(vload(x + i), magnitude));
  for (; i < n; ++i) tail = std::max<uint32_t>(tail, x[i] & F::kMagnitude);
  acc = F::max(F::max(acc, a1), F::max(a2, a3));
}

// row_max over bfloat16 values that also writes each one widened to float32 at out; with
// `stream`, in non-temporal stores from the first 64-byte boundary of out on (copies much
// larger than the caches are not read back before they leave them: a cache line written
// normally is first read from memory, a streamed one is not; the caller fences them)
inline void row_widen(const uint16_t* x, int64_t n, float* out, Vec& acc, uint32_t& tail, bool stream) {
  int64_t i = 0;
#if QKV_AVX512 || QKV_AVX2
  constexpr int64_t lanes = kVecBytes / 4;  // float32 values out per vector; as many bf16 in
  const Vec magnitude = Field<2>::mask();
  for (; i + lanes <= n; i += lanes) {
    const bool aligned = stream && reinterpret_cast<uintptr_t>(out + i) % 64 == 0;
#if QKV_AVX512
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m512i wide = _mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16);
    acc = Field<2>::max(acc, vand(_mm512_zextsi256_si512(half), magnitude));
    if (aligned) _mm512_stream_si512(reinterpret_cast<__m512i*>(out + i), wide);
    else _mm512_storeu_si512(out + i, wide);
#else
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256i wide = _mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16);
    acc = Field<2>::max(acc, vand(_mm256_zextsi128_si256(half), magnitude));
    if (aligned || (stream && reinterpret_cast<uintptr_t>(out + i) % 32 == 0)) _mm256_stream_si256(reinterpret_cast<__m256i*>(out + i), wide);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), wide);
#endif
  }
#else
  (void)acc;
  (void)stream;
#endif
  for (; i < n; ++i) {
    const uint32_t bits = uint32_t(x[i]) << 16;
    std::memcpy(out + i, &bits, 4);
    tail = std::max<uint32_t>(tail, x[i] & 0x7FFFu);
  }
}

// One tensor: rows of `inner` contiguous values, one at every index of `sizes` (`dims` of
// them), the row at index (i_0, i_1, ...) starting at sum_d i_d * strides[d] values from
// `base`; `out`: where its float32 copy goes (row r at r * inner), or null.
struct Strided {
  const void* base;
  int width;
  int64_t dims;
  const int64_t* sizes;
  const int64_t* strides;
  int64_t inner;
  float* out;
  bool stream;  // the copy in non-temporal stores (`row_widen`)
  int64_t rows;
  int64_t grain;   // rows per share; 1 when rows are cut into pieces
  int64_t pieces;  // pieces of kGrainValues values per row
  int64_t shares;
};

void plan(Strided& t) {
  t.rows = 1;
  for (int64_t d = 0; d < t.dims; ++d) t.rows *= t.sizes[d];
  if (t.rows == 0 || t.inner == 0) {
    t.shares = 0;
    return;
  }
  t.grain = std::max<int64_t>(1, kGrainValues / t.inner);
  t.pieces = (t.inner + kGrainValues - 1) / kGrainValues;
  t.shares = t.grain > 1 ? (t.rows + t.grain - 1) / t.grain : t.rows * t.pieces;
}

// row r's index (last dim fastest) into idx, its offset returned
int64_t locate(const Strided& t, int64_t r, int64_t* idx) {
  int64_t offset = 0;
  for (int64_t d = t.dims - 1; d >= 0; --d) {
    idx[d] = r % t.sizes[d];
    r /= t.sizes[d];
    offset += idx[d] * t.strides[d];
  }
  return offset;
}

// the rows [from, from + n) of a row of t at `offset` values from its base, row index r
template <int Width>
inline void scan_piece(const Strided& t, int64_t offset, int64_t r, int64_t from, int64_t n, Vec& acc, uint32_t& tail) {
  using Bits = typename Field<Width>::Bits;
  const Bits* x = static_cast<const Bits*>(t.base) + offset + from;
  if constexpr (Width == 2) {
    if (t.out != nullptr) {
      row_widen(x, n, t.out + r * t.inner + from, acc, tail, t.stream);
      return;
    }
  }
  row_max<Width>(x, n, acc, tail);
}

// the largest magnitude field of share s of t
template <int Width>
uint32_t share_max(const Strided& t, int64_t s) {
  Vec acc = vzero();
  uint32_t tail = 0;
  int64_t idx[64];  // the caller merges dims; a tensor has at most 64 (PyTorch's limit too)
  if (t.grain == 1) {
    const int64_t r = s / t.pieces, from = s % t.pieces * kGrainValues;
    scan_piece<Width>(t, locate(t, r, idx), r, from, std::min(kGrainValues, t.inner - from), acc, tail);
    return std::max(tail, lanes_max<Width>(acc));
  }
  const int64_t first = s * t.grain, last = std::min(t.rows, first + t.grain);
  int64_t offset = locate(t, first, idx);
  for (int64_t r = first; r < last; ++r) {
    scan_piece<Width>(t, offset, r, 0, t.inner, acc, tail);
    for (int64_t d = t.dims - 1; d >= 0; --d) {  // the next row's index, like an odometer
      offset += t.strides[d];
      if (++idx[d] < t.sizes[d]) break;
      offset -= t.strides[d] * t.sizes[d];
      idx[d] = 0;
    }
  }
  return std::max(tail, lanes_max<Width>(acc));
}

int scan_all(std::vector<Strided>& tensors, int32_t* bits, int64_t num_threads) {
  std::vector<int64_t> first_share(tensors.size() + 1, 0);  // tensor i's shares: [first_share[i], first_share[i + 1])
  for (size_t i = 0; i < tensors.size(); ++i) {
    plan(tensors[i]);
    first_share[i + 1] = first_share[i] + tensors[i].shares;
  }
  const int64_t shares = first_share.back();
  std::vector<uint32_t> best(std::max<int64_t>(shares, 1), 0);
  // the split of at::parallel_for with grain 1: contiguous runs of ceil(shares / threads)
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, shares)), run = (shares + threads - 1) / threads;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
  for (int64_t worker = 0; worker < threads; ++worker) {
    const int64_t s0 = worker * run, s1 = std::min(shares, s0 + run);
    size_t i = std::upper_bound(first_share.begin(), first_share.end(), s0) - first_share.begin() - 1;
    for (int64_t s = s0; s < s1; ++s) {
      while (s >= first_share[i + 1]) ++i;
      const Strided& t = tensors[i];
      const int64_t local = s - first_share[i];
      best[s] = t.width == 2 ? share_max<2>(t, local) : share_max<4>(t, local);
    }
#if QKV_AVX512 || QKV_AVX2
    _mm_sfence();  // this thread's streamed copies are in memory before the caller reads them
#endif
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    uint32_t top = 0;
    for (int64_t s = first_share[i]; s < first_share[i + 1]; ++s) top = std::max(top, best[s]);
    bits[i] = static_cast<int32_t>(top);  // at most 0x7FFFFFFF
  }
  return 0;
}

int scan_entry(int64_t count, const void* const* data, const int64_t* widths, const int64_t* dims, const int64_t* layout,
               const int64_t* inner, float* const* out, int32_t* bits, int64_t num_threads, bool stream) {
  try {
    std::vector<Strided> tensors;
    tensors.reserve(count);
    for (int64_t i = 0; i < count; ++i) {
      if (dims[i] > 64 || (widths[i] != 2 && widths[i] != 4)) return 1;
      tensors.push_back(Strided{data[i], static_cast<int>(widths[i]), dims[i], layout, layout + dims[i], inner[i],
                                out == nullptr ? nullptr : out[i], stream, 0, 1, 1, 0});
      layout += 2 * dims[i];
    }
    return scan_all(tensors, bits, num_threads);
  } catch (...) {  // nothing may leave an extern "C" function
    return 1;
  }
}

}  // namespace

// bits[i] = the largest magnitude field (the value's bits with the sign cleared) of tensor i's
// values, for `count` tensors: data[i], values of widths[i] bytes (2: bfloat16 or float16,
// 4: float32), dims[i] row dims whose sizes and strides (in values) follow one another in
// `layout` (sizes, then strides, per tensor), rows of inner[i] contiguous values. Python checks
// that each tensor's values lie in readable memory. Returns 0, or 1 when memory ran out (or a
// tensor came with more than 64 row dims or another width).
extern "C" int qkv_magnitude(int64_t count, const void* const* data, const int64_t* widths, const int64_t* dims,
                             const int64_t* layout, const int64_t* inner, int32_t* bits, int64_t num_threads) {
  return scan_entry(count, data, widths, dims, layout, inner, nullptr, bits, num_threads, false);
}

// qkv_magnitude over bfloat16 tensors (every width 2) that also writes tensor i's values as
// float32 into out[i], contiguous in its row-major order: the scan and the widened copy in one
// read of the input. stream != 0: the copies in non-temporal stores (`row_widen`).
extern "C" int qkv_widen_bf16(int64_t count, const void* const* data, const int64_t* dims, const int64_t* layout,
                              const int64_t* inner, float* const* out, int32_t* bits, int64_t num_threads,
                              int64_t stream) {
  try {
    std::vector<int64_t> widths(std::max<int64_t>(count, 1), 2);
    return scan_entry(count, data, widths.data(), dims, layout, inner, out, bits, num_threads, stream != 0);
  } catch (...) {
    return 1;
  }
}
