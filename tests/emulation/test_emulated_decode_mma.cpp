// minikv-test: white-box
// The tensor-core decode kernel (decode_mma.cuh, sm_80+: GQA groups of every storage, and MHA
// with 2- or 16-bit values) run by the warp emulator against the CPU backend
// (decode_harness.hpp), over storages other than the default one (test_emulated_decode_k4v2.cpp
// has that): key and value bits in {2, 4, 8, 16} independently, G 16 to 128 (at most 8 groups
// a row: the kernel's path), head_dim 64, 128 and 256, groups of 1 to 16 query heads (3, 5, 6
// and 7 included, and groups over two CTAs), fp16 and bf16, with and without sinks, R from 2 G
// to 192 (blocks that 128 does not divide).
#include "../../kernels/decode_mma.cuh"
#include "decode_harness.hpp"

namespace {

using namespace emu_test;

const Kernel kMma{
    "mma",
    [](uint32_t n_rep) { return heads_in_chunks(n_rep, k::kMmaMaxHeads); },
    [](const Launch &l) { return tiles_of_all_tokens(l, k::make_mma_decode_plan(block_layout(*l.cfg)).qtile); },
    [](const minikv_config &cfg, const k::DecodeParams &p, CopyLanding landing) {
      const minikv::BlockLayout &bl = p.st.block;  // decode_mma_path: what the plan sends here
      REQUIRE((bl.group >= 16 && bl.head_dim % bl.group == 0 && bl.head_dim / bl.group <= k::kMmaMaxGroups &&
               bl.k_row_bytes % 16 == 0 && bl.v_row_bytes % 16 == 0));
      const k::MmaLaunchPlan plan = k::make_mma_launch_plan(p.st.block);
      const k::MmaDecodeArgs args{p, plan.g, plan.block_tokens};
      auto go = [&](auto fn) { emulate(p, k::kMmaThreads, plan.g.total, landing, [&] { fn(args); }); };
      switch (cfg.key_bits) {
        case 2: k::DecodeMmaKeyBits<2>::dispatch(cfg.dtype, p.st.block, go); break;
        case 4: k::DecodeMmaKeyBits<4>::dispatch(cfg.dtype, p.st.block, go); break;
        case 8: k::DecodeMmaKeyBits<8>::dispatch(cfg.dtype, p.st.block, go); break;
        default: k::DecodeMmaKeyBits<16>::dispatch(cfg.dtype, p.st.block, go); break;
      }
      return p.splits == 1;
    }};

}  // namespace

TEST_SUITE("cpu") {
TEST_CASE("the tensor-core decode kernel run by the warp emulator matches the CPU backend") {
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  // {key bits, value bits, G, head_dim, n_rep, dtype, sinks, R, kernels}
  const std::vector<Shape> shapes = {
      {2, 2, 32, 128, 4, F16, 0, 64, 1},    {4, 4, 16, 128, 8, BF16, 0, 32, 1},  {2, 4, 128, 128, 2, BF16, 0, 128, 1},
      {16, 2, 16, 128, 5, F16, 0, 32, 1},   {2, 16, 32, 64, 6, F16, 0, 64, 1},   {16, 4, 64, 128, 7, BF16, 0, 128, 1},
      {4, 16, 16, 64, 16, F16, 0, 32, 1},   {16, 16, 16, 128, 8, F16, 0, 32, 1}, {8, 8, 32, 128, 4, BF16, 4, 64, 1},
      {8, 2, 16, 64, 2, F16, 0, 32, 1},     {4, 8, 64, 128, 8, F16, 4, 128, 1},  {16, 8, 32, 64, 4, BF16, 0, 64, 1},
      {2, 2, 64, 128, 8, F16, 0, 128, 1},   {8, 8, 128, 128, 4, F16, 0, 128, 1}, {16, 16, 16, 64, 1, BF16, 17, 32, 1},
      {2, 2, 16, 128, 1, F16, 20, 32, 1},   {4, 2, 64, 128, 3, F16, 17, 192, 1}, {2, 2, 32, 64, 4, BF16, 0, 160, 1},
      {2, 2, 32, 256, 4, BF16, 0, 64, 1},   {4, 4, 128, 256, 2, F16, 0, 128, 1}, {16, 16, 32, 256, 3, BF16, 0, 32, 1},
      {4, 2, 32, 256, 1, F16, 4, 96, 1},
  };
  run_shapes(shapes, {kMma});
}
}  // TEST_SUITE
