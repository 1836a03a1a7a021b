"""One handle from two threads (the call that overlaps another fails with BAD_STATE, never
races) and a handle created before fork() (multiprocessing's "fork" start method: the
child decodes with it)."""
import multiprocessing
import os
import threading

import numpy as np
import pytest

import minikv
from conftest import cpu_cache

H, HKV, D = 8, 2, 64


def test_a_call_overlapping_another_thread_fails_with_bad_state():
    # ctypes releases the GIL during C calls: a query from this thread can overlap a long
    # prefill on another thread. The overlapping call raises BAD_STATE naming both calls.
    L = 768
    cache = cpu_cache(dtype="f32", num_layers=2, num_heads=H, num_kv_heads=HKV, head_dim=D,
                      max_sequences=2, max_seq_len=L)
    rng = np.random.default_rng(3)
    q = rng.standard_normal((L, H, D), dtype=np.float32)
    k = rng.standard_normal((L, HKV, D), dtype=np.float32)
    v = rng.standard_normal((L, HKV, D), dtype=np.float32)
    cu = np.array([0, L], dtype=np.int32)
    overlaps = 0
    for attempt in range(50):
        if overlaps:
            break
        layer, seq = attempt % 2, attempt // 2 % 2
        state = {"started": threading.Event(), "done": threading.Event(), "error": None}

        def prefill():
            state["started"].set()
            try:
                cache.prefill(layer, [seq], cu, q, k, v)
            except minikv.MinikvError as e:
                state["error"] = e
            state["done"].set()

        other = threading.Thread(target=prefill)
        other.start()
        state["started"].wait()
        while not state["done"].is_set():
            try:
                seen, _ = cache.sequence_length(seq, layer)
                assert seen in (0, L)
            except minikv.MinikvError as e:
                assert e.status == minikv.Status.BAD_STATE, e
                assert e.message.startswith(
                    "minikv_sequence_length: the cache is in use by minikv_prefill"), e.message
                overlaps += 1
        other.join()
        if state["error"] is None:
            cache.release(seq)
        else:  # the prefill found the handle held by a query: nothing changed
            assert state["error"].status == minikv.Status.BAD_STATE, state["error"]
            assert "in use by minikv_sequence_length" in state["error"].message
    cache.close()
    assert overlaps > 0, "no query overlapped a prefill in 50 attempts"


_inherited = None  # the parent's cache, seen by a forked child


def _decode_in_child(q, results):
    try:
        out = _inherited.decode(0, [0, 1], q)
        # The child's copy keeps working: append + decode again, then release.
        _inherited.append(0, [0, 1], np.zeros((2, HKV, D), np.float32),
                          np.zeros((2, HKV, D), np.float32))
        _inherited.decode(0, [0, 1], q)
        _inherited.release(1)
        results.put(("ok", out.tobytes()))
    except Exception as e:  # reported to the parent
        results.put(("error", repr(e)))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork() on this platform")
def test_a_handle_created_before_fork_works_in_the_child():
    global _inherited
    os.environ["MINIKV_NUM_THREADS"] = "4"  # worker threads exist even on one core
    try:
        cache = cpu_cache(dtype="f32", num_layers=1, num_heads=H, num_kv_heads=HKV,
                          head_dim=D, max_sequences=2, max_seq_len=256, residual_length=32)
    finally:
        del os.environ["MINIKV_NUM_THREADS"]
    rng = np.random.default_rng(4)
    lens = [70, 45]
    n = sum(lens)
    cache.prefill(0, [0, 1], minikv.cu_seqlens_from_lengths(lens),
                  rng.standard_normal((n, H, D), dtype=np.float32),
                  rng.standard_normal((n, HKV, D), dtype=np.float32),
                  rng.standard_normal((n, HKV, D), dtype=np.float32))
    cache.append(0, [0, 1], rng.standard_normal((2, HKV, D), dtype=np.float32),
                 rng.standard_normal((2, HKV, D), dtype=np.float32))
    q = rng.standard_normal((2, H, D), dtype=np.float32)
    expected = cache.decode(0, [0, 1], q)
    _inherited = cache
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    child = ctx.Process(target=_decode_in_child, args=(q, results))
    child.start()
    child.join(timeout=60)
    if child.is_alive():  # the parent's worker threads do not exist in the child
        child.kill()
        child.join()
        pytest.fail("the child hung on the inherited handle")
    assert child.exitcode == 0
    status, payload = results.get(timeout=10)
    assert status == "ok", payload
    assert payload == expected.tobytes()
    # The parent's cache is untouched by what the child did.
    assert cache.decode(0, [0, 1], q).tobytes() == expected.tobytes()
    assert cache.sequence_length(1, 0).seen == 46
    _inherited = None
    cache.close()
