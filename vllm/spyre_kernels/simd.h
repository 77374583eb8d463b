// What the kernel files share: the vector width they are written for,
// their vector types, the argument checks more than one op makes, loads
// of float32 and bfloat16 lanes, lane sums and dot products, and the
// transposed sum that turns 16 vectors of partial sums into 16 sums.
//
// The kernels are written with GCC vector extensions, so that one source
// builds for AVX-512 or AVX2 (x86), VSX (Power) and the z/Architecture
// vector facility: a vector is kLanes float32 (or 32-bit integer) lanes,
// which the compiler maps onto the machine's registers.  The `_u` types
// are the same vectors, loadable from any address of their element type.
//
// ops.py builds linear.cpp, quant.cpp, attention.cpp, elementwise.cpp,
// lora.cpp and vllm_elementwise.cpp into one extension; each includes this
// header and keeps the rest of its code in an anonymous namespace of its
// own.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace spyre_kernels {

// float32 lanes of a vector.
constexpr int64_t kLanes = 16;

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint
    __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef uint32_t vuint_u
    __attribute__((vector_size(kLanes * sizeof(uint32_t)), aligned(4)));
// kLanes bfloat16 (their bits), loadable from any bfloat16 address.
typedef uint16_t vhalf_u
    __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));

// The machine's own vector, for the loops that stream weights (the linear
// and quantized tiles): kNativeLanes float32 lanes, one register.  With
// AVX-512 it is the vector above.  With AVX2 alone (AMD EPYC before Zen 4,
// Intel before Skylake-SP) it is half of it: GCC splits a 16-lane vector
// into two 256-bit halves there, but keeps such values in memory across a
// loop's iterations, which made the bfloat16 tile read its weight at a
// fifth of the speed of the same loop on 8-lane vectors.  The weights'
// packed layouts do not depend on it.
#if defined(__AVX2__) && !defined(__AVX512F__)
#define SPYRE_NATIVE_HALF 1
constexpr int64_t kNativeLanes = 8;
#else
constexpr int64_t kNativeLanes = kLanes;
#endif
typedef float nfloat
    __attribute__((vector_size(kNativeLanes * sizeof(float))));
typedef float nfloat_u
    __attribute__((vector_size(kNativeLanes * sizeof(float)), aligned(4)));
typedef int32_t nint
    __attribute__((vector_size(kNativeLanes * sizeof(int32_t))));
typedef uint32_t nuint
    __attribute__((vector_size(kNativeLanes * sizeof(uint32_t))));
typedef uint32_t nuint_u
    __attribute__((vector_size(kNativeLanes * sizeof(uint32_t)), aligned(4)));

// The element types the ops take besides float32.
inline bool float_or_bf16(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16;
}

// `op`'s tensor `what` must hold float32.
inline void check_float(const at::Tensor& t, const char* op,
                        const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", what,
              " must be float32, got ", t.scalar_type());
}

// What the linear ops (packed_linear, quant_linear) check of a packed
// weight of `blocks` column blocks of `block` columns and K input
// features: the input's features, and the outputs the blocks can hold.
inline void check_packed_shape(const char* op, const at::Tensor& input,
                               int64_t K, int64_t blocks, int64_t block,
                               int64_t out_features) {
  TORCH_CHECK(input.size(-1) == K, op, ": the input has ", input.size(-1),
              " features, the weight ", K);
  TORCH_CHECK(out_features > (blocks - 1) * block &&
                  out_features <= blocks * block,
              op, ": ", out_features,
              " outputs do not match a packed weight of ", blocks,
              " blocks");
}

// A linear op's bias: one value per output.
inline void check_bias(const char* op, const at::Tensor& bias,
                       int64_t out_features) {
  TORCH_CHECK(bias.numel() == out_features, op, ": bias of ", bias.numel(),
              " for ", out_features, " outputs");
}

// kLanes elements at p, as float32.
inline vfloat_u load(const float* p) {
  return *reinterpret_cast<const vfloat_u*>(p);
}
inline vfloat_u load(const c10::BFloat16* p) {
  const vuint w = __builtin_convertvector(
      *reinterpret_cast<const vhalf_u*>(p), vuint);
  return reinterpret_cast<vfloat_u>(w << 16);
}

// The sum of the lanes of v, as a tree (the lanes are independent, so the
// adds need not wait on one another).
inline float lane_sum(vfloat_u v) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  vfloat_u acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = lane_sum(acc);
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// One step of a transposed lane sum.  a and b hold partial sums of W-lane
// groups of some tokens each, laid out in blocks of W lanes; the result
// holds the tokens of both, each token's partials halved in number.
template <int W>
[[gnu::always_inline]] inline vfloat_u fold(vfloat_u a, vfloat_u b) {
  vint take_low, take_high;
  for (int l = 0; l < kLanes; ++l) {
    const int j = l % (2 * W);
    take_low[l] = j < W ? l : kLanes + l - W;
    take_high[l] = j < W ? l + W : kLanes + l;
  }
  return __builtin_shuffle(a, b, take_low) +
         __builtin_shuffle(a, b, take_high);
}

// Lane t of the result is the sum of the lanes of acc[t], t < 16.
[[gnu::always_inline]] inline vfloat_u transpose_sum(const vfloat_u* acc) {
  vfloat_u l1[8], l2[4], l3[2];
  for (int t = 0; t < 8; ++t) l1[t] = fold<1>(acc[2 * t], acc[2 * t + 1]);
  for (int t = 0; t < 4; ++t) l2[t] = fold<2>(l1[2 * t], l1[2 * t + 1]);
  for (int t = 0; t < 2; ++t) l3[t] = fold<4>(l2[2 * t], l2[2 * t + 1]);
  return fold<8>(l3[0], l3[1]);
}

// The same on the machine's own vectors (kNativeLanes lanes).
typedef uint16_t nhalf_u
    __attribute__((vector_size(kNativeLanes * sizeof(uint16_t)), aligned(2)));

inline nfloat_u native_load(const float* p) {
  return *reinterpret_cast<const nfloat_u*>(p);
}
inline nfloat_u native_load(const c10::BFloat16* p) {
  const nuint w = __builtin_convertvector(
      *reinterpret_cast<const nhalf_u*>(p), nuint);
  return reinterpret_cast<nfloat_u>(w << 16);
}

inline float native_lane_sum(nfloat_u v) {
#if defined(SPYRE_NATIVE_HALF)
  float s4[4];
  for (int l = 0; l < 4; ++l) s4[l] = v[l] + v[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#else
  return lane_sum(v);
#endif
}

template <int W>
[[gnu::always_inline]] inline nfloat_u native_fold(nfloat_u a, nfloat_u b) {
  nint take_low, take_high;
  for (int l = 0; l < kNativeLanes; ++l) {
    const int j = l % (2 * W);
    take_low[l] = j < W ? l : kNativeLanes + l - W;
    take_high[l] = j < W ? l + W : kNativeLanes + l;
  }
  return __builtin_shuffle(a, b, take_low) +
         __builtin_shuffle(a, b, take_high);
}

// Lane t of the result is the sum of the lanes of acc[t], t < kNativeLanes.
[[gnu::always_inline]] inline nfloat_u native_transpose_sum(
    const nfloat_u* acc) {
#if defined(SPYRE_NATIVE_HALF)
  nfloat_u l1[4], l2[2];
  for (int t = 0; t < 4; ++t)
    l1[t] = native_fold<1>(acc[2 * t], acc[2 * t + 1]);
  for (int t = 0; t < 2; ++t)
    l2[t] = native_fold<2>(l1[2 * t], l1[2 * t + 1]);
  return native_fold<4>(l2[0], l2[1]);
#else
  return transpose_sum(acc);
#endif
}

}  // namespace spyre_kernels
