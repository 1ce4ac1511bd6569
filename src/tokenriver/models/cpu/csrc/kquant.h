// K-quant row tiles: GGUF's Q2_K to Q6_K weights at the file's own bits per weight, in the row tiles of
// tiles.h (models/cpu/tiles.py's tile_kquant writes them; models/kquant.py defines the values).
//
// A weight is w[n, k] = d * sc * (q - o) - dmin * m, per row n:
//   q   the code, its low_bits (4 or 2) low bits, then num_high high bits (up to 2 over a nibble, 1 over a crumb);
//   sc  a signed sub-block scale per `scale_group` (16 or 32) columns; d a float16 scale per 256 columns;
//   m   an unsigned sub-block min per `min_group` (32 or 16) columns and dmin its float16 scale per 256 (where
//       has_mins: not Q3_K, Q6_K);
//   o   the codes' centre, 2^(low_bits + num_high - 1), for a centred row (Q6_K, Q3_K), 0 for the others; bit r of
//       offset_masks[t] set for row r of tile t (null: no row is centred).
// Stored as one record per tile of 16 rows and super-block of 256 columns, everything a super-block's product reads
// in one run of bytes (one stream for the hardware's prefetcher; models/cpu/tiles.py writes them from 16 row
// records, models/kquant.py's RecordLayout, byte for byte). For the 64-byte vector of code word k (k = 0..7), byte
// 4r + i is row r's code of column 4k + i:
//   codes   8 blocks of 32 columns × 64 * low_bits bytes: nibbles as tiles.h's int4 words (word j: bytes 4j .. 4j + 3
//           of each row's 16; its low nibbles code word j, its high ones word 4 + j), or crumbs as two vectors (h =
//           0 for words 0-3, 1 for 4-7; bits 2j, 2j + 1 of byte 4r + i: word 4h + j's column)
//   high    8 blocks × 64 * num_high bytes: one high bit as a plane (byte 4r + i, bit k: code word k's column),
//           two as two crumb vectors laid out as the crumb codes are
//   terms   byte j of the 16 rows' scales and mins (models/kquant.py's pack_terms: a byte each at term_bits 8;
//           at 6 or 4, value 4q + i's low nibble in bits 4 (q % 2) of byte 4 (q / 2) + i, at 6 its top two bits in
//           bits 2q of byte 8 + i) at 16 j + r, so that one shift and mask give four values of all 16 rows
//           (KQuantTerms)
//   d       16 float16, then dmin 16 float16 (where has_mins)
// A record then takes the file's bytes: Q2_K 2.625 bits a weight, Q3_K 3.4375, Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625. A
// fused projection of parts of different types keeps every part's values: the union of their fields, the absent
// ones zero, a byte per scale and min.
//
// The int8-activation products (kquant.cpp's GEMV, gemm.cpp's GEMM) compute a row as one chain over its blocks of 32
// columns, in order, lane by lane the same in both, so a row's bits never depend on its batch. Per block b, with the
// activations rounded to int8 per 32 (xs their scale, T_h the sum of half h's rounded activations, T = T_0 + T_1):
//     U   = the exact integer sum of the block's codes times the rounded activations, minus o * T
//     acc = fma(U, (d * sc) * xs, acc)                  scales per 32: d * sc exact in float32
//     or, scales per 16, per half h:
//     U_h = half h's exact integer sum, minus o * T_h;  acc = fma(U_h, (d * sc_h) * xs, acc), h = 0 then 1
//     acc = fma(-(dmin * m), xs * T, acc)               mins per 32 (-(dmin * m) exact)
//     or, mins per 16, acc = fma(-(dmin * m_h), xs * T_h, acc), h = 0 then 1
// Per 32 this is gemv.cpp's int4 arithmetic with exact float32 scales and mins, so gemm.cpp runs those weights
// through its int4 tiles.
// Weights of 2-bit codes (Q2_K, Q3_K; low_bits 2) round the activations per super-block instead (xs its scale,
// activation_run), as llama.cpp's Q8_K does, and per super-block s compute two exact integers and two FMAs:
//     S   = the sum over its halves h of sc_h * U_h     (U_h as above: minus o * T_h in a centred row)
//     M   = the sum over its runs of mins of m * T     (where has_mins)
//     acc = fma(S, d * xs, acc);  acc = fma(M, -(dmin * xs), acc)
// Sub-chains then end at super-blocks. Each (q - o) * sc lies in -127..128 (models/kquant.py checks the fields), so
// the GEMM stages it plus 127 as one unsigned byte and dpbusd sums S directly (gemm.cpp's crumb_tile); the GEMV sums
// S and M in float32 FMAs, exactly: |U_h| <= 16 * 4 * 127 and |sc| <= 32, m <= 255 and |T_h| <= 16 * 127, so every
// partial sum of a super-block is an integer below 2^24.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "tiles.h"

namespace tokenriver {

struct KQuantWeight {
  const uint8_t* records;        // [tiles, K/256, record]
  const uint16_t* offset_masks;  // [tiles], or null
  int64_t N, K, scale_group, record;
  int32_t num_high;              // 0, 1 (a plane) or 2 (crumbs)
  int32_t has_mins;
  // Where each sub-chain of a row's sum ends, in blocks (tiles.h's chain_ends), or null for one chain.
  const int64_t* chain_ends;
  int32_t low_bits;              // 4 (nibbles) or 2 (crumbs)
  int32_t min_group;             // 32 or 16 (where has_mins)
  int32_t term_bits;             // 8, 6 or 4: a scale's or min's width in the records

  int64_t blocks() const { return K / 32; }
  int words() const { return 4; }  // a block's code words (tiles.h's int4)
  int64_t chain_end(int64_t c) const { return chain_ends == nullptr ? blocks() : chain_ends[c]; }
  int scale_runs() const { return scale_group == 16 ? 2 : 1; }
  // The columns the activations are rounded in: a super-block for 2-bit codes, else a block (the comment above).
  int64_t activation_run() const { return low_bits == 2 ? 256 : 32; }
  int min_runs() const { return min_group == 16 ? 2 : 1; }
  // A super-block's scales, and its scales and mins, per row.
  int num_scales() const { return 8 * scale_runs(); }
  int num_terms() const { return num_scales() + (has_mins ? 8 * min_runs() : 0); }
  // The codes' centre, a centred row's offset o.
  int centre() const { return 1 << (low_bits + num_high - 1); }
  int64_t code_bytes() const { return 64 * low_bits; }  // a tile block's codes
  int64_t tile_bytes() const { return K / 256 * record; }  // a tile's records, all a product of it reads
  int64_t high_at() const { return 8 * code_bytes(); }
  int64_t terms_at() const { return high_at() + 512 * num_high; }
  int64_t d_at() const { return terms_at() + kTileRows * num_terms() * term_bits / 8; }
  // The record holding block b of tile t.
  const uint8_t* super(int64_t t, int64_t b) const { return records + (t * (K / 256) + b / 8) * record; }
  const uint8_t* block(int64_t t, int64_t b) const { return super(t, b) + code_bytes() * (b % 8); }
  const uint8_t* block_high_a(int64_t t, int64_t b) const {
    return super(t, b) + high_at() + 64 * num_high * (b % 8);
  }
  const uint8_t* block_high_b(int64_t t, int64_t b) const { return block_high_a(t, b) + 64; }
  const uint16_t* block_d(int64_t t, int64_t b) const {
    return reinterpret_cast<const uint16_t*>(super(t, b) + d_at());
  }
  const uint16_t* block_dmin(int64_t t, int64_t b) const { return block_d(t, b) + kTileRows; }
  uint16_t offsets(int64_t t) const { return offset_masks == nullptr ? 0 : offset_masks[t]; }
  // Row r's code of column c of block b of tile t.
  int code(int64_t t, int64_t b, int r, int c) const {
    const int h = c / 16, j = (c % 16) / 4, i = c % 4;
    const uint8_t* low = block(t, b);
    int value, high = 0;
    if (low_bits == 4) {
      const uint8_t byte = low[64 * j + 4 * r + i];
      value = h == 0 ? byte & 0x0F : byte >> 4;
    } else {
      value = (low[64 * h + 4 * r + i] >> (2 * j)) & 3;
    }
    if (num_high == 1) high = (block_high_a(t, b)[4 * r + i] >> (4 * h + j)) & 1;
    if (num_high == 2) high = ((h == 0 ? block_high_a(t, b) : block_high_b(t, b))[4 * r + i] >> (2 * j)) & 3;
    return value + (high << low_bits);
  }
};

// Value v of a super-block's scales and mins at `bits` (the layout above; models/kquant.py's pack_terms), byte j of
// them at terms[j * stride] (a row record: 1; row r of a tile record: terms + r, 16); a signed 6-bit scale
// sign-extended.
inline int kquant_term(const uint8_t* terms, int64_t stride, int v, int bits, bool is_signed) {
  if (bits == 8) return is_signed ? static_cast<int8_t>(terms[v * stride]) : terms[v * stride];
  const int q = v / 4, i = v % 4;
  int value = (terms[(4 * (q / 2) + i) * stride] >> (4 * (q % 2))) & 0x0F;
  if (bits == 6) value |= ((terms[(8 + i) * stride] >> (2 * q)) & 3) << 4;
  return bits == 6 && is_signed ? (value ^ 0x20) - 0x20 : value;
}

// A tile's scales and mins of one super-block, each run's 16 rows as 16 bytes: scales [num_scales][16] int8, then
// mins [8 * min_runs][16] uint8 (where has_mins). At 8 bits the record's own bytes; at 6 or 4 unpacked (the comment
// above): four values of the 16 rows by a shift and a mask, 6-bit scales of a weight without mins sign-extended
// (Q3_K's). A weight with 4-bit terms has mins (Q2_K's; 32 scales alone would need runs of 8).
struct KQuantTerms {
  alignas(64) uint8_t unpacked[512];
  const uint8_t* bytes = nullptr;

  // The terms of the super-block whose record starts at `record`.
  void read(const KQuantWeight& w, const uint8_t* record);
  // The 16 scales of the run holding column 32 b + 16 h; the 16 mins of that run.
  const int8_t* scales(const KQuantWeight& w, int64_t b, int h) const {
    return reinterpret_cast<const int8_t*>(bytes + 16 * (w.scale_runs() * (b % 8) + (w.scale_runs() == 2 ? h : 0)));
  }
  const uint8_t* mins(const KQuantWeight& w, int64_t b, int h) const {
    return bytes + 16 * (w.num_scales() + w.min_runs() * (b % 8) + (w.min_runs() == 2 ? h : 0));
  }
};

inline void KQuantTerms::read(const KQuantWeight& w, const uint8_t* record) {
  const uint8_t* packed = record + w.terms_at();
  if (w.term_bits == 8) {
    bytes = packed;
    return;
  }
  bytes = unpacked;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  if (w.term_bits == 4) {
    for (int k = 0; k < 4; ++k) {
      const __m512i p = _mm512_loadu_si512(packed + 64 * k);
      _mm512_store_si512(unpacked + 128 * k, _mm512_and_si512(p, nibble));
      _mm512_store_si512(unpacked + 128 * k + 64, _mm512_and_si512(_mm512_srli_epi16(p, 4), nibble));
    }
    return;
  }
  const __m512i p0 = _mm512_loadu_si512(packed), p1 = _mm512_loadu_si512(packed + 64);
  const __m512i tops = _mm512_loadu_si512(packed + 128);
  // low | (shifted tops & 0x30): ternary logic 0xF8 is a | (b & c).
  __m512i values[4] = {
      _mm512_ternarylogic_epi32(_mm512_and_si512(p0, nibble), _mm512_slli_epi16(tops, 4), top, 0xF8),
      _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(p0, 4), nibble), _mm512_slli_epi16(tops, 2), top,
                                0xF8),
      _mm512_ternarylogic_epi32(_mm512_and_si512(p1, nibble), tops, top, 0xF8),
      _mm512_ternarylogic_epi32(_mm512_and_si512(_mm512_srli_epi16(p1, 4), nibble), _mm512_srli_epi16(tops, 2), top,
                                0xF8),
  };
  const __m512i sign = _mm512_set1_epi8(0x20);
  for (int q = 0; q < 4; ++q) {
    if (!w.has_mins) values[q] = _mm512_sub_epi8(_mm512_xor_si512(values[q], sign), sign);
    _mm512_store_si512(unpacked + 64 * q, values[q]);
  }
#else
  for (int v = 0; v < w.num_terms(); ++v)
    for (int r = 0; r < kTileRows; ++r)
      unpacked[16 * v + r] = static_cast<uint8_t>(kquant_term(packed + r, kTileRows, v, w.term_bits, !w.has_mins));
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 float16 values (a tile's d or dmin) as float32.
inline __m512 kquant_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// A tile's 16 values d * sc of the scale run at `scales` (exact in float32), the GEMV's and the GEMM's.
inline __m512 kquant_scale_run(const int8_t* scales, __m512 d) {
  const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
}

// A tile's 16 values -(dmin * m) of the min run at `mins` (exact in float32).
inline __m512 kquant_min_run(const uint8_t* mins, __m512 dmin) {
  const __m512i m = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mins)));
  return _mm512_xor_ps(_mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)), _mm512_set1_ps(-0.0f));
}

// One high bit's plane (64 bytes at `at`: bit k of byte 4r + i, code word k's column) merged into the codes as
// their bit BIT (2 over crumbs, 4 over nibbles).
template <int BIT>
inline void kquant_add_plane(const uint8_t* at, __m512i codes[8]) {
  const __m512i mask = _mm512_set1_epi8(1 << BIT);
  const __m512i plane = _mm512_loadu_si512(at);
#pragma GCC unroll 8
  for (int k = 0; k < 8; ++k) {
    const __m512i moved = k < BIT ? _mm512_slli_epi16(plane, BIT - k) : _mm512_srli_epi16(plane, k - BIT);
    // codes | (moved & mask): ternary logic 0xF8 is a | (b & c).
    codes[k] = _mm512_ternarylogic_epi32(codes[k], moved, mask, 0xF8);
  }
}

// A tile block's 2-bit codes and their third bit (kquant_codes where low_bits is 2): codes[4h + j] is bits 2j, 2j + 1
// of crumb vector h; the plane's bit k moves to bit 2 of codes[k].
inline void kquant_crumb_codes(const KQuantWeight& w, int64_t t, int64_t b, __m512i codes[8]) {
  const __m512i two = _mm512_set1_epi8(3);
  const uint8_t* block = w.block(t, b);
  for (int h = 0; h < 2; ++h) {
    const __m512i crumbs = _mm512_loadu_si512(block + 64 * h);
    codes[4 * h] = _mm512_and_si512(crumbs, two);
    codes[4 * h + 1] = _mm512_and_si512(_mm512_srli_epi16(crumbs, 2), two);
    codes[4 * h + 2] = _mm512_and_si512(_mm512_srli_epi16(crumbs, 4), two);
    codes[4 * h + 3] = _mm512_and_si512(_mm512_srli_epi16(crumbs, 6), two);
  }
  if (w.num_high == 1) kquant_add_plane<2>(w.block_high_a(t, b), codes);
}

// A tile block's nibbles (its 256 bytes at `block`) as codes: codes[j] the low nibbles of word j, codes[4 + j] the
// high ones (the layout above).
inline void kquant_nibbles(const uint8_t* block, __m512i codes[8]) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m512i raw = _mm512_loadu_si512(block + 64 * j);
    codes[j] = _mm512_and_si512(raw, nibble);
    codes[4 + j] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
  }
}

// A tile block's codes as unsigned bytes, a vector per code word (codes[k]: byte 4r + i row r's code of column
// 4k + i), low bits and high bits merged (the layout above).
inline void kquant_codes(const KQuantWeight& w, int64_t t, int64_t b, __m512i codes[8]) {
  if (w.low_bits == 2) {
    kquant_crumb_codes(w, t, b, codes);
    return;
  }
  kquant_nibbles(w.block(t, b), codes);
  if (w.num_high == 2) {
    // codes | (shifted & mask): ternary logic 0xF8 is a | (b & c).
    const __m512i mask = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i crumbs = _mm512_loadu_si512(h == 0 ? w.block_high_a(t, b) : w.block_high_b(t, b));
      __m512i* word = codes + 4 * h;
      word[0] = _mm512_ternarylogic_epi32(word[0], _mm512_slli_epi16(crumbs, 4), mask, 0xF8);
      word[1] = _mm512_ternarylogic_epi32(word[1], _mm512_slli_epi16(crumbs, 2), mask, 0xF8);
      word[2] = _mm512_ternarylogic_epi32(word[2], crumbs, mask, 0xF8);
      word[3] = _mm512_ternarylogic_epi32(word[3], _mm512_srli_epi16(crumbs, 2), mask, 0xF8);
    }
  } else if (w.num_high == 1) {
    kquant_add_plane<4>(w.block_high_a(t, b), codes);
  }
}
#endif

}  // namespace tokenriver
