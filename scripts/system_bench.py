#!/usr/bin/env python3
"""scripts/system_bench.py — what libminikv buys a serving stack: the MiniKV paper's
Figures 11-13 on a LLaMA-2-7B-shaped model (32 layers, 32 heads x 128, hidden 4096, MLP
11008, vocab 32000) with random fp16 weights built from the config (no download).

Two engines run the same transformers model:
  full    its own SDPA attention with a transformers cache (StaticCache: preallocated for
          prompt + generation, as a serving stack reserves it; DynamicCache for Figure 12,
          where a static cache's materialized mask would grow with the prompt squared);
  minikv  minikv.hf.MiniKVGenerator (prefill through minikv_prefill, each token through
          minikv_append + minikv_decode), pool sized for what the budget keeps.
Figures:
  11  peak GPU memory vs batch size (prompt --prompt, caches sized for --gen tokens), and
      the largest batch each engine holds;
  12  the longest prompt that runs at batch 1 (prefill + a few decode steps);
  13  (a) per-token decode latency vs prompt length at batch 1 (--latency-gen tokens);
      (b) throughput (tokens/s) at prompt --prompt / gen --gen at the largest batch of 11.
Peak memory = torch's peak allocation (weights, activations, the full engine's cache) +
libminikv's reserved pool and workspace (cudaMalloc'd by the library, outside torch).
--memory-limit-gb emulates a smaller GPU (e.g. 40 for the paper's A100-40GB): torch's
allocator is capped so that torch + libminikv stay under it.

Tensor parallelism: started by torchrun, every rank holds 1/W of the attention heads and of
the MLP (transformers' tensor-parallel plan, NCCL on GPUs, gloo on the CPU) and the minikv
engine one cache per rank with that rank's heads. The random weights then come from
transformers' loader, which initializes each rank's own shards (rank 0 writes a checkpoint
holding only the config and the final norm). Memory is per rank (--memory-limit-gb per
GPU; peak = the largest rank's, peak_bytes_per_rank each), times are the slowest rank's,
and a batch fits only when it fits on every rank. Only rank 0 prints and writes. (A rank
that ran out of memory in the middle of a step would leave the others waiting in a
collective; the ranks allocate the same sizes, so they run out at the same call.)

Writes bench/results/system-<date>-<device>/system.json and fig11_memory.png,
fig12_max_prompt.png, fig13_latency.png, fig13_throughput.png (matplotlib; --plot-only
JSON redraws them from a saved run).

    MINIKV_LIBRARY=build-cuda/libminikv.so python3 scripts/system_bench.py --memory-limit-gb 40
    MINIKV_LIBRARY=build-hf/libminikv.so python3 scripts/system_bench.py --tiny   # CPU smoke
    NCCL_NVLS_ENABLE=0 MINIKV_LIBRARY=build-cuda/libminikv.so \
        torchrun --nproc-per-node 2 scripts/system_bench.py --memory-limit-gb 40   # TP = 2
    MINIKV_LIBRARY=build-hf/libminikv.so torchrun --nproc-per-node 2 scripts/system_bench.py \
        --device cpu --tiny                                          # TP = 2, gloo (CPU smoke)
"""
from __future__ import annotations

import argparse
import datetime
import gc
import inspect
import json
import math
import os
import platform
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402

import minikv  # noqa: E402
from results import git_commit, write_json  # noqa: E402
from minikv.hf import MiniKVGenerator, tensor_parallel_heads  # noqa: E402

GiB = 1 << 30
LLAMA2_7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, head_dim=128)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, head_dim=64)
# The paper's MiniKV setting: 2-bit keys and values, G = 16, R = 128, 50% budget.
MINIKV_SETTINGS = {
    "pyramid-50": dict(heavy_ratio=0.25, recent_ratio=0.25, budget_policy="pyramid"),
    "uniform-50": dict(heavy_ratio=0.25, recent_ratio=0.25, budget_policy="uniform"),
}


class OutOfMemory(Exception):
    pass


def is_oom(e):
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    if isinstance(e, minikv.MinikvError):
        return e.status in (minikv.Status.OUT_OF_MEMORY, minikv.Status.CAPACITY_EXCEEDED)
    return isinstance(e, RuntimeError) and "out of memory" in str(e).lower()


def local(p):
    """This rank's part of a parameter (a DTensor under tensor parallelism)."""
    return p.to_local() if hasattr(p, "to_local") else p


class Bench:
    def __init__(self, args):
        self.args = args
        self.world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun: tensor-parallel ranks
        self.rank = int(os.environ.get("RANK", "0"))
        self.device = torch.device(args.device)
        if self.world > 1:
            self._init_distributed()
        if self.device.type == "cuda" and self.device.index is None:  # memory calls need an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.dtype = torch.float16 if self.cuda else torch.float32
        shape = TINY if args.tiny else LLAMA2_7B
        cfg = transformers.LlamaConfig(max_position_embeddings=1 << 20, **shape)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        t = time.time()
        if self.world > 1:
            self.model = self._tensor_parallel_model(cfg)
        else:
            default = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)  # random weights made directly in fp16
            try:
                with torch.device(self.device):
                    self.model = transformers.LlamaForCausalLM(cfg).eval()
            finally:
                torch.set_default_dtype(default)
        self.cfg = cfg
        self.weights_bytes = sum(local(p).numel() * p.element_size() for p in self.model.parameters())
        tp = f", tensor-parallel over {self.world} ranks (this rank's share)" if self.world > 1 else ""
        print(f"model: LLaMA-2-7B shape{' (tiny)' if args.tiny else ''}, {self.weights_bytes / GiB:.2f} GiB "
              f"of {self.dtype} weights on {self.device}{tp}, built in {time.time() - t:.1f} s", flush=True)
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        # The paper's quantization (MINIKV_PRESET_PAPER) under the chosen budget.
        self.fields = dict(MINIKV_SETTINGS[args.setting], preset="paper")
        # Tokens per pool block, as the preset sets them (the pool is sized in blocks).
        self.block_tokens = minikv.Config.from_preset("paper").residual_length
        self.total = torch.cuda.get_device_properties(self.device).total_memory if self.cuda else 0
        self._kept = {}

    # ---- tensor parallelism -------------------------------------------------------------------
    def _init_distributed(self):
        if self.device.type == "cuda":
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast (SHARP)
            self.device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", device_id=self.device)
        else:
            if torch.cuda.is_available():  # transformers would put the model on the GPU
                raise SystemExit("--device cpu under torchrun: hide the GPUs (CUDA_VISIBLE_DEVICES=)")
            dist.init_process_group("gloo")
        # A world size that does not divide the KV heads is refused here, before loading.
        tensor_parallel_heads(transformers.LlamaConfig(**(TINY if self.args.tiny else LLAMA2_7B)),
                              self.world)

    def _tensor_parallel_model(self, cfg):
        """The model under transformers' tensor-parallel plan, which is applied while loading a
        checkpoint: rank 0 writes one with the config and the final norm only, and the loader
        initializes every missing weight at random on each rank's own shards."""
        from safetensors.torch import save_file
        path = os.path.join(tempfile.gettempdir(),
                            f"minikv-system-bench-{'tiny' if self.args.tiny else 'llama2-7b'}")
        if self.rank == 0:
            os.makedirs(path, exist_ok=True)
            cfg.save_pretrained(path)
            save_file({"model.norm.weight": torch.ones(cfg.hidden_size)},
                      os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        dist.barrier()
        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # not the list of the weights it initialized
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(
                path, distributed_config=transformers.DistributedConfig(tp_plan="auto"),
                dtype=self.dtype, attn_implementation="sdpa").eval()
        finally:
            transformers.logging.set_verbosity(verbosity)

    def agree(self, r):
        """One outcome for every rank (they ran the same calls): out of memory when any rank
        was, the slowest rank's times, the largest rank's peak and each rank's."""
        if self.world == 1:
            return r
        rs = [None] * self.world
        dist.all_gather_object(rs, r)
        ooms = [x["oom"] for x in rs if "oom" in x]
        if ooms:
            return dict(oom=ooms[0])
        out = dict(rs[0])
        for key in ("prefill_s", "decode_s"):
            out[key] = max(x[key] for x in rs)
        out["peak_bytes"] = max(x["peak_bytes"] for x in rs)
        out["peak_bytes_per_rank"] = [x["peak_bytes"] for x in rs]
        return out

    # ---- memory ------------------------------------------------------------------------------
    def _begin(self, reserved_outside=0):
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            if self.args.memory_limit_gb:
                allowed = self.args.memory_limit_gb * GiB - reserved_outside
                if allowed <= torch.cuda.memory_allocated(self.device):
                    raise OutOfMemory("libminikv's pool alone exceeds the memory limit")
                torch.cuda.set_per_process_memory_fraction(allowed / self.total, self.device)

    def _end(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)
            if self.args.memory_limit_gb:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            return torch.cuda.max_memory_allocated(self.device)
        return 0

    def _sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)

    # ---- one run of an engine ---------------------------------------------------------------
    def run(self, engine, batch, prompt, steps, cache_len, static=True):
        """Prefill `batch` random prompts of `prompt` tokens, then `steps` greedy decode steps,
        with caches sized for `cache_len` tokens per sequence. Returns times and memory, or
        raises OutOfMemory."""
        try:
            return (self._run_full if engine == "full" else self._run_minikv)(
                batch, prompt, steps, cache_len, static)
        except Exception as e:  # noqa: BLE001 - OOM of torch or libminikv
            if is_oom(e):
                raise OutOfMemory(str(e).splitlines()[0][:200]) from None
            raise
        finally:
            if self.cuda and self.args.memory_limit_gb:
                torch.cuda.set_per_process_memory_fraction(1.0, self.device)
            gc.collect()
            if self.cuda:
                torch.cuda.empty_cache()

    def _ids(self, batch, prompt):
        g = torch.Generator(device="cpu").manual_seed(batch * 100003 + prompt)
        return torch.randint(0, self.cfg.vocab_size, (batch, prompt), generator=g).to(self.device)

    def _run_full(self, batch, prompt, steps, cache_len, static):
        m, ids = self.model, self._ids(batch, prompt)
        self._begin()
        cache = (transformers.StaticCache(config=self.cfg, max_cache_len=cache_len) if static
                 else transformers.DynamicCache(config=self.cfg))
        with torch.inference_mode():
            t0 = time.perf_counter()
            logits = m(input_ids=ids, use_cache=True, logits_to_keep=1, **{self.cache_kw: cache}).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
            t1 = time.perf_counter()
            for i in range(steps):
                pos = torch.full((batch, 1), prompt + i, device=self.device, dtype=torch.long)
                logits = m(input_ids=nxt, position_ids=pos, use_cache=True,
                           **{self.cache_kw: cache}).logits
                nxt = logits[:, -1].argmax(-1, keepdim=True)
            self._sync()
            t2 = time.perf_counter()
        kv = sum(t.numel() * t.element_size() for layer in cache.layers
                 for t in (layer.keys, layer.values) if t is not None)
        peak = self._end()
        del cache, logits
        return dict(prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, peak_bytes=peak,
                    kv_bytes=kv, torch_peak_bytes=peak)

    def kept_per_layer(self, prompt):
        """Tokens the budget keeps in each layer of one prompt of this length, as
        src/policy.cpp selects them (CUMULATIVE scores: floor(h_l L) + floor(r L), or all)."""
        f, m = self.fields, self.cfg.num_hidden_layers
        h, r = f["heavy_ratio"], f["recent_ratio"]
        ratios = [h] * m
        if f["budget_policy"] == "pyramid":
            delta = f.get("pyramid_depth", 7.0)
            bottom, top = h * (2 - 1 / delta), h / delta
            ratios = [min(max(bottom + (top - bottom) * l / (m - 1), 0.0), 1 - r) if m > 1 else
                      min(h, 1 - r) for l in range(m)]

        def floor(x):
            return int(math.floor(x + 1e-9 * (1 + x)))
        return [prompt if hl + r >= 1 - 1e-12 or floor(hl * prompt) + floor(r * prompt) >= prompt
                else floor(hl * prompt) + floor(r * prompt) for hl in ratios]

    def check_kept(self, prompt):
        """kept_per_layer against what the library keeps (a batch-1 prefill)."""
        with MiniKVGenerator(self.model, max_sequences=1, max_seq_len=prompt, **self.fields) as g:
            g.prefill(self._ids(1, prompt))
            got = [g.cache.sequence_length(0, l).cached for l in range(self.cfg.num_hidden_layers)]
        if got != self.kept_per_layer(prompt):
            raise AssertionError(f"kept tokens per layer at prompt {prompt}: library {got}, "
                                 f"model {self.kept_per_layer(prompt)}")

    def _run_minikv(self, batch, prompt, steps, cache_len, static):
        R = self.block_tokens
        gen_tokens = cache_len - prompt
        # The pool holds what the budget keeps plus the generated tokens (whole blocks of R
        # tokens per sequence and layer, one block of slack), not max_seq_len per slot.
        blocks = sum((k + gen_tokens + R - 1) // R + 1 for k in self.kept_per_layer(prompt))
        ids = self._ids(batch, prompt)
        gen = MiniKVGenerator(self.model, max_sequences=batch, max_seq_len=cache_len,
                              max_tokens=batch * blocks * R, **self.fields)
        try:
            st = gen.memory_stats()
            outside = st.pool_bytes + st.workspace_bytes
            self._begin(outside)
            with torch.inference_mode():
                t0 = time.perf_counter()
                group = self.args.prefill_group  # bounds the packed prefill's activations
                logits = torch.cat([gen.prefill(ids[i:i + group], seq_ids=range(i, min(i + group, batch)))
                                    for i in range(0, batch, group)])
                nxt = logits.argmax(-1)
                self._sync()
                t1 = time.perf_counter()
                for _ in range(steps):
                    nxt = gen.step(nxt).argmax(-1)
                self._sync()
                t2 = time.perf_counter()
            torch_peak = self._end()
            st = gen.memory_stats()
        finally:
            gen.close()
        return dict(prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, peak_bytes=torch_peak + outside,
                    torch_peak_bytes=torch_peak, kv_bytes=st.pool_bytes, kv_used_bytes=st.used_bytes,
                    workspace_bytes=st.workspace_bytes, compression_ratio=st.compression_ratio)

    # ---- searches ---------------------------------------------------------------------------
    def largest(self, fits, start, limit, resolution):
        """The largest n in [start, limit] with fits(n) (doubling, then bisection to
        `resolution`, or to 1/16 of the lower bound when resolution is 0)."""
        if not fits(start):
            return 0
        lo, hi = start, None
        while hi is None:
            n = min(lo * 2, limit)
            if n == lo:
                return lo
            if fits(n):
                lo = n
            else:
                hi = n
        while hi - lo > (resolution or max(1, lo // 16)):
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
        return lo

    def attempt(self, engine, *a, **k):
        try:
            r = self.run(engine, *a, **k)
        except OutOfMemory as e:
            r = dict(oom=str(e))
        return self.agree(r)


def fig11(b, args, res):
    """Peak memory vs batch (prompt, caches for prompt + gen), and the largest batch."""
    cache_len = args.prompt + args.gen
    out = {}
    for engine in ("full", "minikv"):
        rows = []
        for batch in args.mem_batches:
            r = b.attempt(engine, batch, args.prompt, args.mem_steps, cache_len)
            r["batch"] = batch
            rows.append(r)
            print(f"  fig11 {engine:6} batch {batch:4}: " + (
                f"OOM ({r['oom'][:60]})" if "oom" in r else
                f"peak {r['peak_bytes'] / GiB:7.2f} GiB (KV {r['kv_bytes'] / GiB:6.2f} GiB), "
                f"prefill {r['prefill_s']:.2f} s" + (
                    "; peak per rank " + ", ".join(f"{x / GiB:.2f}" for x in r["peak_bytes_per_rank"])
                    + " GiB" if "peak_bytes_per_rank" in r else "")), flush=True)
            if "oom" in r:
                break

        def fits(n):
            r = b.attempt(engine, n, args.prompt, 2, cache_len)
            print(f"  fig11 {engine:6} largest-batch probe {n:5}: {'fits' if 'oom' not in r else 'OOM'}",
                  flush=True)
            return "oom" not in r

        biggest = b.largest(fits, 1, args.max_batch, args.batch_resolution)
        out[engine] = dict(points=rows, largest_batch=biggest)
        print(f"  fig11 {engine}: largest batch at prompt {args.prompt} + gen {args.gen}: {biggest}",
              flush=True)
    res["fig11"] = dict(prompt=args.prompt, gen=args.gen, **out)


def fig12(b, args, res):
    """The longest prompt that runs at batch 1 (prefill + 4 decode steps)."""
    out = {}
    for engine in ("full", "minikv"):
        tried = []

        def fits(n):
            r = b.attempt(engine, 1, n, 4, n + 16, static=False)
            r["prompt"] = n
            tried.append(r)
            print(f"  fig12 {engine:6} prompt {n:7}: " + (
                "OOM" if "oom" in r else f"peak {r['peak_bytes'] / GiB:7.2f} GiB, prefill {r['prefill_s']:.1f} s"),
                flush=True)
            return "oom" not in r

        longest = b.largest(fits, args.min_length, args.max_length, args.length_resolution)
        out[engine] = dict(longest_prompt=longest, tried=tried,
                           capped=longest >= args.max_length)
        print(f"  fig12 {engine}: longest prompt at batch 1: {longest}"
              f"{' (the --max-length cap)' if longest >= args.max_length else ''}", flush=True)
    res["fig12"] = out


def fig13(b, args, res):
    lat = {}
    for engine in ("full", "minikv"):
        rows = []
        for p in args.latency_prompts:
            r = b.attempt(engine, 1, p, args.latency_gen, p + args.latency_gen)
            r["prompt"] = p
            if "oom" not in r:
                r["ms_per_token"] = 1000 * r["decode_s"] / args.latency_gen
            rows.append(r)
            print(f"  fig13a {engine:6} prompt {p:6}: " + (
                "OOM" if "oom" in r else f"{r['ms_per_token']:.2f} ms/token"), flush=True)
        lat[engine] = rows
    thr = {}
    largest = res.get("fig11", {})
    for engine in ("full", "minikv"):
        batch = largest.get(engine, {}).get("largest_batch") or args.throughput_batch
        r = None
        while batch >= 1:
            r = b.attempt(engine, batch, args.prompt, args.gen, args.prompt + args.gen)
            if "oom" not in r:
                break
            batch = int(batch * 0.9)  # the short probe fitted but the long run did not
        r["batch"] = batch
        if "oom" not in r:
            r["decode_tokens_per_s"] = batch * args.gen / r["decode_s"]
            r["tokens_per_s"] = batch * args.gen / (r["prefill_s"] + r["decode_s"])
            print(f"  fig13b {engine:6} batch {batch}: {r['tokens_per_s']:.0f} tokens/s end to end, "
                  f"{r['decode_tokens_per_s']:.0f} tokens/s decoding", flush=True)
        thr[engine] = r
    res["fig13"] = dict(latency_gen=args.latency_gen, latency=lat, throughput=thr,
                        prompt=args.prompt, gen=args.gen)


# ---- plots ----------------------------------------------------------------------------------
def plot(res, out_dir):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNGs (pip install matplotlib; then --plot-only)")
        return []
    files = []
    colors = {"full": "tab:gray", "minikv": "tab:blue"}
    tp = res["meta"].get("tensor_parallel") or 1
    label = {e: text + (f", TP={tp}" if tp > 1 else "") for e, text in
             (("full", "full cache (SDPA)"), ("minikv", "libminikv " + res["meta"]["setting"]))}
    limit = res["meta"].get("memory_limit_gb")

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        files.append(path)

    # A CPU run has no device memory to measure: it plots the KV cache's bytes instead.
    on_gpu = bool(res["meta"].get("device_memory_bytes"))
    metric = "peak_bytes" if on_gpu else "kv_bytes"
    metric_label = "peak GPU memory (GiB)" if on_gpu else "KV cache (GiB; CPU run)"
    if "fig11" in res:
        f = res["fig11"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for e in ("full", "minikv"):
            pts = [p for p in f[e]["points"] if "oom" not in p]
            ax.plot([p["batch"] for p in pts], [p[metric] / GiB for p in pts], "o-",
                    color=colors[e], label=f"{label[e]} (largest batch {f[e]['largest_batch']})")
            ax.axvline(f[e]["largest_batch"], color=colors[e], ls=":", lw=1)  # the probed limit
        if limit:
            ax.axhline(limit, color="tab:red", ls="--", lw=1, label=f"memory limit {limit} GiB")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel(metric_label)
        ax.set_title(f"Fig. 11: prompt {f['prompt']}, caches for +{f['gen']} tokens")
        ax.legend(fontsize=8)
        save(fig, "fig11_memory.png")
    if "fig12" in res:
        f = res["fig12"]
        fig, ax = plt.subplots(figsize=(5, 4))
        es = ["full", "minikv"]
        vals = [f[e]["longest_prompt"] for e in es]
        bars = ax.bar([label[e] for e in es], vals, color=[colors[e] for e in es])
        for bar, v, e in zip(bars, vals, es):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v}{'+' if f[e]['capped'] else ''}",
                    ha="center", va="bottom")
        ax.set_ylabel("longest prompt at batch 1 (tokens)")
        ax.set_title("Fig. 12: maximum prompt length" + (f" ({limit} GiB)" if limit else ""))
        save(fig, "fig12_max_prompt.png")
    if "fig13" in res:
        f = res["fig13"]
        fig, ax = plt.subplots(figsize=(6, 4))
        for e in ("full", "minikv"):
            pts = [p for p in f["latency"][e] if "oom" not in p]
            ax.plot([p["prompt"] for p in pts], [p["ms_per_token"] for p in pts], "o-", color=colors[e],
                    label=label[e])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("decode latency (ms / token)")
        ax.set_title(f"Fig. 13a: batch 1, {f['latency_gen']} generated tokens")
        ax.legend(fontsize=8)
        save(fig, "fig13_latency.png")
        fig, ax = plt.subplots(figsize=(5, 4))
        es = [e for e in ("full", "minikv") if "oom" not in f["throughput"][e]]
        vals = [f["throughput"][e]["tokens_per_s"] for e in es]
        bars = ax.bar([f"{label[e]}\nbatch {f['throughput'][e]['batch']}" for e in es], vals,
                      color=[colors[e] for e in es])
        for bar, v in zip(bars, vals):
            ax.text(bar.get_x() + bar.get_width() / 2, v, f"{v:.0f}", ha="center", va="bottom")
        ax.set_ylabel("throughput (generated tokens / s)")
        ax.set_title(f"Fig. 13b: prompt {f['prompt']}, gen {f['gen']}, largest batch")
        save(fig, "fig13_throughput.png")
    return files


def ints(s):
    return [int(x) for x in s.split(",") if x]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model and small sizes (CPU smoke)")
    p.add_argument("--figures", default="11,12,13", type=ints)
    p.add_argument("--setting", choices=list(MINIKV_SETTINGS), default="pyramid-50")
    p.add_argument("--memory-limit-gb", type=float, default=0,
                   help="emulate a GPU of this size (0: the whole device)")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--gen", type=int, default=1024)
    p.add_argument("--mem-batches", type=ints, default=ints("1,2,4,8,16,32,64,128,256"))
    p.add_argument("--mem-steps", type=int, default=8, help="decode steps run in the memory test")
    p.add_argument("--max-batch", type=int, default=1024)
    p.add_argument("--batch-resolution", type=int, default=0, help="0: 1/16 of the lower bound")
    p.add_argument("--min-length", type=int, default=4096)
    p.add_argument("--max-length", type=int, default=131072)
    p.add_argument("--length-resolution", type=int, default=2048)
    p.add_argument("--latency-prompts", type=ints, default=ints("1024,2048,4096,8192,16384,32768"))
    p.add_argument("--latency-gen", type=int, default=1024)
    p.add_argument("--throughput-batch", type=int, default=1, help="used when figure 11 did not run")
    p.add_argument("--prefill-group", type=int, default=16,
                   help="libminikv prefills the batch this many sequences at a time")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--plot-only", default=None, help="redraw the PNGs of a system.json")
    args = p.parse_args()

    if args.plot_only:
        with open(args.plot_only) as f:
            res = json.load(f)
        for path in plot(res, os.path.dirname(os.path.abspath(args.plot_only))):
            print("wrote", path)
        return
    if args.tiny:  # small enough for a CPU
        for k, v in dict(prompt=256, gen=64, mem_batches=[1, 2, 4], mem_steps=2, max_batch=8,
                         min_length=512, max_length=2048, length_resolution=512,
                         latency_prompts=[128, 256, 512], latency_gen=16, prefill_group=4).items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    started = time.time()
    if int(os.environ.get("RANK", "0")) != 0:  # tensor parallelism: rank 0 reports for all
        sys.stdout = open(os.devnull, "w")
    b = Bench(args)
    if args.tiny:  # the pool sizing's model of the budget, against the library
        for n in (args.prompt, 300, 1000):
            b.check_kept(n)
        print("kept tokens per layer: the pool sizing agrees with the library", flush=True)
    dev = torch.cuda.get_device_name(b.device) if b.cuda else (platform.processor() or platform.machine())
    res = dict(meta=dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), device=dev,
        commit=git_commit(), libminikv=minikv.library_version(), library_path=minikv.library_path(),
        torch=torch.__version__, transformers=transformers.__version__,
        model="tiny" if args.tiny else "LLaMA-2-7B shape, random weights", dtype=str(b.dtype),
        weights_bytes=b.weights_bytes, setting=args.setting, minikv_fields=b.fields,
        memory_limit_gb=args.memory_limit_gb or None, tensor_parallel=b.world,
        device_memory_bytes=b.total, args=vars(args),
        note="peak = torch max_memory_allocated + libminikv pool + workspace; full engine: "
             "StaticCache (DynamicCache in fig12), SDPA"))
    if not b.cuda:
        res["meta"]["note"] += "; CPU run: no device memory, peak_bytes is 0 and nothing runs out"
    out_dir = args.out_dir or os.path.join(
        ROOT, "bench", "results",
        f"system-{datetime.date.today().isoformat()}-{'cuda' if b.cuda else 'cpu'}"
        f"{f'-tp{b.world}' if b.world > 1 else ''}{'-tiny' if args.tiny else ''}")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "system.json")

    def save():  # after every figure, so a run cut short (a time limit) keeps what it measured
        res["meta"]["seconds"] = time.time() - started
        if b.rank == 0:
            write_json(path, res)

    for fig, fn in ((11, fig11), (12, fig12), (13, fig13)):
        if fig in args.figures:
            print(f"figure {fig}", flush=True)
            t = time.time()
            fn(b, args, res)
            res[f"fig{fig}"]["seconds"] = time.time() - t
            save()
    print("wrote", path)
    for png in plot(res, out_dir) if b.rank == 0 else ():
        print("wrote", png)
    print(f"done in {time.time() - started:.0f} s")
    if b.world > 1:
        dist.barrier()  # as in tp_generate.py: no rank tears gloo down under a peer
        dist.destroy_process_group()
        # Nor the interpreter's teardown after gloo's: it can abort there (tp_generate.py).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
