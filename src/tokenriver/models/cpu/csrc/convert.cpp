// GGUF block formats → the packed layouts the products read (models/quant.py's Int4Weight, Int8Weight), at load.
//
// The same rules as loader/gguf_blocks.py, which is the portable version and the reference these are tested
// against bit for bit: numpy spends several passes over memory per field, and a 500 MB file must load in
// about a second. Each block is decoded into registers or a 256-float scratch and written once; rows are
// shared among threads. Products are formed in the order gguf's own dequantization forms them (and the library
// is built with -ffp-contract=off), so the float values are gguf's exactly.
//
// Layouts (ggml-common.h): Q4_K 144 bytes per 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 of
// nibbles), Q6_K 210 (128 bytes of low nibbles, 64 of two high bits, 16 int8 scales, f16 d), Q3_K 110 (32 bytes
// of high bits, 64 of two low bits, 12 of 6-bit scales, f16 d), Q2_K 84 (16 bytes of 4-bit scale and min, 64 of
// two bits, f16 d, f16 dmin), Q8_0 34 per 32 (f16 d, 32 int8), IQ4_NL 18 per 32, IQ4_XS 136 per 256, Q5_0 22 per 32
// (f16 d, 4 bytes of fifth bits, 16 of nibbles) and Q5_1 24 (f16 d, f16 m, then Q5_0's), whose fields are kept.

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec.h"

namespace {

using tokenriver::half_to_float;

// GGUF type codes (gguf.GGMLQuantizationType).
enum : int { Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23 };

constexpr int8_t kIq4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline uint16_t float_to_half(float x) { return _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT); }
inline float load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// Q4_K's (scale, min) of sub-block j from their 12 packed bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int* scale, int* min) {
  if (j < 4) {
    *scale = q[j] & 63;
    *min = q[j + 4] & 63;
  } else {
    *scale = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One block of a re-quantized type → its float values (gguf's dequantization); returns the weights per block.
int decode_block(int type, const uint8_t* b, float* w) {
  switch (type) {
    case Q2_K: {
      const float d = load_half(b + 80), dmin = load_half(b + 82);
      for (int e = 0; e < 256; ++e) {
        const int sub = e / 16, half = e / 128, shift = 2 * ((e % 128) / 32), l = e % 32;
        const float dl = d * float(b[sub] & 0x0F), ml = dmin * float(b[sub] >> 4);
        w[e] = dl * float((b[16 + half * 32 + l] >> shift) & 3) - ml;
      }
      return 256;
    }
    case Q3_K: {
      const uint8_t* hmask = b;
      const uint8_t* qs = b + 32;
      const uint8_t* sc = b + 96;
      const float d = load_half(b + 108);
      float dl[16];
      for (int i = 0; i < 16; ++i) {
        const int low = i < 8 ? sc[i] & 0x0F : sc[i - 8] >> 4;
        const int high = (sc[8 + i % 4] >> (2 * (i / 4))) & 3;
        dl[i] = d * float(int8_t(low | (high << 4)) - 32);
      }
      for (int e = 0; e < 256; ++e) {
        const int half = e / 128, shift = 2 * ((e % 128) / 32), l = e % 32;
        const int q = ((qs[half * 32 + l] >> shift) & 3) - (((hmask[l] >> (e / 32)) & 1) ? 0 : 4);
        w[e] = dl[e / 16] * float(q);
      }
      return 256;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = load_half(b + 208);
      for (int g = 0; g < 8; ++g) {
        const int half = g / 4, j = g % 4;
        for (int l = 0; l < 32; ++l) {
          const uint8_t byte = ql[half * 64 + (j % 2) * 32 + l];
          const int low = j < 2 ? byte & 0x0F : byte >> 4;
          const int q = (low | (((qh[half * 32 + l] >> (2 * j)) & 3) << 4)) - 32;
          w[g * 32 + l] = (d * float(sc[2 * g + l / 16])) * float(q);
        }
      }
      return 256;
    }
    default:
      return 0;
  }
}

// 32 floats → int8 codes and their float16 scale: max|w| / 127 rounded to float16 first, q = round(w / scale)
// half to even (quant.py's quantize_int8 rule). Vector max, division and rounding are the scalar IEEE operations
// lane by lane, so the codes are the same; a NaN weight is left out of the maximum and clamps to -127.
inline void requantize_group(const float* w, int8_t* q, uint16_t* scale) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(w + 8 * i);
    amax = _mm256_max_ps(_mm256_and_ps(v[i], magnitude), amax);
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  *scale = float_to_half(_mm_cvtss_f32(m) / 127.0f);
  const float s = half_to_float(*scale);
  if (!(s > 0.0f)) {
    std::memset(q, 0, 32);
    return;
  }
  const __m256 divisor = _mm256_set1_ps(s), low = _mm256_set1_ps(-127.0f), high = _mm256_set1_ps(127.0f);
  __m256i codes[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 rounded = _mm256_round_ps(_mm256_div_ps(v[i], divisor), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    codes[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, low), high));
  }
  // packs interleave the 128-bit lanes; the permutation puts the 4-byte runs back in column order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(codes[0], codes[1]), _mm256_packs_epi32(codes[2], codes[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// An exactly mapped int8 block → codes and float16 scales; returns the weights per block.
int exact_int8_block(int type, const uint8_t* b, int8_t* q, uint16_t* scales) {
  switch (type) {
    case Q8_0:
      std::memcpy(scales, b, 2);
      std::memcpy(q, b + 2, 32);
      return 32;
    case IQ4_NL:
      for (int j = 0; j < 16; ++j) {
        q[j] = kIq4Values[b[2 + j] & 0x0F];
        q[j + 16] = kIq4Values[b[2 + j] >> 4];
      }
      std::memcpy(scales, b, 2);
      return 32;
    case IQ4_XS: {
      const float d = load_half(b);
      uint16_t high;
      std::memcpy(&high, b + 2, 2);
      for (int g = 0; g < 8; ++g) {
        const int ls = ((b[4 + g / 2] >> (4 * (g % 2))) & 0x0F) | (((high >> (2 * g)) & 3) << 4);
        scales[g] = float_to_half(d * float(ls - 32));
        const uint8_t* qs = b + 8 + 16 * g;
        for (int j = 0; j < 16; ++j) {
          q[32 * g + j] = kIq4Values[qs[j] & 0x0F];
          q[32 * g + j + 16] = kIq4Values[qs[j] >> 4];
        }
      }
      return 256;
    }
    default:
      return 0;
  }
}

int block_bytes(int type) {
  switch (type) {
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q6_K: return 210;
    case IQ4_NL: return 18;
    case IQ4_XS: return 136;
    default: return 0;
  }
}

int block_weights(int type) { return type == Q8_0 || type == IQ4_NL ? 32 : 256; }

bool is_exact_int8(int type) { return type == Q8_0 || type == IQ4_NL || type == IQ4_XS; }

bool is_finite_half(uint16_t h) { return (h & 0x7C00) != 0x7C00; }

// Q4_K blocks (high_bits null) or Q5_K blocks (Q4_K's header, 32 bytes of fifth bits, then the nibbles) → nibbles
// in Q4_0's order per 32, float16 scales d * sc and mins -dmin * m per 32 and, for Q5_K, each group's fifth bits as
// one word (bit l: bit g of high-bit byte l). Returns 1 if a scale or min is not finite in float16.
int convert_k_quant(const uint8_t* src, int64_t N, int64_t K, uint8_t* qweight, uint16_t* scales, uint16_t* mins,
                    uint32_t* high_bits, int num_threads) {
  const int64_t blocks = K / 256;
  const int block_bytes = high_bits == nullptr ? 144 : 176;
  int status = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : status)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* b = src + (n * blocks + i) * block_bytes;
      const float d = load_half(b), dmin = load_half(b + 2);
      const uint8_t* qs = b + (high_bits == nullptr ? 16 : 48);
      for (int g = 0; g < 8; ++g) {
        int scale, min;
        scale_min_k4(g, b + 4, &scale, &min);
        const int64_t group = n * (K / 32) + i * 8 + g;
        scales[group] = float_to_half(d * float(scale));
        mins[group] = float_to_half(-(dmin * float(min)));
        status |= !is_finite_half(scales[group]) | !is_finite_half(mins[group]);
        const uint8_t* chunk = qs + (g / 2) * 32;
        const int shift = 4 * (g % 2);
        uint8_t* out = qweight + group * 16;
        for (int j = 0; j < 16; ++j) {
          out[j] = uint8_t(((chunk[j] >> shift) & 0x0F) | (((chunk[j + 16] >> shift) & 0x0F) << 4));
        }
        if (high_bits != nullptr) {
          uint32_t word = 0;
          for (int l = 0; l < 32; ++l) word |= uint32_t((b[16 + l] >> g) & 1) << l;
          high_bits[group] = word;
        }
      }
    }
  }
  return status;
}


// Q5_0 (22 bytes per 32: f16 d, 4 bytes of fifth bits, 16 of nibbles) or Q5_1 (24: f16 d, f16 m, then the same)
// blocks → the nibbles and fifth-bit words as stored, scale d and min (Q5_0: -16 d, exact; Q5_1: m). Returns 1 where
// a scale or min is not finite or Q5_0's 16 |d| passes float16's largest value (gguf_blocks.py's repack_q5_0 then
// keeps the tensor as int8, or names the damage).
int convert_five_bit(const uint8_t* src, int type, int64_t N, int64_t K, uint8_t* qweight, uint16_t* scales,
                     uint16_t* mins, uint32_t* high_bits, int num_threads) {
  const int header = type == Q5_0 ? 2 : 4, bytes = header + 20;
  const int64_t groups = K / 32;
  int status = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : status)
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = src + (n * groups + g) * bytes;
      const int64_t group = n * groups + g;
      std::memcpy(scales + group, b, 2);
      if (type == Q5_0) {
        const float d = load_half(b);
        status |= !(std::fabs(d) * 16.0f <= 65504.0f);
        mins[group] = float_to_half(-16.0f * d);
      } else {
        std::memcpy(mins + group, b + 2, 2);
        status |= !is_finite_half(scales[group]) | !is_finite_half(mins[group]);
      }
      std::memcpy(high_bits + group, b + header, 4);
      std::memcpy(qweight + group * 16, b + header + 4, 16);
    }
  }
  return status;
}

}  // namespace

extern "C" {

// Whether convert_to_int8 handles this GGUF type code (the others go through gguf's numpy dequantization).
int convert_to_int8_supports(int type) { return type != Q4_K && block_bytes(type) != 0; }

// src [N, K / block_weights * block_bytes] bytes of one GGUF matrix → q [N, K] int8, scales [N, K / 32] float16.
// Returns 0, or 1 if a scale is not finite in float16 (a damaged file).
int convert_to_int8(const uint8_t* src, int type, int64_t N, int64_t K, int8_t* q, uint16_t* scales,
                    int num_threads) {
  const int bytes = block_bytes(type), per_block = block_weights(type);
  const int64_t blocks = K / per_block;
  int status = 0;
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : status)
  for (int64_t n = 0; n < N; ++n) {
    float w[256];
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* b = src + (n * blocks + i) * bytes;
      int8_t* qb = q + n * K + i * per_block;
      uint16_t* sb = scales + n * (K / 32) + i * (per_block / 32);
      if (is_exact_int8(type)) {
        exact_int8_block(type, b, qb, sb);
      } else {
        decode_block(type, b, w);
        for (int g = 0; g < per_block / 32; ++g) requantize_group(w + 32 * g, qb + 32 * g, sb + g);
      }
      for (int g = 0; g < per_block / 32; ++g) status |= !is_finite_half(sb[g]);
    }
  }
  return status;
}

// Float rows w [N, K] → int8 codes q [N, K] and float16 scales [N, K / 32] by requantize_group: quant.py's
// quantize_int8 with groups of 32, the same codes, for the loader's fusions of parts stored in different types.
void quantize_int8_groups(const float* w, int64_t N, int64_t K, int8_t* q, uint16_t* scales, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < K / 32; ++g) requantize_group(w + n * K + 32 * g, q + n * K + 32 * g, scales + n * (K / 32) + g);
}

// Q4_K src [N, K / 256 * 144] → qweight [N, K / 2] (Q4_0's nibble order per 32), scales and mins [N, K / 32]
// float16 (d * sc and -dmin * m). Returns 0, or 1 if one is not finite in float16.
int convert_q4_k(const uint8_t* src, int64_t N, int64_t K, uint8_t* qweight, uint16_t* scales, uint16_t* mins,
                 int num_threads) {
  return convert_k_quant(src, N, K, qweight, scales, mins, nullptr, num_threads);
}

// Q5_K src [N, K / 256 * 176] → convert_q4_k's outputs and the fifth bits high_bits [N, K / 32]
// (loader/gguf_blocks.py's repack_q5_k).
int convert_q5_k(const uint8_t* src, int64_t N, int64_t K, uint8_t* qweight, uint16_t* scales, uint16_t* mins,
                 uint32_t* high_bits, int num_threads) {
  return convert_k_quant(src, N, K, qweight, scales, mins, high_bits, num_threads);
}

// Q5_0 or Q5_1 src [N, K / 32 * (22 or 24)] → qweight [N, K / 2] (the nibbles), scales and mins [N, K / 32] float16
// and the fifth bits high_bits [N, K / 32] (loader/gguf_blocks.py's repack_q5_0 and repack_q5_1). Returns 0, or 1
// where the numpy rule decides (convert_five_bit).
int convert_q5(const uint8_t* src, int type, int64_t N, int64_t K, uint8_t* qweight, uint16_t* scales, uint16_t* mins,
               uint32_t* high_bits, int num_threads) {
  if (type != Q5_0 && type != Q5_1) return 1;
  return convert_five_bit(src, type, N, K, qweight, scales, mins, high_bits, num_threads);
}

}  // extern "C"
