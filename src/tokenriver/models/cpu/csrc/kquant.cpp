// K-quant weights at their own size (kquant.h): GGUF's Q2_K to Q6_K blocks converted at load into
// models/kquant.py's row records, the int8-activation GEMV of a decode step over their tile records, and their rows
// decoded to float32 (an embedding's lookup, the reference's weights).
//
// A decode step streams every weight once, so its time is the bytes read: Q6_K kept as int8 read 8.5 bits a weight
// for its 6.56, Q4_K with a float16 scale and min per 32 columns 5 for its 4.5. Here a tile block's codes are built
// in registers from the nibbles or crumbs and the high bits (a shift and a bitwise select a word), and the float work
// per block and activation row is one FMA per run of scales (two for runs of 16) and one per run of mins; for 2-bit
// codes, two per super-block (kquant.h). A tile's
// record holds everything a super-block's product reads, so the product reads one stream of bytes front to back.
// The GEMM of many rows (gemm.cpp, kquant_gemm_int8x) computes each row with the same operations.

#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <vector>

#include "kquant.h"
#include "vec.h"

namespace {

using tokenriver::half_to_float;
using tokenriver::KQuantWeight;
using tokenriver::kTileRows;
using tokenriver::quantize_activations;

constexpr int64_t kPrefetchBytes = 8192;

// Row n decoded into out [K]: (d * sc) * (q - o) - dmin * m, each product exact in float32, one rounding.
void decode_row(const KQuantWeight& w, int64_t n, float* out) {
  const int64_t t = n / kTileRows;
  const int r = static_cast<int>(n % kTileRows);
  const int offset = (w.offsets(t) >> r) & 1 ? w.centre() : 0;
  tokenriver::KQuantTerms terms;
  for (int64_t b = 0; b < w.blocks(); ++b) {
    if (b % 8 == 0) terms.read(w, w.super(t, b));
    const float d = half_to_float(w.block_d(t, b)[r]);
    const float dmin = w.has_mins ? half_to_float(w.block_dmin(t, b)[r]) : 0.0f;
    for (int c = 0; c < 32; ++c) {
      const float scale = d * float(terms.scales(w, b, c / 16)[r]);
      const float value = scale * float(w.code(t, b, r, c) - offset);
      out[32 * b + c] = w.has_mins ? value - dmin * float(terms.mins(w, b, c / 16)[r]) : value;
    }
  }
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// One activation row rounded to int8 per run (kquant.h: 32 columns, or a super-block for 2-bit codes), with per run
// its scale and per block the sums of its two halves.
struct KActivations {
  std::vector<int8_t> xq;
  std::vector<float> xscale;        // [K/run]
  std::vector<int32_t> half_sums;  // [K/32, 2]
  std::vector<float> xterm;         // [K/32]: xs * T, the min term's factor (gemv.cpp's RowActivations; runs of 32)

  KActivations(const float* x, int64_t K, int64_t run) : xq(K), xscale(K / run), half_sums(K / 16), xterm(K / 32) {
    quantize_activations(x, 1, K, xq.data(), xscale.data(), run);
    for (int64_t h = 0; h < K / 16; ++h) {
      int32_t total = 0;
      for (int i = 0; i < 16; ++i) total += xq[16 * h + i];
      half_sums[h] = total;
    }
    for (int64_t b = 0; b < K / 32; ++b)
      xterm[b] = xscale[b * 32 / run] * static_cast<float>(half_sums[2 * b] + half_sums[2 * b + 1]);
  }
  int32_t word(int64_t b, int j) const {
    int32_t value;
    memcpy(&value, xq.data() + 32 * b + 4 * j, 4);
    return value;
  }
};

// Activation row a's integer sums of block b's two halves against a tile block's codes (a lane per weight row),
// each minus o * T_h in the rows `offset` marks as centred: two chains of integers, whose order changes no bit.
inline void centred_half_sums(const __m512i codes[8], const KActivations& a, int64_t b, __mmask16 offset,
                              int32_t centre, __m512i& lo, __m512i& hi) {
  lo = hi = _mm512_setzero_si512();
  for (int j = 0; j < 4; ++j) {
    lo = _mm512_dpbusd_epi32(lo, codes[j], _mm512_set1_epi32(a.word(b, j)));
    hi = _mm512_dpbusd_epi32(hi, codes[4 + j], _mm512_set1_epi32(a.word(b, 4 + j)));
  }
  if (offset) {
    lo = _mm512_mask_sub_epi32(lo, offset, lo, _mm512_set1_epi32(centre * a.half_sums[2 * b]));
    hi = _mm512_mask_sub_epi32(hi, offset, hi, _mm512_set1_epi32(centre * a.half_sums[2 * b + 1]));
  }
}

// The tile block's codes, a lane per row, the record's bytes kPrefetchBytes further on their way into L2 (a record
// is read front to back over its 8 blocks, so a block's share of it is prefetched with each).
inline void block_codes(const KQuantWeight& w, int64_t t, int64_t b, __m512i codes[8]) {
  const char* ahead = reinterpret_cast<const char*>(w.super(t, b)) + w.record * (b % 8) / 8 + kPrefetchBytes;
  for (int64_t at = 0; at < w.record / 8; at += 64) _mm_prefetch(ahead + at, _MM_HINT_T1);
  tokenriver::kquant_codes(w, t, b, codes);
}

// The tile's 16 scales d * sc of half h of block b.
inline __m512 block_scale(const KQuantWeight& w, const tokenriver::KQuantTerms& terms, int64_t b, int h, __m512 d) {
  return tokenriver::kquant_scale_run(terms.scales(w, b, h), d);
}

// The tile's 16 mins -(dmin * m) of the run holding column 32 b + 16 h.
inline __m512 block_min(const KQuantWeight& w, const tokenriver::KQuantTerms& terms, int64_t t, int64_t b, int h) {
  return tokenriver::kquant_min_run(terms.mins(w, b, h), tokenriver::kquant_halves(w.block_dmin(t, b)));
}

// Tile t's 16 rows against MT activation rows, into y (ld: y's row stride): kquant.h's arithmetic, a lane per row.
// SUB16: scales per 16 columns (each half of a block its own sum).
template <bool SUB16, int MT>
void kquant_tile(const KQuantWeight& w, int64_t t, const KActivations* a, float* y, int64_t ld) {
  const __mmask16 offset = w.offsets(t);
  const int32_t centre = w.centre();
  const bool has_mins = w.has_mins, min16 = w.has_mins && w.min_group == 16;
  __m512 total[MT];
  tokenriver::KQuantTerms terms;
  for (int64_t c = 0, begin = 0, end; begin < w.blocks(); begin = end, ++c) {
    end = w.chain_end(c);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = begin; b < end; ++b) {
      if (b % 8 == 0 || b == begin) terms.read(w, w.super(t, b));
      __m512i codes[8];
      block_codes(w, t, b, codes);
      const __m512 d = tokenriver::kquant_halves(w.block_d(t, b));
      const __m512 scale_lo = block_scale(w, terms, b, 0, d);
      const __m512 scale_hi = SUB16 ? block_scale(w, terms, b, 1, d) : scale_lo;
      const __m512 min = has_mins ? block_min(w, terms, t, b, 0) : _mm512_setzero_ps();
      const __m512 min_hi = min16 ? block_min(w, terms, t, b, 1) : min;
      for (int m = 0; m < MT; ++m) {
        const __m512 xs = _mm512_set1_ps(a[m].xscale[b]);
        const int32_t t_lo = a[m].half_sums[2 * b], t_hi = a[m].half_sums[2 * b + 1];
        __m512i lo, hi;
        centred_half_sums(codes, a[m], b, offset, centre, lo, hi);
        if (SUB16) {
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale_lo, xs), acc[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_mul_ps(scale_hi, xs), acc[m]);
        } else {
          lo = _mm512_add_epi32(lo, hi);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_mul_ps(scale_lo, xs), acc[m]);
        }
        if (min16) {
          acc[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(a[m].xscale[b] * static_cast<float>(t_lo)), acc[m]);
          acc[m] = _mm512_fmadd_ps(min_hi, _mm512_set1_ps(a[m].xscale[b] * static_cast<float>(t_hi)), acc[m]);
        } else if (has_mins) {
          acc[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(a[m].xterm[b]), acc[m]);
        }
      }
    }
    for (int m = 0; m < MT; ++m) total[m] = c == 0 ? acc[m] : _mm512_add_ps(total[m], acc[m]);
  }
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, w.N - kTileRows * t));
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ld + kTileRows * t, lanes, total[m]);
}

// A tile's 16 scales (int8) or mins (uint8) of one run, as int32 lanes.
inline __m512i widened_scales(const int8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline __m512i widened_mins(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Tile t's 16 rows of 2-bit codes against MT activation rows rounded per super-block: kquant.h's arithmetic of
// super-block sums, a lane per row. Per block the halves' integer sums U_h (minus o * T_h in centred rows) times
// their scales, and the mins times T_h, add into the super-block's sums S and M (exact); then two FMAs.
template <int MT>
void kquant_crumb_tile(const KQuantWeight& w, int64_t t, const KActivations* a, float* y, int64_t ld) {
  const __mmask16 offset = w.offsets(t);
  const int32_t centre = w.centre();
  const bool has_mins = w.has_mins;
  __m512 total[MT];
  for (int64_t c = 0, begin = 0, end; begin < w.blocks(); begin = end, ++c) {
    end = w.chain_end(c);
    __m512 acc[MT];
    for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t s = begin / 8; s < end / 8; ++s) {
      __m512 sums[MT], mins[MT];
      for (int m = 0; m < MT; ++m) sums[m] = mins[m] = _mm512_setzero_ps();
      tokenriver::KQuantTerms terms;
      terms.read(w, w.super(t, 8 * s));
      for (int64_t b = 8 * s; b < 8 * s + 8; ++b) {
        __m512i codes[8];
        block_codes(w, t, b, codes);
        const __m512 scale_lo = _mm512_cvtepi32_ps(widened_scales(terms.scales(w, b, 0)));
        const __m512 scale_hi = _mm512_cvtepi32_ps(widened_scales(terms.scales(w, b, 1)));
        const __m512 zero = _mm512_setzero_ps();
        const __m512 min_lo = has_mins ? _mm512_cvtepi32_ps(widened_mins(terms.mins(w, b, 0))) : zero;
        const __m512 min_hi = has_mins ? _mm512_cvtepi32_ps(widened_mins(terms.mins(w, b, 1))) : zero;
        for (int m = 0; m < MT; ++m) {
          const int32_t t_lo = a[m].half_sums[2 * b], t_hi = a[m].half_sums[2 * b + 1];
          __m512i lo, hi;
          centred_half_sums(codes, a[m], b, offset, centre, lo, hi);
          // S and M as float32 sums, exactly: every term and partial sum is an integer below 2^24 (kquant.h).
          sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), scale_lo, sums[m]);
          sums[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), scale_hi, sums[m]);
          if (has_mins) {
            mins[m] = _mm512_fmadd_ps(min_lo, _mm512_set1_ps(static_cast<float>(t_lo)), mins[m]);
            mins[m] = _mm512_fmadd_ps(min_hi, _mm512_set1_ps(static_cast<float>(t_hi)), mins[m]);
          }
        }
      }
      const __m512 d = tokenriver::kquant_halves(w.block_d(t, 8 * s));
      const __m512 dmin = has_mins ? tokenriver::kquant_halves(w.block_dmin(t, 8 * s)) : _mm512_setzero_ps();
      for (int m = 0; m < MT; ++m) {
        const __m512 xs = _mm512_set1_ps(a[m].xscale[s]);
        acc[m] = _mm512_fmadd_ps(sums[m], _mm512_mul_ps(d, xs), acc[m]);
        if (has_mins)
          acc[m] = _mm512_fmadd_ps(mins[m], _mm512_xor_ps(_mm512_mul_ps(dmin, xs), _mm512_set1_ps(-0.0f)), acc[m]);
      }
    }
    for (int m = 0; m < MT; ++m) total[m] = c == 0 ? acc[m] : _mm512_add_ps(total[m], acc[m]);
  }
  const int valid = static_cast<int>(std::min<int64_t>(kTileRows, w.N - kTileRows * t));
  const __mmask16 lanes = static_cast<__mmask16>((1u << valid) - 1);
  for (int m = 0; m < MT; ++m) _mm512_mask_storeu_ps(y + m * ld + kTileRows * t, lanes, total[m]);
}

// The tile kernel for a weight and MT activation rows.
template <int MT>
void kquant_tile_of(const KQuantWeight& w, int64_t t, const KActivations* a, float* y, int64_t ld) {
  if (w.low_bits == 2)
    kquant_crumb_tile<MT>(w, t, a, y, ld);
  else if (w.scale_group == 16)
    kquant_tile<true, MT>(w, t, a, y, ld);
  else
    kquant_tile<false, MT>(w, t, a, y, ld);
}

// Tile t against every activation row, four at a time.
void kquant_rows(const KQuantWeight& w, int64_t t, const std::vector<KActivations>& activations, float* y) {
  const int64_t M = static_cast<int64_t>(activations.size());
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) kquant_tile_of<4>(w, t, activations.data() + m, y + m * w.N, w.N);
  switch (M - m) {
    case 3: kquant_tile_of<3>(w, t, activations.data() + m, y + m * w.N, w.N); break;
    case 2: kquant_tile_of<2>(w, t, activations.data() + m, y + m * w.N, w.N); break;
    case 1: kquant_tile_of<1>(w, t, activations.data() + m, y + m * w.N, w.N); break;
    default: break;
  }
}

void linear(const float* x, int64_t M, const KQuantWeight& w, float* y, int num_threads) {
  std::vector<KActivations> activations;
  activations.reserve(M);
  for (int64_t m = 0; m < M; ++m) activations.emplace_back(x + m * w.K, w.K, w.activation_run());
  const int64_t num_tiles = (w.N + kTileRows - 1) / kTileRows;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t t = 0; t < num_tiles; ++t) kquant_rows(w, t, activations, y);
}
#endif

// ---- GGUF blocks → row records (models/kquant.py's KQuantRecords) ---------------------------------------------------

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

// Bit `bit` of each of 32 bytes as one word, byte l's at bit l.
uint32_t bit_word(const uint8_t* bytes, int bit) {
#if defined(__AVX2__)
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  return static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_sll_epi16(v, _mm_cvtsi32_si128(7 - bit))));
#else
  uint32_t word = 0;
  for (int l = 0; l < 32; ++l) word |= uint32_t((bytes[l] >> bit) & 1) << l;
  return word;
#endif
}

// A run's 32 nibbles, bits shift .. shift + 3 of chunk [32], as its 16 record bytes: byte j holds column j low and
// column j + 16 high.
inline void put_nibbles(const uint8_t* chunk, int shift, uint8_t* out) {
#if defined(__SSE2__)
  const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk));
  const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i bytes =
      shift == 0 ? _mm_or_si128(_mm_and_si128(low, nibble), _mm_slli_epi16(_mm_and_si128(high, nibble), 4))
                 : _mm_or_si128(_mm_and_si128(_mm_srli_epi16(low, 4), nibble), _mm_andnot_si128(nibble, high));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), bytes);
#else
  for (int j = 0; j < 16; ++j)
    out[j] = uint8_t(((chunk[j] >> shift) & 0x0F) | (((chunk[j + 16] >> shift) & 0x0F) << 4));
#endif
}

// A super-block's scales then mins (values [count]) as a record's bytes at `bits` (models/kquant.py's pack_terms:
// at 4 or 6, value 4q + i's low nibble in bits 4 (q % 2) of byte 4 (q / 2) + i, at 6 its top two bits in bits 2q
// of byte 8 + i).
void put_terms(const int* values, int count, int bits, uint8_t* out) {
  if (bits == 8) {
    for (int v = 0; v < count; ++v) out[v] = static_cast<uint8_t>(values[v]);
    return;
  }
  memset(out, 0, count * bits / 8);
  for (int v = 0; v < count; ++v) {
    const int q = v / 4, i = v % 4;
    out[4 * (q / 2) + i] |= static_cast<uint8_t>((values[v] & 0x0F) << (4 * (q % 2)));
    if (bits == 6) out[8 + i] |= static_cast<uint8_t>(((values[v] >> 4) & 3) << (2 * q));
  }
}

// One Q4_K or Q5_K super-block into its row record (models/kquant.py's RecordLayout): 8 groups' nibbles (16 bytes
// each, Q4_0's order), the 6-bit scales and mins, d and dmin, and for Q5_K each group's fifth bits as one word.
void convert_q4_k_block(const uint8_t* b, bool has_high, uint8_t* record, int64_t high_at, int64_t terms_at,
                        int64_t d_at) {
  memcpy(record + d_at, b, 2);
  memcpy(record + d_at + 2, b + 2, 2);
  const uint8_t* qs = b + (has_high ? 48 : 16);
  int terms[16];
  for (int g = 0; g < 8; ++g) scale_min_k4(g, b + 4, terms + g, terms + 8 + g);
  put_terms(terms, 16, 6, record + terms_at);
  for (int g = 0; g < 8; ++g) {
    const uint8_t* chunk = qs + (g / 2) * 32;
    put_nibbles(chunk, 4 * (g % 2), record + 16 * g);
    if (has_high) {
      const uint32_t word = bit_word(b + 16, g);
      memcpy(record + high_at + 4 * g, &word, 4);
    }
  }
}

// One Q6_K super-block (ql [128], qh [64], scales [16] int8, d) into its row record: nibbles, bit 4 and bit 5
// words per group of 32, its 16 scales (a byte each) and d. Element 32 g + l: low nibble of
// ql[64 (g / 4) + 32 (g % 2) + l] (high nibble for g % 4 >= 2), bits 4 and 5 from qh[32 (g / 4) + l] >> 2 (g % 4).
void convert_q6_k_block(const uint8_t* b, uint8_t* record, int64_t high_at, int64_t terms_at, int64_t d_at) {
  memcpy(record + terms_at, b + 192, 16);
  memcpy(record + d_at, b + 208, 2);
  for (int g = 0; g < 8; ++g) {
    const int half = g / 4, j = g % 4;
    put_nibbles(b + half * 64 + (j % 2) * 32, j < 2 ? 0 : 4, record + 16 * g);
    const uint32_t words[2] = {bit_word(b + 128 + half * 32, 2 * j), bit_word(b + 128 + half * 32, 2 * j + 1)};
    memcpy(record + high_at + 8 * g, words, 8);
  }
}

// A run's 32 two-bit codes, bits shift and shift + 1 of src [32], into its 8 crumb bytes (models/kquant.py's order:
// byte 4h + i holds columns 16h + 4j + i at bits 2j): four bytes of src at a time, each byte's two bits masked out
// of a 32-bit word and moved to their place in it.
void put_crumbs(const uint8_t* src, int shift, uint8_t* run) {
  for (int h = 0; h < 2; ++h) {
    uint32_t out = 0;
    for (int j = 0; j < 4; ++j) {
      uint32_t word;
      memcpy(&word, src + 16 * h + 4 * j, 4);
      out |= ((word >> shift) & 0x03030303u) << (2 * j);
    }
    memcpy(run + 4 * h, &out, 4);
  }
}

// One Q3_K super-block (hmask [32], qs [64], 12 bytes of 6-bit scales, d) into its row record: the centred codes
// q + 4 = low + 4 high as crumbs and a high word per 32, the 6-bit scales sc - 32 per 16, d
// (loader/kquant_blocks.py's unpack_q3_k). Element 32 g + l: low bits at bit 2 (g % 4) of qs[32 (g / 4) + l], high
// bit at bit g of hmask[l].
void convert_q3_k_block(const uint8_t* b, uint8_t* record, int64_t high_at, int64_t terms_at, int64_t d_at) {
  memcpy(record + d_at, b + 108, 2);
  int scales[16];
  for (int i = 0; i < 16; ++i) {
    const int low = i < 8 ? b[96 + i] & 0x0F : b[96 + i - 8] >> 4;
    const int top = (b[104 + i % 4] >> (2 * (i / 4))) & 3;
    scales[i] = (low | (top << 4)) - 32;
  }
  put_terms(scales, 16, 6, record + terms_at);
  for (int g = 0; g < 8; ++g) {
    put_crumbs(b + 32 + 32 * (g / 4), 2 * (g % 4), record + 8 * g);
    const uint32_t word = bit_word(b, g);
    memcpy(record + high_at + 4 * g, &word, 4);
  }
}

// One Q2_K super-block (16 bytes of 4-bit (scale, min) pairs, qs [64], d, dmin) into its row record: the codes as
// crumbs, the 4-bit scales and mins per 16, d and dmin (loader/kquant_blocks.py's unpack_q2_k).
void convert_q2_k_block(const uint8_t* b, uint8_t* record, int64_t terms_at, int64_t d_at) {
  memcpy(record + d_at, b + 80, 2);
  memcpy(record + d_at + 2, b + 82, 2);
  int terms[32];
  for (int i = 0; i < 16; ++i) {
    terms[i] = b[i] & 0x0F;
    terms[16 + i] = b[i] >> 4;
  }
  put_terms(terms, 32, 4, record + terms_at);
  for (int g = 0; g < 8; ++g) put_crumbs(b + 16 + 32 * (g / 4), 2 * (g % 4), record + 8 * g);
}

// A row record's layout (models/kquant.py's RecordLayout) as kquant_relayout takes it: byte offsets, then groups.
struct RowLayout {
  int64_t size, high, terms, d, low_bits, num_high, scale_group, has_mins, min_group, centre, term_bits;

  int64_t num_scales() const { return 256 / scale_group; }
  // The record's scale i, min i.
  int scale(const uint8_t* record, int64_t i) const {
    return tokenriver::kquant_term(record + terms, 1, static_cast<int>(i), static_cast<int>(term_bits), has_mins == 0);
  }
  int min(const uint8_t* record, int64_t i) const {
    return tokenriver::kquant_term(record + terms, 1, static_cast<int>(num_scales() + i), static_cast<int>(term_bits),
                                   false);
  }

  // Run g's 32 codes: their low bits (nibbles: byte l % 16 of the run, the high nibble for l >= 16; crumbs: byte
  // 4 (l / 16) + l % 4 of the run, bits 2 ((l % 16) / 4)), then each high word's bit l above them.
  void codes(const uint8_t* record, int g, int* out) const {
    if (low_bits == 4) {
      for (int l = 0; l < 16; ++l) {
        out[l] = record[16 * g + l] & 0x0F;
        out[l + 16] = record[16 * g + l] >> 4;
      }
    } else {
      for (int c = 0; c < 8; ++c)
        for (int j = 0; j < 4; ++j) out[16 * (c / 4) + 4 * j + c % 4] = (record[8 * g + c] >> (2 * j)) & 3;
    }
    for (int k = 0; k < num_high; ++k) {
      uint32_t word;
      memcpy(&word, record + high + 4 * (num_high * g + k), 4);
      for (int l = 0; l < 32; ++l) out[l] |= static_cast<int>((word >> l) & 1) << (low_bits + k);
    }
  }

  // Run g's 32 codes written into a record (codes() read back).
  void put_codes(uint8_t* record, int g, const int* codes) const {
    const int mask = (1 << low_bits) - 1;
    if (low_bits == 4) {
      for (int l = 0; l < 16; ++l)
        record[16 * g + l] = static_cast<uint8_t>((codes[l] & mask) | (codes[l + 16] & mask) << 4);
    } else {
      for (int c = 0; c < 8; ++c) {
        int byte = 0;
        for (int j = 0; j < 4; ++j) byte |= (codes[16 * (c / 4) + 4 * j + c % 4] & mask) << (2 * j);
        record[8 * g + c] = static_cast<uint8_t>(byte);
      }
    }
    for (int k = 0; k < num_high; ++k) {
      uint32_t word = 0;
      for (int l = 0; l < 32; ++l) word |= static_cast<uint32_t>((codes[l] >> (low_bits + k)) & 1) << l;
      memcpy(record + high + 4 * (num_high * g + k), &word, 4);
    }
  }
};

// One row's super-block record in layout `from` rewritten in `to` (a union that holds it: codes as wide or wider,
// scales and mins in groups as small or smaller, at bits as wide): the codes re-centred on to's centre where the row
// is centred, scales and mins repeated to to's groups, absent mins and dmin zero (models/kquant.py's _union_part).
void relayout_record(const uint8_t* src, bool centred, const RowLayout& from, const RowLayout& to, uint8_t* dst) {
  memset(dst, 0, to.size);
  const int shift = centred ? static_cast<int>(to.centre - from.centre) : 0;
  for (int g = 0; g < 8; ++g) {
    int codes[32];
    from.codes(src, g, codes);
    for (int l = 0; l < 32; ++l) codes[l] += shift;
    to.put_codes(dst, g, codes);
  }
  int terms[32] = {};
  for (int64_t i = 0; i < to.num_scales(); ++i) terms[i] = from.scale(src, i * to.scale_group / from.scale_group);
  const int64_t num_mins = to.has_mins ? 256 / to.min_group : 0;
  if (to.has_mins && from.has_mins) {
    for (int64_t i = 0; i < num_mins; ++i)
      terms[to.num_scales() + i] = from.min(src, i * to.min_group / from.min_group);
    memcpy(dst + to.d + 2, src + from.d + 2, 2);
  }
  put_terms(terms, static_cast<int>(to.num_scales() + num_mins), static_cast<int>(to.term_bits), dst + to.terms);
  memcpy(dst + to.d, src + from.d, 2);
}

// A row record's fields (models/kquant.py's RecordLayout) as kquant_tile_records moves them into a tile record.
struct TileFields {
  int64_t high_at, terms_at, d_at;
  int num_high, has_mins, low_bits;
};

// A high word's bits as a tile's byte for column c of every fourth: bit k of the byte is the word's bit
// 16 (k / 4) + 4 (k % 4) + c (kquant.h's plane).
inline uint8_t high_plane(uint32_t word, int c) {
#if defined(__BMI2__)
  return static_cast<uint8_t>(_pext_u32(word, 0x11111111u << c));
#else
  int plane = 0;
  for (int k = 0; k < 8; ++k) plane |= ((word >> (16 * (k / 4) + 4 * (k % 4) + c)) & 1) << k;
  return static_cast<uint8_t>(plane);
#endif
}

// Two high words' bits as a tile's crumb byte for column c of every fourth in half h: crumb j holds column
// 16 h + 4 j + c's bit of each word (the low word's below the high word's).
inline uint8_t high_crumbs(uint32_t low, uint32_t high, int h, int c) {
#if defined(__BMI2__)
  const uint32_t mask = 0x1111u << (16 * h + c);
  return static_cast<uint8_t>(_pdep_u32(_pext_u32(low, mask), 0x55) | _pdep_u32(_pext_u32(high, mask), 0xAA));
#else
  int crumbs = 0;
  for (int j = 0; j < 4; ++j) {
    const int column = 16 * h + 4 * j + c;
    crumbs |= (((low >> column) & 1) | (((high >> column) & 1) << 1)) << (2 * j);
  }
  return static_cast<uint8_t>(crumbs);
#endif
}

// One super-block of a tile's 16 row records (row r's at rows + r * row_stride) written as its tile record out
// (kquant.h): the code words transposed (word w of row r to out's word 16 w + r, a gather of the 16 rows' words at
// a time), the high words as planes or crumbs, the scales' and mins' bytes byte by byte, d and dmin per row.
void tile_super_block(const uint8_t* rows, int64_t row_stride, const TileFields& f, uint8_t* out) {
  const int code_words = 8 * f.low_bits;
  const int64_t high_out = 512 * f.low_bits, terms_out = high_out + 512 * f.num_high;
  const int64_t term_bytes = f.d_at - f.terms_at, d_out = terms_out + kTileRows * term_bytes;
#if defined(__AVX512F__)
  const __m512i starts = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(static_cast<int>(row_stride)));
  for (int w = 0; w < code_words; ++w)
    _mm512_storeu_si512(out + 64 * w, _mm512_i32gather_epi32(starts, rows + 4 * w, 1));
#else
  for (int r = 0; r < kTileRows; ++r)
    for (int w = 0; w < code_words; ++w) memcpy(out + 64 * w + 4 * r, rows + r * row_stride + 4 * w, 4);
#endif
  for (int r = 0; r < kTileRows; ++r) {
    const uint8_t* row = rows + r * row_stride;
    for (int i = 0; i < 8; ++i) {
      uint32_t words[2];
      memcpy(words, row + f.high_at + 4 * f.num_high * i, 4 * f.num_high);
      for (int c = 0; c < 4 && f.num_high == 1; ++c) out[high_out + 64 * i + 4 * r + c] = high_plane(words[0], c);
      for (int c = 0; c < 4 && f.num_high == 2; ++c)
        for (int h = 0; h < 2; ++h)
          out[high_out + 128 * i + 64 * h + 4 * r + c] = high_crumbs(words[0], words[1], h, c);
    }
    for (int64_t j = 0; j < term_bytes; ++j) out[terms_out + kTileRows * j + r] = row[f.terms_at + j];
    memcpy(out + d_out + 2 * r, row + f.d_at, 2);
    if (f.has_mins) memcpy(out + d_out + 32 + 2 * r, row + f.d_at + 2, 2);
  }
}

}  // namespace

extern "C" {

// GGUF type codes (gguf.GGMLQuantizationType) of the K-quants kept as records.
enum : int { kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// src [N, K / 256 * block bytes] of one GGUF matrix → its row records [N, K / 256, record] (models/kquant.py's
// RecordLayout for the type: the byte offsets of the bit words, the scales and mins, and d within a record).
// Returns 0, or 1 for a type it does not convert.
int convert_kquant(const uint8_t* src, int type, int64_t N, int64_t K, uint8_t* records, int64_t record,
                   int64_t high_at, int64_t terms_at, int64_t d_at, int num_threads) {
  const int bytes = type == kQ2_K   ? 84
                    : type == kQ3_K ? 110
                    : type == kQ4_K ? 144
                    : type == kQ5_K ? 176
                    : type == kQ6_K ? 210
                                    : 0;
  if (bytes == 0) return 1;
  const int64_t blocks = K / 256;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < blocks; ++i) {
      const uint8_t* b = src + (n * blocks + i) * bytes;
      uint8_t* out = records + (n * blocks + i) * record;
      if (type == kQ6_K)
        convert_q6_k_block(b, out, high_at, terms_at, d_at);
      else if (type == kQ3_K)
        convert_q3_k_block(b, out, high_at, terms_at, d_at);
      else if (type == kQ2_K)
        convert_q2_k_block(b, out, terms_at, d_at);
      else
        convert_q4_k_block(b, type == kQ5_K, out, high_at, terms_at, d_at);
    }
  return 0;
}

// Row records src [N, K/256, from's size] in layout `from` → the same values in layout `to` (dst [N, K/256, to's
// size]), for a fused projection stacked in the union of its parts' layouts (models/kquant.py's concatenate_records):
// each layout as RowLayout's 11 fields; offsets [N], a row's code offset (non-zero: centred).
void kquant_relayout(const uint8_t* src, const uint8_t* offsets, int64_t N, int64_t K, const int64_t* from,
                     const int64_t* to, uint8_t* dst, int num_threads) {
  RowLayout a, b;
  memcpy(&a, from, sizeof(a));
  memcpy(&b, to, sizeof(b));
  const int64_t supers = K / 256;
#pragma omp parallel for num_threads(num_threads) schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t s = 0; s < supers; ++s)
      relayout_record(src + (n * supers + s) * a.size, offsets[n] != 0, a, b, dst + (n * supers + s) * b.size);
}

// Row records [N, K/256, record] (models/kquant.py's RecordLayout: the byte offsets high_at, terms_at and d_at of a
// row's fields, its low_bits) rewritten in place as tile records (kquant.h; models/cpu/tiles.py's tile_kquant, the
// same bytes): a tile's 16 rows take exactly its record's bytes, so each tile is copied out and written back. N a
// multiple of 16.
void kquant_tile_records(uint8_t* records, int64_t N, int64_t K, int64_t record, int64_t high_at, int64_t terms_at,
                         int64_t d_at, int num_high, int has_mins, int low_bits, int num_threads) {
  const int64_t supers = K / 256;
  const TileFields fields{high_at, terms_at, d_at, num_high, has_mins, low_bits};
  tokenriver::rewrite_tiles(records, N, supers * record, num_threads, [&](const uint8_t* rows, uint8_t* tile) {
    for (int64_t s = 0; s < supers; ++s)
      tile_super_block(rows + s * record, supers * record, fields, tile + s * kTileRows * record);
  });
}

// Rows ids [count] of a K-quant weight in row tiles (kquant.h), decoded into out [count, K].
void kquant_dequantize_rows(const KQuantWeight* w, const int64_t* ids, int64_t count, float* out, int num_threads) {
#pragma omp parallel for num_threads(num_threads) schedule(static) if (count > 1)
  for (int64_t i = 0; i < count; ++i) decode_row(*w, ids[i], out + i * w->K);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
// y [M, N] = x [M, K] (activations rounded to int8 per 32 columns) @ the K-quant weight [N, K]ᵀ: kquant.h's
// arithmetic, any number of rows (the GEMM, gemm.cpp, gives each row the same bits).
void kquant_linear_int8x(const KQuantWeight* w, const float* x, int64_t M, float* y, int num_threads) {
  linear(x, M, *w, y, num_threads);
}

int kquant_supported() { return 1; }
#else
int kquant_supported() { return 0; }
#endif

}  // extern "C"
