// The default storage's decode kernels as the emulated tests launch them (decode_harness.hpp):
// the K4V2 plan's tile count and arguments, and the one-warp kernel of decode_k4v2_warp.cu for
// storage of KB-bit keys, VB-bit values and group G.
#pragma once

#include "../../kernels/decode_k4v2_warp.cu"
#include "decode_harness.hpp"

namespace emu_test {

inline uint32_t k4v2_tiles(const Launch &l) {  // cuda_backend.cpp: the K4V2 kernels' count
  uint32_t all, quantized;
  longest(l, all, quantized);
  const uint32_t qtile = k::make_k4v2_launch_plan(block_layout(*l.cfg), 12080).tiles.qtile;
  return (quantized + qtile - 1) / qtile + (all - quantized + k::kK4V2RowTile - 1) / k::kK4V2RowTile + 1;
}
inline k::K4V2Args k4v2_args(const k::DecodeParams &p) {  // the plan's (driver 12.8 or later)
  const k::K4V2LaunchPlan plan = k::make_k4v2_launch_plan(p.st.block, 12080);
  return {p, plan.tiles, plan.block_tokens};
}

template <int KB, int VB, int G = 32> Kernel one_warp_kernel() {
  return {"one-warp", [](uint32_t n_rep) { return k::k4v2_warp_slots(n_rep); }, k4v2_tiles,
          [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
            REQUIRE(cfg.key_bits == uint32_t(KB));
            REQUIRE(cfg.value_bits == uint32_t(VB));
            REQUIRE(cfg.group_size == uint32_t(G));
            const k::K4V2Args args = k4v2_args(p);
            dispatch_dtype_head_dim<64, 128, 256>(cfg, [&](auto t, auto d) {
              using T = decltype(t);
              constexpr int D = decltype(d)::value;
              auto go = [&](size_t smem, const std::function<void()> &thread) { emulate(p, 32, smem, landing, thread); };
              if constexpr (!k::k4v2_warp_instance(KB, VB, G, D)) {
                FAIL("head_dim " << D << " with G " << G);
              } else if (p.heads_per_cta == 1) {
                go(k::K4V2WarpLayout<D, 1, KB, VB, G>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 1, KB, VB, G>(args); });
              } else if (p.heads_per_cta == 2) {
                go(k::K4V2WarpLayout<D, 2, KB, VB, G>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 2, KB, VB, G>(args); });
              } else {
                go(k::K4V2WarpLayout<D, 4, KB, VB, G>::kTotal, [&] { k::decode_k4v2_warp_kernel<T, D, 4, KB, VB, G>(args); });
              }
            });
            return p.splits == 1 || k::k4v2_warp_fused_merge(p.splits, p.heads_per_cta, p.num_heads / p.num_kv_heads);
          }};
}

}  // namespace emu_test
