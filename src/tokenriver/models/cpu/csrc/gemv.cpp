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
// The sum is split per group: y[m, n] = sum_g scale_g * (sum_{k in g} q_k x_k) + sum_g min_g * (sum_{k in g} x_k).
// The second term needs only the per-group sums of x, computed once per call and shared by every output.
// Two arithmetic modes: float32 activations (exact up to summation order), or activations rounded to int8 per 32
// columns and multiplied as integers, as llama.cpp does (see quantize_activations). For int4 weights the float
// path is bound by decoding (about sixteen vector operations per 16 weight bytes) and streams the weights at about
// half the memory speed; the int8 path (int4_pair_tile) takes about a third of the operations and keeps up with it.
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
using tokenriver::decode_int8;
using tokenriver::fifth_bits;
using tokenriver::half_to_float;
using tokenriver::horizontal_sum;
using tokenriver::quantize_activations;

// Per-group sums of x: xsum [M, K/G].
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t G) {
  int64_t num_groups = K / G;
  std::vector<float> sums(M * num_groups);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < num_groups; ++g) {
      float s = 0.0f;
      for (int64_t k = g * G; k < (g + 1) * G; ++k) s += x[m * K + k];
      sums[m * num_groups + g] = s;
    }
  return sums;
}

// How far ahead of the bytes being decoded to prefetch weight bytes, and into which cache. The rows of a tile are
// adjacent in memory, so this reaches into the next tiles. Into L2, 8 KB ahead: faster than into L1 4 KB ahead,
// and 16 KB ahead was no better (benchmarks/HISTORY.md). Without any prefetch the products ran at half the speed.
constexpr int64_t kPrefetchBytes = 8192;

// Groups whose float16 scales are converted to float32 at a time, into a buffer on the stack.
constexpr int64_t kScaleChunk = 64;

// Float16 → float32 for n values (n <= kScaleChunk), eight at a time.
inline void halves_to_floats(const uint16_t* in, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
  for (; i < n; ++i) out[i] = half_to_float(in[i]);
}

// sum_g min_g * xsum_g over one weight row: the part of an int4 product that the mins contribute.
inline float min_term(const uint16_t* row_mins, const float* row_xsum, int64_t num_groups) {
  __m256 acc = _mm256_setzero_ps();
  int64_t g = 0;
  for (; g + 8 <= num_groups; g += 8)
    acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row_mins + g))),
                          _mm256_loadu_ps(row_xsum + g), acc);
  float total = horizontal_sum(acc);
  for (; g < num_groups; ++g) total += half_to_float(row_mins[g]) * row_xsum[g];
  return total;
}

// RT output rows × MT activation rows (RT * MT <= 8). Per 32 columns each (row, activation row) pair takes two
// short partial sums (four products), scales them by the block's group scale and adds them into its accumulator:
// a flat loop with every accumulator in a register, which beat accumulating per group first (that version kept
// its per-group sums on the stack). The min term sum_g min_g * xsum_g is a short dot
// product done once at the end.
template <bool IS_INT4, int RT, int MT>
void tile(const float* x, int64_t K, const float* xsum, const uint8_t* qweight, const uint16_t* scales,
          const uint16_t* mins, const uint32_t* qh, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  const int64_t num_groups = K / G;
  const int64_t row_bytes = IS_INT4 ? K / 2 : K;
  const int64_t blocks_per_group = G / 32;
  __m256 acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  for (int64_t g = 0; g < num_groups; ++g) {
    float scale_of_row[RT];
    for (int r = 0; r < RT; ++r) scale_of_row[r] = half_to_float(scales[(n0 + r) * num_groups + g]);
    for (int64_t block = 0; block < blocks_per_group; ++block) {
      const int64_t k = (g * blocks_per_group + block) * 32;
      // Activations loaded once per 32 columns and reused by every output row of the tile.
      __m256 xv[MT][4];
      for (int m = 0; m < MT; ++m)
        for (int i = 0; i < 4; ++i) xv[m][i] = _mm256_loadu_ps(x + (m0 + m) * K + k + 8 * i);
      for (int r = 0; r < RT; ++r) {
        const uint8_t* row = qweight + (n0 + r) * row_bytes;
        _mm_prefetch(reinterpret_cast<const char*>(row + (IS_INT4 ? k / 2 : k)) + kPrefetchBytes, _MM_HINT_T1);
        __m256 w[4];
        if (IS_INT4)
          decode_int4(row + k / 2, w, qh == nullptr ? nullptr : qh + (n0 + r) * (K / 32) + k / 32);
        else
          decode_int8(reinterpret_cast<const int8_t*>(row + k), w);
        const __m256 scale = _mm256_set1_ps(scale_of_row[r]);
        for (int m = 0; m < MT; ++m) {
          __m256 even = _mm256_mul_ps(w[0], xv[m][0]);
          __m256 odd = _mm256_mul_ps(w[1], xv[m][1]);
          even = _mm256_fmadd_ps(w[2], xv[m][2], even);
          odd = _mm256_fmadd_ps(w[3], xv[m][3], odd);
          acc[r][m] = _mm256_fmadd_ps(scale, _mm256_add_ps(even, odd), acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) {
      float total = horizontal_sum(acc[r][m]);
      if (IS_INT4) total += min_term(mins + (n0 + r) * num_groups, xsum + (m0 + m) * num_groups, num_groups);
      y[(m0 + m) * N + n0 + r] = total;
    }
}

// Integer dot of 32 int8 weights with 32 int8 activations → 8 int32 partial sums as floats. maddubs multiplies
// unsigned by signed bytes, so the weights pass their sign to the activations (|w| * sign(w) x); no pair sum
// overflows int16 (2 * 128 * 127 < 32768).
inline __m256 dot32(__m256i w, __m256i xq) {
  const __m256i pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// tile() with int8 activations, for int8 weights (int4 weights take int4_pair_tile): the same tiling and scales.
// Int8 weights stream at memory speed on either path; this one exists for llama.cpp's arithmetic.
template <int RT, int MT>
void tile_q8(const int8_t* xq, const float* xscale, int64_t K, const uint8_t* qweight, const uint16_t* scales,
             int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  const int64_t num_groups = K / G;
  const int64_t row_bytes = K;
  __m256 acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  alignas(32) float scale_buffer[RT][kScaleChunk];
  for (int64_t g0 = 0; g0 < num_groups; g0 += kScaleChunk) {
    const int64_t chunk = num_groups - g0 < kScaleChunk ? num_groups - g0 : kScaleChunk;
    for (int r = 0; r < RT; ++r) halves_to_floats(scales + (n0 + r) * num_groups + g0, chunk, scale_buffer[r]);
    for (int64_t g = g0; g < g0 + chunk; ++g) {
      __m256 partial[RT][MT];
      for (int r = 0; r < RT; ++r)
        for (int m = 0; m < MT; ++m) partial[r][m] = _mm256_setzero_ps();
      for (int64_t k = g * G; k < (g + 1) * G; k += 32) {
        __m256i xv[MT];
        __m256 xs[MT];
        for (int m = 0; m < MT; ++m) {
          xv[m] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (m0 + m) * K + k));
          xs[m] = _mm256_broadcast_ss(xscale + ((m0 + m) * K + k) / 32);
        }
        for (int r = 0; r < RT; ++r) {
          const uint8_t* row = qweight + (n0 + r) * row_bytes;
          _mm_prefetch(reinterpret_cast<const char*>(row + k) + kPrefetchBytes, _MM_HINT_T1);
          const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
          for (int m = 0; m < MT; ++m) partial[r][m] = _mm256_fmadd_ps(dot32(w, xv[m]), xs[m], partial[r][m]);
        }
      }
      for (int r = 0; r < RT; ++r) {
        const __m256 scale = _mm256_broadcast_ss(&scale_buffer[r][g - g0]);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(scale, partial[r][m], acc[r][m]);
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) y[(m0 + m) * N + n0 + r] = horizontal_sum(acc[r][m]);
}

// One row of int8 activations in the order int4_pair_tile reads them. For blocks 2p and 2p+1 (32 columns each),
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

// Two int4 blocks (32 bytes) against their paired activations: 8 int32 sums as floats, lanes 0-3 over the first
// block's columns, 4-7 over the second's. Each 16-bit pair sum is at most 2 * 15 * 127, the sum of the low and
// high halves twice that: no saturation.
// HIGH (int5): low_bits and high_bits are the fifth bits of low's and high's 32 codes, in their order; the sums
// stay within int16 (2 * (31 * 127) * 2 < 32768).
template <bool HIGH = false>
inline __m256 pair_sums(const uint8_t* bytes, const int8_t* lo, const int8_t* hi, uint32_t low_bits = 0,
                        uint32_t high_bits = 0) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  __m256i low = _mm256_and_si256(raw, nibble);
  __m256i high = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
  if (HIGH) {
    low = _mm256_or_si256(low, fifth_bits(low_bits));
    high = _mm256_or_si256(high, fifth_bits(high_bits));
  }
  const __m256i xl = _mm256_load_si256(reinterpret_cast<const __m256i*>(lo));
  const __m256i xh = _mm256_load_si256(reinterpret_cast<const __m256i*>(hi));
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  // One instruction per 32 bytes where the CPU has VNNI: unsigned nibbles times signed activations, each four
  // products summed into an int32 lane. The same integer sums as the three instructions below.
  return _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), low, xl), high, xh));
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(low, xl), _mm256_maddubs_epi16(high, xh));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// Int4 weights against int8 activations, two blocks per step: per 32 weight bytes and activation row, two maddubs,
// an add, a madd, a conversion and one FMA by [s_2p x4 | s_2p+1 x4] (s_b = weight scale * activation scale of block
// b), about a third of the float path's operations per weight, so the product streams the weights at memory speed.
// Block scales are built 8 blocks at a time, permuted to [s0 s2 s4 s6 | s1 s3 s5 s7] so that pair j's scales are
// element j of each 128-bit half, an in-lane broadcast. block_group[b] is block b's group (no division per row).
// The result for an (output row, activation row) pair is the same whatever RT and MT: the tile shape only decides
// which loads are shared.
// HIGH: int5 weights, qh their high bits. A pair's low codes are columns 0-15 of both blocks, its high codes
// columns 16-31 of both (pair_activations), so each takes half of either block's word.
template <int RT, int MT, bool HIGH>
void int4_pair_tile(const int8_t* lo, const int8_t* hi, const float* xscale, const float* xsum,
                    const int32_t* block_group, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                    const uint16_t* mins, const uint32_t* qh, int64_t G, int64_t n0, int64_t m0, float* y,
                    int64_t N) {
  const auto low_bits = [](uint32_t first, uint32_t second) { return (first & 0xFFFFu) | (second << 16); };
  const auto high_bits = [](uint32_t first, uint32_t second) { return (first >> 16) | (second & 0xFFFF0000u); };
  const int64_t num_blocks = K / 32, num_groups = K / G, pair_bytes = 32 * ((num_blocks + 1) / 2);
  const int64_t row_bytes = K / 2;
  const __m256i by_pair = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const int8_t* lo_rows = lo + m0 * pair_bytes;
  const int8_t* hi_rows = hi + m0 * pair_bytes;
  const float* xscale_rows = xscale + m0 * num_blocks;
  __m256 acc[RT][MT];
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t b0 = 0;
  for (; b0 + 8 <= num_blocks; b0 += 8) {
    alignas(32) float block_scale[RT][MT][8];
    for (int r = 0; r < RT; ++r) {
      const uint16_t* row_scales = scales + (n0 + r) * num_groups;
      __m128i halves;
      if (G == 32) {
        halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_scales + b0));
      } else {
        alignas(16) uint16_t gathered[8];
        for (int b = 0; b < 8; ++b) gathered[b] = row_scales[block_group[b0 + b]];
        halves = _mm_load_si128(reinterpret_cast<const __m128i*>(gathered));
      }
      const __m256 weight_scale = _mm256_cvtph_ps(halves);
      for (int m = 0; m < MT; ++m)
        _mm256_store_ps(block_scale[r][m], _mm256_permutevar8x32_ps(
            _mm256_mul_ps(weight_scale, _mm256_loadu_ps(xscale_rows + m * num_blocks + b0)), by_pair));
    }
    // Pair j of the 8 blocks, j a compile-time constant so that the in-lane broadcast takes an immediate and
    // every loop unrolls: the RT * MT accumulators then stay in registers.
    const auto pair = [&](auto j) {
      constexpr int kBroadcast = decltype(j)::value * 0x55;
      const int64_t at = 16 * b0 + 32 * decltype(j)::value;
#pragma GCC unroll 8
      for (int r = 0; r < RT; ++r) {
        const uint8_t* bytes = qweight + (n0 + r) * row_bytes + at;
        _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T1);
        uint32_t first_bits = 0, second_bits = 0;
        if (HIGH) {
          const uint32_t* words = qh + (n0 + r) * num_blocks + b0 + 2 * decltype(j)::value;
          first_bits = low_bits(words[0], words[1]);
          second_bits = high_bits(words[0], words[1]);
        }
#pragma GCC unroll 8
        for (int m = 0; m < MT; ++m) {
          const __m256 sums = pair_sums<HIGH>(bytes, lo_rows + m * pair_bytes + at, hi_rows + m * pair_bytes + at,
                                              first_bits, second_bits);
          const __m256 scale = _mm256_permute_ps(_mm256_load_ps(block_scale[r][m]), kBroadcast);
          acc[r][m] = _mm256_fmadd_ps(sums, scale, acc[r][m]);
        }
      }
    };
    pair(std::integral_constant<int, 0>{});
    pair(std::integral_constant<int, 1>{});
    pair(std::integral_constant<int, 2>{});
    pair(std::integral_constant<int, 3>{});
  }
  // The last 1-7 blocks a pair at a time; an odd last block reads its 16 bytes into a zero-padded copy.
  for (; b0 < num_blocks; b0 += 2) {
    const bool single = b0 + 1 == num_blocks;
    const int64_t at = 16 * b0;
    for (int r = 0; r < RT; ++r) {
      const uint16_t* row_scales = scales + (n0 + r) * num_groups;
      const float first_weight_scale = half_to_float(row_scales[block_group[b0]]);
      const float second_weight_scale = single ? 0.0f : half_to_float(row_scales[block_group[b0 + 1]]);
      alignas(32) uint8_t padded[32] = {};
      const uint8_t* bytes = qweight + (n0 + r) * row_bytes + at;
      // The rows' last bytes too: rows whose length is not a multiple of 256 bytes would otherwise leave a line
      // of every row unprefetched, a DRAM stall per row.
      _mm_prefetch(reinterpret_cast<const char*>(bytes) + kPrefetchBytes, _MM_HINT_T1);
      if (single) {
        memcpy(padded, bytes, 16);
        bytes = padded;
      }
      uint32_t first_bits = 0, second_bits = 0;
      if (HIGH) {
        const uint32_t* words = qh + (n0 + r) * num_blocks + b0;
        const uint32_t second_word = single ? 0u : words[1];
        first_bits = low_bits(words[0], second_word);
        second_bits = high_bits(words[0], second_word);
      }
      for (int m = 0; m < MT; ++m) {
        const float* xs = xscale_rows + m * num_blocks + b0;
        const float first = first_weight_scale * xs[0], second = single ? 0.0f : second_weight_scale * xs[1];
        const __m256 scale = _mm256_setr_ps(first, first, first, first, second, second, second, second);
        const __m256 sums = pair_sums<HIGH>(bytes, lo_rows + m * pair_bytes + at, hi_rows + m * pair_bytes + at,
                                            first_bits, second_bits);
        acc[r][m] = _mm256_fmadd_ps(sums, scale, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int m = 0; m < MT; ++m)
      y[(m0 + m) * N + n0 + r] = horizontal_sum(acc[r][m]) +
                                 min_term(mins + (n0 + r) * num_groups, xsum + (m0 + m) * num_groups, num_groups);
}

// The activations as the tiles read them: float rows, their per-group sums, and (int8 mode) their int8 copy.
struct Activations {
  const float* x;       // [M, K]
  int64_t M, K;
  const float* xsum;    // [M, K/G], int4 only
  const int8_t* xq;     // [M, K], int8 mode only
  const float* xscale;  // [M, K/32], int8 mode only
};

template <bool IS_INT4, bool INT8_X, int RT, int MT>
inline void run_tile(const Activations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                     const uint32_t* qh, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  static_assert(!(IS_INT4 && INT8_X), "int4 weights with int8 activations run int4_linear_pairs");
  if (INT8_X)
    tile_q8<RT, MT>(a.xq, a.xscale, a.K, qweight, scales, G, n0, m0, y, N);
  else
    tile<IS_INT4, RT, MT>(a.x, a.K, a.xsum, qweight, scales, mins, qh, G, n0, m0, y, N);
}

// Four output rows of one activation-row count MT: each decoded weight vector feeds all MT activation rows.
template <bool IS_INT4, bool INT8_X, int MT>
inline void four_rows_of(const Activations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                         const uint32_t* qh, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  for (int r = 0; r < 4; ++r) run_tile<IS_INT4, INT8_X, 1, MT>(a, qweight, scales, mins, qh, G, n0 + r, m0, y, N);
}

// Four output rows starting at n0 against every activation row. Eight activation rows at a time, then the rest in
// one tile, so every weight is decoded once per eight rows: speculative verification (1 + k rows) then costs
// little more than one row. A single activation row takes 4 output rows per tile instead (its activations are
// loaded once for all four), two take 2 × 2.
template <bool IS_INT4, bool INT8_X>
void four_rows(const Activations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
               const uint32_t* qh, int64_t G, int64_t n0, float* y, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 8 <= a.M; m0 += 8) four_rows_of<IS_INT4, INT8_X, 8>(a, qweight, scales, mins, qh, G, n0, m0, y, N);
  switch (a.M - m0) {
    case 1: run_tile<IS_INT4, INT8_X, 4, 1>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 2:
      for (int r = 0; r < 4; r += 2)
        run_tile<IS_INT4, INT8_X, 2, 2>(a, qweight, scales, mins, qh, G, n0 + r, m0, y, N);
      break;
    case 3: four_rows_of<IS_INT4, INT8_X, 3>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 4: four_rows_of<IS_INT4, INT8_X, 4>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 5: four_rows_of<IS_INT4, INT8_X, 5>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 6: four_rows_of<IS_INT4, INT8_X, 6>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    case 7: four_rows_of<IS_INT4, INT8_X, 7>(a, qweight, scales, mins, qh, G, n0, m0, y, N); break;
    default: break;
  }
}

// Activation rows quantized for int4_pair_tile, one row per call (rows are independent and run in parallel):
// xq and xscale as quantize_activations makes them, the paired copies, and the per-group sums of the rounded
// activations that the min term multiplies.
struct PairedActivations {
  int64_t K, G, pair_bytes;
  std::vector<int8_t> xq;
  std::vector<float> xscale, xsum;
  std::vector<int8_t, AlignedAllocator<int8_t>> lo, hi;
  std::vector<int32_t> block_group;

  PairedActivations(const float* x, int64_t M, int64_t K_, int64_t G_, int num_threads)
      : K(K_), G(G_), pair_bytes(32 * ((K_ / 32 + 1) / 2)), xq(M * K_), xscale(M * K_ / 32), xsum(M * K_ / G_),
        lo(M * pair_bytes), hi(M * pair_bytes), block_group(K_ / 32) {
    for (int64_t b = 0; b < K / 32; ++b) block_group[b] = static_cast<int32_t>(b * 32 / G);
#pragma omp parallel for num_threads(num_threads) schedule(static) if (M >= 16)
    for (int64_t m = 0; m < M; ++m) {
      quantize_activations(x + m * K, 1, K, xq.data() + m * K, xscale.data() + m * K / 32);
      // Per group: each block's exact integer sum times its scale, one multiply per 32 values.
      for (int64_t g = 0; g < K / G; ++g) {
        float sum = 0.0f;
        for (int64_t b = g * G / 32; b < (g + 1) * G / 32; ++b) {
          const int8_t* block = xq.data() + m * K + 32 * b;
          int32_t block_sum = 0;
          for (int i = 0; i < 32; ++i) block_sum += block[i];
          sum += xscale[m * (K / 32) + b] * static_cast<float>(block_sum);
        }
        xsum[m * (K / G) + g] = sum;
      }
      pair_activations(xq.data() + m * K, K, lo.data() + m * pair_bytes, hi.data() + m * pair_bytes);
    }
  }
};

// Activation rows [m_begin, m_end) against RT weight rows from n0, three activation rows per tile.
template <int RT, bool HIGH>
void pair_rows(const PairedActivations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
               const uint32_t* qh, int64_t n0, int64_t m_begin, int64_t m_end, float* y, int64_t N) {
  const auto tile = [&](auto rows, int64_t m0) {
    int4_pair_tile<RT, decltype(rows)::value, HIGH>(a.lo.data(), a.hi.data(), a.xscale.data(), a.xsum.data(),
                                                    a.block_group.data(), a.K, qweight, scales, mins, qh, a.G, n0,
                                                    m0, y, N);
  };
  int64_t m0 = m_begin;
  for (; m0 + 3 <= m_end; m0 += 3) tile(std::integral_constant<int, 3>{}, m0);
  if (m_end - m0 == 2) tile(std::integral_constant<int, 2>{}, m0);
  if (m_end - m0 == 1) tile(std::integral_constant<int, 1>{}, m0);
}

// Paired activation bytes per pass: they should stay in L2 while every weight tile sweeps over them.
constexpr int64_t kPairChunkBytes = 256 * 1024;

// Int4 weights with int8 activations, any number of rows. Every output is int4_pair_tile's arithmetic on its own
// (weight row, activation row) pair, in the same order whatever the tile shape, so a row's result does not depend
// on how many rows came with it: one row (decode) and 2,048 (prefill) give the same bits for the same row.
template <bool HIGH>
void int4_linear_pairs(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
                       const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  const PairedActivations a(x, M, K, G, num_threads);
  const int64_t chunk = std::max<int64_t>(3, kPairChunkBytes / (2 * a.pair_bytes) / 3 * 3);
  for (int64_t m_begin = 0; m_begin < M; m_begin += chunk) {
    const int64_t m_end = std::min(M, m_begin + chunk);
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t t = 0; t < N / 4; ++t)
      pair_rows<4, HIGH>(a, qweight, scales, mins, qh, 4 * t, m_begin, m_end, y, N);
    for (int64_t n = 4 * (N / 4); n < N; ++n)
      pair_rows<1, HIGH>(a, qweight, scales, mins, qh, n, m_begin, m_end, y, N);
  }
}

template <bool IS_INT4, bool INT8_X>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
            const uint16_t* mins, const uint32_t* qh, int64_t N, int64_t G, float* y, int num_threads) {
  std::vector<int8_t> xq;
  std::vector<float> xscale;
  if (INT8_X) {
    xq.resize(M * K);
    xscale.resize(M * K / 32);
    quantize_activations(x, M, K, xq.data(), xscale.data());
  }
  std::vector<float> xsum;
  if (IS_INT4) xsum = group_sums(x, M, K, G);
  const Activations a{x, M, K, xsum.data(), xq.data(), xscale.data()};
  // Tiles of 4 output rows, then the remainder one row at a time.
  const int64_t num_tiles = N / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) four_rows<IS_INT4, INT8_X>(a, qweight, scales, mins, qh, G, 4 * t, y, N);
  for (int64_t n = 4 * num_tiles; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) run_tile<IS_INT4, INT8_X, 1, 1>(a, qweight, scales, mins, qh, G, n, m, y, N);
}

}  // namespace

extern "C" {

// Arguments start with the weight's (fixed per layer, bound once in Python) and end with the call's. The int4
// products take int5 weights too: qh their high bits, or null for int4.
void int4_linear_f32(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                     int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                     int num_threads) {
  linear<true, false>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_linear_f32(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const float* x, int64_t M, float* y, int num_threads) {
  linear<false, false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size,
                       y, num_threads);
}

// The same products with activations rounded to int8 per 32 columns (quantize_activations).
void int4_linear_int8x(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                       int64_t N, int64_t K, int64_t group_size, const float* x, int64_t M, float* y,
                       int num_threads) {
  if (qh == nullptr)
    int4_linear_pairs<false>(x, M, K, qweight, scales, mins, nullptr, N, group_size, y, num_threads);
  else
    int4_linear_pairs<true>(x, M, K, qweight, scales, mins, qh, N, group_size, y, num_threads);
}

void int8_linear_int8x(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                       const float* x, int64_t M, float* y, int num_threads) {
  linear<false, true>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, nullptr, N, group_size,
                      y, num_threads);
}

}  // extern "C"
