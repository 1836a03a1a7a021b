#!/usr/bin/env python3
"""One call of one libminikv kernel path, for `ncu` (bench/ncu.sh) to profile.

  decode:  prefill B sequences of L tokens, append --appends more (1), then `reps` decode steps
           of one layer
  prefill: `reps` prefills of one sequence of L tokens (CUMULATIVE or WINDOW)
Random inputs as in bench_gpu.py; fp16 or bf16; head_dim 128; the storage of --preset
(the paper's by default), or of --key-bits/--value-bits/--group where given. --trace prints,
instead, the per-kernel GPU time of the reps (torch.profiler / CUPTI; one rep before is a
warm-up), the host wall time per rep and when each rep's calls returned to the host: where
a prefill's time goes besides the two attention kernels, or a decode's between its decode
kernel and the split merge.
"""
import time
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bindings", "python"))
import minikv  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["decode", "prefill"])
    ap.add_argument("--dtype", default="f16")
    ap.add_argument("--B", type=int, default=8)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--Hkv", type=int, default=8)
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--mode", default="cumulative")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--json", help="with --trace: write the per-kernel times here")
    ap.add_argument("--preset", default="paper", help="minikv preset: paper, balanced, ...")
    ap.add_argument("--key-bits", type=int)
    ap.add_argument("--value-bits", type=int)
    ap.add_argument("--group", type=int)
    ap.add_argument("--appends", type=int, default=1,
                    help="decode: tokens appended after the prefill (they fill the 16-bit residual)")
    a = ap.parse_args()
    if a.json and not a.trace:
        ap.error("--json needs --trace")
    storage = {name: value for name, value in (("key_bits", a.key_bits),
                                               ("value_bits", a.value_bits),
                                               ("group_size", a.group)) if value is not None}
    tdtype = {"f16": torch.float16, "bf16": torch.bfloat16}[a.dtype]
    B = 1 if a.what == "prefill" else a.B
    D, dev = 128, torch.device("cuda")
    cache = minikv.Cache(minikv.Config.from_preset(
        a.preset, backend="cuda", dtype=a.dtype, num_layers=1, num_heads=a.H, num_kv_heads=a.Hkv,
        head_dim=D, max_sequences=B, max_seq_len=a.L + max(a.appends, 16), score_mode=a.mode,
        **storage))
    ids, cu = list(range(B)), [i * a.L for i in range(B + 1)]
    q = torch.randn((B * a.L, a.H, D), device=dev, dtype=tdtype)
    k = torch.randn((B * a.L, a.Hkv, D), device=dev, dtype=tdtype)
    v = torch.randn((B * a.L, a.Hkv, D), device=dev, dtype=tdtype)

    def prefill():
        cache.prefill(0, ids, cu, q, k, v)
        if a.what == "prefill":
            for i in ids:
                cache.release(i)
    if a.what == "decode":
        prefill()
        for _ in range(a.appends):
            cache.append(0, ids, torch.randn((B, a.Hkv, D), device=dev, dtype=tdtype),
                         torch.randn((B, a.Hkv, D), device=dev, dtype=tdtype))
        qd = torch.randn((B, a.H, D), device=dev, dtype=tdtype)
    step = prefill if a.what == "prefill" else lambda: cache.decode(0, ids, qd)
    if a.trace:
        step()  # warm-up
        torch.cuda.synchronize()
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            walls, returns = [], []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                step()
                returns.append((time.perf_counter() - t0) * 1e3)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
        what = (a.mode if a.what == "prefill"
                else f"B={B} {a.preset} {storage or ''} appends {a.appends}")
        print(f"{a.what} L={a.L} H={a.H} Hkv={a.Hkv} {a.dtype} {what}: wall ms per rep",
              " ".join(f"{w:.3f}" for w in walls), "; the calls returned after",
              " ".join(f"{w:.3f}" for w in returns))
        try:
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=15,
                                              max_name_column_width=60)
        except (KeyError, AttributeError, ValueError):  # older torch names it cuda_time_total
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=15,
                                              max_name_column_width=60)
        print(table)
        if a.json:
            kernels = {}
            for e in prof.key_averages():
                if e.device_type != torch.autograd.DeviceType.CUDA:
                    continue
                total = getattr(e, "device_time_total", None)
                if total is None:  # older torch
                    total = e.cuda_time_total
                kernels[e.key] = {"launches_per_rep": e.count / a.reps, "us_per_rep": total / a.reps}
            record = {"what": a.what, "L": a.L, "H": a.H, "Hkv": a.Hkv, "B": B, "dtype": a.dtype,
                      "appends": a.appends, "mode": a.mode, "preset": a.preset, "storage": storage, "reps": a.reps,
                      "wall_ms": walls, "returned_ms": returns, "kernels": kernels}
            with open(a.json, "w") as f:
                json.dump(record, f, indent=1)
        cache.close()
        return
    for _ in range(a.reps):
        step()
    torch.cuda.synchronize()
    cache.close()


if __name__ == "__main__":
    main()
