// minikv_config: the defaults (MINIKV_PRESET_BALANCED), the presets, validation of every
// field (status + a message that names the field), struct_size versioning.
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "support.hpp"

namespace {

minikv_config valid() { return test::cpu_config(2, 8, 2, 64); }

// Creates with cfg and returns the status; on failure checks the thread-local message
// names `field` (and the call), and that *out was reset to NULL.
minikv_status create_status(const minikv_config &cfg, const char *field) {
  minikv_cache *c = reinterpret_cast<minikv_cache *>(0x1);  // must be overwritten
  const minikv_status st = minikv_cache_create(&cfg, &c);
  if (st == MINIKV_OK) {
    minikv_cache_destroy(c);
    return st;
  }
  CHECK(c == nullptr);
  const std::string msg = minikv_last_error_message();
  INFO("message: ", msg);
  CHECK(msg.find(field) != std::string::npos);
  return st;
}

}  // namespace

TEST_SUITE("cpu") {

TEST_CASE("config: defaults are MINIKV_PRESET_BALANCED") {
  minikv_config c;
  std::memset(&c, 0xab, sizeof(c));
  minikv_config_default(&c);
  CHECK(c.struct_size == sizeof(minikv_config));
  CHECK(c.backend == MINIKV_BACKEND_AUTO);
  CHECK(c.device_id == 0);
  CHECK(c.dtype == MINIKV_DTYPE_F16);
  CHECK(c.num_layers == 0);  // model dimensions must be set by the caller
  CHECK(c.num_heads == 0);
  CHECK(c.num_kv_heads == 0);
  CHECK(c.head_dim == 0);
  CHECK(c.max_sequences == 1);
  CHECK(c.max_seq_len == 4096);
  CHECK(c.max_tokens == 0);
  CHECK(c.heavy_ratio == 0.25f);
  CHECK(c.recent_ratio == 0.25f);
  CHECK(c.budget_policy == MINIKV_BUDGET_PYRAMID);
  CHECK(c.pyramid_depth == 7.0f);
  CHECK(c.score_mode == MINIKV_SCORE_WINDOW);
  CHECK(c.window_size == 32);
  CHECK(c.pool_kernel == 7);
  CHECK(c.key_bits == 4);
  CHECK(c.value_bits == 2);
  CHECK(c.group_size == 32);
  CHECK(c.residual_length == 64);
  CHECK(c.sink_tokens == 4);
  CHECK(c.prefill_staging_tokens == 0);
  CHECK(c.flush_tokens == 32);
  CHECK(c.reserved_v3_ == 0);
  CHECK(minikv_config_default(nullptr) == MINIKV_ERR_INVALID_ARGUMENT);  // and no crash
  // The same bytes as the BALANCED preset applied on top.
  minikv_config b = c;
  MKV_REQUIRE_OK(minikv_config_preset(&b, MINIKV_PRESET_BALANCED));
  CHECK(std::memcmp(&b, &c, sizeof(c)) == 0);
}

namespace {

// The compression fields a preset sets (include/minikv.h documents each preset).
struct PresetFields {
  minikv_preset preset;
  uint32_t key_bits, value_bits, group_size, sink_tokens;
  minikv_budget_policy policy;
  minikv_score_mode score_mode;
  uint32_t residual_length, flush_tokens;
};

const PresetFields kPresets[] = {
    {MINIKV_PRESET_BALANCED, 4, 2, 32, 4, MINIKV_BUDGET_PYRAMID, MINIKV_SCORE_WINDOW, 64, 32},
    {MINIKV_PRESET_PAPER, 2, 2, 16, 0, MINIKV_BUDGET_PYRAMID, MINIKV_SCORE_CUMULATIVE, 128, 0},
    {MINIKV_PRESET_QUALITY, 8, 8, 32, 4, MINIKV_BUDGET_UNIFORM, MINIKV_SCORE_CUMULATIVE, 128, 0},
    {MINIKV_PRESET_EVICTION_ONLY, 16, 16, 16, 0, MINIKV_BUDGET_UNIFORM, MINIKV_SCORE_CUMULATIVE, 128, 0},
};

}  // namespace

TEST_CASE("config: each preset sets exactly its compression fields") {
  for (const PresetFields &p : kPresets) {
    CAPTURE(p.preset);
    // Every other field keeps what the caller had, including unusual values.
    minikv_config c;
    minikv_config_default(&c);
    c.backend = MINIKV_BACKEND_CPU;
    c.device_id = 3;
    c.dtype = MINIKV_DTYPE_BF16;
    c.num_layers = 7;
    c.num_heads = 12;
    c.num_kv_heads = 4;
    c.head_dim = 96;
    c.max_sequences = 5;
    c.max_seq_len = 777;
    c.max_tokens = 12345;
    c.reserved_v1_ = 0xdead;
    // ... and every compression field is overwritten, whatever it held.
    c.heavy_ratio = c.recent_ratio = 0.9f;
    c.budget_policy = p.policy == MINIKV_BUDGET_UNIFORM ? MINIKV_BUDGET_PYRAMID : MINIKV_BUDGET_UNIFORM;
    c.pyramid_depth = 2.0f;
    c.score_mode = p.score_mode == MINIKV_SCORE_WINDOW ? MINIKV_SCORE_CUMULATIVE : MINIKV_SCORE_WINDOW;
    c.window_size = 5;
    c.pool_kernel = 3;
    c.key_bits = c.value_bits = 3;
    c.group_size = 64;
    c.residual_length = 512;
    c.flush_tokens = 96;
    c.sink_tokens = 63;
    const minikv_config before = c;
    MKV_REQUIRE_OK(minikv_config_preset(&c, p.preset));
    CHECK(c.struct_size == before.struct_size);
    CHECK(c.backend == before.backend);
    CHECK(c.device_id == 3);
    CHECK(c.dtype == MINIKV_DTYPE_BF16);
    CHECK(c.num_layers == 7);
    CHECK(c.num_heads == 12);
    CHECK(c.num_kv_heads == 4);
    CHECK(c.head_dim == 96);
    CHECK(c.max_sequences == 5);
    CHECK(c.max_seq_len == 777);
    CHECK(c.max_tokens == 12345);
    CHECK(c.reserved_v1_ == 0xdead);
    CHECK(c.prefill_staging_tokens == 0);
    CHECK(c.key_bits == p.key_bits);
    CHECK(c.value_bits == p.value_bits);
    CHECK(c.group_size == p.group_size);
    CHECK(c.sink_tokens == p.sink_tokens);
    CHECK(c.budget_policy == p.policy);
    CHECK(c.heavy_ratio == 0.25f);
    CHECK(c.recent_ratio == 0.25f);
    CHECK(c.pyramid_depth == 7.0f);
    CHECK(c.score_mode == p.score_mode);
    CHECK(c.window_size == 32);
    CHECK(c.pool_kernel == 7);
    CHECK(c.residual_length == p.residual_length);
    CHECK(c.flush_tokens == p.flush_tokens);
  }
}

TEST_CASE("config: every preset creates a cache that prefills and decodes") {
  for (const PresetFields &p : kPresets) {
    CAPTURE(p.preset);
    minikv_config c = valid();
    MKV_REQUIRE_OK(minikv_config_preset(&c, p.preset));
    c.max_seq_len = 300;
    test::CachePtr cache = test::make_cache(c);
    test::Rng rng(17);
    const uint32_t L = 200, H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim;
    test::Buf q(c.dtype, size_t(L) * H * D), k(c.dtype, size_t(L) * Hkv * D),
        v(c.dtype, size_t(L) * Hkv * D), out(c.dtype, size_t(L) * H * D), o1(c.dtype, size_t(H) * D);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    const uint32_t seq = 0;
    const int32_t cu[2] = {0, static_cast<int32_t>(L)};
    for (uint32_t layer = 0; layer < c.num_layers; ++layer)
      MKV_REQUIRE_OK(minikv_prefill(cache.get(), layer, 1, &seq, cu, q.data(), k.data(), v.data(),
                                    out.data(), nullptr));
    MKV_REQUIRE_OK(minikv_decode(cache.get(), 1, 1, &seq, q.data(), o1.data(), nullptr));
    for (double x : o1.doubles()) CHECK(std::isfinite(x));
    const std::vector<int32_t> kept = test::kept_positions(cache.get(), 0, 0, 0);
    for (uint32_t t = 0; t < p.sink_tokens; ++t) CHECK(kept[t] == int32_t(t));
  }
}

TEST_CASE("config: a preset writes only within struct_size and checks its arguments") {
  unsigned char frame[sizeof(minikv_config) + 64];
  auto *cfg = reinterpret_cast<minikv_config *>(frame);
  unsigned char before[sizeof(frame)];
  auto unchanged = [&] { return std::memcmp(frame, before, sizeof(frame)) == 0; };
  SUBCASE("a struct_size that covers sink_tokens but not prefill_staging_tokens") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, 100));
    MKV_REQUIRE_OK(minikv_config_preset(cfg, MINIKV_PRESET_PAPER));
    CHECK(cfg->sink_tokens == 0);
    CHECK(cfg->key_bits == 2);
    for (size_t i = 100; i < sizeof(frame); ++i) CHECK(frame[i] == 0xA5);
  }
  SUBCASE("a struct_size without flush_tokens: BALANCED as it was before the field") {
    // R = 128 flushed whole: a 64-token residual without the sliding flush would cost such a
    // caller accuracy.
    for (uint32_t size : {100u, 104u, 107u}) {
      CAPTURE(size);
      std::memset(frame, 0xA5, sizeof(frame));
      MKV_REQUIRE_OK(minikv_config_init(cfg, size));
      CHECK(cfg->residual_length == 128);
      cfg->residual_length = 32;
      MKV_REQUIRE_OK(minikv_config_preset(cfg, MINIKV_PRESET_BALANCED));
      CHECK(cfg->residual_length == 128);
      CHECK(cfg->group_size == 32);
      for (size_t i = size; i < sizeof(frame); ++i) CHECK(frame[i] == 0xA5);
    }
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, 108));  // covers flush_tokens
    CHECK(cfg->residual_length == 64);
    CHECK(cfg->flush_tokens == 32);
    for (size_t i = 108; i < sizeof(frame); ++i) CHECK(frame[i] == 0xA5);
  }
  SUBCASE("a newer, larger struct: its tail is left alone") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, sizeof(frame)));
    std::memset(frame + sizeof(minikv_config), 0x5A, sizeof(frame) - sizeof(minikv_config));
    MKV_REQUIRE_OK(minikv_config_preset(cfg, MINIKV_PRESET_QUALITY));
    CHECK(cfg->key_bits == 8);
    for (size_t i = sizeof(minikv_config); i < sizeof(frame); ++i) CHECK(frame[i] == 0x5A);
  }
  SUBCASE("the first version's struct has no sink_tokens: VERSION_MISMATCH, nothing written") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, 96));
    std::memcpy(before, frame, sizeof(frame));
    CHECK(minikv_config_preset(cfg, MINIKV_PRESET_PAPER) == MINIKV_ERR_VERSION_MISMATCH);
    CHECK(std::string(minikv_last_error_message()).find("struct_size") != std::string::npos);
    CHECK(unchanged());
    cfg->struct_size = 0;
    std::memcpy(before, frame, sizeof(frame));
    CHECK(minikv_config_preset(cfg, MINIKV_PRESET_BALANCED) == MINIKV_ERR_VERSION_MISMATCH);
    CHECK(unchanged());
  }
  SUBCASE("an unknown preset: INVALID_ARGUMENT naming it, nothing written") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, sizeof(minikv_config)));
    std::memcpy(before, frame, sizeof(frame));
    for (int bad : {-1, 4, 99, INT32_MIN}) {
      CAPTURE(bad);
      minikv_preset p;
      std::memcpy(&p, &bad, sizeof(p));  // any int a C caller may pass
      CHECK(minikv_config_preset(cfg, p) == MINIKV_ERR_INVALID_ARGUMENT);
      CHECK(std::string(minikv_last_error_message()).find("preset") != std::string::npos);
      CHECK(unchanged());
    }
  }
  SUBCASE("NULL") {
    CHECK(minikv_config_preset(nullptr, MINIKV_PRESET_PAPER) == MINIKV_ERR_INVALID_ARGUMENT);
    CHECK(std::string(minikv_last_error_message()).find("cfg") != std::string::npos);
  }
}

TEST_CASE("config: init writes only the caller's struct_size bytes") {
  // The library's struct may grow; a caller's may be the first version's 96 bytes.
  constexpr size_t kV1 = 96;
  REQUIRE(sizeof(minikv_config) >= kV1);
  unsigned char frame[sizeof(minikv_config) + 64];
  std::memset(frame, 0xA5, sizeof(frame));
  auto *cfg = reinterpret_cast<minikv_config *>(frame);
  MKV_REQUIRE_OK(minikv_config_init(cfg, kV1));
  CHECK(cfg->struct_size == kV1);
  CHECK(cfg->key_bits == 4);
  CHECK(cfg->residual_length == 128);
  for (size_t i = kV1; i < sizeof(frame); ++i) CHECK(frame[i] == 0xA5);

  SUBCASE("the 0.1 symbol fills the first version only") {
    std::memset(frame, 0xA5, sizeof(frame));
    (minikv_config_default)(cfg);  // the exported function, not the macro
    CHECK(cfg->struct_size == kV1);
    for (size_t i = kV1; i < sizeof(frame); ++i) CHECK(frame[i] == 0xA5);
  }
  SUBCASE("a size below the first version writes nothing") {
    std::memset(frame, 0xA5, sizeof(frame));
    CHECK(minikv_config_init(cfg, kV1 - 4) == MINIKV_ERR_VERSION_MISMATCH);
    CHECK(std::string(minikv_last_error_message()).find("struct_size") != std::string::npos);
    for (unsigned char b : frame) CHECK(b == 0xA5);
  }
  SUBCASE("a newer header's extra bytes are zeroed and read as unset") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, sizeof(frame)));
    CHECK(cfg->struct_size == sizeof(frame));
    for (size_t i = sizeof(minikv_config); i < sizeof(frame); ++i) CHECK(frame[i] == 0);
    cfg->backend = MINIKV_BACKEND_CPU;
    cfg->num_layers = 1;
    cfg->num_heads = cfg->num_kv_heads = 1;
    cfg->head_dim = 64;
    minikv_cache *cache = nullptr;
    MKV_REQUIRE_OK(minikv_cache_create(cfg, &cache));
    minikv_cache_destroy(cache);
  }
  SUBCASE("a first-version struct creates a cache with later fields at their defaults") {
    std::memset(frame, 0xA5, sizeof(frame));
    MKV_REQUIRE_OK(minikv_config_init(cfg, kV1));
    cfg->backend = MINIKV_BACKEND_CPU;
    cfg->num_layers = 1;
    cfg->num_heads = cfg->num_kv_heads = 1;
    cfg->head_dim = 64;
    minikv_cache *cache = nullptr;
    MKV_REQUIRE_OK(minikv_cache_create(cfg, &cache));  // the 0xA5 tail is not read
    minikv_cache_destroy(cache);
  }
}

TEST_CASE("config: unset model dimensions are rejected by name") {
  minikv_config c;
  minikv_config_default(&c);
  c.backend = MINIKV_BACKEND_CPU;
  CHECK(create_status(c, "num_layers") == MINIKV_ERR_INVALID_ARGUMENT);
}

TEST_CASE("config: a valid config creates a CPU cache") {
  minikv_config c = valid();
  minikv_cache *cache = nullptr;
  MKV_REQUIRE_OK(minikv_cache_create(&c, &cache));
  REQUIRE(cache != nullptr);
  CHECK(std::string(minikv_cache_last_error(cache)).empty());
  minikv_cache_destroy(cache);
  minikv_cache_destroy(nullptr);  // no-op
}

TEST_CASE("config: every bad field gives INVALID_ARGUMENT naming it") {
  struct Bad {
    const char *field;
    std::function<void(minikv_config &)> set;
  };
  const std::vector<Bad> bad = {
      {"backend", [](minikv_config &c) { c.backend = static_cast<minikv_backend>(3); }},
      {"backend", [](minikv_config &c) { c.backend = static_cast<minikv_backend>(-1); }},
      {"device_id", [](minikv_config &c) { c.device_id = -1; }},
      {"dtype", [](minikv_config &c) { c.dtype = static_cast<minikv_dtype>(3); }},
      {"dtype", [](minikv_config &c) { c.dtype = static_cast<minikv_dtype>(-7); }},
      {"num_layers", [](minikv_config &c) { c.num_layers = 0; }},
      {"num_heads", [](minikv_config &c) { c.num_heads = 0; }},
      {"num_kv_heads", [](minikv_config &c) { c.num_kv_heads = 0; }},
      {"head_dim", [](minikv_config &c) { c.head_dim = 0; }},
      {"head_dim", [](minikv_config &c) { c.head_dim = 24; }},   // not a multiple of 16
      {"head_dim", [](minikv_config &c) { c.head_dim = 272; }},  // above 256
      {"max_sequences", [](minikv_config &c) { c.max_sequences = 0; }},
      {"max_seq_len", [](minikv_config &c) { c.max_seq_len = 0; }},
      {"heavy_ratio", [](minikv_config &c) { c.heavy_ratio = -0.1f; }},
      {"heavy_ratio", [](minikv_config &c) { c.heavy_ratio = 1.5f; }},
      {"heavy_ratio", [](minikv_config &c) { c.heavy_ratio = NAN; }},
      {"recent_ratio", [](minikv_config &c) { c.recent_ratio = -1.0f; }},
      {"recent_ratio", [](minikv_config &c) { c.recent_ratio = INFINITY; }},
      {"budget_policy",
       [](minikv_config &c) { c.budget_policy = static_cast<minikv_budget_policy>(2); }},
      {"pyramid_depth", [](minikv_config &c) { c.pyramid_depth = 0.5f; }},
      {"pyramid_depth", [](minikv_config &c) { c.pyramid_depth = NAN; }},
      {"score_mode", [](minikv_config &c) { c.score_mode = static_cast<minikv_score_mode>(2); }},
      {"window_size", [](minikv_config &c) { c.window_size = 0; }},
      {"pool_kernel", [](minikv_config &c) { c.pool_kernel = 0; }},
      {"pool_kernel", [](minikv_config &c) { c.pool_kernel = 4; }},  // must be odd
      {"key_bits", [](minikv_config &c) { c.key_bits = 3; }},
      {"key_bits", [](minikv_config &c) { c.key_bits = 32; }},
      {"key_bits", [](minikv_config &c) { c.key_bits = 5; }},
      {"value_bits", [](minikv_config &c) { c.value_bits = 6; }},
      {"value_bits", [](minikv_config &c) { c.value_bits = 1; }},
      {"value_bits", [](minikv_config &c) { c.value_bits = 0; }},
      {"group_size", [](minikv_config &c) { c.group_size = 8; }},
      {"group_size", [](minikv_config &c) { c.group_size = 48; }},
      {"residual_length", [](minikv_config &c) { c.residual_length = 24; }},  // not k*G
      {"residual_length", [](minikv_config &c) { c.residual_length = 0; }},
      {"residual_length", [](minikv_config &c) { c.residual_length = 8; }},  // < G
      {"sink_tokens", [](minikv_config &c) { c.sink_tokens = 65; }},
      {"sink_tokens", [](minikv_config &c) { c.sink_tokens = UINT32_MAX; }},
  };
  for (const Bad &b : bad) {
    minikv_config c = valid();
    b.set(c);
    CAPTURE(b.field);
    CHECK(create_status(c, b.field) == MINIKV_ERR_INVALID_ARGUMENT);
  }
}

TEST_CASE("config: the message lists the allowed values") {
  minikv_config c = valid();
  c.group_size = 8;
  CHECK(create_status(c, "group_size") == MINIKV_ERR_INVALID_ARGUMENT);
  const std::string msg = minikv_last_error_message();
  CHECK(msg.find("16") != std::string::npos);
  CHECK(msg.find("128") != std::string::npos);
}

TEST_CASE("config: num_heads must be a multiple of num_kv_heads") {
  minikv_config c = valid();
  c.num_heads = 12;
  c.num_kv_heads = 8;
  CHECK(create_status(c, "num_kv_heads") == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("num_heads") != std::string::npos);
  c.num_heads = 16;  // 2 per group: fine
  CHECK(create_status(c, "") == MINIKV_OK);
}

TEST_CASE("config: head_dim must be a multiple of group_size (quantized values)") {
  minikv_config c = valid();
  c.head_dim = 48;
  c.group_size = 32;
  c.residual_length = 128;
  CHECK(create_status(c, "group_size") == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("head_dim") != std::string::npos);
  c.value_bits = 16;  // values unquantized: no channel groups needed
  CHECK(create_status(c, "") == MINIKV_OK);
}

TEST_CASE("config: accepted edge values") {
  minikv_config c = valid();
  SUBCASE("bits 4 and 16, mixed") {
    c.key_bits = 4;
    c.value_bits = 16;
  }
  SUBCASE("bits 8 and 2, mixed") {
    c.key_bits = 8;
    c.value_bits = 2;
  }
  SUBCASE("group 128 with head_dim 128") {
    c.head_dim = 128;
    c.group_size = 128;
    c.residual_length = 256;
  }
  SUBCASE("ratios 0 and 1") {
    c.heavy_ratio = 0.0f;
    c.recent_ratio = 1.0f;
  }
  SUBCASE("pyramid depth 1, window mode, pool kernel 1") {
    c.budget_policy = MINIKV_BUDGET_PYRAMID;
    c.pyramid_depth = 1.0f;
    c.score_mode = MINIKV_SCORE_WINDOW;
    c.pool_kernel = 1;
  }
  SUBCASE("sink_tokens 64, the largest") { c.sink_tokens = 64; }
  SUBCASE("flush_tokens: any value (rounded up to whole groups, at most R)") {
    c.flush_tokens = c.group_size;
    for (uint32_t f : {1u, 8u, 24u, 128u, 129u, 4096u, UINT32_MAX}) {
      CAPTURE(f);
      minikv_config d = valid();
      d.flush_tokens = f;
      CHECK(create_status(d, "") == MINIKV_OK);
    }
  }
  SUBCASE("head_dim 16 and 256") {
    c.head_dim = 256;
    minikv_config d = valid();
    d.head_dim = 16;
    CHECK(create_status(d, "") == MINIKV_OK);
  }
  CHECK(create_status(c, "") == MINIKV_OK);
}

TEST_CASE("config: NULL arguments") {
  minikv_config c = valid();
  minikv_cache *cache = reinterpret_cast<minikv_cache *>(0x1);
  CHECK(minikv_cache_create(nullptr, &cache) == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(cache == nullptr);
  CHECK(std::string(minikv_last_error_message()).find("config") != std::string::npos);
  CHECK(minikv_cache_create(&c, nullptr) == MINIKV_ERR_INVALID_ARGUMENT);
  CHECK(std::string(minikv_last_error_message()).find("out") != std::string::npos);
}

TEST_CASE("config: struct_size versioning") {
  // A caller with a newer header: the struct is larger than ours.
  struct Bigger {
    minikv_config cfg;
    uint64_t future_fields[4];
  };
  Bigger big;
  std::memset(&big, 0, sizeof(big));
  big.cfg = valid();

  SUBCASE("too small is VERSION_MISMATCH") {
    minikv_config c = valid();
    for (uint32_t size : {0u, 4u, 92u}) {  // below the first version (96 bytes)
      c.struct_size = size;
      CAPTURE(size);
      CHECK(create_status(c, "struct_size") == MINIKV_ERR_VERSION_MISMATCH);
    }
  }
  SUBCASE("larger with a zero tail is accepted") {
    big.cfg.struct_size = sizeof(Bigger);
    minikv_cache *cache = nullptr;
    MKV_REQUIRE_OK(minikv_cache_create(&big.cfg, &cache));
    minikv_cache_destroy(cache);
  }
  SUBCASE("larger with a non-zero tail is VERSION_MISMATCH") {
    big.cfg.struct_size = sizeof(Bigger);
    big.future_fields[3] = 1;
    CHECK(create_status(big.cfg, "struct_size") == MINIKV_ERR_VERSION_MISMATCH);
  }
  SUBCASE("prefill_staging_tokens is read only when struct_size covers it") {
    big.cfg.prefill_staging_tokens = big.cfg.max_sequences * big.cfg.max_seq_len + 1;
    CHECK(create_status(big.cfg, "prefill_staging_tokens") == MINIKV_ERR_INVALID_ARGUMENT);
    big.cfg.struct_size = 100;  // a caller whose struct ends with sink_tokens: not read
    CHECK(create_status(big.cfg, "") == MINIKV_OK);
  }
  SUBCASE("reserved_v3_ must be 0: a newer caller's field is refused, not ignored") {
    big.cfg.reserved_v3_ = 1;
    CHECK(create_status(big.cfg, "reserved_v3_") == MINIKV_ERR_VERSION_MISMATCH);
  }
  SUBCASE("a tail byte just past our struct counts") {
    big.cfg.struct_size = sizeof(minikv_config) + 1;
    reinterpret_cast<unsigned char *>(&big)[sizeof(minikv_config)] = 7;
    CHECK(create_status(big.cfg, "struct_size") == MINIKV_ERR_VERSION_MISMATCH);
    // ... but bytes beyond the caller's struct_size are not read.
    reinterpret_cast<unsigned char *>(&big)[sizeof(minikv_config)] = 0;
    big.future_fields[3] = 9;
    minikv_cache *cache = nullptr;
    MKV_REQUIRE_OK(minikv_cache_create(&big.cfg, &cache));
    minikv_cache_destroy(cache);
  }
}

TEST_CASE("config: a struct_size without flush_tokens flushes the whole residual") {
  // The bytes where flush_tokens would be are not read: a caller built before the field
  // keeps the flush its library had (stats after the first flushes tell the two apart).
  auto used_after_appends = [](minikv_config c) {
    c.residual_length = 64;
    c.heavy_ratio = 1.0f;  // keep the 10 prompt tokens
    test::CachePtr cache = test::make_cache(c);
    test::Rng rng(5);
    const uint32_t H = c.num_heads, Hkv = c.num_kv_heads, D = c.head_dim, L = 10, seq = 0;
    test::Buf q(c.dtype, size_t(L) * H * D), k(c.dtype, size_t(L) * Hkv * D), v(c.dtype, size_t(L) * Hkv * D),
        out(c.dtype, size_t(L) * H * D);
    q.fill_normal(rng);
    k.fill_normal(rng);
    v.fill_normal(rng);
    const int32_t cu[2] = {0, int32_t(L)};
    for (uint32_t l = 0; l < c.num_layers; ++l) {
      MKV_REQUIRE_OK(minikv_prefill(cache.get(), l, 1, &seq, cu, q.data(), k.data(), v.data(), out.data(), nullptr));
      for (uint32_t t = 0; t < 80; ++t)
        MKV_REQUIRE_OK(minikv_append(cache.get(), l, 1, &seq, k.data(), v.data(), nullptr));
    }
    minikv_memory_stats st{};
    st.struct_size = sizeof(st);
    MKV_REQUIRE_OK(minikv_memory_stats_get(cache.get(), &st));
    return st.used_bytes;
  };
  minikv_config whole = valid(), sliding = valid(), old = valid();
  whole.flush_tokens = 0;
  sliding.flush_tokens = 32;
  old.flush_tokens = 32;
  old.struct_size = offsetof(minikv_config, flush_tokens);
  const uint64_t w = used_after_appends(whole);
  CHECK(used_after_appends(old) == w);
  CHECK(used_after_appends(sliding) != w);
}

TEST_CASE("config: a pool that cannot be addressed is rejected before any allocation") {
  minikv_config c = valid();
  c.max_tokens = uint64_t(1) << 62;
  minikv_cache *cache = nullptr;
  const minikv_status st = minikv_cache_create(&c, &cache);
  CHECK((st == MINIKV_ERR_INVALID_ARGUMENT || st == MINIKV_ERR_OUT_OF_MEMORY));
  CHECK(cache == nullptr);
  CHECK(std::string(minikv_last_error_message()).find("max_tokens") != std::string::npos);
}

TEST_CASE("config: max_tokens within residual_length of 2^64 is rejected (no wrap)") {
  // ceil(max_tokens / R) computed as (max_tokens + R - 1) / R wrapped to a pool of 0 blocks:
  // create said OK and every prefill then failed with CAPACITY_EXCEEDED.
  for (uint64_t max_tokens : {UINT64_MAX, UINT64_MAX - 1, UINT64_MAX - 126, uint64_t(1) << 63}) {
    CAPTURE(max_tokens);
    minikv_config c = valid();
    c.max_tokens = max_tokens;
    CHECK(create_status(c, "minikv_cache_create: max_tokens") == MINIKV_ERR_INVALID_ARGUMENT);
  }
}

TEST_CASE("config: pool-size errors name the call and the fields that cause them") {
  SUBCASE("max_sequences x num_layers residual slots") {
    minikv_config c = valid();
    c.max_sequences = 1u << 20;
    c.num_layers = 4096;
    c.max_seq_len = 16;
    c.max_tokens = 1024;  // the pool itself is small: max_tokens is not the cause
    CHECK(create_status(c, "minikv_cache_create: max_sequences (1048576) x num_layers (4096)") ==
          MINIKV_ERR_INVALID_ARGUMENT);
    CHECK(std::string(minikv_last_error_message()).find("max_tokens") == std::string::npos);
  }
  SUBCASE("the default pool of max_tokens = 0") {
    minikv_config c = valid();
    c.max_sequences = 1u << 16;
    c.num_layers = 64;
    c.max_seq_len = 1u << 20;
    const std::string want =
        "minikv_cache_create: max_tokens = 0 reserves max_sequences (65536) x num_layers (64) x "
        "ceil(max_seq_len (1048576) / residual_length (128))";
    CHECK(create_status(c, want.c_str()) == MINIKV_ERR_INVALID_ARGUMENT);
  }
  SUBCASE("the block tables") {
    minikv_config c = valid();
    c.max_sequences = 1u << 12;
    c.num_layers = 64;
    c.max_seq_len = 1u << 30;
    c.max_tokens = uint64_t(1) << 30;  // 2^23 blocks: each table could hold them all
    CHECK(create_status(c, "minikv_cache_create: the block tables need max_sequences (4096) x "
                           "num_layers (64)") == MINIKV_ERR_INVALID_ARGUMENT);
  }
  SUBCASE("a pool larger than the machine") {
    minikv_config c = valid();
    c.max_tokens = uint64_t(1) << 37;  // 2^30 blocks of 128 tokens: 2^30 x 96 KiB
    c.num_kv_heads = 8;
    c.num_heads = 8;
    c.head_dim = 128;
    CHECK(create_status(c, "minikv_cache_create: the block pool") == MINIKV_ERR_OUT_OF_MEMORY);
    CHECK(std::string(minikv_last_error_message()).find("lower max_tokens") != std::string::npos);
  }
}

TEST_CASE("config: CUDA backend absent is UNSUPPORTED on a CPU-only build") {
  minikv_config c = valid();
  c.backend = MINIKV_BACKEND_CUDA;
  minikv_cache *cache = nullptr;
  const minikv_status st = minikv_cache_create(&c, &cache);
  if (st == MINIKV_OK) {
    minikv_cache_destroy(cache);  // a CUDA build with a device: fine
  } else {
    CHECK((st == MINIKV_ERR_UNSUPPORTED || st == MINIKV_ERR_DEVICE));
    CHECK(cache == nullptr);
    CHECK(std::string(minikv_last_error_message()).find("CUDA") != std::string::npos);
  }
}

TEST_CASE("config: AUTO resolves to a concrete backend and CPU stays CPU") {
  minikv_config c = valid();
  c.backend = MINIKV_BACKEND_AUTO;
  test::CachePtr cache = test::make_cache(c);
  minikv_backend b = MINIKV_BACKEND_AUTO;
  MKV_REQUIRE_OK(minikv_cache_backend(cache.get(), &b));
  CHECK((b == MINIKV_BACKEND_CPU || b == MINIKV_BACKEND_CUDA));
  c.backend = MINIKV_BACKEND_CPU;
  test::CachePtr cpu = test::make_cache(c);
  MKV_REQUIRE_OK(minikv_cache_backend(cpu.get(), &b));
  CHECK(b == MINIKV_BACKEND_CPU);
}

TEST_CASE("status strings and version") {
  for (int s = 0; s <= 8; ++s) {
    const char *text = minikv_status_string(static_cast<minikv_status>(s));
    REQUIRE(text != nullptr);
    CHECK(std::strlen(text) > 0);
  }
  CHECK(std::string(minikv_status_string(MINIKV_ERR_BAD_STATE)).find("BAD_STATE") !=
        std::string::npos);
  CHECK(std::string(minikv_status_string(MINIKV_ERR_CAPACITY_EXCEEDED)).find("CAPACITY") !=
        std::string::npos);
  CHECK(minikv_status_string(static_cast<minikv_status>(9999)) != nullptr);
  CHECK(minikv_status_string(static_cast<minikv_status>(-1)) != nullptr);
  CHECK(minikv_version_number() == MINIKV_VERSION_NUMBER);
  const std::string v = std::to_string(MINIKV_VERSION_MAJOR) + "." +
                        std::to_string(MINIKV_VERSION_MINOR) + "." +
                        std::to_string(MINIKV_VERSION_PATCH);
  CHECK(std::string(minikv_version_string()) == v);
  CHECK(MINIKV_OK == 0);
  CHECK(MINIKV_ERR_INVALID_ARGUMENT == 1);
  CHECK(MINIKV_ERR_OUT_OF_MEMORY == 2);
  CHECK(MINIKV_ERR_CAPACITY_EXCEEDED == 3);
  CHECK(MINIKV_ERR_BAD_STATE == 4);
  CHECK(MINIKV_ERR_UNSUPPORTED == 5);
  CHECK(MINIKV_ERR_DEVICE == 6);
  CHECK(MINIKV_ERR_VERSION_MISMATCH == 7);
  CHECK(MINIKV_ERR_INTERNAL == 8);
}

}  // TEST_SUITE
