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

#include "kquant.h"
#include "tiles.h"
#include "vec.h"

namespace {

using tokenriver::decode_int4;
using tokenriver::decode_int8;
using tokenriver::kTileRows;
using tokenriver::TiledWeight;
using tokenriver::KQuantWeight;
using tokenriver::FloatLanes;
using tokenriver::fma_lanes;
using tokenriver::fold_lanes;
using tokenriver::kFloatLanes;
using tokenriver::load_lanes;
using tokenriver::zero_lanes;
using tokenriver::half_to_float;
using tokenriver::quantize_activations;
using tokenriver::transpose8;

// Float products: decoded weight rows per tile (four rows × four activation rows of accumulators).
constexpr int kFloatRows = 4;
// Int8 products: weight rows per tile, activation rows per vector, and per packed panel (two vectors).
constexpr int kRows = 8;
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

// Row n of a tiled weight (tiles.h), columns [0, K), decoded to float32: the values decode_row gives the same row
// stored row after row.
template <bool IS_INT4>
inline void decode_tiled_row(const TiledWeight& w, int64_t n, float* out) {
  for (int64_t b = 0; b < w.blocks(); ++b) {
    alignas(32) uint8_t bytes[32];
    w.row_block(n, b, bytes);
    const __m256 scale = _mm256_set1_ps(w.row_scale(n, b));
    __m256 codes[4];
    if (IS_INT4) {
      const uint32_t fifth = w.fifth != nullptr ? w.row_fifth(n, b) : 0;
      decode_int4(bytes, codes, w.fifth != nullptr ? &fifth : nullptr);
      const __m256 min = _mm256_set1_ps(w.row_min(n, b));
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 32 * b + 8 * i, _mm256_fmadd_ps(scale, codes[i], min));
    } else {
      decode_int8(reinterpret_cast<const int8_t*>(bytes), codes);
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 32 * b + 8 * i, _mm256_mul_ps(scale, codes[i]));
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
void gemm(const float* x, int64_t M, const TiledWeight& weight, float* y, int num_threads) {
  const int64_t K = weight.K, N = weight.N;
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
        for (int64_t r = 0; r < count; ++r) decode_tiled_row<IS_INT4>(weight, n0 + r, w.data() + r * K);
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

// Activation rows [0, valid) of x (K columns) rounded per run of 32 columns (run: a multiple of 32) and packed into
// one panel, with each run's scales ([K/run, 16]) and each block's terms; rows past valid are zero. xq [16, K] and
// xscale [16, K/32] are scratch.
template <bool IS_INT4>
void pack_int8_panel(const float* x, int64_t valid, int64_t K, int8_t* xq, float* xscale, uint32_t* quads,
                     float* scales, float* terms, int64_t run = 32) {
  const int64_t num_blocks = K / 32, per_run = run / 32;
  for (int64_t i = 0; i < kPanel; ++i) {
    int8_t* row = xq + i * K;
    float* row_scales = xscale + i * num_blocks;
    if (i < valid) {
      quantize_activations(x + i * K, 1, K, row, row_scales, run);
    } else {
      memset(row, 0, K);
      for (int64_t b = 0; b < num_blocks; ++b) row_scales[b] = 0.0f;
    }
    for (int64_t b = 0; b < num_blocks; ++b) {
      int32_t total = 0;
      for (int j = 0; j < 32; ++j) total += row[32 * b + j];
      const float scale = row_scales[b / per_run];
      if (b % per_run == 0) scales[b / per_run * kPanel + i] = scale;
      terms[b * kPanel + i] = IS_INT4 ? scale * static_cast<float>(total) : static_cast<float>(-128 * total);
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
                       float* terms, int64_t run = 32) {
  const __mmask16 lanes = static_cast<__mmask16>(valid >= kPanel ? 0xFFFF : (1u << valid) - 1);
  const __m512 magnitude = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
  const __m512i low_byte = _mm512_set1_epi32(0xFF);
  for (int64_t r = 0; r < K / run; ++r) {
    __m512 largest = _mm512_setzero_ps();
    for (int64_t k = run * r; k < run * (r + 1); ++k)
      largest = _mm512_max_ps(largest, _mm512_and_ps(_mm512_maskz_loadu_ps(lanes, x + k * ld), magnitude));
    const __m512 scale = _mm512_div_ps(largest, _mm512_set1_ps(127.0f));
    const __m512 divisor =
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(scale, _mm512_setzero_ps(), _CMP_EQ_OQ), scale, _mm512_set1_ps(1.0f));
    _mm512_storeu_ps(scales + r * kPanel, scale);
    for (int64_t b = run / 32 * r; b < run / 32 * (r + 1); ++b) {
      __m512i total = _mm512_setzero_si512();
      for (int j = 0; j < 8; ++j) {
        __m512i q[4];
        for (int c = 0; c < 4; ++c) {
          const __m512 v = _mm512_maskz_loadu_ps(lanes, x + (32 * b + 4 * j + c) * ld);
          q[c] = _mm512_cvtps_epi32(_mm512_div_ps(v, divisor));
          total = _mm512_add_epi32(total, q[c]);
        }
        // Lane i: row i's four rounded values as the bytes of one word, the first column lowest.
        __m512i word = _mm512_slli_epi32(q[3], 24);
        for (int c = 0; c < 3; ++c)
          word = _mm512_or_si512(word, _mm512_slli_epi32(_mm512_and_si512(q[c], low_byte), 8 * c));
        _mm512_storeu_si512(quads + (8 * b + j) * kPanel, word);
      }
      const __m512i offset_total = _mm512_mullo_epi32(total, _mm512_set1_epi32(-128));
      _mm512_storeu_ps(terms + b * kPanel,
                       IS_INT4 ? _mm512_mul_ps(scale, _mm512_cvtepi32_ps(total)) : _mm512_cvtepi32_ps(offset_total));
    }
  }
}

// v holds at least n elements (its contents are scratch).
template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(n);
}

// A row tile's codes and terms as int8_tile reads them ("staged"), for S rows side by side: 16, or 32 for a fused
// gate/up weight (the tile's 16 gates, then the tile of their 16 ups). Per block b, words [8][S]: word j of row r
// holds the unsigned codes of columns 4j .. 4j + 3 (int4: 0..15, int5 with their fifth bits 0..31; int8: q + 128),
// a row tile's word taken whole for 16 rows at a time; scales and mins [K/32][S] as floats (for one scale per row
// the same scales at every block).
// The weight is read through a local copy: the staged words are stores that the compiler must otherwise assume may
// change its fields, and it re-derived every address from them (a division among them) at every block.
template <bool IS_INT4, int S>
inline void stage_tile(const TiledWeight& weight, int64_t t, int row0, uint32_t* words, float* scales, float* mins) {
  const TiledWeight w = weight;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const uint8_t* block = w.block(t, b);
    uint32_t* out = words + 8 * S * b + row0;
    if (IS_INT4) {
      const uint64_t* masks = w.fifth != nullptr ? w.block_fifth(t, b) : nullptr;
      for (int j = 0; j < 4; ++j) {
        const __m512i raw = _mm512_loadu_si512(block + 64 * j);
        __m512i low = _mm512_and_si512(raw, nibble), high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
        if (masks != nullptr) {
          low = _mm512_mask_add_epi8(low, masks[j], low, _mm512_set1_epi8(16));
          high = _mm512_mask_add_epi8(high, masks[4 + j], high, _mm512_set1_epi8(16));
        }
        _mm512_storeu_si512(out + S * j, low);
        _mm512_storeu_si512(out + S * (4 + j), high);
      }
    } else {
      for (int j = 0; j < 8; ++j)
        _mm512_storeu_si512(out + S * j, _mm512_xor_si512(_mm512_loadu_si512(block + 64 * j), _mm512_set1_epi8(-128)));
    }
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block_scales(t, b))));
    _mm512_storeu_ps(scales + S * b + row0, scale);
    if (IS_INT4)
      _mm512_storeu_ps(mins + S * b + row0,
                       w.mins == nullptr
                           ? _mm512_mul_ps(scale, _mm512_set1_ps(-w.centre()))
                           : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.block_mins(t, b)))));
  }
}

// A later tile's weight bytes, for int8_tile to fetch into L2 a few 64-byte lines per block of 32 columns while it
// computes: 'lines' lines from each non-null start (the second: a fused SwiGLU's ups).
struct TilePrefetch {
  const char* starts[2] = {nullptr, nullptr};
  int64_t lines = 0;
};

// RT weight rows of a staged tile (stage_tile: S rows side by side, these from row0; with FUSED the first RT / 2
// are gates and the rest their ups, S / 2 rows further) × one panel's 16 activation rows, the first `valid` of them
// real, into y[m0 + i, n0 + r] for the first real_rows rows (the rest: a last tile's zero rows). Each weight
// word's address is the block's base plus a constant: with rows K bytes apart instead, the compiler kept one
// pointer per (row, column) and spilled them, and the tile ran at 1.3 instead of 2.5 billion dpbusd per second.
template <bool IS_INT4, int RT, int S, bool FUSED>
void int8_tile(const uint32_t* words, const float* w_scales, const float* w_mins, int row0, int64_t K,
               const uint32_t* quads, const float* x_scales, const float* x_terms, int valid, float* y, int64_t N,
               int64_t m0, int64_t n0, int64_t y_ld, int real_rows, const int64_t* chain_ends,
               const TilePrefetch& prefetch, bool gelu = false) {
  // Lane of weight row r in the staged tile.
  constexpr auto lane = [](int r) { return FUSED && r >= RT / 2 ? S / 2 + r - RT / 2 : r; };
  const int64_t num_blocks = K / 32;
  const int64_t lines_per_block = (prefetch.lines + num_blocks - 1) / num_blocks;
  words += row0;
  w_scales += row0;
  w_mins += row0;
  // acc: one sub-chain of the row (chain_ends, tiles.h; one chain where it is null), then the row's result: the
  // finished sub-chains wait in memory, added in order, so that the block loop holds only one chain in registers.
  __m512 acc[RT];
  alignas(64) float finished[RT][kPanel];
  for (int64_t c = 0, begin = 0, end; begin < num_blocks; begin = end, ++c) {
    end = chain_ends == nullptr ? num_blocks : chain_ends[c];
    for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = begin; b < end; ++b) {
      __m512i sums[RT];
      const __m512i start =
          IS_INT4 ? _mm512_setzero_si512() : _mm512_cvtps_epi32(_mm512_loadu_ps(x_terms + b * kPanel));
      for (int r = 0; r < RT; ++r) sums[r] = start;
      const uint32_t* block_words = words + 8 * S * b;
      const uint32_t* block_quads = quads + 8 * kPanel * b;
      for (int64_t l = b * lines_per_block; l < std::min(prefetch.lines, (b + 1) * lines_per_block); ++l)
        for (const char* start : prefetch.starts)
          if (start != nullptr) _mm_prefetch(start + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j) {
        const __m512i x = _mm512_loadu_si512(block_quads + j * kPanel);
        for (int r = 0; r < RT; ++r) {
          const __m512i weights = _mm512_set1_epi32(static_cast<int>(block_words[S * j + lane(r)]));
          sums[r] = _mm512_dpbusd_epi32(sums[r], weights, x);
        }
      }
      const __m512 x_scale = _mm512_loadu_ps(x_scales + b * kPanel);
      const __m512 x_sum = IS_INT4 ? _mm512_loadu_ps(x_terms + b * kPanel) : _mm512_setzero_ps();
      for (int r = 0; r < RT; ++r) {
        const __m512 exact = _mm512_cvtepi32_ps(sums[r]);
        acc[r] =
            _mm512_fmadd_ps(exact, _mm512_mul_ps(_mm512_set1_ps(w_scales[S * b + lane(r)]), x_scale), acc[r]);
        if (IS_INT4) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(w_mins[S * b + lane(r)]), x_sum, acc[r]);
      }
    }
    for (int r = 0; r < RT; ++r) {
      if (c > 0) acc[r] = _mm512_add_ps(_mm512_load_ps(finished[r]), acc[r]);
      if (end < num_blocks) _mm512_store_ps(finished[r], acc[r]);
    }
  }
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
  const __mmask8 columns = static_cast<__mmask8>((1u << std::min(RT, real_rows)) - 1);
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

// ---- K-quant weights (kquant.h) ---------------------------------------------------------------------------------
//
// A K-quant weight with scales per 32 and no centred rows (Q4_K, Q5_K) is, per block, an int4 weight whose scale
// d * sc and min -(dmin * m) are exact float32 values: staged so, gemm_int8's tiles run it as they run int4. One with
// scales per 16 or centred rows (Q6_K, or parts fused with it) runs kquant_int8_tile, which sums each half of a block
// apart. Every lane runs kquant.h's operations in kquant.cpp's order, so a row gets the GEMV's bits.

using tokenriver::kquant_add_plane;
using tokenriver::kquant_codes;
using tokenriver::kquant_halves;
using tokenriver::kquant_min_run;
using tokenriver::kquant_nibbles;
using tokenriver::kquant_scale_run;
using tokenriver::KQuantTerms;

// A Q4_K or Q5_K tile (NH high bits: 0 or 1) staged as stage_tile below, a super-block's record at a time: every
// field of a record lies at a constant offset from its start (kquant.h), so the fields' addresses are computed
// once per weight instead of per block and field; the codes are kquant_codes' for these layouts.
template <int S, int NH>
inline void stage_nibble_tile(const KQuantWeight& w, int64_t t, int row0, uint32_t* words, float* scales,
                              float* mins) {
  const int64_t high_at = w.high_at(), d_at = w.d_at();
  const uint8_t* record = w.super(t, 0);
  KQuantTerms terms;
  for (int64_t s = 0; s < w.K / 256; ++s, record += w.record) {
    const __m512 d = kquant_halves(reinterpret_cast<const uint16_t*>(record + d_at));
    const __m512 dmin = kquant_halves(reinterpret_cast<const uint16_t*>(record + d_at) + kTileRows);
    terms.read(w, record);
    for (int k = 0; k < 8; ++k) {
      const int64_t b = 8 * s + k;
      __m512i codes[8];
      kquant_nibbles(record + 256 * k, codes);
      if (NH == 1) kquant_add_plane<4>(record + high_at + 64 * k, codes);
      for (int c = 0; c < 8; ++c) _mm512_storeu_si512(words + 8 * S * b + row0 + S * c, codes[c]);
      _mm512_storeu_ps(scales + S * b + row0, kquant_scale_run(terms.scales(w, k, 0), d));
      _mm512_storeu_ps(mins + S * b + row0, kquant_min_run(terms.mins(w, k, 0), dmin));
    }
  }
}

// stage_tile for a K-quant weight with scales per 32 and mins, no centred rows (Q4_K, Q5_K): the int4 tiles'
// staging. Read through a local copy, as stage_tile above says why.
template <bool IS_INT4, int S>
inline void stage_tile(const KQuantWeight& weight, int64_t t, int row0, uint32_t* words, float* scales, float* mins) {
  static_assert(IS_INT4, "a K-quant weight stages as int4");
  const KQuantWeight w = weight;
  if (w.num_high == 0)
    stage_nibble_tile<S, 0>(w, t, row0, words, scales, mins);
  else
    stage_nibble_tile<S, 1>(w, t, row0, words, scales, mins);
}

// Tile t staged for kquant_int8_tile: words [K/32][8][16], scales [K/32][2][16] (each half's d * sc) and mins
// [K/32][2][16] (each half's -(dmin * m); the two equal where mins are per 32). Read as stage_tile above is.
void stage_kquant_tile(const KQuantWeight& weight, int64_t t, uint32_t* words, float* scales, float* mins) {
  const KQuantWeight w = weight;
  __m512 d = _mm512_setzero_ps(), dmin = _mm512_setzero_ps();
  KQuantTerms terms;
  for (int64_t b = 0; b < w.blocks(); ++b) {
    if (b % 8 == 0) {
      d = kquant_halves(w.block_d(t, b));
      dmin = w.has_mins ? kquant_halves(w.block_dmin(t, b)) : _mm512_setzero_ps();
      terms.read(w, w.super(t, b));
    }
    __m512i codes[8];
    kquant_codes(w, t, b, codes);
    for (int k = 0; k < 8; ++k) _mm512_storeu_si512(words + (8 * b + k) * kTileRows, codes[k]);
    for (int h = 0; h < 2; ++h) {
      _mm512_storeu_ps(scales + (2 * b + h) * kTileRows, kquant_scale_run(terms.scales(w, b, h), d));
      const __m512 min = w.has_mins ? kquant_min_run(terms.mins(w, b, h), dmin) : _mm512_setzero_ps();
      _mm512_storeu_ps(mins + (2 * b + h) * kTileRows, min);
    }
  }
}

// Which of a tile's rows are centred (kquant.h's offsets): every one of them (Q6_K, Q3_K), none (Q2_K), or some (a
// fused projection of parts of both kinds). A template argument, so that the first two take no choice per row and
// block.
enum class Centring { kAll, kNone, kSome };

// A panel's terms of each block's halves, the same for every weight row (gemm_kquant forms them once per
// panel): starts [K/32][2][16], minus the centre times the half's sum of rounded activations T_h (a centred row's
// integer sums start there: kquant.h's o * T, subtracted as integers, so the same values as after); half_terms
// [K/32][2][16], the activation scale times T_h (what a min per 16 multiplies).
struct HalfTerms {
  const int32_t* starts;
  const float* half_terms;
};

// Staged rows [first, first + RT) of a tile against one panel's 16 activation rows, into out [RT][16] (row r's sums
// for the panel's rows, a vector each): kquant.cpp's per-16 arithmetic, a lane per activation row.
template <int RT, Centring CENTRING>
void kquant_int8_tile(const KQuantWeight& w, const uint32_t* words, const float* scales, const float* mins,
                      uint16_t offsets, int first, const uint32_t* quads, const float* x_scales,
                      const float* x_terms, const HalfTerms& halves, float (*out)[kPanel],
                      const TilePrefetch& prefetch) {
  const int64_t num_blocks = w.blocks();
  const int64_t lines_per_block = (prefetch.lines + num_blocks - 1) / num_blocks;
  const bool has_mins = w.has_mins, min16 = w.has_mins && w.min_group == 16;
  bool centred[RT];
  for (int r = 0; r < RT; ++r)
    centred[r] = CENTRING == Centring::kAll || (CENTRING == Centring::kSome && ((offsets >> (first + r)) & 1));
  __m512 total[RT];
  for (int64_t c = 0, begin = 0, end; begin < num_blocks; begin = end, ++c) {
    end = w.chain_end(c);
    __m512 acc[RT];
    for (int r = 0; r < RT; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t b = begin; b < end; ++b) {
      const __m512i zero = _mm512_setzero_si512();
      const __m512i start_lo = CENTRING == Centring::kNone ? zero : _mm512_loadu_si512(halves.starts + 2 * b * kPanel);
      const __m512i start_hi =
          CENTRING == Centring::kNone ? zero : _mm512_loadu_si512(halves.starts + (2 * b + 1) * kPanel);
      __m512i lo[RT], hi[RT];
      for (int r = 0; r < RT; ++r) {
        lo[r] = centred[r] ? start_lo : zero;
        hi[r] = centred[r] ? start_hi : zero;
      }
      const uint32_t* block_words = words + 8 * kTileRows * b + first;
      const uint32_t* block_quads = quads + 8 * kPanel * b;
      for (int64_t l = b * lines_per_block; l < std::min(prefetch.lines, (b + 1) * lines_per_block); ++l)
        _mm_prefetch(prefetch.starts[0] + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const __m512i x_lo = _mm512_loadu_si512(block_quads + j * kPanel);
        const __m512i x_hi = _mm512_loadu_si512(block_quads + (4 + j) * kPanel);
        for (int r = 0; r < RT; ++r) {
          lo[r] = _mm512_dpbusd_epi32(lo[r], _mm512_set1_epi32(static_cast<int>(block_words[kTileRows * j + r])), x_lo);
          hi[r] = _mm512_dpbusd_epi32(hi[r], _mm512_set1_epi32(static_cast<int>(block_words[kTileRows * (4 + j) + r])),
                                      x_hi);
        }
      }
      const __m512 xs = _mm512_loadu_ps(x_scales + b * kPanel);
      const __m512 x_sum = _mm512_loadu_ps(x_terms + b * kPanel);
      const __m512 x_min_lo = min16 ? _mm512_loadu_ps(halves.half_terms + 2 * b * kPanel) : x_sum;
      const __m512 x_min_hi = min16 ? _mm512_loadu_ps(halves.half_terms + (2 * b + 1) * kPanel) : x_sum;
      for (int r = 0; r < RT; ++r) {
        const int row = first + r;
        const __m512 scale_lo = _mm512_set1_ps(scales[2 * b * kTileRows + row]);
        const __m512 scale_hi = _mm512_set1_ps(scales[(2 * b + 1) * kTileRows + row]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo[r]), _mm512_mul_ps(scale_lo, xs), acc[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi[r]), _mm512_mul_ps(scale_hi, xs), acc[r]);
        if (min16) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mins[2 * b * kTileRows + row]), x_min_lo, acc[r]);
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mins[(2 * b + 1) * kTileRows + row]), x_min_hi, acc[r]);
        } else if (has_mins) {
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mins[2 * b * kTileRows + row]), x_sum, acc[r]);
        }
      }
    }
    for (int r = 0; r < RT; ++r) total[r] = c == 0 ? acc[r] : _mm512_add_ps(total[r], acc[r]);
  }
  for (int r = 0; r < RT; ++r) _mm512_store_ps(out[r], total[r]);
}

// A K-quant tile staged for kquant_int8_tile (stage_kquant_tile), with its rows' centring (kquant.h's offsets).
struct StagedKTile {
  std::vector<uint32_t> words;
  std::vector<float> scales, mins;
  uint16_t offsets = 0;

  void stage(const KQuantWeight& w, int64_t t) {
    grow(words, kTileRows * w.K / 4);
    grow(scales, 2 * kTileRows * w.blocks());
    grow(mins, 2 * kTileRows * w.blocks());
    stage_kquant_tile(w, t, words.data(), scales.data(), mins.data());
    offsets = w.offsets(t);
  }
};

// One panel as kquant_int8_tile reads it: its packed words, scales and block terms, and its HalfTerms.
struct HalvesPanel {
  const uint32_t* quads;
  const float* x_scales;
  const float* x_terms;
  HalfTerms halves;
};

// Rows [first, first + kRows) of a staged tile against one panel, into out: kquant_int8_tile for the tile's
// centring.
void kquant_panel_rows(const KQuantWeight& w, const StagedKTile& tile, int first, const HalvesPanel& panel,
                       float (*out)[kPanel], const TilePrefetch& prefetch) {
  const auto run = [&](auto centring) {
    kquant_int8_tile<kRows, decltype(centring)::value>(w, tile.words.data(), tile.scales.data(), tile.mins.data(),
                                                       tile.offsets, first, panel.quads, panel.x_scales,
                                                       panel.x_terms, panel.halves, out, prefetch);
  };
  if (tile.offsets == 0xFFFF)
    run(std::integral_constant<Centring, Centring::kAll>{});
  else if (tile.offsets == 0)
    run(std::integral_constant<Centring, Centring::kNone>{});
  else
    run(std::integral_constant<Centring, Centring::kSome>{});
}

// ---- 2-bit codes (Q2_K, Q3_K): one integer sum per super-block -------------------------------------------------
//
// A weight of 2-bit codes rounds its activations per super-block (kquant.h), so a row's super-block sum S is one
// exact integer: each code's value (q - o) times its half's scale, times the rounded activation. Staged, each code
// becomes that product plus 127, an unsigned byte (Q3_K's (q - 4) sc lies in -124..128, Q2_K's q sc in 0..45;
// models/kquant.py refuses fields outside them), so dpbusd sums S + 127 T at once, from the panel's -127 T: no
// conversion, product or FMA per block. The mins' sum M = Σ m_h T_h takes eight dpwssd a super-block over the
// panel's half sums T_h, two to a word. Then per super-block the GEMV's two FMAs.

// A panel's terms for crumb_tile, the same for every weight row, per super-block s: starts [K/256][16], -127 T_s,
// and t_pairs [K/256][8][16], the half sums T_h of block 8 s + i two to a word (T_2i | T_2i+1 << 16, int16 each:
// |T_h| <= 16 * 127).
struct CrumbPanel {
  const uint32_t* quads;
  const float* x_scales;  // [K/256][16]
  const int32_t* starts;
  const uint32_t* t_pairs;
};

// Tile t staged for crumb_tile: words [K/32][8][16] (each code (q - o) sc + 127, as the int4 tiles' words lie), d
// and dmin per super-block [K/256][16] as floats, and min_pairs [K/256][8][16] (block 8 s + i's two halves' mins,
// m_0 | m_1 << 16).
struct StagedCrumbTile {
  std::vector<uint32_t> words, min_pairs;
  std::vector<float> d, dmin;

  void stage(const KQuantWeight& weight, int64_t t);
};

void StagedCrumbTile::stage(const KQuantWeight& weight, int64_t t) {
  const KQuantWeight w = weight;
  const int64_t supers = w.K / 256;
  grow(words, kTileRows * w.K / 4);
  grow(min_pairs, 8 * kTileRows * supers);
  grow(d, kTileRows * supers);
  grow(dmin, kTileRows * supers);
  // Lane j of a 32-lane int16 vector holds a byte of row j / 4: of rows 0-7 in the low half of a code word's vector,
  // of rows 8-15 in the high half.
  alignas(64) int16_t rows_lo[32], rows_hi[32];
  uint32_t centred_lo = 0, centred_hi = 0;
  for (int j = 0; j < 32; ++j) {
    rows_lo[j] = static_cast<int16_t>(j / 4);
    rows_hi[j] = static_cast<int16_t>(8 + j / 4);
    centred_lo |= ((w.offsets(t) >> (j / 4)) & 1u) << j;
    centred_hi |= ((w.offsets(t) >> (8 + j / 4)) & 1u) << j;
  }
  const __m512i lane_lo = _mm512_load_si512(rows_lo), lane_hi = _mm512_load_si512(rows_hi);
  const __m512i centre_lo = _mm512_maskz_mov_epi16(centred_lo, _mm512_set1_epi16(static_cast<int16_t>(w.centre())));
  const __m512i centre_hi = _mm512_maskz_mov_epi16(centred_hi, _mm512_set1_epi16(static_cast<int16_t>(w.centre())));
  // packus interleaves its operands' 128-bit lanes; this puts the 64-bit groups back in order.
  const __m512i order = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  KQuantTerms terms;
  for (int64_t b = 0; b < w.blocks(); ++b) {
    const int64_t s = b / 8;
    if (b % 8 == 0) {
      _mm512_storeu_ps(d.data() + s * kTileRows, kquant_halves(w.block_d(t, b)));
      if (w.has_mins) _mm512_storeu_ps(dmin.data() + s * kTileRows, kquant_halves(w.block_dmin(t, b)));
      terms.read(w, w.super(t, b));
    }
    __m512i codes[8];
    kquant_codes(w, t, b, codes);
    for (int h = 0; h < 2; ++h) {
      const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(terms.scales(w, b, h)));
      const __m512i sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(scales));
      const __m512i sc_lo = _mm512_permutexvar_epi16(lane_lo, sc), sc_hi = _mm512_permutexvar_epi16(lane_hi, sc);
      // (q - o) sc + 127 = q sc + (127 - o sc).
      const __m512i bias_lo = _mm512_sub_epi16(_mm512_set1_epi16(127), _mm512_mullo_epi16(centre_lo, sc_lo));
      const __m512i bias_hi = _mm512_sub_epi16(_mm512_set1_epi16(127), _mm512_mullo_epi16(centre_hi, sc_hi));
      for (int j = 0; j < 4; ++j) {
        const __m512i code = codes[4 * h + j];
        const __m512i lo = _mm512_add_epi16(
            _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(code)), sc_lo), bias_lo);
        const __m512i hi = _mm512_add_epi16(
            _mm512_mullo_epi16(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(code, 1)), sc_hi), bias_hi);
        _mm512_storeu_si512(words.data() + (8 * b + 4 * h + j) * kTileRows,
                            _mm512_permutexvar_epi64(order, _mm512_packus_epi16(lo, hi)));
      }
    }
    if (w.has_mins) {
      const auto widen = [](const uint8_t* p) {
        return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      };
      const __m512i high = _mm512_slli_epi32(widen(terms.mins(w, b, 1)), 16);
      const __m512i pair = _mm512_or_si512(widen(terms.mins(w, b, 0)), high);
      _mm512_storeu_si512(min_pairs.data() + b * kTileRows, pair);
    }
  }
}

// The panel's CrumbPanel terms from its packed words (x_starts and t_pairs: [K/256][16] and [K/256][8][16]).
void crumb_panel_terms(const uint32_t* panel, int64_t K, int32_t* starts, uint32_t* t_pairs) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t s = 0; s < K / 256; ++s) {
    __m512i total = _mm512_setzero_si512();
    for (int i = 0; i < 8; ++i) {
      __m512i half_sums[2];
      for (int h = 0; h < 2; ++h) {
        half_sums[h] = _mm512_setzero_si512();
        for (int j = 0; j < 4; ++j)
          half_sums[h] = _mm512_dpbusd_epi32(half_sums[h], ones,
                                             _mm512_loadu_si512(panel + (8 * (8 * s + i) + 4 * h + j) * kPanel));
        total = _mm512_add_epi32(total, half_sums[h]);
      }
      const __m512i pair = _mm512_or_si512(_mm512_and_si512(half_sums[0], _mm512_set1_epi32(0xFFFF)),
                                           _mm512_slli_epi32(half_sums[1], 16));
      _mm512_storeu_si512(t_pairs + (8 * s + i) * kPanel, pair);
    }
    _mm512_storeu_si512(starts + s * kPanel, _mm512_mullo_epi32(total, _mm512_set1_epi32(-127)));
  }
}

// A crumb tile's 16 rows against one panel's 16 activation rows, into out [16][16]: per super-block S from the
// panel's start, then fma(S, d xs), and with mins fma(M, -(dmin xs)), as kquant.cpp's kquant_crumb_tile, a lane per
// activation row. Sixteen chains of dpbusd, one per weight row (eight leave it waiting on their latency); the float
// sums wait in out between super-blocks, a later sub-chain's in `chain`.
void crumb_tile(const KQuantWeight& w, const StagedCrumbTile& tile, const CrumbPanel& panel, float (*out)[kPanel],
                const TilePrefetch& prefetch) {
  constexpr int RT = kTileRows;
  const int64_t num_blocks = w.blocks();
  const int64_t lines_per_block = (prefetch.lines + num_blocks - 1) / num_blocks;
  const __m512 negative = _mm512_set1_ps(-0.0f);
  alignas(64) float chain[RT][kPanel];
  for (int64_t c = 0, begin = 0, end; begin < num_blocks; begin = end, ++c) {
    end = w.chain_end(c);
    float (*acc)[kPanel] = c == 0 ? out : chain;
    for (int r = 0; r < RT; ++r) _mm512_store_ps(acc[r], _mm512_setzero_ps());
    for (int64_t s = begin / 8; s < end / 8; ++s) {
      __m512i sums[RT];
      const __m512i start = _mm512_loadu_si512(panel.starts + s * kPanel);
      for (int r = 0; r < RT; ++r) sums[r] = start;
      for (int64_t b = 8 * s; b < 8 * s + 8; ++b) {
        const uint32_t* block_words = tile.words.data() + 8 * kTileRows * b;
        const uint32_t* block_quads = panel.quads + 8 * kPanel * b;
        for (int64_t l = b * lines_per_block; l < std::min(prefetch.lines, (b + 1) * lines_per_block); ++l)
          _mm_prefetch(prefetch.starts[0] + 64 * l, _MM_HINT_T1);
#pragma GCC unroll 8
        for (int j = 0; j < 8; ++j) {
          const __m512i x = _mm512_loadu_si512(block_quads + j * kPanel);
          for (int r = 0; r < RT; ++r) {
            const __m512i word = _mm512_set1_epi32(static_cast<int>(block_words[kTileRows * j + r]));
            sums[r] = _mm512_dpbusd_epi32(sums[r], word, x);
          }
        }
      }
      const __m512 xs = _mm512_loadu_ps(panel.x_scales + s * kPanel);
      for (int r = 0; r < RT; ++r) {
        const __m512 d = _mm512_mul_ps(_mm512_set1_ps(tile.d[s * kTileRows + r]), xs);
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), d, _mm512_load_ps(acc[r])));
      }
      if (!w.has_mins) continue;
      for (int r = 0; r < RT; ++r) sums[r] = _mm512_setzero_si512();
      for (int i = 0; i < 8; ++i) {
        const __m512i t_pair = _mm512_loadu_si512(panel.t_pairs + (8 * s + i) * kPanel);
        const uint32_t* pairs = tile.min_pairs.data() + (8 * s + i) * kTileRows;
        for (int r = 0; r < RT; ++r)
          sums[r] = _mm512_dpwssd_epi32(sums[r], _mm512_set1_epi32(static_cast<int>(pairs[r])), t_pair);
      }
      for (int r = 0; r < RT; ++r) {
        const __m512 dmin = _mm512_xor_ps(_mm512_mul_ps(_mm512_set1_ps(tile.dmin[s * kTileRows + r]), xs), negative);
        _mm512_store_ps(acc[r], _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums[r]), dmin, _mm512_load_ps(acc[r])));
      }
    }
    if (c > 0)
      for (int r = 0; r < RT; ++r)
        _mm512_store_ps(out[r], _mm512_add_ps(_mm512_load_ps(out[r]), _mm512_load_ps(chain[r])));
  }
}

// The crumb tile's rows [first, first + 16): the whole tile, crumb_tile.
void kquant_panel_rows(const KQuantWeight& w, const StagedCrumbTile& tile, int, const CrumbPanel& panel,
                       float (*out)[kPanel], const TilePrefetch& prefetch) {
  crumb_tile(w, tile, panel, out, prefetch);
}

// The halves' panel terms (HalfTerms) from the panel's packed words.
void halves_panel_terms(const uint32_t* panel, int64_t K, int32_t centre, const float* x_scales, int32_t* x_starts,
                        float* x_half_terms) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t h = 0; h < K / 16; ++h) {
    __m512i sums = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j)
      sums = _mm512_dpbusd_epi32(sums, ones, _mm512_loadu_si512(panel + (4 * h + j) * kPanel));
    const __m512i start = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_mullo_epi32(sums, _mm512_set1_epi32(centre)));
    _mm512_storeu_si512(x_starts + h * kPanel, start);
    const __m512 xs = _mm512_loadu_ps(x_scales + h / 2 * kPanel);
    _mm512_storeu_ps(x_half_terms + h * kPanel, _mm512_mul_ps(xs, _mm512_cvtepi32_ps(sums)));
  }
}

// y [M, N] = x [M, K] @ a K-quant weight's [N, K]ᵀ that the int4 tiles do not run: with CRUMBS its 2-bit codes'
// super-block sums (above), else scales per 16 or centred rows (kquant_int8_tile). gemm_int8's panels and their
// terms, formed once per panel rather than in every tile's blocks, then tiles in parallel. x_ld, swiglu_up and
// gelu as gemm_int8 takes them: x feature-major, and a gated MLP's gate/up product writing silu(gate) * up
// (gelu_tanh(gate) * up) feature-major; here a tile of gates and the tile of their ups are staged side by side,
// and each run of kRows gates meets its ups' sums in registers. The same values either way.
template <bool CRUMBS>
void gemm_kquant(const float* x, int64_t M, const KQuantWeight& w, float* y, int num_threads, int64_t x_ld = 0,
                 int64_t swiglu_up = 0, bool gelu = false) {
  using Staged = std::conditional_t<CRUMBS, StagedCrumbTile, StagedKTile>;
  const int64_t K = w.K, N = swiglu_up > 0 ? swiglu_up : w.N, num_blocks = K / 32, run = w.activation_run();
  const int64_t panel_words = K / 4 * kPanel, panel_blocks = num_blocks * kPanel;
  const int64_t chunk = std::max<int64_t>(kPanel, kChunkBytes / K / kPanel * kPanel);
  const int64_t num_panels = (std::min(chunk, M) + kPanel - 1) / kPanel;
  thread_local std::vector<uint32_t> scratch;
  const int64_t scratch_words = num_panels * (panel_words + 6 * panel_blocks) + 16;
  if (scratch.size() < static_cast<size_t>(scratch_words)) scratch.resize(scratch_words);
  uint32_t* const quads =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* const x_scales = reinterpret_cast<float*>(quads + num_panels * panel_words);
  float* const x_terms = x_scales + num_panels * panel_blocks;
  int32_t* const x_starts = reinterpret_cast<int32_t*>(x_terms + num_panels * panel_blocks);
  float* const x_half_terms = reinterpret_cast<float*>(x_starts + num_panels * 2 * panel_blocks);
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<int8_t> xq;
    thread_local std::vector<float> xscale;
    thread_local Staged gates, ups;
    grow(xq, kPanel * K);
    grow(xscale, kPanel * num_blocks);
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
#pragma omp for schedule(static)
      for (int64_t p = 0; p < (rows + kPanel - 1) / kPanel; ++p) {
        const int64_t valid = std::min<int64_t>(kPanel, rows - p * kPanel);
        uint32_t* panel = quads + p * panel_words;
        float* scales = x_scales + p * panel_blocks;
        if (x_ld > 0)
          pack_int8_panel_t<true>(x + m0 + p * kPanel, x_ld, valid, K, panel, scales, x_terms + p * panel_blocks, run);
        else
          pack_int8_panel<true>(x + (m0 + p * kPanel) * K, valid, K, xq.data(), xscale.data(), panel, scales,
                                x_terms + p * panel_blocks, run);
        if (CRUMBS)
          crumb_panel_terms(panel, K, x_starts + p * 2 * panel_blocks,
                            reinterpret_cast<uint32_t*>(x_half_terms + p * 2 * panel_blocks));
        else
          halves_panel_terms(panel, K, w.centre(), scales, x_starts + p * 2 * panel_blocks,
                             x_half_terms + p * 2 * panel_blocks);
      }
#pragma omp for schedule(guided, 2)
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n0 = t * kTileRows, up_tile = swiglu_up / kTileRows + t;
        const int count = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
        // The tiles after next, into L2 over the first panel's blocks, as gemm_int8's tiles fetch theirs.
        TilePrefetch prefetch, up_prefetch;
        if (t + 2 < num_tiles) {
          prefetch.starts[0] = reinterpret_cast<const char*>(w.super(t + 2, 0));
          prefetch.lines = w.tile_bytes() / 64;
          if (swiglu_up > 0) {
            up_prefetch.starts[0] = reinterpret_cast<const char*>(w.super(up_tile + 2, 0));
            up_prefetch.lines = prefetch.lines;
          }
        }
        gates.stage(w, t);
        if (swiglu_up > 0) ups.stage(w, up_tile);
        for (int64_t m = 0; m < rows; m += kPanel) {
          const int64_t p = m / kPanel;
          const int valid = static_cast<int>(std::min<int64_t>(kPanel, rows - m));
          const auto panel = [&] {
            if constexpr (CRUMBS)
              return CrumbPanel{quads + p * panel_words, x_scales + p * panel_blocks, x_starts + p * 2 * panel_blocks,
                                reinterpret_cast<const uint32_t*>(x_half_terms + p * 2 * panel_blocks)};
            else
              return HalvesPanel{quads + p * panel_words, x_scales + p * panel_blocks, x_terms + p * panel_blocks,
                                 HalfTerms{x_starts + p * 2 * panel_blocks, x_half_terms + p * 2 * panel_blocks}};
          }();
          // Rows a kquant_panel_rows call computes: crumb_tile takes the whole tile.
          constexpr int kStep = CRUMBS ? kTileRows : kRows;
          for (int first = 0; first < count; first += kStep) {
            const bool fetches = p == 0 && first == 0;
            const int real_rows = std::min(kStep, count - first);
            alignas(64) float sums[kStep][kPanel];
            kquant_panel_rows(w, gates, first, panel, sums, fetches ? prefetch : TilePrefetch{});
            if (swiglu_up == 0) {
              for (int i = 0; i < valid; ++i)
                for (int r = 0; r < real_rows; ++r) y[(m0 + m + i) * N + n0 + first + r] = sums[r][i];
              continue;
            }
            alignas(64) float up_sums[kStep][kPanel];
            kquant_panel_rows(w, ups, first, panel, up_sums, fetches ? up_prefetch : TilePrefetch{});
            const __mmask16 lanes = static_cast<__mmask16>(valid >= kPanel ? 0xFFFF : (1u << valid) - 1);
            for (int r = 0; r < real_rows; ++r) {
              const __m512 gate = _mm512_load_ps(sums[r]), up = _mm512_load_ps(up_sums[r]);
              _mm512_mask_storeu_ps(y + (n0 + first + r) * M + m0 + m, lanes,
                                    gelu ? tokenriver::gelu_tanh_times(gate, up) : tokenriver::silu_times(gate, up));
            }
          }
        }
      }
    }
  }
}

// Whether gemm_int8's int4 tiles run this K-quant weight (the block comment above).
bool runs_as_int4(const KQuantWeight& w) {
  return w.scale_group == 32 && w.has_mins && w.min_group == 32 && w.low_bits == 4 && w.offset_masks == nullptr;
}

// x_ld: 0 for x [M, K] row after row; else x is stored feature-major, column k at x + k * x_ld, the rows
// consecutive. The same values either way.
// swiglu_up > 0: weight rows [0, N) are an MLP's gates and [swiglu_up, swiglu_up + N) their ups (swiglu_up a
// multiple of 16, so that a tile of gates has its ups in one tile), and y [N, y_ld] (feature-major) gets
// silu(gate) * up. A tile then takes three gates and their three ups, and SwiGLU runs on its sums in registers: no
// [2N, M] product is written and read back by a pass of its own. The values are those of the product row after
// row and ops.cpp's SwiGLU.
template <bool IS_INT4, class Weight = TiledWeight>
void gemm_int8(const float* x, int64_t M, const Weight& weight, float* y, int num_threads, int64_t x_ld = 0,
               int64_t swiglu_up = 0, bool gelu = false) {
  const int64_t K = weight.K, N = swiglu_up > 0 ? swiglu_up : weight.N;
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
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows;
  const int64_t tile_bytes = weight.tile_bytes();
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
    thread_local std::vector<uint32_t> w;
    grow(xq, kPanel * K);
    grow(xscale, kPanel * num_blocks);
    grow(w, 2 * kTileRows * K / 4);
    grow(w_scales, 2 * kTileRows * num_blocks);
    grow(w_mins, 2 * kTileRows * num_blocks);
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
        const int64_t n0 = t * kTileRows;
        const int count = static_cast<int>(std::min<int64_t>(kTileRows, N - n0));
        // The tile after next, into L2 while this one computes (the products of a decode step read it from
        // memory): its bytes spread over the first panel's blocks (int8_tile). Issued all at once, the lines
        // stalled the core until miss buffers freed up (benchmarks/HISTORY.md).
        TilePrefetch prefetch;
        if (t + 2 < num_tiles) {
          prefetch.starts[0] = reinterpret_cast<const char*>(weight.block(t + 2, 0));
          if (swiglu_up > 0)
            prefetch.starts[1] = reinterpret_cast<const char*>(weight.block(swiglu_up / kTileRows + t + 2, 0));
          prefetch.lines = tile_bytes / 64;
        }
        const auto run = [&](auto rows_per_tile, auto stride, auto fused, int row0, int64_t first) {
          constexpr int RT = decltype(rows_per_tile)::value, S = decltype(stride)::value;
          for (int64_t m = 0; m < rows; m += kPanel) {
            const int64_t p = m / kPanel;
            int8_tile<IS_INT4, RT, S, decltype(fused)::value>(
                w.data(), w_scales.data(), w_mins.data(), row0, K, quads + p * panel_words, x_scales + p * panel_blocks,
                x_terms + p * panel_blocks, static_cast<int>(std::min<int64_t>(kPanel, rows - m)), y_chunk, N, m, first,
                y_ld, count - row0, weight.chain_ends, p == 0 && row0 == 0 ? prefetch : TilePrefetch{}, gelu);
          }
        };
        if (swiglu_up > 0) {
          constexpr int S = 2 * kTileRows;
          stage_tile<IS_INT4, S>(weight, t, 0, w.data(), w_scales.data(), w_mins.data());
          stage_tile<IS_INT4, S>(weight, swiglu_up / kTileRows + t, kTileRows, w.data(), w_scales.data(),
                                 w_mins.data());
          // Four gates and their four ups at a time (a tile's gates are all real: N is a multiple of 16).
          for (int row0 = 0; row0 < count; row0 += kRows / 2)
            run(std::integral_constant<int, kRows>{}, std::integral_constant<int, S>{}, std::true_type{}, row0,
                n0 + row0);
          continue;
        }
        stage_tile<IS_INT4, kTileRows>(weight, t, 0, w.data(), w_scales.data(), w_mins.data());
        // Eight rows at a time: a tile is two runs, and the last tile's zero rows past N are computed, not stored.
        for (int row0 = 0; row0 < count; row0 += kRows)
          run(std::integral_constant<int, kRows>{}, std::integral_constant<int, kTileRows>{}, std::false_type{}, row0,
              n0 + row0);
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

TiledWeight int4_weight(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                        int64_t N, int64_t K, int64_t G) {
  return TiledWeight{codes, scales, mins, fifth, N, K, G, true};
}

TiledWeight int8_weight(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t G) {
  return TiledWeight{reinterpret_cast<const uint8_t*>(codes), scales, nullptr, nullptr, N, K, G, false};
}

// Rows ids[i] of a tiled weight decoded into out [count, K].
template <bool IS_INT4>
void dequantize_rows(const TiledWeight& w, const int64_t* ids, int64_t count, float* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
  for (int64_t i = 0; i < count; ++i) decode_tiled_row<IS_INT4>(w, ids[i], out + i * w.K);
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ dequantized weight [N, K]ᵀ, the weight in row tiles (tiles.h); arguments in the order of
// gemv.cpp's int4_linear_f32.
void int4_gemm_f32(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                   int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm<true>(x, M, int4_weight(codes, scales, mins, fifth, N, K, group_size), y, num_threads);
}

void int8_gemm_f32(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                   const float* x, int64_t M, float* y, int num_threads) {
  gemm<false>(x, M, int8_weight(codes, scales, N, K, group_size), y, num_threads);
}

// Float32 copy of weights stored row after row (the loader's formats, before they are tiled), [N, K], decoded
// exactly as the products decode them.
void int4_dequantize(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                     int64_t N, int64_t K, int64_t group_size, float* out, int num_threads) {
  dequantize<true>(qweight, scales, mins, qh, N, K, group_size, out, num_threads);
}

void int8_dequantize(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     float* out, int num_threads) {
  dequantize<false>(reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, K, group_size, out,
                    num_threads);
}

// Rows ids [count] of a weight in row tiles, decoded into out [count, K]: an embedding's lookup, or the whole
// matrix (ids 0 .. N - 1).
void int4_dequantize_rows(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                          int64_t N, int64_t K, int64_t group_size, const int64_t* ids, int64_t count, float* out,
                          int num_threads) {
  dequantize_rows<true>(int4_weight(codes, scales, mins, fifth, N, K, group_size), ids, count, out, num_threads);
}

void int8_dequantize_rows(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                          const int64_t* ids, int64_t count, float* out, int num_threads) {
  dequantize_rows<false>(int8_weight(codes, scales, N, K, group_size), ids, count, out, num_threads);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// The same products with the activations rounded to int8 per 32 columns (models/quant.py's rounded mode), where the
// CPU has AVX512-VNNI; K a multiple of 32, groups a multiple of 32. Present only then: gemm_int8x_supported says.
// chain_ends: the weight's sub-chains (tiles.h), or null.
void int4_gemm_int8x(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                     int64_t N, int64_t K, int64_t group_size, const int64_t* chain_ends, const float* x, int64_t M,
                     float* y, int num_threads) {
  TiledWeight w = int4_weight(codes, scales, mins, fifth, N, K, group_size);
  w.chain_ends = chain_ends;
  gemm_int8<true>(x, M, w, y, num_threads);
}

void int8_gemm_int8x(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const int64_t* chain_ends, const float* x, int64_t M, float* y, int num_threads) {
  TiledWeight w = int8_weight(codes, scales, N, K, group_size);
  w.chain_ends = chain_ends;
  gemm_int8<false>(x, M, w, y, num_threads);
}

// int4_gemm_int8x / int8_gemm_int8x with x stored feature-major ([K, x_ld]): the native decoder's MLP keeps its
// intermediate so, and the same values come out.
void int4_gemm_int8x_strided(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                             int64_t N, int64_t K, int64_t group_size, const int64_t* chain_ends, const float* x,
                             int64_t M, int64_t x_ld, float* y, int num_threads) {
  TiledWeight w = int4_weight(codes, scales, mins, fifth, N, K, group_size);
  w.chain_ends = chain_ends;
  gemm_int8<true>(x, M, w, y, num_threads, x_ld);
}

void int8_gemm_int8x_strided(const int8_t* codes, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                             const int64_t* chain_ends, const float* x, int64_t M, int64_t x_ld, float* y,
                             int num_threads) {
  TiledWeight w = int8_weight(codes, scales, N, K, group_size);
  w.chain_ends = chain_ends;
  gemm_int8<false>(x, M, w, y, num_threads, x_ld);
}

// y [I, M] (feature-major) = silu(x Wᵀ [:, :I]) * x Wᵀ [:, I:2I] for a fused gate/up weight [2I, K]: the native
// decoder's MLP intermediate, the values of int4_gemm_int8x and ops.cpp's SwiGLU.
void int4_gemm_int8x_swiglu(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                            int64_t I, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                            int num_threads) {
  gemm_int8<true>(x, M, int4_weight(codes, scales, mins, fifth, 2 * I, K, group_size), y, num_threads, 0, I);
}

void int8_gemm_int8x_swiglu(const int8_t* codes, const uint16_t* scales, int64_t I, int64_t K, int64_t group_size,
                            const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<false>(x, M, int8_weight(codes, scales, 2 * I, K, group_size), y, num_threads, 0, I);
}

// The same with GeGLU, gelu_tanh(gate) * up (Gemma's MLP): ops.cpp's GeGLU on int4_gemm_int8x's values.
void int4_gemm_int8x_geglu(const uint8_t* codes, const uint16_t* scales, const uint16_t* mins, const uint64_t* fifth,
                           int64_t I, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                           int num_threads) {
  gemm_int8<true>(x, M, int4_weight(codes, scales, mins, fifth, 2 * I, K, group_size), y, num_threads, 0, I, true);
}

void int8_gemm_int8x_geglu(const int8_t* codes, const uint16_t* scales, int64_t I, int64_t K, int64_t group_size,
                           const float* x, int64_t M, float* y, int num_threads) {
  gemm_int8<false>(x, M, int8_weight(codes, scales, 2 * I, K, group_size), y, num_threads, 0, I, true);
}

// y [M, N] = x [M, K] with int8 activations @ a K-quant weight [N, K]ᵀ (kquant.h): kquant.cpp's GEMV per row.
void kquant_gemm_int8x(const KQuantWeight* w, const float* x, int64_t M, float* y, int num_threads) {
  if (runs_as_int4(*w))
    gemm_int8<true>(x, M, *w, y, num_threads);
  else if (w->low_bits == 2)
    gemm_kquant<true>(x, M, *w, y, num_threads);
  else
    gemm_kquant<false>(x, M, *w, y, num_threads);
}

// kquant_gemm_int8x with x stored feature-major ([K, x_ld]): the same values.
void kquant_gemm_int8x_strided(const KQuantWeight* w, const float* x, int64_t M, int64_t x_ld, float* y,
                               int num_threads) {
  if (runs_as_int4(*w))
    gemm_int8<true>(x, M, *w, y, num_threads, x_ld);
  else if (w->low_bits == 2)
    gemm_kquant<true>(x, M, *w, y, num_threads, x_ld);
  else
    gemm_kquant<false>(x, M, *w, y, num_threads, x_ld);
}

// y [I, M] (feature-major) = silu(x Wᵀ [:, :I]) * x Wᵀ [:, I:2I] (gelu_tanh with gelu) for a fused gate/up K-quant
// weight [2I, K], I a multiple of 16: kquant_gemm_int8x's values and ops.cpp's SwiGLU (GeGLU).
void kquant_gemm_int8x_gated(const KQuantWeight* w, int64_t I, int gelu, const float* x, int64_t M, float* y,
                             int num_threads) {
  if (runs_as_int4(*w))
    gemm_int8<true>(x, M, *w, y, num_threads, 0, I, gelu != 0);
  else if (w->low_bits == 2)
    gemm_kquant<true>(x, M, *w, y, num_threads, 0, I, gelu != 0);
  else
    gemm_kquant<false>(x, M, *w, y, num_threads, 0, I, gelu != 0);
}

int gemm_int8x_supported() { return 1; }
#else
int gemm_int8x_supported() { return 0; }
#endif

}  // extern "C"
