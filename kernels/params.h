// Flat POD parameter structs shared by the host launchers and the kernels. Everything a
// launch needs per sequence travels in the kernel parameters (at most kMax* sequences per
// launch, larger batches are split into several launches): the launch snapshots them, so
// nothing is staged in host memory that a later call could overwrite before the GPU reads
// it, and a CUDA graph capture records exactly the values of the captured call.
#pragma once

#include <cstdint>

#include "../src/layout.h"

namespace minikv {
namespace kernels {

constexpr uint32_t kMaxPrefillSeqs = 64;   // sequences per prefill launch
constexpr uint32_t kMaxAppendSeqs = 64;    // sequences per append launch
constexpr uint32_t kMaxDecodeSeqs = 128;   // sequences per decode launch
constexpr uint32_t kMaxTableIds = 900;     // block-table entries per table-update launch
constexpr float kLog2e = 1.4426950408889634f;

// The device storage of the cache, exactly in the layout of src/layout.h.
//   pool         [num_blocks][block.bytes]
//   residual     [residual_slots][res.bytes]
//   block_table  [residual_slots][max_blocks_per_seq] int32: pool block of logical block b
//                of (sequence, layer) slot s (the device mirror of the host block lists)
struct DeviceStorage {
  uint8_t *pool;
  uint8_t *residual;
  int32_t *block_table;
  BlockLayout block;
  ResidualLayout res;
  uint32_t max_blocks_per_seq;
  uint32_t pad_;
};

// ---- prefill ----------------------------------------------------------------------------
// Sequences of one prefill launch. Per-sequence workspace rows start at ws_offset (the
// workspaces hold ws_tokens rows: the launch's sequences are packed there back to back).
struct PrefillSeqs {
  uint32_t n;
  int64_t token_begin[kMaxPrefillSeqs];  // first row in the caller's packed q/k/v/out
  uint32_t len[kMaxPrefillSeqs];         // prompt length L
  uint32_t ws_offset[kMaxPrefillSeqs];   // first row of this sequence in the workspaces
  uint32_t tile_begin[kMaxPrefillSeqs + 1];  // prefix sums of this launch's tiles per sequence
};

// The keys of each sequence (chunked prefill, minikv_prefill_chunk): the seqs.len query
// rows of a sequence are its prompt positions [q_pos, q_pos + len) and attend to the keys
// [0, q_pos + len), key p at row kv_begin + p of k/v. A whole prompt: q_pos = 0 and
// kv_begin = token_begin; a chunk: k/v are the layer's staging rows, kv_begin its run.
struct PrefillKeys {
  int64_t kv_begin[kMaxPrefillSeqs];
  uint32_t q_pos[kMaxPrefillSeqs];
};

struct PrefillAttnParams {
  const void *q, *k, *v;
  void *out;
  float *lse;  // [num_heads][ws_tokens] row log-sum-exp in log2 units (of logits * log2 e)
  uint32_t num_heads, num_kv_heads, ws_tokens;
  float scale_log2;  // log2(e) / sqrt(head_dim)
  PrefillSeqs seqs;  // tiles: ceil(len / kPrefillQueryTile) query tiles
  PrefillKeys keys;
  uint32_t kv_heads_per_chunk;  // the grid's order (prefill_common.cuh cta_tile_head); set by the launcher
};

// Column sums of exp(s - LSE) over the query rows at prompt positions >= row_begin for key
// columns [0, col_end), summed over the query heads of each KV head. Columns below col_done
// add to the sums already there (earlier chunks of the prompt); the others are written.
struct PrefillScoreParams {
  const void *q, *k;
  const float *lse;
  float *scores;  // [num_kv_heads][scores_stride], a sequence's columns from score_offset
  uint32_t num_heads, num_kv_heads, ws_tokens, scores_stride;
  float scale_log2;
  PrefillSeqs seqs;  // tiles: ceil(col_end / kPrefillKeyTile) key tiles
  PrefillKeys keys;
  uint32_t row_begin[kMaxPrefillSeqs];
  uint32_t col_end[kMaxPrefillSeqs];
  uint32_t col_done[kMaxPrefillSeqs];
  uint32_t score_offset[kMaxPrefillSeqs];
  // The general score passes only (launch_prefill_scores, _wgmma; prefill_common.cuh): each
  // (key tile, KV head)'s items split over `parts` CTAs (set by the launcher; 1: not split),
  // whose column sums wait in part_sums [parts][part_stride][kPrefillKeyTile] until the last
  // to finish adds them in part order; part_counters[part_stride] count the arrivals and are
  // left at zero.
  float *part_sums;
  uint32_t *part_counters;
  uint32_t parts, part_stride;
  uint32_t kv_heads_per_chunk;  // the grid's order (prefill_common.cuh cta_tile_head); set by the launcher
};

// Selection of the kept positions per (sequence, KV head), ascending, into kept: the sinks
// [0, n_sink), the n_heavy best of [n_sink, candidates), the suffix [candidates, L).
struct SelectParams {
  const float *scores;  // [num_kv_heads][ws_tokens]
  int32_t *kept;        // [num_kv_heads][ws_tokens]
  uint32_t ws_tokens;
  uint32_t pool_kernel;  // WINDOW max-pool width (1 = none)
  PrefillSeqs seqs;
  uint32_t candidates[kMaxPrefillSeqs];  // end of the candidate range (keep all: L)
  uint32_t n_sink[kMaxPrefillSeqs];
  uint32_t n_heavy[kMaxPrefillSeqs];
  uint32_t n_keep[kMaxPrefillSeqs];
  uint32_t scored_prefix[kMaxPrefillSeqs];  // pooled range (WINDOW with pool_kernel > 1), else 0
  uint8_t mode[kMaxPrefillSeqs];            // 0 keep all, 1 recent only, 2 scored
};

// Store of the kept tokens in cache order: the sinks into the slot's sink region, whole
// groups quantized into blocks, the tail into the residual.
struct StoreParams {
  const void *k, *v;
  const int32_t *kept;  // [num_kv_heads][ws_tokens]
  DeviceStorage st;
  uint32_t ws_tokens;
  PrefillSeqs seqs;
  uint32_t sinks[kMaxPrefillSeqs];      // kept[0, sinks): positions 0..sinks-1
  uint32_t quantized[kMaxPrefillSeqs];  // tokens that go to blocks (multiple of G)
  uint32_t n_keep[kMaxPrefillSeqs];     // sinks included
  uint32_t slot[kMaxPrefillSeqs];       // residual slot = block-table row
  // Kept indices whose positions the selection chooses: [sinks, chosen_end). Before them,
  // index i is position i; from chosen_end on, position suffix_begin + (i − chosen_end). So
  // a CTA of those indices stores before the selection ends (select_plan.h set_store_positions).
  uint32_t chosen_end[kMaxPrefillSeqs];
  uint32_t suffix_begin[kMaxPrefillSeqs];
};

// Writes ids into block_table[slot][first + i], i < count.
struct TableParams {
  int32_t *block_table;
  uint32_t max_blocks_per_seq;
  uint32_t slot, first, count;
  int32_t ids[kMaxTableIds];
};

// ---- append -----------------------------------------------------------------------------
struct AppendItemParams {
  uint32_t input;      // row of the token's K/V in the caller's k/v [..][num_kv_heads][head_dim]
  uint32_t slot;       // residual slot = block-table row
  uint32_t row;        // residual row the token goes to
  uint32_t quantized;  // tokens in blocks before this append
  int32_t position;
  int32_t block_lo, block_hi;  // flush: pool blocks of logical blocks quantized/R and
                               // (quantized+F-1)/R (the mirror is updated with them)
  uint32_t flush;
};
struct AppendParams {
  const void *k, *v;  // the caller's [batch][num_kv_heads][head_dim]: item i reads row items[i].input
  DeviceStorage st;
  uint32_t flush_tokens;  // F: the oldest residual rows a flush quantizes (<= R)
  uint32_t n;
  AppendItemParams items[kMaxAppendSeqs];
};

// ---- decode -----------------------------------------------------------------------------
struct DecodeParams {
  const void *q;  // [n][num_heads][head_dim]
  void *out;
  float *part_o;   // [n][num_heads][splits][head_dim] unnormalized partial outputs
  float *part_ml;  // [n][num_heads][splits][2] partial (max, sum), log2 units
  uint32_t *counters;  // [n][num_kv_heads] fast path: splits done; zero between launches
  DeviceStorage st;
  uint32_t num_heads, num_kv_heads;
  uint32_t heads_per_cta;  // query heads of one GQA group handled by one CTA
  uint32_t splits;
  float scale_log2;
  uint32_t n;
  uint32_t slot[kMaxDecodeSeqs];
  uint32_t sinks[kMaxDecodeSeqs];
  uint32_t quantized[kMaxDecodeSeqs];
  uint32_t residual[kMaxDecodeSeqs];  // the appended token included (minikv_append_decode)
  // minikv_append_decode: the token this launch appends (decode_common.cuh has the contract).
  // new_k/new_v: the caller's [n][num_kv_heads][head_dim] (nullptr: plain decode, no token);
  // new_position[b] >= 0: sequence b's residual row residual[b] - 1 is that token, at that
  // position, not yet in its slot; < 0: nothing to append for b (its flush stored it).
  const void *new_k, *new_v;
  int32_t new_position[kMaxDecodeSeqs];
};

}  // namespace kernels
}  // namespace minikv

// Kernel parameters must fit the classic 4 KB limit (no reliance on CUDA 12.1's larger one).
namespace minikv {
namespace kernels {
static_assert(sizeof(PrefillAttnParams) <= 4096 && sizeof(PrefillScoreParams) <= 4096 &&
                  sizeof(SelectParams) <= 4096 && sizeof(StoreParams) <= 4096 &&
                  sizeof(TableParams) <= 4096 && sizeof(AppendParams) <= 4096 &&
                  sizeof(DecodeParams) <= 4096,
              "kernel parameters exceed 4 KB");
}  // namespace kernels
}  // namespace minikv
