// The rounded mode's many-row quantized products on Intel AMX tiles (Sapphire Rapids and later): bfloat16 inputs,
// float32 sums.
//
// gemm.cpp's int8 product spends most of its time on float work per block of 32 columns: each integer block sum is
// converted, scaled by the weight's and the activation's block scales and added, four vector operations per 16
// outputs per block. An AMX tile instruction adds 16 × 16 × 32 products in ~16 cycles, but the same per-block float
// work after it costs twice that, and on this CPU it does not overlap with the tile unit: tile instructions and
// AVX-512 arithmetic in one loop took more than the sum of their separate times (C harness). Integer tiles followed
// by the per-block scaling gained little over the VNNI kernel (benchmarks/HISTORY.md).
//
// Bfloat16 tiles need no per-block work: the weights are decoded to float32 (scale * q + min, gemm.cpp's decoding,
// bit for bit) and rounded to bfloat16, the activations rounded to bfloat16, and the tile instruction sums every
// product in float32 over all K. Each weight is decoded once per call and serves every activation row. The rounding
// is bfloat16's (8 significant bits) on both operands, finer than int8 activations per 32 columns; decode steps of up
// to max_gemv_rows rows keep gemv.cpp's int8 products. It beats the VNNI kernel and F.linear on a bfloat16 copy
// (oneDNN) at batch-decode sizes; at prefill sizes oneDNN's is faster, as writing and reading back the float32
// outputs costs more than decoding there (kRowOperandRows below; figures in benchmarks/HISTORY.md).
//
// The product is computed transposed, yᵀ = W xᵀ, so that the weights are the tile instruction's row operand: a
// weight tile is 16 weight rows of 32 bfloat16 columns, each row decoded in place from its own bytes (no shuffling),
// and the activations take the pair-interleaved layout of the column operand (16 rows of 16 activation rows × 2
// columns), a 16 × 16 transpose of 32-bit pairs done once per call. Each 16 × 16 float32 result tile is transposed
// back on its way to y. (The other way round, weights as the column operand, costs that transpose per weight block
// instead, which is slower at decode sizes.) Every output is one fixed sequence of
// tile instructions over K, whatever the batch, so a row's result does not depend on the other rows in it.
//
// Linux hands out the tile registers only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM):
// gemm_bf16_amx_supported() asks once, and callers check it before any product. Each thread loads the tile
// configuration at the start of a product and releases the tiles after it.

#include "gemm_amx.h"

#ifdef TOKENRIVER_GEMM_AMX

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "reductions.h"
#include "vec.h"

namespace {

using tokenriver::prefetch_weight_rows;
using tokenriver::reduce_columns;
using tokenriver::RowReductions;

constexpr int kTile = 16;                     // rows of every tile; weight rows and activation rows per tile
constexpr int kTileBytes = kTile * 64;        // one tile: 16 rows of 64 bytes (32 bfloat16 or 16 float32)
constexpr int64_t kChunkBytes = 1024 * 1024;  // activation rows per pass, as bfloat16 tiles, kept in L2
constexpr long kReqXcompPerm = 0x1023;        // arch_prctl: ARCH_REQ_XCOMP_PERM
constexpr long kXfeatureTileData = 18;        // XFEATURE_XTILEDATA

// Tiles 0-3: float32 sums of two weight tiles against two activation tiles; 4 and 5: weight tiles; 6 and 7:
// activation tiles.
struct TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
};

void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTile;
    config.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&config);
}

// Transposes 16 vectors of 16 32-bit words (r[i] = row i) in place: r[j] = column j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // r[4g + c], 128-bit lane l: rows 4g..4g+3, column 4l + c.
  for (int g = 0; g < 16; g += 4) {
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  // Column 4l + c gathers lane l of r[c], r[4 + c], r[8 + c], r[12 + c]: a 4 × 4 transpose of 128-bit lanes.
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), x1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i y0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[4 + c] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[8 + c] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[12 + c] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// Group g's float16 values of weight row n (scales or mins, [N, K/G]) as floats, 16 groups per conversion.
inline void groups_to_float(const uint16_t* values, int64_t num_groups, int64_t n, float* out) {
  for (int64_t g = 0; g < num_groups; g += 16) {
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(16, num_groups - g)) - 1);
    const __m256i halves = _mm256_maskz_loadu_epi16(mask, values + n * num_groups + g);
    _mm512_mask_storeu_ps(out + g, mask, _mm512_cvtph_ps(halves));
  }
}

// Weight rows [n0, n0 + 16) (zero past N) decoded to bfloat16 as tiles, one per block of 32 columns:
// tiles + b * kTileBytes, row r at + 64 r. Every value is gemm.cpp's decode_row's float32 (scale * q + min with one
// rounding, or scale * q), rounded to nearest even bfloat16. `groups`: scratch for a row's group scales and mins.
//
// An int4 block takes its values from a table: the 16 possible codes' values, computed and rounded once per group,
// looked up by one word permute for all 32 columns (vpermw takes the low 5 bits of each index, and the table holds
// its 16 values twice, so the bits above a nibble do not matter). About 7 vector operations per 32 weights against
// 11 for converting and multiplying each weight.
template <bool IS_INT4>
void weight_tiles(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh, int64_t N,
                  int64_t K,
                  int64_t G, int64_t n0, uint8_t* tiles, float* groups) {
  const int64_t num_blocks = K / 32, num_groups = K / G, blocks_per_group = G / 32;
  const int valid = static_cast<int>(std::min<int64_t>(kTile, N - n0));
  float* const row_scales = groups;
  float* const row_mins = groups + num_groups;
  const __m512 codes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int r = 0; r < kTile; ++r) {
    uint8_t* out = tiles + 64 * r;
    if (r >= valid) {
      for (int64_t b = 0; b < num_blocks; ++b) _mm512_store_si512(out + b * kTileBytes, _mm512_setzero_si512());
      continue;
    }
    const int64_t n = n0 + r;
    groups_to_float(scales, num_groups, n, row_scales);
    if (IS_INT4) groups_to_float(mins, num_groups, n, row_mins);
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m512 scale = _mm512_set1_ps(row_scales[g]);
      // int4: the group's 16 values, twice over (words 0-15 and 16-31); int5: its 32 values.
      __m512i table = _mm512_setzero_si512();
      if (IS_INT4) {
        const __m512 min = _mm512_set1_ps(row_mins[g]);
        const __m512 values = _mm512_fmadd_ps(codes, scale, min);
        const __m512 upper = qh == nullptr ? values
                                           : _mm512_fmadd_ps(_mm512_add_ps(codes, _mm512_set1_ps(16.0f)), scale, min);
        table = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(upper, values));
      }
      for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; ++b) {
        __m512i values;
        if (IS_INT4) {
          // Indices: the 16 bytes (low nibbles: columns 0-15), then the same bytes shifted right by 4 (high
          // nibbles: columns 16-31), each widened to a word.
          const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qweight + n * (K / 2) + 16 * b));
          const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(bytes), _mm_srli_epi16(bytes, 4), 1);
          __m512i indices = _mm512_cvtepu8_epi16(both);
          if (qh != nullptr)  // the nibble alone, then the fifth bit (vpermw reads five bits)
            indices = _mm512_or_si512(_mm512_and_si512(indices, _mm512_set1_epi16(0x0F)),
                                      _mm512_maskz_mov_epi16(qh[n * num_blocks + b], _mm512_set1_epi16(0x10)));
          values = _mm512_permutexvar_epi16(indices, table);
        } else {
          const __m128i* q = reinterpret_cast<const __m128i*>(qweight + n * K + 32 * b);
          const __m512 low = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), scale);
          const __m512 high = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), scale);
          // cvtne2ps puts its second operand's 16 values first: columns 0-31 in order.
          values = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
        }
        _mm512_store_si512(out + b * kTileBytes, values);
      }
    }
  }
}

// Activation rows [0, valid) of x (zero past valid) rounded to bfloat16 as column-operand tiles, one per block of 32
// columns: tiles + b * kTileBytes, whose row p holds, for each activation row i, its columns 2p and 2p + 1.
void activation_tiles(const float* x, int64_t valid, int64_t K, uint8_t* tiles) {
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i pairs[kTile];  // pairs[i]: activation row i's 16 column pairs of the block
    for (int i = 0; i < kTile; ++i) {
      if (i >= valid) {
        pairs[i] = _mm512_setzero_si512();
        continue;
      }
      const float* row = x + i * K + 32 * b;
      pairs[i] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(row + 16), _mm512_loadu_ps(row)));
    }
    transpose16(pairs);
    for (int p = 0; p < kTile; ++p) _mm512_store_si512(tiles + b * kTileBytes + 64 * p, pairs[p]);
  }
}

template <int S>
__attribute__((always_inline)) inline void store_sums(float* out, int64_t stride) {
  if constexpr (S == 0)
    _tile_stored(0, out, stride);
  else if constexpr (S == 1)
    _tile_stored(1, out, stride);
  else if constexpr (S == 2)
    _tile_stored(2, out, stride);
  else
    _tile_stored(3, out, stride);
}

// The row operand of a product: tile r (0 or 1) of block b starts at base + r * tile_step + b * block_step, its rows
// row_stride bytes apart. Weight tiles are stored block after block (rows 64 bytes apart); activation rows in
// order (a block is 64 bytes of a row).
struct RowTiles {
  const uint8_t* base;
  int64_t row_stride, block_step, tile_step;
};

// RT row-operand tiles × CT column-operand tiles (`columns`, then `columns + column_step`; block b at + b *
// kTileBytes, rows 64 bytes apart), RT and CT 1 or 2, over num_blocks blocks of 32 columns: sums tile (r, c) = row
// tile r against column tile c, stored at sums + 16 r * ld + 16 c (rows ld floats apart). Two by two, each tile
// loaded feeds two tile instructions, and every tile of a block has its own register, so a load never waits for
// the instruction that read the register before (AMX tiles are not renamed), which one weight tile against four
// activation tiles did.
template <int RT, int CT>
void multiply_tiles(const RowTiles& rows, const uint8_t* columns, int64_t column_step, int64_t num_blocks,
                    float* sums, int64_t ld) {
  _tile_zero(0);
  if constexpr (CT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && CT > 1) _tile_zero(3);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* row_tile = rows.base + b * rows.block_step;
    _tile_loadd(4, row_tile, rows.row_stride);
    if constexpr (RT > 1) _tile_loadd(5, row_tile + rows.tile_step, rows.row_stride);
    _tile_loadd(6, columns + b * kTileBytes, 64);
    if constexpr (CT > 1) _tile_loadd(7, columns + column_step + b * kTileBytes, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (CT > 1) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT > 1) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT > 1 && CT > 1) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t stride = ld * static_cast<int64_t>(sizeof(float));
  store_sums<0>(sums, stride);
  if constexpr (CT > 1) store_sums<1>(sums + kTile, stride);
  if constexpr (RT > 1) store_sums<2>(sums + kTile * ld, stride);
  if constexpr (RT > 1 && CT > 1) store_sums<3>(sums + kTile * ld + kTile, stride);
}

// multiply_tiles with the tile counts chosen at run time.
inline void multiply_tiles(int row_tiles, int column_tiles, const RowTiles& rows, const uint8_t* columns,
                           int64_t column_step, int64_t num_blocks, float* sums, int64_t ld) {
  if (row_tiles == 2 && column_tiles == 2)
    multiply_tiles<2, 2>(rows, columns, column_step, num_blocks, sums, ld);
  else if (row_tiles == 2)
    multiply_tiles<2, 1>(rows, columns, column_step, num_blocks, sums, ld);
  else if (column_tiles == 2)
    multiply_tiles<1, 2>(rows, columns, column_step, num_blocks, sums, ld);
  else
    multiply_tiles<1, 1>(rows, columns, column_step, num_blocks, sums, ld);
}

// Sums tile [16 weight rows, 16 activation rows] (rows ld floats apart) → y[m0 + i, n0 + r] for i < `valid`,
// r < `columns`.
inline void store_transposed(const float* sums, int64_t ld, int64_t valid, int columns, float* y, int64_t N,
                             int64_t m0, int64_t n0) {
  __m512i rows[kTile];
  for (int r = 0; r < kTile; ++r) rows[r] = _mm512_load_si512(sums + r * ld);
  transpose16(rows);
  const __mmask16 mask = static_cast<__mmask16>((1u << columns) - 1);
  for (int i = 0; i < kTile && i < valid; ++i)
    _mm512_mask_storeu_ps(y + (m0 + i) * N + n0, mask, reinterpret_cast<__m512>(rows[i]));
}

// Scratch of the calling thread kept between calls, 64-byte aligned: a fresh buffer per call came back from the
// system each time and cost a page fault per 4 KB written (gemm.cpp's reason), and zeroing it cost as much again.
inline uint8_t* aligned_scratch(std::vector<uint8_t>& scratch, size_t bytes) {
  if (scratch.size() < bytes + 64) scratch.resize(bytes + 64);
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
}

// Weight rows [n0, n0 + 16) as column-operand tiles: weight_tiles' row-operand tiles, each transposed as 16 × 16
// pairs of columns, so that row p holds every weight row's columns 2p and 2p + 1.
template <bool IS_INT4>
void weight_column_tiles(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                         int64_t N, int64_t K,
                         int64_t G, int64_t n0, uint8_t* tiles, float* groups) {
  weight_tiles<IS_INT4>(qweight, scales, mins, qh, N, K, G, n0, tiles, groups);
  for (int64_t b = 0; b < K / 32; ++b) {
    __m512i pairs[kTile];
    for (int r = 0; r < kTile; ++r) pairs[r] = _mm512_load_si512(tiles + b * kTileBytes + 64 * r);
    transpose16(pairs);
    for (int p = 0; p < kTile; ++p) _mm512_store_si512(tiles + b * kTileBytes + 64 * p, pairs[p]);
  }
}

// Activation rows [0, valid) of x rounded to bfloat16, row after row (K values each), and rows [valid, padded) zero:
// row-operand tiles read straight from it.
void activation_rows(const float* x, int64_t valid, int64_t padded, int64_t K, uint8_t* rows) {
  for (int64_t i = 0; i < padded; ++i) {
    uint8_t* out = rows + i * 2 * K;
    for (int64_t k = 0; k < K; k += 32) {
      const __m512i values = i < valid ? reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(
                                             _mm512_loadu_ps(x + i * K + k + 16), _mm512_loadu_ps(x + i * K + k)))
                                       : _mm512_setzero_si512();
      _mm512_storeu_si512(out + 2 * k, values);
    }
  }
}

// Products of at least this many rows take the activations as the row operand and the weights as the column
// operand: the sums tiles then have y's layout and are stored into it directly, at the cost of transposing each
// decoded weight tile, which is shared by every row. Below it the transposed form is faster (it writes each
// output tile through a transpose, but decodes weights in place); from 128 rows on the direct store wins by a few
// percent, and at 2048 rows both are bound by writing and reading the float32 outputs (benchmarks/HISTORY.md).
constexpr int64_t kRowOperandRows = 128;

// The product, both ways round. ROWS_ARE_ACTIVATIONS false: yᵀ = W xᵀ, weight tiles against activation tiles
// transposed as column operands; true: y = x Wᵀ, activation rows against transposed weight tiles. Either way each
// output sums the same 16 × 16 × 32 tile instructions over the same blocks in the same order, so the two give the
// same bits (tests/models/test_quant.py checks).
template <bool IS_INT4, bool ROWS_ARE_ACTIVATIONS>
void gemm_amx(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
              const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads,
              const RowReductions* reductions = nullptr) {
  const int64_t num_blocks = K / 32, tile_row_bytes = num_blocks * kTileBytes;
  // Activation rows per pass, a whole number of tile pairs, as bfloat16 kept in L2.
  const int64_t chunk = std::max<int64_t>(2 * kTile, kChunkBytes / (2 * K) / (2 * kTile) * (2 * kTile));
  const int64_t chunk_tiles = (std::min(chunk, M) + kTile - 1) / kTile;
  thread_local std::vector<uint8_t> activation_scratch;
  uint8_t* const activations = aligned_scratch(activation_scratch, chunk_tiles * tile_row_bytes);
  const int64_t num_weight_tiles = (N + kTile - 1) / kTile;
#pragma omp parallel num_threads(num_threads)
  {
    configure_tiles();
    thread_local std::vector<uint8_t> weight_scratch;
    uint8_t* const weights = aligned_scratch(weight_scratch, 2 * tile_row_bytes);
    thread_local std::vector<float> groups;
    if (groups.size() < static_cast<size_t>(2 * K / G)) groups.resize(2 * K / G);
    alignas(64) float sums[4 * kTile * kTile];  // [32, 32]: sums tile (r, c) at 16 r * 32 + 16 c
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
      const int64_t row_tiles = (rows + kTile - 1) / kTile;
#pragma omp for schedule(static)
      for (int64_t t = 0; t < row_tiles; ++t) {
        const int64_t valid = std::min<int64_t>(kTile, rows - t * kTile);
        if (ROWS_ARE_ACTIVATIONS)
          activation_rows(x + (m0 + t * kTile) * K, valid, kTile, K, activations + t * tile_row_bytes);
        else
          activation_tiles(x + (m0 + t * kTile) * K, valid, K, activations + t * tile_row_bytes);
      }
      // Pairs of weight tiles handed out a few at a time (gemm.cpp's reason: cores of a shared machine run at
      // different speeds); each thread mostly takes the pair after its last, as the prefetch assumes.
#pragma omp for schedule(guided, 1)
      for (int64_t t = 0; t < num_weight_tiles; t += 2) {
        const int64_t n0 = t * kTile;
        const int weight_tiles_here = t + 1 < num_weight_tiles ? 2 : 1;
        const int64_t pair_rows = std::min<int64_t>(2 * kTile, N - n0);
        // The next pair's bytes into L2 while this one computes (gemm.cpp's prefetch).
        if (n0 + pair_rows < N)
          prefetch_weight_rows<IS_INT4>(qweight, scales, mins, K, G, n0 + pair_rows,
                                        std::min<int64_t>(2 * kTile, N - n0 - pair_rows));
        for (int w = 0; w < weight_tiles_here; ++w) {
          uint8_t* tiles = weights + w * tile_row_bytes;
          if (ROWS_ARE_ACTIVATIONS)
            weight_column_tiles<IS_INT4>(qweight, scales, mins, qh, N, K, G, n0 + w * kTile, tiles, groups.data());
          else
            weight_tiles<IS_INT4>(qweight, scales, mins, qh, N, K, G, n0 + w * kTile, tiles, groups.data());
        }
        float* y_chunk = y != nullptr ? y + m0 * N : nullptr;  // null: reductions instead of y
        for (int64_t r = 0; r < row_tiles; r += 2) {
          const int activation_tiles_here = r + 1 < row_tiles ? 2 : 1;
          const uint8_t* group = activations + r * tile_row_bytes;
          if (ROWS_ARE_ACTIVATIONS) {
            // Whole tiles go straight into y; a tile past the last row or column through `sums`.
            const RowTiles activation_rows_here{group, 2 * K, 64, kTile * 2 * K};
            const bool whole = (r + activation_tiles_here) * kTile <= rows && n0 + weight_tiles_here * kTile <= N;
            float* out = whole ? y_chunk + r * kTile * N + n0 : sums;
            multiply_tiles(activation_tiles_here, weight_tiles_here, activation_rows_here, weights, tile_row_bytes,
                           num_blocks, out, whole ? N : 2 * kTile);
            if (!whole)
              for (int64_t i = 0; i < activation_tiles_here * kTile && r * kTile + i < rows; ++i)
                memcpy(y_chunk + (r * kTile + i) * N + n0, sums + i * 2 * kTile, pair_rows * sizeof(float));
          } else {
            multiply_tiles(weight_tiles_here, activation_tiles_here, {weights, 64, kTileBytes, tile_row_bytes},
                           group, tile_row_bytes, num_blocks, sums, 2 * kTile);
            for (int w = 0; w < weight_tiles_here; ++w)
              for (int a = 0; a < activation_tiles_here; ++a) {
                const float* tile = sums + w * kTile * 2 * kTile + a * kTile;
                const int columns = static_cast<int>(std::min<int64_t>(kTile, N - n0 - w * kTile));
                if (reductions != nullptr)
                  reduce_columns(tile, 2 * kTile, rows - (r + a) * kTile, columns, m0 + (r + a) * kTile,
                                    n0 + w * kTile, reductions[omp_get_thread_num()]);
                else
                  store_transposed(tile, 2 * kTile, rows - (r + a) * kTile, columns, y_chunk, N, (r + a) * kTile,
                                   n0 + w * kTile);
              }
          }
        }
      }
    }
    _tile_release();
  }
}

template <bool IS_INT4>
void gemm_amx(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
              const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  if (M >= kRowOperandRows)
    gemm_amx<IS_INT4, true>(x, M, K, qweight, scales, mins, qh, N, G, y, num_threads);
  else
    gemm_amx<IS_INT4, false>(x, M, K, qweight, scales, mins, qh, N, G, y, num_threads);
}

// Per activation row of y = x Wᵀ (the transposed product's arithmetic, so y's values are those of the gemm_amx
// call): its argmax, largest value and log-sum-exp, without writing y (reductions.h). Returns how many values of y
// were NaN or infinite (the results are then not to be used).
template <bool IS_INT4>
int64_t argmax_amx(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                   const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, int64_t* argmax, float* max,
                   float* lse, int num_threads) {
  const auto product = [&](int threads, const RowReductions* reductions) {
    gemm_amx<IS_INT4, false>(x, M, K, qweight, scales, mins, qh, N, G, nullptr, threads, reductions);
  };
  return tokenriver::reduce_rows(num_threads, M, product, argmax, max, lse);
}

}  // namespace

extern "C" {

int gemm_bf16_amx_supported() {
  static const bool ready = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  return ready ? 1 : 0;
}

void int4_gemm_bf16_amx(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                        int64_t N, int64_t K,
                        int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm_amx<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_gemm_bf16_amx(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                        const float* x, int64_t M, float* y, int num_threads) {
  gemm_amx<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size, y,
                  num_threads);
}

int64_t int4_argmax_bf16_amx(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                             int64_t N,
                             int64_t K, int64_t group_size, const float* x, int64_t M, int64_t* argmax, float* max,
                             float* lse, int num_threads) {
  return argmax_amx<true>(x, M, K, qweight, scales, mins, qh, N, group_size, argmax, max, lse, num_threads);
}

int64_t int8_argmax_bf16_amx(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                             const float* x, int64_t M, int64_t* argmax, float* max, float* lse, int num_threads) {
  return argmax_amx<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size,
                           argmax, max, lse, num_threads);
}

}  // extern "C"

#else

extern "C" int gemm_bf16_amx_supported() { return 0; }

#endif
