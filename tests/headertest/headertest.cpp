// The public header compiled as C++ (-Wall -Wextra -pedantic -Werror): extern "C" guards,
// no C-only constructs; enums and structs usable from C++.
#include "minikv.h"

#include <cstdio>
#include <type_traits>

static_assert(std::is_standard_layout<minikv_config>::value, "minikv_config must be POD");
static_assert(std::is_trivially_copyable<minikv_config>::value, "minikv_config must be POD");
static_assert(std::is_standard_layout<minikv_memory_stats>::value, "stats must be POD");

int main() {
  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.backend = MINIKV_BACKEND_CPU;
  cfg.num_layers = 1;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 128;
  cfg.max_seq_len = 256;
  minikv_cache *cache = nullptr;
  const minikv_status st = minikv_cache_create(&cfg, &cache);
  if (st != MINIKV_OK) {
    std::fprintf(stderr, "create: %s\n", minikv_last_error_message());
    return 1;
  }
  minikv_cache_destroy(cache);
  std::printf("headertest (C++): libminikv %s OK\n", minikv_version_string());
  return minikv_version_number() == MINIKV_VERSION_NUMBER ? 0 : 1;
}
