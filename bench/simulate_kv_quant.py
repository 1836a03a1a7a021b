#!/usr/bin/env python3
"""bench/simulate_kv_quant.py — storage formats libminikv does not have yet, measured before
they are built: 3-bit codes and a per-head Hadamard rotation of keys and/or values ahead of
the KIVI quantizer (issue: accuracy at the paper's memory), next to the formats it has.

The model's own attention with the cache quantized in PyTorch ("fake quantization"), on the
decode-phase perplexity protocol of scripts/eval_accuracy.py (same corpus, same windows for
the same --seed and context): one exact forward over the first ctx-257 tokens of each window
(the prefill), then the next 256 tokens teacher-forced in one chunk whose queries see the
prefill's keys and values quantized — per channel over groups of G tokens for keys, per
token over groups of G channels for values, asymmetric min/max, scale and minimum rounded to
fp16, as the library stores them (docs/algorithm.md) — except the first `sinks` positions
(16-bit) and a tail shorter than a group (the library's 16-bit residual), and the chunk's
own keys and values exact. Keep-all: no eviction, so the rows isolate the quantizer.
A rotation multiplies each head's keys (or values) by the orthonormal Hadamard matrix H
before quantizing and by Hᵀ after, which the library would fold into q (keys: q·Hᵀ k = (q H)·k
for H orthonormal) and into the output (values).

The residual (rows marked "R = …"): the chunk's own keys and values pass through the 16-bit
residual as decode appends them one at a time, instead of staying exact. A flush quantizes
the residual's oldest F tokens (whole groups) once it holds R: F = R is the library's flush
(MINIKV.md §4; the token that fills it attends to its own quantized K/V), F < R a sliding
residual that always keeps the newest R − F tokens in 16 bits. Each chunk query reads a key
quantized or exact as the flushes up to its own append left it.

The tensor-core roundings (rows marked "p·s_v" and "q ⊙ s_k"): the decode attention computed
from the codes, as the CUDA kernels do, instead of SDPA over the dequantized cache. "p·s_v":
each probability times its value group's scale, and each 16-bit row's probability, rounded to
fp16 once (the A / B operand of P·V; MINIKV.md allows it, the kernels do it). "q ⊙ s_k": also
each query channel times its key group's scale rounded to fp16 once (the QK operand; the
kernels carry it exactly in two fp16 pieces, hi + lo, which MINIKV.md requires today). Both
round to fp16's 11-bit significand; the kernels' power-of-two prescaling keeps the operands
in fp16's normal range.

    python3 bench/simulate_kv_quant.py --out bench/results/<date>_cpu_simulated-quant.json \
        [--contexts 2048] [--windows 16] [--threads 2] [--settings default,fp16] [--check]

--check (the CI smoke) also runs each batch as one causal forward without the cache and
requires the chunked exact path to give the same losses (|Δnll| < 1e-4), the attention from
the codes without roundings to give the fake-quantized cache's (|Δnll| < 1e-4), and every
setting's loss to be finite: it fails if the attention hook or the cache split breaks.

Needs torch, transformers and the GGUF (scripts/fetch-model.sh), like eval_accuracy.py.
"""
from __future__ import annotations

import argparse
import collections
import copy
import datetime
import inspect
import json
import math
import os
import random
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from eval_accuracy import DEFAULT_CORPUS, Corpus, batches  # noqa: E402
from minikv.gguf_llama import default_model_path, load_gguf_llama  # noqa: E402
from results import git_commit  # noqa: E402

class Residual(collections.namedtuple("Residual", "length flush")):
    """The decode chunk through a 16-bit residual of `length` tokens that quantizes its
    oldest `flush` tokens when full."""

    def quantized(self, tail, appended):
        """Tokens flushed out of the residual after `appended` appends to one that held
        `tail` after the prefill."""
        held = tail + appended
        return 0 if held < self.length else self.flush * ((held - self.length) // self.flush + 1)


# (name, key bits, value bits, G, sinks, rotate keys, rotate values[, operand roundings or a
# Residual]); bits 16 = exact.
SETTINGS = [
    ("K2V2 G16 (paper)", 2, 2, 16, 0, False, False),
    ("K2V2 G16 rot K+V", 2, 2, 16, 0, True, True),
    ("K4V2 G32 +4 sinks (default)", 4, 2, 32, 4, False, False),
    ("K4V2 G32 +4 sinks rot V", 4, 2, 32, 4, False, True),
    ("K4V2 G32 +4 sinks rot K", 4, 2, 32, 4, True, False),
    ("K3V3 G32 +4 sinks", 3, 3, 32, 4, False, False),
    ("K3V3 G32 +4 sinks rot V", 3, 3, 32, 4, False, True),
    ("K3V3 G32 +4 sinks rot K+V", 3, 3, 32, 4, True, True),
    ("K3V2 G32 +4 sinks rot V", 3, 2, 32, 4, False, True),
    ("K4V2 G32 +4 sinks, from the codes", 4, 2, 32, 4, False, False, ""),
    ("K4V2 G32 +4 sinks, p·s_v fp16", 4, 2, 32, 4, False, False, "pv"),
    ("K4V2 G32 +4 sinks, p·s_v + q ⊙ s_k fp16", 4, 2, 32, 4, False, False, "pv+qk"),
    ("K4V2 G32 +4 sinks, no flush", 4, 2, 32, 4, False, False, Residual(1 << 30, 1 << 30)),
    ("K4V2 G32 +4 sinks, R = 128", 4, 2, 32, 4, False, False, Residual(128, 128)),
    ("K4V2 G32 +4 sinks, R = 64", 4, 2, 32, 4, False, False, Residual(64, 64)),
    ("K4V2 G32 +4 sinks, R = 32", 4, 2, 32, 4, False, False, Residual(32, 32)),
    ("K4V2 G32 +4 sinks, R = 128 sliding 32", 4, 2, 32, 4, False, False, Residual(128, 32)),
    ("K4V2 G32 +4 sinks, R = 96 sliding 32", 4, 2, 32, 4, False, False, Residual(96, 32)),
    ("K4V2 G32 +4 sinks, R = 64 sliding 32", 4, 2, 32, 4, False, False, Residual(64, 32)),
]


def hadamard(d, dtype):
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if h.shape[0] != d:
        raise ValueError(f"head_dim {d} is not a power of two")
    return h / math.sqrt(d)


def fp16_round(x):
    return x.to(torch.float16).to(x.dtype)


def significand11(x):
    """x rounded to fp16's 11-bit significand, exponent unbounded (round half to even)."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 2048) / 2048, e)


def quantize_codes(x, bits, dim):
    """Asymmetric min/max quantization of x along `dim` (the group), scale and minimum
    rounded to fp16: (codes, scale, minimum), the last two with `dim` kept as size 1."""
    levels = (1 << bits) - 1
    mn = fp16_round(x.amin(dim, keepdim=True))
    mx = x.amax(dim, keepdim=True)
    scale = fp16_round((mx - mn) / levels)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round((x - mn) / safe), 0, levels), scale, mn


def quantize(x, bits, dim):
    """quantize_codes, dequantized."""
    if bits >= 16:
        return x
    code, scale, mn = quantize_codes(x, bits, dim)
    return code * scale + mn


def attend_from_codes(query, key, value, P, setting, scaling):
    """The decode chunk's attention (queries [B, H, Tq, D] at positions P..P+Tq-1; key and
    value [B, Hkv, P + Tq, D]) over the prefill's cache as the CUDA kernels compute it: logits
    of quantized keys as Σ (q ⊙ s_k) · code + q · m_k, values as Σ (p · s_v) · code + Σ p · m_v,
    16-bit rows (sinks, the residual tail, the chunk's own keys) exact, with the operand
    roundings `setting` names. No rotations."""
    _, kb, vb, G, sinks, _, _, rounding = setting
    B, H, Tq, D = query.shape
    n_rep = H // key.shape[1]
    q_end = sinks + (P - sinks) // G * G
    n, ng = q_end - sinks, (q_end - sinks) // G
    rep = lambda t: t.repeat_interleave(n_rep, 1)  # noqa: E731
    kq, vq = key[:, :, sinks:q_end], value[:, :, sinks:q_end]
    ck, sk, mk = (rep(t) for t in quantize_codes(kq.reshape(B, -1, ng, G, D), kb, 3))  # [B,H,ng,G|1,D]
    cv, sv, mv = (rep(t) for t in quantize_codes(vq.reshape(B, -1, n, D // G, G), vb, 4))  # [B,H,n,D/G,G|1]
    qs = query[:, :, :, None, :] * sk[:, :, None, :, 0, :]  # [B,H,Tq,ng,D]
    if "qk" in rounding:
        qs = significand11(qs)
    lq = torch.einsum("bhigc,bhgtc->bhigt", qs, ck).reshape(B, H, Tq, n)
    lq = lq + torch.einsum("bhic,bhgc->bhig", query, mk[:, :, :, 0, :]).repeat_interleave(G, 3)
    rows = torch.cat([torch.arange(sinks), torch.arange(q_end, P + Tq)])  # 16-bit rows
    kr, vr = rep(key[:, :, rows]), rep(value[:, :, rows])
    lr = query @ kr.transpose(2, 3)
    causal = torch.ones(Tq, Tq, dtype=torch.bool).tril()
    lr[..., -Tq:] = lr[..., -Tq:].masked_fill(~causal, float("-inf"))
    logits = torch.cat([lq, lr], 3) * scaling
    p = torch.softmax(logits, 3)
    pq, pr = p[..., :n], p[..., n:]
    ps = pq[..., None] * sv[:, :, None, :, :, 0]  # [B,H,Tq,n,D/G]
    if "pv" in rounding:
        ps, pr = significand11(ps), significand11(pr)
    out = torch.einsum("bhitj,bhtjc->bhijc", ps, cv).reshape(B, H, Tq, D)
    out = out + torch.einsum("bhit,bhtj->bhij", pq, mv[..., 0]).repeat_interleave(G, 3)
    return out + pr @ vr


def fake_cache(k, v, kb, vb, G, sinks, rot_k, rot_v, H):
    """k, v: [B, Hkv, P, D] of the prefill; the cache as decode would read it."""
    P = k.shape[2]
    q_end = sinks + (P - sinks) // G * G  # tokens past it stay in the 16-bit residual
    if q_end <= sinks:
        return k, v
    k, v = k.clone(), v.clone()
    ks, vs = k[:, :, sinks:q_end], v[:, :, sinks:q_end]
    if rot_k:
        ks = ks @ H
    if rot_v:
        vs = vs @ H
    B, Hkv, n, D = ks.shape
    # keys: per channel over G tokens
    kq = quantize(ks.reshape(B, Hkv, n // G, G, D), kb, 3).reshape(B, Hkv, n, D)
    # values: per token over G channels
    vq = quantize(vs.reshape(B, Hkv, n, D // G, G), vb, 4).reshape(B, Hkv, n, D)
    if rot_k:
        kq = kq @ H.T
    if rot_v:
        vq = vq @ H.T
    k[:, :, sinks:q_end], v[:, :, sinks:q_end] = kq, vq
    return k, v


def attend_through_residual(query, key, value, P, setting, scaling):
    """The decode chunk's attention (queries [B, H, Tq, D] at positions P..P+Tq-1; key and
    value [B, Hkv, P + Tq, D]) with the chunk's tokens appended to the residual one at a time
    (setting[7], a Residual): query i reads the keys and values that the flushes up to its
    own append have quantized, the others exact. Quantized tokens dequantized (fake
    quantization, no operand roundings), groups aligned at the sinks as the library stores
    them."""
    _, kb, vb, G, sinks, _, _, res = setting
    _, H, Tq, _ = query.shape
    n_rep = H // key.shape[1]
    total = key.shape[2]
    q_end = sinks + (P - sinks) // G * G
    # Every whole group quantized (a flush takes whole groups), as fake_cache stores the prefill.
    kq, vq = fake_cache(key, value, kb, vb, G, sinks, False, False, None)
    # quantized[i, j]: key j read quantized by query i (flushes up to and with its own append)
    ends = torch.tensor([q_end + res.quantized(P - q_end, i + 1) for i in range(Tq)])
    j = torch.arange(total)
    quantized = (j[None, :] >= sinks) & (j[None, :] < ends[:, None])
    causal = j[None, :] <= P + torch.arange(Tq)[:, None]
    rep = lambda t: t.repeat_interleave(n_rep, 1)  # noqa: E731
    exact_logits, quant_logits = query @ rep(key).transpose(2, 3), query @ rep(kq).transpose(2, 3)
    logits = torch.where(quantized, quant_logits, exact_logits).masked_fill(~causal, float("-inf"))
    p = torch.softmax(logits * scaling, 3)
    zero = torch.zeros((), dtype=p.dtype)
    return torch.where(quantized, p, zero) @ rep(vq) + torch.where(quantized, zero, p) @ rep(value)


class Sim:
    """An attention function for transformers: exact, except that the queries of a decode
    chunk read the prefill's keys and values through fake_cache."""

    def __init__(self):
        self.setting = None  # None: exact
        self.prefill_len = 0
        self.H = None

    def __call__(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        n_rep = query.shape[1] // key.shape[1]
        if self.setting is not None and len(self.setting) > 7 and key.shape[2] > query.shape[2]:
            attend = attend_through_residual if isinstance(self.setting[7], Residual) else attend_from_codes
            out = attend(query, key, value, self.prefill_len, self.setting, scaling)
            return out.transpose(1, 2).contiguous(), None
        if self.setting is not None and key.shape[2] > query.shape[2]:
            _, kb, vb, G, sinks, rot_k, rot_v = self.setting[:7]
            P = self.prefill_len
            if self.H is None or self.H.shape[0] != key.shape[-1]:
                self.H = hadamard(key.shape[-1], key.dtype)
            kp, vp = fake_cache(key[:, :, :P], value[:, :, :P], kb, vb, G, sinks, rot_k, rot_v, self.H)
            key = torch.cat([kp, key[:, :, P:]], 2)
            value = torch.cat([vp, value[:, :, P:]], 2)
        key = key.repeat_interleave(n_rep, 1)
        value = value.repeat_interleave(n_rep, 1)
        Tq, Tk = query.shape[2], key.shape[2]
        causal = torch.ones(Tq, Tk, dtype=torch.bool).tril(Tk - Tq)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal,
                                                               scale=scaling)
        return out.transpose(1, 2).contiguous(), None


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--corpus", default=os.environ.get("MINIKV_CORPUS", DEFAULT_CORPUS))
    ap.add_argument("--contexts", default="2048")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--settings", default="",
                    help="comma-separated substrings: only the settings whose names contain one")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless the chunked exact path equals one causal forward")
    args = ap.parse_args()
    if args.check and args.settings:
        ap.error("--check compares settings: it runs every one (no --settings)")
    torch.set_grad_enabled(False)
    settings = [s for s in SETTINGS if not args.settings or any(w in s[0] for w in args.settings.split(","))]
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_gguf_llama(args.model, dtype=torch.float32, device=torch.device("cpu"))
    sim = Sim()
    transformers.AttentionInterface.register("minikv_sim", sim)
    model.config._attn_implementation = "minikv_sim"
    for layer in model.model.layers:
        layer.self_attn.config._attn_implementation = "minikv_sim"
    corpus = Corpus(tok, args.corpus)
    # transformers renames past_key_values to cache (5.x deprecates the old name)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    n = args.decode_tokens
    rows = []
    meta = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                commit=git_commit() or "?", model=os.path.basename(args.model), torch=torch.__version__,
                transformers=transformers.__version__, decode_tokens=n, windows=args.windows, seed=args.seed,
                method="fake quantization of the prefill's K/V (keep-all), see the script's header")
    for ctx in [int(c) for c in args.contexts.split(",")]:
        rng = random.Random(args.seed * 1000 + ctx)  # eval_accuracy.py's windows
        windows = corpus.windows(ctx, args.windows, rng)
        nll = {}
        t0 = time.time()
        for b in batches(windows, args.batch):
            x = torch.tensor(b)
            P = ctx - n - 1
            sim.setting, sim.prefill_len = None, P
            cache = transformers.DynamicCache(config=model.config)
            model(input_ids=x[:, :P], use_cache=True, logits_to_keep=1, **{cache_kw: cache})
            forced, target = x[:, P:P + n], x[:, P + 1:P + n + 1]
            if args.check:  # the same positions from one causal forward, no cache
                logits = model(input_ids=x[:, :P + n], use_cache=False, logits_to_keep=n).logits.float()
                l = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
                nll.setdefault("one forward", []).extend(l.mean(1).tolist())
            for s in [None] + settings:
                sim.setting = s
                c = copy.deepcopy(cache)
                logits = model(input_ids=forced, use_cache=True, **{cache_kw: c}).logits.float()
                l = torch.nn.functional.cross_entropy(logits.transpose(1, 2), target, reduction="none")
                nll.setdefault(s[0] if s else "full", []).extend(l.mean(1).tolist())
            print(f"ctx {ctx}: {len(nll['full'])}/{len(windows)} windows, {time.time() - t0:.0f} s", flush=True)
        ref = float(np.mean(nll["full"]))
        for s in [None] + settings:
            name = s[0] if s else "full"
            m = float(np.mean(nll[name]))
            row = dict(setting=name, ctx=ctx, nll=m, ppl=math.exp(m), delta_ppl=math.exp(m - ref) - 1)
            if s:
                _, kb, vb, G, sinks, rk, rv = s[:7]
                extra = s[7] if len(s) > 7 else ""
                row.update(key_bits=kb, value_bits=vb, group=G, sinks=sinks, rotate_keys=rk,
                           rotate_values=rv, bits_per_element=(kb + vb) / 2 + 32 / G,
                           operand_roundings=extra if isinstance(extra, str) else "")
                if isinstance(extra, Residual):
                    row.update(residual_length=extra.length, flush_tokens=extra.flush)
            rows.append(row)
            print(f"  {name:40s} ppl {row['ppl']:8.3f}  delta {100 * row['delta_ppl']:+6.2f}%"
                  + (f"  {row['bits_per_element']:.2f} bits/elt" if s else ""), flush=True)
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=rows), f, indent=1)
        if args.check:
            gap = max(abs(a - b) for a, b in zip(nll["one forward"], nll["full"]))
            # the attention from the codes without roundings is the fake-quantized cache's
            codes_gap = max(abs(a - b) for a, b in zip(nll["K4V2 G32 +4 sinks (default)"],
                                                       nll["K4V2 G32 +4 sinks, from the codes"]))
            # the chunk through a residual that never flushes is the chunk read exact
            residual_gap = max(abs(a - b) for a, b in zip(nll["K4V2 G32 +4 sinks (default)"],
                                                          nll["K4V2 G32 +4 sinks, no flush"]))
            finite = all(math.isfinite(v) for vs in nll.values() for v in vs)
            print(f"check ctx {ctx}: chunked vs one forward max |dnll| {gap:.2e}, from the codes vs "
                  f"dequantized {codes_gap:.2e}, no flush vs exact chunk {residual_gap:.2e}, losses "
                  f"finite: {finite}")
            if gap > 1e-4 or codes_gap > 1e-4 or residual_gap > 1e-4 or not finite:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
