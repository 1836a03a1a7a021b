#include "cache.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <utility>

#include "checked_size.h"
#include "config.h"
#include "alloc.h"
#include "error.h"
#include "finite.h"

namespace minikv {

namespace {

constexpr const char *kCreate = "minikv_cache_create";
// Pool blocks, residual slots and block-table entries are indexed by uint32.
constexpr uint64_t kMaxCount = 1ull << 31;

// The storage geometry of `cfg`, every count and size checked before anything is allocated;
// each failure names the fields that cause it.
StorageSpec plan_storage(const minikv_config &cfg) {
  const uint32_t R = cfg.residual_length;
  const uint32_t elem = static_cast<uint32_t>(dtype_bytes(cfg.dtype));
  StorageSpec spec;
  spec.cfg = cfg;
  spec.block = make_block_layout(R, cfg.num_kv_heads, cfg.head_dim, cfg.group_size, cfg.key_bits,
                                 cfg.value_bits, elem);
  spec.residual = make_residual_layout(R, cfg.num_kv_heads, cfg.head_dim, elem, cfg.sink_tokens);
  const uint64_t slots = checked_size(kCreate, "max_sequences x num_layers",
                                      {cfg.max_sequences, cfg.num_layers});
  if (slots > kMaxCount) {
    fail(MINIKV_ERR_INVALID_ARGUMENT,
         "%s: max_sequences (%u) x num_layers (%u) = %llu residual slots; at most 2^31", kCreate,
         cfg.max_sequences, cfg.num_layers, static_cast<unsigned long long>(slots));
  }
  const uint64_t blocks_per_seq = ceil_div(cfg.max_seq_len, R);
  uint64_t blocks;
  if (cfg.max_tokens == 0) {
    blocks = checked_size(kCreate, "the default pool size", {slots, blocks_per_seq});
    if (blocks > kMaxCount) {
      fail(MINIKV_ERR_INVALID_ARGUMENT,
           "%s: max_tokens = 0 reserves max_sequences (%u) x num_layers (%u) x ceil(max_seq_len "
           "(%u) / residual_length (%u)) = %llu blocks; at most 2^31: set max_tokens to the "
           "tokens the pool must hold",
           kCreate, cfg.max_sequences, cfg.num_layers, cfg.max_seq_len, R,
           static_cast<unsigned long long>(blocks));
    }
  } else {
    blocks = ceil_div(cfg.max_tokens, R);
    if (blocks > kMaxCount) {
      fail(MINIKV_ERR_INVALID_ARGUMENT,
           "%s: max_tokens (%llu) needs %llu blocks of residual_length (%u) tokens; at most 2^31",
           kCreate, static_cast<unsigned long long>(cfg.max_tokens),
           static_cast<unsigned long long>(blocks), R);
    }
  }
  // A (sequence, layer) never holds more blocks than the pool has.
  const uint64_t table_len = std::min(blocks_per_seq, blocks);
  const uint64_t table_entries = checked_size(kCreate, "the block tables", {slots, table_len});
  if (table_entries > kMaxCount) {
    fail(MINIKV_ERR_INVALID_ARGUMENT,
         "%s: the block tables need max_sequences (%u) x num_layers (%u) x %llu blocks per "
         "sequence (ceil(max_seq_len / residual_length), at most the pool's blocks) = %llu "
         "entries; at most 2^31: lower max_sequences, num_layers or max_seq_len",
         kCreate, cfg.max_sequences, cfg.num_layers, static_cast<unsigned long long>(table_len),
         static_cast<unsigned long long>(table_entries));
  }
  spec.num_blocks = static_cast<uint32_t>(blocks);
  spec.residual_slots = static_cast<uint32_t>(slots);
  spec.max_blocks_per_seq = static_cast<uint32_t>(table_len);
  spec.flush_tokens = flush_size(cfg);
  spec.pool_bytes = checked_size(kCreate, "the block pool in bytes", {blocks, spec.block.bytes});
  spec.residual_bytes =
      checked_size(kCreate, "the residual slots in bytes", {slots, spec.residual.bytes});
  spec.staging_bytes = checked_size(
      kCreate, "the prefill staging area in bytes (num_layers x prefill_staging_tokens x "
               "num_kv_heads x head_dim x 2 x dtype bytes)",
      {cfg.num_layers, cfg.prefill_staging_tokens, cfg.num_kv_heads, cfg.head_dim, 2, elem});
  return spec;
}

// Fails with OUT_OF_MEMORY, before anything is allocated, when the host storage of the CPU
// backend cannot fit the machine's RAM + swap (calloc would refuse it later, or succeed
// under overcommit and leave the process to the OOM killer).
void check_host_storage(const StorageSpec &spec) {
  const uint64_t need = checked_sum(
      kCreate, "the host storage in bytes",
      checked_sum(kCreate, "the host storage in bytes", spec.pool_bytes, spec.residual_bytes),
      spec.staging_bytes);
  const uint64_t have = host_memory_bytes();
  if (need > have) {
    fail(MINIKV_ERR_OUT_OF_MEMORY,
         "%s: the block pool (%llu blocks, %llu bytes), the residual slots (%llu bytes) and "
         "the prefill staging area (%llu bytes) need more than this machine's memory (%llu "
         "bytes of RAM + swap): lower max_tokens (or max_sequences, num_layers, max_seq_len "
         "when it is 0) or prefill_staging_tokens",
         kCreate, static_cast<unsigned long long>(spec.num_blocks),
         static_cast<unsigned long long>(spec.pool_bytes),
         static_cast<unsigned long long>(spec.residual_bytes),
         static_cast<unsigned long long>(spec.staging_bytes),
         static_cast<unsigned long long>(have));
  }
}

std::unique_ptr<Backend> make_backend(const StorageSpec &spec) {
  const minikv_config &cfg = spec.cfg;
  switch (cfg.backend) {
    case MINIKV_BACKEND_CPU: check_host_storage(spec); return make_cpu_backend(spec);
    case MINIKV_BACKEND_CUDA: return make_cuda_backend(spec);
    default:
      if (cuda_backend_available(cfg.device_id)) {
        try {
          return make_cuda_backend(spec);
        } catch (const Error &e) {
          // A size or dtype the CUDA kernels do not compile: AUTO falls back to the CPU.
          if (e.status() != MINIKV_ERR_UNSUPPORTED) throw;
        }
      }
      check_host_storage(spec);
      return make_cpu_backend(spec);
  }
}

}  // namespace

Cache::Cache(const minikv_config &cfg) : cfg_(cfg), spec_(plan_storage(cfg)) {
  // The pool first: a pool the machine cannot hold fails here, before the host bookkeeping.
  backend_ = make_backend(spec_);
  cfg_.backend = backend_->kind();

  const uint64_t slots = spec_.residual_slots;
  heavy_ratios_ = layer_heavy_ratios(cfg);
  states_.resize(slots);
  tables_.resize(slots * spec_.max_blocks_per_seq);
  seen_.resize(cfg.max_sequences);
  prefill_items_.reserve(cfg.max_sequences);
  append_items_.reserve(cfg.max_sequences);
  append_extra_.reserve(cfg.max_sequences);
  decode_items_.reserve(cfg.max_sequences);
  returned_blocks_.reserve(spec_.num_blocks);  // untouched until blocks come back
  if (cfg.prefill_staging_tokens > 0) {
    staging_.resize(cfg.num_layers);
    for (StagingRuns &runs : staging_) runs.init(cfg.prefill_staging_tokens, cfg.max_sequences);
  }
}

Cache::~Cache() = default;

void Cache::set_error(const std::string &message) noexcept {
  try {
    last_error_ = message;
  } catch (...) {
    last_error_.assign("out of memory");  // fits the in-object buffer: cannot throw
  }
}

uint32_t Cache::blocks_for(uint64_t quantized_tokens) const {
  return static_cast<uint32_t>(ceil_div(quantized_tokens, cfg_.residual_length));
}

CacheView Cache::view(uint32_t seq, uint32_t layer) const {
  const LayerState &s = state(seq, layer);
  CacheView v;
  v.blocks = table(seq, layer);
  v.num_blocks = s.num_blocks;
  v.residual_slot = seq * cfg_.num_layers + layer;
  v.sinks = s.sinks;
  v.quantized = s.quantized;
  v.residual = s.residual;
  return v;
}

void Cache::take_blocks(uint32_t seq, uint32_t layer, uint32_t n) noexcept {
  LayerState &s = state(seq, layer);
  uint32_t *t = table(seq, layer);
  for (uint32_t i = 0; i < n; ++i) {
    if (returned_blocks_.empty()) {
      t[s.num_blocks++] = next_fresh_block_++;
    } else {
      t[s.num_blocks++] = returned_blocks_.back();
      returned_blocks_.pop_back();
    }
  }
}

void Cache::return_blocks(uint32_t seq, uint32_t layer, uint32_t n) noexcept {
  LayerState &s = state(seq, layer);
  const uint32_t *t = table(seq, layer);
  // Within the capacity reserved at create: push_back allocates nothing.
  for (uint32_t i = 0; i < n; ++i) returned_blocks_.push_back(t[--s.num_blocks]);
}

void Cache::check_common(const char *call, uint32_t layer, uint32_t n_seqs,
                         const uint32_t *seq_ids, bool need_prefilled) const {
  MINIKV_REQUIRE(layer < cfg_.num_layers, "%s: layer (%u) must be < num_layers (%u)", call,
                 layer, cfg_.num_layers);
  MINIKV_REQUIRE(n_seqs >= 1, "%s: n_seqs must be >= 1", call);
  MINIKV_REQUIRE(n_seqs <= cfg_.max_sequences,
                 "%s: n_seqs (%u) exceeds max_sequences (%u); seq_ids must be distinct", call,
                 n_seqs, cfg_.max_sequences);
  MINIKV_REQUIRE(seq_ids != nullptr, "%s: seq_ids is NULL", call);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    MINIKV_REQUIRE(seq_ids[i] < cfg_.max_sequences,
                   "%s: seq_ids[%u] (%u) must be < max_sequences (%u)", call, i, seq_ids[i],
                   cfg_.max_sequences);
  }
  bool repeated = false;
  uint32_t at = 0;
  for (uint32_t i = 0; i < n_seqs && !repeated; ++i) {
    repeated = seen_[seq_ids[i]] != 0;
    seen_[seq_ids[i]] = 1;
    at = i;
  }
  for (uint32_t i = 0; i < n_seqs; ++i) seen_[seq_ids[i]] = 0;
  MINIKV_REQUIRE(!repeated, "%s: seq_ids[%u] (%u) appears twice in one call", call, at,
                 seq_ids[at]);
  if (need_prefilled) {
    for (uint32_t i = 0; i < n_seqs; ++i) require_prefilled(call, seq_ids[i], layer);
  }
}

void Cache::require_prefilled(const char *call, uint32_t seq, uint32_t layer) const {
  const LayerState &s = state(seq, layer);
  if (s.prefilled) return;
  if (s.pending_len > 0) {
    fail(MINIKV_ERR_BAD_STATE,
         "%s: sequence %u is mid-prompt in layer %u (%u of %u prompt tokens received by "
         "minikv_prefill_chunk): send the rest of its prompt first",
         call, seq, layer, s.received, s.pending_len);
  }
  fail(MINIKV_ERR_BAD_STATE, "%s: sequence %u has not been prefilled for layer %u", call, seq,
       layer);
}

static void check_stream(const char *call, minikv_backend kind, void *stream) {
  MINIKV_REQUIRE(kind != MINIKV_BACKEND_CPU || stream == nullptr,
                 "%s: stream must be NULL for the CPU backend", call);
}

void Cache::check_aligned(const char *call,
                          std::initializer_list<std::pair<const char *, const void *>> tensors) const {
  // minikv.h: aligned to the element size (CPU) or to 16 bytes (CUDA, whose prefill moves
  // rows with 16-byte loads).
  const bool cuda = backend_->kind() == MINIKV_BACKEND_CUDA;
  const size_t align = cuda ? 16 : dtype_bytes(cfg_.dtype);
  for (const auto &x : tensors) {
    MINIKV_REQUIRE(reinterpret_cast<uintptr_t>(x.second) % align == 0,
                   "%s: %s (%p) must be aligned to %zu bytes (%s)", call, x.first, x.second,
                   align, cuda ? "the CUDA backend's requirement" : "its element size");
  }
}

void Cache::check_disjoint(
    const char *call, const void *out, uint64_t out_bytes,
    std::initializer_list<std::pair<const char *, std::pair<const void *, uint64_t>>> inputs) const {
  const uintptr_t o = reinterpret_cast<uintptr_t>(out);
  for (const auto &x : inputs) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(x.second.first);
    MINIKV_REQUIRE(o + out_bytes <= a || a + x.second.second <= o,
                   "%s: out (%p, %llu bytes) overlaps %s (%p, %llu bytes); out may not alias "
                   "an input",
                   call, out, static_cast<unsigned long long>(out_bytes), x.first, x.second.first,
                   static_cast<unsigned long long>(x.second.second));
  }
}

void Cache::check_finite(const char *call, const char *name, const void *data, uint64_t rows,
                         uint32_t heads, const uint32_t *seq_ids, const int32_t *cu_seqlens) const {
  // minikv.h: inputs must be finite. Device memory is not readable here (CUDA: the
  // caller's duty); in host memory one pass over the inputs checks them.
  if (backend_->kind() != MINIKV_BACKEND_CPU) return;
  const uint64_t n = rows * heads * cfg_.head_dim;
  float value = 0.0f;
  const uint64_t at = dispatch_dtype(cfg_.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T *x = static_cast<const T *>(data);
    const uint64_t i = first_non_finite(x, n);
    if (i < n) value = to_float(x[i]);
    return i;
  });
  if (at == n) return;
  const uint64_t row = at / (uint64_t(heads) * cfg_.head_dim);
  uint64_t seq = row, position = 0;  // the row is a sequence of the batch (append, decode)
  if (cu_seqlens) {                  // the row is a token of the packed prompts (prefill)
    seq = 0;
    while (uint64_t(cu_seqlens[seq + 1]) <= row) ++seq;
    position = row - uint64_t(cu_seqlens[seq]);
  }
  fail(MINIKV_ERR_INVALID_ARGUMENT,
       "%s: %s[%llu][%llu][%llu] (seq_id %u%s%llu, %shead %llu, channel %llu) is %s: inputs "
       "must be finite (nothing changed)",
       call, name, static_cast<unsigned long long>(row),
       static_cast<unsigned long long>(at / cfg_.head_dim % heads),
       static_cast<unsigned long long>(at % cfg_.head_dim), seq_ids[seq],
       cu_seqlens ? ", position " : ", sequence ",
       static_cast<unsigned long long>(cu_seqlens ? position : seq),
       heads == cfg_.num_heads ? "" : "kv ",
       static_cast<unsigned long long>(at / cfg_.head_dim % heads),
       static_cast<unsigned long long>(at % cfg_.head_dim),
       value != value ? "NaN" : value > 0 ? "+inf" : "-inf");
}

void Cache::prefill(const char *call, uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids,
                    const int32_t *cu_seqlens, const uint32_t *prompt_lens, const void *q,
                    const void *k, const void *v, void *out, void *stream) {
  check_common(call, layer, n_seqs, seq_ids, false);
  MINIKV_REQUIRE(cu_seqlens != nullptr, "%s: cu_seqlens is NULL", call);
  const bool chunked = prompt_lens != nullptr;  // minikv_prefill_chunk
  MINIKV_REQUIRE(q && k && v && out, "%s: %s is NULL", call,
                 !q ? "q" : !k ? "k" : !v ? "v" : "out");
  check_stream(call, backend_->kind(), stream);
  check_aligned(call, {{"q", q}, {"k", k}, {"v", v}, {"out", out}});
  MINIKV_REQUIRE(cu_seqlens[0] == 0, "%s: cu_seqlens[0] (%d) must be 0", call, cu_seqlens[0]);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const int64_t len = int64_t(cu_seqlens[i + 1]) - cu_seqlens[i];
    MINIKV_REQUIRE(len >= 1 && len <= cfg_.max_seq_len,
                   "%s: sequence %u (seq_id %u) has %s %lld = cu_seqlens[%u] - "
                   "cu_seqlens[%u]; it must be in [1, max_seq_len = %u]",
                   call, i, seq_ids[i], chunked ? "a chunk of length" : "length",
                   static_cast<long long>(len), i + 1, i, cfg_.max_seq_len);
    if (chunked) {
      MINIKV_REQUIRE(prompt_lens[i] >= 1 && prompt_lens[i] <= cfg_.max_seq_len,
                     "%s: prompt_lens[%u] (%u, seq_id %u) must be in [1, max_seq_len = %u]",
                     call, i, prompt_lens[i], seq_ids[i], cfg_.max_seq_len);
    }
  }
  const uint64_t tokens = uint64_t(cu_seqlens[n_seqs]);
  check_finite(call, "q", q, tokens, cfg_.num_heads, seq_ids, cu_seqlens);
  check_finite(call, "k", k, tokens, cfg_.num_kv_heads, seq_ids, cu_seqlens);
  check_finite(call, "v", v, tokens, cfg_.num_kv_heads, seq_ids, cu_seqlens);
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const LayerState &s = state(seq_ids[i], layer);
    if (s.prefilled) {
      fail(MINIKV_ERR_BAD_STATE,
           "%s: sequence %u is already prefilled for layer %u (release it to start a new "
           "prompt)",
           call, seq_ids[i], layer);
    }
    if (!chunked && s.pending_len > 0) {
      fail(MINIKV_ERR_BAD_STATE,
           "%s: sequence %u is mid-prompt in layer %u (%u of %u prompt tokens received by "
           "minikv_prefill_chunk): send the rest with minikv_prefill_chunk, or release it",
           call, seq_ids[i], layer, s.received, s.pending_len);
    }
    if (!chunked) continue;
    const uint32_t len = static_cast<uint32_t>(cu_seqlens[i + 1] - cu_seqlens[i]);
    const uint32_t whole = prompt_lens[i];
    if (s.pending_len > 0) {
      MINIKV_REQUIRE(whole == s.pending_len,
                     "%s: prompt_lens[%u] (%u) differs from the prompt length %u that the first "
                     "chunk of sequence %u gave in layer %u",
                     call, i, whole, s.pending_len, seq_ids[i], layer);
    }
    MINIKV_REQUIRE(uint64_t(s.received) + len <= whole,
                   "%s: the chunk of sequence %u (seq_id %u) covers prompt positions [%u, %llu), "
                   "past its prompt_lens[%u] (%u)",
                   call, i, seq_ids[i], s.received,
                   static_cast<unsigned long long>(uint64_t(s.received) + len), i, whole);
    if (s.pending_len == 0 && len < whole) {  // the first of several chunks
      MINIKV_REQUIRE(cfg_.prefill_staging_tokens > 0,
                     "%s: sequence %u (seq_id %u) sends %u of its %u prompt tokens, but chunked "
                     "prefill is off (prefill_staging_tokens = 0): send whole prompts, or set "
                     "prefill_staging_tokens at create",
                     call, i, seq_ids[i], len, whole);
      MINIKV_REQUIRE(whole <= cfg_.prefill_staging_tokens,
                     "%s: prompt_lens[%u] (%u, seq_id %u) exceeds prefill_staging_tokens (%u): "
                     "such a prompt can never be staged; send it in one call or raise "
                     "prefill_staging_tokens",
                     call, i, whole, seq_ids[i], cfg_.prefill_staging_tokens);
    }
  }

  // Plans, and the blocks that prompts starting now will keep (reserved at their first
  // chunk, so that later chunks cannot run out).
  std::vector<PrefillItem> &items = prefill_items_;
  items.assign(n_seqs, PrefillItem());  // within the capacity reserved at create
  uint64_t need = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const LayerState &s = state(seq_ids[i], layer);
    PrefillItem &it = items[i];
    it.token_begin = cu_seqlens[i];
    it.rows = static_cast<uint32_t>(cu_seqlens[i + 1] - cu_seqlens[i]);
    it.position = s.received;
    const uint32_t whole = chunked ? prompt_lens[i] : it.rows;
    it.staged = it.rows < whole;  // not the whole prompt in this call
    it.last = it.position + it.rows == whole;
    it.staging_begin = s.staging_begin;
    it.scored_keys = s.scored_keys;
    it.plan = plan_selection(cfg_, heavy_ratios_[layer], whole);
    it.dst.sinks = it.plan.n_sink;
    const uint32_t rest = it.plan.n_keep - it.plan.n_sink;
    it.dst.quantized = rest - rest % cfg_.group_size;
    it.dst.residual = rest - it.dst.quantized;
    it.dst.residual_slot = seq_ids[i] * cfg_.num_layers + layer;
    if (s.pending_len == 0) need += blocks_for(it.dst.quantized);
  }
  if (need > free_blocks()) {
    fail(MINIKV_ERR_CAPACITY_EXCEEDED,
         "%s: the batch needs %llu free blocks of %u tokens, the pool has %llu free of %u; "
         "release sequences or raise max_tokens",
         call, static_cast<unsigned long long>(need), cfg_.residual_length,
         static_cast<unsigned long long>(free_blocks()),
         spec_.num_blocks);
  }
  // Staging runs of the prompts whose first chunk this is.
  StagingRuns *runs = staging_.empty() ? nullptr : &staging_[layer];
  auto give_runs = [&](uint32_t count) {
    for (uint32_t i = count; i-- > 0;)
      if (items[i].staged && items[i].position == 0) runs->give(items[i].staging_begin);
  };
  for (uint32_t i = 0; i < n_seqs; ++i) {
    PrefillItem &it = items[i];
    if (!it.staged || it.position > 0) continue;
    const uint32_t at = runs->find(it.plan.prompt_len);
    if (at == StagingRuns::kNone) {
      const uint32_t used = runs->used(), largest = runs->largest_free();
      give_runs(i);
      const uint32_t by_call = used - runs->used();
      fail(MINIKV_ERR_CAPACITY_EXCEEDED,
           "%s: sequence %u (seq_id %u) needs %u contiguous staging rows for its prompt in "
           "layer %u; of prefill_staging_tokens (%u), %u are staged for prompts in flight%s "
           "and the longest free run is %u rows: finish or release prompts and retry",
           call, i, seq_ids[i], it.plan.prompt_len, layer, runs->capacity(), runs->used(),
           by_call > 0 ? format(" (%u more by earlier sequences of this call)", by_call).c_str()
                       : "",
           largest);
    }
    runs->take(at, it.plan.prompt_len);
    it.staging_begin = at;
  }

  for (uint32_t i = 0; i < n_seqs; ++i) {
    if (items[i].position == 0) take_blocks(seq_ids[i], layer, blocks_for(items[i].dst.quantized));
    items[i].dst.blocks = table(seq_ids[i], layer);
    items[i].dst.num_blocks = state(seq_ids[i], layer).num_blocks;
  }
  try {
    backend_->prefill(layer, items, q, k, v, out, stream);
  } catch (...) {
    for (uint32_t i = n_seqs; i-- > 0;)
      if (items[i].position == 0)
        return_blocks(seq_ids[i], layer, state(seq_ids[i], layer).num_blocks);
    give_runs(n_seqs);
    throw;
  }
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const PrefillItem &it = items[i];
    LayerState &s = state(seq_ids[i], layer);
    if (!it.last) {  // mid-prompt
      s.pending_len = it.plan.prompt_len;
      s.received = it.position + it.rows;
      s.staging_begin = it.staging_begin;
      if (chunk_scores(cfg_, it)) s.scored_keys = it.position + it.rows;
      continue;
    }
    if (it.staged) runs->give(it.staging_begin);
    const uint32_t blocks = s.num_blocks;
    s = LayerState();
    s.num_blocks = blocks;
    s.prefilled = true;
    s.prompt_len = it.plan.prompt_len;
    s.kept_prompt = it.plan.n_keep;
    s.sinks = it.dst.sinks;
    s.quantized = it.dst.quantized;
    s.residual = it.dst.residual;
  }
}

void Cache::plan_append(const char *call, uint32_t layer, uint32_t n_seqs,
                        const uint32_t *seq_ids) {
  std::vector<AppendItem> &items = append_items_;
  std::vector<uint32_t> &extra = append_extra_;
  items.assign(n_seqs, AppendItem());  // within the capacity reserved at create
  extra.assign(n_seqs, 0);
  uint64_t need = 0;
  for (uint32_t i = 0; i < n_seqs; ++i) {
    const LayerState &s = state(seq_ids[i], layer);
    const uint64_t seen = uint64_t(s.prompt_len) + s.generated;
    if (seen >= cfg_.max_seq_len) {
      fail(MINIKV_ERR_CAPACITY_EXCEEDED,
           "%s: sequence %u has reached max_seq_len (%u positions) in layer %u", call,
           seq_ids[i], cfg_.max_seq_len, layer);
    }
    items[i].position = static_cast<int32_t>(seen);
    items[i].flush = s.residual + 1 == cfg_.residual_length;
    if (items[i].flush) {
      const uint32_t total = blocks_for(uint64_t(s.quantized) + spec_.flush_tokens);
      extra[i] = total - s.num_blocks;
      need += extra[i];
    }
  }
  if (need > free_blocks()) {
    fail(MINIKV_ERR_CAPACITY_EXCEEDED,
         "%s: flushing the residual needs %llu free blocks, the pool has %llu free of %u; "
         "release or preempt sequences and retry",
         call, static_cast<unsigned long long>(need),
         static_cast<unsigned long long>(free_blocks()), spec_.num_blocks);
  }
  for (uint32_t i = 0; i < n_seqs; ++i) {
    take_blocks(seq_ids[i], layer, extra[i]);
    items[i].dst = view(seq_ids[i], layer);
  }
}

// One token more in a (sequence, layer)'s counts: into the residual, or, when the residual
// becomes full (R tokens) with it, its oldest F flushed into blocks. S is a LayerState or a
// CacheView.
template <typename S> static void add_token(S &s, bool flush, const StorageSpec &spec) {
  if (flush) {
    s.quantized += spec.flush_tokens;
    s.residual = spec.block.tokens - spec.flush_tokens;
  } else {
    s.residual += 1;
  }
}

void Cache::return_append_blocks(uint32_t layer, uint32_t n_seqs,
                                 const uint32_t *seq_ids) noexcept {
  for (uint32_t i = n_seqs; i-- > 0;) return_blocks(seq_ids[i], layer, append_extra_[i]);
}

void Cache::commit_append(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids) noexcept {
  for (uint32_t i = 0; i < n_seqs; ++i) {
    LayerState &s = state(seq_ids[i], layer);
    s.generated += 1;
    add_token(s, append_items_[i].flush, spec_);
  }
}

void Cache::append(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids, const void *k,
                   const void *v, void *stream) {
  constexpr const char *call = "minikv_append";
  check_common(call, layer, n_seqs, seq_ids, true);
  MINIKV_REQUIRE(k && v, "%s: %s is NULL", call, !k ? "k" : "v");
  check_stream(call, backend_->kind(), stream);
  check_aligned(call, {{"k", k}, {"v", v}});
  check_finite(call, "k", k, n_seqs, cfg_.num_kv_heads, seq_ids, nullptr);
  check_finite(call, "v", v, n_seqs, cfg_.num_kv_heads, seq_ids, nullptr);
  plan_append(call, layer, n_seqs, seq_ids);
  try {
    backend_->append(layer, append_items_, k, v, stream);
  } catch (...) {
    return_append_blocks(layer, n_seqs, seq_ids);
    throw;
  }
  commit_append(layer, n_seqs, seq_ids);
}

void Cache::decode(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids, const void *q,
                   void *out, void *stream) {
  constexpr const char *call = "minikv_decode";
  check_common(call, layer, n_seqs, seq_ids, true);
  MINIKV_REQUIRE(q && out, "%s: %s is NULL", call, !q ? "q" : "out");
  check_stream(call, backend_->kind(), stream);
  check_aligned(call, {{"q", q}, {"out", out}});
  check_finite(call, "q", q, n_seqs, cfg_.num_heads, seq_ids, nullptr);
  std::vector<CacheView> &items = decode_items_;
  items.assign(n_seqs, CacheView());  // within the capacity reserved at create
  for (uint32_t i = 0; i < n_seqs; ++i) {
    items[i] = view(seq_ids[i], layer);
    if (items[i].sinks + items[i].quantized + items[i].residual == 0) {
      fail(MINIKV_ERR_BAD_STATE,
           "%s: sequence %u has no cached token in layer %u (its prompt kept none): append "
           "the token's K/V before decoding",
           call, seq_ids[i], layer);
    }
  }
  backend_->decode(layer, items, q, out, stream);
}

void Cache::append_decode(uint32_t layer, uint32_t n_seqs, const uint32_t *seq_ids,
                          const void *q, const void *k, const void *v, void *out,
                          void *stream) {
  constexpr const char *call = "minikv_append_decode";
  check_common(call, layer, n_seqs, seq_ids, true);
  MINIKV_REQUIRE(q && k && v && out, "%s: %s is NULL", call,
                 !q ? "q" : !k ? "k" : !v ? "v" : "out");
  check_stream(call, backend_->kind(), stream);
  check_aligned(call, {{"q", q}, {"k", k}, {"v", v}, {"out", out}});
  const uint64_t elem = dtype_bytes(cfg_.dtype);
  const uint64_t q_bytes = uint64_t(n_seqs) * cfg_.num_heads * cfg_.head_dim * elem;
  const uint64_t kv_bytes = uint64_t(n_seqs) * cfg_.num_kv_heads * cfg_.head_dim * elem;
  check_disjoint(call, out, q_bytes, {{"q", {q, q_bytes}}, {"k", {k, kv_bytes}}, {"v", {v, kv_bytes}}});
  check_finite(call, "q", q, n_seqs, cfg_.num_heads, seq_ids, nullptr);
  check_finite(call, "k", k, n_seqs, cfg_.num_kv_heads, seq_ids, nullptr);
  check_finite(call, "v", v, n_seqs, cfg_.num_kv_heads, seq_ids, nullptr);
  plan_append(call, layer, n_seqs, seq_ids);
  // The views decode reads: each sequence's cache once its token is appended (a flush moves
  // the full residual into the blocks plan_append took).
  std::vector<CacheView> &after = decode_items_;
  after.assign(n_seqs, CacheView());  // within the capacity reserved at create
  for (uint32_t i = 0; i < n_seqs; ++i) {
    after[i] = append_items_[i].dst;
    add_token(after[i], append_items_[i].flush, spec_);
  }
  try {
    backend_->append_decode(layer, append_items_, after, q, k, v, out, stream);
  } catch (...) {
    return_append_blocks(layer, n_seqs, seq_ids);
    throw;
  }
  commit_append(layer, n_seqs, seq_ids);
}

void Cache::release(uint32_t seq_id) {
  MINIKV_REQUIRE(seq_id < cfg_.max_sequences,
                 "minikv_sequence_release: seq_id (%u) must be < max_sequences (%u)", seq_id,
                 cfg_.max_sequences);
  for (uint32_t layer = cfg_.num_layers; layer-- > 0;) {
    LayerState &s = state(seq_id, layer);
    // An abandoned chunked prompt: its staging run (a prompt sent whole has none).
    if (s.pending_len > 0) staging_[layer].give(s.staging_begin);
    return_blocks(seq_id, layer, s.num_blocks);
    s = LayerState();
  }
}

void Cache::sequence_length(uint32_t seq_id, uint32_t layer, uint64_t *seen,
                            uint64_t *cached) const {
  MINIKV_REQUIRE(seq_id < cfg_.max_sequences,
                 "minikv_sequence_length: seq_id (%u) must be < max_sequences (%u)", seq_id,
                 cfg_.max_sequences);
  MINIKV_REQUIRE(layer < cfg_.num_layers,
                 "minikv_sequence_length: layer (%u) must be < num_layers (%u)", layer,
                 cfg_.num_layers);
  const LayerState &s = state(seq_id, layer);
  if (seen) *seen = uint64_t(s.prompt_len) + s.generated;
  if (cached) *cached = uint64_t(s.sinks) + s.quantized + s.residual;
}

void Cache::kept_positions(uint32_t seq_id, uint32_t layer, uint32_t kv_head,
                           int32_t *positions, uint32_t capacity, uint32_t *count) const {
  constexpr const char *call = "minikv_kept_positions";
  MINIKV_REQUIRE(seq_id < cfg_.max_sequences, "%s: seq_id (%u) must be < max_sequences (%u)",
                 call, seq_id, cfg_.max_sequences);
  MINIKV_REQUIRE(layer < cfg_.num_layers, "%s: layer (%u) must be < num_layers (%u)", call,
                 layer, cfg_.num_layers);
  MINIKV_REQUIRE(kv_head < cfg_.num_kv_heads, "%s: kv_head (%u) must be < num_kv_heads (%u)",
                 call, kv_head, cfg_.num_kv_heads);
  MINIKV_REQUIRE(count != nullptr, "%s: count is NULL", call);
  MINIKV_REQUIRE(capacity == 0 || positions != nullptr,
                 "%s: positions is NULL but capacity is %u", call, capacity);
  require_prefilled(call, seq_id, layer);
  const LayerState &s = state(seq_id, layer);
  // Sinks first, at their implicit positions 0..sinks-1; then blocks and residual.
  const uint32_t n = std::min(capacity, s.kept_prompt);
  const uint32_t sinks = std::min(n, s.sinks);
  for (uint32_t t = 0; t < sinks; ++t) positions[t] = static_cast<int32_t>(t);
  if (n > sinks) backend_->read_positions(view(seq_id, layer), kv_head, n - sinks, positions + sinks);
  *count = s.kept_prompt;
}

minikv_memory_stats Cache::stats() const {
  minikv_memory_stats st{};
  st.struct_size = sizeof(st);
  st.pool_bytes = backend_->pool_bytes();
  st.workspace_bytes = backend_->workspace_bytes();
  // Sink and residual tokens are stored unquantized, in the caller's dtype.
  const uint64_t dense_token_bytes =
      2ull * cfg_.num_kv_heads * cfg_.head_dim * dtype_bytes(cfg_.dtype);
  for (const LayerState &s : states_) {
    if (!s.prefilled) continue;
    st.tokens_seen += uint64_t(s.prompt_len) + s.generated;
    st.tokens_cached += uint64_t(s.sinks) + s.quantized + s.residual;
    st.used_bytes += quantized_bytes(spec_.block, s.quantized) +
                     dense_token_bytes * (uint64_t(s.sinks) + s.residual);
  }
  st.fp16_equivalent_bytes = st.tokens_seen * cfg_.num_kv_heads * cfg_.head_dim * 2ull * 2ull;
  st.compression_ratio =
      st.fp16_equivalent_bytes == 0
          ? 0.0
          : 1.0 - static_cast<double>(st.used_bytes) / static_cast<double>(st.fp16_equivalent_bytes);
  return st;
}

}  // namespace minikv
