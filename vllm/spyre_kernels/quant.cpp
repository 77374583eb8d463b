// Linear layers whose weights stay quantized: 8-bit integers, FP8
// (float8_e4m3fn) or 4-bit integers, read as they are and dequantized in
// registers.
//
// A decode step streams every weight once, so the bytes per weight set its
// time: one byte (int8, FP8) or half a byte (int4) against bfloat16's two.
// The weight [N, K] is packed once, at load time, like the float kernel's
// (linear.cpp): column blocks of kBlock outputs, one row of
// the block per input feature, so that a block streams contiguously:
//
//   int8, FP8:  [N / kBlock][K][kBlock] bytes (column c of row k at c);
//   int4:       [N / kBlock][K][kBlock / 2] bytes, the low nibble of byte
//               c holding column c and the high nibble column c + 16,
//               each the format's code, 0..15.
//
// Scales come per group of input features and per column, [N / kBlock]
// [G][kBlock] float32 (G = ceil(K / group size), the last group possibly
// shorter; one group: per-channel or per-tensor scales), with
// optional offsets of the same shape: the weight of column c at feature k
// in group g is code * scale[g][c] + offset[g][c]; or one zero point for
// the whole layer (8 in a symmetric int4 format, whose codes are 0..15):
// (code - zero) * scale[g][c], applied once per group to its sum.  An
// FP8 code is the e4m3 value times 2^-8 (its bits widened to a half float,
// see fp8_codes): the packer folds the 2^8 into the scales.
//
// Inputs and sums are float32, so a layer computes the product of its
// input by the dequantized weight up to float32 rounding (the order of the
// sums, and with a zero point or offsets their sum of inputs taken apart):
// the format's reference, not an approximation of it.
//
// Many rows of rounded inputs (a prompt under the bfloat16 precision) are
// bound by arithmetic, not by reading the weight.  From dense_rows rows on
// (the caller sets it where the CPU multiplies bfloat16 on AMX tiles), the
// weight is dequantized into a bfloat16 scratch [K, N], one layer at a
// time, and the product runs on oneDNN: the weight rounded to bfloat16, the
// output rounded to bfloat16 before the bias, as a bfloat16 layer's prompt
// is (spyre_linear.onednn_bf16_linear).
//
// Written with GCC vector extensions, as the float kernel is, on the
// machine's own vectors (kNativeLanes, simd.h), with AVX-512 or AVX2
// intrinsics where the CPU has them for the widening loads (GCC 12 does
// not vectorise a conversion of a byte vector) and FP8's half-float route
// (F16C beside AVX2).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

using namespace spyre_kernels;

constexpr int64_t kBlock = 2 * kLanes;  // columns per block
// The machine's vectors per block row (simd.h): 2 with AVX-512, 4 with
// AVX2 alone.
constexpr int64_t kVecs = kBlock / kNativeLanes;
constexpr int64_t kMaxRows = 12;
// The float32 tiles' largest height.  With AVX2 alone a block row is four
// vectors, and each row's sums (four, and four more for the group's part)
// soon outgrow AVX2's 16 registers: of tiles of 2, 3 and 11 rows, 3
// multiplied SmolLM2's layers at 64 rows fastest on a first-generation
// Zen EPYC (int8 1.76x, int4 1.57x, FP8 1.16x faster than 11;
// benchmarks/linear.py).  A tile of 2 or more rows sums each row in the
// same order whatever its height (one chain), and no tile is left with
// one row where there are more, so only the time changes.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kFloatRows = 3;
#else
constexpr int64_t kFloatRows = kMaxRows;
#endif

// Row tiles of near-equal height, at most `most` rows each: 16 rows run
// as 8 + 8, not 12 + 4.
inline int64_t tile_height(int64_t M, int64_t most) {
  const int64_t tiles = (M + most - 1) / most;
  return tiles ? (M + tiles - 1) / tiles : 0;
}
// Bytes read ahead: into the first-level cache, and into L2 (as far as
// the float kernel's requests, in bytes).
constexpr int64_t kAheadL1 = 2048;
constexpr int64_t kAheadL2 = 12288;

enum Kind : int64_t { kInt8 = 0, kFp8 = 1, kInt4 = 2 };

typedef int8_t vbyte_u
    __attribute__((vector_size(kNativeLanes), aligned(1)));
typedef uint8_t vubyte_u
    __attribute__((vector_size(kNativeLanes), aligned(1)));

// A bfloat16 (its bits) as a float, exactly.
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// A float rounded to bfloat16 (nearest, ties to even), as PyTorch rounds.
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;  // NaN
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// kNativeLanes bytes widened to 32-bit lanes, signed or not.
#if defined(__AVX512F__)
inline nint widen_signed(const uint8_t* p) {
  return reinterpret_cast<nint>(_mm512_cvtepi8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline nint widen_unsigned(const uint8_t* p) {
  return reinterpret_cast<nint>(_mm512_cvtepu8_epi32(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#elif defined(__AVX2__)
inline nint widen_signed(const uint8_t* p) {
  return reinterpret_cast<nint>(_mm256_cvtepi8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline nint widen_unsigned(const uint8_t* p) {
  return reinterpret_cast<nint>(_mm256_cvtepu8_epi32(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#else
inline nint widen_signed(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vbyte_u*>(p), nint);
}
inline nint widen_unsigned(const uint8_t* p) {
  return __builtin_convertvector(*reinterpret_cast<const vubyte_u*>(p),
                                 nint);
}
#endif

// kNativeLanes FP8 (e4m3fn) codes as floats, 2^-8 times their value.  The
// sign and the seven exponent-and-mantissa bits moved to where a half
// float has them (5-bit exponent, bias 15, against e4m3's 4-bit, bias 7)
// make a half float of the value times 2^-8, subnormals included; the NaN
// code 0x7F reads as 480 (a checkpoint holds none).  With AVX-512, or AVX2
// and F16C: each code sign-extended to 16 bits and shifted left by 7 has
// the sign in bits 15 and 14 and the rest in bits 13..7; clearing bit 14
// leaves the half float.
inline nfloat fp8_codes(const uint8_t* p) {
#if defined(__AVX512F__)
  const __m256i wide = _mm256_cvtepi8_epi16(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<nfloat>(_mm512_cvtph_ps(_mm256_and_si256(
      _mm256_slli_epi16(wide, 7),
      _mm256_set1_epi16(static_cast<int16_t>(0xBFFF)))));
#elif defined(__AVX2__) && defined(__F16C__)
  const __m128i wide = _mm_cvtepi8_epi16(
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<nfloat>(_mm256_cvtph_ps(_mm_and_si128(
      _mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<int16_t>(0xBFFF)))));
#else
  // 2^9 times the value = (e ? 8 + m : m) << max(e - 1, 0), e the
  // exponent field and m the mantissa: exact in 32-bit integers; times
  // 2^-17, 2^-8 times the value, as above.
  const nint v = widen_unsigned(p);
  const nint e = (v >> 3) & 15;
  const nint normal = e != 0;  // -1 or 0
  const nint magnitude = ((v & 7) | (normal & 8)) << (e + normal);
  const nint value = (v & 0x80) ? -magnitude : magnitude;
  return __builtin_convertvector(value, nfloat) * (1.0f / 131072.0f);
#endif
}

// The 32 codes of one block row, as kVecs vectors of floats (columns
// kNativeLanes * v onwards in w[v]).
template <int K>
inline void codes(const uint8_t* row, nfloat (&w)[kVecs]) {
  if constexpr (K == kInt8) {
    for (int v = 0; v < kVecs; ++v)
      w[v] = __builtin_convertvector(widen_signed(row + v * kNativeLanes),
                                     nfloat);
  } else if constexpr (K == kFp8) {
    for (int v = 0; v < kVecs; ++v) w[v] = fp8_codes(row + v * kNativeLanes);
  } else {
    // Read as they are, 0..15: a zero point (8 in symmetric formats)
    // is an offset, which costs once per group, not per weight.  Byte c
    // holds column c and column c + 16.
    constexpr int half = kVecs / 2;
    for (int v = 0; v < half; ++v) {
      const nint n = widen_unsigned(row + v * kNativeLanes);
      w[v] = __builtin_convertvector(n & 15, nfloat);
      w[v + half] = __builtin_convertvector(n >> 4, nfloat);
    }
  }
}

#if defined(__AVX512F__)
// The same as two vectors (kVecs is 2 here), for the AVX-512 tiles.
template <int K>
inline void codes(const uint8_t* row, vfloat& lo, vfloat& hi) {
  nfloat w[kVecs];
  codes<K>(row, w);
  lo = w[0];
  hi = w[1];
}
#endif

template <int K>
constexpr int64_t row_bytes() {
  return K == kInt4 ? kBlock / 2 : kBlock;
}

// Prefetches for the rows from `row` on, `span` bytes: one per cache line
// they start (a row of int8 codes is half a line, of int4 a quarter).
constexpr int64_t kLine = 64;
inline void prefetch_rows(const uint8_t* row, int64_t offset, int64_t span) {
  for (int64_t at = (offset + kLine - 1) / kLine * kLine - offset;
       at < span; at += kLine) {
    __builtin_prefetch(row + at + kAheadL1);
    __builtin_prefetch(row + at + kAheadL2, 0, 2);
  }
}

// acc[r] += sums[r] * the scales of group g, plus the group's offsets
// times row r's sum of inputs over the group (xsums, [R][groups]); or,
// for one zero point for the whole layer (a symmetric int4 format's 8),
// acc[r] += (sums[r] - zero * xsums) * the scales.
template <int R>
inline void add_group(nfloat (&acc)[R][kVecs], const nfloat (&sums)[R][kVecs],
                      const float* scales, const float* offsets, float zero,
                      const float* xsums, int64_t groups, int64_t g) {
  const float* sg = scales + g * kBlock;
  nfloat sv[kVecs];
  for (int v = 0; v < kVecs; ++v)
    sv[v] = *reinterpret_cast<const nfloat_u*>(sg + v * kNativeLanes);
  if (!offsets && zero != 0.0f) {
    for (int r = 0; r < R; ++r) {
      const float shift = zero * xsums[r * groups + g];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += (sums[r][v] - shift) * sv[v];
    }
    return;
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] += sums[r][v] * sv[v];
  if (offsets) {
    const float* og = offsets + g * kBlock;
    nfloat ov[kVecs];
    for (int v = 0; v < kVecs; ++v)
      ov[v] = *reinterpret_cast<const nfloat_u*>(og + v * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const float xs = xsums[r * groups + g];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xs * ov[v];
    }
  }
}

// Where a tile's rows go: float32 outputs, or bfloat16 ones (rounded
// after the bias, as a float32 result converted to bfloat16 is).
struct Out {
  void* y;  // the tile's first output
  int64_t ldy;
  bool bf16;
};

// y[r, 0:cols] = acc[r] (+ bias) for the R rows.
template <int R>
inline void store_rows(const nfloat (&acc)[R][kVecs], Out out, int64_t cols,
                       const float* bias) {
  float row[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v)
      *reinterpret_cast<nfloat_u*>(row + v * kNativeLanes) = acc[r][v];
    if (bias)
      for (int64_t c = 0; c < cols; ++c) row[c] += bias[c];
    if (out.bf16) {
      uint16_t* yr = static_cast<uint16_t*>(out.y) + r * out.ldy;
      for (int64_t c = 0; c < cols; ++c) yr[c] = to_bf16(row[c]);
    } else {
      std::memcpy(static_cast<float*>(out.y) + r * out.ldy, row,
                  cols * sizeof(float));
    }
  }
}

// Independent sums per row and column vector: with few rows, each weight
// vector feeds few fused multiply-adds, and one chain of sums would wait
// on its own latency (4 cycles) at every input feature.  As many chains
// of a block row's vectors as with two vectors a row: AVX2 has half
// AVX-512's registers, and twice the vectors a row.
template <int R>
constexpr int chains() {
  constexpr int two = R == 1 ? 4 : R <= 3 ? 2 : 1;
  return two * 2 / kVecs > 0 ? two * 2 / kVecs : 1;
}

// y[r, 0:cols] = x[r, :] . dequantized block (+ bias), for the R rows of
// x.  Within a group the codes are multiplied as they are; the group's
// sums are then scaled, and its offsets weighted by the group's sum of
// inputs (xsums, [R][groups]): sum(x * (q * s + o)) = s * sum(x * q) +
// o * sum(x).
template <int K, int R>
void tile(const float* x, int64_t ldx, const float* xsums, int64_t groups,
          const uint8_t* block, int64_t in, int64_t group,
          const float* scales, const float* offsets, float zero, Out out,
          int64_t cols, const float* bias) {
  constexpr int U = chains<R>();
  constexpr int64_t bytes = row_bytes<K>();
  nfloat acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = nfloat{};
  for (int64_t k0 = 0, g = 0; k0 < in; k0 += group, ++g) {
    nfloat part[U][R][kVecs];
    for (int u = 0; u < U; ++u)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v) part[u][r][v] = nfloat{};
    const int64_t end = std::min(k0 + group, in);
    int64_t k = k0;
    auto step = [&](int u, int64_t kk) {
      const uint8_t* row = block + kk * bytes;
      nfloat w[kVecs];
      codes<K>(row, w);
      for (int r = 0; r < R; ++r) {
        const float xs = x[r * ldx + kk];
        for (int v = 0; v < kVecs; ++v) part[u][r][v] += xs * w[v];
      }
    };
    for (; k + U <= end; k += U) {
      prefetch_rows(block + k * bytes, k * bytes, U * bytes);
      for (int u = 0; u < U; ++u) step(u, k + u);
    }
    for (; k < end; ++k) {
      prefetch_rows(block + k * bytes, k * bytes, bytes);
      step(0, k);
    }
    nfloat sums[R][kVecs];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) {
        sums[r][v] = part[0][r][v];
        for (int u = 1; u < U; ++u) sums[r][v] += part[u][r][v];
      }
    add_group<R>(acc, sums, scales, offsets, zero, xsums, groups, g);
  }
  store_rows<R>(acc, out, cols, bias);
}

// The integer tiles for decode rows: with AVX512BW, or AVX2 alone (an
// AVX-512 build without AVX512BW keeps the float32 tiles).
#if defined(__AVX512BW__) || (defined(__AVX2__) && !defined(__AVX512F__))
#define SPYRE_INT16_TILES 1
#include "quant_int16.h"
#endif

using TileFn = void (*)(const float*, int64_t, const float*, int64_t,
                        const uint8_t*, int64_t, int64_t, const float*,
                        const float*, float, Out, int64_t, const float*);

#if defined(__AVX512BF16__)
// Rounded inputs (bfloat16 precision): from dot_rows rows on, a tile
// multiplies bfloat16 pairs with vdpbf16ps, two input features per lane,
// twice the products per instruction of float32 multiply-adds.  The caller
// sets dot_rows where benchmarks/linear.py found it faster (AMD's Zen 4);
// on Intel's AMX machines the float32 tiles are faster at every height.
// Codes are
// small integers or FP8 values, exact in bfloat16, so only the inputs are
// rounded, as the bfloat16 float kernel rounds them.

// Lanes of rows k (a) and k + 1 (b) as bfloat16 pairs: b's upper half
// above a's (both exact, so truncation is rounding).
inline __m512i bf16_pairs(vfloat a, vfloat b) {
  const vuint ua = reinterpret_cast<vuint>(a);
  const vuint ub = reinterpret_cast<vuint>(b);
  return reinterpret_cast<__m512i>((ub & 0xFFFF0000u) | (ua >> 16));
}

// The codes of block rows k and k + 1 as bfloat16 pairs, one lane per
// column: columns 0-15 in p0, 16-31 in p1.
template <int K>
inline void code_pairs(const uint8_t* row, __m512bh& p0, __m512bh& p1) {
#if defined(__AVX512BW__)
  if constexpr (K == kInt4) {
    // int4 straight to bfloat16, never through float32: the two rows'
    // 32 bytes widened to 16-bit words, interleaved so that each lane
    // holds one column's bytes of rows k and k + 1, and each nibble then
    // looked up in a table of the bfloat16 values 0..15 (vpermw reads the
    // low 5 bits of an index, so the table repeats and the high nibble
    // needs no mask).  Four shuffles and a shift per 64 weights, where
    // widening through float32 takes a dozen instructions.
    const __m512i bf16_codes = _mm512_set_epi16(
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000,
        0x4170, 0x4160, 0x4150, 0x4140, 0x4130, 0x4120, 0x4110, 0x4100,
        0x40E0, 0x40C0, 0x40A0, 0x4080, 0x4040, 0x4000, 0x3F80, 0x0000);
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i words = _mm512_permutexvar_epi16(
        interleave, _mm512_cvtepu8_epi16(_mm256_loadu_si256(
                        reinterpret_cast<const __m256i*>(row))));
    p0 = reinterpret_cast<__m512bh>(
        _mm512_permutexvar_epi16(words, bf16_codes));
    p1 = reinterpret_cast<__m512bh>(
        _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), bf16_codes));
    return;
  }
#endif
  constexpr int64_t bytes = row_bytes<K>();
  vfloat a0, a1, b0, b1;
  codes<K>(row, a0, a1);
  codes<K>(row + bytes, b0, b1);
  p0 = reinterpret_cast<__m512bh>(bf16_pairs(a0, b0));
  p1 = reinterpret_cast<__m512bh>(bf16_pairs(a1, b1));
}

// tile() on bfloat16 input pairs x ([R][ldx] pairs); in and group even.
template <int K, int R>
void tile_dot(const uint32_t* x, int64_t ldx, const float* xsums,
              int64_t groups, const uint8_t* block, int64_t in,
              int64_t group, const float* scales, const float* offsets,
              float zero, Out out, int64_t cols, const float* bias) {
  constexpr int64_t bytes = row_bytes<K>();
  vfloat acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = vfloat{};
  for (int64_t k0 = 0, g = 0; k0 < in; k0 += group, ++g) {
    vfloat part[R][2];
    for (int r = 0; r < R; ++r) part[r][0] = part[r][1] = vfloat{};
    const int64_t end = std::min(k0 + group, in);
    for (int64_t k = k0; k < end; k += 2) {
      const uint8_t* row = block + k * bytes;
      prefetch_rows(row, k * bytes, 2 * bytes);
      __m512bh p0, p1;
      code_pairs<K>(row, p0, p1);
      for (int r = 0; r < R; ++r) {
        const __m512bh xs = reinterpret_cast<__m512bh>(
            _mm512_set1_epi32(x[r * ldx + k / 2]));
        part[r][0] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(part[r][0]), xs, p0));
        part[r][1] = reinterpret_cast<vfloat>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(part[r][1]), xs, p1));
      }
    }
    add_group<R>(acc, part, scales, offsets, zero, xsums, groups, g);
  }
  store_rows<R>(acc, out, cols, bias);
}

using DotFn = void (*)(const uint32_t*, int64_t, const float*, int64_t,
                       const uint8_t*, int64_t, int64_t, const float*,
                       const float*, float, Out, int64_t, const float*);

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

// Each row's sum of inputs per group ([M][groups]), for the offsets or
// the zero point.
void group_sums(const float* x, int64_t M, int64_t K, int64_t group,
                int64_t groups, float* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * group; k < std::min(K, (g + 1) * group); ++k)
        s += x[m * K + k];
      out[m * groups + g] = s;
    }
}

#if defined(__AVX512BF16__)
// The weight as bfloat16 [K, n_pad] (n_pad = blocks * kBlock): row k holds
// every column's (code - zero) * scale + offset at input feature k.
template <int K>
void dequantize_bf16(const uint8_t* wp, const float* sp, const float* op,
                     float zero, int64_t blocks, int64_t features,
                     int64_t groups, int64_t group, uint16_t* out) {
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
        lo = (lo - zero) * *reinterpret_cast<const vfloat_u*>(s + g * kBlock);
        hi = (hi - zero) *
             *reinterpret_cast<const vfloat_u*>(s + g * kBlock + kLanes);
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
                        double zero_point,
                        const std::optional<at::Tensor>& bias,
                        bool round_inputs, int64_t dense_rows,
                        int64_t dot_rows, int64_t int_rows) {
  TORCH_CHECK(kind == kInt8 || kind == kFp8 || kind == kInt4,
              "quant_linear: unknown weight kind ", kind,
              " (0 int8, 1 fp8, 2 int4)");
  TORCH_CHECK(float_or_bf16(input.scalar_type()),
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
  // One zero point for every weight (weight = (code - zero) * scale),
  // where no offsets are given.
  TORCH_CHECK(op == nullptr || zero_point == 0.0,
              "quant_linear: offsets and a zero point of ", zero_point);
  const float zf = static_cast<float>(zero_point);
  check_packed_shape("quant_linear", input, K, blocks, kBlock,
                     out_features);
  const int64_t M = K ? input.numel() / K : 0;
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = out_features;
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_bias("quant_linear", *bias, out_features);
    b = bias->scalar_type() == at::kFloat ||
                bias->scalar_type() == at::kBFloat16
            ? bias->contiguous()
            : bias->to(at::kFloat).contiguous();
  }
#if defined(__AVX512BF16__)
  if (round_inputs && dense_rows > 0 && M >= dense_rows) {
    const at::Tensor x16 = input.to(at::kBFloat16).contiguous();
    at::Tensor wt = at::empty({K, blocks * kBlock}, x16.options());
    auto* wtp = static_cast<uint16_t*>(wt.data_ptr());
    const uint8_t* wq = packed.data_ptr<uint8_t>();
    const float* sq = scales.data_ptr<float>();
    if (kind == kInt8)
      dequantize_bf16<kInt8>(wq, sq, op, zf, blocks, K, groups, group, wtp);
    else if (kind == kFp8)
      dequantize_bf16<kFp8>(wq, sq, op, zf, blocks, K, groups, group, wtp);
    else
      dequantize_bf16<kInt4>(wq, sq, op, zf, blocks, K, groups, group, wtp);
    at::Tensor y16 = at::mm(x16.view({M, K}), wt);
    at::Tensor yf = y16.narrow(1, 0, out_features).to(at::kFloat);
    if (b.defined()) yf.add_(b);
    yf = yf.view(out_sizes);
    return input.scalar_type() == at::kFloat ? yf
                                             : yf.to(input.scalar_type());
  }
#else
  (void)dense_rows;
  (void)dot_rows;
#endif
  // The tiles read float32 inputs; the bfloat16 pairs of the dot tiles,
  // bfloat16 ones.  A bfloat16 input is widened (exactly) into a float32
  // scratch; round_inputs rounds a float32 one to bfloat16 (nearest even)
  // as the bfloat16 precision's products take it.  A bfloat16 input's
  // outputs are rounded to bfloat16 as they are stored.  The scratch is
  // filled here, not by ATen conversions: a decode step calls this once
  // per layer, and each ATen call costs microseconds.
  const bool bf16_in = input.scalar_type() == at::kBFloat16;
  at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  std::vector<float> x32;
  std::vector<uint16_t> x16;
  const float* xf = bf16_in ? nullptr : x.data_ptr<float>();
  const uint16_t* xb =
      bf16_in ? static_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  const int64_t height = tile_height(M, kMaxRows);
  // int8 and int4 codes on 16-bit integer inputs (quant_int16.h):
  // bfloat16 inputs, up to int_rows rows.
  int64_t span = 0;
#if defined(SPYRE_INT16_TILES)
  if ((kind == kInt8 || kind == kInt4) && (round_inputs || bf16_in) &&
      K % 2 == 0 &&
      height > 0 && height <= std::min(int_rows, kIntRows))
    span = int_span(group);
#else
  (void)int_rows;
#endif
  const DotFnOrNull* dots = nullptr;
#if defined(__AVX512BF16__)
  if (!span && round_inputs && dot_rows > 0 && K % 2 == 0 && group % 2 == 0 &&
      height >= dot_rows)
    dots = kind == kInt8 ? kDots<kInt8> : kind == kFp8 ? kDots<kFp8>
                                                         : kDots<kInt4>;
#endif
  // One pass over the inputs: the float32 scratch the tiles read, and the
  // rounded bfloat16 copy only where the dot tiles read it.
  if (!bf16_in && round_inputs) {
    x32.resize(M * K);
    if (dots) x16.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) {
      const uint16_t h = to_bf16(xf[i]);
      x32[i] = from_bf16(h);
      if (dots) x16[i] = h;
    }
    xb = dots ? x16.data() : nullptr;
    xf = x32.data();
  } else if (bf16_in) {
    x32.resize(M * K);
    for (int64_t i = 0; i < M * K; ++i) x32[i] = from_bf16(xb[i]);
    xf = x32.data();
  }
  at::Tensor y = at::empty(out_sizes, input.options());
  // Biases as float32 (a bfloat16 bias widened exactly).
  std::vector<float> bias32;
  const float* bp = nullptr;
  if (b.defined()) {
    if (b.scalar_type() == at::kFloat) {
      bp = b.data_ptr<float>();
    } else {
      const auto* b16 = static_cast<const uint16_t*>(b.data_ptr());
      bias32.resize(out_features);
      for (int64_t c = 0; c < out_features; ++c) bias32[c] = from_bf16(b16[c]);
      bp = bias32.data();
    }
  }
  // Each row's sum of inputs per group, for the offsets or the zero point.
  std::vector<float> xsums;
  if (op || zf != 0.0f) {
    xsums.resize(M * groups);
    group_sums(xf, M, K, group, groups, xsums.data());
  }
  const float* xsp = xsums.empty() ? nullptr : xsums.data();
  std::vector<int16_t> xq;
  std::vector<float> powers;
  const int64_t spans = span ? (K + span - 1) / span : 0;
#if defined(SPYRE_INT16_TILES)
  if (span) {
    xq.resize(M * K);
    powers.resize(M * spans);
    inputs_as_int16(xf, M, K, span, xq.data(), powers.data());
  }
#endif
  // The float32 tiles' rows: at most kFloatRows (AVX2) a tile.
  const int64_t tile_rows =
      (span || dots) ? height : tile_height(M, kFloatRows);
  const TileFn* tiles = kind == kInt8  ? kTiles<kInt8>
                        : kind == kFp8 ? kTiles<kFp8>
                                       : kTiles<kInt4>;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  char* yp = static_cast<char*>(y.data_ptr());
  const int64_t y_bytes = y.element_size();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t cols = std::min(kBlock, out_features - c0);
      const int64_t at = blk * groups * kBlock;
      for (int64_t m0 = 0, rows = 0; m0 < M; m0 += rows) {
        rows = std::min(tile_rows, M - m0);
        if (M - m0 - rows == 1 && rows > 2) --rows;  // never one row alone
        const Out out{yp + (m0 * out_features + c0) * y_bytes, out_features,
                      bf16_in};
        const float* xs = xsp ? xsp + m0 * groups : nullptr;
        const uint8_t* w = wp + blk * K * bytes;
        const float* o = op ? op + at : nullptr;
        const float* bc = bp ? bp + c0 : nullptr;
#if defined(SPYRE_INT16_TILES)
        if (span) {
          (kind == kInt8 ? kInts<kInt8> : kInts<kInt4>)[rows](
              xq.data() + m0 * K, K, powers.data() + m0 * spans, spans, span,
              xs, groups, w, K, group, sp + at, o, zf, out, cols, bc);
          continue;
        }
#endif
#if defined(__AVX512BF16__)
        if (dots) {
          dots[rows](reinterpret_cast<const uint32_t*>(xb + m0 * K), K / 2,
                     xs, groups, w, K, group, sp + at, o, zf, out, cols, bc);
          continue;
        }
#endif
        tiles[rows](xf + m0 * K, K, xs, groups, w, K, group, sp + at, o, zf,
                    out, cols, bc);
      }
    }
  });
  return y;
}

// A checkpoint's codes packed 32 / bits to an int32 along the input
// features (GPTQ's qweight, [K / per][N]), the first in the lowest bits,
// unpacked at load time to one byte each, [K][N]: row r * per + i of the
// result is bits i * bits ... of row r's words.  Shifts of the words'
// values, so either byte order reads the same codes; each output row is a
// contiguous pass, where strided byte copies of the words' bytes were the
// largest part of a quantized load.
at::Tensor unpack_codes(const at::Tensor& words, int64_t bits) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt,
              "unpack_codes: words must be 2-D int32, not ",
              words.sizes(), " ", words.scalar_type());
  TORCH_CHECK(bits > 0 && bits <= 8 && 32 % bits == 0,
              "unpack_codes: ", bits,
              "-bit codes: need 1, 2, 4 or 8 bits, a divisor of 32");
  const at::Tensor w = words.contiguous();
  const int64_t rows = w.size(0), cols = w.size(1), per = 32 / bits;
  at::Tensor out = at::empty({rows * per, cols},
                             w.options().dtype(at::kByte));
  const uint32_t* src =
      reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const uint32_t mask = (1u << bits) - 1;
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint32_t* row = src + r * cols;
      for (int64_t i = 0; i < per; ++i) {
        uint8_t* o = dst + (r * per + i) * cols;
        const int shift = static_cast<int>(bits * i);
        for (int64_t n = 0; n < cols; ++n)
          o[n] = static_cast<uint8_t>((row[n] >> shift) & mask);
      }
    }
  });
  return out;
}

// A checkpoint's codes, 32 / bits to an int32 word along the input
// features, the first in the lowest bits (GPTQ's qweight, [K / per][N]:
// dim 0; compressed-tensors' weight_packed, [N][K / per]: dim 1), laid out
// at load time in the kernel's column blocks in one pass, with no byte per
// code in between: 8-bit codes as int8 (the unsigned code's top bit
// flipped), [N / 32][K][32] bytes; 4-bit codes two to a byte,
// [N / 32][K][16] (column c of a block in the low half of byte c, column
// c + 16 in its high half).  Columns past N are 0.  Each block reads its
// 32 columns' words of every word of K and writes its own bytes in order.
template <int kBits>
void pack_words_into(const uint32_t* src, int64_t words_k, int64_t n,
                     int64_t stride_k, int64_t stride_n, uint8_t* dst) {
  constexpr int kPer = 32 / kBits;
  constexpr uint32_t kMask = (1u << kBits) - 1;
  constexpr int64_t kOut = kBits == 8 ? kBlock : kBlock / 2;
  const int64_t K = words_k * kPer, blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    uint32_t w[kBlock];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t cols = std::min(kBlock, n - c0);
      uint8_t* o = dst + blk * K * kOut;
      for (int64_t r = 0; r < words_k; ++r) {
        const uint32_t* at = src + r * stride_k + c0 * stride_n;
        for (int64_t j = 0; j < kBlock; ++j)
          w[j] = j < cols ? at[j * stride_n] : 0u;
        for (int i = 0; i < kPer; ++i, o += kOut) {
          const int shift = kBits * i;
          if constexpr (kBits == 8) {
            for (int64_t j = 0; j < kBlock; ++j)
              o[j] = j < cols ? static_cast<uint8_t>((w[j] >> shift) ^ 128u)
                              : 0;
          } else {
            for (int64_t j = 0; j < kOut; ++j)
              o[j] = static_cast<uint8_t>(
                  ((w[j] >> shift) & kMask) |
                  (((w[j + kOut] >> shift) & kMask) << 4));
          }
        }
      }
    }
  });
}

at::Tensor pack_code_words(const at::Tensor& words, int64_t bits,
                           int64_t dim, int64_t out_features) {
  TORCH_CHECK(words.dim() == 2 && words.scalar_type() == at::kInt,
              "pack_code_words: words must be 2-D int32, not ",
              words.sizes(), " ", words.scalar_type());
  TORCH_CHECK(bits == 8 || bits == 4, "pack_code_words: ", bits,
              "-bit codes: need 8 or 4");
  TORCH_CHECK(dim == 0 || dim == 1, "pack_code_words: dim ", dim,
              ": the codes run along dim 0 or 1");
  TORCH_CHECK(words.size(1 - dim) == out_features,
              "pack_code_words: words of ", words.size(1 - dim),
              " output features, not ", out_features);
  const at::Tensor w = words.contiguous();
  const int64_t words_k = w.size(dim), n = out_features;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::Tensor out = at::empty(
      {blocks, words_k * (32 / bits), bits == 8 ? kBlock : kBlock / 2},
      w.options().dtype(at::kByte));
  const uint32_t* src =
      reinterpret_cast<const uint32_t*>(w.data_ptr<int32_t>());
  const int64_t stride_k = dim == 0 ? n : 1, stride_n = dim == 0 ? 1 : words_k;
  (bits == 8 ? pack_words_into<8> : pack_words_into<4>)(
      src, words_k, n, stride_k, stride_n, out.data_ptr<uint8_t>());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(spyre_kernels, m) {
  m.def("unpack_codes(Tensor words, int bits) -> Tensor");
  m.def("pack_code_words(Tensor words, int bits, int dim, "
        "int out_features) -> Tensor");
  m.def(
      "quant_linear(Tensor input, Tensor packed, Tensor scales, "
      "Tensor? offsets, int kind, int group_size, int out_features, "
      "float zero_point, "
      "Tensor? bias=None, bool round_inputs=False, int dense_rows=0, "
      "int dot_rows=0, int int_rows=0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("quant_linear", &quant_linear);
  m.impl("unpack_codes", &unpack_codes);
  m.impl("pack_code_words", &pack_code_words);
}
