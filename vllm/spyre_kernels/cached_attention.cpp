// One attention layer's cache step in one call: this step's keys and values
// written into the layer's cache, then its queries attended over it, for
// vLLM's model code (`--model-impl vllm`) under `eager`.  That model code
// flattens a step to [tokens, heads * head size]; in Python the two cache
// ops of a step took 17 dispatched ops a layer (views and transposes to the
// cache's layout and back, the conversions to the cache's dtype, two
// `index_copy_`, the kernel), about 25 us of Python and dispatch against
// 8 us of attention at 2B, where `eager` runs each op the graph holds.
// Here the keys and values go straight into their slots, converted as
// Tensor.to converts them, and the kernel runs on the same tensors, so the
// cache holds the same values and the output is the same, bit for bit:
//
// * store_decode_attention: a static batch's decode step (the warm-up
//   shape's cache [B, KVH, T, D], written at the step's `cache_slots`,
//   read under its mask [B, L, T]) on `decode_attention`;
// * store_paged_attention: a continuous-batching step (the block pool
//   [slots, KVH, D], written at the step's `cache_slots` [B, L], read
//   through its block table) on `paged_attention`.
//
// Used by vllm/attention/backends/spyre_attn.py (`AttentionStep`'s
// `fused`); the ops they call are in attention.cpp.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <vector>

namespace {

// Checks that x is [B * L, heads * D] (vLLM's split of the fused
// projection leaves rows strided, each row's heads contiguous).
void check_rows(const at::Tensor& x, int64_t B, int64_t L, int64_t heads,
                const char* op, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == B * L && heads > 0 &&
                  x.size(1) % heads == 0,
              op, ": ", what, " ", x.sizes(), " is not [", B * L,
              " tokens, ", heads, " heads x head size]");
}

// x as [B, L, heads, D] (a view).
at::Tensor heads_of(const at::Tensor& x, int64_t B, int64_t L,
                    int64_t heads, const char* op, const char* what) {
  check_rows(x, B, L, heads, op, what);
  return x.view({B, L, heads, x.size(1) / heads});
}

// The cache's or pool's element type, and the keys' and values': f(src_t,
// cache_t) for float32 and bfloat16.
template <typename F>
void with_types(at::ScalarType src, at::ScalarType cache, const char* op,
                F&& f) {
  auto one = [&](at::ScalarType t, auto&& g) {
    if (t == at::kFloat) {
      g(float{});
    } else if (t == at::kBFloat16) {
      g(c10::BFloat16{});
    } else {
      TORCH_CHECK(false, op, ": expected float32 or bfloat16, got ", t);
    }
  };
  one(src, [&](auto s) { one(cache, [&](auto c) { f(s, c); }); });
}

// Writes this step's keys or values (x: [B * L, KVH * D], each row's heads
// contiguous) into `cache` at its slots: token (b, l)'s head h goes to
// element offset dst(b, l, h) * D, converted to the cache's type as
// Tensor.to converts (bfloat16 rounded to nearest even).  One pass, in
// place of a conversion and an `index_copy_` (same values: a copy).
template <typename Dst>
void scatter(const at::Tensor& x, at::Tensor& cache, int64_t B, int64_t L,
             int64_t KVH, const char* op, Dst&& dst) {
  const int64_t D = x.size(1) / KVH;
  TORCH_CHECK(x.stride(1) == 1 && cache.is_contiguous() &&
                  cache.size(-1) == D,
              op, ": the cache ", cache.sizes(), " does not take rows of ",
              KVH, " heads of ", D);
  with_types(x.scalar_type(), cache.scalar_type(), op,
             [&](auto src_zero, auto cache_zero) {
    using src_t = decltype(src_zero);
    using cache_t = decltype(cache_zero);
    const src_t* xp = x.data_ptr<src_t>();
    cache_t* cp = cache.data_ptr<cache_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l) {
        const src_t* row = xp + (b * L + l) * x.stride(0);
        for (int64_t h = 0; h < KVH; ++h) {
          cache_t* out = cp + dst(b, l, h) * D;
          for (int64_t j = 0; j < D; ++j)
            out[j] = static_cast<cache_t>(static_cast<float>(row[h * D + j]));
        }
      }
  });
}

// A step's slots as int64 values, each checked to lie below `limit`.
std::vector<int64_t> slots_of(const at::Tensor& slots, int64_t limit,
                              const char* op) {
  const at::Tensor s = slots.to(at::kLong).contiguous();
  std::vector<int64_t> out(s.data_ptr<int64_t>(),
                           s.data_ptr<int64_t>() + s.numel());
  for (int64_t slot : out)
    TORCH_CHECK(slot >= 0 && slot < limit, op, ": cache slot ", slot,
                " is outside the cache's ", limit, " slots");
  return out;
}

// Queries [B, L, heads, D] as the kernels take them: [B, KVH, L * group,
// D], the group of query heads sharing a key/value head stacked.
at::Tensor stacked(const at::Tensor& q, int64_t KVH, const char* op) {
  const int64_t B = q.size(0), L = q.size(1), heads = q.size(2),
                D = q.size(3);
  TORCH_CHECK(heads % KVH == 0, op, ": ", heads,
              " query heads do not share ", KVH, " key/value heads evenly");
  const int64_t group = heads / KVH;
  return q.reshape({B, L, KVH, group, D})
      .transpose(1, 2)
      .reshape({B, KVH, L * group, D});
}

// The kernels' output [B, KVH, L * group, Dv] as vLLM's [B * L, heads * Dv].
at::Tensor unstacked(const at::Tensor& out, int64_t L) {
  const int64_t B = out.size(0), KVH = out.size(1), Dv = out.size(3);
  const int64_t group = out.size(2) / L;
  return out.view({B, KVH, L, group, Dv})
      .transpose(1, 2)
      .reshape({B * L, KVH * group * Dv});
}

at::Tensor store_decode_attention(const at::Tensor& query,
                                  const at::Tensor& key,
                                  const at::Tensor& value,
                                  at::Tensor& key_cache,
                                  at::Tensor& value_cache,
                                  const at::Tensor& cache_slots,
                                  const at::Tensor& mask, int64_t heads,
                                  double scale) {
  const char* op = "store_decode_attention";
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 &&
                  mask.dim() == 3,
              op, ": expected 4-d caches and a 3-d mask, got ",
              key_cache.sizes(), ", ", value_cache.sizes(), " and ",
              mask.sizes());
  const int64_t B = key_cache.size(0), KVH = key_cache.size(1),
                L = mask.size(1);
  check_rows(key, B, L, KVH, op, "key");
  check_rows(value, B, L, KVH, op, "value");
  TORCH_CHECK(cache_slots.numel() == L, op, ": ", cache_slots.numel(),
              " cache slots for ", L, " positions");
  // A bfloat16 cache under a float32 model rounds what it keeps.
  const int64_t T = key_cache.size(2);
  const std::vector<int64_t> slots = slots_of(cache_slots, T, op);
  auto slot_of = [&](int64_t b, int64_t l, int64_t h) {
    return (b * KVH + h) * T + slots[l];
  };
  TORCH_CHECK(value_cache.size(2) == T, op, ": key and value caches of ",
              T, " and ", value_cache.size(2), " slots");
  scatter(key, key_cache, B, L, KVH, op, slot_of);
  scatter(value, value_cache, B, L, KVH, op, slot_of);
  static auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("spyre_kernels::decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double,
                            const c10::optional<at::Tensor>&)>();
  const at::Tensor q = stacked(heads_of(query, B, L, heads, op, "query"),
                               KVH, op);
  return unstacked(
      attend.call(q, key_cache, value_cache, mask, scale, c10::nullopt), L);
}

at::Tensor store_paged_attention(const at::Tensor& query,
                                 const at::Tensor& key,
                                 const at::Tensor& value,
                                 at::Tensor& key_pool, at::Tensor& value_pool,
                                 const at::Tensor& cache_slots,
                                 const at::Tensor& block_table,
                                 const at::Tensor& ctx_lens,
                                 int64_t block_size, int64_t heads,
                                 double scale, int64_t window) {
  const char* op = "store_paged_attention";
  TORCH_CHECK(key_pool.dim() == 3 && value_pool.dim() == 3 &&
                  cache_slots.dim() == 2 && block_table.dim() == 2,
              op, ": expected 3-d pools and 2-d slots and block table, got ",
              key_pool.sizes(), ", ", value_pool.sizes(), ", ",
              cache_slots.sizes(), " and ", block_table.sizes());
  const int64_t B = cache_slots.size(0), L = cache_slots.size(1),
                KVH = key_pool.size(1);
  check_rows(key, B, L, KVH, op, "key");
  check_rows(value, B, L, KVH, op, "value");
  TORCH_CHECK(value_pool.size(0) == key_pool.size(0), op,
              ": key and value pools of ", key_pool.size(0), " and ",
              value_pool.size(0), " slots");
  const std::vector<int64_t> slots =
      slots_of(cache_slots, key_pool.size(0), op);
  auto slot_of = [&](int64_t b, int64_t l, int64_t h) {
    return slots[b * L + l] * KVH + h;
  };
  scatter(key, key_pool, B, L, KVH, op, slot_of);
  scatter(value, value_pool, B, L, KVH, op, slot_of);
  static auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("spyre_kernels::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, double, int64_t,
                            const c10::optional<at::Tensor>&)>();
  const at::Tensor q = stacked(heads_of(query, B, L, heads, op, "query"),
                               KVH, op);
  return unstacked(attend.call(q, key_pool, value_pool, block_table,
                               ctx_lens, block_size, scale, window,
                               c10::nullopt),
                   L);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "store_decode_attention(Tensor query, Tensor key, Tensor value, "
      "Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor cache_slots, "
      "Tensor mask, int heads, float scale) -> Tensor");
  m.def(
      "store_paged_attention(Tensor query, Tensor key, Tensor value, "
      "Tensor(a!) key_pool, Tensor(b!) value_pool, Tensor cache_slots, "
      "Tensor block_table, Tensor ctx_lens, int block_size, int heads, "
      "float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("store_decode_attention", &store_decode_attention);
  m.impl("store_paged_attention", &store_paged_attention);
}
