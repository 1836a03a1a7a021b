#!/usr/bin/env python3
"""Where a batch-1 decode's time goes inside the one-warp kernel (docs/kernels.md, open
direction 6): per-stage %globaltimer stamps of every CTA of one launch.

Needs a profiling build of libminikv (cmake -DMINIKV_DECODE_STAGE_CLOCK=ON), named by
MINIKV_LIBRARY. One layer of the library's default cache (the engine's `--kv minikv`) is
prefilled with --L random tokens, then --steps append_decode calls run one by one, each
queued behind a streaming kernel on the same stream (as the engine's Q/K/V product; the
decode may start early behind it). After each step the stamps are read back; the table gives, per
stage, the CTAs that reached it and the median and latest time since the earliest CTA's
start over them, each time the median over the steps after the first.

  MINIKV_LIBRARY=build-clock/libminikv.so python3 bench/decode_stage_clock.py --L 4096
"""
import argparse
import ctypes
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bindings", "python"))
import minikv  # noqa: E402
from minikv import _library  # noqa: E402

STAGES = ["entry", "copies issued", "waited", "q' ready", "tiles done", "partials stored",
          "arrived last", "merged"]
MAX_CTAS = 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--L", type=int, default=4096)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hkv", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--json", help="write the per-step stage times here")
    a = ap.parse_args()
    lib = _library.load()
    if not hasattr(lib, "minikv_debug_decode_stage_clock"):
        sys.exit("this libminikv is not a profiling build (cmake -DMINIKV_DECODE_STAGE_CLOCK=ON)")
    read = lib.minikv_debug_decode_stage_clock
    read.argtypes = [ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_uint]
    read.restype = ctypes.c_int
    stamps = (ctypes.c_ulonglong * (MAX_CTAS * len(STAGES)))()

    D, dev = 128, torch.device("cuda")
    tdtype = {"f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    cache = minikv.Cache(minikv.Config(backend="cuda", dtype=a.dtype, num_layers=1, num_heads=a.H,
                                       num_kv_heads=a.Hkv, head_dim=D, max_sequences=1,
                                       max_seq_len=a.L + a.steps + 1))
    q = torch.randn((a.L, a.H, D), device=dev, dtype=tdtype)
    k = torch.randn((a.L, a.Hkv, D), device=dev, dtype=tdtype)
    v = torch.randn((a.L, a.Hkv, D), device=dev, dtype=tdtype)
    cache.prefill(0, [0], [0, a.L], q, k, v)
    torch.cuda.synchronize()
    read(stamps, MAX_CTAS)  # zeroes the prefill's (none) and anything before

    # Long enough (~60-100 us) that the decode's launch is queued behind it, as in the engine's
    # graph, rather than reaching an idle GPU after the host's launch time.
    x = torch.randn((1 << 25,), device=dev)
    rows = []
    for step in range(a.steps):
        qd = torch.randn((1, a.H, D), device=dev, dtype=tdtype)
        kd = torch.randn((1, a.Hkv, D), device=dev, dtype=tdtype)
        vd = torch.randn((1, a.Hkv, D), device=dev, dtype=tdtype)
        torch.cuda.synchronize()
        x.mul_(1.0)  # the kernel before, as the engine's Q/K/V product
        cache.append_decode(0, [0], qd, kd, vd)
        n = read(stamps, MAX_CTAS)
        if n != len(STAGES):
            sys.exit("minikv_debug_decode_stage_clock failed")
        ctas = [stamps[c * n:(c + 1) * n] for c in range(MAX_CTAS)]
        ctas = [s for s in ctas if s[0]]
        if not ctas:
            print(f"step {step}: no one-warp decode launch (a flush, or another kernel)")
            continue
        t0 = min(s[0] for s in ctas)
        row = {"step": step, "ctas": len(ctas)}
        for i, name in enumerate(STAGES):
            t = [(s[i] - t0) / 1e3 for s in ctas if s[i]]
            row[name] = {"ctas": len(t), "median_us": statistics.median(t), "max_us": max(t)} if t else None
        rows.append(row)
    cache.close()

    print(f"one-warp decode, L={a.L} H={a.H} Hkv={a.Hkv} {a.dtype}, default storage, batch 1: "
          f"us since the first CTA's start (median over steps 1..{len(rows) - 1})")
    print(f"{'stage':18} {'CTAs':>6} {'median':>8} {'latest':>8}")
    for name in STAGES:
        cells = [r[name] for r in rows[1:] if r[name]]
        if not cells:
            continue
        med = statistics.median(c["median_us"] for c in cells)
        mx = statistics.median(c["max_us"] for c in cells)
        print(f"{name:18} {cells[-1]['ctas']:6d} {med:8.2f} {mx:8.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"L": a.L, "H": a.H, "Hkv": a.Hkv, "dtype": a.dtype, "steps": rows}, f, indent=1)


if __name__ == "__main__":
    main()
