"""minikv.hf under transformers' tensor parallelism: two ranks on the CPU with gloo
(torchrun; the model loaded with tp_plan="auto"), each rank's generator caching its own
heads, against the same scenario run by one process on the whole model (tp_scenario.py).

A tiny random LLaMA with 4 query and 2 KV heads (one KV head per rank) of 32 channels
(the default group_size), 2 layers. Skipped
without torch, transformers 5.x or accelerate (transformers needs it for tp_plan)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minikv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.0")
pytest.importorskip("accelerate")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import minikv.hf as hf  # noqa: E402
import tp_scenario  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def tiny_checkpoint(path, num_heads, num_kv_heads, hidden):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=tp_scenario.VOCAB, hidden_size=hidden,
                                   intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                                   head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():  # wider than the default init: attention far from uniform (test_hf.py)
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The scenario on two tensor-parallel ranks (one torchrun) and in this process."""
    tmp = tmp_path_factory.mktemp("tp")
    good = tiny_checkpoint(str(tmp / "llama-4h-2kv"), 4, 2, 64)
    bad = tiny_checkpoint(str(tmp / "llama-6h-3kv"), 6, 3, 96)
    out = tmp / "out"
    out.mkdir()
    # One thread per rank: CI machines are small, and the results do not depend on it.
    env = dict(os.environ, OMP_NUM_THREADS="1", MINIKV_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", os.path.join(HERE, "tp_scenario.py"), good, bad, str(out)]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=600, universal_newlines=True)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    ranks = [torch.load(str(out / f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    model = transformers.AutoModelForCausalLM.from_pretrained(good, dtype=torch.float32).eval()
    single = {name: tp_scenario.run(model, fields) for name, fields in tp_scenario.SETTINGS.items()}
    return ranks, single


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def logit_diffs(rank, single):
    """max |TP - single| over every prompt position and every teacher-forced step."""
    prompt = max(max_diff(a, b) for a, b in zip(rank["prompt_logits"], single["prompt_logits"]))
    return prompt, max_diff(rank["forced_logits"], single["forced_logits"])


def test_each_rank_caches_its_own_heads(runs):
    ranks, single = runs
    for name in tp_scenario.SETTINGS:
        full = single[name]["config"]
        assert single[name]["tp"] == (1, 0)
        for r, res in enumerate(ranks):
            cfg = res[name]["config"]
            assert res[name]["tp"] == (WORLD, r)
            assert (cfg.num_heads, cfg.num_kv_heads) == (full.num_heads // WORLD,
                                                         full.num_kv_heads // WORLD)
            assert cfg.backend == minikv.Backend.CPU and cfg.dtype == minikv.DType.F32
            # Logits come back whole and identical on every rank (the model gathers them).
            assert torch.equal(res[name]["forced_logits"], ranks[0][name]["forced_logits"])


# Keep-all 16-bit: the ranks' attention is exact, so TP and single process differ only by
# float32 rounding in the model (o_proj and down_proj sum partial products per rank, then
# all-reduce). Bound: test_hf.py's adapter-vs-model tolerance for float32.
KEEP_ALL_ATOL = 2e-5


def test_keep_all_equals_single_process(runs):
    ranks, single = runs
    want = single["keep-all-16"]
    for r, res in enumerate(ranks):
        got = res["keep-all-16"]
        prompt, forced = logit_diffs(got, want)
        assert prompt <= KEEP_ALL_ATOL and forced <= KEEP_ALL_ATOL, (r, prompt, forced)
        assert got["greedy"] == want["greedy"]
        assert all(np.array_equal(got["kept"][key], want["kept"][key]) for key in got["kept"])
    assert len(set(want["greedy"])) > 2  # the model does not repeat one token


def replay(calls_per_rank, config):
    """Replays the ranks' recorded libminikv calls, heads concatenated in rank order, into
    one cache of the whole model; returns the largest |output - rank outputs|."""
    worst = 0.0
    with minikv.Cache(config) as cache:
        for calls in zip(*calls_per_rank):
            if calls[0][0] == "release":
                cache.release(calls[0][1])
                continue
            kind, layer, ids = calls[0][:3]
            first = 4 if kind == "prefill" else 3  # prefill: cu_seqlens, then the tensors
            cat = [torch.cat(parts, dim=1) for parts in zip(*(c[first:] for c in calls))]
            if kind == "prefill":
                q, k, v, want = cat
                got = cache.prefill(layer, ids, calls[0][3], q, k, v)
            elif kind == "append":
                cache.append(layer, ids, *cat)
                continue
            else:
                q, want = cat
                got = cache.decode(layer, ids, q)
            worst = max(worst, max_diff(got, want))
    return worst


@pytest.mark.parametrize("name", list(tp_scenario.SETTINGS))
def test_ranks_together_are_the_single_process_cache(runs, name):
    """The exact statement: the ranks' calls, replayed into one cache of every head, give
    bit-identical outputs (selection, budgets and quantization are per KV head)."""
    ranks, single = runs
    calls = [res[name]["calls"] for res in ranks]
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) > 2 * tp_scenario.FORCED
    full = single[name]["config"]
    assert replay(calls, full) == 0.0


def quantization_lipschitz(bits):
    """How far a dequantized element can move when every element of its group moves by at
    most e and the codes stay the same: x^ = q * scale + mn with q <= 2^b - 1; mn moves by
    at most e and scale = (max - min) / (2^b - 1) by at most 2e / (2^b - 1), so x^ moves by
    at most e + (2^b - 1) * 2e / (2^b - 1) = 3e, for any b. 16-bit storage: e."""
    return 1.0 if bits == 16 else 3.0


def test_minikv_defaults_equal_single_process(runs):
    ranks, single = runs
    want = single["defaults"]
    cfg = want["config"]
    assert cfg.key_bits < 16 and cfg.value_bits < 16  # the defaults quantize
    # The same inputs give bit-identical caches (test above); the inputs differ by the
    # model's float32 rounding, which KEEP_ALL_ATOL bounds through exact attention. With
    # the kept positions identical (checked) and the same codes, quantization moves each
    # dequantized element by at most quantization_lipschitz times its input's move, so the
    # logits may differ by that factor times the keep-all bound. (A code flipping at a
    # rounding boundary would move an element by a whole quantization step and fail this.)
    lipschitz = max(quantization_lipschitz(cfg.key_bits), quantization_lipschitz(cfg.value_bits))
    atol = lipschitz * KEEP_ALL_ATOL
    kept_fraction = []
    for r, res in enumerate(ranks):
        got = res["defaults"]
        assert got["kept"].keys() <= want["kept"].keys()
        for key, positions in got["kept"].items():  # kept positions identical per head
            assert np.array_equal(positions, want["kept"][key]), key
            kept_fraction.append(len(positions) / tp_scenario.PROMPTS[key[0]])
        prompt, forced = logit_diffs(got, want)
        assert prompt <= atol and forced <= atol, (
            f"rank {r}: max |TP - single| = {max(prompt, forced):.3g} > {atol:.3g}; past the "
            f"rounding bound: a code flipped at a rounding boundary, or the caches differ")
        assert got["greedy"] == want["greedy"]
        assert got["tokens_cached"] == want["tokens_cached"]
    # Every KV head of the model is in exactly one rank's cache.
    assert sorted(k for res in ranks for k in res["defaults"]["kept"]) == sorted(want["kept"])
    # The split caches store what the single one does, byte for byte.
    assert sum(res["defaults"]["used_bytes"] for res in ranks) == want["used_bytes"]
    assert max(kept_fraction) < 1.0  # the defaults evicted something


def test_world_size_not_dividing_kv_heads_is_refused(runs):
    ranks, _ = runs
    for res in ranks:
        msg = res["refusal"]
        assert msg is not None, "a model with 3 KV heads over 2 ranks was accepted"
        assert "num_key_value_heads (3)" in msg and "2 ranks" in msg and "[1, 3]" in msg


def test_tensor_parallel_heads():
    cfg = transformers.LlamaConfig(num_attention_heads=32, num_key_value_heads=8, hidden_size=256)
    assert hf.tensor_parallel_heads(cfg, 1) == (32, 8)
    assert hf.tensor_parallel_heads(cfg, 4) == (8, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(8\).*\[1, 2, 4, 8\]"):
        hf.tensor_parallel_heads(cfg, 3)
    with pytest.raises(ValueError, match="world_size"):
        hf.tensor_parallel_heads(cfg, 0)


def test_attention_refuses_heads_the_cache_does_not_hold():
    """A plan that hands a rank's attention other heads than its cache holds is an error
    naming both counts, before any libminikv call."""
    class Layer:
        layer_idx = 0
    q, kv = torch.zeros(1, 4, 3, 32), torch.zeros(1, 2, 3, 32)
    call = hf._Call("prefill", np.zeros(1, dtype=np.uint32), None, (2, 1), np.array([0, 3]))
    with pytest.raises(RuntimeError, match="4 query and 2 KV heads but the cache holds 2 and 1"):
        hf.minikv_attention(Layer(), q, kv, kv, None, minikv_call=call)
