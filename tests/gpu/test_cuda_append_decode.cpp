// minikv_append_decode on the CUDA backend against minikv_append followed by minikv_decode:
// two CUDA caches driven with the same steps, one through each path, must agree bit for bit
// on every output element, on the sequences' lengths and on the whole device storage (the
// fused launch stores the appended row and its position itself). Covered: each decode
// kernel, fast (GQA 1/2/4/8, head_dim 64/128, fp16/bf16), mma and generic (sinks, 4/8/16
// bits, GQA groups over several CTAs), flushes (the flush subset goes through the append kernel
// first), ragged batches in shuffled order, split-K (long contexts, few sequences), batches
// larger than one decode launch (128) and than one append launch (64), a non-default
// stream, and CUDA graph capture of the combined call. Skipped without a CUDA device.
#include <doctest/doctest.h>

#include <algorithm>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.h"
#include "white_box.hpp"

namespace {

using gt::DevBuf;
using gt::Tensor;

struct Shape {
  const char *name;
  minikv_dtype dtype;
  uint32_t head_dim, heads, kv_heads;
  uint32_t key_bits, value_bits, group, residual, sinks;
  std::vector<uint32_t> lens;
  uint32_t steps;
  const char *kernel = nullptr;  // MINIKV_DECODE_KERNEL (nullptr: the library's plan)
  uint32_t flush = 0;            // flush_tokens (0: the whole residual)
};

minikv_config config_of(const Shape &s) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.backend = MINIKV_BACKEND_CUDA;
  cfg.dtype = s.dtype;
  cfg.num_layers = 2;
  cfg.num_heads = s.heads;
  cfg.num_kv_heads = s.kv_heads;
  cfg.head_dim = s.head_dim;
  cfg.max_sequences = static_cast<uint32_t>(s.lens.size());
  cfg.max_seq_len = *std::max_element(s.lens.begin(), s.lens.end()) + s.steps + 1;
  cfg.key_bits = s.key_bits;
  cfg.value_bits = s.value_bits;
  cfg.group_size = s.group;
  cfg.residual_length = s.residual;
  cfg.sink_tokens = s.sinks;
  cfg.flush_tokens = s.flush;
  return cfg;
}

struct CacheDeleter {
  void operator()(minikv_cache *c) const { minikv_cache_destroy(c); }
};
using CachePtr = std::unique_ptr<minikv_cache, CacheDeleter>;

CachePtr make(const minikv_config &cfg) {
  minikv_cache *c = nullptr;
  MKV_OK(minikv_cache_create(&cfg, &c));
  return CachePtr(c);
}

// Random rows in the dtype, on the device.
DevBuf device_tensor(minikv_dtype dt, size_t n, std::mt19937 &rng, float stddev) {
  Tensor t(dt, n);
  t.fill_normal(rng, stddev);
  DevBuf d(n * 2);
  d.upload(t.bits);
  return d;
}

void prefill_both(minikv_cache *a, minikv_cache *b, const minikv_config &cfg,
                  const std::vector<uint32_t> &ids, const std::vector<uint32_t> &lens,
                  std::mt19937 &rng) {
  std::vector<int32_t> cu(1, 0);
  for (uint32_t L : lens) cu.push_back(cu.back() + static_cast<int32_t>(L));
  const size_t T = cu.back(), q_row = size_t(cfg.num_heads) * cfg.head_dim,
               kv_row = size_t(cfg.num_kv_heads) * cfg.head_dim;
  for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
    DevBuf q = device_tensor(cfg.dtype, T * q_row, rng, 1.0f);
    DevBuf k = device_tensor(cfg.dtype, T * kv_row, rng, 1.5f);
    DevBuf v = device_tensor(cfg.dtype, T * kv_row, rng, 1.0f);
    DevBuf out(T * q_row * 2);
    for (minikv_cache *c : {a, b})
      MKV_OK(minikv_prefill(c, layer, static_cast<uint32_t>(ids.size()), ids.data(), cu.data(),
                            q.get(), k.get(), v.get(), out.get(), nullptr));
  }
}

void run(const Shape &s, cudaStream_t stream) {
  INFO(std::string(s.name));
  const minikv_config cfg = config_of(s);
  const gt::DecodeKernelChoice choice(s.kernel);
  CachePtr fused = make(cfg), split = make(cfg);
  const uint32_t n = static_cast<uint32_t>(s.lens.size());
  std::vector<uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0u);
  std::reverse(ids.begin(), ids.end());  // slots not in batch order
  std::mt19937 rng(1234);
  prefill_both(fused.get(), split.get(), cfg, ids, s.lens, rng);
  const size_t q_row = size_t(cfg.num_heads) * cfg.head_dim,
               kv_row = size_t(cfg.num_kv_heads) * cfg.head_dim;
  std::vector<uint32_t> appended(n, 0);
  for (uint32_t step = 0; step < s.steps; ++step) {
    // Every other step the whole batch, otherwise a shuffled subset of it.
    std::vector<uint32_t> batch = ids;
    std::shuffle(batch.begin(), batch.end(), rng);
    if (step % 2 == 1) batch.resize(1 + rng() % n);
    const uint32_t b = static_cast<uint32_t>(batch.size());
    for (uint32_t id : batch) ++appended[id];
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      CAPTURE(step);
      CAPTURE(layer);
      DevBuf q = device_tensor(cfg.dtype, b * q_row, rng, 1.0f);
      DevBuf k = device_tensor(cfg.dtype, b * kv_row, rng, 1.5f);
      DevBuf v = device_tensor(cfg.dtype, b * kv_row, rng, 1.0f);
      DevBuf out_fused(b * q_row * 2), out_split(b * q_row * 2);
      CUDA_OK(cudaMemset(out_fused.get(), 0xff, b * q_row * 2));  // NaN poison
      // The uploads and the poison ran on the legacy stream, which a non-blocking `stream`
      // does not wait for (cudaMemset and pageable uploads return before they land).
      CUDA_OK(cudaDeviceSynchronize());
      MKV_OK(minikv_append_decode(fused.get(), layer, b, batch.data(), q.get(), k.get(), v.get(),
                                  out_fused.get(), stream));
      MKV_OK(minikv_append(split.get(), layer, b, batch.data(), k.get(), v.get(), stream));
      MKV_OK(minikv_decode(split.get(), layer, b, batch.data(), q.get(), out_split.get(), stream));
      CUDA_OK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> a = out_fused.download<uint16_t>(b * q_row);
      const std::vector<uint16_t> c = out_split.download<uint16_t>(b * q_row);
      size_t differ = 0;
      for (size_t i = 0; i < a.size(); ++i) differ += a[i] != c[i];
      INFO(differ << " of " << a.size() << " output elements differ");
      CHECK(differ == 0);
    }
    if (step % 16 == 15) test::check_same_storage(fused.get(), split.get(), "after step " + std::to_string(step));
  }
  // A residual holds fewer than R tokens: R appends to one sequence flushed it.
  CHECK(*std::max_element(appended.begin(), appended.end()) >= s.residual);
  for (uint32_t id : ids)
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      uint64_t sa = 0, ca = 0, sb = 1, cb = 1;
      MKV_OK(minikv_sequence_length(fused.get(), id, layer, &sa, &ca));
      MKV_OK(minikv_sequence_length(split.get(), id, layer, &sb, &cb));
      CHECK(sa == sb);
      CHECK(ca == cb);
    }
  test::check_same_storage(fused.get(), split.get(), "at the end");
}

std::vector<uint32_t> many(uint32_t n) {
  std::vector<uint32_t> lens(n);
  for (uint32_t i = 0; i < n; ++i) lens[i] = 3 + (i * 29) % 70;
  return lens;
}

const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("append_decode equals append then decode bit for bit on CUDA") {
  GPU_OR_CHECK_CONFIGS();
  const Shape shapes[] = {
      // the fast kernel (the library's plan): 2-bit, G 16, no sinks, GQA 1/2/4/8
      {"fast f16 hd128 mha", F16, 128, 4, 4, 2, 2, 16, 32, 0, {1, 40, 300}, 70},
      {"fast bf16 hd64 gqa2", BF16, 64, 4, 2, 2, 2, 16, 32, 0, {17, 129}, 70},
      {"fast f16 hd128 gqa4 long split-K", F16, 128, 8, 2, 2, 2, 16, 64, 0, {3000}, 70},
      {"fast bf16 hd128 gqa8", BF16, 128, 16, 2, 2, 2, 16, 16, 0, {90, 5}, 40},
      // the tensor-core kernel (the plan for other GQA storage): sinks, other bits, groups
      // over several CTAs
      // the default storage's four-warp kernel (its plan on sm_90 for groups of more than
      // four; forced for the others): short tiles, splits, 8 head slots
      {"k4v2 f16 hd128 G32 4 sinks gqa4", F16, 128, 8, 2, 4, 2, 32, 32, 4, {2, 200, 700}, 70, "k4v2"},
      {"k4v2 bf16 hd128 G32 4 sinks gqa8 long split-K", BF16, 128, 16, 2, 4, 2, 32, 128, 4, {4000, 300}, 150},
      {"k4v2 f16 hd64 G32 mha", F16, 64, 4, 4, 4, 2, 32, 64, 0, {1, 40, 300}, 80, "k4v2"},
      // its one-warp kernel (the plan for groups of up to four): MHA, groups of 2 and 4, 8
      // (forced: two chunks of four head slots)
      {"k4v2-warp f16 hd64 G32 mha", F16, 64, 4, 4, 4, 2, 32, 64, 0, {1, 40, 300}, 80, "k4v2-warp"},
      {"k4v2-warp bf16 hd128 G32 4 sinks mha long split-K", BF16, 128, 4, 4, 4, 2, 32, 128, 4, {4000, 300}, 150,
       "k4v2-warp"},
      {"k4v2-warp f16 hd128 G32 4 sinks gqa4", F16, 128, 8, 2, 4, 2, 32, 32, 4, {2, 200, 700}, 70, "k4v2-warp"},
      {"k4v2-warp bf16 hd64 G32 gqa2", BF16, 64, 4, 2, 4, 2, 32, 32, 0, {17, 129}, 70, "k4v2-warp"},
      {"k4v2-warp f16 hd128 G32 gqa8 long split-K", F16, 128, 16, 2, 4, 2, 32, 128, 4, {4000, 300}, 150,
       "k4v2-warp"},
      {"mma f16 hd128 K4V2 G32 4 sinks gqa4", F16, 128, 8, 2, 4, 2, 32, 32, 4, {2, 200, 700}, 70, "mma"},
      {"mma bf16 hd64 K8V8 gqa3", BF16, 64, 6, 2, 8, 8, 16, 16, 0, {60, 1}, 40},
      {"mma f16 hd64 16/16 gqa12 17 sinks", F16, 64, 12, 1, 16, 16, 16, 32, 17, {100, 10}, 70},
      {"mma bf16 hd128 K4V4 gqa4 long split-K", BF16, 128, 4, 1, 4, 4, 16, 128, 0, {4000}, 130},
      // the generic kernel: its plan for MHA outside the fast path, forced elsewhere
      {"generic bf16 hd64 K8V8 mha", BF16, 64, 4, 4, 8, 8, 16, 16, 0, {60, 1, 33}, 40},
      {"generic f16 hd128 K4V2 G32 4 sinks gqa4", F16, 128, 8, 2, 4, 2, 32, 32, 4, {2, 200, 700}, 70, "generic"},
      {"generic f16 hd64 16/16 gqa12 17 sinks", F16, 64, 12, 1, 16, 16, 16, 32, 17, {100, 10}, 70, "generic"},
      {"generic bf16 hd128 K2V4 gqa2 long split-K", BF16, 128, 4, 2, 2, 4, 16, 128, 0, {4000}, 130, "generic"},
      // more sequences than one decode launch (128) and one append launch (64)
      {"fast f16 hd64 gqa2 batch of 150", F16, 64, 4, 2, 2, 2, 16, 16, 0, many(150), 32},
      {"mma f16 hd64 K4V2 gqa2 batch of 150", F16, 64, 4, 2, 4, 2, 16, 16, 4, many(150), 32},
      {"generic f16 hd64 K4V2 gqa2 batch of 150", F16, 64, 4, 2, 4, 2, 16, 16, 4, many(150), 32, "generic"},
      {"k4v2-warp f16 hd128 G32 4 sinks gqa4 batch of 150", F16, 128, 8, 2, 4, 2, 32, 32, 4, many(150), 40},
      {"k4v2 f16 hd128 G32 4 sinks gqa8 batch of 300", F16, 128, 16, 2, 4, 2, 32, 32, 4, many(300), 40},
      // sliding flushes (flush_tokens < R)
      {"k4v2-warp f16 hd128 G32 4 sinks mha R64 F32", F16, 128, 4, 4, 4, 2, 32, 64, 4, {2, 200, 700}, 130, nullptr, 32},
      {"k4v2 bf16 hd128 G32 4 sinks gqa8 R128 F32", BF16, 128, 16, 2, 4, 2, 32, 128, 4, {4000, 300}, 200, nullptr, 32},
      {"fast f16 hd128 gqa4 R64 F16", F16, 128, 8, 2, 2, 2, 16, 64, 0, {1, 40, 300}, 130, nullptr, 16},
      {"mma bf16 hd64 K8V8 gqa3 R48 F32", BF16, 64, 6, 2, 8, 8, 16, 48, 0, {60, 1}, 100, nullptr, 32},
  };
  if (gt::configs_only()) {
    for (const Shape &s : shapes) {
      INFO(std::string(s.name));
      gt::check_config_on_cpu(config_of(s));
    }
    return;
  }
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const Shape &s : shapes) {
    SUBCASE(s.name) { run(s, s.lens.size() > 100 ? stream : nullptr); }
  }
  CUDA_OK(cudaStreamDestroy(stream));
}

// Three caches: `graph` replays each step captured in a graph, `plain` runs the combined
// call, `split` append + decode; all three outputs must be identical. Returns how many steps
// flushed a residual (its append launch captured too).
int run_graph_case(const Shape &s) {
  minikv_config cfg = config_of(s);
  cfg.num_layers = 1;
  CachePtr graph_cache = make(cfg), plain = make(cfg), split = make(cfg);
  std::mt19937 rng(77);
  const uint32_t n = static_cast<uint32_t>(s.lens.size());
  std::vector<uint32_t> ids(n);
  std::iota(ids.begin(), ids.end(), 0u);
  std::reverse(ids.begin(), ids.end());  // slots not in batch order
  prefill_both(graph_cache.get(), plain.get(), cfg, ids, s.lens, rng);
  std::mt19937 rng2(77);
  CachePtr unused = make(cfg);
  prefill_both(split.get(), unused.get(), cfg, ids, s.lens, rng2);  // the same prompts
  const size_t q_row = size_t(cfg.num_heads) * cfg.head_dim,
               kv_row = size_t(cfg.num_kv_heads) * cfg.head_dim;
  cudaStream_t stream;
  CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // Residual tokens per sequence: the prefill quantizes the largest multiple of G of the
  // kept tokens after the sinks; a step that brings the residual to R flushes it.
  std::vector<uint64_t> residual(n);
  for (uint32_t b = 0; b < n; ++b) {
    uint64_t cached = 0;
    MKV_OK(minikv_sequence_length(plain.get(), b, 0, nullptr, &cached));
    residual[b] = (cached - s.sinks) % s.group;
  }
  int flushing = 0;
  for (uint32_t step = 0; step < s.steps; ++step) {
    CAPTURE(step);
    DevBuf q = device_tensor(cfg.dtype, n * q_row, rng, 1.0f);
    DevBuf k = device_tensor(cfg.dtype, n * kv_row, rng, 1.5f);
    DevBuf v = device_tensor(cfg.dtype, n * kv_row, rng, 1.0f);
    DevBuf og(n * q_row * 2), op(n * q_row * 2), os(n * q_row * 2);
    CUDA_OK(cudaMemset(og.get(), 0xff, n * q_row * 2));
    CUDA_OK(cudaDeviceSynchronize());  // inputs and poison in place before the non-blocking stream
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const minikv_status st = minikv_append_decode(graph_cache.get(), 0, n, ids.data(), q.get(),
                                                  k.get(), v.get(), og.get(), stream);
    CUDA_OK(cudaStreamEndCapture(stream, &graph));
    REQUIRE_MESSAGE(st == MINIKV_OK, std::string(minikv_last_error_message()));
    CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    CUDA_OK(cudaGraphLaunch(exec, stream));
    MKV_OK(minikv_append_decode(plain.get(), 0, n, ids.data(), q.get(), k.get(), v.get(), op.get(), stream));
    MKV_OK(minikv_append(split.get(), 0, n, ids.data(), k.get(), v.get(), stream));
    MKV_OK(minikv_decode(split.get(), 0, n, ids.data(), q.get(), os.get(), stream));
    CUDA_OK(cudaStreamSynchronize(stream));
    CUDA_OK(cudaGraphExecDestroy(exec));
    CUDA_OK(cudaGraphDestroy(graph));
    const std::vector<uint16_t> g = og.download<uint16_t>(n * q_row);
    CHECK(g == op.download<uint16_t>(n * q_row));
    CHECK(g == os.download<uint16_t>(n * q_row));
    bool flushed = false;
    for (uint64_t &r : residual)
      if (++r == s.residual) {
        r = s.flush ? s.residual - s.flush : 0;
        flushed = true;
      }
    flushing += flushed;
  }
  test::check_same_storage(graph_cache.get(), split.get(), "graph vs append + decode");
  CUDA_OK(cudaStreamDestroy(stream));
  return flushing;
}

TEST_CASE("CUDA graph capture of append_decode replays the uncaptured calls") {
  GPU_OR_SKIP();
  SUBCASE("paper storage with flushes") {
    // R = 16: steps with and without a flush. Kept: 37 + 37 of 150 (64 quantized + 10
    // residual), 19 + 19 of 77 (32 + 6).
    CHECK(run_graph_case({"graph", F16, 128, 8, 2, 2, 2, 16, 16, 0, {150, 77}, 40}) >= 2);
  }
  SUBCASE("default storage with the split merge launched as a dependent") {
    // 4-bit keys, 2-bit values, G 32, 4 sinks, groups of 4: the one-warp kernel, ~31
    // 128-token tiles per sequence over 4 CTAs' worth of heads, so more splits than its
    // in-kernel merge takes (splits x 4 slots > 64): decode_merge runs, launched as a
    // programmatic dependent, and its graph edge is captured.
    run_graph_case({"graph default", F16, 128, 8, 2, 4, 2, 32, 128, 4, {8000, 3000}, 6});
  }
  SUBCASE("default storage over side-by-side decode launches") {
    // 300 sequences: three decode launches of 100 on their own streams, forked from the
    // captured stream and joined back into it (each with its own partials and counters).
    CHECK(run_graph_case({"graph default batch of 300", F16, 128, 8, 2, 4, 2, 32, 64, 4, many(300), 40}) >= 2);
  }
  SUBCASE("default storage with sliding flushes") {
    // R = 64, F = 32: after a sequence's first flush, one every 32 steps.
    CHECK(run_graph_case({"graph sliding", F16, 128, 8, 2, 4, 2, 32, 64, 4, {150, 77, 3}, 110, nullptr, 32}) >= 4);
  }
}

}  // TEST_SUITE
