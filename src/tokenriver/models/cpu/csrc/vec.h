// AVX2 helpers shared by the kernels: horizontal sums, a vectorized exp, decoding quantized weights to floats and
// rounding activations to int8.
#pragma once

#include <immintrin.h>
#include <stdint.h>

namespace tokenriver {

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float horizontal_max(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for 8 floats, within ~2 ulp of expf (Cephes' expf: x = n ln2 + r with |r| <= ln2 / 2, e^r by a degree-6
// polynomial, times 2^n built in the exponent bits). Inputs are clamped to [-87.3, 88]: e^x at or below the
// lower clamp is under the smallest normal float and returns as 0, above the upper one it stays at e^88.
inline __m256 exp256(__m256 x) {
  const __m256 lower = _mm256_set1_ps(-87.33654f);
  x = _mm256_min_ps(_mm256_max_ps(x, lower), _mm256_set1_ps(88.0f));
  // n = round(x / ln2); r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n + 127 in the exponent field. At the lower clamp n = -126 at most, so the field stays >= 1;
  // results under the smallest normal float are flushed to 0 by the mask.
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
  return _mm256_and_ps(result, _mm256_cmp_ps(x, lower, _CMP_GT_OQ));
}

#if defined(__AVX512F__)
// exp256 on 16 floats: the same operations lane by lane, so the same results.
inline __m512 exp512(__m512 x) {
  const __m512 lower = _mm512_set1_ps(-87.33654f);
  x = _mm512_min_ps(_mm512_max_ps(x, lower), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __m512 result = _mm512_mul_ps(p, _mm512_castsi512_ps(exponent));
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lower, _CMP_GT_OQ), result);
}

// silu(gate) * up on 16 floats, silu(g) = g / (1 + e^-g) as PyTorch computes it (ops.cpp's SwiGLU and gemm.cpp's
// fused one share it, so they agree bit for bit).
inline __m512 silu_times(__m512 gate, __m512 up) {
  const __m512i sign_bit = _mm512_set1_epi32(INT32_MIN);
  const __m512 negated = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(gate), sign_bit));
  return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(negated))), up);
}
#endif

// sqrt(2 / pi), gelu_tanh's constant, rounded once to float.
constexpr float kGeluScale = 0.7978845608028654f;

// gelu_tanh(g) * up on 8 floats. gelu_tanh(g) = g/2 * (1 + tanh(u)), u = sqrt(2/pi) * (g + 0.044715 g^3), computed
// as g / (1 + e^(-2u)): the same function without tanh's cancellation near -1 (PyTorch's form loses most of its
// relative precision there), so within ~1e-6 relative of PyTorch's float32 result wherever that one is precise.
inline __m256 gelu_tanh_times(__m256 g, __m256 up) {
  const __m256 g_cubed = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
  const __m256 inner = _mm256_mul_ps(_mm256_set1_ps(kGeluScale),
                                     _mm256_add_ps(g, _mm256_mul_ps(_mm256_set1_ps(0.044715f), g_cubed)));
  const __m256 e = exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f), inner));
  return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), up);
}

#if defined(__AVX512F__)
// The same on 16 floats, lane by lane the same operations (ops.cpp's GeGLU and gemm.cpp's fused one agree bit for
// bit).
inline __m512 gelu_tanh_times(__m512 g, __m512 up) {
  const __m512 g_cubed = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
  const __m512 inner = _mm512_mul_ps(_mm512_set1_ps(kGeluScale),
                                     _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), g_cubed)));
  const __m512 e = exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f), inner));
  return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), up);
}
#endif

// Transposes 8 rows of 8 floats (r[i] = row i) into 8 columns: r[j] = column j.
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

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// 32 int4 columns (16 bytes) → four vectors of 8 floats: columns 0-7, 8-15, 16-23, 24-31.
// Bytes 0-7 widened to 32-bit lanes hold columns 0-7 in their low nibbles and 16-23 in their high nibbles.
// With `high` (5-bit codes), bit j of *high is bit 4 of column j's code.
inline void decode_int4(const uint8_t* bytes, __m256 w[4], const uint32_t* high = nullptr) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
  __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8)));
  __m256i codes[4] = {_mm256_and_si256(first, mask), _mm256_and_si256(second, mask), _mm256_srli_epi32(first, 4),
                      _mm256_srli_epi32(second, 4)};
  if (high != nullptr) {
    const __m256i shifts = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int i = 0; i < 4; ++i) {
      const __m256i bits = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(*high >> (8 * i))), shifts);
      codes[i] = _mm256_or_si256(codes[i], _mm256_slli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(1)), 4));
    }
  }
  for (int i = 0; i < 4; ++i) w[i] = _mm256_cvtepi32_ps(codes[i]);
}

// 32 bits → 32 bytes, byte j 0x10 where bit j is set and 0 elsewhere: a 5-bit code's fifth bit in place.
inline __m256i fifth_bits(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm256_maskz_mov_epi8(static_cast<__mmask32>(bits), _mm256_set1_epi8(0x10));
#else
  // Byte j takes the mask byte j / 8, then tests its own bit of it.
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
#endif
}

// 32 int8 columns → four vectors of 8 floats.
inline void decode_int8(const int8_t* bytes, __m256 w[4]) {
  for (int i = 0; i < 4; ++i) {
    __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + 8 * i));
    w[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
  }
}

// ---- Float32 activations: the arithmetic of every float product (gemv.cpp's GEMV, gemm.cpp's GEMM) -------------
//
// An output y[m, n] = sum over k of w[n, k] x[m, k], with w the weight as dequantized (int4: fma(scale, q, min), one
// rounding; int8: scale * q, exact). Lane l of a vector accumulator takes the columns k = l, l + W, l + 2W, ... in
// order, acc = fma(w, x, acc) (W = kFloatLanes: 16 where the CPU has AVX-512, else 8), and the lanes are then added
// in a fixed tree (fold_lanes). The GEMV decodes each block of weights in registers (decode_block), the GEMM into a
// buffer of decoded rows; both run these operations, so a row's bits do not depend on which one computes it or on
// what else is in the batch.
#if defined(__AVX512F__)
using FloatLanes = __m512;
constexpr int kFloatLanes = 16;
inline __m512 zero_lanes() { return _mm512_setzero_ps(); }
inline __m512 load_lanes(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 fma_lanes(__m512 w, __m512 x, __m512 acc) { return _mm512_fmadd_ps(w, x, acc); }
inline float fold_lanes(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return horizontal_sum(_mm256_add_ps(_mm512_castps512_ps256(v), high));
}
#else
using FloatLanes = __m256;
constexpr int kFloatLanes = 8;
inline __m256 zero_lanes() { return _mm256_setzero_ps(); }
inline __m256 load_lanes(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 fma_lanes(__m256 w, __m256 x, __m256 acc) { return _mm256_fmadd_ps(w, x, acc); }
inline float fold_lanes(__m256 v) { return horizontal_sum(v); }
#endif

// One block of 32 columns of a weight row, dequantized into 32 / kFloatLanes vectors in column order: int4 bytes
// (with high, the fifth bits of int5 codes) as fma(scale, q, min), int8 ones as scale * q.
template <bool IS_INT4>
inline void decode_block(const uint8_t* bytes, const uint32_t* high, float scale, float min, FloatLanes* w) {
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(scale);
  if (IS_INT4) {
    // Byte j: column j in its low nibble, column j + 16 in its high one.
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
    __m512i low = _mm512_and_si512(codes, _mm512_set1_epi32(0x0F)), upper = _mm512_srli_epi32(codes, 4);
    if (high != nullptr) {
      const __m512i sixteen = _mm512_set1_epi32(16);
      low = _mm512_mask_add_epi32(low, static_cast<__mmask16>(*high & 0xFFFFu), low, sixteen);
      upper = _mm512_mask_add_epi32(upper, static_cast<__mmask16>(*high >> 16), upper, sixteen);
    }
    const __m512 offset = _mm512_set1_ps(min);
    w[0] = _mm512_fmadd_ps(factor, _mm512_cvtepi32_ps(low), offset);
    w[1] = _mm512_fmadd_ps(factor, _mm512_cvtepi32_ps(upper), offset);
  } else {
    for (int i = 0; i < 2; ++i)
      w[i] = _mm512_mul_ps(factor, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                       _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16 * i)))));
  }
#else
  const __m256 factor = _mm256_set1_ps(scale);
  __m256 codes[4];
  if (IS_INT4) {
    decode_int4(bytes, codes, high);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_fmadd_ps(factor, codes[i], _mm256_set1_ps(min));
  } else {
    decode_int8(reinterpret_cast<const int8_t*>(bytes), codes);
    for (int i = 0; i < 4; ++i) w[i] = _mm256_mul_ps(factor, codes[i]);
  }
#endif
}

// Activations quantized to int8 per run of 32 columns (run_length, a multiple of 32: 256 for kquant.h's 2-bit codes),
// as llama.cpp does on CPUs (gemv.cpp's and gemm.cpp's int8 products): x ≈ xscale * xq with xscale = max|x| / 127
// over the run and xq = round(x / xscale). Integer products then cost one instruction per 32 weights (maddubs)
// instead of four conversions and four FMAs; the error is that of rounding x to 8 bits.
inline void quantize_activations(const float* x, int64_t M, int64_t K, int8_t* xq, float* xscale,
                                 int64_t run_length = 32) {
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  // packs works within 128-bit lanes; this puts the 8 groups of 4 bytes back in column order.
  const __m256i lane_order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t run = 0; run < M * K / run_length; ++run) {
    const float* in = x + run_length * run;
    __m256 amax = _mm256_setzero_ps();
    for (int64_t i = 0; i < run_length; i += 8)
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, _mm256_loadu_ps(in + i)));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float scale = _mm_cvtss_f32(m4) / 127.0f;
    xscale[run] = scale;
    // Round half to even (the default MXCSR mode), as torch.round does; |q| <= 127, so packing never saturates.
    const __m256 divisor = _mm256_set1_ps(scale == 0.0f ? 1.0f : scale);
    for (int64_t k = 0; k < run_length; k += 32) {
      __m256i q[4];
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(in + k + 8 * i), divisor));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + run_length * run + k),
                          _mm256_permutevar8x32_epi32(bytes, lane_order));
    }
  }
}

}  // namespace tokenriver
