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
// Two passes, each split over the threads (where the work is worth a
// fork): the shrink (each row's r values, a dot product over `in` each,
// A's rows in the outer loop, four of them at a time) and the expand
// (each output a dot product over r; 16 outputs at a time when r is a
// multiple of 16, their products kept in lanes until one transposed sum,
// B's rows in the outer loop).  `a` and `b` are float32 or bfloat16 (the
// adapters' dtype), the input and `out` float32 or bfloat16; products and
// sums are float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "simd.h"

namespace {

using namespace spyre_kernels;

// out[0..15] of 16 adjacent outputs of a slice: the dot products of h
// (r values) with 16 rows of b (r each), r a multiple of kLanes.
template <typename W>
inline vfloat_u expand16(const float* h, const W* b, int64_t R) {
  vfloat_u acc[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) acc[j] = vfloat_u{};
  for (int64_t r = 0; r < R; r += kLanes) {
    const vfloat_u hv = load(h + r);
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += load(b + j * R + r) * hv;
  }
  return transpose_sum(acc);
}

// Multiply-adds per task of at::parallel_for: a decode step's few rows
// stay on one thread where a fork would cost more than the work.
constexpr int64_t kTaskWork = 32768;

template <typename W, typename Y>
void run_slice(const float* x, const W* a, const W* b, const int64_t* slots,
               float scale, int64_t T, int64_t S, int64_t R, int64_t in,
               int64_t n, int64_t width, float* h, Y* y, int64_t y_stride) {
  // Shrink: each of the r rows of a slot's A is read once for every row of
  // the step on that slot.
  const int64_t r_grain = std::max<int64_t>(1, kTaskWork / (T * in + 1));
  at::parallel_for(0, R, r_grain, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    // Four of A's rows at a time: four independent sums in flight (one
    // dot product's sum waits on its previous step), each in the order
    // `dot` sums.
    for (; r + 4 <= end && in % kLanes == 0; r += 4) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0 || s >= S) {
          for (int64_t q = 0; q < 4; ++q) h[t * R + r + q] = 0.f;
          continue;
        }
        const float* xt = x + t * in;
        const W* a0 = a + (s * R + r) * in;
        vfloat_u acc[4] = {};
        for (int64_t i = 0; i < in; i += kLanes) {
          const vfloat_u xv = load(xt + i);
          for (int64_t q = 0; q < 4; ++q)
            acc[q] += xv * load(a0 + q * in + i);
        }
        for (int64_t q = 0; q < 4; ++q)
          h[t * R + r + q] = scale * lane_sum(acc[q]);
      }
    }
    for (; r < end; ++r) {
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        h[t * R + r] = (s >= 0 && s < S)
                           ? scale * dot(x + t * in, a + (s * R + r) * in,
                                         in)
                           : 0.f;
      }
    }
  });
  // Expand: 16 outputs at a time, their rows of B read once for every
  // row of the step.
  const int64_t tiles = (width + kLanes - 1) / kLanes;
  const bool vector_r = R % kLanes == 0;
  const int64_t tile_grain =
      std::max<int64_t>(1, kTaskWork / (T * kLanes * R + 1));
  at::parallel_for(0, tiles, tile_grain, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      const int64_t o0 = tile * kLanes;
      const int64_t m = std::min<int64_t>(kLanes, width - o0);
      for (int64_t t = 0; t < T; ++t) {
        const int64_t s = slots[t];
        if (s < 0 || s >= S) continue;
        const float* ht = h + t * R;
        const W* bt = b + (s * n + o0) * R;
        Y* yt = y + t * y_stride + o0;
        if (vector_r && m == kLanes) {
          const vfloat_u sums = expand16(ht, bt, R);
          for (int64_t j = 0; j < kLanes; ++j)
            yt[j] = static_cast<Y>(static_cast<float>(yt[j]) + sums[j]);
        } else {
          for (int64_t j = 0; j < m; ++j)
            yt[j] = static_cast<Y>(static_cast<float>(yt[j]) +
                                   dot(ht, bt + j * R, R));
        }
      }
    }
  });
}

// One slice: out[:, offset : offset + width] += its product.
void add_slice(const at::Tensor& out, const at::Tensor& x,
               const at::Tensor& a_stacked, const at::Tensor& b_stacked,
               const int64_t* slots, float scale, int64_t offset,
               int64_t width) {
  const int64_t T = x.size(0), in = x.size(1);
  const at::ScalarType w = a_stacked.scalar_type();
  TORCH_CHECK(float_or_bf16(w) && b_stacked.scalar_type() == w,
              "lora_add_: a and b must both be float32 or both bfloat16");
  const int64_t S = a_stacked.size(0);
  const at::Tensor a =
      a_stacked.reshape({S, -1, a_stacked.size(-1)}).contiguous();
  const at::Tensor b =
      b_stacked.reshape({S, b_stacked.size(-2), b_stacked.size(-1)})
          .contiguous();
  const int64_t R = a.size(1), n = b.size(1);
  TORCH_CHECK(a.size(2) == in, "lora_add_: a takes ", a.size(2),
              " inputs, the rows have ", in);
  TORCH_CHECK(b.size(0) == S && b.size(2) == R, "lora_add_: b of shape ",
              b.sizes(), " for ", S, " slots of rank ", R);
  width = std::min(width, n);
  TORCH_CHECK(offset >= 0 && offset + width <= out.size(1),
              "lora_add_: columns ", offset, " to ", offset + width,
              " of an output of ", out.size(1));
  at::Tensor h = at::empty({T, R}, x.options());
  const float* xp = x.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const int64_t ys = out.stride(0);
  const bool wf = w == at::kFloat, yf = out.scalar_type() == at::kFloat;
  using BF = c10::BFloat16;
  if (wf && yf) {
    run_slice(xp, a.data_ptr<float>(), b.data_ptr<float>(), slots, scale, T,
              S, R, in, n, width, hp, out.data_ptr<float>() + offset, ys);
  } else if (wf) {
    run_slice(xp, a.data_ptr<float>(), b.data_ptr<float>(), slots, scale, T,
              S, R, in, n, width, hp, out.data_ptr<BF>() + offset, ys);
  } else if (yf) {
    run_slice(xp, a.data_ptr<BF>(), b.data_ptr<BF>(), slots, scale, T, S, R,
              in, n, width, hp, out.data_ptr<float>() + offset, ys);
  } else {
    run_slice(xp, a.data_ptr<BF>(), b.data_ptr<BF>(), slots, scale, T, S, R,
              in, n, width, hp, out.data_ptr<BF>() + offset, ys);
  }
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
  const int64_t in = input.size(-1);
  const at::Tensor x = input.reshape({-1, in}).to(at::kFloat).contiguous();
  TORCH_CHECK(out.size(0) == x.size(0), "lora_add_: ", out.size(0),
              " output rows for ", x.size(0), " input rows");
  TORCH_CHECK(slots.numel() >= x.size(0), "lora_add_: ", slots.numel(),
              " slots for ", x.size(0), " rows");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  add_slice(out, x, a0, b0, sp, sc, 0, width0);
  if (a1.has_value()) add_slice(out, x, *a1, *b1, sp, sc, width0, width1);
  if (a2.has_value())
    add_slice(out, x, *a2, *b2, sp, sc, width0 + width1, width2);
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
