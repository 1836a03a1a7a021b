// The C ABI: argument checks that need no state, exception → status translation, and the
// last-error bookkeeping. No logic lives here.
#include <cstring>
#include <new>
#include <system_error>
#include <string>
#include <utility>

#include "config.h"
#include "error.h"
#include "handle.h"
#include "minikv.h"

namespace {

#define MINIKV_STR2(x) #x
#define MINIKV_STR(x) MINIKV_STR2(x)
constexpr const char kVersionString[] = MINIKV_STR(MINIKV_VERSION_MAJOR) "." MINIKV_STR(
    MINIKV_VERSION_MINOR) "." MINIKV_STR(MINIKV_VERSION_PATCH);

// Builds a + b + c + d into out. Running out of memory while describing a failure must not
// throw out of the noexcept guard (that would terminate the process, found by
// tests/reliability/test_oom): fall back to a text short enough for std::string's
// in-object buffer, which never allocates.
void compose(std::string &out, const char *a, const char *b = "", const char *c = "",
             const char *d = "") noexcept {
  try {
    out = a;
    out += b;
    out += c;
    out += d;
  } catch (...) {
    out.assign("out of memory");
  }
}

// Runs fn, mapping every exception to a status and recording the message on the thread
// and, when given, on the handle.
template <typename Fn>
minikv_status guarded(const minikv_cache *handle, const char *call, Fn &&fn) noexcept {
  minikv_status status = MINIKV_OK;
  std::string message;
  try {
    fn();
    return MINIKV_OK;
  } catch (const minikv::Error &e) {
    status = e.status();
    compose(message, e.what());
  } catch (const std::bad_alloc &) {
    status = MINIKV_ERR_OUT_OF_MEMORY;
    compose(message, call, ": out of host memory");
  } catch (const std::system_error &e) {  // e.g. no more threads for the CPU backend's pool
    status = MINIKV_ERR_OUT_OF_MEMORY;
    compose(message, call, ": out of system resources: ", e.what());
  } catch (const std::exception &e) {
    status = MINIKV_ERR_INTERNAL;
    compose(message, call, ": internal error: ", e.what());
  } catch (...) {
    status = MINIKV_ERR_INTERNAL;
    compose(message, call, ": internal error (unknown exception)");
  }
  minikv::set_thread_error(message);
  if (handle) const_cast<minikv_cache *>(handle)->impl.set_error(message);
  return status;
}

// guarded() on a handle, which `call` holds for its duration: a call that finds the handle
// held by another (so, on another thread) fails with BAD_STATE naming both, and records
// its message on this thread only (the handle's message belongs to the other call).
template <typename Fn>
minikv_status exclusive(const minikv_cache *handle, const char *call, Fn &&fn) noexcept {
  std::atomic<const char *> &in_use = const_cast<minikv_cache *>(handle)->in_use;
  const char *holder = nullptr;
  if (!in_use.compare_exchange_strong(holder, call, std::memory_order_acquire,
                                      std::memory_order_relaxed)) {
    std::string message;
    compose(message, call, ": the cache is in use by ", holder,
            " on another thread at the same time; a handle must be used from one thread at a "
            "time (nothing changed)");
    minikv::set_thread_error(message);
    return MINIKV_ERR_BAD_STATE;
  }
  const minikv_status status = guarded(handle, call, std::forward<Fn>(fn));
  in_use.store(nullptr, std::memory_order_release);
  return status;
}

minikv_status null_handle(const char *call) noexcept {
  std::string message;
  compose(message, call, ": cache is NULL");
  minikv::set_thread_error(message);
  return MINIKV_ERR_INVALID_ARGUMENT;
}

}  // namespace

extern "C" {

uint32_t minikv_version_number(void) { return MINIKV_VERSION_NUMBER; }
const char *minikv_version_string(void) { return kVersionString; }
const char *minikv_last_error_message(void) { return minikv::thread_error(); }

const char *minikv_status_string(minikv_status status) {
  // Any int a C caller passes, known or not, read without loading an out-of-range enum.
  switch (minikv::raw_enum(status)) {
    case MINIKV_OK: return "MINIKV_OK: success";
    case MINIKV_ERR_INVALID_ARGUMENT: return "MINIKV_ERR_INVALID_ARGUMENT: invalid argument";
    case MINIKV_ERR_OUT_OF_MEMORY: return "MINIKV_ERR_OUT_OF_MEMORY: out of memory";
    case MINIKV_ERR_CAPACITY_EXCEEDED:
      return "MINIKV_ERR_CAPACITY_EXCEEDED: cache capacity exceeded (nothing changed)";
    case MINIKV_ERR_BAD_STATE: return "MINIKV_ERR_BAD_STATE: call not valid in this state";
    case MINIKV_ERR_UNSUPPORTED: return "MINIKV_ERR_UNSUPPORTED: not supported by this build";
    case MINIKV_ERR_DEVICE: return "MINIKV_ERR_DEVICE: CUDA device error";
    case MINIKV_ERR_VERSION_MISMATCH:
      return "MINIKV_ERR_VERSION_MISMATCH: struct size not readable by this library";
    case MINIKV_ERR_INTERNAL: return "MINIKV_ERR_INTERNAL: internal error";
  }
  return "unknown minikv_status";
}

minikv_status minikv_config_init(minikv_config *cfg, size_t struct_size) {
  return guarded(nullptr, "minikv_config_init", [&] { minikv::config_init(cfg, struct_size); });
}

minikv_status minikv_config_preset(minikv_config *cfg, minikv_preset preset) {
  // Read as an int right here: any int a C caller passes may arrive, and an enum-typed load
  // of one outside the enum's range (passing `preset` on by value) is undefined behaviour.
  const int32_t raw = minikv::raw_enum(preset);
  return guarded(nullptr, "minikv_config_preset", [&] { minikv::config_preset(cfg, raw); });
}

// The 0.1 symbol (the header now maps the name to minikv_config_init): such a caller's
// struct has exactly the first version's fields.
#undef minikv_config_default
void minikv_config_default(minikv_config *cfg) {
  if (cfg) minikv::config_init(cfg, minikv::kConfigSizeV1);
}

minikv_status minikv_cache_create(const minikv_config *cfg, minikv_cache **out) {
  if (out) *out = nullptr;
  return guarded(nullptr, "minikv_cache_create", [&] {
    MINIKV_REQUIRE(out != nullptr, "minikv_cache_create: out is NULL");
    minikv_config c;
    try {
      c = minikv::config_read(cfg);
    } catch (const minikv::Error &e) {  // name the call, as every other message does
      throw minikv::Error(e.status(), std::string("minikv_cache_create: ") + e.what());
    }
    *out = new minikv_cache(c);
  });
}

void minikv_cache_destroy(minikv_cache *cache) { delete cache; }

const char *minikv_cache_last_error(const minikv_cache *cache) {
  return cache ? cache->impl.last_error() : "minikv_cache_last_error: cache is NULL";
}

minikv_status minikv_cache_backend(const minikv_cache *cache, minikv_backend *backend) {
  if (!cache) return null_handle("minikv_cache_backend");
  return exclusive(cache, "minikv_cache_backend", [&] {
    MINIKV_REQUIRE(backend != nullptr, "minikv_cache_backend: backend is NULL");
    *backend = cache->impl.config().backend;
  });
}

minikv_status minikv_prefill(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                             const uint32_t *seq_ids, const int32_t *cu_seqlens, const void *q,
                             const void *k, const void *v, void *out, void *stream) {
  if (!cache) return null_handle("minikv_prefill");
  return exclusive(cache, "minikv_prefill", [&] {
    cache->impl.prefill(layer, n_seqs, seq_ids, cu_seqlens, q, k, v, out, stream);
  });
}

minikv_status minikv_prefill_chunk(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                                   const uint32_t *seq_ids, const int32_t *cu_seqlens,
                                   const uint32_t *prompt_lens, const void *q, const void *k,
                                   const void *v, void *out, void *stream) {
  if (!cache) return null_handle("minikv_prefill_chunk");
  return exclusive(cache, "minikv_prefill_chunk", [&] {
    MINIKV_REQUIRE(prompt_lens != nullptr, "minikv_prefill_chunk: prompt_lens is NULL");
    cache->impl.prefill("minikv_prefill_chunk", layer, n_seqs, seq_ids, cu_seqlens, prompt_lens,
                        q, k, v, out, stream);
  });
}

minikv_status minikv_append(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                            const uint32_t *seq_ids, const void *k, const void *v,
                            void *stream) {
  if (!cache) return null_handle("minikv_append");
  return exclusive(cache, "minikv_append",
                 [&] { cache->impl.append(layer, n_seqs, seq_ids, k, v, stream); });
}

minikv_status minikv_decode(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                            const uint32_t *seq_ids, const void *q, void *out, void *stream) {
  if (!cache) return null_handle("minikv_decode");
  return exclusive(cache, "minikv_decode",
                 [&] { cache->impl.decode(layer, n_seqs, seq_ids, q, out, stream); });
}

minikv_status minikv_append_decode(minikv_cache *cache, uint32_t layer, uint32_t n_seqs,
                                   const uint32_t *seq_ids, const void *q, const void *k,
                                   const void *v, void *out, void *stream) {
  if (!cache) return null_handle("minikv_append_decode");
  return exclusive(cache, "minikv_append_decode", [&] {
    cache->impl.append_decode(layer, n_seqs, seq_ids, q, k, v, out, stream);
  });
}

minikv_status minikv_sequence_release(minikv_cache *cache, uint32_t seq_id) {
  if (!cache) return null_handle("minikv_sequence_release");
  return exclusive(cache, "minikv_sequence_release", [&] { cache->impl.release(seq_id); });
}

minikv_status minikv_sequence_length(const minikv_cache *cache, uint32_t seq_id, uint32_t layer,
                                     uint64_t *tokens_seen, uint64_t *tokens_cached) {
  if (!cache) return null_handle("minikv_sequence_length");
  return exclusive(cache, "minikv_sequence_length", [&] {
    cache->impl.sequence_length(seq_id, layer, tokens_seen, tokens_cached);
  });
}

minikv_status minikv_kept_positions(const minikv_cache *cache, uint32_t seq_id, uint32_t layer,
                                    uint32_t kv_head, int32_t *positions, uint32_t capacity,
                                    uint32_t *count) {
  if (!cache) return null_handle("minikv_kept_positions");
  return exclusive(cache, "minikv_kept_positions", [&] {
    cache->impl.kept_positions(seq_id, layer, kv_head, positions, capacity, count);
  });
}

minikv_status minikv_memory_stats_get(const minikv_cache *cache, minikv_memory_stats *out) {
  if (!cache) return null_handle("minikv_memory_stats_get");
  return exclusive(cache, "minikv_memory_stats_get", [&] {
    MINIKV_REQUIRE(out != nullptr, "minikv_memory_stats_get: out is NULL");
    const uint32_t size = out->struct_size;
    if (size < minikv::kStatsSizeV1) {
      minikv::fail(MINIKV_ERR_VERSION_MISMATCH,
                   "minikv_memory_stats_get: out->struct_size (%u) is smaller than the first "
                   "version of minikv_memory_stats (%u); set it to sizeof(minikv_memory_stats)",
                   size, minikv::kStatsSizeV1);
    }
    const minikv_memory_stats st = cache->impl.stats();
    // Write only the fields both versions have; keep the caller's struct_size.
    const size_t n = size < sizeof(minikv_memory_stats) ? size : sizeof(minikv_memory_stats);
    std::memcpy(reinterpret_cast<char *>(out) + sizeof(uint32_t),
                reinterpret_cast<const char *>(&st) + sizeof(uint32_t), n - sizeof(uint32_t));
  });
}

}  // extern "C"
