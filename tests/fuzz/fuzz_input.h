// Helpers shared by the fuzz targets: a byte reader over the fuzz input, a deterministic
// PRNG for tensor contents, and a CHECK that aborts with a message (libFuzzer and the
// replay driver both report an abort as a failure, with the input that caused it).
#pragma once

#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "../splitmix64.hpp"

namespace fuzz {

// Reads the input front to back; past the end every read returns 0, so any input (even an
// empty one) decodes to a well-defined, finite call sequence.
class Input {
 public:
  Input(const uint8_t *data, size_t size) : data_(data), size_(size) {}
  bool empty() const { return pos_ >= size_; }
  size_t remaining() const { return pos_ < size_ ? size_ - pos_ : 0; }
  uint8_t u8() { return pos_ < size_ ? data_[pos_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  uint32_t u32() { return static_cast<uint32_t>(u16()) | (static_cast<uint32_t>(u16()) << 16); }
  uint64_t u64() { return static_cast<uint64_t>(u32()) | (static_cast<uint64_t>(u32()) << 32); }
  // Uniform-ish in [0, n) for n >= 1.
  uint32_t below(uint32_t n) { return n <= 256 ? u8() % n : u32() % n; }
  void bytes(void *dst, size_t n) {
    for (size_t i = 0; i < n; ++i) static_cast<uint8_t *>(dst)[i] = u8();
  }

 private:
  const uint8_t *data_;
  size_t size_;
  size_t pos_ = 0;
};

// Tensor contents derived from a seed read from the input, so a short input still drives
// realistic data.
class Rng : public testdata::SplitMix64 {
 public:
  using SplitMix64::SplitMix64;
  // Uniform in [-1, 1).
  float uniform() { return static_cast<float>(next() >> 40) / 8388608.0f - 1.0f; }
};

[[noreturn]] inline void die(const char *file, int line, const char *expr, const char *fmt, ...) {
  std::fprintf(stderr, "\n%s:%d: invariant violated: %s\n  ", file, line, expr);
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  std::abort();
}

}  // namespace fuzz

// FUZZ_CHECK(cond, "printf format", args...): abort with the message when cond is false.
#define FUZZ_CHECK(cond, ...)                                        \
  do {                                                               \
    if (!(cond)) ::fuzz::die(__FILE__, __LINE__, #cond, __VA_ARGS__); \
  } while (0)
