// The CUDA backend: owns the device storage (pool blocks and residual slots in the layout of
// src/layout.h, byte-identical to the CPU backend's), the device mirror of the block tables
// and every workspace, all allocated in the constructor. prefill / append / decode only
// launch kernels on the caller's stream: no allocation, no host synchronization, per-call
// sizes and block ids travel as kernel parameters (so append + decode can be captured in
// a CUDA graph). read_positions and read_storage synchronize the device.
//
// Streams: the workspaces belong to the handle, so calls on one handle that use different
// streams must be ordered by the caller (as with any handle: it is not internally
// synchronized).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../src/backend.h"
#include "../src/config.h"
#include "../src/error.h"
#include "cuda_check.h"
#include "cuda_debug.h"
#include "cuda_shapes.h"
#include "decode_generic_plan.h"
#include "decode_k4v2_plan.h"
#include "decode_mma_plan.h"
#include "decode_splits.h"
#include "launchers.h"
#include "select_plan.h"

namespace minikv {

void throw_cuda_error(cudaError_t err, const char *call) {
  (void)cudaGetLastError();  // clear a non-sticky error so the handle stays usable
  fail(err == cudaErrorMemoryAllocation ? MINIKV_ERR_OUT_OF_MEMORY : MINIKV_ERR_DEVICE, "%s: %s",
       call, cudaGetErrorString(err));
}

void check_launch_error(const char *kernel_name) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) throw_cuda_error(err, kernel_name);
}

namespace {

using namespace kernels;

// Makes `device` current for the scope (the caller's thread may use another device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    MINIKV_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) MINIKV_CUDA_CHECK(cudaSetDevice(device));
    changed_ = previous_ != device;
  }
  ~DeviceGuard() {
    if (changed_) (void)cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard &) = delete;
  DeviceGuard &operator=(const DeviceGuard &) = delete;

 private:
  int previous_ = 0;
  bool changed_ = false;
};

// Move-only cudaMalloc RAII.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(uint64_t bytes, const char *what) : bytes_(bytes) {
    if (bytes == 0) return;
    const cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      (void)cudaGetLastError();
      fail(err == cudaErrorMemoryAllocation ? MINIKV_ERR_OUT_OF_MEMORY : MINIKV_ERR_DEVICE,
           "minikv_cache_create: cudaMalloc of %llu bytes for the %s: %s",
           static_cast<unsigned long long>(bytes), what, cudaGetErrorString(err));
    }
  }
  ~DeviceBuffer() {
    if (ptr_) (void)cudaFree(ptr_);
  }
  DeviceBuffer(DeviceBuffer &&o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  DeviceBuffer &operator=(DeviceBuffer &&o) noexcept {
    std::swap(ptr_, o.ptr_);
    std::swap(bytes_, o.bytes_);
    return *this;
  }
  template <typename T> T *as() const { return static_cast<T *>(ptr_); }
  uint64_t bytes() const { return bytes_; }

 private:
  void *ptr_ = nullptr;
  uint64_t bytes_ = 0;
};

uint32_t ceil_div(uint64_t a, uint64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }

// Streams that run a batch's decode launches side by side (a batch of more sequences than
// one launch takes), forked from and joined back into the caller's stream by events, which
// CUDA graph capture records as a fork and a join. Created once, at minikv_cache_create.
class DecodeLanes {
 public:
  DecodeLanes() = default;
  explicit DecodeLanes(uint32_t n) : streams_(n, nullptr), joins_(n, nullptr) {
    try {
      MINIKV_CUDA_CHECK(cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming));
      for (uint32_t i = 0; i < n; ++i) {
        MINIKV_CUDA_CHECK(cudaStreamCreateWithFlags(&streams_[i], cudaStreamNonBlocking));
        MINIKV_CUDA_CHECK(cudaEventCreateWithFlags(&joins_[i], cudaEventDisableTiming));
      }
    } catch (...) {
      release();
      throw;
    }
  }
  ~DecodeLanes() { release(); }
  DecodeLanes(const DecodeLanes &) = delete;
  DecodeLanes &operator=(DecodeLanes &&o) noexcept {
    std::swap(streams_, o.streams_);
    std::swap(joins_, o.joins_);
    std::swap(fork_, o.fork_);
    return *this;
  }
  uint32_t size() const { return static_cast<uint32_t>(streams_.size()); }
  cudaStream_t stream(uint32_t i) const { return streams_[i]; }
  // Lanes [0, n) start after the work queued on `caller` so far.
  void fork(cudaStream_t caller, uint32_t n) const {
    MINIKV_CUDA_CHECK(cudaEventRecord(fork_, caller));
    for (uint32_t i = 0; i < n; ++i) MINIKV_CUDA_CHECK(cudaStreamWaitEvent(streams_[i], fork_, 0));
  }
  // `caller`'s later work waits for lanes [0, n).
  void join(cudaStream_t caller, uint32_t n) const {
    for (uint32_t i = 0; i < n; ++i) {
      MINIKV_CUDA_CHECK(cudaEventRecord(joins_[i], streams_[i]));
      MINIKV_CUDA_CHECK(cudaStreamWaitEvent(caller, joins_[i], 0));
    }
  }
  // The same on a failed call's way out (a capture must not end unjoined); errors are the
  // failure already being reported.
  void join_after_failure(cudaStream_t caller, uint32_t n) const noexcept {
    for (uint32_t i = 0; i < n; ++i)
      if (cudaEventRecord(joins_[i], streams_[i]) == cudaSuccess) (void)cudaStreamWaitEvent(caller, joins_[i], 0);
  }

 private:
  void release() noexcept {
    for (cudaStream_t s : streams_)
      if (s) (void)cudaStreamDestroy(s);
    for (cudaEvent_t e : joins_)
      if (e) (void)cudaEventDestroy(e);
    if (fork_) (void)cudaEventDestroy(fork_);
  }
  std::vector<cudaStream_t> streams_;
  std::vector<cudaEvent_t> joins_;
  cudaEvent_t fork_ = nullptr;
};

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(const StorageSpec &spec)
      : spec_(spec), cfg_(spec.cfg), device_(spec.cfg.device_id) {
    DeviceGuard guard(device_);
    cudaDeviceProp prop{};
    MINIKV_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_));
    num_sms_ = static_cast<uint32_t>(prop.multiProcessorCount);
    configure_prefill_kernels(cfg_.dtype, cfg_.head_dim);
    prefill_wgmma_ = prefill_wgmma_usable(cfg_.dtype, cfg_.head_dim);
    prefill_scores_wgmma_ = prefill_scores_wgmma_usable(cfg_.dtype, cfg_.head_dim);
    window_scores_ = cfg_.score_mode == MINIKV_SCORE_WINDOW &&
                     prefill_window_scores_fit(cfg_.head_dim, cfg_.num_heads / cfg_.num_kv_heads, cfg_.window_size);
    int driver = 0;
    MINIKV_CUDA_CHECK(cudaDriverGetVersion(&driver));
    programmatic_prefill_ = prop.major >= 9 && driver >= 12030;

    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    pool_ = DeviceBuffer(spec.pool_bytes, "block pool");
    residual_ = DeviceBuffer(spec.residual_bytes, "residual slots");
    table_ = DeviceBuffer(uint64_t(spec.residual_slots) * spec.max_blocks_per_seq * 4, "block tables");
    // Zeroed so that bytes never written are identical to the CPU backend's calloc'ed pool.
    MINIKV_CUDA_CHECK(cudaMemset(pool_.as<void>(), 0, pool_.bytes()));
    MINIKV_CUDA_CHECK(cudaMemset(residual_.as<void>(), 0, residual_.bytes()));
    MINIKV_CUDA_CHECK(cudaMemset(table_.as<void>(), 0, table_.bytes()));

    // Prefill workspaces: one batch of prompts up to ws_tokens_ rows in total (a longer
    // batch runs in several launches).
    // Counted in whole groups of four rows (ws_rows), so that every sequence's rows start
    // 16-byte aligned in each head's LSE row: the score pass bulk-copies them 64 at a time,
    // the last head's last copy up to a query tile past the rows (the buffer's slack).
    ws_tokens_ = ws_rows(std::max<uint32_t>(cfg_.max_seq_len, 1));
    lse_ = DeviceBuffer((uint64_t(H) * ws_tokens_ + kPrefillQueryTile) * 4, "prefill LSE workspace");
    scores_ = DeviceBuffer(uint64_t(Hkv) * ws_tokens_ * 4, "prefill score workspace");
    kept_ = DeviceBuffer(uint64_t(Hkv) * ws_tokens_ * 4, "prefill selection workspace");
    // The score passes' parts of short launches (launchers.h): their column sums and
    // arrival counters, which the last part leaves at zero.
    if (!window_scores_ && scores_possible(cfg_)) {
      const uint64_t pairs = prefill_score_part_ctas(num_sms_);
      score_parts_ = DeviceBuffer(kScoreMaxParts * pairs * kPrefillKeyTile * 4, "prefill score workspace");
      score_part_counters_ = DeviceBuffer(pairs * 4, "prefill score workspace");
      MINIKV_CUDA_CHECK(cudaMemset(score_part_counters_.as<void>(), 0, score_part_counters_.bytes()));
    }
    // Chunked prefill: the staged K/V of every layer, the running score sums of the staged
    // prompts ([num_layers][num_kv_heads][staging rows]) and the selection of their last
    // chunks ([num_kv_heads][staging rows]), all indexed by the prompts' staging runs.
    const uint64_t S = cfg_.prefill_staging_tokens;
    if (S > 0) {
      staging_ = DeviceBuffer(spec.staging_bytes, "prefill staging area");
      if (scores_possible(cfg_))
        staged_scores_ = DeviceBuffer(uint64_t(cfg_.num_layers) * Hkv * S * 4, "prefill staging scores");
      staged_kept_ = DeviceBuffer(uint64_t(Hkv) * S * 4, "prefill staging selection");
    }
    prefill_order_.reserve(cfg_.max_sequences);

    // The decode plan, chosen once: the fast kernel for the paper's storage, the default
    // storage's own kernels on sm_90, the tensor-core kernel for the other GQA groups, the
    // generic kernel for the rest. MINIKV_DECODE_KERNEL=fast|k4v2|k4v2-warp|mma|generic
    // forces one (a debugging and benchmarking knob, docs/kernels.md#decode; a kernel that
    // cannot take the configuration is an error).
    // Split-K partials: enough rows for every head of a full decode launch plus the extra
    // splits that fill the GPU when the batch is small (two rounds of the resident CTAs).
    const uint32_t n_rep = H / Hkv;
    const uint64_t rows = uint64_t(std::min(cfg_.max_sequences, kMaxDecodeSeqs)) * H;
    const bool fast_ok = decode_fast_path(spec.block, spec.residual, n_rep);
    const bool mma_ok = decode_mma_path(spec.block, n_rep);
    // MHA takes the tensor-core kernel where it measured faster than the generic one: values
    // of 2 or 16 bits (bench/results, the decode matrix); GQA always.
    const bool mma_first = n_rep >= 2 || spec.block.value_bits == 2 || spec.block.value_bits == 16;
    // The default storage's kernels need an sm_90 image that this device loads. Groups of up
    // to four heads take the one-warp kernel (one chunk of head slots; B 8, L 32K on the H200:
    // 1.8x the four-warp kernel's rate under MHA, 1.08x for groups of 4, bench/results);
    // larger groups the four-warp one (groups of 7 and 8: 1.2x the one-warp kernel's rate,
    // which reads each KV head once per chunk of four).
    // The one-warp kernel is the plan for the rest of k4v2_warp_storage (bit pairs at G = 32,
    // 4/2 and 2/2 at G = 64 and 128) under the same rule: for groups of up to four heads it
    // read 1.2-4.2x faster than decode_mma or the generic kernel (B 8 and 1, L 32K and 128K,
    // H100). For groups of 7 and 8 it tied decode_mma or lost (8-bit keys: 0.77-0.90x),
    // except at 4/4 bits (1.18-1.22x faster) at G = 32, not at G = 16 (64/8: 1.12x slower).
    // At G = 16 (2/2 and 4/4 bits) it took 0.39-0.59x decode_mma's time for groups of 1, 2
    // and 4 (H200, B 8, 32K; B 1 0.50x and 0.73x).
    const bool k4v2_path = decode_k4v2_path(spec.block, n_rep);
    const bool k4v2_warp_path = decode_k4v2_warp_path(spec.block, n_rep);
    const uint32_t k4v2_heads = decode_mma_heads_per_cta(n_rep);
    const uint32_t k4v2_ctas = k4v2_path ? configure_decode_k4v2(cfg_.dtype, spec.block, k4v2_heads) : 0;
    const uint32_t k4v2_warp_ctas = k4v2_warp_path ? configure_decode_k4v2_warp(cfg_.dtype, spec.block, n_rep) : 0;
    const bool k4v2_ok = k4v2_ctas > 0, k4v2_warp_ok = k4v2_warp_ctas > 0;
    const bool k4v2_warp_first = k4v2_warp_planned(spec.block.key_bits, spec.block.value_bits, spec.block.group, n_rep);
    // The paper's storage takes the one-warp kernel where it read faster than the fast one
    // (k4v2_warp_before_fast: groups of two; four at head_dim 64).
    const bool fast_first = fast_ok && !(k4v2_warp_ok && k4v2_warp_before_fast(n_rep, D));
    decode_kernel_ = fast_first                        ? DecodeKernel::kFast
                     : k4v2_warp_ok && k4v2_warp_first ? DecodeKernel::kK4V2Warp
                     : k4v2_ok                         ? DecodeKernel::kK4V2
                     : mma_ok && mma_first             ? DecodeKernel::kMma
                                                       : DecodeKernel::kGeneric;
    if (const char *forced = std::getenv("MINIKV_DECODE_KERNEL")) {
      const std::string name(forced);
      if (name == "fast" && fast_ok) decode_kernel_ = DecodeKernel::kFast;
      else if (name == "k4v2" && k4v2_ok) decode_kernel_ = DecodeKernel::kK4V2;
      else if (name == "k4v2-warp" && k4v2_warp_ok) decode_kernel_ = DecodeKernel::kK4V2Warp;
      else if (name == "mma" && mma_ok) decode_kernel_ = DecodeKernel::kMma;
      else if (name == "generic") decode_kernel_ = DecodeKernel::kGeneric;
      else if (!name.empty())
        fail(MINIKV_ERR_UNSUPPORTED,
             "minikv_cache_create: MINIKV_DECODE_KERNEL=%s cannot decode this configuration "
             "(fast: 2-bit keys and values, G 16, no sinks, n_rep 1/2/4/8; k4v2: 4-bit keys, "
             "2-bit values, G 32, head_dim 64/128, sm_90; k4v2-warp: the same at head_dim 64/128/256, "
             "2-, 4- or 8-bit keys and values of equal width or 8-bit keys with 2- or 4-bit values at G 32, or "
             "4-bit keys + 2-bit values and 2-bit both at G 64/128, or 2/2 and 4/4 bits at G 16 "
             "(head_dim 64/128); "
             "mma: G >= 16 with head_dim / G <= 8; generic: any)",
             forced);
    }
    if (const char *forced = std::getenv("MINIKV_DECODE_SPLITS")) {
      char *end = nullptr;
      const unsigned long s = std::strtoul(forced, &end, 10);
      if (*forced != '\0' && (*end != '\0' || s == 0 || s > kDecodeMaxSplits))
        fail(MINIKV_ERR_INVALID_ARGUMENT,
             "minikv_cache_create: MINIKV_DECODE_SPLITS=%s must be a split count from 1 to %u",
             forced, kDecodeMaxSplits);
      forced_splits_ = static_cast<uint32_t>(s);
    }
    switch (decode_kernel_) {
      case DecodeKernel::kK4V2:
      case DecodeKernel::kK4V2Warp: {
        const bool four_warps = decode_kernel_ == DecodeKernel::kK4V2;
        heads_per_cta_ = four_warps ? k4v2_heads : decode_k4v2_warp_heads_per_cta(n_rep);
        k4v2_plan_ = make_k4v2_launch_plan(spec.block, driver);
        decode_tile_ = k4v2_plan_.tiles.qtile;
        // Early starts where the driver also captures the edge into a graph, as for the merge;
        // MINIKV_DECODE_EARLY=0 turns them off (a benchmarking knob like the two above).
        decode_early_ = !four_warps && k4v2_plan_.programmatic_merge;
        if (const char *e = std::getenv("MINIKV_DECODE_EARLY"); e && *e) {
          if (std::strcmp(e, "0") != 0 && std::strcmp(e, "1") != 0)
            fail(MINIKV_ERR_INVALID_ARGUMENT, "minikv_cache_create: MINIKV_DECODE_EARLY=%s must be 0 or 1", e);
          if (std::strcmp(e, "0") == 0) decode_early_ = false;
        }
        decode_slots_ = num_sms_ * (four_warps ? k4v2_ctas : k4v2_warp_ctas);
        break;
      }
      case DecodeKernel::kFast:
        heads_per_cta_ = n_rep;
        decode_slots_ = num_sms_ * decode_fast_ctas_per_sm(cfg_.dtype, D, n_rep);
        break;
      case DecodeKernel::kMma:
        heads_per_cta_ = decode_mma_heads_per_cta(n_rep);
        mma_plan_ = make_mma_launch_plan(spec.block);
        decode_tile_ = mma_plan_.g.qtile;
        decode_slots_ = num_sms_ * configure_decode_mma(cfg_.dtype, spec.block);
        break;
      case DecodeKernel::kGeneric:
        heads_per_cta_ = decode_generic_heads_per_cta(n_rep);
        decode_tile_ = make_generic_decode_plan(spec.block, heads_per_cta_).qtile;
        decode_slots_ = num_sms_ * configure_decode_generic(cfg_.dtype, spec.block, n_rep);
        break;
    }
    part_rows_ = rows + 2ull * decode_slots_ * heads_per_cta_;
    // A batch of more than kMaxDecodeSeqs sequences is decoded by several launches that run
    // side by side, each with its own partials and split counters (one launch of 128
    // sequences under GQA 32/8 fills ~0.7 of the H200's resident CTAs).
    const uint32_t lanes = std::min(ceil_div(cfg_.max_sequences, kMaxDecodeSeqs), kDecodeMaxLanes);
    if (lanes > 1) lanes_ = DecodeLanes(lanes);
    const uint32_t ws_lanes = std::max(lanes, 1u);
    part_o_ = DeviceBuffer(ws_lanes * part_rows_ * D * 4, "decode workspace");
    part_ml_ = DeviceBuffer(ws_lanes * part_rows_ * 2 * 4, "decode workspace");
    // Split counters of the fused merges; the merging CTA leaves them at zero.
    split_counters_ = DeviceBuffer(uint64_t(ws_lanes) * kMaxDecodeSeqs * Hkv * 4, "decode workspace");
    MINIKV_CUDA_CHECK(cudaMemset(split_counters_.as<void>(), 0, split_counters_.bytes()));
    MINIKV_CUDA_CHECK(cudaDeviceSynchronize());  // memsets done before any stream uses them

    st_.pool = pool_.as<uint8_t>();
    st_.residual = residual_.as<uint8_t>();
    st_.block_table = table_.as<int32_t>();
    st_.block = spec.block;
    st_.res = spec.residual;
    st_.max_blocks_per_seq = spec.max_blocks_per_seq;
  }

  ~CudaBackend() override {
    // Destroy waits until the whole device is idle (not only this cache's work), then frees
    // (DeviceBuffer); after a sticky fault the synchronize fails and the frees do too.
    if (cudaSetDevice(device_) == cudaSuccess) (void)cudaDeviceSynchronize();
  }

  minikv_backend kind() const override { return MINIKV_BACKEND_CUDA; }
  uint64_t pool_bytes() const override { return pool_.bytes() + residual_.bytes(); }
  uint64_t workspace_bytes() const override {
    return table_.bytes() + lse_.bytes() + scores_.bytes() + kept_.bytes() + score_parts_.bytes() +
           score_part_counters_.bytes() + part_o_.bytes() +
           part_ml_.bytes() + split_counters_.bytes() + staging_.bytes() + staged_scores_.bytes() +
           staged_kept_.bytes();
  }

  // ---- prefill ----------------------------------------------------------------------
  void prefill(uint32_t layer, const std::vector<PrefillItem> &items, const void *q,
               const void *k, const void *v, void *out, void *stream) override {
    DeviceGuard guard(device_);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    blocks_written(s);
    // Whole prompts first, then the chunks of staged prompts: a launch reads one K/V source.
    std::vector<uint32_t> &order = prefill_order_;  // within the capacity reserved at create
    order.clear();
    for (int staged = 0; staged < 2; ++staged)
      for (uint32_t i = 0; i < items.size(); ++i)
        if (items[i].staged == (staged == 1)) order.push_back(i);
    for (const PrefillItem &it : items) {
      if (it.last) set_table(it.dst.residual_slot, 0, it.dst.blocks, it.dst.num_blocks, s);
      // A chunk joins its prompt's earlier rows in the staging run, where every kernel of
      // the launch reads the prompt's K/V.
      if (it.staged) {
        const uint64_t row = kv_row_bytes(), at = (uint64_t(it.staging_begin) + it.position) * row;
        const uint64_t from = uint64_t(it.token_begin) * row, bytes = uint64_t(it.rows) * row;
        MINIKV_CUDA_CHECK(cudaMemcpyAsync(stage_k(layer) + at, static_cast<const uint8_t *>(k) + from,
                                          bytes, cudaMemcpyDeviceToDevice, s));
        MINIKV_CUDA_CHECK(cudaMemcpyAsync(stage_v(layer) + at, static_cast<const uint8_t *>(v) + from,
                                          bytes, cudaMemcpyDeviceToDevice, s));
      }
    }
    size_t i = 0;
    while (i < order.size()) {
      // The workspaces hold the launch's rows: whole prompts (LSE, scores, selection) or
      // chunks (LSE; their sums and selection live in the staging buffers).
      const bool staged = items[order[i]].staged;
      size_t j = i;
      uint64_t rows = 0;
      while (j < order.size() && j - i < kMaxPrefillSeqs && items[order[j]].staged == staged &&
             rows + ws_rows(items[order[j]].rows) <= ws_tokens_) {
        rows += ws_rows(items[order[j]].rows);
        ++j;
      }
      prefill_launch(layer, items, order, i, j, q, k, v, out, s);
      i = j;
    }
  }

  // ---- append -------------------------------------------------------------------------
  void append(uint32_t, const std::vector<AppendItem> &items, const void *k, const void *v,
              void *stream) override {
    DeviceGuard guard(device_);
    launch_appends(items, false, k, v, static_cast<cudaStream_t>(stream));
  }

  // ---- decode -------------------------------------------------------------------------
  void decode(uint32_t, const std::vector<CacheView> &items, const void *q, void *out,
              void *stream) override {
    DeviceGuard guard(device_);
    launch_decodes(items, q, out, nullptr, nullptr, nullptr, static_cast<cudaStream_t>(stream));
  }

  // ---- append + decode ----------------------------------------------------------------
  // The decode launch appends the tokens itself (decode_common.cuh); only sequences whose
  // residual becomes full are appended first, by the append kernel, which flushes them.
  void append_decode(uint32_t, const std::vector<AppendItem> &items,
                     const std::vector<CacheView> &after, const void *q, const void *k,
                     const void *v, void *out, void *stream) override {
    DeviceGuard guard(device_);
    const cudaStream_t s = static_cast<cudaStream_t>(stream);
    launch_appends(items, true, k, v, s);
    launch_decodes(after, q, out, &items, k, v, s);
  }

  // ---- inspection (synchronous) -----------------------------------------------------------
  void read_positions(const CacheView &view, uint32_t kv_head, uint32_t count,
                      int32_t *out) const override {
    DeviceGuard guard(device_);
    MINIKV_CUDA_CHECK(cudaDeviceSynchronize());
    const BlockLayout &bl = spec_.block;
    const uint32_t R = bl.tokens;
    uint32_t t = 0;
    while (t < count && t < view.quantized) {
      const uint32_t n = std::min({count - t, view.quantized - t, R - t % R});
      const uint8_t *src = pool_.as<uint8_t>() + uint64_t(view.blocks[t / R]) * bl.bytes +
                           bl.positions + kv_head * bl.positions_head() + (t % R) * 4;
      MINIKV_CUDA_CHECK(cudaMemcpy(out + t, src, n * 4, cudaMemcpyDeviceToHost));
      t += n;
    }
    if (t < count) {
      const ResidualLayout &rl = spec_.residual;
      const uint8_t *src = residual_.as<uint8_t>() + uint64_t(view.residual_slot) * rl.bytes +
                           rl.positions + (uint64_t(kv_head) * R + (t - view.quantized)) * 4;
      MINIKV_CUDA_CHECK(cudaMemcpy(out + t, src, (count - t) * 4, cudaMemcpyDeviceToHost));
    }
  }

  void read_storage(std::vector<uint8_t> &pool, std::vector<uint8_t> &residual) const override {
    DeviceGuard guard(device_);
    MINIKV_CUDA_CHECK(cudaDeviceSynchronize());
    pool.resize(pool_.bytes());
    residual.resize(residual_.bytes());
    MINIKV_CUDA_CHECK(cudaMemcpy(pool.data(), pool_.as<void>(), pool.size(), cudaMemcpyDeviceToHost));
    MINIKV_CUDA_CHECK(cudaMemcpy(residual.data(), residual_.as<void>(), residual.size(), cudaMemcpyDeviceToHost));
  }

 private:
  // Append kernel launches for items (only those that flush when flushes_only).
  void launch_appends(const std::vector<AppendItem> &items, bool flushes_only, const void *k,
                      const void *v, cudaStream_t stream) {
    const uint32_t R = cfg_.residual_length, F = spec_.flush_tokens;
    AppendParams p{};
    p.k = k;
    p.v = v;
    p.st = st_;
    p.flush_tokens = F;
    for (size_t i = 0; i < items.size(); ++i) {
      const AppendItem &it = items[i];
      if (flushes_only && !it.flush) continue;
      AppendItemParams &ip = p.items[p.n++];
      ip.input = static_cast<uint32_t>(i);
      ip.slot = it.dst.residual_slot;
      ip.row = it.dst.residual;
      ip.quantized = it.dst.quantized;
      ip.position = it.position;
      ip.flush = it.flush ? 1u : 0u;
      if (it.flush) {
        const uint32_t lo = it.dst.quantized / R, hi = (it.dst.quantized + F - 1) / R;
        if (hi >= it.dst.num_blocks)
          fail(MINIKV_ERR_INTERNAL, "minikv_append: flush needs block %u of %u", hi, it.dst.num_blocks);
        ip.block_lo = static_cast<int32_t>(it.dst.blocks[lo]);
        ip.block_hi = static_cast<int32_t>(it.dst.blocks[hi]);
        blocks_written(stream);
      }
      if (p.n == kMaxAppendSeqs) {
        launch_append(cfg_.dtype, p, stream);
        p.n = 0;
      }
    }
    if (p.n > 0) launch_append(cfg_.dtype, p, stream);
  }

  // Decode launches over `views`. With `appended` (the items of minikv_append_decode, k, v)
  // the launches also append each item's token that no flush stored (decode_common.cuh).
  // A batch of more than kMaxDecodeSeqs sequences goes in equal launches on the decode lanes,
  // side by side, and the caller's stream waits for all of them.
  void launch_decodes(const std::vector<CacheView> &views, const void *q, void *out,
                      const std::vector<AppendItem> *appended, const void *k, const void *v,
                      cudaStream_t stream) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const uint64_t elem = dtype_bytes(cfg_.dtype);
    const uint64_t row = uint64_t(H) * D * elem, kv_row = uint64_t(Hkv) * D * elem;
    const uint32_t launches = ceil_div(views.size(), kMaxDecodeSeqs);
    const uint32_t per_launch = launches == 0 ? 0 : ceil_div(views.size(), launches);
    const uint32_t lanes = std::min(launches, lanes_.size());
    // The one-warp kernel starts behind the caller's kernel before it, its first quantized
    // tiles read before it waits, where no launch that may still run wrote the blocks: since
    // this cache last wrote its blocks or table on `stream`, a decode went there with an
    // ordinary launch (it started once that write was done, and so did everything after it).
    const bool early = decode_early_ && !blocks_dirty_ && lanes <= 1;
    // CTAs that run at once: every launch on its own lane shares the device.
    const uint32_t concurrent = std::max(lanes, 1u);
    if (lanes > 1) lanes_.fork(stream, lanes);
    try {
      for (uint32_t l = 0; l < launches; ++l) {
        const size_t i = size_t(l) * per_launch;
        const uint32_t lane = lanes > 1 ? l % lanes : 0;
        const cudaStream_t s = lanes > 1 ? lanes_.stream(lane) : stream;
        DecodeParams p{};
        p.q = static_cast<const uint8_t *>(q) + i * row;
        p.out = static_cast<uint8_t *>(out) + i * row;
        p.part_o = part_o_.as<float>() + lane * part_rows_ * D;
        p.part_ml = part_ml_.as<float>() + lane * part_rows_ * 2;
        p.counters = split_counters_.as<uint32_t>() + uint64_t(lane) * kMaxDecodeSeqs * Hkv;
        p.st = st_;
        p.num_heads = H;
        p.num_kv_heads = Hkv;
        p.heads_per_cta = heads_per_cta_;
        p.scale_log2 = kLog2e / std::sqrt(static_cast<float>(D));
        p.n = static_cast<uint32_t>(std::min<size_t>(per_launch, views.size() - i));
        if (appended) {
          p.new_k = static_cast<const uint8_t *>(k) + i * kv_row;
          p.new_v = static_cast<const uint8_t *>(v) + i * kv_row;
        }
        uint32_t longest = 1, longest_quantized = 0;
        for (uint32_t b = 0; b < p.n; ++b) {
          const CacheView &view = views[i + b];
          p.slot[b] = view.residual_slot;
          p.sinks[b] = view.sinks;
          p.quantized[b] = view.quantized;
          p.residual[b] = view.residual;
          p.new_position[b] = appended && !(*appended)[i + b].flush ? (*appended)[i + b].position : -1;
          longest = std::max(longest, view.sinks + view.quantized + view.residual);
          longest_quantized = std::max(longest_quantized, view.quantized);
        }
        // Splits depend on sizes only (deterministic, graph-capture friendly) and stay within
        // the workspace.
        const uint64_t max_splits = std::min<uint64_t>(
            std::max<uint64_t>(part_rows_ / (uint64_t(p.n) * H), 1), kDecodeMaxSplits);
        const uint64_t ctas = uint64_t(p.n) * concurrent * Hkv * ceil_div(H / Hkv, heads_per_cta_);
        // Generic: the sink and residual segments add up to two tiles (residual ≤ R rows).
        const bool fast = decode_kernel_ == DecodeKernel::kFast;
        // k4v2: 16-bit rows (sinks, residual) in tiles of kK4V2RowTile, the rest by decode_tile_.
        const uint64_t tiles = fast ? ceil_div(longest_quantized, kDecodeFastTile)
                               : decode_kernel_ == DecodeKernel::kK4V2 || decode_kernel_ == DecodeKernel::kK4V2Warp
                                   ? ceil_div(longest_quantized, decode_tile_) +
                                         ceil_div(longest - longest_quantized, kK4V2RowTile) + 1
                                   : ceil_div(longest, decode_tile_) + 2;
        const uint64_t splits = forced_splits_ ? std::min<uint64_t>({forced_splits_, max_splits, tiles})
                                               : best_splits(ctas, tiles, max_splits);
        p.splits = static_cast<uint32_t>(std::max<uint64_t>(splits, 1));
        switch (decode_kernel_) {
          case DecodeKernel::kFast: launch_decode_fast(cfg_.dtype, D, p, s); break;
          case DecodeKernel::kK4V2: launch_decode_k4v2(cfg_.dtype, p, k4v2_plan_, s); break;
          case DecodeKernel::kK4V2Warp: launch_decode_k4v2_warp(cfg_.dtype, p, k4v2_plan_, s, early); break;
          case DecodeKernel::kMma: launch_decode_mma(cfg_.dtype, p, mma_plan_, s); break;
          case DecodeKernel::kGeneric: launch_decode_generic(cfg_.dtype, p, s); break;
        }
      }
    } catch (...) {
      if (lanes > 1) lanes_.join_after_failure(stream, lanes);
      throw;
    }
    if (lanes > 1) lanes_.join(stream, lanes);
    if (blocks_dirty_ && dirty_stream_ == stream) blocks_dirty_ = false;
  }

  // This cache's blocks or block table written by work queued on `s` (see launch_decodes).
  void blocks_written(cudaStream_t s) {
    blocks_dirty_ = true;
    dirty_stream_ = s;
  }

  // choose_decode_splits (decode_splits.h) for this cache's kernel and resident slots. It
  // costs a division per candidate (~1 us of host time at 128 tiles), and a decode loop asks
  // the same question for every layer of a step (the tiles change every 128 tokens): the
  // last answer is kept.
  uint64_t best_splits(uint64_t ctas, uint64_t tiles, uint64_t max_splits) {
    SplitsQuery &m = last_splits_;
    if (m.ctas == ctas && m.tiles == tiles && m.max_splits == max_splits) return m.splits;
    const bool issue_bound = decode_kernel_ == DecodeKernel::kK4V2Warp && heads_per_cta_ == 4;
    m = SplitsQuery{ctas, tiles, max_splits, choose_decode_splits(ctas, tiles, max_splits, decode_slots_, issue_bound)};
    return m.splits;
  }

  // block_table[slot][first + i] = blocks[i], by table-update launches.
  void set_table(uint32_t slot, uint32_t first, const uint32_t *blocks, uint32_t count,
                 cudaStream_t s) {
    blocks_written(s);
    for (uint32_t i = 0; i < count; i += kMaxTableIds) {
      TableParams p{};
      p.block_table = st_.block_table;
      p.max_blocks_per_seq = spec_.max_blocks_per_seq;
      p.slot = slot;
      p.first = first + i;
      p.count = std::min(kMaxTableIds, count - i);
      for (uint32_t b = 0; b < p.count; ++b) p.ids[b] = static_cast<int32_t>(blocks[i + b]);
      launch_set_block_table(p, s);
    }
  }

  uint64_t kv_row_bytes() const {
    return uint64_t(cfg_.num_kv_heads) * cfg_.head_dim * dtype_bytes(cfg_.dtype);
  }
  // The staging rows of `layer` (K, then V): [prefill_staging_tokens][num_kv_heads][head_dim].
  uint8_t *stage_k(uint32_t layer) const {
    return staging_.as<uint8_t>() + uint64_t(layer) * 2 * cfg_.prefill_staging_tokens * kv_row_bytes();
  }
  uint8_t *stage_v(uint32_t layer) const {
    return stage_k(layer) + uint64_t(cfg_.prefill_staging_tokens) * kv_row_bytes();
  }
  float *stage_scores(uint32_t layer) const {
    return staged_scores_.as<float>() +
           uint64_t(layer) * cfg_.num_kv_heads * cfg_.prefill_staging_tokens;
  }

  // Attention, scores, and (for the items that complete their prompt) selection and store
  // of items order[begin, end): all whole prompts, whose rows fit the workspaces together,
  // or all chunks of staged prompts, whose K/V, score sums and selection are in the staging
  // buffers of `layer` (their rows fit the LSE workspace together).
  void prefill_launch(uint32_t layer, const std::vector<PrefillItem> &items,
                      const std::vector<uint32_t> &order, size_t begin, size_t end,
                      const void *q, const void *k, const void *v, void *out, cudaStream_t s) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const uint32_t G = cfg_.group_size;
    const float scale_log2 = kLog2e / std::sqrt(static_cast<float>(D));
    const bool window = cfg_.score_mode == MINIKV_SCORE_WINDOW;
    const bool staged = items[order[begin]].staged;
    const uint32_t S = cfg_.prefill_staging_tokens;
    const void *keys = staged ? stage_k(layer) : k, *values = staged ? stage_v(layer) : v;
    float *sums = staged ? stage_scores(layer) : scores_.as<float>();
    int32_t *kept = staged ? staged_kept_.as<int32_t>() : kept_.as<int32_t>();
    const uint32_t select_stride = staged ? S : ws_tokens_;

    PrefillAttnParams attn{};
    attn.q = q;
    attn.k = keys;
    attn.v = values;
    attn.out = out;
    attn.lse = lse_.as<float>();
    attn.num_heads = H;
    attn.num_kv_heads = Hkv;
    attn.ws_tokens = ws_tokens_;
    attn.scale_log2 = scale_log2;

    PrefillScoreParams sc{};
    sc.q = q;
    sc.k = keys;
    sc.lse = lse_.as<float>();
    sc.scores = sums;
    sc.num_heads = H;
    sc.num_kv_heads = Hkv;
    sc.ws_tokens = ws_tokens_;
    sc.scores_stride = select_stride;
    sc.scale_log2 = scale_log2;
    sc.part_sums = score_parts_.as<float>();
    sc.part_counters = score_part_counters_.as<uint32_t>();
    sc.part_stride = prefill_score_part_ctas(num_sms_);

    SelectParams sel{};
    sel.scores = sums;
    sel.kept = kept;
    sel.ws_tokens = select_stride;
    sel.pool_kernel = window ? cfg_.pool_kernel : 1;

    StoreParams store{};
    store.k = keys;
    store.v = values;
    store.kept = kept;
    store.st = st_;
    store.ws_tokens = select_stride;

    uint32_t ws_off = 0, max_tasks = 0;
    for (size_t i = begin; i < end; ++i) {
      const PrefillItem &it = items[order[i]];
      const SelectionPlan &plan = it.plan;
      const uint32_t L = plan.prompt_len;
      // Where the prompt's K/V rows, score sums and selection start (position 0).
      const int64_t kv_begin = staged ? int64_t(it.staging_begin) : it.token_begin;
      const uint32_t prompt_at = staged ? it.staging_begin : ws_off;
      auto add_seq = [&](PrefillSeqs &seqs, int64_t token_begin, uint32_t len, uint32_t ws_offset,
                         uint32_t tiles) {
        const uint32_t n = seqs.n++;
        seqs.token_begin[n] = token_begin;
        seqs.len[n] = len;
        seqs.ws_offset[n] = ws_offset;
        seqs.tile_begin[n + 1] = seqs.tile_begin[n] + tiles;
        return n;
      };
      const uint32_t a = add_seq(attn.seqs, it.token_begin, it.rows, ws_off,
                                 ceil_div(it.rows, kPrefillQueryTile));
      attn.keys.kv_begin[a] = kv_begin;
      attn.keys.q_pos[a] = it.position;

      const bool pooled = window && cfg_.pool_kernel > 1;
      if (chunk_scores(cfg_, it)) {
        // Columns up to the chunk's last key (a whole prompt: all of col_end).
        const uint32_t col_end = std::min(pooled ? plan.scored_prefix : plan.candidates,
                                          it.position + it.rows);
        const uint32_t n = add_seq(sc.seqs, it.token_begin, it.rows, ws_off,
                                   ceil_div(col_end, kPrefillKeyTile));
        sc.keys.kv_begin[n] = kv_begin;
        sc.keys.q_pos[n] = it.position;
        sc.row_begin[n] = first_scoring_row(cfg_, plan);
        sc.col_end[n] = col_end;
        sc.col_done[n] = it.scored_keys;
        sc.score_offset[n] = prompt_at;
      }
      ws_off += ws_rows(staged ? it.rows : L);
      if (!it.last) continue;

      const uint32_t b = add_seq(sel.seqs, 0, L, prompt_at, 0);
      set_selection(sel, b, plan, pooled);

      add_seq(store.seqs, kv_begin, L, prompt_at, 0);
      store.sinks[b] = it.dst.sinks;
      store.quantized[b] = it.dst.quantized;
      store.n_keep[b] = plan.n_keep;
      store.slot[b] = it.dst.residual_slot;
      set_store_positions(store, b, plan);
      max_tasks = std::max(max_tasks, it.dst.quantized / G + (plan.n_keep > it.dst.quantized ? 1u : 0u));
    }
    if (prefill_wgmma_) launch_prefill_wgmma(cfg_.dtype, D, attn, num_sms_, s);
    else launch_prefill_attention(cfg_.dtype, D, attn, num_sms_, s);
    const bool pdl = programmatic_prefill_;
    if (sc.seqs.n > 0) {
      if (window_scores_) launch_prefill_window_scores(cfg_.dtype, D, sc, num_sms_, s, pdl);
      else if (prefill_scores_wgmma_) launch_prefill_scores_wgmma(cfg_.dtype, D, sc, num_sms_, s, pdl);
      else launch_prefill_scores(cfg_.dtype, D, sc, num_sms_, s, pdl);
    }
    if (sel.seqs.n == 0) return;
    launch_select(sel, Hkv, s, pdl);
    launch_store_kept(cfg_.dtype, store, max_tasks, s, pdl);
  }

  StorageSpec spec_;
  minikv_config cfg_;
  int device_;
  uint32_t num_sms_ = 0;
  uint32_t ws_tokens_ = 0;
  // Workspace rows a sequence of `rows` rows takes: whole groups of four (16 bytes of LSE).
  static uint32_t ws_rows(uint32_t rows) { return (rows + 3) / 4 * 4; }
  uint32_t heads_per_cta_ = 1;  // query heads of one decode CTA
  enum class DecodeKernel { kFast, kK4V2, kK4V2Warp, kMma, kGeneric };
  DecodeKernel decode_kernel_ = DecodeKernel::kGeneric;  // the decode plan
  MmaLaunchPlan mma_plan_{};  // the tensor-core kernel's tiles and stages (kMma)
  K4V2LaunchPlan k4v2_plan_{};  // the default storage kernels' (kK4V2, kK4V2Warp)
  bool prefill_wgmma_ = false;  // prefill_wgmma_usable(): the sm_90a forward on this device
  bool prefill_scores_wgmma_ = false;  // prefill_scores_wgmma_usable(): the sm_90a score pass
  bool window_scores_ = false;  // WINDOW mode's own score pass (prefill_window_scores_fit)
  // Prefill's kernels after the forward start as programmatic dependents (launchers.h): sm_90
  // and a driver that captures the edges into graphs (12.3+).
  bool programmatic_prefill_ = false;
  uint64_t decode_slots_ = 1;   // resident decode CTAs on the device
  uint32_t forced_splits_ = 0;  // MINIKV_DECODE_SPLITS (0: best_splits decides)
  bool decode_early_ = false;   // the one-warp kernel may start early (launch_decodes)
  bool blocks_dirty_ = true;    // blocks or table written on dirty_stream_ since a decode there
  cudaStream_t dirty_stream_ = nullptr;
  uint32_t decode_tile_ = kDecodeFastTile;  // tokens per decode tile (generic: quantized tiles)
  uint64_t part_rows_ = 0;
  struct SplitsQuery {
    uint64_t ctas = 0, tiles = 0, max_splits = 0, splits = 0;
  } last_splits_;  // best_splits' last question and answer
  DeviceBuffer pool_, residual_, table_;
  DeviceBuffer lse_, scores_, kept_;
  DeviceBuffer score_parts_, score_part_counters_;  // empty unless a general score pass runs
  DeviceBuffer staging_, staged_scores_, staged_kept_;  // chunked prefill (empty when off)
  std::vector<uint32_t> prefill_order_;  // per call: whole prompts, then staged chunks
  DeviceBuffer part_o_, part_ml_, split_counters_;  // per lane (at least one)
  DecodeLanes lanes_;  // empty unless max_sequences > kMaxDecodeSeqs
  DeviceStorage st_{};

  friend std::vector<float> minikv::cuda_debug_scores(const Backend &, uint32_t, uint32_t);
};

}  // namespace

std::vector<float> cuda_debug_scores(const Backend &backend, uint32_t kv_head, uint32_t count) {
  const auto *cuda = dynamic_cast<const CudaBackend *>(&backend);
  MINIKV_REQUIRE(cuda != nullptr, "cuda_debug_scores: not the CUDA backend");
  MINIKV_REQUIRE(kv_head < cuda->cfg_.num_kv_heads && count <= cuda->ws_tokens_,
                 "cuda_debug_scores: kv_head %u / count %u out of range", kv_head, count);
  DeviceGuard guard(cuda->device_);
  MINIKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<float> out(count);
  MINIKV_CUDA_CHECK(cudaMemcpy(out.data(), cuda->scores_.as<float>() + uint64_t(kv_head) * cuda->ws_tokens_,
                               count * sizeof(float), cudaMemcpyDeviceToHost));
  return out;
}

std::vector<std::vector<int32_t>> cuda_debug_select(const std::vector<SelectionPlan> &plans,
                                                    const std::vector<std::vector<float>> &scores,
                                                    uint32_t kv_heads, uint32_t pool_kernel) {
  const uint32_t n = static_cast<uint32_t>(plans.size());
  MINIKV_REQUIRE(n >= 1 && n <= kernels::kMaxPrefillSeqs && kv_heads >= 1 && scores.size() == size_t(n) * kv_heads,
                 "cuda_debug_select: %u sequences, %u KV heads, %zu score rows", n, kv_heads, scores.size());
  for (uint32_t s = 0; s < n; ++s)
    for (uint32_t h = 0; h < kv_heads; ++h)
      MINIKV_REQUIRE(scores[size_t(s) * kv_heads + h].size() >= plans[s].prompt_len,
                     "cuda_debug_select: scores of sequence %u too short", s);
  kernels::SelectionRun run(plans, scores, kv_heads, pool_kernel);
  DeviceBuffer d_scores(run.scores.size() * sizeof(float), "debug scores");
  DeviceBuffer d_kept(run.scores.size() * sizeof(int32_t), "debug kept positions");
  MINIKV_CUDA_CHECK(cudaMemcpy(d_scores.as<void>(), run.scores.data(), run.scores.size() * sizeof(float),
                               cudaMemcpyHostToDevice));
  run.params.scores = d_scores.as<float>();
  run.params.kept = d_kept.as<int32_t>();
  kernels::launch_select(run.params, kv_heads, nullptr, false);
  MINIKV_CUDA_CHECK(cudaDeviceSynchronize());
  std::vector<int32_t> all(run.scores.size());
  MINIKV_CUDA_CHECK(cudaMemcpy(all.data(), d_kept.as<void>(), all.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
  return run.kept(all, plans, kv_heads);
}

bool cuda_backend_available(int device_id) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  if (device_id < 0 || device_id >= count) return false;
  int major = 0;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_id) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return major >= 8;
}

std::unique_ptr<Backend> make_cuda_backend(const StorageSpec &spec) {
  const minikv_config &cfg = spec.cfg;
  // A property of the build, checked before the device: the same answer on every machine.
  const std::string why = kernels::cuda_unsupported(cfg);
  if (!why.empty()) fail(MINIKV_ERR_UNSUPPORTED, "minikv_cache_create: %s", why.c_str());
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    fail(MINIKV_ERR_UNSUPPORTED, "minikv_cache_create: no usable CUDA device (%s)",
         cudaGetErrorString(err));
  }
  if (cfg.device_id < 0 || cfg.device_id >= count) {
    fail(MINIKV_ERR_UNSUPPORTED, "minikv_cache_create: device_id %d, but %d CUDA device(s) present",
         cfg.device_id, count);
  }
  if (!cuda_backend_available(cfg.device_id)) {
    fail(MINIKV_ERR_UNSUPPORTED,
         "minikv_cache_create: CUDA device %d has compute capability below 8.0 (the kernels "
         "need sm_80 tensor cores)",
         cfg.device_id);
  }
  return std::make_unique<CudaBackend>(spec);
}

}  // namespace minikv
