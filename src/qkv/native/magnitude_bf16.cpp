// The largest magnitude of bfloat16 tensors in one pass, built at run time by
// qkv/native/build.py and called through the operator qkv::magnitude_bf16
// (qkv/native/magnitude_bf16.py) for the input check of every attention call
// (qkv/attention/problem.py, _check_magnitudes).
//
// A bfloat16 value is a sign bit and 15 bits of magnitude, and those 15 bits, read as an
// unsigned integer, are ordered as the magnitudes are: 0 is zero, 0x7F80 infinity, anything
// above a NaN. So the largest |x| of a tensor, and whether it holds an infinity or a NaN, is
// the largest (bits & 0x7FFF): one AND and one unsigned max per 32 values, exact, with no
// conversion to float32. torch.aminmax on bfloat16 converts every value and runs at about a
// third of the memory bandwidth (three 16 MiB tensors, 2 threads: 2.7 ms against 1.1 ms here;
// as views of heads side by side, rows of 64 values: 7.1 ms against 1.9 ms).
//
// A tensor arrives as its data pointer, the sizes and strides (in values) of its rows, and
// the length of a row: its contiguous innermost dims, merged by the caller.

// No torch header at all (a cold build in a few seconds); the threads are OpenMP's.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr uint16_t kMagnitudeBits = 0x7FFF;
constexpr int64_t kGrainValues = int64_t(1) << 16;  // values per share of a thread, at least

// acc = max(acc, bits & 0x7FFF) lane by lane over n values at x; no horizontal reduction
// here (a share reduces its accumulator once: rows may hold only 32 or 64 values)
inline void row_max(const uint16_t* x, int64_t n, __m512i& acc) {
  const __m512i magnitude = _mm512_set1_epi16(static_cast<int16_t>(kMagnitudeBits));
  __m512i other = _mm512_setzero_si512();  // a second chain: a max has a latency
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(x + i), magnitude));
    other = _mm512_max_epu16(other, _mm512_and_si512(_mm512_loadu_si512(x + i + 32), magnitude));
  }
  for (; i < n; i += 32) {  // the tail, 32 values at a time, the last load masked
    const __mmask32 valid = n - i >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((uint32_t(1) << (n - i)) - 1);
    acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_maskz_loadu_epi16(valid, x + i), magnitude));
  }
  acc = _mm512_max_epu16(acc, other);
}

// the largest lane of acc
uint16_t lanes_max(__m512i acc) {
  alignas(64) uint16_t lanes[32];
  _mm512_store_si512(lanes, acc);
  return *std::max_element(lanes, lanes + 32);
}

// One tensor: rows of `inner` contiguous values, one at every index of `sizes` (`dims` of
// them), the row at index (i_0, i_1, ...) starting at sum_d i_d * strides[d] values from `base`.
struct Strided {
  const uint16_t* base;
  int64_t dims;
  const int64_t* sizes;
  const int64_t* strides;
  int64_t inner;
};

uint16_t largest_bits(const Strided& t, int64_t num_threads) {
  const int64_t dims = t.dims;
  int64_t rows = 1;
  for (int64_t d = 0; d < dims; ++d) rows *= t.sizes[d];
  if (rows == 0 || t.inner == 0) return 0;
  const uint16_t* base = t.base;
  // row r's index (last dim fastest) into idx, its offset returned
  auto locate = [&](int64_t r, int64_t* idx) {
    int64_t offset = 0;
    for (int64_t d = dims - 1; d >= 0; --d) {
      idx[d] = r % t.sizes[d];
      r /= t.sizes[d];
      offset += idx[d] * t.strides[d];
    }
    return offset;
  };
  // a share of a thread: `grain` consecutive rows, or one piece of kGrainValues values of a long row
  const int64_t grain = std::max<int64_t>(1, kGrainValues / t.inner);
  const int64_t pieces = (t.inner + kGrainValues - 1) / kGrainValues;  // per row
  const int64_t shares = grain > 1 ? (rows + grain - 1) / grain : rows * pieces;
  std::vector<uint16_t> best(shares, 0);
  // the split of at::parallel_for with grain 1: contiguous runs of ceil(shares / threads)
  const int64_t threads = std::max<int64_t>(1, std::min(num_threads, shares)), run = (shares + threads - 1) / threads;
#pragma omp parallel for num_threads(static_cast<int>(threads)) schedule(static, 1)
  for (int64_t worker = 0; worker < threads; ++worker) {
    const int64_t s0 = worker * run, s1 = std::min(shares, s0 + run);
    int64_t idx[64];  // the caller merges dims; a tensor has at most 64 (PyTorch's limit too)
    for (int64_t s = s0; s < s1; ++s) {
      __m512i acc = _mm512_setzero_si512();
      if (grain == 1) {
        const int64_t from = s % pieces * kGrainValues;
        row_max(base + locate(s / pieces, idx) + from, std::min(kGrainValues, t.inner - from), acc);
        best[s] = lanes_max(acc);
        continue;
      }
      const int64_t first = s * grain, last = std::min(rows, first + grain);
      int64_t offset = locate(first, idx);
      for (int64_t r = first; r < last; ++r) {
        row_max(base + offset, t.inner, acc);
        for (int64_t d = dims - 1; d >= 0; --d) {  // the next row's index, like an odometer
          offset += t.strides[d];
          if (++idx[d] < t.sizes[d]) break;
          offset -= t.strides[d] * t.sizes[d];
          idx[d] = 0;
        }
      }
      best[s] = lanes_max(acc);
    }
  }
  return *std::max_element(best.begin(), best.end());
}

}  // namespace

// bits[i] = the largest 15-bit magnitude field of tensor i's bfloat16 values, for `count`
// tensors: data[i], dims[i] row dims whose sizes and strides (in values) follow one another
// in `layout` (sizes, then strides, per tensor), rows of inner[i] contiguous values. Python
// checks that each tensor's values lie in readable memory. Returns 0, or 1 when memory ran out
// (or a tensor came with more than 64 row dims).
extern "C" int qkv_magnitude_bf16(int64_t count, const uint16_t* const* data, const int64_t* dims, const int64_t* layout,
                                  const int64_t* inner, int32_t* bits, int64_t num_threads) {
  try {
    for (int64_t i = 0; i < count; ++i) {
      if (dims[i] > 64) return 1;
      bits[i] = largest_bits(Strided{data[i], dims[i], layout, layout + dims[i], inner[i]}, num_threads);
      layout += 2 * dims[i];
    }
  } catch (...) {  // nothing may leave an extern "C" function
    return 1;
  }
  return 0;
}
