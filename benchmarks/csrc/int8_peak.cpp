// The machine's int8 multiply-add peak: independent chains of 512-bit dpbusd (64 multiply-adds each) per thread, no
// memory traffic. benchmarks/kquant_roofline.py builds and runs it; the products it is the ceiling of are
// models/cpu/csrc/kquant.cpp's and gemm.cpp's.
#include <immintrin.h>
#include <omp.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const long rounds = 20000000;  // of 12 instructions per thread
  double best = 0.0;
  for (int repeat = 0; repeat < 5; ++repeat) {
    const auto start = std::chrono::steady_clock::now();
    int checksum = 0;
#pragma omp parallel num_threads(threads) reduction(+ : checksum)
    {
      __m512i acc[12];
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_epi32(i);
      __m512i a = _mm512_set1_epi32(0x01010101);
      const __m512i b = _mm512_set1_epi32(0x02020202);
      for (long k = 0; k < rounds; ++k) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
        __asm__ volatile("" : "+v"(a));  // keeps the loop from being folded away
      }
      for (int i = 0; i < 12; ++i) checksum += _mm512_reduce_add_epi32(acc[i]);
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double rate = 64.0 * 12.0 * rounds * threads / seconds;
    if (rate > best) best = rate;
    if (checksum == 42) std::puts("");
  }
  std::printf("%.6e\n", best);
  return 0;
}
