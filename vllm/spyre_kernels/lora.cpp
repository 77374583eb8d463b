// The adapters' products of a LoRA layer over the rows of one forward
// (vllm/lora/punica_wrapper/spyre_punica.py).
//
// lora_delta(input [T, in], a [S, (1,) r, in], b [S, (1,) out, r],
//            slots [T] int64, scale) -> [T, out] float32
//
//   delta[t] = scale * (b[s] @ (a[s] @ input[t]))  with s = slots[t] >= 0,
//   delta[t] = 0                                   with s < 0 (no adapter).
//
// `a` and `b` are the stacked matrices of every adapter slot that vLLM's
// LoRA layers hold (S slots of rank r, a smaller adapter's rows and
// columns zero); each row reads only its own slot's: T * r * (in + out)
// products, whatever the other slots hold.  Two passes: the shrink (each
// row's r values, a dot product over `in` each) and the expand (each
// output, a dot product over r), each split over the threads.  `a` and
// `b` are float32 or bfloat16 (the adapters' dtype), the input float32 or
// bfloat16; products and sums are float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cstdint>

#include "simd.h"

namespace {

using namespace spyre_kernels;

// Dot products per task of at::parallel_for.
constexpr int64_t kShrinkGrain = 8;
constexpr int64_t kExpandGrain = 256;

inline float lane_sum(vfloat v) {
  float s = 0.f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// kLanes weights from `w` as float32 lanes.
inline vfloat load(const float* w) { return *(const vfloat_u*)w; }
inline vfloat load(const c10::BFloat16* w) {
  const vhalf_u bits = *(const vhalf_u*)w;
  return (vfloat)(__builtin_convertvector(bits, vuint) << 16);
}

template <typename W>
inline float dot(const float* x, const W* w, int64_t n) {
  vfloat acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(x + i) * load(w + i);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += x[i] * static_cast<float>(w[i]);
  return s;
}

template <typename W>
void run(const float* x, const W* a, const W* b, const int64_t* slots,
         float scale, int64_t T, int64_t S, int64_t R, int64_t in,
         int64_t out, float* h, float* y) {
  at::parallel_for(0, T * R, kShrinkGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / R, r = i % R, s = slots[t];
      h[i] = (s >= 0 && s < S)
                 ? scale * dot(x + t * in, a + (s * R + r) * in, in)
                 : 0.f;
    }
  });
  at::parallel_for(0, T * out, kExpandGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / out, o = i % out, s = slots[t];
      y[i] = (s >= 0 && s < S) ? dot(h + t * R, b + (s * out + o) * R, R)
                               : 0.f;
    }
  });
}

at::Tensor lora_delta(const at::Tensor& input, const at::Tensor& a_stacked,
                      const at::Tensor& b_stacked, const at::Tensor& slots,
                      double scale) {
  TORCH_CHECK(float_or_bf16(input.scalar_type()),
              "lora_delta: the input must be float32 or bfloat16, got ",
              input.scalar_type());
  TORCH_CHECK(a_stacked.scalar_type() == b_stacked.scalar_type() &&
                  float_or_bf16(a_stacked.scalar_type()),
              "lora_delta: a and b must both be float32 or both bfloat16");
  TORCH_CHECK(slots.scalar_type() == at::kLong,
              "lora_delta: slots must be int64");
  const int64_t in = input.size(-1);
  const at::Tensor x = input.reshape({-1, in}).to(at::kFloat).contiguous();
  const int64_t T = x.size(0);
  TORCH_CHECK(slots.numel() >= T, "lora_delta: ", slots.numel(),
              " slots for ", T, " rows");
  const int64_t S = a_stacked.size(0);
  const at::Tensor a =
      a_stacked.reshape({S, -1, a_stacked.size(-1)}).contiguous();
  const at::Tensor b = b_stacked
                           .reshape({b_stacked.size(0), b_stacked.size(-2),
                                     b_stacked.size(-1)})
                           .contiguous();
  const int64_t R = a.size(1), out = b.size(1);
  TORCH_CHECK(a.size(2) == in, "lora_delta: a takes ", a.size(2),
              " inputs, the rows have ", in);
  TORCH_CHECK(b.size(0) == S && b.size(2) == R, "lora_delta: b of shape ",
              b.sizes(), " for ", S, " slots of rank ", R);
  const at::Tensor sl = slots.contiguous();
  at::Tensor h = at::empty({T, R}, x.options());
  at::Tensor y = at::empty({T, out}, x.options());
  if (a.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(),
        sl.data_ptr<int64_t>(), static_cast<float>(scale), T, S, R, in, out,
        h.data_ptr<float>(), y.data_ptr<float>());
  } else {
    run(x.data_ptr<float>(), a.data_ptr<c10::BFloat16>(),
        b.data_ptr<c10::BFloat16>(), sl.data_ptr<int64_t>(),
        static_cast<float>(scale), T, S, R, in, out, h.data_ptr<float>(),
        y.data_ptr<float>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "lora_delta(Tensor input, Tensor a, Tensor b, Tensor slots, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("lora_delta", &lora_delta);
}
