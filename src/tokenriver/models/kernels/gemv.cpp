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
//   int8: qweight [N, K] int8, scales [N, K/G] float16: w[n, k] = scale[n, k/G] * q[n, k].
// Activations x [M, K] and outputs y [M, N] are float32, row-major and contiguous.
//
// The sum is split per group: y[m, n] = sum_g scale_g * (sum_{k in g} q_k x_k) + sum_g min_g * (sum_{k in g} x_k).
// The second term needs only the per-group sums of x, computed once per call and shared by every output.
// Two arithmetic modes: float32 activations (exact up to summation order), or activations rounded to int8 per 32
// columns and multiplied as integers, as llama.cpp does (fewer instructions per weight; see quantize_activations).
// Parallel over output rows with OpenMP; it shares PyTorch's libgomp (same soname), so the threads are PyTorch's.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>

#include <vector>

#include "vec.h"

namespace {

using tokenriver::decode_int4;
using tokenriver::decode_int8;
using tokenriver::half_to_float;
using tokenriver::horizontal_sum;

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

// How far ahead of the bytes being decoded to prefetch weight bytes. The rows of a tile are adjacent in memory,
// so this reaches into the next tiles; measured on a cold 49152×576 int8 matrix, one thread: 5.2 GB/s without,
// 8.1 / 9.0 / 9.4 GB/s at 1 / 2 / 4 KB ahead.
constexpr int64_t kPrefetchBytes = 4096;

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
// a flat loop with every accumulator in a register, which measured 1.7x faster than accumulating per group
// first (that version kept its per-group sums on the stack). The min term sum_g min_g * xsum_g is a short dot
// product done once at the end.
template <bool IS_INT4, int RT, int MT>
void tile(const float* x, int64_t K, const float* xsum, const uint8_t* qweight, const uint16_t* scales,
          const uint16_t* mins, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
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
        _mm_prefetch(reinterpret_cast<const char*>(row + (IS_INT4 ? k / 2 : k)) + kPrefetchBytes, _MM_HINT_T0);
        __m256 w[4];
        if (IS_INT4)
          decode_int4(row + k / 2, w);
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

// Activations quantized to int8 per run of 32 columns, as llama.cpp does on CPUs: x ≈ xscale * xq with
// xscale = max|x| / 127 over the run and xq = round(x / xscale). Integer products then cost one instruction per
// 32 weights (maddubs) instead of four conversions and four FMAs; the error is that of rounding x to 8 bits.
void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* xq, float* xscale) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  // packs works within 128-bit lanes; this puts the 8 groups of 4 bytes back in column order.
  const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t run = 0; run < M * K / 32; ++run) {
    const float* in = x + 32 * run;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_ps(in + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[i]));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f;
    xscale[run] = scale;
    // Round half to even (the default MXCSR mode), as torch.round does; |q| <= 127, so packing never saturates.
    const __m256 divisor = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
    __m256i q[4];
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(v[i], divisor));
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 32 * run), _mm256_permutevar8x32_epi32(bytes, lane_order));
  }
}

// 32 int4 columns (16 bytes) → 32 unsigned bytes 0..15 in column order (low nibbles, then high nibbles).
inline __m256i int4_bytes(const uint8_t* bytes) {
  __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// Integer dot of 32 weight bytes with 32 int8 activations → 8 int32 partial sums as floats. maddubs multiplies
// unsigned by signed bytes, so int8 weights pass their sign to the activations (|w| * sign(w) x); no pair sum
// overflows int16 (2 * 128 * 127 < 32768).
template <bool IS_INT4>
inline __m256 dot32(__m256i w, __m256i xq) {
  const __m256i pairs = IS_INT4 ? _mm256_maddubs_epi16(w, xq)
                                : _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(xq, w));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// tile() with int8 activations: the same tiling, scales and min term.
template <bool IS_INT4, int RT, int MT>
void tile_q8(const int8_t* xq, const float* xscale, int64_t K, const float* xsum, const uint8_t* qweight,
             const uint16_t* scales, const uint16_t* mins, int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  const int64_t num_groups = K / G;
  const int64_t row_bytes = IS_INT4 ? K / 2 : K;
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
          _mm_prefetch(reinterpret_cast<const char*>(row + (IS_INT4 ? k / 2 : k)) + kPrefetchBytes, _MM_HINT_T0);
          const __m256i w = IS_INT4 ? int4_bytes(row + k / 2)
                                    : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k));
          for (int m = 0; m < MT; ++m) partial[r][m] = _mm256_fmadd_ps(dot32<IS_INT4>(w, xv[m]), xs[m], partial[r][m]);
        }
      }
      for (int r = 0; r < RT; ++r) {
        const __m256 scale = _mm256_broadcast_ss(&scale_buffer[r][g - g0]);
        for (int m = 0; m < MT; ++m) acc[r][m] = _mm256_fmadd_ps(scale, partial[r][m], acc[r][m]);
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
                     int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  if (INT8_X)
    tile_q8<IS_INT4, RT, MT>(a.xq, a.xscale, a.K, a.xsum, qweight, scales, mins, G, n0, m0, y, N);
  else
    tile<IS_INT4, RT, MT>(a.x, a.K, a.xsum, qweight, scales, mins, G, n0, m0, y, N);
}

// Four output rows of one activation-row count MT: each decoded weight vector feeds all MT activation rows.
template <bool IS_INT4, bool INT8_X, int MT>
inline void four_rows_of(const Activations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
                         int64_t G, int64_t n0, int64_t m0, float* y, int64_t N) {
  for (int r = 0; r < 4; ++r) run_tile<IS_INT4, INT8_X, 1, MT>(a, qweight, scales, mins, G, n0 + r, m0, y, N);
}

// Four output rows starting at n0 against every activation row. Eight activation rows at a time, then the rest in
// one tile, so every weight is decoded once per eight rows: speculative verification (1 + k rows) then costs
// little more than one row. A single activation row takes 4 output rows per tile instead (its activations are
// loaded once for all four), two take 2 × 2.
template <bool IS_INT4, bool INT8_X>
void four_rows(const Activations& a, const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins,
               int64_t G, int64_t n0, float* y, int64_t N) {
  int64_t m0 = 0;
  for (; m0 + 8 <= a.M; m0 += 8) four_rows_of<IS_INT4, INT8_X, 8>(a, qweight, scales, mins, G, n0, m0, y, N);
  switch (a.M - m0) {
    case 1: run_tile<IS_INT4, INT8_X, 4, 1>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    case 2:
      for (int r = 0; r < 4; r += 2) run_tile<IS_INT4, INT8_X, 2, 2>(a, qweight, scales, mins, G, n0 + r, m0, y, N);
      break;
    case 3: four_rows_of<IS_INT4, INT8_X, 3>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    case 4: four_rows_of<IS_INT4, INT8_X, 4>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    case 5: four_rows_of<IS_INT4, INT8_X, 5>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    case 6: four_rows_of<IS_INT4, INT8_X, 6>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    case 7: four_rows_of<IS_INT4, INT8_X, 7>(a, qweight, scales, mins, G, n0, m0, y, N); break;
    default: break;
  }
}

template <bool IS_INT4, bool INT8_X>
void linear(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
            const uint16_t* mins, int64_t N, int64_t G, float* y, int num_threads) {
  std::vector<int8_t> xq;
  std::vector<float> xscale;
  std::vector<float> rounded;  // the activations the int8 products see, so the min term sees the same ones
  if (INT8_X) {
    xq.resize(M * K);
    xscale.resize(M * K / 32);
    quantize_activations(x, M, K, xq.data(), xscale.data());
    if (IS_INT4) {
      rounded.resize(M * K);
      for (int64_t i = 0; i < M * K; ++i) rounded[i] = xscale[i / 32] * xq[i];
    }
  }
  std::vector<float> xsum;
  if (IS_INT4) xsum = group_sums(INT8_X ? rounded.data() : x, M, K, G);
  const Activations a{x, M, K, xsum.data(), xq.data(), xscale.data()};
  // Tiles of 4 output rows, then the remainder one row at a time.
  const int64_t num_tiles = N / 4;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) four_rows<IS_INT4, INT8_X>(a, qweight, scales, mins, G, 4 * t, y, N);
  for (int64_t n = 4 * num_tiles; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) run_tile<IS_INT4, INT8_X, 1, 1>(a, qweight, scales, mins, G, n, m, y, N);
}

}  // namespace

extern "C" {

// Arguments start with the weight's (fixed per layer, bound once in Python) and end with the call's.
void int4_linear_f32(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                     int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  linear<true, false>(x, M, K, qweight, scales, mins, N, group_size, y, num_threads);
}

void int8_linear_f32(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     const float* x, int64_t M, float* y, int num_threads) {
  linear<false, false>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, N, group_size, y,
                       num_threads);
}

// The same products with activations rounded to int8 per 32 columns (quantize_activations).
void int4_linear_int8x(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                       int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  linear<true, true>(x, M, K, qweight, scales, mins, N, group_size, y, num_threads);
}

void int8_linear_int8x(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                       const float* x, int64_t M, float* y, int num_threads) {
  linear<false, true>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, N, group_size, y,
                      num_threads);
}

}  // extern "C"
