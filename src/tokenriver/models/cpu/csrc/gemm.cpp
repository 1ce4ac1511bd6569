// Quantized matrix products of many activation rows (batched decode, prefill) on x86-64 CPUs with AVX2 + FMA.
//
// With more than max_gemv_rows rows (quant.py, 10 by default) a product is bound by arithmetic, not by
// reading the weights, so the weights are decoded to float32 once per call, a few rows at a time into a small
// buffer, and every activation row reuses them there. No float32 copy of the model is kept (for the embedded model
// it would be 540 MB), and on these skinny shapes sgemm on such a copy is far from its peak
// (benchmarks/results/gemm.md compares the two).
//
// Float32 activations: RT = 4 decoded weight rows × 4 activation rows of accumulators, in vec.h's float arithmetic
// (one FMA chain per lane of column residues, folded in a fixed tree), the arithmetic of gemv.cpp's float GEMV, so a
// row gives the same bits here and there, whatever the batch.
//
// Where the CPU has AVX512-VNNI a second product is compiled in for models/quant.py's rounded mode: the activations
// are rounded to int8 per 32 columns exactly as gemv.cpp's int8 path rounds them, and multiplied as integers (see
// "Int8 activations" below), four times an FMA's products per instruction, and a decode step and a prefill of the
// same row round alike. The tile's weight layout and vectorized block scales (tile_row, block_terms) keep every
// weight word at a constant offset, so nothing spills (benchmarks/HISTORY.md has the figures).
//
// Weight formats are gemv.cpp's (int4 with scales and mins per group, int8 with scales per group); the decoded
// weights equal the reference dequantization bit for bit (scale * q is exact in float32, one rounding for + min).

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <memory>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tokenriver::decode_int4;
using tokenriver::decode_int8;
using tokenriver::FloatLanes;
using tokenriver::fma_lanes;
using tokenriver::fold_lanes;
using tokenriver::kFloatLanes;
using tokenriver::load_lanes;
using tokenriver::zero_lanes;
using tokenriver::half_to_float;
using tokenriver::prefetch_group_terms;
using tokenriver::quantize_activations;
using tokenriver::transpose8;

// Float products: decoded weight rows per tile (four rows × four activation rows of accumulators).
constexpr int kFloatRows = 4;
// Int8 products: weight rows per tile, activation rows per vector, and per packed panel (two vectors).
constexpr int kRows = 6;
constexpr int kLanes = 8;
constexpr int kPanel = 2 * kLanes;

// Activation rows per pass: [chunk, K] floats should sit in L2 (512 KB) while every weight tile of the matrix sweeps
// over them. Larger batches are taken in chunks, each re-decoding the weights (cheap next to the chunk's arithmetic:
// ~20 instructions per 32 weights against one FMA per weight and activation row).
constexpr int64_t kChunkBytes = 512 * 1024;

// Weight row n, columns [0, K), decoded to float32.
template <bool IS_INT4>
inline void decode_row(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                       int64_t K, int64_t G, int64_t n, float* out) {
  const int64_t num_groups = K / G;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t at = n * num_groups + k / G;
    const __m256 scale = _mm256_set1_ps(half_to_float(scales[at]));
    __m256 w[4];
    if (IS_INT4) {
      decode_int4(qweight + n * (K / 2) + k / 2, w, qh == nullptr ? nullptr : qh + n * (K / 32) + k / 32);
      const __m256 min = _mm256_set1_ps(half_to_float(mins[at]));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 8 * i, _mm256_fmadd_ps(scale, w[i], min));
    } else {
      decode_int8(reinterpret_cast<const int8_t*>(qweight) + n * K + k, w);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 8 * i, _mm256_mul_ps(scale, w[i]));
    }
  }
}

// RT decoded weight rows (w, row stride K) × MT activation rows of x from m0: vec.h's float arithmetic, one lane
// chain per column residue, folded.
template <int RT, int MT>
void float_tile(const float* w, const float* x, int64_t K, int64_t m0, float* y, int64_t N, int64_t n0) {
  FloatLanes acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = zero_lanes();
  for (int64_t k = 0; k < K; k += kFloatLanes) {
    FloatLanes xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = load_lanes(x + (m0 + m) * K + k);
    for (int r = 0; r < RT; ++r) {
      const FloatLanes wv = load_lanes(w + r * K + k);
      for (int m = 0; m < MT; ++m) acc[r][m] = fma_lanes(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n0 + r] = fold_lanes(acc[r][m]);
}

// RT decoded weight rows against activation rows [m_begin, m_end), kFloatRows at a time, then the rest.
template <int RT>
void float_rows(const float* w, const float* x, int64_t K, int64_t m_begin, int64_t m_end, float* y, int64_t N,
                int64_t n0) {
  int64_t m = m_begin;
  for (; m + 4 <= m_end; m += 4) float_tile<RT, 4>(w, x, K, m, y, N, n0);
  switch (m_end - m) {
    case 3: float_tile<RT, 3>(w, x, K, m, y, N, n0); break;
    case 2: float_tile<RT, 2>(w, x, K, m, y, N, n0); break;
    case 1: float_tile<RT, 1>(w, x, K, m, y, N, n0); break;
    default: break;
  }
}

template <bool IS_INT4>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
          const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  // Activation rows per pass: their [chunk, K] floats should sit in L2 while every weight tile sweeps over them.
  const int64_t chunk = std::max<int64_t>(4, kChunkBytes / (K * static_cast<int64_t>(sizeof(float))) / 4 * 4);
  const int64_t num_tiles = (N + kFloatRows - 1) / kFloatRows;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t m1 = std::min(M, m0 + chunk);
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> w(kFloatRows * K);
      // Handed out a few tiles at a time, not split in halves up front: the two cores of a shared machine often
      // run at different speeds, and with fixed halves the faster one waited at the barrier. Which thread
      // computes a tile does not change its result.
#pragma omp for schedule(dynamic, 8)
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n0 = t * kFloatRows;
        const int64_t count = std::min<int64_t>(kFloatRows, N - n0);
        for (int64_t r = 0; r < count; ++r)
          decode_row<IS_INT4>(qweight, scales, mins, qh, K, G, n0 + r, w.data() + r * K);
        switch (count) {
          case 4: float_rows<4>(w.data(), x, K, m0, m1, y, N, n0); break;
          case 3: float_rows<3>(w.data(), x, K, m0, m1, y, N, n0); break;
          case 2: float_rows<2>(w.data(), x, K, m0, m1, y, N, n0); break;
          default: float_rows<1>(w.data(), x, K, m0, m1, y, N, n0); break;
        }
      }
    }
  }
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)

// Int8 activations. A panel holds 16 activation rows rounded to int8, as 32-bit words of four consecutive columns,
// transposed ([K/4, 16]: one 512-bit vector per four columns), with each row's scale and a term of its rounded
// values per block of 32 columns ([K/32, 16] floats each). Per four columns, dpbusd multiplies one weight word (four
// 8-bit columns, broadcast, the unsigned operand) by the panel's vector (the signed one) and adds each row's four
// products into its int32 lane. Per block the integer sums are exact; times the block's weight scale and the row's
// activation scale they are added to the row's float32 sum, block after block in order, so a row's result does not
// depend on the batch.
//   int4 weights (w = s u + min, u in 0..15): the min term adds min times the row's block sum of rounded
//   activations (the panel's term, scaled).
//   int8 weights (w = s q) go in offset by 128 (u = q + 128), so the integer sum carries 128 times the row's block
//   sum of activations: the panel's term is minus that, the value each block's integer sums start from, shared by
//   every weight row. Against offsetting the activations and subtracting 128 times each weight row's block sum in
//   float, the same exact sums with one float operation fewer per block and row.

// Activation rows [0, valid) of x (K columns) rounded and packed into one panel; rows past valid are zero.
// xq [16, K] and xscale [16, K/32] are scratch.
template <bool IS_INT4>
void pack_int8_panel(const float* x, int64_t valid, int64_t K, int8_t* xq, float* xscale, uint32_t* quads,
                     float* scales, float* terms) {
  const int64_t num_blocks = K / 32;
  for (int64_t i = 0; i < kPanel; ++i) {
    int8_t* row = xq + i * K;
    float* row_scales = xscale + i * num_blocks;
    if (i < valid) {
      quantize_activations(x + i * K, 1, K, row, row_scales);
    } else {
      memset(row, 0, K);
      for (int64_t b = 0; b < num_blocks; ++b) row_scales[b] = 0.0f;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      int32_t total = 0;
      for (int j = 0; j < 32; ++j) total += row[32 * b + j];
      scales[b * kPanel + i] = row_scales[b];
      terms[b * kPanel + i] = IS_INT4 ? row_scales[b] * static_cast<float>(total) : static_cast<float>(-128 * total);
    }
  }
  // Eight words (32 columns) of eight rows at a time, transposed through registers.
  for (int64_t k = 0; k < K / 4; k += 8)
    for (int half = 0; half < 2; ++half) {
      __m256 r[kLanes];
      for (int i = 0; i < kLanes; ++i)
        r[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(xq + (half * kLanes + i) * K + 4 * k));
      transpose8(r);
      for (int j = 0; j < kLanes; ++j)
        _mm256_storeu_ps(reinterpret_cast<float*>(quads + (k + j) * kPanel + half * kLanes), r[j]);
    }
}

// pack_int8_panel for activations stored feature-major: column k of rows [0, valid) at x + k * ld (the rows
// consecutive), as the native decoder keeps the MLP's intermediate. Each lane is one activation row, and every value
// goes through the operations pack_int8_panel applies to it (the largest magnitude of its run of 32, that over 127,
// the value divided by it and rounded), so the panel is the same; no transposes: the words of four columns come
// from four vectors of rows.
template <bool IS_INT4>
void pack_int8_panel_t(const float* x, int64_t ld, int64_t valid, int64_t K, uint32_t* quads, float* scales,
                       float* terms) {
  const __mmask16 lanes = static_cast<__mmask16>(valid >= kPanel ? 0xFFFF : (1u << valid) - 1);
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i low_byte = _mm512_set1_epi32(0xFF);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512 v[32];
    __m512 largest = _mm512_setzero_ps();
    for (int k = 0; k < 32; ++k) {
      v[k] = _mm512_maskz_loadu_ps(lanes, x + (32 * b + k) * ld);
      largest = _mm512_max_ps(largest, _mm512_and_ps(v[k], magnitude));
    }
    const __m512 scale = _mm512_div_ps(largest, _mm512_set1_ps(127.0f));
    const __m512 divisor =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_EQ_OQ), scale, _mm512_set1_ps(1.0f));
    __m512i total = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      __m512i q[4];
      for (int c = 0; c < 4; ++c) {
        q[c] = _mm512_cvtps_epi32(_mm512_div_ps(v[4 * j + c], divisor));
        total = _mm512_add_epi32(total, q[c]);
      }
      // Lane i: row i's four rounded values as the bytes of one word, the first column lowest.
      __m512i word = _mm512_slli_epi32(q[3], 24);
      for (int c = 0; c < 3; ++c)
        word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(q[c], low_byte), 8 * c));
      _mm512_storeu_si512(quads + (8 * b + j) * kPanel, word);
    }
    _mm512_storeu_ps(scales + b * kPanel, scale);
    const __m512i offset_total = _mm512_mullo_epi32(total, _mm512_set1_epi32(-128));
    _mm512_storeu_ps(terms + b * kPanel,
                     IS_INT4 ? _mm512_mul_ps(scale, _mm512_cvtepi32_ps(total)) : _mm512_cvtepi32_ps(offset_total));
  }
}

// v holds at least n elements (its contents are scratch).
template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(n);
}

// Int8 weights with one scale per output channel (group size K): int8_tile's PER_ROW epilogue.
template <bool IS_INT4>
constexpr bool one_scale_per_row(int64_t K, int64_t G) {
  return !IS_INT4 && G == K;
}

// Per block of 32 columns of weight rows [n0, n0 + count), the scale and (int4) the min, as floats [count, K/32];
// int8 weights with one scale per row: that scale, [count].
// With groups of 32 the half-precision scales and mins of a row are contiguous and convert 16 at a time.
template <bool IS_INT4>
void block_terms(const uint16_t* scales, const uint16_t* mins, int64_t K, int64_t G, int64_t n0, int64_t count,
                 float* out_scales, float* out_mins) {
  const int64_t num_blocks = K / 32, num_groups = K / G;
  if (one_scale_per_row<IS_INT4>(K, G)) {  // int8_tile's PER_ROW reads out_scales [count]
    for (int64_t r = 0; r < count; ++r) out_scales[r] = half_to_float(scales[n0 + r]);
    return;
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t n = n0 + r;
    float* row_scales = out_scales + r * num_blocks;
    float* row_mins = out_mins + r * num_blocks;
    if (G == 32) {
      for (int64_t b = 0; b < num_blocks; b += 16) {
        const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, num_blocks - b)) - 1);
        const __m512 s = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, scales + n * num_groups + b));
        _mm512_mask_storeu_ps(row_scales + b, mask, s);
        if (IS_INT4)
          _mm512_mask_storeu_ps(row_mins + b, mask,
                                _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + n * num_groups + b)));
      }
    } else {
      for (int64_t b = 0; b < num_blocks; ++b) {
        row_scales[b] = half_to_float(scales[n * num_groups + b * 32 / G]);
        if (IS_INT4) row_mins[b] = half_to_float(mins[n * num_groups + b * 32 / G]);
      }
    }
  }
}

// Weight row n as the int8 tile reads it: its K columns as unsigned bytes in order (int4: the 0..15 codes, int5 the
// 0..31 codes with their high bits qh; int8: q + 128), block b (32 columns) at out + 32 * kRows * b, so that the
// tile's rows of a block sit together at fixed offsets.
template <bool IS_INT4>
inline void tile_row(const uint8_t* qweight, const uint32_t* qh, int64_t K, int64_t n, uint8_t* out) {
  int64_t b = 0;
  if (IS_INT4) {
    // Four blocks at a time: their 64 bytes give the four blocks' low nibbles in the 128-bit lanes of lo and their
    // high ones in hi's, and block i's 32 bytes are lane i of lo then lane i of hi.
    const __m512i nibble = _mm512_set1_epi8(0x0F);
    const __m512i blocks01 = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i blocks23 = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    for (; b + 4 <= K / 32; b += 4, out += 4 * 32 * kRows) {
      const __m512i raw = _mm512_loadu_si512(qweight + n * (K / 2) + 16 * b);
      const __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      __m512i first = _mm512_permutex2var_epi64(lo, blocks01, hi);
      __m512i second = _mm512_permutex2var_epi64(lo, blocks23, hi);
      if (qh != nullptr) {
        // first holds blocks b and b + 1 in column order, second b + 2 and b + 3: each one high-bit word a block.
        const uint32_t* words = qh + n * (K / 32) + b;
        const __m512i fifth = _mm512_set1_epi8(0x10);
        first = _mm512_or_si512(first, _mm512_maskz_mov_epi8(words[0] | uint64_t{words[1]} << 32, fifth));
        second = _mm512_or_si512(second, _mm512_maskz_mov_epi8(words[2] | uint64_t{words[3]} << 32, fifth));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(first));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 32 * kRows), _mm512_extracti64x4_epi64(first, 1));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * kRows), _mm512_castsi512_si256(second));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 96 * kRows), _mm512_extracti64x4_epi64(second, 1));
    }
  }
  for (; b < K / 32; ++b, out += 32 * kRows) {
    if (IS_INT4) {
      const __m128i nibble = _mm_set1_epi8(0x0F);
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qweight + n * (K / 2) + 16 * b));
      __m128i low = _mm_and_si128(raw, nibble), high = _mm_and_si128(_mm_srli_epi16(raw, 4), nibble);
      if (qh != nullptr) {
        const uint32_t word = qh[n * (K / 32) + b];
        low = _mm_or_si128(low, _mm_maskz_mov_epi8(static_cast<__mmask16>(word), _mm_set1_epi8(0x10)));
        high = _mm_or_si128(high, _mm_maskz_mov_epi8(static_cast<__mmask16>(word >> 16), _mm_set1_epi8(0x10)));
      }
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), low);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), high);
    } else {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qweight + n * K + 32 * b));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_xor_si256(q, _mm256_set1_epi8(-128)));
    }
  }
}

// A later tile's weight bytes, for int8_tile to fetch into L2 a few 64-byte lines per block of 32 columns while it
// computes: 'lines' lines from each non-null start (the second: a fused SwiGLU's ups).
struct TilePrefetch {
  const char* starts[2] = {nullptr, nullptr};
  int64_t lines = 0;
};

// RT weight rows (w: tile_row's layout; scales and mins [RT, K/32]) × one panel's 16 activation rows, the first
// `valid` of them real, into y[m0 + i, n0 + r]. Each weight word's address is the block's base plus a constant:
// with rows K bytes apart instead, the compiler kept one pointer per (row, column) and spilled them, and the tile
// ran at 1.3 instead of 2.5 billion dpbusd per second.
// PER_ROW (int8 weights with one scale per output channel, w_scales [RT, 1]): a block's sums are scaled by the
// activation scale alone and the row's weight scale multiplies the total once, so each block and row costs one FMA
// instead of a multiply and an FMA, and the loop runs closer to dpbusd's rate.
template <bool IS_INT4, int RT, bool PER_ROW = false>
void int8_tile(const uint8_t* w, const float* w_scales, const float* w_mins, int64_t K, const uint32_t* quads,
               const float* x_scales, const float* x_terms, int valid, float* y, int64_t N, int64_t m0, int64_t n0,
               int64_t y_ld, const TilePrefetch& prefetch, bool gelu = false) {
  static_assert(!(IS_INT4 && PER_ROW), "int4 weights keep a scale and a min per group");
  const int64_t num_blocks = K / 32;
  const int64_t lines_per_block = (prefetch.lines + num_blocks - 1) / num_blocks;
  const uint32_t* w_words = reinterpret_cast<const uint32_t*>(w);
  __m512 acc[RT];
  for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    __m512i sums[RT];
    const __m512i start = IS_INT4 ? _mm512_setzero_si512() : _mm512_cvtps_epi32(_mm512_loadu_ps(x_terms + b * kPanel));
    for (int r = 0; r < RT; ++r) sums[r] = start;
    const uint32_t* block_words = w_words + 8 * kRows * b;
    const uint32_t* block_quads = quads + 8 * kPanel * b;
    for (int64_t l = b * lines_per_block; l < std::min(prefetch.lines, (b + 1) * lines_per_block); ++l)
      for (const char* start : prefetch.starts)
        if (start != nullptr) _mm_prefetch(start + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i x = _mm512_loadu_si512(block_quads + j * kPanel);
      for (int r = 0; r < RT; ++r) {
        const __m512i weights = _mm512_set1_epi32(static_cast<int>(block_words[8 * r + j]));
        sums[r] = _mm512_dpbusd_epi32(sums[r], weights, x);
      }
    }
    const __m512 x_scale = _mm512_loadu_ps(x_scales + b * kPanel);
    const __m512 x_sum = IS_INT4 ? _mm512_loadu_ps(x_terms + b * kPanel) : _mm512_setzero_ps();
    for (int r = 0; r < RT; ++r) {
      const __m512 exact = _mm512_cvtepi32_ps(sums[r]);
      if (PER_ROW) {
        acc[r] = _mm512_fmadd_ps(exact, x_scale, acc[r]);
        continue;
      }
      acc[r] = _mm512_fmadd_ps(exact, _mm512_mul_ps(_mm512_set1_ps(w_scales[r * num_blocks + b]), x_scale), acc[r]);
      if (IS_INT4) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w_mins[r * num_blocks + b]), x_sum, acc[r]);
    }
  }
  if (PER_ROW)
    for (int r = 0; r < RT; ++r) acc[r] = _mm512_mul_ps(acc[r], _mm512_set1_ps(w_scales[r]));
  // SwiGLU (GeGLU if gelu) into y feature-major ([N, y_ld]): rows r < RT / 2 are gates and the rest their ups, and
  // row n0 + r of y (activation rows m0.. of it) is silu(gate r) * up r (gelu_tanh(gate r) * up r).
  if (y_ld > 0) {
    const __mmask16 lanes = static_cast<__mmask16>(valid >= kPanel ? 0xFFFF : (1u << valid) - 1);
    for (int r = 0; r < RT / 2; ++r)
      _mm512_mask_storeu_ps(y + (n0 + r) * y_ld + m0, lanes,
                            gelu ? tokenriver::gelu_tanh_times(acc[r], acc[r + RT / 2])
                                 : tokenriver::silu_times(acc[r], acc[r + RT / 2]));
    return;
  }
  // Out through registers: the 8 × 16 matrix of weight rows (zero past RT) by activation rows, transposed as two
  // 8 × 8 halves, gives each activation row its RT sums in one vector, stored under a mask, instead of a scalar
  // store per sum through a stack copy.
  const __mmask8 columns = static_cast<__mmask8>((1u << RT) - 1);
  for (int half = 0; half < 2; ++half) {
    __m256 rows[kLanes];
    // The extract's lane index must be an immediate: spelled out, not `half`, which is one only once the loop is
    // unrolled (a change elsewhere in the tile once stopped GCC from unrolling it and the build failed).
    for (int r = 0; r < kLanes; ++r)
      rows[r] = r >= RT ? _mm256_setzero_ps()
                : half == 0 ? _mm512_extractf32x8_ps(acc[r], 0) : _mm512_extractf32x8_ps(acc[r], 1);
    transpose8(rows);
    for (int i = 0; i < kLanes && half * kLanes + i < valid; ++i)
      _mm256_mask_storeu_ps(y + (m0 + half * kLanes + i) * N + n0, columns, rows[i]);
  }
}

// x_ld: 0 for x [M, K] row after row; else x is stored feature-major, column k at x + k * x_ld, the rows
// consecutive. The same values either way.
// swiglu_up > 0: weight rows [0, N) are an MLP's gates and [swiglu_up, swiglu_up + N) their ups, and y [N, y_ld]
// (feature-major) gets silu(gate) * up. A tile then takes three gates and their three ups, and SwiGLU runs on its
// sums in registers: no [2N, M] product is written and read back by a pass of its own. The values are those of
// the product row after row and ops.cpp's SwiGLU.
template <bool IS_INT4>
void gemm_int8(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
               const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads,
               int64_t x_ld = 0, int64_t swiglu_up = 0, bool gelu = false) {
  const int64_t y_ld = swiglu_up > 0 ? M : 0;
  const int64_t num_blocks = K / 32, panel_words = K / 4 * kPanel, panel_blocks = num_blocks * kPanel;
  const int64_t chunk = std::max<int64_t>(kPanel, kChunkBytes / K / kPanel * kPanel);
  const int64_t num_panels = (std::min(chunk, M) + kPanel - 1) / kPanel;
  // The packed panels live in scratch of the calling thread, kept between calls: a fresh buffer per call came back
  // from the system each time and cost a page fault per 4 KB written. 64-byte aligned, so that no panel load
  // spans two cache lines. (thread_local: the caller's buffer, reached by pointer inside the parallel region,
  // where the name would mean each worker's own.)
  thread_local std::vector<uint32_t> scratch;
  const int64_t scratch_words = num_panels * (panel_words + 2 * panel_blocks) + 16;
  if (scratch.size() < static_cast<size_t>(scratch_words)) scratch.resize(scratch_words);
  uint32_t* const quads =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* const x_scales = reinterpret_cast<float*>(quads + num_panels * panel_words);
  float* const x_terms = x_scales + num_panels * panel_blocks;
  // Rows of y per tile.
  const int64_t tile_outputs = swiglu_up > 0 ? kRows / 2 : kRows;
  const bool per_row = one_scale_per_row<IS_INT4>(K, G);
  const int64_t row_terms = per_row ? 1 : num_blocks;  // block_terms' floats per weight row
  const int64_t num_tiles = (N + tile_outputs - 1) / tile_outputs;
  // One parallel region for packing and products (one fork and join per product, not two per chunk). Tiles are
  // handed out in runs that shrink as the product nears its end (guided, down to 2 tiles): each thread mostly
  // takes the tiles after its last one, as the weight prefetch below assumes, and neither thread waits long at the
  // end for the other's last run.
#pragma omp parallel num_threads(num_threads)
  {
    // Each thread's scratch, kept between calls (thread_local: here, each worker's own): allocated and zero-filled
    // per call (~40 KB per thread and product, 120 products a decode step), its memset showed up in profiles.
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xscale, w_scales, w_mins;
    thread_local std::vector<uint8_t> w;
    grow(xq, kPanel * K);
    grow(xscale, kPanel * num_blocks);
    grow(w, kRows * K);
    grow(w_scales, kRows * num_blocks);
    grow(w_mins, kRows * num_blocks);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < (rows + kPanel - 1) / kPanel; ++p) {
        const int64_t valid = std::min<int64_t>(kPanel, rows - p * kPanel);
        if (x_ld > 0)
          pack_int8_panel_t<IS_INT4>(x + m0 + p * kPanel, x_ld, valid, K, quads + p * panel_words,
                                     x_scales + p * panel_blocks, x_terms + p * panel_blocks);
        else
          pack_int8_panel<IS_INT4>(x + (m0 + p * kPanel) * K, valid, K, xq.data(), xscale.data(),
                                   quads + p * panel_words, x_scales + p * panel_blocks, x_terms + p * panel_blocks);
      }
      float* y_chunk = y_ld > 0 ? y + m0 : y + m0 * N;
#pragma omp for schedule(guided, 2)
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n0 = t * tile_outputs;
        const int64_t count = std::min<int64_t>(tile_outputs, N - n0);
        // The weights of the tile after next, into L2 while this one computes (the products of a decode step read
        // them from memory): their bytes spread over the first panel's blocks (int8_tile), their scales now.
        // Issued all at once, the bytes (54 lines a tile of K = 576, 144 of K = 1536) stalled the core until
        // miss buffers freed up (benchmarks/HISTORY.md).
        TilePrefetch prefetch;
        if (n0 + 2 * tile_outputs < N) {
          const int64_t later = n0 + 2 * tile_outputs, later_rows = std::min<int64_t>(tile_outputs, N - later);
          const int64_t row_bytes = IS_INT4 ? K / 2 : K;
          prefetch.starts[0] = reinterpret_cast<const char*>(qweight + later * row_bytes);
          if (swiglu_up > 0)
            prefetch.starts[1] = reinterpret_cast<const char*>(qweight + (swiglu_up + later) * row_bytes);
          prefetch.lines = (later_rows * row_bytes + 63) / 64;
          prefetch_group_terms<IS_INT4>(scales, mins, K, G, later, later_rows);
          if (swiglu_up > 0) prefetch_group_terms<IS_INT4>(scales, mins, K, G, swiglu_up + later, later_rows);
        }
        block_terms<IS_INT4>(scales, mins, K, G, n0, count, w_scales.data(), w_mins.data());
        for (int64_t r = 0; r < count; ++r) tile_row<IS_INT4>(qweight, qh, K, n0 + r, w.data() + 32 * r);
        if (swiglu_up > 0) {
          block_terms<IS_INT4>(scales, mins, K, G, swiglu_up + n0, count, w_scales.data() + count * row_terms,
                               w_mins.data() + count * row_terms);
          for (int64_t r = 0; r < count; ++r)
            tile_row<IS_INT4>(qweight, qh, K, swiglu_up + n0 + r, w.data() + 32 * (count + r));
        }
        const int64_t tile_rows = swiglu_up > 0 ? 2 * count : count;
        const auto run = [&](auto rows_per_tile) {
          constexpr int RT = decltype(rows_per_tile)::value;
          for (int64_t m = 0; m < rows; m += kPanel) {
            const int64_t p = m / kPanel;
            const auto tile = [&](auto per_row_tile) {
              int8_tile<IS_INT4, RT, decltype(per_row_tile)::value>(
                  w.data(), w_scales.data(), w_mins.data(), K, quads + p * panel_words, x_scales + p * panel_blocks,
                  x_terms + p * panel_blocks, static_cast<int>(std::min<int64_t>(kPanel, rows - m)), y_chunk, N, m,
                  n0, y_ld, p == 0 ? prefetch : TilePrefetch{}, gelu);
            };
            // per_row is never true for int4; the constant keeps the int4 build from instantiating PER_ROW.
            if (per_row)
              tile(std::integral_constant<bool, !IS_INT4>{});
            else
              tile(std::false_type{});
          }
        };
        switch (tile_rows) {
          case 6: run(std::integral_constant<int, 6>{}); break;
          case 5: run(std::integral_constant<int, 5>{}); break;
          case 4: run(std::integral_constant<int, 4>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          default: run(std::integral_constant<int, 1>{}); break;
        }
      }
    }
  }
}

#endif

template <bool IS_INT4>
void dequantize(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh, int64_t N,
                int64_t K,
                int64_t G, float* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) decode_row<IS_INT4>(qweight, scales, mins, qh, K, G, n, out + n * K);
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ dequantized weight [N, K]ᵀ; arguments in the order of gemv.cpp's int4_linear_f32.
void int4_gemm_f32(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                   int64_t N, int64_t K,
                   int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_gemm_f32(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                   const float* x, int64_t M, float* y, int num_threads) {
  gemm<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size, y,
              num_threads);
}

// Float32 copy of the weights, [N, K], decoded exactly as the products decode them.
void int4_dequantize(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                     int64_t N, int64_t K,
                     int64_t group_size, float* out, int num_threads) {
  dequantize<true>(qweight, scales, mins, qh, N, K, group_size, out, num_threads);
}

void int8_dequantize(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     float* out, int num_threads) {
  dequantize<false>(reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, K, group_size, out,
                    num_threads);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The same products with the activations rounded to int8 per 32 columns (models/quant.py's rounded mode), where the
// CPU has AVX512-VNNI; K a multiple of 32, groups a multiple of 32. Present only then: gemm_int8x_supported says.
void int4_gemm_int8x(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                     int64_t N, int64_t K,
                     int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_gemm_int8x(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size, y,
                   num_threads);
}

// int4_gemm_int8x / int8_gemm_int8x with x stored feature-major ([K, x_ld]): the native decoder's MLP keeps its
// intermediate so, and the same values come out.
void int4_gemm_int8x_strided(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                             int64_t N,
                             int64_t K, int64_t group_size, const float* x, int64_t M, int64_t x_ld, float* y,
                             int num_threads) {
  gemm_int8<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads, x_ld);
}

void int8_gemm_int8x_strided(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                             const float* x, int64_t M, int64_t x_ld, float* y, int num_threads) {
  gemm_int8<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size, y,
                   num_threads, x_ld);
}

// y [I, M] (feature-major) = silu(x Wᵀ [:, :I]) * x Wᵀ [:, I:2I] for a fused gate/up weight [2I, K]: the native
// decoder's MLP intermediate, the values of int4_gemm_int8x and ops.cpp's SwiGLU.
void int4_gemm_int8x_swiglu(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                            int64_t I,
                            int64_t K, int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<true>(x, M, K, qweight, scales, mins, qh, I, group_size, y, num_threads, 0, I);
}

void int8_gemm_int8x_swiglu(const int8_t* qweight, const uint16_t* scales, int64_t I, int64_t K, int64_t group_size,
                            const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, I, group_size, y,
                   num_threads, 0, I);
}

// The same with GeGLU, gelu_tanh(gate) * up (Gemma's MLP): ops.cpp's GeGLU on int4_gemm_int8x's values.
void int4_gemm_int8x_geglu(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                           int64_t I,
                           int64_t K, int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<true>(x, M, K, qweight, scales, mins, qh, I, group_size, y, num_threads, 0, I, true);
}

void int8_gemm_int8x_geglu(const int8_t* qweight, const uint16_t* scales, int64_t I, int64_t K, int64_t group_size,
                           const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, I, group_size, y,
                   num_threads, 0, I, true);
}

int gemm_int8x_supported() { return 1; }
#else
int gemm_int8x_supported() { return 0; }
#endif

}  // extern "C"
