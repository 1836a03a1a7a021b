// The object behind the opaque minikv_cache handle: configuration, per-layer budgets,
// per-(sequence, layer) state, the block allocator, and exact memory statistics. Every
// public operation validates completely and reserves every block it needs before it
// touches the backend, so a failed call changes nothing.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "backend.h"
#include "staging_runs.h"
#include "minikv.h"

namespace minikv {

class Cache {
 public:
  explicit Cache(const minikv_config &cfg);  // throws Error
  ~Cache();
  Cache(const Cache &) = delete;
  Cache &operator=(const Cache &) = delete;

  const minikv_config &config() const { return cfg_; }
  // White-box tests (tests/gpu): the backend, e.g. to read its storage.
  const Backend &backend() const { return *backend_; }
  // Where (seq, layer) keeps its tokens, as the backend is handed it (and white-box tests).
  CacheView view(uint32_t seq, uint32_t layer) const;

  // minikv_prefill (prompt_lens NULL: each sequence's rows are its whole prompt) and
  // minikv_prefill_chunk; `call` names the function in messages.
  void prefill(const char *call, uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids,
               const int32_t *cu_seqlens, const uint32_t *prompt_lens, const void *q,
               const void *k, const void *v, void *out, void *stream);
  void prefill(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids,
               const int32_t *cu_seqlens, const void *q, const void *k, const void *v,
               void *out, void *stream) {
    prefill("minikv_prefill", layer, n_seqs, seq_ids, cu_seqlens, nullptr, q, k, v, out, stream);
  }
  void append(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids, const void *k,
              const void *v, void *stream);
  void decode(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids, const void *q,
              void *out, void *stream);
  void append_decode(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids, const void *q,
                     const void *k, const void *v, void *out, void *stream);
  void release(uint32_t seq_id);
  void sequence_length(uint32_t seq_id, uint32_t layer, uint64_t *seen, uint64_t *cached) const;
  void kept_positions(uint32_t seq_id, uint32_t layer, uint32_t kv_head, int32_t *positions,
                      uint32_t capacity, uint32_t *count) const;
  minikv_memory_stats stats() const;

  // Per-handle last error (minikv_cache_last_error).
  void set_error(const std::string &message) noexcept;
  const char *last_error() const noexcept { return last_error_.c_str(); }

 private:
  struct LayerState {
    bool prefilled = false;
    uint32_t prompt_len = 0;
    uint32_t kept_prompt = 0;  // n_keep
    uint32_t generated = 0;
    uint32_t sinks = 0;
    uint32_t quantized = 0;
    uint32_t residual = 0;
    uint32_t num_blocks = 0;  // entries used in this pair's row of tables_ (mid-prompt:
                              // the blocks the finished prompt will keep, reserved)
    // Mid-prompt (minikv_prefill_chunk, between the first and the last chunk): the whole
    // prompt's length (0: not mid-prompt), the positions received so far, the staging run
    // and the keys whose score sums are set (PrefillItem::scored_keys).
    uint32_t pending_len = 0;
    uint32_t received = 0;
    uint32_t staging_begin = 0;
    uint32_t scored_keys = 0;
  };

  LayerState &state(uint32_t seq, uint32_t layer) { return states_[size_t(seq) * cfg_.num_layers + layer]; }
  const LayerState &state(uint32_t seq, uint32_t layer) const { return states_[size_t(seq) * cfg_.num_layers + layer]; }
  uint32_t blocks_for(uint64_t quantized_tokens) const;
  void check_common(const char *call, uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids,
                    bool need_prefilled) const;
  // BAD_STATE unless the (sequence, layer) is prefilled (the message tells mid-prompt apart).
  void require_prefilled(const char *call, uint32_t seq, uint32_t layer) const;
  // Tensor pointers aligned as minikv.h states (element size; 16 bytes for CUDA).
  void check_aligned(const char *call,
                     std::initializer_list<std::pair<const char *, const void *>> tensors) const;
  // CPU backend: every element of a [rows][heads][head_dim] input is finite. Rows are the
  // tokens of the packed prompts (cu_seqlens given) or the sequences of the batch.
  void check_finite(const char *call, const char *name, const void *data, uint64_t rows,
                    uint32_t heads, const uint32_t *seq_ids, const int32_t *cu_seqlens) const;
  // `out` (out_bytes) shares no byte with an input tensor (the CUDA kernels of a call read
  // the inputs while others write out).
  void check_disjoint(const char *call, const void *out, uint64_t out_bytes,
                      std::initializer_list<std::pair<const char *, std::pair<const void *, uint64_t>>>
                          inputs) const;
  // Plans the append of one token per sequence (append, append_decode) after the argument
  // checks: fails when a sequence reached max_seq_len or the pool lacks the blocks of the
  // flushes due, else takes those blocks (append_extra_[i] of them; return_append_blocks
  // gives them back) and fills append_items_ (each view before the token, new blocks
  // included).
  void plan_append(const char *call, uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids);
  void return_append_blocks(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids) noexcept;
  // The planned append done: each sequence holds one token more.
  void commit_append(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids) noexcept;
  uint32_t *table(uint32_t seq, uint32_t layer) {
    return tables_.data() + (size_t(seq) * cfg_.num_layers + layer) * spec_.max_blocks_per_seq;
  }
  const uint32_t *table(uint32_t seq, uint32_t layer) const {
    return const_cast<Cache *>(this)->table(seq, layer);
  }
  // Moves n blocks from the free list to the end of a pair's table (availability checked).
  void take_blocks(uint32_t seq, uint32_t layer, uint32_t n) noexcept;
  // Returns the last n blocks of a pair's table to the free list.
  void return_blocks(uint32_t seq, uint32_t layer, uint32_t n) noexcept;

  minikv_config cfg_;
  StorageSpec spec_;
  std::vector<double> heavy_ratios_;
  std::vector<LayerState> states_;  // [max_sequences][num_layers]
  // Free blocks: those returned by released sequences (a stack, handed out first; capacity
  // for all) and those never handed out, [next_fresh_block_, num_blocks) — so create does
  // not write a list of every block. Blocks go out in the order of a stack filled 0, 1, ...
  std::vector<uint32_t> returned_blocks_;
  uint32_t next_fresh_block_ = 0;
  uint64_t free_blocks() const {
    return returned_blocks_.size() + (spec_.num_blocks - next_fresh_block_);
  }
  std::vector<uint32_t> tables_;       // [max_sequences][num_layers][max_blocks_per_seq]
  std::vector<StagingRuns> staging_;   // [num_layers] when prefill_staging_tokens > 0
  // Per-call scratch, sized at create so that calls allocate nothing.
  mutable std::vector<uint8_t> seen_;  // [max_sequences]: duplicate seq_id check
  std::vector<PrefillItem> prefill_items_;
  std::vector<AppendItem> append_items_;
  std::vector<uint32_t> append_extra_;
  std::vector<CacheView> decode_items_;
  std::unique_ptr<Backend> backend_;
  std::string last_error_;
};

}  // namespace minikv
