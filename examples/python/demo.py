#!/usr/bin/env python3
"""libminikv from Python: create -> prefill -> append -> decode -> stats -> destroy.

A synthetic LLaMA-shaped workload (GQA, head_dim 128) in which, as in real models, a
minority of prompt tokens (10% here) draw most of every query's attention. Two prompts of
different lengths are prefilled as one ragged batch, then tokens are decoded one at a
time; each decode output is compared with exact attention over the full uncompressed
history (float64 numpy), and so are two references computed here: the same kept tokens
unquantized (the eviction's share of the error), and a plain recent window of the same
size (what the heavy-hitter selection buys).

    MINIKV_LIBRARY=build/libminikv.so python examples/python/demo.py
    python examples/python/demo.py --cuda      # torch CUDA tensors, CUDA backend
"""
import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python"))
import minikv  # noqa: E402


def exact_decode(q, k, v, keep=None):
    """q [H, D], k/v [N, Hkv, D] -> [H, D], float64, GQA; keep[g]: the rows KV head g sees."""
    H, D = q.shape
    rep = H // k.shape[1]
    out = np.empty((H, D))
    for h in range(H):
        g = h // rep
        rows = slice(None) if keep is None else keep[g]
        s = k[rows, g] @ q[h] / math.sqrt(D)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v[rows, g]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cuda", action="store_true", help="CUDA backend with torch CUDA tensors")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200, help="decoded tokens")
    ap.add_argument("--prompts", type=int, nargs="+", default=[1500, 700])
    ap.add_argument("--bits", type=int, default=2, choices=[2, 4, 8, 16], help="key and value bits")
    args = ap.parse_args()

    H, HKV, D = 8, 2, 128
    rng = np.random.default_rng(0)
    cfg = minikv.Config(backend="cuda" if args.cuda else "cpu", dtype="f16",
                        num_layers=args.layers, num_heads=H, num_kv_heads=HKV, head_dim=D,
                        max_sequences=len(args.prompts),
                        max_seq_len=max(args.prompts) + args.steps,
                        key_bits=args.bits, value_bits=args.bits)  # the rest: the defaults
    if args.cuda:
        import torch
        to_dev = lambda a: torch.from_numpy(a).cuda()  # noqa: E731
        to_host = lambda t: t.cpu().numpy()  # noqa: E731
    else:
        to_dev = to_host = lambda a: a  # noqa: E731

    print(f"libminikv {minikv.library_version()} from {minikv.library_path()}")
    # Important keys carry a component along a direction u_g that every query of KV group
    # g shares: +4 on their logits, so they take most of the attention.
    u = rng.standard_normal((HKV, D))
    u *= math.sqrt(4.0 * math.sqrt(D)) / np.linalg.norm(u, axis=1, keepdims=True)

    def tokens(n, heads, kind):
        x = rng.standard_normal((n, heads, D)).astype(np.float32)
        if kind == "q":
            x += np.repeat(u, H // HKV, axis=0)[None]
        return x.astype(np.float16)

    seq_ids = list(range(len(args.prompts)))
    history = {}  # (seq, layer) -> full K, V as float64: the exact reference
    with minikv.Cache(cfg) as cache:
        print(f"cache: {cache}")
        cu = minikv.cu_seqlens_from_lengths(args.prompts)
        for layer in range(args.layers):
            q, k, v = tokens(cu[-1], H, "q"), tokens(cu[-1], HKV, "k"), tokens(cu[-1], HKV, "v")
            for s, L in enumerate(args.prompts):  # 10% important tokens per prompt
                important = cu[s] + rng.choice(L, L // 10, replace=False)
                k[important] = (k[important].astype(np.float32) + u[None]).astype(np.float16)
            cache.prefill(layer, seq_ids, cu, to_dev(q), to_dev(k), to_dev(v))
            for s in seq_ids:
                history[(s, layer)] = (k[cu[s]:cu[s + 1]].astype(np.float64),
                                       v[cu[s]:cu[s + 1]].astype(np.float64))
        kept, recent = {}, {}
        for s, L in enumerate(args.prompts):
            seen, cached = cache.sequence_length(s, 0)
            print(f"seq {s}: prompt {L} tokens, kept {cached} after prefill (layer 0)")
            for layer in range(args.layers):
                kept[(s, layer)] = [cache.kept_positions(s, layer, g).tolist() for g in range(HKV)]
                recent[(s, layer)] = [list(range(L - len(p), L)) for p in kept[(s, layer)]]

        def rel(a, b):
            return np.linalg.norm(a - b) / np.linalg.norm(b)

        errors = {"minikv": [], "evict": [], "recent": []}
        for step in range(args.steps):
            for layer in range(args.layers):
                k, v, q = tokens(len(seq_ids), HKV, "k"), tokens(len(seq_ids), HKV, "v"), tokens(len(seq_ids), H, "q")
                cache.append(layer, seq_ids, to_dev(k), to_dev(v))
                out = to_host(cache.decode(layer, seq_ids, to_dev(q))).astype(np.float64)
                for s in seq_ids:
                    hk, hv = history[(s, layer)]
                    hk = np.concatenate([hk, k[s:s + 1].astype(np.float64)])
                    hv = np.concatenate([hv, v[s:s + 1].astype(np.float64)])
                    history[(s, layer)] = (hk, hv)
                    qs = q[s].astype(np.float64)
                    ref = exact_decode(qs, hk, hv)
                    new = list(range(args.prompts[s], len(hk)))  # generated: always kept
                    errors["minikv"].append(rel(out[s], ref))
                    for name, sets in (("evict", kept), ("recent", recent)):
                        keep = [p + new for p in sets[(s, layer)]]
                        errors[name].append(rel(exact_decode(qs, hk, hv, keep), ref))

        st = cache.memory_stats()
        print(f"decoded {args.steps} tokens x {len(seq_ids)} sequences x {args.layers} layers")
        print(f"tokens seen {st.tokens_seen}, cached {st.tokens_cached}; "
              f"KV bytes {st.used_bytes} vs FP16 {st.fp16_equivalent_bytes}")
        print(f"compression: {100 * st.compression_ratio:.1f}% smaller than an FP16 cache")
        print("decode vs exact attention over the full FP16 history (relative L2 error):")
        for name, text in (("minikv", f"libminikv (kept tokens, {args.bits}-bit)"),
                           ("evict", "same kept tokens, unquantized"),
                           ("recent", "recent window of the same size")):
            e = errors[name]
            print(f"  {text:32s} mean {np.mean(e):.4f}  max {np.max(e):.4f}")
        for s in seq_ids:
            cache.release(s)
    print("cache destroyed")


if __name__ == "__main__":
    main()
