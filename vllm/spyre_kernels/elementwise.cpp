// The small per-layer operations of a decoder, each in one pass.
//
// Under `inductor` the norms and the rotary embedding of every layer are
// fused into generated loops.  Under `eager` each is a chain of separate
// PyTorch ops: an RMS norm is pow, mean, add,
// rsqrt, two multiplies and a cast; FMS's rotary embedding multiplies a
// 6-dimensional broadcast of its 2 x 2 rotation matrices by the queries and
// keys and sums the pairs, a broadcast that PyTorch runs slowly (80 us for
// the queries of 8 sequences of SmolLM2 on the reference machine: with the
// keys and the sums, about 4 ms of a 30 ms profiled decode step over 30
// layers).  These kernels do each in one pass
// over memory, in float32:
//
// * rms_norm: y = weight * (x * rsqrt(mean(x^2) + eps)), per row, the
//   squares summed in kLanes partial sums (as PyTorch's vectorized mean
//   does, though not in its exact order: results may differ in the last
//   bit);
// * rotary_qk: for each pair (x0, x1) of a head at position p, with FMS's
//   table T[p, i] = [[cos, -sin], [sin, cos]]:
//   y0 = T00 * x0 + T01 * x1, y1 = T10 * x0 + T11 * x1, the products and
//   sums kept apart (no fused multiply-add), so that the result is FMS's
//   bit for bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>

#include "simd.h"

namespace {

using namespace spyre_kernels;

// Rows per task of at::parallel_for: small batches stay on one thread.
constexpr int64_t kRowGrain = 16;

at::Tensor rms_norm(
    const at::Tensor& input, const at::Tensor& weight, double eps) {
  check_float(input, "rms_norm", "the input");
  check_float(weight, "rms_norm", "the weight");
  const int64_t H = input.size(-1);
  TORCH_CHECK(weight.numel() == H, "rms_norm: a weight of ", weight.numel(),
              " for rows of ", H);
  const at::Tensor x = input.contiguous();
  const at::Tensor w = weight.contiguous();
  at::Tensor y = at::empty_like(x);
  const int64_t rows = H ? x.numel() / H : 0;
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = xp + r * H;
      float* yr = yp + r * H;
      vfloat acc{};
      int64_t i = 0;
      for (; i + kLanes <= H; i += kLanes) {
        const vfloat v = *reinterpret_cast<const vfloat_u*>(xr + i);
        acc += v * v;
      }
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
      for (; i < H; ++i) sum += xr[i] * xr[i];
      const float scale = 1.f / std::sqrt(sum / H + epsf);
      for (int64_t i = 0; i < H; ++i) yr[i] = wp[i] * (xr[i] * scale);
    }
  });
  return y;
}

// One tensor of heads [B, L, H, D] (any strides but a unit last one)
// rotated into a new contiguous tensor.  No multiply-add contraction here,
// in this function or in the loop body it hands to at::parallel_for.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
at::Tensor rotate(
    const at::Tensor& x, const float* table, int64_t positions,
    const at::Tensor& position_ids) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1,
              "rotary_qk: heads must be [batch, length, heads, dim] with "
              "a unit last stride");
  const int64_t B = x.size(0), L = x.size(1), H = x.size(2), D = x.size(3);
  at::Tensor y = at::empty({B, L, H, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), sl = x.stride(1), sh = x.stride(2);
  const auto pos = position_ids.accessor<int64_t, 2>();
  const int64_t half = D / 2;
  at::parallel_for(0, B * L, kRowGrain, [&](int64_t begin, int64_t end) {
    for (int64_t bl = begin; bl < end; ++bl) {
      const int64_t b = bl / L, l = bl % L;
      const int64_t p = pos[b][l];
      TORCH_CHECK(p >= 0 && p < positions, "rotary_qk: position ", p,
                  " outside the table of ", positions);
      const float* t = table + p * half * 4;
      for (int64_t h = 0; h < H; ++h) {
        const float* xr = xp + b * sb + l * sl + h * sh;
        float* yr = yp + ((b * L + l) * H + h) * D;
        for (int64_t i = 0; i < half; ++i) {
          const float x0 = xr[2 * i], x1 = xr[2 * i + 1];
          const float* m = t + 4 * i;
          const float a0 = m[0] * x0, a1 = m[1] * x1;
          const float b0 = m[2] * x0, b1 = m[3] * x1;
          yr[2 * i] = a0 + a1;
          yr[2 * i + 1] = b0 + b1;
        }
      }
    }
  });
  return y;
}
#pragma GCC pop_options

std::tuple<at::Tensor, at::Tensor> rotary_qk(const at::Tensor& q,
                                             const at::Tensor& k,
                                             const at::Tensor& table,
                                             const at::Tensor& position_ids) {
  check_float(q, "rotary_qk", "the queries");
  check_float(k, "rotary_qk", "the keys");
  check_float(table, "rotary_qk", "the rotation table");
  TORCH_CHECK(q.size(-1) % 2 == 0 && q.size(-1) == k.size(-1),
              "rotary_qk: head dims ", q.size(-1), " and ", k.size(-1));
  TORCH_CHECK(table.dim() == 4 && table.size(1) * 2 == q.size(-1) &&
                  table.size(2) == 2 && table.size(3) == 2 &&
                  table.is_contiguous(),
              "rotary_qk: the table must be [positions, dim / 2, 2, 2]");
  TORCH_CHECK(position_ids.dim() == 2 &&
                  position_ids.scalar_type() == at::kLong &&
                  position_ids.size(0) == q.size(0) &&
                  position_ids.size(1) == q.size(1) &&
                  k.size(0) == q.size(0) && k.size(1) == q.size(1),
              "rotary_qk: position ids [batch, length] (int64) for queries "
              "and keys of that batch and length");
  const float* tp = table.data_ptr<float>();
  return {rotate(q, tp, table.size(0), position_ids),
          rotate(k, tp, table.size(0), position_ids)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor");
  m.def(
      "rotary_qk(Tensor q, Tensor k, Tensor table, Tensor position_ids) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("rotary_qk", &rotary_qk);
}
