/*
 * backend.h — what the engine asks of a compute backend (model_cpu.c: OpenBLAS + libminikv's
 * CPU backend; model_cuda.cu: cuBLAS + small kernels + libminikv's CUDA backend, the decode
 * step replayed as one CUDA graph).
 *
 * A backend owns the model's weights, its activation buffers and one minikv_cache whose
 * sequence slots are the engine's sequences. The engine decides which sequences run; the
 * backend runs them:
 *   prefill  the prompts of new sequences through every layer (one minikv_prefill per
 *            layer for the whole batch), returning the logits of each prompt's last token;
 *   decode   one token for each of a batch of running sequences (minikv_append_decode
 *            per layer), returning logits;
 *   greedy   n decode steps of a fixed batch with the token choice (argmax) made by the
 *            backend itself, so that a GPU never waits for the host between steps (the
 *            benchmark's path).
 * Every call is synchronous: when it returns, the outputs are in host memory. A failed
 * call returns false with a message (last_error()) and the status of the failing libminikv
 * call in `status` (MINIKV_OK when something else failed), so the engine can tell a full
 * pool (MINIKV_ERR_CAPACITY_EXCEEDED) from a bug.
 */
#ifndef ENGINE_BACKEND_H
#define ENGINE_BACKEND_H

#include <stdbool.h>
#include <stdint.h>

#include "minikv.h"
#include "model.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Sizes fixed when a backend is created. */
typedef struct backend_options {
  uint32_t max_batch;          /* sequences per decode step (and cache slots) */
  uint32_t max_prompt_tokens;  /* tokens of one prefill call, all its prompts together */
  uint32_t chunk_tokens;       /* prompt tokens per dense (GEMM) pass; 0 = the backend's */
  minikv_dtype dtype;          /* activations handed to libminikv (and the GPU's weights) */
  bool quiet;                  /* no progress lines on stderr */
  bool no_graphs;              /* CUDA: launch each decode step's kernels directly */
  bool no_gemv;                /* CUDA: cuBLAS (and separate norm/RoPE/SwiGLU kernels) for
                                  decode batches too, not the fused GEMVs of gemv.cuh */
  bool no_pdl;                 /* CUDA: launch the fused GEMVs without programmatic dependence
                                  on the kernel before them (gemv.cuh) */
} backend_options;

/* Called after each layer of a prefill (progress lines on long prompts). */
typedef void (*progress_fn)(void *ctx, uint32_t layers_done, uint32_t layers);

typedef struct backend backend;
struct backend {
  const char *name;       /* "cpu" or "cuda" */
  char device[128];       /* what computes: the GPU's name, or "CPU (n threads)" */
  bool fused_gemv;        /* CUDA: batch-1 decode steps run gemv.cuh's fused products (what
                             the device and the model's sizes allow, not only the option) */
  bool gemv_pdl;          /* CUDA: and those products start behind one another (sm_90+) */
  model_config model;
  backend_options opt;
  minikv_cache *cache;    /* slots 0 .. opt.max_batch-1 */
  minikv_config kv;       /* the configuration the cache was created with */
  minikv_status status;   /* of the last failing libminikv call */
  uint64_t weight_bytes;  /* weights as stored for computing */
  uint64_t buffer_bytes;  /* activations, logits and library-independent scratch */
  uint64_t graph_updates, graph_instantiations; /* decode steps replayed by updating an
                                                   executable graph / by a new one (CUDA) */
  double step_host_seconds; /* CUDA: host time spent recording, capturing, updating and
                               launching decode steps, summed (the GPU idles when a step's
                               exceeds the GPU time of the step before) */
  double step_host_max_seconds; /* CUDA: the longest of those steps */
  progress_fn progress;
  void *progress_ctx;

  bool (*prefill)(backend *b, uint32_t n_seqs, const uint32_t *seq_ids,
                  const int32_t *cu_seqlens, const int32_t *tokens, float *logits);
  bool (*decode)(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *tokens,
                 const int32_t *positions, float *logits);
  /* n_steps greedy steps: step 0 feeds `tokens` at `positions`, each next step the argmax
     of the previous one at the next position; writes the argmaxes to out[n_steps][n_seqs]
     and the wall time of each step, as the host saw it complete, to step_seconds[n_steps]
     (may be NULL). */
  bool (*greedy)(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *tokens,
                 const int32_t *positions, uint32_t n_steps, int32_t *out, double *step_seconds);
  /* Frees a sequence's slot (after its queued work). */
  bool (*release)(backend *b, uint32_t seq_id);
  /* Device memory in use by the whole process now, or 0 where not measured (CPU). */
  uint64_t (*device_used)(backend *b);
  /* GB/s of a large copy in the memory the backend computes from (bytes read + written),
     the bandwidth a memory-bound decode step can reach; 0 with a message on failure. */
  double (*copy_bandwidth)(backend *b);
  /* Seconds of one decode step of n rows without its attention (no libminikv call: the
     cache is not touched, the outputs are meaningless): the dense part's time, so that a
     measured step splits into dense work and attention. The mean of `repeats` steps
     (CUDA: one graph replayed); 0 with a message on failure. */
  double (*dense_step_seconds)(backend *b, uint32_t n, uint32_t repeats);
  void (*destroy)(backend *b);
};

/* The libminikv configuration for this model: num_layers/heads/kv_heads/head_dim, dtype,
   backend, max_sequences = max_batch and max_seq_len filled in over `kv` (which carries the
   compression settings and max_tokens). */
minikv_config backend_cache_config(const model_config *m, const minikv_config *kv,
                                   const backend_options *opt, minikv_backend which,
                                   uint32_t max_seq_len);

/* Bytes of the buffers (activations, logits, scratch) a backend allocates for these
   options: its buffer_bytes once created. */
uint64_t backend_buffer_bytes(const char *name, const model_config *m, const backend_options *opt);

/* Backends; NULL with a message. `kv` holds the compression settings (and max_tokens); the
   backend fills the rest (backend_cache_config). */
#ifdef ENGINE_WITH_CPU
backend *backend_cpu_create(const model_source *src, const model_config *m, const minikv_config *kv,
                            uint32_t max_seq_len, const backend_options *opt);
uint64_t backend_cpu_buffer_bytes(const model_config *m, const backend_options *opt);
#endif
#ifdef ENGINE_WITH_CUDA
backend *backend_cuda_create(const model_source *src, const model_config *m, const minikv_config *kv,
                             uint32_t max_seq_len, const backend_options *opt);
uint64_t backend_cuda_buffer_bytes(const model_config *m, const backend_options *opt);
#endif

/* The backend called `name` ("cpu", or "cuda" in a CUDA build). */
backend *backend_create(const char *name, const model_source *src, const model_config *m,
                        const minikv_config *kv, uint32_t max_seq_len, const backend_options *opt);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_BACKEND_H */
