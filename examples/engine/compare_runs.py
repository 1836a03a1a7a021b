#!/usr/bin/env python3
"""examples/engine/compare_runs.py — the same greedy generations through several engine
configurations, compared token by token and logit by logit.

Cases: SmolLM2-135M (or any GGUF) with --kv full and --kv balanced, one prompt alone
(decode batch 1) and three prompts together (decode batch 3, then 2 and 1 as they leave).
Variants: the backend flags of each run, e.g.
  cuda            the fused GEMV decode step (gemv.cuh)
  cuda --no-gemv  cuBLAS and separate norm/RoPE/SwiGLU kernels
  cpu             OpenBLAS + libminikv's CPU backend, float32 (the reference)
Each run's token ids and logits are written under --out (runs/<variant>/<case>.ids|.<i>.npy);
--reference DIR reads a variant's files from another machine instead of running it (the CPU
backend's, computed where OpenBLAS is). For each variant after the first, against the first:
the tokens must be equal up to a position where the first variant's two best logits are
within --tie of each other (a near-tie, where rounding may choose), and max |logit
difference| over the positions before any parting must be within --tol.

    python3 examples/engine/compare_runs.py --engine build/examples/engine/minikv-engine \\
        --model .models/SmolLM2-135M-Instruct.Q4_1.gguf --out /tmp/cmp --variants cpu
    python3 examples/engine/compare_runs.py --engine build-gpu/.../minikv-engine --model ... \\
        --out /tmp/cmp --reference /tmp/cmp/runs/cpu --variants "cuda" "cuda --no-gemv"
"""
import argparse
import os
import shlex
import subprocess
import sys

import numpy as np

PROMPTS = [
    "It was a truth universally acknowledged, that a single man in possession of a good fortune,",
    "The three primary colours are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]
CASES = [(kv, batch) for kv in ("full", "balanced") for batch in ("alone", "batched")]


def case_name(kv, batch):
    return f"{kv}-{batch}"


def run(engine, model, variant, kv, batch, steps, where):
    os.makedirs(where, exist_ok=True)
    name = case_name(kv, batch)
    prompts = PROMPTS[:1] if batch == "alone" else PROMPTS
    backend, *flags = shlex.split(variant)
    cmd = [engine, "--model", model, "--backend", backend, "--kv", kv, "-n", str(steps), "--ids", "--quiet",
           "--dump-logits", os.path.join(where, name + ".f32")] + flags
    for p in prompts:
        cmd += ["--prompt", p]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    with open(os.path.join(where, name + ".ids"), "w") as f:
        f.write(r.stdout)
    # Logits kept as float16 (within 0.03 of float32 below |64|; a run's files can then
    # travel to another machine as a reference: 8 prompts x 32 steps = 25 MB for SmolLM2).
    for i in range(len(prompts)):
        dump = os.path.join(where, name + ".f32") + (f".{i}" if len(prompts) > 1 else "")
        np.save(os.path.join(where, f"{name}.{i}.npy"), np.fromfile(dump, dtype=np.float32).astype(np.float16))
        os.remove(dump)


def load(where, kv, batch, n_vocab=None):
    """Per prompt: (token ids, logits [steps, n_vocab]); n_vocab None: the logits' length
    over the token count (one row of logits per generated token)."""
    name = case_name(kv, batch)
    seqs, cur = [], None
    for line in open(os.path.join(where, name + ".ids")):
        line = line.strip()
        if line.startswith("==="):
            cur = []
            seqs.append(cur)
        elif line:
            if cur is None:
                cur = []
                seqs.append(cur)
            cur.append(int(line))
    out = []
    for i, ids in enumerate(seqs):
        logits = np.load(os.path.join(where, f"{name}.{i}.npy")).astype(np.float32)
        width = n_vocab or (logits.size // len(ids) if ids else 0)
        if not width or logits.size % width:
            sys.exit(f"{where}/{name}: {logits.size} logits do not split into rows of {width}")
        out.append((ids, logits.reshape(-1, width)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--variants", nargs="+", required=True, help="backend + flags of each run")
    p.add_argument("--reference", help="a variant's files computed elsewhere, compared first")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--n-vocab", type=int, default=None,
                   help="logits per row (default: the dump's length over the generated tokens)")
    p.add_argument("--tol", type=float, default=0.25, help="max |logit difference| (0.25: f16 weights on the GPU)")
    p.add_argument("--tie", type=float, default=0.5, help="a near-tie: best two logits within this")
    a = p.parse_args()
    dirs = []
    if a.reference:
        dirs.append(("reference", a.reference))
    for v in a.variants:
        where = os.path.join(a.out, "runs", v.replace(" ", "").replace("--", "_"))
        for kv, batch in CASES:
            run(a.engine, a.model, v, kv, batch, a.steps, where)
        dirs.append((v, where))
    ok = True
    base_name, base = dirs[0]
    for name, where in dirs[1:]:
        for kv, batch in CASES:
            ref, got = load(base, kv, batch, a.n_vocab), load(where, kv, batch, a.n_vocab)
            for i, ((ids_r, lr), (ids_g, lg)) in enumerate(zip(ref, got)):
                same = 0
                while same < min(len(ids_r), len(ids_g)) and ids_r[same] == ids_g[same]:
                    same += 1
                upto = min(same + 1, len(lr), len(lg))  # the first parting position's logits still compare
                diff = float(np.max(np.abs(lr[:upto] - lg[:upto])))
                verdict = "ok"
                if diff > a.tol:
                    verdict, ok = f"FAIL: max |dlogit| above {a.tol}", False
                if same < min(len(ids_r), len(ids_g)):
                    top2 = np.sort(lr[same])[-2:]
                    margin = float(top2[1] - top2[0])
                    if margin > a.tie:
                        verdict, ok = f"FAIL: parted at step {same} where the best two logits differ by {margin:.3f}", False
                    else:
                        verdict += f" (parted at step {same}, a near-tie: {margin:.3f})"
                print(f"{name:>16} vs {base_name}: {case_name(kv, batch):<16} prompt {i}: "
                      f"{same}/{len(ids_r)} tokens equal, max |dlogit| {diff:.4f}  {verdict}")
    if len(dirs) == 1:
        print(f"compare_runs: recorded {dirs[0][1]} (one variant: nothing to compare)")
    else:
        print("compare_runs: all equal within tolerance" if ok else "compare_runs: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
