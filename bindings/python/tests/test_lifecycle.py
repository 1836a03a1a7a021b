"""The whole lifecycle through the CPU backend, checking numbers at every step:
with key_bits = value_bits = 16 and heavy_ratio = 1 the cache keeps every token
unquantized, so prefill must equal causal attention and each decode must equal attention
over the whole history (float64 numpy).

recent_ratio is 0 here: the library clips heavy_ratio to 1 - recent_ratio and floors both
budgets separately, so heavy_ratio = 1 with the default recent_ratio = 0.25 keeps
floor(0.75 L) + floor(0.25 L), one token short of L for e.g. L = 37."""
import numpy as np
import pytest

import minikv
from conftest import NP_DTYPES, TOLERANCE, cpu_cache
from reference import causal_attention, decode_attention

LAYERS, H, HKV, D, R = 2, 4, 2, 32, 16


def exact_config(dtype, **kw):
    cfg = dict(dtype=dtype, num_layers=LAYERS, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_sequences=4, max_seq_len=160, key_bits=16, value_bits=16, heavy_ratio=1.0, recent_ratio=0.0,
               budget_policy="uniform", group_size=16, residual_length=R)
    cfg.update(kw)
    return cfg


def close(actual, expected, dtype, what):
    actual = np.asarray(actual, dtype=np.float64)
    assert np.isfinite(actual).all(), f"{what}: NaN/Inf in the output"
    tol = TOLERANCE[dtype]
    err = np.abs(actual - expected)
    bound = tol + tol * np.abs(expected)
    assert (err <= bound).all(), (f"{what}: max error {err.max():.3g} (at {np.unravel_index(err.argmax(), err.shape)}), "
                                  f"tolerance {tol}")


class History:
    """Per (sequence, layer): every K/V row the sequence has seen, as float64."""

    def __init__(self):
        self.k, self.v = {}, {}

    def add(self, seq, layer, k, v):
        key = (seq, layer)
        self.k[key] = np.concatenate([self.k.get(key, np.zeros((0, HKV, D))), np.asarray(k, np.float64)])
        self.v[key] = np.concatenate([self.v.get(key, np.zeros((0, HKV, D))), np.asarray(v, np.float64)])

    def attend(self, seq, layer, q):
        k, v = self.k[(seq, layer)], self.v[(seq, layer)]
        return decode_attention(q, [k[:, g] for g in range(HKV)], [v[:, g] for g in range(HKV)])

    def drop(self, seq):
        for key in [key for key in self.k if key[0] == seq]:
            del self.k[key], self.v[key]


def prefill_batch(cache, rng, dtype, seq_ids, lengths, hist, packed=True):
    npt = NP_DTYPES[dtype]
    for layer in range(LAYERS):
        qs = [rng.standard_normal((L, H, D)).astype(npt) for L in lengths]
        ks = [rng.standard_normal((L, HKV, D)).astype(npt) for L in lengths]
        vs = [rng.standard_normal((L, HKV, D)).astype(npt) for L in lengths]
        if packed:
            cu = minikv.cu_seqlens_from_lengths(lengths)
            out = cache.prefill(layer, seq_ids, cu, np.concatenate(qs), np.concatenate(ks),
                                np.concatenate(vs))
            assert out.shape == (sum(lengths), H, D) and out.dtype == npt
            outs = [out[cu[i]:cu[i + 1]] for i in range(len(lengths))]
        else:
            outs = cache.prefill(layer, seq_ids, None, qs, ks, vs)
        for s, (qi, ki, vi, oi) in enumerate(zip(qs, ks, vs, outs)):
            close(oi, causal_attention(qi, ki, vi), dtype, f"prefill layer {layer} seq {seq_ids[s]}")
            hist.add(seq_ids[s], layer, ki, vi)


def decode_steps(cache, rng, dtype, seq_ids, steps, hist, out=None):
    npt = NP_DTYPES[dtype]
    n = len(seq_ids)
    for step in range(steps):
        for layer in range(LAYERS):
            k = rng.standard_normal((n, HKV, D)).astype(npt)
            v = rng.standard_normal((n, HKV, D)).astype(npt)
            q = rng.standard_normal((n, H, D)).astype(npt)
            cache.append(layer, seq_ids, k, v)
            for i, s in enumerate(seq_ids):
                hist.add(s, layer, k[i:i + 1], v[i:i + 1])
            o = cache.decode(layer, seq_ids, q, out=out)
            if out is not None:
                assert o is out
            for i, s in enumerate(seq_ids):
                close(o[i], hist.attend(s, layer, q[i]), dtype,
                      f"decode step {step} layer {layer} seq {s}")


@pytest.mark.parametrize("dtype", [minikv.DType.F32, minikv.DType.F16])
def test_lifecycle_exact(rng, dtype):
    hist = History()
    elem = dtype.itemsize
    with cpu_cache(**exact_config(dtype)) as cache:
        assert cache.backend == minikv.Backend.CPU and not cache.closed
        seq_ids, lengths = [2, 0, 3], [37, 5, 64]  # ragged, slots out of order
        prefill_batch(cache, rng, dtype, seq_ids, lengths, hist)
        for s, L in zip(seq_ids, lengths):
            for layer in range(LAYERS):
                assert tuple(cache.sequence_length(s, layer)) == (L, L)
                for g in range(HKV):
                    np.testing.assert_array_equal(cache.kept_positions(s, layer, g), np.arange(L))
        assert tuple(cache.sequence_length(1, 0)) == (0, 0)  # an empty slot

        # 40 steps with R = 16: every sequence flushes its residual at least twice.
        steps = 40
        decode_steps(cache, rng, dtype, seq_ids, steps, hist,
                     out=np.empty((3, H, D), NP_DTYPES[dtype]))
        # A subset of the batch, in another order.
        decode_steps(cache, rng, dtype, [3, 2], 3, hist)
        seen = {2: 37 + steps + 3, 0: 5 + steps, 3: 64 + steps + 3}
        for s, n in seen.items():
            assert tuple(cache.sequence_length(s, 1)) == (n, n)

        st = cache.memory_stats()
        total = LAYERS * sum(seen.values())
        assert st.tokens_seen == total and st.tokens_cached == total
        assert st.used_bytes == total * 2 * HKV * D * elem  # everything stored 16-bit
        assert st.fp16_equivalent_bytes == total * HKV * D * 4
        assert st.compression_ratio == pytest.approx(1 - st.used_bytes / st.fp16_equivalent_bytes)
        assert st.pool_bytes >= st.used_bytes and st.workspace_bytes > 0

        # Release a slot and reuse it for a new prompt (through per-sequence lists).
        cache.release(0)
        hist.drop(0)
        for layer in range(LAYERS):
            assert tuple(cache.sequence_length(0, layer)) == (0, 0)
        with pytest.raises(minikv.MinikvError) as e:
            cache.decode(0, [0], np.zeros((1, H, D), NP_DTYPES[dtype]))
        assert e.value.status == minikv.Status.BAD_STATE
        after = cache.memory_stats()
        assert after.tokens_seen == total - LAYERS * seen[0]
        prefill_batch(cache, rng, dtype, [0], [20], hist, packed=False)
        cache.release(1)  # releasing an empty slot is a no-op
        decode_steps(cache, rng, dtype, [0, 3, 2], 18, hist)

        # A sequence not released cannot be prefilled again, and the failure changes nothing.
        with pytest.raises(minikv.MinikvError) as e:
            prefill_batch(cache, rng, dtype, [2], [4], History())
        assert e.value.status == minikv.Status.BAD_STATE
        assert "already prefilled" in e.value.message
        decode_steps(cache, rng, dtype, [2], 2, hist)
    assert cache.closed


@pytest.mark.parametrize("dtype", [minikv.DType.F32, minikv.DType.F16])
def test_sliding_flush_exact(rng, dtype):
    """flush_tokens = 16 of residual_length = 32: each flush moves the oldest 16 residual
    tokens into the blocks and the newest 16 to the residual's front. With 16-bit storage
    every decode must still equal attention over the whole history (a row flushed twice,
    lost or left out of order would show), across several flushes per sequence."""
    hist = History()
    with cpu_cache(**exact_config(dtype, residual_length=32, flush_tokens=16)) as cache:
        assert (cache.config.residual_length, cache.config.flush_tokens) == (32, 16)
        seq_ids, lengths = [1, 3], [21, 50]  # prompt tails of 5 and 2 tokens
        prefill_batch(cache, rng, dtype, seq_ids, lengths, hist)
        steps = 70  # flushes at the residual's 32nd token, then every 16: 4 or more each
        decode_steps(cache, rng, dtype, seq_ids, steps, hist)
        for s, L in zip(seq_ids, lengths):
            assert tuple(cache.sequence_length(s, 1)) == (L + steps, L + steps)


@pytest.mark.parametrize("dtype", [minikv.DType.F32, minikv.DType.F16])
@pytest.mark.parametrize("residual,flush", [(R, 0), (2 * R, R)])  # whole and sliding flushes
def test_append_decode_equals_append_then_decode(rng, dtype, residual, flush):
    """append_decode gives the bytes of append + decode (quantized cache, GQA, flushes, a
    ragged batch in shuffled order); a failing call appends nothing and leaves out alone."""
    npt = NP_DTYPES[dtype]
    cfg = dict(dtype=dtype, num_layers=LAYERS, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_sequences=4, max_seq_len=160, residual_length=residual, flush_tokens=flush)
    with cpu_cache(**cfg) as fused, cpu_cache(**cfg) as split:
        seq_ids, lengths = [2, 0, 3], [37, 5, 64]
        cu = minikv.cu_seqlens_from_lengths(lengths)
        for layer in range(LAYERS):
            q = rng.standard_normal((sum(lengths), H, D)).astype(npt)
            k = rng.standard_normal((sum(lengths), HKV, D)).astype(npt)
            v = rng.standard_normal((sum(lengths), HKV, D)).astype(npt)
            fused.prefill(layer, seq_ids, cu, q, k, v)
            split.prefill(layer, seq_ids, cu, q, k, v)
        for step in range(60):  # R = 16 (or F = 16 of R = 32): flushes
            batch = list(rng.permutation(seq_ids)[:1 + step % 3])
            n = len(batch)
            for layer in range(LAYERS):
                q = rng.standard_normal((n, H, D)).astype(npt)
                k = rng.standard_normal((n, HKV, D)).astype(npt)
                v = rng.standard_normal((n, HKV, D)).astype(npt)
                got = fused.append_decode(layer, batch, q, k, v)
                split.append(layer, batch, k, v)
                want = split.decode(layer, batch, q)
                assert got.dtype == npt and got.tobytes() == want.tobytes(), f"step {step} layer {layer}"
        for s in seq_ids:
            assert tuple(fused.sequence_length(s, 1)) == tuple(split.sequence_length(s, 1))

        before = tuple(fused.sequence_length(0, 0))
        q = rng.standard_normal((1, H, D)).astype(npt)
        k = rng.standard_normal((1, HKV, D)).astype(npt)
        q[0, 1, 2] = np.nan
        out = np.full((1, H, D), 7, npt)
        with pytest.raises(minikv.MinikvError) as e:
            fused.append_decode(0, [0], q, k, k, out)
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "minikv_append_decode" in str(e.value)
        assert tuple(fused.sequence_length(0, 0)) == before
        assert (out == 7).all()
        with pytest.raises(ValueError, match="out overlaps q"):
            fused.append_decode(0, [0], q, k, k, q)
