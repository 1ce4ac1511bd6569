// A whole decoder stack for one step in one call: every layer's norms, quantized products, rotary positions, paged
// attention and gated MLP, in the order the model page runs them. One loop serves four layer layouts and mixtures of
// experts, each part a layer lacks being a null pointer or zero:
// - Llama (models/llama.py): input norm, attention, post-attention norm, SwiGLU MLP;
// - Qwen3 (models/qwen3.py): the same, with an RMSNorm over each query and key head before rotary, and a sliding
//   window where the layer has one;
// - Phi-3 / Phi-4-mini (models/phi3.py): Llama's block with a window and, in Phi-4-mini, partial rotary (per
//   decoder: only the first rotary_dim values of each head turn);
// - mixtures of experts (models/moe.py: Qwen3-MoE, Qwen2-MoE, Mixtral): Qwen3's attention and, in place of the
//   MLP, a router and per-expert SwiGLU MLPs over the rows routed to each, plus Qwen2-MoE's gated shared expert;
// - Gemma 2 and 3 (models/gemma.py): Qwen3's parts, norms also on the attention and MLP outputs before each is
//   added to the residual stream, GeGLU instead of SwiGLU (per decoder), Gemma 2's soft-capped attention scores
//   (per decoder) and, on Gemma 3's sliding layers, rotary tables of their own base (per layer). Its norms multiply
//   by (1 + weight): the caller passes those sums.
//
// A single-stream decode step is ~240 small operations (8 per layer, 30 layers), each a few microseconds of
// arithmetic. Run from Python, each also pays module dispatch, argument checks, a tensor allocation and a ctypes
// call, which together took about as long as the arithmetic. Here the Python side makes one call per step.
//
// Nothing new is computed: each operation is the extern "C" function the module path calls (gemv.cpp, gemm.cpp,
// ops.cpp, attention.cpp), with the same arguments, so the results equal the module path's bit for bit. (The q/k
// norms run in place on the qkv rows, head_rms_norm_f32, where the modules normalize a copy: the same arithmetic.)

#include <omp.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <vector>

#include "kquant.h"


extern "C" {
void int4_linear_f32(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                     const float*, int64_t, float*, int);
void int4_linear_int8x(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                       const int64_t*, const float*, int64_t, float*, int);
void int4_gemm_f32(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                   const float*, int64_t, float*, int);
void int8_linear_f32(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int);
void int8_linear_int8x(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const int64_t*, const float*,
                       int64_t, float*, int);
void int8_gemm_f32(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*, int);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
void int4_gemm_int8x(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                     const int64_t*, const float*, int64_t, float*, int);
void int8_gemm_int8x(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const int64_t*, const float*, int64_t,
                     float*, int);
void int4_gemm_int8x_strided(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t,
                             int64_t, const int64_t*, const float*, int64_t, int64_t, float*, int);
void int8_gemm_int8x_strided(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const int64_t*, const float*,
                             int64_t, int64_t, float*, int);
void int4_gemm_int8x_swiglu(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t,
                            int64_t, const float*, int64_t, float*, int);
void int8_gemm_int8x_swiglu(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                            int);
void int4_gemm_int8x_geglu(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                           const float*, int64_t, float*, int);
void int8_gemm_int8x_geglu(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const float*, int64_t, float*,
                           int);
void kquant_gemm_int8x(const tokenriver::KQuantWeight*, const float*, int64_t, float*, int);
void kquant_gemm_int8x_strided(const tokenriver::KQuantWeight*, const float*, int64_t, int64_t, float*, int);
void kquant_gemm_int8x_gated(const tokenriver::KQuantWeight*, int64_t, int, const float*, int64_t, float*, int);
void kquant_linear_int8x(const tokenriver::KQuantWeight*, const float*, int64_t, float*, int);
#endif
void kquant_dequantize_rows(const tokenriver::KQuantWeight*, const int64_t*, int64_t, float*, int);
void rms_norm_f32(const float*, float*, const float*, int64_t, int64_t, float, float*, int);
void int4_dequantize_rows(const uint8_t*, const uint16_t*, const uint16_t*, const uint64_t*, int64_t, int64_t, int64_t,
                          const int64_t*, int64_t, float*, int);
void int8_dequantize_rows(const int8_t*, const uint16_t*, int64_t, int64_t, int64_t, const int64_t*, int64_t, float*,
                          int);
int argmax_logsumexp_f32(const float*, int64_t, int64_t, int64_t*, float*, float*, int);
void rotary_f32(float*, int64_t, int64_t, float*, int64_t, int64_t, const float*, const float*, int64_t, int64_t,
                int64_t, int);
void head_rms_norm_f32(float*, int64_t, int64_t, const float*, int64_t, int64_t, float, int);
void silu_mul_f32(const float*, int64_t, int64_t, float*, int);
void gelu_tanh_mul_f32(const float*, int64_t, int64_t, float*, int);
void row_dots_f32(const float*, int64_t, int64_t, const float*, int64_t, float*, int);
void moe_route_f32(const float*, int64_t, int64_t, int64_t, int, int64_t*, float*, int);
void sigmoid_gate_f32(const float*, int64_t, int64_t, const float*, float*, int);
int paged_attention_window_f32(const float*, int64_t, int64_t, const float*, int64_t, const float*, int64_t,
                               const int64_t*, void*, void*, int64_t, int64_t, int64_t, int64_t, int64_t,
                               const int64_t*, int64_t, int64_t, const int64_t*, int64_t, const int64_t*, int64_t,
                               float, int64_t, float, float*, int64_t, int, int);
}

namespace {

// A quantized linear layer (models/quant.py): the weight in gemv.cpp's format and how the layer runs it.
// Mirrored field for field by native.py's LinearSpec.
struct Linear {
  const uint8_t* qweight;   // in row tiles (tiles.h): int4 [tiles, K/32, 4, 16, 4] or int8 [tiles, K/32, 8, 16, 4]
  const uint16_t* scales;   // [tiles, K/G, 16] float16
  const uint16_t* mins;     // [tiles, K/G, 16] float16, int4 only
  const uint64_t* high_bits;  // [tiles, K/32, 2, 4] int5's fifth-bit masks (tiles.h), or null
  const float* bias;        // [N] or null
  int64_t out_features, in_features, group_size;
  int64_t max_gemv_rows;    // up to this many rows take the GEMV, more take the GEMM
  int32_t is_int4;
  int32_t int8_activations; // the GEMV rounds activations to int8
  int32_t gemm_rounding;    // the many-row products: 0 exact, 1 activations to int8
  const int64_t* chain_ends;  // the int8-activation products' sub-chains (tiles.h), or null
  // A K-quant weight at its own size (kquant.h), in place of the fields above but bias and sizes; or null. Its
  // products are int8-activation ones (the Python side binds it only so).
  const tokenriver::KQuantWeight* kquant;
  // A projection fused of parts run apart (models/stacked.py: K-quant parts of different types), each a Linear of
  // its own rows, their outputs side by side; or null (num_parts 0), and then none of this struct's other weights
  // are set.
  const Linear* parts;
  int64_t num_parts;
};

// A mixture-of-experts MLP (models/moe.py's SparseMoeBlock; native.py's MoeSpec): a float32 router, each expert's
// fused gate/up and down projections, and an optional shared expert with its float32 gate.
struct Moe {
  const float* router;              // [E, H]
  int64_t num_experts, top_k;
  int32_t normalize;                // the chosen probabilities renormalized to sum to one
  int64_t intermediate_size;        // each expert's
  const Linear* gate_ups;           // [E]: [2I, H] each
  const Linear* downs;              // [E]: [H, I] each
  const Linear* shared_gate_up;     // [2I_s, H], or null: no shared expert
  const Linear* shared_down;        // [H, I_s]
  int64_t shared_intermediate_size;
  const float* shared_gate;         // [H]: the shared expert's output is scaled by sigmoid(x . shared_gate)
};

// One decoder layer's weights (native.py's LayerSpec). The parts after the projections are Qwen3's and Gemma's:
// null (or 0) where a layer has none.
struct Layer {
  const float* input_norm;          // [H] adds the previous layer's output into the stream, normalizes the sum
  const float* pre_mlp_norm;        // [H] adds the attention output in, normalizes the MLP's input (Llama's
                                    // post_attention_layernorm, Gemma's pre_feedforward_layernorm)
  Linear qkv, o, gate_up, down;
  const float* q_norm;              // [head_dim] RMSNorm of each query head before rotary, or null
  const float* k_norm;              // [head_dim] of each key head; set with q_norm
  const float* attention_out_norm;  // [H] on the attention output before it is added (Gemma's
                                    // post_attention_layernorm), or null
  const float* mlp_out_norm;        // [H] on the MLP output before it is added (post_feedforward_layernorm), or null
  int64_t window;                   // sliding window: each token sees its last `window` positions (0: all)
  int32_t local_rope;               // rotates with the step's local tables (Gemma 3's sliding layers)
  const Moe* moe;                   // a mixture of experts in place of gate_up and down, or null
};

// The gated MLP's activation (Decoder.activation).
constexpr int32_t kSiLU = 0;       // SwiGLU: silu(gate) * up
constexpr int32_t kGeluTanh = 1;   // GeGLU: gelu(gate, tanh approximation) * up

// The stack's shapes and weights (native.py's DecoderSpec).
struct Decoder {
  const Layer* layers;
  int64_t num_layers, hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size;
  float rms_norm_eps, scale;
  int32_t activation;  // kSiLU or kGeluTanh
  int64_t rotary_dim;  // the first rotary_dim values of each query and key head turn (head_dim but under partial
                       // rotary: Phi-4-mini)
  float softcap;       // attention scores soft-capped at softcap (Gemma 2), 0: none
};

// This step's tensors (native.py's StepSpec); the int64 arrays are AttentionMetadata's.
struct Step {
  const float* hidden;      // [T, H] the embeddings, read only
  float* out;               // [T, H] the last layer's MLP output
  float* residual;          // [T, H] the residual stream before that output is added
  int64_t num_tokens;
  const float* cos;         // [T, rotary_dim / 2]
  const float* sin;         // [T, rotary_dim / 2]
  const float* local_cos;   // [T, rotary_dim / 2] for layers with local_rope (may equal cos)
  const float* local_sin;   // [T, rotary_dim / 2]
  const int64_t* slots;     // [T]
  const int64_t* block_tables;  // [num_requests, max_blocks]
  int64_t num_requests, max_blocks;
  const int64_t* queries;   // [num_queries, 3] single query tokens, or null
  int64_t num_queries;
  const int64_t* chunks;    // [num_chunks, 4] prompt chunks, or null
  int64_t num_chunks;
  void* const* key_caches;    // per layer, [num_blocks, block_size, num_kv_heads, head_dim]
  void* const* value_caches;
  int64_t num_blocks, block_size;
  int32_t num_threads;
  int32_t kv_cache_format;     // the pools hold 0: float32, 1: float16, 2: int8 (attention.cpp)
  int32_t threading;           // 0: measured per step (runs_in_row_groups), 1: every operation split across the
                               // threads, 2: one group of rows per thread where the step allows it
};

// Greedy passes of a multi-step decode (native.py's GreedyLoopSpec; runner/native_stack.py): what the runner does
// around the stack between two passes, for rows that take their raw argmax. Each pass embeds the token the pass
// before chose, runs the stack, the final norm and the output projection, and takes each row's argmax, largest
// logit and log-sum-exp, with the functions and arguments the Python side calls, so the same bits come out.
struct GreedyLoop {
  const Linear* table;          // the embedding matrix as a quantized layer (a tied output projection), or null
  const float* float_table;     // [V, H] float32 rows, where table is null
  int64_t vocab_size;           // rows of the embedding matrix
  float embed_scale;            // embeddings times this (Gemma's, rounded to float32), or 0: not scaled
  const float* cos_table;       // [num_positions, rotary_dim / 2] the rotary tables by position
  const float* sin_table;
  const float* local_cos_table; // Gemma 3's sliding layers' tables (the global ones where they share them)
  const float* local_sin_table;
  int64_t num_positions;
  const float* final_norm;      // [H] the final norm's weight (Gemma's 1 + weight)
  float final_norm_eps;
  const Linear* lm_head;        // [V_out, H] without bias, its GEMV or GEMM by the rows, as linear() picks
  int64_t num_passes;
  const int64_t* first_tokens;    // [B] the tokens the first pass decodes, one per request
  const int64_t* first_positions; // [B] their positions
  int64_t* tokens;                // [num_passes, B] out: each pass's argmax
  float* max_logits;              // [num_passes, B] out: its logit
  float* log_normalizers;         // [num_passes, B] out: its row's log-sum-exp
};

void linear(const Linear& l, const float* x, int64_t M, float* y, int threads);

// A projection of parts run apart: each part's product, its columns laid into y [M, N] beside the others' (one row
// straight into place).
void stacked_linear(const Linear& l, const float* x, int64_t M, float* y, int threads) {
  thread_local std::vector<float> part_out;
  int64_t column = 0;
  for (int64_t p = 0; p < l.num_parts; ++p) {
    const Linear& part = l.parts[p];
    const int64_t n = part.out_features;
    if (M == 1) {
      linear(part, x, 1, y + column, threads);
    } else {
      if (part_out.size() < static_cast<size_t>(M * n)) part_out.resize(M * n);
      linear(part, x, M, part_out.data(), threads);
      for (int64_t m = 0; m < M; ++m)
        memcpy(y + m * l.out_features + column, part_out.data() + m * n, n * sizeof(float));
    }
    column += n;
  }
}

void linear(const Linear& l, const float* x, int64_t M, float* y, int threads) {
  if (l.num_parts > 0) {
    stacked_linear(l, x, M, y, threads);
    return;
  }
  const int64_t N = l.out_features, K = l.in_features, G = l.group_size;
  const bool gemm = M > l.max_gemv_rows;
  const int8_t* codes8 = reinterpret_cast<const int8_t*>(l.qweight);
  if (l.kquant != nullptr) {
    // K-quant layouts exist only where these products are compiled (kquant_supported).
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    (gemm ? kquant_gemm_int8x : kquant_linear_int8x)(l.kquant, x, M, y, threads);
#endif
  } else if (!(gemm ? l.gemm_rounding == 1 : l.int8_activations)) {
    if (l.is_int4)
      (gemm ? int4_gemm_f32 : int4_linear_f32)(l.qweight, l.scales, l.mins, l.high_bits, N, K, G, x, M, y, threads);
    else
      (gemm ? int8_gemm_f32 : int8_linear_f32)(codes8, l.scales, N, K, G, x, M, y, threads);
  } else if (l.is_int4) {
    auto product = int4_linear_int8x;  // without VNNI the int8 products of many rows run the GEMV (gemv.cpp)
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (gemm) product = int4_gemm_int8x;
#endif
    product(l.qweight, l.scales, l.mins, l.high_bits, N, K, G, l.chain_ends, x, M, y, threads);
  } else {
    auto product = int8_linear_int8x;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    if (gemm) product = int8_gemm_int8x;
#endif
    product(codes8, l.scales, N, K, G, l.chain_ends, x, M, y, threads);
  }
  if (l.bias != nullptr)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = 0; n < N; ++n) y[m * N + n] += l.bias[n];
}

// Whether the layer's MLP keeps its intermediate feature-major: both products on gemm.cpp's int8-activation GEMM,
// which then applies SwiGLU (or GeGLU) to the gate/up sums in its tiles and writes silu(gate) * up transposed ([I, T]:
// no transposes out of its tiles, no [2I, T] product and no pass of the activation over it), and the down product
// packs its input from it without transposing either. Every value goes through the same operations as row after
// row (the activations' 8- and 16-wide forms agree bit for bit; I a multiple of 8), so the output is the same,
// without writing out the [2I, T] gate/up product and reading it back (benchmarks/HISTORY.md, "fused SwiGLU").
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
bool mlp_feature_major(const Layer& layer, int64_t T, int64_t I) {
  const Linear& gate_up = layer.gate_up;
  const Linear& down = layer.down;
  // I a whole number of row tiles (tiles.h): a tile of gates then has its ups in one tile.
  return gate_up.num_parts == 0 && down.num_parts == 0 && T > gate_up.max_gemv_rows && T > down.max_gemv_rows &&
         gate_up.gemm_rounding == 1 && down.gemm_rounding == 1 && gate_up.bias == nullptr && down.bias == nullptr &&
         I % 16 == 0;
}

// The down product: linear's int8-activation GEMM reading x feature-major ([K, x_ld]).
void linear_from_feature_major(const Linear& l, const float* x, int64_t M, int64_t x_ld, float* y, int threads) {
  const int64_t N = l.out_features, K = l.in_features, G = l.group_size;
  if (l.kquant != nullptr)
    kquant_gemm_int8x_strided(l.kquant, x, M, x_ld, y, threads);
  else if (l.is_int4)
    int4_gemm_int8x_strided(l.qweight, l.scales, l.mins, l.high_bits, N, K, G, l.chain_ends, x, M, x_ld, y, threads);
  else
    int8_gemm_int8x_strided(reinterpret_cast<const int8_t*>(l.qweight), l.scales, N, K, G, l.chain_ends, x, M, x_ld,
                            y, threads);
}

// silu(gate) * up (gelu_tanh(gate) * up if gelu) into y [I, M] (feature-major) from the fused gate/up layer
// ([2I, K]) on x [M, K].
void gated_feature_major(const Linear& l, bool gelu, const float* x, int64_t M, float* y, int threads) {
  const int64_t I = l.out_features / 2, K = l.in_features, G = l.group_size;
  const auto int4_product = gelu ? int4_gemm_int8x_geglu : int4_gemm_int8x_swiglu;
  const auto int8_product = gelu ? int8_gemm_int8x_geglu : int8_gemm_int8x_swiglu;
  if (l.kquant != nullptr)
    kquant_gemm_int8x_gated(l.kquant, I, gelu ? 1 : 0, x, M, y, threads);
  else if (l.is_int4)
    int4_product(l.qweight, l.scales, l.mins, l.high_bits, I, K, G, x, M, y, threads);
  else
    int8_product(reinterpret_cast<const int8_t*>(l.qweight), l.scales, I, K, G, x, M, y, threads);
}
#endif

// The layer's gated MLP on normed [T, H] into out [T, H]; gate_up [T, 2I] and activation [T, I] are scratch.
void run_mlp(const Decoder* d, const Layer& layer, const float* normed, int64_t T, float* gate_up, float* activation,
             float* out, int threads) {
  const int64_t I = d->intermediate_size;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  if (mlp_feature_major(layer, T, I)) {
    gated_feature_major(layer.gate_up, d->activation == kGeluTanh, normed, T, activation, threads);
    linear_from_feature_major(layer.down, activation, T, T, out, threads);
    return;
  }
#endif
  linear(layer.gate_up, normed, T, gate_up, threads);
  if (d->activation == kGeluTanh)
    gelu_tanh_mul_f32(gate_up, T, I, activation, threads);
  else
    silu_mul_f32(gate_up, T, I, activation, threads);
  linear(layer.down, activation, T, out, threads);
}

// A SwiGLU MLP on rows x [M, H] into y [M, H], row after row as the model page's SwiGLUMLP runs it: gate_up [M, 2I]
// and activation [M, I] are scratch.
void swiglu_rows(const Linear& gate_up, const Linear& down, const float* x, int64_t M, float* gate_up_out,
                 float* activation, float* y, int threads) {
  linear(gate_up, x, M, gate_up_out, threads);
  silu_mul_f32(gate_up_out, M, gate_up.out_features / 2, activation, threads);
  linear(down, activation, M, y, threads);
}

// The mixture of experts on normed [T, H] into out [T, H], as SparseMoeBlock.forward computes it: route, then per
// expert the rows of the tokens that chose it (in token order) through its MLP, and each output row times its
// routing weight added to its token's row, expert after expert in order; then the shared expert's output times its
// gate. Experts no token chose cost nothing. The chosen experts are shared out among the threads, each running its
// experts' products alone: a decode step's experts are small products, and one fork for all of them beats one per
// product. Which thread runs an expert changes none of its bits, and the sums are added in expert order after.
void run_moe(const Moe& m, const float* normed, int64_t T, int64_t H, float* out, int threads) {
  const int64_t E = m.num_experts, k = m.top_k;
  thread_local std::vector<float> logits, weights, outputs, gates, shared_gate_up, shared_activation, shared_out;
  thread_local std::vector<int64_t> experts, pairs, starts, next, active;
  logits.resize(T * E);
  weights.resize(T * k);
  experts.resize(T * k);
  outputs.resize(T * k * H);
  row_dots_f32(normed, T, H, m.router, E, logits.data(), threads);
  moe_route_f32(logits.data(), T, E, k, m.normalize, experts.data(), weights.data(), threads);
  // The (token, choice) pairs grouped by expert, in pair order within each: a stable counting sort.
  starts.assign(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p) ++starts[experts[p] + 1];
  for (int64_t e = 0; e < E; ++e) starts[e + 1] += starts[e];
  pairs.resize(T * k);
  next.assign(starts.begin(), starts.end() - 1);
  for (int64_t p = 0; p < T * k; ++p) pairs[next[experts[p]]++] = p;
  active.clear();
  for (int64_t e = 0; e < E; ++e)
    if (starts[e + 1] > starts[e]) active.push_back(e);
  const int64_t I = m.intermediate_size;
  // The caller's buffers, by pointer: inside the parallel region a thread_local name means each worker's own.
  const int64_t* const first = starts.data();
  const int64_t* const grouped = pairs.data();
  float* const expert_outputs = outputs.data();
  const auto run_expert = [&m, normed, H, k, I, first, grouped, expert_outputs](int64_t e, int inner_threads) {
    thread_local std::vector<float> rows, gate_up, activation;  // each running thread's own
    const int64_t count = first[e + 1] - first[e];
    rows.resize(count * H);
    gate_up.resize(count * 2 * I);
    activation.resize(count * I);
    const int64_t* chosen = grouped + first[e];
    for (int64_t i = 0; i < count; ++i) memcpy(rows.data() + i * H, normed + chosen[i] / k * H, H * sizeof(float));
    swiglu_rows(m.gate_ups[e], m.downs[e], rows.data(), count, gate_up.data(), activation.data(),
                expert_outputs + first[e] * H, inner_threads);
  };
  const int64_t* const order = active.data();
  const int64_t num_active = static_cast<int64_t>(active.size());
  if (threads > 1 && num_active > 1) {
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t a = 0; a < num_active; ++a) run_expert(order[a], 1);
  } else {
    for (int64_t a = 0; a < num_active; ++a) run_expert(order[a], threads);
  }
  memset(out, 0, T * H * sizeof(float));
  for (int64_t p = 0; p < T * k; ++p) {
    const int64_t pair = pairs[p];
    const float weight = weights[pair];
    float* row = out + pair / k * H;
    const float* expert_row = outputs.data() + p * H;
    for (int64_t h = 0; h < H; ++h) row[h] += expert_row[h] * weight;
  }
  if (m.shared_gate_up == nullptr) return;
  const int64_t shared_I = m.shared_intermediate_size;
  gates.resize(T);
  shared_gate_up.resize(T * 2 * shared_I);
  shared_activation.resize(T * shared_I);
  shared_out.resize(T * H);
  sigmoid_gate_f32(normed, T, H, m.shared_gate, gates.data(), threads);
  swiglu_rows(*m.shared_gate_up, *m.shared_down, normed, T, shared_gate_up.data(), shared_activation.data(),
              shared_out.data(), threads);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) out[t * H + h] += gates[t] * shared_out[t * H + h];
}

// Every layer over all of the step's rows; returns paged attention's status.
int run_layers(const Decoder* d, const Step* s) {
  const int64_t T = s->num_tokens, H = d->hidden_size, hd = d->head_dim;
  const int64_t q_width = d->num_heads * hd, kv_width = d->num_kv_heads * hd;
  const int64_t qkv_width = q_width + 2 * kv_width;
  const int threads = s->num_threads;
  const float eps = d->rms_norm_eps;
  // The step's intermediates, in scratch of the calling thread kept between steps: fresh vectors were zero-filled
  // (1.7 MB for 64 rows of the embedded model) and, past malloc's threshold, page-faulted in again every step.
  thread_local std::vector<float> scratch;
  const int64_t sizes[] = {T * H, T * qkv_width, T * q_width, T * 2 * d->intermediate_size, T * d->intermediate_size};
  int64_t total = 0;
  for (const int64_t size : sizes) total += (size + 15) / 16 * 16;  // each part 64-byte aligned past the first
  if (scratch.size() < static_cast<size_t>(total + 16)) scratch.resize(total + 16);
  float* part = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(scratch.data()) + 63) & ~uintptr_t{63});
  float* parts[5];
  for (int k = 0; k < 5; ++k) {
    parts[k] = part;
    part += (sizes[k] + 15) / 16 * 16;
  }
  float* const normed = parts[0];
  float* const qkv = parts[1];
  float* const attention = parts[2];
  float* const gate_up = parts[3];
  float* const activation = parts[4];
  memcpy(s->residual, s->hidden, T * H * sizeof(float));
  for (int64_t i = 0; i < d->num_layers; ++i) {
    const Layer& layer = d->layers[i];
    // The first layer's residual stream is the embeddings; later ones add the previous MLP output first.
    if (i == 0)
      rms_norm_f32(s->residual, nullptr, layer.input_norm, T, H, eps, normed, threads);
    else
      rms_norm_f32(s->out, s->residual, layer.input_norm, T, H, eps, normed, threads);
    linear(layer.qkv, normed, T, qkv, threads);
    float* query = qkv;
    float* key = query + q_width;
    float* value = key + kv_width;
    if (layer.q_norm != nullptr) {
      head_rms_norm_f32(query, qkv_width, d->num_heads, layer.q_norm, T, hd, eps, threads);
      head_rms_norm_f32(key, qkv_width, d->num_kv_heads, layer.k_norm, T, hd, eps, threads);
    }
    const float* cos = layer.local_rope ? s->local_cos : s->cos;
    const float* sin = layer.local_rope ? s->local_sin : s->sin;
    rotary_f32(query, qkv_width, d->num_heads, key, qkv_width, d->num_kv_heads, cos, sin, T, hd, d->rotary_dim,
               threads);
    const int status = paged_attention_window_f32(
        query, qkv_width, T, key, qkv_width, value, qkv_width, s->slots, s->key_caches[i], s->value_caches[i],
        s->num_blocks, s->block_size, d->num_heads, d->num_kv_heads, hd, s->block_tables, s->num_requests,
        s->max_blocks, s->queries, s->num_queries, s->chunks, s->num_chunks, d->scale, layer.window, d->softcap,
        attention, q_width, threads, s->kv_cache_format);
    if (status != 0) return status;
    linear(layer.o, attention, T, s->out, threads);
    // Normalized in place: each value is read before it is written.
    if (layer.attention_out_norm != nullptr)
      rms_norm_f32(s->out, nullptr, layer.attention_out_norm, T, H, eps, s->out, threads);
    rms_norm_f32(s->out, s->residual, layer.pre_mlp_norm, T, H, eps, normed, threads);
    if (layer.moe != nullptr)
      run_moe(*layer.moe, normed, T, H, s->out, threads);
    else
      run_mlp(d, layer, normed, T, gate_up, activation, s->out, threads);
    if (layer.mlp_out_norm != nullptr) rms_norm_f32(s->out, nullptr, layer.mlp_out_norm, T, H, eps, s->out, threads);
  }
  return 0;
}

// Rows per pass of a long step. A prompt step's float32 intermediates outgrow the caches when it is large (a 2048-row
// step writes and reads back 1.3 GB of product outputs), so a step of more rows runs the whole stack over one slice
// of its rows after another, each slice's keys and values written to the cache before the next slice attends to
// them. Every operation treats its rows independently or, in attention, by absolute context position, so the
// results are the same bits either way; only the weights are decoded once per slice. 256 rows was the fastest of
// 128, 256, 512 and whole steps on the prompt steps of 64 chat prompts (benchmarks/HISTORY.md).
constexpr int64_t kRowsPerPass = 256;

// The part of step s that concerns rows [r0, r1): its rows, the single query tokens among them and the parts of
// prompt chunks they hold (a chunk cut at r1 sees the context its last kept token sees). The index arrays go into
// `queries` and `chunks`.
Step slice_rows(const Step& s, int64_t H, int64_t rotary_dim, int64_t r0, int64_t r1, std::vector<int64_t>& queries,
                std::vector<int64_t>& chunks) {
  queries.clear();
  chunks.clear();
  for (int64_t q = 0; q < s.num_queries; ++q) {
    const int64_t* query = s.queries + 3 * q;
    if (query[0] >= r0 && query[0] < r1) queries.insert(queries.end(), {query[0] - r0, query[1], query[2]});
  }
  for (int64_t c = 0; c < s.num_chunks; ++c) {
    const int64_t* chunk = s.chunks + 4 * c;
    const int64_t first = std::max(chunk[0], r0), end = std::min(chunk[0] + chunk[2], r1);
    const int64_t context = chunk[3] - (chunk[0] + chunk[2] - end);  // what the chunk's last kept token sees
    if (first < end) chunks.insert(chunks.end(), {first - r0, chunk[1], end - first, context});
  }
  Step slice = s;
  slice.hidden = s.hidden + r0 * H;
  slice.out = s.out + r0 * H;
  slice.residual = s.residual + r0 * H;
  slice.num_tokens = r1 - r0;
  slice.cos = s.cos + r0 * (rotary_dim / 2);
  slice.sin = s.sin + r0 * (rotary_dim / 2);
  slice.local_cos = s.local_cos + r0 * (rotary_dim / 2);
  slice.local_sin = s.local_sin + r0 * (rotary_dim / 2);
  slice.slots = s.slots + r0;
  slice.queries = queries.empty() ? nullptr : queries.data();
  slice.num_queries = static_cast<int64_t>(queries.size()) / 3;
  slice.chunks = chunks.empty() ? nullptr : chunks.data();
  slice.num_chunks = static_cast<int64_t>(chunks.size()) / 4;
  return slice;
}

// How the threads share a step. By default every operation is split across them (a product by output columns,
// attention by query), which needs each thread to read the rows the others wrote at every step of the stack, and
// to meet them at every operation's end. That is cheap between cores that share a cache. Between cores that do not
// (another L3 slice, another socket; a cloud VM's two vCPUs move between the two cases every few minutes) each
// cache line the other core wrote takes several times longer to arrive, and the small operations suffer most. There
// a decode step runs instead as one group of rows per thread, each group through the whole stack on its thread
// alone: the weights are read by every thread, but nothing written is read across cores and no thread waits for
// another until the end. Between cores that share a cache, groups cost a little (every thread repacks every weight
// tile), so they are not the default there (docs/performance.md; figures in benchmarks/HISTORY.md).
//
// Which case holds is measured at each such step: the one-way time of a cache line handed back and forth between
// two of the team's threads, a few microseconds a step; kSeparateCachesNs sits between the handoff times measured
// with and without a shared cache. Both ways compute every row with the same operations (the GEMM's rows do not
// depend on the batch, attention's not on the threads), so the choice changes no result.
constexpr double kSeparateCachesNs = 70.0;
constexpr int kHandoffRounds = 16;

// The mean one-way time (ns) of a cache line passed between threads 0 and 1 of a team of two, or 0 if thread 1 did
// not take its first turn before the deadline below (the measurement is then skipped, not waited for).
double handoff_ns() {
  alignas(64) std::atomic<int> turn{0};
  double elapsed_ns = 0.0;
#pragma omp parallel num_threads(2)
  if (omp_get_num_threads() == 2) {
    using Clock = std::chrono::steady_clock;
    // Thread 1 passes each even value on to the next odd one, thread 0 each odd value to the next even one; thread 0
    // times the 2 * kHandoffRounds passes from 2 to 2 * kHandoffRounds + 1. Passing on is a compare-exchange, so
    // that -1 (thread 0 gave up waiting) is never overwritten.
    const bool first = omp_get_thread_num() == 0;
    const Clock::time_point deadline = Clock::now() + std::chrono::microseconds(50);
    Clock::time_point start;
    for (int value = first ? 1 : 0; value <= 2 * kHandoffRounds + 1; value += 2) {
      int seen = turn.load(std::memory_order_acquire);
      while (seen != value && seen >= 0) {
        if (first && Clock::now() > deadline && turn.compare_exchange_strong(seen, -1)) break;
        seen = turn.load(std::memory_order_acquire);
      }
      if (seen != value) break;
      if (first && value == 1) start = Clock::now();
      if (value == 2 * kHandoffRounds + 1) {
        elapsed_ns = std::chrono::duration<double, std::nano>(Clock::now() - start).count();
        break;
      }
      if (!turn.compare_exchange_strong(seen, value + 1)) break;
    }
  }
  return elapsed_ns / (2 * kHandoffRounds);
}

// Whether step s runs as one group of rows per thread: a decode step (one query token per request: a request's
// later token attends to the keys its earlier ones write in the same step, which another group might not have
// written yet) with more rows per thread than any layer's GEMV takes, so that every product still runs the GEMM,
// as for the whole step; and then either asked for (threading 2) or, by default, when the threads do not share a
// cache.
bool runs_in_row_groups(const Decoder* d, const Step& s) {
  if (s.threading == 1 || s.num_threads < 2 || s.num_chunks > 0 || s.num_tokens > kRowsPerPass) return false;
  std::vector<char> has_query(s.num_requests, 0);
  for (int64_t q = 0; q < s.num_queries; ++q) {
    const int64_t request = s.queries[3 * q + 1];
    if (request < 0 || request >= s.num_requests || has_query[request]) return false;
    has_query[request] = 1;
  }
  const int64_t rows = s.num_tokens / s.num_threads;
  for (int64_t i = 0; i < d->num_layers; ++i) {
    const Layer& layer = d->layers[i];
    // An expert's rows are the tokens routed to it: in groups, fewer of them, perhaps few enough for the GEMV.
    if (layer.moe != nullptr) return false;
    for (const Linear* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      if (rows <= l->max_gemv_rows) return false;
  }
  return s.threading == 2 || handoff_ns() > kSeparateCachesNs;
}

// The step's rows cut into num_threads groups, each run through every layer by one thread.
int run_row_groups(const Decoder* d, const Step& s) {
  const int groups = s.num_threads;
  std::vector<std::vector<int64_t>> queries(groups), chunks(groups);
  std::vector<Step> slices;
  for (int g = 0; g < groups; ++g) {
    const int64_t r0 = s.num_tokens * g / groups, r1 = s.num_tokens * (g + 1) / groups;
    slices.push_back(slice_rows(s, d->hidden_size, d->rotary_dim, r0, r1, queries[g], chunks[g]));
    slices.back().num_threads = 1;
  }
  std::vector<int> status(groups, 0);
  // A team may come smaller than asked (OMP_THREAD_LIMIT): its threads then share the groups out.
#pragma omp parallel num_threads(groups)
  for (int g = omp_get_thread_num(); g < groups; g += omp_get_num_threads()) status[g] = run_layers(d, &slices[g]);
  for (const int code : status)
    if (code != 0) return code;
  return 0;
}

}  // namespace

extern "C" {

// Runs every layer; returns 0, or paged attention's error status (1: an index out of range, 2: head_dim not
// compiled in). Every layer sees the same step, so the first layer's attention finds any such error, before
// the cache is written; out and residual are then partly written. A step of more than kRowsPerPass rows runs in
// slices of rows (an error in a later slice leaves the earlier slices' cache entries written).
int decoder_f32(const Decoder* d, const Step* s) {
  if (runs_in_row_groups(d, *s)) return run_row_groups(d, *s);
  if (s->num_tokens <= kRowsPerPass) return run_layers(d, s);
  std::vector<int64_t> queries, chunks;
  for (int64_t r0 = 0; r0 < s->num_tokens; r0 += kRowsPerPass) {
    const int64_t r1 = std::min(r0 + kRowsPerPass, s->num_tokens);
    const Step slice = slice_rows(*s, d->hidden_size, d->rotary_dim, r0, r1, queries, chunks);
    const int status = run_layers(d, &slice);
    if (status != 0) return status;
  }
  return 0;
}

// num_passes greedy passes of B one-token requests (base: the step's cache, block tables [B, max_blocks] covering
// every pass's position, threads; its per-token fields are this function's own). Returns how many passes it
// finished: fewer when a pass cannot run here (a position past the rotary table or the block table, an attention
// error) or a row's logits are not all finite. The caller runs the rest its own way; a pass cut short wrote only
// the keys and values that pass writes again.
int decoder_greedy_f32(const Decoder* d, const Step* base, const GreedyLoop* g) {
  const int64_t B = base->num_requests, H = d->hidden_size, half = d->rotary_dim / 2;
  const int64_t V = g->lm_head->out_features;
  const int threads = base->num_threads;
  std::vector<float> hidden(B * H), out(B * H), residual(B * H), normed(B * H);
  // The logits, B x V floats (32 rows of a 262,144-token vocabulary: 32 MiB), kept between calls: a fresh buffer
  // each call would be zeroed and faulted in page by page, and handed back to the system at its end.
  thread_local std::vector<float> logits;
  if (logits.size() < static_cast<size_t>(B * V)) logits.resize(B * V);
  std::vector<float> cos(B * half), sin(B * half), local_cos(B * half), local_sin(B * half);
  std::vector<int64_t> slots(B), queries(3 * B);
  Step s = *base;
  s.hidden = hidden.data();
  s.out = out.data();
  s.residual = residual.data();
  s.num_tokens = B;
  s.cos = cos.data();
  s.sin = sin.data();
  s.local_cos = local_cos.data();
  s.local_sin = local_sin.data();
  s.slots = slots.data();
  s.queries = queries.data();
  s.num_queries = B;
  s.chunks = nullptr;
  s.num_chunks = 0;
  for (int64_t pass = 0; pass < g->num_passes; ++pass) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t token = pass == 0 ? g->first_tokens[b] : g->tokens[(pass - 1) * B + b];
      const int64_t position = g->first_positions[b] + pass;
      if (token < 0 || token >= g->vocab_size || position < 0 || position >= g->num_positions ||
          position / s.block_size >= s.max_blocks)
        return static_cast<int>(pass);
      float* row = hidden.data() + b * H;
      if (g->table == nullptr) {
        memcpy(row, g->float_table + token * H, H * sizeof(float));
      } else if (g->table->kquant != nullptr) {
        kquant_dequantize_rows(g->table->kquant, &token, 1, row, threads);
      } else if (g->table->is_int4) {
        const Linear& t = *g->table;
        int4_dequantize_rows(t.qweight, t.scales, t.mins, t.high_bits, t.out_features, H, t.group_size, &token, 1, row,
                             threads);
      } else {
        const Linear& t = *g->table;
        int8_dequantize_rows(reinterpret_cast<const int8_t*>(t.qweight), t.scales, t.out_features, H, t.group_size,
                             &token, 1, row, threads);
      }
      if (g->embed_scale != 0.0f)
        for (int64_t h = 0; h < H; ++h) row[h] *= g->embed_scale;
      memcpy(cos.data() + b * half, g->cos_table + position * half, half * sizeof(float));
      memcpy(sin.data() + b * half, g->sin_table + position * half, half * sizeof(float));
      memcpy(local_cos.data() + b * half, g->local_cos_table + position * half, half * sizeof(float));
      memcpy(local_sin.data() + b * half, g->local_sin_table + position * half, half * sizeof(float));
      slots[b] = s.block_tables[b * s.max_blocks + position / s.block_size] * s.block_size + position % s.block_size;
      queries[3 * b] = b;
      queries[3 * b + 1] = b;
      queries[3 * b + 2] = position + 1;
    }
    if (decoder_f32(d, &s) != 0) return static_cast<int>(pass);
    rms_norm_f32(out.data(), residual.data(), g->final_norm, B, H, g->final_norm_eps, normed.data(), threads);
    linear(*g->lm_head, normed.data(), B, logits.data(), threads);
    if (argmax_logsumexp_f32(logits.data(), B, V, g->tokens + pass * B, g->max_logits + pass * B,
                             g->log_normalizers + pass * B, threads) != 0)
      return static_cast<int>(pass);
  }
  return static_cast<int>(g->num_passes);
}

}  // extern "C"
