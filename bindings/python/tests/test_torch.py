"""PyTorch tensors: host tensors through the CPU backend (incl. bfloat16), and CUDA tensors
through the CUDA backend compared with the CPU backend. Skipped without torch / CUDA."""
import numpy as np
import pytest

import minikv
from conftest import TOLERANCE, cpu_cache
from reference import causal_attention, decode_attention

torch = pytest.importorskip("torch")

H, HKV, D = 8, 2, 64
TORCH_DTYPES = {minikv.DType.F16: torch.float16, minikv.DType.BF16: torch.bfloat16,
                minikv.DType.F32: torch.float32}


def randn(rng, *shape, dtype=torch.float16, device="cpu"):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device=device, dtype=dtype)


def f64(t):
    return t.detach().to("cpu", torch.float64).numpy()


def test_torch_cpu_tensors_match_numpy(rng):
    cfg = dict(dtype="f16", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_sequences=2, max_seq_len=256, residual_length=32)
    lengths = [50, 33]
    q, k, v = (randn(rng, sum(lengths), n, D) for n in (H, HKV, HKV))
    cu = minikv.cu_seqlens_from_lengths(lengths)
    with cpu_cache(**cfg) as a, cpu_cache(**cfg) as b:
        out_t = a.prefill(0, [0, 1], torch.from_numpy(cu), q, k, v)
        assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float16
        out_n = b.prefill(0, [0, 1], cu, q.numpy(), k.numpy(), v.numpy())
        np.testing.assert_array_equal(out_t.numpy(), out_n)
        out = torch.empty(2, H, D, dtype=torch.float16)
        for _ in range(40):
            kn, vn, qn = randn(rng, 2, HKV, D), randn(rng, 2, HKV, D), randn(rng, 2, H, D)
            a.append(0, [0, 1], kn, vn)
            b.append(0, [0, 1], kn.numpy(), vn.numpy())
            assert a.decode(0, [0, 1], qn, out=out) is out
            np.testing.assert_array_equal(out.numpy(), b.decode(0, [0, 1], qn.numpy()))
        assert a.memory_stats() == b.memory_stats()
        with pytest.raises(ValueError, match="not contiguous"):
            a.decode(0, [0, 1], randn(rng, 2, D, H).transpose(1, 2))
        with pytest.raises(ValueError, match="torch.float32"):
            a.decode(0, [0, 1], randn(rng, 2, H, D, dtype=torch.float32))


def test_bfloat16_through_torch(rng):
    dt = minikv.DType.BF16
    with cpu_cache(dtype="bf16", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
                   max_sequences=2, max_seq_len=128, key_bits=16, value_bits=16,
                   heavy_ratio=1.0, recent_ratio=0.0, residual_length=16) as c:
        qs = [randn(rng, L, H, D, dtype=torch.bfloat16) for L in (20, 9)]
        ks = [randn(rng, L, HKV, D, dtype=torch.bfloat16) for L in (20, 9)]
        vs = [randn(rng, L, HKV, D, dtype=torch.bfloat16) for L in (20, 9)]
        outs = c.prefill(0, [1, 0], None, qs, ks, vs)
        tol = TOLERANCE[dt]
        for qi, ki, vi, oi in zip(qs, ks, vs, outs):
            np.testing.assert_allclose(f64(oi), causal_attention(f64(qi), f64(ki), f64(vi)), rtol=tol, atol=tol)
        hk, hv = [f64(x) for x in ks], [f64(x) for x in vs]
        for _ in range(20):
            kn, vn = randn(rng, 2, HKV, D, dtype=torch.bfloat16), randn(rng, 2, HKV, D, dtype=torch.bfloat16)
            qn = randn(rng, 2, H, D, dtype=torch.bfloat16)
            c.append(0, [1, 0], kn, vn)
            o = c.decode(0, [1, 0], qn)
            for i in range(2):
                hk[i] = np.concatenate([hk[i], f64(kn[i:i + 1])])
                hv[i] = np.concatenate([hv[i], f64(vn[i:i + 1])])
                ref = decode_attention(f64(qn[i]), [hk[i][:, g] for g in range(HKV)],
                                       [hv[i][:, g] for g in range(HKV)])
                np.testing.assert_allclose(f64(o[i]), ref, rtol=tol, atol=tol)
        with pytest.raises(ValueError, match="numpy cannot hold"):
            c.decode(0, [0], np.zeros((1, H, D), np.float16))


# ---- CUDA ------------------------------------------------------------------------------
def cuda_cache_or_skip(**cfg):
    """cpu_cache's configuration (Preset.PAPER under `cfg`) on the CUDA backend."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch")
    try:
        return minikv.Cache(minikv.Config.from_preset("paper", backend="cuda", **cfg))
    except minikv.MinikvError as e:
        if e.status == minikv.Status.UNSUPPORTED:
            pytest.skip(f"no CUDA backend in this libminikv: {e.message}")
        raise


CUDA_CASES = {
    "exact-f16": dict(dtype="f16", key_bits=16, value_bits=16, heavy_ratio=1.0, recent_ratio=0.0),
    "minikv-f16": dict(dtype="f16"),
    "minikv-bf16": dict(dtype="bf16"),
    "minikv-f16-4bit-window": dict(dtype="f16", key_bits=4, value_bits=4, score_mode="window"),
    # A sliding flush: 24 rounds up to 32 (G = 16), the oldest 32 of R = 64 per flush.
    "minikv-f16-flush24": dict(dtype="f16", flush_tokens=24),
}


@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_cuda_backend_matches_cpu_backend(rng, case):
    """torch CUDA tensors through the CUDA backend give what the CPU backend gives for the
    same inputs: prefill and every decode output (to the dtype's tolerance), the kept
    positions and the memory accounting (exactly)."""
    cfg = dict(num_layers=2, num_heads=H, num_kv_heads=HKV, head_dim=D, max_sequences=4,
               max_seq_len=1024, residual_length=64)
    cfg.update(CUDA_CASES[case])
    gpu = cuda_cache_or_skip(**cfg)
    dt = minikv.Config(**cfg).dtype
    tdt = TORCH_DTYPES[dt]
    tol = 2 * TOLERANCE[dt]
    stream = torch.cuda.Stream()
    with gpu, cpu_cache(**cfg) as cpu:
        ids, lengths = [3, 0, 1], [300, 17, 129]
        cu = minikv.cu_seqlens_from_lengths(lengths)
        for layer in range(2):
            q, k, v = (randn(rng, sum(lengths), n, D, dtype=tdt) for n in (H, HKV, HKV))
            ref = cpu.prefill(layer, ids, cu, q, k, v)
            # An explicit torch stream for prefill: it must wait for the copies made on the
            # current stream (the caller's job, as with any CUDA library).
            qd, kd, vd = q.cuda(), k.cuda(), v.cuda()
            stream.wait_stream(torch.cuda.current_stream())
            got = gpu.prefill(layer, ids, cu, qd, kd, vd, stream=stream)
            stream.synchronize()
            assert got.is_cuda and got.dtype == tdt
            np.testing.assert_allclose(f64(got), f64(ref), rtol=tol, atol=tol)
            for s in ids:
                for g in range(HKV):
                    np.testing.assert_array_equal(gpu.kept_positions(s, layer, g),
                                                  cpu.kept_positions(s, layer, g))
        out = torch.empty(3, H, D, dtype=tdt, device="cuda")
        for step in range(150):  # > 2 flushes of R = 64 (3 or more of 32 with flush_tokens 24)
            for layer in range(2):
                kn, vn, qn = (randn(rng, 3, n, D, dtype=tdt) for n in (HKV, HKV, H))
                cpu.append(layer, ids, kn, vn)
                ref = cpu.decode(layer, ids, qn)
                # stream=None: torch's current stream; an int stream handle on odd steps.
                s_arg = None if step % 2 == 0 else torch.cuda.current_stream().cuda_stream
                gpu.append(layer, ids, kn.cuda(), vn.cuda(), stream=s_arg)
                gpu.decode(layer, ids, qn.cuda(), out=out, stream=s_arg)
                np.testing.assert_allclose(f64(out), f64(ref), rtol=tol, atol=tol,
                                           err_msg=f"step {step} layer {layer}")
        torch.cuda.synchronize()
        a, b = gpu.memory_stats(), cpu.memory_stats()
        for field in ("used_bytes", "tokens_seen", "tokens_cached", "fp16_equivalent_bytes",
                      "compression_ratio"):
            assert getattr(a, field) == getattr(b, field), field
        gpu.release(0)
        cpu.release(0)
        assert gpu.memory_stats().used_bytes == cpu.memory_stats().used_bytes


def test_cuda_memory_space_checks(rng):
    cfg = dict(dtype="f16", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D)
    with cuda_cache_or_skip(**cfg) as gpu, cpu_cache(**cfg) as cpu:
        host = randn(rng, 1, H, D)
        with pytest.raises(ValueError, match="host memory"):
            gpu.decode(0, [0], host)
        with pytest.raises(ValueError, match="host memory"):
            gpu.decode(0, [0], host.numpy())
        with pytest.raises(ValueError, match="CPU backend"):
            cpu.decode(0, [0], host.cuda())
        with pytest.raises(ValueError, match="stream must be None"):
            cpu.decode(0, [0], host, stream=torch.cuda.current_stream())
