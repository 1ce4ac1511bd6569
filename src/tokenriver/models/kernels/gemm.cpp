// Quantized matrix products of many activation rows (batched decode, prefill) on x86-64 CPUs with AVX2 + FMA.
//
// With 17 or more rows a product is bound by arithmetic, not by reading the weights, so the weights are decoded
// to float32 once per call, a few rows at a time into a small buffer, and every activation row reuses them there.
// No float32 copy of the model is kept: for the embedded model that copy was 540 MB, and MKL's sgemm on it ran
// at 60-110 GFLOP/s on these shapes (17 to 64 rows, K of 576 or 1536) against ~165 at large square sizes.
//
// The register tile is 6 weight rows × 16 activation rows: per column k, two vector loads of the activations
// (stored transposed, [K, M], so that 8 rows are one vector), six broadcasts of decoded weights and twelve FMAs
// into twelve accumulators. Each output y[m, n] is the sum over k in order 0..K-1 of one FMA per column, in its
// own accumulator lane: the result for a row does not depend on how many other rows are in the batch or where
// it sits in it, so batching never changes a sequence's logits.
//
// Where the CPU has AVX512-BF16 a second arithmetic is compiled in (Bf16Pairs below), for models/quant.py's
// rounded mode: the decoded weights and the activations are rounded to bfloat16 and multiplied by dot-product
// instructions that sum pairs of products into float32, twice an FMA's arithmetic per instruction. Same tiles,
// same per-row independence; on this machine a 512-token prefill ran 1.58x faster (1,301 vs 824 tokens/s, medians
// of 10 alternating runs, faster in all 10) and 64 sequences x 128 tokens 1.36x (639 vs 471, 4 of 4).
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
using tokenriver::half_to_float;

// Weight rows per tile, activation rows per vector, and activation rows per packed panel (two vectors).
constexpr int kRows = 6;
constexpr int kLanes = 8;
constexpr int kPanel = 2 * kLanes;

// Activation rows transposed per pass: [K, chunk] floats should sit in L2 (512 KB) while every weight tile of the
// matrix sweeps over them. Larger batches are taken in chunks, each re-decoding the weights (cheap next to the
// chunk's arithmetic: ~20 instructions per 32 weights against 2 FMAs per weight per 16 rows).
constexpr int64_t kChunkBytes = 512 * 1024;

// How a tile multiplies: float32 FMAs on float32 values, or (Bf16Pairs) AVX512-BF16 dot products on bfloat16
// pairs. A Bf16Pairs element is two bfloat16 values of consecutive columns in one 32-bit word; one dot product
// instruction multiplies 8 such pairs by a broadcast weight pair and adds both products to 8 float32 sums, twice
// the arithmetic of an FMA in the same time. The tiles below are written once for both: K counts elements.
struct F32 {
  using T = float;
  using V = __m256;
  static V load(const T* p) { return _mm256_loadu_ps(p); }
  static V splat(const T* p) { return _mm256_broadcast_ss(p); }
  static __m256 madd(V w, V x, __m256 acc) { return _mm256_fmadd_ps(w, x, acc); }
};

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
struct Bf16Pairs {
  using T = uint32_t;
  using V = __m256i;
  static V load(const T* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static V splat(const T* p) { return _mm256_set1_epi32(static_cast<int>(*p)); }
  static __m256 madd(V w, V x, __m256 acc) { return _mm256_dpbf16_ps(acc, (__m256bh)w, (__m256bh)x); }
};

// 16 floats → 8 bfloat16 pairs (round to nearest even), as one vector of 32-bit words.
inline __m256i to_pairs(const float* p) {
  return (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(p));
}
#endif

// Weight row n, columns [0, K), decoded to float32 (F32) or to bfloat16 pairs (Bf16Pairs: K / 2 words).
template <bool IS_INT4, typename A>
inline void decode_row(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t K, int64_t G,
                       int64_t n, typename A::T* out) {
  const int64_t num_groups = K / G;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t at = n * num_groups + k / G;
    const __m256 scale = _mm256_set1_ps(half_to_float(scales[at]));
    __m256 w[4];
    if (IS_INT4) {
      decode_int4(qweight + n * (K / 2) + k / 2, w);
      const __m256 min = _mm256_set1_ps(half_to_float(mins[at]));
      for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(scale, w[i], min);
    } else {
      decode_int8(reinterpret_cast<const int8_t*>(qweight) + n * K + k, w);
      for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(scale, w[i]);
    }
    if constexpr (std::is_same_v<A, F32>) {
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + k + 8 * i, w[i]);
    } else {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
      for (int i = 0; i < 2; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + k / 2 + 8 * i),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_insertf32x8(_mm512_castps256_ps512(w[2 * i]),
                                                                           w[2 * i + 1], 1)));
#endif
    }
  }
}

// Writes a tile's sums, out[r][i] for weight row r and activation row i, to y[m0 + i, n0 + r] for the first
// `valid` activation rows (the transposed activations are zero-padded past the batch).
template <int RT, int VT>
inline void store_tile(const float (&out)[RT][VT * kLanes], int valid, float* y, int64_t N, int64_t m0,
                       int64_t n0) {
  for (int i = 0; i < valid; ++i)
    for (int r = 0; r < RT; ++r) y[(m0 + i) * N + n0 + r] = out[r][i];
}

// The main tile, 6 weight rows (w, row stride K) × the 16 activation rows of one panel ([K, 16], rows m0..,
// the first `valid` of them real):
// written out with named accumulators because GCC keeps an array of twelve vectors on the stack, storing it
// every column.
template <typename A>
void tile_6x16(const typename A::T* w, const typename A::T* panel, int64_t K, int64_t m0, int valid, float* y,
               int64_t N, int64_t n0) {
  __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00,
         a40 = a00, a41 = a00, a50 = a00, a51 = a00;
  const typename A::T* column = panel;
  for (int64_t k = 0; k < K; ++k, column += kPanel) {
    const typename A::V x0 = A::load(column), x1 = A::load(column + kLanes);
    typename A::V b = A::splat(w + k);
    a00 = A::madd(b, x0, a00);
    a01 = A::madd(b, x1, a01);
    b = A::splat(w + K + k);
    a10 = A::madd(b, x0, a10);
    a11 = A::madd(b, x1, a11);
    b = A::splat(w + 2 * K + k);
    a20 = A::madd(b, x0, a20);
    a21 = A::madd(b, x1, a21);
    b = A::splat(w + 3 * K + k);
    a30 = A::madd(b, x0, a30);
    a31 = A::madd(b, x1, a31);
    b = A::splat(w + 4 * K + k);
    a40 = A::madd(b, x0, a40);
    a41 = A::madd(b, x1, a41);
    b = A::splat(w + 5 * K + k);
    a50 = A::madd(b, x0, a50);
    a51 = A::madd(b, x1, a51);
  }
  alignas(32) float out[kRows][2 * kLanes];
  const __m256 sums[kRows][2] = {{a00, a01}, {a10, a11}, {a20, a21}, {a30, a31}, {a40, a41}, {a50, a51}};
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < 2; ++v) _mm256_store_ps(&out[r][kLanes * v], sums[r][v]);
  store_tile<kRows, 2>(out, valid, y, N, m0, n0);
}

// Half a panel: 6 weight rows × the first 8 activation rows of a panel (a batch's last few rows).
template <typename A>
void tile_6x8(const typename A::T* w, const typename A::T* panel, int64_t K, int64_t m0, int valid, float* y,
              int64_t N, int64_t n0) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  const typename A::T* column = panel;
  for (int64_t k = 0; k < K; ++k, column += kPanel) {
    const typename A::V x = A::load(column);
    a0 = A::madd(A::splat(w + k), x, a0);
    a1 = A::madd(A::splat(w + K + k), x, a1);
    a2 = A::madd(A::splat(w + 2 * K + k), x, a2);
    a3 = A::madd(A::splat(w + 3 * K + k), x, a3);
    a4 = A::madd(A::splat(w + 4 * K + k), x, a4);
    a5 = A::madd(A::splat(w + 5 * K + k), x, a5);
  }
  alignas(32) float out[kRows][kLanes];
  const __m256 sums[kRows] = {a0, a1, a2, a3, a4, a5};
  for (int r = 0; r < kRows; ++r) _mm256_store_ps(out[r], sums[r]);
  store_tile<kRows, 1>(out, valid, y, N, m0, n0);
}

// Any smaller tile (the last weight rows of a matrix, the last 8 activation rows of a batch): the same sums in the
// same order, so a row's result does not depend on which tile computed it.
template <typename A, int RT, int VT>
void tile(const typename A::T* w, const typename A::T* panel, int64_t K, int64_t m0, int valid, float* y, int64_t N,
          int64_t n0) {
  __m256 acc[RT][VT];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) acc[r][v] = _mm256_setzero_ps();
  const typename A::T* column = panel;
  for (int64_t k = 0; k < K; ++k, column += kPanel) {
    typename A::V x[VT];
    for (int v = 0; v < VT; ++v) x[v] = A::load(column + kLanes * v);
    for (int r = 0; r < RT; ++r) {
      const typename A::V weight = A::splat(w + r * K + k);
      for (int v = 0; v < VT; ++v) acc[r][v] = A::madd(weight, x[v], acc[r][v]);
    }
  }
  alignas(32) float out[RT][VT * kLanes];
  for (int r = 0; r < RT; ++r)
    for (int v = 0; v < VT; ++v) _mm256_store_ps(&out[r][kLanes * v], acc[r][v]);
  store_tile<RT, VT>(out, valid, y, N, m0, n0);
}

// RT weight rows against the activation rows [0, rows) of the packed chunk, one panel at a time.
template <typename A, int RT>
void weight_rows(const typename A::T* w, const typename A::T* panels, int64_t K, int64_t rows, float* y, int64_t N,
                 int64_t n0) {
  for (int64_t m = 0; m < rows; m += kPanel) {
    const typename A::T* panel = panels + m * K;
    const int valid = static_cast<int>(std::min<int64_t>(kPanel, rows - m));
    if (valid > kLanes && RT == kRows)
      tile_6x16<A>(w, panel, K, m, valid, y, N, n0);
    else if (valid > kLanes)
      tile<A, RT, 2>(w, panel, K, m, valid, y, N, n0);
    else if (RT == kRows)
      tile_6x8<A>(w, panel, K, m, valid, y, N, n0);
    else
      tile<A, RT, 1>(w, panel, K, m, valid, y, N, n0);
  }
}

// Transposes 8 rows of 8 32-bit elements (r[i] = row i) into 8 columns: r[j] = column j.
inline void transpose8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  __m256 u[8];
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// One panel: rows [0, valid) of x (row-major, K float columns) transposed into panel [K', 16] of A's elements
// (K' = K floats, or K / 2 bfloat16 pairs); rows past valid read `zeros`. Eight elements of eight rows at a time
// through registers, not one strided store per element: a 512-token prefill ran ~5% faster than with the scalar
// copy (medians of 20 alternating runs, faster in 18).
template <typename A>
inline void pack_panel(const float* x, int64_t valid, int64_t K, const float* zeros, typename A::T* panel) {
  const float* rows[kPanel];
  for (int64_t i = 0; i < kPanel; ++i) rows[i] = i < valid ? x + i * K : zeros;
  constexpr int64_t kFloats = std::is_same_v<A, F32> ? kLanes : 2 * kLanes;  // floats per 8 elements
  const int64_t stride = std::is_same_v<A, F32> ? 1 : 2;
  int64_t k = 0;
  for (; k + kFloats <= K; k += kFloats)
    for (int half = 0; half < 2; ++half) {
      __m256 r[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        if constexpr (std::is_same_v<A, F32>) {
          r[i] = _mm256_loadu_ps(rows[half * kLanes + i] + k);
        } else {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
          r[i] = _mm256_castsi256_ps(to_pairs(rows[half * kLanes + i] + k));
#endif
        }
      }
      transpose8(r);
      for (int j = 0; j < kLanes; ++j)
        _mm256_storeu_ps(reinterpret_cast<float*>(panel + (k / stride + j) * kPanel + half * kLanes), r[j]);
    }
  if constexpr (std::is_same_v<A, F32>)
    for (; k < K; ++k)
      for (int64_t i = 0; i < kPanel; ++i) panel[k * kPanel + i] = rows[i][k];
}

template <bool IS_INT4, typename A>
void gemm(const float* x, int64_t M, int64_t K, const uint8_t* qweight, const uint16_t* scales,
          const uint16_t* mins, int64_t N, int64_t G, float* y, int num_threads) {
  using T = typename A::T;
  const int64_t elements = std::is_same_v<A, F32> ? K : K / 2;  // per row
  const int64_t fit = kChunkBytes / (elements * static_cast<int64_t>(sizeof(T)));
  const int64_t chunk = std::max<int64_t>(kPanel, fit / kPanel * kPanel);
  const int64_t num_panels = (std::min(chunk, M) + kPanel - 1) / kPanel;
  // Not zero-filled: packing writes every element, zeros included.
  const std::unique_ptr<T[]> panels(new T[num_panels * elements * kPanel]);
  const std::vector<float> zeros(K);  // the rows of a last partial panel past the batch
  const int64_t num_tiles = (N + kRows - 1) / kRows;
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    // Pack the chunk's rows 16 at a time into panels [K', 16], zero past the last row.
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t p = 0; p < (rows + kPanel - 1) / kPanel; ++p)
      pack_panel<A>(x + (m0 + p * kPanel) * K, std::min<int64_t>(kPanel, rows - p * kPanel), K, zeros.data(),
                    panels.get() + p * elements * kPanel);
    float* y_chunk = y + m0 * N;
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<T> w(kRows * elements);
      // Handed out a few tiles at a time, not split in halves up front: the two cores of a shared machine often
      // run at different speeds, and with fixed halves the faster one waited at the barrier. A 512-token prefill
      // ran ~5% faster this way (median of 30 alternating runs). Which thread computes a tile does not change
      // its result.
#pragma omp for schedule(dynamic, 8)
      for (int64_t t = 0; t < num_tiles; ++t) {
        const int64_t n0 = t * kRows;
        const int64_t count = std::min<int64_t>(kRows, N - n0);
        for (int64_t r = 0; r < count; ++r)
          decode_row<IS_INT4, A>(qweight, scales, mins, K, G, n0 + r, w.data() + r * elements);
        const T* rows_w = w.data();
        switch (count) {
          case 6: weight_rows<A, 6>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
          case 5: weight_rows<A, 5>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
          case 4: weight_rows<A, 4>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
          case 3: weight_rows<A, 3>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
          case 2: weight_rows<A, 2>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
          default: weight_rows<A, 1>(rows_w, panels.get(), elements, rows, y_chunk, N, n0); break;
        }
      }
    }
  }
}

template <bool IS_INT4>
void dequantize(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                int64_t G, float* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n) decode_row<IS_INT4, F32>(qweight, scales, mins, K, G, n, out + n * K);
}

}  // namespace

extern "C" {

// y [M, N] = x [M, K] @ dequantized weight [N, K]ᵀ; arguments in the order of gemv.cpp's int4_linear_f32.
void int4_gemm_f32(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                   int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm<true, F32>(x, M, K, qweight, scales, mins, N, group_size, y, num_threads);
}

void int8_gemm_f32(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                   const float* x, int64_t M, float* y, int num_threads) {
  gemm<false, F32>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, N, group_size, y, num_threads);
}

// Float32 copy of the weights, [N, K], decoded exactly as the products decode them.
void int4_dequantize(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                     int64_t group_size, float* out, int num_threads) {
  dequantize<true>(qweight, scales, mins, N, K, group_size, out, num_threads);
}

void int8_dequantize(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                     float* out, int num_threads) {
  dequantize<false>(reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, N, K, group_size, out,
                    num_threads);
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// The same products with the weights and activations rounded to bfloat16 (sums in float32): where the CPU has
// AVX512-BF16, twice the arithmetic per instruction. Present only then; gemm_bf16_supported says which.
void int4_gemm_bf16(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                    int64_t group_size, const float* x, int64_t M, float* y, int num_threads) {
  gemm<true, Bf16Pairs>(x, M, K, qweight, scales, mins, N, group_size, y, num_threads);
}

void int8_gemm_bf16(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                    const float* x, int64_t M, float* y, int num_threads) {
  gemm<false, Bf16Pairs>(x, M, K, reinterpret_cast<const uint8_t*>(qweight), scales, nullptr, N, group_size, y,
                         num_threads);
}

int gemm_bf16_supported() { return 1; }
#else
int gemm_bf16_supported() { return 0; }
#endif

}  // extern "C"
