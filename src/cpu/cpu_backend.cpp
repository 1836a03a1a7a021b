// The CPU backend: the reference every CUDA kernel is checked against, and the embedded
// default on machines without a GPU. float32 arithmetic (scores accumulated in double),
// exact softmax, O(L) extra memory per thread (no L×L buffer), all threads of the pool.
// The hot loops are the SIMD kernels of simd_kernels.h, whose results are the same bits on
// every machine; this file plans the work and moves the data.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>

#include "../alloc.h"
#include "../backend.h"
#include "../checked_size.h"
#include "../config.h"
#include "../dtype.h"
#include "../error.h"
#include "../quant.h"
#include "simd_kernels.h"
#include "thread_pool.h"

namespace minikv {
namespace {

// Query rows processed together in prefill: each key row is loaded once per block.
constexpr uint32_t kQueryBlock = 16;

// Decode parts: a (sequence, KV head) group's quantized blocks split into up to
// kMaxDecodeParts runs of whole blocks of at least kMinPartTokens tokens, by the sequence's
// length alone (never by the thread count or the batch), so that one long sequence spreads
// over the pool; the sinks belong to the first part, the residual to the last. Each part
// keeps its own running softmax; the thread that finishes a group's last part merges the
// parts' states in part order.
constexpr uint32_t kMaxDecodeParts = 4, kMinPartTokens = 512;

// The most parts a sequence of the config can have.
uint32_t max_decode_parts(const minikv_config &cfg) {
  return std::max(1u, std::min(cfg.max_seq_len / kMinPartTokens, kMaxDecodeParts));
}

struct FreeDeleter {
  void operator()(void *p) const { std::free(p); }
};
using HostBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

HostBuffer host_alloc(uint64_t bytes, const char *what) {
  // calloc: untouched pages stay unmapped, so resident memory follows real use.
  void *p = host_calloc(bytes == 0 ? 1 : bytes);  // test seam: src/alloc.h
  if (!p) {
    fail(MINIKV_ERR_OUT_OF_MEMORY, "minikv_cache_create: cannot allocate %llu bytes for the %s",
         static_cast<unsigned long long>(bytes), what);
  }
  return HostBuffer(static_cast<uint8_t *>(p));
}

// Per-thread scratch, sized at create for what the config can use.
struct Scratch {
  std::vector<float> k, v;       // [max(max_seq_len, R)][D] rows as float, or key/value panels
  std::vector<float> s;          // [kQueryBlock][max_seq_len] logits / probabilities
  std::vector<float> q, o;       // [kQueryBlock][D]
  std::vector<float> scores, pooled;  // [max_seq_len], when a layer can need scores
  std::vector<int32_t> kept;          // [max_seq_len]
  std::vector<uint32_t> order;        // [max_seq_len], when a layer can need scores
  std::vector<float> dec;             // decode: DecodeScratch
  // What k and v hold as prefill panels: those of KV head panels_kvh in prefill pass
  // panels_pass (0: none), reused by the next query head of the same group on this thread.
  uint64_t panels_pass = 0;
  uint32_t panels_kvh = 0;
};

// Threads worth having: the widest parallel loop is over the query heads (prefill) or over
// the parts of (sequence, KV head) pairs (decode); a thread beyond that would only hold
// scratch.
unsigned usable_threads(const minikv_config &cfg) {
  const uint64_t widest = std::max<uint64_t>(
      cfg.num_heads, uint64_t(cfg.max_sequences) * cfg.num_kv_heads * max_decode_parts(cfg));
  return static_cast<unsigned>(std::min<uint64_t>(cpu::default_thread_count(), widest));
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const StorageSpec &spec)
      : spec_(spec), cfg_(spec.cfg), bl_(spec.block), rl_(spec.residual),
        max_parts_(max_decode_parts(spec.cfg)), pool_threads_(usable_threads(spec.cfg)) {
    pool_ = host_alloc(spec.pool_bytes, "block pool");
    residual_ = host_alloc(spec.residual_bytes, "residual slots");
    const uint64_t rows = std::max<uint64_t>(cfg_.max_seq_len, cfg_.residual_length);
    const uint32_t D = cfg_.head_dim;
    const uint64_t score_len = scores_possible(cfg_) ? cfg_.max_seq_len : 0;
    scratch_.resize(pool_threads_.size());
    for (Scratch &s : scratch_) {
      // Rows as float, or (prefill attention) the prompt's keys and values in panels.
      const uint64_t panels = align_up(D, cpu::kPanelWidth) * align_up(cfg_.max_seq_len, cpu::kPanelWidth);
      s.k.resize(std::max(rows * D, panels));
      s.v.resize(std::max(rows * D, panels));
      s.s.resize(uint64_t(kQueryBlock) * key_stride());
      s.q.resize(kQueryBlock * D);
      s.o.resize(kQueryBlock * D);
      s.scores.resize(score_len);
      s.pooled.resize(score_len);
      s.kept.resize(cfg_.max_seq_len);
      s.order.resize(score_len);
      s.dec.resize(decode_scratch(nullptr).floats);
      workspace_bytes_ += (s.k.size() + s.v.size() + s.s.size() + s.q.size() + s.o.size() +
                           s.scores.size() + s.pooled.size()) * sizeof(float) +
                          (s.kept.size() + s.order.size()) * 4 + s.dec.size() * sizeof(float);
    }
    head_scores_.resize(uint64_t(cfg_.num_heads) * score_len);
    workspace_bytes_ += head_scores_.size() * sizeof(double);
    const uint64_t groups = uint64_t(cfg_.max_sequences) * cfg_.num_kv_heads;
    if (max_parts_ > 1) {  // else every group is one part: no states, no counters
      decode_states_.resize(groups * max_parts_ * part_state_floats());
      parts_done_.reset(new std::atomic<uint32_t>[groups]);
      workspace_bytes_ += decode_states_.size() * sizeof(float) + groups * sizeof(std::atomic<uint32_t>);
    }
    // Chunked prefill: the staged K/V of every layer, and the running score sums of its
    // prompts ([num_layers][num_heads][staging rows], when scores can be needed).
    const uint64_t S = cfg_.prefill_staging_tokens;
    if (S > 0) {
      staging_ = host_alloc(spec.staging_bytes, "prefill staging area");
      const uint64_t sums = scores_possible(cfg_) ? uint64_t(cfg_.num_layers) * cfg_.num_heads * S : 0;
      staged_scores_ = host_alloc(sums * sizeof(double), "prefill staging scores");
      workspace_bytes_ += spec.staging_bytes + sums * sizeof(double);
    }
  }

  minikv_backend kind() const override { return MINIKV_BACKEND_CPU; }
  uint64_t pool_bytes() const override {
    return spec_.pool_bytes + spec_.residual_bytes;
  }
  uint64_t workspace_bytes() const override { return workspace_bytes_; }

  void prefill(uint32_t layer, const std::vector<PrefillItem> &items, const void *q,
               const void *k, const void *v, void *out, void *) override {
    dispatch_dtype(cfg_.dtype, [&](auto tag) {
      using T = decltype(tag);
      for (const PrefillItem &it : items)
        prefill_sequence<T>(layer, it, static_cast<const T *>(q), static_cast<const T *>(k),
                            static_cast<const T *>(v), static_cast<T *>(out));
      return 0;
    });
  }

  void append(uint32_t, const std::vector<AppendItem> &items, const void *k, const void *v,
              void *) override {
    dispatch_dtype(cfg_.dtype, [&](auto tag) {
      using T = decltype(tag);
      const uint32_t Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
      pool_threads_.parallel_for(uint64_t(items.size()) * Hkv, [&](uint64_t w, unsigned worker) {
        const AppendItem &it = items[w / Hkv];
        const uint32_t head = static_cast<uint32_t>(w % Hkv);
        const uint64_t src = ((w / Hkv) * Hkv + head) * D;
        uint8_t *slot = residual_slot(it.dst.residual_slot);
        T *k_res = residual_row<T>(slot, rl_.k, head, it.dst.residual);
        T *v_res = residual_row<T>(slot, rl_.v, head, it.dst.residual);
        std::memcpy(k_res, static_cast<const T *>(k) + src, D * sizeof(T));
        std::memcpy(v_res, static_cast<const T *>(v) + src, D * sizeof(T));
        residual_positions(slot, head)[it.dst.residual] = it.position;
        if (it.flush) flush_residual<T>(it.dst, head, scratch_[worker]);
        return;
      });
      return 0;
    });
  }

  void decode(uint32_t, const std::vector<CacheView> &items, const void *q, void *out,
              void *) override {
    dispatch_dtype(cfg_.dtype, [&](auto tag) {
      using T = decltype(tag);
      const uint32_t Hkv = cfg_.num_kv_heads, n_rep = cfg_.num_heads / Hkv;
      const uint64_t groups = uint64_t(items.size()) * Hkv;
      if (max_parts_ > 1)
        for (uint64_t g = 0; g < groups; ++g) parts_done_[g].store(0, std::memory_order_relaxed);
      // One work item per part of a (sequence, KV head) group: each cached K/V row is
      // decoded once and serves the n_rep query heads of the group; a long sequence's parts
      // spread over the pool even when it is alone.
      pool_threads_.parallel_for(groups * max_parts_, [&](uint64_t w, unsigned worker) {
        const uint64_t g = w / max_parts_;
        const CacheView &view = items[g / Hkv];
        const uint32_t part = static_cast<uint32_t>(w % max_parts_), parts = decode_parts(view);
        if (part >= parts) return;
        const uint64_t first = g * n_rep * cfg_.head_dim;  // rows of q/out of this group
        decode_part<T>(view, static_cast<uint32_t>(g % Hkv), static_cast<const T *>(q) + first,
                       static_cast<T *>(out) + first, part, parts, g, scratch_[worker]);
      });
      return 0;
    });
  }

  void read_storage(std::vector<uint8_t> &pool, std::vector<uint8_t> &residual) const override {
    pool.assign(pool_.get(), pool_.get() + spec_.pool_bytes);
    residual.assign(residual_.get(), residual_.get() + spec_.residual_bytes);
  }

  void read_positions(const CacheView &view, uint32_t kv_head, uint32_t count,
                      int32_t *out) const override {
    for (uint32_t t = 0; t < count; ++t) {
      if (t < view.quantized) {
        const uint8_t *block = block_ptr(view.blocks[t / bl_.tokens]);
        out[t] = reinterpret_cast<const int32_t *>(block + bl_.positions +
                                                   kv_head * bl_.positions_head())[t % bl_.tokens];
      } else {
        uint8_t *slot = residual_slot(view.residual_slot);
        out[t] = residual_positions(slot, kv_head)[t - view.quantized];
      }
    }
  }

 private:
  // Row stride of the logits: whole key panels, plus one cache line so that the rows of a
  // tile do not all map to the same L1 set.
  uint64_t key_stride() const { return align_up(cfg_.max_seq_len, cpu::kPanelWidth) + 16; }
  uint8_t *block_ptr(uint32_t block) const { return pool_.get() + uint64_t(block) * bl_.bytes; }
  uint8_t *residual_slot(uint32_t slot) const { return residual_.get() + uint64_t(slot) * rl_.bytes; }
  template <typename T>
  T *residual_row(uint8_t *slot, uint64_t region, uint32_t head, uint32_t row) const {
    return reinterpret_cast<T *>(slot + region) + (uint64_t(head) * rl_.tokens + row) * rl_.head_dim;
  }
  template <typename T>
  T *sink_row(uint8_t *slot, uint64_t region, uint32_t head, uint32_t row) const {
    return reinterpret_cast<T *>(slot + region) + (uint64_t(head) * rl_.sink_tokens + row) * rl_.head_dim;
  }
  int32_t *residual_positions(uint8_t *slot, uint32_t head) const {
    return reinterpret_cast<int32_t *>(slot + rl_.positions) + uint64_t(head) * rl_.tokens;
  }

  // ---- prefill --------------------------------------------------------------------
  // Where a prompt's keys and values are read from (the caller's rows, or the staging run
  // of a chunked prompt: row0 + p is prompt position p) and where its score sums go
  // (column sums per query head h at scores + h * score_stride, indexed by position).
  template <typename T> struct PromptRows {
    const T *k, *v;
    int64_t row0;
    double *scores;
    uint64_t score_stride;
  };

  template <typename T>
  void prefill_sequence(uint32_t layer, const PrefillItem &it, const T *q, const T *k, const T *v,
                        T *out) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads;
    const bool need_scores = plan_needs_scores(it.plan);
    PromptRows<T> src{k, v, it.token_begin, head_scores_.data(), cfg_.max_seq_len};
    if (it.staged) {
      // The chunk joins the prompt's earlier rows in the staging run; the attention and the
      // selection read the whole prompt from there.
      const uint64_t S = cfg_.prefill_staging_tokens, row = uint64_t(Hkv) * cfg_.head_dim;
      T *k_stage = reinterpret_cast<T *>(staging_.get()) + uint64_t(layer) * 2 * S * row;
      T *v_stage = k_stage + S * row;
      const uint64_t at = (uint64_t(it.staging_begin) + it.position) * row;
      std::memcpy(k_stage + at, k + it.token_begin * row, it.rows * row * sizeof(T));
      std::memcpy(v_stage + at, v + it.token_begin * row, it.rows * row * sizeof(T));
      double *sums = reinterpret_cast<double *>(staged_scores_.get());
      src = {k_stage, v_stage, it.staging_begin,
             need_scores ? sums + uint64_t(layer) * H * S + it.staging_begin : nullptr, S};
    }
    // Rows whose attention counts towards the scores (prompt positions).
    const uint32_t score_from = first_scoring_row(cfg_, it.plan);
    const bool scores_now = chunk_scores(cfg_, it);
    ++prefill_passes_;  // the panels of an earlier pass (other rows) are stale
    pool_threads_.parallel_for(H, [&](uint64_t h, unsigned worker) {
      attention_head<T>(it, static_cast<uint32_t>(h), scores_now, score_from, q, src, out,
                        scratch_[worker]);
    });
    if (!it.last) return;
    pool_threads_.parallel_for(Hkv, [&](uint64_t kvh, unsigned worker) {
      select_and_store<T>(it, static_cast<uint32_t>(kvh), need_scores, src, scratch_[worker]);
    });
  }

  // Causal attention of one query head: the item's rows (prompt positions [position,
  // position + rows)) over the prompt's keys [0, position + rows), optionally accumulating the
  // column sums of the probabilities of rows >= score_from (the importance scores) into the
  // head's sums: blocks of kQueryBlock query rows, each with its full row of logits (exact
  // softmax, no L×L). Each row's probabilities depend on its position and the keys only, and
  // rows add to the sums in position order, so a prompt in chunks sums as in one call.
  template <typename T>
  void attention_head(const PrefillItem &it, uint32_t h, bool scores_now, uint32_t score_from,
                      const T *q, const PromptRows<T> &src, T *out, Scratch &ws) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const uint32_t kvh = h / (H / Hkv);
    const uint32_t keys = it.position + it.rows;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const uint64_t lds = key_stride();
    // Keys and values in zero-padded panels of W columns (src/cpu/simd_kernels.h), in the
    // row buffers ws.k and ws.v (sized for them), each row converted through ws.o; kept
    // for the next query head of the same KV head that this thread takes in this pass.
    constexpr uint32_t W = cpu::kPanelWidth;
    const uint32_t L_pad = static_cast<uint32_t>(align_up(keys, W));
    const uint64_t v_panel = uint64_t(L_pad) * W;
    float *k_panels = ws.k.data(), *v_panels = ws.v.data(), *row = ws.o.data();
    const bool have_panels = ws.panels_pass == prefill_passes_ && ws.panels_kvh == kvh;
    ws.panels_pass = prefill_passes_;
    ws.panels_kvh = kvh;
    if (!have_panels) {
      std::fill(k_panels, k_panels + uint64_t(L_pad) * D, 0.0f);
      std::fill(v_panels, v_panels + align_up(D, W) * L_pad, 0.0f);
      for (uint32_t j = 0; j < keys; ++j) {
        const uint64_t at = (uint64_t(src.row0 + j) * Hkv + kvh) * D;
        float *k_at = k_panels + (uint64_t(j / W) * D) * W + j % W;
        cpu::to_floats(src.k + at, D, row);
        for (uint32_t c = 0; c < D; ++c) k_at[uint64_t(c) * W] = row[c];
        float *v_at = v_panels + uint64_t(j) * W;
        cpu::to_floats(src.v + at, D, row);
        for (uint32_t c = 0; c < D; ++c) v_at[(c / W) * v_panel + c % W] = row[c];
      }
    }
    // Sums of keys [0, scored_keys) hold the earlier chunks' rows; the others start here.
    double *col = scores_now ? src.scores + uint64_t(h) * src.score_stride : nullptr;
    if (scores_now) std::fill(col + it.scored_keys, col + keys, 0.0);

    for (uint32_t i0 = 0; i0 < it.rows; i0 += kQueryBlock) {
      const uint32_t rows = std::min(kQueryBlock, it.rows - i0);
      const uint32_t first = it.position + i0;  // prompt position of the block's first row
      for (uint32_t r = 0; r < rows; ++r)
        cpu::to_floats(q + (uint64_t(it.token_begin + i0 + r) * H + h) * D, D, ws.q.data() + r * D);
      cpu::causal_logits(ws.q.data(), rows, D, k_panels, first, ws.s.data(), lds);
      cpu::softmax_rows(ws.s.data(), rows, lds, first, scale, col,
                        std::max(score_from, first) - first);
      cpu::causal_pv(ws.s.data(), rows, lds, v_panels, v_panel, D, first, ws.o.data());
      // Clamped: a mean of values at the dtype's maximum may round just above it.
      for (uint64_t i = 0; i < uint64_t(rows) * D; ++i) ws.o[i] = clamp_finite<T>(ws.o[i]);
      for (uint32_t r = 0; r < rows; ++r)
        cpu::from_floats(ws.o.data() + r * D, D, out + (uint64_t(it.token_begin + i0 + r) * H + h) * D);
    }
  }

  // Scores of one KV head (sum over its query heads), selection, and storage of the kept
  // tokens: whole groups quantized into blocks, the tail into the residual.
  template <typename T>
  void select_and_store(const PrefillItem &it, uint32_t kvh, bool need_scores,
                        const PromptRows<T> &src, Scratch &ws) {
    const uint32_t H = cfg_.num_heads, Hkv = cfg_.num_kv_heads, D = cfg_.head_dim;
    const uint32_t n_rep = H / Hkv;
    const SelectionPlan &plan = it.plan;
    if (need_scores) {
      const uint32_t n = plan.candidates;
      for (uint32_t j = 0; j < n; ++j) {
        double acc = 0.0;
        for (uint32_t r = 0; r < n_rep; ++r)
          acc += src.scores[uint64_t(kvh * n_rep + r) * src.score_stride + j];
        ws.scores[j] = static_cast<float>(acc);
      }
      const float *scores = ws.scores.data();
      if (cfg_.score_mode == MINIKV_SCORE_WINDOW && cfg_.pool_kernel > 1) {
        // Pool over the scored prefix, then select among the candidates (a sub-range).
        for (uint32_t j = n; j < plan.scored_prefix; ++j) {
          double acc = 0.0;
          for (uint32_t r = 0; r < n_rep; ++r)
            acc += src.scores[uint64_t(kvh * n_rep + r) * src.score_stride + j];
          ws.scores[j] = static_cast<float>(acc);
        }
        max_pool_1d(ws.scores.data(), ws.pooled.data(), plan.scored_prefix, cfg_.pool_kernel);
        scores = ws.pooled.data();
      }
      select_kept(plan, scores, ws.kept.data(), ws.order.data());
    } else {
      select_kept(plan, nullptr, ws.kept.data(), ws.order.data());
    }

    // Gather the kept rows (ascending positions) as float.
    const uint32_t n_keep = plan.n_keep;
    for (uint32_t t = 0; t < n_keep; ++t) {
      const uint64_t at = (uint64_t(src.row0 + ws.kept[t]) * Hkv + kvh) * D;
      cpu::to_floats(src.k + at, D, ws.k.data() + uint64_t(t) * D);
      cpu::to_floats(src.v + at, D, ws.v.data() + uint64_t(t) * D);
    }
    // Cache order: sinks [0, sinks), blocks, residual.
    const uint32_t sinks = it.dst.sinks, first_residual = sinks + it.dst.quantized;
    uint8_t *slot = residual_slot(it.dst.residual_slot);
    for (uint32_t t = 0; t < sinks; ++t) {
      cpu::from_floats(ws.k.data() + uint64_t(t) * D, D, sink_row<T>(slot, rl_.sink_k, kvh, t));
      cpu::from_floats(ws.v.data() + uint64_t(t) * D, D, sink_row<T>(slot, rl_.sink_v, kvh, t));
    }
    store_tokens<T>(it.dst, kvh, 0, it.dst.quantized, ws.k.data() + uint64_t(sinks) * D,
                    ws.v.data() + uint64_t(sinks) * D, ws.kept.data() + sinks);
    for (uint32_t t = first_residual; t < n_keep; ++t) {
      const uint32_t row = t - first_residual;
      cpu::from_floats(ws.k.data() + uint64_t(t) * D, D, residual_row<T>(slot, rl_.k, kvh, row));
      cpu::from_floats(ws.v.data() + uint64_t(t) * D, D, residual_row<T>(slot, rl_.v, kvh, row));
      residual_positions(slot, kvh)[row] = ws.kept[t];
    }
  }

  // ---- storage ----------------------------------------------------------------------
  // Writes n tokens (n a multiple of G) of one KV head, float rows [n][D], as cached tokens
  // [first, first + n) of `dst` (first a multiple of G): codes + scales, or 16-bit values.
  template <typename T>
  void store_tokens(const CacheView &dst, uint32_t head, uint32_t first, uint32_t n,
                    const float *k_rows, const float *v_rows, const int32_t *positions) {
    const uint32_t D = cfg_.head_dim, G = cfg_.group_size, R = bl_.tokens;
    const uint32_t kb = cfg_.key_bits, vb = cfg_.value_bits;
    for (uint32_t g0 = 0; g0 < n; g0 += G) {
      const uint32_t t0 = first + g0;  // cached-token index of the group's first token
      uint8_t *block = block_ptr(dst.blocks[t0 / R]);
      const uint32_t row0 = t0 % R;
      int32_t *pos = reinterpret_cast<int32_t *>(block + bl_.positions + head * bl_.positions_head());
      for (uint32_t t = 0; t < G; ++t) pos[row0 + t] = positions[g0 + t];

      uint8_t *k_codes = block + bl_.k_codes + head * bl_.k_codes_head();
      if (kb == 16) {
        for (uint32_t t = 0; t < G; ++t) {
          T *row = reinterpret_cast<T *>(k_codes + (row0 + t) * bl_.k_row_bytes);
          for (uint32_t c = 0; c < D; ++c) row[c] = from_float<T>(k_rows[uint64_t(g0 + t) * D + c]);
        }
      } else {
        // Keys: per channel, over the G tokens of the group.
        T *scale = reinterpret_cast<T *>(block + bl_.k_scale + head * bl_.k_scale_head()) + (row0 / G) * D;
        T *minimum = reinterpret_cast<T *>(block + bl_.k_min + head * bl_.k_scale_head()) + (row0 / G) * D;
        for (uint32_t t = 0; t < G; ++t) std::memset(k_codes + (row0 + t) * bl_.k_row_bytes, 0, bl_.k_row_bytes);
        for (uint32_t c = 0; c < D; ++c) {
          float mn = INFINITY, mx = -INFINITY;
          for (uint32_t t = 0; t < G; ++t) {
            const float x = k_rows[uint64_t(g0 + t) * D + c];
            mn = std::min(mn, x);
            mx = std::max(mx, x);
          }
          const T scale_t = from_float<T>(group_scale(mn, mx, quant_levels(kb)));
          const T min_t = from_float<T>(mn);
          scale[c] = scale_t;
          minimum[c] = min_t;
          for (uint32_t t = 0; t < G; ++t) {
            const uint32_t code = quantize_code(k_rows[uint64_t(g0 + t) * D + c], to_float(min_t),
                                                to_float(scale_t), quant_levels(kb));
            pack_code(k_codes + (row0 + t) * bl_.k_row_bytes, c, code, kb);
          }
        }
      }

      uint8_t *v_codes = block + bl_.v_codes + head * bl_.v_codes_head();
      for (uint32_t t = 0; t < G; ++t) {
        const float *x = v_rows + uint64_t(g0 + t) * D;
        uint8_t *row = v_codes + (row0 + t) * bl_.v_row_bytes;
        if (vb == 16) {
          for (uint32_t c = 0; c < D; ++c) reinterpret_cast<T *>(row)[c] = from_float<T>(x[c]);
          continue;
        }
        // Values: per token, over G consecutive channels.
        std::memset(row, 0, bl_.v_row_bytes);
        const uint32_t groups = D / G;
        T *scale = reinterpret_cast<T *>(block + bl_.v_scale + head * bl_.v_scale_head()) + (row0 + t) * groups;
        T *minimum = reinterpret_cast<T *>(block + bl_.v_min + head * bl_.v_scale_head()) + (row0 + t) * groups;
        for (uint32_t g = 0; g < groups; ++g) {
          const float *xg = x + g * G;
          const float mn = *std::min_element(xg, xg + G), mx = *std::max_element(xg, xg + G);
          const T scale_t = from_float<T>(group_scale(mn, mx, quant_levels(vb)));
          const T min_t = from_float<T>(mn);
          scale[g] = scale_t;
          minimum[g] = min_t;
          for (uint32_t c = 0; c < G; ++c)
            pack_code(row, g * G + c, quantize_code(xg[c], to_float(min_t), to_float(scale_t), quant_levels(vb)), vb);
        }
      }
    }
  }

  static void pack_code(uint8_t *row, uint32_t i, uint32_t code, uint32_t bits) {
    uint32_t *words = reinterpret_cast<uint32_t *>(row);
    const uint32_t per_word = 32u / bits;
    words[i / per_word] |= code << ((i % per_word) * bits);
  }

  // Quantizes the oldest F tokens of one head's full residual (R tokens) into the blocks
  // after `quantized` and moves the other R - F to the front of the residual.
  template <typename T>
  void flush_residual(const CacheView &dst, uint32_t head, Scratch &ws) {
    const uint32_t R = rl_.tokens, F = spec_.flush_tokens, D = cfg_.head_dim;
    uint8_t *slot = residual_slot(dst.residual_slot);
    T *k_res = residual_row<T>(slot, rl_.k, head, 0);
    T *v_res = residual_row<T>(slot, rl_.v, head, 0);
    int32_t *positions = residual_positions(slot, head);
    cpu::to_floats(k_res, uint64_t(F) * D, ws.k.data());
    cpu::to_floats(v_res, uint64_t(F) * D, ws.v.data());
    store_tokens<T>(dst, head, dst.quantized, F, ws.k.data(), ws.v.data(), positions);
    std::memmove(k_res, k_res + uint64_t(F) * D, uint64_t(R - F) * D * sizeof(T));
    std::memmove(v_res, v_res + uint64_t(F) * D, uint64_t(R - F) * D * sizeof(T));
    std::memmove(positions, positions + F, uint64_t(R - F) * sizeof(int32_t));
  }

  // ---- decode -----------------------------------------------------------------------
  // Online softmax of the n_rep query heads of KV head `kvh` over one part of the cache
  // (kMaxDecodeParts), in cache order: the 16-bit sinks, the quantized tokens in tiles of at
  // most decode_tile() tokens inside a block (codes decoded on the fly by the SIMD kernels:
  // no dequantized copy of the cache), the 16-bit residual.
  // The parts and tiles fix where the running maximum is updated: the result depends on the
  // configuration and the data only (src/cpu/simd_kernels.h gives each kernel's order).
  uint32_t decode_tile() const { return std::min<uint32_t>(bl_.tokens, 128); }
  // Rows of the 16-bit regions (sinks, residual) folded at once.
  uint32_t dense_chunk() const { return std::max(decode_tile(), rl_.tokens); }

  // Carves the per-thread decode scratch; with base == nullptr it only counts floats.
  struct DecodeScratch {
    float *q, *qs, *bias, *acc, *logits, *m, *l, *l_old, *correction, *k_scale, *k_min, *v_scale,
        *v_min;
    uint64_t ld;  // logits row stride: the tile, rounded up to 16 (softmax_update reads it)
    uint64_t floats;
  };
  DecodeScratch decode_scratch(float *base) const {
    const uint64_t D = cfg_.head_dim, G = cfg_.group_size, n_rep = cfg_.num_heads / cfg_.num_kv_heads;
    const uint64_t tile = dense_chunk();
    DecodeScratch d{};
    d.ld = align_up(tile, 16);
    uint64_t at = 0;
    auto take = [&](uint64_t n) { float *p = base ? base + at : nullptr; at += align_up(n, 16); return p; };
    d.q = take(n_rep * D);
    d.qs = take(tile / G * n_rep * D);
    d.bias = take(tile / G * n_rep);
    d.acc = take(n_rep * D);
    d.logits = take(n_rep * d.ld);
    d.m = take(n_rep);
    d.l = take(n_rep);
    d.l_old = take(n_rep);
    d.correction = take(n_rep);
    d.k_scale = take(tile / G * D);
    d.k_min = take(tile / G * D);
    d.v_scale = take(tile * (D / G));
    d.v_min = take(tile * (D / G));
    d.floats = at;
    return d;
  }

  uint32_t decode_parts(const CacheView &view) const {
    const uint32_t blocks = static_cast<uint32_t>(ceil_div(view.quantized, bl_.tokens));
    return std::max(1u, std::min({view.quantized / kMinPartTokens, blocks, kMaxDecodeParts}));
  }
  // A part's softmax state in decode_states_: running max and sum per head, then the mean of
  // the values so far [n_rep][D].
  uint64_t part_state_floats() const {
    const uint64_t n_rep = cfg_.num_heads / cfg_.num_kv_heads;
    return align_up(2 * n_rep, 16) + n_rep * cfg_.head_dim;
  }

  template <typename T>
  void decode_part(const CacheView &view, uint32_t kvh, const T *q_in, T *out, uint32_t part,
                   uint32_t parts, uint64_t group, Scratch &ws) {
    const uint32_t D = cfg_.head_dim, G = cfg_.group_size, R = bl_.tokens;
    const uint32_t kb = cfg_.key_bits, vb = cfg_.value_bits;
    const uint32_t n_rep = cfg_.num_heads / cfg_.num_kv_heads;
    const float scale = 1.0f / std::sqrt(static_cast<float>(D));
    const DecodeScratch d = decode_scratch(ws.dec.data());
    cpu::to_floats(q_in, uint64_t(n_rep) * D, d.q);
    std::fill(d.acc, d.acc + uint64_t(n_rep) * D, 0.0f);
    std::fill(d.m, d.m + n_rep, -INFINITY);
    std::fill(d.l, d.l + n_rep, 0.0f);
    // d.logits[r][0, n) hold the tile's logits: fold them into the running softmax, which
    // leaves the weights p / l in d.logits for the value pass. d.acc holds the weighted mean
    // of the values so far (weights summing to 1), not their sum: it stays within the
    // values' range, where a sum of values near the dtype's maximum overflows although the
    // output (as prefill's) is finite.
    auto fold = [&](uint32_t n) {
      std::copy(d.l, d.l + n_rep, d.l_old);
      cpu::softmax_update(d.logits, n_rep, d.ld, n, d.m, d.l, d.correction);
      for (uint32_t r = 0; r < n_rep; ++r) {
        const float inv = 1.0f / d.l[r];
        d.correction[r] *= d.l_old[r] * inv;  // the previous mean's share
        d.l_old[r] = inv;
      }
      cpu::scale_rows(d.acc, n_rep, D, d.correction);
      cpu::scale_rows(d.logits, n_rep, static_cast<uint32_t>(d.ld), d.l_old);
    };

    // Unquantized rows k_rows/v_rows [n][D] (sinks, residual), in chunks that fit the
    // logits buffer.
    auto attend_dense = [&](const T *k_rows, const T *v_rows, uint32_t n) {
      const uint32_t chunk = dense_chunk();
      for (uint32_t t0 = 0; t0 < n; t0 += chunk) {
        const uint32_t count = std::min(chunk, n - t0);
        cpu::dot_rows(d.q, n_rep, D, cpu::as_floats(k_rows + uint64_t(t0) * D, uint64_t(count) * D, ws.k.data()),
                      D, count, scale, d.logits, d.ld);
        fold(count);
        cpu::value_accumulate_rows(d.logits, n_rep, d.ld, count,
                                   cpu::as_floats(v_rows + uint64_t(t0) * D, uint64_t(count) * D, ws.v.data()),
                                   D, D, d.acc);
      }
    };
    uint8_t *slot = residual_slot(view.residual_slot);
    if (part == 0)
      attend_dense(sink_row<T>(slot, rl_.sink_k, kvh, 0), sink_row<T>(slot, rl_.sink_v, kvh, 0),
                   view.sinks);

    const uint32_t tile = decode_tile();
    const uint64_t blocks = ceil_div(view.quantized, R);
    const uint32_t begin = static_cast<uint32_t>(blocks * part / parts * R);
    const uint32_t end = static_cast<uint32_t>(std::min<uint64_t>(blocks * (part + 1) / parts * R, view.quantized));
    for (uint32_t t0 = begin, n = 0; t0 < end; t0 += n) {
      const uint32_t row0 = t0 % R;
      // A tile ends at its block's end: 128 need not divide R (e.g. R = 192). n is a
      // multiple of G (G divides R and 128, or G = 128).
      n = std::min({tile, R - row0, end - t0});
      const uint8_t *block = block_ptr(view.blocks[t0 / R]);
      const uint8_t *k_codes = block + bl_.k_codes + kvh * bl_.k_codes_head() + row0 * bl_.k_row_bytes;
      if (kb == 16) {
        const float *rows = cpu::as_floats(reinterpret_cast<const T *>(k_codes), uint64_t(n) * D, ws.k.data());
        cpu::dot_rows(d.q, n_rep, D, rows, D, n, scale, d.logits, d.ld);
      } else {
        // q · (code * s + m) = (q * s) · code + q · m, with (s, m) shared by a key group.
        const T *ks = reinterpret_cast<const T *>(block + bl_.k_scale + kvh * bl_.k_scale_head()) + (row0 / G) * D;
        const T *km = reinterpret_cast<const T *>(block + bl_.k_min + kvh * bl_.k_scale_head()) + (row0 / G) * D;
        const uint32_t groups = n / G;
        cpu::scale_channels(d.q, n_rep, D, cpu::as_floats(ks, uint64_t(groups) * D, d.k_scale), groups, d.qs);
        cpu::dot_rows(d.q, n_rep, D, cpu::as_floats(km, uint64_t(groups) * D, d.k_min), D, groups, 1.0f,
                      d.bias, groups);
        cpu::key_logits_codes(d.qs, d.bias, n_rep, D, reinterpret_cast<const uint32_t *>(k_codes),
                              bl_.k_row_bytes / 4, kb, G, n, scale, d.logits, d.ld);
      }
      fold(n);
      const uint8_t *v_codes = block + bl_.v_codes + kvh * bl_.v_codes_head() + row0 * bl_.v_row_bytes;
      if (vb == 16) {
        const float *rows = cpu::as_floats(reinterpret_cast<const T *>(v_codes), uint64_t(n) * D, ws.v.data());
        cpu::value_accumulate_rows(d.logits, n_rep, d.ld, n, rows, D, D, d.acc);
      } else {
        const uint64_t first = uint64_t(row0) * (D / G);  // (scale, min) pairs of the tile
        const T *vs = reinterpret_cast<const T *>(block + bl_.v_scale + kvh * bl_.v_scale_head()) + first;
        const T *vm = reinterpret_cast<const T *>(block + bl_.v_min + kvh * bl_.v_scale_head()) + first;
        cpu::value_accumulate_codes(d.logits, n_rep, d.ld, n, reinterpret_cast<const uint32_t *>(v_codes),
                                    bl_.v_row_bytes / 4, vb, cpu::as_floats(vs, uint64_t(n) * (D / G), d.v_scale),
                                    cpu::as_floats(vm, uint64_t(n) * (D / G), d.v_min), G, D,
                                    finite_max<T>(), d.acc);
      }
    }

    if (part == parts - 1)
      attend_dense(residual_row<T>(slot, rl_.k, kvh, 0), residual_row<T>(slot, rl_.v, kvh, 0),
                   view.residual);
    if (parts > 1) {
      float *state = decode_states_.data() + (group * max_parts_ + part) * part_state_floats();
      std::copy(d.m, d.m + n_rep, state);
      std::copy(d.l, d.l + n_rep, state + n_rep);
      std::copy(d.acc, d.acc + uint64_t(n_rep) * D, state + align_up(2 * n_rep, 16));
      // The other parts' states are visible to the thread that counts the last one.
      if (parts_done_[group].fetch_add(1, std::memory_order_acq_rel) != parts - 1) return;
      merge_parts(group, parts, d);
    }
    // A mean of values within the dtype's range is within it too, up to the rounding of
    // the weights: keep that rounding from overflowing the conversion.
    for (uint64_t i = 0; i < uint64_t(n_rep) * D; ++i) d.acc[i] = clamp_finite<T>(d.acc[i]);
    cpu::from_floats(d.acc, uint64_t(n_rep) * D, out);
  }

  // The softmax states of a group's parts merged in part order into d.m, d.l, d.acc: the
  // state (m, l, mean) takes part b's (m_b, l_b, mean_b) as m' = max(m, m_b),
  // w = l exp(m - m'), w_b = l_b exp(m_b - m'), l' = w + w_b, mean' = mean w / l' + mean_b w_b / l'.
  void merge_parts(uint64_t group, uint32_t parts, const DecodeScratch &d) {
    const uint32_t D = cfg_.head_dim, n_rep = cfg_.num_heads / cfg_.num_kv_heads;
    const uint64_t values = align_up(2 * n_rep, 16);
    const float *state = decode_states_.data() + group * max_parts_ * part_state_floats();
    std::copy(state, state + n_rep, d.m);
    std::copy(state + n_rep, state + 2 * n_rep, d.l);
    std::copy(state + values, state + values + uint64_t(n_rep) * D, d.acc);
    for (uint32_t b = 1; b < parts; ++b) {
      state += part_state_floats();
      // exp(m - m') into d.correction, exp(m_b - m') into d.logits[r][0] (the kernels' exp).
      for (uint32_t r = 0; r < n_rep; ++r) d.logits[r * d.ld] = state[r];
      std::copy(d.l, d.l + n_rep, d.l_old);
      cpu::softmax_update(d.logits, n_rep, d.ld, 1, d.m, d.l, d.correction);
      for (uint32_t r = 0; r < n_rep; ++r) {
        const float w = d.l_old[r] * d.correction[r], w_b = state[n_rep + r] * d.logits[r * d.ld];
        d.l[r] = w + w_b;
        const float share = w / d.l[r], share_b = w_b / d.l[r];
        float *acc = d.acc + uint64_t(r) * D;
        const float *mean_b = state + values + uint64_t(r) * D;
        for (uint32_t c = 0; c < D; ++c) acc[c] = acc[c] * share + mean_b[c] * share_b;
      }
    }
  }

  StorageSpec spec_;
  minikv_config cfg_;
  BlockLayout bl_;
  ResidualLayout rl_;
  uint32_t max_parts_;  // decode parts of the longest sequence (max_decode_parts)
  HostBuffer pool_, residual_;
  HostBuffer staging_;        // [num_layers][K, V][prefill_staging_tokens][Hkv][D] of T
  HostBuffer staged_scores_;  // [num_layers][num_heads][prefill_staging_tokens] double
  cpu::ThreadPool pool_threads_;
  std::vector<Scratch> scratch_;
  std::vector<double> head_scores_;  // [num_heads][max_seq_len] column sums of one sequence
  // Decode: [max_sequences * num_kv_heads][max_parts_] part states (when a sequence can have
  // several), and per group the parts finished in this call.
  std::vector<float> decode_states_;
  std::unique_ptr<std::atomic<uint32_t>[]> parts_done_;
  uint64_t workspace_bytes_ = 0;
  uint64_t prefill_passes_ = 0;  // attention passes of prefill so far (Scratch::panels_pass)
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const StorageSpec &spec) {
  return std::make_unique<CpuBackend>(spec);
}

}  // namespace minikv
