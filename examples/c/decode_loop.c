/* decode_loop.c — the calls an inference engine makes to libminikv, in order:
 *   1. create a cache for the model's shape;
 *   2. prefill a batch of prompts of different lengths, layer by layer;
 *   3. generate: per step and layer, append the new token's K/V, then decode its query;
 *   4. read what the cache holds; 5. handle errors; release a finished sequence so its slot
 *   takes a new prompt (continuous batching); destroy.
 * The model is a stand-in (fill() makes its Q/K/V). CPU backend, float32 host buffers; for
 * the CUDA backend pass device pointers and a cudaStream_t instead (the calls are the same).
 *   cc decode_loop.c $(pkg-config --cflags --libs minikv) -o decode_loop && ./decode_loop */
#include <minikv.h>

#include <stdio.h>
#include <stdlib.h>

enum { LAYERS = 4, HEADS = 8, KV_HEADS = 2, HEAD_DIM = 64, STEPS = 48 };
enum { N_SEQS = 3, Q_ROW = HEADS * HEAD_DIM, KV_ROW = KV_HEADS * HEAD_DIM };

/* Stand-in for the model's projections: n deterministic values in [-1, 1). */
static void fill(float *x, size_t n, uint32_t *state) {
  for (size_t i = 0; i < n; ++i) {
    *state = *state * 1664525u + 1013904223u;
    x[i] = (float)(*state >> 8) / (float)(1u << 23) - 1.0f;
  }
}

/* A failed call: the status and the library's detail, which names the argument. */
static int report(const char *call, minikv_status st, const minikv_cache *cache) {
  fprintf(stderr, "%s: %s\n  %s\n", call, minikv_status_string(st),
          cache ? minikv_cache_last_error(cache) : minikv_last_error_message());
  return 1;
}

/* Prefills prompts `seq_ids` (lengths from cu_seqlens) in every layer. */
static minikv_status prefill_all(minikv_cache *cache, uint32_t n, const uint32_t *seq_ids,
                                 const int32_t *cu_seqlens, uint32_t *rng) {
  const size_t tokens = (size_t)cu_seqlens[n];
  float *q = malloc(tokens * Q_ROW * sizeof *q), *out = malloc(tokens * Q_ROW * sizeof *out);
  float *k = malloc(tokens * KV_ROW * sizeof *k), *v = malloc(tokens * KV_ROW * sizeof *v);
  minikv_status st = q && k && v && out ? MINIKV_OK : MINIKV_ERR_OUT_OF_MEMORY;
  for (uint32_t layer = 0; layer < LAYERS && st == MINIKV_OK; ++layer) {
    fill(q, tokens * Q_ROW, rng);  /* this layer's Q/K/V of every prompt token, packed */
    fill(k, tokens * KV_ROW, rng); /* back to back: [tokens, heads, head_dim] */
    fill(v, tokens * KV_ROW, rng);
    st = minikv_prefill(cache, layer, n, seq_ids, cu_seqlens, q, k, v, out, NULL);
    /* out: the prompts' attention output, the input of the layer's output projection */
  }
  free(q); free(k); free(v); free(out);
  return st;
}

int main(void) {
  if (!MINIKV_VERSION_COMPATIBLE(minikv_version_number())) {
    fprintf(stderr, "compiled against libminikv %d.%d.%d, loaded %s\n", MINIKV_VERSION_MAJOR,
            MINIKV_VERSION_MINOR, MINIKV_VERSION_PATCH, minikv_version_string());
    return 1;
  }
  /* 1. Create: the defaults keep 25% heavy hitters + 25% recent window + 4 sinks of each
   *    prompt at 4-bit keys and 2-bit values (MINIKV_PRESET_BALANCED); set the model's
   *    shape and the capacity. */
  minikv_config cfg;
  minikv_config_default(&cfg);
  /* minikv_config_preset(&cfg, MINIKV_PRESET_PAPER);   the MiniKV paper's exact setting */
  cfg.backend = MINIKV_BACKEND_CPU;
  cfg.dtype = MINIKV_DTYPE_F32;
  cfg.num_layers = LAYERS;
  cfg.num_heads = HEADS;
  cfg.num_kv_heads = KV_HEADS;
  cfg.head_dim = HEAD_DIM;
  cfg.max_sequences = N_SEQS;
  cfg.max_seq_len = 2048;
  minikv_cache *cache = NULL;
  minikv_status st = minikv_cache_create(&cfg, &cache);
  if (st != MINIKV_OK) return report("minikv_cache_create", st, NULL);

  /* 2. Prefill three prompts of 700, 300 and 500 tokens in one batch. */
  uint32_t rng = 42;
  const uint32_t seq_ids[N_SEQS] = {0, 1, 2};
  const int32_t cu_seqlens[N_SEQS + 1] = {0, 700, 1000, 1500};
  st = prefill_all(cache, N_SEQS, seq_ids, cu_seqlens, &rng);
  if (st != MINIKV_OK) return report("minikv_prefill", st, cache);

  /* 3. Generate: one token per sequence and step. In each layer the new token's K/V go in
   *    first, then its query attends to the whole cached context, itself included. */
  float q1[N_SEQS * Q_ROW], k1[N_SEQS * KV_ROW], v1[N_SEQS * KV_ROW], o1[N_SEQS * Q_ROW];
  for (int step = 0; step < STEPS; ++step) {
    for (uint32_t layer = 0; layer < LAYERS; ++layer) {
      fill(q1, N_SEQS * Q_ROW, &rng);
      fill(k1, N_SEQS * KV_ROW, &rng);
      fill(v1, N_SEQS * KV_ROW, &rng);
      st = minikv_append(cache, layer, N_SEQS, seq_ids, k1, v1, NULL);
      if (st == MINIKV_OK) st = minikv_decode(cache, layer, N_SEQS, seq_ids, q1, o1, NULL);
      if (st == MINIKV_ERR_CAPACITY_EXCEEDED) {
        /* The pool is full and nothing changed: an engine preempts or releases a sequence
         * (minikv_sequence_release) and retries. Not reached with this capacity. */
      }
      if (st != MINIKV_OK) return report("minikv_append/minikv_decode", st, cache);
    }
  }

  /* 4. What the cache holds: tokens seen vs kept, per sequence (layer 0 here; every layer
   *    keeps the same share under the default UNIFORM budgets), and the memory against an
   *    fp16 cache of every token. */
  for (uint32_t s = 0; s < N_SEQS; ++s) {
    uint64_t seen = 0, cached = 0;
    minikv_sequence_length(cache, seq_ids[s], 0, &seen, &cached);
    printf("sequence %u, layer 0: %llu tokens seen, %llu kept\n", (unsigned)seq_ids[s],
           (unsigned long long)seen, (unsigned long long)cached);
  }
  minikv_memory_stats ms = {.struct_size = sizeof ms};
  st = minikv_memory_stats_get(cache, &ms);
  if (st != MINIKV_OK) return report("minikv_memory_stats_get", st, cache);
  printf("%llu of %llu tokens kept in %.1f KiB: %.1f%% smaller than an fp16 cache\n",
         (unsigned long long)ms.tokens_cached, (unsigned long long)ms.tokens_seen,
         (double)ms.used_bytes / 1024.0, 100.0 * ms.compression_ratio);

  /* 5. Errors: a call that fails says why and changes nothing. A second prefill of a
   *    (sequence, layer) is a state error... */
  st = prefill_all(cache, 1, &seq_ids[1], (const int32_t[]){0, 100}, &rng);
  printf("prefill of a busy slot: %s\n  %s\n", minikv_status_string(st),
         minikv_cache_last_error(cache));
  if (st != MINIKV_ERR_BAD_STATE) return report("expected MINIKV_ERR_BAD_STATE", st, cache);
  /* ...until the sequence is released: its slot then takes a new prompt. */
  st = minikv_sequence_release(cache, seq_ids[1]);
  if (st == MINIKV_OK) st = prefill_all(cache, 1, &seq_ids[1], (const int32_t[]){0, 100}, &rng);
  if (st != MINIKV_OK) return report("release + prefill", st, cache);
  printf("slot %u released and refilled with a 100-token prompt\n", (unsigned)seq_ids[1]);

  minikv_cache_destroy(cache);
  return 0;
}
