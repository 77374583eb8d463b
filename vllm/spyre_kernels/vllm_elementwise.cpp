// vLLM's custom ops in their native forms, each in one pass: what vLLM's
// model code runs on a platform that is not CUDA's, as a chain of PyTorch
// ops that `eager` dispatches one by one (the model code's norms, rotary
// embeddings and gated activations, twice or once per decoder layer).
// Each kernel takes the native form's steps in its order and dtypes
// (float32, or bfloat16 with every intermediate the native form rounds
// rounded here too), so that it gives the native form's results:
//
// * add_rms_norm: RMSNorm.forward_native, residual add included:
//   s = x (+ residual) in float32, the new residual s in the input's
//   dtype, y = round(round(s * rsqrt(mean(s^2) + eps)) * weight), each
//   round to the input's dtype (the squares are summed in kLanes partial
//   sums, as elementwise.cpp's rms_norm does: the last bit may differ);
// * rotary_cos_sin: RotaryEmbedding.forward_native over vLLM's table of
//   cos | sin per position: for each pair (x1, x2) of a head's rotated
//   dims (halves in the NeoX style, neighbours otherwise),
//   o1 = round(round(x1 c) - round(x2 s)), o2 = round(round(x2 c) +
//   round(x1 s)), c and s the table's values in x's dtype; dims past the
//   rotated ones copied;
// * silu_and_mul: SiluAndMul.forward_native, round(round(silu(a)) * b)
//   for the two halves a, b of each row (silu(a) = a / (1 + exp(-a)) in
//   float32, exp within 2 units of its last place: PyTorch's may differ
//   there, which a bfloat16 rounding almost always hides).
//
// Used under `eager` by vllm/model_executor/layers/spyre_vllm_fused_ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

using namespace spyre_kernels;

constexpr int64_t kRowGrain = 16;

// x's dtype's rounding of a float32 value (none for float32).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <typename T>
void add_rms_norm_rows(const T* xp, const T* rp, const T* wp, T* yp, T* sp,
                       int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    std::vector<float> s(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = xp + r * H;
      for (int64_t i = 0; i < H; ++i)
        s[i] = rp ? static_cast<float>(xr[i]) +
                        static_cast<float>(rp[r * H + i])
                  : static_cast<float>(xr[i]);
      if (sp)
        for (int64_t i = 0; i < H; ++i) sp[r * H + i] = static_cast<T>(s[i]);
      vfloat acc{};
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) {
        const vfloat v = *reinterpret_cast<const vfloat_u*>(s.data() + i);
        acc += v * v;
      }
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
      for (; i < H; ++i) sum += s[i] * s[i];
      const float scale = 1.f / std::sqrt(sum / H + eps);
      T* yr = yp + r * H;
      for (int64_t i = 0; i < H; ++i)
        yr[i] = static_cast<T>(
            static_cast<float>(static_cast<T>(s[i] * scale)) *
            static_cast<float>(wp[i]));
    }
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(
    const at::Tensor& input, const std::optional<at::Tensor>& residual,
    const at::Tensor& weight, double eps) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(float_or_bf16(dtype) && weight.scalar_type() == dtype,
              "add_rms_norm: float32 or bfloat16 inputs and a weight of "
              "their dtype, got ", dtype, " and ", weight.scalar_type());
  const int64_t H = input.size(-1);
  TORCH_CHECK(weight.numel() == H, "add_rms_norm: a weight of ",
              weight.numel(), " for rows of ", H);
  const bool has_residual = residual.has_value() && residual->defined();
  at::Tensor r;
  if (has_residual) {
    TORCH_CHECK(residual->sizes() == input.sizes() &&
                    residual->scalar_type() == dtype,
                "add_rms_norm: the residual must have the input's shape and "
                "dtype");
    r = residual->contiguous();
  }
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(x);
  at::Tensor sum = has_residual ? at::empty_like(x) : at::empty({0}, x.options());
  const int64_t rows = H ? x.numel() / H : 0;
  const float epsf = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    add_rms_norm_rows<float>(x.data_ptr<float>(),
                             has_residual ? r.data_ptr<float>() : nullptr,
                             w.data_ptr<float>(), y.data_ptr<float>(),
                             has_residual ? sum.data_ptr<float>() : nullptr,
                             rows, H, epsf);
  } else {
    using B = c10::BFloat16;
    add_rms_norm_rows<B>(x.data_ptr<B>(),
                         has_residual ? r.data_ptr<B>() : nullptr,
                         w.data_ptr<B>(), y.data_ptr<B>(),
                         has_residual ? sum.data_ptr<B>() : nullptr, rows,
                         H, epsf);
  }
  return {y, sum};
}


#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
template <typename T, typename C>
void rotate_rows(const T* xp, int64_t row_stride, T* yp, int64_t width,
                 const int64_t* pos, int64_t tokens, const C* cache,
                 int64_t positions, int64_t head, int64_t rot, bool neox) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t p = pos[t];
      TORCH_CHECK(p >= 0 && p < positions, "rotary_cos_sin: position ", p,
                  " outside the table of ", positions);
      const C* cs = cache + p * rot;
      const T* xr = xp + t * row_stride;
      T* yr = yp + t * width;
      for (int64_t h = 0; h < width / head; ++h) {
        const T* x = xr + h * head;
        T* y = yr + h * head;
        for (int64_t i = 0; i < half; ++i) {
          const float c = round_to<T>(static_cast<float>(cs[i]));
          const float s = round_to<T>(static_cast<float>(cs[half + i]));
          const int64_t i1 = neox ? i : 2 * i;
          const int64_t i2 = neox ? half + i : 2 * i + 1;
          const float x1 = static_cast<float>(x[i1]);
          const float x2 = static_cast<float>(x[i2]);
          const float a = round_to<T>(x1 * c), b = round_to<T>(x2 * s);
          const float d = round_to<T>(x2 * c), e = round_to<T>(x1 * s);
          y[i1] = static_cast<T>(a - b);
          y[i2] = static_cast<T>(d + e);
        }
        for (int64_t i = rot; i < head; ++i) y[i] = x[i];
      }
    }
  });
}
#pragma GCC pop_options

// One of query or key [tokens, heads * head] (rows of any stride, unit
// last stride) rotated into a new contiguous tensor.
template <typename T>
at::Tensor rotate_cs(const at::Tensor& x, const at::Tensor& positions,
                     const at::Tensor& cache, int64_t head, int64_t rot,
                     bool neox) {
  const int64_t tokens = positions.numel();
  TORCH_CHECK(x.dim() == 2 && x.size(0) == tokens && x.stride(1) == 1 &&
                  x.size(1) % head == 0,
              "rotary_cos_sin: heads must be [tokens, heads * ", head,
              "] with a unit last stride, got ", x.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t* pos = positions.data_ptr<int64_t>();
  if (cache.scalar_type() == at::kFloat)
    rotate_rows<T, float>(x.data_ptr<T>(), x.stride(0), y.data_ptr<T>(),
                          x.size(1), pos, tokens, cache.data_ptr<float>(),
                          cache.size(0), head, rot, neox);
  else
    rotate_rows<T, c10::BFloat16>(
        x.data_ptr<T>(), x.stride(0), y.data_ptr<T>(), x.size(1), pos,
        tokens, cache.data_ptr<c10::BFloat16>(), cache.size(0), head, rot,
        neox);
  return y;
}

std::tuple<at::Tensor, at::Tensor> rotary_cos_sin(
    const at::Tensor& positions, const at::Tensor& query,
    const std::optional<at::Tensor>& key, const at::Tensor& cache,
    int64_t head_size, int64_t rotary_dim, bool neox) {
  const auto dtype = query.scalar_type();
  TORCH_CHECK(float_or_bf16(dtype) && float_or_bf16(cache.scalar_type()),
              "rotary_cos_sin: float32 or bfloat16 heads and table, got ",
              dtype, " and ", cache.scalar_type());
  TORCH_CHECK(positions.scalar_type() == at::kLong &&
                  positions.is_contiguous(),
              "rotary_cos_sin: contiguous int64 positions");
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == rotary_dim &&
                  cache.is_contiguous() && rotary_dim % 2 == 0 &&
                  rotary_dim <= head_size,
              "rotary_cos_sin: a table [positions, ", rotary_dim,
              "] of cos | sin");
  const bool has_key = key.has_value() && key->defined();
  TORCH_CHECK(!has_key || key->scalar_type() == dtype,
              "rotary_cos_sin: the key must have the query's dtype");
  auto run = [&](const at::Tensor& x) {
    return dtype == at::kFloat
               ? rotate_cs<float>(x, positions, cache, head_size,
                                  rotary_dim, neox)
               : rotate_cs<c10::BFloat16>(x, positions, cache, head_size,
                                          rotary_dim, neox);
  };
  return {run(query), has_key ? run(*key) : at::empty({0}, query.options())};
}

// exp(x) for kLanes floats, within 2 units of float32's last place: x =
// n ln2 + r, |r| <= ln2 / 2 (ln2 in two parts), e^r by its Taylor
// polynomial to degree 7 (Horner), times 2^n built in the exponent bits
// (as 2^(n - 1) * 2 up to the largest float); infinity above 88.72, zero
// below -87.33, where e^x leaves the normal floats (silu's exp(-a) of a
// below -88.72 is infinite: silu is -0, where PyTorch's is a subnormal).
inline vfloat exp_lanes(vfloat x) {
  const vint over = x > 88.72283f, under = x < -87.33654f;
  x = under ? vfloat{} : x;
  x = over ? vfloat{} : x;
  const vfloat n = __builtin_convertvector(
      __builtin_convertvector(x * 1.44269504f + (x < 0.f ? -0.5f : 0.5f),
                              vint),
      vfloat);
  const vfloat r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  vfloat p = vfloat{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const vint bits = (__builtin_convertvector(n, vint) + 126) << 23;
  const vfloat e = p * reinterpret_cast<vfloat>(bits) * 2.f;
  const vfloat inf = vfloat{} + __builtin_inff();
  return over ? inf : under ? vfloat{} : e;
}

// kLanes floats rounded to T (bfloat16: to nearest, ties to even, as
// c10::BFloat16 rounds; finite values) and back; float32: as they are.
template <typename T>
inline vfloat round_lanes(vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const vuint u = reinterpret_cast<vuint>(v);
    return reinterpret_cast<vfloat>(
        ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16) << 16);
  }
}

template <typename T>
inline void store_lanes(T* y, vfloat v) {
  if constexpr (std::is_same_v<T, float>) {
    *reinterpret_cast<vfloat_u*>(y) = v;
  } else {
    // v holds bfloat16 values already (round_lanes): their high halves.
    const vuint u = reinterpret_cast<vuint>(v) >> 16;
    *reinterpret_cast<vhalf_u*>(y) = __builtin_convertvector(
        u, decltype(vhalf_u{}));
  }
}

template <typename T>
void silu_mul_rows(const T* xp, int64_t ldx, T* yp, int64_t rows,
                   int64_t d) {
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* a = xp + r * ldx;
      const T* b = a + d;
      T* y = yp + r * d;
      int64_t i = 0;
      for (; i + kLanes <= d; i += kLanes) {
        const vfloat v = load(a + i);
        const vfloat silu = round_lanes<T>(v / (1.f + exp_lanes(-v)));
        store_lanes<T>(y + i, round_lanes<T>(silu * load(b + i)));
      }
      if (i < d) {  // the last lanes, through zero-padded buffers
        alignas(64) T ta[kLanes] = {}, tb[kLanes] = {}, ty[kLanes];
        std::copy(a + i, a + d, ta);
        std::copy(b + i, b + d, tb);
        const vfloat v = load(ta);
        const vfloat silu = round_lanes<T>(v / (1.f + exp_lanes(-v)));
        store_lanes<T>(ty, round_lanes<T>(silu * load(tb)));
        std::copy(ty, ty + (d - i), y + i);
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& input) {
  const auto dtype = input.scalar_type();
  TORCH_CHECK(float_or_bf16(dtype), "silu_and_mul: float32 or bfloat16, got ",
              dtype);
  const int64_t width = input.size(-1);
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: an even last dim, got ", width);
  const at::Tensor x = input.contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = width / 2;
  at::Tensor y = at::empty(sizes, x.options());
  const int64_t rows = width ? x.numel() / width : 0;
  if (dtype == at::kFloat)
    silu_mul_rows<float>(x.data_ptr<float>(), width, y.data_ptr<float>(),
                         rows, width / 2);
  else
    silu_mul_rows<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), width,
                                 y.data_ptr<c10::BFloat16>(), rows,
                                 width / 2);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "add_rms_norm(Tensor input, Tensor? residual, Tensor weight, "
      "float eps) -> (Tensor, Tensor)");
  m.def(
      "rotary_cos_sin(Tensor positions, Tensor query, Tensor? key, "
      "Tensor cache, int head_size, int rotary_dim, bool neox) "
      "-> (Tensor, Tensor)");
  m.def("silu_and_mul(Tensor input) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_cos_sin", &rotary_cos_sin);
  m.impl("silu_and_mul", &silu_and_mul);
}
