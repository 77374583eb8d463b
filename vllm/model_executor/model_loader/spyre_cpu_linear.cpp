// Linear layers for small batches on the CPU, with weights packed once.
//
// A decode step multiplies a few rows of activations (one per sequence of
// the batch) by every weight matrix of the model: the step is bound by how
// fast the weights stream from memory.  The weight [N, K] is packed once,
// at load time, into column blocks of kBlock outputs, [N / kBlock][K]
// [kBlock], so that one block is read as a single contiguous stream, and
// each step computes up to kMaxRows rows against it from registers.
//
// Written with GCC vector extensions, so the same source builds for AVX-512
// or AVX2 (x86), VSX (Power) and the z/Architecture vector facility.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kLanes = 16;              // floats per vector
constexpr int64_t kVecs = 2;                // vectors per column block
constexpr int64_t kBlock = kLanes * kVecs;  // columns per block
constexpr int64_t kMaxRows = 12;            // rows per register tile
constexpr int64_t kPrefetch = 32;           // rows of a block read ahead

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
// The same vector, loadable from any float address.
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

// y[r, 0:cols] = x[r, :] . block (+ bias), for the R rows of x.
template <int R>
void tile(const float* x, int64_t ldx, const float* block, int64_t K,
          float* y, int64_t ldy, int64_t cols, const float* bias) {
  vfloat acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = vfloat{};
  for (int64_t k = 0; k < K; ++k) {
    const float* row = block + k * kBlock;
    __builtin_prefetch(row + kPrefetch * kBlock);
    __builtin_prefetch(row + kPrefetch * kBlock + kLanes);
    vfloat w[kVecs];
    for (int v = 0; v < kVecs; ++v)
      w[v] = *reinterpret_cast<const vfloat_u*>(row + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xs = x[r * ldx + k];
      for (int v = 0; v < kVecs; ++v) acc[r][v] += xs * w[v];
    }
  }
  float out[kBlock];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kVecs; ++v)
      *reinterpret_cast<vfloat_u*>(out + v * kLanes) = acc[r][v];
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

at::Tensor packed_linear(const at::Tensor& input, const at::Tensor& packed,
                         int64_t out_features,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat &&
                  packed.scalar_type() == at::kFloat,
              "packed_linear: float32 only, got ", input.scalar_type());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kBlock &&
                  packed.is_contiguous(),
              "packed_linear: the weight must come from pack_weight");
  const int64_t K = packed.size(1);
  const int64_t blocks = packed.size(0);
  TORCH_CHECK(input.size(-1) == K, "packed_linear: the input has ",
              input.size(-1), " features, the weight ", K);
  TORCH_CHECK(out_features > (blocks - 1) * kBlock &&
                  out_features <= blocks * kBlock,
              "packed_linear: ", out_features,
              " outputs do not match a packed weight of ", blocks,
              " blocks");
  // Rows are read in place when the input is contiguous, and the output
  // is allocated at its final shape: a decode step makes ~120 of these
  // calls, so each tensor op saved here counts.
  const at::Tensor x = input.is_contiguous() ? input : input.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  auto out_sizes = input.sizes().vec();
  out_sizes.back() = out_features;
  at::Tensor y = at::empty(out_sizes, x.options());
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features,
                "packed_linear: bias of ", bias->numel(), " for ",
                out_features, " outputs");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  // Row tiles of near-equal height: 16 rows run as 8 + 8, not 12 + 4.
  const int64_t tiles = (M + kMaxRows - 1) / kMaxRows;
  const int64_t height = tiles ? (M + tiles - 1) / tiles : 0;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t c0 = blk * kBlock;
      const int64_t cols = std::min(kBlock, out_features - c0);
      const float* block = wp + blk * K * kBlock;
      for (int64_t m0 = 0; m0 < M; m0 += height) {
        const int64_t rows = std::min(height, M - m0);
        kTiles[rows](xp + m0 * K, K, block, K, yp + m0 * out_features + c0,
                     out_features, cols, bp ? bp + c0 : nullptr);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(spyre_cpu, m) {
  m.def(
      "packed_linear(Tensor input, Tensor packed, int out_features, "
      "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(spyre_cpu, CPU, m) {
  m.impl("packed_linear", &packed_linear);
}
