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
// The query (and so the output) is float32 or bfloat16, and so are the
// keys and values, independently: a bfloat16 cache under a float32
// residual stream is the CPU's bfloat16 mode.  Scores, softmax and the
// weighted sum are float32 either way; a bfloat16 output is rounded once
// at the end.
//
// Same conventions as spyre_cpu_linear.cpp (GCC vector extensions).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef uint16_t vhalf_u
    __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));
typedef uint32_t vword
    __attribute__((vector_size(kLanes * sizeof(uint32_t))));
using bf16 = c10::BFloat16;

// kLanes elements at p, as float32.
inline vfloat_u load(const float* p) {
  return *reinterpret_cast<const vfloat_u*>(p);
}
inline vfloat_u load(const bf16* p) {
  const vword w = __builtin_convertvector(
      *reinterpret_cast<const vhalf_u*>(p), vword);
  return reinterpret_cast<vfloat_u>(w << 16);
}

template <typename T>
float dot(const float* a, const T* b, int64_t n) {
  vfloat_u acc{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc += load(a + i) * load(b + i);
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * static_cast<float>(b[i]);
  return s;
}

// y[0:n] += p * x[0:n]
template <typename T>
void axpy(float p, const T* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    *reinterpret_cast<vfloat_u*>(y + i) += p * load(x + i);
  for (; i < n; ++i) y[i] += p * static_cast<float>(x[i]);
}

// Attention of `group` query rows (the query heads sharing one key/value
// head, at one position) over `n` cached tokens: key_at(i) / value_at(i)
// point at token i's key and value.  q: group rows of D floats; out: group
// rows of Dv floats; scores: scratch of at least group * n floats.  With
// n == 0 the rows get zeros.
template <typename T, typename KeyAt, typename ValueAt>
void attend_group(const float* q, int64_t group, int64_t D, int64_t Dv,
                  int64_t n, KeyAt key_at, ValueAt value_at, float scale,
                  float* scores, float* out) {
  // Scores of the group's rows, token by token: each key read once.
  for (int64_t i = 0; i < n; ++i) {
    const T* key = key_at(i);
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
    const T* value = value_at(i);
    for (int64_t g = 0; g < group; ++g)
      axpy(scores[g * n + i], value, out + g * Dv, Dv);
  }
}

void check_dtypes(const at::Tensor& query, const at::Tensor& keys,
                  const at::Tensor& values, const char* op) {
  auto supported = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16;
  };
  TORCH_CHECK(supported(query.scalar_type()) &&
                  supported(keys.scalar_type()) &&
                  keys.scalar_type() == values.scalar_type(),
              op, ": a float32 or bfloat16 query, and keys and values of "
              "one dtype, float32 or bfloat16; got ", query.scalar_type(),
              ", ", keys.scalar_type(), " and ", values.scalar_type());
}

// Calls f(T{}) with T the C++ type of float32 or bfloat16 elements.
template <typename F>
void with_element_type(at::ScalarType dtype, F&& f) {
  if (dtype == at::kBFloat16)
    f(bf16{});
  else
    f(float{});
}

// One work item's query rows in float32, and its output rows written back
// from float32 (rounded once for bfloat16).
struct Rows {
  std::vector<float> q, out;
  Rows(int64_t group, int64_t D, int64_t Dv) : q(group * D), out(group * Dv) {}

  template <typename T>
  const float* query(const T* src) {
    for (size_t j = 0; j < q.size(); ++j) q[j] = static_cast<float>(src[j]);
    return q.data();
  }
  template <typename T>
  void write(T* dst) const {
    for (size_t j = 0; j < out.size(); ++j) dst[j] = static_cast<T>(out[j]);
  }
};

// query: [B, KVH, R, D], R = L * group rows per key/value head (row r is
// query position r / group); keys: [B, KVH, T, D]; values: [B, KVH, T, Dv];
// mask: [B, L, T] bool, true = may attend.  Returns [B, KVH, R, Dv].  A row
// that may attend to nothing gets zeros.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& mask,
                            double scale) {
  check_dtypes(query, keys, values, "decode_attention");
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
  with_element_type(q.scalar_type(), [&](auto q_zero) {
  with_element_type(k.scalar_type(), [&](auto kv_zero) {
  using scalar_t = decltype(q_zero);
  using cache_t = decltype(kv_zero);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k.data_ptr<cache_t>();
  const cache_t* vp = v.data_ptr<cache_t>();
  const bool* mp = m.data_ptr<bool>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> slots(T);
    std::vector<float> scores(group * T);
    Rows rows(group, D, Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH;
      const cache_t* kh = kp + bh * T * D;
      const cache_t* vh = vp + bh * T * Dv;
      for (int64_t pos = 0; pos < L; ++pos) {
        const bool* visible = mp + (b * L + pos) * T;
        int64_t n = 0;
        for (int64_t t = 0; t < T; ++t)
          if (visible[t]) slots[n++] = t;
        const int64_t r0 = bh * R + pos * group;
        attend_group<cache_t>(
            rows.query(qp + r0 * D), group, D, Dv, n,
            [&](int64_t i) { return kh + slots[i] * D; },
            [&](int64_t i) { return vh + slots[i] * Dv; }, fscale,
            scores.data(), rows.out.data());
        rows.write(op + r0 * Dv);
      }
    }
  });
  });
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
  check_dtypes(query, key_pool, value_pool, "paged_attention");
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
  with_element_type(q.scalar_type(), [&](auto q_zero) {
  with_element_type(kp.scalar_type(), [&](auto kv_zero) {
  using scalar_t = decltype(q_zero);
  using cache_t = decltype(kv_zero);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kbase = kp.data_ptr<cache_t>();
  const cache_t* vbase = vp.data_ptr<cache_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  // One work item per (sequence, key/value head, query position).
  at::parallel_for(0, B * KVH * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * MB * block_size);
    Rows rows(group, D, Dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pos = item % L, bh = item / L;
      const int64_t b = bh / KVH, h = bh % KVH;
      const int64_t* table = btp + b * MB;
      const int64_t n = clp[b * L + pos];
      auto slot = [&](int64_t i) {
        return table[i / block_size] * block_size + i % block_size;
      };
      const int64_t r0 = bh * R + pos * group;
      attend_group<cache_t>(
          rows.query(qp + r0 * D), group, D, Dv, n,
          [&](int64_t i) { return kbase + (slot(i) * KVH + h) * D; },
          [&](int64_t i) { return vbase + (slot(i) * KVH + h) * Dv; },
          fscale, scores.data(), rows.out.data());
      rows.write(op + r0 * Dv);
    }
  });
  });
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
