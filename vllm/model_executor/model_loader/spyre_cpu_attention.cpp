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
// in where the tokens are (the paged op runs every key/value head of a
// position in one pass, since a token's heads are adjacent in the pool).
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

typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The sum of the lanes of v, as a tree (the lanes are independent, so the
// adds need not wait on one another).
inline float lane_sum(vfloat_u v) {
  float s8[8], s4[4];
  for (int l = 0; l < 8; ++l) s8[l] = v[l] + v[l + 8];
  for (int l = 0; l < 4; ++l) s4[l] = s8[l] + s8[l + 4];
  return (s4[0] + s4[2]) + (s4[1] + s4[3]);
}

template <typename T>
float dot(const float* a, const T* b, int64_t n) {
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

// exp(x) for x <= 0 (a softmax after subtracting the maximum), to about
// one unit in the last place; below -87 (where exp leaves float32's normal
// range) it gives exp(-87), which no softmax sum that holds a 1 can see.
[[gnu::always_inline]] inline vfloat_u exp_nonpositive(vfloat_u x) {
  const vfloat_u lowest = x * 0.f - 87.f;
  x = x < lowest ? lowest : x;
  // x = n ln2 + f, |f| <= ln2 / 2; n rounded by the 1.5 * 2^23 trick.
  const float shifter = 12582912.f;
  const vfloat_u t = x * 1.44269504f + shifter;
  const vfloat_u n = t - shifter;
  vfloat_u f = x - n * 0.693359375f;  // ln2, high bits (exact product)
  f = f - n * -2.12194440e-4f;  // ln2, the rest
  vfloat_u p = f * (1.f / 5040) + (1.f / 720);
  p = p * f + (1.f / 120);
  p = p * f + (1.f / 24);
  p = p * f + (1.f / 6);
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  // 2^n: n + 127 in the exponent field.
  const vint bits = (reinterpret_cast<vint>(t) -
                     reinterpret_cast<vint>(t * 0.f + shifter) + 127) << 23;
  return p * reinterpret_cast<vfloat_u>(bits);
}

// scores[r * n + i] = scale * q_r . key of token i, for `rows` query rows,
// `group` rows per key/value head: row r reads head r / group, whose keys
// of token i are at keys[i] + (r / group) * key_stride.  16 tokens at a
// time where the head size allows: each token's products stay in lanes,
// and one transposed sum turns 16 of them into 16 scores.  Every row of a
// 16-token tile runs before the next tile, so the tile's keys (of every
// head) are read from memory once.
template <typename T>
void row_scores(const float* q, int64_t rows, int64_t group, int64_t D,
                int64_t n, const T* const* keys, int64_t key_stride,
                float scale, float* scores) {
  int64_t i = 0;
  if (D % kLanes == 0) {
    vfloat_u acc[kLanes];
    for (; i + kLanes <= n; i += kLanes) {
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = q + r * D;
        const int64_t offset = (r / group) * key_stride;
        for (int t = 0; t < kLanes; ++t) acc[t] = vfloat_u{};
        for (int64_t d = 0; d < D; d += kLanes) {
          const vfloat_u qd = load(qr + d);
          for (int t = 0; t < kLanes; ++t)
            acc[t] += qd * load(keys[i + t] + offset + d);
        }
        *reinterpret_cast<vfloat_u*>(scores + r * n + i) =
            transpose_sum(acc) * scale;
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
// by, each token's values loaded once for every row.
template <int Rows, typename T>
void weigh_values(const float* p, int64_t n, const T* const* values,
                  int64_t offset, int64_t Dv, float* out) {
  constexpr int kTile = 4;
  int64_t c0 = 0;
  for (; c0 + kTile * kLanes <= Dv; c0 += kTile * kLanes) {
    vfloat_u acc[Rows][kTile] = {};
    for (int64_t i = 0; i < n; ++i) {
      const T* v = values[i] + offset + c0;
      vfloat_u x[kTile];
      for (int c = 0; c < kTile; ++c) x[c] = load(v + c * kLanes);
      for (int r = 0; r < Rows; ++r) {
        const float w = p[r * n + i];
        for (int c = 0; c < kTile; ++c) acc[r][c] += w * x[c];
      }
    }
    for (int r = 0; r < Rows; ++r)
      for (int c = 0; c < kTile; ++c)
        *reinterpret_cast<vfloat_u*>(out + r * Dv + c0 + c * kLanes) =
            acc[r][c];
  }
  for (; c0 + kLanes <= Dv; c0 += kLanes) {
    vfloat_u acc[Rows] = {};
    for (int64_t i = 0; i < n; ++i) {
      const vfloat_u x = load(values[i] + offset + c0);
      for (int r = 0; r < Rows; ++r) acc[r] += p[r * n + i] * x;
    }
    for (int r = 0; r < Rows; ++r)
      *reinterpret_cast<vfloat_u*>(out + r * Dv + c0) = acc[r];
  }
  for (int64_t j = c0; j < Dv; ++j)
    for (int r = 0; r < Rows; ++r) {
      float sum = 0.f;
      for (int64_t i = 0; i < n; ++i)
        sum += p[r * n + i] * static_cast<float>(values[i][offset + j]);
      out[r * Dv + j] = sum;
    }
}

// s[0:n] = exp(s - max(s)); returns their sum.
inline float exp_shifted(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = std::max(mx, s[i]);
  vfloat_u sums{};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    vfloat_u* v = reinterpret_cast<vfloat_u*>(s + i);
    *v = exp_nonpositive(*v - mx);
    sums += *v;
  }
  float sum = lane_sum(sums);
  for (; i < n; ++i) {
    s[i] = std::exp(s[i] - mx);
    sum += s[i];
  }
  return sum;
}

// Attention of the query rows of `heads` key/value heads at one position,
// `group` rows per head (the query heads that share it), over `n` cached
// tokens: token i's keys of head h are at keys[i] + h * key_stride, its
// values at values[i] + h * value_stride.  q: heads * group rows of D
// floats; out: as many rows of Dv floats; scores: scratch of at least
// heads * group * n floats.  With n == 0 the rows get zeros.
template <typename T>
void attend(const float* q, int64_t heads, int64_t group, int64_t D,
            int64_t Dv, int64_t n, const T* const* keys, int64_t key_stride,
            const T* const* values, int64_t value_stride, float scale,
            float* scores, float* out) {
  const int64_t rows = heads * group;
  row_scores<T>(q, rows, group, D, n, keys, key_stride, scale, scores);
  for (int64_t r = 0; r < rows && n > 0; ++r) {
    float* s = scores + r * n;
    const float inverse = 1.f / exp_shifted(s, n);
    for (int64_t i = 0; i < n; ++i) s[i] *= inverse;
  }
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t g = 0; g < group; g += 4) {
      const int64_t r = h * group + g;
      const float* p = scores + r * n;
      const int64_t offset = h * value_stride;
      float* o = out + r * Dv;
      switch (std::min<int64_t>(group - g, 4)) {
        case 1: weigh_values<1>(p, n, values, offset, Dv, o); break;
        case 2: weigh_values<2>(p, n, values, offset, Dv, o); break;
        case 3: weigh_values<3>(p, n, values, offset, Dv, o); break;
        default: weigh_values<4>(p, n, values, offset, Dv, o); break;
      }
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
                        values.data(), 0, fscale, scores.data(),
                        rows.out.data());
        rows.write(0, op + r0 * Dv);
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
  // One work item per (sequence, query position), all key/value heads
  // together: a token's keys (and values) of every head are adjacent in
  // the pool, so a pass over the tokens reads them in one stream.
  at::parallel_for(0, B * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(KVH * group * MB * block_size);
    // Where each token of the current sequence is (its first head's keys
    // and values), filled as far as a query position needs: the positions
    // of one sequence share them.
    std::vector<const cache_t*> keys(MB * block_size),
        values(MB * block_size);
    int64_t located_b = -1, located = 0;
    Rows rows(KVH, group, D, Dv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t pos = item % L, b = item / L;
      const int64_t* table = btp + b * MB;
      const int64_t n = clp[b * L + pos];
      if (b != located_b) located_b = b, located = 0;
      for (; located < n; ++located) {
        const int64_t slot = table[located / block_size] * block_size +
                             located % block_size;
        keys[located] = kbase + slot * KVH * D;
        values[located] = vbase + slot * KVH * Dv;
      }
      for (int64_t h = 0; h < KVH; ++h)
        rows.read(h, qp + ((b * KVH + h) * R + pos * group) * D);
      attend<cache_t>(rows.q.data(), KVH, group, D, Dv, n, keys.data(), D,
                      values.data(), Dv, fscale, scores.data(),
                      rows.out.data());
      for (int64_t h = 0; h < KVH; ++h)
        rows.write(h, op + ((b * KVH + h) * R + pos * group) * Dv);
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
