// The CUDA backend against the CPU backend through the public C API, on identical inputs:
// prefill outputs on every element, kept positions (also against a float64 reference
// selection), decode outputs at every step of a generation across residual flushes, for
// ragged batches, GQA 1/2/4/8, both score modes, 2/4/8/16 bits, fp16/bf16, every compiled
// head_dim (64, 80, 96, 128, 256; MHA and GQA, prompts across the forward's tiles);
// sequence release and reuse; CAPACITY_EXCEEDED; CUDA graph capture of append + decode;
// attention sinks; unsupported configurations. Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <cstdio>
#include <memory>
#include <numeric>

#include "../../kernels/cuda_shapes.h"
#include "cpu_gpu_pair.h"

namespace {

using gt::DevBuf;
using gt::Tensor;
using gt::Case;
using gt::Pair;
using gt::run_case;
using gt::make_config;

std::vector<uint32_t> batch_lens(uint32_t n) {
  std::vector<uint32_t> lens(n);
  for (uint32_t i = 0; i < n; ++i) lens[i] = 5 + (i * 37) % 56;
  return lens;
}

const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
const minikv_score_mode CUM = MINIKV_SCORE_CUMULATIVE, WIN = MINIKV_SCORE_WINDOW;
const minikv_budget_policy UNI = MINIKV_BUDGET_UNIFORM, PYR = MINIKV_BUDGET_PYRAMID;

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA matches CPU on prefill + selection + decode across flushes") {
  GPU_OR_CHECK_CONFIGS();
  const std::vector<Case> cases = {
      // ragged batch with 1-token and tile-boundary prompts, GQA 4, paper defaults
      {"f16 hd128 gqa4 cumulative 2/2 G16", F16, 128, 8, 2, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
       {1, 64, 65, 300}, 150},
      // GQA 1, window scores with max-pool, 4-bit keys, G=32
      {"bf16 hd64 gqa1 window 4/2 G32", BF16, 64, 8, 8, WIN, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
       {130, 257}, 70},
      // GQA 8, pyramid budgets, 4-bit values, short residual (many flushes)
      {"f16 hd64 gqa8 pyramid 2/4 G16", F16, 64, 16, 2, CUM, 2, 4, 16, 32, PYR, 0.25f, 0.25f,
       {500}, 100},
      // GQA 2, pure eviction (16-bit storage)
      {"bf16 hd128 gqa2 16/16", BF16, 128, 4, 2, CUM, 16, 16, 16, 32, UNI, 0.25f, 0.25f,
       {200, 31}, 40},
      // keep everything (budget >= prompt), GQA 8 with a single KV head
      {"f16 hd128 gqa8 keep-all", F16, 128, 8, 1, WIN, 2, 2, 16, 64, UNI, 0.6f, 0.5f, {100, 7}, 20},
      // only the recent window (no heavy hitters), G = 64
      {"bf16 hd64 recent-only G64", BF16, 64, 4, 4, CUM, 2, 2, 64, 128, UNI, 0.0f, 0.3f, {333}, 140},
      // a long prompt: many prefill tiles, decode split across CTAs
      {"f16 hd128 mha long", F16, 128, 4, 4, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f, {2100}, 12},
      // 8-bit keys and values (the generic decode), and 8-bit keys with 2-bit values
      {"f16 hd128 gqa4 8/8 G32", F16, 128, 8, 2, CUM, 8, 8, 32, 64, UNI, 0.25f, 0.25f,
       {1, 64, 300}, 80},
      {"bf16 hd64 gqa2 8/2 G16", BF16, 64, 4, 2, WIN, 8, 2, 16, 32, PYR, 0.25f, 0.25f,
       {200, 45}, 40},
      // attention sinks (the generic decode's sink segment): the default preset's storage,
      // more sinks than a 16-row tile, prompts no longer than the sinks, keep-all
      {"f16 hd128 gqa4 4/2 G32 4 sinks", F16, 128, 8, 2, CUM, 4, 2, 32, 128, UNI, 0.25f, 0.25f,
       {1, 4, 5, 300, 1000}, 140, 1.0f, 4},
      {"bf16 hd64 gqa2 2/2 G16 40 sinks window", BF16, 64, 4, 2, WIN, 2, 2, 16, 32, PYR, 0.25f,
       0.25f, {40, 41, 250}, 40, 1.0f, 40},
      {"f16 hd64 mha 16/16 keep-all 17 sinks", F16, 64, 4, 4, CUM, 16, 16, 16, 32, UNI, 0.6f, 0.5f,
       {100, 7}, 20, 1.0f, 17},
      // a batch larger than one launch holds (64 prefill/append, 128 decode sequences)
      {"f16 hd64 gqa2 batch of 150", F16, 64, 4, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f,
       batch_lens(150), 35},
      // the default storage over three decode launches side by side (the one-warp kernel)
      {"f16 hd128 gqa4 4/2 G32 4 sinks batch of 300", F16, 128, 8, 2, CUM, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
       batch_lens(300), 70, 1.0f, 4},
      // sliding flushes (flush_tokens < R): the default storage with R = 64 and 128, F = 32
      // (the one-warp and four-warp kernels), the paper's with F = G, F not dividing R
      {"f16 hd128 gqa4 4/2 G32 4 sinks R64 F32", F16, 128, 8, 2, CUM, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
       {1, 4, 5, 300, 1000}, 140, 1.0f, 4, false, 32},
      {"bf16 hd128 mha 4/2 G32 4 sinks R128 F32", BF16, 128, 4, 4, WIN, 4, 2, 32, 128, PYR, 0.25f, 0.25f,
       {130, 700}, 200, 1.0f, 4, false, 32},
      {"f16 hd128 gqa8 4/2 G32 R64 F32 batch of 300", F16, 128, 16, 2, CUM, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
       batch_lens(300), 100, 1.0f, 4, false, 32},
      {"f16 hd64 gqa2 paper R64 F16", F16, 64, 4, 2, CUM, 2, 2, 16, 64, PYR, 0.25f, 0.25f,
       {1, 64, 65, 300}, 120, 1.0f, 0, false, 16},
      {"bf16 hd64 mha 8/8 G16 R80 F48", BF16, 64, 4, 4, CUM, 8, 8, 16, 80, UNI, 0.25f, 0.25f,
       {200, 31}, 180, 1.0f, 0, false, 48},
  };
  for (const Case &c : cases) {
    SUBCASE(c.name) { run_case(c); }
  }
}

TEST_CASE("CUDA matches CPU on prefill at every head_dim") {
  GPU_OR_CHECK_CONFIGS();
  // Each head_dim in both dtypes, MHA and GQA, both score modes: prompts of 1 token, around
  // the forwards' key tiles (mma.sync: 32 keys at head_dim 256, else 64; sm_90a: 64 at
  // head_dim 256, else 128) and
  // query tiles (128 rows), and long enough for several score-pass tiles; then decode steps
  // across a flush.
  const std::vector<uint32_t> lens = {1, 31, 33, 63, 64, 65, 127, 128, 129, 255, 256, 257, 300, 1000};
  for (const uint32_t D : {64u, 80u, 96u, 128u, 256u}) {
    if (!minikv::kernels::head_dim_compiled(D)) continue;  // MINIKV_CUDA_HEAD_DIMS
    for (const minikv_dtype dt : {F16, BF16}) {
      for (const uint32_t n_rep : {1u, 4u}) {
        const minikv_score_mode mode = (D / 16 + n_rep) % 2 ? CUM : WIN;
        const std::string name = std::string(dt == F16 ? "f16" : "bf16") + " hd" +
                                 std::to_string(D) + (n_rep == 1 ? " mha" : " gqa4") +
                                 (mode == CUM ? " cumulative" : " window");
        SUBCASE(name.c_str()) {
          const Case c{name.c_str(), dt, D, 2 * n_rep, 2, mode, 4, 2, 16, 32, UNI, 0.25f, 0.25f,
                       lens, 40};
          run_case(c);
        }
      }
    }
  }
}

TEST_CASE("CUDA matches CPU after sequence release and reuse") {
  GPU_OR_SKIP();
  const Case c{"reuse", F16, 128, 8, 4, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f, {90, 150}, 80};
  Pair pair(make_config(c, MINIKV_BACKEND_CUDA));
  const std::vector<uint32_t> both = {0, 1};
  for (uint32_t layer = 0; layer < 2; ++layer)
    pair.prefill(layer, both, gt::make_prompt(pair.cfg(), layer, c.lens, 5 + layer));
  std::mt19937 rng(7);
  for (uint32_t s = 0; s < 40; ++s) pair.step(0, both, rng, "before release");
  MKV_OK(minikv_sequence_release(pair.cpu(), 0));
  MKV_OK(minikv_sequence_release(pair.gpu(), 0));
  CHECK_EQ(minikv_decode(pair.gpu(), 0, 1, both.data(), nullptr, nullptr, nullptr),
           MINIKV_ERR_BAD_STATE);
  // A new prompt in the released slot reuses its blocks (with stale bytes in them).
  const std::vector<uint32_t> zero = {0};
  pair.prefill(0, zero, gt::make_prompt(pair.cfg(), 0, {141}, 41));
  pair.prefill(1, zero, gt::make_prompt(pair.cfg(), 1, {141}, 43));
  for (uint32_t s = 0; s < 40; ++s) {
    pair.step(0, both, rng, "after reuse, layer 0");
    pair.step(1, both, rng, "after reuse, layer 1");
  }
  pair.check_stats();
}

TEST_CASE("CUDA CAPACITY_EXCEEDED leaves the cache unchanged and usable") {
  GPU_OR_SKIP();
  Case c{"capacity", BF16, 64, 4, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f, {128}, 0};
  minikv_config cfg = make_config(c, MINIKV_BACKEND_CUDA);
  cfg.max_sequences = 3;
  cfg.max_seq_len = 400;
  cfg.max_tokens = 3 * 32;  // three blocks
  Pair pair(cfg);
  // 300 tokens keep 150: 9 groups quantized = 144 tokens = 5 blocks > 3.
  const std::vector<uint32_t> one = {0}, two = {1};
  {
    gt::Prompt big = gt::make_prompt(pair.cfg(), 0, {300}, 3);
    DevBuf q(big.q.size() * 2), k(big.k.size() * 2), v(big.v.size() * 2), o(big.q.size() * 2);
    q.upload(big.q.bits);
    k.upload(big.k.bits);
    v.upload(big.v.bits);
    CHECK_EQ(minikv_prefill(pair.gpu(), 0, 1, one.data(), big.cu.data(), q.get(), k.get(), v.get(),
                            o.get(), nullptr),
             MINIKV_ERR_CAPACITY_EXCEEDED);
    uint64_t seen = 1, cached = 1;
    MKV_OK(minikv_sequence_length(pair.gpu(), 0, 0, &seen, &cached));
    CHECK_EQ(seen, 0u);
    CHECK_EQ(cached, 0u);
  }
  // 128 tokens keep 64 = 2 blocks; a second sequence of 64 keeps 32 = 1 block: pool full.
  pair.prefill(0, one, gt::make_prompt(pair.cfg(), 0, {128}, 4));
  pair.prefill(0, two, gt::make_prompt(pair.cfg(), 0, {64}, 5));
  std::mt19937 rng(11);
  // Sequence 0 has 0 residual tokens (64 quantized): its 32nd append flushes into a new block.
  for (uint32_t s = 0; s < 31; ++s) pair.step(0, one, rng, "filling the residual");
  DevBuf kd(2 * 64 * 2), vd(2 * 64 * 2);
  std::vector<uint16_t> zeros(2 * 64, 0x3c00);
  kd.upload(zeros);
  vd.upload(zeros);
  CHECK_EQ(minikv_append(pair.gpu(), 0, 1, one.data(), kd.get(), vd.get(), nullptr),
           MINIKV_ERR_CAPACITY_EXCEEDED);
  CHECK_EQ(minikv_append(pair.cpu(), 0, 1, one.data(), zeros.data(), zeros.data(), nullptr),
           MINIKV_ERR_CAPACITY_EXCEEDED);
  // Unchanged: a decode without the failed token still matches (append + decode of a new
  // token fails the same way, so decode on the current state through a zero-length step).
  uint64_t seen = 0;
  MKV_OK(minikv_sequence_length(pair.gpu(), 0, 0, &seen, nullptr));
  CHECK_EQ(seen, 128u + 31u);
  MKV_OK(minikv_sequence_release(pair.cpu(), 1));
  MKV_OK(minikv_sequence_release(pair.gpu(), 1));
  // The freed block takes this flush; the next one (32 appends later) would need another.
  for (uint32_t s = 0; s < 31; ++s) pair.step(0, one, rng, "after freeing a block");
  pair.check_stats();
}

TEST_CASE("CUDA graph capture of append + decode replays the uncaptured step") {
  GPU_OR_SKIP();
  const Case c{"graph", F16, 128, 8, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f, {150, 77}, 40};
  const minikv_config cfg = make_config(c, MINIKV_BACKEND_CUDA);
  minikv_cache *a = nullptr, *b = nullptr;
  MKV_OK(minikv_cache_create(&cfg, &a));
  MKV_OK(minikv_cache_create(&cfg, &b));
  std::unique_ptr<minikv_cache, void (*)(minikv_cache *)> ga(a, minikv_cache_destroy), gb(b, minikv_cache_destroy);
  const std::vector<uint32_t> ids = {0, 1};
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const gt::Prompt p = gt::make_prompt(cfg, 0, c.lens, 8);
  const size_t T = p.cu.back();
  DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(T * H * D * 2);
  q.upload(p.q.bits);
  k.upload(p.k.bits);
  v.upload(p.v.bits);
  MKV_OK(minikv_prefill(a, 0, 2, ids.data(), p.cu.data(), q.get(), k.get(), v.get(), o.get(), nullptr));
  MKV_OK(minikv_prefill(b, 0, 2, ids.data(), p.cu.data(), q.get(), k.get(), v.get(), o.get(), nullptr));

  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::mt19937 rng(23);
  DevBuf kd(2 * Hkv * D * 2), vd(2 * Hkv * D * 2), qd(2 * H * D * 2), oa(2 * H * D * 2), ob(2 * H * D * 2);
  // Sequence 1 keeps 38 tokens: 32 quantized + 6 residual, so its 26th append flushes.
  int captured = 0, flushing_captured = 0;
  for (uint32_t step = 0; step < 40; ++step) {
    Tensor kt(cfg.dtype, 2 * Hkv * D), vt(cfg.dtype, 2 * Hkv * D), qt(cfg.dtype, 2 * H * D);
    kt.fill_normal(rng, 1.5f);
    vt.fill_normal(rng, 1.0f);
    qt.fill_normal(rng, 1.0f);
    kd.upload(kt.bits);
    vd.upload(vt.bits);
    qd.upload(qt.bits);
    CUDA_OK(cudaDeviceSynchronize());  // the uploads (legacy stream) landed before `stream` reads them
    uint64_t cached1 = 0;
    MKV_OK(minikv_sequence_length(a, 1, 0, nullptr, &cached1));
    const bool flushes = (cached1 - 32) % 32 == 31;  // the residual reaches R with this token
    // b: plain calls on the stream.
    MKV_OK(minikv_append(b, 0, 2, ids.data(), kd.get(), vd.get(), stream));
    MKV_OK(minikv_decode(b, 0, 2, ids.data(), qd.get(), ob.get(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaMemset(oa.get(), 0xff, 2 * H * D * 2));
    CUDA_OK(cudaDeviceSynchronize());  // the poison lands before the non-blocking stream writes
    if (step % 3 == 0 || flushes) {
      // a: the same step captured into a graph, then launched.
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      const minikv_status s1 = minikv_append(a, 0, 2, ids.data(), kd.get(), vd.get(), stream);
      const minikv_status s2 = minikv_decode(a, 0, 2, ids.data(), qd.get(), oa.get(), stream);
      CUDA_OK(cudaStreamEndCapture(stream, &graph));
      REQUIRE_MESSAGE(s1 == MINIKV_OK, std::string(minikv_last_error_message()));
      REQUIRE_MESSAGE(s2 == MINIKV_OK, std::string(minikv_last_error_message()));
      CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      CUDA_OK(cudaGraphLaunch(exec, stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      CUDA_OK(cudaGraphExecDestroy(exec));
      CUDA_OK(cudaGraphDestroy(graph));
      ++captured;
      flushing_captured += flushes ? 1 : 0;
    } else {
      MKV_OK(minikv_append(a, 0, 2, ids.data(), kd.get(), vd.get(), stream));
      MKV_OK(minikv_decode(a, 0, 2, ids.data(), qd.get(), oa.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
    }
    INFO("step " << step << (flushes ? " (flush)" : ""));
    CHECK(oa.download<uint16_t>(2 * H * D) == ob.download<uint16_t>(2 * H * D));
  }
  CHECK(captured > 10);
  CHECK(flushing_captured >= 1);
  CUDA_OK(cudaStreamDestroy(stream));
}

TEST_CASE("CUDA backend: unsupported configurations and argument errors") {
  GPU_OR_SKIP();
  minikv_config cfg;
  minikv_config_default(&cfg);
  minikv_config_preset(&cfg, MINIKV_PRESET_PAPER);  // 2-bit, G = 16, no sinks
  cfg.backend = MINIKV_BACKEND_CUDA;
  cfg.num_layers = 1;
  cfg.num_heads = 4;
  cfg.num_kv_heads = 2;
  cfg.head_dim = 128;
  cfg.max_seq_len = 256;
  minikv_cache *c = nullptr;
  SUBCASE("F32") {
    cfg.dtype = MINIKV_DTYPE_F32;
    CHECK_EQ(minikv_cache_create(&cfg, &c), MINIKV_ERR_UNSUPPORTED);
    CHECK(std::string(minikv_last_error_message()).find("F32") != std::string::npos);
  }
  SUBCASE("head_dim 48 (not compiled); AUTO falls back to the CPU") {
    cfg.head_dim = 48;
    CHECK_EQ(minikv_cache_create(&cfg, &c), MINIKV_ERR_UNSUPPORTED);
    const std::string msg = minikv_last_error_message();
    CHECK(msg.find("head_dim 48") != std::string::npos);
    CHECK(msg.find("(supported: " + minikv::kernels::compiled_head_dims_text()) != std::string::npos);
    cfg.backend = MINIKV_BACKEND_AUTO;
    MKV_OK(minikv_cache_create(&cfg, &c));
    minikv_cache_destroy(c);
  }
  SUBCASE("every compiled head_dim creates in every storage configuration") {
    // The generic decode takes any bits, group and sinks; create fails only for what the
    // build leaves out (MINIKV_CUDA_HEAD_DIMS).
    for (const uint32_t D : {64u, 80u, 96u, 128u, 256u}) {
      for (const uint32_t bits : {2u, 4u, 8u, 16u}) {
        cfg.head_dim = D;
        cfg.key_bits = bits;
        cfg.value_bits = bits == 16 ? 2 : bits;
        cfg.group_size = D % 32 == 0 ? 32 : 16;
        cfg.residual_length = 2 * cfg.group_size;
        cfg.sink_tokens = bits == 8 ? 4 : 0;
        INFO("head_dim " << D << " bits " << bits);
        const minikv_status st = minikv_cache_create(&cfg, &c);
        if (minikv::kernels::head_dim_compiled(D)) {
          CHECK_EQ(st, MINIKV_OK);
          minikv_cache_destroy(c);
        } else {
          CHECK_EQ(st, MINIKV_ERR_UNSUPPORTED);
        }
      }
    }
  }
  SUBCASE("misaligned device pointer: INVALID_ARGUMENT, the cache stays usable") {
    MKV_OK(minikv_cache_create(&cfg, &c));
    std::unique_ptr<minikv_cache, void (*)(minikv_cache *)> guard(c, minikv_cache_destroy);
    const gt::Prompt p = gt::make_prompt(cfg, 0, {40}, 2);
    DevBuf q(p.q.size() * 2 + 16), k(p.k.size() * 2), v(p.v.size() * 2), o(p.q.size() * 2);
    q.upload(p.q.bits);
    k.upload(p.k.bits);
    v.upload(p.v.bits);
    const uint32_t id = 0;
    const void *bad = static_cast<const uint8_t *>(q.get()) + 2;
    CHECK_EQ(minikv_prefill(c, 0, 1, &id, p.cu.data(), bad, k.get(), v.get(), o.get(), nullptr),
             MINIKV_ERR_INVALID_ARGUMENT);
    CHECK(std::string(minikv_cache_last_error(c)).find("aligned") != std::string::npos);
    MKV_OK(minikv_prefill(c, 0, 1, &id, p.cu.data(), q.get(), k.get(), v.get(), o.get(), nullptr));
    MKV_OK(minikv_decode(c, 0, 1, &id, q.get(), o.get(), nullptr));
    CUDA_OK(cudaDeviceSynchronize());
  }
}

}  // TEST_SUITE
