"""Errors: bad configs, bad tensors (caught before C), library state errors, closed handles."""
import copy
import gc
import pickle

import numpy as np
import pytest

import minikv
from conftest import cpu_cache

H, HKV, D = 8, 2, 32  # GQA: 4 query heads per KV head


def small(**kw):
    # Uniform budgets: every layer keeps half its prompt (the capacity case counts on it).
    cfg = dict(dtype="f32", num_layers=2, num_heads=H, num_kv_heads=HKV, head_dim=D,
               max_sequences=2, max_seq_len=64, residual_length=16, budget_policy="uniform")
    cfg.update(kw)
    return cpu_cache(**cfg)


def arr(*shape, dtype=np.float32):
    return np.ones(shape, dtype=dtype)


# ---- configuration -------------------------------------------------------------------
@pytest.mark.parametrize("fields,named", [
    (dict(num_heads=12, num_kv_heads=8), "num_heads (12) must be a multiple of num_kv_heads (8)"),
    (dict(head_dim=100), "head_dim (100)"),
    (dict(key_bits=3), "key_bits (3)"),
    (dict(group_size=16, residual_length=24), "residual_length (24)"),
    (dict(heavy_ratio=1.5), "heavy_ratio"),
    (dict(pool_kernel=4), "pool_kernel (4)"),
    (dict(backend=7), "backend (7)"),
    (dict(num_layers=0), "num_layers (0)"),
])
def test_bad_config_names_the_field(fields, named):
    with pytest.raises(minikv.MinikvError) as e:
        small(**fields)
    assert e.value.status == minikv.Status.INVALID_ARGUMENT
    assert named in e.value.message, e.value.message
    assert "INVALID_ARGUMENT" in str(e.value)


def test_missing_dimensions_and_python_side_ranges():
    with pytest.raises(minikv.MinikvError) as e:
        minikv.Cache(minikv.Config(backend="cpu"))  # model dimensions left at 0
    assert e.value.status == minikv.Status.INVALID_ARGUMENT and "num_layers" in e.value.message
    # Values ctypes would silently wrap are refused before the C call, naming the field.
    # (flush_tokens has no invalid value in the library, which rounds it: test_compression.py.)
    for field, value in [("num_heads", -1), ("max_tokens", -5), ("head_dim", 2 ** 32),
                         ("flush_tokens", -32), ("flush_tokens", 2 ** 32)]:
        with pytest.raises(minikv.MinikvError) as e:
            minikv.Config(**{field: value})
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and field in e.value.message
    with pytest.raises(minikv.MinikvError, match="dtype"):
        minikv.Config(dtype="float64")
    with pytest.raises(minikv.MinikvError, match="num_layers"):
        minikv.Config(num_layers="two")
    with pytest.raises(TypeError):
        minikv.Cache(minikv.Config(), num_layers=1)  # a Config or fields, not both


def test_cuda_backend_absent_is_unsupported():
    try:
        cache = small(backend="cuda")
    except minikv.MinikvError as e:
        assert e.status == minikv.Status.UNSUPPORTED, e
        assert "CUDA" in e.message
        # AUTO falls back to the CPU backend, and says so.
        with minikv.Cache(minikv.Config(num_layers=1, num_heads=2, num_kv_heads=1,
                                        head_dim=64)) as auto:
            assert auto.backend == minikv.Backend.CPU
            assert auto.config.backend == minikv.Backend.CPU
    else:
        cache.close()
        pytest.skip("this libminikv has a usable CUDA backend")


# ---- tensors checked before the C call ------------------------------------------------
def test_gqa_and_tensor_validation():
    with small() as c:
        cu = [0, 3, 5]
        q, kv = arr(5, H, D), arr(5, HKV, D)
        cases = [
            (lambda: c.prefill(0, [0, 1], cu, arr(5, HKV, D), kv, kv), "q: shape [5, 2, 32]"),
            (lambda: c.prefill(0, [0, 1], cu, q, arr(5, H, D), kv), "num_kv_heads"),
            (lambda: c.prefill(0, [0, 1], cu, q, kv, arr(5, HKV, 16)), "v: shape"),
            (lambda: c.prefill(0, [0, 1], [0, 3, 6], q, kv, kv), "total_tokens = cu_seqlens[-1]"),
            (lambda: c.prefill(0, [0, 1], [0, 3], q, kv, kv), "n_seqs + 1"),
            (lambda: c.prefill(0, [0, 1], [1, 3, 5], q, kv, kv), "cu_seqlens[0]"),
            (lambda: c.prefill(0, [0, 1], [0, 5, 5], q, kv, kv), "increase strictly"),
            (lambda: c.prefill(0, [0, 1], cu, q.astype(np.float64), kv, kv), "dtype float64"),
            (lambda: c.prefill(0, [0, 1], cu, q.astype(np.float16), kv, kv), "F32"),
            (lambda: c.prefill(0, [0, 1], cu, q, kv, np.ones((D, HKV, 5), np.float32).T), "C-contiguous"),
            (lambda: c.prefill(0, [0, 1], cu, q, kv, kv, out=q), "overlaps q"),
            (lambda: c.prefill(0, [0, 1], cu, q, kv, kv, out=arr(5, H, D, dtype=np.float16)), "out: dtype"),
            (lambda: c.prefill(0, [0, 1], cu, q, kv, kv, stream=1234), "stream must be None"),
            (lambda: c.prefill(0, [], [0], q, kv, kv), "non-empty"),
            (lambda: c.prefill(0, [0, -1], cu, q, kv, kv), "ids must be in"),
            (lambda: c.prefill(0, [0, 1], None, [q[:3]], [kv[:3]], [kv[:3]]), "seq_ids has 2"),
            (lambda: c.prefill(0, [0], None, [q[:3]], [kv[:2]], [kv[:3]]), "k[0]: shape [2, 2, 32]"),
            (lambda: c.append(0, [0, 1], arr(2, H, D), arr(2, HKV, D)), "[n_seqs, num_kv_heads, head_dim]"),
            (lambda: c.append(0, [0], arr(2, HKV, D), arr(2, HKV, D)), "k: shape [2, 2, 32]"),
            (lambda: c.decode(0, [0], arr(1, HKV, D)), "[n_seqs, num_heads, head_dim]"),
            (lambda: c.decode(0, [0, 1], arr(2, H, D), out=arr(1, H, D)), "out: shape"),
        ]
        for call, text in cases:
            with pytest.raises(ValueError) as e:
                call()
            assert text in str(e.value), (text, str(e.value))
        ro = arr(1, H, D)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            c.decode(0, [0], arr(1, H, D), out=ro)
        with pytest.raises(TypeError, match="numpy array"):
            c.decode(0, [0], [[0.0] * D] * H)
        # None of the rejected calls reached the cache.
        assert c.memory_stats().tokens_seen == 0


# ---- errors the library reports --------------------------------------------------------
def test_library_errors_carry_status_and_message():
    with small(max_tokens=32) as c:  # two blocks of 16 tokens in the whole pool
        q, kv = arr(1, H, D), arr(1, HKV, D)
        with pytest.raises(minikv.MinikvError) as e:
            c.decode(0, [0], q)
        assert e.value.status == minikv.Status.BAD_STATE
        assert "has not been prefilled for layer 0" in e.value.message
        with pytest.raises(minikv.MinikvError) as e:
            c.append(1, [5], kv, kv)
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "max_sequences" in e.value.message
        with pytest.raises(minikv.MinikvError) as e:
            c.decode(2, [0], q)
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "layer (2)" in e.value.message
        with pytest.raises(minikv.MinikvError) as e:
            c.prefill(0, [1, 1], [0, 1, 2], arr(2, H, D), arr(2, HKV, D), arr(2, HKV, D))
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "twice" in e.value.message
        with pytest.raises(minikv.MinikvError) as e:
            c.prefill(0, [0], [0, 65], arr(65, H, D), arr(65, HKV, D), arr(65, HKV, D))
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "max_seq_len" in e.value.message
        with pytest.raises(minikv.MinikvError) as e:
            c.kept_positions(0, 0, HKV)
        assert e.value.status == minikv.Status.INVALID_ARGUMENT and "kv_head" in e.value.message
        # Capacity: a 64-token prompt keeps 32 tokens = 2 blocks; a second one does not fit.
        x, y = arr(64, H, D), arr(64, HKV, D)
        c.prefill(0, [0], [0, 64], x, y, y)
        before = c.memory_stats()
        with pytest.raises(minikv.MinikvError) as e:
            c.prefill(0, [1], [0, 64], x, y, y)
        assert e.value.status == minikv.Status.CAPACITY_EXCEEDED and "free blocks" in e.value.message
        assert c.memory_stats() == before, "a failed call must change nothing"
        assert tuple(c.sequence_length(1, 0)) == (0, 0)
        c.release(0)  # frees the blocks: now it fits
        c.prefill(0, [1], [0, 64], x, y, y)
        assert tuple(c.sequence_length(1, 0)) == (64, 32)
    assert minikv.status_string(minikv.Status.BAD_STATE).startswith("MINIKV_ERR_BAD_STATE")
    unknown = minikv.MinikvError(99, "from the future")
    assert unknown.status == 99 and "99" in str(unknown)


# ---- a closed cache ------------------------------------------------------------------
def test_use_after_close_is_an_error_not_a_crash():
    c = small()
    c.close()
    c.close()  # idempotent
    assert c.closed
    calls = [
        lambda: c.prefill(0, [0], [0, 1], arr(1, H, D), arr(1, HKV, D), arr(1, HKV, D)),
        lambda: c.append(0, [0], arr(1, HKV, D), arr(1, HKV, D)),
        lambda: c.decode(0, [0], arr(1, H, D)),
        lambda: c.release(0),
        lambda: c.sequence_length(0, 0),
        lambda: c.kept_positions(0, 0, 0),
        lambda: c.memory_stats(),
        lambda: c.handle,
        lambda: c.__enter__(),
    ]
    for call in calls:
        with pytest.raises(minikv.MinikvError) as e:
            call()
        assert e.value.status == minikv.Status.BAD_STATE and "closed" in e.value.message
    assert "closed" in repr(c)

    with small() as c2:
        c2.prefill(0, [0], [0, 4], arr(4, H, D), arr(4, HKV, D), arr(4, HKV, D))
    with pytest.raises(minikv.MinikvError):
        c2.memory_stats()
    # Dropping an open cache frees it through the safety net.
    c3 = small()
    del c3
    gc.collect()


def test_cache_cannot_be_copied():
    with small() as c:
        for op in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(TypeError):
                op(c)
