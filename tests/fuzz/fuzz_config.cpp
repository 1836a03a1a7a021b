// Fuzz target: configuration parsing and validation (minikv_cache_create).
// Random bytes become a minikv_config — raw, or the defaults with a few fields overwritten
// by raw values — with a random struct_size, inside a larger buffer so that any
// struct_size up to sizeof + 64 names readable bytes. Checks:
//   1. the status is a documented one for minikv_cache_create;
//   2. VERSION_MISMATCH exactly when struct_size is below the first version (96 bytes),
//      or is larger with a non-zero byte past this library's struct;
//   3. a failed create sets *out = NULL and a message;
//   4. an accepted config satisfies every constraint minikv.h documents, and a modest
//      config that satisfies them is accepted (or fails with OUT_OF_MEMORY, never INVALID);
//   5. a created cache is usable (prefill one token, append, decode: finite output, exact
//      lengths and stats) and destroyable; nothing leaks (LeakSanitizer in reliability.sh).
// Huge but valid configs must not take the fuzzer down: allocations above kBudget fail as
// if the machine were out of memory (operator new and host_calloc), which also exercises
// create's OUT_OF_MEMORY cleanup.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "alloc_control.h"
#include "fuzz_input.h"
#include "minikv.h"

// minikv_status_string as a C caller reaches it, taking any int: C++ cannot form an enum
// value outside the enum's range without undefined behaviour (UBSan -fsanitize=enum flags
// the load in the caller), so the same symbol is declared here with an int parameter (the
// calling convention passes both alike; the library reads its argument as an int).
extern "C" const char *status_string_of_int(int32_t status) __asm__("minikv_status_string");

namespace {

constexpr size_t kTail = 64;
constexpr size_t kBudget = size_t(16) << 20;  // largest single allocation allowed in create

uint32_t bit(minikv_status s) { return 1u << static_cast<unsigned>(s); }

// The constraints minikv.h documents, plus the ones the library states in its messages
// for sizes every implementation must accept (the "modest" domain).
// Enum fields hold arbitrary caller ints: read them as int32 (an enum-typed load of an
// out-of-range value is undefined behaviour in C++).
template <typename E>
int32_t raw(const E &field) {
  int32_t v;
  std::memcpy(&v, &field, sizeof(v));
  return v;
}

bool documented_valid(const minikv_config &c) {
  const int32_t backend = raw(c.backend), dtype = raw(c.dtype), policy = raw(c.budget_policy),
                score = raw(c.score_mode);
  const auto ratio_ok = [](float x) { return std::isfinite(x) && x >= 0.0f && x <= 1.0f; };
  const auto bits_ok = [](uint32_t b) { return b == 2 || b == 4 || b == 8 || b == 16; };
  return (backend == MINIKV_BACKEND_AUTO || backend == MINIKV_BACKEND_CPU) && c.device_id >= 0 &&
         (dtype == MINIKV_DTYPE_F16 || dtype == MINIKV_DTYPE_BF16 || dtype == MINIKV_DTYPE_F32) &&
         c.num_layers >= 1 && c.num_kv_heads >= 1 && c.num_heads >= 1 &&
         c.num_heads % c.num_kv_heads == 0 && c.head_dim >= 16 && c.head_dim <= 256 &&
         c.head_dim % 16 == 0 && c.max_sequences >= 1 && c.max_seq_len >= 1 && ratio_ok(c.heavy_ratio) &&
         ratio_ok(c.recent_ratio) &&
         (policy == MINIKV_BUDGET_UNIFORM || policy == MINIKV_BUDGET_PYRAMID) &&
         std::isfinite(c.pyramid_depth) && c.pyramid_depth >= 1.0f &&
         (score == MINIKV_SCORE_CUMULATIVE || score == MINIKV_SCORE_WINDOW) &&
         c.window_size >= 1 && c.pool_kernel % 2 == 1 && bits_ok(c.key_bits) && bits_ok(c.value_bits) &&
         (c.group_size == 16 || c.group_size == 32 || c.group_size == 64 || c.group_size == 128) &&
         (c.value_bits == 16 || c.head_dim % c.group_size == 0) && c.residual_length >= c.group_size &&
         c.residual_length % c.group_size == 0 && c.sink_tokens <= 64 &&
         uint64_t(c.prefill_staging_tokens) <= uint64_t(c.max_sequences) * c.max_seq_len;
}

bool modest(const minikv_config &c) {
  return c.num_layers <= 64 && c.num_kv_heads <= 64 && c.num_heads <= 256 && c.max_sequences <= 64 &&
         c.max_seq_len <= 4096 && c.max_tokens <= (1u << 20) && c.pool_kernel <= 63 &&
         c.residual_length <= 1024;
}

size_t elem_bytes(minikv_dtype d) { return d == MINIKV_DTYPE_F32 ? 4 : 2; }

// A created cache works: one prompt token, one appended token, one decode.
void exercise(minikv_cache *c, const minikv_config &cfg) {
  const size_t e = elem_bytes(cfg.dtype);
  const size_t q_elems = size_t(cfg.num_heads) * cfg.head_dim;
  const size_t kv_elems = size_t(cfg.num_kv_heads) * cfg.head_dim;
  if ((q_elems + 2 * kv_elems) * e > (size_t(8) << 20)) return;  // keep executions fast
  // 0.25 in every dtype: a finite, exactly representable input.
  std::vector<uint8_t> q(q_elems * e), k(kv_elems * e), v(kv_elems * e), out(q_elems * e, 0xEE);
  auto fill = [&](std::vector<uint8_t> &b) {
    for (size_t i = 0; i < b.size() / e; ++i) {
      if (e == 4) {
        const float x = 0.25f;
        std::memcpy(b.data() + 4 * i, &x, 4);
      } else {
        const uint16_t h = cfg.dtype == MINIKV_DTYPE_F16 ? 0x3400 : 0x3e80;  // 0.25
        std::memcpy(b.data() + 2 * i, &h, 2);
      }
    }
  };
  fill(q);
  fill(k);
  fill(v);
  const uint32_t seq = cfg.max_sequences - 1;
  const int32_t cu[2] = {0, 1};
  minikv_status st = minikv_prefill(c, 0, 1, &seq, cu, q.data(), k.data(), v.data(), out.data(), nullptr);
  FUZZ_CHECK(st == MINIKV_OK, "one-token prefill on a fresh cache: %s (%s)", minikv_status_string(st),
             minikv_last_error_message());
  uint64_t seen = 0, cached = 0;
  FUZZ_CHECK(minikv_sequence_length(c, seq, 0, &seen, &cached) == MINIKV_OK && seen == 1 && cached <= 1,
             "after a one-token prefill: seen %llu cached %llu", (unsigned long long)seen,
             (unsigned long long)cached);
  st = minikv_append(c, 0, 1, &seq, k.data(), v.data(), nullptr);
  if (cfg.max_seq_len == 1) {
    FUZZ_CHECK(st == MINIKV_ERR_CAPACITY_EXCEEDED, "append past max_seq_len 1: %s", minikv_status_string(st));
    return;
  }
  FUZZ_CHECK(st == MINIKV_OK, "append after prefill: %s (%s)", minikv_status_string(st),
             minikv_last_error_message());
  st = minikv_decode(c, 0, 1, &seq, q.data(), out.data(), nullptr);
  FUZZ_CHECK(st == MINIKV_OK, "decode after append: %s (%s)", minikv_status_string(st),
             minikv_last_error_message());
  // Every key and value is 0.25, so attention returns 0.25 whatever the weights (up to the
  // quantizer: a constant group dequantizes exactly).
  for (size_t i = 0; i < q_elems; ++i) {
    float x;
    if (e == 4) {
      std::memcpy(&x, out.data() + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, out.data() + 2 * i, 2);
      x = h == (cfg.dtype == MINIKV_DTYPE_F16 ? 0x3400 : 0x3e80) ? 0.25f : -1.0f;
    }
    FUZZ_CHECK(x == 0.25f, "decode over constant 0.25 keys/values gave element %zu != 0.25", i);
  }
  minikv_memory_stats ms{};
  ms.struct_size = sizeof(ms);
  FUZZ_CHECK(minikv_memory_stats_get(c, &ms) == MINIKV_OK && ms.tokens_seen == 2 &&
                 ms.tokens_cached <= 2 && ms.used_bytes <= ms.pool_bytes,
             "stats after prefill+append: seen %llu cached %llu used %llu pool %llu",
             (unsigned long long)ms.tokens_seen, (unsigned long long)ms.tokens_cached,
             (unsigned long long)ms.used_bytes, (unsigned long long)ms.pool_bytes);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  setenv("MINIKV_NUM_THREADS", "1", 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz::Input in(data, size);
  alignas(minikv_config) uint8_t buf[sizeof(minikv_config) + kTail] = {};
  const uint8_t mode = in.u8();
  if (mode & 1) {
    in.bytes(buf, sizeof(minikv_config));  // raw bytes
  } else {
    // Defaults with small dimensions, then a few fields overwritten by raw 32-bit values.
    minikv_config c;
    minikv_config_default(&c);
    c.backend = MINIKV_BACKEND_CPU;
    c.num_layers = 1 + in.u8() % 4;
    c.num_kv_heads = 1 + in.u8() % 4;
    c.num_heads = c.num_kv_heads * (1 + in.u8() % 4);
    c.head_dim = 16 * (1 + in.u8() % 16);
    c.max_sequences = 1 + in.u8() % 8;
    c.max_seq_len = 1 + in.u16() % 2048;
    std::memcpy(buf, &c, sizeof(c));
    for (uint32_t n = in.u8() % 4; n-- > 0;) {
      const size_t at = 4 * in.below(sizeof(minikv_config) / 4);
      const uint32_t value = in.u32();
      std::memcpy(buf + at, &value, 4);
    }
  }
  uint32_t struct_size;
  switch ((mode >> 1) & 3) {
    case 0: struct_size = sizeof(minikv_config); break;
    case 1: struct_size = in.below(sizeof(minikv_config)); break;
    case 2: struct_size = sizeof(minikv_config) + 1 + in.below(kTail); break;
    default: struct_size = in.u32() % (sizeof(minikv_config) + kTail + 1); break;
  }
  std::memcpy(buf, &struct_size, 4);
  bool tail_set = false;
  if ((mode >> 3) & 1) {
    const size_t at = sizeof(minikv_config) + in.below(kTail);
    buf[at] = static_cast<uint8_t>(1 + in.u8() % 255);
    tail_set = at < struct_size;
  }
  // What the library reads: the caller's struct_size bytes, defaults past them.
  constexpr uint32_t kFirstVersion = 96;
  minikv_config cfg;
  minikv_config_default(&cfg);
  std::memcpy(&cfg, buf, std::min<size_t>(struct_size, sizeof(cfg)));
  // reserved_v3_ is a future field's slot: non-zero is refused, not ignored.
  const bool readable = struct_size >= kFirstVersion && !tail_set && cfg.reserved_v3_ == 0;
  // minikv_status_string takes any int a C caller passes (here: the first field, often far
  // outside the enum) without undefined behaviour (UBSan -fsanitize=enum in the clang build).
  {
    int32_t any;
    std::memcpy(&any, buf, sizeof(any));
    const char *text = status_string_of_int(any);
    FUZZ_CHECK(text != nullptr && text[0] != '\0', "minikv_status_string(%u) is empty",
               struct_size);
  }

  minikv_cache *cache = reinterpret_cast<minikv_cache *>(uintptr_t(0x1));
  minikv_status st;
  {
    alloc_control::Armed guard(0, false, kBudget);
    st = minikv_cache_create(reinterpret_cast<const minikv_config *>(buf), &cache);
  }
  const uint32_t allowed = bit(MINIKV_OK) | bit(MINIKV_ERR_INVALID_ARGUMENT) |
                           bit(MINIKV_ERR_VERSION_MISMATCH) | bit(MINIKV_ERR_UNSUPPORTED) |
                           bit(MINIKV_ERR_OUT_OF_MEMORY) | bit(MINIKV_ERR_DEVICE);
  FUZZ_CHECK(allowed & bit(st), "minikv_cache_create returned undocumented status %d", static_cast<int>(st));
  FUZZ_CHECK(readable == (st != MINIKV_ERR_VERSION_MISMATCH),
             "struct_size %u (sizeof %zu, non-zero tail byte read: %d) gave %s", struct_size,
             sizeof(minikv_config), int(tail_set), minikv_status_string(st));
  if (st != MINIKV_OK) {
    FUZZ_CHECK(cache == nullptr, "failed create (%s) left *out non-NULL", minikv_status_string(st));
    FUZZ_CHECK(minikv_last_error_message()[0] != '\0', "failed create (%s) left no message",
               minikv_status_string(st));
    if (readable && documented_valid(cfg) && modest(cfg)) {
      FUZZ_CHECK(st == MINIKV_ERR_OUT_OF_MEMORY,
                 "a documented-valid modest config was rejected: %s (%s)", minikv_status_string(st),
                 minikv_last_error_message());
    }
    return 0;
  }
  FUZZ_CHECK(cache != nullptr, "create returned OK with a NULL handle");
  FUZZ_CHECK(documented_valid(cfg),
             "create accepted a config that violates minikv.h (layers %u heads %u/%u dim %u G %u R %u "
             "bits %u/%u pool_kernel %u)",
             cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.group_size,
             cfg.residual_length, cfg.key_bits, cfg.value_bits, cfg.pool_kernel);
  minikv_memory_stats ms{};
  ms.struct_size = sizeof(ms);
  FUZZ_CHECK(minikv_memory_stats_get(cache, &ms) == MINIKV_OK && ms.pool_bytes > 0 && ms.used_bytes == 0 &&
                 ms.tokens_seen == 0 && ms.tokens_cached == 0,
             "fresh cache stats are not empty");
  exercise(cache, cfg);
  minikv_cache_destroy(cache);
  return 0;
}
