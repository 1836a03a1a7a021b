"""Cache.prefill_chunk (minikv_prefill_chunk): a prompt in chunks equals one prefill, the
sequence refuses decode while mid-prompt, an abandoned prompt is released, and bad
arguments raise with the library's message."""
import numpy as np
import pytest

import minikv
from conftest import cpu_cache

H, HKV, D = 4, 2, 32


def prompts(rng, lens, layers=2):
    """Per layer: packed q, k, v of the whole prompts (float32)."""
    total = sum(lens)
    return [tuple(rng.standard_normal((total, h, D)).astype(np.float32) * s
                  for h, s in ((H, 1.5), (HKV, 1.0), (HKV, 1.0)))
            for _ in range(layers)]


@pytest.mark.parametrize("mode", ["cumulative", "window"])
def test_chunks_equal_one_call(rng, mode):
    lens = [90, 33, 7]
    data = prompts(rng, lens)
    cu = minikv.cu_seqlens_from_lengths(lens)
    ids = [2, 0, 1]
    cfg = dict(num_layers=2, num_heads=H, num_kv_heads=HKV, head_dim=D, dtype="f32",
               max_sequences=3, max_seq_len=128, residual_length=32, score_mode=mode,
               window_size=10, prefill_staging_tokens=sum(lens))
    with cpu_cache(**cfg) as whole, cpu_cache(**cfg) as chunked:
        want = [whole.prefill(layer, ids, cu, *data[layer]) for layer in range(2)]
        got = [np.full_like(w, np.nan) for w in want]
        # Chunks of 13 (the 7-token prompt comes whole), every layer per step, one batch.
        for start in range(0, max(lens), 13):
            batch = [s for s in range(3) if start < lens[s]]
            sizes = [min(13, lens[s] - start) for s in batch]
            rows = [np.arange(cu[s] + start, cu[s] + start + n) for s, n in zip(batch, sizes)]
            for layer in range(2):
                q, k, v = data[layer]
                out = chunked.prefill_chunk(layer, [ids[s] for s in batch], [lens[s] for s in batch],
                                            None, [q[r] for r in rows], [k[r] for r in rows],
                                            [v[r] for r in rows])
                for r, o in zip(rows, out):
                    got[layer][r] = o
        for layer in range(2):
            np.testing.assert_array_equal(got[layer], want[layer])
            for s in ids:
                for g in range(HKV):
                    np.testing.assert_array_equal(chunked.kept_positions(s, layer, g),
                                                  whole.kept_positions(s, layer, g))
        assert chunked.memory_stats() == whole.memory_stats()


def test_mid_prompt_and_abandoned(rng):
    (q, k, v), = prompts(rng, [40], layers=1)
    with cpu_cache(num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D, dtype="f32",
                   max_sequences=2, max_seq_len=64, prefill_staging_tokens=40) as cache:
        cache.prefill_chunk(0, 0, 40, [0, 25], q[:25], k[:25], v[:25])
        with pytest.raises(minikv.MinikvError) as e:
            cache.decode(0, 0, q[:1])
        assert e.value.status is minikv.Status.BAD_STATE and "mid-prompt" in str(e.value)
        # Staging is full (40 rows): another prompt cannot start in chunks.
        with pytest.raises(minikv.MinikvError) as e:
            cache.prefill_chunk(0, 1, 40, [0, 5], q[:5], k[:5], v[:5])
        assert e.value.status is minikv.Status.CAPACITY_EXCEEDED
        cache.release(0)  # abandoned: its staging rows are free again
        cache.prefill_chunk(0, 1, 40, [0, 5], q[:5], k[:5], v[:5])
        assert cache.sequence_length(1, 0).seen == 0
        cache.prefill_chunk(0, 1, 40, [0, 35], q[5:], k[5:], v[5:])
        assert cache.sequence_length(1, 0).seen == 40


def test_bad_arguments(rng):
    (q, k, v), = prompts(rng, [20], layers=1)
    with cpu_cache(num_layers=1, num_heads=H, num_kv_heads=HKV, head_dim=D, dtype="f32",
                   max_seq_len=64) as cache:
        assert cache.config.prefill_staging_tokens == 0
        with pytest.raises(ValueError, match="prompt_lens has 2 entries"):
            cache.prefill_chunk(0, 0, [20, 20], [0, 10], q[:10], k[:10], v[:10])
        with pytest.raises(minikv.MinikvError, match="chunked prefill is off") as e:
            cache.prefill_chunk(0, 0, 20, [0, 10], q[:10], k[:10], v[:10])
        assert e.value.status is minikv.Status.INVALID_ARGUMENT
        cache.prefill_chunk(0, 0, 20, [0, 20], q, k, v)  # a whole prompt needs no staging
        with pytest.raises(minikv.MinikvError) as e:
            cache.prefill_chunk(0, 0, 20, [0, 20], q, k, v)
        assert e.value.status is minikv.Status.BAD_STATE
