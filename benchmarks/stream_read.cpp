// The machine's memory read bandwidth, for benchmarks/roofline.py: a sum
// over a float32 array that streams it from memory as fast as the cores
// can take it.
//
// Each of `threads` OpenMP threads sums one contiguous share of the array.
// A share is read as kStreams sub-streams in lock step, one vector of each
// per step, each into its own accumulator: several pages are read at once
// (the hardware prefetchers stop at page boundaries), and no addition
// waits for the one before it.  Every stream is prefetched 1 KiB ahead
// into the L2 cache (locality 1: prefetcht2 on x86); on the reference
// machine (AVX-512) that read 2-24 % faster than prefetching into L1 with
// two threads, and about 25 % faster with one.  The sum is returned so
// that nothing is optimised away.
//
// A vector is one register of the build's widest float vectors, and the
// accumulators take half the registers: 16 of AVX-512's 32, 8 of AVX2's
// 16.  (With AVX2 alone, 16 streams of 64-byte vectors took 32 registers:
// the sums spilled to the stack, and the read measured 11-17 GB/s where
// torch.sum read 19-21 on a 2-core AMD EPYC without AVX-512.)
//
// Written with GCC vector extensions, so the same source builds for AVX-512
// or AVX2 (x86), VSX (Power) and the z/Architecture vector facility.  Plain
// C linkage without torch headers: it builds in a second, and roofline.py
// calls it through ctypes.

#include <omp.h>

#include <cstdint>

namespace {

#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr int64_t kLanes = 8;     // floats per vector: one ymm register
constexpr int64_t kStreams = 8;   // sub-streams per thread
#else
constexpr int64_t kLanes = 16;    // floats per vector: one 64-byte line
constexpr int64_t kStreams = 16;  // sub-streams per thread
#endif
constexpr int64_t kPrefetch = 1024 / (kLanes * 4);  // vectors read ahead

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
// The same vector, loadable from any float address.
typedef float vfloat_u
    __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

// Sum of x[0:n] by one thread.
float share_sum(const float* x, int64_t n) {
  const int64_t len = n / (kStreams * kLanes) * kLanes;  // per stream
  vfloat acc[kStreams] = {};
  for (int64_t i = 0; i < len; i += kLanes) {
    for (int64_t s = 0; s < kStreams; ++s) {
      const float* p = x + s * len + i;
      __builtin_prefetch(p + kPrefetch * kLanes, 0, 1);
      acc[s] += *reinterpret_cast<const vfloat_u*>(p);
    }
  }
  for (int64_t s = 1; s < kStreams; ++s) acc[0] += acc[s];
  float sum = 0;
  for (int64_t l = 0; l < kLanes; ++l) sum += acc[0][l];
  for (int64_t i = kStreams * len; i < n; ++i) sum += x[i];
  return sum;
}

}  // namespace

// Sum of x[0:n], read by `threads` threads (at least 1).
extern "C" double spyre_stream_sum(const float* x, int64_t n, int threads) {
  double total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const int64_t t = omp_get_thread_num(), T = omp_get_num_threads();
    const int64_t vecs = n / kLanes;
    const int64_t begin = vecs * t / T * kLanes;
    const int64_t end = t == T - 1 ? n : vecs * (t + 1) / T * kLanes;
    total += share_sum(x + begin, end - begin);
  }
  return total;
}
