// minikv-test: white-box (reads the stored bytes through src/handle.h).
// Chunked prefill on the CUDA backend (minikv_prefill_chunk): prompts sent in chunks of
// many sizes (1 token, sizes not aligned to the group, the residual or the kernels' 64/128-
// row tiles, long chunks), alone or in ragged batches that mix first, middle, last and
// whole-prompt chunks, more sequences than one launch holds, fp16/bf16, head_dim 64, 80,
// 96, 128 and 256 (those this build compiles, cuda_shapes.h), GQA 1/2/4/8, CUMULATIVE and WINDOW scores, sinks. Each is compared on every element with
// the same prompts prefilled whole on the CUDA backend and on the CPU backend: outputs
// within the CUDA-vs-CPU tolerance, kept positions identical (inputs whose selection
// boundary is well separated, gpu_util.h) and equal to the float64 reference selection,
// stored bytes identical to the whole-prompt CUDA cache, equal statistics, and decode steps
// across residual flushes afterwards. Skipped when no CUDA device is present.
#include <doctest/doctest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "../../kernels/cuda_shapes.h"
#include "cpu_gpu_pair.h"
#include "handle.h"

namespace {

using gt::Case;
using gt::DevBuf;
using gt::Tensor;
using gt::check_stats_equal;

const minikv_dtype F16 = MINIKV_DTYPE_F16, BF16 = MINIKV_DTYPE_BF16;
const minikv_score_mode CUM = MINIKV_SCORE_CUMULATIVE, WIN = MINIKV_SCORE_WINDOW;
const minikv_budget_policy UNI = MINIKV_BUDGET_UNIFORM, PYR = MINIKV_BUDGET_PYRAMID;

// How prompts are cut: every chunk `size` rows (the last one shorter), or random sizes in
// [1, size]; staggered: sequence i sends its first chunk at step i % 3.
struct Cut {
  uint32_t size;
  bool random = false;
  bool staggered = false;
};

std::vector<uint32_t> cut_prompt(uint32_t L, const Cut &cut, std::mt19937 &rng) {
  std::vector<uint32_t> c;
  for (uint32_t at = 0; at < L;) {
    const uint32_t n = std::min(L - at, cut.random ? 1 + uint32_t(rng() % cut.size) : cut.size);
    c.push_back(n);
    at += n;
  }
  return c;
}

struct Caches {
  minikv_cache *cpu = nullptr, *whole = nullptr, *chunked = nullptr;
  explicit Caches(minikv_config cfg) {
    cfg.backend = MINIKV_BACKEND_CPU;
    MKV_OK(minikv_cache_create(&cfg, &cpu));
    cfg.backend = MINIKV_BACKEND_CUDA;
    MKV_OK(minikv_cache_create(&cfg, &whole));
    MKV_OK(minikv_cache_create(&cfg, &chunked));
  }
  ~Caches() {
    minikv_cache_destroy(cpu);
    minikv_cache_destroy(whole);
    minikv_cache_destroy(chunked);
  }
};

// The rows [first, first + n) of sequence s of a packed [T][heads][D] tensor, appended to dst.
void take_rows(const Tensor &src, const std::vector<int32_t> &cu, size_t s, uint32_t first,
               uint32_t n, size_t row, std::vector<uint16_t> &dst) {
  const size_t at = (size_t(cu[s]) + first) * row;
  dst.insert(dst.end(), src.bits.begin() + at, src.bits.begin() + at + size_t(n) * row);
}

// Prefills every layer of `prompts` in chunks (engine order: each step, every layer in turn,
// one ragged batch of the sequences that have a chunk left) and returns the outputs in the
// whole prompts' packing.
std::vector<Tensor> prefill_in_chunks(minikv_cache *c, const minikv_config &cfg,
                                      const std::vector<uint32_t> &ids,
                                      const std::vector<gt::Prompt> &prompts,
                                      const std::vector<uint32_t> &lens, const Cut &cut) {
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  std::mt19937 rng(1234);
  std::vector<std::vector<uint32_t>> chunks;
  for (uint32_t L : lens) chunks.push_back(cut_prompt(L, cut, rng));
  std::vector<Tensor> out;
  for (const gt::Prompt &p : prompts) out.emplace_back(cfg.dtype, p.q.size());
  std::vector<uint32_t> next(lens.size(), 0), done(lens.size(), 0);
  for (uint32_t step = 0;; ++step) {
    std::vector<size_t> seqs;
    bool left = false;
    for (size_t i = 0; i < lens.size(); ++i) {
      left = left || next[i] < chunks[i].size();
      if ((!cut.staggered || step >= i % 3) && next[i] < chunks[i].size()) seqs.push_back(i);
    }
    if (!left) break;
    if (seqs.empty()) continue;
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      const gt::Prompt &p = prompts[layer];
      std::vector<uint32_t> batch_ids, prompt_lens;
      std::vector<int32_t> cu{0};
      std::vector<uint16_t> q, k, v;
      for (size_t i : seqs) {
        const uint32_t n = chunks[i][next[i]];
        batch_ids.push_back(ids[i]);
        prompt_lens.push_back(lens[i]);
        cu.push_back(cu.back() + static_cast<int32_t>(n));
        take_rows(p.q, p.cu, i, done[i], n, size_t(H) * D, q);
        take_rows(p.k, p.cu, i, done[i], n, size_t(Hkv) * D, k);
        take_rows(p.v, p.cu, i, done[i], n, size_t(Hkv) * D, v);
      }
      DevBuf qd(q.size() * 2), kd(k.size() * 2), vd(v.size() * 2), od(q.size() * 2);
      qd.upload(q);
      kd.upload(k);
      vd.upload(v);
      CUDA_OK(cudaMemset(od.get(), 0xff, q.size() * 2));  // NaN poison: every row written
      INFO("step " << step << " layer " << layer);
      MKV_OK(minikv_prefill_chunk(c, layer, static_cast<uint32_t>(seqs.size()), batch_ids.data(),
                                  cu.data(), prompt_lens.data(), qd.get(), kd.get(), vd.get(),
                                  od.get(), nullptr));
      const std::vector<uint16_t> o = od.download<uint16_t>(q.size());
      for (size_t b = 0; b < seqs.size(); ++b) {
        const size_t i = seqs[b], row = size_t(H) * D;
        const size_t n = size_t(cu[b + 1] - cu[b]);
        for (size_t e = 0; e < n * row; ++e)
          out[layer].set((size_t(p.cu[i]) + done[i]) * row + e,
                         gt::from_bits(cfg.dtype, o[size_t(cu[b]) * row + e]));
      }
    }
    for (size_t i : seqs) done[i] += chunks[i][next[i]++];
  }
  return out;
}

std::vector<Tensor> prefill_whole_gpu(minikv_cache *c, const std::vector<uint32_t> &ids,
                                      const std::vector<gt::Prompt> &prompts) {
  std::vector<Tensor> out;
  for (uint32_t layer = 0; layer < prompts.size(); ++layer) {
    const gt::Prompt &p = prompts[layer];
    DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(p.q.size() * 2);
    q.upload(p.q.bits);
    k.upload(p.k.bits);
    v.upload(p.v.bits);
    MKV_OK(minikv_prefill(c, layer, static_cast<uint32_t>(ids.size()), ids.data(), p.cu.data(),
                          q.get(), k.get(), v.get(), o.get(), nullptr));
    out.push_back(Tensor::from_device(p.q.dtype, o, p.q.size()));
  }
  return out;
}

std::vector<Tensor> prefill_whole_cpu(minikv_cache *c, const std::vector<uint32_t> &ids,
                                      const std::vector<gt::Prompt> &prompts) {
  std::vector<Tensor> out;
  for (uint32_t layer = 0; layer < prompts.size(); ++layer) {
    const gt::Prompt &p = prompts[layer];
    std::vector<uint16_t> o(p.q.size());
    MKV_OK(minikv_prefill(c, layer, static_cast<uint32_t>(ids.size()), ids.data(), p.cu.data(),
                          p.q.bits.data(), p.k.bits.data(), p.v.bits.data(), o.data(), nullptr));
    out.push_back(Tensor::from_host_bits(p.q.dtype, o));
  }
  return out;
}

// Rows whose every element has the same bits in both (reported, not asserted: the forward
// computes each row from its position and the keys alone, so chunked rows usually are).
size_t identical_rows(const Tensor &a, const Tensor &b, size_t row) {
  size_t same = 0;
  for (size_t r = 0; r < a.size() / row; ++r)
    same += std::equal(a.bits.begin() + r * row, a.bits.begin() + (r + 1) * row, b.bits.begin() + r * row);
  return same;
}

void run_chunked(const Case &c, const Cut &cut) {
  INFO("case " << c.name << ", chunks of " << (cut.random ? "up to " : "") << cut.size
               << (cut.staggered ? ", staggered" : ""));
  minikv_config cfg = gt::make_config(c, MINIKV_BACKEND_CUDA);
  cfg.prefill_staging_tokens = std::accumulate(c.lens.begin(), c.lens.end(), 0u);
  if (gt::configs_only()) {
    gt::check_config_on_cpu(cfg);
    return;
  }
  Caches caches(cfg);
  std::vector<uint32_t> ids(c.lens.size());
  std::iota(ids.begin(), ids.end(), 0u);
  std::reverse(ids.begin(), ids.end());  // slots not in batch order
  std::vector<gt::Prompt> prompts;
  for (uint32_t layer = 0; layer < cfg.num_layers; ++layer)
    prompts.push_back(gt::make_prompt(cfg, layer, c.lens, 17 + layer));

  const std::vector<Tensor> cpu = prefill_whole_cpu(caches.cpu, ids, prompts);
  const std::vector<Tensor> whole = prefill_whole_gpu(caches.whole, ids, prompts);
  const std::vector<Tensor> chunked = prefill_in_chunks(caches.chunked, cfg, ids, prompts, c.lens, cut);
  const size_t row = size_t(cfg.num_heads) * cfg.head_dim;
  for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
    INFO("layer " << layer << ", input seed " << prompts[layer].seed);
    gt::check_close(chunked[layer], whole[layer], gt::attention_tol(cfg.dtype), "chunked vs whole (CUDA)");
    gt::check_close(chunked[layer], cpu[layer], gt::attention_tol(cfg.dtype), "chunked (CUDA) vs CPU");
    MESSAGE(c.name << " layer " << layer << ": " << identical_rows(chunked[layer], whole[layer], row)
                   << " of " << chunked[layer].size() / row << " output rows bit-identical to one call");
    for (size_t s = 0; s < ids.size(); ++s)
      for (uint32_t kvh = 0; kvh < cfg.num_kv_heads; ++kvh) {
        INFO("seq_id " << ids[s] << " kv_head " << kvh);
        const std::vector<int32_t> got = gt::Pair::kept(caches.chunked, ids[s], layer, kvh);
        CHECK(got == gt::Pair::kept(caches.cpu, ids[s], layer, kvh));
        CHECK(got == prompts[layer].expected_kept[s * cfg.num_kv_heads + kvh]);
      }
  }
  check_stats_equal(caches.chunked, caches.cpu);
  check_stats_equal(caches.chunked, caches.whole);
  if (!cut.staggered) {  // the same blocks in the same order: the same bytes
    std::vector<uint8_t> pool_c, res_c, pool_w, res_w;
    caches.chunked->impl.backend().read_storage(pool_c, res_c);
    caches.whole->impl.backend().read_storage(pool_w, res_w);
    CHECK(pool_c == pool_w);
    CHECK(res_c == res_w);
  }

  // Generation on all three: the chunked cache decodes like the others.
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  const uint32_t n = static_cast<uint32_t>(ids.size());
  std::mt19937 rng(99);
  for (uint32_t step = 0; step < c.steps; ++step)
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      Tensor k(cfg.dtype, size_t(n) * Hkv * D), v(cfg.dtype, size_t(n) * Hkv * D), q(cfg.dtype, size_t(n) * H * D);
      k.fill_normal(rng, 1.5f);
      v.fill_normal(rng, 1.0f);
      q.fill_normal(rng, 1.0f);
      std::vector<uint16_t> out_cpu(q.size());
      MKV_OK(minikv_append(caches.cpu, layer, n, ids.data(), k.bits.data(), v.bits.data(), nullptr));
      MKV_OK(minikv_decode(caches.cpu, layer, n, ids.data(), q.bits.data(), out_cpu.data(), nullptr));
      DevBuf kd(k.size() * 2), vd(v.size() * 2), qd(q.size() * 2), ow(q.size() * 2), oc(q.size() * 2);
      kd.upload(k.bits);
      vd.upload(v.bits);
      qd.upload(q.bits);
      for (minikv_cache *g : {caches.whole, caches.chunked})
        MKV_OK(minikv_append(g, layer, n, ids.data(), kd.get(), vd.get(), nullptr));
      MKV_OK(minikv_decode(caches.whole, layer, n, ids.data(), qd.get(), ow.get(), nullptr));
      MKV_OK(minikv_decode(caches.chunked, layer, n, ids.data(), qd.get(), oc.get(), nullptr));
      const Tensor got = Tensor::from_device(cfg.dtype, oc, q.size());
      const std::string what = "decode step " + std::to_string(step) + " layer " + std::to_string(layer);
      gt::check_close(got, Tensor::from_host_bits(cfg.dtype, out_cpu), gt::attention_tol(cfg.dtype), what + " vs CPU");
      if (!cut.staggered) CHECK(got.bits == Tensor::from_device(cfg.dtype, ow, q.size()).bits);
    }
  check_stats_equal(caches.chunked, caches.cpu);
}

std::vector<uint32_t> batch_lens(uint32_t n) {
  std::vector<uint32_t> lens(n);
  for (uint32_t i = 0; i < n; ++i) lens[i] = 5 + (i * 37) % 56;
  return lens;
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA chunked prefill equals one call: ragged batches in both score modes") {
  GPU_OR_CHECK_CONFIGS();
  struct Run {
    Case c;
    Cut cut;
  };
  const std::vector<Run> runs = {
      // 1-token and tile-boundary prompts with a long one, chunks of 100 (not a multiple of
      // the 64/128-row tiles or of G), staggered: batches mix whole prompts and chunks
      {{"f16 hd128 gqa4 cumulative", F16, 128, 8, 2, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
        {1, 64, 65, 300, 2100}, 40},
       {100, false, true}},
      {{"f16 hd128 gqa4 cumulative aligned", F16, 128, 8, 2, CUM, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
        {1, 64, 65, 300, 2100}, 40},
       {37}},
      // WINDOW with max-pool, random chunk sizes (the window's queries split across chunks)
      {{"bf16 hd64 gqa1 window 4/2 G32", BF16, 64, 8, 8, WIN, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
        {130, 257, 40}, 30},
       {50, true, true}},
      {{"f16 hd128 gqa2 window 2/2", F16, 128, 4, 2, WIN, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
        {31, 500}, 20},
       {17}},
      // chunks of one token; GQA 8 with pyramid budgets and 4-bit values
      {{"f16 hd64 gqa8 pyramid 2/4 G16 1-token chunks", F16, 64, 16, 2, CUM, 2, 4, 16, 32, PYR,
        0.25f, 0.25f, {130}, 30},
       {1}},
      {{"bf16 hd128 gqa4 window 1-token chunks", BF16, 128, 8, 2, WIN, 2, 2, 16, 32, UNI, 0.25f,
        0.25f, {70, 33}, 10},
       {1}},
      // pure eviction with sinks; keep-all; recent-only
      {{"bf16 hd128 gqa2 16/16 4 sinks", BF16, 128, 4, 2, CUM, 16, 16, 16, 32, UNI, 0.25f, 0.25f,
        {200, 31, 3}, 20, 1.0f, 4},
       {64, false, true}},
      {{"f16 hd128 gqa8 keep-all", F16, 128, 8, 1, WIN, 2, 2, 16, 64, UNI, 0.6f, 0.5f, {100, 7}, 20},
       {30}},
      {{"bf16 hd64 recent-only G64", BF16, 64, 4, 4, CUM, 2, 2, 64, 128, UNI, 0.0f, 0.3f, {333}, 40},
       {100}},
      // long prompts in long chunks (a 3000-token prompt in chunks of 1000 and of 700)
      {{"f16 hd128 mha cumulative long", F16, 128, 4, 4, CUM, 2, 2, 16, 128, UNI, 0.25f, 0.25f,
        {3000}, 10},
       {1000}},
      {{"bf16 hd64 gqa4 window long", BF16, 64, 8, 2, WIN, 4, 2, 32, 128, UNI, 0.25f, 0.25f,
        {3000, 1200}, 10},
       {700, false, true}},
      // more sequences than one launch holds (64), in chunks
      {{"f16 hd64 gqa2 batch of 70", F16, 64, 4, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f,
        batch_lens(70), 10},
       {23, false, true}},
      // the head_dims without a wgmma forward (the mma.sync one, 64-row query tiles of
      // 80/96/256 channels) and whose decode takes the generic kernel: 2-bit code rows of 20
      // (hd80) and 24 bytes (hd96) stay packed; hd256 with sinks and 4-bit storage
      {{"f16 hd80 gqa4 cumulative", F16, 80, 8, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f,
        {1, 64, 65, 300}, 30},
       {37, false, true}},
      {{"bf16 hd80 mha window 1-token chunks", BF16, 80, 4, 4, WIN, 2, 4, 16, 32, UNI, 0.25f,
        0.25f, {70, 9}, 10},
       {1}},
      {{"bf16 hd96 gqa2 window 4/2 G32", BF16, 96, 4, 2, WIN, 4, 2, 32, 64, UNI, 0.25f, 0.25f,
        {130, 257, 40}, 20},
       {50, true, true}},
      {{"f16 hd96 gqa8 pyramid 2/2 G16", F16, 96, 8, 1, CUM, 2, 2, 16, 32, PYR, 0.25f, 0.25f,
        {200, 31}, 20},
       {64}},
      {{"f16 hd256 gqa4 4/4 G32 4 sinks", F16, 256, 8, 2, CUM, 4, 4, 32, 64, UNI, 0.25f, 0.25f,
        {200, 33, 3}, 20, 1.0f, 4},
       {60, false, true}},
      {{"bf16 hd256 mha window long", BF16, 256, 2, 2, WIN, 2, 2, 16, 64, UNI, 0.25f, 0.25f,
        {1500}, 10},
       {500}},
  };
  for (const Run &r : runs) {
    SUBCASE(r.c.name) {
      if (!minikv::kernels::head_dim_compiled(r.c.head_dim)) {
        MESSAGE("head_dim " << r.c.head_dim << " is not compiled into this build: skipped");
      } else {
        run_chunked(r.c, r.cut);
      }
    }
  }
}

TEST_CASE("CUDA chunked prefill: an abandoned prompt and a full staging area change nothing") {
  GPU_OR_SKIP();
  const Case c{"abandon", F16, 128, 8, 2, CUM, 2, 2, 16, 32, UNI, 0.25f, 0.25f, {400}, 0};
  minikv_config cfg = gt::make_config(c, MINIKV_BACKEND_CUDA);
  cfg.num_layers = 1;
  cfg.prefill_staging_tokens = 400;
  Caches caches(cfg);
  const gt::Prompt p = gt::make_prompt(cfg, 0, c.lens, 61);
  const uint32_t id = 1, other = 0;
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
  DevBuf q(p.q.size() * 2), k(p.k.size() * 2), v(p.v.size() * 2), o(p.q.size() * 2);
  q.upload(p.q.bits);
  k.upload(p.k.bits);
  v.upload(p.v.bits);
  auto chunk = [&](uint32_t seq, uint32_t first, uint32_t n) {
    const int32_t cu[2] = {0, static_cast<int32_t>(n)};
    const uint32_t len = 400;
    return minikv_prefill_chunk(caches.chunked, 0, 1, &seq, cu, &len,
                                static_cast<const uint16_t *>(q.get()) + size_t(first) * H * D,
                                static_cast<const uint16_t *>(k.get()) + size_t(first) * Hkv * D,
                                static_cast<const uint16_t *>(v.get()) + size_t(first) * Hkv * D,
                                static_cast<uint16_t *>(o.get()) + size_t(first) * H * D, nullptr);
  };
  MKV_OK(chunk(id, 0, 160));
  // The staging area (400 rows) is held by that prompt: another one cannot start.
  CHECK_EQ(chunk(other, 0, 10), MINIKV_ERR_CAPACITY_EXCEEDED);
  MKV_OK(minikv_sequence_release(caches.chunked, id));  // abandoned mid-prompt
  // The same prompt again (in another slot, other chunks) equals one call on the CPU.
  CUDA_OK(cudaMemset(o.get(), 0xff, p.q.size() * 2));
  MKV_OK(chunk(other, 0, 16));
  MKV_OK(chunk(other, 16, 129));
  MKV_OK(chunk(other, 145, 255));
  std::vector<uint16_t> out_cpu(p.q.size());
  MKV_OK(minikv_prefill(caches.cpu, 0, 1, &other, p.cu.data(), p.q.bits.data(), p.k.bits.data(),
                        p.v.bits.data(), out_cpu.data(), nullptr));
  gt::check_close(Tensor::from_device(cfg.dtype, o, p.q.size()), Tensor::from_host_bits(cfg.dtype, out_cpu),
                  gt::attention_tol(cfg.dtype), "after an abandoned prompt");
  for (uint32_t kvh = 0; kvh < Hkv; ++kvh)
    CHECK(gt::Pair::kept(caches.chunked, other, 0, kvh) == p.expected_kept[kvh]);
  check_stats_equal(caches.chunked, caches.cpu);
}

}  // TEST_SUITE
