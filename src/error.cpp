#include "error.h"

#include <cstdio>
#include <vector>

namespace minikv {
namespace {
thread_local std::string t_last_error;

std::string vformat(const char *fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  const int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  if (n <= 0) return std::string();
  std::vector<char> buf(static_cast<size_t>(n) + 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  return std::string(buf.data(), static_cast<size_t>(n));
}
}  // namespace

std::string format(const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  return s;
}

void fail(minikv_status status, const char *fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vformat(fmt, args);
  va_end(args);
  throw Error(status, std::move(s));
}

void set_thread_error(const std::string &message) {
  try {
    t_last_error = message;
  } catch (...) {
    // Out of memory while reporting: a text that fits the string's in-object buffer
    // (never allocates) rather than an empty message for a failed call.
    t_last_error.assign("out of memory");
  }
}

const char *thread_error() noexcept { return t_last_error.c_str(); }

}  // namespace minikv
