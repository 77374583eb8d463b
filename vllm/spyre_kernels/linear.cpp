// Linear layers for small batches on the CPU, with weights packed once.
//
// A decode step multiplies a few rows of activations (one per sequence of
// the batch) by every weight matrix of the model: the step is bound by how
// fast the weights stream from memory.  The weight [N, K] is packed once,
// at load time, into column blocks of kBlock outputs, [N / kBlock][K]
// [kBlock], so that one block is read as a single contiguous stream, and
// each step computes up to kMaxRows rows against it from registers.
//
// bfloat16 weights halve the bytes a step reads.  They are packed in pairs
// of input features, [N / kBlock][K / 2][kBlock][2], so that one 32-bit
// lane holds the weights of one output for features k and k + 1: where the
// CPU has AVX512_BF16 one `vdpbf16ps` multiplies a lane pair by the pair of
// inputs and adds both products in float32; elsewhere the halves are
// widened to float32 by shifts and multiplied as above.  The inputs are
// rounded to bfloat16 (float32 inputs once per call), sums are float32,
// and the output has the input's dtype: float32, or bfloat16 rounded once
// with the bias added before rounding.
//
// Where the CPU has AMX (the build sees __AMX_BF16__), a bfloat16 product
// of kAmxRows rows or more (a prompt, or a large batch) runs on AMX tiles
// instead, straight from the same packed weight: a packed block of kBlock
// columns is, for each group of 32 input features, two AMX weight tiles
// of 16 pair rows by 16 columns, side by side (row stride 2 * kBlock
// bfloat16).  The weight is never held twice.
//
// Written with GCC vector extensions, so the same source builds for AVX-512
// or AVX2 (x86), VSX (Power) and the z/Architecture vector facility; the
// tiles hold the machine's own vectors (kNativeLanes, simd.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) || defined(__AMX_BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AMX_TILE__)
#include <sys/syscall.h>
#include <unistd.h>
#define SPYRE_AMX 1
#endif

#include "simd.h"

namespace {

using namespace spyre_kernels;

constexpr int64_t kBlock = 2 * kLanes;             // columns per block
constexpr int64_t kVecs = kBlock / kNativeLanes;  // vectors per block row
constexpr int64_t kMaxRows = 12;            // rows per register tile
constexpr int64_t kPrefetch = 16;           // rows of a block read ahead
constexpr int64_t kPrefetchL2 = 96;  // ... and fetched into L2 (see fetch)

// A vector of bfloat16 pairs, one pair of input features per lane.
using vpair = nuint;
using vpair_u = nuint_u;

// Asks for the block row kPrefetch rows on (into the first-level cache)
// and the one kPrefetchL2 rows on (into L2).  The far request is what keeps
// enough reads in flight when a tile has many rows: each row of the block
// then takes longer to compute, and with the near request alone a 10-row
// tile read the weights at 21 GB/s where a 2-row one read them at 26; with
// both, 26 and 28 (Intel Xeon, 2 cores).
template <typename T>
inline void fetch(const T* row) {
  __builtin_prefetch(row + kPrefetch * kBlock);
  __builtin_prefetch(row + kPrefetch * kBlock + kLanes);
  __builtin_prefetch(row + kPrefetchL2 * kBlock, 0, 2);
  __builtin_prefetch(row + kPrefetchL2 * kBlock + kLanes, 0, 2);
}

// y[r, 0:cols] = x[r, :] . block (+ bias), for the R rows of x.
template <int R>
void tile(const float* x, int64_t ldx, const float* block, int64_t K,
          float* y, int64_t ldy, int64_t cols, const float* bias) {
  nfloat acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = nfloat{};
  for (int64_t k = 0; k < K; ++k) {
    const float* row = block + k * kBlock;
    fetch(row);
    nfloat w[kVecs];
    for (int v = 0; v < kVecs; ++v)
      w[v] = *reinterpret_cast<const nfloat_u*>(row + v * kNativeLanes);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xs * w[v];
    }
  }
  float out[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v)
      *reinterpret_cast<nfloat_u*>(out + v * kNativeLanes) = acc[r][v];
    float* yr = y + r * ldy;
    if (bias) {
      for (int64_t c = 0; c < cols; ++c) yr[c] = out[c] + bias[c];
    } else {
      std::memcpy(yr, out, cols * sizeof(float));
    }
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*,
                        int64_t, int64_t, const float*);
constexpr TileFn kTiles[kMaxRows + 1] = {
    nullptr, tile<1>, tile<2>, tile<3>,  tile<4>,  tile<5>, tile<6>,
    tile<7>, tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// Row tiles of near-equal height: 16 rows run as 8 + 8, not 12 + 4.
int64_t tile_height(int64_t M) {
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  return tiles ? (M + tiles - 1) / tiles : 0;
}

// The bfloat16 pair in the upper and lower half of each lane, widened.
inline nfloat low_half(vpair w) {
  return reinterpret_cast<nfloat>(w << 16);
}
inline nfloat high_half(vpair w) {
  return reinterpret_cast<nfloat>(w & 0xFFFF0000u);
}

// Rounds to bfloat16, nearest even (the float is finite or infinite here;
// a NaN stays a NaN).
inline uint16_t to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits >> 16) | 0x40;
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline void store(float* y, float v) { *y = v; }
inline void store(uint16_t* y, float v) { *y = to_bf16(v); }

// The bfloat16 tile: x holds R rows of K / 2 input pairs, block K / 2 rows
// of kBlock output pairs; Out is float (float32) or uint16_t (bfloat16).
template <typename Out, int R>
void tile_bf16(const uint32_t* x, int64_t ldx, const uint32_t* block,
               int64_t K2, Out* y, int64_t ldy, int64_t cols,
               const float* bias) {
  nfloat acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = nfloat{};
  for (int64_t k = 0; k < K2; ++k) {
    const uint32_t* row = block + k * kBlock;
    fetch(row);
    vpair w[kVecs];
    for (int v = 0; v < kVecs; ++v)
      w[v] = *reinterpret_cast<const vpair_u*>(row + v * kNativeLanes);
#if defined(__AVX512BF16__)
    for (int r = 0; r < R; ++r) {
      const __m512i xs = _mm512_set1_epi32(x[r * ldx + k]);
      for (int v = 0; v < kVecs; ++v)
        acc[r][v] = reinterpret_cast<nfloat>(_mm512_dpbf16_ps(
            reinterpret_cast<__m512>(acc[r][v]),
            reinterpret_cast<__m512bh>(xs),
            reinterpret_cast<__m512bh>(w[v])));
    }
#else
    nfloat lo[kVecs], hi[kVecs];
    for (int v = 0; v < kVecs; ++v) {
      lo[v] = low_half(w[v]);
      hi[v] = high_half(w[v]);
    }
    for (int r = 0; r < R; ++r) {
      const uint32_t pair = x[r * ldx + k];
      float x0, x1;
      const uint32_t b0 = pair << 16, b1 = pair & 0xFFFF0000u;
      std::memcpy(&x0, &b0, sizeof x0);
      std::memcpy(&x1, &b1, sizeof x1);
      for (int v = 0; v < kVecs; ++v)
        acc[r][v] += x0 * lo[v] + x1 * hi[v];
    }
#endif
  }
  float out[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v)
      *reinterpret_cast<nfloat_u*>(out + v * kNativeLanes) = acc[r][v];
    Out* yr = y + r * ldy;
    for (int64_t c = 0; c < cols; ++c)
      store(yr + c, bias ? out[c] + bias[c] : out[c]);
  }
}

#if defined(SPYRE_AMX)
// Rows from which a bfloat16 product runs on AMX tiles.  Below it the
// vector tiles above read the weight as fast, one pass of up to kMaxRows
// rows (benchmarks/linear.py, kernel spyre-bf16, on an AMX Xeon).
constexpr int64_t kAmxRows = 16;
// Rows of the input multiplied against one weight block while it stays in
// L2: the weight is read from memory once per kAmxSpan rows.
constexpr int64_t kAmxSpan = 256;

// Linux hands a process the AMX tile registers only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA).
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023;
    constexpr int kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: float32 sums, 16 rows by 16 columns (top-left, top-right,
// bottom-left, bottom-right of a 32 x 32 output tile); 4-5: 16 input rows
// by 32 features; 6-7: 16 feature pairs by 16 columns of a weight block.
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// The rows m0 .. m0 + 31 (16 when `half`) of a against one weight block
// (K / 2 pair rows of 2 * kBlock bfloat16), over all K features, into
// `sums` [32][kBlock].
void amx_tile(const uint16_t* a, int64_t K, const uint16_t* block,
              bool half, float* sums) {
  constexpr int64_t ldb = 2 * kBlock * sizeof(uint16_t);
  constexpr int64_t lds = kBlock * sizeof(float);
  const int64_t lda = K * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  if (!half) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {
    const uint16_t* w = block + (k / 2) * 2 * kBlock;
    _tile_loadd(6, w, ldb);
    _tile_loadd(7, w + kBlock, ldb);
    _tile_loadd(4, a + k, lda);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (!half) {
      _tile_loadd(5, a + 16 * K + k, lda);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, lds);
  _tile_stored(1, sums + 16, lds);
  if (!half) {
    _tile_stored(2, sums + 16 * kBlock, lds);
    _tile_stored(3, sums + 16 * kBlock + 16, lds);
  }
}

// y = x . W on AMX tiles.  x: M rows of K bfloat16 (K a multiple of 32),
// copied with zero rows up to a multiple of 16; W: `blocks` packed blocks.
template <typename Out>
void run_amx(const at::Tensor& x, const uint16_t* wp, Out* yp, int64_t M,
             int64_t K, int64_t blocks, int64_t out_features,
             const float* bp) {
  const int64_t padded = (M + 15) / 16 * 16;
  at::Tensor a = at::zeros({padded, K}, x.options().dtype(at::kBFloat16));
  a.narrow(0, 0, M).copy_(x.view({M, K}));
  const auto* ap = static_cast<const uint16_t*>(a.data_ptr());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float sums[32 * kBlock];
    for (int64_t s0 = 0; s0 < padded; s0 += kAmxSpan) {
      const int64_t span_end = std::min(padded, s0 + kAmxSpan);
      for (int64_t blk = begin; blk < end; ++blk) {
        const int64_t c0 = blk * kBlock;
        const int64_t cols = std::min(kBlock, out_features - c0);
        const uint16_t* block = wp + blk * K * kBlock;
        const float* bias = bp ? bp + c0 : nullptr;
        for (int64_t m0 = s0; m0 < span_end; m0 += 32) {
          const bool half = span_end - m0 <= 16;
          amx_tile(ap + m0 * K, K, block, half, sums);
          const int64_t rows = std::min<int64_t>(half ? 16 : 32, M - m0);
          for (int64_t r = 0; r < rows; ++r) {
            const float* sr = sums + r * kBlock;
            Out* yr = yp + (m0 + r) * out_features + c0;
            for (int64_t c = 0; c < cols; ++c)
              store(yr + c, bias ? sr[c] + bias[c] : sr[c]);
          }
        }
      }
    }
    _tile_release();
  });
}
#endif

template <typename Out>
using TileBf16Fn = void (*)(const uint32_t*, int64_t, const uint32_t*,
                            int64_t, Out*, int64_t, int64_t, const float*);
template <typename Out>
constexpr TileBf16Fn<Out> kTilesBf16[kMaxRows + 1] = {
    nullptr,           tile_bf16<Out, 1>,  tile_bf16<Out, 2>,
    tile_bf16<Out, 3>, tile_bf16<Out, 4>,  tile_bf16<Out, 5>,
    tile_bf16<Out, 6>, tile_bf16<Out, 7>,  tile_bf16<Out, 8>,
    tile_bf16<Out, 9>, tile_bf16<Out, 10>, tile_bf16<Out, 11>,
    tile_bf16<Out, 12>};

// y = x . W over every column block, in row tiles of near-equal height:
// x has M rows of L elements (float32 inputs, or bfloat16 input pairs), a
// block of W L rows of kBlock elements of the same kind.
template <typename In, typename Out>
void run_tiles(void (*const* tiles)(const In*, int64_t, const In*, int64_t,
                                    Out*, int64_t, int64_t, const float*),
               const In* xp, const In* wp, Out* yp, int64_t M, int64_t L,
               int64_t blocks, int64_t out_features, const float* bp) {
  const int64_t height = tile_height(M);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t cols = std::min(kBlock, out_features - c0);
      for (int64_t m0 = 0; m0 < M; m0 += height) {
        const int64_t rows = std::min(height, M - m0);
        tiles[rows](xp + m0 * L, L, wp + blk * L * kBlock, L,
                    yp + m0 * out_features + c0, out_features, cols,
                    bp ? bp + c0 : nullptr);
      }
    }
  });
}

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed,
                         int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  const bool bf16 = packed.scalar_type() == at::kBFloat16;
  const bool float_input = input.scalar_type() == at::kFloat;
  TORCH_CHECK((packed.scalar_type() == at::kFloat && float_input) ||
                  (bf16 && float_or_bf16(input.scalar_type())),
              "packed_linear: a float32 weight takes float32 inputs, a "
              "bfloat16 weight float32 or bfloat16 inputs; got weight ",
              packed.scalar_type(), " and input ", input.scalar_type());
  // float32: [blocks][K][kBlock]; bfloat16: [blocks][K / 2][kBlock * 2].
  const int64_t width = bf16 ? 2 * kBlock : kBlock;
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == width &&
                  packed.is_contiguous(),
              "packed_linear: the weight must come from pack_weight");
  const int64_t K = bf16 ? 2 * packed.size(1) : packed.size(1);
  const int64_t blocks = packed.size(0);
  check_packed_shape("packed_linear", input, K, blocks, kBlock,
                     out_features);
  // Rows are read in place when the input is contiguous, and the output
  // is allocated at its final shape: a decode step makes ~120 of these
  // calls, so each tensor op saved here counts.
  at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = out_features;
  at::Tensor y = at::empty(out_sizes, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    check_bias("packed_linear", *bias, out_features);
    b = bias->to(at::kFloat).contiguous();
  }
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  if (bf16) {
#if defined(SPYRE_AMX)
    if (M >= kAmxRows && K % 32 == 0 && amx_permitted()) {
      const auto* wp = static_cast<const uint16_t*>(packed.data_ptr());
      if (float_input) {
        run_amx(x, wp, y.data_ptr<float>(), M, K, blocks, out_features, bp);
      } else {
        run_amx(x, wp, static_cast<uint16_t*>(y.data_ptr()), M, K, blocks,
                out_features, bp);
      }
      return y;
    }
#endif
    // The inputs as bfloat16 pairs, read 32 bits at a time.
    if (float_input) {
      x = x.to(at::kBFloat16);
    } else if (reinterpret_cast<uintptr_t>(x.data_ptr()) % 4) {
      x = x.clone();
    }
    const auto* xp = static_cast<const uint32_t*>(x.data_ptr());
    const auto* wp = static_cast<const uint32_t*>(packed.data_ptr());
    if (float_input) {
      run_tiles(kTilesBf16<float>, xp, wp, y.data_ptr<float>(), M, K / 2,
                blocks, out_features, bp);
    } else {
      run_tiles(kTilesBf16<uint16_t>, xp, wp,
                static_cast<uint16_t*>(y.data_ptr()), M, K / 2, blocks,
                out_features, bp);
    }
    return y;
  }
  run_tiles(kTiles, x.data_ptr<float>(), packed.data_ptr<float>(),
            y.data_ptr<float>(), M, K, blocks, out_features, bp);
  return y;
}

}  // namespace

TORCH_LIBRARY(spyre_kernels, m) {
  m.def(
      "packed_linear(Tensor input, Tensor packed, int out_features, "
      "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_kernels, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
