// Allocation control for out-of-memory tests: replaces the global operator new/delete of
// the test executable (which also serves libminikv's C++ allocations: std::vector, the
// handle, thread states) and provides a hook for minikv::host_calloc (src/alloc.h), both
// driven by one counter so "the N-th allocation" means the same thing for both.
//
// Include this header in exactly ONE translation unit of an executable (it defines the
// replaceable global allocation functions).
//
//   alloc_control::Armed guard(/*fail_at=*/N, /*sticky=*/false);  // count from here
//   ... call the library ...                                      // N-th allocation fails
//   guard.count()                                                 // allocations seen
//
// While disarmed nothing fails (the test framework allocates freely). live() counts
// operator-new blocks not yet deleted, armed or not, so a test can check that a failed
// call leaked nothing even without LeakSanitizer.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <new>

#include "alloc.h"

namespace alloc_control {

inline std::atomic<bool> g_armed{false};
inline std::atomic<uint64_t> g_count{0};     // allocations while armed
inline std::atomic<uint64_t> g_fail_at{0};   // 0: none; else the allocation numbered so fails
inline std::atomic<bool> g_sticky{false};    // and so does every later one (memory stays short)
inline std::atomic<size_t> g_max_bytes{SIZE_MAX};  // while armed, larger requests fail
inline std::atomic<int64_t> g_live{0};       // operator-new blocks currently allocated
inline std::atomic<size_t> g_largest{0};     // largest request while armed

// Decides whether the allocation being made now must fail, and counts it.
inline bool should_fail(size_t bytes) {
  if (!g_armed.load(std::memory_order_acquire)) return false;
  for (size_t seen = g_largest.load(std::memory_order_relaxed);
       bytes > seen && !g_largest.compare_exchange_weak(seen, bytes, std::memory_order_relaxed);) {
  }
  if (bytes > g_max_bytes.load(std::memory_order_relaxed)) return true;
  const uint64_t n = g_count.fetch_add(1, std::memory_order_relaxed) + 1;
  const uint64_t f = g_fail_at.load(std::memory_order_relaxed);
  return f != 0 && (n == f || (n > f && g_sticky.load(std::memory_order_relaxed)));
}

// For minikv::testing::set_host_calloc_hook.
inline void *calloc_hook(size_t bytes) {
  if (should_fail(bytes)) return nullptr;
  return std::calloc(1, bytes);
}

inline int64_t live() { return g_live.load(std::memory_order_relaxed); }

// Arms the counter for its lifetime and routes host_calloc through calloc_hook.
class Armed {
 public:
  explicit Armed(uint64_t fail_at = 0, bool sticky = false, size_t max_bytes = SIZE_MAX) {
    minikv::testing::set_host_calloc_hook(&calloc_hook);
    g_count.store(0, std::memory_order_relaxed);
    g_largest.store(0, std::memory_order_relaxed);
    g_fail_at.store(fail_at, std::memory_order_relaxed);
    g_sticky.store(sticky, std::memory_order_relaxed);
    g_max_bytes.store(max_bytes, std::memory_order_relaxed);
    g_armed.store(true, std::memory_order_release);
  }
  ~Armed() { disarm(); }
  Armed(const Armed &) = delete;
  Armed &operator=(const Armed &) = delete;
  void disarm() {
    g_armed.store(false, std::memory_order_release);
    minikv::testing::set_host_calloc_hook(nullptr);
  }
  uint64_t count() const { return g_count.load(std::memory_order_relaxed); }
  // The largest single request (operator new or host_calloc) since arming, failed or not.
  size_t largest() const { return g_largest.load(std::memory_order_relaxed); }
};

namespace detail {
inline void *allocate(size_t n, size_t align, bool nothrow) {
  if (should_fail(n)) {
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  if (n == 0) n = 1;
  void *p;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n);
  } else {
    p = std::aligned_alloc(align, (n + align - 1) / align * align);
  }
  if (!p) {
    if (nothrow) return nullptr;
    throw std::bad_alloc();
  }
  g_live.fetch_add(1, std::memory_order_relaxed);
  return p;
}
inline void release(void *p) {
  if (!p) return;
  g_live.fetch_sub(1, std::memory_order_relaxed);
  std::free(p);
}
}  // namespace detail
}  // namespace alloc_control

// ---- the replaceable global allocation functions --------------------------------------
void *operator new(size_t n) { return alloc_control::detail::allocate(n, 0, false); }
void *operator new[](size_t n) { return alloc_control::detail::allocate(n, 0, false); }
void *operator new(size_t n, const std::nothrow_t &) noexcept {
  return alloc_control::detail::allocate(n, 0, true);
}
void *operator new[](size_t n, const std::nothrow_t &) noexcept {
  return alloc_control::detail::allocate(n, 0, true);
}
void *operator new(size_t n, std::align_val_t a) {
  return alloc_control::detail::allocate(n, static_cast<size_t>(a), false);
}
void *operator new[](size_t n, std::align_val_t a) {
  return alloc_control::detail::allocate(n, static_cast<size_t>(a), false);
}
void *operator new(size_t n, std::align_val_t a, const std::nothrow_t &) noexcept {
  return alloc_control::detail::allocate(n, static_cast<size_t>(a), true);
}
void *operator new[](size_t n, std::align_val_t a, const std::nothrow_t &) noexcept {
  return alloc_control::detail::allocate(n, static_cast<size_t>(a), true);
}
void operator delete(void *p) noexcept { alloc_control::detail::release(p); }
void operator delete[](void *p) noexcept { alloc_control::detail::release(p); }
void operator delete(void *p, size_t) noexcept { alloc_control::detail::release(p); }
void operator delete[](void *p, size_t) noexcept { alloc_control::detail::release(p); }
void operator delete(void *p, const std::nothrow_t &) noexcept { alloc_control::detail::release(p); }
void operator delete[](void *p, const std::nothrow_t &) noexcept { alloc_control::detail::release(p); }
void operator delete(void *p, std::align_val_t) noexcept { alloc_control::detail::release(p); }
void operator delete[](void *p, std::align_val_t) noexcept { alloc_control::detail::release(p); }
void operator delete(void *p, size_t, std::align_val_t) noexcept { alloc_control::detail::release(p); }
void operator delete[](void *p, size_t, std::align_val_t) noexcept { alloc_control::detail::release(p); }
void operator delete(void *p, std::align_val_t, const std::nothrow_t &) noexcept {
  alloc_control::detail::release(p);
}
void operator delete[](void *p, std::align_val_t, const std::nothrow_t &) noexcept {
  alloc_control::detail::release(p);
}
