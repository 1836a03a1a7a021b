/* The public header compiled as strict C99 (-std=c99 -Wall -Wextra -pedantic -Werror):
 * no C++ or CUDA in it, every type and call usable from C. Runs a create/destroy. */
#include "minikv.h"
#include "minikv.h" /* include guard */

#include <stdio.h>
#include <string.h>

int main(void) {
  minikv_config cfg;
  minikv_memory_stats stats;
  minikv_cache *cache = NULL;
  minikv_status st;
  minikv_backend be = MINIKV_BACKEND_CPU;
  minikv_dtype dt = MINIKV_DTYPE_F32;
  minikv_budget_policy bp = MINIKV_BUDGET_PYRAMID;
  minikv_score_mode sm = MINIKV_SCORE_WINDOW;

  minikv_config_default(&cfg);
  cfg.backend = be;
  cfg.dtype = dt;
  cfg.budget_policy = bp;
  cfg.score_mode = sm;
  cfg.num_layers = 1;
  cfg.num_heads = 2;
  cfg.num_kv_heads = 1;
  cfg.head_dim = 64;
  cfg.max_seq_len = 256;
  st = minikv_cache_create(&cfg, &cache);
  if (st != MINIKV_OK) {
    fprintf(stderr, "create: %s: %s\n", minikv_status_string(st), minikv_last_error_message());
    return 1;
  }
  memset(&stats, 0, sizeof(stats));
  stats.struct_size = (uint32_t)sizeof(stats);
  st = minikv_memory_stats_get(cache, &stats);
  if (st != MINIKV_OK || stats.pool_bytes == 0 || stats.used_bytes != 0) {
    fprintf(stderr, "stats: %s\n", minikv_cache_last_error(cache));
    minikv_cache_destroy(cache);
    return 1;
  }
  minikv_cache_destroy(cache);
  if (minikv_version_number() != MINIKV_VERSION_NUMBER) {
    fprintf(stderr, "header %d, library %u\n", MINIKV_VERSION_NUMBER,
            (unsigned)minikv_version_number());
    return 1;
  }
  printf("headertest (C99): libminikv %s OK\n", minikv_version_string());
  return 0;
}
