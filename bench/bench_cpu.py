#!/usr/bin/env python3
"""CPU benchmark of libminikv against PyTorch's CPU scaled_dot_product_attention (issue 20).

Same thread count for both (MINIKV_NUM_THREADS and torch.set_num_threads), one layer,
batch 1, inputs random normal; each number is a median of several calls:
  - decode: libminikv over its compressed cache (presets "paper": 2-bit, G = 16, and
    "balanced", the default: 4-bit keys, 2-bit values, G = 32, 4 sinks; R = 128, heavy 0.25
    + recent 0.25 = 50% of the prompt kept) vs SDPA over the full uncompressed cache of L
    tokens, in fp32 and in fp16 (a q_len-1 query, GQA through enable_gqa);
  - prefill: libminikv ("paper" preset: causal attention + CUMULATIVE or WINDOW scores + selection +
    quantization into the cache) vs SDPA's causal attention alone.
And this machine's measured ceilings (bench/cpu_peak.c: a STREAM-like copy, an FMA loop and
a multiply + add loop), so GB/s and GFLOP/s read against the limit.

How the two sides are timed. Each runs in a process of its own, as a user running only it
would: libminikv in one (no PyTorch loaded), PyTorch in two, one with libgomp's default
wait policy (its OpenMP workers spin a while after each parallel region, then sleep) and one
with OMP_WAIT_POLICY=PASSIVE (they sleep at once); the baseline reported is the faster of
the two. This script drives them in turns: a block of consecutive calls of one function
(the first untimed, below 20 ms a call), then the next function's block, rounds of that, the
order rotated each round, so that all of them see the same load on a shared machine (slow
functions: blocks of at most ~0.4 s after the first round, at least one call). Before each block it
waits until every thread of every worker is idle (their CPU time, /proc/PID/task/*/schedstat,
unchanged for a few ms): one side's spinning threads never take the other side's cores.
Both numbers come from one invocation. (Timing both in one process, calls interleaved, made
each side pay for the other's threads: PyTorch's spinning workers kept the cores libminikv's
pool needed, and SDPA's calls left libminikv's cache cold.)

The decode cache of length L is built as the prefill would leave it (L/2 tokens kept): a
prefill of min(L, --prefill-cap) tokens, then appends up to L/2 cached tokens, so that long
contexts need no O(L^2) prefill; decode time depends on the cached tokens only.

  python3 bench/bench_cpu.py --out bench/results/DATE_cpu_COMMIT.json [--threads 2]
      [--decode-lengths 4096,32768] [--prefill-shapes 8/2/64/2048,32/8/128/4096]

Needs torch (CPU) and a built libminikv (MINIKV_LIBRARY or the repository's build dirs).
"""
import argparse
import ctypes
import datetime
import glob
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))

# The baseline's processes: name -> environment added to the parent's.
BASELINE_WAIT_POLICIES = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"}}


# ---- the worker processes ------------------------------------------------------------------

def timed_block(fn, reps, warmup, clock):
    """ms per call of `reps` consecutive calls of fn, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = clock()
        fn()
        times.append((clock() - t0) * 1e3)
    return times


class MinikvSide:
    """libminikv through raw ctypes calls (no per-call checks in the timed loop); numpy
    inputs, no PyTorch in this process."""

    def __init__(self):
        import numpy as np
        import minikv
        self.np, self.m = np, minikv
        self.lib = minikv.load()
        self.rng = np.random.default_rng(0)
        self.caches = []

    def array(self, shape, dtype):
        a = self.rng.standard_normal(shape, dtype=self.np.float32)
        return a.astype({"f32": self.np.float32, "f16": self.np.float16}[dtype])

    def cache(self, dtype, H, Hkv, D, max_len, mode="cumulative", preset="paper"):
        """A one-layer cache with a library preset: "paper" (2-bit keys and values, G = 16,
        no sinks) or "balanced" (the default: 4-bit keys, 2-bit values, G = 32, 4 sinks);
        both keep 50% of the prompt (heavy 0.25 + recent 0.25), R = 128."""
        cache = self.m.Cache(self.m.Config.from_preset(
            preset, backend="cpu", dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=Hkv,
            head_dim=D, max_sequences=1, max_seq_len=max_len, score_mode=mode))
        self.caches.append(cache)
        return cache

    def check(self, status, handle):
        if status != 0:
            raise RuntimeError(self.lib.minikv_cache_last_error(handle))

    def info(self):
        return dict(library=self.m.library_version(), library_path=self.m.library_path())

    def clear(self):
        for cache in self.caches:
            cache.close()
        self.caches = []

    def setup_decode(self, dtype, preset, H, Hkv, D, L, prefill_cap):
        cache = self.cache(dtype, H, Hkv, D, L + 16, preset=preset)
        h = ctypes.c_void_p(cache.handle)
        ids = (ctypes.c_uint32 * 1)(0)
        lp = min(L, prefill_cap)
        q, k, v = self.array((lp, H, D), dtype), self.array((lp, Hkv, D), dtype), self.array((lp, Hkv, D), dtype)
        out = self.np.empty_like(q)
        cu = (ctypes.c_int32 * 2)(0, lp)
        self.check(self.lib.minikv_prefill(h, 0, 1, ids, cu, ptr(q), ptr(k), ptr(v), ptr(out), None), h)
        kn, vn = self.array((Hkv, D), dtype), self.array((Hkv, D), dtype)
        seen, cached = cache.sequence_length(0, 0)
        while cached < L // 2 + 1:  # the prompt's kept half, plus the new token
            self.check(self.lib.minikv_append(h, 0, 1, ids, ptr(kn), ptr(vn), None), h)
            seen, cached = cache.sequence_length(0, 0)
        qd = self.array((H, D), dtype)
        od = self.np.empty_like(qd)
        qp, op = ptr(qd), ptr(od)  # built once: the timed call is the C call and its check
        fns = {"decode": lambda: self.check(self.lib.minikv_decode(h, 0, 1, ids, qp, op, None), h)}
        return fns, dict(cached_tokens=cached, minikv_bytes=cache.memory_stats().used_bytes)

    def setup_prefill(self, dtype, H, Hkv, D, L):
        q, k, v = self.array((L, H, D), dtype), self.array((L, Hkv, D), dtype), self.array((L, Hkv, D), dtype)
        out = self.np.empty_like(q)
        ids = (ctypes.c_uint32 * 1)(0)
        cu = (ctypes.c_int32 * 2)(0, L)
        ptrs = (ptr(q), ptr(k), ptr(v), ptr(out))  # built once, outside the timed calls
        fns = {}
        for mode in ("cumulative", "window"):
            h = ctypes.c_void_p(self.cache(dtype, H, Hkv, D, L, mode).handle)

            def call(h=h):  # prefill, then release so that the next call can prefill again
                self.check(self.lib.minikv_prefill(h, 0, 1, ids, cu, *ptrs, None), h)
                self.lib.minikv_sequence_release(h, 0)
            fns[f"prefill_{mode}"] = call
        return fns, {}


class TorchSide:
    """PyTorch's scaled_dot_product_attention on the full uncompressed cache."""

    def __init__(self, threads):
        import torch
        import torch.nn.functional as F
        self.torch, self.F = torch, F
        torch.set_num_threads(threads)
        torch.manual_seed(0)

    def clear(self):
        pass

    def info(self):
        return dict(torch=self.torch.__version__,
                    torch_cpu_capability=self.torch.backends.cpu.get_cpu_capability())

    def setup_decode(self, H, Hkv, D, L, **_):
        torch, F = self.torch, self.F
        fns = {}
        for name, dt in (("f32", torch.float32), ("f16", torch.float16)):
            q = torch.randn(1, H, 1, D, dtype=dt)
            k = torch.randn(1, Hkv, L + 1, D, dtype=dt)
            v = torch.randn(1, Hkv, L + 1, D, dtype=dt)
            fns[f"sdpa_{name}"] = lambda q=q, k=k, v=v: F.scaled_dot_product_attention(
                q, k, v, enable_gqa=H != Hkv)
        return fns, {}

    def setup_prefill(self, H, Hkv, D, L, **_):
        # fp32 (PyTorch's CPU flash kernel; its fp16 path is far slower on CPUs without
        # native fp16 arithmetic), [1, heads, L, D] contiguous.
        torch, F = self.torch, self.F
        q = torch.randn(1, H, L, D)
        k = torch.randn(1, Hkv, L, D)
        v = torch.randn(1, Hkv, L, D)
        return {"sdpa_causal": lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=H != Hkv)}, {}


def worker_main(side_name, threads, cpu_time):
    """Answers the driver's JSON commands, one a line on stdin, one reply a line."""
    channel = sys.stdout
    sys.stdout = sys.stderr  # only replies on the channel
    clock = time.thread_time if cpu_time else time.perf_counter
    side = MinikvSide() if side_name == "minikv" else TorchSide(threads)
    fns = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd.pop("op")
            if op == "quit":
                break
            if op == "setup_decode":
                fns, reply = side.setup_decode(**cmd)
            elif op == "setup_prefill":
                fns, reply = side.setup_prefill(**cmd)
            elif op == "time":
                reply = dict(ms=timed_block(fns[cmd["fn"]], cmd["reps"], cmd["warmup"], clock))
            elif op == "info":
                reply = side.info()
            elif op == "clear":
                fns = {}
                side.clear()
                reply = {}
            else:
                raise ValueError(f"unknown op {op}")
        except Exception:
            reply = dict(error=traceback.format_exc())
        channel.write(json.dumps(reply) + "\n")
        channel.flush()


def ptr(a):
    """A void pointer to the array's data that keeps the array alive (numpy's data_as)."""
    return a.ctypes.data_as(ctypes.c_void_p)


# ---- the driver ----------------------------------------------------------------------------

class Worker:
    def __init__(self, name, side, threads, cpu_time, env):
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", side, "--threads", str(threads)]
            + (["--cpu-time"] if cpu_time else []),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env={**os.environ, **env})

    def call(self, op, **args):
        self.proc.stdin.write(json.dumps(dict(op=op, **args)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited ({self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.name}: {reply['error']}")
        return reply

    def cpu_ns(self):
        """CPU time of all of this process's threads so far."""
        total = 0
        for path in glob.glob(f"/proc/{self.proc.pid}/task/*/schedstat"):
            try:
                with open(path) as f:
                    total += int(f.read().split()[0])
            except (OSError, ValueError, IndexError):
                pass  # a thread that ended meanwhile
        return total

    def close(self):
        try:
            self.call("quit")
        except (RuntimeError, OSError, ValueError):
            pass
        self.proc.wait()


class Driver:
    def __init__(self, workers):
        self.workers = workers
        self.waits_ms = []
        self.not_parked = 0

    def park(self, window_s=0.003, timeout_s=2.0):
        """Waits until no worker thread runs: their CPU time moves by less than 2% of a
        window of 3 ms (the driver's last reply is already read, so only spinning or
        background threads would run)."""
        t0 = time.perf_counter()
        before = sum(w.cpu_ns() for w in self.workers)
        while True:
            time.sleep(window_s)
            now = sum(w.cpu_ns() for w in self.workers)
            if now - before < 0.02 * window_s * 1e9:
                break
            before = now
            if time.perf_counter() - t0 > timeout_s:
                self.not_parked += 1
                break
        self.waits_ms.append((time.perf_counter() - t0) * 1e3)

    def measure(self, entries, reps, rounds, warmup, block_budget_ms=400.0):
        """entries: (worker, fn) pairs. `rounds` rounds of a block of calls per entry, the
        entries' order rotated each round; returns the median and minimum ms per entry.
        After the first round a slow function's blocks shrink to what fits block_budget_ms
        (at least one call), and functions of 20 ms or more skip the untimed call."""
        per_block = max(1, math.ceil(reps / rounds))
        times = [[] for _ in entries]
        for r in range(rounds):
            for j in range(len(entries)):
                i = (j + r) % len(entries)
                worker, fn = entries[i]
                n, w = per_block, warmup
                if times[i]:
                    t = statistics.median(times[i])
                    n = max(1, min(per_block, int(block_budget_ms / t)))
                    w = warmup if t < 20.0 else 0
                self.park()
                times[i] += worker.call("time", fn=fn, reps=n, warmup=w)["ms"]
        return [(statistics.median(t), min(t)) for t in times]


def machine_peak(threads, cpu_time):
    exe = os.path.join(tempfile.mkdtemp(prefix="minikv-peak-"), "cpu_peak")
    subprocess.run(["cc", "-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-fopenmp", os.path.join(HERE, "cpu_peak.c"),
                    "-o", exe], check=True)
    out = subprocess.run([exe, str(threads)] + (["cpu"] if cpu_time else []), check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def load_average():
    try:
        return os.getloadavg()
    except OSError:
        return None


def best_baseline(res, key, timings):
    """timings: wait policy -> (median, min) ms. Records each, and the faster as `key`."""
    for policy, (t, t_min) in timings.items():
        res[f"{key}_{policy}_ms"] = t
    policy = min(timings, key=lambda p: timings[p][0])
    res[f"{key}_ms"], res[f"{key}_min_ms"] = timings[policy]
    res[f"{key}_wait_policy"] = policy
    return timings[policy][0]


def bench_decode(drv, mkv, baselines, dtype, H, Hkv, D, L, reps, rounds, prefill_cap, peak, preset):
    shape = dict(H=H, Hkv=Hkv, D=D, L=L)
    info = mkv.call("setup_decode", dtype=dtype, preset=preset, prefill_cap=prefill_cap, **shape)
    for b in baselines:
        b.call("setup_decode", **shape)
    entries = [(mkv, "decode")] + [(b, f"sdpa_{n}") for n in ("f32", "f16") for b in baselines]
    times = drv.measure(entries, reps, rounds, warmup=1)
    for w in [mkv] + baselines:
        w.call("clear")
    (t_mkv, t_mkv_min) = times[0]
    used, cached = info["minikv_bytes"], info["cached_tokens"]
    res = dict(kind="decode", preset=preset, dtype=dtype, H=H, Hkv=Hkv, D=D, L=L, cached_tokens=cached,
               minikv_ms=t_mkv, minikv_min_ms=t_mkv_min, minikv_bytes=used,
               minikv_GBps=used / (t_mkv * 1e-3) / 1e9,
               minikv_GFLOPs=4.0 * H * cached * D / (t_mkv * 1e-3) / 1e9)
    for k, name in enumerate(("f32", "f16")):
        by_policy = {b.name: times[1 + k * len(baselines) + j] for j, b in enumerate(baselines)}
        t = best_baseline(res, f"sdpa_{name}", by_policy)
        full = 2 * Hkv * (L + 1) * D * (4 if name == "f32" else 2)
        res[f"sdpa_{name}_GBps"] = full / (t * 1e-3) / 1e9
        res[f"speedup_vs_sdpa_{name}"] = t / t_mkv
    res["minikv_fraction_of_copy"] = res["minikv_GBps"] / peak["copy_GBps"]
    return res


def bench_prefill(drv, mkv, baselines, dtype, H, Hkv, D, L, reps, peak):
    shape = dict(H=H, Hkv=Hkv, D=D, L=L)
    mkv.call("setup_prefill", dtype=dtype, **shape)
    for b in baselines:
        b.call("setup_prefill", **shape)
    modes = ("cumulative", "window")
    entries = [(mkv, f"prefill_{m}") for m in modes] + [(b, "sdpa_causal") for b in baselines]
    # One call per block, each block after an untimed call of the same function.
    times = drv.measure(entries, reps, rounds=reps, warmup=1)
    for w in [mkv] + baselines:
        w.call("clear")
    flops = 4.0 * H * D * L * (L + 1) / 2  # causal QK^T and PV
    res = dict(kind="prefill", dtype=dtype, **shape)
    for mode, (t, t_min) in zip(modes, times):
        res[f"minikv_{mode}_ms"] = t
        res[f"minikv_{mode}_min_ms"] = t_min
        res[f"minikv_{mode}_GFLOPs"] = flops / (t * 1e-3) / 1e9
    t = best_baseline(res, "sdpa_f32", {b.name: times[2 + j] for j, b in enumerate(baselines)})
    res["sdpa_f32_GFLOPs"] = flops / (t * 1e-3) / 1e9
    res["cumulative_over_sdpa"] = res["minikv_cumulative_ms"] / t
    res["window_over_sdpa"] = res["minikv_window_ms"] / t
    res["minikv_cumulative_fraction_of_fma_peak"] = res["minikv_cumulative_GFLOPs"] / peak["fma_GFLOPs"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="f32,f16", help="libminikv's dtype (its cache's scales and residual)")
    ap.add_argument("--decode-shapes", default="8/2/64,32/8/128", help="H/Hkv/D")
    ap.add_argument("--decode-lengths", default="4096,32768")
    ap.add_argument("--prefill-shapes", default="8/2/64/2048,32/8/128/4096", help="H/Hkv/D/L")
    ap.add_argument("--presets", default="paper,balanced", help="decode cache settings (see MinikvSide.cache)")
    ap.add_argument("--prefill-cap", type=int, default=4096, help="longest prefill building a decode cache")
    ap.add_argument("--decode-reps", type=int, default=48)
    ap.add_argument("--decode-rounds", type=int, default=6, help="blocks of decode calls per function")
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--baseline-wait-policies", default=",".join(BASELINE_WAIT_POLICIES),
                    help="PyTorch processes to time, the faster reported: "
                         + ", ".join(f"{k} ({v or 'libgomp default'})" for k, v in BASELINE_WAIT_POLICIES.items()))
    ap.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time (--threads 1)")
    ap.add_argument("--worker", choices=("minikv", "torch"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time measures the calling thread only: use --threads 1")
    if args.worker:
        return worker_main(args.worker, args.threads, args.cpu_time)
    if not args.out:
        ap.error("--out is required")

    os.environ["MINIKV_NUM_THREADS"] = str(args.threads)  # read when a cache is created
    from results import git_commit, write_json
    policies = args.baseline_wait_policies.split(",")
    mkv = Worker("minikv", "minikv", args.threads, args.cpu_time, {})
    baselines = [Worker(p, "torch", args.threads, args.cpu_time, BASELINE_WAIT_POLICIES[p]) for p in policies]
    drv = Driver([mkv] + baselines)

    method = ("separate processes driven in turns, each block after every worker thread idled; "
              f"libminikv alone in one, PyTorch in {len(baselines)} (wait policy "
              + " / ".join(f"{p}: {BASELINE_WAIT_POLICIES[p] or 'libgomp default'}" for p in policies)
              + f"), the faster baseline reported; decode: {args.decode_rounds} rounds of blocks of "
              "consecutive calls after one untimed (slow functions: fewer calls, at least one per "
              "block, no untimed call from 20 ms); prefill: one call per block after one untimed "
              "(none from 20 ms)")
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs",
                commit=git_commit() or "?", threads=args.threads, **mkv.call("info"),
                **baselines[0].call("info"), load_before=load_average(), clock="thread CPU time" if args.cpu_time else "wall",
                method=method)
    peak = machine_peak(args.threads, args.cpu_time)
    meta["peak"] = peak
    print(f"{meta['machine']}  commit {meta['commit']}  threads {args.threads}  load {meta['load_before']}")
    print(f"method: {method}")
    print(f"peak: copy {peak['copy_GBps']:.1f} GB/s, FMA {peak['fma_GFLOPs']:.0f} GFLOP/s, "
          f"mul+add {peak['muladd_GFLOPs']:.0f} GFLOP/s", flush=True)
    rows = []

    def save():
        meta["load_after"] = load_average()
        meta["park_wait_ms_max"] = max(drv.waits_ms, default=0)
        meta["park_timeouts"] = drv.not_parked
        write_json(args.out, dict(meta=meta, results=rows))

    try:
        for dtype in args.dtypes.split(","):
            for preset, shape in ((p, s) for p in args.presets.split(",")
                                  for s in filter(None, args.decode_shapes.split(","))):
                H, Hkv, D = (int(x) for x in shape.split("/"))
                for L in (int(x) for x in filter(None, args.decode_lengths.split(","))):
                    r = bench_decode(drv, mkv, baselines, dtype, H, Hkv, D, L, args.decode_reps,
                                     args.decode_rounds, args.prefill_cap, peak, preset)
                    rows.append(r)
                    print(f"decode  {dtype} {preset} H={H}/{Hkv} D={D} L={L}: minikv {r['minikv_ms']:.3f} ms "
                          f"({r['minikv_GBps']:.1f} GB/s, {r['minikv_GFLOPs']:.1f} GFLOP/s)  sdpa f32 "
                          f"{r['sdpa_f32_ms']:.3f} ms [{r['sdpa_f32_wait_policy']}] ({r['speedup_vs_sdpa_f32']:.2f}x)  "
                          f"sdpa f16 {r['sdpa_f16_ms']:.3f} ms [{r['sdpa_f16_wait_policy']}] "
                          f"({r['speedup_vs_sdpa_f16']:.2f}x)", flush=True)
                    save()
            for shape in filter(None, args.prefill_shapes.split(",")):
                H, Hkv, D, L = (int(x) for x in shape.split("/"))
                r = bench_prefill(drv, mkv, baselines, dtype, H, Hkv, D, L, args.prefill_reps, peak)
                rows.append(r)
                print(f"prefill {dtype} H={H}/{Hkv} D={D} L={L}: cumulative {r['minikv_cumulative_ms']:.1f} ms "
                      f"({r['cumulative_over_sdpa']:.2f}x sdpa, {r['minikv_cumulative_GFLOPs']:.0f} GFLOP/s)  "
                      f"window {r['minikv_window_ms']:.1f} ms ({r['window_over_sdpa']:.2f}x)  "
                      f"sdpa {r['sdpa_f32_ms']:.1f} ms [{r['sdpa_f32_wait_policy']}] "
                      f"({r['sdpa_f32_GFLOPs']:.0f} GFLOP/s)", flush=True)
                save()
    finally:
        for w in drv.workers:
            w.close()
    print(f"load after: {load_average()}; waits for idle workers: max {meta.get('park_wait_ms_max', 0):.0f} ms, "
          f"{meta.get('park_timeouts', 0)} timed out")


if __name__ == "__main__":
    main()
