/* Pins the layout of the public structs and enums (the ABI callers compiled against
 * 0.1 rely on). Checked at compile time with C11 _Static_assert; a change here is an ABI
 * break: append fields instead, and bump the major version for anything else. */
#include <limits.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "minikv.h"

#define PIN_OFFSET(type, field, off) \
  _Static_assert(offsetof(type, field) == (off), #type "." #field " moved")

_Static_assert(sizeof(minikv_status) == 4, "enum size");
_Static_assert(sizeof(minikv_backend) == 4, "enum size");
_Static_assert(sizeof(minikv_dtype) == 4, "enum size");
_Static_assert(sizeof(minikv_budget_policy) == 4, "enum size");
_Static_assert(sizeof(minikv_score_mode) == 4, "enum size");

/* Offsets that do not depend on the alignment of 64-bit integers. */
PIN_OFFSET(minikv_config, struct_size, 0);
PIN_OFFSET(minikv_config, backend, 4);
PIN_OFFSET(minikv_config, device_id, 8);
PIN_OFFSET(minikv_config, dtype, 12);
PIN_OFFSET(minikv_config, num_layers, 16);
PIN_OFFSET(minikv_config, num_heads, 20);
PIN_OFFSET(minikv_config, num_kv_heads, 24);
PIN_OFFSET(minikv_config, head_dim, 28);
PIN_OFFSET(minikv_config, max_sequences, 32);
PIN_OFFSET(minikv_config, max_seq_len, 36);
PIN_OFFSET(minikv_config, max_tokens, 40);
PIN_OFFSET(minikv_config, heavy_ratio, 48);
PIN_OFFSET(minikv_config, recent_ratio, 52);
PIN_OFFSET(minikv_config, budget_policy, 56);
PIN_OFFSET(minikv_config, pyramid_depth, 60);
PIN_OFFSET(minikv_config, score_mode, 64);
PIN_OFFSET(minikv_config, window_size, 68);
PIN_OFFSET(minikv_config, pool_kernel, 72);
PIN_OFFSET(minikv_config, key_bits, 76);
PIN_OFFSET(minikv_config, value_bits, 80);
PIN_OFFSET(minikv_config, group_size, 84);
PIN_OFFSET(minikv_config, residual_length, 88);
PIN_OFFSET(minikv_config, reserved_v1_, 92);
PIN_OFFSET(minikv_config, sink_tokens, 96);
PIN_OFFSET(minikv_config, prefill_staging_tokens, 100);
PIN_OFFSET(minikv_config, flush_tokens, 104);
PIN_OFFSET(minikv_config, reserved_v3_, 108);

#if defined(__x86_64__) || defined(__aarch64__) || defined(__powerpc64__) || \
    (defined(__riscv) && __riscv_xlen == 64)
/* LP64 targets: 64-bit members are 8-aligned. */
_Static_assert(sizeof(minikv_config) == 112, "minikv_config size changed");
PIN_OFFSET(minikv_memory_stats, struct_size, 0);
PIN_OFFSET(minikv_memory_stats, pool_bytes, 8);
PIN_OFFSET(minikv_memory_stats, used_bytes, 16);
PIN_OFFSET(minikv_memory_stats, workspace_bytes, 24);
PIN_OFFSET(minikv_memory_stats, tokens_seen, 32);
PIN_OFFSET(minikv_memory_stats, tokens_cached, 40);
PIN_OFFSET(minikv_memory_stats, fp16_equivalent_bytes, 48);
PIN_OFFSET(minikv_memory_stats, compression_ratio, 56);
_Static_assert(sizeof(minikv_memory_stats) == 64, "minikv_memory_stats size changed");
#endif

int main(void) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  /* The library's own idea of the struct size must match the header's. */
  if (cfg.struct_size != sizeof(minikv_config)) {
    fprintf(stderr, "minikv_config_default wrote struct_size %u, header says %u\n",
            (unsigned)cfg.struct_size, (unsigned)sizeof(minikv_config));
    return 1;
  }
  /* A C enum object holds any int: minikv_status_string must take values the enum does not
   * name without undefined behaviour (a C++ enum-typed load of them is UB; clang's
   * -fsanitize=enum reports it). */
  {
    static const int unnamed[] = {9, 16, 255, 9999, -1, INT_MIN, INT_MAX};
    size_t i;
    for (i = 0; i < sizeof(unnamed) / sizeof(unnamed[0]); ++i) {
      const char *text = minikv_status_string((minikv_status)unnamed[i]);
      if (!text || strcmp(text, "unknown minikv_status") != 0) {
        fprintf(stderr, "minikv_status_string(%d) = \"%s\"\n", unnamed[i], text ? text : "(null)");
        return 1;
      }
    }
  }
  printf("abi layout: sizeof(minikv_config) %u, sizeof(minikv_memory_stats) %u\n",
         (unsigned)sizeof(minikv_config), (unsigned)sizeof(minikv_memory_stats));
  return 0;
}
