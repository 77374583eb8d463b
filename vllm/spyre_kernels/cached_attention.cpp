// A layer's cache step under `eager` in one or two calls: this step's keys
// and values written into the layer's cache, and its queries attended over
// it.  `eager` runs each op a graph holds one by one, and the cache ops in
// Python took 13-17 dispatched ops a layer (views and transposes to the
// cache's layout and back, conversions to the cache's dtype, two
// `index_copy_`, the kernel): about 25 us of Python and dispatch against
// 8 us of attention at 2B.  Here the keys and values go straight into
// their slots, converted as Tensor.to converts them (bfloat16 rounded to
// nearest even), and the kernels of attention.cpp run on the same tensors,
// so the caches hold the same values and the outputs are the same, bit for
// bit:
//
// * store_static_kv, store_paged_kv: keys and values [B, L, KVH, D] into a
//   static batch's cache [B, KVH, T, D] at the step's `cache_slots` [L],
//   or into the block pool [slots, KVH, D] at its `cache_slots` [B, L];
// * decode_attention_heads, paged_attention_heads: `decode_attention` and
//   `paged_attention` over queries [B, L, heads, D], returning [B, L,
//   heads, Dv] (the kernels take each key/value head's query heads
//   stacked): FMS's compute ops;
// * store_decode_attention, store_paged_attention: both at once over vLLM's
//   flattened [B * L, heads * D] rows (vLLM's model code).
//
// Used by vllm/attention/ops/spyre_static_cache.py and spyre_paged_cache.py
// (their eager ops and `store_and_attend`).

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

// f(src_t, cache_t) for the keys' and the cache's element types, each
// float32 or bfloat16.
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

// Writes keys or values x [B, L, KVH, D] (each head's D contiguous) into
// `cache`: token (b, l)'s head h at element offset dst(b, l, h) * D.
template <typename Dst>
void scatter(const at::Tensor& x, at::Tensor& cache, const char* op,
             Dst&& dst) {
  const int64_t B = x.size(0), L = x.size(1), KVH = x.size(2),
                D = x.size(3);
  TORCH_CHECK(x.stride(3) == 1 && cache.is_contiguous() &&
                  cache.size(-1) == D,
              op, ": the cache ", cache.sizes(), " does not take ", KVH,
              " heads of ", D);
  with_types(x.scalar_type(), cache.scalar_type(), op,
             [&](auto src_zero, auto cache_zero) {
    using src_t = decltype(src_zero);
    using cache_t = decltype(cache_zero);
    const src_t* xp = x.data_ptr<src_t>();
    cache_t* cp = cache.data_ptr<cache_t>();
    for (int64_t b = 0; b < B; ++b)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t h = 0; h < KVH; ++h) {
          const src_t* in =
              xp + b * x.stride(0) + l * x.stride(1) + h * x.stride(2);
          cache_t* out = cp + dst(b, l, h) * D;
          for (int64_t j = 0; j < D; ++j)
            out[j] = static_cast<cache_t>(static_cast<float>(in[j]));
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

void check_kv(const at::Tensor& keys, const at::Tensor& values,
              int64_t KVH, const char* op) {
  TORCH_CHECK(keys.dim() == 4 && values.dim() == 4 &&
                  keys.sizes().slice(0, 3) == values.sizes().slice(0, 3) &&
                  keys.size(2) == KVH,
              op, ": keys ", keys.sizes(), " and values ", values.sizes(),
              " are not [B, L, ", KVH, " key/value heads, head size]");
}

void store_static(const at::Tensor& keys, const at::Tensor& values,
                  at::Tensor& key_cache, at::Tensor& value_cache,
                  const at::Tensor& cache_slots, const char* op) {
  TORCH_CHECK(key_cache.dim() == 4 && value_cache.dim() == 4 &&
                  key_cache.sizes().slice(0, 3) ==
                      value_cache.sizes().slice(0, 3),
              op, ": expected 4-d caches of the same slots, got ",
              key_cache.sizes(), " and ", value_cache.sizes());
  const int64_t B = key_cache.size(0), KVH = key_cache.size(1),
                T = key_cache.size(2);
  check_kv(keys, values, KVH, op);
  TORCH_CHECK(keys.size(0) == B && cache_slots.numel() == keys.size(1), op,
              ": ", keys.size(0), " rows of ", keys.size(1), " positions, ",
              cache_slots.numel(), " cache slots, for a cache of ", B,
              " rows");
  const std::vector<int64_t> slots = slots_of(cache_slots, T, op);
  auto slot_of = [&](int64_t b, int64_t l, int64_t h) {
    return (b * KVH + h) * T + slots[l];
  };
  scatter(keys, key_cache, op, slot_of);
  scatter(values, value_cache, op, slot_of);
}

void store_paged(const at::Tensor& keys, const at::Tensor& values,
                 at::Tensor& key_pool, at::Tensor& value_pool,
                 const at::Tensor& cache_slots, const char* op) {
  TORCH_CHECK(key_pool.dim() == 3 && value_pool.dim() == 3 &&
                  key_pool.sizes().slice(0, 2) ==
                      value_pool.sizes().slice(0, 2),
              op, ": expected 3-d pools of the same slots, got ",
              key_pool.sizes(), " and ", value_pool.sizes());
  const int64_t KVH = key_pool.size(1);
  check_kv(keys, values, KVH, op);
  const int64_t L = keys.size(1);
  TORCH_CHECK(cache_slots.numel() == keys.size(0) * L, op, ": ",
              cache_slots.numel(), " cache slots for ", keys.size(0),
              " rows of ", L, " positions");
  const std::vector<int64_t> slots =
      slots_of(cache_slots, key_pool.size(0), op);
  auto slot_of = [&](int64_t b, int64_t l, int64_t h) {
    return slots[b * L + l] * KVH + h;
  };
  scatter(keys, key_pool, op, slot_of);
  scatter(values, value_pool, op, slot_of);
}

// Queries [B, L, heads, D] as the kernels take them: [B, KVH, L * group,
// D], the group of query heads sharing a key/value head stacked.
at::Tensor stacked(const at::Tensor& q, int64_t KVH, const char* op) {
  TORCH_CHECK(q.dim() == 4, op, ": expected a 4-d query, got ", q.sizes());
  const int64_t B = q.size(0), L = q.size(1), heads = q.size(2),
                D = q.size(3);
  TORCH_CHECK(KVH > 0 && heads % KVH == 0, op, ": ", heads,
              " query heads do not share ", KVH, " key/value heads evenly");
  const int64_t group = heads / KVH;
  return q.reshape({B, L, KVH, group, D})
      .transpose(1, 2)
      .reshape({B, KVH, L * group, D});
}

// The kernels' output [B, KVH, L * group, Dv] as [B, L, heads, Dv].
at::Tensor unstacked(const at::Tensor& out, int64_t L) {
  const int64_t B = out.size(0), KVH = out.size(1), Dv = out.size(3);
  const int64_t group = out.size(2) / L;
  return out.view({B, KVH, L, group, Dv})
      .transpose(1, 2)
      .reshape({B, L, KVH * group, Dv});
}

at::Tensor attend_static(const at::Tensor& query, const at::Tensor& keys,
                         const at::Tensor& values, const at::Tensor& mask,
                         double scale,
                         const c10::optional<at::Tensor>& sinks,
                         const char* op) {
  static auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("spyre_kernels::decode_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, double,
                            const c10::optional<at::Tensor>&)>();
  TORCH_CHECK(keys.dim() == 4, op, ": expected a 4-d cache, got ",
              keys.sizes());
  return unstacked(attend.call(stacked(query, keys.size(1), op), keys,
                               values, mask, scale, sinks),
                   query.size(1));
}

at::Tensor attend_paged(const at::Tensor& query, const at::Tensor& key_pool,
                        const at::Tensor& value_pool,
                        const at::Tensor& block_table,
                        const at::Tensor& ctx_lens, int64_t block_size,
                        double scale, int64_t window,
                        const c10::optional<at::Tensor>& sinks,
                        const char* op) {
  static auto attend =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("spyre_kernels::paged_attention", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, int64_t, double, int64_t,
                            const c10::optional<at::Tensor>&)>();
  TORCH_CHECK(key_pool.dim() == 3, op, ": expected a 3-d pool, got ",
              key_pool.sizes());
  return unstacked(attend.call(stacked(query, key_pool.size(1), op),
                               key_pool, value_pool, block_table, ctx_lens,
                               block_size, scale, window, sinks),
                   query.size(1));
}

// ---- the ops -------------------------------------------------------------

void store_static_kv(const at::Tensor& keys, const at::Tensor& values,
                     at::Tensor& key_cache, at::Tensor& value_cache,
                     const at::Tensor& cache_slots) {
  store_static(keys, values, key_cache, value_cache, cache_slots,
               "store_static_kv");
}

void store_paged_kv(const at::Tensor& keys, const at::Tensor& values,
                    at::Tensor& key_pool, at::Tensor& value_pool,
                    const at::Tensor& cache_slots) {
  store_paged(keys, values, key_pool, value_pool, cache_slots,
              "store_paged_kv");
}

at::Tensor decode_attention_heads(const at::Tensor& query,
                                  const at::Tensor& keys,
                                  const at::Tensor& values,
                                  const at::Tensor& mask, double scale,
                                  const c10::optional<at::Tensor>& sinks) {
  return attend_static(query, keys, values, mask, scale, sinks,
                       "decode_attention_heads");
}

at::Tensor paged_attention_heads(const at::Tensor& query,
                                 const at::Tensor& key_pool,
                                 const at::Tensor& value_pool,
                                 const at::Tensor& block_table,
                                 const at::Tensor& ctx_lens,
                                 int64_t block_size, double scale,
                                 int64_t window,
                                 const c10::optional<at::Tensor>& sinks) {
  return attend_paged(query, key_pool, value_pool, block_table, ctx_lens,
                      block_size, scale, window, sinks,
                      "paged_attention_heads");
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
  TORCH_CHECK(key_cache.dim() == 4 && mask.dim() == 3, op,
              ": expected a 4-d cache and a 3-d mask, got ",
              key_cache.sizes(), " and ", mask.sizes());
  const int64_t B = key_cache.size(0), KVH = key_cache.size(1),
                L = mask.size(1);
  store_static(heads_of(key, B, L, KVH, op, "key"),
               heads_of(value, B, L, KVH, op, "value"), key_cache,
               value_cache, cache_slots, op);
  return attend_static(heads_of(query, B, L, heads, op, "query"), key_cache,
                       value_cache, mask, scale, c10::nullopt, op)
      .reshape({B * L, -1});
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
  TORCH_CHECK(key_pool.dim() == 3 && cache_slots.dim() == 2, op,
              ": expected a 3-d pool and 2-d slots, got ", key_pool.sizes(),
              " and ", cache_slots.sizes());
  const int64_t B = cache_slots.size(0), L = cache_slots.size(1),
                KVH = key_pool.size(1);
  store_paged(heads_of(key, B, L, KVH, op, "key"),
              heads_of(value, B, L, KVH, op, "value"), key_pool, value_pool,
              cache_slots, op);
  return attend_paged(heads_of(query, B, L, heads, op, "query"), key_pool,
                      value_pool, block_table, ctx_lens, block_size, scale,
                      window, c10::nullopt, op)
      .reshape({B * L, -1});
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "store_static_kv(Tensor keys, Tensor values, Tensor(a!) key_cache, "
      "Tensor(b!) value_cache, Tensor cache_slots) -> ()");
  m.def(
      "store_paged_kv(Tensor keys, Tensor values, Tensor(a!) key_pool, "
      "Tensor(b!) value_pool, Tensor cache_slots) -> ()");
  m.def(
      "decode_attention_heads(Tensor query, Tensor keys, Tensor values, "
      "Tensor mask, float scale, Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_attention_heads(Tensor query, Tensor key_pool, "
      "Tensor value_pool, Tensor block_table, Tensor ctx_lens, "
      "int block_size, float scale, int window=0, Tensor? sinks=None) "
      "-> Tensor");
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
  m.impl("store_static_kv", &store_static_kv);
  m.impl("store_paged_kv", &store_paged_kv);
  m.impl("decode_attention_heads", &decode_attention_heads);
  m.impl("paged_attention_heads", &paged_attention_heads);
  m.impl("store_decode_attention", &store_decode_attention);
  m.impl("store_paged_attention", &store_paged_attention);
}
