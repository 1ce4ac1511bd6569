// Quantized matrix-vector products that read weights at memory speed on x86-64 CPUs with AVX2 + FMA + F16C.
//
// One decode step multiplies a few activation rows by every weight matrix of the model, so its time is the time
// to stream the weights from memory. These kernels read the weights in their quantized form (0.5 or 1 byte per
// weight plus one float16 scale per group), decode them in registers and accumulate in float32, so the bytes read
// per weight are 4-8x fewer than float32 and no float copy of the matrix is ever written.
//
// Weight formats (row n of an [N, K] matrix, groups of G consecutive columns, G a multiple of 32):
//   int4: qweight [N, K/2] uint8. Each run of 32 columns is 16 bytes; byte j holds column j in its low nibble and
//         column j+16 in its high nibble (GGUF's Q4_0/Q4_1 order). scales, mins [N, K/G] float16:
//         w[n, k] = scale[n, k/G] * q[n, k] + min[n, k/G].
//   int5: int4 plus high bits [N, K/32] uint32, bit j of word b the fifth bit of column 32 b + j's code:
//         w[n, k] = scale * (q[n, k] + 16 * bit) + min (GGUF's Q5_0, its qh word per block as it is).
//   int8: qweight [N, K] int8, scales [N, K/G] float16: w[n, k] = scale[n, k/G] * q[n, k].
// Activations x [M, K] and outputs y [M, N] are float32, row-major and contiguous.
//
// Two arithmetic modes, each computing a row the same way in this GEMV and in gemm.cpp's GEMM, so a row's bits never
// depend on how many rows share the product:
// - float32 activations: vec.h's float arithmetic (the exact dequantized weight times x, one FMA chain per lane of
//   column residues, a fixed fold of the lanes), the weights decoded in registers a block of 32 columns at a time;
// - activations rounded to int8 per 32 columns and multiplied as integers, as llama.cpp does (quantize_activations):
//   for int4 weights about a third of the float path's operations, so the products keep up with memory ("one
//   arithmetic per row" below).
// Parallel over output rows with OpenMP; it shares PyTorch's libgomp (same soname), so the threads are PyTorch's.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <new>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// 32-byte aligned storage for the paired activations, which the pair kernel loads with aligned loads.
template <typename T>
struct AlignedAllocator {
  using value_type = T;
  AlignedAllocator() = default;
  template <typename U>
  AlignedAllocator(const AlignedAllocator<U>&) {}
  T* allocate(size_t n) {
    void* p = aligned_alloc(32, (n * sizeof(T) + 31) / 32 * 32);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t) { free(p); }
  bool operator==(const AlignedAllocator&) const { return true; }
  bool operator!=(const AlignedAllocator&) const { return false; }
};

using tokenriver::decode_int4;
using tokenriver::decode_block;
using tokenriver::decode_int8;
using tokenriver::FloatLanes;
using tokenriver::fma_lanes;
using tokenriver::fold_lanes;
using tokenriver::kFloatLanes;
using tokenriver::load_lanes;
using tokenriver::zero_lanes;
using tokenriver::fifth_bits;
using tokenriver::half_to_float;
using tokenriver::horizontal_sum;
using tokenriver::prefetch_group_terms;
using tokenriver::quantize_activations;
using tokenriver::transpose8;

// One row of int8 activations in the order the int4 tiles read them. For blocks 2p and 2p+1 (32 columns each),
// the 32 bytes lo[p] are [columns 0-15 of block 2p | columns 0-15 of block 2p+1] and hi[p] the same for columns
// 16-31: one 32-byte load of the two blocks' weights (16 bytes each) gives their low nibbles in lo's order after one
// AND and their high nibbles in hi's order after a shift and an AND, so no weight byte is moved. An odd last block
// has zero activations in its upper half.
void pair_activations(const int8_t* xq, int64_t K, int8_t* lo, int8_t* hi) {
  const int64_t num_blocks = K / 32, pair_bytes = 32 * ((num_blocks + 1) / 2);
  memset(lo, 0, pair_bytes);
  memset(hi, 0, pair_bytes);
  for (int64_t b = 0; b < num_blocks; ++b) {  // block 2p at 32p, block 2p+1 at 32p + 16
    memcpy(lo + 16 * b, xq + 32 * b, 16);
    memcpy(hi + 16 * b, xq + 32 * b + 16, 16);
  }
}

// ---- Int8 activations: one arithmetic per row ----------------------------------------------------------------
//
// Every product with int8 activations computes an output as one chain over its blocks of 32 columns, in order, the
// same here and in gemm.cpp's GEMM (int8_tile), so a row's bits depend on that row alone: not on how many rows
// share the product, where the row sits among them, or which thread computes it. Per block b,
//     S_b = the exact integer sum of the block's codes times the row's rounded activations
//     acc = fma(S_b, ws_b * xs_b, acc)          ws_b the weight's scale for the block, xs_b the activations'
//     acc = fma(min_b, xs_b * T_b, acc)          int4 weights only: T_b the block's sum of rounded activations
// and y = acc. Int8 weights with one scale per output channel (group size K) take acc = fma(S_b, xs_b, acc) and
// y = acc * ws. The integer sums are exact whatever instructions add them, so only the float chain fixes the bits.
// Here a vector's lanes are 8 weight rows of one activation row; in the GEMM they are 16 activation rows of one
// weight row. Each lane goes through the same operations either way.

// 8 int32 lanes → the integer block sums of 8 weight rows (the rows' vectors t[0..7]): for int4 pairs each t[r]
// holds block 2p's partial sums in lanes 0-3 and block 2p+1's in 4-7, and the two results are those blocks' sums of
// rows 0-7; for int8 each t[r] is one block's 8 partial sums, and first gets the sums (second is unused).
template <bool PAIRED>
inline void block_sums_of_rows(const __m256i t[8], __m256i& first, __m256i& second) {
  const __m256i rows0123 = _mm256_hadd_epi32(_mm256_hadd_epi32(t[0], t[1]), _mm256_hadd_epi32(t[2], t[3]));
  const __m256i rows4567 = _mm256_hadd_epi32(_mm256_hadd_epi32(t[4], t[5]), _mm256_hadd_epi32(t[6], t[7]));
  // Each: [rows' sums over lanes 0-3 | rows' sums over lanes 4-7].
  const __m256i low = _mm256_permute2x128_si256(rows0123, rows4567, 0x20);
  const __m256i high = _mm256_permute2x128_si256(rows0123, rows4567, 0x31);
  if (PAIRED) {
    first = low;
    second = high;
  } else {
    first = _mm256_add_epi32(low, high);
    second = first;
  }
}

// Integer partial sums of two int4 blocks (32 bytes) against their paired activations: lanes 0-3 over the first
// block's columns, 4-7 over the second's. Each 16-bit pair sum is at most 2 * 31 * 127: no saturation.
// HIGH (int5): low_bits and high_bits are the fifth bits of low's and high's 32 codes, in their order.
template <bool HIGH>
inline __m256i pair_sums(__m256i raw, __m256i xl, __m256i xh, uint32_t low_bits, uint32_t high_bits) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  __m256i low = _mm256_and_si256(raw, nibble);
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  if (HIGH) {
    low = _mm256_or_si256(low, fifth_bits(low_bits));
    high = _mm256_or_si256(high, fifth_bits(high_bits));
  }
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), low, xl), high, xh);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, xl), _mm256_maddubs_epi16(high, xh));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
#endif
}

// Integer partial sums of one int8 block (32 signed weights) against 32 signed activations, 8 int32 lanes. maddubs
// multiplies unsigned by signed bytes, so the weights pass their sign to the activations (|w| * sign(w) x); no
// pair sum overflows int16 (2 * 128 * 127 < 32768).
inline __m256i int8_sums(const uint8_t* bytes, const int8_t* x) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// One activation row as the int8 tiles read it: rounded (quantize_activations), per block its scale and (int4)
// xs_b * T_b, and for int4 weights the paired copy.
struct RowActivations {
  int64_t K, pair_bytes;
  std::vector<int8_t> xq;
  std::vector<float> xscale, xterm;
  std::vector<int32_t> xsum;  // per block, the sum of its rounded activations
  std::vector<int8_t, AlignedAllocator<int8_t>> lo, hi;

  RowActivations(const float* x, int64_t K_, bool is_int4)
      : K(K_), pair_bytes(32 * ((K_ / 32 + 1) / 2)), xq(K_), xscale(K_ / 32), xterm(K_ / 32), xsum(K_ / 32) {
    quantize_activations(x, 1, K, xq.data(), xscale.data());
    for (int64_t b = 0; b < K / 32; ++b) {
      int32_t total = 0;
      for (int i = 0; i < 32; ++i) total += xq[32 * b + i];
      xsum[b] = total;
      xterm[b] = xscale[b] * static_cast<float>(total);
    }
    if (is_int4) {
      lo.resize(pair_bytes);
      hi.resize(pair_bytes);
      pair_activations(xq.data(), K, lo.data(), hi.data());
    }
  }
};

// Weight rows per tile: the float chains of 16 rows run side by side, so that one row's serial chain does not
// bound the tile.
constexpr int kTileRows = 16;

// One term (scales or mins) of blocks [b0, b0 + count) (count <= 8) for the tile's 16 rows, float32, block-major
// into out[b * 16 + r]. G == 32: each row's halves for the blocks are contiguous.
inline void transpose_terms(const uint16_t* source, const int64_t rows[kTileRows], int64_t num_groups, int64_t b0,
                            int64_t count, float* out) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  // z[k] = rows k, k + 4, k + 8, k + 12 in its 128-bit lanes; lane L of z[0..3] then holds rows 4L .. 4L + 3, whose
  // 8 × 4 halves a 16-bit transpose within each lane turns into 64-bit runs of 4 rows per block.
  const __mmask8 mask = static_cast<__mmask8>((1u << count) - 1);
  __m512i z[4];
  for (int k = 0; k < 4; ++k) {
    z[k] = _mm512_castsi128_si512(_mm_maskz_loadu_epi16(mask, source + rows[k] * num_groups + b0));
    for (int lane = 1; lane < 4; ++lane)
      z[k] = _mm512_inserti32x4(z[k], _mm_maskz_loadu_epi16(mask, source + rows[k + 4 * lane] * num_groups + b0),
                                lane);
  }
  const __m512i a = _mm512_unpacklo_epi16(z[0], z[1]), b = _mm512_unpackhi_epi16(z[0], z[1]);
  const __m512i c = _mm512_unpacklo_epi16(z[2], z[3]), d = _mm512_unpackhi_epi16(z[2], z[3]);
  // Per lane, 64-bit runs: [block 0 | block 1], [2 | 3], [4 | 5], [6 | 7], each run rows 4L .. 4L + 3.
  const __m512i pairs[4] = {_mm512_unpacklo_epi32(a, c), _mm512_unpackhi_epi32(a, c), _mm512_unpacklo_epi32(b, d),
                            _mm512_unpackhi_epi32(b, d)};
  const __m512i by_block = _mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7);
  for (int p = 0; p < 4 && 2 * p < count; ++p) {
    const __m512i blocks = _mm512_permutexvar_epi64(by_block, pairs[p]);  // [block 2p rows 0-15 | block 2p + 1]
    _mm512_storeu_ps(out + (b0 + 2 * p) * kTileRows, _mm512_cvtph_ps(_mm512_castsi512_si256(blocks)));
    if (2 * p + 1 < count)
      _mm512_storeu_ps(out + (b0 + 2 * p + 1) * kTileRows, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(blocks, 1)));
  }
#else
  for (int half = 0; half < kTileRows / 8; ++half) {
    __m256 v[8];  // row r's blocks, then transposed: block j's 8 rows
    for (int r = 0; r < 8; ++r) {
      alignas(16) uint16_t padded[8] = {};
      memcpy(padded, source + rows[8 * half + r] * num_groups + b0, count * sizeof(uint16_t));
      v[r] = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(padded)));
    }
    transpose8(v);
    for (int j = 0; j < count; ++j) _mm256_storeu_ps(out + (b0 + j) * kTileRows + 8 * half, v[j]);
  }
#endif
}

// Per block of 32 columns, the tile's 16 weight rows' scales (and int4 mins) as floats, block-major:
// out[b * 16 + r]. rows[r] is the weight row of lane r. Int8 weights with one scale per row: out[r] only.
template <bool IS_INT4>
void tile_terms(const uint16_t* scales, const uint16_t* mins, const int64_t rows[kTileRows], int64_t K, int64_t G,
                float* out_scales, float* out_mins) {
  const int64_t num_blocks = K / 32, num_groups = K / G;
  if (!IS_INT4 && G == K) {
    for (int r = 0; r < kTileRows; ++r) out_scales[r] = half_to_float(scales[rows[r]]);
    return;
  }
  for (int term = 0; term < (IS_INT4 ? 2 : 1); ++term) {
    const uint16_t* source = term == 0 ? scales : mins;
    float* out = term == 0 ? out_scales : out_mins;
    if (G == 32) {
      for (int64_t b0 = 0; b0 < num_blocks; b0 += 8)
        transpose_terms(source, rows, num_groups, b0, std::min<int64_t>(8, num_blocks - b0), out);
      continue;
    }
    const int64_t blocks_per_group = G / 32;
    for (int64_t b = 0; b < num_blocks; ++b)
      for (int r = 0; r < kTileRows; ++r)
        out[b * kTileRows + r] = half_to_float(source[rows[r] * num_groups + b / blocks_per_group]);
  }
}

// The float chain (above) of a tile's 16 weight rows for one activation row, a lane per row: one 16-lane vector
// where the CPU has AVX-512 VNNI (as RowSums), two 8-lane ones elsewhere, the same operations lane by lane.
template <bool IS_INT4, bool PER_ROW>
struct Chain {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  __m512 acc = _mm512_setzero_ps();

  template <typename Sums>
  void step(Sums sums, const float* scales, const float* mins, float x_scale, float x_term) {
    const __m512 exact = _mm512_cvtepi32_ps(sums);
    if (PER_ROW) {
      acc = _mm512_fmadd_ps(exact, _mm512_set1_ps(x_scale), acc);
      return;
    }
    acc = _mm512_fmadd_ps(exact, _mm512_mul_ps(_mm512_loadu_ps(scales), _mm512_set1_ps(x_scale)), acc);
    if (IS_INT4) acc = _mm512_fmadd_ps(_mm512_loadu_ps(mins), _mm512_set1_ps(x_term), acc);
  }

  void store(const float* row_scales, float out[kTileRows]) {
    _mm512_storeu_ps(out, PER_ROW ? _mm512_mul_ps(acc, _mm512_loadu_ps(row_scales)) : acc);
  }
#else
  __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};

  template <typename Sums>
  void step(Sums sums, const float* scales, const float* mins, float x_scale, float x_term) {
    for (int h = 0; h < 2; ++h) {
      const __m256 exact = _mm256_cvtepi32_ps(sums.rows[h]);
      if (PER_ROW) {
        acc[h] = _mm256_fmadd_ps(exact, _mm256_set1_ps(x_scale), acc[h]);
        continue;
      }
      acc[h] = _mm256_fmadd_ps(exact, _mm256_mul_ps(_mm256_loadu_ps(scales + 8 * h), _mm256_set1_ps(x_scale)),
                               acc[h]);
      if (IS_INT4) acc[h] = _mm256_fmadd_ps(_mm256_loadu_ps(mins + 8 * h), _mm256_set1_ps(x_term), acc[h]);
    }
  }

  void store(const float* row_scales, float out[kTileRows]) {
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(out + 8 * h, PER_ROW ? _mm256_mul_ps(acc[h], _mm256_loadu_ps(row_scales + 8 * h)) : acc[h]);
  }
#endif
};

// Integer sums of two int4 blocks (b, b + 1) for 8 weight rows: the blocks' sums of rows 0-7 (an odd last block:
// first only).
template <bool HIGH>
inline void int4_block_sums(const RowActivations& a, const uint8_t* qweight, const uint32_t* qh, const int64_t* rows,
                            int64_t b, __m256i& first, __m256i& second) {
  const int64_t num_blocks = a.K / 32, row_bytes = a.K / 2;
  const bool single = b + 1 == num_blocks;
  const __m256i xl = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.lo.data() + 16 * b));
  const __m256i xh = _mm256_load_si256(reinterpret_cast<const __m256i*>(a.hi.data() + 16 * b));
  __m256i t[8];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* bytes = qweight + rows[r] * row_bytes + 16 * b;
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + kTileRows * row_bytes, _MM_HINT_T1);  // the next tile's
    // An odd last block: its 16 bytes and zeros (its partner's activations are zero too).
    const __m256i raw = single ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)))
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    uint32_t low_bits = 0, high_bits = 0;
    if (HIGH) {
      const uint32_t* words = qh + rows[r] * num_blocks + b;
      const uint32_t next = single ? 0u : words[1];
      low_bits = (words[0] & 0xFFFFu) | (next << 16);
      high_bits = (words[0] >> 16) | (next & 0xFFFF0000u);
    }
    t[r] = pair_sums<HIGH>(raw, xl, xh, low_bits, high_bits);
  }
  block_sums_of_rows<true>(t, first, second);
}

// Integer sums of one int8 block for 8 weight rows.
inline __m256i int8_block_sums(const RowActivations& a, const uint8_t* qweight, const int64_t* rows, int64_t b) {
  __m256i t[8];
  for (int r = 0; r < 8; ++r) {
    const uint8_t* bytes = qweight + rows[r] * a.K + 32 * b;
    _mm_prefetch(reinterpret_cast<const char*>(bytes) + 2 * kTileRows * a.K, _MM_HINT_T1);  // two tiles ahead
    t[r] = int8_sums(bytes, a.xq.data() + 32 * b);
  }
  __m256i sums, unused;
  block_sums_of_rows<false>(t, sums, unused);
  return sums;
}

// The integer block sums of a tile's 16 weight rows for one block, rows 0-15 in order: one 16-lane vector where the
// CPU has AVX-512 (VNNI), two 8-lane ones elsewhere. Integer sums are exact, so both hold the same values.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
using RowSums = __m512i;

// Per 128-bit lane the four sums of four rows, from t[0..3] whose lane holds each row's four partial sums there:
// lane k of the result holds [t0, t1, t2, t3]'s totals over lane k.
inline __m512i four_row_totals(const __m512i t[4]) {
  const __m512i t01 = _mm512_add_epi32(_mm512_unpacklo_epi32(t[0], t[1]), _mm512_unpackhi_epi32(t[0], t[1]));
  const __m512i t23 = _mm512_add_epi32(_mm512_unpacklo_epi32(t[2], t[3]), _mm512_unpackhi_epi32(t[2], t[3]));
  return _mm512_add_epi32(_mm512_unpacklo_epi64(t01, t23), _mm512_unpackhi_epi64(t01, t23));
}

// From lows (rows 0-3 in lanes 0-1, rows 8-11 in 2-3) and highs (rows 4-7, 12-15): lanes `first` and `first + 2` of
// each, as rows 0-15 in order.
template <int FIRST>
inline __m512i rows_in_order(__m512i lows, __m512i highs) {
  constexpr int kPick = FIRST | ((FIRST + 2) << 2) | (FIRST << 4) | ((FIRST + 2) << 6);
  const __m512i picked = _mm512_shuffle_i32x4(lows, highs, kPick);  // [lows f, lows f+2, highs f, highs f+2]
  return _mm512_shuffle_i32x4(picked, picked, 0b11011000);            // [lows f, highs f, lows f+2, highs f+2]
}

// Two int4 blocks (b, b + 1) of rows[0..15]: each vector t[i] holds rows i and i + 8, 32 bytes each; per row, lanes
// 0-3 are block b's partial sums and 4-7 block b + 1's. An odd last block: its 16 bytes and zeros.
template <bool HIGH>
inline void int4_row_sums(const RowActivations& a, const uint8_t* qweight, const uint32_t* qh, const int64_t* rows,
                          int64_t b, RowSums& first, RowSums& second) {
  const int64_t num_blocks = a.K / 32, row_bytes = a.K / 2;
  const bool single = b + 1 == num_blocks;
  const __m512i xl = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.lo.data() + 16 * b)));
  const __m512i xh = _mm512_broadcast_i64x4(_mm256_load_si256(reinterpret_cast<const __m256i*>(a.hi.data() + 16 * b)));
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  __m512i t[8];
  for (int i = 0; i < 8; ++i) {
    const uint8_t* upper = qweight + rows[i] * row_bytes + 16 * b;
    const uint8_t* lower = qweight + rows[i + 8] * row_bytes + 16 * b;
    if (b % 4 == 0) {  // once per 64-byte line: the next tile's
      _mm_prefetch(reinterpret_cast<const char*>(upper) + kTileRows * row_bytes, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(lower) + kTileRows * row_bytes, _MM_HINT_T1);
    }
    const auto load = [single](const uint8_t* p) {
      return single ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))
                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    };
    const __m512i raw = _mm512_inserti64x4(_mm512_castsi256_si512(load(upper)), load(lower), 1);
    __m512i low = _mm512_and_si512(raw, nibble);
    __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    if (HIGH) {
      uint64_t low_bits = 0, high_bits = 0;
      for (int half = 0; half < 2; ++half) {
        const uint32_t* words = qh + rows[i + 8 * half] * num_blocks + b;
        const uint32_t next = single ? 0u : words[1];
        low_bits |= uint64_t{(words[0] & 0xFFFFu) | (next << 16)} << (32 * half);
        high_bits |= uint64_t{(words[0] >> 16) | (next & 0xFFFF0000u)} << (32 * half);
      }
      low = _mm512_or_si512(low, _mm512_maskz_mov_epi8(low_bits, _mm512_set1_epi8(0x10)));
      high = _mm512_or_si512(high, _mm512_maskz_mov_epi8(high_bits, _mm512_set1_epi8(0x10)));
    }
    t[i] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), low, xl), high, xh);
  }
  // Per lane: lane 0 rows (0-3 | 4-7) block b, lane 1 block b + 1, lanes 2-3 the same for rows 8-11 | 12-15.
  const __m512i lows = four_row_totals(t), highs = four_row_totals(t + 4);
  first = rows_in_order<0>(lows, highs);
  second = rows_in_order<1>(lows, highs);
}

// One int8 block of rows[0..15]: weights offset to unsigned (q + 128) for dpbusd, whose sums then carry 128 times
// the block's sum of activations, taken off after (exact).
inline RowSums int8_row_sums(const RowActivations& a, const uint8_t* qweight, const int64_t* rows, int64_t b) {
  const __m512i x = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq.data() + 32 * b)));
  const __m512i offset = _mm512_set1_epi8(-128);
  __m512i t[8];
  for (int i = 0; i < 8; ++i) {
    const uint8_t* upper = qweight + rows[i] * a.K + 32 * b;
    const uint8_t* lower = qweight + rows[i + 8] * a.K + 32 * b;
    if (b % 2 == 0) {  // once per 64-byte line: two tiles ahead
      _mm_prefetch(reinterpret_cast<const char*>(upper) + 2 * kTileRows * a.K, _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(lower) + 2 * kTileRows * a.K, _MM_HINT_T1);
    }
    const __m512i raw = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(upper))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lower)), 1);
    t[i] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(raw, offset), x);
  }
  // Per lane: halves of the block (lanes 0, 1: rows 0-3 | 4-7; lanes 2, 3: rows 8-11 | 12-15); added in pairs.
  __m512i lows = four_row_totals(t), highs = four_row_totals(t + 4);
  lows = _mm512_add_epi32(lows, _mm512_shuffle_i32x4(lows, lows, 0b10110001));
  highs = _mm512_add_epi32(highs, _mm512_shuffle_i32x4(highs, highs, 0b10110001));
  return _mm512_sub_epi32(rows_in_order<0>(lows, highs), _mm512_set1_epi32(128 * a.xsum[b]));
}

inline __m512 exact_sums(RowSums sums) { return _mm512_cvtepi32_ps(sums); }
#else
struct RowSums {
  __m256i rows[2];  // rows 0-7, 8-15
};

template <bool HIGH>
inline void int4_row_sums(const RowActivations& a, const uint8_t* qweight, const uint32_t* qh, const int64_t* rows,
                          int64_t b, RowSums& first, RowSums& second) {
  for (int half = 0; half < 2; ++half)
    int4_block_sums<HIGH>(a, qweight, qh, rows + 8 * half, b, first.rows[half], second.rows[half]);
}

inline RowSums int8_row_sums(const RowActivations& a, const uint8_t* qweight, const int64_t* rows, int64_t b) {
  return RowSums{{int8_block_sums(a, qweight, rows, b), int8_block_sums(a, qweight, rows + 8, b)}};
}
#endif

// A tile's 16 weight rows (rows[r], the last row repeated past N) × one activation row: y's outputs, the first
// `valid` stored. Int4: blocks two at a time (one 32-byte load per row).
template <bool IS_INT4, bool HIGH, bool PER_ROW>
void int8_tile(const RowActivations& a, const uint8_t* qweight, const uint32_t* qh, const int64_t rows[kTileRows],
               const float* row_scales, const float* row_mins, int valid, float* y_row) {
  const int64_t num_blocks = a.K / 32;
  Chain<IS_INT4, PER_ROW> chain;
  const auto step = [&](RowSums sums, int64_t b) {
    chain.step(sums, row_scales + kTileRows * b, IS_INT4 ? row_mins + kTileRows * b : nullptr, a.xscale[b],
               a.xterm[b]);
  };
  if (IS_INT4) {
    for (int64_t b = 0; b < num_blocks; b += 2) {
      RowSums first, second;
      int4_row_sums<HIGH>(a, qweight, qh, rows, b, first, second);
      step(first, b);
      if (b + 1 < num_blocks) step(second, b + 1);
    }
  } else {
    for (int64_t b = 0; b < num_blocks; ++b) step(int8_row_sums(a, qweight, rows, b), b);
  }
  alignas(64) float out[kTileRows];
  chain.store(row_scales, out);
  for (int r = 0; r < valid; ++r) y_row[r] = out[r];
}

// y [M, N] = x [M, K] with int8 activations @ the weight [N, K]ᵀ (int4, int5 with qh, or int8): tiles of 16 weight
// rows in parallel, each against every activation row in turn (its weights stay in L1 between rows).
template <bool IS_INT4, bool HIGH, bool PER_ROW>
void linear_int8(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                 const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  std::vector<RowActivations> activations;
  activations.reserve(M);
  for (int64_t m = 0; m < M; ++m) activations.emplace_back(x + m * K, K, IS_INT4);
  const int64_t num_tiles = (N + kTileRows - 1) / kTileRows, num_blocks = K / 32;
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> row_scales(kTileRows * num_blocks), row_mins(IS_INT4 ? kTileRows * num_blocks : 0);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tiles; ++t) {
      int64_t rows[kTileRows];
      for (int r = 0; r < kTileRows; ++r) rows[r] = std::min<int64_t>(kTileRows * t + r, N - 1);
      const int valid = static_cast<int>(std::min<int64_t>(kTileRows, N - kTileRows * t));
      // The next tile's scales and mins into L2 while this one computes: read at a tile's start, they would
      // otherwise come from memory, one stall per tile.
      if (kTileRows * (t + 1) < N)
        prefetch_group_terms<IS_INT4>(scales, mins, K, G, kTileRows * (t + 1),
                                      std::min<int64_t>(kTileRows, N - kTileRows * (t + 1)));
      tile_terms<IS_INT4>(scales, mins, rows, K, G, row_scales.data(), row_mins.data());
      for (int64_t m = 0; m < M; ++m)
        int8_tile<IS_INT4, HIGH, PER_ROW>(activations[m], qweight, qh, rows, row_scales.data(), row_mins.data(),
                                          valid, y + m * N + kTileRows * t);
    }
  }
}

// ---- Float32 activations ----------------------------------------------------------------------------------------
//
// vec.h's float arithmetic (decode_block, one lane chain per column residue, fold_lanes), the weights decoded in
// registers block by block: RT weight rows × MT activation rows per tile, each decoded block feeding all MT rows.

// How far ahead of the bytes being decoded the float path prefetches weight bytes, into L2: the rows of a tile are
// adjacent in memory, so this reaches into the next tiles (benchmarks/HISTORY.md has the distances tried).
constexpr int64_t kPrefetchBytes = 8192;

template <bool IS_INT4, int RT, int MT>
void float_tile(const float* x, int64_t K, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                const uint32_t* qh, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  constexpr int kVectors = 32 / kFloatLanes;
  const int64_t num_groups = K / G, row_bytes = IS_INT4 ? K / 2 : K;
  FloatLanes acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = zero_lanes();
  for (int64_t b = 0; b < K / 32; ++b) {
    FloatLanes xv[MT][kVectors];
    for (int m = 0; m < MT; ++m)
      for (int i = 0; i < kVectors; ++i) xv[m][i] = load_lanes(x + (m0 + m) * K + 32 * b + kFloatLanes * i);
    for (int r = 0; r < RT; ++r) {
      const int64_t n = n0 + r, at = n * num_groups + 32 * b / G;
      const uint8_t* bytes = qweight + n * row_bytes + (IS_INT4 ? 16 * b : 32 * b);
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T1);
      FloatLanes w[kVectors];
      decode_block<IS_INT4>(bytes, qh == nullptr ? nullptr : qh + n * (K / 32) + b, half_to_float(scales[at]),
                            IS_INT4 ? half_to_float(mins[at]) : 0.0f, w);
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < kVectors; ++i) acc[r][m] = fma_lanes(w[i], xv[m][i], acc[r][m]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n0 + r] = fold_lanes(acc[r][m]);
}

// RT weight rows from n0 against every activation row, four at a time, then the rest in one tile.
template <bool IS_INT4, int RT>
void float_rows(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                const uint16_t* mins, const uint32_t* qh, int64_t G, int64_t n0, float* y, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 4 <= M; m0 += 4) float_tile<IS_INT4, RT, 4>(x, K, qweight, scales, mins, qh, G, n0, m0, y, N);
  switch (M - m0) {
    case 3: float_tile<IS_INT4, RT, 3>(x, K, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 2: float_tile<IS_INT4, RT, 2>(x, K, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 1: float_tile<IS_INT4, RT, 1>(x, K, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    default: break;
  }
}

template <bool IS_INT4>
void linear_f32(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  // Tiles of 4 weight rows, then the remainder one row at a time.
  const int64_t num_tiles = N / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) float_rows<IS_INT4, 4>(x, M, K, qweight, scales, mins, qh, G, 4 * t, y, N);
  for (int64_t n = 4 * num_tiles; n < N; ++n) float_rows<IS_INT4, 1>(x, M, K, qweight, scales, mins, qh, G, n, y, N);
}

}  // namespace

extern "C" {

// Arguments start with the weight's (fixed per layer, bound once in Python) and end with the call's. The int4
// products take int5 weights too: qh their high bits, or null for int4.
void int4_linear_f32(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                     int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                     int num_threads) {
  linear_f32<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_linear_f32(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const float* x, int64_t M, float* y, int num_threads) {
  linear_f32<false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size, y,
                    num_threads);
}

// The same products with activations rounded to int8 per 32 columns (quantize_activations), any number of rows,
// in the arithmetic gemm.cpp's int8 GEMM shares (above).
void int4_linear_int8x(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                       int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                       int num_threads) {
  if (qh == nullptr)
    linear_int8<true, false, false>(x, M, K, qweight, scales, mins, nullptr, N, group_size, y, num_threads);
  else
    linear_int8<true, true, false>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_linear_int8x(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                       const float* x, int64_t M, float* y, int num_threads) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(qweight);
  if (group_size == K)
    linear_int8<false, false, true>(x, M, K, bytes, scales, nullptr, nullptr, N, group_size, y, num_threads);
  else
    linear_int8<false, false, false>(x, M, K, bytes, scales, nullptr, nullptr, N, group_size, y, num_threads);
}

}  // extern "C"
