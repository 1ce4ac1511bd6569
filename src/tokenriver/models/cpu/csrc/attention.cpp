// Paged attention read straight from the KV block pool, after writing this step's keys and values into it.
//
// Each query token attends to the first context_len tokens of its request, whose keys and values sit in the
// blocks its block table names: key_cache, value_cache [num_blocks, block_size, num_kv_heads, entry]. No gathered
// copy of the context is made: the kernel walks the block table. Grouped-query attention: query heads
// h * G .. h * G + G - 1 share kv head h (G = heads / kv heads).
//
// One arithmetic per query token: its result depends on its query and its context alone, not on whether it is
// decoded or sits in a prompt chunk, how its prompt was chunked or found in the prefix cache, what it is batched
// with, or the thread count. Every query token goes through the same code (attend_kv) in the same order:
// - the context is cut at fixed positions: tiles of kTile tokens from position 0, splits of kSplitTokens tokens (a
//   whole number of tiles); a sliding window masks the positions before it in its first tile;
// - per tile, the scores (a vector lane per context token), then flash attention's online-softmax update of the
//   running max m, sum l and accumulator acc = sum e^(s - m) v (a lane per head dimension), in float32;
// - per split, (m, l, acc) start afresh and are folded into the token's result in split order (merge_split), so a
//   long context's splits can run on several threads (flash-decoding) and still give a prompt chunk's numbers.
// Rows that share a pass (the query heads of a kv head, the tokens of a chunk) each keep their own chains, so
// which rows share one changes no bit. Work items: kQueryBlock tokens of a prompt chunk and one kv head; a decode
// token's heads, or one split of them where its context is longer than a split.
//
// The pool holds float32, float16 or int8. Float16 entries are widened to float32 on load (F16C); this step's keys
// and values are rounded to float16 (to nearest, ties to even) when stored, exactly as PyTorch's .to(torch.float16)
// rounds them. An int8 entry (one token's vector for one kv head) is head_dim values q and then its float32 scale s,
// 4 bytes: the vector is s * q, with s = max|x| / 127 and q = x / s rounded to nearest, ties to even
// (kv/cache.py's encode_int8, the same operations in the same order). With an int8 pool the queries are rounded to
// int8 per 32 head dimensions as well (quantize_activations, as llama.cpp rounds them for its q8_0 cache): a score
// is then integer products summed exactly per 32 dimensions (VNNI where the CPU has it), scaled by the query's block
// scales in order and by the key's scale. Where the CPU has AVX512-BF16 an int8 pool's values are multiplied in
// bfloat16 pairs: the stored integers are exact there, the softmax weights rounded to nearest even.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tokenriver::exp256;
using tokenriver::horizontal_max;
using tokenriver::horizontal_sum;
using tokenriver::quantize_activations;
using tokenriver::transpose8;

// Eight cache entries as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// Sixteen cache entries as floats.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#endif

// Entries after an entry's head_dim values: an int8 entry's scale.
template <typename Cache>
constexpr int64_t kEntryExtra = std::is_same<Cache, int8_t>::value ? 4 : 0;

// The scale of the entry whose values start at p (head_dim D): stored with int8 entries, 1 for float ones.
inline float entry_scale(const float*, int64_t) { return 1.0f; }
inline float entry_scale(const uint16_t*, int64_t) { return 1.0f; }
inline float entry_scale(const int8_t* p, int64_t D) {
  float scale;
  memcpy(&scale, p + D, sizeof(scale));
  return scale;
}

// n floats (a multiple of 8) into cache entries.
// One token's vectors for its kv heads (heads × D floats, D a multiple of 8) into its cache entries.
inline void store_entries(const float* in, int64_t heads, int64_t D, float* out) {
  memcpy(out, in, heads * D * sizeof(float));
}
inline void store_entries(const float* in, int64_t heads, int64_t D, uint16_t* out) {
  for (int64_t i = 0; i < heads * D; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline void store_entries(const float* in, int64_t heads, int64_t D, int8_t* out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t h = 0; h < heads; ++h, in += D, out += D + 4) {
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < D; i += 8)
      largest = _mm256_max_ps(largest, _mm256_and_ps(_mm256_loadu_ps(in + i), magnitude));
    const float scale = horizontal_max(largest) / 127.0f;
    const __m256 divisor = _mm256_set1_ps(scale > 0.0f ? scale : 1.0f);
    for (int64_t i = 0; i < D; i += 8) {
      // Round to nearest even (the default rounding mode), then narrow: |q| <= 127, so the packs never saturate.
      const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(in + i), divisor));
      const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + i), _mm_packs_epi16(words, words));
    }
    memcpy(out + D, &scale, sizeof(scale));
  }
}

// Context tokens per tile: scored, and taken into the online softmax, together. A multiple of 16.
constexpr int64_t kTile = 32;
// Context tokens per split, a whole number of tiles: small enough that one long decoding request spreads over the
// threads.
constexpr int64_t kSplitTokens = 128;
// Query tokens of a prompt chunk per work item.
constexpr int64_t kQueryBlock = 32;
// Below this many (token, head) score products the whole call runs on one thread (shorter ones finish before a
// second thread would have started).
constexpr int64_t kParallelWork = 1 << 11;

// Head dimensions per block of a query's int8 rounding (vec.h's quantize_activations).
constexpr int64_t kQueryBlockDims = 32;

template <typename Cache>
struct Problem {
  const float* query;  // row r, head j at query + r * q_row_stride + j * head_dim
  int64_t q_row_stride;
  float* out;  // same layout with out_row_stride
  int64_t out_row_stride;
  const Cache* key_cache;
  const Cache* value_cache;
  int64_t num_heads, num_kv_heads, block_size;
  const int64_t* block_tables;  // [num_requests, max_blocks]
  int64_t max_blocks;
  float scale;
  // Sliding window: a token sees only the last `window` positions up to itself (0: the whole context).
  int64_t window;
  // Soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax (0: none).
  float softcap;
};

// Query tokens [row, row + length) of one request, at positions context - length .. context - 1: a prompt chunk, or
// one decoding token (length 1).
struct Span {
  int64_t row, request, length, context;
};

// The first position a token at `position` sees: its window's start.
inline int64_t window_start(int64_t window, int64_t position) {
  return window > 0 && position + 1 > window ? position + 1 - window : 0;
}

// pass(std::integral_constant<int, R>{}, r) over rows [ra, rb): kMax rows at a time, then the rest in one pass.
template <int kMax, typename Pass>
inline void in_row_groups(int64_t ra, int64_t rb, const Pass& pass) {
  int64_t r = ra;
  for (; r + kMax <= rb; r += kMax) pass(std::integral_constant<int, kMax>{}, r);
  if constexpr (kMax > 1) {
    if (r < rb) in_row_groups<kMax - 1>(r, rb, pass);
  }
}

// Soft-capped scores in place, s = cap * tanh(s / cap) (Gemma 2's attention; cap > 0), for count scores, a
// multiple of 8: tanh |x| = (1 - e) / (1 + e) with e = exp(-2 |x|), and x's sign; exp256's accuracy.
inline void soft_cap(float* scores, int64_t count, float cap) {
  const __m256 inverse = _mm256_set1_ps(1.0f / cap), factor = _mm256_set1_ps(cap);
  const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f), minus_two = _mm256_set1_ps(-2.0f);
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(scores + j), inverse);
    const __m256 e = exp256(_mm256_mul_ps(minus_two, _mm256_andnot_ps(sign, x)));
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    _mm256_storeu_ps(scores + j, _mm256_mul_ps(factor, _mm256_or_ps(t, _mm256_and_ps(sign, x))));
  }
}

// One row's online-softmax update over a tile's kTile scores (masked ones -inf): raises the running max m to the
// tile's, turns the scores into weights e^(s - m), rescales the running sum l and adds theirs, and returns
// e^(m_old - m_new), the factor the row's accumulator must be rescaled by. Int8 entries: each weight then times its
// value's scale (the value pass multiplies the stored integers). PAIRS: the weights rounded to bfloat16, in the
// first kTile / 2 floats' bytes. One pass over the scores after the max, so no store waits on another.
template <typename Cache, bool PAIRS>
inline float online_softmax(float* scores, const float* value_scales, float& m, float& l) {
  __m256 max_vector = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < kTile; j += 8) max_vector = _mm256_max_ps(max_vector, _mm256_load_ps(scores + j));
  const float new_max = fmaxf(m, horizontal_max(max_vector));
  const float rescale = m == -INFINITY ? 0.0f : expf(m - new_max);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < kTile; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(scores + j), shift));
    total = _mm256_add_ps(total, e);
    const __m256 weight = kEntryExtra<Cache> > 0 ? _mm256_mul_ps(e, _mm256_load_ps(value_scales + j)) : e;
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (PAIRS) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(reinterpret_cast<uint16_t*>(scores) + j),
                       (__m128i)_mm256_cvtneps_pbh(weight));
      continue;
    }
#endif
    _mm256_store_ps(scores + j, weight);
  }
  m = new_max;
  l = l * rescale + horizontal_sum(total);
  return rescale;
}

// Folds one split's (m, l, acc) of a row into the row's result so far (M, L, A): both brought to the larger max.
// A split the row saw nothing of (m = -inf) leaves it as it is. -ffp-contract=off keeps every product rounded.
inline void merge_split(float& M, float& L, float* A, float m, float l, const float* acc, int64_t D) {
  if (m == -INFINITY) return;
  if (M == -INFINITY) {
    M = m;
    L = l;
    memcpy(A, acc, D * sizeof(float));
    return;
  }
  const float top = fmaxf(M, m);
  const float a = expf(M - top), b = expf(m - top);
  L = L * a + l * b;
  for (int64_t d = 0; d < D; ++d) A[d] = A[d] * a + acc[d] * b;
  M = top;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 lanes, 32 registers: 8 rows × 2 vectors of scores, 4 rows × 4 vectors of outputs.
struct Vector {
  using V = __m512;
  static constexpr int kWidth = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(float x) { return _mm512_set1_ps(x); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
};
constexpr int kScoreRows = 8, kValueRows = 4, kValueVectors = 4;
#else
// 8 lanes, 16 registers: 3 rows × 4 vectors of scores (the keys taken from L1 as FMA operands), 3 rows × 3 vectors
// of outputs (four vectors spilled an accumulator to the stack).
struct Vector {
  using V = __m256;
  static constexpr int kWidth = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(float x) { return _mm256_set1_ps(x); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
};
constexpr int kScoreRows = 3, kValueRows = 3, kValueVectors = 3;
#endif

// Float pools: scores[r * kTile + j] = (q_r . k_j) * scale for R packed query rows q ([R, head_dim]) and the tile's
// keys transposed, keys_t[d * kTile + j]: per score one FMA chain over the head dimensions in order.
template <int ND, int R>
inline void float_scores(const float* q, const float* keys_t, float scale, float* scores) {
  using Vec = Vector;
  constexpr int64_t D = ND * 8;
  constexpr int kVectors = kTile / Vec::kWidth;
  typename Vec::V sums[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) sums[r][v] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename Vec::V keys[kVectors];
    for (int v = 0; v < kVectors; ++v) keys[v] = Vec::load(keys_t + d * kTile + Vec::kWidth * v);
    for (int r = 0; r < R; ++r) {
      const typename Vec::V element = Vec::broadcast(q[r * D + d]);
      for (int v = 0; v < kVectors; ++v) sums[r][v] = Vec::fmadd(element, keys[v], sums[r][v]);
    }
  }
  const typename Vec::V factor = Vec::broadcast(scale);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) Vec::store(scores + r * kTile + Vec::kWidth * v, Vec::mul(sums[r][v], factor));
}

// A tile's keys (float or float16 entries) transposed into keys_t[d * kTile + j], eight tokens × eight head
// dimensions at a time; tokens past n are zeros.
template <int ND, typename Cache>
inline void transpose_float_keys(const Cache* const* keys, int64_t n, float* keys_t) {
  constexpr int64_t D = ND * 8;
  for (int64_t j0 = 0; j0 < kTile; j0 += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 rows[8];
      for (int e = 0; e < 8; ++e) rows[e] = j0 + e < n ? load8(keys[j0 + e] + d) : _mm256_setzero_ps();
      transpose8(rows);
      for (int e = 0; e < 8; ++e) _mm256_store_ps(keys_t + (d + e) * kTile + j0, rows[e]);
    }
}

// ---- Int8 pools: integer scores ------------------------------------------------------------------------------
//
// A query row is rounded to int8 per 32 head dimensions (codes c, block scales qs_b; head_dim padded to a multiple
// of 32 with zeros). For key j (codes k, scale s_j) the score is
//     acc = fma(I_b, qs_b, acc) over the blocks b in order, I_b = sum over the block of c_d k_d (an exact integer)
//     score = acc * (scale * s_j)
// The tile's keys are transposed into 32-bit words (four dimensions of one token), word-major:
// key_words[w * kTile + j]. With VNNI each code is stored plus 128 (unsigned, as vpdpbusd wants) and I_b comes out
// 128 times the block's sum of query codes too high, which is taken off (exact).

// Head dimensions a query row is rounded over: head_dim up to a multiple of 32.
template <int ND>
constexpr int64_t kPaddedDims = (ND * 8 + kQueryBlockDims - 1) / kQueryBlockDims * kQueryBlockDims;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr bool kVnni = true;
// 4 rows × 2 vectors of integer sums and of float chains.
constexpr int kInt8ScoreRows = 4;

// Transposes 16 rows of 16 32-bit words (r[i] = row i) into 16 columns: r[j] = column j.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // Per 128-bit lane c: r[4i + e] holds word 4c + e of rows 4i .. 4i + 3.
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  // Column 4c + e is lane c of r[e], r[4 + e], r[8 + e], r[12 + e].
  __m512i out[16];
  for (int e = 0; e < 4; ++e) {
    const __m512i ab_low = _mm512_shuffle_i32x4(r[e], r[4 + e], 0x44), ab_high = _mm512_shuffle_i32x4(r[e], r[4 + e], 0xEE);
    const __m512i cd_low = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0x44);
    const __m512i cd_high = _mm512_shuffle_i32x4(r[8 + e], r[12 + e], 0xEE);
    out[e] = _mm512_shuffle_i32x4(ab_low, cd_low, 0x88);
    out[4 + e] = _mm512_shuffle_i32x4(ab_low, cd_low, 0xDD);
    out[8 + e] = _mm512_shuffle_i32x4(ab_high, cd_high, 0x88);
    out[12 + e] = _mm512_shuffle_i32x4(ab_high, cd_high, 0xDD);
  }
  for (int k = 0; k < 16; ++k) r[k] = out[k];
}

// The tile's int8 keys as words (see above), codes plus 128; tokens past n, and dimensions past head_dim, code 0.
template <int ND>
inline void int8_key_words(const int8_t* const* keys, int64_t n, uint32_t* key_words) {
  constexpr int64_t kWords = ND * 2, kPaddedWords = kPaddedDims<ND> / 4;
  const __m512i offset = _mm512_set1_epi8(-128);
  for (int64_t j0 = 0; j0 < kTile; j0 += 16)
    for (int64_t w0 = 0; w0 < kPaddedWords; w0 += 16) {
      const int64_t valid = std::min<int64_t>(std::max<int64_t>(kWords - w0, 0), 16);
      const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
      __m512i rows[16];
      for (int e = 0; e < 16; ++e)
        rows[e] = j0 + e < n ? _mm512_maskz_loadu_epi32(mask, keys[j0 + e] + 4 * w0) : _mm512_setzero_si512();
      transpose16(rows);
      for (int64_t e = 0; e < 16 && w0 + e < kPaddedWords; ++e)
        _mm512_store_si512(key_words + (w0 + e) * kTile + j0, _mm512_xor_si512(rows[e], offset));
    }
}

// scores[r * kTile + j] for R query rows: codes as words (q_words[r * padded words + w]), block scales and
// offsets (128 times each block's sum of codes) [r * blocks + b]; factors[j] = scale * s_j.
template <int ND, int R>
inline void int8_scores(const uint32_t* q_words, const float* q_scales, const int32_t* q_offsets,
                        const uint32_t* key_words, const float* factors, float* scores) {
  constexpr int64_t kPaddedWords = kPaddedDims<ND> / 4, kBlocks = kPaddedDims<ND> / kQueryBlockDims;
  constexpr int kVectors = kTile / 16;
  __m512 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kBlocks; ++b) {
    __m512i sums[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_setzero_si512();
    for (int64_t w = 8 * b; w < 8 * b + 8; ++w) {
      __m512i keys[kVectors];
      for (int v = 0; v < kVectors; ++v) keys[v] = _mm512_load_si512(key_words + w * kTile + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512i element = _mm512_set1_epi32(static_cast<int>(q_words[r * kPaddedWords + w]));
        for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbusd_epi32(sums[r][v], keys[v], element);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m512i offset = _mm512_set1_epi32(q_offsets[r * kBlocks + b]);
      const __m512 block_scale = _mm512_set1_ps(q_scales[r * kBlocks + b]);
      for (int v = 0; v < kVectors; ++v)
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r][v], offset)), block_scale, acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      _mm512_storeu_ps(scores + r * kTile + 16 * v, _mm512_mul_ps(acc[r][v], _mm512_loadu_ps(factors + 16 * v)));
}
#else
constexpr bool kVnni = false;
// 2 rows × 4 vectors of integer sums and of float chains.
constexpr int kInt8ScoreRows = 2;

// The tile's int8 keys as words (see above), codes as they are; tokens past n, and dimensions past head_dim, 0.
template <int ND>
inline void int8_key_words(const int8_t* const* keys, int64_t n, uint32_t* key_words) {
  constexpr int64_t kWords = ND * 2, kPaddedWords = kPaddedDims<ND> / 4;
  for (int64_t j0 = 0; j0 < kTile; j0 += 8)
    for (int64_t w0 = 0; w0 < kPaddedWords; w0 += 8) {
      const int64_t valid = std::min<int64_t>(std::max<int64_t>(kWords - w0, 0), 8);
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      __m256 rows[8];
      for (int e = 0; e < 8; ++e)
        rows[e] = j0 + e < n ? _mm256_castsi256_ps(_mm256_maskload_epi32(
                                   reinterpret_cast<const int*>(keys[j0 + e] + 4 * w0), mask))
                             : _mm256_setzero_ps();
      transpose8(rows);
      for (int64_t e = 0; e < 8 && w0 + e < kPaddedWords; ++e)
        _mm256_store_ps(reinterpret_cast<float*>(key_words + (w0 + e) * kTile + j0), rows[e]);
    }
}

// int8_scores without VNNI: |k| times the query codes carrying k's sign (maddubs: pairs of them, at most
// 2 * 127 * 127 in 16 bits), then pairs of those (madd).
template <int ND, int R>
inline void int8_scores(const uint32_t* q_words, const float* q_scales, const int32_t* q_offsets,
                        const uint32_t* key_words, const float* factors, float* scores) {
  constexpr int64_t kPaddedWords = kPaddedDims<ND> / 4, kBlocks = kPaddedDims<ND> / kQueryBlockDims;
  constexpr int kVectors = kTile / 8;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][kVectors];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v) acc[r][v] = _mm256_setzero_ps();
  for (int64_t b = 0; b < kBlocks; ++b) {
    __m256i sums[R][kVectors];
    for (int r = 0; r < R; ++r)
      for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm256_setzero_si256();
    for (int64_t w = 8 * b; w < 8 * b + 8; ++w) {
      __m256i keys[kVectors];
      for (int v = 0; v < kVectors; ++v)
        keys[v] = _mm256_load_si256(reinterpret_cast<const __m256i*>(key_words + w * kTile + 8 * v));
      for (int r = 0; r < R; ++r) {
        const __m256i element = _mm256_set1_epi32(static_cast<int>(q_words[r * kPaddedWords + w]));
        for (int v = 0; v < kVectors; ++v) {
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(keys[v]), _mm256_sign_epi8(element, keys[v]));
          sums[r][v] = _mm256_add_epi32(sums[r][v], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 block_scale = _mm256_set1_ps(q_scales[r * kBlocks + b]);
      for (int v = 0; v < kVectors; ++v)
        acc[r][v] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][v]), block_scale, acc[r][v]);
    }
  }
  (void)q_offsets;
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kVectors; ++v)
      _mm256_storeu_ps(scores + r * kTile + 8 * v, _mm256_mul_ps(acc[r][v], _mm256_loadu_ps(factors + 8 * v)));
}
#endif

// ---- Values --------------------------------------------------------------------------------------------------

// acc_r = acc_r * rescale[r] + sum over the tile's n tokens of weights_r[j] * value row j, for R rows (acc[r],
// weights[r]) and head dimensions [W * c0, W * (c0 + CW)), W the vector width: per output one chain over the
// tokens in order.
template <int R, int CW>
inline void float_values(const float* const* value_rows, int64_t n, const float* const* weights, const float* rescale,
                         int c0, float* const* acc) {
  using Vec = Vector;
  constexpr int W = Vec::kWidth;
  typename Vec::V sum[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) sum[r][c] = Vec::mul(Vec::load(acc[r] + W * (c0 + c)), Vec::broadcast(rescale[r]));
  for (int64_t j = 0; j < n; ++j) {
    typename Vec::V values[CW];
    for (int c = 0; c < CW; ++c) values[c] = Vec::load(value_rows[j] + W * (c0 + c));
    for (int r = 0; r < R; ++r) {
      const typename Vec::V weight = Vec::broadcast(weights[r][j]);
      for (int c = 0; c < CW; ++c) sum[r][c] = Vec::fmadd(weight, values[c], sum[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) Vec::store(acc[r] + W * (c0 + c), sum[r][c]);
}

// pass(std::integral_constant<int, CW>{}, c0) over kVectors vectors of head dimensions: kValueVectors per pass
// (c0 the first), then the rest in one pass.
template <int kVectors, typename Pass>
inline void in_value_passes(const Pass& pass) {
  int c0 = 0;
  for (; c0 + kValueVectors <= kVectors; c0 += kValueVectors) pass(std::integral_constant<int, kValueVectors>{}, c0);
  if (kVectors - c0 == 3) pass(std::integral_constant<int, 3>{}, c0);
  if (kVectors - c0 == 2) pass(std::integral_constant<int, 2>{}, c0);
  if (kVectors - c0 == 1) pass(std::integral_constant<int, 1>{}, c0);
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
// An int8 pool's values in bfloat16 pairs (vdpbf16ps: 32 products per instruction, twice a float32 FMA's 16). The
// stored integers (|q| <= 127) are exact in bfloat16, so only the softmax weights are rounded, to nearest even
// (within 2^-8 relative); every product is exact and every sum float32. Head dimensions come 16 at a time.
template <typename Cache, int ND>
constexpr bool kPairProducts = std::is_same<Cache, int8_t>::value && ND % 2 == 0;

// Pairs of bfloat16 (element 2i in the low half of 32-bit lane i, 2i + 1 in the high half) from two vectors of
// floats that are exact in bfloat16 (small integers): their high halves, no rounding needed.
inline __m512i pair_exact(__m512 low, __m512 high) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(high), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                         _mm512_srli_epi32(_mm512_castps_si512(low), 16));
}

// A tile's int8 values as bfloat16 pairs: value_pairs[i * D + d] holds dimension d of tokens 2i and 2i + 1 (a
// missing last token: zero).
template <int ND>
inline void pair_values(const int8_t* const* values, int64_t n, uint32_t* value_pairs) {
  constexpr int64_t D = ND * 8;
  for (int64_t i = 0; 2 * i < n; ++i)
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 low = load16(values[2 * i] + d);
      const __m512 high = 2 * i + 1 < n ? load16(values[2 * i + 1] + d) : _mm512_setzero_ps();
      _mm512_storeu_si512(value_pairs + i * D + d, pair_exact(low, high));
    }
}

// float_values in pairs: acc_r = acc_r * rescale[r] + sum over the tile's token pairs i of weights_r's pair i
// (bfloat16) times value_pairs row i, for head dimensions [16 * c0, 16 * (c0 + CW)).
template <int ND, int R, int CW>
inline void pair_values_pass(const uint32_t* value_pairs, int64_t pairs, const uint32_t* const* weights,
                             const float* rescale, int c0, float* const* acc) {
  constexpr int64_t D = ND * 8;
  __m512 sum[R][CW];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c)
      sum[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * (c0 + c)), _mm512_set1_ps(rescale[r]));
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh values[CW];
    for (int c = 0; c < CW; ++c) values[c] = (__m512bh)_mm512_loadu_si512(value_pairs + i * D + 16 * (c0 + c));
    for (int r = 0; r < R; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r][i]));
      for (int c = 0; c < CW; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], weight, values[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(acc[r] + 16 * (c0 + c), sum[r][c]);
}
#else
template <typename Cache, int ND>
constexpr bool kPairProducts = false;
#endif

// ---- One kv head's rows over their context -------------------------------------------------------------------

// Scratch of a work item, carved from one 64-byte aligned buffer per thread, reused from call to call. Rows: the
// (query token, query head of the kv head) pairs, row r token i0 + r / G, head kv * G + r % G.
struct Workspace {
  float* queries;      // float pools: [rows, head_dim]
  uint32_t* q_words;   // int8 pools: [rows, padded dims / 4], the rounded queries
  float* q_scales;     // int8 pools: [rows, blocks]
  int32_t* q_offsets;  // int8 pools with VNNI: [rows, blocks], 128 times each block's sum of codes
  float* keys;         // the tile's keys: [head_dim, kTile] floats, or [padded dims / 4, kTile] words
  float* values;       // the tile's widened values [kTile, head_dim], or bfloat16 pairs [kTile / 2, head_dim]
  float* scores;       // [rows, kTile]
  float *m, *l, *rescale, *acc;  // the current split: [rows] each, acc [rows, head_dim]
  float *M, *L, *A;              // the result so far: [rows] each, A [rows, head_dim]

  Workspace(int64_t rows, int64_t D) {
    struct alignas(64) Line {
      float values[16];
    };
    static thread_local std::vector<Line> buffer;
    const auto lines = [](int64_t floats) { return (floats + 15) / 16; };
    const int64_t words = (D + kQueryBlockDims - 1) / kQueryBlockDims * kQueryBlockDims / 4;
    const int64_t sizes[] = {rows * D, rows * words, rows * words / 8, rows * words / 8, kTile * std::max(words, D),
                             kTile * D, rows * kTile, rows, rows, rows, rows * D, rows, rows, rows * D};
    float* parts[14];
    float* next = nullptr;
    int64_t total = 0;
    for (const int64_t size : sizes) total += lines(size);
    if (static_cast<int64_t>(buffer.size()) < total) buffer.resize(total);
    next = buffer.data()->values;
    for (int k = 0; k < 14; ++k) {
      parts[k] = next;
      next += 16 * lines(sizes[k]);
    }
    queries = parts[0];
    q_words = reinterpret_cast<uint32_t*>(parts[1]);
    q_scales = parts[2];
    q_offsets = reinterpret_cast<int32_t*>(parts[3]);
    keys = parts[4];
    values = parts[5];
    scores = parts[6];
    m = parts[7];
    l = parts[8];
    rescale = parts[9];
    acc = parts[10];
    M = parts[11];
    L = parts[12];
    A = parts[13];
  }
};

// The rows' queries into the workspace: copied for a float pool, rounded to int8 per 32 head dimensions for an int8
// one.
template <int ND, typename Cache>
void pack_queries(const Problem<Cache>& p, const Span& span, int64_t kv, int64_t i0, int64_t row_base,
                  int64_t num_rows, int64_t G, Workspace& w) {
  constexpr int64_t D = ND * 8, kPadded = kPaddedDims<ND>, kBlocks = kPadded / kQueryBlockDims;
  for (int64_t r = row_base; r < row_base + num_rows; ++r) {
    const float* query = p.query + (span.row + i0 + (r - row_base) / G) * p.q_row_stride + (kv * G + r % G) * D;
    if constexpr (std::is_same<Cache, int8_t>::value) {
      alignas(64) float padded[kPadded] = {};
      memcpy(padded, query, D * sizeof(float));
      int8_t* codes = reinterpret_cast<int8_t*>(w.q_words + r * kPadded / 4);
      quantize_activations(padded, 1, kPadded, codes, w.q_scales + r * kBlocks);
      for (int64_t b = 0; b < kBlocks; ++b) {
        int32_t sum = 0;
        for (int64_t d = 0; d < kQueryBlockDims; ++d) sum += codes[b * kQueryBlockDims + d];
        w.q_offsets[r * kBlocks + b] = 128 * sum;
      }
    } else {
      memcpy(w.queries + r * D, query, D * sizeof(float));
    }
  }
}

// The tile's keys and values into the workspace (its n tokens' rows at offsets, kv head kv): value_rows[j] points at
// token j's values as floats, value_scales[j] its int8 scale; factors[j] = scale times key j's int8 scale.
template <int ND, typename Cache>
void load_tile(const Problem<Cache>& p, const int64_t* offsets, int64_t kv, int64_t n, Workspace& w,
               const float** value_rows, float* value_scales, float* factors) {
  constexpr int64_t D = ND * 8;
  const int64_t entry = D + kEntryExtra<Cache>;
  const Cache* keys[kTile];
  const Cache* values[kTile];
  for (int64_t j = 0; j < n; ++j) {
    keys[j] = p.key_cache + offsets[j] + kv * entry;
    values[j] = p.value_cache + offsets[j] + kv * entry;
  }
  if constexpr (std::is_same<Cache, int8_t>::value) {
    for (int64_t j = 0; j < kTile; ++j) {
      factors[j] = j < n ? p.scale * entry_scale(keys[j], D) : 0.0f;
      value_scales[j] = j < n ? entry_scale(values[j], D) : 1.0f;
    }
    int8_key_words<ND>(keys, n, reinterpret_cast<uint32_t*>(w.keys));
  } else {
    transpose_float_keys<ND>(keys, n, w.keys);
  }
  if constexpr (kPairProducts<Cache, ND>) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
    pair_values<ND>(values, n, reinterpret_cast<uint32_t*>(w.values));
#endif
  } else {
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (std::is_same<Cache, float>::value) {
        value_rows[j] = values[j];
        continue;
      }
      for (int64_t d = 0; d < D; d += 8) _mm256_store_ps(w.values + j * D + d, load8(values[j] + d));
      value_rows[j] = w.values + j * D;
    }
  }
}

// The pool offsets (in cache elements) of the rows of context tokens [t0, t0 + n) of a request (blocks: its block
// table): one division for the run, not two per token.
template <typename Cache>
inline void token_offsets(const Problem<Cache>& p, const int64_t* blocks, int64_t t0, int64_t n, int64_t entry,
                          int64_t* offsets) {
  const int64_t token_stride = p.num_kv_heads * entry;
  int64_t block = t0 / p.block_size, slot = t0 % p.block_size;
  for (int64_t j = 0; j < n; ++j) {
    offsets[j] = (blocks[block] * p.block_size + slot) * token_stride;
    if (++slot == p.block_size) {
      slot = 0;
      ++block;
    }
  }
}

// Asks for the entries of kv heads [kv0, kv1) of context tokens [t0, t1) into L2: the blocks are scattered, so the
// hardware prefetcher stops at each block's end, and a tile read cold waits on memory once per token.
template <int ND, typename Cache>
inline void prefetch_tile(const Problem<Cache>& p, const int64_t* blocks, int64_t kv0, int64_t kv1, int64_t t0,
                          int64_t t1) {
  const int64_t entry = ND * 8 + kEntryExtra<Cache>, bytes = (kv1 - kv0) * entry * sizeof(Cache);
  for (int64_t start = t0; start < t1; start += kTile) {
    int64_t offsets[kTile];
    const int64_t count = std::min(kTile, t1 - start);
    token_offsets(p, blocks, start, count, entry, offsets);
    for (int64_t j = 0; j < count; ++j)
      for (const Cache* pool : {p.key_cache, p.value_cache}) {
        const char* first = reinterpret_cast<const char*>(pool + offsets[j] + kv0 * entry);
        for (int64_t line = 0; line < bytes + 63; line += 64) _mm_prefetch(first + std::min(line, bytes - 1), _MM_HINT_T0);
      }
  }
}

// The next tile's token rows (the entries of kv heads [kv0, kv1)), asked for into L2 a few tokens at a time between
// the phases of the current tile's work: issued in one burst, the requests queued up behind each other and stalled
// the core.
template <typename Cache>
struct TilePrefetcher {
  const Cache* pools[2] = {nullptr, nullptr};
  int64_t offsets[kTile];
  int64_t count = 0, done = 0, per_step = 0, bytes = 0;

  void plan(const Problem<Cache>& p, const int64_t* blocks, int64_t entry, int64_t kv0, int64_t kv1, int64_t t0,
            int64_t t1, int64_t steps) {
    pools[0] = p.key_cache + kv0 * entry;
    pools[1] = p.value_cache + kv0 * entry;
    count = std::max<int64_t>(t1 - t0, 0);
    done = 0;
    per_step = (count + steps - 1) / steps;
    bytes = (kv1 - kv0) * entry * static_cast<int64_t>(sizeof(Cache));
    token_offsets(p, blocks, t0, count, entry, offsets);
  }
  void step() {
    const int64_t until = std::min(count, done + per_step);
    for (; done < until; ++done)
      for (const Cache* pool : pools) {
        const char* first = reinterpret_cast<const char*>(pool + offsets[done]);
        for (int64_t line = 0; line < bytes + 63; line += 64) _mm_prefetch(first + std::min(line, bytes - 1), _MM_HINT_T1);
      }
  }
  void finish() {
    per_step = count;
    step();
  }
};

// One tile of kv head kv for its rows of tokens [ia, ib) (those that see it; the head's rows start at row_base):
// their scores, each row's masked online-softmax update, then their value sums.
template <int ND, typename Cache>
void attend_tile(const Problem<Cache>& p, const int64_t* offsets, int64_t kv, int64_t tile, int64_t n,
                 int64_t first_position, int64_t i0, int64_t ia, int64_t ib, int64_t G, int64_t row_base,
                 Workspace& w, TilePrefetcher<Cache>& prefetch) {
  constexpr int64_t D = ND * 8, kPaddedWords = kPaddedDims<ND> / 4, kBlocks = kPaddedDims<ND> / kQueryBlockDims;
  constexpr bool kPairs = kPairProducts<Cache, ND>;
  const float* value_rows[kTile];
  alignas(32) float value_scales[kTile], factors[kTile];
  load_tile<ND, Cache>(p, offsets, kv, n, w, value_rows, value_scales, factors);
  prefetch.step();
  const int64_t ra = row_base + (ia - i0) * G, rb = row_base + (ib - i0) * G;
  if constexpr (std::is_same<Cache, int8_t>::value) {
    in_row_groups<kInt8ScoreRows>(ra, rb, [&](auto rows, int64_t r) {
      int8_scores<ND, decltype(rows)::value>(w.q_words + r * kPaddedWords, w.q_scales + r * kBlocks,
                                             w.q_offsets + r * kBlocks, reinterpret_cast<const uint32_t*>(w.keys),
                                             factors, w.scores + r * kTile);
    });
  } else {
    in_row_groups<kScoreRows>(ra, rb, [&](auto rows, int64_t r) {
      float_scores<ND, decltype(rows)::value>(w.queries + r * D, w.keys, p.scale, w.scores + r * kTile);
    });
  }
  prefetch.step();
  if (p.softcap > 0.0f) soft_cap(w.scores + ra * kTile, (rb - ra) * kTile, p.softcap);
  for (int64_t i = ia; i < ib; ++i) {
    const int64_t position = first_position + i;
    const int64_t visible = std::min(position + 1 - tile, n);
    const int64_t hidden = std::max<int64_t>(window_start(p.window, position) - tile, 0);
    for (int64_t r = row_base + (i - i0) * G; r < row_base + (i - i0 + 1) * G; ++r) {
      float* s = w.scores + r * kTile;
      for (int64_t j = 0; j < hidden; ++j) s[j] = -INFINITY;
      for (int64_t j = visible; j < kTile; ++j) s[j] = -INFINITY;
      // hidden < visible, so the max is finite.
      w.rescale[r] = online_softmax<Cache, kPairs>(s, value_scales, w.m[r], w.l[r]);
    }
  }
  prefetch.step();
  in_row_groups<kValueRows>(ra, rb, [&](auto rows, int64_t r) {
    constexpr int R = decltype(rows)::value;
    const float* weights[R];
    float* acc[R];
    for (int k = 0; k < R; ++k) {
      weights[k] = w.scores + (r + k) * kTile;
      acc[k] = w.acc + (r + k) * D;
    }
    if constexpr (kPairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VL__)
      const uint32_t* pair_weights[R];
      for (int k = 0; k < R; ++k) pair_weights[k] = reinterpret_cast<const uint32_t*>(weights[k]);
      in_value_passes<ND / 2>([&](auto width, int c0) {
        pair_values_pass<ND, R, decltype(width)::value>(reinterpret_cast<const uint32_t*>(w.values), (n + 1) / 2,
                                                        pair_weights, w.rescale + r, c0, acc);
      });
#endif
    } else {
      in_value_passes<D / Vector::kWidth>([&](auto width, int c0) {
        float_values<R, decltype(width)::value>(value_rows, n, weights, w.rescale + r, c0, acc);
      });
    }
  });
}

// Query tokens [i0, i1) of `span`, the query heads of kv heads [kv0, kv1), over their whole context (split < 0) or
// over one split of it: leaves each row's (M, L, A) in the workspace, its output A / L. Row r of kv head kv0 + k is
// row k * (i1 - i0) * G + r of the workspace. Each tile is taken by every kv head in turn while its token rows (all
// kv heads side by side) are in L1.
template <int ND, typename Cache>
void attend_rows(const Problem<Cache>& p, const Span& span, int64_t kv0, int64_t kv1, int64_t i0, int64_t i1,
                 int64_t split, Workspace& w) {
  constexpr int64_t D = ND * 8;
  const int64_t G = p.num_heads / p.num_kv_heads, head_rows = (i1 - i0) * G, num_rows = (kv1 - kv0) * head_rows;
  const int64_t* blocks = p.block_tables + span.request * p.max_blocks;
  const int64_t first_position = span.context - span.length, last_position = first_position + i1 - 1;
  for (int64_t kv = kv0; kv < kv1; ++kv) pack_queries<ND, Cache>(p, span, kv, i0, (kv - kv0) * head_rows, head_rows, G, w);
  const int64_t first_seen = window_start(p.window, first_position + i0);
  const int64_t s0 = split >= 0 ? split : first_seen / kSplitTokens;
  const int64_t s1 = split >= 0 ? split + 1 : last_position / kSplitTokens + 1;
  for (int64_t r = 0; r < num_rows; ++r) {
    w.M[r] = -INFINITY;
    w.L[r] = 0.0f;
  }
  for (int64_t s = s0; s < s1; ++s) {
    for (int64_t r = 0; r < num_rows; ++r) {
      w.m[r] = -INFINITY;
      w.l[r] = 0.0f;
    }
    memset(w.acc, 0, num_rows * D * sizeof(float));
    const int64_t begin = std::max(s * kSplitTokens, first_seen / kTile * kTile);
    const int64_t end = std::min((s + 1) * kSplitTokens, last_position + 1);
    for (int64_t tile = begin; tile < end; tile += kTile) {
      const int64_t n = std::min(last_position + 1 - tile, kTile);
      // The tokens that see the tile: [ia, ib), those at or after its start whose window reaches into it.
      const int64_t ia = tile > first_position + i0 ? tile - first_position : i0;
      int64_t ib = i1;
      while (ib > ia && window_start(p.window, first_position + ib - 1) >= tile + n) --ib;
      TilePrefetcher<Cache> prefetch;
      prefetch.plan(p, blocks, D + kEntryExtra<Cache>, kv0, kv1, tile + kTile, std::min(tile + 2 * kTile, end),
                    3 * (kv1 - kv0));
      if (ia < ib) {
        int64_t offsets[kTile];
        token_offsets(p, blocks, tile, n, D + kEntryExtra<Cache>, offsets);
        for (int64_t kv = kv0; kv < kv1; ++kv)
          attend_tile<ND, Cache>(p, offsets, kv, tile, n, first_position, i0, ia, ib, G, (kv - kv0) * head_rows, w,
                                 prefetch);
      }
      prefetch.finish();
    }
    for (int64_t r = 0; r < num_rows; ++r) merge_split(w.M[r], w.L[r], w.A + r * D, w.m[r], w.l[r], w.acc + r * D, D);
  }
}

// ---- Work items ----------------------------------------------------------------------------------------------

// A piece of work: query tokens [i0, i1) of a span with one kv head (kv >= 0) or all of them (kv < 0), over the
// whole context (split < 0) or one split, whose partial result then goes to scratch.
struct Item {
  int64_t span, kv, i0, i1, split, scratch;
};

// The splits a decoding token's context covers: [first, last].
inline void decode_splits(const Span& span, int64_t window, int64_t& first, int64_t& last) {
  first = window_start(window, span.context - 1) / kSplitTokens;
  last = (span.context - 1) / kSplitTokens;
}

// Thread `part` of `parts`'s share of items [0, n): a contiguous run of about equal work (work(i) of item i), so
// that a thread knows the item it takes next.
template <typename Work>
void equal_work_run(int64_t n, int part, int parts, Work work, int64_t& begin, int64_t& end) {
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += work(i);
  // Run k starts at the item boundary whose work before it is nearest k / parts of the total.
  const auto boundary = [&](int k) {
    if (k <= 0) return int64_t{0};
    if (k >= parts) return n;
    int64_t best = 0, best_gap = total * k, sum = 0;
    for (int64_t i = 0; i <= n; ++i) {
      const int64_t gap = sum * parts > total * k ? sum * parts - total * k : total * k - sum * parts;
      if (gap < best_gap) {
        best = i;
        best_gap = gap;
      }
      if (i < n) sum += work(i);
    }
    return best;
  };
  begin = boundary(part);
  end = boundary(part + 1);
}

// The first tile a decoding token's item (its whole context, or split `split`) reads, into L2.
template <int ND, typename Cache>
inline void prefetch_first_tiles(const Problem<Cache>& p, const Span& span, int64_t split) {
  const int64_t last = span.context - 1, first_seen = window_start(p.window, last);
  const int64_t begin = split >= 0 ? std::max(split * kSplitTokens, first_seen / kTile * kTile) : first_seen / kTile * kTile;
  prefetch_tile<ND, Cache>(p, p.block_tables + span.request * p.max_blocks, 0, p.num_kv_heads, begin,
                           std::min(begin + kTile, last + 1));
}

// Runs one item: its rows' outputs A / L into out, or their (M, L, A) into scratch (per head: M, L, then A).
template <int ND, typename Cache>
void run_item(const Problem<Cache>& p, const std::vector<Span>& spans, const Item& item, float* scratch) {
  constexpr int64_t D = ND * 8;
  const int64_t G = p.num_heads / p.num_kv_heads;
  const Span& span = spans[item.span];
  const int64_t kv0 = item.kv >= 0 ? item.kv : 0, kv1 = item.kv >= 0 ? item.kv + 1 : p.num_kv_heads;
  const int64_t head_rows = (item.i1 - item.i0) * G;
  Workspace w((kv1 - kv0) * head_rows, D);
  attend_rows<ND, Cache>(p, span, kv0, kv1, item.i0, item.i1, item.split, w);
  for (int64_t r = 0; r < (kv1 - kv0) * head_rows; ++r) {
    const int64_t head = (kv0 + r / head_rows) * G + r % G, token = item.i0 + r % head_rows / G;
    if (item.scratch >= 0) {
      float* partial = scratch + item.scratch + head * (D + 2);
      partial[0] = w.M[r];
      partial[1] = w.L[r];
      memcpy(partial + 2, w.A + r * D, D * sizeof(float));
      continue;
    }
    float* out = p.out + (span.row + token) * p.out_row_stride + head * D;
    for (int64_t d = 0; d < D; ++d) out[d] = w.A[r * D + d] / w.L[r];
  }
}

// Every span: prompt chunks in items of kQueryBlock tokens and one kv head (the later blocks, which see more
// context, first), decoding tokens in one item for all heads, or one per split where there are several, whose
// partial results are then folded in split order.
template <int ND, typename Cache>
void run(const Problem<Cache>& p, const std::vector<Span>& spans, int num_threads) {
  constexpr int64_t D = ND * 8;
  const int64_t H = p.num_heads, partial_floats = H * (D + 2);
  std::vector<Item> items;
  std::vector<int64_t> merges;  // spans whose splits run apart
  int64_t num_partials = 0, work = 0;
  for (int64_t c = 0; c < static_cast<int64_t>(spans.size()); ++c) {
    const Span& span = spans[c];
    work += span.length * std::min(span.context, p.window > 0 ? p.window : span.context) * H;
    if (span.length > 1) {
      for (int64_t i0 = (span.length - 1) / kQueryBlock * kQueryBlock; i0 >= 0; i0 -= kQueryBlock)
        for (int64_t kv = 0; kv < p.num_kv_heads; ++kv)
          items.push_back({c, kv, i0, std::min(i0 + kQueryBlock, span.length), -1, -1});
      continue;
    }
    int64_t first, last;
    decode_splits(span, p.window, first, last);
    if (first == last) {
      items.push_back({c, -1, 0, 1, -1, -1});
      continue;
    }
    merges.push_back(c);
    for (int64_t s = first; s <= last; ++s) items.push_back({c, -1, 0, 1, s, (num_partials++) * partial_floats});
  }
  std::vector<float> scratch(num_partials * partial_floats);
  const int threads = work >= kParallelWork ? num_threads : 1;
  const int64_t num_items = static_cast<int64_t>(items.size());
  int64_t num_chunk_items = 0;
  while (num_chunk_items < num_items && items[num_chunk_items].kv >= 0) ++num_chunk_items;
  // Prompt chunks handed out one at a time; then decoding tokens in one contiguous run of about equal work per
  // thread, each item's first tiles fetched while the one before it computes (their blocks are cold and scattered).
  const auto decode_work = [&](int64_t i) {
    const Span& span = spans[items[i].span];
    return items[i].split >= 0 ? kSplitTokens : std::min(span.context, p.window > 0 ? p.window : span.context);
  };
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(dynamic) nowait
    for (int64_t i = 0; i < num_chunk_items; ++i) run_item<ND, Cache>(p, spans, items[i], scratch.data());
    int64_t begin, end;
    equal_work_run(num_items - num_chunk_items, omp_get_thread_num(), omp_get_num_threads(),
                   [&](int64_t i) { return decode_work(num_chunk_items + i); }, begin, end);
    for (int64_t i = num_chunk_items + begin; i < num_chunk_items + end; ++i) {
      if (i + 1 < num_chunk_items + end) prefetch_first_tiles<ND, Cache>(p, spans[items[i + 1].span], items[i + 1].split);
      run_item<ND, Cache>(p, spans, items[i], scratch.data());
    }
  }
  if (merges.empty()) return;
  // Each split span's partial results: consecutive in scratch, in split order, from its first item's offset.
  std::vector<int64_t> first_partial(spans.size(), -1);
  for (const Item& item : items)
    if (item.scratch >= 0 && first_partial[item.span] < 0) first_partial[item.span] = item.scratch;
  const int64_t num_merges = static_cast<int64_t>(merges.size());
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
  for (int64_t k = 0; k < num_merges; ++k) {
    const Span& span = spans[merges[k]];
    int64_t first, last;
    decode_splits(span, p.window, first, last);
    std::vector<float> A(D);
    for (int64_t h = 0; h < H; ++h) {
      float M = -INFINITY, L = 0.0f;
      for (int64_t s = 0; s <= last - first; ++s) {
        const float* partial = scratch.data() + first_partial[merges[k]] + s * partial_floats + h * (D + 2);
        merge_split(M, L, A.data(), partial[0], partial[1], partial + 2, D);
      }
      float* out = p.out + span.row * p.out_row_stride + h * D;
      for (int64_t d = 0; d < D; ++d) out[d] = A[d] / L;
    }
  }
}

// Head sizes run() is compiled for (head_dim = 8 * ND).
bool supported_head_dim(int64_t head_dim) {
  switch (head_dim) {
    case 32: case 64: case 80: case 96: case 128: case 256: return true;
    default: return false;
  }
}

// paged_attention_window_f32 for one pool type.
template <typename Cache>
int paged_attention(const float* query, int64_t q_row_stride, int64_t num_rows, const float* key, int64_t k_row_stride,
                    const float* value, int64_t v_row_stride, const int64_t* slots, Cache* key_cache,
                    Cache* value_cache, int64_t num_blocks, int64_t block_size, int64_t num_heads,
                    int64_t num_kv_heads, int64_t head_dim, const int64_t* block_tables, int64_t num_requests,
                    int64_t max_blocks, const int64_t* queries, int64_t num_queries, const int64_t* chunks,
                    int64_t num_chunks, float scale, int64_t window, float softcap, float* out,
                    int64_t out_row_stride, int num_threads) {
  if (!supported_head_dim(head_dim)) return 2;
  if (window < 0 || !(softcap >= 0.0f) || isinf(softcap)) return 1;
  if (num_heads % num_kv_heads != 0) return 1;
  for (int64_t t = 0; t < num_rows; ++t)
    if (slots[t] < 0 || slots[t] >= num_blocks * block_size) return 1;
  for (int64_t qi = 0; qi < num_queries; ++qi) {
    const int64_t row = queries[3 * qi], request = queries[3 * qi + 1], context = queries[3 * qi + 2];
    if (row < 0 || row >= num_rows || request < 0 || request >= num_requests) return 1;
    if (context < 1 || context > max_blocks * block_size) return 1;
    const int64_t* blocks = block_tables + request * max_blocks;
    for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b)
      if (blocks[b] < 0 || blocks[b] >= num_blocks) return 1;
  }
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t row = chunks[4 * c], request = chunks[4 * c + 1], length = chunks[4 * c + 2];
    const int64_t context = chunks[4 * c + 3];
    if (row < 0 || length < 1 || row + length > num_rows || request < 0 || request >= num_requests) return 1;
    if (context < length || context > max_blocks * block_size) return 1;
    const int64_t* blocks = block_tables + request * max_blocks;
    for (int64_t b = 0; b < (context + block_size - 1) / block_size; ++b)
      if (blocks[b] < 0 || blocks[b] >= num_blocks) return 1;
  }
  const int64_t width = num_kv_heads * (head_dim + kEntryExtra<Cache>);  // cache elements per token
  // In parallel for a prompt's many rows: the first write to a pool page also takes the page fault that maps it,
  // which on a fresh pool is a visible share of a large batch's step when one thread takes them all.
#pragma omp parallel for num_threads(num_threads) if (num_rows >= 2 * num_threads && num_threads > 1)
  for (int64_t t = 0; t < num_rows; ++t) {
    store_entries(key + t * k_row_stride, num_kv_heads, head_dim, key_cache + slots[t] * width);
    store_entries(value + t * v_row_stride, num_kv_heads, head_dim, value_cache + slots[t] * width);
  }
  const Problem<Cache> p{query,        q_row_stride, out,          out_row_stride, key_cache, value_cache,
                         num_heads,    num_kv_heads, block_size,   block_tables,   max_blocks, scale,
                         window,       softcap};
  std::vector<Span> spans;
  spans.reserve(num_chunks + num_queries);
  for (int64_t c = 0; c < num_chunks; ++c) spans.push_back({chunks[4 * c], chunks[4 * c + 1], chunks[4 * c + 2], chunks[4 * c + 3]});
  for (int64_t qi = 0; qi < num_queries; ++qi) spans.push_back({queries[3 * qi], queries[3 * qi + 1], 1, queries[3 * qi + 2]});
  switch (head_dim) {
    case 32: run<4, Cache>(p, spans, num_threads); break;
    case 64: run<8, Cache>(p, spans, num_threads); break;
    case 80: run<10, Cache>(p, spans, num_threads); break;
    case 96: run<12, Cache>(p, spans, num_threads); break;
    case 128: run<16, Cache>(p, spans, num_threads); break;
    case 256: run<32, Cache>(p, spans, num_threads); break;
  }
  return 0;
}

}  // namespace

extern "C" {

// Head sizes the kernel is compiled for (head_dim = 8 * ND).
int paged_attention_supports(int64_t head_dim) { return supported_head_dim(head_dim); }

// First stores this step's keys and values in their cache slots, then attends.
//   query [num_rows rows of num_heads * head_dim, q_row_stride floats apart]; out likewise (out_row_stride).
//   key, value [num_rows rows of num_kv_heads * head_dim]; slots [num_rows] int64: each row's cache slot.
//   key_cache, value_cache [num_blocks, block_size, num_kv_heads, entry]: kv_cache_format 0: float32, entry =
//   head_dim; 1: float16 (as uint16 bits), entry = head_dim; 2: int8, entry = head_dim + 4 (the values, then the
//   float32 scale's bytes). block_tables [num_requests, max_blocks] int64; queries [num_queries, 3] int64: single
//   query tokens (token row in query/out, request index into block_tables, context length); chunks [num_chunks, 4]
//   int64: prompt chunks (first token row, request index, number of tokens, context length after them), whose
//   tokens attend causally.
//   window: sliding-window attention, each token sees only the last `window` positions up to itself (0: all).
//   softcap: scores soft-capped to softcap * tanh(scores / softcap) before the softmax (Gemma 2; 0: none).
// Returns 0, or 1 if a slot, row, request, context length, block id, the window or softcap is out of range
// (nothing is written or computed then), or 2 if head_dim is not supported.
int paged_attention_window_f32(const float* query, int64_t q_row_stride, int64_t num_rows, const float* key,
                        int64_t k_row_stride, const float* value, int64_t v_row_stride, const int64_t* slots,
                        void* key_cache, void* value_cache, int64_t num_blocks, int64_t block_size,
                        int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, const int64_t* block_tables,
                        int64_t num_requests, int64_t max_blocks, const int64_t* queries, int64_t num_queries,
                        const int64_t* chunks, int64_t num_chunks, float scale, int64_t window, float softcap,
                        float* out, int64_t out_row_stride, int num_threads, int kv_cache_format) {
  const auto attend_in = [&](auto* key_pool, auto* value_pool) {
    return paged_attention(query, q_row_stride, num_rows, key, k_row_stride, value, v_row_stride, slots, key_pool,
                           value_pool, num_blocks, block_size, num_heads, num_kv_heads, head_dim, block_tables,
                           num_requests, max_blocks, queries, num_queries, chunks, num_chunks, scale, window, softcap,
                           out, out_row_stride, num_threads);
  };
  switch (kv_cache_format) {
    case 0: return attend_in(static_cast<float*>(key_cache), static_cast<float*>(value_cache));
    case 1: return attend_in(static_cast<uint16_t*>(key_cache), static_cast<uint16_t*>(value_cache));
    case 2: return attend_in(static_cast<int8_t*>(key_cache), static_cast<int8_t*>(value_cache));
    default: return 1;
  }
}

}  // extern "C"
