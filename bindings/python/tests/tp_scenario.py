"""The calls test_hf_tp.py compares between a tensor-parallel run and a single process.

`run(model, fields)` drives one MiniKVGenerator through a fixed scenario and returns what it
saw; test_hf_tp.py runs it in its own process on the whole model, and this file, started
by torchrun (`python -m torch.distributed.run --nproc-per-node 2 tp_scenario.py CKPT
CKPT_BAD OUT DEVICE`), runs it on every rank of the model loaded with tp_plan "auto" (on the
CPU with gloo, float32; or on one GPU per rank with NCCL, float16) and saves each rank's
results to OUT/rank<r>.pt.

The scenario: a ragged batch of two prompts prefilled (every position's logits), 140
teacher-forced tokens each in one step (past the default residual_length of 64, flushed 32
tokens at a time: several flushes), the kept positions of every (sequence, layer, KV head),
the memory statistics, then greedy generation of one prompt. Every libminikv call is
recorded (inputs and outputs, copied to the host, and the releases), so the test can replay
a run's calls into another cache.
"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import minikv.hf as hf  # noqa: E402

VOCAB = 128
PROMPTS = (70, 53)      # prompt lengths of the ragged batch
FORCED = 140            # teacher-forced tokens per sequence
GREEDY = (41, 12)       # greedy generation: prompt length, new tokens
MAX_SEQ_LEN = 256
# Keep every token, unquantized (test_hf.py's LOSSLESS), and the library's defaults.
SETTINGS = {
    "keep-all-16": dict(key_bits=16, value_bits=16, heavy_ratio=1.0, recent_ratio=0.0,
                        group_size=16, residual_length=16),
    "defaults": {},
}


def host(t):
    return t.detach().to("cpu", copy=True)


class Recorder:
    """A minikv.Cache that records each prefill/append/decode/append_decode call: its inputs
    and output."""

    def __init__(self, cache):
        self._cache = cache
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def prefill(self, layer, seq_ids, cu_seqlens, q, k, v, **kw):
        out = self._cache.prefill(layer, seq_ids, cu_seqlens, q, k, v, **kw)
        self.calls.append(("prefill", layer, np.array(seq_ids), np.array(cu_seqlens),
                           host(q), host(k), host(v), host(out)))
        return out

    def append(self, layer, seq_ids, k, v, **kw):
        self._cache.append(layer, seq_ids, k, v, **kw)
        self.calls.append(("append", layer, np.array(seq_ids), host(k), host(v)))

    def release(self, seq_id):
        self._cache.release(seq_id)
        self.calls.append(("release", seq_id))

    def decode(self, layer, seq_ids, q, **kw):
        out = self._cache.decode(layer, seq_ids, q, **kw)
        self.calls.append(("decode", layer, np.array(seq_ids), host(q), host(out)))
        return out

    def append_decode(self, layer, seq_ids, q, k, v, **kw):
        # Recorded as the append and the decode it equals, bit for bit (the replay's calls).
        out = self._cache.append_decode(layer, seq_ids, q, k, v, **kw)
        self.calls.append(("append", layer, np.array(seq_ids), host(k), host(v)))
        self.calls.append(("decode", layer, np.array(seq_ids), host(q), host(out)))
        return out


def tokens(seed, n):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(model, fields):
    """The scenario on `model` with minikv.Config `fields`; returns a dict of results."""
    gen = hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=MAX_SEQ_LEN, **fields)
    rec = Recorder(gen.cache)
    gen.cache = rec
    try:
        prompts = [tokens(i, n) for i, n in enumerate(PROMPTS)]
        prompt_logits = gen.prefill(prompts, all_logits=True)
        forced = torch.tensor([tokens(10 + i, FORCED) for i in range(len(PROMPTS))])
        forced_logits = gen.step(forced)
        cfg = gen.cache.config
        kept = {(s, layer, gen.kv_head_offset + h): gen.cache.kept_positions(s, layer, h)
                for s in range(len(PROMPTS)) for layer in range(cfg.num_layers)
                for h in range(cfg.num_kv_heads)}
        stats = gen.memory_stats()
        gen.reset()
        greedy = gen.generate(tokens(20, GREEDY[0]), max_new_tokens=GREEDY[1])[0]
    finally:
        gen.close()
    return dict(prompt_logits=[host(t) for t in prompt_logits], forced_logits=host(forced_logits),
                kept=kept, used_bytes=stats.used_bytes, tokens_cached=stats.tokens_cached,
                greedy=greedy, calls=rec.calls, config=cfg, tp=(gen.tp_world, gen.tp_rank))


DTYPES = {"cpu": torch.float32, "cuda": torch.float16}  # the CUDA backend has no float32


def main(checkpoint, bad_checkpoint, out_dir, device):
    import transformers

    # The model's own tensor-parallel plan over every rank; transformers puts it on the
    # machine's accelerator (one GPU per rank, NCCL) or, where there is none, on the CPU
    # (gloo). The caller hides the GPUs for a CPU run.
    def load(path):
        return transformers.AutoModelForCausalLM.from_pretrained(
            path, distributed_config=transformers.DistributedConfig(tp_plan="auto"),
            dtype=DTYPES[device]).eval()
    model = load(checkpoint)
    if next(model.parameters()).device.type != device:
        raise RuntimeError(f"the model is on {next(model.parameters()).device}, not {device}")
    rank = torch.distributed.get_rank()
    results = {name: run(model, fields) for name, fields in SETTINGS.items()}
    # A model whose KV heads do not split over the ranks: the generator refuses it.
    bad = load(bad_checkpoint)
    try:
        hf.MiniKVGenerator(bad, max_seq_len=64).close()
        results["refusal"] = None
    except ValueError as e:
        results["refusal"] = str(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    # No interpreter teardown after gloo's: it can abort there (examples/python/tp_generate.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
