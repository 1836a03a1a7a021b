#!/usr/bin/env python3
"""Decode over the configuration matrix against cuDNN attention on the full cache (issue 12).

For every storage configuration (key bits, value bits, group size, sink tokens) and shape
(query heads / KV heads, head_dim, batch B, context L, 50 % kept), in one process on one GPU:
  - libminikv decode, one query token per sequence, over a cache of three layers called in
    rotation (so no layer's cache stays in L2 between its calls);
  - libminikv append + decode of a new token (the engine's step), same rotation, and the
    same step through minikv_append_decode (one call; on CUDA no launch of its own for the
    append unless a residual flushes): step_ms, fused_step_ms and their ratios to decode
    (issue 12's target: a step <= 1.1x the decode alone);
  - cuDNN attention (PyTorch SDPA, SDPBackend.CUDNN_ATTENTION) and flash SDPA on the full
    16-bit cache of L + 1 tokens, three caches in rotation;
  - a device-to-device copy: the same-run bandwidth ceiling.
Bytes per decode = the layer's compressed cache (used_bytes / layers) + q + out. Reported per
cell: times, GB/s, the fraction of copy bandwidth, and `of_cudnn_rate` = libminikv's bytes/s
over cuDNN's bytes/s on its full cache (the issue's target is >= 0.85).

  python3 bench/bench_decode_matrix.py --out bench/results/x.json [--quick] [--queued] [--dtype f16]
      [--storage 0,2] [--shapes 1,2] [--kernels auto,generic] [--head-dims 64,128,256]

--kernels measures each cell once per decode kernel: `auto` is the plan the library picks,
`fast`, `k4v2`, `k4v2-warp`, `mma` or `generic` force one through MINIKV_DECODE_KERNEL (docs/kernels.md#decode);
a kernel that cannot take the configuration is recorded as an error row. --head-dims runs
every (selected) shape at each listed head_dim instead of its own: the 64 and 256 columns.
"""
import argparse
import ctypes
import datetime
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "scripts"))
sys.path.insert(0, HERE)
import minikv  # noqa: E402
import bench_gpu  # noqa: E402
from bench_gpu import copy_bandwidth, median_ms, sdpa  # noqa: E402
from results import git_commit, write_json  # noqa: E402

DEV = torch.device("cuda")
LAYERS = 3

# (name, key_bits, value_bits, group_size, sink_tokens)
STORAGE = [
    ("K2V2 G16 (paper)", 2, 2, 16, 0),
    ("K2V2 G32", 2, 2, 32, 0),
    ("K4V2 G32", 4, 2, 32, 0),
    ("K4V2 G32 +4 sinks", 4, 2, 32, 4),
    ("K4V4 G16", 4, 4, 16, 0),
    ("K8V8 G32", 8, 8, 32, 0),
    ("K16V16 (eviction)", 16, 16, 16, 0),
    ("K4V4 G32", 4, 4, 32, 0),
    ("K4V2 G64", 4, 2, 64, 0),
    ("K2V2 G128", 2, 2, 128, 0),
    ("K8V4 G32", 8, 4, 32, 0),
]


def rand(shape, tdtype):
    return torch.randn(shape, device=DEV, dtype=tdtype)


def make_cache(dtype, B, H, Hkv, D, L, kb, vb, G, sinks, kernel="auto"):
    if kernel == "auto":
        os.environ.pop("MINIKV_DECODE_KERNEL", None)
    else:
        os.environ["MINIKV_DECODE_KERNEL"] = kernel  # read by minikv_cache_create
    fields = dict(backend="cuda", dtype=dtype, num_layers=LAYERS, num_heads=H, num_kv_heads=Hkv,
                  head_dim=D, max_sequences=B, max_seq_len=L + 1024, score_mode="window",
                  key_bits=kb, value_bits=vb, group_size=G, residual_length=128,
                  sink_tokens=sinks)
    return minikv.Cache(minikv.Config(**fields))


def bench_cell(dtype, tdtype, storage, B, H, Hkv, D, L, copy_gbs, baselines, kernel):
    name, kb, vb, G, sinks = storage
    cache = make_cache(dtype, B, H, Hkv, D, L, kb, vb, G, sinks, kernel)
    lib, handle = minikv.load(), ctypes.c_void_p(cache.handle)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream or None)
    for layer in range(LAYERS):  # one sequence at a time: bounded prompt buffers
        for s in range(B):
            q, k, v = rand((L, H, D), tdtype), rand((L, Hkv, D), tdtype), rand((L, Hkv, D), tdtype)
            cache.prefill(layer, [s], [0, L], q, k, v)
            del q, k, v
    ids = list(range(B))
    kn, vn = rand((B, Hkv, D), tdtype), rand((B, Hkv, D), tdtype)
    for layer in range(LAYERS):
        cache.append(layer, ids, kn, vn)
    torch.cuda.synchronize()
    used = cache.memory_stats().used_bytes / LAYERS
    qd, out = rand((B, H, D), tdtype), torch.empty((B, H, D), device=DEV, dtype=tdtype)
    ids_c = (ctypes.c_uint32 * B)(*ids)
    qp, op = ctypes.c_void_p(qd.data_ptr()), ctypes.c_void_p(out.data_ptr())
    kp, vp = ctypes.c_void_p(kn.data_ptr()), ctypes.c_void_p(vn.data_ptr())
    turn = [0]

    def decode():
        layer = turn[0] % LAYERS
        turn[0] += 1
        if lib.minikv_decode(handle, layer, B, ids_c, qp, op, stream) != 0:
            raise RuntimeError(lib.minikv_cache_last_error(handle))

    def step():
        layer = turn[0] % LAYERS
        turn[0] += 1
        if lib.minikv_append(handle, layer, B, ids_c, kp, vp, stream) != 0 or \
                lib.minikv_decode(handle, layer, B, ids_c, qp, op, stream) != 0:
            raise RuntimeError(lib.minikv_cache_last_error(handle))

    def fused_step():
        layer = turn[0] % LAYERS
        turn[0] += 1
        if lib.minikv_append_decode(handle, layer, B, ids_c, qp, kp, vp, op, stream) != 0:
            raise RuntimeError(lib.minikv_cache_last_error(handle))

    t_dec = median_ms(decode, calls_per_sample=30, samples=11)
    # 2 x 180 appends of the two step kinds < max_seq_len - L = 1024
    t_step = median_ms(step, calls_per_sample=15, samples=11, warmup=2)
    t_fused = median_ms(fused_step, calls_per_sample=15, samples=11, warmup=2)
    cache.close()
    read = used + 2 * qd.numel() * qd.element_size()
    gbs = read / (t_dec * 1e-3) / 1e9
    base = baselines[(B, H, Hkv, D, L)]
    r = dict(kind="decode", kernel=kernel, dtype=dtype, storage=name, key_bits=kb, value_bits=vb, group=G,
             sinks=sinks, B=B, H=H, Hkv=Hkv, D=D, L=L, minikv_ms=t_dec, step_ms=t_step,
             step_over_decode=t_step / t_dec, fused_step_ms=t_fused,
             fused_over_decode=t_fused / t_dec, compressed_bytes=read, minikv_GBps=gbs,
             fraction_of_copy=gbs / copy_gbs, **base)
    if base.get("cudnn_ms"):
        r["speedup_vs_cudnn"] = base["cudnn_ms"] / t_dec
        r["of_cudnn_rate"] = gbs / base["cudnn_GBps"]
    r["speedup_vs_flash"] = base["flash_ms"] / t_dec
    return r


def bench_baselines(tdtype, B, H, Hkv, D, L):
    from torch.nn.attention import SDPBackend
    qs = rand((B, H, 1, D), tdtype)
    caches = [(rand((B, Hkv, L + 1, D), tdtype), rand((B, Hkv, L + 1, D), tdtype))
              for _ in range(LAYERS)]
    full = caches[0][0].numel() * caches[0][0].element_size() * 2
    res = {}
    for key, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
        turn = [0]

        def call():
            k, v = caches[turn[0] % LAYERS]
            turn[0] += 1
            sdpa(backend, qs, k, v)
        try:
            ms = median_ms(call, calls_per_sample=30, samples=11)
        except RuntimeError as e:  # backend refused the shape: recorded, not fatal
            res[f"{key}_error"] = str(e).splitlines()[0][:200]
            continue
        res[f"{key}_ms"] = ms
        res[f"{key}_GBps"] = full / (ms * 1e-3) / 1e9
    del qs, caches
    torch.cuda.empty_cache()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--quick", action="store_true", help="L = 32K only")
    ap.add_argument("--storage", default="", help="comma-separated indices into STORAGE")
    ap.add_argument("--shapes", default="", help="comma-separated indices into the shape list")
    ap.add_argument("--kernels", default="auto", help="auto, fast, k4v2, k4v2-warp, mma, generic (comma-separated)")
    ap.add_argument("--shape", action="append", default=[],
                    help="B,H,Hkv,D,L: a shape of its own (repeatable), instead of the list")
    ap.add_argument("--head-dims", default="",
                    help="comma-separated head_dim values (64, 80, 96, 128, 256): every shape "
                         "runs at each of them instead of its own")
    ap.add_argument("--queued", action="store_true",
                    help="start each timed sample behind ~5 ms of GPU work, so that the host's "
                         "part of every call (libminikv's and the baselines') overlaps it as in "
                         "an engine; without it a sample starts on an idle GPU, and a call whose "
                         "host part outlasts its GPU work (B = 1) is timed at the host's pace")
    args = ap.parse_args()
    if args.queued:
        bench_gpu.QUEUED_SLEEP_CYCLES = 10_000_000  # ~5 ms at the H200's ~2 GHz
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=torch.cuda.get_device_name(), commit=git_commit() or "?",
                torch=torch.__version__, library=minikv.library_version(), layers=LAYERS,
                queued=args.queued)
    copy_gbs = copy_bandwidth()
    meta["copy_GBps"] = copy_gbs
    print(f"{meta['device']}  commit {meta['commit']}  copy {copy_gbs:.0f} GB/s", flush=True)
    storages = ([STORAGE[int(i)] for i in args.storage.split(",")] if args.storage else STORAGE)
    # (B, H, Hkv, D, L): MHA, GQA 4, GQA 8, Qwen2.5-7B's 28/4; B = 1; head_dim 64.
    shapes = [(8, 32, 32, 128, 32768), (8, 32, 8, 128, 32768), (8, 64, 8, 128, 32768),
              (8, 28, 4, 128, 32768), (1, 32, 32, 128, 32768), (1, 32, 8, 128, 32768),
              (8, 32, 8, 64, 32768)]
    if not args.quick:
        shapes += [(8, 32, 32, 128, 131072), (8, 32, 8, 128, 131072)]
    if args.shapes:
        shapes = [shapes[int(i)] for i in args.shapes.split(",")]
    if args.shape:
        shapes = [tuple(int(x) for x in sh.split(",")) for sh in args.shape]
    if args.head_dims:
        dims = [int(d) for d in args.head_dims.split(",")]
        shapes = list(dict.fromkeys((B, H, Hkv, D, L) for (B, H, Hkv, _, L) in shapes for D in dims))
    rows = []
    for dtype in args.dtype.split(","):
        tdtype = {"f16": torch.float16, "bf16": torch.bfloat16}[dtype]
        baselines = {s: bench_baselines(tdtype, *s) for s in shapes}
        for (B, H, Hkv, D, L) in shapes:
            for st, kernel in ((st, k) for st in storages for k in args.kernels.split(",")):
                if st[1] == 16 and st[2] == 16 and D != 128:
                    continue
                try:
                    r = bench_cell(dtype, tdtype, st, B, H, Hkv, D, L, copy_gbs, baselines, kernel)
                except (RuntimeError, TypeError, minikv.MinikvError) as e:
                    r = dict(kind="decode", kernel=kernel, dtype=dtype, storage=st[0], B=B, H=H,
                             Hkv=Hkv, D=D, L=L, error=str(e)[:300])
                    print(f"{dtype} {st[0]:20} {kernel:7} B={B} {H}/{Hkv} D={D} L={L}: {r['error']}", flush=True)
                    rows.append(r)
                    continue
                rows.append(r)
                print(f"{dtype} {st[0]:20} {kernel:7} B={B} {H:2}/{Hkv:2} D={D:3} L={L:6}: "
                      f"{r['minikv_ms']:.4f} ms {100 * r['fraction_of_copy']:3.0f}% copy  "
                      f"step/decode {r['step_over_decode']:.2f} fused {r['fused_over_decode']:.2f}  "
                      f"cudnn {r.get('cudnn_ms', float('nan')):.4f} ms "
                      f"x{r.get('speedup_vs_cudnn', float('nan')):.2f}  "
                      f"of cudnn rate {100 * r.get('of_cudnn_rate', float('nan')):3.0f}%", flush=True)
                torch.cuda.empty_cache()
                write_json(args.out, dict(meta=meta, results=rows))
    write_json(args.out, dict(meta=meta, results=rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
