// The CUDA backend at the edges of its inputs (issue 17):
//   - extreme finite values: fp16 K/V at +-65504, whose 2-bit groups dequantize to 65520 and
//     65536 (past the fp16 maximum), and bf16 K/V of magnitude 2^60 (with |q| |k| ~ 1, the
//     bound minikv.h states for CUDA bf16), give finite outputs
//     that match the CPU backend (which clamps dequantized values and outputs) in prefill,
//     decode and append_decode, on each decode kernel (fast, k4v2, mma, generic);
//   - non-finite inputs (NaN, +-inf in q, k or v, at prefill, append, decode and
//     append_decode) stay inside the (sequence, layer) they were given for: the other
//     sequences' outputs are bit for bit those of a control cache that never saw them, the
//     lengths and statistics are equal, the device reports no error, and once the poisoned
//     sequence is released its slot computes as the control's again.
//   - misaligned device pointers (q, k, v or out 2, 4 or 8 bytes past a 16-byte boundary)
//     at prefill, prefill_chunk, append, decode and append_decode fail with
//     MINIKV_ERR_INVALID_ARGUMENT naming the tensor and its address, write no output, leave
//     the cache bit for bit as a control cache that never saw them, and later calls compute
//     as the control's.
// Skipped without a CUDA device.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cpu_gpu_pair.h"
#include "gpu_util.h"
#include "white_box.hpp"

namespace {

using gt::DevBuf;
using gt::Tensor;

struct CacheDeleter {
  void operator()(minikv_cache *c) const { minikv_cache_destroy(c); }
};
using CachePtr = std::unique_ptr<minikv_cache, CacheDeleter>;

CachePtr make(minikv_config cfg, minikv_backend backend) {
  cfg.backend = backend;
  minikv_cache *c = nullptr;
  MKV_OK(minikv_cache_create(&cfg, &c));
  return CachePtr(c);
}

minikv_config config_of(minikv_dtype dt, uint32_t key_bits, uint32_t value_bits, uint32_t group,
                        uint32_t sinks, uint32_t heads, uint32_t kv_heads) {
  minikv_config cfg;
  minikv_config_default(&cfg);
  cfg.dtype = dt;
  cfg.num_layers = 2;
  cfg.num_heads = heads;
  cfg.num_kv_heads = kv_heads;
  cfg.head_dim = 128;
  cfg.max_sequences = 4;
  cfg.max_seq_len = 1024;
  cfg.key_bits = key_bits;
  cfg.value_bits = value_bits;
  cfg.group_size = group;
  cfg.residual_length = 2 * group;
  cfg.sink_tokens = sinks;
  return cfg;
}

DevBuf upload(const Tensor &t) {
  DevBuf d(t.size() * 2);
  d.upload(t.bits);
  return d;
}

// Random q, k, v of `rows` rows (packed prompt tokens, or one per sequence of a batch).
struct Inputs {
  Tensor q, k, v;
  Inputs(const minikv_config &cfg, size_t rows, std::mt19937 &rng)
      : q(cfg.dtype, rows * cfg.num_heads * cfg.head_dim),
        k(cfg.dtype, rows * cfg.num_kv_heads * cfg.head_dim),
        v(cfg.dtype, rows * cfg.num_kv_heads * cfg.head_dim) {
    q.fill_normal(rng, 1.0f);
    k.fill_normal(rng, 1.5f);
    v.fill_normal(rng, 1.0f);
  }
};

// One call on a CPU cache (host tensors) and a CUDA cache (the same tensors on the device);
// returns both outputs (empty when the call has none).
struct Outputs {
  Tensor cpu, gpu;
};

class Twin {
 public:
  explicit Twin(const minikv_config &cfg)
      : cfg_(cfg), cpu_(make(cfg, MINIKV_BACKEND_CPU)), gpu_(make(cfg, MINIKV_BACKEND_CUDA)) {}
  const minikv_config &cfg() const { return cfg_; }

  Outputs prefill(uint32_t layer, const std::vector<uint32_t> &ids, const std::vector<int32_t> &cu,
                  const Tensor &q, const Tensor &k, const Tensor &v) {
    Outputs o{Tensor(cfg_.dtype, q.size()), Tensor()};
    MKV_OK(minikv_prefill(cpu_.get(), layer, n(ids), ids.data(), cu.data(), q.bits.data(),
                          k.bits.data(), v.bits.data(), o.cpu.bits.data(), nullptr));
    DevBuf dq = upload(q), dk = upload(k), dv = upload(v), dout(q.size() * 2);
    MKV_OK(minikv_prefill(gpu_.get(), layer, n(ids), ids.data(), cu.data(), dq.get(), dk.get(),
                          dv.get(), dout.get(), nullptr));
    o.cpu = Tensor::from_host_bits(cfg_.dtype, o.cpu.bits);
    o.gpu = Tensor::from_device(cfg_.dtype, dout, q.size());
    return o;
  }

  // minikv_append_decode, or minikv_append then minikv_decode.
  Outputs step(uint32_t layer, const std::vector<uint32_t> &ids, const Tensor &q, const Tensor &k,
               const Tensor &v, bool fused) {
    Outputs o{Tensor(cfg_.dtype, q.size()), Tensor()};
    DevBuf dq = upload(q), dk = upload(k), dv = upload(v), dout(q.size() * 2);
    if (fused) {
      MKV_OK(minikv_append_decode(cpu_.get(), layer, n(ids), ids.data(), q.bits.data(),
                                  k.bits.data(), v.bits.data(), o.cpu.bits.data(), nullptr));
      MKV_OK(minikv_append_decode(gpu_.get(), layer, n(ids), ids.data(), dq.get(), dk.get(),
                                  dv.get(), dout.get(), nullptr));
    } else {
      MKV_OK(minikv_append(cpu_.get(), layer, n(ids), ids.data(), k.bits.data(), v.bits.data(), nullptr));
      MKV_OK(minikv_decode(cpu_.get(), layer, n(ids), ids.data(), q.bits.data(), o.cpu.bits.data(), nullptr));
      MKV_OK(minikv_append(gpu_.get(), layer, n(ids), ids.data(), dk.get(), dv.get(), nullptr));
      MKV_OK(minikv_decode(gpu_.get(), layer, n(ids), ids.data(), dq.get(), dout.get(), nullptr));
    }
    o.cpu = Tensor::from_host_bits(cfg_.dtype, o.cpu.bits);
    o.gpu = Tensor::from_device(cfg_.dtype, dout, q.size());
    return o;
  }

 private:
  static uint32_t n(const std::vector<uint32_t> &ids) { return static_cast<uint32_t>(ids.size()); }
  minikv_config cfg_;
  CachePtr cpu_, gpu_;
};

// Fills a [rows][heads][D] tensor with fn(row, head, channel).
Tensor make_tensor(minikv_dtype dt, size_t rows, uint32_t heads, uint32_t D,
                   const std::function<float(size_t, uint32_t, uint32_t)> &fn) {
  Tensor t(dt, rows * heads * D);
  for (size_t r = 0; r < rows; ++r)
    for (uint32_t h = 0; h < heads; ++h)
      for (uint32_t c = 0; c < D; ++c) t.set((r * heads + h) * D + c, fn(r, h, c));
  return t;
}

// Values at the edge of the range: in every group of G channels, one channel 0 and the
// others +-M (sign by channel parity), so each 2-bit value group spans [-M, M] or [0, M] and
// dequantizes past M; keys likewise along tokens. Queries small, so logits stay moderate.
// Every prompt token is kept (the budget covers the prompt): the keys' pattern makes many
// scores equal, and the point here is quantization and decode, not selection.
void run_extreme(minikv_config cfg, float M, const char *what, const char *kernel = nullptr) {
  // Values of magnitude M with alternating signs cancel: the probabilities' one rounding to
  // the dtype (the prefill forward's P·V operand, the tensor-core decode's p · s_v) moves an
  // output by up to that rounding times M, whatever the output's own size. Derived bound:
  // 2^-11 · M (fp16) or 2^-8 · M (bf16) per rounding, twice for the output's own rounding
  // and the CPU's, on top of the usual tolerance.
  gt::Tol tol = gt::attention_tol(cfg.dtype);
  tol.atol += 2.0 * M * (cfg.dtype == MINIKV_DTYPE_F16 ? 0x1p-11 : 0x1p-8);
  INFO(what);
  cfg.heavy_ratio = 0.6f;
  cfg.recent_ratio = 0.5f;
  const gt::DecodeKernelChoice choice(kernel);
  Twin twin(cfg);
  const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim, G = cfg.group_size;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  auto value = [&](size_t t, uint32_t, uint32_t c) {
    return c % G == 0 ? 0.0f : (c % 2 ? M : (t % 3 == 0 ? -M : M));
  };
  auto key = [&](size_t t, uint32_t, uint32_t c) { return t % G == 0 ? 0.0f : (c % 2 ? M : -M); };
  auto query = [&](size_t, uint32_t, uint32_t) { return nd(rng) * (1.0f / M); };
  const std::vector<uint32_t> ids = {2, 0};
  const std::vector<int32_t> cu = {0, 300, 341};
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const Outputs o = twin.prefill(layer, ids, cu, make_tensor(cfg.dtype, 341, H, D, query),
                                   make_tensor(cfg.dtype, 341, Hkv, D, key),
                                   make_tensor(cfg.dtype, 341, Hkv, D, value));
    gt::check_close(o.gpu, o.cpu, tol, "prefill layer " + std::to_string(layer));
  }
  for (uint32_t step = 0; step < 3 * cfg.residual_length; ++step) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const Outputs o = twin.step(layer, ids, make_tensor(cfg.dtype, 2, H, D, query),
                                  make_tensor(cfg.dtype, 2, Hkv, D, [&](size_t r, uint32_t h, uint32_t c) {
                                    return key(step + r, h, c);
                                  }),
                                  make_tensor(cfg.dtype, 2, Hkv, D, value), step % 2 == 1);
      gt::check_close(o.gpu, o.cpu, tol,
                      "step " + std::to_string(step) + " layer " + std::to_string(layer));
    }
  }
}

// A call's device tensors, each with 16 bytes (8 elements) to spare past its end so that a
// shifted pointer stays inside the allocation; out, spare included, starts as a sentinel.
constexpr uint16_t kOutSentinel = 0x5a5a;
constexpr size_t kSpare = 8;
struct DeviceIo {
  DevBuf q, k, v, out;
  size_t out_elems;
  explicit DeviceIo(const Inputs &in)
      : q((in.q.size() + kSpare) * 2), k((in.k.size() + kSpare) * 2),
        v((in.v.size() + kSpare) * 2), out((in.q.size() + kSpare) * 2),
        out_elems(in.q.size()) {
    q.upload(in.q.bits);
    k.upload(in.k.bits);
    v.upload(in.v.bits);
    out.upload(std::vector<uint16_t>(out_elems + kSpare, kOutSentinel));
  }
};

// The two caches agree on everything a call could have changed: pool and residual bytes,
// kept positions, lengths and statistics.
void check_same_cache(minikv_cache *a, minikv_cache *b, const minikv_config &cfg,
                      const std::string &when) {
  INFO(when);
  test::check_same_storage(a, b, when);
  for (uint32_t id = 0; id < cfg.max_sequences; ++id)
    for (uint32_t layer = 0; layer < cfg.num_layers; ++layer) {
      uint64_t seen_a = 0, cached_a = 0, seen_b = 1, cached_b = 1;
      MKV_OK(minikv_sequence_length(a, id, layer, &seen_a, &cached_a));
      MKV_OK(minikv_sequence_length(b, id, layer, &seen_b, &cached_b));
      CHECK(seen_a == seen_b);
      CHECK(cached_a == cached_b);
      if (seen_a == 0) continue;  // not prefilled, or mid-prompt
      for (uint32_t kvh = 0; kvh < cfg.num_kv_heads; ++kvh) {
        std::vector<int32_t> pa(cfg.max_seq_len, -1), pb(cfg.max_seq_len, -1);
        uint32_t na = 0, nb = 0;
        MKV_OK(minikv_kept_positions(a, id, layer, kvh, pa.data(), cfg.max_seq_len, &na));
        MKV_OK(minikv_kept_positions(b, id, layer, kvh, pb.data(), cfg.max_seq_len, &nb));
        CHECK(na == nb);
        CHECK(pa == pb);
      }
    }
  gt::check_stats_equal(a, b);
}

// call(q, k, v, out) once for each tensor of `tensors` ("q", "k", "v", "out") shifted by 2, 4
// and 8 bytes, the others aligned: every one fails with INVALID_ARGUMENT and a message naming
// the call, the tensor, its address and the 16-byte requirement; out keeps its sentinel; the
// cache stays as `control`.
using TensorCall = std::function<minikv_status(void *q, void *k, void *v, void *out)>;
void expect_misaligned_fail(minikv_cache *cache, minikv_cache *control,
                            const minikv_config &cfg, const char *call_name, DeviceIo &io,
                            std::initializer_list<const char *> tensors, const TensorCall &call) {
  INFO(call_name);
  for (const char *tensor : tensors) {
    for (const size_t offset : {2u, 4u, 8u}) {
      void *ptr[4] = {io.q.get(), io.k.get(), io.v.get(), io.out.get()};
      const int which = std::string("qkvo").find(tensor[0]);
      ptr[which] = static_cast<uint8_t *>(ptr[which]) + offset;
      INFO(tensor << " shifted by " << offset << " bytes");
      CHECK(call(ptr[0], ptr[1], ptr[2], ptr[3]) == MINIKV_ERR_INVALID_ARGUMENT);
      char address[32];
      std::snprintf(address, sizeof address, "%p", ptr[which]);
      const std::string message = minikv_cache_last_error(cache);
      INFO("message: " << message);
      CHECK(message.find(std::string(call_name) + ": " + tensor + " (" + address + ")") !=
            std::string::npos);
      CHECK(message.find("must be aligned to 16 bytes") != std::string::npos);
    }
  }
  const std::vector<uint16_t> out = io.out.download<uint16_t>(io.out_elems + kSpare);
  CHECK(std::all_of(out.begin(), out.end(), [](uint16_t x) { return x == kOutSentinel; }));
  CUDA_OK(cudaGetLastError());
  check_same_cache(cache, control, cfg, std::string("after the misaligned ") + call_name);
}

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA outputs stay finite and match the CPU for fp16 values at 65504") {
  GPU_OR_SKIP();
  // Before the outputs were clamped, fp16 decode returned +inf here (a mean of values that
  // dequantize to 65520), where the CPU backend returns 65504.
  const minikv_dtype F16 = MINIKV_DTYPE_F16;
  run_extreme(config_of(F16, 2, 2, 16, 0, 8, 2), 65504.0f, "fast kernel: 2-bit, G 16, GQA 4");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "k4v2 kernel: 4/2-bit, G 32, 4 sinks");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "mma kernel: 4/2-bit, G 32, 4 sinks", "mma");
  run_extreme(config_of(F16, 4, 2, 32, 4, 4, 4), 65504.0f, "k4v2-warp kernel: 4/2-bit, G 32, 4 sinks, MHA",
              "k4v2-warp");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "k4v2-warp kernel: 4/2-bit, G 32, 4 sinks, GQA 4",
              "k4v2-warp");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "generic kernel: 4/2-bit, G 32, 4 sinks",
              "generic");
  run_extreme(config_of(F16, 16, 16, 16, 0, 4, 4), 65504.0f, "generic kernel: 16-bit storage, MHA");
}

TEST_CASE("CUDA bf16 values of magnitude 2^60 decode as on the CPU") {
  GPU_OR_SKIP();
  const float M = 1152921504606846976.0f;  // 2^60: the bound minikv.h states for CUDA bf16
  const minikv_dtype BF16 = MINIKV_DTYPE_BF16;
  run_extreme(config_of(BF16, 2, 2, 16, 0, 4, 4), M, "fast kernel");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "k4v2 kernel");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "mma kernel", "mma");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 4, 4), M, "k4v2-warp kernel MHA", "k4v2-warp");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "k4v2-warp kernel GQA 4", "k4v2-warp");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "generic kernel", "generic");
}

TEST_CASE("non-finite inputs on CUDA stay inside their sequence and layer") {
  GPU_OR_SKIP();
  for (const char *kernel : {"fast", "k4v2", "k4v2-warp", "mma", "generic"}) {
    CAPTURE(kernel);
    const bool fast = kernel[0] == 'f';
    const minikv_config cfg = fast ? config_of(MINIKV_DTYPE_F16, 2, 2, 16, 0, 8, 2)
                                   : config_of(MINIKV_DTYPE_BF16, 4, 2, 32, 4, 8, 2);
    const gt::DecodeKernelChoice choice(kernel);
    CachePtr poisoned = make(cfg, MINIKV_BACKEND_CUDA), control = make(cfg, MINIKV_BACKEND_CUDA);
    const uint32_t H = cfg.num_heads, Hkv = cfg.num_kv_heads, D = cfg.head_dim;
    const size_t q_row = size_t(H) * D, kv_row = size_t(Hkv) * D;
    const std::vector<uint32_t> ids = {0, 1, 2};  // sequence 1 (batch row 1) gets the poison
    const std::vector<int32_t> cu = {0, 200, 350, 420};
    std::mt19937 rng(11);
    const float specials[] = {NAN, INFINITY, -INFINITY};
    // The rows [first, second) of `rows` are equal, element for element, in a and b.
    auto outputs_agree = [&](const std::vector<uint16_t> &a, const std::vector<uint16_t> &b,
                             size_t row_elems, const std::vector<std::pair<size_t, size_t>> &rows,
                             const std::string &what) {
      INFO(what);
      for (const auto &r : rows)
        for (size_t i = r.first * row_elems; i < r.second * row_elems; ++i) {
          if (a[i] != b[i]) {
            FAIL_CHECK("element " << i << " differs: " << a[i] << " vs " << b[i]);
            return;
          }
        }
    };
    auto compare_lengths_and_stats = [&](const char *when) {
      INFO(when);
      for (uint32_t id = 0; id < 4; ++id)
        for (uint32_t layer = 0; layer < 2; ++layer) {
          uint64_t sa = 0, ca = 0, sb = 1, cb = 1;
          MKV_OK(minikv_sequence_length(poisoned.get(), id, layer, &sa, &ca));
          MKV_OK(minikv_sequence_length(control.get(), id, layer, &sb, &cb));
          CHECK(sa == sb);
          CHECK(ca == cb);
        }
      minikv_memory_stats a{}, b{};
      a.struct_size = b.struct_size = sizeof(minikv_memory_stats);
      MKV_OK(minikv_memory_stats_get(poisoned.get(), &a));
      MKV_OK(minikv_memory_stats_get(control.get(), &b));
      CHECK(a.used_bytes == b.used_bytes);
      CHECK(a.tokens_seen == b.tokens_seen);
      CHECK(a.tokens_cached == b.tokens_cached);
    };
    // Prefill: seq_id 1's prompt (tokens 200..349) with NaN in q, +inf in k, -inf in v;
    // rows 230 and 240 sit in the last key tile of sequence 0 (keys 128..255 of a 128-key
    // tile), past its last key.
    for (uint32_t layer = 0; layer < 2; ++layer) {
      Inputs in(cfg, 420, rng);
      DevBuf dq = upload(in.q), dk = upload(in.k), dv = upload(in.v), oa(420 * q_row * 2), ob(420 * q_row * 2);
      MKV_OK(minikv_prefill(control.get(), layer, 3, ids.data(), cu.data(), dq.get(), dk.get(), dv.get(), ob.get(), nullptr));
      in.q.set(260 * q_row + 5, NAN);
      in.k.set(300 * kv_row + 7, INFINITY);
      in.v.set(349 * kv_row + 1, -INFINITY);
      in.k.set(230 * kv_row + 3, INFINITY);
      in.v.set(240 * kv_row + 2, -INFINITY);
      DevBuf pq = upload(in.q), pk = upload(in.k), pv = upload(in.v);
      MKV_OK(minikv_prefill(poisoned.get(), layer, 3, ids.data(), cu.data(), pq.get(), pk.get(), pv.get(), oa.get(), nullptr));
      outputs_agree(oa.download<uint16_t>(420 * q_row), ob.download<uint16_t>(420 * q_row), q_row,
                    {{0, 200}, {350, 420}}, "prefill outputs of the other sequences");
    }
    compare_lengths_and_stats("after the prefill");
    // Decode steps: sequence 1's q, k or v non-finite in turn, through both entry points.
    for (uint32_t step = 0; step < 70; ++step) {
      CAPTURE(step);
      for (uint32_t layer = 0; layer < 2; ++layer) {
        Inputs in(cfg, 3, rng);
        DevBuf dq = upload(in.q), dk = upload(in.k), dv = upload(in.v), oa(3 * q_row * 2), ob(3 * q_row * 2);
        const bool fused = step % 2 == 0;
        auto call = [&](minikv_cache *c, const DevBuf &qq, const DevBuf &kk, const DevBuf &vv, DevBuf &o) {
          if (fused) {
            MKV_OK(minikv_append_decode(c, layer, 3, ids.data(), qq.get(), kk.get(), vv.get(), o.get(), nullptr));
          } else {
            MKV_OK(minikv_append(c, layer, 3, ids.data(), kk.get(), vv.get(), nullptr));
            MKV_OK(minikv_decode(c, layer, 3, ids.data(), qq.get(), o.get(), nullptr));
          }
        };
        call(control.get(), dq, dk, dv, ob);
        const float x = specials[step % 3];
        switch (step % 4) {
          case 0: in.q.set(q_row + rng() % q_row, x); break;
          case 1: in.k.set(kv_row + rng() % kv_row, x); break;
          case 2: in.v.set(kv_row + rng() % kv_row, x); break;
          default: break;  // a clean step: the sequence's cache already holds the poison
        }
        DevBuf pq = upload(in.q), pk = upload(in.k), pv = upload(in.v);
        call(poisoned.get(), pq, pk, pv, oa);
        outputs_agree(oa.download<uint16_t>(3 * q_row), ob.download<uint16_t>(3 * q_row), q_row,
                      {{0, 1}, {2, 3}}, "decode outputs of the other sequences");
      }
    }
    compare_lengths_and_stats("after the decode steps");
    CUDA_OK(cudaDeviceSynchronize());  // no device fault, nothing sticky
    // Released and prefilled again, the slot computes as the control's: every output equal.
    MKV_OK(minikv_sequence_release(poisoned.get(), 1));
    MKV_OK(minikv_sequence_release(control.get(), 1));
    const std::vector<uint32_t> one = {1};
    const std::vector<int32_t> cu1 = {0, 130};
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const Inputs in(cfg, 130, rng);
      DevBuf dq = upload(in.q), dk = upload(in.k), dv = upload(in.v), oa(130 * q_row * 2), ob(130 * q_row * 2);
      MKV_OK(minikv_prefill(control.get(), layer, 1, one.data(), cu1.data(), dq.get(), dk.get(), dv.get(), ob.get(), nullptr));
      MKV_OK(minikv_prefill(poisoned.get(), layer, 1, one.data(), cu1.data(), dq.get(), dk.get(), dv.get(), oa.get(), nullptr));
      CHECK(oa.download<uint16_t>(130 * q_row) == ob.download<uint16_t>(130 * q_row));
    }
    for (uint32_t step = 0; step < 40; ++step) {
      for (uint32_t layer = 0; layer < 2; ++layer) {
        const Inputs in(cfg, 3, rng);
        DevBuf dq = upload(in.q), dk = upload(in.k), dv = upload(in.v), oa(3 * q_row * 2), ob(3 * q_row * 2);
        MKV_OK(minikv_append_decode(control.get(), layer, 3, ids.data(), dq.get(), dk.get(), dv.get(), ob.get(), nullptr));
        MKV_OK(minikv_append_decode(poisoned.get(), layer, 3, ids.data(), dq.get(), dk.get(), dv.get(), oa.get(), nullptr));
        INFO("after release and a new prompt, step " << step << " layer " << layer);
        CHECK(oa.download<uint16_t>(3 * q_row) == ob.download<uint16_t>(3 * q_row));
      }
    }
    compare_lengths_and_stats("after the new prompt");
  }
}

TEST_CASE("misaligned device pointers fail naming the pointer and change nothing") {
  GPU_OR_SKIP();
  minikv_config cfg = config_of(MINIKV_DTYPE_F16, 2, 2, 16, 0, 8, 2);
  cfg.prefill_staging_tokens = 256;
  CachePtr cache = make(cfg, MINIKV_BACKEND_CUDA), control = make(cfg, MINIKV_BACKEND_CUDA);
  minikv_cache *const both[2] = {cache.get(), control.get()};
  std::mt19937 rng(23);
  // Sequences 0 and 1 prefilled in both layers: the state the failing calls must keep.
  const std::vector<uint32_t> pair = {0, 1};
  const std::vector<int32_t> pair_cu = {0, 100, 170};
  for (uint32_t layer = 0; layer < 2; ++layer) {
    DeviceIo io(Inputs(cfg, 170, rng));
    for (minikv_cache *c : both)
      MKV_OK(minikv_prefill(c, layer, 2, pair.data(), pair_cu.data(), io.q.get(), io.k.get(),
                            io.v.get(), io.out.get(), nullptr));
  }
  const std::vector<uint32_t> two = {2};
  const std::vector<int32_t> cu60 = {0, 60};
  const uint32_t three = 3;
  const int32_t first_chunk[2] = {0, 40}, second_chunk[2] = {0, 50};
  const uint32_t prompt_len = 90;

  // Each call with one tensor misaligned.
  DeviceIo prompt(Inputs(cfg, 60, rng));
  expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_prefill", prompt,
                         {"q", "k", "v", "out"}, [&](void *q, void *k, void *v, void *out) {
                           return minikv_prefill(cache.get(), 0, 1, two.data(), cu60.data(), q,
                                                 k, v, out, nullptr);
                         });
  DeviceIo chunk(Inputs(cfg, 40, rng));
  expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_prefill_chunk", chunk,
                         {"q", "k", "v", "out"}, [&](void *q, void *k, void *v, void *out) {
                           return minikv_prefill_chunk(cache.get(), 0, 1, &three, first_chunk,
                                                       &prompt_len, q, k, v, out, nullptr);
                         });
  DeviceIo step(Inputs(cfg, 2, rng));
  expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_append", step, {"k", "v"},
                         [&](void *, void *k, void *v, void *) {
                           return minikv_append(cache.get(), 1, 2, pair.data(), k, v, nullptr);
                         });
  expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_decode", step, {"q", "out"},
                         [&](void *q, void *, void *, void *out) {
                           return minikv_decode(cache.get(), 1, 2, pair.data(), q, out, nullptr);
                         });
  expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_append_decode", step,
                         {"q", "k", "v", "out"}, [&](void *q, void *k, void *v, void *out) {
                           return minikv_append_decode(cache.get(), 1, 2, pair.data(), q, k, v,
                                                       out, nullptr);
                         });

  // Later calls compute as the control's, bit for bit: a whole prompt, a prompt in two chunks
  // (its second chunk refused misaligned first: the prompt stays mid-way where it was), and
  // decode steps past a flush through both entry points.
  auto same_outputs = [&](const DevBuf &a, const DevBuf &b, size_t n, const std::string &what) {
    INFO(what);
    CHECK(a.download<uint16_t>(n) == b.download<uint16_t>(n));
  };
  for (uint32_t layer = 0; layer < 2; ++layer) {
    const Inputs in(cfg, 60, rng);
    DeviceIo a(in), b(in);
    MKV_OK(minikv_prefill(cache.get(), layer, 1, two.data(), cu60.data(), a.q.get(), a.k.get(),
                          a.v.get(), a.out.get(), nullptr));
    MKV_OK(minikv_prefill(control.get(), layer, 1, two.data(), cu60.data(), b.q.get(),
                          b.k.get(), b.v.get(), b.out.get(), nullptr));
    same_outputs(a.out, b.out, a.out_elems, "prefill, layer " + std::to_string(layer));
    const Inputs first(cfg, 40, rng), second(cfg, 50, rng);
    DeviceIo fa(first), fb(first), sa(second), sb(second);
    MKV_OK(minikv_prefill_chunk(cache.get(), layer, 1, &three, first_chunk, &prompt_len,
                                fa.q.get(), fa.k.get(), fa.v.get(), fa.out.get(), nullptr));
    MKV_OK(minikv_prefill_chunk(control.get(), layer, 1, &three, first_chunk, &prompt_len,
                                fb.q.get(), fb.k.get(), fb.v.get(), fb.out.get(), nullptr));
    same_outputs(fa.out, fb.out, fa.out_elems, "first chunk, layer " + std::to_string(layer));
    expect_misaligned_fail(cache.get(), control.get(), cfg, "minikv_prefill_chunk", sa,
                           {"q", "k", "v", "out"}, [&](void *q, void *k, void *v, void *out) {
                             return minikv_prefill_chunk(cache.get(), layer, 1, &three,
                                                         second_chunk, &prompt_len, q, k, v,
                                                         out, nullptr);
                           });
    MKV_OK(minikv_prefill_chunk(cache.get(), layer, 1, &three, second_chunk, &prompt_len,
                                sa.q.get(), sa.k.get(), sa.v.get(), sa.out.get(), nullptr));
    MKV_OK(minikv_prefill_chunk(control.get(), layer, 1, &three, second_chunk, &prompt_len,
                                sb.q.get(), sb.k.get(), sb.v.get(), sb.out.get(), nullptr));
    same_outputs(sa.out, sb.out, sa.out_elems, "second chunk, layer " + std::to_string(layer));
  }
  const std::vector<uint32_t> all = {0, 1, 2, 3};
  for (uint32_t s = 0; s < cfg.residual_length + 4; ++s) {
    for (uint32_t layer = 0; layer < 2; ++layer) {
      const Inputs in(cfg, 4, rng);
      DeviceIo a(in), b(in);
      for (auto *x : {&a, &b}) {
        minikv_cache *c = x == &a ? cache.get() : control.get();
        if (s % 2 == 0) {
          MKV_OK(minikv_append_decode(c, layer, 4, all.data(), x->q.get(), x->k.get(),
                                      x->v.get(), x->out.get(), nullptr));
        } else {
          MKV_OK(minikv_append(c, layer, 4, all.data(), x->k.get(), x->v.get(), nullptr));
          MKV_OK(minikv_decode(c, layer, 4, all.data(), x->q.get(), x->out.get(), nullptr));
        }
      }
      same_outputs(a.out, b.out, a.out_elems,
                   "step " + std::to_string(s) + ", layer " + std::to_string(layer));
    }
  }
  CUDA_OK(cudaDeviceSynchronize());
  check_same_cache(cache.get(), control.get(), cfg, "after the later calls");
}

}  // TEST_SUITE
