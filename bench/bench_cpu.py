#!/usr/bin/env python3
"""CPU benchmark of libminikv against PyTorch's CPU scaled_dot_product_attention (issue 20).

One process, the same thread count for both (MINIKV_NUM_THREADS and torch.set_num_threads),
one layer, batch 1, inputs random normal; each number is a median of several calls:
  - decode: libminikv over its compressed cache (presets "paper": 2-bit, G = 16, and
    "balanced", the default: 4-bit keys, 2-bit values, G = 32, 4 sinks; R = 128, heavy 0.25
    + recent 0.25 = 50% of the prompt kept) vs SDPA over the full uncompressed cache of L
    tokens, in fp32 and in fp16 (a q_len-1 query, GQA through enable_gqa);
  - prefill: libminikv ("paper" preset: causal attention + CUMULATIVE or WINDOW scores + selection +
    quantization into the cache) vs SDPA's causal attention alone.
And this machine's measured ceilings (bench/cpu_peak.c: a STREAM-like copy, an FMA loop and
a multiply + add loop), so GB/s and GFLOP/s read against the limit.

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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))


# Wall time; --cpu-time (with --threads 1) uses this thread's CPU time instead, which a
# machine shared with other jobs inflates less (cache and memory contention remain).
CLOCK = [time.perf_counter]


def interleaved_ms(fns, reps, warmup=1):
    """Median and minimum ms per call of each function, the calls interleaved (f1, f2, ...,
    f1, f2, ...) so that all of them see the same load on a shared machine."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    clock = CLOCK[0]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = clock()
            fn()
            times[i].append((clock() - t0) * 1e3)
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


class Minikv:
    """Raw ctypes calls (no per-call checks in the timed loop)."""

    def __init__(self, minikv):
        self.m = minikv
        self.lib = minikv.load()

    def cache(self, dtype, H, Hkv, D, max_len, mode="cumulative", preset="paper"):
        """A one-layer cache with a library preset: "paper" (2-bit keys and values, G = 16,
        no sinks) or "balanced" (the default: 4-bit keys, 2-bit values, G = 32, 4 sinks);
        both keep 50% of the prompt (heavy 0.25 + recent 0.25), R = 128."""
        return self.m.Cache(self.m.Config.from_preset(
            preset, backend="cpu", dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=Hkv,
            head_dim=D, max_sequences=1, max_seq_len=max_len, score_mode=mode))

    def check(self, status, handle):
        if status != 0:
            raise RuntimeError(self.lib.minikv_cache_last_error(handle))


def ptr(t):
    return ctypes.c_void_p(t.data_ptr())


def bench_decode(mk, torch, F, dtype, H, Hkv, D, L, reps, prefill_cap, peak, preset):
    tdtype = {"f32": torch.float32, "f16": torch.float16}[dtype]
    cache = mk.cache(dtype, H, Hkv, D, L + 16, preset=preset)
    h = ctypes.c_void_p(cache.handle)
    ids = (ctypes.c_uint32 * 1)(0)
    lp = min(L, prefill_cap)
    q = torch.randn(lp, H, D, dtype=tdtype)
    k = torch.randn(lp, Hkv, D, dtype=tdtype)
    v = torch.randn(lp, Hkv, D, dtype=tdtype)
    out = torch.empty_like(q)
    cu = (ctypes.c_int32 * 2)(0, lp)
    mk.check(mk.lib.minikv_prefill(h, 0, 1, ids, cu, ptr(q), ptr(k), ptr(v), ptr(out), None), h)
    kn = torch.randn(Hkv, D, dtype=tdtype)
    vn = torch.randn(Hkv, D, dtype=tdtype)
    seen, cached = cache.sequence_length(0, 0)
    while cached < L // 2 + 1:  # the prompt's kept half, plus the new token
        mk.check(mk.lib.minikv_append(h, 0, 1, ids, ptr(kn), ptr(vn), None), h)
        seen, cached = cache.sequence_length(0, 0)
    used = cache.memory_stats().used_bytes
    qd = torch.randn(H, D, dtype=tdtype)
    od = torch.empty_like(qd)
    base = {}
    for name, bt in (("f32", torch.float32), ("f16", torch.float16)):
        base[name] = (torch.randn(1, H, 1, D, dtype=bt), torch.randn(1, Hkv, L + 1, D, dtype=bt),
                      torch.randn(1, Hkv, L + 1, D, dtype=bt))

    def sdpa(name):
        qs, ks, vs = base[name]
        return lambda: F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=H != Hkv)
    (t_mkv, t_mkv_min), (t32, t32_min), (t16, t16_min) = interleaved_ms(
        [lambda: mk.check(mk.lib.minikv_decode(h, 0, 1, ids, ptr(qd), ptr(od), None), h),
         sdpa("f32"), sdpa("f16")], reps, warmup=3)
    cache.close()
    res = dict(kind="decode", preset=preset, dtype=dtype, H=H, Hkv=Hkv, D=D, L=L, cached_tokens=cached,
               minikv_ms=t_mkv, minikv_min_ms=t_mkv_min, minikv_bytes=used,
               minikv_GBps=used / (t_mkv * 1e-3) / 1e9,
               minikv_GFLOPs=4.0 * H * cached * D / (t_mkv * 1e-3) / 1e9)
    for name, t, t_min in (("f32", t32, t32_min), ("f16", t16, t16_min)):
        full = 2 * base[name][1].numel() * base[name][1].element_size()
        res[f"sdpa_{name}_ms"] = t
        res[f"sdpa_{name}_min_ms"] = t_min
        res[f"sdpa_{name}_GBps"] = full / (t * 1e-3) / 1e9
        res[f"speedup_vs_sdpa_{name}"] = t / t_mkv
    res["minikv_fraction_of_copy"] = res["minikv_GBps"] / peak["copy_GBps"]
    return res


def bench_prefill(mk, torch, F, dtype, H, Hkv, D, L, reps, peak):
    tdtype = {"f32": torch.float32, "f16": torch.float16}[dtype]
    q = torch.randn(L, H, D, dtype=tdtype)
    k = torch.randn(L, Hkv, D, dtype=tdtype)
    v = torch.randn(L, Hkv, D, dtype=tdtype)
    out = torch.empty_like(q)
    ids = (ctypes.c_uint32 * 1)(0)
    cu = (ctypes.c_int32 * 2)(0, L)
    flops = 4.0 * H * D * L * (L + 1) / 2  # causal QK^T and PV
    res = dict(kind="prefill", dtype=dtype, H=H, Hkv=Hkv, D=D, L=L)
    caches, calls = [], []
    for mode in ("cumulative", "window"):
        cache = mk.cache(dtype, H, Hkv, D, L, mode)
        h = ctypes.c_void_p(cache.handle)

        def call(h=h):  # prefill, then release so that the next call can prefill again
            mk.check(mk.lib.minikv_prefill(h, 0, 1, ids, cu, ptr(q), ptr(k), ptr(v), ptr(out), None), h)
            mk.lib.minikv_sequence_release(h, 0)
        caches.append(cache)
        calls.append(call)
    # SDPA on fp32 (PyTorch's CPU flash kernel; its fp16 path is far slower on CPUs without
    # native fp16 arithmetic).
    qs = q.float().view(1, L, H, D).transpose(1, 2)
    ks = k.float().view(1, L, Hkv, D).transpose(1, 2)
    vs = v.float().view(1, L, Hkv, D).transpose(1, 2)
    calls.append(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                        enable_gqa=H != Hkv))
    times = interleaved_ms(calls, reps)
    for cache in caches:
        cache.close()
    for mode, (t, t_min) in zip(("cumulative", "window"), times):
        res[f"minikv_{mode}_ms"] = t
        res[f"minikv_{mode}_min_ms"] = t_min
        res[f"minikv_{mode}_GFLOPs"] = flops / (t * 1e-3) / 1e9
    t, t_min = times[2]
    res["sdpa_f32_ms"] = t
    res["sdpa_f32_min_ms"] = t_min
    res["sdpa_f32_GFLOPs"] = flops / (t * 1e-3) / 1e9
    res["cumulative_over_sdpa"] = res["minikv_cumulative_ms"] / t
    res["window_over_sdpa"] = res["minikv_window_ms"] / t
    res["minikv_cumulative_fraction_of_muladd_peak"] = res["minikv_cumulative_GFLOPs"] / peak["muladd_GFLOPs"]
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="f32,f16", help="libminikv's dtype (its cache's scales and residual)")
    ap.add_argument("--decode-shapes", default="8/2/64,32/8/128", help="H/Hkv/D")
    ap.add_argument("--decode-lengths", default="4096,32768")
    ap.add_argument("--prefill-shapes", default="8/2/64/2048,32/8/128/4096", help="H/Hkv/D/L")
    ap.add_argument("--presets", default="paper,balanced", help="decode cache settings (see Minikv.cache)")
    ap.add_argument("--prefill-cap", type=int, default=4096, help="longest prefill building a decode cache")
    ap.add_argument("--decode-reps", type=int, default=51)
    ap.add_argument("--prefill-reps", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true", help="time the calling thread's CPU time (--threads 1)")
    args = ap.parse_args()
    if args.cpu_time:
        if args.threads != 1:
            ap.error("--cpu-time measures the calling thread only: use --threads 1")
        CLOCK[0] = time.thread_time

    os.environ["MINIKV_NUM_THREADS"] = str(args.threads)  # read when a cache is created
    import torch
    import torch.nn.functional as F
    import minikv
    from results import git_commit, write_json
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    mk = Minikv(minikv)

    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                machine=f"{platform.node()}: {cpu_model()}, {os.cpu_count()} CPUs",
                commit=git_commit() or "?", torch=torch.__version__, threads=args.threads,
                torch_cpu_capability=torch.backends.cpu.get_cpu_capability(),
                library=minikv.library_version(), load_before=load_average(),
                clock="thread CPU time" if args.cpu_time else "wall")
    peak = machine_peak(args.threads, args.cpu_time)
    meta["peak"] = peak
    print(f"{meta['machine']}  commit {meta['commit']}  threads {args.threads}  load {meta['load_before']}")
    print(f"peak: copy {peak['copy_GBps']:.1f} GB/s, FMA {peak['fma_GFLOPs']:.0f} GFLOP/s, "
          f"mul+add {peak['muladd_GFLOPs']:.0f} GFLOP/s", flush=True)
    rows = []

    def save():
        meta["load_after"] = load_average()
        write_json(args.out, dict(meta=meta, results=rows))

    for dtype in args.dtypes.split(","):
        for preset, shape in ((p, s) for p in args.presets.split(",")
                              for s in filter(None, args.decode_shapes.split(","))):
            H, Hkv, D = (int(x) for x in shape.split("/"))
            for L in (int(x) for x in filter(None, args.decode_lengths.split(","))):
                r = bench_decode(mk, torch, F, dtype, H, Hkv, D, L, args.decode_reps, args.prefill_cap,
                                 peak, preset)
                rows.append(r)
                print(f"decode  {dtype} {preset} H={H}/{Hkv} D={D} L={L}: minikv {r['minikv_ms']:.3f} ms "
                      f"({r['minikv_GBps']:.1f} GB/s, {r['minikv_GFLOPs']:.1f} GFLOP/s)  sdpa f32 "
                      f"{r['sdpa_f32_ms']:.3f} ms ({r['speedup_vs_sdpa_f32']:.2f}x)  sdpa f16 "
                      f"{r['sdpa_f16_ms']:.3f} ms ({r['speedup_vs_sdpa_f16']:.2f}x)", flush=True)
                save()
        for shape in filter(None, args.prefill_shapes.split(",")):
            H, Hkv, D, L = (int(x) for x in shape.split("/"))
            r = bench_prefill(mk, torch, F, dtype, H, Hkv, D, L, args.prefill_reps, peak)
            rows.append(r)
            print(f"prefill {dtype} H={H}/{Hkv} D={D} L={L}: cumulative {r['minikv_cumulative_ms']:.1f} ms "
                  f"({r['cumulative_over_sdpa']:.2f}x sdpa, {r['minikv_cumulative_GFLOPs']:.0f} GFLOP/s)  "
                  f"window {r['minikv_window_ms']:.1f} ms ({r['window_over_sdpa']:.2f}x)  "
                  f"sdpa {r['sdpa_f32_ms']:.1f} ms ({r['sdpa_f32_GFLOPs']:.0f} GFLOP/s)", flush=True)
            save()
    print(f"load after: {load_average()}")


if __name__ == "__main__":
    main()
