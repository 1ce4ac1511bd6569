// Per-row reductions of a matrix product's output without writing it: each activation row's argmax (first of equal
// maxima), largest value and log-sum-exp. The output projection of a greedy step needs nothing else; 64 rows of the
// embedded model's 49,152 logits are 12.6 MB written and read back otherwise. gemm.cpp (int8 activations) folds its
// sums tiles in here instead of storing them.
#pragma once

#include <math.h>
#include <stdint.h>

#include <vector>

#include "vec.h"

#if defined(__AVX512F__)
namespace tokenriver {

// One thread's running reductions of y's rows over the columns it has seen, indexed by activation row: the largest
// value, its first column (-1 before any), the sum of e^(y - largest) and how many values were not finite.
struct RowReductions {
  float* max;
  int32_t* argmax;
  float* sum;
  int64_t* not_finite;
};

// Sums of up to 16 columns of y for 16 activation rows (column c's 16 rows at sums + c * ld, lane i for activation
// row m0 + i; the first `valid` lanes real) folded into the reductions of those rows over y's columns n0 ..
// n0 + columns - 1, in increasing order, so that among equal values the first column wins (torch.argmax's rule).
inline void reduce_columns(const float* sums, int64_t ld, int64_t valid, int columns, int64_t m0, int64_t n0,
                           const RowReductions& r) {
  constexpr int kLanes = 16;
  const __mmask16 lanes = static_cast<__mmask16>(valid >= kLanes ? 0xFFFF : (1u << valid) - 1);
  const __m512 old_max = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), lanes, r.max + m0);
  __m512 best = old_max;
  __m512i index = _mm512_maskz_loadu_epi32(lanes, r.argmax + m0);
  __mmask16 not_finite = 0;
  for (int c = 0; c < columns; ++c) {
    const __m512 v = _mm512_loadu_ps(sums + c * ld);
    not_finite |= _mm512_fpclass_ps_mask(v, 0x99);  // NaN (quiet, signalling), +inf, -inf
    const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, greater, v);
    index = _mm512_mask_mov_epi32(index, greater, _mm512_set1_epi32(static_cast<int32_t>(n0 + c)));
  }
  // The running sum moves to the new largest value, then takes these columns' terms, summed pairwise first: added
  // one by one into the running sum, a lane's chain of ~25,000 additions lost ~1e-4 of the log-sum-exp.
  __m512 terms[kLanes];
  for (int c = 0; c < kLanes; ++c)
    terms[c] = c < columns ? exp512(_mm512_sub_ps(_mm512_loadu_ps(sums + c * ld), best)) : _mm512_setzero_ps();
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int c = 0; c < width; ++c) terms[c] = _mm512_add_ps(terms[c], terms[c + width]);
  const __m512 rescaled = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, r.sum + m0), exp512(_mm512_sub_ps(old_max, best)));
  const __m512 sum = _mm512_add_ps(rescaled, terms[0]);
  _mm512_mask_storeu_ps(r.max + m0, lanes, best);
  _mm512_mask_storeu_epi32(r.argmax + m0, lanes, index);
  _mm512_mask_storeu_ps(r.sum + m0, lanes, sum);
  *r.not_finite += __builtin_popcount(not_finite & lanes);
}

// Every thread's RowReductions over M rows, and their merge: each thread reduces the columns it computes.
class ThreadReductions {
 public:
  ThreadReductions(int threads, int64_t M)
      : M_(M), maxes_(threads * M, -INFINITY), sums_(threads * M, 0.0f), argmaxes_(threads * M, -1),
        not_finite_(threads, 0) {
    for (int t = 0; t < threads; ++t)
      each_.push_back({maxes_.data() + t * M, argmaxes_.data() + t * M, sums_.data() + t * M, &not_finite_[t]});
  }

  const RowReductions* each() const { return each_.data(); }

  // Row m's argmax across the threads (the smallest column among equal maxima), its value and the log-sum-exp of
  // the row; returns how many values of y were NaN or infinite (the results are then not to be used).
  int64_t merge(int64_t* argmax, float* max, float* lse) const {
    const int threads = static_cast<int>(each_.size());
    int64_t total_not_finite = 0;
    for (int t = 0; t < threads; ++t) total_not_finite += not_finite_[t];
    for (int64_t m = 0; m < M_; ++m) {
      float best = -INFINITY;
      int64_t best_index = -1;
      for (int t = 0; t < threads; ++t) {
        const float value = maxes_[t * M_ + m];
        const int64_t index = argmaxes_[t * M_ + m];
        if (index >= 0 && (best_index < 0 || value > best || (value == best && index < best_index))) {
          best = value;
          best_index = index;
        }
      }
      float total = 0.0f;
      for (int t = 0; t < threads; ++t)
        if (argmaxes_[t * M_ + m] >= 0) total += sums_[t * M_ + m] * expf(maxes_[t * M_ + m] - best);
      argmax[m] = best_index;
      max[m] = best;
      lse[m] = best + logf(total);
    }
    return total_not_finite;
  }

 private:
  int64_t M_;
  std::vector<float> maxes_, sums_;
  std::vector<int32_t> argmaxes_;
  std::vector<int64_t> not_finite_;
  std::vector<RowReductions> each_;
};

// Runs product(threads, reductions) (a product folding its columns into each thread's RowReductions) and merges
// the threads' results into argmax, max and lse [M]; returns how many values were not finite.
template <typename Product>
int64_t reduce_rows(int num_threads, int64_t M, const Product& product, int64_t* argmax, float* max, float* lse) {
  const int threads = num_threads > 1 ? num_threads : 1;
  const ThreadReductions reductions(threads, M);
  product(threads, reductions.each());
  return reductions.merge(argmax, max, lse);
}

}  // namespace tokenriver
#endif
