/*
 * model_cuda.cu — the model on one NVIDIA GPU: weights and activations in f16 or bf16, a
 * float32 residual stream, attention through libminikv's CUDA backend. Matrix products of
 * prompts and of large decode batches go through cuBLAS (cublasGemmEx, 16-bit inputs,
 * float32 accumulation) with embedding/RMSNorm/RoPE/SwiGLU/argmax as the small kernels
 * below; decode batches of at most GEMV_MAX_ROWS sequences use gemv.cuh's bandwidth-bound
 * GEMVs instead, the small kernels fused into them (four launches per layer next to
 * libminikv's).
 *
 * The layer is the CPU backend's (model_cpu.c): Q, K and V come from one product with the
 * stacked [Wq; Wk; Wv] and are split (with RoPE) into the dense tensors libminikv reads;
 * gate and up come from one product with [Wgate; Wup]; the output and down projections
 * accumulate straight into the float32 residual (cuBLAS with a float32 C and beta = 1).
 *
 * A decode step — embedding, every layer (with minikv_append_decode), the final norm, the
 * logits and their argmax — runs as one CUDA graph. libminikv bakes the sizes of
 * each call (cache lengths, flush or not) into its kernels' parameters at the call, so a
 * graph recorded for one step is not valid for the next: each step is captured again, and
 * the captured graph updates an instantiated one of the same shape (cudaGraphExecUpdate:
 * parameters only, no new instantiation, as llama.cpp does). The shape changes from step
 * to step: libminikv launches a flush kernel in the steps where a layer's residual fills
 * (with budgets that differ by layer, in different steps for different layers) and a
 * split merge at some lengths. So the executable graphs are kept by shape (the batch and
 * how many nodes the capture holds after each layer's libminikv call), and a step whose
 * shape was seen before updates that graph; with a fixed set of sequences the shapes
 * repeat every flush_tokens steps. The host's capture
 * work is hidden by running one step ahead of the GPU on the greedy path: the next step's
 * token comes from the argmax kernel of the previous one, in device memory, and
 * positions advance on the device, so step t+1 is captured and queued while step t
 * runs. Two executable graphs alternate, so one is never updated while it may run.
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "util.h"

/* ---- failure handling --------------------------------------------------------------- */

#define CUDA_TRY(call)                                                                      \
  do {                                                                                      \
    const cudaError_t e_ = (call);                                                          \
    if (e_ != cudaSuccess) return fail("%s: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_TRY(call)                                                                    \
  do {                                                                                      \
    const cublasStatus_t s_ = (call);                                                       \
    if (s_ != CUBLAS_STATUS_SUCCESS) return fail("%s: %s", #call, cublasGetStatusString(s_)); \
  } while (0)

#define LAUNCH_TRY() CUDA_TRY(cudaGetLastError())

/* For chains of calls: true on success, else false with a message naming `what`. */
static bool cuda_ok(cudaError_t e, const char *what) {
  return e == cudaSuccess || fail("%s: %s", what, cudaGetErrorString(e));
}

/* ---- 16-bit element types ------------------------------------------------------------ */

template <typename T> __device__ __forceinline__ float to_f32(T x);
template <> __device__ __forceinline__ float to_f32<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

/* Runs the statements that follow dtype with T = its element type (f16 or bf16);
   variadic because kernel launches hold commas. */
#define DISPATCH_16BIT(dtype, ...)                                                          \
  do {                                                                                      \
    if ((dtype) == MINIKV_DTYPE_F16) {                                                      \
      using T = __half;                                                                     \
      __VA_ARGS__;                                                                          \
    } else {                                                                                \
      using T = __nv_bfloat16;                                                              \
      __VA_ARGS__;                                                                          \
    }                                                                                       \
  } while (0)

#include "gemv.cuh" /* uses to_f32 / from_f32 */

/* ---- kernels --------------------------------------------------------------------------- */

/* Random weights: uniform(-scale, scale) from a counter hash (splitmix64) of (seed, i), or
   `fill` for every element when scale == 0 (norm weights). */
template <typename T>
__global__ void init_weights_kernel(T *w, uint64_t n, uint64_t seed, float scale, float fill) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
    uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    const float u = (float)(z >> 40) * (1.0f / 16777216.0f); /* [0, 1) */
    w[i] = from_f32<T>(scale == 0.0f ? fill : (2.0f * u - 1.0f) * scale);
  }
}

__global__ void init_f32_kernel(float *w, uint64_t n, float value) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) w[i] = value;
}

template <typename T>
__global__ void convert_kernel(const float *src, T *dst, uint64_t n) {
  for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
    dst[i] = from_f32<T>(src[i]);
}

/* x[r] = embedding row tokens[r], as float32. One block per row. */
template <typename T>
__global__ void embed_kernel(const int32_t *tokens, const T *table, float *x, int d) {
  const T *row = table + (size_t)tokens[blockIdx.x] * d;
  float *out = x + (size_t)blockIdx.x * d;
  if (d % 8 == 0) { /* 16-byte loads: one or two per thread at common widths */
    for (int i = 8 * threadIdx.x; i < d; i += 8 * blockDim.x) {
      const uint4 u = *reinterpret_cast<const uint4 *>(row + i);
      const T *e = reinterpret_cast<const T *>(&u);
      *reinterpret_cast<float4 *>(out + i) = make_float4(to_f32(e[0]), to_f32(e[1]), to_f32(e[2]), to_f32(e[3]));
      *reinterpret_cast<float4 *>(out + i + 4) = make_float4(to_f32(e[4]), to_f32(e[5]), to_f32(e[6]), to_f32(e[7]));
    }
    return;
  }
  for (int i = threadIdx.x; i < d; i += blockDim.x) out[i] = to_f32(row[i]);
}

/* out[r] = x[rows ? rows[r] : r] / rms * w, in T. One block per output row; the sum of
   squares in float32 (what transformers computes in). */
template <typename T>
__global__ void rms_norm_kernel(const float *x, const int32_t *rows, const float *w, T *out, int d, float eps) {
  const float *in = x + (size_t)(rows ? rows[blockIdx.x] : blockIdx.x) * d;
  float ss = 0.0f;
  for (int i = threadIdx.x; i < d; i += blockDim.x) ss += in[i] * in[i];
  __shared__ float partial[32];
  for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  if (threadIdx.x < 32) {
    ss = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x == 0) partial[0] = ss;
  }
  __syncthreads();
  const float inv = rsqrtf(partial[0] / (float)d + eps);
  T *o_row = out + (size_t)blockIdx.x * d;
  for (int i = threadIdx.x; i < d; i += blockDim.x) o_row[i] = from_f32<T>(w[i] * (in[i] * inv));
}

/* Splits a chunk's qkv rows ([rows, (H + 2 Hkv) D]) into q, k, v rows row0.. of the
   whole-call tensors, rotating each interleaved pair (2i, 2i+1) of Q and K heads by
   positions[row0 + r] * inv_freq[i]. One block per row: the row's D/2 angles first (in
   double: long contexts need the angle's bits), then every (head, pair) of the row. */
template <typename T>
__global__ void rope_split_kernel(const T *qkv, T *q, T *k, T *v, const int32_t *positions,
                                  const double *inv_freq, int row0, int H, int Hkv, int D) {
  __shared__ float cos_sin[2][128]; /* D <= 256 */
  const int r = blockIdx.x, row = row0 + r, width = (H + 2 * Hkv) * D, pairs = D / 2;
  const T *src = qkv + (size_t)r * width;
  const double pos = (double)positions[row];
  for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
    double sn, cs;
    sincos(pos * inv_freq[i], &sn, &cs);
    cos_sin[0][i] = (float)cs;
    cos_sin[1][i] = (float)sn;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < (H + Hkv) * pairs; j += blockDim.x) {
    const int h = j / pairs, i = j % pairs;
    const float c = cos_sin[0][i], s = cos_sin[1][i];
    const float x0 = to_f32(src[h * D + 2 * i]), x1 = to_f32(src[h * D + 2 * i + 1]);
    T *dst = h < H ? q + ((size_t)row * H + h) * D : k + ((size_t)row * Hkv + (h - H)) * D;
    dst[2 * i] = from_f32<T>(x0 * c - x1 * s);
    dst[2 * i + 1] = from_f32<T>(x0 * s + x1 * c);
  }
  for (int j = threadIdx.x; j < Hkv * D; j += blockDim.x) v[(size_t)row * Hkv * D + j] = src[(H + Hkv) * D + j];
}

/* hid[r][i] = silu(gate) * up with gu rows [gate (ff) | up (ff)]. */
template <typename T>
__global__ void silu_mul_kernel(const T *gu, T *hid, int rows, int ff) {
  const size_t n = (size_t)rows * ff;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const size_t r = i / ff, c = i % ff;
    const float g = to_f32(gu[r * 2 * ff + c]), u = to_f32(gu[r * 2 * ff + ff + c]);
    hid[i] = from_f32<T>(g / (1.0f + __expf(-g)) * u);
  }
}

/* tokens[r] = first index of the largest logit of row r, also copied to history[r] when
   given; positions[r] advances by one (the next step's). One block of ARGMAX_THREADS per
   row, four loads in flight per thread (one at a time, a 32K vocabulary took 30 us). */
enum { ARGMAX_THREADS = 1024, ARGMAX_UNROLL = 4 };
__global__ void __launch_bounds__(ARGMAX_THREADS) argmax_kernel(const float *logits, int n_vocab, int32_t *tokens,
                                                                int32_t *history, int32_t *positions) {
  const float *row = logits + (size_t)blockIdx.x * n_vocab;
  float best = -INFINITY;
  int idx = n_vocab;
  for (int i0 = threadIdx.x; i0 < n_vocab; i0 += ARGMAX_UNROLL * ARGMAX_THREADS) {
    float v[ARGMAX_UNROLL];
#pragma unroll
    for (int j = 0; j < ARGMAX_UNROLL; ++j) {
      const int i = i0 + j * ARGMAX_THREADS;
      v[j] = i < n_vocab ? row[i] : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < ARGMAX_UNROLL; ++j) {
      const int i = i0 + j * ARGMAX_THREADS; /* ascending: ties keep the first */
      if (i < n_vocab && (v[j] > best || (v[j] == best && i < idx))) {
        best = v[j];
        idx = i;
      }
    }
  }
  __shared__ float sv[32];
  __shared__ int si[32];
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
    if (ov > best || (ov == best && oi < idx)) {
      best = ov;
      idx = oi;
    }
  }
  if ((threadIdx.x & 31) == 0) {
    sv[threadIdx.x >> 5] = best;
    si[threadIdx.x >> 5] = idx;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < (int)(blockDim.x >> 5); ++w)
      if (sv[w] > best || (sv[w] == best && si[w] < idx)) {
        best = sv[w];
        idx = si[w];
      }
    if (idx >= n_vocab) idx = 0; /* a row of NaN: any valid id */
    tokens[blockIdx.x] = idx;
    if (history) history[blockIdx.x] = idx;
    positions[blockIdx.x] += 1;
  }
}

static unsigned grid_for(uint64_t n, unsigned block) {
  const uint64_t g = (n + block - 1) / block;
  return (unsigned)(g < 65536 ? (g ? g : 1) : 65536);
}

/* ---- the backend --------------------------------------------------------------------- */

struct cuda_layer {
  float *attn_norm, *ffn_norm; /* float32 */
  void *wqkv;  /* [(H + 2 Hkv) D, d] */
  void *wo;    /* [d, H D] */
  void *wgu;   /* [2 ff, d] */
  void *wdown; /* [d, ff] */
};

/* An executable decode-step graph and the shape it was captured with: the batch and, after
   each layer's libminikv call, how many nodes the capture held. */
enum { STEP_GRAPHS_PER_SLOT = 48 };
struct step_graph {
  cudaGraphExec_t exec; /* NULL: a free entry */
  uint32_t n;
  uint32_t *nodes_after_layer; /* [n_layers] */
  uint64_t last_used;
};

struct cuda_backend {
  backend base;
  cudaStream_t stream;
  cublasHandle_t blas;
  void *blas_workspace;
  cudaDataType_t dt; /* CUDA_R_16F or CUDA_R_16BF */
  size_t esize;      /* 2 */
  cuda_layer *layers;
  void *embed, *output; /* [vocab, d]; output == embed when tied */
  float *out_norm;
  double *inv_freq;
  /* whole-call buffers: rows = max(max_prompt_tokens, max_batch) */
  float *x;
  void *q, *k, *v, *attn;
  int32_t *tokens, *positions;
  /* per chunk */
  void *xb, *qkv, *gu, *hid;
  /* logits rows */
  int32_t *last_rows; /* [max_batch] rows of x that get logits */
  void *last_xb;      /* [max_batch, d] */
  float *logits;      /* [max_batch, vocab] */
  int32_t *history;   /* [history_steps, max_batch] greedy tokens */
  uint32_t history_steps;
  /* decode graphs: those of slot s run only in slot s's launches */
  step_graph graphs[2][STEP_GRAPHS_PER_SLOT];
  uint32_t *graph_shapes;  /* [2][STEP_GRAPHS_PER_SLOT][n_layers]: their nodes_after_layer */
  uint32_t *shape_scratch; /* [n_layers]: the step being captured */
  uint64_t graph_clock;    /* step_graph.last_used */
  cudaEvent_t exec_done[2];
  bool exec_launched[2];
  bool dry_run; /* allocate_buffers only counts bytes */
  /* gemv.cuh: decode batches of at most gemv_max_rows (0: cuBLAS for all), CTAs per SM
     of each kernel (by epilogue and log2 of its row count), the GPU's SMs */
  uint32_t gemv_max_rows;
  int gemv_ctas_per_sm[GEMV_EPILOGUES][4];
  int sm_count;
  bool gemv_pdl; /* products launched behind products as programmatic dependents */
};

static cuda_backend *cb(backend *b) { return (cuda_backend *)b; }

static bool minikv_ok(backend *b, minikv_status s, const char *call, uint32_t layer) {
  b->status = s;
  if (s == MINIKV_OK) return true;
  return fail("%s (layer %u): %s: %s", call, layer, minikv_status_string(s), minikv_last_error_message());
}

/* out[rows, m] (+)= in[rows, k] · w[m, k]^T; in and w 16-bit, out 16-bit or float32.
   Row-major A·B^T is, for column-major cuBLAS, C^T = W^T(op T) · X^T. */
static bool gemm(cuda_backend *c, const void *w, const void *in, void *out, bool out_f32, int rows,
                 int m, int k, bool accumulate) {
  const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  CUBLAS_TRY(cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, m, rows, k, &alpha, w, c->dt, k, in, c->dt, k,
                          &beta, out, out_f32 ? CUDA_R_32F : c->dt, m, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
  return true;
}

static void *elem(void *base, size_t index, size_t esize) { return (char *)base + index * esize; }

/* ---- gemv.cuh's products for decode batches ---------------------------------------- */

static int log2_rows(int nb) { return nb == 1 ? 0 : nb == 2 ? 1 : nb == 4 ? 2 : 3; }

/* Shared memory of a kernel with NB activation rows: the normalized rows, for the
   epilogues that take the norm input. */
static size_t gemv_smem(int epilogue, int nb, int k) { return epilogue == GEMV_RESIDUAL ? 0 : (size_t)nb * k * 2; }

template <typename T, int NB, int kEpi>
static bool gemv_prepare_one(cuda_backend *c, int k, size_t smem_limit) {
  const size_t smem = gemv_smem(kEpi, NB, k);
  int *ctas = &c->gemv_ctas_per_sm[kEpi][log2_rows(NB)];
  *ctas = 0;
  if (smem > smem_limit) return true; /* too wide a model for NB rows: not used */
  CUDA_TRY(cudaFuncSetAttribute(gemv_kernel<T, NB, kEpi>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(ctas, gemv_kernel<T, NB, kEpi>, GEMV_THREADS, smem));
  return true;
}

template <typename T, int NB>
static bool gemv_prepare_rows(cuda_backend *c, int k, size_t smem_limit) {
  return gemv_prepare_one<T, NB, GEMV_ROPE_SPLIT>(c, k, smem_limit) && gemv_prepare_one<T, NB, GEMV_SWIGLU>(c, k, smem_limit) &&
         gemv_prepare_one<T, NB, GEMV_RESIDUAL>(c, k, smem_limit) && gemv_prepare_one<T, NB, GEMV_LOGITS>(c, k, smem_limit);
}

/* Sets gemv_max_rows: the largest NB (1, 2, 4, 8) whose kernels all fit an SM, or 0 when
   the model's sizes, or --no-gemv, rule the path out. Done before any capture
   (cudaFuncSetAttribute is not a stream operation). */
static bool gemv_prepare(cuda_backend *c, const cudaDeviceProp *prop) {
  const model_config *m = &c->base.model;
  c->gemv_max_rows = 0;
  c->sm_count = prop->multiProcessorCount;
  c->gemv_pdl = prop->major >= 9 && !c->base.opt.no_pdl; /* programmatic dependent launch: sm_90 */
  if (c->base.opt.no_gemv ||
      !gemv_shapes_supported((int)m->n_embd, (int)(m->n_heads * m->head_dim), (int)(m->n_kv_heads * m->head_dim),
                             (int)m->n_ff, (int)m->head_dim, (int)m->n_vocab))
    return true;
  const int k = (int)m->n_embd; /* the norm input's width: every such product reads x */
  const size_t limit = prop->sharedMemPerBlockOptin > 1024 ? prop->sharedMemPerBlockOptin - 1024 : 0; /* static part */
  DISPATCH_16BIT(c->base.opt.dtype, {
    if (!gemv_prepare_rows<T, 1>(c, k, limit) || !gemv_prepare_rows<T, 2>(c, k, limit) ||
        !gemv_prepare_rows<T, 4>(c, k, limit) || !gemv_prepare_rows<T, 8>(c, k, limit))
      return false;
  });
  for (int nb = 1, i = 0; nb <= GEMV_MAX_ROWS; nb *= 2, ++i) {
    bool all = true;
    for (int e = 0; e < GEMV_EPILOGUES; ++e) all = all && c->gemv_ctas_per_sm[e][i] > 0;
    if (!all) break;
    c->gemv_max_rows = (uint32_t)nb;
  }
  return true;
}

template <typename T, int NB, int kEpi>
static bool gemv_launch_rows(cuda_backend *c, const gemv_params &p, bool programmatic) {
  const int tasks = gemv_tasks(kEpi, p);
  const int resident = c->sm_count * c->gemv_ctas_per_sm[kEpi][log2_rows(NB)];
  gemv_params q = p;
  q.split = gemv_best_split(tasks, p.k / 8, resident, gemv_chunks_in_flight(NB));
  const int per_cta = GEMV_WARPS / q.split, wanted = (tasks + per_cta - 1) / per_cta;
  /* With `programmatic`, a programmatic dependent of the kernel before it on the stream
     (gemv_kernel's prologue); a CUDA graph captures the edge. */
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(wanted < resident ? wanted : resident);
  config.blockDim = dim3(GEMV_THREADS);
  config.dynamicSmemBytes = gemv_smem(kEpi, NB, p.k);
  config.stream = c->stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = programmatic ? 1 : 0;
  CUDA_TRY(cudaLaunchKernelEx(&config, gemv_kernel<T, NB, kEpi>, q));
  return true;
}

/* One product of p.n <= gemv_max_rows rows, with the kernel of the next power of two;
   `behind_gemv`: the kernel before it on the stream is another product's (or the
   embedding's), so it may start as that one's CTAs leave (unless --no-pdl). */
template <int kEpi>
static bool gemv_launch(cuda_backend *c, const gemv_params &p, bool behind_gemv) {
  const bool programmatic = behind_gemv && c->gemv_pdl;
  DISPATCH_16BIT(c->base.opt.dtype, {
    if (p.n <= 1) return gemv_launch_rows<T, 1, kEpi>(c, p, programmatic);
    if (p.n <= 2) return gemv_launch_rows<T, 2, kEpi>(c, p, programmatic);
    if (p.n <= 4) return gemv_launch_rows<T, 4, kEpi>(c, p, programmatic);
    return gemv_launch_rows<T, 8, kEpi>(c, p, programmatic);
  });
  return false; /* not reached */
}

/* The weight [m][k] and the n rows every GEMV launch names; the rest zero. */
static gemv_params gemv_base(const void *w, int m, int k, int n) {
  gemv_params p;
  memset(&p, 0, sizeof p);
  p.w = w;
  p.m = m;
  p.k = k;
  p.n = n;
  return p;
}

static gemv_params gemv_norm_input(const void *w, int m, int k, int n, const float *x, const int32_t *x_rows,
                                   const float *norm_w, float eps) {
  gemv_params p = gemv_base(w, m, k, n);
  p.x = x;
  p.x_rows = x_rows;
  p.norm_w = norm_w;
  p.eps = eps;
  return p;
}

/* x += a W^T (fp32 residual stream) for n rows of a [n][k] 16-bit input. */
static gemv_params gemv_residual(const void *w, int m, int k, int n, const void *a, float *x) {
  gemv_params p = gemv_base(w, m, k, n);
  p.a = a;
  p.out_f32 = x;
  return p;
}

/* A decode step's layer for n <= gemv_max_rows rows, before and after attention: q, k, v
   from x; then x += attn Wo^T and the MLP block. */
static bool gemv_attention_inputs(cuda_backend *c, const cuda_layer *L, int n) {
  const model_config *m = &c->base.model;
  const int d = (int)m->n_embd, H = (int)m->n_heads, Hkv = (int)m->n_kv_heads, D = (int)m->head_dim;
  gemv_params p = gemv_norm_input(L->wqkv, (H + 2 * Hkv) * D, d, n, c->x, NULL, L->attn_norm, m->rms_eps);
  p.q = c->q;
  p.k_out = c->k;
  p.v = c->v;
  p.positions = c->positions;
  p.inv_freq = c->inv_freq;
  p.H = H;
  p.Hkv = Hkv;
  p.D = D;
  return gemv_launch<GEMV_ROPE_SPLIT>(c, p, true);
}

static bool gemv_attention_output_and_mlp(cuda_backend *c, const cuda_layer *L, int n) {
  const model_config *m = &c->base.model;
  const int d = (int)m->n_embd, hd = (int)(m->n_heads * m->head_dim), ff = (int)m->n_ff;
  /* Behind libminikv's decode: started early, its CTAs take the SMs of the attention's tail
     (two batch-1 cells 5-8% slower: bench/results/2026-12-07_nvidia-h100_session47-calls.txt,
     call E). */
  if (!gemv_launch<GEMV_RESIDUAL>(c, gemv_residual(L->wo, d, hd, n, c->attn, c->x), false)) return false;
  gemv_params p = gemv_norm_input(L->wgu, 2 * ff, d, n, c->x, NULL, L->ffn_norm, m->rms_eps);
  p.hid = c->hid;
  p.ff = ff;
  if (!gemv_launch<GEMV_SWIGLU>(c, p, true)) return false;
  return gemv_launch<GEMV_RESIDUAL>(c, gemv_residual(L->wdown, d, ff, n, c->hid, c->x), true);
}

/* Rows [row0, row0 + rows) of x -> q, k, v (whole-call rows). */
static bool attention_inputs(cuda_backend *c, const cuda_layer *L, int row0, int rows) {
  const model_config *m = &c->base.model;
  const int d = (int)m->n_embd, H = (int)m->n_heads, Hkv = (int)m->n_kv_heads, D = (int)m->head_dim;
  DISPATCH_16BIT(c->base.opt.dtype, {
    rms_norm_kernel<T><<<rows, 256, 0, c->stream>>>(c->x + (size_t)row0 * d, NULL, L->attn_norm, (T *)c->xb, d, m->rms_eps);
  });
  LAUNCH_TRY();
  if (!gemm(c, L->wqkv, c->xb, c->qkv, false, rows, (H + 2 * Hkv) * D, d, false)) return false;
  DISPATCH_16BIT(c->base.opt.dtype, {
    rope_split_kernel<T><<<rows, 256, 0, c->stream>>>((const T *)c->qkv, (T *)c->q, (T *)c->k, (T *)c->v,
                                                      c->positions, c->inv_freq, row0, H, Hkv, D);
  });
  LAUNCH_TRY();
  return true;
}

/* Rows [row0, row0 + rows): x += attn · Wo^T, then the MLP block. */
static bool attention_output_and_mlp(cuda_backend *c, const cuda_layer *L, int row0, int rows) {
  const model_config *m = &c->base.model;
  const int d = (int)m->n_embd, hd = (int)(m->n_heads * m->head_dim), ff = (int)m->n_ff;
  float *x = c->x + (size_t)row0 * d;
  if (!gemm(c, L->wo, elem(c->attn, (size_t)row0 * hd, c->esize), x, true, rows, d, hd, true)) return false;
  DISPATCH_16BIT(c->base.opt.dtype, {
    rms_norm_kernel<T><<<rows, 256, 0, c->stream>>>(x, NULL, L->ffn_norm, (T *)c->xb, d, m->rms_eps);
  });
  LAUNCH_TRY();
  if (!gemm(c, L->wgu, c->xb, c->gu, false, rows, 2 * ff, d, false)) return false;
  DISPATCH_16BIT(c->base.opt.dtype, {
    silu_mul_kernel<T><<<grid_for((uint64_t)rows * ff, 256), 256, 0, c->stream>>>((const T *)c->gu, (T *)c->hid, rows, ff);
  });
  LAUNCH_TRY();
  return gemm(c, L->wdown, c->hid, x, true, rows, d, ff, true);
}

/* Final norm of rows rows[0, n) of x (device; NULL = rows 0..n-1), their logits into
   c->logits. */
static bool logits_of(cuda_backend *c, const int32_t *rows, int n) {
  const model_config *m = &c->base.model;
  if ((uint32_t)n <= c->gemv_max_rows) {
    gemv_params p = gemv_norm_input(c->output, (int)m->n_vocab, (int)m->n_embd, n, c->x, rows, c->out_norm, m->rms_eps);
    p.out_f32 = c->logits;
    return gemv_launch<GEMV_LOGITS>(c, p, true);
  }
  DISPATCH_16BIT(c->base.opt.dtype, {
    rms_norm_kernel<T><<<n, 256, 0, c->stream>>>(c->x, rows, c->out_norm, (T *)c->last_xb, (int)m->n_embd, m->rms_eps);
  });
  LAUNCH_TRY();
  return gemm(c, c->output, c->last_xb, c->logits, true, n, (int)m->n_vocab, (int)m->n_embd, false);
}

static bool tokens_valid(const backend *b, const int32_t *tokens, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || (uint32_t)tokens[i] >= b->model.n_vocab)
      return fail("token id %d at row %zu is outside the vocabulary (%u)", tokens[i], i, b->model.n_vocab);
  return true;
}

static bool cuda_prefill(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *cu_seqlens,
                         const int32_t *tokens, float *logits) {
  cuda_backend *c = cb(b);
  const size_t total = (size_t)cu_seqlens[n_seqs];
  const int chunk = (int)b->opt.chunk_tokens, d = (int)b->model.n_embd;
  if (n_seqs == 0 || n_seqs > b->opt.max_batch || total == 0 || total > b->opt.max_prompt_tokens)
    return fail("prefill of %u prompts, %zu tokens: at most %u prompts and %u tokens per call", n_seqs, total,
                b->opt.max_batch, b->opt.max_prompt_tokens);
  if (!tokens_valid(b, tokens, total)) return false;
  int32_t *pos = (int32_t *)alloc_zeroed(total, sizeof *pos, "prefill positions");
  int32_t *last = (int32_t *)alloc_zeroed(n_seqs, sizeof *last, "prefill rows");
  bool ok = pos && last;
  for (uint32_t s = 0; ok && s < n_seqs; ++s) {
    for (int32_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) pos[t] = t - cu_seqlens[s];
    last[s] = cu_seqlens[s + 1] - 1;
  }
  /* Copies from pageable memory, finished before the buffers are freed below. */
  ok = ok && cuda_ok(cudaMemcpyAsync(c->tokens, tokens, total * sizeof *tokens, cudaMemcpyHostToDevice, c->stream), "prefill tokens") &&
       cuda_ok(cudaMemcpyAsync(c->positions, pos, total * sizeof *pos, cudaMemcpyHostToDevice, c->stream), "prefill positions") &&
       cuda_ok(cudaMemcpyAsync(c->last_rows, last, n_seqs * sizeof *last, cudaMemcpyHostToDevice, c->stream), "prefill rows") &&
       cuda_ok(cudaStreamSynchronize(c->stream), "prefill upload");
  free(pos);
  free(last);
  if (!ok) return false;
  DISPATCH_16BIT(b->opt.dtype, { embed_kernel<T><<<(unsigned)total, 256, 0, c->stream>>>(c->tokens, (const T *)c->embed, c->x, d); });
  LAUNCH_TRY();
  for (uint32_t l = 0; l < b->model.n_layers; ++l) {
    const cuda_layer *L = &c->layers[l];
    for (size_t r = 0; r < total; r += chunk)
      if (!attention_inputs(c, L, (int)r, (int)(total - r < (size_t)chunk ? total - r : chunk))) return false;
    if (!minikv_ok(b, minikv_prefill(b->cache, l, n_seqs, seq_ids, cu_seqlens, c->q, c->k, c->v, c->attn, c->stream),
                   "minikv_prefill", l))
      return false;
    for (size_t r = 0; r < total; r += chunk)
      if (!attention_output_and_mlp(c, L, (int)r, (int)(total - r < (size_t)chunk ? total - r : chunk))) return false;
    if (b->progress) {
      CUDA_TRY(cudaStreamSynchronize(c->stream)); /* so that the line tells the truth */
      b->progress(b->progress_ctx, l + 1, b->model.n_layers);
    }
  }
  if (!logits_of(c, c->last_rows, (int)n_seqs)) return false;
  CUDA_TRY(cudaMemcpyAsync(logits, c->logits, (size_t)n_seqs * b->model.n_vocab * sizeof(float),
                           cudaMemcpyDeviceToHost, c->stream));
  CUDA_TRY(cudaStreamSynchronize(c->stream));
  return true;
}

/* Nodes the stream's capture holds so far. */
static size_t captured_nodes(cudaStream_t s) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  cudaGraph_t graph = NULL;
  size_t n = 0;
  if (cudaStreamGetCaptureInfo(s, &status, NULL, &graph) == cudaSuccess && status == cudaStreamCaptureStatusActive && graph)
    cudaGraphGetNodes(graph, NULL, &n);
  return n;
}

/* Queues one decode step of n sequences on the stream (being captured): tokens and
   positions are read from c->tokens / c->positions; the argmax of the logits goes back to
   c->tokens (and to `history` when given) and positions advance by one. Without seq_ids
   the libminikv calls are left out (the dense part alone, for timing). `shape`, when
   given, gets the captured node count after each layer's libminikv call. */
static bool record_step(cuda_backend *c, uint32_t n, const uint32_t *seq_ids, int32_t *history, uint32_t *shape) {
  backend *b = &c->base;
  const model_config *m = &b->model;
  const int chunk = (int)b->opt.chunk_tokens;
  const bool gemv = n <= c->gemv_max_rows;
  DISPATCH_16BIT(b->opt.dtype, { embed_kernel<T><<<n, 256, 0, c->stream>>>(c->tokens, (const T *)c->embed, c->x, (int)m->n_embd); });
  LAUNCH_TRY();
  for (uint32_t l = 0; l < m->n_layers; ++l) {
    const cuda_layer *L = &c->layers[l];
    if (gemv && !gemv_attention_inputs(c, L, (int)n)) return false;
    for (uint32_t r = 0; !gemv && r < n; r += chunk)
      if (!attention_inputs(c, L, (int)r, (int)(n - r < (uint32_t)chunk ? n - r : chunk))) return false;
    if (seq_ids && !minikv_ok(b, minikv_append_decode(b->cache, l, n, seq_ids, c->q, c->k, c->v, c->attn, c->stream),
                              "minikv_append_decode", l))
      return false;
    if (shape) shape[l] = (uint32_t)captured_nodes(c->stream);
    if (gemv && !gemv_attention_output_and_mlp(c, L, (int)n)) return false;
    for (uint32_t r = 0; !gemv && r < n; r += chunk)
      if (!attention_output_and_mlp(c, L, (int)r, (int)(n - r < (uint32_t)chunk ? n - r : chunk))) return false;
  }
  if (!logits_of(c, NULL, (int)n)) return false;
  argmax_kernel<<<n, ARGMAX_THREADS, 0, c->stream>>>(c->logits, (int)m->n_vocab, c->tokens, history, c->positions);
  LAUNCH_TRY();
  return true;
}

/* Slot `slot`'s graph of this shape (c->shape_scratch, n), or NULL. */
static step_graph *find_step_graph(cuda_backend *c, int slot, uint32_t n) {
  const size_t bytes = c->base.model.n_layers * sizeof *c->shape_scratch;
  for (int i = 0; i < STEP_GRAPHS_PER_SLOT; ++i) {
    step_graph *g = &c->graphs[slot][i];
    if (g->exec && g->n == n && memcmp(g->nodes_after_layer, c->shape_scratch, bytes) == 0) return g;
  }
  return NULL;
}

/* A free entry of slot `slot` (the least recently used one, emptied, when none is free),
   given this shape. */
static step_graph *new_step_graph(cuda_backend *c, int slot, uint32_t n) {
  step_graph *g = &c->graphs[slot][0];
  for (int i = 0; i < STEP_GRAPHS_PER_SLOT && g->exec; ++i) {
    step_graph *h = &c->graphs[slot][i];
    if (!h->exec || h->last_used < g->last_used) g = h;
  }
  if (g->exec) cudaGraphExecDestroy(g->exec);
  g->exec = NULL;
  g->n = n;
  memcpy(g->nodes_after_layer, c->shape_scratch, c->base.model.n_layers * sizeof *c->shape_scratch);
  return g;
}

/* Captures one step into a graph, makes an executable graph of slot `slot` run it (the
   slot's graph of the same shape, updated in place, else a new instantiation), and
   launches it. The caller made sure the previous launch of that slot has finished. */
static bool capture_and_launch_step(cuda_backend *c, int slot, uint32_t n, const uint32_t *seq_ids, int32_t *history) {
  if (c->base.opt.no_graphs) { /* the same kernels, launched one by one */
    if (!record_step(c, n, seq_ids, history, NULL)) return false;
    CUDA_TRY(cudaEventRecord(c->exec_done[slot], c->stream));
    c->exec_launched[slot] = true;
    return true;
  }
  cudaGraph_t graph = NULL;
  CUDA_TRY(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
  const bool recorded = record_step(c, n, seq_ids, history, c->shape_scratch);
  const cudaError_t ended = cudaStreamEndCapture(c->stream, &graph);
  if (!recorded) {
    if (graph) cudaGraphDestroy(graph);
    return false; /* record_step's message */
  }
  if (ended != cudaSuccess)
    return fail("capturing the decode step: %s (--no-graphs launches the kernels directly)", cudaGetErrorString(ended));
  step_graph *g = find_step_graph(c, slot, n);
  bool updated = false;
  if (g) {
    cudaGraphExecUpdateResultInfo info;
    updated = cudaGraphExecUpdate(g->exec, graph, &info) == cudaSuccess;
    if (!updated) {
      cudaGetLastError(); /* clear the update's error: a new instantiation follows */
      cudaGraphExecDestroy(g->exec);
      g->exec = NULL;
    }
  } else {
    g = new_step_graph(c, slot, n);
  }
  cudaError_t e = cudaSuccess;
  if (!updated) e = cudaGraphInstantiate(&g->exec, graph, 0);
  cudaGraphDestroy(graph);
  if (e != cudaSuccess) {
    g->exec = NULL;
    return fail("instantiating the decode graph: %s", cudaGetErrorString(e));
  }
  g->last_used = ++c->graph_clock;
  if (updated) ++c->base.graph_updates;
  else ++c->base.graph_instantiations;
  CUDA_TRY(cudaGraphLaunch(g->exec, c->stream));
  CUDA_TRY(cudaEventRecord(c->exec_done[slot], c->stream));
  c->exec_launched[slot] = true;
  return true;
}

/* capture_and_launch_step, its host time added to step_host_seconds. */
static bool launch_step(cuda_backend *c, int slot, uint32_t n, const uint32_t *seq_ids, int32_t *history) {
  const double t0 = now_seconds();
  const bool ok = capture_and_launch_step(c, slot, n, seq_ids, history);
  const double dt = now_seconds() - t0;
  c->base.step_host_seconds += dt;
  if (dt > c->base.step_host_max_seconds) c->base.step_host_max_seconds = dt;
  return ok;
}

static bool wait_slot(cuda_backend *c, int slot) {
  if (c->exec_launched[slot]) CUDA_TRY(cudaEventSynchronize(c->exec_done[slot]));
  return true;
}

static bool upload_step_inputs(cuda_backend *c, uint32_t n, const int32_t *tokens, const int32_t *positions) {
  CUDA_TRY(cudaMemcpyAsync(c->tokens, tokens, n * sizeof *tokens, cudaMemcpyHostToDevice, c->stream));
  CUDA_TRY(cudaMemcpyAsync(c->positions, positions, n * sizeof *positions, cudaMemcpyHostToDevice, c->stream));
  return true;
}

static bool check_batch(const backend *b, uint32_t n, const int32_t *tokens) {
  if (n == 0 || n > b->opt.max_batch) return fail("decode of %u sequences: 1 to %u per step", n, b->opt.max_batch);
  return tokens_valid(b, tokens, n);
}

static bool cuda_decode(backend *b, uint32_t n, const uint32_t *seq_ids, const int32_t *tokens,
                        const int32_t *positions, float *logits) {
  cuda_backend *c = cb(b);
  if (!check_batch(b, n, tokens) || !wait_slot(c, 0) || !wait_slot(c, 1)) return false;
  if (!upload_step_inputs(c, n, tokens, positions) || !launch_step(c, 0, n, seq_ids, NULL)) return false;
  CUDA_TRY(cudaMemcpyAsync(logits, c->logits, (size_t)n * b->model.n_vocab * sizeof(float), cudaMemcpyDeviceToHost, c->stream));
  CUDA_TRY(cudaStreamSynchronize(c->stream));
  return true;
}

static bool cuda_greedy(backend *b, uint32_t n, const uint32_t *seq_ids, const int32_t *tokens,
                        const int32_t *positions, uint32_t n_steps, int32_t *out, double *step_seconds) {
  cuda_backend *c = cb(b);
  if (!check_batch(b, n, tokens) || !wait_slot(c, 0) || !wait_slot(c, 1)) return false;
  if (n_steps == 0) return true;
  if (c->history_steps < n_steps) {
    if (c->history) cudaFree(c->history);
    c->history = NULL;
    c->history_steps = 0;
    CUDA_TRY(cudaMalloc(&c->history, (size_t)n_steps * b->opt.max_batch * sizeof(int32_t)));
    c->history_steps = n_steps;
  }
  cudaEvent_t *ev = (cudaEvent_t *)alloc_zeroed(n_steps + 1, sizeof *ev, "step events");
  if (!ev) return false;
  bool ok = true;
  uint32_t created = 0;
  for (; ok && created <= n_steps; ++created) ok = cuda_ok(cudaEventCreate(&ev[created]), "cudaEventCreate");
  ok = ok && upload_step_inputs(c, n, tokens, positions) && cuda_ok(cudaEventRecord(ev[0], c->stream), "cudaEventRecord");
  for (uint32_t s = 0; ok && s < n_steps; ++s) {
    const int slot = (int)(s & 1);
    /* The host runs at most one step ahead: before reusing a slot, its previous launch
       (two steps back) must be done. */
    ok = wait_slot(c, slot) && launch_step(c, slot, n, seq_ids, c->history + (size_t)s * n) &&
         cuda_ok(cudaEventRecord(ev[s + 1], c->stream), "cudaEventRecord");
  }
  ok = ok && cuda_ok(cudaStreamSynchronize(c->stream), "greedy decoding") &&
       cuda_ok(cudaMemcpy(out, c->history, (size_t)n_steps * n * sizeof *out, cudaMemcpyDeviceToHost), "greedy tokens");
  for (uint32_t s = 0; ok && step_seconds && s < n_steps; ++s) {
    float ms = 0;
    ok = cuda_ok(cudaEventElapsedTime(&ms, ev[s], ev[s + 1]), "step timing");
    step_seconds[s] = 1e-3 * ms;
  }
  for (uint32_t i = 0; i < created; ++i) cudaEventDestroy(ev[i]);
  free(ev);
  return ok;
}

static double cuda_dense_step_seconds(backend *b, uint32_t n, uint32_t repeats) {
  cuda_backend *c = cb(b);
  if (n == 0 || n > b->opt.max_batch || repeats == 0) {
    fail("dense step timing of %u rows x %u repeats: 1 to %u rows", n, repeats, b->opt.max_batch);
    return 0;
  }
  const size_t hd = (size_t)b->model.n_heads * b->model.head_dim;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t exec = NULL;
  cudaEvent_t t0 = NULL, t1 = NULL;
  /* valid token ids and a finite attention output for the meaningless run */
  bool ok = wait_slot(c, 0) && wait_slot(c, 1) &&
            cuda_ok(cudaMemsetAsync(c->tokens, 0, n * sizeof(int32_t), c->stream), "memset") &&
            cuda_ok(cudaMemsetAsync(c->positions, 0, n * sizeof(int32_t), c->stream), "memset") &&
            cuda_ok(cudaMemsetAsync(c->attn, 0, n * hd * c->esize, c->stream), "memset") &&
            cuda_ok(cudaEventCreate(&t0), "cudaEventCreate") && cuda_ok(cudaEventCreate(&t1), "cudaEventCreate");
  if (ok && !b->opt.no_graphs) {
    ok = cuda_ok(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal), "capture");
    const bool recorded = ok && record_step(c, n, NULL, NULL, NULL);
    if (ok) ok = cuda_ok(cudaStreamEndCapture(c->stream, &graph), "capturing the dense step") && recorded;
    ok = ok && cuda_ok(cudaGraphInstantiate(&exec, graph, 0), "instantiating the dense step");
  }
  /* one untimed step, then `repeats` timed ones back to back */
  for (uint32_t i = 0; ok && i <= repeats; ++i) {
    if (i == 1) ok = cuda_ok(cudaEventRecord(t0, c->stream), "cudaEventRecord");
    ok = ok && (exec ? cuda_ok(cudaGraphLaunch(exec, c->stream), "cudaGraphLaunch") : record_step(c, n, NULL, NULL, NULL));
  }
  float ms = 0;
  ok = ok && cuda_ok(cudaEventRecord(t1, c->stream), "cudaEventRecord") &&
       cuda_ok(cudaEventSynchronize(t1), "dense step") && cuda_ok(cudaEventElapsedTime(&ms, t0, t1), "timing");
  if (exec) cudaGraphExecDestroy(exec);
  if (graph) cudaGraphDestroy(graph);
  if (t0) cudaEventDestroy(t0);
  if (t1) cudaEventDestroy(t1);
  return ok ? 1e-3 * ms / repeats : 0.0;
}

static bool cuda_release(backend *b, uint32_t seq_id) {
  cuda_backend *c = cb(b);
  /* Work queued for this slot must not meet a new prompt's blocks: wait for the stream. */
  CUDA_TRY(cudaStreamSynchronize(c->stream));
  return minikv_ok(b, minikv_sequence_release(b->cache, seq_id), "minikv_sequence_release", 0);
}

static uint64_t cuda_device_used(backend *b) {
  (void)b;
  size_t free_b = 0, total = 0;
  if (cudaMemGetInfo(&free_b, &total) != cudaSuccess) return 0;
  return (uint64_t)(total - free_b);
}

static void cuda_destroy(backend *b) {
  if (!b) return;
  cuda_backend *c = cb(b);
  if (c->stream) cudaStreamSynchronize(c->stream);
  minikv_cache_destroy(b->cache);
  for (int s = 0; s < 2; ++s) {
    for (int i = 0; i < STEP_GRAPHS_PER_SLOT; ++i)
      if (c->graphs[s][i].exec) cudaGraphExecDestroy(c->graphs[s][i].exec);
    if (c->exec_done[s]) cudaEventDestroy(c->exec_done[s]);
  }
  free(c->graph_shapes);
  free(c->shape_scratch);
  if (c->layers)
    for (uint32_t l = 0; l < b->model.n_layers; ++l) {
      cuda_layer *L = &c->layers[l];
      void *p[] = {L->attn_norm, L->ffn_norm, L->wqkv, L->wo, L->wgu, L->wdown};
      for (size_t i = 0; i < sizeof p / sizeof p[0]; ++i) cudaFree(p[i]);
    }
  free(c->layers);
  if (c->output != c->embed) cudaFree(c->output);
  void *p[] = {c->embed, c->out_norm, c->inv_freq, c->x, c->q, c->k, c->v, c->attn, c->tokens, c->positions,
               c->xb, c->qkv, c->gu, c->hid, c->last_rows, c->last_xb, c->logits, c->history, c->blas_workspace};
  for (size_t i = 0; i < sizeof p / sizeof p[0]; ++i) cudaFree(p[i]);
  if (c->blas) cublasDestroy(c->blas);
  if (c->stream) cudaStreamDestroy(c->stream);
  free(c);
}

/* ---- creation ------------------------------------------------------------------------- */

static bool device_alloc(cuda_backend *c, void **p, size_t bytes, uint64_t *account, const char *what) {
  if (c->dry_run) {
    *account += bytes;
    return true;
  }
  const cudaError_t e = cudaMalloc(p, bytes ? bytes : 1);
  if (e != cudaSuccess) {
    *p = NULL;
    char a[32];
    return fail("cudaMalloc of %s for %s: %s", format_bytes((double)bytes, a, sizeof a), what, cudaGetErrorString(e));
  }
  *account += bytes;
  return true;
}

/* One weight tensor (name) of [rows, cols] into dst (16-bit, device): random values
   generated on the device, or the file's values dequantized on the host, converted on
   the device. `staging` is a device float buffer of at least rows*cols elements. */
static bool upload_weight(cuda_backend *c, const model_source *src, const char *name, uint64_t rows, uint64_t cols,
                          void *dst, float *host, float *staging) {
  const uint64_t n = rows * cols;
  if (!src->gguf) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const char *s = name; *s; ++s) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    const float scale = (float)sqrt(3.0 / (double)cols);
    DISPATCH_16BIT(c->base.opt.dtype, {
      init_weights_kernel<T><<<grid_for(n, 256), 256, 0, c->stream>>>((T *)dst, n, src->seed ^ h, scale, 1.0f);
    });
    LAUNCH_TRY();
    return true;
  }
  if (!model_read_tensor(src, name, rows, cols, host)) return false;
  CUDA_TRY(cudaMemcpyAsync(staging, host, n * sizeof(float), cudaMemcpyHostToDevice, c->stream));
  DISPATCH_16BIT(c->base.opt.dtype, {
    convert_kernel<T><<<grid_for(n, 256), 256, 0, c->stream>>>(staging, (T *)dst, n);
  });
  LAUNCH_TRY();
  CUDA_TRY(cudaStreamSynchronize(c->stream)); /* `host` is reused for the next tensor */
  return true;
}

/* A norm weight (float32 on the device). */
static bool upload_norm(cuda_backend *c, const model_source *src, const char *name, uint64_t d, float *dst, float *host) {
  if (!src->gguf) {
    init_f32_kernel<<<grid_for(d, 256), 256, 0, c->stream>>>(dst, d, 1.0f);
    LAUNCH_TRY();
    return true;
  }
  if (!model_read_tensor(src, name, 1, d, host)) return false;
  CUDA_TRY(cudaMemcpy(dst, host, d * sizeof(float), cudaMemcpyHostToDevice));
  return true;
}

static bool load_weights(cuda_backend *c, const model_source *src) {
  const model_config *m = &c->base.model;
  const uint64_t d = m->n_embd, D = m->head_dim, q = m->n_heads * D, kv = m->n_kv_heads * D, ff = m->n_ff;
  const uint64_t V = m->n_vocab, es = c->esize;
  uint64_t *acc = &c->base.weight_bytes;
  /* Host and device staging for the file's tensors: the largest is the embedding. */
  const uint64_t largest = src->gguf ? (V * d > 2 * ff * d ? V * d : 2 * ff * d) : 0;
  float *host = NULL, *staging = NULL;
  bool ok = true;
  if (largest) {
    host = (float *)alloc_zeroed(largest, sizeof(float), "weight staging");
    ok = host && cuda_ok(cudaMalloc(&staging, largest * sizeof(float)), "cudaMalloc of the weight staging buffer");
  }
  c->layers = (cuda_layer *)alloc_zeroed(m->n_layers, sizeof *c->layers, "layers");
  ok = ok && c->layers;
  char name[96];
  for (uint32_t l = 0; ok && l < m->n_layers; ++l) {
    cuda_layer *L = &c->layers[l];
    ok = device_alloc(c, (void **)&L->attn_norm, d * 4, acc, "weights") && device_alloc(c, (void **)&L->ffn_norm, d * 4, acc, "weights") &&
         device_alloc(c, &L->wqkv, (q + 2 * kv) * d * es, acc, "weights") && device_alloc(c, &L->wo, d * q * es, acc, "weights") &&
         device_alloc(c, &L->wgu, 2 * ff * d * es, acc, "weights") && device_alloc(c, &L->wdown, d * ff * es, acc, "weights") &&
         upload_norm(c, src, model_layer_tensor(l, "attn_norm", name, sizeof name), d, L->attn_norm, host) &&
         upload_norm(c, src, model_layer_tensor(l, "ffn_norm", name, sizeof name), d, L->ffn_norm, host) &&
         upload_weight(c, src, model_layer_tensor(l, "attn_q", name, sizeof name), q, d, L->wqkv, host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "attn_k", name, sizeof name), kv, d, elem(L->wqkv, q * d, es), host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "attn_v", name, sizeof name), kv, d, elem(L->wqkv, (q + kv) * d, es), host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "attn_output", name, sizeof name), d, q, L->wo, host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "ffn_gate", name, sizeof name), ff, d, L->wgu, host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "ffn_up", name, sizeof name), ff, d, elem(L->wgu, ff * d, es), host, staging) &&
         upload_weight(c, src, model_layer_tensor(l, "ffn_down", name, sizeof name), d, ff, L->wdown, host, staging);
  }
  ok = ok && device_alloc(c, &c->embed, V * d * es, acc, "weights") &&
       device_alloc(c, (void **)&c->out_norm, d * 4, acc, "weights") &&
       upload_weight(c, src, "token_embd.weight", V, d, c->embed, host, staging) &&
       upload_norm(c, src, "output_norm.weight", d, c->out_norm, host);
  if (ok && m->tied_embeddings) c->output = c->embed;
  else if (ok)
    ok = device_alloc(c, &c->output, V * d * es, acc, "weights") &&
         upload_weight(c, src, "output.weight", V, d, c->output, host, staging);
  double *inv_freq = (double *)alloc_zeroed(D / 2, sizeof(double), "rope");
  ok = ok && inv_freq && model_rope_frequencies(src, m, inv_freq) &&
       cuda_ok(cudaMalloc(&c->inv_freq, D / 2 * sizeof(double)), "cudaMalloc (rope)") &&
       cuda_ok(cudaMemcpy(c->inv_freq, inv_freq, D / 2 * sizeof(double), cudaMemcpyHostToDevice), "rope upload") &&
       cuda_ok(cudaStreamSynchronize(c->stream), "loading the weights");
  free(inv_freq);
  free(host);
  if (staging) cudaFree(staging);
  return ok;
}

static bool allocate_buffers(cuda_backend *c) {
  const backend *b = &c->base;
  const model_config *m = &b->model;
  const uint64_t d = m->n_embd, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, ff = m->n_ff;
  const uint64_t rows = b->opt.max_prompt_tokens > b->opt.max_batch ? b->opt.max_prompt_tokens : b->opt.max_batch;
  const uint64_t chunk = b->opt.chunk_tokens, B = b->opt.max_batch, es = c->esize;
  uint64_t *acc = &c->base.buffer_bytes;
  const size_t blas_ws = 32u << 20; /* cuBLAS's recommendation for Hopper */
  return device_alloc(c, (void **)&c->x, rows * d * 4, acc, "activations") &&
         device_alloc(c, &c->q, rows * H * D * es, acc, "activations") &&
         device_alloc(c, &c->k, rows * Hkv * D * es, acc, "activations") &&
         device_alloc(c, &c->v, rows * Hkv * D * es, acc, "activations") &&
         device_alloc(c, &c->attn, rows * H * D * es, acc, "activations") &&
         device_alloc(c, (void **)&c->tokens, rows * 4, acc, "activations") &&
         device_alloc(c, (void **)&c->positions, rows * 4, acc, "activations") &&
         device_alloc(c, &c->xb, chunk * d * es, acc, "activations") &&
         device_alloc(c, &c->qkv, chunk * (H + 2 * Hkv) * D * es, acc, "activations") &&
         device_alloc(c, &c->gu, chunk * 2 * ff * es, acc, "activations") &&
         device_alloc(c, &c->hid, chunk * ff * es, acc, "activations") &&
         device_alloc(c, (void **)&c->last_rows, B * 4, acc, "activations") &&
         device_alloc(c, &c->last_xb, B * d * es, acc, "activations") &&
         device_alloc(c, (void **)&c->logits, B * m->n_vocab * 4, acc, "logits") &&
         device_alloc(c, &c->blas_workspace, blas_ws, acc, "cuBLAS workspace");
}

/* The options as the backend uses them: prompt chunks of 4096 rows by default, no larger
   than the longest prefill, no smaller than a decode batch (one chunk per step). */
static backend_options cuda_options(const backend_options *opt) {
  backend_options o = *opt;
  if (o.chunk_tokens == 0) o.chunk_tokens = 4096;
  if (o.chunk_tokens > o.max_prompt_tokens) o.chunk_tokens = o.max_prompt_tokens;
  if (o.chunk_tokens < o.max_batch) o.chunk_tokens = o.max_batch;
  return o;
}

extern "C" uint64_t backend_cuda_buffer_bytes(const model_config *m, const backend_options *opt) {
  cuda_backend c;
  memset(&c, 0, sizeof c);
  c.base.model = *m;
  c.base.opt = cuda_options(opt);
  c.esize = 2;
  c.dry_run = true;
  allocate_buffers(&c);
  return c.base.buffer_bytes;
}

/* Median of 11 timed copies of 1 GiB (far beyond L2), bytes read + written. */
static double cuda_copy_bandwidth(backend *b) {
  cuda_backend *c = cb(b);
  const size_t n = (size_t)1 << 30;
  void *src = NULL, *dst = NULL;
  cudaEvent_t t0 = NULL, t1 = NULL;
  float ms[11];
  bool ok = cuda_ok(cudaMalloc(&src, n), "copy bandwidth buffer") && cuda_ok(cudaMalloc(&dst, n), "copy bandwidth buffer") &&
            cuda_ok(cudaMemsetAsync(src, 1, n, c->stream), "memset") && cuda_ok(cudaEventCreate(&t0), "cudaEventCreate") &&
            cuda_ok(cudaEventCreate(&t1), "cudaEventCreate") &&
            cuda_ok(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, c->stream), "warm-up copy");
  for (int i = 0; ok && i < 11; ++i)
    ok = cuda_ok(cudaEventRecord(t0, c->stream), "cudaEventRecord") &&
         cuda_ok(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, c->stream), "copy") &&
         cuda_ok(cudaEventRecord(t1, c->stream), "cudaEventRecord") && cuda_ok(cudaEventSynchronize(t1), "copy") &&
         cuda_ok(cudaEventElapsedTime(&ms[i], t0, t1), "cudaEventElapsedTime");
  double gbs = 0;
  if (ok) {
    for (int i = 1; i < 11; ++i) /* insertion sort for the median */
      for (int j = i; j > 0 && ms[j] < ms[j - 1]; --j) {
        const float t = ms[j];
        ms[j] = ms[j - 1];
        ms[j - 1] = t;
      }
    gbs = 2.0 * (double)n / (1e-3 * ms[5]) / 1e9;
  }
  if (t0) cudaEventDestroy(t0);
  if (t1) cudaEventDestroy(t1);
  cudaFree(src);
  cudaFree(dst);
  return gbs;
}

extern "C" backend *backend_cuda_create(const model_source *src, const model_config *m, const minikv_config *kv,
                                        uint32_t max_seq_len, const backend_options *opt) {
  if (opt->dtype != MINIKV_DTYPE_F16 && opt->dtype != MINIKV_DTYPE_BF16) {
    fail("the CUDA backend computes in f16 or bf16 (--dtype f16|bf16)");
    return NULL;
  }
  if (m->head_dim > 256) { /* rope_split_kernel's shared angles */
    fail("head_dim %u: the CUDA backend handles up to 256", m->head_dim);
    return NULL;
  }
  cuda_backend *c = (cuda_backend *)alloc_zeroed(1, sizeof *c, "CUDA backend");
  if (!c) return NULL;
  backend *b = &c->base;
  b->name = "cuda";
  b->model = *m;
  b->opt = cuda_options(opt);
  b->prefill = cuda_prefill;
  b->decode = cuda_decode;
  b->greedy = cuda_greedy;
  b->release = cuda_release;
  b->device_used = cuda_device_used;
  b->copy_bandwidth = cuda_copy_bandwidth;
  b->dense_step_seconds = cuda_dense_step_seconds;
  b->destroy = cuda_destroy;
  c->dt = opt->dtype == MINIKV_DTYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
  c->esize = 2;
  c->graph_shapes = (uint32_t *)alloc_zeroed((size_t)2 * STEP_GRAPHS_PER_SLOT * m->n_layers, sizeof *c->graph_shapes, "graph shapes");
  c->shape_scratch = (uint32_t *)alloc_zeroed(m->n_layers, sizeof *c->shape_scratch, "graph shapes");
  for (int s = 0; c->graph_shapes && s < 2; ++s)
    for (int i = 0; i < STEP_GRAPHS_PER_SLOT; ++i)
      c->graphs[s][i].nodes_after_layer = c->graph_shapes + ((size_t)s * STEP_GRAPHS_PER_SLOT + i) * m->n_layers;
  bool ok = c->graph_shapes && c->shape_scratch &&
            cuda_ok(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking), "creating a CUDA stream (is there a GPU?)") &&
            cuda_ok(cudaEventCreateWithFlags(&c->exec_done[0], cudaEventDisableTiming), "cudaEventCreate") &&
            cuda_ok(cudaEventCreateWithFlags(&c->exec_done[1], cudaEventDisableTiming), "cudaEventCreate");
  int device = 0;
  cudaDeviceProp prop;
  ok = ok && cuda_ok(cudaGetDevice(&device), "cudaGetDevice") &&
       cuda_ok(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties") && gemv_prepare(c, &prop);
  if (ok) {
    snprintf(b->device, sizeof b->device, "%.127s", prop.name);
    b->fused_gemv = c->gemv_max_rows > 0;
    b->gemv_pdl = b->fused_gemv && c->gemv_pdl;
  }
  if (ok && cublasCreate(&c->blas) != CUBLAS_STATUS_SUCCESS) ok = fail("cublasCreate failed");
  ok = ok && allocate_buffers(c);
  if (ok && (cublasSetStream(c->blas, c->stream) != CUBLAS_STATUS_SUCCESS ||
             cublasSetWorkspace(c->blas, c->blas_workspace, 32u << 20) != CUBLAS_STATUS_SUCCESS))
    ok = fail("setting up cuBLAS (stream, workspace) failed");
  ok = ok && load_weights(c, src);
  if (ok) {
    b->kv = backend_cache_config(m, kv, &b->opt, MINIKV_BACKEND_CUDA, max_seq_len);
    ok = minikv_ok(b, minikv_cache_create(&b->kv, &b->cache), "minikv_cache_create", 0);
  }
  if (!ok) {
    cuda_destroy(b);
    return NULL;
  }
  return b;
}
