// The largest magnitude of bfloat16 tensors in one pass, built at run time by
// qkv/kernels/magnitude_bf16.py for the input check of every attention call
// (qkv/_problem.py, _check_magnitudes).
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

#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
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

// One tensor: rows of `inner` contiguous values, one at every index of `sizes`, the row at
// index (i_0, i_1, ...) starting at sum_d i_d * strides[d] values from `data`.
struct Strided {
  uintptr_t data;
  std::vector<int64_t> sizes, strides;
  int64_t inner;
};

uint16_t largest_bits(const Strided& t) {
  const int64_t dims = static_cast<int64_t>(t.sizes.size());
  int64_t rows = 1;
  for (int64_t n : t.sizes) rows *= n;
  if (rows == 0 || t.inner == 0) return 0;
  const auto* base = reinterpret_cast<const uint16_t*>(t.data);
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
  at::parallel_for(0, shares, 1, [&](int64_t s0, int64_t s1) {
    std::vector<int64_t> idx(std::max<int64_t>(dims, 1));
    for (int64_t s = s0; s < s1; ++s) {
      __m512i acc = _mm512_setzero_si512();
      if (grain == 1) {
        const int64_t from = s % pieces * kGrainValues;
        row_max(base + locate(s / pieces, idx.data()) + from, std::min(kGrainValues, t.inner - from), acc);
        best[s] = lanes_max(acc);
        continue;
      }
      const int64_t first = s * grain, last = std::min(rows, first + grain);
      int64_t offset = locate(first, idx.data());
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
  });
  return *std::max_element(best.begin(), best.end());
}

// per tensor, the largest 15-bit magnitude field of its bfloat16 values
std::vector<int> largest_magnitude_bits(const std::vector<Strided>& tensors) {
  std::vector<int> out;
  for (const Strided& t : tensors) out.push_back(largest_bits(t));
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  pybind11::class_<Strided>(module, "Strided")
      .def(pybind11::init([](uintptr_t data, std::vector<int64_t> sizes, std::vector<int64_t> strides, int64_t inner) {
             if (sizes.size() != strides.size()) throw std::invalid_argument("sizes and strides differ in length");
             return Strided{data, std::move(sizes), std::move(strides), inner};
           }),
           pybind11::arg("data"), pybind11::arg("sizes"), pybind11::arg("strides"), pybind11::arg("inner"));
  module.def("largest_magnitude_bits", &largest_magnitude_bits,
             "per bfloat16 tensor, the largest (bits & 0x7FFF): its largest |x|, 0x7F80 for inf, above for NaN",
             pybind11::arg("tensors"),
             // the GIL is released while it runs, as PyTorch's own reductions do
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
