// The decode split count: how many CTAs share one (sequence, KV head × head chunk)'s tiles
// (flash-decoding), chosen from sizes alone on the host, so that a CUDA graph replays the
// same grid. Host-only arithmetic, tested without a GPU (tests/test_decode_plans.cpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace minikv {
namespace kernels {

// The split count s (1 ≤ s ≤ max_splits, s ≤ tiles) that minimizes the estimated time
//   rounds(s) × (⌈tiles / s⌉ + 1) + (s > 1 ? merge : 0)
// in units of one tile's time (the + 1 for a CTA's pipeline fill), rounds(s) counting the
// waves of ctas · s CTAs over `slots` resident CTAs (1 up to one wave: the CTAs run side by
// side). Past one wave, a last partial wave counts as a whole round, unless
// `partial_wave_share`, for CTAs bound by instruction issue (the one-warp kernel with four
// head slots, GQA groups of four and more): there a partial wave counts its share (at least
// 0.4 of a wave: its CTAs still pay their own latency), and a split merge (four heads in
// the last CTA) about three tiles. H200 (bench/results, 2026-12-03 and -04): MHA, one-warp
// kernel, B = 8 at 32K took 1.31× longer with 7 splits (1.13 waves) than with 6 (0.97),
// and B = 73 at 2K 1.07× longer with one split (1.47 waves) than with two; GQA 32/8, the
// Llama-3-8B engine step was 4.5% faster with one split (1.45 waves) than with two (2.9),
// and B = 128 at 2K (0.71 waves at one split) 1.4×. Ties go to fewer splits.
inline uint64_t choose_decode_splits(uint64_t ctas, uint64_t tiles, uint64_t max_splits, uint64_t slots,
                                     bool partial_wave_share) {
  const double tail_round = partial_wave_share ? 0.4 : 1.0, merge_tiles = partial_wave_share ? 3.0 : 0.0;
  const uint64_t top = std::min<uint64_t>(max_splits, std::max<uint64_t>(tiles, 1));
  uint64_t best = 1;
  double best_cost = 0.0;
  for (uint64_t s = 1; s <= top; ++s) {
    const double waves = double(ctas * s) / double(std::max<uint64_t>(slots, 1));
    const double whole = std::floor(waves), part = waves - whole;
    const double rounds = waves <= 1.0 ? 1.0 : whole + (part > 0.0 ? std::max(part, tail_round) : 0.0);
    const double cost = rounds * double((tiles + s - 1) / s + 1) + (s > 1 ? merge_tiles : 0.0);
    if (s == 1 || cost < best_cost) {
      best = s;
      best_cost = cost;
    }
  }
  return best;
}

}  // namespace kernels
}  // namespace minikv
