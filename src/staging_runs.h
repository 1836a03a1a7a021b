// The staging rows of one layer (chunked prefill): contiguous runs handed out first-fit, one
// per prompt in flight, so that a prompt's K/V are one dense array the prefill kernels read
// like the caller's. Host bookkeeping only; the backend owns the rows themselves.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace minikv {

class StagingRuns {
 public:
  static constexpr uint32_t kNone = UINT32_MAX;

  // `capacity` rows, at most `max_runs` runs at once (the capacity is reserved here: take()
  // never allocates).
  void init(uint32_t capacity, uint32_t max_runs) {
    capacity_ = capacity;
    runs_.reserve(max_runs);
  }

  // First row of the lowest free run of n rows, or kNone.
  uint32_t find(uint32_t n) const {
    uint32_t at = 0;
    for (const Run &r : runs_) {
      if (r.begin - at >= n) return at;
      at = r.begin + r.rows;
    }
    return capacity_ - at >= n ? at : kNone;
  }

  // Marks [begin, begin + n) used (a free run find() returned).
  void take(uint32_t begin, uint32_t n) {
    const auto at = std::lower_bound(runs_.begin(), runs_.end(), begin,
                                     [](const Run &r, uint32_t b) { return r.begin < b; });
    runs_.insert(at, Run{begin, n});
  }

  // Frees the run that starts at `begin` (taken before).
  void give(uint32_t begin) {
    const auto at = std::lower_bound(runs_.begin(), runs_.end(), begin,
                                     [](const Run &r, uint32_t b) { return r.begin < b; });
    if (at != runs_.end() && at->begin == begin) runs_.erase(at);
  }

  uint32_t capacity() const { return capacity_; }
  uint32_t used() const {
    uint32_t n = 0;
    for (const Run &r : runs_) n += r.rows;
    return n;
  }
  // The longest free run.
  uint32_t largest_free() const {
    uint32_t at = 0, best = 0;
    for (const Run &r : runs_) {
      best = std::max(best, r.begin - at);
      at = r.begin + r.rows;
    }
    return std::max(best, capacity_ - at);
  }

 private:
  struct Run {
    uint32_t begin, rows;
  };
  uint32_t capacity_ = 0;
  std::vector<Run> runs_;  // sorted by begin, disjoint
};

}  // namespace minikv
