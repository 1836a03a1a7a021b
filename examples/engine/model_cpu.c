/*
 * model_cpu.c — the model on the CPU: float32 weights and activations, every matrix
 * product through CBLAS (OpenBLAS), attention through libminikv's CPU backend (Q/K/V handed
 * over in the cache's dtype: F16 by default, as on the GPU, or F32).
 *
 * Per layer and per chunk of at most chunk_tokens rows (prompts are long, decode batches
 * are small; the same code runs both):
 *   xb = rms(x) · attn_norm;  qkv = xb · [Wq; Wk; Wv]^T  (one GEMM, the three stacked)
 *   q, k, v = split(qkv), RoPE on q and k at each row's position, converted to the dtype
 * then libminikv: minikv_prefill for all prompt rows at once, or minikv_append_decode
 * (the new tokens appended, then attended) for a decode batch; then per chunk
 *   x += attn · Wo^T;  xb = rms(x) · ffn_norm;  gu = xb · [Wgate; Wup]^T
 *   x += (silu(gate) * up) · Wdown^T
 * GEMMs accumulate straight into the residual stream x (beta = 1).
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */

#include <cblas.h>
#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "backend.h"
#include "sampler.h"
#include "util.h"

typedef struct cpu_layer {
  float *attn_norm, *ffn_norm;
  float *wqkv;  /* [(H + 2 Hkv) D, d]: the Q, K and V rows stacked */
  float *wo;    /* [d, H D] */
  float *wgu;   /* [2 ff, d]: gate rows, then up rows */
  float *wdown; /* [d, ff] */
} cpu_layer;

typedef struct cpu_backend {
  backend base;
  cpu_layer *layers;
  float *embed;  /* [vocab, d] */
  float *out_norm;
  float *output; /* [vocab, d]; the embedding itself when tied */
  double *inv_freq;
  size_t esize;  /* bytes per element of the libminikv dtype */
  /* whole-call buffers, rows = max(max_prompt_tokens, max_batch) */
  float *x;               /* [rows, d] residual stream */
  void *q, *k, *v, *attn; /* [rows, H|Hkv, D] in the dtype */
  int32_t *positions;     /* [rows] */
  /* per-chunk buffers, chunk_tokens rows */
  float *xb, *qkv, *att, *gu, *hid;
  float *last;            /* [max_batch, d] the rows that get logits */
} cpu_backend;

/* ---- small kernels -------------------------------------------------------------------- */

static void rms_norm(float *out, const float *x, const float *w, size_t rows, size_t d, float eps) {
  for (size_t r = 0; r < rows; ++r, x += d, out += d) {
    double ss = 0;
    for (size_t i = 0; i < d; ++i) ss += (double)x[i] * x[i];
    const float inv = (float)(1.0 / sqrt(ss / (double)d + (double)eps));
    for (size_t i = 0; i < d; ++i) out[i] = w[i] * (x[i] * inv);
  }
}

/* out[rows, m] (+)= in[rows, k] · w[m, k]^T */
static void matmul(float *out, const float *in, const float *w, size_t rows, size_t m, size_t k,
                   bool accumulate) {
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)rows, (int)m, (int)k, 1.0f, in,
              (int)k, w, (int)k, accumulate ? 1.0f : 0.0f, out, (int)m);
}

static void store(void *dst, size_t i, float v, minikv_dtype dt) {
  if (dt == MINIKV_DTYPE_F32) ((float *)dst)[i] = v;
  else if (dt == MINIKV_DTYPE_F16) ((uint16_t *)dst)[i] = f32_to_f16(v);
  else ((uint16_t *)dst)[i] = f32_to_bf16(v);
}

static float load(const void *src, size_t i, minikv_dtype dt) {
  if (dt == MINIKV_DTYPE_F32) return ((const float *)src)[i];
  if (dt == MINIKV_DTYPE_F16) return f16_to_f32(((const uint16_t *)src)[i]);
  return bf16_to_f32(((const uint16_t *)src)[i]);
}

/* Splits qkv rows into q, k, v (rows row0.. of the whole-call buffers), rotating the
   interleaved pairs of every Q and K head by position * inv_freq. */
static void rope_split(cpu_backend *c, const float *qkv, size_t row0, size_t rows) {
  const model_config *m = &c->base.model;
  const size_t D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, width = (H + 2 * Hkv) * D;
  const minikv_dtype dt = c->base.opt.dtype;
  for (size_t r = 0; r < rows; ++r) {
    const float *src = qkv + r * width;
    const size_t row = row0 + r;
    const double pos = (double)c->positions[row];
    for (size_t i = 0; i < D / 2; ++i) {
      const double angle = pos * c->inv_freq[i];
      const float cs = (float)cos(angle), sn = (float)sin(angle);
      for (size_t h = 0; h < H + Hkv; ++h) {
        const float x0 = src[h * D + 2 * i], x1 = src[h * D + 2 * i + 1];
        void *dst = h < H ? c->q : c->k;
        const size_t at = (h < H ? row * H + h : row * Hkv + (h - H)) * D + 2 * i;
        store(dst, at, x0 * cs - x1 * sn, dt);
        store(dst, at + 1, x0 * sn + x1 * cs, dt);
      }
    }
    for (size_t j = 0; j < Hkv * D; ++j) store(c->v, row * Hkv * D + j, src[(H + Hkv) * D + j], dt);
  }
}

/* ---- one layer ------------------------------------------------------------------------ */

/* Rows [row0, row0 + rows) of x -> q, k, v of the whole-call buffers. */
static void attention_inputs(cpu_backend *c, const cpu_layer *L, size_t row0, size_t rows) {
  const model_config *m = &c->base.model;
  const size_t d = m->n_embd, width = (size_t)(m->n_heads + 2 * m->n_kv_heads) * m->head_dim;
  rms_norm(c->xb, c->x + row0 * d, L->attn_norm, rows, d, m->rms_eps);
  matmul(c->qkv, c->xb, L->wqkv, rows, width, d, false);
  rope_split(c, c->qkv, row0, rows);
}

/* Rows [row0, row0 + rows): x += attn · Wo^T, then the MLP block. */
static void attention_output_and_mlp(cpu_backend *c, const cpu_layer *L, size_t row0, size_t rows) {
  const model_config *m = &c->base.model;
  const size_t d = m->n_embd, hd = (size_t)m->n_heads * m->head_dim, ff = m->n_ff;
  float *x = c->x + row0 * d;
  for (size_t i = 0; i < rows * hd; ++i) c->att[i] = load(c->attn, row0 * hd + i, c->base.opt.dtype);
  matmul(x, c->att, L->wo, rows, d, hd, true);
  rms_norm(c->xb, x, L->ffn_norm, rows, d, m->rms_eps);
  matmul(c->gu, c->xb, L->wgu, rows, 2 * ff, d, false);
  for (size_t r = 0; r < rows; ++r) {
    const float *g = c->gu + r * 2 * ff, *u = g + ff;
    for (size_t i = 0; i < ff; ++i) c->hid[r * ff + i] = g[i] / (1.0f + expf(-g[i])) * u[i];
  }
  matmul(x, c->hid, L->wdown, rows, d, ff, true);
}

static void embed_rows(cpu_backend *c, const int32_t *tokens, size_t rows) {
  const size_t d = c->base.model.n_embd;
  for (size_t r = 0; r < rows; ++r) memcpy(c->x + r * d, c->embed + (size_t)tokens[r] * d, d * sizeof(float));
}

static bool tokens_valid(const cpu_backend *c, const int32_t *tokens, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (tokens[i] < 0 || (uint32_t)tokens[i] >= c->base.model.n_vocab)
      return fail("token id %d at row %zu is outside the vocabulary (%u)", tokens[i], i,
                  c->base.model.n_vocab);
  return true;
}

static bool minikv_ok(backend *b, minikv_status s, const char *call, uint32_t layer) {
  b->status = s;
  if (s == MINIKV_OK) return true;
  return fail("%s (layer %u): %s: %s", call, layer, minikv_status_string(s), minikv_last_error_message());
}

/* Final norm of the rows listed, then their logits. */
static void logits_of(cpu_backend *c, const size_t *rows, size_t n, float *logits) {
  const model_config *m = &c->base.model;
  const size_t d = m->n_embd;
  for (size_t i = 0; i < n; ++i) rms_norm(c->last + i * d, c->x + rows[i] * d, c->out_norm, 1, d, m->rms_eps);
  matmul(logits, c->last, c->output, n, m->n_vocab, d, false);
}

/* ---- the backend calls ---------------------------------------------------------------- */

static bool cpu_prefill(backend *b, uint32_t n_seqs, const uint32_t *seq_ids,
                        const int32_t *cu_seqlens, const int32_t *tokens, float *logits) {
  cpu_backend *c = (cpu_backend *)b;
  const size_t total = (size_t)cu_seqlens[n_seqs], chunk = b->opt.chunk_tokens;
  if (n_seqs == 0 || n_seqs > b->opt.max_batch || total == 0 || total > b->opt.max_prompt_tokens)
    return fail("prefill of %u prompts, %zu tokens: at most %u prompts and %u tokens per call",
                n_seqs, total, b->opt.max_batch, b->opt.max_prompt_tokens);
  if (!tokens_valid(c, tokens, total)) return false;
  for (uint32_t s = 0; s < n_seqs; ++s)
    for (int32_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) c->positions[t] = t - cu_seqlens[s];
  embed_rows(c, tokens, total);
  for (uint32_t l = 0; l < b->model.n_layers; ++l) {
    const cpu_layer *L = &c->layers[l];
    for (size_t r = 0; r < total; r += chunk) attention_inputs(c, L, r, total - r < chunk ? total - r : chunk);
    if (!minikv_ok(b, minikv_prefill(b->cache, l, n_seqs, seq_ids, cu_seqlens, c->q, c->k, c->v, c->attn, NULL),
                   "minikv_prefill", l))
      return false;
    for (size_t r = 0; r < total; r += chunk) attention_output_and_mlp(c, L, r, total - r < chunk ? total - r : chunk);
    if (b->progress) b->progress(b->progress_ctx, l + 1, b->model.n_layers);
  }
  size_t rows[1024];
  for (uint32_t s0 = 0; s0 < n_seqs; s0 += 1024) { /* rows[] in pieces; max_batch may be larger */
    const uint32_t n = n_seqs - s0 < 1024 ? n_seqs - s0 : 1024;
    for (uint32_t s = 0; s < n; ++s) rows[s] = (size_t)cu_seqlens[s0 + s + 1] - 1;
    logits_of(c, rows, n, logits + (size_t)s0 * b->model.n_vocab);
  }
  return true;
}

/* One decode step; without `attention` (seq_ids NULL) the libminikv calls are left out and
   the attention output is whatever the buffer holds: the dense part alone, for timing. */
static bool decode_step(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *tokens,
                        const int32_t *positions, float *logits) {
  cpu_backend *c = (cpu_backend *)b;
  if (n_seqs == 0 || n_seqs > b->opt.max_batch)
    return fail("decode of %u sequences: 1 to %u per step", n_seqs, b->opt.max_batch);
  if (!tokens_valid(c, tokens, n_seqs)) return false;
  memcpy(c->positions, positions, n_seqs * sizeof *positions);
  embed_rows(c, tokens, n_seqs);
  const size_t chunk = b->opt.chunk_tokens;
  for (uint32_t l = 0; l < b->model.n_layers; ++l) {
    const cpu_layer *L = &c->layers[l];
    for (size_t r = 0; r < n_seqs; r += chunk) attention_inputs(c, L, r, n_seqs - r < chunk ? n_seqs - r : chunk);
    if (seq_ids &&
        !minikv_ok(b, minikv_append_decode(b->cache, l, n_seqs, seq_ids, c->q, c->k, c->v, c->attn, NULL),
                   "minikv_append_decode", l))
      return false;
    for (size_t r = 0; r < n_seqs; r += chunk) attention_output_and_mlp(c, L, r, n_seqs - r < chunk ? n_seqs - r : chunk);
  }
  size_t rows[1024];
  for (uint32_t s0 = 0; s0 < n_seqs; s0 += 1024) {
    const uint32_t n = n_seqs - s0 < 1024 ? n_seqs - s0 : 1024;
    for (uint32_t s = 0; s < n; ++s) rows[s] = s0 + s;
    logits_of(c, rows, n, logits + (size_t)s0 * b->model.n_vocab);
  }
  return true;
}

static bool cpu_decode(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *tokens,
                       const int32_t *positions, float *logits) {
  return seq_ids ? decode_step(b, n_seqs, seq_ids, tokens, positions, logits)
                 : fail("decode: seq_ids is NULL");
}

static double cpu_dense_step_seconds(backend *b, uint32_t n, uint32_t repeats) {
  float *logits = alloc_zeroed((size_t)n * b->model.n_vocab, sizeof *logits, "logits");
  int32_t *zeros = alloc_zeroed(n, sizeof *zeros, "tokens");
  bool ok = logits && zeros;
  const double t0 = now_seconds();
  for (uint32_t i = 0; ok && i < repeats; ++i) ok = decode_step(b, n, NULL, zeros, zeros, logits);
  const double seconds = ok && repeats ? (now_seconds() - t0) / repeats : 0.0;
  free(logits);
  free(zeros);
  return seconds;
}

static bool cpu_greedy(backend *b, uint32_t n_seqs, const uint32_t *seq_ids, const int32_t *tokens,
                       const int32_t *positions, uint32_t n_steps, int32_t *out, double *step_seconds) {
  const size_t V = b->model.n_vocab;
  float *logits = alloc_zeroed((size_t)n_seqs * V, sizeof *logits, "greedy logits");
  int32_t *tok = alloc_zeroed(n_seqs, sizeof *tok, "greedy tokens");
  int32_t *pos = alloc_zeroed(n_seqs, sizeof *pos, "greedy positions");
  bool ok = logits && tok && pos;
  if (ok) {
    memcpy(tok, tokens, n_seqs * sizeof *tok);
    memcpy(pos, positions, n_seqs * sizeof *pos);
  }
  for (uint32_t step = 0; ok && step < n_steps; ++step) {
    const double t0 = now_seconds();
    ok = cpu_decode(b, n_seqs, seq_ids, tok, pos, logits);
    for (uint32_t s = 0; ok && s < n_seqs; ++s) {
      tok[s] = out[(size_t)step * n_seqs + s] = argmax_f32(logits + s * V, V);
      ++pos[s];
    }
    if (step_seconds) step_seconds[step] = now_seconds() - t0;
  }
  free(logits);
  free(tok);
  free(pos);
  return ok;
}

static bool cpu_release(backend *b, uint32_t seq_id) {
  return minikv_ok(b, minikv_sequence_release(b->cache, seq_id), "minikv_sequence_release", 0);
}

static uint64_t cpu_device_used(backend *b) {
  (void)b;
  return 0;
}

/* Median of 5 copies of 256 MB (far beyond the caches). */
static double cpu_copy_bandwidth(backend *b) {
  (void)b;
  const size_t n = (size_t)256 << 20;
  char *src = malloc(n), *dst = malloc(n);
  double best[5] = {0}, gbs = 0;
  if (src && dst) {
    memset(src, 1, n);
    memset(dst, 2, n);
    for (int i = 0; i < 5; ++i) {
      const double t0 = now_seconds();
      memcpy(dst, src, n);
      best[i] = 2.0 * (double)n / (now_seconds() - t0) / 1e9;
    }
    for (int i = 0; i < 5; ++i) /* median of five: sort by insertion */
      for (int j = i; j > 0 && best[j] < best[j - 1]; --j) {
        const double t = best[j];
        best[j] = best[j - 1];
        best[j - 1] = t;
      }
    volatile char sink = dst[n / 2]; /* the copies are read: they cannot be optimized away */
    (void)sink;
    gbs = best[2];
  } else {
    fail("out of host memory (copy bandwidth buffers)");
  }
  free(src);
  free(dst);
  return gbs;
}

static void cpu_destroy(backend *b) {
  if (!b) return;
  cpu_backend *c = (cpu_backend *)b;
  minikv_cache_destroy(b->cache);
  if (c->layers)
    for (uint32_t l = 0; l < b->model.n_layers; ++l) {
      cpu_layer *L = &c->layers[l];
      free(L->attn_norm);
      free(L->ffn_norm);
      free(L->wqkv);
      free(L->wo);
      free(L->wgu);
      free(L->wdown);
    }
  free(c->layers);
  if (c->output != c->embed) free(c->output);
  free(c->embed);
  free(c->out_norm);
  free(c->inv_freq);
  void *buffers[] = {c->x, c->q, c->k, c->v, c->attn, c->positions, c->xb, c->qkv, c->att, c->gu, c->hid, c->last};
  for (size_t i = 0; i < sizeof buffers / sizeof buffers[0]; ++i) free(buffers[i]);
  free(c);
}

/* ---- creation ------------------------------------------------------------------------- */

/* Allocates a weight of rows x cols and reads it (stacked tensors: several reads). */
static float *weight(cpu_backend *c, uint64_t rows, uint64_t cols) {
  float *w = alloc_zeroed((size_t)(rows * cols), sizeof *w, "weights");
  if (w) c->base.weight_bytes += rows * cols * sizeof *w;
  return w;
}

static bool read_layer(cpu_backend *c, const model_source *src, uint32_t l) {
  const model_config *m = &c->base.model;
  const uint64_t d = m->n_embd, D = m->head_dim, q = m->n_heads * D, kv = m->n_kv_heads * D, ff = m->n_ff;
  cpu_layer *L = &c->layers[l];
  char name[96];
  L->attn_norm = weight(c, 1, d);
  L->ffn_norm = weight(c, 1, d);
  L->wqkv = weight(c, q + 2 * kv, d);
  L->wo = weight(c, d, q);
  L->wgu = weight(c, 2 * ff, d);
  L->wdown = weight(c, d, ff);
  return L->attn_norm && L->ffn_norm && L->wqkv && L->wo && L->wgu && L->wdown &&
         model_read_tensor(src, model_layer_tensor(l, "attn_norm", name, sizeof name), 1, d, L->attn_norm) &&
         model_read_tensor(src, model_layer_tensor(l, "ffn_norm", name, sizeof name), 1, d, L->ffn_norm) &&
         model_read_tensor(src, model_layer_tensor(l, "attn_q", name, sizeof name), q, d, L->wqkv) &&
         model_read_tensor(src, model_layer_tensor(l, "attn_k", name, sizeof name), kv, d, L->wqkv + q * d) &&
         model_read_tensor(src, model_layer_tensor(l, "attn_v", name, sizeof name), kv, d, L->wqkv + (q + kv) * d) &&
         model_read_tensor(src, model_layer_tensor(l, "attn_output", name, sizeof name), d, q, L->wo) &&
         model_read_tensor(src, model_layer_tensor(l, "ffn_gate", name, sizeof name), ff, d, L->wgu) &&
         model_read_tensor(src, model_layer_tensor(l, "ffn_up", name, sizeof name), ff, d, L->wgu + ff * d) &&
         model_read_tensor(src, model_layer_tensor(l, "ffn_down", name, sizeof name), d, ff, L->wdown);
}

/* Allocates (or, for a dry run, only counts) one activation buffer. */
static bool buffer(cpu_backend *c, void **p, size_t count, size_t size, bool dry) {
  c->base.buffer_bytes += count * size;
  if (dry) return true;
  return (*p = alloc_zeroed(count, size, "activation buffers")) != NULL;
}

static bool cpu_buffers(cpu_backend *c, bool dry) {
  const model_config *m = &c->base.model;
  const backend_options *opt = &c->base.opt;
  const size_t d = m->n_embd, D = m->head_dim, H = m->n_heads, Hkv = m->n_kv_heads, ff = m->n_ff;
  const size_t rows = opt->max_prompt_tokens > opt->max_batch ? opt->max_prompt_tokens : opt->max_batch;
  const size_t chunk = opt->chunk_tokens, es = c->esize, last = opt->max_batch < 1024 ? opt->max_batch : 1024;
  return buffer(c, (void **)&c->x, rows * d, sizeof(float), dry) && buffer(c, &c->q, rows * H * D, es, dry) &&
         buffer(c, &c->k, rows * Hkv * D, es, dry) && buffer(c, &c->v, rows * Hkv * D, es, dry) &&
         buffer(c, &c->attn, rows * H * D, es, dry) && buffer(c, (void **)&c->positions, rows, sizeof(int32_t), dry) &&
         buffer(c, (void **)&c->xb, chunk * d, sizeof(float), dry) &&
         buffer(c, (void **)&c->qkv, chunk * (H + 2 * Hkv) * D, sizeof(float), dry) &&
         buffer(c, (void **)&c->att, chunk * H * D, sizeof(float), dry) &&
         buffer(c, (void **)&c->gu, chunk * 2 * ff, sizeof(float), dry) &&
         buffer(c, (void **)&c->hid, chunk * ff, sizeof(float), dry) &&
         buffer(c, (void **)&c->last, last * d, sizeof(float), dry);
}

/* The options as the backend uses them (defaults filled in). */
static backend_options cpu_options(const backend_options *opt) {
  backend_options o = *opt;
  if (o.chunk_tokens == 0) o.chunk_tokens = 256;
  return o;
}

uint64_t backend_cpu_buffer_bytes(const model_config *m, const backend_options *opt) {
  cpu_backend c;
  memset(&c, 0, sizeof c);
  c.base.model = *m;
  c.base.opt = cpu_options(opt);
  c.esize = opt->dtype == MINIKV_DTYPE_F32 ? 4 : 2;
  cpu_buffers(&c, true);
  return c.base.buffer_bytes;
}

backend *backend_cpu_create(const model_source *src, const model_config *m, const minikv_config *kv,
                            uint32_t max_seq_len, const backend_options *opt) {
  cpu_backend *c = alloc_zeroed(1, sizeof *c, "CPU backend");
  if (!c) return NULL;
  backend *b = &c->base;
  b->name = "cpu";
  b->model = *m;
  b->opt = cpu_options(opt);
  b->prefill = cpu_prefill;
  b->decode = cpu_decode;
  b->greedy = cpu_greedy;
  b->release = cpu_release;
  b->device_used = cpu_device_used;
  b->copy_bandwidth = cpu_copy_bandwidth;
  b->dense_step_seconds = cpu_dense_step_seconds;
  b->destroy = cpu_destroy;
  snprintf(b->device, sizeof b->device, "CPU (%ld threads online)", sysconf(_SC_NPROCESSORS_ONLN));
  c->esize = opt->dtype == MINIKV_DTYPE_F32 ? 4 : 2;

  bool ok = (c->layers = alloc_zeroed(m->n_layers, sizeof *c->layers, "layers")) != NULL;
  for (uint32_t l = 0; ok && l < m->n_layers; ++l) ok = read_layer(c, src, l);
  ok = ok && (c->embed = weight(c, m->n_vocab, m->n_embd)) && (c->out_norm = weight(c, 1, m->n_embd)) &&
       (c->inv_freq = alloc_zeroed(m->head_dim / 2, sizeof *c->inv_freq, "rope")) &&
       model_read_tensor(src, "token_embd.weight", m->n_vocab, m->n_embd, c->embed) &&
       model_read_tensor(src, "output_norm.weight", 1, m->n_embd, c->out_norm) &&
       model_rope_frequencies(src, m, c->inv_freq);
  if (ok && m->tied_embeddings) c->output = c->embed;
  else if (ok) ok = (c->output = weight(c, m->n_vocab, m->n_embd)) && model_read_tensor(src, "output.weight", m->n_vocab, m->n_embd, c->output);
  ok = ok && cpu_buffers(c, false);
  if (ok) {
    b->kv = backend_cache_config(m, kv, &b->opt, MINIKV_BACKEND_CPU, max_seq_len);
    ok = minikv_ok(b, minikv_cache_create(&b->kv, &b->cache), "minikv_cache_create", 0);
  }
  if (!ok) {
    cpu_destroy(b);
    return NULL;
  }
  return b;
}
