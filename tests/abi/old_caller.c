/* A program built against the 0.1.0 header, run against this library: it declares the
 * first version of minikv_config and the 0.1 entry points itself (no #include of today's
 * minikv.h), puts a canary right after its struct, and checks that the library fills only
 * the fields it has and creates a cache from them. Fails on a library whose
 * minikv_config_default writes its own, larger sizeof. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct old_config { /* minikv.h 0.1.0, verbatim field order */
  uint32_t struct_size;
  int32_t backend;
  int32_t device_id;
  int32_t dtype;
  uint32_t num_layers, num_heads, num_kv_heads, head_dim;
  uint32_t max_sequences, max_seq_len;
  uint64_t max_tokens;
  float heavy_ratio, recent_ratio;
  int32_t budget_policy;
  float pyramid_depth;
  int32_t score_mode;
  uint32_t window_size, pool_kernel, key_bits, value_bits, group_size, residual_length;
  /* 4 bytes of tail padding (the uint64 field aligns the struct to 8) */
} old_config;

void minikv_config_default(old_config *cfg);
int minikv_cache_create(const old_config *cfg, void **out);
void minikv_cache_destroy(void *cache);
const char *minikv_last_error_message(void);

int main(void) {
  struct {
    old_config cfg;
    unsigned char canary[256];
  } frame;
  void *cache = NULL;
  size_t i;
  int st;
  _Static_assert(sizeof(old_config) == 96, "the 0.1.0 minikv_config is 96 bytes");
  memset(&frame, 0xA5, sizeof(frame));
  minikv_config_default(&frame.cfg);
  for (i = 0; i < sizeof(frame.canary); ++i) {
    if (frame.canary[i] != 0xA5) {
      fprintf(stderr, "minikv_config_default wrote byte %zu past the 0.1 struct\n", i);
      return 1;
    }
  }
  /* The library's current defaults (MINIKV_PRESET_BALANCED), first-version fields only. */
  if (frame.cfg.struct_size != sizeof(old_config) || frame.cfg.key_bits != 4 ||
      frame.cfg.group_size != 32 || frame.cfg.residual_length != 128) {
    fprintf(stderr, "0.1 defaults wrong: struct_size %u key_bits %u group_size %u\n",
            frame.cfg.struct_size, frame.cfg.key_bits, frame.cfg.group_size);
    return 1;
  }
  frame.cfg.backend = 1; /* CPU */
  frame.cfg.num_layers = 2;
  frame.cfg.num_heads = 4;
  frame.cfg.num_kv_heads = 2;
  frame.cfg.head_dim = 64;
  st = minikv_cache_create(&frame.cfg, &cache);
  if (st != 0 || cache == NULL) {
    fprintf(stderr, "create from a 0.1 struct failed (%d): %s\n", st,
            minikv_last_error_message());
    return 1;
  }
  minikv_cache_destroy(cache);
  puts("old caller: 0.1 struct filled without overflow, cache created");
  return 0;
}
