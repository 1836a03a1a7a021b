/* A tiny program built against an installed libminikv (pkg-config and find_package):
 * create, prefill one short prompt, decode, stats, destroy, version check. */
#include <minikv.h>

#include <stdio.h>

#define D 64

int main(void) {
  minikv_config cfg;
  minikv_cache *cache = NULL;
  minikv_status st;
  float q[4 * D], k[4 * D], v[4 * D], out[4 * D];
  uint32_t seq = 0;
  int32_t cu[2] = {0, 4};
  int i;
  minikv_memory_stats stats;

  if (!MINIKV_VERSION_COMPATIBLE(minikv_version_number())) {
    fprintf(stderr, "header version %d but library %u\n", MINIKV_VERSION_NUMBER,
            (unsigned)minikv_version_number());
    return 1;
  }
  minikv_config_default(&cfg);
  cfg.backend = MINIKV_BACKEND_CPU;
  cfg.dtype = MINIKV_DTYPE_F32;
  cfg.num_layers = 1;
  cfg.num_heads = 1;
  cfg.num_kv_heads = 1;
  cfg.head_dim = D;
  cfg.max_seq_len = 64;
  st = minikv_cache_create(&cfg, &cache);
  if (st != MINIKV_OK) {
    fprintf(stderr, "create: %s\n", minikv_last_error_message());
    return 1;
  }
  for (i = 0; i < 4 * D; ++i) {
    q[i] = (float)(i % 7) * 0.1f;
    k[i] = (float)(i % 5) * 0.1f;
    v[i] = 1.0f; /* attention of constant values is that constant */
  }
  st = minikv_prefill(cache, 0, 1, &seq, cu, q, k, v, out, NULL);
  if (st == MINIKV_OK) st = minikv_decode(cache, 0, 1, &seq, q, out, NULL);
  if (st != MINIKV_OK || out[0] < 0.999f || out[0] > 1.001f) {
    fprintf(stderr, "prefill/decode: %s (out[0] = %g)\n", minikv_cache_last_error(cache),
            (double)out[0]);
    minikv_cache_destroy(cache);
    return 1;
  }
  stats.struct_size = (uint32_t)sizeof(stats);
  st = minikv_memory_stats_get(cache, &stats);
  minikv_cache_destroy(cache);
  if (st != MINIKV_OK || stats.tokens_seen != 4) {
    fprintf(stderr, "stats failed\n");
    return 1;
  }
  printf("consumer OK: libminikv %s\n", minikv_version_string());
  return 0;
}
