// gemm_amx.cpp's entry points (decoder.cpp calls them; native.py looks them up by name).
#pragma once

#include <stdint.h>

extern "C" {

// 1 if the bfloat16 tile products below are compiled in (the compiler targeted AMX-BF16) and the OS lets this
// process use the tiles (asked once, on the first call), else 0.
int gemm_bf16_amx_supported();

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENRIVER_GEMM_AMX 1
// y [M, N] = bf16(x) [M, K] @ bf16(dequantized weight) [N, K]ᵀ with float32 sums; arguments in the order of
// gemv.cpp's int4_linear_f32; K a multiple of 32. Only where gemm_bf16_amx_supported().
void int4_gemm_bf16_amx(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                        int64_t N, int64_t K,
                        int64_t group_size, const float* x, int64_t M, float* y, int num_threads);
void int8_gemm_bf16_amx(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                        const float* x, int64_t M, float* y, int num_threads);
// Per row of the y above, without writing y: argmax [M] (first of equal maxima), max [M] and log-sum-exp [M].
// Returns how many values of y were NaN or infinite; the outputs are meaningless then.
int64_t int4_argmax_bf16_amx(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, const uint32_t* qh,
                             int64_t N,
                             int64_t K, int64_t group_size, const float* x, int64_t M, int64_t* argmax, float* max,
                             float* lse, int num_threads);
int64_t int8_argmax_bf16_amx(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                             const float* x, int64_t M, int64_t* argmax, float* max, float* lse, int num_threads);
#endif

}  // extern "C"
