// The interface both backends implement. The cache (cache.cpp) does all bookkeeping —
// validation, budgets, block allocation, lengths — on the host and hands a backend fully
// planned work: which blocks to write, how many tokens each sequence keeps. A backend
// owns the storage (pool blocks, residual slots, workspaces) and the arithmetic, and must
// not fail after it has modified storage, except with MINIKV_ERR_DEVICE.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "error.h"
#include "layout.h"
#include "minikv.h"
#include "policy.h"

namespace minikv {

// Storage geometry every backend is created with.
struct StorageSpec {
  minikv_config cfg;
  BlockLayout block;
  ResidualLayout residual;
  uint32_t num_blocks;       // pool blocks
  uint32_t residual_slots;   // max_sequences * num_layers
  uint32_t max_blocks_per_seq;  // blocks one (sequence, layer) can ever hold
  uint32_t flush_tokens;     // F: the oldest tokens of a full residual a flush quantizes
                             // (flush_size(cfg): a multiple of G, at most R)
  uint64_t pool_bytes;       // num_blocks * block.bytes
  uint64_t residual_bytes;   // residual_slots * residual.bytes
  // Chunked prefill: every layer has a staging area of cfg.prefill_staging_tokens rows
  // [rows][num_kv_heads][head_dim] of K and of V in the caller's dtype (0: none).
  uint64_t staging_bytes;    // K + V of all layers
};

// Where one (sequence, layer) keeps its tokens.
struct CacheView {
  const uint32_t *blocks = nullptr;  // block table (host array)
  uint32_t num_blocks = 0;
  uint32_t residual_slot = 0;
  uint32_t sinks = 0;      // sink tokens (positions 0..sinks-1) in the slot's sink region
  uint32_t quantized = 0;  // tokens in blocks (a multiple of group_size)
  uint32_t residual = 0;   // tokens in the residual slot
};

// One sequence of a prefill call: its whole prompt, or one chunk of it (minikv_prefill_chunk).
// A chunked prompt keeps its K/V in a run of staging rows of the layer, row p = prompt
// position p, and its running score sums beside them, from the first chunk to the last.
struct PrefillItem {
  int64_t token_begin = 0;  // first row of this sequence's chunk in the packed q/k/v/out
  uint32_t rows = 0;        // rows of the chunk (a whole prompt: plan.prompt_len)
  uint32_t position = 0;    // prompt position of the chunk's first row
  bool staged = false;      // the prompt goes through the staging run (not one call)
  bool last = true;         // the chunk completes the prompt: select and store
  uint32_t staging_begin = 0;  // staged: first staging row of the run (position 0)
  // staged: score sums of keys [0, scored_keys) hold the earlier chunks' queries (the keys
  // of every earlier chunk that had scoring queries); sums of later keys are not set yet.
  uint32_t scored_keys = 0;
  SelectionPlan plan;  // of the whole prompt
  CacheView dst;  // sinks = plan.n_sink; quantized = the other kept tokens rounded down to
                  // G; residual = the rest (the last chunk writes it)
};

// Whether a prompt's queries score keys (heavy hitters to choose), and from which prompt
// position on (WINDOW: the last window_size queries).
inline bool plan_needs_scores(const SelectionPlan &plan) { return !plan.keep_all && plan.n_heavy > 0; }
inline uint32_t first_scoring_row(const minikv_config &cfg, const SelectionPlan &plan) {
  return cfg.score_mode == MINIKV_SCORE_WINDOW ? plan.scored_prefix : 0;
}
// Whether the rows of an item include scoring queries.
inline bool chunk_scores(const minikv_config &cfg, const PrefillItem &it) {
  return plan_needs_scores(it.plan) && it.position + it.rows > first_scoring_row(cfg, it.plan);
}

struct AppendItem {
  CacheView dst;        // state before the append; blocks already include a flush's new ones
  int32_t position = 0; // the token's position in its sequence
  bool flush = false;   // the residual reaches R with this token: quantize its oldest F
                        // tokens into blocks and move the other R - F to its front
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual minikv_backend kind() const = 0;
  virtual uint64_t pool_bytes() const = 0;
  virtual uint64_t workspace_bytes() const = 0;

  // Staged items read and write the staging area of `layer`.
  virtual void prefill(uint32_t layer, const std::vector<PrefillItem> &items, const void *q,
                       const void *k, const void *v, void *out, void *stream) = 0;
  virtual void append(uint32_t layer, const std::vector<AppendItem> &items, const void *k,
                      const void *v, void *stream) = 0;
  virtual void decode(uint32_t layer, const std::vector<CacheView> &items, const void *q,
                      void *out, void *stream) = 0;
  // append(items) then decode(after), `after` being each sequence's view once its token is
  // appended; the outputs and storage must equal those of the two calls bit for bit. A
  // backend may fuse them (CUDA: one launch); this one runs them in order.
  virtual void append_decode(uint32_t layer, const std::vector<AppendItem> &items,
                             const std::vector<CacheView> &after, const void *q, const void *k,
                             const void *v, void *out, void *stream) {
    append(layer, items, k, v, stream);
    decode(layer, after, q, out, stream);
  }
  // Positions of the tokens in blocks and residual [0, count) of one KV head (cache order
  // after the sinks, whose positions are implicit), into host memory.
  virtual void read_positions(const CacheView &view, uint32_t kv_head, uint32_t count,
                              int32_t *out) const = 0;
  // White-box tests: copies the whole block pool and every residual slot into host memory
  // (CUDA: synchronizes the device). Identical calls leave identical bytes in both backends.
  virtual void read_storage(std::vector<uint8_t> &pool, std::vector<uint8_t> &residual) const {
    (void)pool;
    (void)residual;
    fail(MINIKV_ERR_UNSUPPORTED, "read_storage: not implemented by this backend");
  }
};

std::unique_ptr<Backend> make_cpu_backend(const StorageSpec &spec);
// Throws Error(UNSUPPORTED) when libminikv was built without CUDA or no device is present.
std::unique_ptr<Backend> make_cuda_backend(const StorageSpec &spec);
bool cuda_backend_available(int device_id);

}  // namespace minikv
