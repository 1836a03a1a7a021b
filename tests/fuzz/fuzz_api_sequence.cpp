// Fuzz target: the input is decoded into a small CPU-backend configuration and a sequence
// of C API calls with random, often invalid, arguments (sequence ids, layers, lengths,
// cu_seqlens, NULL pointers, streams, release and reuse of slots, a tight block pool,
// prompts in chunks that may be abandoned, a tight staging area).
// A shadow model of every (sequence, layer) predicts the status of each call, and after
// each call the harness checks:
//   1. the status is the one the contract in minikv.h predicts (any of them when a call
//      has several faults) — so also only documented statuses;
//   2. memory statistics are consistent: used <= pool, tokens_cached <= tokens_seen, the
//      sums of minikv_sequence_length equal the stats, fp16_equivalent and the
//      compression ratio follow their definitions, pool and workspace never change;
//   3. a FAILED call changed nothing: every live sequence's decode output (bit for bit),
//      its lengths, kept positions and the stats are as before, and the thread and handle
//      error messages both hold the (non-empty) detail;
//   4. a SUCCESSFUL call changed only the (sequence, layer) pairs it names (catches block
//      pool aliasing), and lengths and kept positions match the selection plan;
//   5. a batched decode equals the same sequences decoded one by one, bit for bit;
//   6. no crash, no sanitizer report (ASan+UBSan in scripts/reliability.sh).
// White-box only for the prediction: the library's own budget plan (policy.h) tells how
// many tokens a prompt keeps, hence how many pool blocks a prefill takes.
//
// Build: libFuzzer (clang -fsanitize=fuzzer) or the plain replay driver (replay_main.cpp).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "dtype.h"
#include "fuzz_input.h"
#include "minikv.h"
#include "policy.h"

namespace {

constexpr uint32_t kMaxOps = 48;
constexpr uint32_t kMaxSteps = 64;  // appends+decodes of one "generate" op

using StatusSet = uint32_t;
constexpr StatusSet bit(minikv_status s) { return 1u << static_cast<unsigned>(s); }

std::string set_names(StatusSet set) {
  std::string s;
  for (unsigned i = 0; i < 32; ++i)
    if (set & (1u << i)) s += std::string(s.empty() ? "" : " | ") + minikv_status_string(static_cast<minikv_status>(i));
  return s.empty() ? "(none)" : s;
}

// The shadow state of one (sequence, layer), as the contract describes it.
struct Pair {
  bool prefilled = false;
  uint32_t prompt_len = 0, generated = 0;
  uint32_t n_keep = 0;     // prompt tokens kept (the selection plan)
  uint32_t sinks = 0;      // of those, the 16-bit sinks (positions 0..sinks-1)
  uint32_t quantized = 0;  // tokens in pool blocks (a multiple of group_size)
  uint32_t residual = 0;   // tokens in the 16-bit residual (< residual_length)
  // Mid-prompt (minikv_prefill_chunk): the whole prompt's length (0: not mid-prompt), the
  // positions received, the first staging row and the pool blocks reserved for the prompt.
  uint32_t pending_len = 0, received = 0, staging_begin = 0, reserved = 0;
  uint64_t seen() const { return uint64_t(prompt_len) + generated; }
  uint64_t cached() const { return uint64_t(sinks) + quantized + residual; }
};

// Everything observable about the cache, for "nothing changed" comparisons.
struct Snapshot {
  minikv_memory_stats stats{};
  std::vector<uint64_t> seen, cached;           // [pair]
  std::vector<std::vector<uint8_t>> decoded;     // [pair] decode output bytes, empty if none
  std::vector<std::vector<int32_t>> kept;        // [pair * Hkv + head]
};

class Harness {
 public:
  Harness(const minikv_config &cfg, bool extreme, uint64_t seed)
      : cfg_(cfg), extreme_(extreme), seed_(seed) {
    L_ = cfg.num_layers;
    S_ = cfg.max_sequences;
    H_ = cfg.num_heads;
    Hkv_ = cfg.num_kv_heads;
    D_ = cfg.head_dim;
    G_ = cfg.group_size;
    R_ = cfg.residual_length;
    // minikv.h: 0 is the whole residual; other values round up to whole groups, at most R.
    F_ = cfg.flush_tokens == 0 ? R_ : uint32_t(std::min<uint64_t>(R_, (uint64_t(cfg.flush_tokens) + G_ - 1) / G_ * G_));
    esize_ = cfg.dtype == MINIKV_DTYPE_F32 ? 4 : 2;
    const uint64_t per_slot = (uint64_t(cfg.max_seq_len) + R_ - 1) / R_;
    num_blocks_ = cfg.max_tokens == 0 ? uint64_t(S_) * L_ * per_slot
                                      : (cfg.max_tokens + R_ - 1) / R_;
    ratios_ = minikv::layer_heavy_ratios(cfg);
    pairs_.resize(size_t(S_) * L_);
    staged_.assign(size_t(L_) * cfg.prefill_staging_tokens, false);
    const minikv_status st = minikv_cache_create(&cfg_, &cache_);
    FUZZ_CHECK(st == MINIKV_OK && cache_ != nullptr,
               "a valid configuration must create: %s (%s)", minikv_status_string(st),
               minikv_last_error_message());
    minikv_memory_stats ms{};
    ms.struct_size = sizeof(ms);
    FUZZ_CHECK(minikv_memory_stats_get(cache_, &ms) == MINIKV_OK, "stats: %s",
               minikv_last_error_message());
    pool_bytes_ = ms.pool_bytes;
    workspace_bytes_ = ms.workspace_bytes;
    FUZZ_CHECK(ms.pool_bytes > 0 && ms.used_bytes == 0 && ms.tokens_seen == 0 &&
                   ms.tokens_cached == 0 && ms.compression_ratio == 0.0,
               "fresh cache stats: pool %llu used %llu seen %llu cached %llu",
               (unsigned long long)ms.pool_bytes, (unsigned long long)ms.used_bytes,
               (unsigned long long)ms.tokens_seen, (unsigned long long)ms.tokens_cached);
  }
  ~Harness() { minikv_cache_destroy(cache_); }
  Harness(const Harness &) = delete;
  Harness &operator=(const Harness &) = delete;

  void run(fuzz::Input &in) {
    for (uint32_t op = 0; op < kMaxOps && !in.empty(); ++op) {
      op_ = op;
      switch (in.u8() % 10) {
        case 0:
        case 1: op_prefill(in); break;
        case 2: op_append(in); break;
        case 3: op_decode(in); break;
        case 4: op_release(in); break;
        case 5: op_query(in); break;
        case 6: op_null_handle(in); break;
        case 7: op_prefill_all_layers(in); break;
        case 8: op_generate(in, 1 + in.below(kMaxSteps)); break;
        default: op_prefill_chunk(in); break;
      }
      check_invariants();
    }
  }

 private:
  Pair &pair(uint32_t seq, uint32_t layer) { return pairs_[size_t(seq) * L_ + layer]; }
  size_t pair_index(uint32_t seq, uint32_t layer) const { return size_t(seq) * L_ + layer; }

  // Prompt tokens that go to pool blocks: the kept ones after the sinks, whole groups.
  uint32_t quantized_of(const minikv::SelectionPlan &plan) const {
    const uint32_t rest = plan.n_keep - plan.n_sink;
    return rest - rest % G_;
  }

  uint64_t used_blocks() const {
    uint64_t n = 0;
    for (const Pair &p : pairs_) n += (p.quantized + R_ - 1) / R_ + p.reserved;
    return n;
  }
  uint64_t free_blocks() const { return num_blocks_ - used_blocks(); }

  // ---- tensor data ----------------------------------------------------------------------
  // `special`: in extreme mode, mix in non-finite and out-of-range values.
  void fill(std::vector<uint8_t> &buf, uint64_t elems, uint64_t seed, bool special = true) {
    buf.assign(std::max<uint64_t>(elems, 1) * esize_, 0);
    fuzz::Rng rng(seed ^ seed_);
    static const float kSpecial[] = {INFINITY, -INFINITY, NAN, 65504.0f, -1e30f, 3e38f,
                                     -0.0f, 1e-40f, 6e-8f};
    for (uint64_t i = 0; i < elems; ++i) {
      float x = 4.0f * rng.uniform();
      if (special && extreme_ && rng.next() % 16 == 0) x = kSpecial[rng.next() % (sizeof(kSpecial) / 4)];
      store(buf.data(), i, x);
    }
  }
  void store(uint8_t *p, uint64_t i, float x) const {
    switch (cfg_.dtype) {
      case MINIKV_DTYPE_F32: std::memcpy(p + 4 * i, &x, 4); break;
      case MINIKV_DTYPE_F16: {
        const uint16_t h = minikv::float_to_half_bits(x);
        std::memcpy(p + 2 * i, &h, 2);
        break;
      }
      default: {
        const uint16_t h = minikv::float_to_bf16_bits(x);
        std::memcpy(p + 2 * i, &h, 2);
      }
    }
  }
  float load(const uint8_t *p, uint64_t i) const {
    uint16_t h;
    switch (cfg_.dtype) {
      case MINIKV_DTYPE_F32: {
        float f;
        std::memcpy(&f, p + 4 * i, 4);
        return f;
      }
      case MINIKV_DTYPE_F16: std::memcpy(&h, p + 2 * i, 2); return minikv::half_bits_to_float(h);
      default: std::memcpy(&h, p + 2 * i, 2); return minikv::bf16_bits_to_float(h);
    }
  }
  // minikv.h: the CPU backend rejects non-finite inputs (INVALID_ARGUMENT, nothing changed).
  bool all_finite(const std::vector<uint8_t> &buf, uint64_t elems) const {
    for (uint64_t i = 0; i < elems; ++i)
      if (!std::isfinite(load(buf.data(), i))) return false;
    return true;
  }
  void check_finite(const std::vector<uint8_t> &buf, uint64_t elems, const char *what) const {
    if (extreme_) return;  // inputs had Inf/NaN: only "no crash, no UB" applies
    for (uint64_t i = 0; i < elems; ++i)
      FUZZ_CHECK(std::isfinite(load(buf.data(), i)), "op %u: %s[%llu] is not finite for finite inputs",
                 op_, what, (unsigned long long)i);
  }

  // ---- argument generation ------------------------------------------------------------------
  // n distinct valid ids, preferring (when `live_layer` >= 0) sequences prefilled in it.
  std::vector<uint32_t> pick_ids(fuzz::Input &in, uint32_t n, int64_t live_layer) {
    std::vector<uint32_t> order(S_);
    for (uint32_t i = 0; i < S_; ++i) order[i] = i;
    for (uint32_t i = S_; i > 1; --i) std::swap(order[i - 1], order[in.below(i)]);
    if (live_layer >= 0 && in.u8() % 4 != 0) {
      std::stable_partition(order.begin(), order.end(), [&](uint32_t s) {
        return pair(s, static_cast<uint32_t>(live_layer)).prefilled;
      });
    }
    order.resize(std::min(n, S_));
    return order;
  }

  bool ids_valid(uint32_t n, const uint32_t *ids) const {
    if (n == 0 || n > S_ || ids == nullptr) return false;
    std::vector<bool> seen(S_, false);
    for (uint32_t i = 0; i < n; ++i) {
      if (ids[i] >= S_ || seen[ids[i]]) return false;
      seen[ids[i]] = true;
    }
    return true;
  }

  // Corrupts a batch (n, ids, layer) for fault kinds 1..6; returns true if it did.
  bool corrupt_batch(fuzz::Input &in, uint32_t fault, uint32_t &n, std::vector<uint32_t> &ids,
                     uint32_t &layer, bool &null_ids) {
    switch (fault) {
      case 1: n = 0; return true;
      case 2: {  // n_seqs above max_sequences: the array still has n valid-looking entries
        n = S_ + 1 + in.below(3);
        while (ids.size() < n) ids.push_back(static_cast<uint32_t>(ids.size() % S_));
        return true;
      }
      case 3:
        if (n >= 2) {
          ids[n - 1] = ids[in.below(n - 1)];
          return true;
        }
        ids[0] = S_ + in.u8();
        return true;
      case 4: ids[in.below(n)] = in.u8() % 2 ? 0xffffffffu : S_ + in.u16(); return true;
      case 5: layer = in.u8() % 2 ? 0xffffffffu : L_ + in.u8(); return true;
      case 6: null_ids = true; return true;
      default: return false;
    }
  }

  // ---- snapshots ------------------------------------------------------------------------------
  std::vector<uint8_t> probe_query(uint32_t seq, uint32_t layer) {
    std::vector<uint8_t> q;
    // Finite: the CPU backend rejects non-finite queries, and the probe must decode.
    fill(q, uint64_t(H_) * D_, 0x51ull * (seq + 1) + 0x7ull * layer, false);
    return q;
  }

  Snapshot snapshot() {
    Snapshot s;
    s.stats.struct_size = sizeof(s.stats);
    FUZZ_CHECK(minikv_memory_stats_get(cache_, &s.stats) == MINIKV_OK, "op %u: stats: %s", op_,
               minikv_last_error_message());
    s.seen.resize(pairs_.size());
    s.cached.resize(pairs_.size());
    s.decoded.resize(pairs_.size());
    s.kept.resize(pairs_.size() * Hkv_);
    for (uint32_t seq = 0; seq < S_; ++seq) {
      for (uint32_t layer = 0; layer < L_; ++layer) {
        const size_t i = pair_index(seq, layer);
        FUZZ_CHECK(minikv_sequence_length(cache_, seq, layer, &s.seen[i], &s.cached[i]) == MINIKV_OK,
                   "op %u: sequence_length(%u, %u): %s", op_, seq, layer, minikv_last_error_message());
        const Pair &p = pair(seq, layer);
        if (!p.prefilled) continue;
        for (uint32_t h = 0; h < Hkv_; ++h) {
          std::vector<int32_t> &pos = s.kept[i * Hkv_ + h];
          pos.assign(p.n_keep + 1, -7);
          uint32_t count = 0;
          FUZZ_CHECK(minikv_kept_positions(cache_, seq, layer, h, pos.data(), p.n_keep, &count) == MINIKV_OK,
                     "op %u: kept_positions(%u, %u, %u): %s", op_, seq, layer, h, minikv_last_error_message());
          FUZZ_CHECK(count == p.n_keep && pos[p.n_keep] == -7,
                     "op %u: kept_positions(%u, %u, %u): count %u (model %u) or wrote past capacity",
                     op_, seq, layer, h, count, p.n_keep);
          pos.pop_back();
        }
        if (p.cached() == 0) continue;
        const std::vector<uint8_t> q = probe_query(seq, layer);
        std::vector<uint8_t> &out = s.decoded[i];
        out.assign(size_t(H_) * D_ * esize_, 0xA5);
        const minikv_status st = minikv_decode(cache_, layer, 1, &seq, q.data(), out.data(), nullptr);
        FUZZ_CHECK(st == MINIKV_OK, "op %u: probe decode(seq %u, layer %u) with %llu cached: %s (%s)",
                   op_, seq, layer, (unsigned long long)p.cached(), minikv_status_string(st),
                   minikv_last_error_message());
        check_finite(out, uint64_t(H_) * D_, "probe decode output");
      }
    }
    // A batched decode of every decodable sequence of a layer equals the single decodes.
    for (uint32_t layer = 0; layer < L_; ++layer) {
      std::vector<uint32_t> ids;
      std::vector<uint8_t> q;
      for (uint32_t seq = 0; seq < S_; ++seq) {
        if (!pair(seq, layer).prefilled || pair(seq, layer).cached() == 0) continue;
        ids.push_back(seq);
        const std::vector<uint8_t> one = probe_query(seq, layer);
        q.insert(q.end(), one.begin(), one.end());
      }
      if (ids.size() < 2) continue;
      std::vector<uint8_t> out(q.size(), 0x5A);
      const minikv_status st = minikv_decode(cache_, layer, static_cast<uint32_t>(ids.size()),
                                             ids.data(), q.data(), out.data(), nullptr);
      FUZZ_CHECK(st == MINIKV_OK, "op %u: batched probe decode of layer %u: %s", op_, layer,
                 minikv_last_error_message());
      const size_t row = size_t(H_) * D_ * esize_;
      for (size_t k = 0; k < ids.size(); ++k)
        FUZZ_CHECK(std::memcmp(out.data() + k * row, s.decoded[pair_index(ids[k], layer)].data(), row) == 0,
                   "op %u: batched decode of layer %u differs from the single decode of seq %u",
                   op_, layer, ids[k]);
    }
    return s;
  }

  // `touched[pair]` marks pairs the call may legitimately change (successful calls).
  void compare(const Snapshot &a, const Snapshot &b, const std::vector<bool> &touched,
               const char *what) {
    for (size_t i = 0; i < pairs_.size(); ++i) {
      if (!touched.empty() && touched[i]) continue;
      const uint32_t seq = static_cast<uint32_t>(i / L_), layer = static_cast<uint32_t>(i % L_);
      FUZZ_CHECK(a.seen[i] == b.seen[i] && a.cached[i] == b.cached[i],
                 "op %u: %s changed the length of seq %u layer %u (seen %llu -> %llu, cached %llu -> %llu)",
                 op_, what, seq, layer, (unsigned long long)a.seen[i], (unsigned long long)b.seen[i],
                 (unsigned long long)a.cached[i], (unsigned long long)b.cached[i]);
      FUZZ_CHECK(a.decoded[i] == b.decoded[i],
                 "op %u: %s changed the decode output of seq %u layer %u", op_, what, seq, layer);
      for (uint32_t h = 0; h < Hkv_; ++h)
        FUZZ_CHECK(a.kept[i * Hkv_ + h] == b.kept[i * Hkv_ + h],
                   "op %u: %s changed the kept positions of seq %u layer %u head %u", op_, what, seq,
                   layer, h);
    }
    if (touched.empty()) {
      FUZZ_CHECK(std::memcmp(&a.stats, &b.stats, sizeof(a.stats)) == 0,
                 "op %u: %s changed the memory stats (used %llu -> %llu, seen %llu -> %llu)", op_, what,
                 (unsigned long long)a.stats.used_bytes, (unsigned long long)b.stats.used_bytes,
                 (unsigned long long)a.stats.tokens_seen, (unsigned long long)b.stats.tokens_seen);
    }
  }

  // Checks the status against the prediction and, for failures, the error messages and
  // that nothing changed. `faults` is the set of statuses the call's faults map to; an empty
  // set means the call is valid and must return `ok_status` (OK or CAPACITY_EXCEEDED).
  bool check_call(const char *what, minikv_status st, StatusSet faults, const Snapshot &before) {
    const StatusSet expected = faults ? faults : bit(MINIKV_OK);
    trace(what, st);
    FUZZ_CHECK(expected & bit(st), "op %u: %s returned %s, the contract predicts %s (message: %s)",
               op_, what, minikv_status_string(st), set_names(expected).c_str(),
               minikv_last_error_message());
    if (st == MINIKV_OK) return true;
    const char *thread_msg = minikv_last_error_message();
    const char *handle_msg = minikv_cache_last_error(cache_);
    FUZZ_CHECK(thread_msg && handle_msg && thread_msg[0] != '\0' && std::strcmp(thread_msg, handle_msg) == 0,
               "op %u: %s failed (%s) but the error messages are '%s' (thread) and '%s' (handle)",
               op_, what, minikv_status_string(st), thread_msg ? thread_msg : "(null)",
               handle_msg ? handle_msg : "(null)");
    const Snapshot after = snapshot();
    compare(before, after, {}, what);
    return false;
  }

  // FUZZ_TRACE=1 prints every checked call: to see what a corpus file exercises.
  void trace(const char *what, minikv_status st) const {
    static const bool on = std::getenv("FUZZ_TRACE") != nullptr;
    if (on) std::fprintf(stderr, "  op %2u %-24s -> %s\n", op_, what, minikv_status_string(st));
  }

  // ---- operations -------------------------------------------------------------------------------
  void op_prefill(fuzz::Input &in) {
    const uint8_t v = in.u8();
    const uint32_t fault = v >= 160 ? 1 + v % 14 : 0;
    uint32_t n = 1 + in.below(std::min(S_, 4u));
    uint32_t layer = in.below(L_);
    std::vector<uint32_t> ids = pick_ids(in, n, -1);
    std::vector<int64_t> lens(n);
    for (uint32_t i = 0; i < n; ++i)
      lens[i] = in.u8() % 8 == 0 ? cfg_.max_seq_len : 1 + in.below(cfg_.max_seq_len);
    const uint64_t data_seed = in.u32();
    prefill(in, fault, n, ids, layer, lens, data_seed);
  }

  void op_prefill_all_layers(fuzz::Input &in) {
    std::vector<uint32_t> ids = pick_ids(in, 1, -1);
    std::vector<int64_t> lens{1 + in.below(cfg_.max_seq_len)};
    const uint64_t data_seed = in.u32();
    for (uint32_t layer = 0; layer < L_; ++layer) {
      std::vector<uint32_t> one = ids;
      prefill(in, 0, 1, one, layer, lens, data_seed + layer);
    }
  }

  void prefill(fuzz::Input &in, uint32_t fault, uint32_t n, std::vector<uint32_t> &ids,
               uint32_t layer, std::vector<int64_t> lens, uint64_t data_seed) {
    bool null_ids = false, null_cu = false, null_tensor[4] = {false, false, false, false};
    void *stream = nullptr;
    int64_t cu0 = 0;
    if (!corrupt_batch(in, fault, n, ids, layer, null_ids)) {
      switch (fault) {
        case 7: null_cu = true; break;
        case 8: null_tensor[in.below(4)] = true; break;
        case 9: stream = reinterpret_cast<void *>(uintptr_t(0x1000)); break;
        case 10: cu0 = in.u8() % 2 ? -1 : 1 + in.below(3); break;
        case 11: lens[in.below(static_cast<uint32_t>(lens.size()))] = 0; break;
        case 12: lens[in.below(static_cast<uint32_t>(lens.size()))] = int64_t(cfg_.max_seq_len) + 1 + in.below(4); break;
        case 13: lens[in.below(static_cast<uint32_t>(lens.size()))] = in.u8() % 2 ? -5 : int64_t(INT32_MAX); break;
        default: break;
      }
    }
    // cu_seqlens: prefix sums of lens (wrapped to int32 like a careless caller's would be).
    const uint32_t n_cu = std::max<uint32_t>(n, static_cast<uint32_t>(lens.size()));
    while (lens.size() < n_cu) lens.push_back(1);
    std::vector<int32_t> cu(n_cu + 1);
    int64_t acc = cu0;
    cu[0] = static_cast<int32_t>(cu0);
    for (uint32_t i = 0; i < n_cu; ++i) {
      acc += lens[i];
      cu[i + 1] = static_cast<int32_t>(static_cast<uint32_t>(acc));
    }

    // Prediction.
    const uint32_t *ids_arg = null_ids ? nullptr : ids.data();
    const bool ids_ok = ids_valid(n, ids_arg);
    bool invalid = !ids_ok || layer >= L_ || null_cu || stream != nullptr || null_tensor[0] ||
                   null_tensor[1] || null_tensor[2] || null_tensor[3];
    if (!null_cu && n >= 1 && n <= S_) {
      if (cu[0] != 0) invalid = true;
      for (uint32_t i = 0; i < n; ++i) {
        const int64_t len = int64_t(cu[i + 1]) - cu[i];
        if (len < 1 || len > cfg_.max_seq_len) invalid = true;
      }
    }
    StatusSet faults = invalid ? bit(MINIKV_ERR_INVALID_ARGUMENT) : 0;
    bool any_prefilled = false;  // or mid-prompt: minikv_prefill takes neither
    if (ids_ok && layer < L_)
      for (uint32_t i = 0; i < n; ++i)
        any_prefilled |= pair(ids[i], layer).prefilled || pair(ids[i], layer).pending_len > 0;
    if (any_prefilled) faults |= bit(MINIKV_ERR_BAD_STATE);
    std::vector<minikv::SelectionPlan> plans;
    if (!invalid && !any_prefilled) {
      uint64_t need = 0;
      for (uint32_t i = 0; i < n; ++i) {
        plans.push_back(minikv::plan_selection(cfg_, ratios_[layer], static_cast<uint32_t>(cu[i + 1] - cu[i])));
        need += (quantized_of(plans.back()) + R_ - 1) / R_;
      }
      if (need > free_blocks()) faults |= bit(MINIKV_ERR_CAPACITY_EXCEEDED);
    }

    // Buffers: exactly the contract's size for a well-formed call, one row otherwise (a
    // rejected call must not read them; ASan reports it if it does).
    const uint64_t total = invalid ? 1 : static_cast<uint64_t>(cu[n]);
    std::vector<uint8_t> q, k, v, out;
    fill(q, total * H_ * D_, data_seed * 4 + 0);
    fill(k, total * Hkv_ * D_, data_seed * 4 + 1);
    fill(v, total * Hkv_ * D_, data_seed * 4 + 2);
    out.assign(std::max<uint64_t>(total, 1) * H_ * D_ * esize_, 0xEE);
    if (!invalid && !(all_finite(q, total * H_ * D_) && all_finite(k, total * Hkv_ * D_) &&
                      all_finite(v, total * Hkv_ * D_)))
      faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);

    const Snapshot before = snapshot();
    const minikv_status st = minikv_prefill(
        cache_, layer, n, ids_arg, null_cu ? nullptr : cu.data(), null_tensor[0] ? nullptr : q.data(),
        null_tensor[1] ? nullptr : k.data(), null_tensor[2] ? nullptr : v.data(),
        null_tensor[3] ? nullptr : out.data(), stream);
    if (!check_call("minikv_prefill", st, faults, before)) return;

    std::vector<bool> touched(pairs_.size(), false);
    for (uint32_t i = 0; i < n; ++i) {
      set_prefilled(pair(ids[i], layer), plans[i]);
      touched[pair_index(ids[i], layer)] = true;
    }
    check_finite(out, total * H_ * D_, "prefill out");
    const Snapshot after = snapshot();
    compare(before, after, touched, "a successful minikv_prefill");
    for (uint32_t i = 0; i < n; ++i) check_kept(after, ids[i], layer, plans[i]);
  }

  // The kept positions follow the plan: ascending, the sinks and the protected suffix
  // entirely, and exactly n_heavy of the candidates.
  void check_kept(const Snapshot &after, uint32_t seq, uint32_t layer,
                  const minikv::SelectionPlan &plan) {
    for (uint32_t h = 0; h < Hkv_; ++h) {
      const std::vector<int32_t> &pos = after.kept[pair_index(seq, layer) * Hkv_ + h];
      uint32_t heavy = 0;
      for (size_t t = 0; t < pos.size(); ++t) {
        FUZZ_CHECK(pos[t] >= 0 && uint32_t(pos[t]) < plan.prompt_len && (t == 0 || pos[t] > pos[t - 1]),
                   "op %u: kept positions of seq %u layer %u head %u not ascending in [0, %u)",
                   op_, seq, layer, h, plan.prompt_len);
        if (!plan.keep_all && uint32_t(pos[t]) >= plan.n_sink && uint32_t(pos[t]) < plan.candidates) ++heavy;
        FUZZ_CHECK(t >= plan.n_sink || pos[t] == int32_t(t),
                   "op %u: seq %u layer %u head %u: sink %zu at position %d", op_, seq, layer, h,
                   t, pos[t]);
      }
      const uint32_t expect_heavy = plan.keep_all ? 0 : plan.n_heavy;
      FUZZ_CHECK(heavy == expect_heavy && pos.size() == plan.n_keep,
                 "op %u: seq %u layer %u head %u kept %zu positions, %u heavy (plan: %u, %u heavy)",
                 op_, seq, layer, h, pos.size(), heavy, plan.n_keep, expect_heavy);
    }
  }

  // The pair after a successful prefill of its whole prompt (in one call or the last chunk).
  void set_prefilled(Pair &p, const minikv::SelectionPlan &plan) {
    p = Pair();
    p.prefilled = true;
    p.prompt_len = plan.prompt_len;
    p.n_keep = plan.n_keep;
    p.sinks = plan.n_sink;
    p.quantized = quantized_of(plan);
    p.residual = plan.n_keep - plan.n_sink - p.quantized;
  }

  // ---- staging model (an independent first fit over a row bitmap per layer) ------------------
  uint32_t staging_find(uint32_t layer, uint32_t n) const {
    const uint32_t cap = cfg_.prefill_staging_tokens;
    const std::vector<bool>::const_iterator rows = staged_.begin() + size_t(layer) * cap;
    for (uint32_t a = 0; a + n <= cap; ++a) {
      uint32_t r = a;
      while (r < a + n && !rows[r]) ++r;
      if (r == a + n) return a;
      a = r;  // the next candidate starts after the used row r
    }
    return UINT32_MAX;
  }
  void staging_mark(uint32_t layer, uint32_t begin, uint32_t n, bool used) {
    for (uint32_t r = begin; r < begin + n; ++r)
      staged_[size_t(layer) * cfg_.prefill_staging_tokens + r] = used;
  }
  // Frees what a pair mid-prompt holds (staging rows; its reserved blocks go with the Pair).
  void drop_pending(uint32_t seq, uint32_t layer) {
    const Pair &p = pair(seq, layer);
    if (p.pending_len > 0) staging_mark(layer, p.staging_begin, p.pending_len, false);
  }

  // minikv_prefill_chunk: the next chunk of 1-4 sequences' prompts (a new prompt, often in
  // several chunks, or the continuation of one mid-prompt), with faults of its own: a NULL
  // prompt_lens, a prompt length out of range or different from the first chunk's, a chunk
  // past the prompt.
  void op_prefill_chunk(fuzz::Input &in) {
    const uint8_t v = in.u8();
    const uint32_t fault = v >= 160 ? 1 + v % 18 : 0;
    uint32_t n = 1 + in.below(std::min(S_, 4u));
    uint32_t layer = in.below(L_);
    std::vector<uint32_t> ids = pick_ids(in, n, -1);
    bool null_ids = false, null_cu = false, null_lens = false, null_tensor[4] = {false, false, false, false};
    void *stream = nullptr;
    const bool corrupted = corrupt_batch(in, fault, n, ids, layer, null_ids);
    // Lengths: continue a prompt mid-way, else a new one, usually cut short.
    std::vector<int64_t> lens(n, 1);
    std::vector<uint32_t> prompt_lens(n, 1);
    const uint32_t valid_n = std::min<uint32_t>(n, static_cast<uint32_t>(ids.size()));
    for (uint32_t i = 0; i < valid_n; ++i) {
      const Pair *p = ids[i] < S_ && layer < L_ ? &pair(ids[i], layer) : nullptr;
      if (p && p->pending_len > 0) {
        prompt_lens[i] = p->pending_len;
        lens[i] = 1 + in.below(p->pending_len - p->received);
      } else {
        prompt_lens[i] = 1 + in.below(cfg_.max_seq_len);
        lens[i] = in.u8() % 4 == 0 ? prompt_lens[i] : 1 + in.below(prompt_lens[i]);
      }
    }
    if (!corrupted && fault >= 7) {
      const uint32_t at = in.below(n);  // the sequence a fault of its own applies to
      switch (fault) {
        case 7: null_cu = true; break;
        case 8: null_tensor[in.below(4)] = true; break;
        case 9: stream = reinterpret_cast<void *>(uintptr_t(0x4000)); break;
        case 10: lens[at] = 0; break;
        case 11: lens[at] = int64_t(cfg_.max_seq_len) + 1 + in.below(4); break;
        case 12: null_lens = true; break;
        case 13: prompt_lens[at] = in.u8() % 2 ? 0 : cfg_.max_seq_len + 1 + in.below(9); break;
        case 14: prompt_lens[at] += 1 + in.below(3); break;       // differs, or past max
        case 15: lens[at] = int64_t(prompt_lens[at]) + 1; break;  // past the prompt
        default: break;
      }
    }
    std::vector<int32_t> cu(n + 1, 0);
    for (uint32_t i = 0; i < n; ++i) cu[i + 1] = static_cast<int32_t>(cu[i] + lens[i]);

    // Prediction, in the library's order: arguments, then each sequence's state.
    const uint32_t *ids_arg = null_ids ? nullptr : ids.data();
    const bool ids_ok = ids_valid(n, ids_arg);
    bool invalid = !ids_ok || layer >= L_ || null_cu || null_lens || stream != nullptr ||
                   null_tensor[0] || null_tensor[1] || null_tensor[2] || null_tensor[3];
    if (ids_ok) {
      for (uint32_t i = 0; i < n; ++i) {
        if (lens[i] < 1 || lens[i] > cfg_.max_seq_len) invalid = true;
        if (prompt_lens[i] < 1 || prompt_lens[i] > cfg_.max_seq_len) invalid = true;
      }
    }
    StatusSet faults = invalid ? bit(MINIKV_ERR_INVALID_ARGUMENT) : 0;
    const uint64_t total = invalid ? 1 : static_cast<uint64_t>(cu[n]);
    std::vector<uint8_t> q, k, vv, out;
    const uint64_t data_seed = in.u32();
    fill(q, total * H_ * D_, data_seed * 4 + 0);
    fill(k, total * Hkv_ * D_, data_seed * 4 + 1);
    fill(vv, total * Hkv_ * D_, data_seed * 4 + 2);
    out.assign(std::max<uint64_t>(total, 1) * H_ * D_ * esize_, 0xEE);
    if (!invalid && !(all_finite(q, total * H_ * D_) && all_finite(k, total * Hkv_ * D_) &&
                      all_finite(vv, total * Hkv_ * D_)))
      faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
    bool state_fault = false;
    std::vector<minikv::SelectionPlan> plans;
    if (!invalid) {
      for (uint32_t i = 0; i < n; ++i) {
        const Pair &p = pair(ids[i], layer);
        const uint32_t len = static_cast<uint32_t>(lens[i]), whole = prompt_lens[i];
        if (p.prefilled) {
          faults |= bit(MINIKV_ERR_BAD_STATE);
          state_fault = true;
        }
        const bool bad = (p.pending_len > 0 && whole != p.pending_len) ||
                         uint64_t(p.received) + len > whole ||
                         (p.pending_len == 0 && len < whole &&
                          (cfg_.prefill_staging_tokens == 0 || whole > cfg_.prefill_staging_tokens));
        if (bad && !p.prefilled) {
          faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
          state_fault = true;
        }
        plans.push_back(minikv::plan_selection(cfg_, ratios_[layer], whole));
      }
    }
    // Capacity: the blocks of prompts starting now, then their staging runs (first fit, in
    // batch order).
    if (!invalid && !state_fault) {
      uint64_t need = 0;
      for (uint32_t i = 0; i < n; ++i)
        if (pair(ids[i], layer).pending_len == 0) need += (quantized_of(plans[i]) + R_ - 1) / R_;
      bool full = need > free_blocks();
      std::vector<std::pair<uint32_t, uint32_t>> taken;
      for (uint32_t i = 0; i < n && !full; ++i) {
        if (pair(ids[i], layer).pending_len > 0 || uint32_t(lens[i]) == prompt_lens[i]) continue;
        const uint32_t at = staging_find(layer, prompt_lens[i]);
        if (at == UINT32_MAX) {
          full = true;
        } else {
          staging_mark(layer, at, prompt_lens[i], true);
          taken.emplace_back(at, prompt_lens[i]);
        }
      }
      for (const auto &t : taken) staging_mark(layer, t.first, t.second, false);
      if (full) faults |= bit(MINIKV_ERR_CAPACITY_EXCEEDED);
    }

    const Snapshot before = snapshot();
    const minikv_status st = minikv_prefill_chunk(
        cache_, layer, n, ids_arg, null_cu ? nullptr : cu.data(), null_lens ? nullptr : prompt_lens.data(),
        null_tensor[0] ? nullptr : q.data(), null_tensor[1] ? nullptr : k.data(),
        null_tensor[2] ? nullptr : vv.data(), null_tensor[3] ? nullptr : out.data(), stream);
    if (!check_call("minikv_prefill_chunk", st, faults, before)) return;

    std::vector<bool> touched(pairs_.size(), false);
    std::vector<uint32_t> finished;
    // First chunks take their staging runs while the rows of prompts this call finishes are
    // still held: the library frees those only after the call's work is done.
    for (uint32_t i = 0; i < n; ++i) {
      Pair &p = pair(ids[i], layer);
      const uint32_t whole = prompt_lens[i];
      if (p.pending_len > 0 || uint32_t(lens[i]) == whole) continue;  // not a first chunk
      p.pending_len = whole;
      p.staging_begin = staging_find(layer, whole);
      staging_mark(layer, p.staging_begin, whole, true);
      p.reserved = (quantized_of(plans[i]) + R_ - 1) / R_;
    }
    for (uint32_t i = 0; i < n; ++i) {
      Pair &p = pair(ids[i], layer);
      const uint32_t len = static_cast<uint32_t>(lens[i]), whole = prompt_lens[i];
      touched[pair_index(ids[i], layer)] = true;
      p.received += len;
      if (p.received < whole) continue;
      drop_pending(ids[i], layer);
      set_prefilled(p, plans[i]);
      finished.push_back(i);
    }
    check_finite(out, total * H_ * D_, "prefill_chunk out");
    const Snapshot after = snapshot();
    compare(before, after, touched, "a successful minikv_prefill_chunk");
    for (uint32_t i : finished) check_kept(after, ids[i], layer, plans[i]);
  }

  void op_append(fuzz::Input &in) {
    const uint8_t v = in.u8();
    const uint32_t fault = v >= 176 ? 1 + v % 10 : 0;
    const uint32_t layer = in.below(L_);
    const uint32_t n = 1 + in.below(std::min(S_, 4u));
    std::vector<uint32_t> ids = pick_ids(in, n, layer);
    append(in, fault, layer, ids, in.u32());
  }

  // Returns the status. `full_check` = false skips the "only the named pairs changed"
  // comparison of a successful call (the generation loop does it every few steps only);
  // failures are always fully checked. With `q` (and `out`, rows of the well-formed batch)
  // the call is minikv_append_decode: the same append, plus q checked before anything changes.
  minikv_status append(fuzz::Input &in, uint32_t fault, uint32_t layer, std::vector<uint32_t> ids,
                       uint64_t data_seed, bool full_check = true,
                       const std::vector<uint8_t> *q = nullptr, std::vector<uint8_t> *out = nullptr) {
    uint32_t n = static_cast<uint32_t>(ids.size());
    bool null_ids = false, null_k = false, null_v = false;
    void *stream = nullptr;
    if (!corrupt_batch(in, fault, n, ids, layer, null_ids)) {
      switch (fault) {
        case 7: null_k = true; break;
        case 8: null_v = true; break;
        case 9: stream = reinterpret_cast<void *>(uintptr_t(0x2000)); break;
        default: break;
      }
    }
    const uint32_t *ids_arg = null_ids ? nullptr : ids.data();
    const bool ids_ok = ids_valid(n, ids_arg) && layer < L_;
    StatusSet faults = 0;
    if (!ids_ok || null_k || null_v || stream) faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
    bool all_prefilled = ids_ok;
    if (ids_ok) {
      uint64_t need = 0;
      for (uint32_t i = 0; i < n; ++i) {
        const Pair &p = pair(ids[i], layer);
        if (!p.prefilled) {
          all_prefilled = false;
          continue;
        }
        if (p.seen() >= cfg_.max_seq_len) faults |= bit(MINIKV_ERR_CAPACITY_EXCEEDED);
        if (p.residual + 1 == R_) need += (p.quantized + F_ + R_ - 1) / R_ - (p.quantized + R_ - 1) / R_;
      }
      if (!all_prefilled) faults |= bit(MINIKV_ERR_BAD_STATE);
      if (all_prefilled && need > free_blocks()) faults |= bit(MINIKV_ERR_CAPACITY_EXCEEDED);
    }
    const bool well_formed = ids_ok;
    std::vector<uint8_t> k, v;
    fill(k, uint64_t(well_formed ? n : 1) * Hkv_ * D_, data_seed * 2);
    fill(v, uint64_t(well_formed ? n : 1) * Hkv_ * D_, data_seed * 2 + 1);
    if (well_formed && !(all_finite(k, uint64_t(n) * Hkv_ * D_) && all_finite(v, uint64_t(n) * Hkv_ * D_)))
      faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);

    if (q && well_formed && !all_finite(*q, uint64_t(n) * H_ * D_))
      faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);

    const char *name = q ? "minikv_append_decode" : "minikv_append";
    full_check = full_check || faults != 0;
    const Snapshot before = full_check ? snapshot() : Snapshot();
    const minikv_status st =
        q ? minikv_append_decode(cache_, layer, n, ids_arg, q->data(), null_k ? nullptr : k.data(),
                                 null_v ? nullptr : v.data(), out->data(), stream)
          : minikv_append(cache_, layer, n, ids_arg, null_k ? nullptr : k.data(),
                          null_v ? nullptr : v.data(), stream);
    if (!full_check) {
      trace(name, st);
      FUZZ_CHECK(st == MINIKV_OK, "op %u: a valid %s returned %s (%s)", op_, name,
                 minikv_status_string(st), minikv_last_error_message());
    } else if (!check_call(name, st, faults, before)) {
      return st;
    }
    std::vector<bool> touched(pairs_.size(), false);
    for (uint32_t i = 0; i < n; ++i) {
      Pair &p = pair(ids[i], layer);
      p.generated += 1;
      if (p.residual + 1 == R_) {
        p.quantized += F_;
        p.residual = R_ - F_;
      } else {
        p.residual += 1;
      }
      touched[pair_index(ids[i], layer)] = true;
    }
    if (full_check) compare(before, snapshot(), touched, q ? "a successful minikv_append_decode" : "a successful minikv_append");
    return st;
  }

  void op_decode(fuzz::Input &in) {
    const uint8_t v = in.u8();
    const uint32_t fault = v >= 176 ? 1 + v % 10 : 0;
    uint32_t layer = in.below(L_);
    uint32_t n = 1 + in.below(std::min(S_, 4u));
    std::vector<uint32_t> ids = pick_ids(in, n, layer);
    n = static_cast<uint32_t>(ids.size());
    bool null_ids = false, null_q = false, null_out = false;
    void *stream = nullptr;
    if (!corrupt_batch(in, fault, n, ids, layer, null_ids)) {
      switch (fault) {
        case 7: null_q = true; break;
        case 8: null_out = true; break;
        case 9: stream = reinterpret_cast<void *>(uintptr_t(0x3000)); break;
        default: break;
      }
    }
    const uint32_t *ids_arg = null_ids ? nullptr : ids.data();
    const bool ids_ok = ids_valid(n, ids_arg) && layer < L_;
    StatusSet faults = 0;
    if (!ids_ok || null_q || null_out || stream) faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
    if (ids_ok)
      for (uint32_t i = 0; i < n; ++i)
        if (!pair(ids[i], layer).prefilled || pair(ids[i], layer).cached() == 0)
          faults |= bit(MINIKV_ERR_BAD_STATE);
    const uint64_t rows = ids_ok ? n : 1;
    std::vector<uint8_t> q, out(rows * H_ * D_ * esize_, 0xCD);
    fill(q, rows * H_ * D_, in.u32());
    if (ids_ok && !all_finite(q, rows * H_ * D_)) faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
    const Snapshot before = snapshot();
    const minikv_status st = minikv_decode(cache_, layer, n, ids_arg, null_q ? nullptr : q.data(),
                                           null_out ? nullptr : out.data(), stream);
    if (!check_call("minikv_decode", st, faults, before)) return;
    check_finite(out, rows * H_ * D_, "decode out");
    compare(before, snapshot(), {}, "a successful minikv_decode");
  }

  void op_release(fuzz::Input &in) {
    const uint8_t v = in.u8();
    uint32_t seq = in.below(S_);
    if (v >= 200) seq = v % 2 ? 0xffffffffu : S_ + in.u16();
    const StatusSet faults = seq >= S_ ? bit(MINIKV_ERR_INVALID_ARGUMENT) : 0;
    const Snapshot before = snapshot();
    const minikv_status st = minikv_sequence_release(cache_, seq);
    if (!check_call("minikv_sequence_release", st, faults, before)) return;
    std::vector<bool> touched(pairs_.size(), false);
    for (uint32_t layer = 0; layer < L_; ++layer) {
      drop_pending(seq, layer);  // an abandoned prompt: its staging rows and reserved blocks
      pair(seq, layer) = Pair();
      touched[pair_index(seq, layer)] = true;
    }
    const Snapshot after = snapshot();
    compare(before, after, touched, "minikv_sequence_release");
    for (uint32_t layer = 0; layer < L_; ++layer) {
      const size_t i = pair_index(seq, layer);
      FUZZ_CHECK(after.seen[i] == 0 && after.cached[i] == 0,
                 "op %u: seq %u layer %u still has %llu positions after release", op_, seq, layer,
                 (unsigned long long)after.seen[i]);
    }
  }

  // Appends one token to, then decodes, every sequence prefilled in each layer, `steps`
  // times: the engine's generation loop, which fills the residual and forces flushes. Odd
  // steps take the combined call, whose output a decode right after must repeat bit for bit.
  void op_generate(fuzz::Input &in, uint32_t steps) {
    const uint64_t seed = in.u32();
    for (uint32_t step = 0; step < steps; ++step) {
      bool any = false;
      for (uint32_t layer = 0; layer < L_; ++layer) {
        std::vector<uint32_t> ids;
        for (uint32_t s = 0; s < S_; ++s)
          if (pair(s, layer).prefilled && pair(s, layer).seen() < cfg_.max_seq_len) ids.push_back(s);
        if (ids.empty()) continue;
        any = true;
        const uint32_t n = static_cast<uint32_t>(ids.size());
        std::vector<uint8_t> q, out(size_t(n) * H_ * D_ * esize_, 0);
        fill(q, uint64_t(n) * H_ * D_, seed + 31ull * step + layer);
        if (step % 2 == 1) {
          if (append(in, 0, layer, ids, seed + 977ull * step + layer, step % 8 == 1, &q, &out) != MINIKV_OK)
            continue;
          std::vector<uint8_t> again(out.size(), 0);
          const minikv_status st = minikv_decode(cache_, layer, n, ids.data(), q.data(), again.data(), nullptr);
          FUZZ_CHECK(st == MINIKV_OK && again == out,
                     "op %u: decode after minikv_append_decode: %s, output %s", op_,
                     minikv_status_string(st), again == out ? "equal" : "differs");
          check_finite(out, uint64_t(n) * H_ * D_, "append_decode out");
          continue;
        }
        if (append(in, 0, layer, ids, seed + 977ull * step + layer, step % 8 == 0) != MINIKV_OK) continue;
        const minikv_status st = minikv_decode(cache_, layer, n, ids.data(), q.data(), out.data(), nullptr);
        const minikv_status want =
            all_finite(q, uint64_t(n) * H_ * D_) ? MINIKV_OK : MINIKV_ERR_INVALID_ARGUMENT;
        FUZZ_CHECK(st == want, "op %u: decode right after a successful append: %s (%s), expected %s",
                   op_, minikv_status_string(st), minikv_last_error_message(),
                   minikv_status_string(want));
        if (st == MINIKV_OK) check_finite(out, uint64_t(n) * H_ * D_, "generation decode out");
      }
      if (!any) return;
    }
  }

  // Read-only queries with odd arguments.
  void op_query(fuzz::Input &in) {
    const uint32_t seq = in.u8() % 4 == 0 ? S_ + in.u8() : in.below(S_);
    const uint32_t layer = in.u8() % 4 == 0 ? L_ + in.u8() : in.below(L_);
    const Snapshot before = snapshot();
    switch (in.u8() % 3) {
      case 0: {
        uint64_t seen = 0xdead, cached = 0xbeef;
        const uint8_t mode = in.u8() % 4;  // which outputs are NULL
        const minikv_status st = minikv_sequence_length(cache_, seq, layer, mode & 1 ? nullptr : &seen,
                                                        mode & 2 ? nullptr : &cached);
        const bool valid = seq < S_ && layer < L_;
        if (!check_call("minikv_sequence_length", st, valid ? 0 : bit(MINIKV_ERR_INVALID_ARGUMENT), before)) return;
        const Pair &p = pair(seq, layer);
        FUZZ_CHECK((mode & 1 || seen == p.seen()) && (mode & 2 || cached == p.cached()),
                   "op %u: sequence_length(%u, %u) = (%llu, %llu), model (%llu, %llu)", op_, seq, layer,
                   (unsigned long long)seen, (unsigned long long)cached, (unsigned long long)p.seen(),
                   (unsigned long long)p.cached());
        break;
      }
      case 1: {
        const uint32_t head = in.u8() % 4 == 0 ? Hkv_ + in.u8() : in.below(Hkv_);
        const uint32_t capacity = in.below(std::max<uint32_t>(cfg_.max_seq_len, 1) + 4);
        const uint8_t mode = in.u8() % 8;
        std::vector<int32_t> pos(capacity + 8, -3);
        uint32_t count = 0xffffffffu;
        const bool null_positions = mode == 1 || (mode == 2 && capacity == 0);
        const bool null_count = mode == 3;
        const minikv_status st = minikv_kept_positions(cache_, seq, layer, head,
                                                       null_positions ? nullptr : pos.data(), capacity,
                                                       null_count ? nullptr : &count);
        StatusSet faults = 0;
        if (seq >= S_ || layer >= L_ || head >= Hkv_ || null_count || (null_positions && capacity > 0))
          faults |= bit(MINIKV_ERR_INVALID_ARGUMENT);
        if (seq < S_ && layer < L_ && !pair(seq, layer).prefilled) faults |= bit(MINIKV_ERR_BAD_STATE);
        if (!check_call("minikv_kept_positions", st, faults, before)) return;
        const Pair &p = pair(seq, layer);
        const uint32_t written = std::min(capacity, p.n_keep);
        FUZZ_CHECK(count == p.n_keep, "op %u: kept_positions count %u, model %u", op_, count, p.n_keep);
        for (uint32_t t = written; t < pos.size(); ++t)
          FUZZ_CHECK(pos[t] == -3, "op %u: kept_positions wrote index %u past min(capacity %u, %u)", op_,
                     t, capacity, p.n_keep);
        if (!null_positions)
          for (uint32_t t = 0; t < written; ++t)
            FUZZ_CHECK(pos[t] == before.kept[pair_index(seq, layer) * Hkv_ + head][t],
                       "op %u: a partial kept_positions read differs from the full one at %u", op_, t);
        break;
      }
      default: {
        // struct_size below, at and above the first version (with a guard tail).
        std::vector<uint8_t> buf(sizeof(minikv_memory_stats) + 32, 0x77);
        static const uint32_t sizes[] = {0, 4, sizeof(minikv_memory_stats) - 8, sizeof(minikv_memory_stats),
                                         sizeof(minikv_memory_stats) + 16};
        const uint32_t size = sizes[in.below(5)];
        std::memcpy(buf.data(), &size, 4);
        const bool null_out = in.u8() % 8 == 0;
        const minikv_status st = minikv_memory_stats_get(
            cache_, null_out ? nullptr : reinterpret_cast<minikv_memory_stats *>(buf.data()));
        StatusSet faults = null_out ? bit(MINIKV_ERR_INVALID_ARGUMENT)
                                    : size < sizeof(minikv_memory_stats) ? bit(MINIKV_ERR_VERSION_MISMATCH) : 0;
        if (!check_call("minikv_memory_stats_get", st, faults, before)) return;
        uint32_t size_after;
        std::memcpy(&size_after, buf.data(), 4);
        FUZZ_CHECK(size_after == size, "op %u: stats changed struct_size %u -> %u", op_, size, size_after);
        for (size_t i = sizeof(minikv_memory_stats); i < buf.size(); ++i)
          FUZZ_CHECK(buf[i] == 0x77, "op %u: stats wrote byte %zu past sizeof(minikv_memory_stats)", op_, i);
        FUZZ_CHECK(std::memcmp(buf.data() + 8, reinterpret_cast<const uint8_t *>(&before.stats) + 8,
                               sizeof(minikv_memory_stats) - 8) == 0,
                   "op %u: stats with struct_size %u differ from the full read", op_, size);
        break;
      }
    }
    compare(before, snapshot(), {}, "a query");
  }

  // Every call with a NULL handle is INVALID_ARGUMENT with a message; destroy(NULL) is a no-op.
  void op_null_handle(fuzz::Input &in) {
    uint32_t id = 0;
    int32_t cu[2] = {0, 1};
    uint8_t buf[64] = {0};
    uint64_t a = 0, b = 0;
    uint32_t count = 0;
    minikv_memory_stats ms{};
    ms.struct_size = sizeof(ms);
    minikv_status st = MINIKV_OK;
    const uint8_t which = in.u8() % 8;
    switch (which) {
      case 0: st = minikv_prefill(nullptr, 0, 1, &id, cu, buf, buf, buf, buf, nullptr); break;
      case 1: st = minikv_append(nullptr, 0, 1, &id, buf, buf, nullptr); break;
      case 2: st = minikv_decode(nullptr, 0, 1, &id, buf, buf, nullptr); break;
      case 3: st = minikv_sequence_release(nullptr, 0); break;
      case 4: st = minikv_sequence_length(nullptr, 0, 0, &a, &b); break;
      case 5: st = minikv_kept_positions(nullptr, 0, 0, 0, nullptr, 0, &count); break;
      case 6: st = minikv_memory_stats_get(nullptr, &ms); break;
      default: {
        minikv_cache_destroy(nullptr);
        const char *m = minikv_cache_last_error(nullptr);
        FUZZ_CHECK(m != nullptr && m[0] != '\0', "op %u: minikv_cache_last_error(NULL) is empty", op_);
        // Unknown values within the enum's range (0..15: values past it cannot be formed
        // in C++ without undefined behaviour; see the report on issue 7).
        const minikv_status any = static_cast<minikv_status>(in.u8() % 16);
        const char *s = minikv_status_string(any);
        FUZZ_CHECK(s != nullptr && s[0] != '\0', "op %u: minikv_status_string(%u) is empty", op_, unsigned(any));
        return;
      }
    }
    FUZZ_CHECK(st == MINIKV_ERR_INVALID_ARGUMENT, "op %u: NULL-handle call %u returned %s", op_, which,
               minikv_status_string(st));
    FUZZ_CHECK(std::strstr(minikv_last_error_message(), "NULL") != nullptr,
               "op %u: NULL-handle call %u: message '%s' does not say NULL", op_, which,
               minikv_last_error_message());
  }

  // ---- invariants after every operation ------------------------------------------------------------
  void check_invariants() {
    minikv_memory_stats st{};
    st.struct_size = sizeof(st);
    FUZZ_CHECK(minikv_memory_stats_get(cache_, &st) == MINIKV_OK, "op %u: stats: %s", op_,
               minikv_last_error_message());
    FUZZ_CHECK(st.pool_bytes == pool_bytes_ && st.workspace_bytes == workspace_bytes_,
               "op %u: pool/workspace bytes changed (%llu/%llu, were %llu/%llu)", op_,
               (unsigned long long)st.pool_bytes, (unsigned long long)st.workspace_bytes,
               (unsigned long long)pool_bytes_, (unsigned long long)workspace_bytes_);
    FUZZ_CHECK(st.used_bytes <= st.pool_bytes, "op %u: used_bytes %llu > pool_bytes %llu", op_,
               (unsigned long long)st.used_bytes, (unsigned long long)st.pool_bytes);
    FUZZ_CHECK(st.tokens_cached <= st.tokens_seen, "op %u: tokens_cached %llu > tokens_seen %llu", op_,
               (unsigned long long)st.tokens_cached, (unsigned long long)st.tokens_seen);
    FUZZ_CHECK((st.used_bytes == 0) == (st.tokens_cached == 0),
               "op %u: used_bytes %llu with %llu cached tokens", op_, (unsigned long long)st.used_bytes,
               (unsigned long long)st.tokens_cached);
    uint64_t seen_sum = 0, cached_sum = 0, model_seen = 0, model_cached = 0;
    for (uint32_t seq = 0; seq < S_; ++seq) {
      for (uint32_t layer = 0; layer < L_; ++layer) {
        uint64_t seen = 0, cached = 0;
        FUZZ_CHECK(minikv_sequence_length(cache_, seq, layer, &seen, &cached) == MINIKV_OK,
                   "op %u: sequence_length: %s", op_, minikv_last_error_message());
        const Pair &p = pair(seq, layer);
        FUZZ_CHECK(seen == p.seen() && cached == p.cached(),
                   "op %u: seq %u layer %u: library (seen %llu, cached %llu), model (%llu, %llu)", op_, seq,
                   layer, (unsigned long long)seen, (unsigned long long)cached,
                   (unsigned long long)p.seen(), (unsigned long long)p.cached());
        FUZZ_CHECK(cached <= seen && seen <= cfg_.max_seq_len,
                   "op %u: seq %u layer %u: cached %llu, seen %llu, max_seq_len %u", op_, seq, layer,
                   (unsigned long long)cached, (unsigned long long)seen, cfg_.max_seq_len);
        seen_sum += seen;
        cached_sum += cached;
        model_seen += p.seen();
        model_cached += p.cached();
      }
    }
    FUZZ_CHECK(st.tokens_seen == seen_sum && st.tokens_cached == cached_sum,
               "op %u: stats (seen %llu, cached %llu) != sums of sequence_length (%llu, %llu)", op_,
               (unsigned long long)st.tokens_seen, (unsigned long long)st.tokens_cached,
               (unsigned long long)seen_sum, (unsigned long long)cached_sum);
    FUZZ_CHECK(st.fp16_equivalent_bytes == st.tokens_seen * Hkv_ * D_ * 4ull,
               "op %u: fp16_equivalent_bytes %llu != tokens_seen * Hkv * D * 4", op_,
               (unsigned long long)st.fp16_equivalent_bytes);
    const double ratio = st.fp16_equivalent_bytes == 0
                             ? 0.0
                             : 1.0 - double(st.used_bytes) / double(st.fp16_equivalent_bytes);
    FUZZ_CHECK(std::fabs(st.compression_ratio - ratio) <= 1e-12, "op %u: compression_ratio %.17g, expected %.17g",
               op_, st.compression_ratio, ratio);
    FUZZ_CHECK(used_blocks() <= num_blocks_, "op %u: the model uses %llu blocks of %llu", op_,
               (unsigned long long)used_blocks(), (unsigned long long)num_blocks_);
  }

  minikv_config cfg_;
  bool extreme_;
  uint64_t seed_;
  minikv_cache *cache_ = nullptr;
  uint32_t L_, S_, H_, Hkv_, D_, G_, R_, F_, esize_;
  uint64_t num_blocks_ = 0, pool_bytes_ = 0, workspace_bytes_ = 0;
  std::vector<double> ratios_;
  std::vector<Pair> pairs_;
  std::vector<bool> staged_;  // [layer][prefill_staging_tokens]: rows held by prompts mid-way
  uint32_t op_ = 0;
};

// A small valid configuration from the first bytes of the input.
minikv_config decode_config(fuzz::Input &in, bool &extreme) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.backend = MINIKV_BACKEND_CPU;
  const uint8_t b0 = in.u8();
  static const minikv_dtype kDtypes[4] = {MINIKV_DTYPE_F32, MINIKV_DTYPE_F16, MINIKV_DTYPE_BF16,
                                          MINIKV_DTYPE_F16};
  cfg.dtype = kDtypes[b0 & 3];
  extreme = (b0 >> 2) & 1;
  cfg.budget_policy = (b0 >> 3) & 1 ? MINIKV_BUDGET_PYRAMID : MINIKV_BUDGET_UNIFORM;
  cfg.score_mode = (b0 >> 4) & 1 ? MINIKV_SCORE_WINDOW : MINIKV_SCORE_CUMULATIVE;
  const uint8_t b1 = in.u8();
  cfg.num_layers = 1 + b1 % 3;
  cfg.num_kv_heads = 1 + (b1 >> 2) % 2;
  cfg.num_heads = cfg.num_kv_heads * (1 + (b1 >> 3) % 3);
  const uint8_t b2 = in.u8();
  static const uint32_t kDims[4] = {16, 32, 48, 64};
  cfg.group_size = b2 & 1 ? 32 : 16;
  cfg.head_dim = kDims[(b2 >> 1) & 3];
  if (cfg.head_dim % cfg.group_size != 0) cfg.group_size = 16;
  cfg.residual_length = cfg.group_size * (1 + (b2 >> 3) % 4);
  cfg.max_sequences = 1 + in.u8() % 4;
  cfg.max_seq_len = 1 + in.u8() % 96;
  const uint8_t b5 = in.u8();
  cfg.max_tokens = b5 % 4 == 0 ? 0 : b5;  // 1..255 tokens: a few blocks, capacity pressure
  const uint8_t b6 = in.u8();
  cfg.heavy_ratio = static_cast<float>(b6 % 9) / 8.0f;
  cfg.recent_ratio = static_cast<float>((b6 / 9) % 9) / 8.0f;
  const uint8_t b7 = in.u8();
  static const uint32_t kBits[4] = {2, 4, 16, 8};
  cfg.key_bits = kBits[b7 % 4];
  cfg.value_bits = kBits[(b7 / 4) % 4];
  const uint8_t b8 = in.u8();
  cfg.window_size = 1 + b8 % 16;
  cfg.pool_kernel = 1 + 2 * ((b8 >> 4) % 4);
  static const uint32_t kSinks[4] = {0, 1, 4, 17};
  cfg.sink_tokens = kSinks[b8 >> 6];
  const uint8_t b9 = in.u8();
  cfg.pyramid_depth = 1.0f + static_cast<float>(b9 % 8);
  // Chunked prefill off, or a staging area of half, one or two longest prompts.
  static const uint32_t kStaging[4] = {0, 1, 2, 4};
  cfg.prefill_staging_tokens = std::min<uint32_t>(
      kStaging[(b9 >> 3) % 4] * cfg.max_seq_len / 2, cfg.max_sequences * cfg.max_seq_len);
  // The whole residual per flush, or a sliding flush of 1 to 48 tokens (rounded up to whole
  // groups, at most R).
  cfg.flush_tokens = (b9 >> 5) & 1 ? 1 + 47 * (b9 >> 6) / 3 : 0;
  return cfg;
}

// One field of the configuration overwritten with an arbitrary value: create must return a
// documented status, and a created cache must be usable and destroyable.
void corrupted_create(fuzz::Input &in, const minikv_config &valid) {
  struct Field { size_t offset, size; bool is_size; };
  static const Field kFields[] = {
      {offsetof(minikv_config, struct_size), 4, false}, {offsetof(minikv_config, backend), 4, false},
      {offsetof(minikv_config, device_id), 4, false},   {offsetof(minikv_config, dtype), 4, false},
      {offsetof(minikv_config, num_layers), 4, true},   {offsetof(minikv_config, num_heads), 4, true},
      {offsetof(minikv_config, num_kv_heads), 4, true}, {offsetof(minikv_config, head_dim), 4, true},
      {offsetof(minikv_config, max_sequences), 4, true}, {offsetof(minikv_config, max_seq_len), 4, true},
      {offsetof(minikv_config, max_tokens), 4, true},   {offsetof(minikv_config, heavy_ratio), 4, false},
      {offsetof(minikv_config, recent_ratio), 4, false}, {offsetof(minikv_config, budget_policy), 4, false},
      {offsetof(minikv_config, pyramid_depth), 4, false}, {offsetof(minikv_config, score_mode), 4, false},
      {offsetof(minikv_config, window_size), 4, true},  {offsetof(minikv_config, pool_kernel), 4, false},
      {offsetof(minikv_config, key_bits), 4, false},    {offsetof(minikv_config, value_bits), 4, false},
      {offsetof(minikv_config, group_size), 4, false},  {offsetof(minikv_config, residual_length), 4, true},
      {offsetof(minikv_config, sink_tokens), 4, true},  {offsetof(minikv_config, prefill_staging_tokens), 4, true},
      {offsetof(minikv_config, flush_tokens), 4, true}, {offsetof(minikv_config, reserved_v3_), 4, false},
  };
  // The struct lives in a larger zeroed buffer, so a struct_size above sizeof still names
  // readable bytes (the caller's side of the contract).
  constexpr size_t kTail = 64;
  alignas(minikv_config) uint8_t buf[sizeof(minikv_config) + kTail] = {};
  std::memcpy(buf, &valid, sizeof(valid));
  const size_t field = in.below(sizeof(kFields) / sizeof(kFields[0]));
  const Field &f = kFields[field];
  // Sizes stay small (fuzz_config explores huge ones): the cache must stay cheap here.
  uint32_t value = f.is_size ? in.u16() % 2048 : in.u32();
  if (field == 0) value = in.below(sizeof(minikv_config) + kTail + 1);
  std::memcpy(buf + f.offset, &value, f.size);
  bool tail_set = false;
  if (in.u8() % 2) {
    const size_t at = sizeof(minikv_config) + in.below(kTail);
    buf[at] = 1;
    tail_set = field == 0 && at < value;
  }
  minikv_cache *c = reinterpret_cast<minikv_cache *>(uintptr_t(0x1));
  const minikv_status st = minikv_cache_create(reinterpret_cast<const minikv_config *>(buf), &c);
  if (field == 0) {
    const bool mismatch = value < 96 || tail_set;  // 96: the first version's size
    FUZZ_CHECK(mismatch == (st == MINIKV_ERR_VERSION_MISMATCH),
               "create with struct_size %u (tail byte set: %d) returned %s", value, int(tail_set),
               minikv_status_string(st));
  }
  const StatusSet allowed = bit(MINIKV_OK) | bit(MINIKV_ERR_INVALID_ARGUMENT) |
                            bit(MINIKV_ERR_VERSION_MISMATCH) | bit(MINIKV_ERR_UNSUPPORTED) |
                            bit(MINIKV_ERR_OUT_OF_MEMORY) | bit(MINIKV_ERR_DEVICE);
  FUZZ_CHECK(allowed & bit(st), "create with field @%zu = %u returned undocumented %d", f.offset, value,
             static_cast<int>(st));
  if (st != MINIKV_OK) {
    FUZZ_CHECK(c == nullptr, "a failed create left *out = %p (must be NULL)", static_cast<void *>(c));
    FUZZ_CHECK(minikv_last_error_message()[0] != '\0', "a failed create (%s) left no message",
               minikv_status_string(st));
    return;
  }
  FUZZ_CHECK(c != nullptr, "create returned OK and a NULL handle");
  minikv_memory_stats ms{};
  ms.struct_size = sizeof(ms);
  FUZZ_CHECK(minikv_memory_stats_get(c, &ms) == MINIKV_OK && ms.used_bytes == 0 && ms.tokens_seen == 0,
             "fresh cache from a corrupted-but-accepted config has bad stats");
  minikv_cache_destroy(c);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int *, char ***) {
  // One compute thread unless the caller chose: a fresh pool per input, fast and exact.
  setenv("MINIKV_NUM_THREADS", "1", 0);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz::Input in(data, size);
  bool extreme = false;
  const minikv_config cfg = decode_config(in, extreme);
  if (in.u8() >= 224) corrupted_create(in, cfg);
  if (std::getenv("FUZZ_TRACE"))
    std::fprintf(stderr, "config: dtype %d layers %u heads %u/%u D %u G %u R %u seqs %u max_seq_len %u "
                 "max_tokens %llu h %.3f r %.3f policy %d score %d bits %u/%u sinks %u extreme %d\n",
                 int(cfg.dtype), cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                 cfg.group_size, cfg.residual_length, cfg.max_sequences, cfg.max_seq_len,
                 (unsigned long long)cfg.max_tokens, cfg.heavy_ratio, cfg.recent_ratio,
                 int(cfg.budget_policy), int(cfg.score_mode), cfg.key_bits, cfg.value_bits,
                 cfg.sink_tokens, int(extreme));
  Harness h(cfg, extreme, in.u64());
  h.run(in);
  return 0;
}
