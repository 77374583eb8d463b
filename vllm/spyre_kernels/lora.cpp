// The adapters' products of a LoRA layer over the rows of one forward
// (vllm/lora/punica_wrapper/spyre_punica.py), added to the base layer's
// output in place:
//
// lora_add_(out [T, N], input [T, in], a[i] [S, (1,) r, in],
//           b[i] [S, (1,) n_i, r], slots [T] int64, scale, widths[i])
//
//   out[t, o_i + j] += scale * (b[i][s] @ (a[i][s] @ input[t]))[j]
//
// for each slice i of the layer (q, k and v of a fused projection; one
// slice otherwise) at column offset o_i = widths[0] + ... + widths[i-1],
// j < widths[i], and s = slots[t] >= 0; rows with s < 0 (no adapter) are
// left as they are.  `a` and `b` are the stacked matrices of every
// adapter slot that vLLM's LoRA layers hold (S slots of rank r, a smaller
// adapter's rows and columns zero); each row reads only its own slot's:
// T * r * (in + n) products, whatever the other slots hold.  One op per
// layer, so that a step's LoRA costs one call per layer, not a chain of
// small ops per slice.
//
// Two passes per slice, each split over the threads: the shrink (each
// row's r values, a dot product over `in` each) and the expand (each
// output a dot product over r; 16 outputs at a time when r is a multiple
// of 16, their products kept in lanes until one transposed sum).  `a` and
// `b` are float32 or bfloat16 (the adapters' dtype), the input and `out`
// float32 or bfloat16; products and sums are float32.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
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

// out[0..15] of 16 adjacent outputs of a slice: the dot products of h
// (r values) with 16 rows of b (r each), r a multiple of kLanes.
template <typename W>
inline vfloat_u expand16(const float* h, const W* b, int64_t R) {
  vfloat_u acc[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) acc[j] = vfloat_u{};
  for (int64_t r = 0; r < R; r += kLanes) {
    const vfloat hv = load(h + r);
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += load(b + j * R + r) * hv;
  }
  return transpose_sum(acc);
}

template <typename W, typename Y>
void run_slice(const float* x, const W* a, const W* b, const int64_t* slots,
               float scale, int64_t T, int64_t S, int64_t R, int64_t in,
               int64_t n, int64_t width, float* h, Y* y, int64_t y_stride) {
  at::parallel_for(0, T * R, kShrinkGrain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / R, r = i % R, s = slots[t];
      h[i] = (s >= 0 && s < S)
                 ? scale * dot(x + t * in, a + (s * R + r) * in, in)
                 : 0.f;
    }
  });
  const int64_t tiles = (width + kLanes - 1) / kLanes;
  const bool vector_r = R % kLanes == 0;
  at::parallel_for(0, T * tiles, kExpandGrain, [&](int64_t begin,
                                                   int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / tiles, o0 = (i % tiles) * kLanes, s = slots[t];
      if (s < 0 || s >= S) continue;
      const float* ht = h + t * R;
      const W* bt = b + (s * n + o0) * R;
      Y* yt = y + t * y_stride + o0;
      const int64_t m = std::min<int64_t>(kLanes, width - o0);
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
  });
}

template <typename W, typename Y>
void run(const at::Tensor& out, const at::Tensor& x, at::TensorList a_list,
         at::TensorList b_list, const int64_t* slots, float scale,
         at::IntArrayRef widths) {
  const int64_t T = x.size(0), in = x.size(1);
  Y* y = out.data_ptr<Y>();
  const int64_t y_stride = out.stride(0);
  int64_t offset = 0;
  for (size_t i = 0; i < a_list.size(); ++i) {
    const at::Tensor& a_stacked = a_list[i];
    const at::Tensor& b_stacked = b_list[i];
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
    const int64_t width = std::min(widths[i], n);
    TORCH_CHECK(offset + width <= out.size(1), "lora_add_: slices of ",
                offset + width, " columns for an output of ", out.size(1));
    at::Tensor h = at::empty({T, R}, x.options());
    run_slice(x.data_ptr<float>(), a.data_ptr<W>(), b.data_ptr<W>(), slots,
              scale, T, S, R, in, n, width, h.data_ptr<float>(), y + offset,
              y_stride);
    offset += widths[i];
  }
}

void lora_add_(const at::Tensor& out, const at::Tensor& input,
               at::TensorList a, at::TensorList b, const at::Tensor& slots,
               double scale, at::IntArrayRef widths) {
  TORCH_CHECK(a.size() == b.size() && a.size() == widths.size() &&
                  !a.empty(),
              "lora_add_: one a, one b and one width per slice");
  TORCH_CHECK(float_or_bf16(input.scalar_type()) &&
                  float_or_bf16(out.scalar_type()),
              "lora_add_: the input and the output must be float32 or "
              "bfloat16");
  const at::ScalarType w = a[0].scalar_type();
  TORCH_CHECK(float_or_bf16(w), "lora_add_: a and b must be float32 or "
              "bfloat16, got ", w);
  for (size_t i = 0; i < a.size(); ++i)
    TORCH_CHECK(a[i].scalar_type() == w && b[i].scalar_type() == w,
                "lora_add_: every a and b must have one dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong,
              "lora_add_: slots must be int64");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1,
              "lora_add_: the output must be [rows, columns], its columns "
              "adjacent");
  const int64_t in = input.size(-1);
  const at::Tensor x = input.reshape({-1, in}).to(at::kFloat).contiguous();
  TORCH_CHECK(out.size(0) == x.size(0), "lora_add_: ", out.size(0),
              " output rows for ", x.size(0), " input rows");
  TORCH_CHECK(slots.numel() >= x.size(0), "lora_add_: ", slots.numel(),
              " slots for ", x.size(0), " rows");
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const bool wf = w == at::kFloat, yf = out.scalar_type() == at::kFloat;
  if (wf && yf) {
    run<float, float>(out, x, a, b, sp, sc, widths);
  } else if (wf) {
    run<float, c10::BFloat16>(out, x, a, b, sp, sc, widths);
  } else if (yf) {
    run<c10::BFloat16, float>(out, x, a, b, sp, sc, widths);
  } else {
    run<c10::BFloat16, c10::BFloat16>(out, x, a, b, sp, sc, widths);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "lora_add_(Tensor(a!) out, Tensor input, Tensor[] a, Tensor[] b, "
      "Tensor slots, float scale, int[] widths) -> ()");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("lora_add_", &lora_add_);
}
