// splitmix64 (Steele, Lea & Flood 2014): the same numbers on every platform and standard
// library. The one generator behind the tests' data (support.hpp, fuzz_input.h, reliability).
#pragma once

#include <cstdint>

namespace testdata {

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : s_(seed) {}
  uint64_t next() {
    uint64_t z = (s_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

 private:
  uint64_t s_;
};

}  // namespace testdata
