"""minikv.hf under transformers' tensor parallelism: two ranks (torchrun; the model loaded
with tp_plan "auto"), each rank's generator caching its own heads, against the same
scenario run by one process on the whole model (tp_scenario.py).

[cpu]: two ranks on the CPU with gloo, float32 (CI). [cuda]: one GPU per rank with NCCL,
float16; runs only where two GPUs are visible and libminikv has its CUDA backend (keep
NCCL_NVLS_ENABLE=0 set where the machine asks for it: it is passed on to the ranks).

A tiny random LLaMA with 4 query and 2 KV heads (one KV head per rank) of 32 channels
(the default group_size), 2 layers. Skipped without torch, transformers 5.x or accelerate
(transformers loads tensor-parallel models through it)."""
import os
import subprocess
import sys

import numpy as np
import pytest

import minikv
from conftest import TOLERANCE

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
def checkpoints(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-models")
    return (tiny_checkpoint(str(tmp / "llama-4h-2kv"), 4, 2, 64),
            tiny_checkpoint(str(tmp / "llama-6h-3kv"), 6, 3, 96))


def single_process(checkpoint, device):
    model = transformers.AutoModelForCausalLM.from_pretrained(
        checkpoint, dtype=tp_scenario.DTYPES[device]).to(device).eval()
    return {name: tp_scenario.run(model, fields) for name, fields in tp_scenario.SETTINGS.items()}


@pytest.fixture(scope="module")
def exact(checkpoints):
    """The scenario in this process on the float32 model, CPU backend."""
    return single_process(checkpoints[0], "cpu")


class Runs:
    def __init__(self, device, ranks, single, exact):
        self.device, self.ranks, self.single, self.exact = device, ranks, single, exact


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def runs(request, checkpoints, exact, tmp_path_factory):
    """The scenario on two tensor-parallel ranks (one torchrun) and in this process."""
    device = request.param
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    if device == "cuda":
        if torch.cuda.device_count() < WORLD:
            pytest.skip(f"fewer than {WORLD} CUDA devices")
        try:
            minikv.Cache(backend="cuda", dtype="f16", num_layers=1, num_heads=1, num_kv_heads=1,
                         head_dim=64).close()
        except minikv.MinikvError as e:
            if e.status == minikv.Status.UNSUPPORTED:
                pytest.skip(f"this libminikv has no CUDA backend: {e}")
            raise
        env.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast in NCCL
    else:
        # One thread per rank (CI machines are small; results do not depend on it), and no
        # GPU: transformers would put the model on it.
        env.update(OMP_NUM_THREADS="1", MINIKV_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path_factory.mktemp(f"tp-{device}")
    good, bad = checkpoints
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={WORLD}", os.path.join(HERE, "tp_scenario.py"), good, bad,
           str(out), device]
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=600, universal_newlines=True)
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-6000:]}"
    ranks = [torch.load(str(out / f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    single = exact if device == "cpu" else single_process(good, device)
    return Runs(device, ranks, single, exact)


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def logit_diffs(rank, single):
    """max |TP - single| over every prompt position and every teacher-forced step."""
    prompt = max(max_diff(a, b) for a, b in zip(rank["prompt_logits"], single["prompt_logits"]))
    return prompt, max_diff(rank["forced_logits"], single["forced_logits"])


def test_each_rank_caches_its_own_heads(runs):
    backend, dtype = {"cpu": (minikv.Backend.CPU, minikv.DType.F32),
                      "cuda": (minikv.Backend.CUDA, minikv.DType.F16)}[runs.device]
    for name in tp_scenario.SETTINGS:
        full = runs.single[name]["config"]
        assert runs.single[name]["tp"] == (1, 0)
        for r, res in enumerate(runs.ranks):
            cfg = res[name]["config"]
            assert res[name]["tp"] == (WORLD, r)
            assert (cfg.num_heads, cfg.num_kv_heads) == (full.num_heads // WORLD,
                                                         full.num_kv_heads // WORLD)
            assert (cfg.backend, cfg.dtype) == (backend, dtype)
            assert runs.device == "cpu" or cfg.device_id == r  # each rank on its own GPU
            # Logits come back whole and identical on every rank (the model gathers them).
            assert torch.equal(res[name]["forced_logits"], runs.ranks[0][name]["forced_logits"])


# Keep-all 16-bit: the ranks' attention is exact, so TP and single process differ only by
# float32 rounding in the model (o_proj and down_proj sum partial products per rank, then
# all-reduce). Bound: test_hf.py's adapter-vs-model tolerance for float32.
KEEP_ALL_ATOL = 2e-5


def test_keep_all_equals_single_process(runs):
    want = runs.single["keep-all-16"]
    if runs.device == "cuda":
        # float16: as close to the float32 model as one float16 process is (flash-attn's
        # budget, as test_hf.py's CUDA test: 2x the low-precision error + atol).
        exact = runs.exact["keep-all-16"]
        budget = 2 * max(logit_diffs(want, exact)) + 0.02
    for r, res in enumerate(runs.ranks):
        got = res["keep-all-16"]
        if runs.device == "cuda":
            err = max(logit_diffs(got, exact))
            assert err <= budget, f"rank {r}: |TP - float32 model| = {err:.3g} > {budget:.3g}"
            continue
        prompt, forced = logit_diffs(got, want)
        assert prompt <= KEEP_ALL_ATOL and forced <= KEEP_ALL_ATOL, (r, prompt, forced)
        assert got["greedy"] == want["greedy"]
        assert all(np.array_equal(got["kept"][key], want["kept"][key]) for key in got["kept"])
    assert len(set(want["greedy"])) > 2  # the model does not repeat one token


def replay(calls_per_rank, config):
    """Replays the ranks' recorded libminikv calls, heads concatenated in rank order, into
    one cache of the whole model; returns the largest |output - rank output| / (1 + |rank
    output|)."""
    worst = 0.0
    device = "cuda" if config.backend == minikv.Backend.CUDA else "cpu"
    with minikv.Cache(config) as cache:
        for calls in zip(*calls_per_rank):
            if calls[0][0] == "release":
                cache.release(calls[0][1])
                continue
            kind, layer, ids = calls[0][:3]
            first = 4 if kind == "prefill" else 3  # prefill: cu_seqlens, then the tensors
            cat = [torch.cat(parts, dim=1).to(device) for parts in zip(*(c[first:] for c in calls))]
            if kind == "prefill":
                q, k, v, want = cat
                got = cache.prefill(layer, ids, calls[0][3], q, k, v)
            elif kind == "append":
                cache.append(layer, ids, *cat)
                continue
            else:
                q, want = cat
                got = cache.decode(layer, ids, q)
            got, want = got.double(), want.double()
            worst = max(worst, ((got - want).abs() / (1 + want.abs())).max().item())
    return worst


@pytest.mark.parametrize("name", list(tp_scenario.SETTINGS))
def test_ranks_together_are_the_single_process_cache(runs, name):
    """The exact statement: the ranks' calls, replayed into one cache of every head, give
    the ranks' outputs (selection, budgets and quantization are per KV head). CPU backend:
    bit-identical (its results depend on the inputs only). CUDA: each output is within the
    kernels' tolerance against float64 attention (conftest.TOLERANCE), so two of them
    within twice that (the decode split may follow the number of heads)."""
    calls = [res[name]["calls"] for res in runs.ranks]
    assert len({len(c) for c in calls}) == 1 and len(calls[0]) > 2 * tp_scenario.FORCED
    full = runs.single[name]["config"]
    bound = 0.0 if runs.device == "cpu" else 2 * TOLERANCE[full.dtype]
    assert replay(calls, full) <= bound


def quantization_lipschitz(bits):
    """How far a dequantized element can move when every element of its group moves by at
    most e and the codes stay the same: x^ = q * scale + mn with q <= 2^b - 1; mn moves by
    at most e and scale = (max - min) / (2^b - 1) by at most 2e / (2^b - 1), so x^ moves by
    at most e + (2^b - 1) * 2e / (2^b - 1) = 3e, for any b. 16-bit storage: e."""
    return 1.0 if bits == 16 else 3.0


def test_minikv_defaults_equal_single_process(runs):
    if runs.device == "cuda":
        pytest.skip("float16 rounding differs between the TP and single-process models by far "
                    "more than float32's and moves elements across 2-bit code boundaries; "
                    "the replay test checks the caches there")
    ranks, want = runs.ranks, runs.single["defaults"]
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
    # The defaults evicted something (the pyramid's bottom layer may keep a short prompt whole).
    assert min(kept_fraction) < 1.0


def test_world_size_not_dividing_kv_heads_is_refused(runs):
    for res in runs.ranks:
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
