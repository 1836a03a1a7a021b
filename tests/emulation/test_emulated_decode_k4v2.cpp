// minikv-test: white-box
// The default storage's decode kernels (4-bit keys, 2-bit values, G = 32) run by the warp
// emulator against the CPU backend (decode_harness.hpp): decode_k4v2_warp_kernel (sm_90, one
// warp, groups of up to four heads: what the plan picks there), decode_k4v2_kernel (sm_90, four
// warps, larger groups) and the tensor-core kernel's instance for this storage (decode_mma.cuh,
// sm_80+). head_dim 64 and 128 (and 256 for the one-warp kernel), MHA and groups of 2 to 12 (one, two, four and eight head
// slots; several chunks), fp16 and bf16, 0, 4 and 17-20 sinks (a sink tile of two M-tiles next
// to quantized tiles: where one tile's refill may land on another's bytes), tiles of 128, 64
// and 32 tokens (R 128, 64, 96).
#include "../../kernels/decode_k4v2.cu"
#include "../../kernels/decode_mma.cuh"
#include "k4v2_kernels.hpp"

namespace {

using namespace emu_test;

uint32_t mma_heads_per_cta(uint32_t n_rep) { return heads_in_chunks(n_rep, k::kMmaMaxHeads); }

const Kernel kOneWarp = one_warp_kernel<4, 2>();

const Kernel kFourWarps{
    "four-warp", mma_heads_per_cta, k4v2_tiles,
    [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
      const k::K4V2Args args = k4v2_args(p);
      dispatch_dtype_head_dim<64, 128>(cfg, [&](auto t, auto d) {
        using T = decltype(t);
        constexpr int D = decltype(d)::value;
        auto go = [&](size_t smem, const std::function<void()> &thread) {
          emulate(p, k::kK4V2Threads, smem, landing, thread);
        };
        if (k::k4v2_head_slots(p.heads_per_cta) == 4)
          go(k::K4V2Layout<sizeof(T), D, 4>::kTotal, [&] { k::decode_k4v2_kernel<T, D, 4>(args); });
        else go(k::K4V2Layout<sizeof(T), D, 8>::kTotal, [&] { k::decode_k4v2_kernel<T, D, 8>(args); });
      });
      return p.splits == 1;
    }};

const Kernel kMma{
    "mma", mma_heads_per_cta,
    [](const Launch &l) { return tiles_of_all_tokens(l, k::make_mma_decode_plan(block_layout(*l.cfg)).qtile); },
    [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
      const k::MmaLaunchPlan plan = k::make_mma_launch_plan(p.st.block);
      const k::MmaDecodeArgs args{p, plan.g, plan.block_tokens};
      k::DecodeMmaKeyBits<4>::dispatch(cfg.dtype, p.st.block, [&](auto fn) {
        emulate(p, k::kMmaThreads, plan.g.total, landing, [&] { fn(args); });
      });
      return p.splits == 1;
    }};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the default storage's decode kernels run by the warp emulator match the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const uint32_t One = 1, Four = 2, Mma = 4, Both = One | Four;  // bits of the kernel list
  const std::vector<Shape> shapes = {
      {4, 2, 32, 128, 1, F16, 4, 128, One},  {4, 2, 32, 64, 1, F16, 0, 64, One},    {4, 2, 32, 64, 1, BF16, 4, 96, One},
      {4, 2, 32, 128, 1, BF16, 0, 96, One},  {4, 2, 32, 128, 2, F16, 4, 128, One},  {4, 2, 32, 64, 2, BF16, 0, 64, One},
      {4, 2, 32, 128, 3, BF16, 4, 96, Both}, {4, 2, 32, 128, 4, F16, 4, 128, Both}, {4, 2, 32, 64, 4, BF16, 4, 128, One},
      {4, 2, 32, 128, 8, F16, 0, 64, Both},
      // More sinks than a 16-row M-tile, next to quantized tiles.
      {4, 2, 32, 128, 1, F16, 20, 128, One}, {4, 2, 32, 64, 1, BF16, 17, 96, One}, {4, 2, 32, 128, 4, BF16, 20, 64, Both},
      // Groups the four-warp kernel takes in one chunk of 8 slots, and in two chunks.
      {4, 2, 32, 64, 6, BF16, 4, 128, Four}, {4, 2, 32, 128, 12, F16, 4, 96, Four},
      // The tensor-core kernel's instance for this storage (MINIKV_DECODE_KERNEL=mma).
      {4, 2, 32, 128, 1, BF16, 4, 128, Mma}, {4, 2, 32, 64, 4, F16, 20, 96, Mma}, {4, 2, 32, 128, 5, F16, 0, 64, Mma},
      // head_dim 256 (Gemma): the one-warp kernel's four 64-channel spans and eight value groups.
      {4, 2, 32, 256, 1, F16, 4, 128, One}, {4, 2, 32, 256, 1, BF16, 20, 96, One}, {4, 2, 32, 256, 2, BF16, 0, 64, One},
      {4, 2, 32, 256, 4, F16, 17, 128, One}, {4, 2, 32, 256, 3, BF16, 4, 64, One},
  };
  run_shapes(shapes, {kOneWarp, kFourWarps, kMma});
}
}  // TEST_SUITE
