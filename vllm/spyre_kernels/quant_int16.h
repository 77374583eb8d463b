// int8 and int4 codes times inputs held as 16-bit integers: quant.cpp's
// tiles for a few rows of inputs at the bfloat16 precision, where the
// float32 tiles spend more instructions widening each code (a widening
// load, masks for int4, a conversion per 16 codes, then a multiply-add)
// than the memory needs to deliver it.  Here a pair of input features
// multiplies a pair of codes in one `vpdpwssd` (AVX512_VNNI; `vpmaddwd`
// and an add without it): two codes per lane, widened to 16 bits, against
// two inputs, summed exactly in 32-bit integers.
//
// The inputs.  A bfloat16 value is an 8-bit integer times a power of two.
// The features are taken in spans of at most kSpan (within one group of
// the weight's scales); each span's inputs are held as 16-bit integers
// against one power of two, 2^(E - 14), E the exponent of the span's
// largest magnitude: every input within a factor 2^7 of that largest is
// held exactly, and a smaller one is rounded to the nearest multiple of
// 2^(E - 14), an error below 2^-15 of the largest.  (bfloat16 itself
// keeps 8 significant bits: the inputs' own rounding is 2^7 times
// coarser.)  Sums stay exact in 32-bit integers over a span: 2 x 128 x
// 32767 per instruction, at most 128 instructions.  Each span's sum is
// then converted to float32 and multiplied by its power of two.
//
// The codes.  The packed layout stays quant.cpp's: rows k and k + 1 are
// widened to 16 bits and paired (`code_words`), so a lane holds one
// column's codes of both rows; int8's lanes come in the order
// `kIntColumns` gives, and the group's float32 sums are put back in
// column order once per group.  int4's codes (0..15, a zero point taken
// off per group as on the float32 tiles) stay below 2^4, int8's below
// 2^7 in magnitude: the spans' integer sums cannot overflow.
//
// Two builds of the tiles: AVX512BW's, 16 columns a register (two
// registers a block row, int8's lanes in `kIntColumns`' order), and
// AVX2's, 8 columns a register (four a block row, every code pair in
// column order: the in-lane byte unpacks of two 16-byte halves pair rows k
// and k + 1 column by column), `vpmaddwd` and an add, or AVX-VNNI's
// 256-bit `vpdpwssd` where the build has it.  Both sum the same integers
// exactly and scale them with the same float32 operations lane by lane,
// so their outputs are equal bit for bit.
//
// Included by quant.cpp, inside its anonymous namespace, where the build
// has AVX512BW or AVX2.

constexpr int64_t kIntRows = 4;  // heights the integer tiles take
constexpr int64_t kSpan = 256;   // features per span at most

// The span length for groups of `group` features (0: the integer tiles do
// not take them): the whole group, or its largest even part of 256, 128,
// 64 features that divides it.
inline int64_t int_span(int64_t group) {
  if (group % 2) return 0;
  if (group <= kSpan) return group;
  for (int64_t span = kSpan; span >= 64; span /= 2)
    if (group % span == 0) return span;
  return 0;
}

// Row r's inputs as 16-bit integers (pairs of features per 32-bit word)
// and each span's power of two: `q` [M][K], `powers` [M][ceil(K / span)].
// The inputs are bfloat16 values (rounded, or bfloat16 inputs widened).
inline void inputs_as_int16(const float* x, int64_t M, int64_t K,
                            int64_t span, int16_t* q, float* powers) {
  const int64_t spans = (K + span - 1) / span;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t s = 0; s < spans; ++s) {
      const float* xs = x + m * K + s * span;
      int16_t* qs = q + m * K + s * span;
      const int64_t n = std::min(span, K - s * span);
      float largest = 0.0f;
      for (int64_t k = 0; k < n; ++k)
        largest = std::max(largest, std::fabs(xs[k]));
      if (!(largest > 0.0f && std::isfinite(largest))) {
        // A span of zeros sums to zero; one with an infinity or a NaN
        // gives NaN sums (a float32 product would give an infinity or a
        // NaN).
        std::fill(qs, qs + n, int16_t{0});
        powers[m * spans + s] = largest == 0.0f
                                    ? 0.0f
                                    : std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      int e;
      std::frexp(largest, &e);  // largest in [2^(e - 1), 2^e)
      const float up = std::ldexp(1.0f, 15 - e);  // 2^(14 - E), E = e - 1
      for (int64_t k = 0; k < n; ++k)
        qs[k] = static_cast<int16_t>(std::nearbyint(xs[k] * up));
      powers[m * spans + s] = std::ldexp(1.0f, e - 15);
    }
}

#if defined(__AVX512BW__)
// Where the interleaved lanes put the block's columns: lanes of the low
// unpack, then of the high one, give columns back through these indices
// (`vpermt2ps` over the two; half 0: columns 0-15, half 1: 16-31).
// Within each 128-bit lane i, the low unpack holds columns 8i..8i+3 and
// the high one 8i+4..8i+7.  A constant table, built at compile time.
struct IntColumns {
  alignas(64) int32_t idx[2][16];
};

constexpr IntColumns make_int_columns() {
  IntColumns t{};
  for (int half = 0; half < 2; ++half)
    for (int j = 0; j < 16; ++j) {
      const int c = 16 * half + j;  // the column wanted in lane j
      const int lane = c / 8, within = c % 8;
      t.idx[half][j] =
          within < 4 ? 4 * lane + within : 16 + 4 * lane + within - 4;
    }
  return t;
}

inline constexpr IntColumns kIntColumns = make_int_columns();

inline __m512i dot_int16(__m512i acc, __m512i codes, __m512i inputs) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, codes, inputs);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(codes, inputs));
#endif
}

// The codes of block rows k and k + 1 as 16-bit pairs, one 32-bit lane
// per column: columns 0-15 in w[0], 16-31 in w[1], for int8 in the lanes'
// order `int_columns` undoes (in-lane unpacks, one instruction each), for
// int4 in column order (the two rows' 32 bytes widened to words, each
// nibble masked or shifted out, and one `vpermw` per 16 columns pairs the
// rows: a row of int4 codes is 16 bytes, byte c holding column c in its
// low nibble and column c + 16 in its high one).
template <int K>
inline void code_words(const uint8_t* row, __m512i (&w)[kVecs]) {
  if constexpr (K == kInt8) {
    const __m512i a = _mm512_cvtepi8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(row + kBlock)));
    w[0] = _mm512_unpacklo_epi16(a, b);
    w[1] = _mm512_unpackhi_epi16(a, b);
  } else {
    const __m512i pair = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i words = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
    w[0] = _mm512_permutexvar_epi16(
        pair, _mm512_and_si512(words, _mm512_set1_epi16(15)));
    w[1] = _mm512_permutexvar_epi16(pair, _mm512_srli_epi16(words, 4));
  }
}

using IVec = __m512i;  // a register of 32-bit sums, 16 columns
using FVec = __m512;   // the same sums in float32

inline IVec izero() { return _mm512_setzero_si512(); }
inline IVec iadd(IVec a, IVec b) { return _mm512_add_epi32(a, b); }
inline IVec ibroadcast(int32_t pair) { return _mm512_set1_epi32(pair); }
inline FVec fzero() { return _mm512_setzero_ps(); }
// part + sum * power, the sum converted to float32.
inline FVec scale_add(IVec sum, float power, FVec part) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(power),
                         part);
}

// A row's group sums in column order: int8's lanes put back.
template <int K>
inline void in_columns(const FVec (&part)[kVecs], nfloat (&sums)[kVecs]) {
  if constexpr (K == kInt8) {
    const __m512i to_cols0 = _mm512_load_si512(kIntColumns.idx[0]);
    const __m512i to_cols1 = _mm512_load_si512(kIntColumns.idx[1]);
    sums[0] = reinterpret_cast<nfloat>(
        _mm512_permutex2var_ps(part[0], to_cols0, part[1]));
    sums[1] = reinterpret_cast<nfloat>(
        _mm512_permutex2var_ps(part[0], to_cols1, part[1]));
  } else {
    sums[0] = reinterpret_cast<nfloat>(part[0]);
    sums[1] = reinterpret_cast<nfloat>(part[1]);
  }
}

// Independent sums: a vpdpwssd waits on its own latency, as tile()'s
// multiply-adds do.
constexpr int int_chains(int R) { return R <= 2 ? 4 : R == 3 ? 2 : 1; }

#else
// AVX2: 8 columns a register, kVecs (4) registers a block row.
inline __m256i dot_int16(__m256i acc, __m256i codes, __m256i inputs) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, codes, inputs);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(codes, inputs));
#endif
}

// The codes of block rows k and k + 1 as 16-bit pairs, one 32-bit lane
// per column, w[v] holding columns 8v..8v+7.  int8: each row's 16-byte
// halves unpacked against the other row's (bytes of one column side by
// side), then sign-extended to words.  int4: the two rows' 16 bytes
// unpacked the same way and zero-extended, each word then holding a byte
// of codes: its low nibble (columns 0-15), or shifted, its high one
// (columns 16-31).
template <int K>
inline void code_words(const uint8_t* row, __m256i (&w)[kVecs]) {
  auto load = [](const uint8_t* p) {
    return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  };
  if constexpr (K == kInt8) {
    for (int h = 0; h < 2; ++h) {
      const __m128i a = load(row + 16 * h);
      const __m128i b = load(row + kBlock + 16 * h);
      w[2 * h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));
      w[2 * h + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));
    }
  } else {
    const __m128i a = load(row);
    const __m128i b = load(row + kBlock / 2);
    const __m256i lo = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(a, b));
    const __m256i hi = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(a, b));
    const __m256i nibble = _mm256_set1_epi16(15);
    w[0] = _mm256_and_si256(lo, nibble);
    w[1] = _mm256_and_si256(hi, nibble);
    w[2] = _mm256_srli_epi16(lo, 4);
    w[3] = _mm256_srli_epi16(hi, 4);
  }
}

using IVec = __m256i;  // a register of 32-bit sums, 8 columns
using FVec = __m256;

inline IVec izero() { return _mm256_setzero_si256(); }
inline IVec iadd(IVec a, IVec b) { return _mm256_add_epi32(a, b); }
inline IVec ibroadcast(int32_t pair) { return _mm256_set1_epi32(pair); }
inline FVec fzero() { return _mm256_setzero_ps(); }
inline FVec scale_add(IVec sum, float power, FVec part) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(power),
                         part);
}

// The sums are in column order already.
template <int K>
inline void in_columns(const FVec (&part)[kVecs], nfloat (&sums)[kVecs]) {
  for (int v = 0; v < kVecs; ++v) sums[v] = reinterpret_cast<nfloat>(part[v]);
}

// Half AVX-512's registers, twice the sums a row.  Without AVX-VNNI a
// product's add waits one cycle on the sum before it (the multiply does
// not wait), so one chain keeps the units busy; a second would spill two
// of one row's eight sums to the stack.  AVX-VNNI's `vpdpwssd` waits on
// its own latency: a second chain for one row.
#if defined(__AVXVNNI__)
constexpr int int_chains(int R) { return R == 1 ? 2 : 1; }
#else
constexpr int int_chains(int) { return 1; }
#endif

#endif

// tile() for int8 or int4 codes on the integer inputs: q [R][ldq] int16
// (pairs read as 32-bit words), powers [R][spans]; `in` and `span` even.
// One body for both builds, on their registers (IVec, FVec, kVecs a
// block row) and helpers above.
template <int K, int R>
void tile_int16(const int16_t* q, int64_t ldq, const float* powers,
                int64_t spans, int64_t span, const float* xsums,
                int64_t groups, const uint8_t* block, int64_t in,
                int64_t group, const float* scales, const float* offsets,
                float zero, Out out, int64_t cols, const float* bias) {
  constexpr int64_t bytes = row_bytes<K>();
  constexpr int U = int_chains(R);
  // Row pairs a pass of the span loop: every chain's, and a whole number
  // of cache lines (a row pair is 64 bytes of int8 codes, 32 of int4).
  constexpr int kPass = std::max<int>(U, kLine / (2 * bytes));
  nfloat acc[R][kVecs];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = nfloat{};
  for (int64_t k0 = 0, g = 0; k0 < in; k0 += group, ++g) {
    const int64_t end = std::min(k0 + group, in);
    FVec part[R][kVecs];  // the group's sums, in the codes' lanes
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVecs; ++v) part[r][v] = fzero();
    for (int64_t s0 = k0; s0 < end; s0 += span) {
      const int64_t s_end = std::min(s0 + span, end);
      IVec isum[U][R][kVecs];
      for (int u = 0; u < U; ++u)
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kVecs; ++v) isum[u][r][v] = izero();
      auto step = [&](int u, int64_t k) {
        IVec w[kVecs];
        code_words<K>(block + k * bytes, w);
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, q + r * ldq + k, sizeof pair);
          const IVec xs = ibroadcast(pair);
          for (int v = 0; v < kVecs; ++v)
            isum[u][r][v] = dot_int16(isum[u][r][v], w[v], xs);
        }
      };
      // Whole cache lines of codes a pass (int4: two row pairs a line),
      // one prefetch each: no line arithmetic in the loop.
      int64_t k = s0;
      for (; k + 2 * kPass <= s_end; k += 2 * kPass) {
        for (int64_t at = 0; at < 2 * kPass * bytes; at += kLine) {
          __builtin_prefetch(block + k * bytes + at + kAheadL1);
          __builtin_prefetch(block + k * bytes + at + kAheadL2, 0, 2);
        }
        for (int p = 0; p < kPass; ++p) step(p % U, k + 2 * p);
      }
      for (; k < s_end; k += 2) {
        prefetch_rows(block + k * bytes, k * bytes, 2 * bytes);
        step(0, k);
      }
      for (int u = 1; u < U; ++u)
        for (int r = 0; r < R; ++r)
          for (int v = 0; v < kVecs; ++v)
            isum[0][r][v] = iadd(isum[0][r][v], isum[u][r][v]);
      const int64_t s = s0 / span;
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < kVecs; ++v)
          part[r][v] = scale_add(isum[0][r][v], powers[r * spans + s],
                                 part[r][v]);
    }
    nfloat sums[R][kVecs];
    for (int r = 0; r < R; ++r) in_columns<K>(part[r], sums[r]);
    add_group<R>(acc, sums, scales, offsets, zero, xsums, groups, g);
  }
  store_rows<R>(acc, out, cols, bias);
}

using IntFn = void (*)(const int16_t*, int64_t, const float*, int64_t,
                       int64_t, const float*, int64_t, const uint8_t*,
                       int64_t, int64_t, const float*, const float*, float,
                       Out, int64_t, const float*);

template <int K>
constexpr IntFn kInts[kIntRows + 1] = {nullptr, tile_int16<K, 1>,
                                       tile_int16<K, 2>, tile_int16<K, 3>,
                                       tile_int16<K, 4>};
