// Configuration: defaults, size-tolerant copy-in of the caller's struct, validation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "minikv.h"

namespace minikv {

// Size of the first published minikv_config (0.1.0: up to residual_length plus the tail
// padding its uint64 field implied): callers may not pass less, and the 0.1 entry point
// minikv_config_default writes exactly this.
constexpr uint32_t kConfigSizeV1 = 96;
static_assert(offsetof(minikv_config, reserved_v1_) == 92 &&
                  offsetof(minikv_config, reserved_v1_) + sizeof(uint32_t) == kConfigSizeV1,
              "the first version of minikv_config is frozen: append fields, never insert");
static_assert(offsetof(minikv_config, sink_tokens) == kConfigSizeV1 &&
                  offsetof(minikv_config, prefill_staging_tokens) == 100 &&
                  offsetof(minikv_config, flush_tokens) == 104 &&
                  offsetof(minikv_config, reserved_v3_) == 108 && sizeof(minikv_config) == 112,
              "fields are appended after reserved_v1_, never inserted");
// Callers whose struct is at least this large have flush_tokens.
constexpr uint32_t kConfigSizeFlush = offsetof(minikv_config, flush_tokens) + sizeof(uint32_t);
constexpr uint32_t kMaxSinkTokens = 64;
constexpr uint32_t kStatsSizeV1 = sizeof(minikv_memory_stats);

// The library's defaults for every field it knows (the compression fields of
// MINIKV_PRESET_BALANCED), struct_size = sizeof(minikv_config).
minikv_config config_defaults();

// minikv_config_preset: sets the compression fields of *cfg to `preset` (the caller's int,
// read with raw_enum). Throws Error (INVALID_ARGUMENT, VERSION_MISMATCH) before writing
// anything.
void config_preset(minikv_config *cfg, int32_t preset);

// minikv_config_init: writes the defaults into the first `size` bytes of *cfg (bytes past
// this library's struct are zeroed: "not set" for a newer header) and sets struct_size.
// Throws Error (INVALID_ARGUMENT, VERSION_MISMATCH) before writing anything.
void config_init(minikv_config *cfg, size_t size);

// Copies the caller's struct (struct_size bytes of it), fills fields the caller's
// version does not have with defaults and validates every field. Throws Error with
// VERSION_MISMATCH or INVALID_ARGUMENT (the message names the field and allowed values).
minikv_config config_read(const minikv_config *user);

size_t dtype_bytes(minikv_dtype dtype);

// The tokens a flush quantizes (minikv.h, flush_tokens): the whole residual for 0, else
// flush_tokens rounded up to a multiple of group_size, at most residual_length.
uint32_t flush_size(const minikv_config &cfg);

// The value a C caller stored in an enum object, read without an enum-typed load: any int
// may arrive there, and loading one outside the enum's range is undefined behaviour in C++
// (UBSan -fsanitize=enum, found by tests/fuzz/fuzz_config).
template <typename E>
int32_t raw_enum(const E &value) {
  static_assert(sizeof(E) == sizeof(int32_t), "C enums in the ABI are 32-bit");
  int32_t v;
  std::memcpy(&v, &value, sizeof(v));
  return v;
}

const char *dtype_name(minikv_dtype dtype);

}  // namespace minikv
