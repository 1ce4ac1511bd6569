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
void int4_gemm_bf16_amx(const uint8_t* qweight, const uint16_t* scales, const uint16_t* mins, int64_t N, int64_t K,
                        int64_t group_size, const float* x, int64_t M, float* y, int num_threads);
void int8_gemm_bf16_amx(const int8_t* qweight, const uint16_t* scales, int64_t N, int64_t K, int64_t group_size,
                        const float* x, int64_t M, float* y, int num_threads);
#endif

}  // extern "C"
