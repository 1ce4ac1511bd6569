// Paged attention for short queries, read straight from the KV block pool (after writing this step's keys and
// values into it).
//
// Each query token attends to the first context_len tokens of its request, whose keys and values sit in the
// blocks its block table names: key_cache, value_cache [num_blocks, block_size, num_kv_heads, head_dim]. No
// gathered copy of the context is made: the kernel walks the block table. Grouped-query attention: query heads
// h * G .. h * G + G - 1 share kv head h (G = heads / kv heads). One work item computes every head of a query
// token, so a token's keys and values (all kv heads side by side) are read from memory once, in block order,
// and serve all its dot products from L1.
//
// Softmax is online, in float32 (flash attention's rule): per tile of tokens, scores s = q.k * scale, the
// running max m is raised to the tile's max, the running sum l and the accumulator acc = sum e^(s - m) v are
// rescaled by e^(m_old - m_new), then the tile's terms are added. The result is acc / l.
//
// Parallel over (query token, split): a context longer than kSplitTokens is cut into splits whose partial
// (m, l, acc) are merged at the end (flash-decoding), so one long request still keeps every thread busy. The
// splits depend only on the request's own context length, never on the batch, so a request's numbers do not
// change with what it is batched with. Each thread takes a contiguous run of these items of about equal work
// and fetches the next item's first tile while it finishes the current one (equal_work_run).
//
// The pool holds float32, float16 or int8 (a 16-bit KV cache halves the bytes each step reads and doubles the
// tokens a pool of given memory holds; int8 takes a bit more than half of that again). Float16 entries are widened
// to float32 on load (F16C) and everything after is float32; this step's keys and values are rounded to float16
// (to nearest, ties to even) when stored, exactly as PyTorch's .to(torch.float16) rounds them. An int8 entry (one
// token's vector for one kv head) is head_dim values q and then its float32 scale s, 4 bytes: the vector is s * q,
// with s = max|x| / 127 and q = x / s rounded to nearest, ties to even (kv/cache.py's encode_int8, the same
// operations in the same order). Scores are q . k_q * s_k, values enter as weight * s_v * v_q. Where the CPU has
// AVX512-BF16, an int8 pool's prompt chunks multiply in bfloat16 (kPairProducts): the integers are exact there, and
// the queries and softmax weights are rounded, as llama.cpp rounds them to float16 for its float16 cache.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

using tokenriver::exp256;
using tokenriver::horizontal_max;
using tokenriver::horizontal_sum;
using tokenriver::transpose8;

// Eight cache entries as floats.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// Where the CPU has AVX-512, decode steps read head dimensions 16 at a time when head_dim is a multiple of 16: one
// conversion and one FMA per 16 values instead of per 8. An int8 pool is bound by those operations more than by
// memory (each value is widened twice, to int32 and to float), so it gains; a float16 pool, bound by memory, does
// not (benchmarks/results/attention.md measures the kernel). Scores sum
// in another order than 8 at a time, so their last bits differ from the 8-wide path's; a request's results still do
// not depend on its batch or the thread count.
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

// Context tokens per split. Small enough that a single decoding request spreads over the threads (splits of 512
// left one thread with most of a 717-token context); with many requests at once the split size hardly matters.
constexpr int64_t kSplitTokens = 128;
// Scores computed per softmax update; a multiple of 8.
constexpr int64_t kTile = 32;
// Below this many (token, head) score products the whole call runs on one thread (about 230 tokens of context
// for 9 heads: shorter ones finish before a second thread would have started).
constexpr int64_t kParallelWork = 1 << 11;

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
  const int64_t* queries;  // [num_queries, 3]: token row, request index, context length
  float scale;
  // Sliding window: a token sees only the last `window` positions up to itself (0: the whole context).
  int64_t window;
  // Soft-capping (Gemma 2): scores become softcap * tanh(scores / softcap) before the softmax (0: none).
  float softcap;

  // First context position query token qi sees: its window's start.
  int64_t first_visible(int64_t qi) const {
    const int64_t context = queries[3 * qi + 2];
    return window > 0 && context > window ? context - window : 0;
  }
  // How many context tokens query token qi sees.
  int64_t visible(int64_t qi) const { return queries[3 * qi + 2] - first_visible(qi); }
};

// The eight horizontal sums of v[0..7], as one vector: lane k = sum of the lanes of v[k].
inline __m256 sum_each(const __m256 v[8]) {
  // hadd adds neighbouring pairs within each 128-bit half; two rounds leave, per half, four partial sums.
  const __m256 pairs0 = _mm256_hadd_ps(v[0], v[1]), pairs1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 pairs2 = _mm256_hadd_ps(v[4], v[5]), pairs3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 quads0 = _mm256_hadd_ps(pairs0, pairs1), quads1 = _mm256_hadd_ps(pairs2, pairs3);
  // quads0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low half | high half), quads1 likewise for v[4..7].
  return _mm256_add_ps(_mm256_permute2f128_ps(quads0, quads1, 0x20), _mm256_permute2f128_ps(quads0, quads1, 0x31));
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

// One head's online-softmax update over a tile's scores (count of them, a multiple of 8; padding lanes -inf):
// raises the running max m to the tile's, turns the scores into e^(s - m), rescales the running sum l and adds
// theirs, and returns e^(m_old - m_new), the factor the head's accumulator must be rescaled by.
inline float online_softmax(float* scores, int64_t count, float& m, float& l) {
  __m256 max_vector = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < count; j += 8) max_vector = _mm256_max_ps(max_vector, _mm256_load_ps(scores + j));
  const float new_max = fmaxf(m, horizontal_max(max_vector));
  const float rescale = m == -INFINITY ? 0.0f : expf(m - new_max);
  const __m256 shift = _mm256_set1_ps(new_max);
  __m256 total = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_load_ps(scores + j), shift));
    _mm256_store_ps(scores + j, e);
    total = _mm256_add_ps(total, e);
  }
  m = new_max;
  l = l * rescale + horizontal_sum(total);
  return rescale;
}

// acc[hh] = acc[hh] * rescale[hh] + sum over the n tokens of weights[hh * kTile + j] * value row j, for head
// dimensions [8 * c0, 8 * (c0 + CW)): HC × CW accumulators, each value vector loaded serving HC heads.
template <int ND, int HC, int CW, typename Cache>
inline void chunk_values(const Cache* const* value_rows, int64_t n, const float* weights, const float* rescale,
                         int c0, float* acc) {
  constexpr int64_t D = ND * 8;
  __m256 sum[HC][CW];
  for (int hh = 0; hh < HC; ++hh)
    for (int c = 0; c < CW; ++c)
      sum[hh][c] = _mm256_mul_ps(_mm256_loadu_ps(acc + hh * D + 8 * (c0 + c)), _mm256_set1_ps(rescale[hh]));
  for (int64_t j = 0; j < n; ++j) {
    __m256 values[CW];
    for (int c = 0; c < CW; ++c) values[c] = load8(value_rows[j] + 8 * (c0 + c));
    for (int hh = 0; hh < HC; ++hh) {
      const __m256 weight = _mm256_broadcast_ss(weights + hh * kTile + j);
      for (int c = 0; c < CW; ++c) sum[hh][c] = _mm256_fmadd_ps(weight, values[c], sum[hh][c]);
    }
  }
  for (int hh = 0; hh < HC; ++hh)
    for (int c = 0; c < CW; ++c) _mm256_storeu_ps(acc + hh * D + 8 * (c0 + c), sum[hh][c]);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The eight horizontal sums of v[0..7] (16 lanes each), as one 8-lane vector: each folded to 8 lanes first.
inline __m256 sum_each(const __m512 v[8]) {
  __m256 halves[8];
  for (int k = 0; k < 8; ++k) halves[k] = _mm256_add_ps(_mm512_castps512_ps256(v[k]), _mm512_extractf32x8_ps(v[k], 1));
  return sum_each(halves);
}

// chunk_values for all head dimensions at once, 16 at a time (NZ = head_dim / 16 vectors per head).
template <int NZ, int HC, typename Cache>
inline void values_wide(const Cache* const* value_rows, int64_t n, const float* weights, const float* rescale,
                        float* acc) {
  constexpr int64_t D = NZ * 16;
  __m512 sum[HC][NZ];
  for (int hh = 0; hh < HC; ++hh)
    for (int c = 0; c < NZ; ++c)
      sum[hh][c] = _mm512_mul_ps(_mm512_loadu_ps(acc + hh * D + 16 * c), _mm512_set1_ps(rescale[hh]));
  for (int64_t j = 0; j < n; ++j) {
    __m512 values[NZ];
    for (int c = 0; c < NZ; ++c) values[c] = load16(value_rows[j] + 16 * c);
    for (int hh = 0; hh < HC; ++hh) {
      const __m512 weight = _mm512_set1_ps(weights[hh * kTile + j]);
      for (int c = 0; c < NZ; ++c) sum[hh][c] = _mm512_fmadd_ps(weight, values[c], sum[hh][c]);
    }
  }
  for (int hh = 0; hh < HC; ++hh)
    for (int c = 0; c < NZ; ++c) _mm512_storeu_ps(acc + hh * D + 16 * c, sum[hh][c]);
}

// tile_heads' score pass, 16 head dimensions at a time: scores[hh * kTile + j] = q_hh . k_j (unscaled) for the n
// keys, eight keys at a time (per head eight FMA chains, then one fold-and-add for the eight sums).
template <int NZ, int HC, typename Cache>
inline void scores_wide(const float* q, const Cache* const* keys, int64_t n, float* scores) {
  constexpr int64_t D = NZ * 16;
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    __m512 sums[HC][8];
    for (int hh = 0; hh < HC; ++hh)
      for (int k = 0; k < 8; ++k) sums[hh][k] = _mm512_setzero_ps();
    for (int i = 0; i < NZ; ++i) {
      __m512 query[HC];
      for (int hh = 0; hh < HC; ++hh) query[hh] = _mm512_loadu_ps(q + hh * D + 16 * i);
      for (int k = 0; k < 8; ++k) {
        const __m512 key = load16(keys[j + k] + 16 * i);
        for (int hh = 0; hh < HC; ++hh) sums[hh][k] = _mm512_fmadd_ps(query[hh], key, sums[hh][k]);
      }
    }
    for (int hh = 0; hh < HC; ++hh) _mm256_store_ps(scores + hh * kTile + j, sum_each(sums[hh]));
  }
  for (; j < n; ++j)
    for (int hh = 0; hh < HC; ++hh) {
      __m512 sum = _mm512_setzero_ps();
      for (int i = 0; i < NZ; ++i)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + hh * D + 16 * i), load16(keys[j] + 16 * i), sum);
      scores[hh * kTile + j] = _mm512_reduce_add_ps(sum);
    }
}
#endif

// The scales of a tile's n entries (entries[j]: values of head size D) into scales[kTile], padded with ones to a
// multiple of 8. Int8 entries only.
template <typename Cache>
inline void gather_scales(const Cache* const* entries, int64_t n, int64_t D, float* scales) {
  for (int64_t j = 0; j < n; ++j) scales[j] = entry_scale(entries[j], D);
  for (int64_t j = n; j < (n + 7) / 8 * 8; ++j) scales[j] = 1.0f;
}

// Int8 entries: the softmax weights of the n tokens (weights[hh * kTile + j], after the running sum took them)
// times each value entry's scale, so that the value pass multiplies the stored integers. Float entries: nothing.
template <int HC, typename Cache>
inline void scale_by_values(const float* value_scales, int64_t n, float* weights) {
  if (kEntryExtra<Cache> == 0) return;
  for (int hh = 0; hh < HC; ++hh)
    for (int64_t j = 0; j < n; j += 8)
      _mm256_store_ps(weights + hh * kTile + j,
                      _mm256_mul_ps(_mm256_load_ps(weights + hh * kTile + j), _mm256_load_ps(value_scales + j)));
}

// One tile of n context tokens for HC query heads that share a kv head (keys, values: rows of that kv head): the
// heads' scores, then the online-softmax update of their m, l and acc ([HC][D], not normalized). Each key and value
// vector is loaded and widened once for all HC heads instead of once per head; per head the arithmetic and its
// order are those of a head alone, so grouping changes no bit. It pays when the pool is in cache; read from
// memory, the prefetches bound it, so they are spread over the three phases of each call (issued in one burst per
// call, the queued requests stalled it).
template <int ND, int HC, typename Cache, typename Prefetch>
void tile_heads(const float* q, const Cache* const* keys, const Cache* const* values, const float* key_scales,
                const float* value_scales, int64_t n, float scale, float softcap, float* m, float* l, float* acc,
                Prefetch& prefetch) {
  constexpr int64_t D = ND * 8;
  alignas(32) float scores[HC * kTile];
  const __m256 factor = _mm256_set1_ps(scale);
  prefetch();
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (ND % 2 == 0) {
    scores_wide<ND / 2, HC, Cache>(q, keys, n, scores);
    for (int64_t k = 0; k < n; k += 8) {
      const __m256 key_factor = kEntryExtra<Cache> > 0 ? _mm256_mul_ps(factor, _mm256_load_ps(key_scales + k)) : factor;
      for (int hh = 0; hh < HC; ++hh)
        _mm256_store_ps(scores + hh * kTile + k, _mm256_mul_ps(_mm256_load_ps(scores + hh * kTile + k), key_factor));
    }
    j = n;
  }
#endif
  // Eight keys at a time: per head eight independent FMA chains, then one transpose-and-add for the eight sums.
  for (; j + 8 <= n; j += 8) {
    __m256 sums[HC][8];
    for (int hh = 0; hh < HC; ++hh)
      for (int k = 0; k < 8; ++k) sums[hh][k] = _mm256_setzero_ps();
    for (int i = 0; i < ND; ++i) {
      __m256 query[HC];
      for (int hh = 0; hh < HC; ++hh) query[hh] = _mm256_loadu_ps(q + hh * D + 8 * i);
      for (int k = 0; k < 8; ++k) {
        const __m256 key = load8(keys[j + k] + 8 * i);
        for (int hh = 0; hh < HC; ++hh) sums[hh][k] = _mm256_fmadd_ps(query[hh], key, sums[hh][k]);
      }
    }
    const __m256 key_factor = kEntryExtra<Cache> > 0 ? _mm256_mul_ps(factor, _mm256_load_ps(key_scales + j)) : factor;
    for (int hh = 0; hh < HC; ++hh)
      _mm256_store_ps(scores + hh * kTile + j, _mm256_mul_ps(sum_each(sums[hh]), key_factor));
  }
  for (; j < n; ++j)
    for (int hh = 0; hh < HC; ++hh) {
      __m256 sum = _mm256_setzero_ps();
      for (int i = 0; i < ND; ++i)
        sum = _mm256_fmadd_ps(_mm256_loadu_ps(q + hh * D + 8 * i), load8(keys[j] + 8 * i), sum);
      scores[hh * kTile + j] = horizontal_sum(sum) * (kEntryExtra<Cache> > 0 ? scale * key_scales[j] : scale);
    }
  prefetch();
  float rescale[HC];
  for (int hh = 0; hh < HC; ++hh) {
    // Padding lanes of the last vector of scores: -inf, so they add e^-inf = 0 and never raise the max.
    float* s = scores + hh * kTile;
    if (softcap > 0.0f) soft_cap(s, (n + 7) / 8 * 8, softcap);  // the padding lanes are set below
    for (int64_t k = n; k < (n + 7) / 8 * 8; ++k) s[k] = -INFINITY;
    rescale[hh] = online_softmax(s, (n + 7) / 8 * 8, m[hh], l[hh]);
  }
  prefetch();
  scale_by_values<HC, Cache>(value_scales, n, scores);
#if defined(__AVX512F__) && defined(__AVX512DQ__)
  if constexpr (ND % 2 == 0) {
    values_wide<ND / 2, HC, Cache>(values, n, scores, rescale, acc);
    return;
  }
#endif
  int c0 = 0;
  for (; c0 + 3 <= ND; c0 += 3) chunk_values<ND, HC, 3, Cache>(values, n, scores, rescale, c0, acc);
  if (ND - c0 == 2) chunk_values<ND, HC, 2, Cache>(values, n, scores, rescale, c0, acc);
  if (ND - c0 == 1) chunk_values<ND, HC, 1, Cache>(values, n, scores, rescale, c0, acc);
}

// Partial attention of every head of query token `query` over context tokens [t0, t1). Writes m[num_heads],
// l[num_heads] and acc[num_heads][ND * 8] (not normalized). A tile's tokens are visited once per kv head while
// their rows (all kv heads of a token side by side) are still in L1, so memory is read in order, once. During
// the last tile it prefetches tokens [next_t0, next_t1) of query next_query, the caller's next item (if >= 0).
template <int ND, typename Cache>
void attend(const Problem<Cache>& p, int64_t query, int64_t t0, int64_t t1, float* m, float* l, float* acc,
            int64_t next_query = -1, int64_t next_t0 = 0, int64_t next_t1 = 0) {
  constexpr int64_t D = ND * 8;
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t entry = D + kEntryExtra<Cache>;
  const int64_t token_stride = p.num_kv_heads * entry;  // cache elements between consecutive tokens of a block
  constexpr int64_t kLine = 64 / sizeof(Cache);        // cache elements per cache line
  const int64_t* row = p.queries + 3 * query;
  const int64_t* blocks = p.block_tables + row[1] * p.max_blocks;
  const float* q_row = p.query + row[0] * p.q_row_stride;
  for (int64_t h = 0; h < p.num_heads; ++h) {
    m[h] = -INFINITY;
    l[h] = 0.0f;
    for (int64_t d = 0; d < D; ++d) acc[h * D + d] = 0.0f;
  }
  const Cache* key_rows[kTile];
  const Cache* value_rows[kTile];
  const Cache* kv_keys[kTile];  // key_rows and value_rows at the current kv head
  const Cache* kv_values[kTile];
  alignas(32) float key_scales[kTile], value_scales[kTile];  // their scales (int8 entries)
  for (int64_t tile = t0; tile < t1; tile += kTile) {
    const int64_t n = t1 - tile < kTile ? t1 - tile : kTile;
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = tile + j;
      const int64_t offset = (blocks[t / p.block_size] * p.block_size + t % p.block_size) * token_stride;
      key_rows[j] = p.key_cache + offset;
      value_rows[j] = p.value_cache + offset;
    }
    // Ask for the next tile's rows (into L2: this tile fills L1) while this one computes: blocks are scattered,
    // so the hardware prefetcher stops at each block boundary. Spread over the work in shares: all at
    // once, the requests queued up behind each other and stalled the core.
    int64_t next_begin = tile + kTile, next_end = tile + kTile + kTile < t1 ? tile + kTile + kTile : t1;
    const int64_t* next_blocks = blocks;
    if (next_begin >= t1 && next_query >= 0) {
      next_blocks = p.block_tables + p.queries[3 * next_query + 1] * p.max_blocks;
      next_begin = next_t0;
      next_end = next_t0 + kTile < next_t1 ? next_t0 + kTile : next_t1;
    }
    // Query heads kv * G .. (kv + 1) * G - 1 read kv head kv, three at a time; each call of tile_heads issues
    // three shares of the prefetches.
    const int64_t num_shares = p.num_kv_heads * ((G + 2) / 3) * 3;
    int64_t share = 0;
    const auto prefetch = [&]() {
      const int64_t share_begin = next_begin + (next_end - next_begin) * share / num_shares;
      const int64_t share_end = next_begin + (next_end - next_begin) * (share + 1) / num_shares;
      ++share;
      for (int64_t t = share_begin; t < share_end; ++t) {
        const int64_t offset = (next_blocks[t / p.block_size] * p.block_size + t % p.block_size) * token_stride;
        for (int64_t f = 0; f < token_stride; f += kLine) {
          _mm_prefetch(reinterpret_cast<const char*>(p.key_cache + offset + f), _MM_HINT_T1);
          _mm_prefetch(reinterpret_cast<const char*>(p.value_cache + offset + f), _MM_HINT_T1);
        }
      }
    };
    for (int64_t kv = 0; kv < p.num_kv_heads; ++kv) {
      for (int64_t j = 0; j < n; ++j) {
        kv_keys[j] = key_rows[j] + kv * entry;
        kv_values[j] = value_rows[j] + kv * entry;
      }
      if (kEntryExtra<Cache> > 0) {
        gather_scales(kv_keys, n, D, key_scales);
        gather_scales(kv_values, n, D, value_scales);
      }
      for (int64_t h = kv * G; h < (kv + 1) * G; h += 3) {
        const float* q = q_row + h * D;
        float* head_acc = acc + h * D;
        switch ((kv + 1) * G - h) {
          case 1:
            tile_heads<ND, 1>(q, kv_keys, kv_values, key_scales, value_scales, n, p.scale, p.softcap, m + h, l + h, head_acc,
                              prefetch);
            break;
          case 2:
            tile_heads<ND, 2>(q, kv_keys, kv_values, key_scales, value_scales, n, p.scale, p.softcap, m + h, l + h, head_acc,
                              prefetch);
            break;
          default:
            tile_heads<ND, 3>(q, kv_keys, kv_values, key_scales, value_scales, n, p.scale, p.softcap, m + h, l + h, head_acc,
                              prefetch);
        }
      }
    }
  }
}

// Thread `part` of `parts`'s share of items [0, n): a contiguous run of about equal work (work(i): tokens item i
// attends over). A thread walks its run in order, so while it computes an item's last tile it already fetches the
// next item's first one; handed out one by one (dynamic scheduling), the next item was unknown and each item's
// first tile came from memory cold.
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

// One (query, split) piece of work of a call with split contexts.
struct Item {
  int64_t query, split, num_splits;
  int64_t scratch;  // first partial result of this query in the scratch buffer, or -1 if not split
};

// Contexts of at most kSplitTokens: one item per query token, accumulating straight into its output row.
template <int ND, typename Cache>
void run_unsplit(const Problem<Cache>& p, int64_t num_queries, int threads) {
  constexpr int64_t D = ND * 8;
  auto body = [&](int64_t query, float* m, float* l, int64_t next) {
    float* out = p.out + p.queries[3 * query] * p.out_row_stride;
    attend<ND, Cache>(p, query, p.first_visible(query), p.queries[3 * query + 2], m, l, out,
                      next < num_queries ? next : -1, next < num_queries ? p.first_visible(next) : 0,
                      next < num_queries ? p.queries[3 * next + 2] : 0);
    for (int64_t h = 0; h < p.num_heads; ++h)
      for (int64_t d = 0; d < D; ++d) out[h * D + d] /= l[h];
  };
  if (threads == 1) {
    std::vector<float> ml(2 * p.num_heads);
    for (int64_t query = 0; query < num_queries; ++query) body(query, ml.data(), ml.data() + p.num_heads, query + 1);
    return;
  }
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> ml(2 * p.num_heads);
    int64_t begin, end;
    equal_work_run(num_queries, omp_get_thread_num(), omp_get_num_threads(),
                   [&](int64_t query) { return p.visible(query); }, begin, end);
    for (int64_t query = begin; query < end; ++query)
      body(query, ml.data(), ml.data() + p.num_heads, query + 1 < end ? query + 1 : num_queries);
  }
}

// Some context is longer than kSplitTokens: items of (query, split); split ones leave partial results in a
// scratch buffer, merged once all are done.
template <int ND, typename Cache>
void run_split(const Problem<Cache>& p, int64_t num_queries, int threads) {
  constexpr int64_t D = ND * 8;
  const int64_t H = p.num_heads;
  const int64_t partial_floats = H * (D + 2);  // m[H], l[H], acc[H][D]
  std::vector<Item> items;
  int64_t num_partials = 0;
  for (int64_t qi = 0; qi < num_queries; ++qi) {
    const int64_t num_splits = (p.visible(qi) + kSplitTokens - 1) / kSplitTokens;
    const int64_t scratch = num_splits > 1 ? num_partials : -1;
    if (num_splits > 1) num_partials += num_splits;
    for (int64_t s = 0; s < num_splits; ++s) items.push_back({qi, s, num_splits, scratch});
  }
  std::vector<float> partials(num_partials * partial_floats);
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> ml(2 * H);
    const auto span = [&](int64_t i, int64_t& t0, int64_t& t1) {
      const int64_t context = p.queries[3 * items[i].query + 2];
      t0 = p.first_visible(items[i].query) + items[i].split * kSplitTokens;
      t1 = t0 + kSplitTokens < context ? t0 + kSplitTokens : context;
    };
    int64_t begin, end;
    equal_work_run(num_items, omp_get_thread_num(), omp_get_num_threads(), [&](int64_t i) {
      int64_t t0, t1;
      span(i, t0, t1);
      return t1 - t0;
    }, begin, end);
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      int64_t t0, t1, next_query = -1, next_t0 = 0, next_t1 = 0;
      span(i, t0, t1);
      if (i + 1 < end) {
        next_query = items[i + 1].query;
        span(i + 1, next_t0, next_t1);
      }
      float* out = p.out + p.queries[3 * item.query] * p.out_row_stride;
      if (item.scratch < 0) {
        attend<ND, Cache>(p, item.query, t0, t1, ml.data(), ml.data() + H, out, next_query, next_t0, next_t1);
        for (int64_t h = 0; h < H; ++h)
          for (int64_t d = 0; d < D; ++d) out[h * D + d] /= ml[H + h];
        continue;
      }
      float* part = partials.data() + (item.scratch + item.split) * partial_floats;
      attend<ND, Cache>(p, item.query, t0, t1, part, part + H, part + 2 * H, next_query, next_t0, next_t1);
    }
#pragma omp barrier
    // Merge the splits: weights e^(m_s - max m) bring every partial to the same reference max.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_items; ++i) {
      const Item& item = items[i];
      if (item.scratch < 0 || item.split != 0) continue;
      float* out = p.out + p.queries[3 * item.query] * p.out_row_stride;
      for (int64_t h = 0; h < H; ++h) {
        float max = -INFINITY;
        for (int64_t s = 0; s < item.num_splits; ++s)
          max = fmaxf(max, partials[(item.scratch + s) * partial_floats + h]);
        float total = 0.0f;
        for (int64_t d = 0; d < D; ++d) out[h * D + d] = 0.0f;
        for (int64_t s = 0; s < item.num_splits; ++s) {
          const float* part = partials.data() + (item.scratch + s) * partial_floats;
          const float weight = expf(part[h] - max);
          total += part[H + h] * weight;
          for (int64_t d = 0; d < D; ++d) out[h * D + d] += part[2 * H + h * D + d] * weight;
        }
        for (int64_t d = 0; d < D; ++d) out[h * D + d] /= total;
      }
    }
  }
}

// Prompt chunks: many query tokens of one request against the same keys, so the work is arranged like a matrix
// product (flash attention's blocks). A work item is a chunk, one kv head and kQueryBlock consecutive query tokens;
// its rows are the (query token, query head of that kv head) pairs, their queries packed once into [rows, head_dim].
// Per tile of kTile context tokens, the tile's keys are transposed (int8 ones times their scales) once into
// [head_dim, kTile] and values not already float32 are widened once into [kTile, head_dim]; then three passes over
// the rows that see the tile: scores, kScoreRows rows at a time (a broadcast query element times a row of the
// transposed keys per FMA: no horizontal sums); each row's online-softmax update; values, kValueRows rows ×
// kValueVectors vectors of head dimensions at a time (each value vector loaded serves those rows). Causal: the
// token at position pos sees positions 0..pos, so a tile is skipped by the tokens it lies wholly after and masked
// (-inf scores) where it straddles them. A row's arithmetic and its order do not depend on the vector width or on
// which rows share a pass: a score is one FMA chain over the head dimensions in order, an output one chain over
// the tile's tokens in order. An int8 pool on a CPU with AVX512-BF16 runs the same passes on bfloat16 pairs
// (kPairProducts): dimension pairs in the scores, token pairs in the values.
constexpr int64_t kQueryBlock = 32;

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// 16 lanes, 32 registers: 8 rows × 2 vectors of scores, 4 rows × 4 vectors of outputs.
struct ChunkVector {
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
struct ChunkVector {
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

// scores[r * kTile + j] = q_r . k_j * scale for kScoreRows packed query rows q ([kScoreRows, head_dim]) and the
// tile's keys, transposed: keys_t[d * kTile + j].
template <int ND>
inline void chunk_scores(const float* q, const float* keys_t, float scale, float* scores) {
  using Vec = ChunkVector;
  constexpr int64_t D = ND * 8;
  constexpr int kVectors = kTile / Vec::kWidth;
  typename Vec::V sums[kScoreRows][kVectors];
  for (int r = 0; r < kScoreRows; ++r)
    for (int v = 0; v < kVectors; ++v) sums[r][v] = Vec::zero();
  for (int64_t d = 0; d < D; ++d) {
    typename Vec::V keys[kVectors];
    for (int v = 0; v < kVectors; ++v) keys[v] = Vec::load(keys_t + d * kTile + Vec::kWidth * v);
    for (int r = 0; r < kScoreRows; ++r) {
      const typename Vec::V element = Vec::broadcast(q[r * D + d]);
      for (int v = 0; v < kVectors; ++v) sums[r][v] = Vec::fmadd(element, keys[v], sums[r][v]);
    }
  }
  const typename Vec::V factor = Vec::broadcast(scale);
  for (int r = 0; r < kScoreRows; ++r)
    for (int v = 0; v < kVectors; ++v) Vec::store(scores + r * kTile + Vec::kWidth * v, Vec::mul(sums[r][v], factor));
}

// acc_r = acc_r * rescale[r] + sum over the tile's n tokens of weights_r[j] * value row j, for kValueRows rows
// (acc[r], weights[r]) and head dimensions [W * c0, W * (c0 + CW)), W the vector width.
template <int ND, int CW>
inline void chunk_values(const float* const* value_rows, int64_t n, const float* const* weights, const float* rescale,
                         int c0, float* const* acc) {
  using Vec = ChunkVector;
  constexpr int W = Vec::kWidth;
  typename Vec::V sum[kValueRows][CW];
  for (int r = 0; r < kValueRows; ++r)
    for (int c = 0; c < CW; ++c) sum[r][c] = Vec::mul(Vec::load(acc[r] + W * (c0 + c)), Vec::broadcast(rescale[r]));
  for (int64_t j = 0; j < n; ++j) {
    typename Vec::V values[CW];
    for (int c = 0; c < CW; ++c) values[c] = Vec::load(value_rows[j] + W * (c0 + c));
    for (int r = 0; r < kValueRows; ++r) {
      const typename Vec::V weight = Vec::broadcast(weights[r][j]);
      for (int c = 0; c < CW; ++c) sum[r][c] = Vec::fmadd(weight, values[c], sum[r][c]);
    }
  }
  for (int r = 0; r < kValueRows; ++r)
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

// chunk_values over all head dimensions.
template <int ND>
inline void chunk_values_all(const float* const* value_rows, int64_t n, const float* const* weights,
                             const float* rescale, float* const* acc) {
  in_value_passes<ND * 8 / ChunkVector::kWidth>([&](auto width, int c0) {
    chunk_values<ND, decltype(width)::value>(value_rows, n, weights, rescale, c0, acc);
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// An int8 pool's chunk path multiplies in bfloat16 pairs (vdpbf16ps: 32 products per instruction, twice a float32
// FMA's 16). The stored integers (|q| <= 127) are exact in bfloat16, so only the queries and the softmax weights
// are rounded, to nearest even (within 2^-8 relative); every product is exact and every sum float32. Keys enter
// unscaled: a score is (q . k_q) * scale * s_k. Head dimensions must come 16 at a time (head_dim % 16 == 0).
template <typename Cache, int ND>
constexpr bool kPairProducts = std::is_same<Cache, int8_t>::value && ND % 2 == 0;

// Pairs of bfloat16 (element 2i in the low half of 32-bit lane i, 2i + 1 in the high half) from two vectors of
// floats that are exact in bfloat16 (small integers): their high halves, no rounding needed.
inline __m256i pair_exact(__m256 low, __m256 high) {
  return _mm256_or_si256(_mm256_and_si256(_mm256_castps_si256(high), _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))),
                         _mm256_srli_epi32(_mm256_castps_si256(low), 16));
}
inline __m512i pair_exact(__m512 low, __m512 high) {
  return _mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(high), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))),
                         _mm512_srli_epi32(_mm512_castps_si512(low), 16));
}

// count floats (a multiple of 32) rounded to bfloat16 in place: the first count / 2 floats' bytes hold them.
inline void round_to_bf16(float* values, int64_t count) {
  for (int64_t j = 0; j < count; j += 32) {
    const __m256bh low = _mm512_cvtneps_pbh(_mm512_loadu_ps(values + j));
    const __m256bh high = _mm512_cvtneps_pbh(_mm512_loadu_ps(values + j + 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + j / 2), (__m256i)low);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values + j / 2 + 8), (__m256i)high);
  }
}

// chunk_scores in pairs: scores[r * kTile + j] = (q_r . k_j) * factors[j] for kScoreRows rows of bfloat16 queries
// (q_pairs[r * D / 2 + i]: dimensions 2i, 2i + 1) and the tile's keys as pairs, key_pairs[i * kTile + j].
template <int ND>
inline void chunk_scores_pairs(const uint32_t* q_pairs, const uint32_t* key_pairs, const float* factors,
                               float* scores) {
  constexpr int64_t P = ND * 4;
  constexpr int kVectors = kTile / 16;
  __m512 sums[kScoreRows][kVectors];
  for (int r = 0; r < kScoreRows; ++r)
    for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_setzero_ps();
  for (int64_t i = 0; i < P; ++i) {
    __m512bh keys[kVectors];
    for (int v = 0; v < kVectors; ++v) keys[v] = (__m512bh)_mm512_loadu_si512(key_pairs + i * kTile + 16 * v);
    for (int r = 0; r < kScoreRows; ++r) {
      const __m512bh element = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[r * P + i]));
      for (int v = 0; v < kVectors; ++v) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], element, keys[v]);
    }
  }
  for (int r = 0; r < kScoreRows; ++r)
    for (int v = 0; v < kVectors; ++v)
      _mm512_storeu_ps(scores + r * kTile + 16 * v, _mm512_mul_ps(sums[r][v], _mm512_loadu_ps(factors + 16 * v)));
}

// chunk_values in pairs: acc_r = acc_r * rescale[r] + sum over the tile's token pairs i of weights_r's pair i
// (bfloat16) times value_pairs row i ([D] lanes, each the two tokens' values of one head dimension), for head
// dimensions [16 * c0, 16 * (c0 + CW)).
template <int ND, int CW>
inline void chunk_values_pairs(const uint32_t* value_pairs, int64_t pairs, const uint32_t* const* weights,
                               const float* rescale, int c0, float* const* acc) {
  constexpr int64_t D = ND * 8;
  __m512 sum[kValueRows][CW];
  for (int r = 0; r < kValueRows; ++r)
    for (int c = 0; c < CW; ++c)
      sum[r][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[r] + 16 * (c0 + c)), _mm512_set1_ps(rescale[r]));
  for (int64_t i = 0; i < pairs; ++i) {
    __m512bh values[CW];
    for (int c = 0; c < CW; ++c) values[c] = (__m512bh)_mm512_loadu_si512(value_pairs + i * D + 16 * (c0 + c));
    for (int r = 0; r < kValueRows; ++r) {
      const __m512bh weight = (__m512bh)_mm512_set1_epi32(static_cast<int>(weights[r][i]));
      for (int c = 0; c < CW; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], weight, values[c]);
    }
  }
  for (int r = 0; r < kValueRows; ++r)
    for (int c = 0; c < CW; ++c) _mm512_storeu_ps(acc[r] + 16 * (c0 + c), sum[r][c]);
}

template <int ND>
inline void chunk_values_pairs_all(const uint32_t* value_pairs, int64_t pairs, const uint32_t* const* weights,
                                   const float* rescale, float* const* acc) {
  in_value_passes<ND / 2>([&](auto width, int c0) {
    chunk_values_pairs<ND, decltype(width)::value>(value_pairs, pairs, weights, rescale, c0, acc);
  });
}
#else
template <typename Cache, int ND>
constexpr bool kPairProducts = false;
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// A tile's keys and values as bfloat16 pairs (kPairProducts): key_pairs[i * kTile + j] holds dimensions 2i, 2i + 1
// of key j, unscaled (tokens past n: zeros); value_pairs[i * D + d] holds dimension d of tokens 2i and 2i + 1 (a
// missing last token: zero). factors[kTile] comes in as the keys' scales and leaves as scale times them (zero past
// n), what the pair scores are multiplied by.
template <int ND>
inline void pair_tile(const int8_t* const* keys, const int8_t* const* values, int64_t n, float scale, float* factors,
                      uint32_t* key_pairs, uint32_t* value_pairs) {
  constexpr int64_t D = ND * 8;
  for (int64_t j = 0; j < kTile; ++j) factors[j] = j < n ? factors[j] * scale : 0.0f;
  for (int64_t j0 = 0; j0 < kTile; j0 += 8)
    for (int64_t d = 0; d < D; d += 8) {
      __m256 rows[8];
      for (int e = 0; e < 8; ++e) rows[e] = j0 + e < n ? load8(keys[j0 + e] + d) : _mm256_setzero_ps();
      transpose8(rows);
      for (int e = 0; e < 8; e += 2)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(key_pairs + (d + e) / 2 * kTile + j0),
                            pair_exact(rows[e], rows[e + 1]));
    }
  for (int64_t i = 0; 2 * i < n; ++i)
    for (int64_t d = 0; d < D; d += 16) {
      const __m512 low = load16(values[2 * i] + d);
      const __m512 high = 2 * i + 1 < n ? load16(values[2 * i + 1] + d) : _mm512_setzero_ps();
      _mm512_storeu_si512(value_pairs + i * D + d, pair_exact(low, high));
    }
}
#endif

// Query tokens [i0, i1) of prompt chunk `chunk` (rows: first row, request index, number of new tokens, context
// length), the query heads of kv head kv; writes their output rows.
template <int ND, typename Cache>
void attend_chunk(const Problem<Cache>& p, const int64_t* chunk, int64_t kv, int64_t i0, int64_t i1) {
  constexpr int64_t D = ND * 8;
  constexpr bool kIsFloat = std::is_same<Cache, float>::value;
  constexpr bool kPairs = kPairProducts<Cache, ND>;
  const int64_t G = p.num_heads / p.num_kv_heads;
  const int64_t entry = D + kEntryExtra<Cache>;
  const int64_t token_stride = p.num_kv_heads * entry;
  const int64_t first_row = chunk[0], query_len = chunk[2], context = chunk[3];
  const int64_t* blocks = p.block_tables + chunk[1] * p.max_blocks;
  const int64_t first_position = context - query_len;  // position of the chunk's token 0
  const int64_t num_rows = (i1 - i0) * G;               // row r: token i0 + r / G, head kv * G + r % G
  // A score pass may run past the last row: kScoreRows - 1 padding rows of queries (zeros) and scores.
  const int64_t padded_rows = num_rows + kScoreRows - 1;
  // One 64-byte aligned buffer: transposed keys [D, kTile], widened values [kTile, D], queries [padded_rows, D],
  // scores [padded_rows, kTile], acc [num_rows, D], a spare acc row [D] and a row of kTile zero weights (for passes
  // past the rows that see a tile), then m, l and the rescale factors [num_rows] each.
  struct alignas(64) Line {
    float values[16];
  };
  const int64_t num_floats = (2 * kTile + padded_rows) * D + padded_rows * kTile + num_rows * D + D + kTile;
  std::vector<Line> buffer((num_floats + 3 * num_rows + 15) / 16);
  float* keys_t = buffer.data()->values;
  float* values_w = keys_t + D * kTile;
  float* queries = values_w + kTile * D;
  float* scores = queries + padded_rows * D;
  float* acc = scores + padded_rows * kTile;
  float* spare = acc + num_rows * D;
  const float* zeros = spare + D;
  float* m = spare + D + kTile;
  float* l = m + num_rows;
  float* rescale = l + num_rows;
  for (int64_t r = 0; r < num_rows; ++r) {
    const float* query = p.query + (first_row + i0 + r / G) * p.q_row_stride + (kv * G + r % G) * D;
    if constexpr (kPairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      // Pair mode: the rows are bfloat16 ([padded_rows, D] of them in the first half of the queries' space).
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(queries) + r * D + d),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(query + d)));
#endif
    } else {
      memcpy(queries + r * D, query, D * sizeof(float));
    }
    m[r] = -INFINITY;
  }
  const float* value_rows[kTile];
  alignas(32) float value_scales[kTile];  // int8 entries' scales
  const int64_t last_position = first_position + i1 - 1;
  // Tiles stay aligned to multiples of kTile from position 0 (a token's numbers do not depend on its chunk);
  // a window skips the tiles wholly before the first token's window.
  const int64_t first_seen =
      p.window > 0 && first_position + i0 + 1 > p.window ? first_position + i0 + 1 - p.window : 0;
  for (int64_t tile = first_seen / kTile * kTile; tile <= last_position; tile += kTile) {
    const int64_t n = last_position + 1 - tile < kTile ? last_position + 1 - tile : kTile;
    // The tokens that see the tile: [ia, ib), those at or after its start whose window reaches into it.
    int64_t ia = tile > first_position + i0 ? tile - first_position : i0, ib = i1;
    if (p.window > 0) {
      while (ib > ia && first_position + ib - p.window >= tile + n) --ib;
    }
    if (ia >= ib) continue;
    const Cache* key_entries[kTile];
    const Cache* value_entries[kTile];
    alignas(32) float key_scales[kTile];
    for (int64_t j = 0; j < n; ++j) {
      const int64_t t = tile + j;
      const int64_t offset = (blocks[t / p.block_size] * p.block_size + t % p.block_size) * token_stride + kv * entry;
      key_entries[j] = p.key_cache + offset;
      value_entries[j] = p.value_cache + offset;
      if constexpr (kIsFloat) {
        value_rows[j] = value_entries[j];
      } else if constexpr (!kPairs) {
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(values_w + j * D + d, load8(value_entries[j] + d));
        value_rows[j] = values_w + j * D;
      }
    }
    if (kEntryExtra<Cache> > 0) gather_scales(key_entries, n, D, key_scales);
    if constexpr (kPairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      pair_tile<ND>(key_entries, value_entries, n, p.scale, key_scales, reinterpret_cast<uint32_t*>(keys_t),
                    reinterpret_cast<uint32_t*>(values_w));
#endif
    } else {
      // The keys (int8 ones times their scales) transposed eight tokens × eight head dimensions at a time; tokens
      // past the tile's n are zeros.
      for (int64_t j0 = 0; j0 < kTile; j0 += 8)
        for (int64_t d = 0; d < D; d += 8) {
          __m256 rows[8];
          for (int e = 0; e < 8; ++e) {
            const int64_t j = j0 + e;
            if (j >= n)
              rows[e] = _mm256_setzero_ps();
            else if (kEntryExtra<Cache> > 0)
              rows[e] = _mm256_mul_ps(load8(key_entries[j] + d), _mm256_set1_ps(key_scales[j]));
            else
              rows[e] = load8(key_entries[j] + d);
          }
          transpose8(rows);
          for (int e = 0; e < 8; ++e) _mm256_store_ps(keys_t + (d + e) * kTile + j0, rows[e]);
        }
    }
    if (kEntryExtra<Cache> > 0) gather_scales(value_entries, n, D, value_scales);
    const int64_t ra = (ia - i0) * G, rb = (ib - i0) * G;
    for (int64_t r = ra; r < rb; r += kScoreRows) {
      if constexpr (kPairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        chunk_scores_pairs<ND>(reinterpret_cast<const uint32_t*>(queries) + r * D / 2,
                               reinterpret_cast<const uint32_t*>(keys_t), key_scales, scores + r * kTile);
#endif
      } else {
        chunk_scores<ND>(queries + r * D, keys_t, p.scale, scores + r * kTile);
      }
    }
    if (p.softcap > 0.0f) soft_cap(scores + ra * kTile, (rb - ra) * kTile, p.softcap);
    for (int64_t i = ia; i < ib; ++i) {
      const int64_t position = first_position + i;
      const int64_t visible = position + 1 - tile < n ? position + 1 - tile : n;
      const int64_t window_start = p.window > 0 && position + 1 > p.window ? position + 1 - p.window : 0;
      const int64_t hidden = window_start > tile ? window_start - tile : 0;
      for (int64_t r = (i - i0) * G; r < (i - i0 + 1) * G; ++r) {
        float* s = scores + r * kTile;
        for (int64_t j = 0; j < hidden; ++j) s[j] = -INFINITY;
        for (int64_t j = visible; j < kTile; ++j) s[j] = -INFINITY;
        // hidden < visible, so the max is finite.
        rescale[r] = online_softmax(s, kTile, m[r], l[r]);
        scale_by_values<1, Cache>(value_scales, n, s);
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if constexpr (kPairs) round_to_bf16(s, kTile);
#endif
      }
    }
    for (int64_t r = ra; r < rb; r += kValueRows) {
      const float* weights[kValueRows];
      float* rows[kValueRows];
      float factors[kValueRows];
      for (int k = 0; k < kValueRows; ++k) {
        const bool is_row = r + k < rb;
        weights[k] = is_row ? scores + (r + k) * kTile : zeros;
        rows[k] = is_row ? acc + (r + k) * D : spare;
        factors[k] = is_row ? rescale[r + k] : 0.0f;
      }
      if constexpr (kPairs) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        const uint32_t* pair_weights[kValueRows];
        for (int k = 0; k < kValueRows; ++k) pair_weights[k] = reinterpret_cast<const uint32_t*>(weights[k]);
        chunk_values_pairs_all<ND>(reinterpret_cast<const uint32_t*>(values_w), (n + 1) / 2, pair_weights, factors,
                                   rows);
#endif
      } else {
        chunk_values_all<ND>(value_rows, n, weights, factors, rows);
      }
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    float* out = p.out + (first_row + i0 + r / G) * p.out_row_stride + (kv * G + r % G) * D;
    for (int64_t d = 0; d < D; ++d) out[d] = acc[r * D + d] / l[r];
  }
}

// Every prompt chunk: work items of (chunk, kv head, block of kQueryBlock query tokens), the later blocks (which
// see more context) first, handed out dynamically.
template <int ND, typename Cache>
void run_chunks(const Problem<Cache>& p, const int64_t* chunks, int64_t num_chunks, int threads) {
  struct ChunkItem {
    int64_t chunk, kv, i0, i1;
  };
  std::vector<ChunkItem> items;
  for (int64_t c = 0; c < num_chunks; ++c) {
    const int64_t query_len = chunks[4 * c + 2];
    for (int64_t i0 = (query_len - 1) / kQueryBlock * kQueryBlock; i0 >= 0; i0 -= kQueryBlock)
      for (int64_t kv = 0; kv < p.num_kv_heads; ++kv)
        items.push_back({c, kv, i0, i0 + kQueryBlock < query_len ? i0 + kQueryBlock : query_len});
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel for num_threads(threads) schedule(dynamic)
  for (int64_t i = 0; i < num_items; ++i)
    attend_chunk<ND, Cache>(p, chunks + 4 * items[i].chunk, items[i].kv, items[i].i0, items[i].i1);
}

template <int ND, typename Cache>
void run(const Problem<Cache>& p, int64_t num_queries, const int64_t* chunks, int64_t num_chunks, int num_threads) {
  if (num_chunks > 0) run_chunks<ND, Cache>(p, chunks, num_chunks, num_threads);
  if (num_queries == 0) return;
  int64_t work = 0;
  bool is_split = false;
  for (int64_t qi = 0; qi < num_queries; ++qi) {
    work += p.visible(qi) * p.num_heads;
    is_split = is_split || p.visible(qi) > kSplitTokens;
  }
  const int threads = work >= kParallelWork ? num_threads : 1;
  if (is_split)
    run_split<ND, Cache>(p, num_queries, threads);
  else
    run_unsplit<ND, Cache>(p, num_queries, threads);
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
  const Problem<Cache> p{query,     q_row_stride, out,          out_row_stride, key_cache, value_cache, num_heads,
                         num_kv_heads, block_size, block_tables, max_blocks,   queries,   scale,
                         window,    softcap};
  switch (head_dim) {
    case 32: run<4, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
    case 64: run<8, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
    case 80: run<10, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
    case 96: run<12, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
    case 128: run<16, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
    case 256: run<32, Cache>(p, num_queries, chunks, num_chunks, num_threads); break;
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
