// Internal error type and last-error storage. Internals throw minikv::Error; the C shims
// in api.cpp catch it and turn it into a status plus a message (no exception crosses the
// C ABI).
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

#include "minikv.h"

namespace minikv {

class Error : public std::runtime_error {
 public:
  Error(minikv_status status, std::string message)
      : std::runtime_error(std::move(message)), status_(status) {}
  minikv_status status() const noexcept { return status_; }

 private:
  minikv_status status_;
};

// printf-style message builder.
std::string format(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

[[noreturn]] void fail(minikv_status status, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

// Records `message` as this thread's last error.
void set_thread_error(const std::string &message);
// This thread's last error message ("" if none).
const char *thread_error() noexcept;

}  // namespace minikv

#define MINIKV_REQUIRE(cond, ...)                                  \
  do {                                                             \
    if (!(cond)) ::minikv::fail(MINIKV_ERR_INVALID_ARGUMENT, __VA_ARGS__); \
  } while (0)
