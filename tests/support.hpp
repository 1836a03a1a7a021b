// Shared helpers of the C-API tests: deterministic data, caller buffers in any dtype,
// a RAII cache, and element-wise comparison with a useful failure message.
#pragma once

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "minikv.h"
#include "reference/fp_ref.hpp"
#include "splitmix64.hpp"

namespace test {

// Deterministic data: splitmix64 (tests/splitmix64.hpp) and what the tests draw from it.
class Rng : public testdata::SplitMix64 {
 public:
  using SplitMix64::SplitMix64;
  double uniform() { return (next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double normal() {                                         // Box-Muller
    const double u1 = 1.0 - uniform(), u2 = uniform();
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  }
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(next() % n); }
};

// A caller buffer of n elements of dtype dt. set() rounds to the dtype; get() reads back.
class Buf {
 public:
  Buf() = default;
  Buf(minikv_dtype dt, size_t n) : dt_(dt), n_(n), bytes_(n * ref::dtype_size(dt) + 16, 0) {}
  size_t size() const { return n_; }
  minikv_dtype dtype() const { return dt_; }
  void *data() { return bytes_.data(); }
  const void *data() const { return bytes_.data(); }
  void *row(size_t first_elem) { return bytes_.data() + first_elem * ref::dtype_size(dt_); }
  const void *row(size_t first_elem) const {
    return bytes_.data() + first_elem * ref::dtype_size(dt_);
  }
  void set(size_t i, double x) {
    if (dt_ == MINIKV_DTYPE_F32) {
      const float f = static_cast<float>(x);
      std::memcpy(&bytes_[i * 4], &f, 4);
    } else {
      const uint16_t b = dt_ == MINIKV_DTYPE_F16 ? ref::f16_bits(x) : ref::bf16_bits(x);
      std::memcpy(&bytes_[i * 2], &b, 2);
    }
  }
  double get(size_t i) const {
    if (dt_ == MINIKV_DTYPE_F32) {
      float f;
      std::memcpy(&f, &bytes_[i * 4], 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, &bytes_[i * 2], 2);
    return dt_ == MINIKV_DTYPE_F16 ? ref::f16_value(b) : ref::bf16_value(b);
  }
  std::vector<double> doubles() const {
    std::vector<double> x(n_);
    for (size_t i = 0; i < n_; ++i) x[i] = get(i);
    return x;
  }
  bool bit_equal(const Buf &o) const { return bytes_ == o.bytes_; }
  void fill_normal(Rng &rng, double scale = 1.0) {
    for (size_t i = 0; i < n_; ++i) set(i, scale * rng.normal());
  }
  void fill(double x) {
    for (size_t i = 0; i < n_; ++i) set(i, x);
  }

 private:
  minikv_dtype dt_ = MINIKV_DTYPE_F32;
  size_t n_ = 0;
  std::vector<uint8_t> bytes_;
};

// A CPU-backend config with the MiniKV paper's setting (MINIKV_PRESET_PAPER: 2-bit keys and
// values, G = 16, no sinks, PYRAMID budgets, h = r = 0.25) and the given dimensions.
inline minikv_config cpu_config(uint32_t layers, uint32_t heads, uint32_t kv_heads,
                                uint32_t head_dim, minikv_dtype dt = MINIKV_DTYPE_F32) {
  minikv_config c;
  minikv_config_default(&c);
  REQUIRE(minikv_config_preset(&c, MINIKV_PRESET_PAPER) == MINIKV_OK);
  c.backend = MINIKV_BACKEND_CPU;
  c.dtype = dt;
  c.num_layers = layers;
  c.num_heads = heads;
  c.num_kv_heads = kv_heads;
  c.head_dim = head_dim;
  return c;
}

struct CacheDeleter {
  void operator()(minikv_cache *c) const { minikv_cache_destroy(c); }
};
using CachePtr = std::unique_ptr<minikv_cache, CacheDeleter>;

inline CachePtr make_cache(const minikv_config &cfg) {
  minikv_cache *c = nullptr;
  const minikv_status st = minikv_cache_create(&cfg, &c);
  INFO("minikv_cache_create: ", std::string(minikv_last_error_message()));
  REQUIRE(st == MINIKV_OK);
  REQUIRE(c != nullptr);
  return CachePtr(c);
}

inline std::string status_name(minikv_status s) { return minikv_status_string(s); }

// Status check with the library's message in the failure report.
#define MKV_REQUIRE_OK(expr)                                                   \
  do {                                                                         \
    const minikv_status mkv_st_ = (expr);                                      \
    INFO(#expr, " -> ", std::string(minikv_status_string(mkv_st_)), " : ",      \
         std::string(minikv_last_error_message()));                            \
    REQUIRE(mkv_st_ == MINIKV_OK);                                             \
  } while (0)

// Compares every element: |got - want| <= atol + rtol * |want|; NaN/Inf in `got` fails.
// Reports the count of violations, the worst one and its index.
struct CloseReport {
  size_t bad = 0, worst = 0, nonfinite = 0;
  double worst_err = 0.0, worst_excess = -INFINITY, max_abs_err = 0.0;
  std::string describe(const std::vector<double> &got, const std::vector<double> &want) const {
    std::ostringstream os;
    os << bad << " of " << got.size() << " elements out of tolerance, " << nonfinite
       << " non-finite; max |err| " << max_abs_err;
    if (!got.empty())
      os << "; worst at " << worst << ": got " << got[worst] << " want " << want[worst];
    return os.str();
  }
};

inline CloseReport compare(const std::vector<double> &got, const std::vector<double> &want,
                           double atol, double rtol) {
  CloseReport r;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++r.nonfinite;
      ++r.bad;
      r.worst = i;
      r.worst_excess = INFINITY;
      continue;
    }
    const double err = std::fabs(got[i] - want[i]);
    const double excess = err - (atol + rtol * std::fabs(want[i]));
    r.max_abs_err = std::max(r.max_abs_err, err);
    if (excess > 0) ++r.bad;
    if (excess > r.worst_excess) {
      r.worst_excess = excess;
      r.worst = i;
      r.worst_err = err;
    }
  }
  return r;
}

#define MKV_CHECK_CLOSE(got, want, atol, rtol)                                  \
  do {                                                                          \
    REQUIRE((got).size() == (want).size());                                     \
    const ::test::CloseReport mkv_r_ = ::test::compare((got), (want), (atol), (rtol)); \
    INFO(mkv_r_.describe((got), (want)));                                       \
    CHECK(mkv_r_.bad == 0);                                                     \
  } while (0)

// Packs per-sequence lengths into cu_seqlens.
inline std::vector<int32_t> cu_from_lengths(const std::vector<uint32_t> &lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t i = 0; i < lens.size(); ++i) cu[i + 1] = cu[i] + static_cast<int32_t>(lens[i]);
  return cu;
}

// Rows [first, first + n) of a [tokens][heads][D] buffer as doubles.
inline std::vector<double> rows(const Buf &b, size_t first, size_t n, size_t row_elems) {
  std::vector<double> x(n * row_elems);
  for (size_t i = 0; i < x.size(); ++i) x[i] = b.get(first * row_elems + i);
  return x;
}

inline std::vector<int32_t> kept_positions(const minikv_cache *c, uint32_t seq, uint32_t layer,
                                           uint32_t kv_head) {
  uint32_t count = 0;
  MKV_REQUIRE_OK(minikv_kept_positions(c, seq, layer, kv_head, nullptr, 0, &count));
  std::vector<int32_t> pos(count);
  uint32_t again = 0;
  if (count > 0)
    MKV_REQUIRE_OK(minikv_kept_positions(c, seq, layer, kv_head, pos.data(), count, &again));
  else
    again = 0;
  REQUIRE(again == count);
  return pos;
}

}  // namespace test
