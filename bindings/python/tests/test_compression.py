"""The paper's (2-bit) settings: memory accounting against src/layout.h computed by hand, and
decode against a numpy model of KIVI quantization over the kept tokens (src/quant.h)."""
import numpy as np
import pytest

import minikv
from conftest import NP_DTYPES, TOLERANCE, cpu_cache
from reference import (SlotModel, decode_attention, dequantized_context, kept_count,
                       quantized_bytes)


def test_paper_setting_compression(rng):
    """MHA, head_dim 128, a 4096-token prompt and 512 decoded tokens with the paper's
    setting (2-bit, G = 16, R = 128, 25% + 25% budget): ~86% smaller than FP16 (MINIKV.md 4)."""
    D, L, steps = 128, 4096, 512
    with cpu_cache(num_layers=1, num_heads=1, num_kv_heads=1, head_dim=D,
                   max_seq_len=L + steps) as cache:
        x = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
        cache.prefill(0, [0], [0, L], x(L, 1, D), x(L, 1, D), x(L, 1, D))
        # Kept 1024 heavy + 1024 recent = 2048 tokens, all quantized: per 16 tokens and head,
        # codes 16 * (32 + 32) B + key (scale, min) 2 * 128 * 2 B + value (scale, min)
        # 16 * 2 * 8 * 2 B = 2048 B; FP16 would take 4096 * 128 * 4 B.
        st = cache.memory_stats()
        assert st.tokens_seen == L and st.tokens_cached == L // 2
        assert st.used_bytes == 2048 // 16 * 2048
        assert st.compression_ratio == pytest.approx(1 - 262144 / (4096 * 128 * 4))  # 0.875
        for _ in range(steps):
            cache.append(0, [0], x(1, 1, D), x(1, 1, D))
        cache.decode(0, [0], x(1, 1, D))
        st = cache.memory_stats()
        # 512 appended tokens = 4 flushes of R = 128: 2560 quantized tokens, residual empty.
        assert st.tokens_seen == L + steps and st.tokens_cached == 2048 + steps
        assert st.used_bytes == 2560 // 16 * 2048 == quantized_bytes(2560, 1, D, 16, 2, 2, 2)
        assert st.fp16_equivalent_bytes == (L + steps) * D * 4
        expected = 1 - 2560 * 128 / ((L + steps) * D * 4)
        assert st.compression_ratio == pytest.approx(expected, rel=1e-12)
        assert st.compression_ratio == pytest.approx(0.861, abs=5e-4)


@pytest.mark.parametrize("dtype", [minikv.DType.F16, minikv.DType.F32])
@pytest.mark.parametrize("bits,group,residual,flush", [
    (2, 16, 32, 0), (4, 32, 64, 0), (2, 64, 64, 0),
    (4, 32, 64, 32), (2, 16, 64, 48), (2, 16, 32, 16),  # sliding flushes (flush_tokens)
    (2, 16, 64, 20), (4, 32, 64, 1), (2, 16, 32, 100)])  # rounded to 32, 32 and 32 = R
def test_stats_follow_layout_every_step(rng, dtype, bits, group, residual, flush):
    """used_bytes and the counts equal the layout.h accounting after every call (prompt
    tails in the residual, flushes every R appends, or with flush_tokens F the oldest F of
    a full residual every F appends, several sequences and layers; F rounded up to whole
    groups, at most R)."""
    H, HKV, D, layers = 4, 2, 64, 2
    npt, elem = NP_DTYPES[dtype], dtype.itemsize
    lengths = {1: 70, 0: 45, 2: 3}
    cfg = dict(dtype=dtype, num_layers=layers, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_sequences=3, max_seq_len=256, key_bits=bits, value_bits=bits,
               group_size=group, residual_length=residual, flush_tokens=flush,
               budget_policy="uniform")  # both layers keep half their prompt
    with cpu_cache(**cfg) as cache:
        assert cache.config.flush_tokens == flush
        models, whole = {}, {}  # whole: the same with flush_tokens = 0 (flush all R)

        def check():
            st = cache.memory_stats()
            used = sum(m.used_bytes(HKV, D, group, bits, bits, elem) for m in models.values())
            seen = sum(m.seen for m in models.values())
            assert st.used_bytes == used
            assert st.tokens_seen == seen
            assert st.tokens_cached == sum(m.cached for m in models.values())
            assert st.fp16_equivalent_bytes == seen * HKV * D * 4
            assert st.compression_ratio == pytest.approx(1 - used / (seen * HKV * D * 4))
            for (s, layer), m in models.items():
                assert tuple(cache.sequence_length(s, layer)) == (m.seen, m.cached)

        assert cache.memory_stats().compression_ratio == 0.0  # empty
        for layer in range(layers):
            ids = list(lengths)
            qs = [rng.standard_normal((L, H, D)).astype(npt) for L in lengths.values()]
            ks = [rng.standard_normal((L, HKV, D)).astype(npt) for L in lengths.values()]
            cache.prefill(layer, ids, None, qs, ks, ks)
            for s, L in lengths.items():
                models[(s, layer)] = SlotModel(L, kept_count(L, 0.25, 0.25), group, residual,
                                               flush)
                whole[(s, layer)] = SlotModel(L, kept_count(L, 0.25, 0.25), group, residual)
            check()
        for step in range(2 * residual + 5):
            for layer in range(layers):
                ids = [1, 0, 2] if step % 2 else [2, 1]  # sequences advance unevenly
                kv = rng.standard_normal((len(ids), HKV, D)).astype(npt)
                cache.append(layer, ids, kv, kv)
                for s in ids:
                    models[(s, layer)].append()
                    whole[(s, layer)].append()
            check()
        assert all(m.flushes >= 1 for m in models.values())
        if next(iter(models.values())).F < residual:
            # The accounting of a whole flush differs from the sliding one's at the end, so
            # the checks above would fail if the library ignored flush_tokens.
            assert any(m.quantized != w.quantized for m, w in zip(models.values(), whole.values()))


@pytest.mark.parametrize("dtype", [minikv.DType.F32, minikv.DType.F16])
@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("flush", [0, 16, 5])  # 16 (and 5, rounded up to 16) of R = 32
def test_quantized_decode_matches_kivi_model(rng, dtype, bits, flush):
    """Decode over the quantized cache equals float64 attention over the numpy model of
    the stored values: kept prompt tokens (as kept_positions reports them) and appended
    tokens in cache order, the first `quantized` of them quantize-dequantized in groups of
    G (keys per channel over G tokens, values per token over G channels), the residual
    exact. Checked at every step across several flushes; with flush_tokens F a flush
    quantizes the oldest F residual tokens and the newest R - F stay exact."""
    H, HKV, D, G, R = 4, 2, 64, 16, 32
    npt = NP_DTYPES[dtype]
    lengths = [70, 45]
    with cpu_cache(dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
                   max_sequences=2, max_seq_len=256, key_bits=bits, value_bits=bits,
                   group_size=G, residual_length=R, flush_tokens=flush) as cache:
        ctx_k, ctx_v, models = {}, {}, {}
        for s, L in enumerate(lengths):
            q = rng.standard_normal((L, H, D)).astype(npt)
            k = rng.standard_normal((L, HKV, D)).astype(npt)
            v = rng.standard_normal((L, HKV, D)).astype(npt)
            cache.prefill(0, [s], [0, L], q, k, v)
            models[s] = SlotModel(L, kept_count(L, 0.25, 0.25), G, R, flush)
            for g in range(HKV):
                kept = cache.kept_positions(s, 0, g)
                assert len(kept) == models[s].cached
                ctx_k[(s, g)] = k[kept, g].astype(np.float32)
                ctx_v[(s, g)] = v[kept, g].astype(np.float32)
        errors = []
        for step in range(2 * R + 7):
            k = rng.standard_normal((2, HKV, D)).astype(npt)
            v = rng.standard_normal((2, HKV, D)).astype(npt)
            q = rng.standard_normal((2, H, D)).astype(npt)
            cache.append(0, [0, 1], k, v)
            out = cache.decode(0, [0, 1], q)
            for s in (0, 1):
                models[s].append()
                ks, vs = [], []
                for g in range(HKV):
                    ctx_k[(s, g)] = np.concatenate([ctx_k[(s, g)], k[s:s + 1, g].astype(np.float32)])
                    ctx_v[(s, g)] = np.concatenate([ctx_v[(s, g)], v[s:s + 1, g].astype(np.float32)])
                    kq, vq = dequantized_context(ctx_k[(s, g)], ctx_v[(s, g)], models[s].quantized,
                                                 G, bits, bits, npt)
                    ks.append(kq)
                    vs.append(vq)
                ref = decode_attention(q[s], ks, vs)
                tol = TOLERANCE[dtype] * 2
                err = np.abs(out[s].astype(np.float64) - ref)
                assert (err <= tol + tol * np.abs(ref)).all(), (
                    f"step {step} seq {s}: max error {err.max():.3g} vs the KIVI model")
                # Quantization does change the result: the model is not trivially exact.
                exact = decode_attention(q[s], [c[:, :] for c in (ctx_k[(s, g)] for g in range(HKV))],
                                         [ctx_v[(s, g)] for g in range(HKV)])
                errors.append(np.abs(exact - ref).max())
        assert max(errors) > 10 * TOLERANCE[dtype]
        assert all(m.flushes >= 2 for m in models.values())


def test_flush_tokens_round_up_to_whole_groups(rng):
    """Any flush_tokens is valid: the library rounds it up to a multiple of group_size and
    caps it at residual_length. With G = 16 and R = 64, caches fed the same tokens agree bit
    for bit (decode outputs) and byte for byte (memory stats) at every step when their
    flush_tokens round to the same F: 24 and 32; 8 and 16; 200, 2**32 - 1 and 0 (the whole
    residual). The three F give different caches (so those comparisons can fail), and every
    cache follows the layout accounting with its rounded F (2-bit storage: a flush moves
    tokens from 16-bit rows to 2-bit codes)."""
    H, HKV, D, G, R, L = 8, 2, 32, 16, 64, 40
    groups = [(24, 32), (8, 16), (200, 2 ** 32 - 1, 0)]  # F = 32, 16 and 64
    flushes = [f for g in groups for f in g]
    cfg = dict(dtype="f32", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_seq_len=256, group_size=G, residual_length=R, budget_policy="uniform")
    caches = []
    try:
        for f in flushes:
            caches.append(cpu_cache(flush_tokens=f, **cfg))
        assert [c.config.flush_tokens for c in caches] == flushes  # reported as given
        x = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
        q, k, v = x(L, H, D), x(L, HKV, D), x(L, HKV, D)
        for c in caches:
            c.prefill(0, [0], [0, L], q, k, v)
        models = [SlotModel(L, kept_count(L, 0.25, 0.25), G, R, f) for f in flushes]
        assert [m.F for m in models] == [32, 32, 16, 16, 64, 64, 64]
        differed = {(0, 1): 0, (0, 2): 0, (1, 2): 0}  # steps where two groups' bytes differ
        for step in range(R + 3 * 32):  # the first flush at R tokens, then every F
            k, v, q = x(1, HKV, D), x(1, HKV, D), x(1, H, D)
            outs, used = {}, {}
            for f, c, m in zip(flushes, caches, models):
                c.append(0, [0], k, v)
                outs[f] = c.decode(0, [0], q).tobytes()
                m.append()
                used[f] = c.memory_stats().used_bytes
                assert used[f] == m.used_bytes(HKV, D, G, 2, 2, 4), f"flush_tokens {f}, step {step}"
                assert tuple(c.sequence_length(0, 0)) == (m.seen, m.cached)
            for same in groups:
                for f in same[1:]:
                    assert outs[f] == outs[same[0]], f"flush_tokens {f} vs {same[0]}, step {step}"
                    assert used[f] == used[same[0]], f"flush_tokens {f} vs {same[0]}, step {step}"
            for a, b in differed:
                differed[(a, b)] += used[groups[a][0]] != used[groups[b][0]]
        assert [m.flushes for m in models] == [4, 4, 7, 7, 2, 2, 2]
        assert min(differed.values()) > 20, differed
    finally:
        for c in caches:
            c.close()
