// The allocation seam for large host buffers (the CPU backend's block pool and residual
// slots). Production code calls minikv::host_calloc instead of std::calloc; tests swap in a
// hook or make the n-th call fail, to prove that every allocation failure becomes
// MINIKV_ERR_OUT_OF_MEMORY with nothing leaked and nothing changed
// (tests/reliability/test_oom.cpp, tests/fuzz/fuzz_config.cpp).
//
// Header-only (C++17 inline variables): one instance per linked module. The shared library
// hides it (its symbols are not exported), so only tests that link the static minikv_core
// can reach the testing:: functions; for libminikv.so they are inert and cost one relaxed
// atomic load per pool allocation, which happens only in minikv_cache_create.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#if defined(__linux__)
#include <sys/sysinfo.h>
#endif

namespace minikv {

// A replacement for calloc(1, bytes): returns zeroed memory that std::free releases, or
// NULL on failure. Must be thread-safe (distinct caches are created concurrently).
using HostCallocFn = void *(*)(size_t bytes);

namespace detail {
inline void *default_host_calloc(size_t bytes) { return std::calloc(1, bytes); }
inline std::atomic<HostCallocFn> g_host_calloc{&default_host_calloc};
inline std::atomic<uint64_t> g_host_calloc_fail_in{0};  // 0 = off, n = the n-th call fails
inline std::atomic<uint64_t> g_host_calloc_calls{0};
}  // namespace detail

// calloc(1, bytes) through the test hook; NULL on failure (callers report OUT_OF_MEMORY).
// The memory is released with std::free.
inline void *host_calloc(size_t bytes) {
  detail::g_host_calloc_calls.fetch_add(1, std::memory_order_relaxed);
  // One-shot countdown: the call that moves it from 1 to 0 fails.
  uint64_t n = detail::g_host_calloc_fail_in.load(std::memory_order_relaxed);
  while (n != 0) {
    if (detail::g_host_calloc_fail_in.compare_exchange_weak(n, n - 1,
                                                            std::memory_order_relaxed)) {
      if (n == 1) return nullptr;
      break;
    }
  }
  return detail::g_host_calloc.load(std::memory_order_acquire)(bytes);
}

// Bytes of RAM + swap of this machine (UINT64_MAX where unknown): more host storage than
// this cannot be committed, so minikv_cache_create refuses it before allocating.
inline uint64_t host_memory_bytes() {
#if defined(__linux__)
  struct sysinfo info;
  if (sysinfo(&info) == 0) return (uint64_t(info.totalram) + info.totalswap) * info.mem_unit;
#endif
  return UINT64_MAX;
}

namespace testing {

// Makes the n-th subsequent host_calloc call (n >= 1) return NULL, once; 0 disarms.
inline void set_alloc_failure(uint64_t n) {
  detail::g_host_calloc_fail_in.store(n, std::memory_order_relaxed);
}

// Routes host_calloc to `fn` (NULL restores std::calloc). For counting or size limits.
inline void set_host_calloc_hook(HostCallocFn fn) {
  detail::g_host_calloc.store(fn ? fn : &detail::default_host_calloc, std::memory_order_release);
}

// host_calloc calls made so far (including failed ones).
inline uint64_t host_calloc_calls() {
  return detail::g_host_calloc_calls.load(std::memory_order_relaxed);
}

}  // namespace testing
}  // namespace minikv
