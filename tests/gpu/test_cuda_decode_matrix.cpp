// Decode over the configuration space against the CPU backend, on every output element:
// key and value bits drawn from {2, 4, 8, 16} independently, with and without attention
// sinks, group sizes 16 to 128, head_dim 64, 80, 96, 128 and 256, GQA groups of 1 to 16
// query heads (3, 5, 6, 7 and 12 included: groups that are not a power of two, and groups
// split over several CTAs), fp16 and bf16, ragged batches with prompts shorter than a group,
// decode steps across residual flushes. Each dimension's values are all hit by the sampled
// cases, and every head_dim in both dtypes, MHA and GQA. Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <string>
#include <utility>

#include "../../kernels/cuda_shapes.h"
#include "../../kernels/decode_k4v2_plan.h"
#include "cpu_gpu_pair.h"

namespace {

struct Shape {
  uint32_t key_bits, value_bits, group, head_dim, n_rep;
  minikv_dtype dtype;
  uint32_t sinks = 0;
  uint32_t residual = 0;  // 0: 2 · group
};

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("decode matches the CPU backend across bits and groups and head_dim and GQA") {
  GPU_OR_CHECK_CONFIGS();
  const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
  const Shape shapes[] = {
      {2, 2, 32, 128, 4, F16},  {2, 2, 16, 64, 3, BF16},  {4, 4, 16, 128, 8, BF16},
      {4, 4, 64, 64, 1, F16},   {4, 2, 32, 128, 4, F16},  {4, 2, 32, 64, 12, BF16},
      {2, 4, 128, 128, 2, BF16}, {16, 2, 16, 128, 5, F16}, {2, 16, 32, 64, 6, F16},
      {16, 4, 64, 128, 7, BF16}, {4, 16, 16, 64, 16, F16}, {16, 16, 16, 128, 8, F16},
      {2, 2, 64, 128, 1, BF16},  {4, 2, 128, 128, 2, F16},
      // 8-bit codes, and the sink segment (the default preset's storage among them)
      {8, 8, 32, 128, 4, BF16, 4}, {8, 2, 16, 64, 2, F16},   {4, 8, 64, 128, 8, F16, 4},
      {2, 8, 32, 64, 1, BF16},     {8, 16, 16, 128, 3, F16, 1}, {16, 8, 32, 64, 4, BF16},
      {4, 2, 32, 128, 4, F16, 4},  {4, 2, 32, 64, 3, BF16, 4}, {2, 2, 16, 128, 1, F16, 20},
      // The tensor-core kernel's tile shapes (decode_mma_plan.h): 128-token quantized tiles
      // (32 tokens per warp: G 64, R 128), a tile shorter than its key group (K8V8 G128: 64),
      // 16-bit storage whose quantized and sink/residual tiles differ in size (head_dim 64,
      // R 32: 32 against 64 rows), MHA included.
      {4, 2, 64, 128, 4, BF16, 4}, {2, 2, 64, 128, 8, F16},   {8, 8, 128, 128, 4, F16},
      {16, 16, 16, 64, 4, F16},    {16, 16, 16, 64, 1, BF16, 17}, {4, 2, 64, 128, 1, F16, 4},
      // head_dim 80 (code rows of 20 and 40 bytes, 3 P·V row subsets of 10 lanes), 96 (24-byte
      // rows, 2 subsets of 12) and 256 (one 32-lane row): the paper's storage too, which the
      // fast path leaves to the generic kernel at these sizes.
      {2, 2, 16, 80, 1, F16},      {2, 2, 16, 80, 4, BF16},    {4, 2, 16, 80, 3, F16, 4},
      {4, 8, 16, 80, 1, BF16},     {16, 16, 32, 80, 2, F16},   {2, 16, 64, 80, 8, BF16},
      {8, 4, 16, 80, 6, F16},      {2, 2, 16, 96, 1, BF16},    {2, 2, 32, 96, 4, F16},
      {4, 2, 32, 96, 1, F16, 4},   {4, 4, 16, 96, 8, BF16},    {8, 8, 32, 96, 2, BF16},
      {16, 2, 16, 96, 5, F16},     {2, 8, 32, 96, 12, F16},    {2, 2, 16, 256, 1, F16},
      {2, 2, 16, 256, 4, BF16},    {4, 2, 32, 256, 1, BF16, 4}, {4, 4, 128, 256, 2, F16},
      {8, 8, 64, 256, 8, F16},     {16, 16, 16, 256, 3, BF16}, {2, 4, 32, 256, 16, BF16},
      {16, 8, 128, 256, 1, F16, 20},
      // Blocks of R tokens that 128 does not divide (R = 3, 5 and 3 groups): tiles end at a
      // block's end (the device fuzz's case that caught the CPU reading past one).
      {4, 2, 64, 128, 3, F16, 17, 192}, {2, 2, 32, 64, 4, BF16, 0, 160}, {8, 8, 16, 128, 2, F16, 4, 48},
      // The default storage's own instance (G fixed at 32): the preset's R = 128 (one key group
      // per warp share), and R = 96 (32-token tiles: half a group per warp).
      {4, 2, 32, 128, 4, F16, 4, 128}, {4, 2, 32, 128, 1, BF16, 4, 128}, {4, 2, 32, 64, 7, BF16, 4, 96},
      // More of it for the one-warp kernel (1, 2 or 4 head slots): 128-, 64- and 32-token
      // tiles (R 128, 64, 96), with and without sinks, both dtypes and head_dims, MHA, groups
      // of 2, 3 (a padded slot) and 8 (two chunks).
      {4, 2, 32, 128, 1, F16, 4, 128}, {4, 2, 32, 64, 1, F16, 0, 64}, {4, 2, 32, 64, 1, BF16, 4, 96},
      {4, 2, 32, 128, 1, BF16, 0, 96}, {4, 2, 32, 128, 2, F16, 4, 128}, {4, 2, 32, 64, 2, BF16, 0, 64},
      {4, 2, 32, 128, 3, BF16, 4, 96}, {4, 2, 32, 128, 8, F16, 4, 128},
      // The one-warp kernel's other storage (the plan for groups of up to four heads, forced
      // for larger ones): bit pairs at G = 32, and G = 64 and 128.
      {2, 2, 32, 128, 1, F16, 4, 128}, {2, 2, 32, 64, 4, BF16, 0, 96}, {4, 4, 32, 128, 2, BF16, 20, 64},
      {4, 4, 32, 64, 1, F16, 4, 128}, {8, 8, 32, 128, 4, F16, 4, 128}, {8, 8, 32, 64, 1, BF16, 17, 64},
      {8, 8, 32, 128, 3, BF16, 0, 96}, {4, 2, 64, 64, 4, BF16, 4, 128}, {4, 2, 64, 128, 1, F16, 0, 192},
      {2, 2, 128, 128, 3, F16, 20, 256}, {4, 2, 128, 128, 2, BF16, 4, 128}, {8, 4, 32, 128, 2, F16, 4, 128},
      {8, 2, 32, 64, 4, BF16, 0, 96},  {4, 4, 32, 128, 8, F16, 4, 128}, {8, 4, 32, 64, 7, BF16, 0, 64},
      // The one-warp kernel at head_dim 256 (four value spans, eight value groups at G = 32).
      {4, 2, 32, 256, 4, F16, 4, 128}, {2, 2, 32, 256, 2, BF16, 0, 96}, {4, 2, 64, 256, 1, F16, 17, 128},
      {8, 8, 32, 256, 3, BF16, 4, 64}, {2, 2, 128, 256, 4, F16, 0, 256}, {4, 4, 32, 256, 1, BF16, 20, 128},
      {8, 4, 32, 256, 8, F16, 4, 128},
      // The one-warp kernel at G = 16 (one, two and four head slots): the paper's storage with
      // sinks (its exact storage stays on the fast path), and 4/4 bits.
      {4, 4, 16, 128, 1, F16, 4, 128}, {4, 4, 16, 64, 2, BF16, 0, 64}, {2, 2, 16, 128, 2, BF16, 4, 96},
      {2, 2, 16, 64, 1, F16, 17, 128}, {2, 2, 16, 128, 4, F16, 4, 128}, {4, 4, 16, 64, 4, BF16, 0, 96},
      {4, 4, 16, 128, 8, F16, 20, 128}, {2, 2, 16, 64, 3, BF16, 17, 64},
  };
  for (const Shape &s : shapes) {
    if (!minikv::kernels::head_dim_compiled(s.head_dim)) continue;  // MINIKV_CUDA_HEAD_DIMS
    const std::string name = "K" + std::to_string(s.key_bits) + "V" + std::to_string(s.value_bits) +
                             " G" + std::to_string(s.group) + " hd" + std::to_string(s.head_dim) +
                             " n_rep " + std::to_string(s.n_rep) +
                             (s.dtype == F16 ? " f16" : " bf16") +
                             (s.sinks ? " sinks " + std::to_string(s.sinks) : "") +
                             (s.residual ? " R " + std::to_string(s.residual) : "");
    // The default storage runs its own kernels where they compile (sm_90): the one-warp one
    // for groups of up to four heads, the four-warp one for larger groups; the one-warp
    // kernel's other storage (k4v2_warp_storage) likewise runs it for groups of up to four
    // (and for 4/4 bits) and decode_mma for larger ones. The kernels the plan does not pick
    // stay checked by forcing them: the tensor-core kernel's instance and the other k4v2
    // kernel for the default storage, the other of the two for the rest.
    namespace mk = minikv::kernels;
    const bool hd = s.head_dim == 64 || s.head_dim == 128;
    const bool k4v2 = hd && s.group == 32 && s.key_bits == 4 && s.value_bits == 2;
    const bool warp_bits = mk::k4v2_warp_instance(s.key_bits, s.value_bits, s.group, s.head_dim);
    const bool warp_planned = mk::k4v2_warp_planned(s.key_bits, s.value_bits, s.group, s.n_rep);
    const char *unplanned = warp_planned ? "k4v2" : "k4v2-warp";
    const char *warp_other = warp_planned ? "mma" : "k4v2-warp";
    const char *forced[3] = {nullptr, k4v2 ? "mma" : warp_bits ? warp_other : nullptr, k4v2 ? unplanned : nullptr};
    for (int ki = 0; ki < 3; ++ki) {
      const char *kernel = forced[ki];
      if (ki > 0 && kernel == nullptr) break;
      const std::string sub = kernel ? name + " (" + kernel + ")" : name;
      SUBCASE(sub.c_str()) {
        const gt::DecodeKernelChoice choice(kernel);
        const uint32_t kv_heads = s.n_rep >= 8 ? 1 : 2;
        const uint32_t R = s.residual ? s.residual : s.group * 2;
        gt::Case c{sub.c_str(), s.dtype, s.head_dim, kv_heads * s.n_rep, kv_heads,
                   MINIKV_SCORE_CUMULATIVE, s.key_bits, s.value_bits, s.group,
                   R, MINIKV_BUDGET_UNIFORM, 0.25f, 0.25f,
                   {1, s.group - 1, s.group + 1, 333, 1200}, R + 9};
        c.sinks = s.sinks;
        gt::run_case(c);
      }
    }
  }
}

TEST_CASE("decode matches the CPU backend when each CTA walks many tiles") {
  GPU_OR_CHECK_CONFIGS();
  // Enough (sequence, KV head) CTAs to fill an H200 without splitting the cache, and 32-token
  // tiles (R = 32), so each CTA walks ~17 tiles through its pipeline stages: the short
  // caches above give most CTAs one to three tiles. A staging bug that only shows after the
  // stages wrap around (phases out of step) hangs or corrupts here.
  // R = 128: 128-token tiles, ~9 per (sequence, KV head) of ~1100 tokens.
  // Keep-all budgets: 480 (sequence, KV head) selections would make the host's float64
  // reference of the scores (and its retries until every boundary is well separated) the
  // test's whole cost, and the selection is not what this test is about.
  // The plan takes the one-warp kernel for these groups (1 and 4); the four-warp and the
  // tensor-core kernels are forced.
  const struct {
    const char *name, *kernel;
    uint32_t heads, R, min_len;
  } runs[] = {{"K4V2 G32 R 32 hd64 gqa4 120 sequences", nullptr, 16, 32, 560},
              {"K4V2 G32 R 32 hd64 gqa4 120 sequences (k4v2)", "k4v2", 16, 32, 560},
              {"K4V2 G32 R 32 hd64 gqa4 120 sequences (mma)", "mma", 16, 32, 560},
              {"K4V2 G32 R 128 hd64 mha 120 sequences", nullptr, 4, 128, 1100},
              {"K4V2 G32 R 128 hd64 gqa4 120 sequences (k4v2)", "k4v2", 16, 128, 1100}};
  for (const auto &r : runs) {
    SUBCASE(r.name) {
      const gt::DecodeKernelChoice choice(r.kernel);
      std::vector<uint32_t> lens(120);
      for (uint32_t i = 0; i < lens.size(); ++i) lens[i] = r.min_len + (i * 37) % 90;
      gt::Case c{r.name, MINIKV_DTYPE_F16, 64, r.heads, 4, MINIKV_SCORE_CUMULATIVE, 4, 2, 32, r.R,
                 MINIKV_BUDGET_UNIFORM, 0.5f, 0.5f, lens, 40};
      c.sinks = 4;
      gt::run_case(c);
    }
  }
}

TEST_CASE("decode matches the CPU backend with extreme query magnitudes in every strategy") {
  GPU_OR_CHECK_CONFIGS();
  // Large logits (softmax near one-hot) and tiny ones (near uniform), on the fast path's
  // storage and on the generic kernel's, at head_dim 128 and at the generic kernel's other
  // lane mappings (80: idle lanes, 256: a row per warp).
  for (const float q_scale : {1e-3f, 40.0f}) {
    // (key bits, group): the fast path's and the generic kernel's storage, and the default
    // storage (its own kernel at head_dim 128).
    for (const auto &[bits, group] : {std::pair{2u, 16u}, std::pair{4u, 16u}, std::pair{4u, 32u}}) {
      for (const uint32_t head_dim : {128u, 80u, 256u}) {
        if (!minikv::kernels::head_dim_compiled(head_dim)) continue;
        // Values are quantized in groups of `group` channels: head_dim 80 takes G16 only
        // (minikv_cache_create refuses 80 at G32 with INVALID_ARGUMENT).
        if (head_dim % group != 0) continue;
        const std::string name = std::to_string(bits) + "-bit G" + std::to_string(group) + " hd" +
                                 std::to_string(head_dim) + " q_scale " + std::to_string(q_scale);
        SUBCASE(name.c_str()) {
          gt::Case c{name.c_str(), MINIKV_DTYPE_F16, head_dim, 8, 2, MINIKV_SCORE_CUMULATIVE,
                     bits, 2, group, 4 * group, MINIKV_BUDGET_UNIFORM, 0.25f, 0.25f, {700, 90}, 20};
          c.q_scale = q_scale;
          gt::run_case(c);
        }
      }
    }
  }
}

TEST_CASE("decode stays finite when the staged code bytes read as fp16 NaN") {
  GPU_OR_CHECK_CONFIGS();
  // Keys and values at two levels: nearly every 8-bit (4-bit) code is all ones, and the
  // tensor-core kernel's stage rows past a short sink or residual tile once held such bytes
  // (NaN as fp16; 0 * NaN poisoned the P.V accumulators). Keep-all: no selection ties.
  // (key bits, value bits): 4/2 is the default storage (its own kernel).
  for (const auto &[kbits, vbits] : {std::pair{8u, 8u}, std::pair{4u, 4u}, std::pair{4u, 2u}}) {
    for (const minikv_dtype dt : {MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16}) {
      const std::string name = "K" + std::to_string(kbits) + "V" + std::to_string(vbits) +
                               (dt == MINIKV_DTYPE_F16 ? " f16" : " bf16");
      SUBCASE(name.c_str()) {
        gt::Case c{name.c_str(), dt, 64, 6, 2, MINIKV_SCORE_CUMULATIVE, kbits, vbits, 32, 64,
                   MINIKV_BUDGET_UNIFORM, 0.5f, 0.5f, {1200, 334, 70}, 73};  // even: keep all
        c.sinks = 4;
        c.saturated = true;
        gt::run_case(c);
      }
    }
  }
}

}  // TEST_SUITE
