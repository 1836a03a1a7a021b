/* engine.c — see engine.h. */
#define _POSIX_C_SOURCE 200809L /* strtok_r */
#include "engine.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

minikv_config backend_cache_config(const model_config *m, const minikv_config *kv,
                                   const backend_options *opt, minikv_backend which,
                                   uint32_t max_seq_len) {
  minikv_config c = *kv;
  c.backend = which;
  c.dtype = opt->dtype;
  c.num_layers = m->n_layers;
  c.num_heads = m->n_heads;
  c.num_kv_heads = m->n_kv_heads;
  c.head_dim = m->head_dim;
  c.max_sequences = opt->max_batch;
  c.max_seq_len = max_seq_len;
  return c;
}

/* The backends this build has, for messages. */
static const char *built_backends(void) {
#if defined(ENGINE_WITH_CPU) && defined(ENGINE_WITH_CUDA)
  return "cpu and cuda";
#elif defined(ENGINE_WITH_CUDA)
  return "only cuda (no CBLAS was found for cpu)";
#else
  return "only cpu (configure libminikv with CUDA for cuda)";
#endif
}

backend *backend_create(const char *name, const model_source *src, const model_config *m,
                        const minikv_config *kv, uint32_t max_seq_len, const backend_options *opt) {
#ifdef ENGINE_WITH_CPU
  if (strcmp(name, "cpu") == 0) return backend_cpu_create(src, m, kv, max_seq_len, opt);
#endif
#ifdef ENGINE_WITH_CUDA
  if (strcmp(name, "cuda") == 0) return backend_cuda_create(src, m, kv, max_seq_len, opt);
#endif
  fail("backend %s: this build has %s", name, built_backends());
  return NULL;
}

uint64_t backend_buffer_bytes(const char *name, const model_config *m, const backend_options *opt) {
#ifdef ENGINE_WITH_CPU
  if (strcmp(name, "cpu") == 0) return backend_cpu_buffer_bytes(m, opt);
#endif
#ifdef ENGINE_WITH_CUDA
  if (strcmp(name, "cuda") == 0) return backend_cuda_buffer_bytes(m, opt);
#endif
  (void)m;
  (void)opt;
  return 0;
}

/* ---- cache settings ------------------------------------------------------------------- */

static bool parse_float(const char *v, float lo, float hi, float *out) {
  char *end;
  const double x = strtod(v, &end);
  if (*v == '\0' || *end != '\0' || !(x >= lo && x <= hi)) return false;
  *out = (float)x;
  return true;
}

static bool parse_uint(const char *v, uint64_t hi, uint64_t *out) {
  char *end;
  if (*v < '0' || *v > '9') return false;
  const unsigned long long x = strtoull(v, &end, 10);
  if (*end != '\0' || x > hi) return false;
  *out = x;
  return true;
}

/* libminikv's named settings (minikv_config_preset). */
static bool apply_preset(minikv_config *kv, const char *name) {
  static const struct { const char *name; minikv_preset preset; } presets[] = {
    {"balanced", MINIKV_PRESET_BALANCED}, {"paper", MINIKV_PRESET_PAPER},
    {"quality", MINIKV_PRESET_QUALITY}, {"eviction", MINIKV_PRESET_EVICTION_ONLY},
  };
  for (size_t i = 0; i < sizeof presets / sizeof presets[0]; ++i)
    if (strcmp(name, presets[i].name) == 0) return minikv_config_preset(kv, presets[i].preset) == MINIKV_OK;
  return false;
}

static bool apply_item(minikv_config *kv, const char *key, const char *val) {
  uint64_t u = 0;
  float f = 0;
  if (strcmp(key, "heavy") == 0 && parse_float(val, 0, 1, &f)) kv->heavy_ratio = f;
  else if (strcmp(key, "recent") == 0 && parse_float(val, 0, 1, &f)) kv->recent_ratio = f;
  else if (strcmp(key, "depth") == 0 && parse_float(val, 1, 1e6f, &f)) kv->pyramid_depth = f;
  else if (strcmp(key, "key_bits") == 0 && parse_uint(val, 64, &u)) kv->key_bits = (uint32_t)u;
  else if (strcmp(key, "value_bits") == 0 && parse_uint(val, 64, &u)) kv->value_bits = (uint32_t)u;
  else if (strcmp(key, "bits") == 0 && parse_uint(val, 64, &u)) kv->key_bits = kv->value_bits = (uint32_t)u;
  else if (strcmp(key, "group") == 0 && parse_uint(val, 1u << 20, &u)) kv->group_size = (uint32_t)u;
  else if (strcmp(key, "residual") == 0 && parse_uint(val, 1u << 20, &u)) kv->residual_length = (uint32_t)u;
  else if (strcmp(key, "flush") == 0 && parse_uint(val, 1u << 20, &u)) kv->flush_tokens = (uint32_t)u;
  else if (strcmp(key, "window") == 0 && parse_uint(val, 1u << 30, &u)) kv->window_size = (uint32_t)u;
  else if (strcmp(key, "pool") == 0 && parse_uint(val, 1u << 20, &u)) kv->pool_kernel = (uint32_t)u;
  else if (strcmp(key, "sinks") == 0 && parse_uint(val, 1u << 20, &u)) kv->sink_tokens = (uint32_t)u;
  else if (strcmp(key, "max_tokens") == 0 && parse_uint(val, UINT64_MAX, &u)) kv->max_tokens = u;
  else if (strcmp(key, "policy") == 0 && strcmp(val, "uniform") == 0) kv->budget_policy = MINIKV_BUDGET_UNIFORM;
  else if (strcmp(key, "policy") == 0 && strcmp(val, "pyramid") == 0) kv->budget_policy = MINIKV_BUDGET_PYRAMID;
  else if (strcmp(key, "score") == 0 && strcmp(val, "cumulative") == 0) kv->score_mode = MINIKV_SCORE_CUMULATIVE;
  else if (strcmp(key, "score") == 0 && strcmp(val, "window") == 0) kv->score_mode = MINIKV_SCORE_WINDOW;
  else return false;
  return true;
}

bool engine_parse_kv(const char *text, minikv_config *kv) {
  char buf[512];
  if (strlen(text) >= sizeof buf) return fail("--kv: setting too long");
  strcpy(buf, text);
  char *save = NULL;
  bool first = true;
  for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save), first = false) {
    if (first && strcmp(item, "full") == 0) {
      kv->key_bits = kv->value_bits = 16;
      kv->heavy_ratio = 1.0f; /* every prompt token is a heavy hitter: nothing is evicted */
      kv->recent_ratio = 0.0f;
      kv->sink_tokens = 0;
      kv->residual_length = 128; /* 128-token blocks, appended whole: nothing moves */
      kv->flush_tokens = 0;
      continue;
    }
    if (first && strcmp(item, "minikv") == 0) continue; /* the library's defaults */
    if (first && apply_preset(kv, item)) continue;
    char *eq = strchr(item, '=');
    if (!eq) return fail("--kv: \"%s\" is neither a setting (full, minikv, balanced, paper, quality, "
                         "eviction) nor field=value", item);
    *eq = '\0';
    if (!apply_item(kv, item, eq + 1))
      return fail("--kv: bad item %s=%s (fields: heavy, recent, key_bits, value_bits, bits, "
                  "group, residual, flush, sinks, policy=uniform|pyramid, depth, score=cumulative|window, "
                  "window, pool, max_tokens)", item, eq + 1);
  }
  return true;
}

const char *engine_describe_kv(const minikv_config *kv, char *buf, size_t size) {
  if (kv->key_bits == 16 && kv->value_bits == 16 && kv->heavy_ratio + kv->recent_ratio >= 1.0f)
    snprintf(buf, size, "full 16-bit cache (every token kept)");
  else
    snprintf(buf, size, "MiniKV %u-bit keys, %u-bit values, group %u, residual %u (flush %u); heavy %.2f + "
             "recent %.2f of the prompt, %u sinks, %s budgets, %s scores",
             kv->key_bits, kv->value_bits, kv->group_size, kv->residual_length,
             (unsigned)engine_flush_tokens(kv),
             (double)kv->heavy_ratio, (double)kv->recent_ratio, kv->sink_tokens,
             kv->budget_policy == MINIKV_BUDGET_PYRAMID ? "pyramid" : "uniform",
             kv->score_mode == MINIKV_SCORE_WINDOW ? "window" : "cumulative");
  return buf;
}

/* ---- scheduling ----------------------------------------------------------------------- */

typedef struct run_state {
  backend *b;
  request *reqs;
  sampler *smp;
  const engine_hooks *hooks;
  uint64_t pool_blocks, reserved_blocks;
  uint32_t max_seq_len;
  int64_t finished;  /* sequences that have left */
  uint32_t *running; /* request indices, in admission order */
  uint32_t n_running;
  bool *slot_used;
  float *logits;     /* [max_batch, n_vocab] */
  int32_t *tokens, *positions;
  uint32_t *seq_ids;
  engine_stats *stats;
} run_state;

static void finish(run_state *st, uint32_t r) {
  request *q = &st->reqs[r];
  ++st->finished;
  q->state = REQUEST_DONE;
  q->t_done = now_seconds();
  st->slot_used[q->slot] = false;
  st->reserved_blocks -= q->reserved_blocks;
}

/* Records token `tok` for request r; true when r is finished after it. */
static bool emit(run_state *st, uint32_t r, int32_t tok, const float *logits) {
  request *q = &st->reqs[r];
  const engine_hooks *h = st->hooks;
  if (h->on_logits) h->on_logits(h->ctx, r, logits);
  q->tokens[q->n_tokens++] = tok;
  if (q->n_tokens == 1) q->t_first_token = now_seconds();
  if (h->on_token) h->on_token(h->ctx, r, tok);
  q->ended_by_token = h->is_end && h->is_end(h->ctx, tok);
  /* The last position a sequence can hold is max_seq_len - 1: a token chosen there can
     not be fed back. */
  return q->ended_by_token || q->n_tokens >= q->max_new_tokens ||
         (uint64_t)q->position >= st->max_seq_len;
}

/* Keeps the cache statistics of the moment the cache holds the most bytes. */
static void note_peak(run_state *st) {
  minikv_memory_stats ms;
  memset(&ms, 0, sizeof ms);
  ms.struct_size = sizeof ms;
  if (minikv_memory_stats_get(st->b->cache, &ms) == MINIKV_OK && ms.used_bytes >= st->stats->peak.used_bytes)
    st->stats->peak = ms;
}

/* Whether the pool holds q's reservation next to the running sequences' ones. */
static bool room_for(const run_state *st, const request *q) {
  return st->pool_blocks == 0 || st->reserved_blocks + q->reserved_blocks <= st->pool_blocks;
}

/* The pool cannot take request r now: it waits for a sequence to leave, or, when none is
   running, is refused (it could never fit). `why`: libminikv's message, or NULL when r's
   reservation is what does not fit. */
static int cannot_fit(run_state *st, uint32_t r, const char *why) {
  request *q = &st->reqs[r];
  char need[160];
  if (!why) {
    snprintf(need, sizeof need, "it needs %llu blocks of %u tokens, the pool has %llu",
             (unsigned long long)q->reserved_blocks, st->b->kv.residual_length,
             (unsigned long long)st->pool_blocks);
    why = need;
  }
  if (st->n_running == 0) {
    q->state = REQUEST_REFUSED;
    snprintf(q->refusal, sizeof q->refusal,
             "the cache cannot hold this sequence even alone (prompt %zu + %u new tokens): %s",
             q->prompt_len, q->max_new_tokens, why);
  } else {
    ++st->stats->deferred;
    q->retry_after = st->finished; /* not before another sequence has left */
  }
  return 0;
}

/* Prefills request r into a free slot. Returns 1 when it runs, 0 when it waits or was
   refused, -1 on a failure. */
static int admit(run_state *st, uint32_t r) {
  backend *b = st->b;
  request *q = &st->reqs[r];
  if (q->prompt_len == 0 || q->prompt_len >= st->max_seq_len || q->prompt_len > b->opt.max_prompt_tokens) {
    q->state = REQUEST_REFUSED;
    snprintf(q->refusal, sizeof q->refusal, "prompt of %zu tokens: 1 to %u fit (max_seq_len %u, "
             "prefill buffers %u)", q->prompt_len, st->max_seq_len - 1, st->max_seq_len,
             b->opt.max_prompt_tokens);
    return 0;
  }
  /* Deferred before: no new attempt until a sequence has left, nor while the room it was
     found to need is still taken. */
  if (q->retry_after >= 0 && st->finished <= q->retry_after) return 0;
  if (q->reserved_blocks && !room_for(st, q)) return st->n_running > 0 ? 0 : cannot_fit(st, r, NULL);

  uint32_t slot = 0;
  while (st->slot_used[slot]) ++slot;
  const int32_t cu[2] = {0, (int32_t)q->prompt_len};
  const double t0 = now_seconds();
  if (!b->prefill(b, 1, &slot, cu, q->prompt, st->logits)) {
    if (b->status != MINIKV_ERR_CAPACITY_EXCEEDED) return -1;
    char why[256];
    snprintf(why, sizeof why, "%s", last_error());
    if (!b->release(b, slot)) return -1; /* the layers it did prefill */
    return cannot_fit(st, r, why);
  }

  /* Room for everything it may still generate, next to the others' reservations. */
  uint64_t appends = q->max_new_tokens;
  if (appends > st->max_seq_len - q->prompt_len) appends = st->max_seq_len - q->prompt_len;
  q->reserved_blocks = 0;
  for (uint32_t l = 0; l < b->model.n_layers; ++l) {
    uint64_t cached = 0;
    if (minikv_sequence_length(b->cache, slot, l, NULL, &cached) != MINIKV_OK) {
      fail("minikv_sequence_length: %s", minikv_last_error_message());
      return -1;
    }
    q->reserved_blocks += engine_blocks_at_end(&b->kv, q->prompt_len, cached, appends);
  }
  if (!room_for(st, q)) {
    if (!b->release(b, slot)) return -1;
    return cannot_fit(st, r, NULL);
  }
  st->stats->prefill_seconds += now_seconds() - t0;
  st->stats->prefill_tokens += q->prompt_len;
  st->reserved_blocks += q->reserved_blocks;
  st->slot_used[slot] = true;
  q->slot = slot;
  q->state = REQUEST_RUNNING;
  q->position = (int32_t)q->prompt_len;
  st->running[st->n_running++] = r;
  note_peak(st);
  const int32_t tok = sampler_pick(st->smp, st->logits, b->model.n_vocab);
  if (tok < 0) return -1;
  if (emit(st, r, tok, st->logits)) {
    finish(st, r);
    --st->n_running;
    if (!b->release(b, slot)) return -1;
  }
  return 1;
}

static bool decode_step(run_state *st) {
  backend *b = st->b;
  const uint32_t n = st->n_running;
  for (uint32_t i = 0; i < n; ++i) {
    request *q = &st->reqs[st->running[i]];
    st->seq_ids[i] = q->slot;
    st->tokens[i] = q->tokens[q->n_tokens - 1];
    st->positions[i] = q->position;
  }
  const double t0 = now_seconds();
  if (!b->decode(b, n, st->seq_ids, st->tokens, st->positions, st->logits)) return false;
  st->stats->decode_seconds += now_seconds() - t0;
  st->stats->decode_steps += 1;
  note_peak(st);
  st->stats->decoded_tokens += n;
  if (n > st->stats->max_running) st->stats->max_running = n;
  uint32_t kept = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = st->running[i];
    request *q = &st->reqs[r];
    q->position += 1;
    const float *row = st->logits + (size_t)i * b->model.n_vocab;
    const int32_t tok = sampler_pick(st->smp, row, b->model.n_vocab);
    if (tok < 0) return false;
    if (emit(st, r, tok, row)) {
      finish(st, r);
      if (!b->release(b, q->slot)) return false;
    } else {
      st->running[kept++] = r;
    }
  }
  st->n_running = kept;
  return true;
}

bool engine_run(backend *b, request *reqs, size_t n, sampler *smp, const engine_hooks *hooks,
                engine_stats *stats) {
  static const engine_hooks no_hooks = {NULL, NULL, NULL, NULL};
  const uint32_t B = b->opt.max_batch, R = b->kv.residual_length;
  /* max_tokens counts whole blocks of R tokens; 0 = room for every slot at max_seq_len */
  const uint64_t pool_blocks = (b->kv.max_tokens + R - 1) / R;
  run_state st = {b, reqs, smp, hooks ? hooks : &no_hooks, pool_blocks, 0, b->kv.max_seq_len, 0,
                  NULL, 0, NULL, NULL, NULL, NULL, NULL, stats};
  memset(stats, 0, sizeof *stats);
  st.running = alloc_zeroed(B, sizeof *st.running, "scheduler");
  st.slot_used = alloc_zeroed(B, sizeof *st.slot_used, "scheduler");
  st.logits = alloc_zeroed((size_t)B * b->model.n_vocab, sizeof *st.logits, "logits");
  st.tokens = alloc_zeroed(B, sizeof *st.tokens, "scheduler");
  st.positions = alloc_zeroed(B, sizeof *st.positions, "scheduler");
  st.seq_ids = alloc_zeroed(B, sizeof *st.seq_ids, "scheduler");
  bool ok = st.running && st.slot_used && st.logits && st.tokens && st.positions && st.seq_ids;
  for (size_t i = 0; ok && i < n; ++i) {
    reqs[i].state = REQUEST_WAITING;
    reqs[i].n_tokens = 0;
    reqs[i].refusal[0] = '\0';
    reqs[i].retry_after = -1;
    reqs[i].reserved_blocks = 0;
    reqs[i].t_submit = now_seconds();
    reqs[i].tokens = alloc_zeroed(reqs[i].max_new_tokens ? reqs[i].max_new_tokens : 1, sizeof(int32_t), "generated tokens");
    ok = reqs[i].tokens != NULL;
    if (reqs[i].max_new_tokens == 0) {
      reqs[i].state = REQUEST_DONE;
      reqs[i].t_done = reqs[i].t_submit;
    }
  }
  size_t next = 0;
  while (ok && (next < n || st.n_running > 0)) {
    /* Admit waiting requests while there is a free slot; stop at the first that waits. */
    while (ok && next < n && st.n_running < B) {
      if (reqs[next].state != REQUEST_WAITING) {
        ++next;
        continue;
      }
      const int a = admit(&st, (uint32_t)next);
      if (a < 0) ok = false;
      else if (a > 0 || reqs[next].state == REQUEST_REFUSED) ++next;
      else if (st.n_running == 0) ok = fail("internal: request %zu waits with nothing running", next);
      else break; /* waits for a running sequence to leave */
    }
    if (ok && st.n_running > 0) ok = decode_step(&st);
  }
  free(st.running);
  free(st.slot_used);
  free(st.logits);
  free(st.tokens);
  free(st.positions);
  free(st.seq_ids);
  return ok;
}

void engine_free_requests(request *reqs, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    free(reqs[i].tokens);
    reqs[i].tokens = NULL;
  }
}
