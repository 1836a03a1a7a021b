/*
 * engine.h — continuous batching of generation requests over a backend.
 *
 * Requests wait in a queue; between decode steps the engine admits the next ones while
 * the cache has a free slot and room, and sequences leave when they end (an end token,
 * their token budget, or max_seq_len). Admission is where a full cache is handled: a
 * request is prefilled, and if libminikv answers MINIKV_ERR_CAPACITY_EXCEEDED, or the pool
 * could not also hold the tokens it may still generate next to what the running
 * sequences may still generate, it is released again and waits for a sequence to leave —
 * or, when nothing else is running, it is refused with the reason. So a running sequence
 * never meets a full pool halfway through a decode step (where some layers would hold the
 * token and others not).
 *
 * The room a sequence needs: libminikv stores each (sequence, layer)'s tokens in blocks of
 * residual_length (minikv.h: max_tokens counts whole blocks), but its sinks and the tokens
 * in its 16-bit residual lie outside them; engine_blocks_at_end counts what a sequence
 * holds at its end.
 */
#ifndef ENGINE_ENGINE_H
#define ENGINE_ENGINE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "backend.h"
#include "pool_blocks.h"
#include "sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum request_state {
  REQUEST_WAITING, REQUEST_RUNNING, REQUEST_DONE, REQUEST_REFUSED
} request_state;

typedef struct request {
  /* in */
  const int32_t *prompt;
  size_t prompt_len;
  uint32_t max_new_tokens;
  /* out */
  request_state state;
  int32_t *tokens;        /* generated tokens (the engine allocates; free with engine_free_requests) */
  size_t n_tokens;
  bool ended_by_token;    /* an end-of-sequence token ended it */
  char refusal[512];      /* why a REFUSED request could not run */
  double t_submit, t_first_token, t_done; /* now_seconds() */
  /* engine-internal */
  uint32_t slot;
  int32_t position;       /* of the next token fed */
  uint64_t reserved_blocks; /* pool blocks it may need to its end (once known) */
  int64_t retry_after;      /* deferred: wait until more sequences than this have left */
} request;

typedef struct engine_hooks {
  /* each generated token, as soon as it is chosen */
  void (*on_token)(void *ctx, size_t request_index, int32_t token);
  /* the logits each generated token was chosen from (n_vocab floats) */
  void (*on_logits)(void *ctx, size_t request_index, const float *logits);
  /* is this token an end of sequence? (NULL: never) */
  bool (*is_end)(void *ctx, int32_t token);
  void *ctx;
} engine_hooks;

typedef struct engine_stats {
  uint32_t max_running;   /* most sequences decoded together */
  uint64_t decode_steps, decoded_tokens, prefill_tokens;
  double prefill_seconds, decode_seconds;
  uint32_t deferred;      /* admissions put off because the cache was full */
  minikv_memory_stats peak; /* the cache's statistics when it held the most bytes */
} engine_stats;

/* Runs every request to completion (or refusal) on the backend's cache (its max_seq_len,
   and its max_tokens as the pool's capacity; 0 = every slot can reach max_seq_len). False
   with a message only for failures other than a full cache. */
bool engine_run(backend *b, request *reqs, size_t n, sampler *smp, const engine_hooks *hooks,
                engine_stats *stats);

void engine_free_requests(request *reqs, size_t n);

/* Parses a cache setting into *kv (which must hold minikv_config_default's values):
     "full"      16-bit keys and values, every token kept, no sinks (exact attention);
     "minikv"    libminikv's defaults;
     "balanced", "paper", "quality", "eviction"  libminikv's presets (minikv_config_preset);
   any of them followed by ",field=value" items, or items alone (over the defaults):
     heavy, recent, key_bits, value_bits, bits (both), group, residual, flush, sinks, policy
     (uniform|pyramid), depth, score (cumulative|window), window, pool, max_tokens.
   False with a message naming the bad item. */
bool engine_parse_kv(const char *text, minikv_config *kv);
/* A one-line description of a cache setting. */
const char *engine_describe_kv(const minikv_config *kv, char *buf, size_t size);

#ifdef __cplusplus
}
#endif

#endif /* ENGINE_ENGINE_H */
