// Attention of a decode step on the CPU, over a fixed-length key/value
// cache (static batching, `decode_attention`) or over a paged one
// (continuous batching, `paged_attention`).
//
// A decode step has one query row per sequence and head, and attends over
// the cache of its batch: a few hundred slots, of which the ones not
// written yet (and a row's left padding) are masked out.  Written with
// matrix products, that is two small batched GEMMs and a softmax per
// layer, each with its own call overhead; here it is one pass per
// key/value head: scores, softmax and the weighted sum of values, with the
// query heads that share the key/value head computed together so the
// cache is read once.  Masked slots are skipped: their probability is
// exactly zero in the softmax.  Both ops share `attend_group`; they differ
// only in where the group's tokens are.
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

// Attention of `group` query rows (the query heads sharing one key/value
// head, at one position) over `n` cached tokens: key_at(i) / value_at(i)
// point at token i's key and value.  q: group rows of D floats; out: group
// rows of Dv floats; scores: scratch of at least group * n floats.  With
// n == 0 the rows get zeros.
template <typename KeyAt, typename ValueAt>
void attend_group(const float* q, int64_t group, int64_t D, int64_t Dv,
                  int64_t n, KeyAt key_at, ValueAt value_at, float scale,
                  float* scores, float* out) {
  // Scores of the group's rows, token by token: each key read once.
  for (int64_t i = 0; i < n; ++i) {
    const float* key = key_at(i);
    for (int64_t g = 0; g < group; ++g)
      scores[g * n + i] = dot(q + g * D, key, D) * scale;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * n;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - mx);
      sum += s[i];
    }
    for (int64_t i = 0; i < n; ++i) s[i] /= sum;
  }
  for (int64_t j = 0; j < group * Dv; ++j) out[j] = 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float* value = value_at(i);
    for (int64_t g = 0; g < group; ++g)
      axpy(scores[g * n + i], value, out + g * Dv, Dv);
  }
}

void check_float_query(const at::Tensor& query, const at::Tensor& keys,
                       const at::Tensor& values, const char* op) {
  TORCH_CHECK(query.scalar_type() == at::kFloat &&
                  keys.scalar_type() == at::kFloat &&
                  values.scalar_type() == at::kFloat,
              op, ": float32 only, got ", query.scalar_type());
}

// query: [B, KVH, R, D], R = L * group rows per key/value head (row r is
// query position r / group); keys: [B, KVH, T, D]; values: [B, KVH, T, Dv];
// mask: [B, L, T] bool, true = may attend.  Returns [B, KVH, R, Dv].  A row
// that may attend to nothing gets zeros.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& mask,
                            double scale) {
  check_float_query(query, keys, values, "decode_attention");
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
        const int64_t r0 = bh * R + pos * group;
        attend_group(
            qp + r0 * D, group, D, Dv, n,
            [&](int64_t i) { return kh + slots[i] * D; },
            [&](int64_t i) { return vh + slots[i] * Dv; }, fscale,
            scores.data(), op + r0 * Dv);
      }
    }
  });
  return out;
}

// Attention over a paged key/value cache: the pools hold fixed-size blocks
// of `block_size` tokens, and each sequence's tokens live in the blocks its
// block table lists, in order.  Every query position reads its own number
// of tokens straight from the blocks, so sequences of different lengths
// share a step without padding or copies.
//
// query: [B, KVH, R, D], R = L * group rows per key/value head (row r is
// query position r / group); key_pool: [S, KVH, D] and value_pool:
// [S, KVH, Dv], S = blocks * block_size; block_table: [B, MB] int64;
// ctx_lens: [B, L] int64, the tokens query position l of sequence b sees
// (its first ctx_lens[b, l] tokens; a length of 0 gives zeros, though the
// model runner gives padding positions one token to see, so that the
// torch-op path, which would give NaN there, agrees).  Returns
// [B, KVH, R, Dv].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_pool,
                           const at::Tensor& value_pool,
                           const at::Tensor& block_table,
                           const at::Tensor& ctx_lens, int64_t block_size,
                           double scale) {
  check_float_query(query, key_pool, value_pool, "paged_attention");
  TORCH_CHECK(block_table.scalar_type() == at::kLong &&
                  ctx_lens.scalar_type() == at::kLong,
              "paged_attention: block_table and ctx_lens must be int64, got ",
              block_table.scalar_type(), " and ", ctx_lens.scalar_type());
  TORCH_CHECK(query.dim() == 4 && key_pool.dim() == 3 &&
                  value_pool.dim() == 3 && block_table.dim() == 2 &&
                  ctx_lens.dim() == 2,
              "paged_attention: expected a 4-d query, 3-d pools, a 2-d "
              "block table and 2-d ctx_lens");
  const int64_t B = query.size(0), KVH = query.size(1), R = query.size(2),
                D = query.size(3);
  const int64_t S = key_pool.size(0), Dv = value_pool.size(2),
                MB = block_table.size(1), L = ctx_lens.size(1);
  TORCH_CHECK(block_size > 0 && S % block_size == 0,
              "paged_attention: pool of ", S,
              " slots is not a whole number of blocks of ", block_size);
  TORCH_CHECK(key_pool.size(1) == KVH && key_pool.size(2) == D &&
                  value_pool.size(0) == S && value_pool.size(1) == KVH,
              "paged_attention: pools ", key_pool.sizes(), " and ",
              value_pool.sizes(), " do not match query ", query.sizes());
  TORCH_CHECK(block_table.size(0) == B && ctx_lens.size(0) == B && L > 0 &&
                  R % L == 0,
              "paged_attention: block_table ", block_table.sizes(),
              " and ctx_lens ", ctx_lens.sizes(), " do not match query ",
              query.sizes());
  const at::Tensor q = query.contiguous(), kp = key_pool.contiguous(),
                   vp = value_pool.contiguous(), bt = block_table.contiguous(),
                   cl = ctx_lens.contiguous();
  const int64_t blocks = S / block_size;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* clp = cl.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * L; ++i)
    TORCH_CHECK(clp[i] >= 0 && clp[i] <= MB * block_size,
                "paged_attention: context length ", clp[i],
                " outside the block table's ", MB * block_size, " tokens");
  for (int64_t i = 0; i < B * MB; ++i)
    TORCH_CHECK(btp[i] >= 0 && btp[i] < blocks, "paged_attention: block ",
                btp[i], " outside the pool of ", blocks, " blocks");
  at::Tensor out = at::empty({B, KVH, R, Dv}, q.options());
  const int64_t group = R / L;
  const float fscale = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  const float* kbase = kp.data_ptr<float>();
  const float* vbase = vp.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // One work item per (sequence, key/value head, query position).
  at::parallel_for(0, B * KVH * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * MB * block_size);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pos = item % L, bh = item / L;
      const int64_t b = bh / KVH, h = bh % KVH;
      const int64_t* table = btp + b * MB;
      const int64_t n = clp[b * L + pos];
      auto slot = [&](int64_t i) {
        return table[i / block_size] * block_size + i % block_size;
      };
      const int64_t r0 = bh * R + pos * group;
      attend_group(
          qp + r0 * D, group, D, Dv, n,
          [&](int64_t i) { return kbase + (slot(i) * KVH + h) * D; },
          [&](int64_t i) { return vbase + (slot(i) * KVH + h) * Dv; },
          fscale, scores.data(), op + r0 * Dv);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_cpu, m) {
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, "
      "Tensor mask, float scale) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor key_pool, Tensor value_pool, "
      "Tensor block_table, Tensor ctx_lens, int block_size, float scale) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_attention", &paged_attention);
}
