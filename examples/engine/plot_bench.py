#!/usr/bin/env python3
"""examples/engine/plot_bench.py — the figures of a `minikv-engine --bench` JSON:

  <out>-latency.png     ms per generated token vs context (batch 1), one panel per model,
                        one line per cache setting, with its roofline expectation dashed
  <out>-throughput.png  tokens/s at the largest batch within the memory limit, per model
                        and setting, the batch written on each bar

    python3 examples/engine/plot_bench.py bench/results/<...>_engine-bench.json [--out PREFIX]

Several JSONs of one device, dtype and commit (e.g. a latency run and a run per model's
throughput) are drawn together; the prefix is then the first one's unless --out names it.

Needs matplotlib (pip install matplotlib).
"""
import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+")
    p.add_argument("--out", help="prefix of the PNG files (default: the first JSON's path without .json)")
    p.add_argument("--commit", help="the commit to name where the JSON has none (a run without .git)")
    args = p.parse_args()

    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(json.load(f))
    r = runs[0]
    for path, run in zip(args.json[1:], runs[1:]):
        for key in ("device", "dtype", "commit", "memory_limit_bytes", "throughput_prompt", "throughput_gen"):
            if run.get(key) != r.get(key):
                p.error(f"{path}: {key} {run.get(key)!r} differs from {args.json[0]}'s {r.get(key)!r}")
    r = dict(r, latency=[x for run in runs for x in run["latency"]],
             throughput=[x for run in runs for x in run["throughput"]])
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = args.out or os.path.splitext(args.json[0])[0]
    commit = r["commit"] if r.get("commit") not in (None, "", "unknown") else (args.commit or "unknown")
    title = f"{r['device']}, {r['dtype']}, commit {commit}"

    models = sorted({x["model"] for x in r["latency"]})
    if models:
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4.5), squeeze=False)
        for ax, model in zip(axes[0], models):
            rows = [x for x in r["latency"] if x["model"] == model]
            for i, cache in enumerate(dict.fromkeys(x["cache"] for x in rows)):
                pts = sorted((x["context"], x["ms_per_token"], x["expected_ms"]) for x in rows if x["cache"] == cache)
                ctx = [p[0] for p in pts]
                color = f"C{i}"
                ax.plot(ctx, [p[1] for p in pts], "o-", color=color, label=f"{cache}")
                ax.plot(ctx, [p[2] for p in pts], "--", color=color, alpha=0.6, label=f"{cache}: (weights + cache) / copy bw")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context (tokens)")
            ax.set_ylabel("ms per generated token, batch 1")
            ax.set_title(model)
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle(f"minikv-engine decode latency ({title})", fontsize=10)
        fig.tight_layout()
        fig.savefig(prefix + "-latency.png", dpi=120)
        print(f"wrote {prefix}-latency.png")

    rows = [x for x in r["throughput"] if x["fits"]]
    if rows:
        fig, ax = plt.subplots(figsize=(1.6 * len(rows) + 2, 4.5))
        labels = [f"{x['model']}\n{x['cache']}" for x in rows]
        bars = ax.bar(range(len(rows)), [x["tokens_per_s"] for x in rows], color=[f"C{i % 10}" for i in range(len(rows))])
        for b, x in zip(bars, rows):
            ax.annotate(f"batch {x['batch']}\n{x['decode_tokens_per_s']:.0f} t/s decoding", (b.get_x() + b.get_width() / 2, b.get_height()),
                        ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("tokens/s, prefill + decode")
        ax.set_title(f"{r['throughput_prompt']} + {r['throughput_gen']} tokens within "
                     f"{r['memory_limit_bytes'] / 1e9:.0f} GB\n({title})", fontsize=10)
        ax.set_ylim(top=1.15 * max(x["tokens_per_s"] for x in rows))  # room for the labels
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(prefix + "-throughput.png", dpi=120)
        print(f"wrote {prefix}-throughput.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
