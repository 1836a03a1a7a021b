"""Token selection seen through kept_positions, and decode over exactly the kept set."""
import math

import numpy as np
import pytest

import minikv
from conftest import TOLERANCE, cpu_cache
from reference import budget_tokens, decode_attention, layer_heavy_ratios

H, HKV, D, L = 4, 2, 32, 64


def planted_prompt(rng, planted):
    """Queries all share a strong component along a unit direction u_g per KV group; the
    keys at `planted[g]` point along u_g, so every query attends to them heavily."""
    q = 0.5 * rng.standard_normal((L, H, D))
    k = 0.5 * rng.standard_normal((L, HKV, D))
    v = rng.standard_normal((L, HKV, D))
    rep = H // HKV
    for g, positions in planted.items():
        u = np.zeros(D)
        u[3 * g + 1] = 1.0
        q[:, g * rep:(g + 1) * rep] += 3.0 * u
        k[positions, g] += 8.0 * u
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32)


@pytest.mark.parametrize("mode,pool", [(minikv.ScoreMode.CUMULATIVE, 7),
                                       (minikv.ScoreMode.WINDOW, 1),
                                       (minikv.ScoreMode.WINDOW, 7)])
def test_heavy_hitters_are_kept(rng, mode, pool):
    if mode == minikv.ScoreMode.CUMULATIVE or pool == 1:
        planted = {0: [3, 11, 29, 40], 1: [5, 17]}
        must_keep = planted
    else:
        # SnapKV max-pooling (kernel 7) spreads a heavy hitter's score to its 3 neighbours
        # on each side; ties go to lower positions, so plant one per head and expect the
        # whole neighbourhood.
        planted = {0: [20], 1: [33]}
        must_keep = {0: list(range(17, 24)), 1: list(range(30, 37))}
    q, k, v = planted_prompt(rng, planted)
    n_heavy, n_recent = budget_tokens(0.25, L), budget_tokens(0.25, L)
    with cpu_cache(dtype="f32", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
                   max_seq_len=128, key_bits=16, value_bits=16, score_mode=mode,
                   window_size=16, pool_kernel=pool, residual_length=16) as cache:
        cache.prefill(0, [0], [0, L], q, k, v)
        kept = {}
        for g in range(HKV):
            kept[g] = cache.kept_positions(0, 0, g)
            assert kept[g].dtype == np.int32
            assert len(kept[g]) == n_heavy + n_recent == cache.sequence_length(0, 0).cached
            assert (np.diff(kept[g]) > 0).all(), "positions must be ascending and distinct"
            assert set(range(L - n_recent, L)) <= set(kept[g].tolist()), "recent window kept"
            assert set(must_keep[g]) <= set(kept[g].tolist()), f"KV head {g} dropped a heavy hitter"
        # The heads choose differently: the planted set of head 0 is not all kept by head 1
        # in general, and selection is per KV head.
        assert kept[0].tolist() != kept[1].tolist()

        # bits = 16: decode equals attention over exactly the kept positions plus the new token.
        for step in range(20):
            kn = rng.standard_normal((1, HKV, D)).astype(np.float32)
            vn = rng.standard_normal((1, HKV, D)).astype(np.float32)
            qn = rng.standard_normal((1, H, D)).astype(np.float32)
            cache.append(0, [0], kn, vn)
            out = cache.decode(0, [0], qn)
            k = np.concatenate([k, kn])
            v = np.concatenate([v, vn])
            idx = [np.concatenate([kept[g], np.arange(L, L + step + 1)]) for g in range(HKV)]
            ref = decode_attention(qn[0], [k[idx[g], g] for g in range(HKV)],
                                   [v[idx[g], g] for g in range(HKV)])
            tol = TOLERANCE[minikv.DType.F32]
            np.testing.assert_allclose(out[0], ref, rtol=tol, atol=tol)


def test_pyramid_budgets_per_layer(rng):
    layers, Lp = 5, 200
    h, r = 0.2, 0.1
    ratios = layer_heavy_ratios(layers, h, r, pyramid=True, depth=7.0)
    assert math.isclose(sum(ratios) / layers, h)  # the mean stays h
    with cpu_cache(dtype="f32", num_layers=layers, num_heads=2, num_kv_heads=1, head_dim=16,
                   max_seq_len=Lp, heavy_ratio=h, recent_ratio=r,
                   budget_policy="pyramid", pyramid_depth=7.0) as cache:
        for layer in range(layers):
            x = rng.standard_normal((Lp, 2, 16)).astype(np.float32)
            kv = rng.standard_normal((Lp, 1, 16)).astype(np.float32)
            cache.prefill(layer, [0], [0, Lp], x, kv, kv)
            expected = budget_tokens(ratios[layer], Lp) + budget_tokens(r, Lp)
            assert len(cache.kept_positions(0, layer, 0)) == expected
        counts = [len(cache.kept_positions(0, layer, 0)) for layer in range(layers)]
        assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]


@pytest.mark.parametrize("sinks", [1, 4, 40])
def test_sinks_are_kept_inside_the_budget(rng, sinks):
    """The first `sinks` positions are always kept and take heavy-hitter slots; a prompt
    no longer than the sinks keeps everything (a 3-token prompt keeps nothing else: its
    25% + 25% budget rounds down to 0 tokens). Decode (bits 16) attends over exactly the
    kept positions."""
    q, k, v = planted_prompt(rng, {0: [30, 31], 1: [45]})
    with cpu_cache(dtype="f32", num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D,
                   max_seq_len=128, key_bits=16, value_bits=16, residual_length=16,
                   max_sequences=2, sink_tokens=sinks) as cache:
        assert cache.config.sink_tokens == sinks
        short = 3
        cache.prefill(0, [0, 1], [0, L, L + short],
                      np.concatenate([q, q[:short]]), np.concatenate([k, k[:short]]),
                      np.concatenate([v, v[:short]]))
        n_heavy, n_recent = budget_tokens(0.25, L), budget_tokens(0.25, L)
        for g in range(HKV):
            kept = cache.kept_positions(0, 0, g)
            assert kept[:min(sinks, L)].tolist() == list(range(min(sinks, L)))
            assert len(kept) == max(n_heavy, sinks) + n_recent
            assert cache.kept_positions(1, 0, g).tolist() == list(range(min(sinks, short)))
        assert tuple(cache.sequence_length(1, 0)) == (short, min(sinks, short))
        qd = rng.standard_normal((1, H, D)).astype(np.float32)
        out = cache.decode(0, [0], qd)
        keys = [k[cache.kept_positions(0, 0, g), g] for g in range(HKV)]
        values = [v[cache.kept_positions(0, 0, g), g] for g in range(HKV)]
        want = decode_attention(qd[0].astype(np.float64), keys, values)
        np.testing.assert_allclose(out[0], want, atol=TOLERANCE[minikv.DType.F32],
                                   rtol=TOLERANCE[minikv.DType.F32])
