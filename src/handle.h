// The object behind the opaque minikv_cache handle of the C API (src/api.cpp). In a header
// so that white-box tests can hold `in_use` as another thread's call would.
#pragma once

#include <atomic>

#include "cache.h"
#include "minikv.h"

struct minikv_cache {
  explicit minikv_cache(const minikv_config &cfg) : impl(cfg) {}
  minikv::Cache impl;
  // The call using the handle now (NULL: none). A handle is not internally synchronized:
  // a second call while this is set comes from another thread and fails with BAD_STATE
  // instead of racing (a deadlock in the CPU backend's pool, or wrong outputs).
  std::atomic<const char *> in_use{nullptr};
};
