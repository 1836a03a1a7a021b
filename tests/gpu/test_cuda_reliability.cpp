// The CUDA backend at the edges of its inputs (issue 17):
//   - extreme finite values: fp16 K/V at +-65504, whose 2-bit groups dequantize to 65520 and
//     65536 (past the fp16 maximum), and bf16 K/V of magnitude 2^60 (with |q| |k| ~ 1, the
//     bound minikv.h states for CUDA bf16), give finite outputs
//     that match the CPU backend (which clamps dequantized values and outputs) in prefill,
//     decode and append_decode, on each decode kernel (fast, mma, generic);
//   - non-finite inputs (NaN, +-inf in q, k or v, at prefill, append, decode and
//     append_decode) stay inside the (sequence, layer) they were given for: the other
//     sequences' outputs are bit for bit those of a control cache that never saw them, the
//     lengths and statistics are equal, the device reports no error, and once the poisoned
//     sequence is released its slot computes as the control's again.
// Skipped without a CUDA device.
#include <doctest/doctest.h>

#include <cmath>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gpu_util.h"

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

}  // namespace

TEST_SUITE("gpu") {

TEST_CASE("CUDA outputs stay finite and match the CPU for fp16 values at 65504") {
  GPU_OR_SKIP();
  // Before the outputs were clamped, fp16 decode returned +inf here (a mean of values that
  // dequantize to 65520), where the CPU backend returns 65504.
  const minikv_dtype F16 = MINIKV_DTYPE_F16;
  run_extreme(config_of(F16, 2, 2, 16, 0, 8, 2), 65504.0f, "fast kernel: 2-bit, G 16, GQA 4");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "mma kernel: 4/2-bit, G 32, 4 sinks");
  run_extreme(config_of(F16, 4, 2, 32, 4, 8, 2), 65504.0f, "generic kernel: 4/2-bit, G 32, 4 sinks",
              "generic");
  run_extreme(config_of(F16, 16, 16, 16, 0, 4, 4), 65504.0f, "generic kernel: 16-bit storage, MHA");
}

TEST_CASE("CUDA bf16 values of magnitude 2^60 decode as on the CPU") {
  GPU_OR_SKIP();
  const float M = 1152921504606846976.0f;  // 2^60: the bound minikv.h states for CUDA bf16
  const minikv_dtype BF16 = MINIKV_DTYPE_BF16;
  run_extreme(config_of(BF16, 2, 2, 16, 0, 4, 4), M, "fast kernel");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "mma kernel");
  run_extreme(config_of(BF16, 4, 2, 32, 4, 8, 2), M, "generic kernel", "generic");
}

TEST_CASE("non-finite inputs on CUDA stay inside their sequence and layer") {
  GPU_OR_SKIP();
  for (const char *kernel : {"fast", "mma", "generic"}) {
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

}  // TEST_SUITE
