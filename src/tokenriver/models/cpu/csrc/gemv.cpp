// Quantized matrix-vector products that read weights at memory speed on x86-64 CPUs with AVX2 + FMA + F16C.
//
// One decode step multiplies a few activation rows by every weight matrix of the model, so its time is the time
// to stream the weights from memory. These kernels read the weights in their quantized form (0.5 or 1 byte per
// weight plus float16 scales per group), in row tiles (tiles.h: 16 rows at a time, each 32-column block as words of
// the 16 rows side by side), decode them in registers and accumulate in float32: 4-8x fewer bytes per weight than
// float32, and no float copy of the matrix is ever written.
//
// Weight formats (row n of an [N, K] matrix, groups of G consecutive columns, G a multiple of 32):
//   int4: w[n, k] = scale[n, k/G] * q[n, k] + min[n, k/G], q in 0..15 (GGUF's Q4_0/Q4_1 nibble order);
//   int5: int4 with a fifth bit per code: w = scale * (q + 16 * bit) + min (GGUF's Q5_0/Q5_1);
//   int8: w[n, k] = scale[n, k/G] * q[n, k].
// Activations x [M, K] and outputs y [M, N] are float32, row-major and contiguous.
//
// Two arithmetic modes, each computing a row the same way in this GEMV and in gemm.cpp's GEMM, so a row's bits never
// depend on how many rows share the product:
// - float32 activations: vec.h's float arithmetic (the exact dequantized weight times x, one FMA chain per lane of
//   column residues, a fixed fold of the lanes);
// - activations rounded to int8 per 32 columns and multiplied as integers, as llama.cpp does (quantize_activations):
//   for int4 weights about a third of the float path's operations, so the products keep up with memory ("one
//   arithmetic per row" below).
// Parallel over tiles of output rows with OpenMP; it shares PyTorch's libgomp (same soname), so the threads are
// PyTorch's.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "tiles.h"
#include "vec.h"

namespace {

using tokenriver::decode_block;
using tokenriver::FloatLanes;
using tokenriver::fma_lanes;
using tokenriver::fold_lanes;
using tokenriver::kFloatLanes;
using tokenriver::kTileRows;
using tokenriver::load_lanes;
using tokenriver::quantize_activations;
using tokenriver::TiledWeight;
using tokenriver::zero_lanes;

// How far ahead of the tile being multiplied the kernels prefetch weight bytes, into L2: about the next tile
// (benchmarks/HISTORY.md has the distances tried).
constexpr int64_t kPrefetchBytes = 8192;

// ---- Int8 activations: one arithmetic per row ----------------------------------------------------------------
//
// Every product with int8 activations computes an output as one chain over its blocks of 32 columns, in order, the
// same here and in gemm.cpp's GEMM (int8_tile), so a row's bits depend on that row alone: not on how many rows
// share the product, where the row sits among them, or which thread computes it. Per block b,
//     S_b = the exact integer sum of the block's codes times the row's rounded activations
//     acc = fma(S_b, ws_b * xs_b, acc)          ws_b the weight's scale for the block, xs_b the activations'
//     acc = fma(min_b, xs_b * T_b, acc)          int4 weights only: T_b the block's sum of rounded activations
// and y = acc; int8 weights with one scale per output channel (group size K) the same, ws_b that scale. The integer
// sums are exact whatever instructions add them, so only the float chain fixes the bits. A weight with chain_ends
// (tiles.h; the projections tensor parallelism splits by columns, models/row_chains.py) runs one such chain per run
// of blocks, each from zero, and y adds the chains' results in order: what a rank's product of those columns gives,
// and how the ranks' results are added. (So a run's product has one arithmetic whatever its group size: a run of
// one group of a per-group weight has one scale per row too.)
// Here a vector's lanes are the 16 weight rows of a tile, each word of the tile's block one load; in the GEMM they
// are 16 activation rows of one weight row. Each lane goes through the same operations either way.

// One activation row rounded to int8 per 32 columns: its codes, and per block its scale xs, xs * T (the int4 min
// term's factor) and 128 * T (what offsetting int8 weights by 128 adds to S).
struct RowActivations {
  std::vector<int8_t> xq;
  std::vector<float> xscale, xterm;
  std::vector<int32_t> offset;

  RowActivations(const float* x, int64_t K) : xq(K), xscale(K / 32), xterm(K / 32), offset(K / 32) {
    quantize_activations(x, 1, K, xq.data(), xscale.data());
    for (int64_t b = 0; b < K / 32; ++b) {
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) total += xq[32 * b + i];
      xterm[b] = xscale[b] * static_cast<float>(total);
      offset[b] = 128 * total;
    }
  }
  // The four rounded activations of word j of block b, as one 32-bit value.
  int32_t word(int64_t b, int j) const {
    int32_t value;
    memcpy(&value, xq.data() + 32 * b + 4 * j, 4);
    return value;
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// A tile block's codes as unsigned bytes, word by word: int4 low nibbles in codes[0..3] (columns 4j + i), high ones
// in codes[4..7] (columns 16 + 4j + i), each with its fifth bit added (int5); int8 codes offset by 128.
template <bool IS_INT4, bool HIGH>
inline void block_codes(const TiledWeight& w, int64_t t, int64_t b, __m512i codes[8]) {
  const uint8_t* block = w.block(t, b);
  _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T1);
  if (!IS_INT4) {
    _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes + 256, _MM_HINT_T1);
    for (int j = 0; j < 8; ++j)
      codes[j] = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * j), _mm512_set1_epi8(-128));
    return;
  }
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_loadu_si512(block + 64 * j);
    codes[j] = _mm512_and_si512(raw, nibble);
    codes[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  }
  if (HIGH) {
    const uint64_t* masks = w.block_fifth(t, b);
    const __m512i sixteen = _mm512_set1_epi8(16);
    for (int k = 0; k < 8; ++k) codes[k] = _mm512_mask_add_epi8(codes[k], masks[k], codes[k], sixteen);
  }
}

// The integer sum S_b of the tile's 16 rows for one activation row, a lane per row.
inline __m512i block_sums(const __m512i codes[8], const RowActivations& a, int64_t b) {
  __m512i sums = _mm512_setzero_si512();
  for (int j = 0; j < 8; ++j) sums = _mm512_dpbusd_epi32(sums, codes[j], _mm512_set1_epi32(a.word(b, j)));
  return sums;
}

// Tile t's 16 rows against MT activation rows (a[0..MT)), y's outputs of those rows (ld: y's row stride).
template <bool IS_INT4, bool HIGH, int MT>
void int8_tile(const TiledWeight& w, int64_t t, const RowActivations* a, float* y, int64_t ld) {
  __m512 total[MT];
  for (int64_t c = 0, begin = 0, end; begin < w.blocks(); begin = end, ++c) {
    end = w.chain_end(c);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = begin; b < end; ++b) {
      __m512i codes[8];
      block_codes<IS_INT4, HIGH>(w, t, b, codes);
      const __m512 scales =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block_scales(t, b))));
      const __m512 mins = !IS_INT4             ? _mm512_setzero_ps()
                          : w.mins == nullptr ? _mm512_mul_ps(scales, _mm512_set1_ps(-w.centre()))
                                              : _mm512_cvtph_ps(_mm256_loadu_si256(
                                                    reinterpret_cast<const __m256i*>(w.block_mins(t, b))));
      for (int m = 0; m < MT; ++m) {
        __m512i sums = block_sums(codes, a[m], b);
        if (!IS_INT4) sums = _mm512_sub_epi32(sums, _mm512_set1_epi32(a[m].offset[b]));
        const __m512 exact = _mm512_cvtepi32_ps(sums);
        acc[m] = _mm512_fmadd_ps(exact, _mm512_mul_ps(scales, _mm512_set1_ps(a[m].xscale[b])), acc[m]);
        if (IS_INT4) acc[m] = _mm512_fmadd_ps(mins, _mm512_set1_ps(a[m].xterm[b]), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) total[m] = c == 0 ? acc[m] : _mm512_add_ps(total[m], acc[m]);
  }
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, w.N - kTileRows * t));
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ld + kTileRows * t, lanes, total[m]);
}
#else
// Without AVX512-VNNI: the same sums 8 lanes at a time (rows 8h .. 8h + 7 of the tile in half h). maddubs
// multiplies unsigned by signed bytes, int8 codes pass their sign to the activations; no pair sum overflows int16
// (2 * 31 * 127 for int5 codes, 2 * 127 * 127 for int8).
template <bool IS_INT4, bool HIGH>
inline void block_codes(const TiledWeight& w, int64_t t, int64_t b, int h, __m256i codes[8]) {
  const uint8_t* block = w.block(t, b) + 32 * h;
  if (h == 0) _mm_prefetch(reinterpret_cast<const char*>(block) + kPrefetchBytes, _MM_HINT_T1);
  if (!IS_INT4) {
    for (int j = 0; j < 8; ++j) codes[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
    return;
  }
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 64 * j));
    codes[j] = _mm256_and_si256(raw, nibble);
    codes[4 + j] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  }
  if (HIGH) {
    const uint64_t* masks = w.block_fifth(t, b);
    for (int k = 0; k < 8; ++k)
      codes[k] = _mm256_or_si256(codes[k], tokenriver::fifth_bits(static_cast<uint32_t>(masks[k] >> (32 * h))));
  }
}

template <bool IS_INT4>
inline __m256i block_sums(const __m256i codes[8], const RowActivations& a, int64_t b) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i sums = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    const __m256i x = _mm256_set1_epi32(a.word(b, j));
    const __m256i pairs = IS_INT4 ? _mm256_maddubs_epi16(codes[j], x)
                                  : _mm256_maddubs_epi16(_mm256_sign_epi8(codes[j], codes[j]), _mm256_sign_epi8(x, codes[j]));
    sums = _mm256_add_epi32(sums, _mm256_madd_epi16(pairs, ones));
  }
  return sums;
}

template <bool IS_INT4, bool HIGH, int MT>
void int8_tile(const TiledWeight& w, int64_t t, const RowActivations* a, float* y, int64_t ld) {
  __m256 total[MT][2];
  for (int64_t c = 0, begin = 0, end; begin < w.blocks(); begin = end, ++c) {
    end = w.chain_end(c);
    __m256 acc[MT][2];
    for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int64_t b = begin; b < end; ++b)
      for (int h = 0; h < 2; ++h) {
        __m256i codes[8];
        block_codes<IS_INT4, HIGH>(w, t, b, h, codes);
        const auto terms = [&](const uint16_t* p) {
          return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * h)));
        };
        const __m256 scales = terms(w.block_scales(t, b));
        const __m256 mins = !IS_INT4             ? _mm256_setzero_ps()
                            : w.mins == nullptr ? _mm256_mul_ps(scales, _mm256_set1_ps(-w.centre()))
                                                : terms(w.block_mins(t, b));
        for (int m = 0; m < MT; ++m) {
          const __m256 exact = _mm256_cvtepi32_ps(block_sums<IS_INT4>(codes, a[m], b));
          acc[m][h] = _mm256_fmadd_ps(exact, _mm256_mul_ps(scales, _mm256_set1_ps(a[m].xscale[b])), acc[m][h]);
          if (IS_INT4) acc[m][h] = _mm256_fmadd_ps(mins, _mm256_set1_ps(a[m].xterm[b]), acc[m][h]);
        }
      }
    for (int m = 0; m < MT; ++m)
      for (int h = 0; h < 2; ++h) total[m][h] = c == 0 ? acc[m][h] : _mm256_add_ps(total[m][h], acc[m][h]);
  }
  alignas(32) float out[kTileRows];
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, w.N - kTileRows * t));
  for (int m = 0; m < MT; ++m) {
    for (int h = 0; h < 2; ++h) _mm256_store_ps(out + 8 * h, total[m][h]);
    memcpy(y + m * ld + kTileRows * t, out, valid * sizeof(float));
  }
}
#endif

// y [M, N] = x [M, K] with int8 activations @ the tiled weight's [N, K]ᵀ: tiles in parallel, each against the
// activation rows four at a time (its blocks stay in L1 between groups).
template <bool IS_INT4, bool HIGH>
void linear_int8(const float* x, int64_t M, const TiledWeight& w, float* y, int num_threads) {
  std::vector<RowActivations> activations;
  activations.reserve(M);
  for (int64_t m = 0; m < M; ++m) activations.emplace_back(x + m * w.K, w.K);
  const int64_t num_tiles = (w.N + kTileRows - 1) / kTileRows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) int8_tile<IS_INT4, HIGH, 4>(w, t, activations.data() + m, y + m * w.N, w.N);
    switch (M - m) {
      case 3: int8_tile<IS_INT4, HIGH, 3>(w, t, activations.data() + m, y + m * w.N, w.N); break;
      case 2: int8_tile<IS_INT4, HIGH, 2>(w, t, activations.data() + m, y + m * w.N, w.N); break;
      case 1: int8_tile<IS_INT4, HIGH, 1>(w, t, activations.data() + m, y + m * w.N, w.N); break;
      default: break;
    }
  }
}

// ---- Float32 activations ----------------------------------------------------------------------------------------
//
// vec.h's float arithmetic (decode_block, one lane chain per column residue, fold_lanes), the weights decoded in
// registers block by block: RT weight rows × MT activation rows per tile, each decoded block feeding all MT rows.

template <bool IS_INT4, int RT, int MT>
void float_tile(const float* x, const TiledWeight& w, int64_t n0, int64_t m0, float* y) {
  constexpr int kVectors = 32 / kFloatLanes;
  const int64_t K = w.K;
  FloatLanes acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = zero_lanes();
  for (int64_t b = 0; b < w.blocks(); ++b) {
    FloatLanes xv[MT][kVectors];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < kVectors; ++i) xv[m][i] = load_lanes(x + (m0 + m) * K + 32 * b + kFloatLanes * i);
    if (b % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(w.block(n0 / kTileRows, b)) + kPrefetchBytes, _MM_HINT_T1);
    for (int r = 0; r < RT; ++r) {
      const int64_t n = n0 + r;
      alignas(32) uint8_t bytes[32];
      w.row_block(n, b, bytes);
      const uint32_t fifth = w.fifth != nullptr ? w.row_fifth(n, b) : 0;
      FloatLanes decoded[kVectors];
      decode_block<IS_INT4>(bytes, w.fifth != nullptr ? &fifth : nullptr, w.row_scale(n, b),
                            IS_INT4 ? w.row_min(n, b) : 0.0f, decoded);
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < kVectors; ++i) acc[r][m] = fma_lanes(decoded[i], xv[m][i], acc[r][m]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) y[(m0 + m) * w.N + n0 + r] = fold_lanes(acc[r][m]);
}

// RT weight rows from n0 against every activation row, four at a time, then the rest in one tile.
template <bool IS_INT4, int RT>
void float_rows(const float* x, int64_t M, const TiledWeight& w, int64_t n0, float* y) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) float_tile<IS_INT4, RT, 4>(x, w, n0, m0, y);
  switch (M - m0) {
    case 3: float_tile<IS_INT4, RT, 3>(x, w, n0, m0, y); break;
    case 2: float_tile<IS_INT4, RT, 2>(x, w, n0, m0, y); break;
    case 1: float_tile<IS_INT4, RT, 1>(x, w, n0, m0, y); break;
    default: break;
  }
}

template <bool IS_INT4>
void linear_f32(const float* x, int64_t M, const TiledWeight& w, float* y, int num_threads) {
  // Tiles of 4 weight rows, then the remainder one row at a time.
  const int64_t num_tiles = w.N / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) float_rows<IS_INT4, 4>(x, M, w, 4 * t, y);
  for (int64_t n = 4 * num_tiles; n < w.N; ++n) float_rows<IS_INT4, 1>(x, M, w, n, y);
}

TiledWeight int4_weight(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                        int64_t N, int64_t K, int64_t G) {
  return TiledWeight{codes, scales, mins, fifth, N, K, G, true};
}

TiledWeight int8_weight(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t G) {
  return TiledWeight{reinterpret_cast<const uint8_t*>(codes), scales, nullptr, nullptr, N, K, G, false};
}

}  // namespace

extern "C" {

// Arguments start with the weight's (fixed per layer, bound once in Python; row tiles, tiles.h) and end with the
// call's. The int4 products take int5 weights too: fifth their high bits' masks, or null for int4.
void int4_linear_f32(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                     int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                     int num_threads) {
  linear_f32<true>(x, M, int4_weight(codes, scales, mins, fifth, N, K, group_size), y, num_threads);
}

void int8_linear_f32(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const float* x, int64_t M, float* y, int num_threads) {
  linear_f32<false>(x, M, int8_weight(codes, scales, N, K, group_size), y, num_threads);
}

// The same products with activations rounded to int8 per 32 columns (quantize_activations), any number of rows,
// in the arithmetic gemm.cpp's int8 GEMM shares (above).
// chain_ends: the weight's sub-chains (tiles.h), or null.
void int4_linear_int8x(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                       int64_t N, int64_t K, int64_t group_size, const int64_t* chain_ends, const float* x, int64_t M,
                       float* y, int num_threads) {
  TiledWeight w = int4_weight(codes, scales, mins, fifth, N, K, group_size);
  w.chain_ends = chain_ends;
  if (fifth == nullptr)
    linear_int8<true, false>(x, M, w, y, num_threads);
  else
    linear_int8<true, true>(x, M, w, y, num_threads);
}

void int8_linear_int8x(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                       const int64_t* chain_ends, const float* x, int64_t M, float* y, int num_threads) {
  TiledWeight w = int8_weight(codes, scales, N, K, group_size);
  w.chain_ends = chain_ends;
  linear_int8<false, false>(x, M, w, y, num_threads);
}

}  // extern "C"
