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
// exactly zero in the softmax.  Both ops share `attend`; they differ only
// in where the tokens are, and in how the work is shared out: the paged
// op, whose sequences differ in length, gives each thread a share of
// about equal cost.
// A continuous-batching prefill chunk is the paged op with 64 positions.
//
// What makes it fast on a vector unit: scores are computed 16 tokens at a
// time (each token's products stay in lanes until one transposed sum turns
// 16 of them into 16 scores), the exponential is a vectorised polynomial,
// and the weighted sum of values keeps a tile of output rows in registers
// while the tokens stream by.
//
// The query (and so the output) is float32 or bfloat16, and so are the
// keys and values, independently: a bfloat16 cache under a float32
// residual stream is the CPU's bfloat16 mode.  Scores, softmax and the
// weighted sum are float32 either way; a bfloat16 output is rounded once
// at the end.
//
// Same conventions as linear.cpp (GCC vector extensions, simd.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <array>
#include <type_traits>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "simd.h"

namespace {

using namespace spyre_kernels;

using bf16 = c10::BFloat16;

// Tokens ahead whose rows the kernels ask for before they read them: the
// rows of consecutive tokens are a stride apart (or in other blocks), which
// the hardware prefetcher follows only a few lines ahead.  The decode
// kernels also ask, into L2 only, for the values kFarAhead tokens on and
// the keys twice as far, which keeps more reads in flight (8-12 % faster
// over mixed lengths).
constexpr int64_t kAhead = 8;
constexpr int64_t kFarAhead = 64;

// Asks for the cache lines of a row of n elements at p: into L1 by
// default, into L2 only with Locality 2 (__builtin_prefetch's hint).
template <int Locality = 3, typename T>
inline void prefetch_row(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(c + off, 0, Locality);
}


// exp(x) for x <= 0 (a softmax after subtracting the maximum), to about
// one unit in the last place; below -87 (where exp leaves float32's normal
// range) it gives exp(-87), which no softmax sum that holds a 1 can see.
// V: a vector of floats (the 16-lane one, or the machine's own).
template <typename V>
[[gnu::always_inline]] inline V exp_nonpositive(V x) {
  using I = decltype(x < x);  // 32-bit integer lanes, as many
  const V lowest = x * 0.f - 87.f;
  x = x < lowest ? lowest : x;
  // x = n ln2 + f, |f| <= ln2 / 2; n rounded by the 1.5 * 2^23 trick.
  const float shifter = 12582912.f;
  const V t = x * 1.44269504f + shifter;
  const V n = t - shifter;
  V f = x - n * 0.693359375f;  // ln2, high bits (exact product)
  f = f - n * -2.12194440e-4f;  // ln2, the rest
  V p = f * (1.f / 5040) + (1.f / 720);
  p = p * f + (1.f / 120);
  p = p * f + (1.f / 24);
  p = p * f + (1.f / 6);
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  // 2^n: n + 127 in the exponent field.
  const I bits = (reinterpret_cast<I>(t) -
                  reinterpret_cast<I>(t * 0.f + shifter) + 127) << 23;
  return p * reinterpret_cast<V>(bits);
}

// scores[r * n + i] = scale * q_r . key of token i, for `rows` query rows,
// `group` rows per key/value head: row r reads head r / group, whose keys
// of token i are at keys[i] + (r / group) * key_stride.  kNativeLanes
// tokens at a time (16 with AVX-512, 8 with AVX2 alone) where the head
// size allows: each token's products stay in lanes, and one transposed sum
// turns them into as many scores.  Every row of a tile runs before the
// next tile, so the tile's keys (of every head) are read from memory
// once.  With fetch_ahead (keys not in the cache
// yet) the next tile's keys, and those 2 * kFarAhead tokens on, are asked
// for while a tile computes.
template <typename T>
void row_scores(const float* q, int64_t rows, int64_t group, int64_t D,
                int64_t n, const T* const* keys, int64_t key_stride,
                float scale, bool fetch_ahead, float* scores) {
  // A token's keys of every head this call reads.
  const int64_t span = (rows - 1) / group * key_stride + D;
  int64_t i = 0;
  constexpr int64_t L = kNativeLanes;
  if (D % L == 0) {
    nfloat_u acc[L];
    for (; i + L <= n; i += L) {
      if (fetch_ahead) {
        for (int64_t t = i + L; t < std::min(i + 2 * L, n); ++t)
          prefetch_row(keys[t], span);
        for (int64_t t = i + 2 * kFarAhead;
             t < std::min(i + 2 * kFarAhead + L, n); ++t)
          prefetch_row<2>(keys[t], span);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * D;
        const int64_t offset = (r / group) * key_stride;
        for (int t = 0; t < L; ++t) acc[t] = nfloat_u{};
        for (int64_t d = 0; d < D; d += L) {
          const nfloat_u qd = native_load(qr + d);
          for (int t = 0; t < L; ++t)
            acc[t] += qd * native_load(keys[i + t] + offset + d);
        }
        *reinterpret_cast<nfloat_u*>(scores + r * n + i) =
            native_transpose_sum(acc) * scale;
      }
    }
  }
  for (; i < n; ++i)
    for (int64_t r = 0; r < rows; ++r)
      scores[r * n + i] =
          dot(q + r * D, keys[i] + (r / group) * key_stride, D) * scale;
}

// out[r] = sum_i p[r * n + i] * (values[i] + offset)[0:Dv] for Rows rows:
// the sums of a tile of columns stay in registers while the tokens stream
// by, each token's values loaded once for every row (and, with
// fetch_ahead, asked for kAhead and kFarAhead tokens before).
template <int Rows, typename T>
void weigh_values(const float* p, int64_t n, const T* const* values,
                  int64_t offset, int64_t Dv, bool fetch_ahead, float* out) {
  constexpr int kTile = 4;
  int64_t c0 = 0;
  for (; c0 + kTile * kNativeLanes <= Dv; c0 += kTile * kNativeLanes) {
    nfloat_u acc[Rows][kTile] = {};
    for (int64_t i = 0; i < n; ++i) {
      if (fetch_ahead && i + kAhead < n)
        prefetch_row(values[i + kAhead] + offset + c0,
                     kTile * kNativeLanes);
      if (fetch_ahead && i + kFarAhead < n)
        prefetch_row<2>(values[i + kFarAhead] + offset + c0,
                        kTile * kNativeLanes);
      const T* v = values[i] + offset + c0;
      nfloat_u x[kTile];
      for (int c = 0; c < kTile; ++c)
        x[c] = native_load(v + c * kNativeLanes);
      for (int r = 0; r < Rows; ++r) {
        const float w = p[r * n + i];
        for (int c = 0; c < kTile; ++c) acc[r][c] += w * x[c];
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < kTile; ++c)
        *reinterpret_cast<nfloat_u*>(out + r * Dv + c0 + c * kNativeLanes) =
            acc[r][c];
  }
  for (; c0 + kNativeLanes <= Dv; c0 += kNativeLanes) {
    nfloat_u acc[Rows] = {};
    for (int64_t i = 0; i < n; ++i) {
      const nfloat_u x = native_load(values[i] + offset + c0);
      for (int r = 0; r < Rows; ++r) acc[r] += p[r * n + i] * x;
    }
    for (int r = 0; r < Rows; ++r)
      *reinterpret_cast<nfloat_u*>(out + r * Dv + c0) = acc[r];
  }
  for (int64_t j = c0; j < Dv; ++j)
    for (int r = 0; r < Rows; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i)
        sum += p[r * n + i] * static_cast<float>(values[i][offset + j]);
      out[r * Dv + j] = sum;
    }
}

// The largest of s[0:n] (-inf for n == 0), kNativeLanes at a time.
inline float row_max(const float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kNativeLanes) {
    nfloat_u m = native_load(s);
    for (i = kNativeLanes; i + kNativeLanes <= n; i += kNativeLanes) {
      const nfloat_u x = native_load(s + i);
      m = m > x ? m : x;
    }
    for (int l = 0; l < kNativeLanes; ++l) mx = std::max(mx, m[l]);
  }
  for (; i < n; ++i) mx = std::max(mx, s[i]);
  return mx;
}

// s[0:n] = exp(s - m), m = max(max(s), sink); returns their sum plus
// exp(sink - m).  The sink is an attention sink's logit (GPT-OSS): a
// column of the softmax with no value, which takes its share of the
// probability and is dropped; -inf (no sink) adds nothing.
inline float exp_shifted(
    float* s, int64_t n,
    float sink = -std::numeric_limits<float>::infinity()) {
  const float mx = std::max(row_max(s, n), sink);
  nfloat_u sums{};
  int64_t i = 0;
  for (; i + kNativeLanes <= n; i += kNativeLanes) {
    nfloat_u* v = reinterpret_cast<nfloat_u*>(s + i);
    *v = exp_nonpositive(*v - mx);
    sums += *v;
  }
  float sum = native_lane_sum(sums);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  if (sink > -std::numeric_limits<float>::infinity())
    sum += std::exp(sink - mx);
  return sum;
}

// Attention of the query rows of `heads` key/value heads at one position,
// `group` rows per head (the query heads that share it), over `n` cached
// tokens: token i's keys of head h are at keys[i] + h * key_stride, its
// values at values[i] + h * value_stride.  q: heads * group rows of D
// floats; out: as many rows of Dv floats; scores: scratch of at least
// heads * group * n floats.  With n == 0 the rows get zeros.  ahead: the
// tokens are not in the cache yet (the first position of a sequence), so
// they are asked for before they are read.  sinks: null, or the
// attention sink's logit of each of the heads * group rows.
template <typename T>
void attend(const float* q, int64_t heads, int64_t group, int64_t D,
            int64_t Dv, int64_t n, const T* const* keys, int64_t key_stride,
            const T* const* values, int64_t value_stride, float scale,
            bool ahead, float* scores, float* out,
            const float* sinks = nullptr) {
  const int64_t rows = heads * group;
  row_scores<T>(q, rows, group, D, n, keys, key_stride, scale, ahead, scores);
  for (int64_t r = 0; r < rows && n > 0; ++r) {
    float* s = scores + r * n;
    const float inverse =
        1.f / (sinks ? exp_shifted(s, n, sinks[r]) : exp_shifted(s, n));
    for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < group; g += 4) {
      const int64_t r = h * group + g;
      const float* p = scores + r * n;
      const int64_t offset = h * value_stride;
      float* o = out + r * Dv;
      switch (std::min<int64_t>(group - g, 4)) {
        case 1: weigh_values<1>(p, n, values, offset, Dv, ahead, o); break;
        case 2: weigh_values<2>(p, n, values, offset, Dv, ahead, o); break;
        case 3: weigh_values<3>(p, n, values, offset, Dv, ahead, o); break;
        default: weigh_values<4>(p, n, values, offset, Dv, ahead, o); break;
      }
    }
}

// What a work item costs beyond its tokens, in tokens (reading its query,
// the softmax's passes, writing its output).
constexpr int64_t kItemCost = 16;

// Runs f(begin, end) over items [0, costs.size()) split into one
// contiguous range per thread, of about equal total cost: item i goes to
// the thread whose share of the running total holds the item's middle.
template <typename F>
void parallel_by_cost(const std::vector<int64_t>& costs, F&& f) {
  const int64_t items = static_cast<int64_t>(costs.size());
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), items));
  int64_t total = 0;
  for (int64_t c : costs) total += c;
  std::vector<int64_t> first(threads + 1, items);
  first[0] = 0;
  int64_t before = 0, thread = 0;
  for (int64_t i = 0; i < items && total > 0; ++i) {
    const int64_t owner = std::min<int64_t>(
        threads - 1, (2 * before + costs[i]) * threads / (2 * total));
    while (thread < owner) first[++thread] = i;
    before += costs[i];
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (first[t] < first[t + 1]) f(first[t], first[t + 1]);
  });
}

void check_dtypes(const at::Tensor& query, const at::Tensor& keys,
                  const at::Tensor& values, const char* op) {
  TORCH_CHECK(float_or_bf16(query.scalar_type()) &&
                  float_or_bf16(keys.scalar_type()) &&
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

// An op's optional attention sinks ([KVH * group], one logit per query
// head, heads sharing a key/value head adjacent) as float32; undefined for
// none.
at::Tensor sinks_of(const c10::optional<at::Tensor>& sinks, int64_t heads,
                    const char* op) {
  if (!sinks.has_value() || !sinks->defined()) return at::Tensor();
  TORCH_CHECK(sinks->numel() == heads, op, ": ", sinks->numel(),
              " attention sinks for ", heads, " query heads");
  return sinks->to(at::kFloat).contiguous();
}

// What decode_attention and paged_attention share once each has checked
// its own arguments: the output [B, KVH, R, Dv] in the query's dtype, the
// query rows per key/value head and position (group = R / L, the query
// heads that share a key/value head), the scale and the attention sinks in
// float32, and the dispatch on the element types of the query (scalar_t)
// and of the cache (cache_t): f(scalar_t{}, cache_t{}, step).
struct DecodeStep {
  at::Tensor out;
  int64_t group;
  float scale;
  at::Tensor sinks;  // float32 [KVH * group], or undefined for none

  // Key/value head h's sinks, or null.
  const float* sinks_of_head(int64_t h) const {
    return sinks.defined() ? sinks.data_ptr<float>() + h * group : nullptr;
  }
};

template <typename F>
at::Tensor run_decode_step(const char* op, const at::Tensor& q,
                           at::ScalarType cache_type, int64_t B,
                           int64_t KVH, int64_t R, int64_t L, int64_t Dv,
                           double scale,
                           const c10::optional<at::Tensor>& sinks, F&& f) {
  DecodeStep step;
  step.out = at::empty({B, KVH, R, Dv}, q.options());
  step.group = R / L;
  step.scale = static_cast<float>(scale);
  step.sinks = sinks_of(sinks, KVH * step.group, op);
  with_element_type(q.scalar_type(), [&](auto q_zero) {
    with_element_type(cache_type,
                      [&](auto kv_zero) { f(q_zero, kv_zero, step); });
  });
  return step.out;
}

// One work item's query rows in float32, `rows` per key/value head, and
// its output rows written back from float32 (rounded once for bfloat16).
struct Rows {
  int64_t rows, D, Dv;
  std::vector<float> q, out;
  Rows(int64_t heads, int64_t rows, int64_t D, int64_t Dv)
      : rows(rows), D(D), Dv(Dv), q(heads * rows * D),
        out(heads * rows * Dv) {}

  // Head h's rows from src.
  template <typename T>
  void read(int64_t h, const T* src) {
    float* dst = q.data() + h * rows * D;
    for (int64_t j = 0; j < rows * D; ++j) dst[j] = static_cast<float>(src[j]);
  }
  // Head h's output rows to dst.
  template <typename T>
  void write(int64_t h, T* dst) const {
    const float* src = out.data() + h * rows * Dv;
    for (int64_t j = 0; j < rows * Dv; ++j) dst[j] = static_cast<T>(src[j]);
  }
};

// query: [B, KVH, R, D], R = L * group rows per key/value head (row r is
// query position r / group); keys: [B, KVH, T, D]; values: [B, KVH, T, Dv];
// mask: [B, L, T] bool, true = may attend; sinks: none, or [KVH * group]
// attention sinks (float).  Returns [B, KVH, R, Dv].  A row that may
// attend to nothing gets zeros.
at::Tensor decode_attention(const at::Tensor& query, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& mask,
                            double scale,
                            const c10::optional<at::Tensor>& sinks) {
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
  return run_decode_step(
      "decode_attention", q, k.scalar_type(), B, KVH, R, L, Dv, scale, sinks,
      [&](auto q_zero, auto kv_zero, const DecodeStep& step) {
  using scalar_t = decltype(q_zero);
  using cache_t = decltype(kv_zero);
  const int64_t group = step.group;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kp = k.data_ptr<cache_t>();
  const cache_t* vp = v.data_ptr<cache_t>();
  const bool* mp = m.data_ptr<bool>();
  scalar_t* op = step.out.data_ptr<scalar_t>();
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<const cache_t*> keys(T), values(T);
    std::vector<float> scores(group * T);
    Rows rows(1, group, D, Dv);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KVH;
      const cache_t* kh = kp + bh * T * D;
      const cache_t* vh = vp + bh * T * Dv;
      for (int64_t pos = 0; pos < L; ++pos) {
        const bool* visible = mp + (b * L + pos) * T;
        int64_t n = 0;
        for (int64_t t = 0; t < T; ++t)
          if (visible[t]) {
            keys[n] = kh + t * D;
            values[n++] = vh + t * Dv;
          }
        const int64_t r0 = bh * R + pos * group;
        rows.read(0, qp + r0 * D);
        attend<cache_t>(rows.q.data(), 1, group, D, Dv, n, keys.data(), 0,
                        values.data(), 0, step.scale, pos == 0,
                        scores.data(), rows.out.data(),
                        step.sinks_of_head(bh % KVH));
        rows.write(0, op + r0 * Dv);
      }
    }
  });
      });
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
// torch-op path, which would give NaN there, agrees).  window > 0: each
// position sees only the last `window` of those tokens (sliding-window
// attention).  sinks: none, or [KVH * group] attention sinks (float).
// Returns [B, KVH, R, Dv].
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key_pool,
                           const at::Tensor& value_pool,
                           const at::Tensor& block_table,
                           const at::Tensor& ctx_lens, int64_t block_size,
                           double scale, int64_t window,
                           const c10::optional<at::Tensor>& sinks) {
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
  TORCH_CHECK(window >= 0, "paged_attention: window ", window,
              " is negative");
  // The first token a position of n tokens sees.
  auto first_seen = [window](int64_t n) {
    return window > 0 && n > window ? n - window : int64_t{0};
  };
  return run_decode_step(
      "paged_attention", q, kp.scalar_type(), B, KVH, R, L, Dv, scale, sinks,
      [&](auto q_zero, auto kv_zero, const DecodeStep& step) {
  using scalar_t = decltype(q_zero);
  using cache_t = decltype(kv_zero);
  const int64_t group = step.group;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const cache_t* kbase = kp.data_ptr<cache_t>();
  const cache_t* vbase = vp.data_ptr<cache_t>();
  scalar_t* op = step.out.data_ptr<scalar_t>();
  // One work item per (sequence, key/value head, query position), shared
  // out by their cost (the tokens each reads): under continuous batching
  // the sequences of a step hold anything from a few tokens to thousands.
  std::vector<int64_t> costs(B * KVH * L);
  for (int64_t item = 0; item < B * KVH * L; ++item) {
    const int64_t n = clp[item / (KVH * L) * L + item % L];
    costs[item] = n - first_seen(n) + kItemCost;
  }
  parallel_by_cost(costs, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(group * MB * block_size);
    // Where each token of the current (sequence, head) is, filled as far
    // as a query position needs: the positions of one sequence share them.
    std::vector<const cache_t*> keys(MB * block_size),
        values(MB * block_size);
    int64_t located_bh = -1, located = 0;
    Rows rows(1, group, D, Dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pos = item % L, bh = item / L;
      const int64_t b = bh / KVH, h = bh % KVH;
      const int64_t* table = btp + b * MB;
      const int64_t n = clp[b * L + pos];
      if (bh != located_bh) located_bh = bh, located = 0;
      for (; located < n; ++located) {
        const int64_t slot = table[located / block_size] * block_size +
                             located % block_size;
        keys[located] = kbase + (slot * KVH + h) * D;
        values[located] = vbase + (slot * KVH + h) * Dv;
      }
      const int64_t r0 = bh * R + pos * group, first = first_seen(n);
      rows.read(0, qp + r0 * D);
      // A sequence's later positions find its tokens in the cache.
      attend<cache_t>(rows.q.data(), 1, group, D, Dv, n - first,
                      keys.data() + first, 0, values.data() + first, 0,
                      step.scale, item == begin || pos == 0, scores.data(),
                      rows.out.data(), step.sinks_of_head(h));
      rows.write(0, op + r0 * Dv);
    }
  });
      });
}

// ---- Encoder attention ---------------------------------------------------
//
// An encoder pass packs several texts into each row of a [B, L] batch, and
// every token attends to all the tokens of its own text and to nothing
// else: the attention of a text is a small dense problem of its own.  Each
// (text, head) is one work item: the text's keys are transposed once into
// a [D, n] panel, then its queries run 16 at a time through the two
// products, each computed in register tiles (up to 4 query rows by 64 key
// columns for the scores, up to 16 output vectors for the weighted sum),
// with the softmax in between on the 16 rows' scores, which stay in the
// first-level cache.

// s[r * lds + c0 + j] = scale * q[r] . kt[:, c0 + j], j < Cols * 16, for
// Rows query rows of D floats (q, row stride D) against a key panel kt
// ([D, ld] floats, token j of the text in column j).
template <int Rows, int Cols>
void score_tile(const float* q, int64_t D, const float* kt, int64_t ld,
                int64_t c0, float scale, float* s, int64_t lds) {
  vfloat_u acc[Rows][Cols] = {};
  for (int64_t d = 0; d < D; ++d) {
    vfloat_u k[Cols];
    for (int c = 0; c < Cols; ++c) k[c] = load(kt + d * ld + c0 + c * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float x = q[r * D + d];
      for (int c = 0; c < Cols; ++c) acc[r][c] += x * k[c];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      *reinterpret_cast<vfloat_u*>(s + r * lds + c0 + c * kLanes) =
          acc[r][c] * scale;
}

template <int Rows>
void score_rows(const float* q, int64_t D, const float* kt, int64_t ld,
                float scale, float* s) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLanes <= ld; c0 += 4 * kLanes)
    score_tile<Rows, 4>(q, D, kt, ld, c0, scale, s, ld);
  switch ((ld - c0) / kLanes) {
    case 3: score_tile<Rows, 3>(q, D, kt, ld, c0, scale, s, ld); break;
    case 2: score_tile<Rows, 2>(q, D, kt, ld, c0, scale, s, ld); break;
    case 1: score_tile<Rows, 1>(q, D, kt, ld, c0, scale, s, ld); break;
    default: break;
  }
}

// out[r * Dv + c0 + j] = inv[r] * sum_t p[r * ldp + t] * v[t][c0 + j],
// j < Cols * 16, for Rows rows.
template <int Rows, int Cols, typename T>
void weigh_tile(const float* p, int64_t ldp, int64_t n, const T* const* v,
                int64_t c0, const float* inv, float* out, int64_t Dv) {
  vfloat_u acc[Rows][Cols] = {};
  for (int64_t t = 0; t < n; ++t) {
    vfloat_u x[Cols];
    for (int c = 0; c < Cols; ++c) x[c] = load(v[t] + c0 + c * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const float w = p[r * ldp + t];
      for (int c = 0; c < Cols; ++c) acc[r][c] += w * x[c];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      *reinterpret_cast<vfloat_u*>(out + r * Dv + c0 + c * kLanes) =
          acc[r][c] * inv[r];
}

// The weighted sums of `rows` (at most 16) rows, over every column: tiles
// of 4 rows by 64 columns, or of 8 rows by 32 for a 32-column head.
template <typename T>
void weigh_rows(const float* p, int64_t ldp, int64_t rows, int64_t n,
                const T* const* v, int64_t Dv, const float* inv,
                float* out) {
  int64_t c0 = 0;
  auto tiles = [&](auto rows_per_tile, auto cols) {
    constexpr int R = decltype(rows_per_tile)::value;
    constexpr int C = decltype(cols)::value;
    for (; c0 + C * kLanes <= Dv; c0 += C * kLanes) {
      int64_t r = 0;
      for (; r + R <= rows; r += R)
        weigh_tile<R, C, T>(p + r * ldp, ldp, n, v, c0, inv + r,
                            out + r * Dv, Dv);
      for (; r < rows; ++r)
        weigh_tile<1, C, T>(p + r * ldp, ldp, n, v, c0, inv + r,
                            out + r * Dv, Dv);
    }
  };
  tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
  tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
  tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{});
  for (int64_t j = c0; j < Dv; ++j)
    for (int64_t r = 0; r < rows; ++r) {
      float sum = 0.f;
      for (int64_t t = 0; t < n; ++t)
        sum += p[r * ldp + t] * static_cast<float>(v[t][j]);
      out[r * Dv + j] = sum * inv[r];
    }
}

#if defined(__AVX512BF16__)
// The same two products on the CPU's bfloat16 dot-product instruction,
// which multiplies pairs of bfloat16 and adds both products to a float32
// lane: twice the multiply-adds of a float32 instruction.  Operands are
// packed as 32-bit lanes holding two bfloat16, the pair a lane sums over:
// for the scores, two adjacent head dimensions; for the weighted sum, two
// adjacent tokens.
constexpr bool kBf16Dot = true;

inline __m512bh pairs(const uint32_t* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
inline __m512bh broadcast_pair(uint32_t pair) {
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
}

// out[r * ldo + c0 + j] = scale[r * scale_step] * sum_k a[r * lda + k] .
// b[k * ldb + c0 + j] for Rows rows, j < Cols * 16, k < K: both products
// of attention, each lane of a and b a pair of bfloat16.  Scores: a the
// queries (pairs of head dimensions), b the transposed keys, one scale.
// Weighted sums: a the probabilities (pairs of tokens), b the values
// paired token by token, each row scaled by its softmax's 1 / sum.
template <int Rows, int Cols>
void dot_tile_bf16(const uint32_t* a, int64_t lda, int64_t K,
                   const uint32_t* b, int64_t ldb, int64_t c0,
                   const float* scale, int64_t scale_step, float* out,
                   int64_t ldo) {
  __m512 acc[Rows][Cols];
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512bh x[Cols];
    for (int c = 0; c < Cols; ++c) x[c] = pairs(b + k * ldb + c0 + c * kLanes);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh w = broadcast_pair(a[r * lda + k]);
      for (int c = 0; c < Cols; ++c)
        acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, x[c]);
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int c = 0; c < Cols; ++c)
      _mm512_storeu_ps(out + r * ldo + c0 + c * kLanes,
                       _mm512_mul_ps(acc[r][c],
                                     _mm512_set1_ps(scale[r * scale_step])));
}

// Scores of Rows query rows (D2 pairs each) against the key panel kt
// [D2, ld], into s (row stride ld).
template <int Rows>
void score_rows_bf16(const uint32_t* q, int64_t D2, const uint32_t* kt,
                     int64_t ld, float scale, float* s) {
  int64_t c0 = 0;
  for (; c0 + 4 * kLanes <= ld; c0 += 4 * kLanes)
    dot_tile_bf16<Rows, 4>(q, D2, D2, kt, ld, c0, &scale, 0, s, ld);
  switch ((ld - c0) / kLanes) {
    case 3: dot_tile_bf16<Rows, 3>(q, D2, D2, kt, ld, c0, &scale, 0, s, ld);
            break;
    case 2: dot_tile_bf16<Rows, 2>(q, D2, D2, kt, ld, c0, &scale, 0, s, ld);
            break;
    case 1: dot_tile_bf16<Rows, 1>(q, D2, D2, kt, ld, c0, &scale, 0, s, ld);
            break;
    default: break;
  }
}

// The weighted sums of `rows` rows (at most 16) over the columns that fill
// whole 16-lane vectors; returns the first column left (done in float32 by
// the caller).
int64_t weigh_rows_bf16(const uint32_t* p, int64_t ldp, int64_t rows,
                        int64_t n2, const uint32_t* v, int64_t Dv,
                        const float* inv, float* out) {
  int64_t c0 = 0;
  auto tiles = [&](auto rows_per_tile, auto cols) {
    constexpr int R = decltype(rows_per_tile)::value;
    constexpr int C = decltype(cols)::value;
    for (; c0 + C * kLanes <= Dv; c0 += C * kLanes) {
      int64_t r = 0;
      for (; r + R <= rows; r += R)
        dot_tile_bf16<R, C>(p + r * ldp, ldp, n2, v, Dv, c0, inv + r, 1,
                            out + r * Dv, Dv);
      for (; r < rows; ++r)
        dot_tile_bf16<1, C>(p + r * ldp, ldp, n2, v, Dv, c0, inv + r, 1,
                            out + r * Dv, Dv);
    }
  };
  tiles(std::integral_constant<int, 4>{}, std::integral_constant<int, 4>{});
  tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 2>{});
  tiles(std::integral_constant<int, 8>{}, std::integral_constant<int, 1>{});
  return c0;
}

// Rounds n floats (n a multiple of 16) to bfloat16, in order.
inline void round_to_bf16(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; i += kLanes)
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + i),
        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i))));
}
#else
constexpr bool kBf16Dot = false;
#endif

// The texts of a packed batch: runs of slots sharing a text_starts value,
// which must be the run's first slot.  Returns (row, first slot, length).
std::vector<std::array<int64_t, 3>> texts_of(const at::Tensor& text_starts) {
  const int64_t B = text_starts.size(0), L = text_starts.size(1);
  const int64_t* ts = text_starts.data_ptr<int64_t>();
  std::vector<std::array<int64_t, 3>> texts;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t l = 0; l < L; ++l) {
      const int64_t start = ts[b * L + l];
      if (start == l) {
        texts.push_back({b, l, 1});
      } else {
        TORCH_CHECK(l > 0 && start == ts[b * L + l - 1],
                    "encoder_attention: slot ", l, " of row ", b,
                    " has text start ", start, ", neither itself nor the "
                    "start of the slot before it");
        ++texts.back()[2];
      }
    }
  return texts;
}

// One (text, head) work item's scratch, and the float32 products.
template <typename T>
struct EncoderItem {
  static constexpr int64_t kBlock = 16;  // query rows per pass
  int64_t D, Dv, ld = 0, n = 0;
  std::vector<float> kt, qb, s, ob, inv;
  std::vector<const T*> vrows;
#if defined(__AVX512BF16__)
  int64_t D2;
  std::vector<uint32_t> kt2, q2, v2, p2;
  std::vector<uint16_t> row;
#endif

  EncoderItem(int64_t D, int64_t Dv, int64_t longest, int64_t panel,
              bool bf16)
      : D(D), Dv(Dv), s(kBlock * panel), ob(kBlock * Dv), inv(kBlock),
        vrows(longest) {
#if defined(__AVX512BF16__)
    D2 = (D + 1) / 2;
    if (bf16) {
      kt2.resize(D2 * panel);
      q2.resize(kBlock * D2);
      v2.resize(panel / 2 * Dv);
      p2.resize(kBlock * panel / 2);
      row.resize(std::max(2 * D2, Dv));
      return;
    }
#endif
    kt.resize(D * panel);
    qb.resize(kBlock * D);
  }

  // Float32: keys transposed into [D, ld].
  void pack(const T* const* keys) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d)
        kt[d * ld + t] = static_cast<float>(keys[t][d]);
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = n; t < ld; ++t) kt[d * ld + t] = 0.f;
  }

  // Float32: `rows` query rows from r0 into out.
  void run(const T* const* queries, int64_t rows, float scale) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t d = 0; d < D; ++d)
        qb[r * D + d] = static_cast<float>(queries[r][d]);
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      score_rows<4>(qb.data() + r * D, D, kt.data(), ld, scale,
                    s.data() + r * ld);
    switch (rows - r) {
      case 3: score_rows<3>(qb.data() + r * D, D, kt.data(), ld, scale,
                            s.data() + r * ld); break;
      case 2: score_rows<2>(qb.data() + r * D, D, kt.data(), ld, scale,
                            s.data() + r * ld); break;
      case 1: score_rows<1>(qb.data() + r * D, D, kt.data(), ld, scale,
                            s.data() + r * ld); break;
      default: break;
    }
    for (int64_t i = 0; i < rows; ++i)
      inv[i] = 1.f / exp_shifted(s.data() + i * ld, n);
    weigh_rows<T>(s.data(), ld, rows, n, vrows.data(), Dv, inv.data(),
                  ob.data());
  }

#if defined(__AVX512BF16__)
  // bfloat16 pairs of a row of m elements (zero past m) into 2 * pairs.
  const uint32_t* paired(const T* src, int64_t m, int64_t count) {
    for (int64_t d = 0; d < 2 * count; ++d)
      row[d] = c10::BFloat16(d < m ? static_cast<float>(src[d]) : 0.f).x;
    return reinterpret_cast<const uint32_t*>(row.data());
  }

  // bfloat16: keys as [D2, ld] pairs of head dimensions, values as
  // [ld / 2, Dv] pairs of tokens.
  void pack_bf16(const T* const* keys) {
    for (int64_t t = 0; t < ld; ++t) {
      if (t < n) {
        const uint32_t* k = paired(keys[t], D, D2);
        for (int64_t j = 0; j < D2; ++j) kt2[j * ld + t] = k[j];
      } else {
        for (int64_t j = 0; j < D2; ++j) kt2[j * ld + t] = 0;
      }
    }
    auto bits = [&](int64_t t, int64_t c) -> uint32_t {
      return t < n ? c10::BFloat16(static_cast<float>(vrows[t][c])).x : 0;
    };
    for (int64_t t2 = 0; t2 < ld / 2; ++t2)
      for (int64_t c = 0; c < Dv; ++c)
        v2[t2 * Dv + c] = bits(2 * t2, c) | bits(2 * t2 + 1, c) << 16;
  }

  void run_bf16(const T* const* queries, int64_t rows, float scale) {
    for (int64_t r = 0; r < rows; ++r) {
      const uint32_t* q = paired(queries[r], D, D2);
      std::copy(q, q + D2, q2.data() + r * D2);
    }
    int64_t r = 0;
    for (; r + 4 <= rows; r += 4)
      score_rows_bf16<4>(q2.data() + r * D2, D2, kt2.data(), ld, scale,
                         s.data() + r * ld);
    switch (rows - r) {
      case 3: score_rows_bf16<3>(q2.data() + r * D2, D2, kt2.data(), ld,
                                 scale, s.data() + r * ld); break;
      case 2: score_rows_bf16<2>(q2.data() + r * D2, D2, kt2.data(), ld,
                                 scale, s.data() + r * ld); break;
      case 1: score_rows_bf16<1>(q2.data() + r * D2, D2, kt2.data(), ld,
                                 scale, s.data() + r * ld); break;
      default: break;
    }
    const int64_t half = ld / 2;
    for (int64_t i = 0; i < rows; ++i) {
      float* si = s.data() + i * ld;
      inv[i] = 1.f / exp_shifted(si, n);
      std::fill(si + n, si + ld, 0.f);
      round_to_bf16(si, ld, reinterpret_cast<uint16_t*>(p2.data() + i * half));
    }
    const int64_t c0 = weigh_rows_bf16(p2.data(), half, rows, half,
                                       v2.data(), Dv, inv.data(), ob.data());
    for (int64_t c = c0; c < Dv; ++c)
      for (int64_t i = 0; i < rows; ++i) {
        float sum = 0.f;
        for (int64_t t = 0; t < n; ++t)
          sum += s[i * ld + t] * static_cast<float>(vrows[t][c]);
        ob[i * Dv + c] = sum * inv[i];
      }
  }
#endif
};

// query, keys: [B, L, H, D]; values: [B, L, H, Dv] (any strides with the
// last one 1, as FMS's fused projection leaves them); text_starts: [B, L]
// int64, the first slot of each slot's text (a slot alone: itself).
// Returns [B, L, H, Dv], every slot attending to the slots of its text.
// With bf16_products (and a CPU that has the instruction) both products
// take bfloat16 operands (the probabilities rounded to bfloat16, float32
// accumulation); otherwise they run in float32.
at::Tensor encoder_attention(const at::Tensor& query, const at::Tensor& keys,
                             const at::Tensor& values,
                             const at::Tensor& text_starts, double scale,
                             bool bf16_products) {
  check_dtypes(query, keys, values, "encoder_attention");
  TORCH_CHECK(query.scalar_type() == keys.scalar_type(),
              "encoder_attention: query and keys of one dtype, got ",
              query.scalar_type(), " and ", keys.scalar_type());
  TORCH_CHECK(query.dim() == 4 && keys.dim() == 4 && values.dim() == 4 &&
                  text_starts.dim() == 2 &&
                  text_starts.scalar_type() == at::kLong,
              "encoder_attention: expected 4-d query/keys/values and 2-d "
              "int64 text_starts");
  const int64_t B = query.size(0), L = query.size(1), H = query.size(2),
                D = query.size(3), Dv = values.size(3);
  TORCH_CHECK(keys.size(0) == B && keys.size(1) == L && keys.size(2) == H &&
                  keys.size(3) == D && values.size(0) == B &&
                  values.size(1) == L && values.size(2) == H &&
                  text_starts.size(0) == B && text_starts.size(1) == L,
              "encoder_attention: query ", query.sizes(), ", keys ",
              keys.sizes(), ", values ", values.sizes(), " and text_starts ",
              text_starts.sizes(), " do not match");
  auto last_dense = [](const at::Tensor& t) {
    return t.stride(3) == 1 ? t : t.contiguous();
  };
  const at::Tensor q = last_dense(query), k = last_dense(keys),
                   v = last_dense(values);
  const auto texts = texts_of(text_starts.contiguous());
  int64_t longest = 0;
  for (const auto& t : texts) longest = std::max(longest, t[2]);
  const int64_t panel = (longest + kLanes - 1) / kLanes * kLanes;
  const bool bf16 = bf16_products && kBf16Dot;
  at::Tensor out = at::empty({B, L, H, Dv}, q.options());
  const float fscale = static_cast<float>(scale);
  with_element_type(q.scalar_type(), [&](auto zero) {
  using T = decltype(zero);
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();
  auto at_slot = [](const at::Tensor& t, const T* base, int64_t b, int64_t l,
                    int64_t h) {
    return base + b * t.stride(0) + l * t.stride(1) + h * t.stride(2);
  };
  const int64_t items = static_cast<int64_t>(texts.size()) * H;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    using Item = EncoderItem<T>;
    Item work(D, Dv, longest, panel, bf16);
    std::vector<const T*> krows(longest), qrows(longest);
    for (int64_t item = begin; item < end; ++item) {
      const auto& text = texts[item / H];
      const int64_t h = item % H, b = text[0], first = text[1], n = text[2];
      work.n = n;
      work.ld = (n + kLanes - 1) / kLanes * kLanes;
      for (int64_t t = 0; t < n; ++t) {
        if (t + kAhead < n) {
          // The rows are a stride apart in memory: fetch ahead what this
          // item reads next (this token's query and values included).
          prefetch_row(at_slot(k, kp, b, first + t + kAhead, h), D);
          prefetch_row(at_slot(v, vp, b, first + t + kAhead, h), Dv);
          prefetch_row(at_slot(q, qp, b, first + t + kAhead, h), D);
        }
        krows[t] = at_slot(k, kp, b, first + t, h);
        work.vrows[t] = at_slot(v, vp, b, first + t, h);
        qrows[t] = at_slot(q, qp, b, first + t, h);
      }
#if defined(__AVX512BF16__)
      if (bf16) work.pack_bf16(krows.data()); else
#endif
      work.pack(krows.data());
      for (int64_t r0 = 0; r0 < n; r0 += Item::kBlock) {
        const int64_t rows = std::min(Item::kBlock, n - r0);
#if defined(__AVX512BF16__)
        if (bf16) work.run_bf16(qrows.data() + r0, rows, fscale); else
#endif
        work.run(qrows.data() + r0, rows, fscale);
        for (int64_t i = 0; i < rows; ++i) {
          T* dst = op + ((b * L + first + r0 + i) * H + h) * Dv;
          for (int64_t j = 0; j < Dv; ++j)
            dst[j] = static_cast<T>(work.ob[i * Dv + j]);
        }
      }
    }
  });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def(
      "decode_attention(Tensor query, Tensor keys, Tensor values, "
      "Tensor mask, float scale, Tensor? sinks=None) -> Tensor");
  m.def(
      "paged_attention(Tensor query, Tensor key_pool, Tensor value_pool, "
      "Tensor block_table, Tensor ctx_lens, int block_size, float scale, "
      "int window=0, Tensor? sinks=None) "
      "-> Tensor");
  m.def(
      "encoder_attention(Tensor query, Tensor keys, Tensor values, "
      "Tensor text_starts, float scale, bool bf16_products) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("paged_attention", &paged_attention);
  m.impl("encoder_attention", &encoder_attention);
}
