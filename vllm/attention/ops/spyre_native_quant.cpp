// Linear layers whose weights stay quantized: 8-bit integers, FP8
// (float8_e4m3fn) or 4-bit integers, read as they are and dequantized in
// registers.
//
// A decode step streams every weight once, so the bytes per weight set its
// time: one byte (int8, FP8) or half a byte (int4) against bfloat16's two.
// The weight [N, K] is packed once, at load time, like the float kernel's
// (spyre_native_linear.cpp): column blocks of kBlock outputs, one row of
// the block per input feature, so that a block streams contiguously:
//
//   int8, FP8:  [N / kBlock][K][kBlock] bytes (column c of row k at c);
//   int4:       [N / kBlock][K][kBlock / 2] bytes, the low nibble of byte
//               c holding column c and the high nibble column c + 16,
//               each the code (-8..7) plus 8.
//
// Scales come per group of input features and per column, [N / kBlock]
// [G][kBlock] float32 (G = ceil(K / group size), the last group possibly
// shorter; one group: per-channel or per-tensor scales), with
// optional offsets of the same shape: the weight of column c at feature k
// in group g is code * scale[g][c] + offset[g][c].  An FP8 code is the
// e4m3 value times 2^-8 (its bits widened to a half float, see
// fp8_codes): the packer folds the 2^8 into the scales.
//
// Inputs and sums are float32, so a layer computes exactly the product of
// its input by the dequantized weight (up to the order of the sums): the
// format's reference, not an approximation of it.
//
// Many rows of rounded inputs (a prompt under the bfloat16 precision) are
// bound by arithmetic, not by reading the weight.  From dense_rows rows on
// (the caller sets it where the CPU multiplies bfloat16 on AMX tiles), the
// weight is dequantized into a bfloat16 scratch [K, N], one layer at a
// time, and the product runs on oneDNN: the weight rounded to bfloat16, the
// output rounded to bfloat16 before the bias, as a bfloat16 layer's prompt
// is (spyre_linear.onednn_bf16_linear).
//
// Written with GCC vector extensions, as the float kernel is, with AVX-512
// intrinsics where the CPU has them for the widening loads (GCC 12 does not
// vectorise a conversion of a byte vector) and FP8's half-float route.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kBlock = 2 * kLanes;  // columns per block (two vectors)
constexpr int64_t kMaxRows = 12;
// Bytes read ahead: into the first-level cache, and into L2 (as far as
// the float kernel's requests, in bytes).
constexpr int64_t kAheadL1 = 2048;
constexpr int64_t kAheadL2 = 12288;

enum Kind : int64_t { kInt8 = 0, kFp8 = 1, kInt4 = 2 };

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));
typedef uint32_t vuint
    __attribute__((vector_size(kLanes * sizeof(uint32_t))));
typedef int8_t vbyte_u __attribute__((vector_size(kLanes), aligned(1)));
typedef uint8_t vubyte_u __attribute__((vector_size(kLanes), aligned(1)));

#if defined(__AVX512F__)
// Sixteen bytes widened to 32-bit lanes, signed or not.
inline vint widen_signed(const uint8_t* p) {
  return reinterpret_cast<vint>(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vint widen_unsigned(const uint8_t* p) {
  return reinterpret_cast<vint>(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
inline vint widen_signed(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vbyte_u*>(p), vint);
}
inline vint widen_unsigned(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vubyte_u*>(p),
                                 vint);
}
#endif

// Sixteen FP8 (e4m3fn) codes as floats, 2^-8 times their value.  The sign
// and the seven exponent-and-mantissa bits moved to where a half float has
// them (5-bit exponent, bias 15, against e4m3's 4-bit, bias 7) make a half
// float of the value times 2^-8, subnormals included; the NaN code 0x7F
// reads as 480 (a checkpoint holds none).
inline vfloat fp8_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i b = _mm256_cvtepu8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i bits = _mm256_or_si256(
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return reinterpret_cast<vfloat>(_mm512_cvtph_ps(bits));
#else
  // 2^9 times the value = (e ? 8 + m : m) << max(e - 1, 0), e the
  // exponent field and m the mantissa: exact in 32-bit integers; times
  // 2^-17, 2^-8 times the value, as above.
  const vint v = widen_unsigned(p);
  const vint e = (v >> 3) & 15;
  const vint normal = e != 0;  // -1 or 0
  const vint magnitude = ((v & 7) | (normal & 8)) << (e + normal);
  const vint value = (v & 0x80) ? -magnitude : magnitude;
  return __builtin_convertvector(value, vfloat) * (1.0f / 131072.0f);
#endif
}

// The 32 codes of one block row, as two vectors of floats.
template <int K>
inline void codes(const uint8_t* row, vfloat& lo, vfloat& hi) {
  if constexpr (K == kInt8) {
    lo = __builtin_convertvector(widen_signed(row), vfloat);
    hi = __builtin_convertvector(widen_signed(row + kLanes), vfloat);
  } else if constexpr (K == kFp8) {
    lo = fp8_codes(row);
    hi = fp8_codes(row + kLanes);
  } else {
    const vint v = widen_unsigned(row);
    // Stored as code + 8 (0..15), read back as -8..7: symmetric formats
    // then need no offsets.
    lo = __builtin_convertvector((v & 15) - 8, vfloat);
    hi = __builtin_convertvector((v >> 4) - 8, vfloat);
  }
}

template <int K>
constexpr int64_t row_bytes() {
  return K == kInt4 ? kBlock / 2 : kBlock;
}

// acc[r] += sums[r] * the scales of group g, plus the group's offsets
// times row r's sum of inputs over the group (xsums, [R][groups]).
template <int R>
inline void add_group(vfloat (&acc)[R][2], const vfloat (&sums)[R][2],
                      const float* scales, const float* offsets,
                      const float* xsums, int64_t groups, int64_t g) {
  const float* sg = scales + g * kBlock;
  const vfloat s0 = *reinterpret_cast<const vfloat_u*>(sg);
  const vfloat s1 = *reinterpret_cast<const vfloat_u*>(sg + kLanes);
  for (int r = 0; r < R; ++r) {
    acc[r][0] += sums[r][0] * s0;
    acc[r][1] += sums[r][1] * s1;
  }
  if (offsets) {
    const float* og = offsets + g * kBlock;
    const vfloat o0 = *reinterpret_cast<const vfloat_u*>(og);
    const vfloat o1 = *reinterpret_cast<const vfloat_u*>(og + kLanes);
    for (int r = 0; r < R; ++r) {
      const float xs = xsums[r * groups + g];
      acc[r][0] += xs * o0;
      acc[r][1] += xs * o1;
    }
  }
}

// y[r, 0:cols] = acc[r] (+ bias) for the R rows.
template <int R>
inline void store_rows(const vfloat (&acc)[R][2], float* y, int64_t ldy,
                       int64_t cols, const float* bias) {
  float out[kBlock];
  for (int r = 0; r < R; ++r) {
    *reinterpret_cast<vfloat_u*>(out) = acc[r][0];
    *reinterpret_cast<vfloat_u*>(out + kLanes) = acc[r][1];
    float* yr = y + r * ldy;
    if (bias) {
      for (int64_t c = 0; c < cols; ++c) yr[c] = out[c] + bias[c];
    } else {
      std::memcpy(yr, out, cols * sizeof(float));
    }
  }
}

// Independent sums per row and column vector: with few rows, each weight
// vector feeds few fused multiply-adds, and one chain of sums would wait
// on its own latency (4 cycles) at every input feature.
template <int R>
constexpr int chains() {
  return R == 1 ? 4 : R <= 3 ? 2 : 1;
}

// y[r, 0:cols] = x[r, :] . dequantized block (+ bias), for the R rows of
// x.  Within a group the codes are multiplied as they are; the group's
// sums are then scaled, and its offsets weighted by the group's sum of
// inputs (xsums, [R][groups]): sum(x * (q * s + o)) = s * sum(x * q) +
// o * sum(x).
template <int K, int R>
void tile(const float* x, int64_t ldx, const float* xsums, int64_t groups,
          const uint8_t* block, int64_t in, int64_t group,
          const float* scales, const float* offsets, float* y, int64_t ldy,
          int64_t cols, const float* bias) {
  constexpr int U = chains<R>();
  constexpr int64_t bytes = row_bytes<K>();
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  for (int64_t k0 = 0, g = 0; k0 < in; k0 += group, ++g) {
    vfloat part[U][R][2];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r) part[u][r][0] = part[u][r][1] = vfloat{};
    const int64_t end = std::min(k0 + group, in);
    int64_t k = k0;
    auto step = [&](int u, int64_t kk) {
      const uint8_t* row = block + kk * bytes;
      __builtin_prefetch(row + kAheadL1);
      __builtin_prefetch(row + kAheadL2, 0, 2);
      vfloat w0, w1;
      codes<K>(row, w0, w1);
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * ldx + kk];
        part[u][r][0] += xs * w0;
        part[u][r][1] += xs * w1;
      }
    };
    for (; k + U <= end; k += U)
      for (int u = 0; u < U; ++u) step(u, k + u);
    for (; k < end; ++k) step(0, k);
    vfloat sums[R][2];
    for (int r = 0; r < R; ++r) {
      sums[r][0] = part[0][r][0];
      sums[r][1] = part[0][r][1];
      for (int u = 1; u < U; ++u) {
        sums[r][0] += part[u][r][0];
        sums[r][1] += part[u][r][1];
      }
    }
    add_group<R>(acc, sums, scales, offsets, xsums, groups, g);
  }
  store_rows<R>(acc, y, ldy, cols, bias);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t,
                        const uint8_t*, int64_t, int64_t, const float*,
                        const float*, float*, int64_t, int64_t,
                        const float*);

#if defined(__AVX512BF16__)
// Rounded inputs (bfloat16 precision): from kDotRows rows on, a tile
// multiplies bfloat16 pairs with vdpbf16ps, two input features per lane,
// twice the products per instruction of float32 multiply-adds.  Codes are
// small integers or FP8 values, exact in bfloat16, so only the inputs are
// rounded, as the bfloat16 float kernel rounds them.
constexpr int64_t kDotRows = 4;

// Lanes of rows k (a) and k + 1 (b) as bfloat16 pairs: b's upper half
// above a's (both exact, so truncation is rounding).
inline __m512i bf16_pairs(vfloat a, vfloat b) {
  const vuint ua = reinterpret_cast<vuint>(a);
  const vuint ub = reinterpret_cast<vuint>(b);
  return reinterpret_cast<__m512i>((ub & 0xFFFF0000u) | (ua >> 16));
}

// tile() on bfloat16 input pairs x ([R][ldx] pairs); in and group even.
template <int K, int R>
void tile_dot(const uint32_t* x, int64_t ldx, const float* xsums,
              int64_t groups, const uint8_t* block, int64_t in,
              int64_t group, const float* scales, const float* offsets,
              float* y, int64_t ldy, int64_t cols, const float* bias) {
  constexpr int64_t bytes = row_bytes<K>();
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  for (int64_t k0 = 0, g = 0; k0 < in; k0 += group, ++g) {
    vfloat part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = vfloat{};
    const int64_t end = std::min(k0 + group, in);
    for (int64_t k = k0; k < end; k += 2) {
      const uint8_t* row = block + k * bytes;
      __builtin_prefetch(row + kAheadL1);
      __builtin_prefetch(row + kAheadL2, 0, 2);
      vfloat a0, a1, b0, b1;
      codes<K>(row, a0, a1);
      codes<K>(row + bytes, b0, b1);
      const __m512bh p0 = reinterpret_cast<__m512bh>(bf16_pairs(a0, b0));
      const __m512bh p1 = reinterpret_cast<__m512bh>(bf16_pairs(a1, b1));
      for (int r = 0; r < R; ++r) {
        const __m512bh xs = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(x[r * ldx + k / 2]));
        part[r][0] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(part[r][0]), xs, p0));
        part[r][1] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(part[r][1]), xs, p1));
      }
    }
    add_group<R>(acc, part, scales, offsets, xsums, groups, g);
  }
  store_rows<R>(acc, y, ldy, cols, bias);
}

using DotFn = void (*)(const uint32_t*, int64_t, const float*, int64_t,
                       const uint8_t*, int64_t, int64_t, const float*,
                       const float*, float*, int64_t, int64_t,
                       const float*);

template <int K>
constexpr DotFn kDots[kMaxRows + 1] = {
    nullptr,         tile_dot<K, 1>,  tile_dot<K, 2>,  tile_dot<K, 3>,
    tile_dot<K, 4>,  tile_dot<K, 5>,  tile_dot<K, 6>,  tile_dot<K, 7>,
    tile_dot<K, 8>,  tile_dot<K, 9>,  tile_dot<K, 10>, tile_dot<K, 11>,
    tile_dot<K, 12>};
#endif

#if defined(__AVX512BF16__)
using DotFnOrNull = DotFn;
#else
using DotFnOrNull = void (*)();
#endif

template <int K>
constexpr TileFn kTiles[kMaxRows + 1] = {
    nullptr,     tile<K, 1>, tile<K, 2>,  tile<K, 3>,  tile<K, 4>,
    tile<K, 5>,  tile<K, 6>, tile<K, 7>,  tile<K, 8>,  tile<K, 9>,
    tile<K, 10>, tile<K, 11>, tile<K, 12>};

#if defined(__AVX512BF16__)
// The weight as bfloat16 [K, n_pad] (n_pad = blocks * kBlock): row k holds
// every column's code * scale + offset at input feature k.
template <int K>
void dequantize_bf16(const uint8_t* wp, const float* sp, const float* op,
                     int64_t blocks, int64_t features, int64_t groups,
                     int64_t group, uint16_t* out) {
  constexpr int64_t bytes = row_bytes<K>();
  const int64_t n_pad = blocks * kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const uint8_t* w = wp + blk * features * bytes;
      const float* s = sp + blk * groups * kBlock;
      const float* o = op ? op + blk * groups * kBlock : nullptr;
      for (int64_t k = 0; k < features; ++k) {
        const int64_t g = k / group;
        vfloat lo, hi;
        codes<K>(w + k * bytes, lo, hi);
        lo *= *reinterpret_cast<const vfloat_u*>(s + g * kBlock);
        hi *= *reinterpret_cast<const vfloat_u*>(s + g * kBlock + kLanes);
        if (o) {
          lo += *reinterpret_cast<const vfloat_u*>(o + g * kBlock);
          hi += *reinterpret_cast<const vfloat_u*>(o + g * kBlock + kLanes);
        }
        const __m512bh v = _mm512_cvtne2ps_pbh(reinterpret_cast<__m512>(hi),
                                               reinterpret_cast<__m512>(lo));
        _mm512_storeu_si512(out + k * n_pad + blk * kBlock,
                            reinterpret_cast<__m512i>(v));
      }
    }
  });
}
#endif

at::Tensor quant_linear(const at::Tensor& input, const at::Tensor& packed,
                        const at::Tensor& scales,
                        const std::optional<at::Tensor>& offsets,
                        int64_t kind, int64_t group, int64_t out_features,
                        const std::optional<at::Tensor>& bias,
                        bool round_inputs, int64_t dense_rows) {
  TORCH_CHECK(kind == kInt8 || kind == kFp8 || kind == kInt4,
              "quant_linear: unknown weight kind ", kind,
              " (0 int8, 1 fp8, 2 int4)");
  TORCH_CHECK(input.scalar_type() == at::kFloat ||
                  input.scalar_type() == at::kBFloat16,
              "quant_linear: float32 or bfloat16 inputs, got ",
              input.scalar_type());
  const int64_t bytes = kind == kInt4 ? kBlock / 2 : kBlock;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  packed.size(2) == bytes && packed.is_contiguous(),
              "quant_linear: the weight must come from pack_quantized");
  const int64_t blocks = packed.size(0);
  const int64_t K = packed.size(1);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 &&
                  scales.size(0) == blocks && scales.size(2) == kBlock &&
                  scales.is_contiguous(),
              "quant_linear: scales must be float32 [blocks, groups, ",
              kBlock, "]");
  const int64_t groups = scales.size(1);
  TORCH_CHECK(group > 0 && groups == (K + group - 1) / group,
              "quant_linear: ", groups, " groups of ", group, " for ", K,
              " input features");
  const float* op = nullptr;
  if (offsets.has_value() && offsets->defined()) {
    TORCH_CHECK(offsets->sizes() == scales.sizes() &&
                    offsets->scalar_type() == at::kFloat &&
                    offsets->is_contiguous(),
                "quant_linear: offsets must have the scales' shape");
    op = offsets->data_ptr<float>();
  }
  TORCH_CHECK(input.size(-1) == K, "quant_linear: the input has ",
              input.size(-1), " features, the weight ", K);
  TORCH_CHECK(out_features > (blocks - 1) * kBlock &&
                  out_features <= blocks * kBlock,
              "quant_linear: ", out_features,
              " outputs do not match a packed weight of ", blocks,
              " blocks");
  const int64_t M = K ? input.numel() / K : 0;
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = out_features;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "quant_linear: bias of ",
                bias->numel(), " for ", out_features, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512BF16__)
  if (round_inputs && dense_rows > 0 && M >= dense_rows) {
    const at::Tensor x16 = input.to(at::kBFloat16).contiguous();
    at::Tensor wt = at::empty({K, blocks * kBlock}, x16.options());
    auto* wtp = static_cast<uint16_t*>(wt.data_ptr());
    const uint8_t* wq = packed.data_ptr<uint8_t>();
    const float* sq = scales.data_ptr<float>();
    if (kind == kInt8)
      dequantize_bf16<kInt8>(wq, sq, op, blocks, K, groups, group, wtp);
    else if (kind == kFp8)
      dequantize_bf16<kFp8>(wq, sq, op, blocks, K, groups, group, wtp);
    else
      dequantize_bf16<kInt4>(wq, sq, op, blocks, K, groups, group, wtp);
    at::Tensor y16 = at::mm(x16.view({M, K}), wt);
    at::Tensor yf = y16.narrow(1, 0, out_features).to(at::kFloat);
    if (b.defined()) yf.add_(b);
    yf = yf.view(out_sizes);
    return input.scalar_type() == at::kFloat ? yf
                                             : yf.to(input.scalar_type());
  }
#else
  (void)dense_rows;
#endif
  at::Tensor x = input.scalar_type() == at::kFloat
                     ? (input.is_contiguous() ? input : input.contiguous())
                     : input.to(at::kFloat).contiguous();
  // round_inputs: the inputs rounded to bfloat16 (nearest even), as the
  // bfloat16 precision's products take them.
  at::Tensor x16;
  if (round_inputs) {
    x16 = x.to(at::kBFloat16);
    x = x16.to(at::kFloat);
  }
  at::Tensor y = at::empty(out_sizes, x.options());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const TileFn* tiles = kind == kInt8  ? kTiles<kInt8>
                        : kind == kFp8 ? kTiles<kFp8>
                                       : kTiles<kInt4>;
  const int64_t height =
      M ? (M + (M + kMaxRows - 1) / kMaxRows - 1) /
              ((M + kMaxRows - 1) / kMaxRows)
        : 0;
  // Each row's sum of inputs per group, for the offsets.
  at::Tensor xsums;
  if (op) {
    xsums = groups * group == K
                ? x.view({M, groups, group}).sum(-1)
                : at::constant_pad_nd(x.view({M, K}), {0, groups * group - K})
                      .view({M, groups, group})
                      .sum(-1);
    xsums = xsums.contiguous();
  }
  const float* xsp = op ? xsums.data_ptr<float>() : nullptr;
  const float* xp = x.data_ptr<float>();
  const DotFnOrNull* dots = nullptr;
#if defined(__AVX512BF16__)
  if (round_inputs && K % 2 == 0 && group % 2 == 0 && height >= kDotRows)
    dots = kind == kInt8 ? kDots<kInt8> : kind == kFp8 ? kDots<kFp8>
                                                         : kDots<kInt4>;
#endif
  const uint32_t* x2 =
      dots ? static_cast<const uint32_t*>(x16.data_ptr()) : nullptr;
  (void)x2;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t cols = std::min(kBlock, out_features - c0);
      const int64_t at = blk * groups * kBlock;
      for (int64_t m0 = 0; m0 < M; m0 += height) {
        const int64_t rows = std::min(height, M - m0);
#if defined(__AVX512BF16__)
        if (dots) {
          dots[rows](x2 + m0 * K / 2, K / 2,
                     xsp ? xsp + m0 * groups : nullptr, groups,
                     wp + blk * K * bytes, K, group, sp + at,
                     op ? op + at : nullptr, yp + m0 * out_features + c0,
                     out_features, cols, bp ? bp + c0 : nullptr);
          continue;
        }
#endif
        tiles[rows](xp + m0 * K, K, xsp ? xsp + m0 * groups : nullptr,
                    groups, wp + blk * K * bytes, K, group, sp + at,
                    op ? op + at : nullptr, yp + m0 * out_features + c0,
                    out_features, cols, bp ? bp + c0 : nullptr);
      }
    }
  });
  return input.scalar_type() == at::kFloat ? y : y.to(input.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_cpu, m) {
  m.def(
      "quant_linear(Tensor input, Tensor packed, Tensor scales, "
      "Tensor? offsets, int kind, int group_size, int out_features, "
      "Tensor? bias=None, bool round_inputs=False, int dense_rows=0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_cpu, CPU, m) {
  m.impl("quant_linear", &quant_linear);
}
