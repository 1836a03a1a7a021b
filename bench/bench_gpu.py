#!/usr/bin/env python3
"""GPU benchmark of libminikv against the baselines users would otherwise pick (issue 4).

In one process on one GPU, for each shape, the median time of
  - libminikv decode: one layer, one query token per sequence, over a cache prefilled with
    L tokens at the default budget (heavy 0.25 + recent 0.25), 2-bit, G = 16;
  - libminikv prefill, CUMULATIVE and WINDOW score modes (attention + scores + selection +
    quantization); with --chunk N also the same prompt in N-token chunks
    (minikv_prefill_chunk, all chunks of one prompt per timed call) and its ratio to one call;
  - the prefill forward alone (the attention kernel's GPU time inside the CUMULATIVE call,
    from torch.profiler / CUPTI) and its TFLOP/s;
  - PyTorch scaled_dot_product_attention with the FlashAttention backend on the full FP16
    cache (decode: q_len 1; prefill: causal), and for prefill also with the cuDNN attention
    backend (SDPBackend.CUDNN_ATTENTION), the baseline of issue 13: ratios against both;
  - a device-to-device copy, the same-run memory-bandwidth ceiling.
Times come from CUDA events around a batch of calls (warm-up first, inputs random, never
zero); the median of the per-call times is reported. Decode bandwidth counts the bytes the
kernel must read: the compressed cache (used_bytes of the layer) plus q and out.

  python3 bench/bench_gpu.py --out bench/results/x.json [--quick] [--dtype f16|bf16]
  python3 bench/bench_gpu.py --out x.json --no-decode --lengths 32768 --chunk 4096
      [--head-dims 64,128,256]   (decode and prefill at each head_dim; default 128)
      [--prefill-kernels auto,mma]   (each prefill shape once per MINIKV_PREFILL_KERNEL
      value, a debug knob read at cache create (docs/kernels.md); the baselines are timed once
      a shape and shared)
"""
import argparse
import ctypes
import datetime
import itertools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bindings", "python"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import minikv  # noqa: E402
from results import git_commit, write_json  # noqa: E402

DEV = torch.device("cuda")


# --queued: each sample starts behind a GPU sleep of this many cycles (~5 ms), so the host
# queues the timed calls while the GPU is busy, as in an engine, and their host time overlaps.
QUEUED_SLEEP_CYCLES = 0


def median_ms(fn, calls_per_sample=10, samples=15, warmup=3):
    """Median per-call time in ms: events around `calls_per_sample` calls, `samples` times
    (behind a GPU sleep when QUEUED_SLEEP_CYCLES is set)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if QUEUED_SLEEP_CYCLES:
            torch.cuda._sleep(QUEUED_SLEEP_CYCLES)
        start.record()
        for _ in range(calls_per_sample):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls_per_sample)
    return statistics.median(times)


def copy_bandwidth():
    """GB/s of a large device-to-device copy, bytes read + written."""
    n = 2 << 30  # 2 GiB, far larger than L2
    src = torch.empty(n, dtype=torch.uint8, device=DEV).random_(0, 255)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), calls_per_sample=5, samples=11)
    del src, dst
    return 2 * n / (ms * 1e-3) / 1e9


def sdpa(backend, q, k, v, causal=False):
    """PyTorch SDPA restricted to one backend (an SDPBackend member); q/k/v [B, heads, L, D]."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])


# Names of the prefill forward kernels (kernels/prefill_wgmma.cu, prefill_attention.cu).
FORWARD_KERNELS = ("prefill_wgmma_kernel", "prefill_attention_kernel")


def forward_kernel_ms(call, reps=3):
    """GPU time per call of the prefill forward kernel inside `call` (torch.profiler, CUPTI);
    None when the profiler records no such kernel."""
    from torch.profiler import ProfilerActivity, profile
    call()  # warm-up
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    total_us = 0.0
    for e in prof.key_averages():
        if any(name in e.key for name in FORWARD_KERNELS):
            total_us += getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
    return total_us / reps / 1e3 if total_us > 0 else None


def make_cache(dtype, B, H, Hkv, D, L, score_mode, gen=16, staging=0):
    return minikv.Cache(minikv.Config.from_preset(
        "paper", backend="cuda", dtype=dtype, num_layers=1, num_heads=H, num_kv_heads=Hkv,
        head_dim=D, max_sequences=B, max_seq_len=L + gen, score_mode=score_mode,
        prefill_staging_tokens=staging))


def rand(shape, tdtype):
    return torch.randn(shape, device=DEV, dtype=tdtype)


def bench_decode(dtype, tdtype, B, H, Hkv, D, L, copy_gbs):
    cache = make_cache(dtype, B, H, Hkv, D, L, "cumulative")
    ids = list(range(B))
    cu = [i * L for i in range(B + 1)]
    q = rand((B * L, H, D), tdtype)
    k = rand((B * L, Hkv, D), tdtype)
    v = rand((B * L, Hkv, D), tdtype)
    cache.prefill(0, ids, cu, q, k, v)
    del q, k, v
    kn, vn = rand((B, Hkv, D), tdtype), rand((B, Hkv, D), tdtype)
    cache.append(0, ids, kn, vn)
    torch.cuda.synchronize()
    used = cache.memory_stats().used_bytes
    qd, out = rand((B, H, D), tdtype), torch.empty((B, H, D), device=DEV, dtype=tdtype)
    lib, handle = minikv.load(), ctypes.c_void_p(cache.handle)
    ids_c = (ctypes.c_uint32 * B)(*ids)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)
    qp, op = ctypes.c_void_p(qd.data_ptr()), ctypes.c_void_p(out.data_ptr())

    def call():
        st = lib.minikv_decode(handle, 0, B, ids_c, qp, op, stream)
        if st != 0:
            raise RuntimeError(lib.minikv_cache_last_error(handle))
    t_mkv = median_ms(call, calls_per_sample=20)
    cache.close()

    # Baseline: SDPA (FlashAttention backend) over the full FP16 cache of L+1 tokens.
    qs = rand((B, H, 1, D), tdtype)
    ks, vs = rand((B, Hkv, L + 1, D), tdtype), rand((B, Hkv, L + 1, D), tdtype)
    from torch.nn.attention import SDPBackend
    t_sdpa = median_ms(lambda: sdpa(SDPBackend.FLASH_ATTENTION, qs, ks, vs), calls_per_sample=20)
    full_bytes = ks.numel() * ks.element_size() * 2
    del qs, ks, vs
    read = used + 2 * qd.numel() * qd.element_size()
    gbs = read / (t_mkv * 1e-3) / 1e9
    return dict(kind="decode", dtype=dtype, B=B, H=H, Hkv=Hkv, D=D, L=L, minikv_ms=t_mkv,
                sdpa_ms=t_sdpa, speedup_vs_sdpa=t_sdpa / t_mkv, compressed_bytes=read,
                minikv_GBps=gbs, fraction_of_copy=gbs / copy_gbs,
                sdpa_GBps=full_bytes / (t_sdpa * 1e-3) / 1e9)


def bench_prefill(dtype, tdtype, B, H, Hkv, D, L, chunk=0, kernel="auto", baselines=None):
    """One prefill shape with the prefill kernels MINIKV_PREFILL_KERNEL=`kernel` selects
    ("auto": unset). `baselines`: an earlier row of the same shape whose SDPA and cuDNN times
    this row reuses instead of timing them again."""
    if kernel == "auto":
        os.environ.pop("MINIKV_PREFILL_KERNEL", None)
    else:
        os.environ["MINIKV_PREFILL_KERNEL"] = kernel  # read by minikv_cache_create
    q = rand((B * L, H, D), tdtype)
    k = rand((B * L, Hkv, D), tdtype)
    v = rand((B * L, Hkv, D), tdtype)
    out = torch.empty_like(q)
    res = dict(kind="prefill", dtype=dtype, B=B, H=H, Hkv=Hkv, D=D, L=L, prefill_kernel=kernel)
    lib = minikv.load()
    ids_c = (ctypes.c_uint32 * B)(*range(B))
    cu_c = (ctypes.c_int32 * (B + 1))(*[i * L for i in range(B + 1)])
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)
    for mode in ("cumulative", "window"):
        cache = make_cache(dtype, B, H, Hkv, D, L, mode)
        handle = ctypes.c_void_p(cache.handle)

        def call():  # prefill, then release so the next call can prefill again
            st = lib.minikv_prefill(handle, 0, B, ids_c, cu_c, ctypes.c_void_p(q.data_ptr()),
                                    ctypes.c_void_p(k.data_ptr()), ctypes.c_void_p(v.data_ptr()),
                                    ctypes.c_void_p(out.data_ptr()), stream)
            if st != 0:
                raise RuntimeError(lib.minikv_cache_last_error(handle))
            for i in range(B):
                lib.minikv_sequence_release(handle, i)
        reps = 3 if L >= 65536 else 5
        res[f"minikv_{mode}_ms"] = median_ms(call, calls_per_sample=1, samples=reps, warmup=1)
        if mode == "cumulative":
            res["forward_ms"] = forward_kernel_ms(call)
        cache.close()
        if 0 < chunk < L:
            res[f"minikv_{mode}_chunked_ms"] = median_ms(
                chunked_prefill_call(lib, dtype, tdtype, B, H, Hkv, D, L, mode, chunk, q, k, v, out, stream),
                calls_per_sample=1, samples=reps, warmup=1)
            res[f"{mode}_chunked_over_one_call"] = (res[f"minikv_{mode}_chunked_ms"] /
                                                    res[f"minikv_{mode}_ms"])
    if 0 < chunk < L:
        res["chunk"] = chunk
    qs = q.view(B, L, H, D).transpose(1, 2)
    ks = k.view(B, L, Hkv, D).transpose(1, 2)
    vs = v.view(B, L, Hkv, D).transpose(1, 2)
    from torch.nn.attention import SDPBackend
    flops = 4.0 * B * H * D * L * L / 2
    # Baselines: flash SDPA (key "sdpa") and cuDNN attention (key "cudnn").
    for key, backend in (("sdpa", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        if baselines is not None:
            if f"{key}_ms" not in baselines:
                continue
            ms = baselines[f"{key}_ms"]
        else:
            try:
                ms = median_ms(lambda: sdpa(backend, qs, ks, vs, True), calls_per_sample=1,
                               samples=5, warmup=1)
            except RuntimeError as e:  # backend refused the shape: recorded, not fatal
                res[f"{key}_error"] = str(e).splitlines()[0][:200]
                continue
        res[f"{key}_ms"] = ms
        res[f"{key}_TFLOPs"] = flops / (ms * 1e-3) / 1e12
        for mode in ("cumulative", "window"):
            res[f"{mode}_over_{key}"] = res[f"minikv_{mode}_ms"] / ms
        if res.get("forward_ms"):
            res[f"forward_of_{key}_speed"] = ms / res["forward_ms"]  # >= 0.9: issue 13
    if res.get("forward_ms"):
        res["forward_TFLOPs"] = flops / (res["forward_ms"] * 1e-3) / 1e12
    del q, k, v, out
    os.environ.pop("MINIKV_PREFILL_KERNEL", None)  # the caches of this row are created
    return res


def chunked_prefill_call(lib, dtype, tdtype, B, H, Hkv, D, L, mode, chunk, q, k, v, out, stream):
    """A call that sends each sequence's L-token prompt in `chunk`-token chunks
    (minikv_prefill_chunk, one call per chunk with every sequence's next chunk), then
    releases. q/k/v/out are the packed prompts; each chunk batch is gathered into
    contiguous buffers first (outside the timed call)."""
    cache = make_cache(dtype, B, H, Hkv, D, L, mode, staging=B * L)
    handle = ctypes.c_void_p(cache.handle)
    ids_c = (ctypes.c_uint32 * B)(*range(B))
    lens_c = (ctypes.c_uint32 * B)(*[L] * B)
    batches = []
    for c0 in range(0, L, chunk):
        n = min(chunk, L - c0)
        rows = torch.cat([torch.arange(s * L + c0, s * L + c0 + n, device=DEV) for s in range(B)])
        qc, kc, vc = q[rows].contiguous(), k[rows].contiguous(), v[rows].contiguous()
        batches.append((qc, kc, vc, torch.empty_like(qc),
                        (ctypes.c_int32 * (B + 1))(*[i * n for i in range(B + 1)])))

    def call():
        for qc, kc, vc, oc, cu_c in batches:
            st = lib.minikv_prefill_chunk(handle, 0, B, ids_c, cu_c, lens_c,
                                          ctypes.c_void_p(qc.data_ptr()), ctypes.c_void_p(kc.data_ptr()),
                                          ctypes.c_void_p(vc.data_ptr()), ctypes.c_void_p(oc.data_ptr()),
                                          stream)
            if st != 0:
                raise RuntimeError(lib.minikv_cache_last_error(handle))
        for i in range(B):
            lib.minikv_sequence_release(handle, i)
    call.cache = cache  # keeps the cache (and the chunk buffers) alive while timed
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="f16,bf16")
    ap.add_argument("--quick", action="store_true", help="4K and 32K only")
    ap.add_argument("--lengths", default="")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes")
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--no-decode", action="store_true")
    ap.add_argument("--chunk", type=int, default=0,
                    help="also time each prefill prompt in chunks of this many tokens "
                         "(minikv_prefill_chunk) against one call")
    ap.add_argument("--head-dims", default="128",
                    help="comma-separated head_dim values (64, 80, 96, 128, 256)")
    ap.add_argument("--prefill-kernels", default="auto",
                    help="comma-separated MINIKV_PREFILL_KERNEL values to time each prefill "
                         "shape with: auto (unset), mma")
    ap.add_argument("--queued", action="store_true",
                    help="start each timed sample behind ~5 ms of GPU work, so that the host's "
                         "part of every call (libminikv's and the baselines') overlaps it as "
                         "in an engine; without it a sample starts on an idle GPU")
    args = ap.parse_args()
    global QUEUED_SLEEP_CYCLES
    if args.queued:
        QUEUED_SLEEP_CYCLES = 10_000_000  # ~5 ms at the H200's ~2 GHz
    head_dims = [int(d) for d in args.head_dims.split(",")]
    prefill_kernels = args.prefill_kernels.split(",")
    lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
               else [4096, 32768] if args.quick else [4096, 32768, 131072])
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), commit=git_commit() or "?",
                torch=torch.__version__, library=minikv.library_version(), queued=args.queued)
    copy_gbs = copy_bandwidth()
    meta["copy_GBps"] = copy_gbs
    print(f"{meta['device']}  commit {meta['commit']}  copy bandwidth {copy_gbs:.0f} GB/s", flush=True)
    rows = []

    def save():  # after every shape, so a run cut short keeps what it measured
        write_json(args.out, dict(meta=meta, results=rows))

    for dtype in args.dtype.split(","):
        tdtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        for D in head_dims:
            for L in ([] if args.no_decode else lengths):
                for (H, Hkv) in ((32, 32), (32, 8)):
                    for B in [int(b) for b in args.batches.split(",")]:
                        r = bench_decode(dtype, tdtype, B, H, Hkv, D, L, copy_gbs)
                        rows.append(r)
                        print(f"decode  {dtype:4} B={B} H={H} Hkv={Hkv:2} D={D:3} L={L:6}: "
                              f"minikv {r['minikv_ms']:.4f} ms ({r['minikv_GBps']:.0f} GB/s, "
                              f"{100 * r['fraction_of_copy']:.0f}% of copy)  sdpa {r['sdpa_ms']:.4f} ms  "
                              f"speed-up {r['speedup_vs_sdpa']:.2f}x", flush=True)
                        torch.cuda.empty_cache()
                        save()
            for L in ([] if args.no_prefill else lengths):
                for (H, Hkv), kernel in itertools.product(((32, 32), (32, 8)), prefill_kernels):
                    # The shape's first kernel times the baselines; the others reuse its row's.
                    r = bench_prefill(dtype, tdtype, 1, H, Hkv, D, L, args.chunk, kernel,
                                      None if kernel == prefill_kernels[0] else rows[-1])
                    rows.append(r)
                    nan = float("nan")
                    print(f"prefill {dtype:4} B=1 H={H} Hkv={Hkv:2} D={D:3} L={L:6} kernels {kernel}: "
                          f"cumulative {r['minikv_cumulative_ms']:.2f} ms "
                          f"({r.get('cumulative_over_cudnn', nan):.2f}x cudnn, "
                          f"{r.get('cumulative_over_sdpa', nan):.2f}x sdpa)  "
                          f"window {r['minikv_window_ms']:.2f} ms "
                          f"({r.get('window_over_cudnn', nan):.2f}x cudnn, "
                          f"{r.get('window_over_sdpa', nan):.2f}x sdpa)", flush=True)
                    print(f"        forward {r.get('forward_ms') or nan:.2f} ms "
                          f"({r.get('forward_TFLOPs', nan):.0f} TFLOP/s, "
                          f"{100 * r.get('forward_of_cudnn_speed', nan):.0f}% of cudnn's speed, "
                          f"{100 * r.get('forward_of_sdpa_speed', nan):.0f}% of sdpa's)  "
                          f"cudnn {r.get('cudnn_ms', nan):.2f} ms  sdpa {r.get('sdpa_ms', nan):.2f} ms",
                          flush=True)
                    if "chunk" in r:
                        print(f"        in chunks of {r['chunk']}: cumulative "
                              f"{r['minikv_cumulative_chunked_ms']:.2f} ms "
                              f"({r['cumulative_chunked_over_one_call']:.3f}x one call)  window "
                              f"{r['minikv_window_chunked_ms']:.2f} ms "
                              f"({r['window_chunked_over_one_call']:.3f}x)", flush=True)
                    torch.cuda.empty_cache()
                    save()
    save()
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
