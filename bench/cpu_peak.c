/* This CPU's measured ceilings for bench/bench_cpu.py, on T threads (OpenMP):
 *   copy:    STREAM-like copy of a 512 MiB array, GB/s counting bytes read + written;
 *   fma:     independent 8-lane fused multiply-add chains (AVX2+FMA), GFLOP/s (2 per lane);
 *   muladd:  the same with a separate multiply and add, GFLOP/s (libminikv's CPU kernels
 *            fuse every product into its sum: the FMA figure is their ceiling).
 * Each is the best of 5 runs. Prints one JSON object. `cpu_peak 1 cpu` times with the
 * thread's CPU time instead of the wall clock (a machine shared with other jobs).
 *   cc -O2 -mavx2 -mfma -ffp-contract=off -fopenmp bench/cpu_peak.c -o cpu_peak && ./cpu_peak 2
 * (-ffp-contract=off: the compiler would otherwise fuse the multiply + add loop.) */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <time.h>

// Wall time, or with "cpu" as the second argument (one thread) the calling thread's CPU
// time, as bench_cpu.py --cpu-time measures the kernels.
static int use_cpu_time = 0;
static double now(void) {
  if (!use_cpu_time) return omp_get_wtime();
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

static double copy_gbps(int threads) {
  const size_t n = (size_t)512 << 20;
  char *a = malloc(n), *b = malloc(n);
  memset(a, 1, n);
  memset(b, 2, n);
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    const double t0 = now();
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      const size_t chunk = n / nt;
      memcpy(b + t * chunk, a + t * chunk, chunk);
    }
    const double gbps = 2.0 * n / (now() - t0) / 1e9;
    if (gbps > best) best = gbps;
  }
  free(a);
  free(b);
  return best;
}

// Twelve independent chains per thread (enough to cover the FMA latency and that of a
// multiply then an add), the loop body spelled out so that every accumulator stays in a
// register.
#define STEP(op) \
  a0 = op(a0); a1 = op(a1); a2 = op(a2); a3 = op(a3); a4 = op(a4); a5 = op(a5); \
  a6 = op(a6); a7 = op(a7); a8 = op(a8); a9 = op(a9); a10 = op(a10); a11 = op(a11);
#define FMA(a) _mm256_fmadd_ps(a, x, y)
#define MULADD(a) _mm256_add_ps(_mm256_mul_ps(a, x), y)
static double flops(int threads, int fused) {
  const long iters = 20000000;
  double best = 0;
  for (int rep = 0; rep < 5; ++rep) {
    float sink = 0;
    const double t0 = now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      // Distinct starting values: identical chains would be merged by the compiler.
      __m256 a0 = _mm256_set1_ps(0.10f), a1 = _mm256_set1_ps(0.11f), a2 = _mm256_set1_ps(0.12f),
             a3 = _mm256_set1_ps(0.13f), a4 = _mm256_set1_ps(0.14f), a5 = _mm256_set1_ps(0.15f),
             a6 = _mm256_set1_ps(0.16f), a7 = _mm256_set1_ps(0.17f), a8 = _mm256_set1_ps(0.18f),
             a9 = _mm256_set1_ps(0.19f), a10 = _mm256_set1_ps(0.20f), a11 = _mm256_set1_ps(0.21f);
      const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
      if (fused) {
        for (long i = 0; i < iters; ++i) { STEP(FMA) }
      } else {
        for (long i = 0; i < iters; ++i) { STEP(MULADD) }
      }
      a0 = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                         _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
      a0 = _mm256_add_ps(a0, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
      float out[8];
      _mm256_storeu_ps(out, a0);
      sink += out[0];
    }
    const double dt = now() - t0;
    const double gf = (double)threads * iters * 12 * 8 * 2 / dt / 1e9;
    if (gf > best) best = gf;
    if (sink == 12345.0f) printf(" ");
  }
  return best;
}

int main(int argc, char **argv) {
  const int threads = argc > 1 ? atoi(argv[1]) : 1;
  use_cpu_time = argc > 2 && strcmp(argv[2], "cpu") == 0 && threads == 1;
  const double copy = copy_gbps(threads), fma = flops(threads, 1), muladd = flops(threads, 0);
  printf("{\"threads\": %d, \"copy_GBps\": %.2f, \"fma_GFLOPs\": %.1f, \"muladd_GFLOPs\": %.1f}\n",
         threads, copy, fma, muladd);
  return 0;
}
