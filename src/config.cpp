#include "config.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "checked_size.h"
#include "error.h"

namespace minikv {

namespace {

// The compression fields that differ between presets (minikv.h documents each; the README
// gives the measurements behind BALANCED), indexed by the preset's value. Every preset
// has h = r = 0.25, pyramid depth 7, window 32 with pooling 7 (read in WINDOW mode).
struct PresetFields {
  uint32_t key_bits, value_bits, group_size, sink_tokens;
  minikv_budget_policy budget_policy;
  minikv_score_mode score_mode;
  uint32_t residual_length, flush_tokens;
};
constexpr PresetFields kPresets[] = {
    /* BALANCED      */ {4, 2, 32, 4, MINIKV_BUDGET_PYRAMID, MINIKV_SCORE_WINDOW, 64, 32},
    /* PAPER         */ {2, 2, 16, 0, MINIKV_BUDGET_PYRAMID, MINIKV_SCORE_CUMULATIVE, 128, 0},
    /* QUALITY       */ {8, 8, 32, 4, MINIKV_BUDGET_UNIFORM, MINIKV_SCORE_CUMULATIVE, 128, 0},
    /* EVICTION_ONLY */ {16, 16, 16, 0, MINIKV_BUDGET_UNIFORM, MINIKV_SCORE_CUMULATIVE, 128, 0},
};
constexpr int32_t kNumPresets = sizeof(kPresets) / sizeof(kPresets[0]);
static_assert(MINIKV_PRESET_EVICTION_ONLY == kNumPresets - 1, "a preset without fields");
// Before flush_tokens every preset flushed the whole residual of 128 tokens: a caller whose
// struct lacks the field gets that (a shorter whole flush would cost it accuracy).
constexpr uint32_t kResidualBeforeFlushTokens = 128;

// Whether a caller's struct of `size` bytes has flush_tokens.
bool has_flush_tokens(size_t size) { return size >= kConfigSizeFlush; }

void set_compression(minikv_config &c, int32_t preset, bool flush_field) {
  const PresetFields &p = kPresets[preset];
  c.heavy_ratio = 0.25f;
  c.recent_ratio = 0.25f;
  c.budget_policy = p.budget_policy;
  c.pyramid_depth = 7.0f;
  c.score_mode = p.score_mode;
  c.window_size = 32;
  c.pool_kernel = 7;
  c.key_bits = p.key_bits;
  c.value_bits = p.value_bits;
  c.group_size = p.group_size;
  c.sink_tokens = p.sink_tokens;
  if (flush_field) {
    c.residual_length = p.residual_length;
    c.flush_tokens = p.flush_tokens;
  } else {
    c.residual_length = kResidualBeforeFlushTokens;
  }
}

}  // namespace

minikv_config config_defaults() {
  minikv_config cfg;
  std::memset(&cfg, 0, sizeof(cfg));
  cfg.struct_size = sizeof(minikv_config);
  cfg.backend = MINIKV_BACKEND_AUTO;
  cfg.device_id = 0;
  cfg.dtype = MINIKV_DTYPE_F16;
  cfg.max_sequences = 1;
  cfg.max_seq_len = 4096;
  cfg.max_tokens = 0;
  set_compression(cfg, MINIKV_PRESET_BALANCED, true);
  return cfg;
}

void config_preset(minikv_config *cfg, int32_t p) {
  MINIKV_REQUIRE(cfg != nullptr, "minikv_config_preset: cfg is NULL");
  MINIKV_REQUIRE(p >= 0 && p < kNumPresets,
                 "minikv_config_preset: preset (%d) must be MINIKV_PRESET_BALANCED (0), _PAPER "
                 "(1), _QUALITY (2) or _EVICTION_ONLY (3)",
                 p);
  constexpr size_t needed = offsetof(minikv_config, sink_tokens) + sizeof(uint32_t);
  if (cfg->struct_size < needed) {
    fail(MINIKV_ERR_VERSION_MISMATCH,
         "minikv_config_preset: cfg->struct_size (%u) must be at least %zu (the preset sets "
         "sink_tokens): initialize cfg with minikv_config_default() of this header",
         cfg->struct_size, needed);
  }
  // Every field written lies within the caller's struct: below `needed`, and flush_tokens
  // only when struct_size covers it.
  set_compression(*cfg, p, has_flush_tokens(cfg->struct_size));
}

void config_init(minikv_config *cfg, size_t size) {
  MINIKV_REQUIRE(cfg != nullptr, "minikv_config_init: cfg is NULL");
  if (size < kConfigSizeV1 || size > UINT32_MAX) {
    fail(MINIKV_ERR_VERSION_MISMATCH,
         "minikv_config_init: struct_size (%zu) must be sizeof(minikv_config) of the caller's "
         "header, at least %u (the first version)",
         size, kConfigSizeV1);
  }
  const minikv_config defaults = config_defaults();
  const size_t ours = sizeof(minikv_config);
  std::memcpy(cfg, &defaults, size < ours ? size : ours);
  if (size > ours) std::memset(reinterpret_cast<unsigned char *>(cfg) + ours, 0, size - ours);
  if (!has_flush_tokens(size)) cfg->residual_length = kResidualBeforeFlushTokens;
  cfg->struct_size = static_cast<uint32_t>(size);
}

uint32_t flush_size(const minikv_config &c) {
  if (c.flush_tokens == 0) return c.residual_length;
  const uint64_t whole_groups = ceil_div(c.flush_tokens, c.group_size) * c.group_size;
  return static_cast<uint32_t>(std::min<uint64_t>(whole_groups, c.residual_length));
}

size_t dtype_bytes(minikv_dtype dtype) { return dtype == MINIKV_DTYPE_F32 ? 4 : 2; }

const char *dtype_name(minikv_dtype dtype) {
  switch (dtype) {
    case MINIKV_DTYPE_F16: return "F16";
    case MINIKV_DTYPE_BF16: return "BF16";
    case MINIKV_DTYPE_F32: return "F32";
  }
  return "unknown";
}

namespace {

void check_bits(const char *field, uint32_t bits) {
  MINIKV_REQUIRE(bits == 2 || bits == 4 || bits == 8 || bits == 16,
                 "%s (%u) must be 2, 4, 8 or 16 (16 = unquantized)", field, bits);
}

void check_ratio(const char *field, float value) {
  MINIKV_REQUIRE(std::isfinite(value) && value >= 0.0f && value <= 1.0f,
                 "%s (%g) must be in [0, 1]", field, static_cast<double>(value));
}

void validate(const minikv_config &c) {
  const int32_t backend = raw_enum(c.backend), dtype = raw_enum(c.dtype);
  const int32_t budget_policy = raw_enum(c.budget_policy), score_mode = raw_enum(c.score_mode);
  MINIKV_REQUIRE(backend == MINIKV_BACKEND_AUTO || backend == MINIKV_BACKEND_CPU ||
                     backend == MINIKV_BACKEND_CUDA,
                 "backend (%d) must be MINIKV_BACKEND_AUTO (0), _CPU (1) or _CUDA (2)", backend);
  MINIKV_REQUIRE(c.device_id >= 0, "device_id (%d) must be >= 0", c.device_id);
  MINIKV_REQUIRE(dtype == MINIKV_DTYPE_F16 || dtype == MINIKV_DTYPE_BF16 ||
                     dtype == MINIKV_DTYPE_F32,
                 "dtype (%d) must be MINIKV_DTYPE_F16 (0), _BF16 (1) or _F32 (2)", dtype);
  MINIKV_REQUIRE(c.num_layers >= 1 && c.num_layers <= 4096,
                 "num_layers (%u) must be in [1, 4096]", c.num_layers);
  MINIKV_REQUIRE(c.num_kv_heads >= 1 && c.num_kv_heads <= 1024,
                 "num_kv_heads (%u) must be in [1, 1024]", c.num_kv_heads);
  MINIKV_REQUIRE(c.num_heads >= 1 && c.num_heads <= 4096, "num_heads (%u) must be in [1, 4096]",
                 c.num_heads);
  MINIKV_REQUIRE(c.num_heads % c.num_kv_heads == 0,
                 "num_heads (%u) must be a multiple of num_kv_heads (%u)", c.num_heads,
                 c.num_kv_heads);
  MINIKV_REQUIRE(c.head_dim >= 16 && c.head_dim <= 256 && c.head_dim % 16 == 0,
                 "head_dim (%u) must be a multiple of 16 in [16, 256]", c.head_dim);
  MINIKV_REQUIRE(c.max_sequences >= 1 && c.max_sequences <= (1u << 20),
                 "max_sequences (%u) must be in [1, 1048576]", c.max_sequences);
  MINIKV_REQUIRE(c.max_seq_len >= 1 && c.max_seq_len <= (1u << 30),
                 "max_seq_len (%u) must be in [1, 2^30]", c.max_seq_len);
  check_ratio("heavy_ratio", c.heavy_ratio);
  check_ratio("recent_ratio", c.recent_ratio);
  MINIKV_REQUIRE(budget_policy == MINIKV_BUDGET_UNIFORM || budget_policy == MINIKV_BUDGET_PYRAMID,
                 "budget_policy (%d) must be MINIKV_BUDGET_UNIFORM (0) or _PYRAMID (1)",
                 budget_policy);
  MINIKV_REQUIRE(std::isfinite(c.pyramid_depth) && c.pyramid_depth >= 1.0f,
                 "pyramid_depth (%g) must be a finite number >= 1",
                 static_cast<double>(c.pyramid_depth));
  MINIKV_REQUIRE(score_mode == MINIKV_SCORE_CUMULATIVE || score_mode == MINIKV_SCORE_WINDOW,
                 "score_mode (%d) must be MINIKV_SCORE_CUMULATIVE (0) or _WINDOW (1)", score_mode);
  MINIKV_REQUIRE(c.window_size >= 1, "window_size (%u) must be >= 1", c.window_size);
  MINIKV_REQUIRE(c.pool_kernel >= 1 && c.pool_kernel % 2 == 1 && c.pool_kernel <= 1023,
                 "pool_kernel (%u) must be odd, in [1, 1023]", c.pool_kernel);
  check_bits("key_bits", c.key_bits);
  check_bits("value_bits", c.value_bits);
  MINIKV_REQUIRE(c.group_size == 16 || c.group_size == 32 || c.group_size == 64 ||
                     c.group_size == 128,
                 "group_size (%u) must be 16, 32, 64 or 128", c.group_size);
  MINIKV_REQUIRE(c.value_bits == 16 || c.head_dim % c.group_size == 0,
                 "head_dim (%u) must be a multiple of group_size (%u): values are quantized in "
                 "groups of group_size channels (group_size 16 fits every head_dim)",
                 c.head_dim, c.group_size);
  MINIKV_REQUIRE(c.residual_length >= c.group_size && c.residual_length % c.group_size == 0 &&
                     c.residual_length <= 4096,
                 "residual_length (%u) must be a multiple of group_size (%u), at most 4096",
                 c.residual_length, c.group_size);
  MINIKV_REQUIRE(c.sink_tokens <= kMaxSinkTokens, "sink_tokens (%u) must be in [0, %u]",
                 c.sink_tokens, kMaxSinkTokens);
  // More staging could never be in use: each sequence stages at most one prompt.
  MINIKV_REQUIRE(c.prefill_staging_tokens <= uint64_t(c.max_sequences) * c.max_seq_len,
                 "prefill_staging_tokens (%u) must be at most max_sequences (%u) x max_seq_len "
                 "(%u): the prompt tokens that can be in flight at once",
                 c.prefill_staging_tokens, c.max_sequences, c.max_seq_len);
}

}  // namespace

minikv_config config_read(const minikv_config *user) {
  MINIKV_REQUIRE(user != nullptr, "config is NULL");
  const uint32_t size = user->struct_size;
  if (size < kConfigSizeV1) {
    fail(MINIKV_ERR_VERSION_MISMATCH,
         "config struct_size (%u) is smaller than the first version of minikv_config (%u): "
         "initialize it with minikv_config_default()",
         size, kConfigSizeV1);
  }
  if (size > sizeof(minikv_config)) {
    // A newer caller: accept it only if every field we do not know is zero (unset).
    const unsigned char *bytes = reinterpret_cast<const unsigned char *>(user);
    for (size_t i = sizeof(minikv_config); i < size; ++i) {
      if (bytes[i] != 0) {
        fail(MINIKV_ERR_VERSION_MISMATCH,
             "config struct_size (%u) is larger than this library's minikv_config (%zu) and "
             "sets fields this library (version %s) does not know",
             size, sizeof(minikv_config), minikv_version_string());
      }
    }
  }
  minikv_config cfg = config_defaults();
  std::memcpy(&cfg, user, sizeof(minikv_config) < size ? sizeof(minikv_config) : size);
  // A caller built before flush_tokens flushes the whole residual, as its library did.
  if (!has_flush_tokens(size)) cfg.flush_tokens = 0;
  if (cfg.reserved_v3_ != 0) {
    // A newer caller's field in the slot this library reserves: refuse rather than ignore.
    fail(MINIKV_ERR_VERSION_MISMATCH,
         "config reserved_v3_ (%u) must be 0: a field this library (version %s) does not know",
         cfg.reserved_v3_, minikv_version_string());
  }
  cfg.struct_size = sizeof(minikv_config);
  validate(cfg);
  return cfg;
}

}  // namespace minikv
