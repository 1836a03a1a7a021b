#!/usr/bin/env python3
"""bench/plot_decode_matrix.py — the decode matrix as one figure: libminikv's decode speed-up
over cuDNN attention on the full fp16 cache, per storage configuration (bars) and shape
(groups), from a bench_decode_matrix.py JSON (same-run ratios). The dashed line marks the
issue's target: 85% of cuDNN's bytes/s, i.e. a speed-up of 0.85 x (full bytes / compressed
bytes), drawn per bar as a tick.

  python3 bench/plot_decode_matrix.py RESULTS.json [MORE.json ...] [--take FILE STORAGE ...]
      [--kernel best] [--label TEXT] [--out FIG.png]

Several files (e.g. a run's 32K and 128K parts) are read in order, and a later file's cell
(storage, shape, kernel) replaces an earlier one's; --take FILE STORAGE (repeatable) takes
only that storage's cells from FILE, e.g. one row rerun after a kernel change. Each cell
keeps its own run's cuDNN baseline; the title names the first file's run.

--kernel best takes the fastest kernel measured per cell: what the decode plan picks (the plan
was set from these runs: kernels/cuda_backend.cpp).
"""
import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--take", nargs=2, action="append", default=[], metavar=("FILE", "STORAGE"),
                    help="replace STORAGE's cells by FILE's")
    ap.add_argument("--kernel", default="best", help="which kernel's rows (best, auto, mma, ...)")
    ap.add_argument("--label", help="the run's name in the title (default: its meta commit)")
    ap.add_argument("--out", help="PNG path (default: the JSON's, .png)")
    a = ap.parse_args()
    d = json.load(open(a.json[0]))
    cells = {}
    sources = [(f, None) for f in a.json] + [(f, st) for f, st in a.take]
    for f, only in sources:
        for r in json.load(open(f))["results"]:
            if r["kind"] == "decode" and "minikv_ms" in r and (only is None or r["storage"] == only):  # error rows: not built
                cells[(r["storage"], r["B"], r["H"], r["Hkv"], r["D"], r["L"], r["kernel"], r["dtype"])] = r
    rows = [r for r in cells.values() if a.kernel == "best" or r["kernel"] == a.kernel]
    if a.kernel == "best":
        best = {}
        for r in rows:
            key = (r["storage"], r["B"], r["H"], r["Hkv"], r["D"], r["L"])
            if key not in best or r["minikv_ms"] < best[key]["minikv_ms"]:
                best[key] = r
        rows = list(best.values())
    shapes = list(dict.fromkeys((r["B"], r["H"], r["Hkv"], r["D"], r["L"]) for r in rows))
    storages = list(dict.fromkeys(r["storage"] for r in rows))
    # Wide enough for the bars, at most a page's width; the legend above the plot.
    fig, ax = plt.subplots(figsize=(min(18, max(8, 1.6 * len(shapes) * len(storages) / 4)), 5.5))
    width = 0.8 / len(storages)
    for j, st in enumerate(storages):
        xs, ys, targets = [], [], []
        for i, sh in enumerate(shapes):
            r = next((r for r in rows if r["storage"] == st and (r["B"], r["H"], r["Hkv"], r["D"], r["L"]) == sh), None)
            if r is None:
                continue
            xs.append(i + (j - (len(storages) - 1) / 2) * width)
            ys.append(r["speedup_vs_cudnn"])
            # 85% of cuDNN's bytes/s: speed-up = 0.85 * cuDNN's bytes / libminikv's bytes.
            targets.append(0.85 * r["speedup_vs_cudnn"] / r["of_cudnn_rate"])
        # tab20's dark shades, then its light ones: one colour each for up to 20 storages.
        ax.bar(xs, ys, width, label=st, color=plt.get_cmap("tab20")((2 * j) % 20 + (2 * j) // 20))
        ax.scatter(xs, targets, marker="_", color="black", s=120, zorder=3)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([f"B={B} H={H}/{Hkv}\nD={D} L={L // 1024}K" for (B, H, Hkv, D, L) in shapes])
    ax.set_ylabel("speed-up over cuDNN attention\n(full fp16 cache, same run)")
    m = d.get("meta", {})
    ax.set_title(f"libminikv decode, {m.get('device', '')}, {m.get('date', '')[:10]}, {a.label or 'commit ' + m.get('commit', '')}"
                 "\n(black ticks: 85% of cuDNN's bytes/s on the compressed bytes)", fontsize=9)
    ax.legend(fontsize=7, ncol=(len(storages) + 1) // 2, loc="lower center", bbox_to_anchor=(0.5, 1.1),
              frameon=False)
    fig.tight_layout()
    out = a.out or a.json[0].rsplit(".", 1)[0] + ".png"
    fig.savefig(out, dpi=120)
    print("wrote", out)


if __name__ == "__main__":
    main()
