// Attention of a decode step over a fixed-length key/value cache, on the CPU.
//
// A decode step has one query row per sequence and head, and attends over
// the cache of its batch: a few hundred slots, of which the ones not
// written yet (and a row's left padding) are masked out.  Written with
// matrix products, that is two small batched GEMMs and a softmax per
// layer, each with its own call overhead; here it is one pass per
// key/value head: scores, softmax and the weighted sum of values, with the
// query heads that share the key/value head computed together so the
// cache is read once.  Masked slots are skipped: their probability is
// exactly zero in the softmax.
//
// Same conventions as spyre_cpu_linear.cpp (GCC vector extensions).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

float dot(const float* a, const float* b, int64_t n) {
  vfloat_u acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    acc += *reinterpret_cast<const vfloat_u*>(a + i) *
           *reinterpret_cast<const vfloat_u*>(b + i);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[0:n] += p * x[0:n]
void axpy(float p, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    *reinterpret_cast<vfloat_u*>(y + i) +=
        p * *reinterpret_cast<const vfloat_u*>(x + i);
  for (; i < n; ++i) y[i] += p * x[i];
}

// query: [B, KVH, R, D], R = L * group rows per key/value head (row r is
// query position r / group); keys: [B, KVH, T, D]; values: [B, KVH, T, Dv];
// mask: [B, L, T] bool, true = may attend.  Returns [B, KVH, R, Dv].  A row
// that may attend to nothing gets zeros.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& mask,
                            double scale) {
  TORCH_CHECK(query.scalar_type() == at::kFloat &&
                  keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              "decode_attention: float32 only, got ", query.scalar_type());
  TORCH_CHECK(mask.scalar_type() == at::kBool,
              "decode_attention: the mask must be bool, got ",
              mask.scalar_type());
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 &&
                  mask.dim() == 3,
              "decode_attention: expected 4-d query/keys/values and a 3-d "
              "mask");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2),
                D = query.size(3);
  const int64_t T = keys.size(2), Dv = values.size(3), L = mask.size(1);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == KVH && keys.size(3) == D,
              "decode_attention: keys ", keys.sizes(), " do not match query ",
              query.sizes());
  TORCH_CHECK(values.size(0) == B && values.size(1) == KVH &&
                  values.size(2) == T,
              "decode_attention: values ", values.sizes(),
              " do not match keys ", keys.sizes());
  TORCH_CHECK(mask.size(0) == B && mask.size(2) == T && L > 0 && R % L == 0,
              "decode_attention: mask ", mask.sizes(), " does not match ",
              B, " sequences, ", R, " query rows and ", T, " slots");
  const at::Tensor q = query.contiguous(), k = keys.contiguous(),
                   v = values.contiguous(), m = mask.contiguous();
  at::Tensor out = at::empty({B, KVH, R, Dv}, q.options());
  const int64_t group = R / L;
  const float fscale = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = m.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(T);
    std::vector<float> scores(group * T);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH;
      const float* kh = kp + bh * T * D;
      const float* vh = vp + bh * T * Dv;
      for (int64_t pos = 0; pos < L; ++pos) {
        const bool* visible = mp + (b * L + pos) * T;
        int64_t n = 0;
        for (int64_t t = 0; t < T; ++t)
          if (visible[t]) slots[n++] = t;
        const int64_t r0 = pos * group;
        // Scores of the group's rows, slot by slot: each key read once.
        for (int64_t i = 0; i < n; ++i) {
          const float* key = kh + slots[i] * D;
          for (int64_t g = 0; g < group; ++g)
            scores[g * T + i] =
                dot(qp + (bh * R + r0 + g) * D, key, D) * fscale;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * T;
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
          float sum = 0.f;
          for (int64_t i = 0; i < n; ++i) {
            s[i] = std::exp(s[i] - mx);
            sum += s[i];
          }
          for (int64_t i = 0; i < n; ++i) s[i] /= sum;
        }
        for (int64_t g = 0; g < group; ++g) {
          float* o = op + (bh * R + r0 + g) * Dv;
          for (int64_t j = 0; j < Dv; ++j) o[j] = 0.f;
        }
        for (int64_t i = 0; i < n; ++i) {
          const float* value = vh + slots[i] * Dv;
          for (int64_t g = 0; g < group; ++g)
            axpy(scores[g * T + i], value, op + (bh * R + r0 + g) * Dv, Dv);
        }
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, "
      "Tensor mask, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
}
