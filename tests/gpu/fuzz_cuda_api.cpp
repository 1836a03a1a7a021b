// Device API-sequence fuzz: random sequences of C API calls applied to a CUDA cache and to a
// CPU cache of the same configuration, the CPU backend being the model. Meant to run under
// compute-sanitizer (memcheck, racecheck) on the GPU, where every launch of every call path
// (prefill in batches, flushes, the fused append_decode, split-K and its merges, release and
// reuse of blocks, failing calls) is checked for out-of-bounds and uninitialized accesses.
//
// Each iteration draws a small configuration (fp16/bf16, head_dim 64/128, GQA group, key and
// value bits, group size, residual length, sinks, budgets, score mode, often a tight pool and
// a short max_seq_len; the CUDA cache decodes with the library's plan (fast, mma or generic
// kernel), or in a third of the iterations with the generic kernel), then --ops calls among: prefill of a batch, append, decode,
// append_decode, release, length/kept-positions/stats queries, and invalid calls (NULL
// pointers, ids out of range or repeated, bad layer, n_seqs 0; for CUDA only, a misaligned
// device pointer). After each call:
//   - both backends returned the same status (CUDA-only faults: CUDA returns
//     INVALID_ARGUMENT and the CPU is not called);
//   - every (sequence, layer) has the same lengths on both, and the statistics are equal;
//   - every output row is finite and within the CPU-vs-CUDA tolerance of the GPU tests,
//     except for a sequence whose kept positions differ between the backends (a near-tie of
//     fp32 scores at the selection boundary: counted and reported, its rows skipped until
//     it is released);
//   - at the end of an iteration the device has no error.
//
//   fuzz_cuda_api [--seed N] [--iterations N] [--ops N]
// Prints a summary; exits 1 on any failed check (each printed with seed, iteration and op).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "dtype.h"
#include "minikv.h"

namespace {

uint64_t g_failures = 0;
std::string g_where;

void check(bool ok, const char *fmt, ...) {
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "FAIL [%s] ", g_where.c_str());
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  std::fputc('\n', stderr);
}

// After this many failed checks the run stops issuing calls (and frees what it holds, so a
// sanitizer's leak report stays about the library).
constexpr uint64_t kMaxFailures = 50;
bool too_many_failures() { return g_failures > kMaxFailures; }

void cuda_ok(cudaError_t err, const char *what) {
  if (err == cudaSuccess) return;
  std::fprintf(stderr, "fuzz_cuda_api: %s: %s\n", what, cudaGetErrorString(err));
  std::exit(1);
}

// Device memory of n bytes (+ 16 so a shifted pointer stays inside), freed on scope exit.
class DevMem {
 public:
  explicit DevMem(size_t bytes) { cuda_ok(cudaMalloc(&p_, bytes + 16), "cudaMalloc"); }
  ~DevMem() { cudaFree(p_); }
  DevMem(const DevMem &) = delete;
  DevMem &operator=(const DevMem &) = delete;
  uint8_t *get() const { return static_cast<uint8_t *>(p_); }

 private:
  void *p_ = nullptr;
};

struct HostTensor {
  std::vector<uint16_t> bits;
};

struct Tol {
  double atol, rtol;
};

class Run {
 public:
  Run(uint64_t seed, uint32_t iteration, uint32_t ops) : rng_(seed * 1000003ull + iteration), ops_(ops) {
    draw_config();
    minikv_config c = cfg_;
    c.backend = MINIKV_BACKEND_CPU;
    const minikv_status sc = minikv_cache_create(&c, &cpu_);
    c.backend = MINIKV_BACKEND_CUDA;
    // A third of the iterations decode with the generic kernel whatever the plan would be.
    generic_ = below(3) == 0;
    if (generic_) setenv("MINIKV_DECODE_KERNEL", "generic", 1);
    const minikv_status sg = minikv_cache_create(&c, &gpu_);
    unsetenv("MINIKV_DECODE_KERNEL");
    check(sc == MINIKV_OK && sg == MINIKV_OK, "create: CPU %s, CUDA %s (%s)", minikv_status_string(sc),
          minikv_status_string(sg), minikv_last_error_message());
    if (sc != MINIKV_OK || sg != MINIKV_OK) std::exit(1);
    cuda_ok(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "cudaStreamCreate");
    diverged_.assign(size_t(cfg_.max_sequences) * cfg_.num_layers, false);
  }
  ~Run() {
    minikv_cache_destroy(cpu_);
    minikv_cache_destroy(gpu_);
    cudaStreamDestroy(stream_);
  }
  Run(const Run &) = delete;
  Run &operator=(const Run &) = delete;

  void go(const std::string &where) {
    std::printf("%s: dtype %s D %u heads %u/%u bits %u/%u G %u R %u F %u sinks %u seqs %u max_seq_len %u "
                "max_tokens %llu h %.2f r %.2f %s%s\n",
                where.c_str(), cfg_.dtype == MINIKV_DTYPE_F16 ? "f16" : "bf16", cfg_.head_dim,
                cfg_.num_heads, cfg_.num_kv_heads, cfg_.key_bits, cfg_.value_bits, cfg_.group_size,
                cfg_.residual_length, cfg_.flush_tokens, cfg_.sink_tokens, cfg_.max_sequences, cfg_.max_seq_len,
                (unsigned long long)cfg_.max_tokens, cfg_.heavy_ratio, cfg_.recent_ratio,
                cfg_.score_mode == MINIKV_SCORE_WINDOW ? "window" : "cumulative",
                generic_ ? " (generic decode kernel)" : "");
    for (uint32_t op = 0; op < ops_ && !too_many_failures(); ++op) {
      g_where = where + " op " + std::to_string(op);
      switch (below(12)) {
        case 0: case 1: op_prefill(); break;
        case 2: op_append(); break;
        case 3: op_decode(); break;
        case 4: case 5: case 6: op_step(); break;
        case 7: op_release(); break;
        case 8: op_query(); break;
        case 9: op_invalid(); break;
        default: op_generate(); break;
      }
      compare_state();
    }
    cuda_ok(cudaStreamSynchronize(stream_), "cudaStreamSynchronize at the end of the iteration");
    cuda_ok(cudaGetLastError(), "cudaGetLastError at the end of the iteration");
    std::printf("  %llu calls compared, %llu output rows, %llu statuses other than OK, %u "
                "sequences with differing kept positions\n",
                (unsigned long long)calls_, (unsigned long long)rows_,
                (unsigned long long)failures_seen_, divergences_);
  }

 private:
  // ---- configuration ------------------------------------------------------------------
  void draw_config() {
    minikv_config c;
    minikv_config_default(&c);
    c.dtype = below(2) ? MINIKV_DTYPE_F16 : MINIKV_DTYPE_BF16;
    c.head_dim = below(2) ? 64 : 128;
    static const uint32_t kReps[] = {1, 2, 3, 4, 8, 12};
    const uint32_t n_rep = kReps[below(6)];
    c.num_kv_heads = n_rep >= 8 ? 1 : 1 + below(2);
    c.num_heads = c.num_kv_heads * n_rep;
    c.num_layers = 1 + below(2);
    static const uint32_t kBits[] = {2, 2, 4, 8, 16};
    c.key_bits = kBits[below(5)];
    c.value_bits = kBits[below(5)];
    static const uint32_t kGroups[] = {16, 16, 32, 64};
    c.group_size = kGroups[below(4)];
    c.residual_length = c.group_size * (1 + below(4));
    static const uint32_t kSinks[] = {0, 0, 4, 17};
    c.sink_tokens = kSinks[below(4)];
    c.max_sequences = 1 + below(6);
    c.max_seq_len = 16 + below(400);
    c.max_tokens = below(3) == 0 ? 0 : uint64_t(c.residual_length) * (1 + below(24));
    static const float kRatios[] = {0.0f, 0.125f, 0.25f, 0.5f, 0.6f};
    c.heavy_ratio = kRatios[below(5)];
    c.recent_ratio = kRatios[1 + below(4)];
    c.budget_policy = below(2) ? MINIKV_BUDGET_UNIFORM : MINIKV_BUDGET_PYRAMID;
    c.score_mode = below(2) ? MINIKV_SCORE_CUMULATIVE : MINIKV_SCORE_WINDOW;
    // The whole residual per flush, or a sliding flush of 1 to R / G groups.
    c.flush_tokens = below(2) ? 0 : c.group_size * (1 + below(c.residual_length / c.group_size));
    cfg_ = c;
    q_row_ = size_t(c.num_heads) * c.head_dim;
    kv_row_ = size_t(c.num_kv_heads) * c.head_dim;
  }

  // ---- helpers ----------------------------------------------------------------------------
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(rng_() % n); }
  Tol tol() const { return cfg_.dtype == MINIKV_DTYPE_BF16 ? Tol{1.5e-2, 2e-2} : Tol{2e-3, 5e-3}; }
  float value_of(uint16_t b) const {
    return cfg_.dtype == MINIKV_DTYPE_BF16 ? minikv::bf16_bits_to_float(b) : minikv::half_bits_to_float(b);
  }
  HostTensor tensor(size_t n, float stddev) {
    HostTensor t;
    t.bits.resize(std::max<size_t>(n, 1));
    std::normal_distribution<float> nd(0.0f, stddev);
    for (auto &b : t.bits)
      b = cfg_.dtype == MINIKV_DTYPE_BF16 ? minikv::float_to_bf16_bits(nd(rng_)) : minikv::float_to_half_bits(nd(rng_));
    return t;
  }
  // The tensor's bytes on the device, complete before the call that reads them (which may
  // run on a non-blocking stream); `keep` owns the buffer until release_all.
  DevMem *upload(const HostTensor &t, std::vector<DevMem *> &keep) {
    DevMem *d = new DevMem(t.bits.size() * 2);
    keep.push_back(d);
    cuda_ok(cudaMemcpy(d->get(), t.bits.data(), t.bits.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    return d;
  }
  void release_all(std::vector<DevMem *> &keep) {
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    for (DevMem *d : keep) delete d;
    keep.clear();
  }
  std::vector<uint16_t> download(const DevMem &d, size_t n) {
    std::vector<uint16_t> h(n);
    cuda_ok(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    cuda_ok(cudaMemcpy(h.data(), d.get(), n * 2, cudaMemcpyDeviceToHost), "cudaMemcpy");
    return h;
  }
  bool prefilled(uint32_t seq, uint32_t layer) const {
    uint64_t seen = 0;
    minikv_sequence_length(cpu_, seq, layer, &seen, nullptr);
    return seen > 0;
  }
  std::vector<uint32_t> pick(uint32_t n) {
    std::vector<uint32_t> ids(cfg_.max_sequences);
    for (uint32_t i = 0; i < ids.size(); ++i) ids[i] = i;
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(std::min<size_t>(n, ids.size()));
    return ids;
  }
  // Sequences of `layer` that can take a token (prefilled, below max_seq_len).
  std::vector<uint32_t> live(uint32_t layer) const {
    std::vector<uint32_t> ids;
    for (uint32_t s = 0; s < cfg_.max_sequences; ++s) {
      uint64_t seen = 0;
      minikv_sequence_length(cpu_, s, layer, &seen, nullptr);
      if (seen > 0 && seen < cfg_.max_seq_len) ids.push_back(s);
    }
    return ids;
  }
  bool same(minikv_status c, minikv_status g, const char *call) {
    ++calls_;
    if (c != MINIKV_OK) ++failures_seen_;
    check(c == g, "%s: CPU %s, CUDA %s (CUDA message: %s)", call, minikv_status_string(c),
          minikv_status_string(g), minikv_cache_last_error(gpu_));
    return c == MINIKV_OK && g == MINIKV_OK;
  }
  // Output rows [row][row_elems] of both backends; rows of diverged sequences are skipped.
  void compare_rows(const std::vector<uint16_t> &cpu, const std::vector<uint16_t> &gpu,
                    const std::vector<uint32_t> &seq_of_row, uint32_t layer, size_t row_elems,
                    const char *what) {
    const Tol t = tol();
    for (size_t r = 0; r < seq_of_row.size(); ++r) {
      if (diverged_[size_t(seq_of_row[r]) * cfg_.num_layers + layer]) continue;
      ++rows_;
      double worst = 0.0;
      size_t at = 0;
      bool finite = true;
      for (size_t i = r * row_elems; i < (r + 1) * row_elems; ++i) {
        const double g = value_of(gpu[i]), c = value_of(cpu[i]);
        finite = finite && std::isfinite(g) && std::isfinite(c);
        const double excess = std::fabs(g - c) - (t.atol + t.rtol * std::fabs(c));
        if (excess > worst) {
          worst = excess;
          at = i;
        }
      }
      check(finite, "%s: row %zu (seq %u, layer %u) has a non-finite element", what, r, seq_of_row[r], layer);
      check(worst <= 0.0, "%s: row %zu (seq %u, layer %u) element %zu: CUDA %g, CPU %g", what, r,
            seq_of_row[r], layer, at, value_of(gpu[at]), value_of(cpu[at]));
    }
  }
  void compare_state() {
    for (uint32_t s = 0; s < cfg_.max_sequences; ++s)
      for (uint32_t l = 0; l < cfg_.num_layers; ++l) {
        uint64_t sc = 0, cc = 0, sg = 1, cg = 1;
        const minikv_status a = minikv_sequence_length(cpu_, s, l, &sc, &cc);
        const minikv_status b = minikv_sequence_length(gpu_, s, l, &sg, &cg);
        check(a == MINIKV_OK && b == MINIKV_OK && sc == sg && cc == cg,
              "seq %u layer %u: CPU (seen %llu, cached %llu), CUDA (%llu, %llu)", s, l,
              (unsigned long long)sc, (unsigned long long)cc, (unsigned long long)sg,
              (unsigned long long)cg);
      }
    minikv_memory_stats a{}, b{};
    a.struct_size = b.struct_size = sizeof(minikv_memory_stats);
    minikv_memory_stats_get(cpu_, &a);
    minikv_memory_stats_get(gpu_, &b);
    check(a.used_bytes == b.used_bytes && a.tokens_seen == b.tokens_seen &&
              a.tokens_cached == b.tokens_cached && a.pool_bytes == b.pool_bytes,
          "stats: CPU used %llu seen %llu cached %llu, CUDA used %llu seen %llu cached %llu",
          (unsigned long long)a.used_bytes, (unsigned long long)a.tokens_seen,
          (unsigned long long)a.tokens_cached, (unsigned long long)b.used_bytes,
          (unsigned long long)b.tokens_seen, (unsigned long long)b.tokens_cached);
  }
  // After a successful prefill: which (sequence, layer) kept different positions.
  void note_divergence(const std::vector<uint32_t> &ids, uint32_t layer) {
    for (uint32_t s : ids) {
      bool differ = false;
      for (uint32_t h = 0; h < cfg_.num_kv_heads; ++h) {
        uint32_t nc = 0, ng = 0;
        minikv_kept_positions(cpu_, s, layer, h, nullptr, 0, &nc);
        minikv_kept_positions(gpu_, s, layer, h, nullptr, 0, &ng);
        std::vector<int32_t> pc(nc + 1), pg(ng + 1);
        minikv_kept_positions(cpu_, s, layer, h, pc.data(), nc, &nc);
        minikv_kept_positions(gpu_, s, layer, h, pg.data(), ng, &ng);
        check(nc == ng, "seq %u layer %u head %u: CPU keeps %u positions, CUDA %u", s, layer, h, nc, ng);
        differ = differ || pc != pg;
      }
      if (differ) ++divergences_;
      diverged_[size_t(s) * cfg_.num_layers + layer] = differ;
    }
  }

  // ---- operations ------------------------------------------------------------------------
  void op_prefill() {
    const uint32_t layer = below(cfg_.num_layers);
    std::vector<uint32_t> ids = pick(1 + below(std::min(cfg_.max_sequences, 4u)));
    std::vector<int32_t> cu(1, 0);
    for (size_t i = 0; i < ids.size(); ++i)
      cu.push_back(cu.back() + static_cast<int32_t>(1 + below(std::min<uint32_t>(cfg_.max_seq_len, 300))));
    const size_t T = cu.back();
    const HostTensor q = tensor(T * q_row_, 1.0f), k = tensor(T * kv_row_, 1.5f), v = tensor(T * kv_row_, 1.0f);
    std::vector<uint16_t> out_c(T * q_row_);
    std::vector<DevMem *> keep;
    DevMem *dq = upload(q, keep), *dk = upload(k, keep), *dv = upload(v, keep), *dout = new DevMem(T * q_row_ * 2);
    keep.push_back(dout);
    const uint32_t n = static_cast<uint32_t>(ids.size());
    const minikv_status c = minikv_prefill(cpu_, layer, n, ids.data(), cu.data(), q.bits.data(),
                                           k.bits.data(), v.bits.data(), out_c.data(), nullptr);
    const minikv_status g = minikv_prefill(gpu_, layer, n, ids.data(), cu.data(), dq->get(), dk->get(),
                                           dv->get(), dout->get(), stream_);
    if (same(c, g, "minikv_prefill")) {
      note_divergence(ids, layer);
      std::vector<uint32_t> seq_of_row(T);
      for (size_t i = 0; i < ids.size(); ++i)
        for (int32_t t = cu[i]; t < cu[i + 1]; ++t) seq_of_row[t] = ids[i];
      // Prefill outputs do not depend on the selection: compare every row.
      std::vector<bool> saved = diverged_;
      std::fill(diverged_.begin(), diverged_.end(), false);
      compare_rows(out_c, download(*dout, T * q_row_), seq_of_row, layer, q_row_, "prefill");
      diverged_ = saved;
    }
    release_all(keep);
  }

  // append (mode 0), decode (1) or append_decode (2) of a batch of `ids` in `layer`.
  void call(int mode, uint32_t layer, const std::vector<uint32_t> &ids) {
    const uint32_t n = static_cast<uint32_t>(ids.size());
    const HostTensor q = tensor(n * q_row_, 1.0f), k = tensor(n * kv_row_, 1.5f), v = tensor(n * kv_row_, 1.0f);
    std::vector<uint16_t> out_c(std::max<size_t>(n * q_row_, 1));
    std::vector<DevMem *> keep;
    DevMem *dq = upload(q, keep), *dk = upload(k, keep), *dv = upload(v, keep), *dout = new DevMem(n * q_row_ * 2);
    keep.push_back(dout);
    cudaStream_t s = below(2) ? stream_ : nullptr;
    minikv_status c, g;
    const char *name;
    if (mode == 0) {
      name = "minikv_append";
      c = minikv_append(cpu_, layer, n, ids.data(), k.bits.data(), v.bits.data(), nullptr);
      g = minikv_append(gpu_, layer, n, ids.data(), dk->get(), dv->get(), s);
    } else if (mode == 1) {
      name = "minikv_decode";
      c = minikv_decode(cpu_, layer, n, ids.data(), q.bits.data(), out_c.data(), nullptr);
      g = minikv_decode(gpu_, layer, n, ids.data(), dq->get(), dout->get(), s);
    } else {
      name = "minikv_append_decode";
      c = minikv_append_decode(cpu_, layer, n, ids.data(), q.bits.data(), k.bits.data(), v.bits.data(),
                               out_c.data(), nullptr);
      g = minikv_append_decode(gpu_, layer, n, ids.data(), dq->get(), dk->get(), dv->get(), dout->get(), s);
    }
    if (same(c, g, name) && mode != 0) compare_rows(out_c, download(*dout, n * q_row_), ids, layer, q_row_, name);
    release_all(keep);
  }
  std::vector<uint32_t> batch_for(uint32_t layer) {
    // Mostly sequences that can take a token; sometimes any (BAD_STATE, CAPACITY_EXCEEDED).
    std::vector<uint32_t> ids = below(4) ? live(layer) : pick(1 + below(cfg_.max_sequences));
    if (ids.empty()) ids = pick(1);
    std::shuffle(ids.begin(), ids.end(), rng_);
    ids.resize(1 + below(static_cast<uint32_t>(ids.size())));
    return ids;
  }
  void op_append() {
    const uint32_t layer = below(cfg_.num_layers);
    call(0, layer, batch_for(layer));
  }
  void op_decode() {
    const uint32_t layer = below(cfg_.num_layers);
    call(1, layer, batch_for(layer));
  }
  void op_step() {
    const uint32_t layer = below(cfg_.num_layers);
    call(2, layer, batch_for(layer));
  }
  // A few engine steps: every live sequence of every layer, fused or not.
  void op_generate() {
    const uint32_t steps = 1 + below(2 * cfg_.residual_length);
    const bool fused = below(2);
    for (uint32_t s = 0; s < steps; ++s)
      for (uint32_t layer = 0; layer < cfg_.num_layers; ++layer) {
        const std::vector<uint32_t> ids = live(layer);
        if (ids.empty()) continue;
        if (fused) {
          call(2, layer, ids);
        } else {
          call(0, layer, ids);
          call(1, layer, ids);
        }
      }
  }
  void op_release() {
    const uint32_t seq = below(cfg_.max_sequences + 1);  // max_sequences: INVALID_ARGUMENT
    const bool ok = same(minikv_sequence_release(cpu_, seq), minikv_sequence_release(gpu_, seq),
                         "minikv_sequence_release");
    if (ok)
      for (uint32_t l = 0; l < cfg_.num_layers; ++l) diverged_[size_t(seq) * cfg_.num_layers + l] = false;
  }
  void op_query() {
    const uint32_t seq = below(cfg_.max_sequences), layer = below(cfg_.num_layers);
    const uint32_t head = below(cfg_.num_kv_heads);
    uint32_t nc = 0, ng = 0;
    const minikv_status c = minikv_kept_positions(cpu_, seq, layer, head, nullptr, 0, &nc);
    const minikv_status g = minikv_kept_positions(gpu_, seq, layer, head, nullptr, 0, &ng);
    if (same(c, g, "minikv_kept_positions")) {
      check(nc == ng, "kept_positions count: CPU %u, CUDA %u", nc, ng);
      const uint32_t cap = below(ng + 2);
      std::vector<int32_t> pg(cap + 4, -9), pc(cap + 4, -9);
      uint32_t again = 0;
      minikv_kept_positions(gpu_, seq, layer, head, cap ? pg.data() : nullptr, cap, &again);
      minikv_kept_positions(cpu_, seq, layer, head, cap ? pc.data() : nullptr, cap, &again);
      check(pg[std::min(cap, ng)] == -9, "kept_positions wrote past min(capacity, count)");
      if (!diverged_[size_t(seq) * cfg_.num_layers + layer]) check(pg == pc, "kept positions differ");
    }
  }
  // Calls both backends must refuse identically, and a misaligned pointer only CUDA refuses.
  void op_invalid() {
    const uint32_t layer = below(cfg_.num_layers);
    std::vector<uint32_t> ids = pick(1 + below(cfg_.max_sequences));
    const uint32_t n = static_cast<uint32_t>(ids.size());
    HostTensor q = tensor(n * q_row_, 1.0f), k = tensor(n * kv_row_, 1.0f);  // q also serves as an aliased out
    std::vector<uint16_t> out_c(n * q_row_);
    std::vector<DevMem *> keep;
    DevMem *dq = upload(q, keep), *dk = upload(k, keep), *dout = new DevMem(n * q_row_ * 2);
    keep.push_back(dout);
    const uint32_t bad_id = cfg_.max_sequences + below(3);
    std::vector<uint32_t> dup = ids;
    dup.push_back(ids[0]);
    switch (below(7)) {
      case 0:
        same(minikv_decode(cpu_, layer, 0, ids.data(), q.bits.data(), out_c.data(), nullptr),
             minikv_decode(gpu_, layer, 0, ids.data(), dq->get(), dout->get(), stream_), "decode n_seqs 0");
        break;
      case 1:
        same(minikv_append(cpu_, cfg_.num_layers + below(3), n, ids.data(), k.bits.data(), k.bits.data(), nullptr),
             minikv_append(gpu_, cfg_.num_layers + below(3), n, ids.data(), dk->get(), dk->get(), stream_),
             "append bad layer");
        break;
      case 2:
        same(minikv_append_decode(cpu_, layer, 1, &bad_id, q.bits.data(), k.bits.data(), k.bits.data(), out_c.data(), nullptr),
             minikv_append_decode(gpu_, layer, 1, &bad_id, dq->get(), dk->get(), dk->get(), dout->get(), stream_),
             "append_decode bad id");
        break;
      case 3:
        same(minikv_append_decode(cpu_, layer, n + 1, dup.data(), q.bits.data(), k.bits.data(), k.bits.data(), out_c.data(), nullptr),
             minikv_append_decode(gpu_, layer, n + 1, dup.data(), dq->get(), dk->get(), dk->get(), dout->get(), stream_),
             "append_decode repeated id");
        break;
      case 4:
        same(minikv_append_decode(cpu_, layer, n, ids.data(), q.bits.data(), nullptr, k.bits.data(), out_c.data(), nullptr),
             minikv_append_decode(gpu_, layer, n, ids.data(), dq->get(), nullptr, dk->get(), dout->get(), stream_),
             "append_decode NULL k");
        break;
      case 5:
        same(minikv_append_decode(cpu_, layer, n, ids.data(), q.bits.data(), k.bits.data(), k.bits.data(), q.bits.data(), nullptr),
             minikv_append_decode(gpu_, layer, n, ids.data(), dq->get(), dk->get(), dk->get(), dq->get(), stream_),
             "append_decode out aliasing q");
        break;
      default: {  // CUDA requires 16-byte alignment: INVALID_ARGUMENT, nothing changes
        std::vector<uint32_t> ok_ids = live(layer);  // valid otherwise (no BAD_STATE first)
        if (ok_ids.empty()) break;
        if (ok_ids.size() > n) ok_ids.resize(n);
        ++calls_;
        const minikv_status g = minikv_append_decode(gpu_, layer, static_cast<uint32_t>(ok_ids.size()),
                                                     ok_ids.data(), dq->get() + 2, dk->get(), dk->get(),
                                                     dout->get(), stream_);
        check(g == MINIKV_ERR_INVALID_ARGUMENT, "misaligned q: CUDA %s", minikv_status_string(g));
        break;
      }
    }
    release_all(keep);
  }

  std::mt19937_64 rng_;
  uint32_t ops_;
  minikv_config cfg_{};
  size_t q_row_ = 0, kv_row_ = 0;
  minikv_cache *cpu_ = nullptr, *gpu_ = nullptr;
  cudaStream_t stream_ = nullptr;
  bool generic_ = false;  // MINIKV_DECODE_KERNEL=generic for the CUDA cache
  std::vector<bool> diverged_;  // [seq][layer]: kept positions differ between the backends
  uint64_t calls_ = 0, rows_ = 0, failures_seen_ = 0;
  uint32_t divergences_ = 0;
};

}  // namespace

int main(int argc, char **argv) {
  uint64_t seed = 1;
  uint32_t iterations = 4, ops = 60;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if ((a == "--seed" || a == "--iterations" || a == "--ops") && i + 1 < argc) {
      const uint64_t v = std::strtoull(argv[++i], nullptr, 10);
      if (a == "--seed") seed = v;
      else if (a == "--iterations") iterations = static_cast<uint32_t>(v);
      else ops = static_cast<uint32_t>(v);
    } else {
      std::fprintf(stderr, "usage: fuzz_cuda_api [--seed N] [--iterations N] [--ops N]\n");
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("fuzz_cuda_api: no CUDA device present: skipped\n");
    return 0;
  }
  setenv("MINIKV_NUM_THREADS", "2", 0);
  // Each iteration's configuration line lands before its failures (stderr) in a shared log.
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  for (uint32_t it = 0; it < iterations && !too_many_failures(); ++it) {
    Run run(seed, it, ops);
    run.go("seed " + std::to_string(seed) + " iteration " + std::to_string(it));
  }
  if (too_many_failures()) std::fprintf(stderr, "fuzz_cuda_api: too many failures, stopped\n");
  std::printf("fuzz_cuda_api: seed %llu, %u iterations x %u ops: %llu failed checks\n",
              (unsigned long long)seed, iterations, ops, (unsigned long long)g_failures);
  return g_failures == 0 ? 0 : 1;
}
