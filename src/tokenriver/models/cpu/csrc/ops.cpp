// The small per-layer operations of a decoder step, each one pass over its rows: RMSNorm with the residual add
// fused in (and per head, for q/k norms), rotary positions applied in place, silu(gate) * up and gelu_tanh(gate) *
// up; and the two reductions the sampler needs of every logits row, its argmax and its log-sum-exp.
//
// On a decode step these run on one to a few rows of a few hundred floats, so their cost in PyTorch is op
// dispatch (about 40 small ops per layer), not arithmetic; here each is one call. They reproduce the arithmetic
// of the PyTorch definitions in models/layers.py and models/attention.py operation for operation; sums of squares
// are added in a different order and exp is a polynomial (vec.h), so float32 results agree to ~1e-6 relative.
// The library is built with -ffp-contract=off so that a * b - c * d rounds both products, as PyTorch does.
//
// Layouts: float32, row-major; a row stride (in floats) lets q and k be views into the fused qkv projection.
// Rows are split across OpenMP threads only when there is enough work to pay for waking them.

#include <math.h>
#include <omp.h>
#include <stdint.h>

#include <algorithm>

#include "vec.h"

namespace {

using tokenriver::exp256;
using tokenriver::horizontal_max;
using tokenriver::horizontal_sum;

// Below this many floats per call a single thread finishes before a team of threads could start.
constexpr int64_t kParallelFloats = 1 << 15;

// body(row) for every row in [0, num_rows): on OpenMP threads when the call moves at least kParallelFloats
// floats, else on the calling thread without entering OpenMP at all (even a one-thread team costs a fork).
template <typename Body>
void for_rows(int64_t num_rows, int64_t num_floats, int num_threads, const Body& body) {
  if (num_threads > 1 && num_rows > 1 && num_floats >= kParallelFloats) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t row = 0; row < num_rows; ++row) body(row);
  } else {
    for (int64_t row = 0; row < num_rows; ++row) body(row);
  }
}

// out[i] = silu(gate[i]) * up[i] for i < n. silu(g) = g / (1 + e^-g), as PyTorch computes it.
inline void silu_mul_run(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  // 16 at a time where the CPU has AVX-512: the same operations per value (exp512 is exp256 lane by lane, so the
  // same bits), half the instructions.
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, tokenriver::silu_times(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
#endif
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign_bit = _mm256_set1_ps(-0.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp256(_mm256_xor_ps(g, sign_bit))));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

// out[i] = gelu_tanh(gate[i]) * up[i] for i < n (vec.h's gelu_tanh_times), 8 at a time (a short tail padded to 8,
// so that every value takes the same operations).
inline void gelu_tanh_mul_run(const float* gate, const float* up, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, tokenriver::gelu_tanh_times(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {
    alignas(32) float g[8] = {}, u[8] = {}, y[8];
    std::copy(gate + i, gate + n, g);
    std::copy(up + i, up + n, u);
    _mm256_store_ps(y, tokenriver::gelu_tanh_times(_mm256_load_ps(g), _mm256_load_ps(u)));
    std::copy(y, y + (n - i), out + i);
  }
}

// out = weight * (row * 1 / sqrt(mean(row^2) + eps)), PyTorch's order of roundings for the float32 case. out may
// be row (each value is read before it is written).
void normalize_row(const float* row, const float* weight, int64_t K, float eps, float* out) {
  __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  int64_t k = 0;
  for (; k + 32 <= K; k += 32)
    for (int i = 0; i < 4; ++i) {
      const __m256 v = _mm256_loadu_ps(row + k + 8 * i);
      sums[i] = _mm256_fmadd_ps(v, v, sums[i]);
    }
  for (; k + 8 <= K; k += 8) {
    const __m256 v = _mm256_loadu_ps(row + k);
    sums[0] = _mm256_fmadd_ps(v, v, sums[0]);
  }
  float sum = horizontal_sum(_mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3])));
  for (; k < K; ++k) sum += row[k] * row[k];
  const float inv_rms = 1.0f / sqrtf(sum / static_cast<float>(K) + eps);
  const __m256 scale = _mm256_set1_ps(inv_rms);
  k = 0;
  for (; k + 8 <= K; k += 8) {
    const __m256 normalized = _mm256_mul_ps(_mm256_loadu_ps(row + k), scale);
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(weight + k), normalized));
  }
  for (; k < K; ++k) out[k] = weight[k] * (row[k] * inv_rms);
}

// x1 * cos - x2 * sin, x2 * cos + x1 * sin on the two halves of the first rotary_dim values of each head of one
// token (heads head_dim apart; the rest of a head, under partial rotary, is left as it is), in place.
void rotate_heads(float* x, int64_t num_heads, int64_t head_dim, int64_t rotary_dim, const float* cos,
                  const float* sin) {
  const int64_t half = rotary_dim / 2;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* x1 = x + h * head_dim;
    float* x2 = x1 + half;
    int64_t i = 0;
    for (; i + 8 <= half; i += 8) {
      const __m256 a = _mm256_loadu_ps(x1 + i), b = _mm256_loadu_ps(x2 + i);
      const __m256 c = _mm256_loadu_ps(cos + i), s = _mm256_loadu_ps(sin + i);
      _mm256_storeu_ps(x1 + i, _mm256_sub_ps(_mm256_mul_ps(a, c), _mm256_mul_ps(b, s)));
      _mm256_storeu_ps(x2 + i, _mm256_add_ps(_mm256_mul_ps(b, c), _mm256_mul_ps(a, s)));
    }
    for (; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// Argmax (the first index of the largest value, as torch.argmax), that largest value and log(sum(exp(row))) of one
// row, in two passes: the max with its index, then the sum of e^(x - max) over four accumulators. A row holding
// NaN gets a NaN log-sum-exp, which the caller checks for (and then uses PyTorch, which defines that case).
void argmax_logsumexp_row(const float* row, int64_t V, int64_t* argmax, float* max, float* lse) {
  __m256 best = _mm256_set1_ps(-INFINITY);
  __m256i best_index = _mm256_set1_epi32(0);
  __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i step = _mm256_set1_epi32(8);
  __m256 unordered = _mm256_setzero_ps();
  int64_t v = 0;
  for (; v + 8 <= V; v += 8) {
    const __m256 x = _mm256_loadu_ps(row + v);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256 greater = _mm256_cmp_ps(x, best, _CMP_GT_OQ);  // strictly: a lane keeps its first maximum
    best = _mm256_blendv_ps(best, x, greater);
    best_index = _mm256_castps_si256(
        _mm256_blendv_ps(_mm256_castsi256_ps(best_index), _mm256_castsi256_ps(index), greater));
    index = _mm256_add_epi32(index, step);
  }
  float max_value = horizontal_max(best);
  alignas(32) float lane_values[8];
  alignas(32) int32_t lane_indices[8];
  _mm256_store_ps(lane_values, best);
  _mm256_store_si256(reinterpret_cast<__m256i*>(lane_indices), best_index);
  int64_t max_index = V;
  for (int lane = 0; lane < 8; ++lane)
    if (v > 0 && lane_values[lane] == max_value && lane_indices[lane] < max_index) max_index = lane_indices[lane];
  bool has_nan = _mm256_movemask_ps(unordered) != 0;
  for (; v < V; ++v) {
    has_nan = has_nan || isnan(row[v]);
    if (row[v] > max_value || max_index == V) {
      max_value = row[v];
      max_index = v;
    }
  }
  const __m256 shift = _mm256_set1_ps(max_value);
  __m256 sums[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  v = 0;
  for (; v + 32 <= V; v += 32)
    for (int i = 0; i < 4; ++i)
      sums[i] = _mm256_add_ps(sums[i], exp256(_mm256_sub_ps(_mm256_loadu_ps(row + v + 8 * i), shift)));
  for (; v + 8 <= V; v += 8) sums[0] = _mm256_add_ps(sums[0], exp256(_mm256_sub_ps(_mm256_loadu_ps(row + v), shift)));
  float total = horizontal_sum(_mm256_add_ps(_mm256_add_ps(sums[0], sums[1]), _mm256_add_ps(sums[2], sums[3])));
  for (; v < V; ++v) total += expf(row[v] - max_value);
  *argmax = max_index;
  *max = max_value;
  *lse = has_nan ? NAN : max_value + logf(total);
}

// x . w over K floats: eight running sums, then their horizontal sum, then the tail; one fixed order.
inline float dot_row(const float* x, const float* w, int64_t K) {
  __m256 sum = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) sum = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), sum);
  float total = horizontal_sum(sum);
  for (; k < K; ++k) total += x[k] * w[k];
  return total;
}

}  // namespace

extern "C" {

// x, out [M, K]; weight [K]. With residual [M, K] (may be null): residual += x first, and the norm is of the sum
// (the residual add that ends one block fused into the norm that starts the next).
void rms_norm_f32(const float* x, float* residual, const float* weight, int64_t M, int64_t K, float eps, float* out,
                  int num_threads) {
  for_rows(M, M * K, num_threads, [&](int64_t m) {
    const float* row = x + m * K;
    if (residual != nullptr) {
      float* sum = residual + m * K;
      int64_t k = 0;
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(sum + k, _mm256_add_ps(_mm256_loadu_ps(sum + k), _mm256_loadu_ps(row + k)));
      for (; k < K; ++k) sum[k] += row[k];
      row = sum;
    }
    normalize_row(row, weight, K, eps, out + m * K);
  });
}

// RMSNorm of each head of x [T rows, row_stride floats apart, of num_heads * head_dim], in place, with one weight
// [head_dim] for every head: Qwen3's and Gemma 3's q/k norms on the query or key part of the fused qkv rows. Each
// head is normalized as rms_norm_f32 normalizes a row of head_dim values, so the results are the same bits.
void head_rms_norm_f32(float* x, int64_t row_stride, int64_t num_heads, const float* weight, int64_t T,
                       int64_t head_dim, float eps, int num_threads) {
  for_rows(T, T * num_heads * head_dim, num_threads, [&](int64_t t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      float* head = x + t * row_stride + h * head_dim;
      normalize_row(head, weight, head_dim, eps, head);
    }
  });
}

// Rotary positions on query [T, num_q_heads, head_dim] and key [T, num_k_heads, head_dim] in place (rows
// q_row_stride / k_row_stride floats apart, heads contiguous): the first rotary_dim values of each head turn
// (rotary_dim = head_dim but under partial rotary); cos, sin [T, rotary_dim / 2] per token.
void rotary_f32(float* query, int64_t q_row_stride, int64_t num_q_heads, float* key, int64_t k_row_stride,
                int64_t num_k_heads, const float* cos, const float* sin, int64_t T, int64_t head_dim,
                int64_t rotary_dim, int num_threads) {
  const int64_t half = rotary_dim / 2;
  for_rows(T, T * (num_q_heads + num_k_heads) * rotary_dim, num_threads, [&](int64_t t) {
    rotate_heads(query + t * q_row_stride, num_q_heads, head_dim, rotary_dim, cos + t * half, sin + t * half);
    rotate_heads(key + t * k_row_stride, num_k_heads, head_dim, rotary_dim, cos + t * half, sin + t * half);
  });
}

// out [M, I] = silu(gate) * up, where gate_up [M, 2I] holds gate in its first I columns and up in the rest.
// silu(g) = g / (1 + e^-g), as PyTorch computes it.
void silu_mul_f32(const float* gate_up, int64_t M, int64_t I, float* out, int num_threads) {
  for_rows(M, M * I, num_threads,
           [&](int64_t m) { silu_mul_run(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, out + m * I); });
}

// out [M, I] = gelu_tanh(gate) * up (GeGLU, Gemma's MLP), gate_up [M, 2I] as for silu_mul_f32.
void gelu_tanh_mul_f32(const float* gate_up, int64_t M, int64_t I, float* out, int num_threads) {
  for_rows(M, M * I, num_threads,
           [&](int64_t m) { gelu_tanh_mul_run(gate_up + m * 2 * I, gate_up + m * 2 * I + I, I, out + m * I); });
}

// Per row of logits [N, V]: argmax[n], max[n] and lse[n] (see argmax_logsumexp_row); rows split across threads.
// Returns how many rows have no finite log-sum-exp (NaN, or no finite value), so the caller needs no second pass
// to find out.
int argmax_logsumexp_f32(const float* logits, int64_t N, int64_t V, int64_t* argmax, float* max, float* lse,
                         int num_threads) {
  for_rows(N, N * V, num_threads,
           [&](int64_t n) { argmax_logsumexp_row(logits + n * V, V, argmax + n, max + n, lse + n); });
  int num_not_finite = 0;
  for (int64_t n = 0; n < N; ++n) num_not_finite += !isfinite(lse[n]);
  return num_not_finite;
}

// Float32 rows x [M, K] against float32 rows w [N, K] into out [M, N] (dot_row each): a mixture of experts' router
// and shared-expert gate, small float matrices that the model page and the native decoder both compute here, so
// that the two pick the same experts with the same weights.
void row_dots_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* out, int num_threads) {
  for_rows(M, M * N * K / 8, num_threads, [&](int64_t m) {
    for (int64_t n = 0; n < N; ++n) out[m * N + n] = dot_row(x + m * K, w + n * K, K);
  });
}

// Per row of router logits [M, E]: the softmax over the E experts (float32, expf, summed in expert order), then the
// top_k probabilities, largest first and the lower expert first among equals, into experts [M, top_k] and weights
// [M, top_k]; with normalize, the chosen probabilities divided by their sum (in the order chosen).
void moe_route_f32(const float* logits, int64_t M, int64_t E, int64_t top_k, int normalize, int64_t* experts,
                   float* weights, int num_threads) {
  for_rows(M, M * E * top_k, num_threads, [&](int64_t m) {
    const float* row = logits + m * E;
    float largest = -INFINITY;
    for (int64_t e = 0; e < E; ++e) largest = fmaxf(largest, row[e]);
    float probabilities[1024];
    float total = 0.0f;
    for (int64_t e = 0; e < E; ++e) total += probabilities[e] = expf(row[e] - largest);
    for (int64_t e = 0; e < E; ++e) probabilities[e] /= total;
    // Each pick is a valid expert whatever the values: a NaN (a damaged router) is taken only when nothing else is
    // left, and spreads to the output.
    bool taken[1024] = {};
    float chosen_total = 0.0f;
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || probabilities[e] > probabilities[best] ||
                          (isnan(probabilities[best]) && !isnan(probabilities[e]))))
          best = e;
      taken[best] = true;
      experts[m * top_k + j] = best;
      weights[m * top_k + j] = probabilities[best];
      chosen_total += probabilities[best];
    }
    if (normalize)
      for (int64_t j = 0; j < top_k; ++j) weights[m * top_k + j] /= chosen_total;
  });
}

// out [M] = sigmoid(x . w) per row of x [M, K] (Qwen2-MoE's shared-expert gate), 1 / (1 + e^-z).
void sigmoid_gate_f32(const float* x, int64_t M, int64_t K, const float* w, float* out, int num_threads) {
  for_rows(M, M * K / 8, num_threads, [&](int64_t m) { out[m] = 1.0f / (1.0f + expf(-dot_row(x + m * K, w, K))); });
}

// The calling thread's pool of OpenMP workers, ended (the thread's next parallel region starts a new one): libgomp
// lets workers spin between regions only while it manages no more threads than there are cores, so a pool a thread
// no longer uses makes every other thread's regions wake their workers from sleep. 0 on success.
int release_thread_pool() { return omp_pause_resource_all(omp_pause_soft); }

}  // extern "C"
