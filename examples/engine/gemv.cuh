/*
 * gemv.cuh — the decode step's matrix products for a few rows (batches of at most
 * GEMV_MAX_ROWS sequences), where a step is bound by reading every weight once: 16-bit
 * W [m, k] row-major (k contiguous) times NB activation rows, float32 accumulation.
 *
 * Why: with cuBLAS and separate RMSNorm/RoPE/SwiGLU kernels the dense part of a batch-1
 * step measured 1.5-1.7x its weight bytes / copy bandwidth on an H200 (bench/results,
 * 2026-12-01). Here each warp streams R = 4 weight rows with 16-byte loads that bypass L1,
 * U chunks of each in flight per lane before any is used (U = 4 for one or two activation
 * rows, 2 for more: registers), and the same activation chunk serves the R rows; one
 * butterfly reduction leaves every sum in every lane, and lane rr * NB + r writes output
 * (row rr, activation r). The grid holds as many CTAs as fit on the GPU at once and walks
 * the tasks (groups of R rows) with a grid stride: a CTA takes 8 / S tasks a round, each
 * by S of its warps that split the row's chunks (blocks of 32 U, interleaved) and add
 * their sums in shared memory in warp order. S (`split`, gemv_best_split) keeps every warp
 * busy when a product has fewer tasks than the GPU holds warps (the output and down
 * projections: m = 4096 is 1024 tasks for ~2,100 resident warps) or a last round would
 * be mostly empty (Q/K/V: 3,072 tasks). Launched behind another product (programmatic
 * dependent launch, model_cuda.cu), a CTA issues its first task's first loads before it
 * waits for the previous kernel's outputs: the weights are constant, only the activations
 * come from it.
 *
 * Input ("prologue"), fixed by the epilogue:
 *   norm    rows x_rows[r] (or r) of the float32 residual x [., k], RMS-normalized and
 *           scaled by norm_w, rounded to T into shared memory [NB, k] (the rounding the
 *           cuBLAS path applies to its normalized copy); no separate RMSNorm pass.
 *   plain   16-bit rows a [n, k] read straight from global memory (L1-cached: every warp
 *           of an SM reads the same rows).
 * Output ("epilogue"):
 *   GEMV_ROPE_SPLIT  W = [Wq; Wk; Wv] (norm input): rows of Q and K rotated by
 *                    positions[r] * inv_freq[pair] (interleaved pairs, as rope_split_kernel),
 *                    written to q [n, H D], k [n, Hkv D], v [n, Hkv D] in T;
 *   GEMV_SWIGLU      W = [Wgate; Wup] (norm input, m = 2 ff): a task is R/2 gate rows and
 *                    the matching up rows; hid [n, ff] = silu(gate) * up in T;
 *   GEMV_RESIDUAL    plain input; out_f32 [n, m] += W a (the residual stream);
 *   GEMV_LOGITS      norm input; out_f32 [n, m] = W a.
 * Requirements (gemv_shapes_supported): k a multiple of 8 (16-byte rows), m even.
 */
#ifndef ENGINE_GEMV_CUH
#define ENGINE_GEMV_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

enum { GEMV_ROPE_SPLIT, GEMV_SWIGLU, GEMV_RESIDUAL, GEMV_LOGITS, GEMV_EPILOGUES };
enum { GEMV_WARPS = 8, GEMV_THREADS = 32 * GEMV_WARPS, GEMV_ROWS_PER_WARP = 4, GEMV_MAX_ROWS = 8 };

/* U, the 16-byte chunks of each weight row a lane has in flight, for NB activation rows:
   R * U = 16 loads for one or two rows, 8 (and registers for the NB activation chunks)
   for more. */
__host__ __device__ constexpr int gemv_chunks_in_flight(int nb) { return nb <= 2 ? 4 : 2; }

struct gemv_params {
  const void *w; /* [m, k] */
  int m, k, n;   /* n <= NB activation rows */
  /* plain input */
  const void *a; /* [n, k] */
  /* norm input */
  const float *x;        /* [., k] */
  const int32_t *x_rows; /* [n] rows of x, or NULL for 0..n-1 */
  const float *norm_w;   /* [k] */
  float eps;
  /* outputs */
  float *out_f32;     /* RESIDUAL, LOGITS: [n, m] */
  void *q, *k_out, *v; /* ROPE_SPLIT */
  const int32_t *positions; /* ROPE_SPLIT: [n] */
  const double *inv_freq;   /* ROPE_SPLIT: [D / 2] */
  int H, Hkv, D;            /* ROPE_SPLIT */
  void *hid;                /* SWIGLU: [n, ff] */
  int ff;                   /* SWIGLU: m = 2 ff */
  int split;                /* S warps per task: 1, 2, 4 or 8 */
};

/* Tasks of a product: groups of R rows (SWIGLU: R / 2 gate rows and their up rows). The
   host sizes the grid and the split from it, the kernel walks it. */
__host__ __device__ inline int gemv_tasks(int epilogue, const gemv_params &p) {
  return epilogue == GEMV_SWIGLU ? p.ff / (GEMV_ROWS_PER_WARP / 2) : (p.m + GEMV_ROWS_PER_WARP - 1) / GEMV_ROWS_PER_WARP;
}

template <typename T> struct gemv_pair;
template <> struct gemv_pair<__half> {
  using type = __half2;
  static __device__ __forceinline__ float2 to_float2(uint32_t u) { return __half22float2(*reinterpret_cast<const __half2 *>(&u)); }
};
template <> struct gemv_pair<__nv_bfloat16> {
  using type = __nv_bfloat162;
  static __device__ __forceinline__ float2 to_float2(uint32_t u) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&u));
  }
};

/* Programmatic dependent launch (sm_90): the kernel after this one may start, and this one
   waits for the kernel before it to complete with its writes visible. */
__device__ __forceinline__ void gemv_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void gemv_wait_for_inputs() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

/* 16 bytes of weights, read once: not kept in L1 (the activations live there). */
__device__ __forceinline__ uint4 gemv_load_stream(const uint4 *p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ void gemv_unpack(const uint4 &u, float2 (&f)[4]) {
  f[0] = gemv_pair<T>::to_float2(u.x);
  f[1] = gemv_pair<T>::to_float2(u.y);
  f[2] = gemv_pair<T>::to_float2(u.z);
  f[3] = gemv_pair<T>::to_float2(u.w);
}

template <typename T>
__device__ __forceinline__ uint32_t gemv_pack(float a, float b) {
  typename gemv_pair<T>::type p;
  p.x = from_f32<T>(a);
  p.y = from_f32<T>(b);
  return *reinterpret_cast<const uint32_t *>(&p);
}

/* Rows x_rows[r] of x, RMS-normalized, times norm_w, in T into s [NB, k]. */
template <typename T, int NB>
__device__ __forceinline__ void gemv_norm_rows(const gemv_params &p, T *s) {
  __shared__ float partial[NB][GEMV_WARPS];
  const float *xr[NB];
  float ss[NB];
#pragma unroll
  for (int r = 0; r < NB; ++r) {
    xr[r] = p.x + (size_t)(r < p.n ? (p.x_rows ? p.x_rows[r] : r) : 0) * p.k;
    ss[r] = 0.0f;
  }
  for (int i = 4 * threadIdx.x; i < p.k; i += 4 * GEMV_THREADS)
#pragma unroll
    for (int r = 0; r < NB; ++r)
      if (r < p.n) {
        const float4 v = *reinterpret_cast<const float4 *>(xr[r] + i);
        ss[r] += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
      }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int r = 0; r < NB; ++r) {
    for (int o = 16; o > 0; o >>= 1) ss[r] += __shfl_xor_sync(0xffffffffu, ss[r], o);
    if (lane == 0) partial[r][warp] = ss[r];
  }
  __syncthreads();
  float inv[NB];
#pragma unroll
  for (int r = 0; r < NB; ++r) {
    float sum = 0.0f;
#pragma unroll
    for (int w = 0; w < GEMV_WARPS; ++w) sum += partial[r][w];
    inv[r] = rsqrtf(sum / (float)p.k + p.eps);
  }
  for (int i = 8 * threadIdx.x; i < p.k; i += 8 * GEMV_THREADS) {
    const float4 w0 = *reinterpret_cast<const float4 *>(p.norm_w + i);
    const float4 w1 = *reinterpret_cast<const float4 *>(p.norm_w + i + 4);
#pragma unroll
    for (int r = 0; r < NB; ++r)
      if (r < p.n) {
        const float4 a = *reinterpret_cast<const float4 *>(xr[r] + i);
        const float4 b = *reinterpret_cast<const float4 *>(xr[r] + i + 4);
        uint4 o; /* the expression of rms_norm_kernel: w * (x * inv) */
        o.x = gemv_pack<T>(w0.x * (a.x * inv[r]), w0.y * (a.y * inv[r]));
        o.y = gemv_pack<T>(w0.z * (a.z * inv[r]), w0.w * (a.w * inv[r]));
        o.z = gemv_pack<T>(w1.x * (b.x * inv[r]), w1.y * (b.y * inv[r]));
        o.w = gemv_pack<T>(w1.z * (b.z * inv[r]), w1.w * (b.w * inv[r]));
        *reinterpret_cast<uint4 *>(s + (size_t)r * p.k + i) = o;
      }
  }
  __syncthreads();
}

/* Output (row, activation r) = sum, written by one lane; `other` is the sum of the next
   row (the RoPE pair's second element, the up row of a SwiGLU gate row). */
template <typename T, int kEpi>
__device__ __forceinline__ void gemv_store(const gemv_params &p, int row, int r, float sum, float other) {
  if constexpr (kEpi == GEMV_RESIDUAL) {
    p.out_f32[(size_t)r * p.m + row] += sum;
  } else if constexpr (kEpi == GEMV_LOGITS) {
    p.out_f32[(size_t)r * p.m + row] = sum;
  } else if constexpr (kEpi == GEMV_SWIGLU) {
    static_cast<T *>(p.hid)[(size_t)r * p.ff + row] = from_f32<T>(sum / (1.0f + __expf(-sum)) * other);
  } else { /* GEMV_ROPE_SPLIT: row is even when it starts a Q/K pair */
    const int qd = p.H * p.D, kd = p.Hkv * p.D;
    if (row >= qd + kd) {
      static_cast<T *>(p.v)[(size_t)r * kd + (row - qd - kd)] = from_f32<T>(sum);
      return;
    }
    double sn, cs;
    sincos((double)p.positions[r] * p.inv_freq[(row % p.D) / 2], &sn, &cs);
    const float c = (float)cs, s = (float)sn;
    T *dst = row < qd ? static_cast<T *>(p.q) + (size_t)r * qd + row : static_cast<T *>(p.k_out) + (size_t)r * kd + (row - qd);
    *reinterpret_cast<uint32_t *>(dst) = gemv_pack<T>(sum * c - other * s, sum * s + other * c);
  }
}

template <typename T, int NB, int kEpi>
__global__ void __launch_bounds__(GEMV_THREADS) gemv_kernel(const __grid_constant__ gemv_params p) {
  constexpr int R = GEMV_ROWS_PER_WARP, U = gemv_chunks_in_flight(NB);
  constexpr bool kNorm = kEpi != GEMV_RESIDUAL;
  static_assert(R * NB <= 32, "one lane per output of a task");
  extern __shared__ __align__(16) unsigned char gemv_rows_smem[];
  /* each warp's R x NB sums, two rounds' worth so that one barrier a round suffices */
  __shared__ float partial_sums[2][GEMV_WARPS][R * NB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks = p.k / 8;
  const int S = p.split, per_cta = GEMV_WARPS / S, slice = warp % S;
  const int tasks = gemv_tasks(kEpi, p);
  /* The warp's task in the first round, and its first chunk of each task. */
  const int t_first = blockIdx.x * per_cta + warp / S, c_first = lane + 32 * U * slice;
  /* Rows of task t, and their weights (a clamped row past m: its sums are not written). */
  auto task_rows = [&](int t, int (&row)[R], const uint4 *(&wrow)[R]) {
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
      row[rr] = kEpi == GEMV_SWIGLU ? (rr < R / 2 ? t * (R / 2) + rr : p.ff + t * (R / 2) + rr - R / 2) : t * R + rr;
      wrow[rr] = static_cast<const uint4 *>(p.w) + (size_t)(row[rr] < p.m ? row[rr] : p.m - 1) * chunks;
    }
  };
  /* The U chunks of each of the R rows from chunk c0 on, one 16-byte load each. */
  uint4 wv[U][R];
  auto load_chunks = [&](const uint4 *const (&wrow)[R], int c0) {
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int rr = 0; rr < R; ++rr)
        wv[u][rr] = c0 + 32 * u < chunks ? gemv_load_stream(wrow[rr] + c0 + 32 * u) : make_uint4(0, 0, 0, 0);
  };
  /* Launched as a programmatic dependent of the kernel before it (gemv_launch_rows), the
     kernel after it may start as this one's CTAs leave; the weights are constant, so the
     first task's first chunks are in flight before the wait for that kernel's outputs (the
     activations): the two kernels' loads overlap instead of one draining before the next
     ramps up. Without the attribute both instructions do nothing. */
  gemv_launch_dependents();
  bool loaded = false;
  if (t_first < tasks && c_first < chunks) {
    int row[R];
    const uint4 *wrow[R];
    task_rows(t_first, row, wrow);
    load_chunks(wrow, c_first);
    loaded = true;
  }
  gemv_wait_for_inputs();
  const T *act;
  if constexpr (kNorm) {
    gemv_norm_rows<T, NB>(p, reinterpret_cast<T *>(gemv_rows_smem));
    act = reinterpret_cast<const T *>(gemv_rows_smem);
  } else {
    act = static_cast<const T *>(p.a);
  }
  /* The bound is the CTA's, not the warp's: with S > 1 every warp must reach each barrier. */
  for (int round = 0, base = blockIdx.x * per_cta; base < tasks; base += gridDim.x * per_cta, ++round) {
    const int t = base + warp / S;
    int row[R];
    const uint4 *wrow[R];
    task_rows(t, row, wrow);
    float acc[R][NB];
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
#pragma unroll
      for (int r = 0; r < NB; ++r) acc[rr][r] = 0.0f;
    for (int c0 = t < tasks ? c_first : chunks; c0 < chunks; c0 += 32 * U * S) {
      if (!loaded) load_chunks(wrow, c0);
      loaded = false;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int c = c0 + 32 * u;
        if (c >= chunks) break;
        float2 wf[R][4];
#pragma unroll
        for (int rr = 0; rr < R; ++rr) gemv_unpack<T>(wv[u][rr], wf[rr]);
#pragma unroll
        for (int r = 0; r < NB; ++r) {
          if (r >= p.n) break;
          const uint4 av = reinterpret_cast<const uint4 *>(act + (size_t)r * p.k)[c]; /* one 16-byte load */
          float2 af[4];
          gemv_unpack<T>(av, af);
#pragma unroll
          for (int rr = 0; rr < R; ++rr)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[rr][r] += wf[rr][e].x * af[e].x + wf[rr][e].y * af[e].y;
        }
      }
    }
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
#pragma unroll
      for (int r = 0; r < NB; ++r)
        for (int o = 16; o > 0; o >>= 1) acc[rr][r] += __shfl_xor_sync(0xffffffffu, acc[rr][r], o);
    if (S > 1) { /* the task's first warp adds the S slices' sums, in slice order */
      float(*mine)[R * NB] = partial_sums[round & 1];
      if (lane == 0)
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
#pragma unroll
          for (int r = 0; r < NB; ++r) mine[warp][rr * NB + r] = acc[rr][r];
      __syncthreads();
      if (slice != 0) continue;
#pragma unroll
      for (int rr = 0; rr < R; ++rr)
#pragma unroll
        for (int r = 0; r < NB; ++r) {
          float sum = mine[warp][rr * NB + r];
          for (int j = 1; j < S; ++j) sum += mine[warp + j][rr * NB + r];
          acc[rr][r] = sum;
        }
    }
    if (t >= tasks) continue;
    /* Lane rr * NB + r writes (row[rr], r). RoPE pairs and SwiGLU's gate/up rows are
       written by the lane of their first row, which holds the partner's sum too (as every
       lane does); V rows go with the same pairing. */
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
#pragma unroll
      for (int r = 0; r < NB; ++r) {
        constexpr bool kPairs = kEpi == GEMV_ROPE_SPLIT || kEpi == GEMV_SWIGLU;
        const bool writer = kEpi == GEMV_ROPE_SPLIT ? rr % 2 == 0 : kEpi == GEMV_SWIGLU ? rr < R / 2 : true;
        const int partner = kEpi == GEMV_SWIGLU ? (rr + R / 2) % R : rr ^ 1;
        if (!writer || lane != rr * NB + r || r >= p.n || row[rr] >= (kEpi == GEMV_SWIGLU ? p.ff : p.m)) continue;
        const float other = kPairs ? acc[partner][r] : 0.0f;
        gemv_store<T, kEpi>(p, row[rr], r, acc[rr][r], other);
        if (kEpi == GEMV_ROPE_SPLIT && row[rr] >= (p.H + p.Hkv) * p.D)
          gemv_store<T, kEpi>(p, row[rr] + 1, r, other, 0.0f);
      }
  }
}

/* S for a product of `tasks` tasks of rows `chunks` 16-byte chunks long, on `resident`
   CTAs: the share of warp-rounds that do work, tasks * S / (rounds * resident * 8), is
   largest (the smallest S of equal shares; compared as S / rounds, exactly), with every
   slice at least one block of 32 U chunks. */
static inline int gemv_best_split(int tasks, int chunks, int resident, int chunks_in_flight) {
  int best = 1, best_rounds = 1;
  for (int S = 1; S <= GEMV_WARPS; S *= 2) {
    if (S > 1 && chunks < S * 32 * chunks_in_flight) break;
    const int per_round = resident * (GEMV_WARPS / S);
    const int rounds = (tasks + per_round - 1) / per_round;
    if (S == 1 || (long long)S * best_rounds > (long long)best * rounds) {
      best = S;
      best_rounds = rounds;
    }
  }
  return best;
}

/* Whether the products of a model with these sizes can take this path. */
static inline bool gemv_shapes_supported(int d, int qd, int kvd, int ff, int head_dim, int vocab) {
  return d % 8 == 0 && qd % 8 == 0 && ff % 8 == 0 && kvd % 2 == 0 && head_dim % 2 == 0 && vocab % 2 == 0;
}

#endif /* ENGINE_GEMV_CUH */
