/*
 * bench.c — minikv-engine --bench: what a compressed cache does to decoding speed, measured
 * end to end in C (no Python in the loop) on random-weight models of real shapes.
 *
 * For each model shape and each cache setting (default: the full 16-bit cache, every
 * token kept; libminikv's defaults; the MiniKV paper's setting):
 *   latency     batch 1: prefill a random prompt of each context length, then time greedy
 *               decode steps (after a few warm-up steps); the milliseconds per token next
 *               to the roofline expectation (weight bytes + cache bytes read per step) /
 *               measured copy bandwidth;
 *   throughput  prompts of --throughput-prompt tokens generating --throughput-gen tokens
 *               each, at the largest batch whose weights + buffers + cache pool + libminikv
 *               workspace fit --memory-limit-gb: tokens per second (decode, and end to end
 *               with the prefills), the peak memory, the expectation per step.
 * Prints tables and writes JSON (--json) with the date, device, commit and every number.
 *
 * How the batch is sized. One prompt is prefilled first (batch 1) to learn how many tokens
 * each layer keeps; a sequence then needs the sum over layers of engine_blocks_at_end's
 * blocks (pool_blocks.h) for its generated tokens. libminikv's memory for
 * S slots and a pool of T tokens is measured on small caches (pool + workspace = a + b*S +
 * c*T, three probes), the engine's buffers come from the backend's own sizing, and the
 * batch is the largest whose total fits the limit, checked by a fourth probe with that many
 * slots; the pool is then created exactly that large. The peak device memory (whole GPU, CUDA context included) is reported as measured.
 */
#define _POSIX_C_SOURCE 200809L

#include "bench.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "backend.h"
#include "engine.h"
#include "model.h"
#include "sampler.h"
#include "util.h"

enum { MAX_LIST = 32 };

typedef struct bench_options {
  const char *models[MAX_LIST];
  size_t n_models;
  const char *settings[MAX_LIST];
  size_t n_settings;
  uint32_t contexts[MAX_LIST];
  size_t n_contexts;
  const char *backend;
  minikv_dtype dtype;
  uint32_t gen, warmup, tp_prompt, tp_gen;
  double memory_limit; /* bytes */
  bool latency, throughput, no_graphs, no_gemv, no_pdl;
  const char *json, *commit;
  uint64_t seed;
} bench_options;

typedef struct latency_row {
  const char *model, *setting;
  uint32_t context;
  double prefill_s, ms_per_token, ms_min, expected_ms, host_ms;
  double dense_ms; /* the same step without its attention (dense_step_seconds) */
  uint64_t weight_bytes, cache_bytes, tokens_cached, tokens_seen;
} latency_row;

typedef struct throughput_row {
  const char *model, *setting;
  uint32_t batch, batch_planned;
  double prefill_s, decode_s, decode_tps, total_tps, step_ms, expected_step_ms, dense_ms;
  double host_ms, host_max_ms;           /* host time a step takes to record, capture and launch */
  uint64_t graph_updates, graph_instantiations; /* of the timed decode */
  uint64_t weight_bytes, buffer_bytes, pool_bytes, workspace_bytes, cache_used_bytes, peak_device_bytes;
  uint64_t blocks_per_seq;
  bool fits;
} throughput_row;

typedef struct bench_state {
  const bench_options *o;
  latency_row lat[MAX_LIST * MAX_LIST * 4];
  size_t n_lat;
  throughput_row tp[MAX_LIST * 4];
  size_t n_tp;
  double copy_gbs;
  char device[128];
  bool fused_gemv, gemv_pdl; /* as the first backend reported them */
  uint64_t graph_updates, graph_instantiations;
  rng64 rng;
  const char *latency_header_for; /* the model whose latency table is open */
} bench_state;

/* ---- options ------------------------------------------------------------------------- */

static void usage(FILE *f) {
  fprintf(f,
    "usage: minikv-engine --bench [options]\n"
    "  --random SHAPES         comma-separated model shapes (llama2-7b,llama3-8b; known: %s)\n"
    "  --kv-list SETTINGS      cache settings separated by ';' (full;minikv;paper), each as --kv\n"
    "  --contexts LIST         latency contexts (1024,2048,4096,8192,16384,32768,65536,131072)\n"
    "  --gen N                 timed decode steps per context (32)\n"
    "  --warmup N              untimed steps first (4)\n"
    "  --throughput-prompt N   prompt tokens per sequence of the throughput run (2048)\n"
    "  --throughput-gen N      generated tokens per sequence (1024)\n"
    "  --memory-limit-gb X     weights + buffers + cache pool + workspace (40)\n"
    "  --no-latency, --no-throughput   skip a part\n"
    "  --no-graphs             CUDA: decode steps launched kernel by kernel, not as graphs\n"
    "  --no-gemv               CUDA: cuBLAS for decode batches of up to 8 too, not the fused GEMVs\n"
    "  --no-pdl                CUDA: fused GEMVs that do not start behind the kernel before them\n"
    "  --backend cpu|cuda      (cuda when built)\n"
    "  --dtype f16|bf16        (f16)\n"
    "  --seed S                random weights and prompts (1)\n"
    "  --json PATH             write every number as JSON\n"
    "  --commit TEXT           recorded in the JSON (default: $MINIKV_COMMIT)\n",
    model_preset_names());
}

static size_t split(char *text, const char *sep, const char **out, size_t max) {
  size_t n = 0;
  char *save = NULL;
  for (char *t = strtok_r(text, sep, &save); t && n < max; t = strtok_r(NULL, sep, &save)) out[n++] = t;
  return n;
}

static char arg_copy[4][1024];

static bool parse_bench_args(int argc, char **argv, bench_options *o) {
  memset(o, 0, sizeof *o);
  static char models[] = "llama2-7b,llama3-8b", settings[] = "full;minikv;paper",
              contexts[] = "1024,2048,4096,8192,16384,32768,65536,131072";
  char *model_text = models, *setting_text = settings, *context_text = contexts;
#ifdef ENGINE_WITH_CUDA
  o->backend = "cuda";
#else
  o->backend = "cpu";
#endif
  o->dtype = MINIKV_DTYPE_F16;
  o->gen = 32;
  o->warmup = 4;
  o->tp_prompt = 2048;
  o->tp_gen = 1024;
  o->memory_limit = 40e9;
  o->latency = o->throughput = true;
  o->commit = getenv("MINIKV_COMMIT") ? getenv("MINIKV_COMMIT") : "unknown";
  o->seed = 1;
  for (int i = 1; i < argc; ++i) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    uint32_t u = 0;
    if (strcmp(a, "--bench") == 0) continue;
    if (strcmp(a, "--no-latency") == 0) { o->latency = false; continue; }
    if (strcmp(a, "--no-throughput") == 0) { o->throughput = false; continue; }
    if (strcmp(a, "--no-graphs") == 0) { o->no_graphs = true; continue; }
    if (strcmp(a, "--no-gemv") == 0) { o->no_gemv = true; continue; }
    if (strcmp(a, "--no-pdl") == 0) { o->no_pdl = true; continue; }
    if (!v) return fail("%s needs a value (or is unknown: --bench --help lists the flags)", a);
    ++i;
    if (strcmp(a, "--random") == 0 || strcmp(a, "--kv-list") == 0 || strcmp(a, "--contexts") == 0) {
      const int slot = a[2] == 'r' ? 0 : a[2] == 'k' ? 1 : 2;
      if (strlen(v) >= sizeof arg_copy[slot]) return fail("%s: too long", a);
      strcpy(arg_copy[slot], v);
      *(slot == 0 ? &model_text : slot == 1 ? &setting_text : &context_text) = arg_copy[slot];
    } else if (strcmp(a, "--gen") == 0) {
      if (!parse_flag_u32(a, v, 1, &o->gen)) return false;
    } else if (strcmp(a, "--warmup") == 0) {
      if (!parse_flag_u32(a, v, 0, &o->warmup)) return false;
    } else if (strcmp(a, "--throughput-prompt") == 0) {
      if (!parse_flag_u32(a, v, 1, &o->tp_prompt)) return false;
    } else if (strcmp(a, "--throughput-gen") == 0) {
      if (!parse_flag_u32(a, v, 2, &o->tp_gen)) return false;
    } else if (strcmp(a, "--memory-limit-gb") == 0) {
      char *end;
      o->memory_limit = strtod(v, &end) * 1e9;
      if (*end != '\0' || !(o->memory_limit > 0)) return fail("--memory-limit-gb needs a positive number");
    } else if (strcmp(a, "--backend") == 0) {
      o->backend = v;
    } else if (strcmp(a, "--dtype") == 0) {
      if (strcmp(v, "f16") == 0) o->dtype = MINIKV_DTYPE_F16;
      else if (strcmp(v, "bf16") == 0) o->dtype = MINIKV_DTYPE_BF16;
      else return fail("--dtype %s: f16 or bf16", v);
    } else if (strcmp(a, "--seed") == 0) {
      if (!parse_flag_u32(a, v, 0, &u)) return false;
      o->seed = u;
    } else if (strcmp(a, "--json") == 0) {
      o->json = v;
    } else if (strcmp(a, "--commit") == 0) {
      o->commit = v;
    } else {
      return fail("unknown flag %s (--bench --help lists them)", a);
    }
  }
  o->n_models = split(model_text, ",", o->models, MAX_LIST);
  o->n_settings = split(setting_text, ";", o->settings, MAX_LIST);
  const char *ctx[MAX_LIST];
  o->n_contexts = split(context_text, ",", ctx, MAX_LIST);
  for (size_t i = 0; i < o->n_contexts; ++i)
    if (!parse_flag_u32("--contexts", ctx[i], 1, &o->contexts[i])) return false;
  model_config m;
  for (size_t i = 0; i < o->n_models; ++i)
    if (!model_config_preset(o->models[i], &m)) return false;
  for (size_t i = 0; i < o->n_settings; ++i) {
    minikv_config kv;
    minikv_config_default(&kv);
    if (!engine_parse_kv(o->settings[i], &kv)) return false;
  }
  if (o->n_models == 0 || o->n_settings == 0) return fail("--random and --kv-list need at least one item");
  return true;
}

/* ---- measurements ---------------------------------------------------------------------- */

static void random_tokens(bench_state *st, int32_t *t, size_t n, uint32_t vocab) {
  for (size_t i = 0; i < n; ++i) t[i] = (int32_t)(rng_next(&st->rng) % vocab);
}

static bool cache_stats(const backend *b, minikv_memory_stats *ms) {
  memset(ms, 0, sizeof *ms);
  ms->struct_size = sizeof *ms;
  const minikv_status s = minikv_memory_stats_get(b->cache, ms);
  return s == MINIKV_OK || fail("minikv_memory_stats_get: %s", minikv_last_error_message());
}

/* Bytes of weights one decode step reads: everything but the embedding table, which only
   gives one row per token (unless it is also the output matrix). */
static uint64_t weights_read(const backend *b) {
  const model_config *m = &b->model;
  const uint64_t table = (uint64_t)m->n_vocab * m->n_embd * (strcmp(b->name, "cuda") == 0 ? 2 : 4);
  return m->tied_embeddings ? b->weight_bytes : b->weight_bytes - table;
}

static double mean(const double *x, size_t n) {
  double s = 0;
  for (size_t i = 0; i < n; ++i) s += x[i];
  return n ? s / (double)n : 0;
}

static bool latency_context(bench_state *st, backend *b, const char *model, const char *setting, uint32_t ctx,
                            double dense_ms) {
  const bench_options *o = st->o;
  const uint32_t steps = o->warmup + o->gen, V = b->model.n_vocab;
  int32_t *prompt = alloc_zeroed(ctx, sizeof *prompt, "prompt");
  float *logits = alloc_zeroed(V, sizeof *logits, "logits");
  int32_t *out = alloc_zeroed(steps, sizeof *out, "tokens");
  double *secs = alloc_zeroed(steps, sizeof *secs, "step times");
  bool ok = prompt && logits && out && secs;
  const uint32_t seq = 0;
  const int32_t cu[2] = {0, (int32_t)ctx};
  minikv_memory_stats before, after;
  double t0 = 0, prefill_s = 0;
  if (ok) {
    random_tokens(st, prompt, ctx, V);
    t0 = now_seconds();
    ok = b->prefill(b, 1, &seq, cu, prompt, logits);
    prefill_s = now_seconds() - t0;
  }
  const int32_t first = ok ? argmax_f32(logits, V) : 0, pos = (int32_t)ctx;
  const double host_before = b->step_host_seconds;
  ok = ok && cache_stats(b, &before) && b->greedy(b, 1, &seq, &first, &pos, steps, out, secs) && cache_stats(b, &after);
  const double host_ms = 1e3 * (b->step_host_seconds - host_before) / steps;
  if (ok) {
    latency_row *r = &st->lat[st->n_lat++];
    r->model = model;
    r->setting = setting;
    r->context = ctx;
    r->prefill_s = prefill_s;
    r->ms_per_token = 1e3 * mean(secs + o->warmup, o->gen);
    r->ms_min = 1e30;
    for (uint32_t i = o->warmup; i < steps; ++i) r->ms_min = fmin(r->ms_min, 1e3 * secs[i]);
    r->weight_bytes = weights_read(b);
    r->cache_bytes = (before.used_bytes + after.used_bytes) / 2; /* the cache grows while timed */
    r->tokens_cached = after.tokens_cached;
    r->tokens_seen = after.tokens_seen;
    r->expected_ms = 1e3 * (double)(r->weight_bytes + r->cache_bytes) / (st->copy_gbs * 1e9);
    r->dense_ms = dense_ms;
    r->host_ms = host_ms;
    const double bw = st->copy_gbs * 1e6; /* bytes per ms */
    printf("  %-10s %-22s %7u %8.2f %9.3f %9.3f %6.2f  %7.3f %7.3f  %7.3f %7.3f  %5.1f%%  %6.3f\n", model, setting, ctx,
           prefill_s, r->ms_per_token, r->expected_ms, r->ms_per_token / r->expected_ms, dense_ms,
           (double)r->weight_bytes / bw, r->ms_per_token - dense_ms, (double)r->cache_bytes / bw,
           100.0 * (double)after.tokens_cached / (double)(after.tokens_seen ? after.tokens_seen : 1), host_ms);
    fflush(stdout);
  }
  ok = ok && b->release(b, seq);
  free(prompt);
  free(logits);
  free(out);
  free(secs);
  return ok;
}

/* Blocks one sequence of the throughput run needs: prefill one prompt, read each layer's
   kept count, count what the layer holds once the generated tokens are appended too
   (engine_blocks_at_end). */
static bool blocks_per_sequence(bench_state *st, backend *b, uint64_t *blocks) {
  const bench_options *o = st->o;
  const uint32_t V = b->model.n_vocab, seq = 0;
  int32_t *prompt = alloc_zeroed(o->tp_prompt, sizeof *prompt, "prompt");
  float *logits = alloc_zeroed(V, sizeof *logits, "logits");
  bool ok = prompt && logits;
  const int32_t cu[2] = {0, (int32_t)o->tp_prompt};
  if (ok) random_tokens(st, prompt, o->tp_prompt, V);
  ok = ok && b->prefill(b, 1, &seq, cu, prompt, logits);
  *blocks = 0;
  for (uint32_t l = 0; ok && l < b->model.n_layers; ++l) {
    uint64_t cached = 0;
    ok = minikv_sequence_length(b->cache, seq, l, NULL, &cached) == MINIKV_OK ||
         fail("minikv_sequence_length: %s", minikv_last_error_message());
    *blocks += engine_blocks_at_end(&b->kv, o->tp_prompt, cached, o->tp_gen);
  }
  ok = ok && b->release(b, seq);
  free(prompt);
  free(logits);
  return ok;
}

/* pool + workspace bytes of a cache with S slots and a pool of T tokens. */
static bool probe_cache(const minikv_config *base, uint32_t slots, uint64_t tokens, double *bytes) {
  minikv_config c = *base;
  c.max_sequences = slots;
  c.max_tokens = tokens;
  minikv_cache *cache = NULL;
  minikv_status s = minikv_cache_create(&c, &cache);
  minikv_memory_stats ms;
  memset(&ms, 0, sizeof ms);
  ms.struct_size = sizeof ms;
  if (s == MINIKV_OK) s = minikv_memory_stats_get(cache, &ms);
  minikv_cache_destroy(cache);
  if (s != MINIKV_OK) return fail("sizing the cache: %s", minikv_last_error_message());
  *bytes = (double)(ms.pool_bytes + ms.workspace_bytes);
  return true;
}

static bool throughput(bench_state *st, const model_config *m, const model_source *src, const minikv_config *kv,
                       const char *model, const char *setting, uint64_t blocks_per_seq, uint64_t weight_bytes) {
  const bench_options *o = st->o;
  const uint32_t max_seq_len = o->tp_prompt + o->tp_gen + 1, R = kv->residual_length;
  backend_options opt = {1, o->tp_prompt, 0, o->dtype, true, o->no_graphs, o->no_gemv, o->no_pdl};
  const minikv_config base = backend_cache_config(m, kv, &opt,
      strcmp(o->backend, "cuda") == 0 ? MINIKV_BACKEND_CUDA : MINIKV_BACKEND_CPU, max_seq_len);
  /* libminikv's memory as a + b*slots + c*tokens, from three small caches */
  const uint64_t t1 = (uint64_t)R * m->n_layers * 2, t2 = 3 * t1;
  double f11, f21, f12;
  if (!probe_cache(&base, 1, t1, &f11) || !probe_cache(&base, 2, t1, &f21) || !probe_cache(&base, 1, t2, &f12))
    return false;
  const double per_slot = f21 - f11, per_token = (f12 - f11) / (double)(t2 - t1);
  const double fixed = f11 - per_slot - per_token * (double)t1;
  uint32_t batch = 0;
  for (uint32_t B = 1; B <= 4096; ++B) {
    opt.max_batch = B;
    const double total = (double)weight_bytes + (double)backend_buffer_bytes(o->backend, m, &opt) + fixed +
                         per_slot * B + per_token * (double)(B * blocks_per_seq * R);
    if (total > o->memory_limit) break;
    batch = B;
  }
  /* The model is linear in the slots only piecewise (a CUDA cache of more than 128 sequences
     adds decode workspace): probe the planned slot count itself and step down until it fits. */
  for (; batch > 0; --batch) {
    double at_batch;
    if (!probe_cache(&base, batch, t1, &at_batch)) return false;
    opt.max_batch = batch;
    const double total = (double)weight_bytes + (double)backend_buffer_bytes(o->backend, m, &opt) + at_batch +
                         per_token * ((double)batch * blocks_per_seq * R - (double)t1);
    if (total <= o->memory_limit) break;
  }
  throughput_row *r = &st->tp[st->n_tp++];
  memset(r, 0, sizeof *r);
  r->model = model;
  r->setting = setting;
  r->blocks_per_seq = blocks_per_seq;
  r->batch_planned = batch;
  if (batch == 0) {
    printf("  %-10s %-22s does not fit %.1f GB even at batch 1\n", model, setting, o->memory_limit / 1e9);
    return true;
  }
  r->fits = true;
  minikv_config sized = *kv;
  sized.max_tokens = (uint64_t)batch * blocks_per_seq * R;
  opt.max_batch = batch;
  backend *b = backend_create(o->backend, src, m, &sized, max_seq_len, &opt);
  if (!b) return false;
  const uint32_t V = m->n_vocab, steps = o->tp_gen - 1;
  uint32_t *ids = alloc_zeroed(batch, sizeof *ids, "ids");
  int32_t *first = alloc_zeroed(batch, sizeof *first, "tokens"), *pos = alloc_zeroed(batch, sizeof *pos, "positions");
  int32_t *prompt = alloc_zeroed(o->tp_prompt, sizeof *prompt, "prompt");
  int32_t *out = alloc_zeroed((size_t)steps * batch, sizeof *out, "tokens");
  float *logits = alloc_zeroed(V, sizeof *logits, "logits");
  double *secs = alloc_zeroed(steps, sizeof *secs, "step times");
  bool ok = ids && first && pos && prompt && out && logits && secs;
  const int32_t cu[2] = {0, (int32_t)o->tp_prompt};
  uint32_t n = 0;
  const double t0 = now_seconds();
  for (; ok && n < batch; ++n) { /* one prompt per prefill call: the buffers stay small */
    ids[n] = n;
    random_tokens(st, prompt, o->tp_prompt, V);
    if (!b->prefill(b, 1, &ids[n], cu, prompt, logits)) {
      if (b->status != MINIKV_ERR_CAPACITY_EXCEEDED) ok = false;
      else ok = b->release(b, n); /* the plan was off: run with the sequences that fit */
      break;
    }
    first[n] = argmax_f32(logits, V);
    pos[n] = (int32_t)o->tp_prompt;
  }
  r->prefill_s = now_seconds() - t0;
  r->batch = n;
  minikv_memory_stats mid, end;
  const double dense_s = ok && n > 0 ? b->dense_step_seconds(b, n, 16) : 0.0;
  ok = ok && n > 0 && dense_s > 0 && cache_stats(b, &mid);
  uint64_t peak = ok ? b->device_used(b) : 0;
  const double host_before = b->step_host_seconds;
  b->step_host_max_seconds = 0;
  const uint64_t updates_before = b->graph_updates, instantiations_before = b->graph_instantiations;
  ok = ok && b->greedy(b, n, ids, first, pos, steps, out, secs) && cache_stats(b, &end);
  if (ok) {
    const uint64_t used = b->device_used(b);
    peak = used > peak ? used : peak;
    r->decode_s = mean(secs, steps) * steps;
    r->step_ms = 1e3 * mean(secs, steps);
    r->decode_tps = (double)n * steps / r->decode_s;
    r->total_tps = (double)n * o->tp_gen / (r->prefill_s + r->decode_s);
    r->weight_bytes = b->weight_bytes;
    r->buffer_bytes = b->buffer_bytes;
    r->pool_bytes = end.pool_bytes;
    r->workspace_bytes = end.workspace_bytes;
    r->cache_used_bytes = (mid.used_bytes + end.used_bytes) / 2;
    r->peak_device_bytes = peak;
    r->expected_step_ms = 1e3 * (double)(weights_read(b) + r->cache_used_bytes) / (st->copy_gbs * 1e9);
    r->dense_ms = 1e3 * dense_s;
    r->host_ms = 1e3 * (b->step_host_seconds - host_before) / steps;
    r->host_max_ms = 1e3 * b->step_host_max_seconds;
    r->graph_updates = b->graph_updates - updates_before;
    r->graph_instantiations = b->graph_instantiations - instantiations_before;
    fprintf(stderr, "throughput %s %s: batch %u (planned %u), %.0f tokens/s decoding\n", model, setting, n, batch,
            r->decode_tps);
    st->graph_updates += b->graph_updates;
    st->graph_instantiations += b->graph_instantiations;
  }
  free(ids);
  free(first);
  free(pos);
  free(prompt);
  free(out);
  free(logits);
  free(secs);
  b->destroy(b);
  return ok;
}

/* ---- one model and setting ------------------------------------------------------------- */

static bool run_setting(bench_state *st, const char *model, const char *setting) {
  const bench_options *o = st->o;
  model_config m;
  minikv_config kv;
  minikv_config_default(&kv);
  if (!model_config_preset(model, &m) || !engine_parse_kv(setting, &kv)) return false;
  const model_source src = {NULL, o->seed};
  uint32_t max_ctx = o->throughput ? o->tp_prompt : 1;
  for (size_t i = 0; o->latency && i < o->n_contexts; ++i)
    if (o->contexts[i] > max_ctx) max_ctx = o->contexts[i];
  const backend_options opt = {1, max_ctx, 0, o->dtype, true, o->no_graphs, o->no_gemv, o->no_pdl};
  backend *b = backend_create(o->backend, &src, &m, &kv, max_ctx + o->warmup + o->gen + 1, &opt);
  if (!b) return false;
  if (st->copy_gbs == 0) {
    st->copy_gbs = b->copy_bandwidth(b);
    snprintf(st->device, sizeof st->device, "%s", b->device);
    st->fused_gemv = b->fused_gemv;
    st->gemv_pdl = b->gemv_pdl;
    printf("device %s, copy bandwidth %.0f GB/s (read + write)\n", st->device, st->copy_gbs);
  }
  if (o->latency && st->latency_header_for != model) {
    st->latency_header_for = model;
    printf("\nlatency, batch 1: ms per generated token (mean of %u steps after %u warm-up) vs the expectation\n"
           "(weight bytes + cache bytes read per step) / copy bandwidth. The step splits into its dense part\n"
           "(the same step without attention, timed alone) next to weights / bandwidth, and the rest (attention:\n"
           "libminikv's append + decode) next to cache bytes / bandwidth; kept = cached / seen positions; host:\n"
           "ms per step the host takes to record, capture, update and launch it (CUDA graphs; 0 on the CPU)\n"
           "  model      cache                  context prefill  ms/token  expected  ratio    dense weights     attn"
           "   cache   kept    host\n", o->gen, o->warmup);
  }
  bool ok = st->copy_gbs > 0;
  const double dense_ms = ok && o->latency ? 1e3 * b->dense_step_seconds(b, 1, 2 * o->gen) : 0.0;
  ok = ok && (!o->latency || dense_ms > 0);
  for (size_t i = 0; ok && o->latency && i < o->n_contexts; ++i)
    ok = latency_context(st, b, model, setting, o->contexts[i], dense_ms);
  uint64_t blocks = 0;
  const uint64_t weights = b->weight_bytes;
  ok = ok && (!o->throughput || blocks_per_sequence(st, b, &blocks));
  st->graph_updates += b->graph_updates;
  st->graph_instantiations += b->graph_instantiations;
  b->destroy(b);
  if (ok && o->throughput) {
    ok = throughput(st, &m, &src, &kv, model, setting, blocks, weights);
  }
  return ok;
}

/* ---- output ----------------------------------------------------------------------------- */

static void json_string(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; ++s) {
    if (*s == '"' || *s == '\\') fputc('\\', f);
    if ((unsigned char)*s >= 0x20) fputc(*s, f);
  }
  fputc('"', f);
}

static bool write_json(const bench_state *st, const char *path, const char *date) {
  const bench_options *o = st->o;
  FILE *f = fopen(path, "w");
  if (!f) return fail("cannot write %s", path);
  fprintf(f, "{\n  \"date\": \"%s\", \"device\": ", date);
  json_string(f, st->device);
  fprintf(f, ", \"commit\": ");
  json_string(f, o->commit);
  fprintf(f, ", \"backend\": \"%s\", \"dtype\": \"%s\",\n", o->backend, o->dtype == MINIKV_DTYPE_F16 ? "f16" : "bf16");
  fprintf(f, "  \"copy_GBps\": %.1f, \"minikv_version\": \"%s\", \"graph_updates\": %llu, \"graph_instantiations\": %llu,\n",
          st->copy_gbs, minikv_version_string(), (unsigned long long)st->graph_updates,
          (unsigned long long)st->graph_instantiations);
  fprintf(f, "  \"cuda_graphs\": %s, \"fused_gemv\": %s, \"gemv_pdl\": %s,\n", o->no_graphs ? "false" : "true",
          st->fused_gemv ? "true" : "false", st->gemv_pdl ? "true" : "false");
  fprintf(f, "  \"warmup_steps\": %u, \"timed_steps\": %u, \"throughput_prompt\": %u, \"throughput_gen\": %u, "
             "\"memory_limit_bytes\": %.0f,\n  \"latency\": [", o->warmup, o->gen, o->tp_prompt, o->tp_gen, o->memory_limit);
  for (size_t i = 0; i < st->n_lat; ++i) {
    const latency_row *r = &st->lat[i];
    fprintf(f, "%s\n    {\"model\": \"%s\", \"cache\": ", i ? "," : "", r->model);
    json_string(f, r->setting);
    fprintf(f, ", \"context\": %u, \"prefill_s\": %.4f, \"ms_per_token\": %.4f, \"ms_min\": %.4f, "
               "\"expected_ms\": %.4f, \"dense_ms\": %.4f, \"host_ms\": %.4f, \"weight_bytes\": %llu, \"cache_bytes\": %llu, "
               "\"tokens_cached\": %llu, \"tokens_seen\": %llu}",
            r->context, r->prefill_s, r->ms_per_token, r->ms_min, r->expected_ms, r->dense_ms, r->host_ms,
            (unsigned long long)r->weight_bytes, (unsigned long long)r->cache_bytes, (unsigned long long)r->tokens_cached,
            (unsigned long long)r->tokens_seen);
  }
  fprintf(f, "\n  ],\n  \"throughput\": [");
  for (size_t i = 0; i < st->n_tp; ++i) {
    const throughput_row *r = &st->tp[i];
    fprintf(f, "%s\n    {\"model\": \"%s\", \"cache\": ", i ? "," : "", r->model);
    json_string(f, r->setting);
    fprintf(f, ", \"fits\": %s, \"batch\": %u, \"batch_planned\": %u, \"blocks_per_sequence\": %llu, "
               "\"prefill_s\": %.3f, \"decode_s\": %.3f, \"decode_tokens_per_s\": %.1f, \"tokens_per_s\": %.1f, "
               "\"step_ms\": %.4f, \"expected_step_ms\": %.4f, \"dense_step_ms\": %.4f, \"host_ms\": %.4f, \"host_max_ms\": %.4f, "
               "\"graph_updates\": %llu, \"graph_instantiations\": %llu, \"weight_bytes\": %llu, \"buffer_bytes\": %llu, "
               "\"pool_bytes\": %llu, \"workspace_bytes\": %llu, \"cache_used_bytes\": %llu, \"peak_device_bytes\": %llu}",
            r->fits ? "true" : "false", r->batch, r->batch_planned, (unsigned long long)r->blocks_per_seq, r->prefill_s,
            r->decode_s, r->decode_tps, r->total_tps, r->step_ms, r->expected_step_ms, r->dense_ms, r->host_ms,
            r->host_max_ms, (unsigned long long)r->graph_updates, (unsigned long long)r->graph_instantiations,
            (unsigned long long)r->weight_bytes, (unsigned long long)r->buffer_bytes, (unsigned long long)r->pool_bytes,
            (unsigned long long)r->workspace_bytes, (unsigned long long)r->cache_used_bytes,
            (unsigned long long)r->peak_device_bytes);
  }
  fprintf(f, "\n  ]\n}\n");
  return fclose(f) == 0 || fail("writing %s failed", path);
}

int bench_main(int argc, char **argv) {
  for (int i = 1; i < argc; ++i)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      usage(stdout);
      return 0;
    }
  bench_options o;
  if (!parse_bench_args(argc, argv, &o)) {
    fprintf(stderr, "minikv-engine --bench: %s\n", last_error());
    usage(stderr);
    return 2;
  }
  bench_state *st = alloc_zeroed(1, sizeof *st, "benchmark state");
  if (!st) {
    fprintf(stderr, "minikv-engine --bench: %s\n", last_error());
    return 1;
  }
  st->o = &o;
  rng_seed(&st->rng, o.seed * 7919 + 17);
  char date[32];
  const time_t now = time(NULL);
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
  printf("minikv-engine --bench, %s, commit %s, libminikv %s, backend %s, %s\n", date, o.commit,
         minikv_version_string(), o.backend, o.dtype == MINIKV_DTYPE_F16 ? "f16" : "bf16");
  bool ok = true;
  for (size_t mi = 0; ok && mi < o.n_models; ++mi)
    for (size_t si = 0; ok && si < o.n_settings; ++si) ok = run_setting(st, o.models[mi], o.settings[si]);
  if (ok && o.throughput) {
    printf("\nthroughput: %u-token prompts + %u generated tokens each, at the largest batch within %.2f GB\n"
           "(step ms: mean decode step; dense: the same step without attention; weights+buffers+cache: what the\n"
           "engine allocates, within the limit; peak device: the whole GPU's use, CUDA context included; host: ms\n"
           "a step takes the host to record, capture and launch (mean, longest), and how many steps needed a new\n"
           "graph)\n"
           "  model      cache                  batch decode t/s  total t/s   step ms  expected    dense  weights+buffers+cache  peak device  prefill"
           "    host (longest)  new graphs\n",
           o.tp_prompt, o.tp_gen, o.memory_limit / 1e9);
    for (size_t i = 0; i < st->n_tp; ++i) {
      const throughput_row *r = &st->tp[i];
      if (!r->fits) {
        printf("  %-10s %-22s does not fit\n", r->model, r->setting);
        continue;
      }
      const double accounted = (double)(r->weight_bytes + r->buffer_bytes + r->pool_bytes + r->workspace_bytes);
      char peak[32] = "        -";
      if (r->peak_device_bytes) snprintf(peak, sizeof peak, "%8.2f GB", (double)r->peak_device_bytes / 1e9);
      printf("  %-10s %-22s %5u %10.0f %10.0f %9.2f %9.2f %8.2f   %17.2f GB  %s  %6.1f s  %6.2f (%6.2f)  %5llu/%llu\n", r->model,
             r->setting, r->batch, r->decode_tps, r->total_tps, r->step_ms, r->expected_step_ms, r->dense_ms,
             accounted / 1e9, peak, r->prefill_s, r->host_ms, r->host_max_ms, (unsigned long long)r->graph_instantiations,
             (unsigned long long)(r->graph_instantiations + r->graph_updates));
    }
  }
  if (ok && st->graph_updates + st->graph_instantiations > 0)
    printf("\ndecode steps replayed as CUDA graphs: %llu by updating an executable graph, %llu by a new one\n",
           (unsigned long long)st->graph_updates, (unsigned long long)st->graph_instantiations);
  if (ok && o.json) {
    ok = write_json(st, o.json, date);
    if (ok) printf("wrote %s\n", o.json);
  }
  if (!ok) fprintf(stderr, "minikv-engine --bench: %s\n", last_error());
  free(st);
  return ok ? 0 : 1;
}
