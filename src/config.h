// Configuration: defaults, size-tolerant copy-in of the caller's struct, validation.
#pragma once

#include <cstddef>
#include <cstdint>

#include "minikv.h"

namespace minikv {

// Size of the first published minikv_config: callers may not pass less.
constexpr uint32_t kConfigSizeV1 = sizeof(minikv_config);
constexpr uint32_t kStatsSizeV1 = sizeof(minikv_memory_stats);

void config_default(minikv_config *cfg);

// Copies the caller's struct (struct_size bytes of it), fills fields the caller's
// version does not have with defaults and validates every field. Throws Error with
// VERSION_MISMATCH or INVALID_ARGUMENT (the message names the field and allowed values).
minikv_config config_read(const minikv_config *user);

size_t dtype_bytes(minikv_dtype dtype);
const char *dtype_name(minikv_dtype dtype);

}  // namespace minikv
