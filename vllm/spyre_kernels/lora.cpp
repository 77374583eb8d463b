// The adapters' products of a LoRA layer over the rows of one forward
// (vllm/lora/punica_wrapper/spyre_punica.py), added to the base layer's
// output in place, every slice of the layer in one call (q, k and v of a
// fused projection are three; gate and up two):
//
// lora_add_(out [T, N], input [T, in], a0 [S, (1,) r, in],
//           b0 [S, (1,) n0, r], a1?, b1?, a2?, b2?, slots [T] int64,
//           scale, width0, width1, width2)
//
//   out[t, o_i + j] += scale * (b_i[s] @ (a_i[s] @ input[t]))[j]
//
// for each slice i at column offset o_i (width0 + ... + width_{i-1}),
// j < min(width_i, n_i), and s = slots[t] >= 0; rows with s < 0 (no
// adapter) are left as they are.  `a` and `b` are the stacked matrices of
// every adapter slot that vLLM's LoRA layers hold (S slots of rank r, a
// smaller adapter's rows and columns zero); each row reads only its own
// slot's: T * r * (in + n) products, whatever the other slots hold.  One
// call per layer, and its arguments plain (optional) tensors and numbers,
// so that inductor's C++ wrapper calls it as it calls the linear kernels
// (a list argument costs it minutes of compiling per graph).
//
// Each slot's B is laid out in tiles (spyre_punica.tile_b_, once an
// adapter is copied into its slot): 16 adjacent outputs a tile, the tile's
// r rows of 16 values each, so that a tile is one contiguous block read as
// r vectors of outputs (the last tile, of n % 16 outputs, r rows of those).
//
// The rows are grouped by slot, so that a slot's matrices are read once
// for all its rows.  Two passes over every slice of the call, in one
// parallel region (one fork and one barrier a call, where the work is
// worth them): the shrink (each row's r values, a dot product over `in`
// each, four of A's rows and two rows of the step at a time), then the
// expand (a tile of B a task: each row's 16 outputs, r multiply-adds of a
// row of the tile by one of the row's r values).  `a` and `b` are float32
// or bfloat16 (the adapters' dtype), the input and `out` float32 or
// bfloat16; products and sums are float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

using namespace spyre_kernels;

// Multiply-adds of a call below which it runs on one thread: a decode
// step's few rows at a small rank, where a fork would cost more than the
// work.
constexpr int64_t kParallelWork = 32768;

// y[0..15] += v.
inline void add_lanes(float* y, vfloat_u v) {
  *reinterpret_cast<vfloat_u*>(y) = load(y) + v;
}
inline void add_lanes(c10::BFloat16* y, vfloat_u v) {
  const vfloat_u sum = load(y) + v;
  for (int64_t j = 0; j < kLanes; ++j)
    y[j] = static_cast<c10::BFloat16>(sum[j]);
}

// The rows of a step grouped by slot: order[first[s] .. first[s + 1]) are
// the rows on slot s, in order; rows on no slot (< 0, or >= S) are left out.
struct Groups {
  std::vector<int64_t> order, first;
  Groups(const int64_t* slots, int64_t T, int64_t S) : first(S + 1, 0) {
    for (int64_t t = 0; t < T; ++t)
      if (slots[t] >= 0 && slots[t] < S) ++first[slots[t] + 1];
    for (int64_t s = 0; s < S; ++s) first[s + 1] += first[s];
    order.resize(first[S]);
    std::vector<int64_t> next(first.begin(), first.end() - 1);
    for (int64_t t = 0; t < T; ++t)
      if (slots[t] >= 0 && slots[t] < S) order[next[slots[t]]++] = t;
  }
  int64_t slots() const { return static_cast<int64_t>(first.size()) - 1; }
};

// One slice of the call: its stacked matrices (S slots of rank R), B's n
// outputs of which the first `width` are added at column `offset`, and
// its rows' shrunk values h [T, R].
template <typename W>
struct Slice {
  const W* a;
  const W* b;
  int64_t R, n, width, offset;
  float* h;
};

// Shrink: h[t, r0 .. r1) of every row on a slot, r1 - r0 <= 4.
template <typename W>
void shrink(const float* x, const Slice<W>& sl, const Groups& g, float scale,
            int64_t in, int64_t r0, int64_t r1) {
  const int64_t R = sl.R;
  for (int64_t s = 0; s < g.slots(); ++s) {
    const int64_t* rows = g.order.data() + g.first[s];
    const int64_t count = g.first[s + 1] - g.first[s];
    const W* a0 = sl.a + (s * R + r0) * in;
    if (r1 - r0 < 4 || in % kLanes != 0) {
      for (int64_t i = 0; i < count; ++i)
        for (int64_t r = r0; r < r1; ++r)
          sl.h[rows[i] * R + r] =
              scale * dot(x + rows[i] * in, a0 + (r - r0) * in, in);
      continue;
    }
    // Two rows by four of A's rows: eight independent sums, each in the
    // order `dot` sums.
    int64_t i = 0;
    for (; i + 2 <= count; i += 2) {
      const float* x0 = x + rows[i] * in;
      const float* x1 = x + rows[i + 1] * in;
      vfloat_u acc0[4] = {}, acc1[4] = {};
      for (int64_t k = 0; k < in; k += kLanes) {
        const vfloat_u xv0 = load(x0 + k), xv1 = load(x1 + k);
        for (int64_t q = 0; q < 4; ++q) {
          const vfloat_u av = load(a0 + q * in + k);
          acc0[q] += xv0 * av;
          acc1[q] += xv1 * av;
        }
      }
      for (int64_t q = 0; q < 4; ++q) {
        sl.h[rows[i] * R + r0 + q] = scale * lane_sum(acc0[q]);
        sl.h[rows[i + 1] * R + r0 + q] = scale * lane_sum(acc1[q]);
      }
    }
    if (i < count) {
      const float* x0 = x + rows[i] * in;
      vfloat_u acc0[4] = {};
      for (int64_t k = 0; k < in; k += kLanes) {
        const vfloat_u xv0 = load(x0 + k);
        for (int64_t q = 0; q < 4; ++q) acc0[q] += xv0 * load(a0 + q * in + k);
      }
      for (int64_t q = 0; q < 4; ++q)
        sl.h[rows[i] * R + r0 + q] = scale * lane_sum(acc0[q]);
    }
  }
}

// Expand: outputs o0 .. o0 + 16 of the slice (one tile of B) for every row
// on a slot, the slot's tile read once for all its rows.
template <typename W, typename Y>
void expand(const Slice<W>& sl, const Groups& g, Y* y, int64_t y_stride,
            int64_t tile) {
  const int64_t R = sl.R, o0 = tile * kLanes;
  const int64_t lanes = std::min<int64_t>(kLanes, sl.n - o0);  // stored
  const int64_t m = std::min<int64_t>(kLanes, sl.width - o0);  // added
  Y* yo = y + sl.offset + o0;
  for (int64_t s = 0; s < g.slots(); ++s) {
    const W* bt = sl.b + (s * sl.n + o0) * R;
    const int64_t* rows = g.order.data() + g.first[s];
    const int64_t count = g.first[s + 1] - g.first[s];
    if (lanes == kLanes && m == kLanes) {
      int64_t i = 0;
      for (; i + 2 <= count; i += 2) {
        const float* h0 = sl.h + rows[i] * R;
        const float* h1 = sl.h + rows[i + 1] * R;
        vfloat_u acc0{}, acc1{};
        for (int64_t r = 0; r < R; ++r) {
          const vfloat_u bv = load(bt + r * kLanes);
          acc0 += bv * h0[r];
          acc1 += bv * h1[r];
        }
        add_lanes(yo + rows[i] * y_stride, acc0);
        add_lanes(yo + rows[i + 1] * y_stride, acc1);
      }
      if (i < count) {
        const float* h0 = sl.h + rows[i] * R;
        vfloat_u acc0{};
        for (int64_t r = 0; r < R; ++r) acc0 += load(bt + r * kLanes) * h0[r];
        add_lanes(yo + rows[i] * y_stride, acc0);
      }
      continue;
    }
    for (int64_t i = 0; i < count; ++i) {
      const float* ht = sl.h + rows[i] * R;
      Y* yt = yo + rows[i] * y_stride;
      for (int64_t j = 0; j < m; ++j) {
        float sum = 0.f;
        for (int64_t r = 0; r < R; ++r)
          sum += ht[r] * static_cast<float>(bt[r * lanes + j]);
        yt[j] = static_cast<Y>(static_cast<float>(yt[j]) + sum);
      }
    }
  }
}

// Every slice of the call: the shrink's tasks (a slice's A rows, four at
// a time), a barrier, the expand's (a slice's tiles).
template <typename W, typename Y>
void run(const float* x, const std::vector<Slice<W>>& slices,
         const Groups& g, float scale, int64_t in, Y* y, int64_t y_stride) {
  std::vector<int64_t> shrink_end, expand_end;  // tasks up to each slice
  int64_t shrinks = 0, expands = 0, work = 0;
  const int64_t rows = static_cast<int64_t>(g.order.size());
  for (const Slice<W>& sl : slices) {
    shrinks += (sl.R + 3) / 4;
    expands += (sl.width + kLanes - 1) / kLanes;
    shrink_end.push_back(shrinks);
    expand_end.push_back(expands);
    work += rows * sl.R * (in + sl.width);
  }
  auto slice_of = [](const std::vector<int64_t>& ends, int64_t task) {
    int64_t i = 0;
    while (task >= ends[i]) ++i;
    return i;
  };
  const int threads = (work < kParallelWork || at::in_parallel_region())
                          ? 1
                          : at::get_num_threads();
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t task = 0; task < shrinks; ++task) {
      const int64_t i = slice_of(shrink_end, task);
      const int64_t r0 = (task - (i ? shrink_end[i - 1] : 0)) * 4;
      const Slice<W>& sl = slices[i];
      shrink(x, sl, g, scale, in, r0, std::min<int64_t>(r0 + 4, sl.R));
    }
#pragma omp for schedule(static)
    for (int64_t task = 0; task < expands; ++task) {
      const int64_t i = slice_of(expand_end, task);
      expand(slices[i], g, y, y_stride,
             task - (i ? expand_end[i - 1] : 0));
    }
  }
}

// A stacked tensor's data as W, contiguous (a copy only if it is not).
template <typename W>
const W* data_of(const at::Tensor& t, std::vector<at::Tensor>& keep) {
  if (t.is_contiguous()) return t.data_ptr<W>();
  keep.push_back(t.contiguous());
  return keep.back().data_ptr<W>();
}

template <typename W, typename Y>
void add_slices(const at::Tensor& out, const float* x, int64_t T,
                int64_t in, const at::Tensor* ab[3][2],
                const int64_t widths[3], const Groups& g, float scale) {
  std::vector<Slice<W>> slices;
  std::vector<at::Tensor> keep;
  int64_t offset = 0;
  for (int i = 0; i < 3 && ab[i][0] != nullptr; ++i) {
    const at::Tensor& a = *ab[i][0];
    const at::Tensor& b = *ab[i][1];
    const int64_t S = a.size(0), R = a.size(-2), n = b.size(-2);
    TORCH_CHECK(a.size(-1) == in, "lora_add_: a takes ", a.size(-1),
                " inputs, the rows have ", in);
    TORCH_CHECK(a.numel() == S * R * in, "lora_add_: a of shape ",
                a.sizes(), " is not [slots, (1,) rank, inputs]");
    TORCH_CHECK(b.size(0) == S && b.size(-1) == R && b.numel() == S * n * R,
                "lora_add_: b of shape ", b.sizes(), " for ", S,
                " slots of rank ", R);
    TORCH_CHECK(S == g.slots(), "lora_add_: slices of ", S, " and ",
                g.slots(), " slots");
    const int64_t width = std::min(widths[i], n);
    TORCH_CHECK(offset + width <= out.size(1), "lora_add_: columns ",
                offset, " to ", offset + width, " of an output of ",
                out.size(1));
    slices.push_back(Slice<W>{data_of<W>(a, keep), data_of<W>(b, keep), R,
                              n, width, offset, nullptr});
    offset += widths[i];
  }
  int64_t h_size = 0;
  for (const Slice<W>& sl : slices) h_size += T * sl.R;
  std::vector<float> h(static_cast<size_t>(h_size));
  h_size = 0;
  for (Slice<W>& sl : slices) {
    sl.h = h.data() + h_size;
    h_size += T * sl.R;
  }
  run(x, slices, g, scale, in, out.data_ptr<Y>(), out.stride(0));
}

// Up to three slices of one layer (q, k and v of a fused projection), at
// adjacent columns from 0: the first `width0`, then `width1`, `width2`.
void lora_add_(const at::Tensor& out, const at::Tensor& input,
               const at::Tensor& a0, const at::Tensor& b0,
               const std::optional<at::Tensor>& a1,
               const std::optional<at::Tensor>& b1,
               const std::optional<at::Tensor>& a2,
               const std::optional<at::Tensor>& b2, const at::Tensor& slots,
               double scale, int64_t width0, int64_t width1,
               int64_t width2) {
  TORCH_CHECK(float_or_bf16(input.scalar_type()) &&
                  float_or_bf16(out.scalar_type()),
              "lora_add_: the input and the output must be float32 or "
              "bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong,
              "lora_add_: slots must be int64");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1,
              "lora_add_: the output must be [rows, columns], its columns "
              "adjacent");
  TORCH_CHECK(a1.has_value() == b1.has_value() &&
                  a2.has_value() == b2.has_value() &&
                  (a1.has_value() || !a2.has_value()),
              "lora_add_: each slice needs its a and its b, in order");
  const at::ScalarType w = a0.scalar_type();
  for (const at::Tensor* t : {&b0, a1 ? &*a1 : &a0, b1 ? &*b1 : &a0,
                              a2 ? &*a2 : &a0, b2 ? &*b2 : &a0})
    TORCH_CHECK(float_or_bf16(w) && t->scalar_type() == w,
                "lora_add_: every a and b must be float32, or every one "
                "bfloat16");
  const int64_t in = input.size(-1);
  const at::Tensor x =
      (input.scalar_type() == at::kFloat && input.is_contiguous())
          ? input
          : input.to(at::kFloat).contiguous();
  const int64_t T = x.numel() / std::max<int64_t>(in, 1);
  TORCH_CHECK(out.size(0) == T, "lora_add_: ", out.size(0),
              " output rows for ", T, " input rows");
  TORCH_CHECK(slots.numel() >= T, "lora_add_: ", slots.numel(),
              " slots for ", T, " rows");
  const at::Tensor sl = slots.contiguous();
  const Groups groups(sl.data_ptr<int64_t>(), T, a0.size(0));
  const at::Tensor* ab[3][2] = {
      {&a0, &b0},
      {a1 ? &*a1 : nullptr, b1 ? &*b1 : nullptr},
      {a2 ? &*a2 : nullptr, b2 ? &*b2 : nullptr}};
  const int64_t widths[3] = {width0, width1, width2};
  const float sc = static_cast<float>(scale);
  const float* xp = x.data_ptr<float>();
  using BF = c10::BFloat16;
  const bool wf = w == at::kFloat, yf = out.scalar_type() == at::kFloat;
  if (wf && yf)
    add_slices<float, float>(out, xp, T, in, ab, widths, groups, sc);
  else if (wf)
    add_slices<float, BF>(out, xp, T, in, ab, widths, groups, sc);
  else if (yf)
    add_slices<BF, float>(out, xp, T, in, ab, widths, groups, sc);
  else
    add_slices<BF, BF>(out, xp, T, in, ab, widths, groups, sc);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "lora_add_(Tensor(a!) out, Tensor input, Tensor a0, Tensor b0, "
      "Tensor? a1, Tensor? b1, Tensor? a2, Tensor? b2, Tensor slots, "
      "float scale, int width0, int width1, int width2) -> ()");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("lora_add_", &lora_add_);
}
