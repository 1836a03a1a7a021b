"""Independent numpy models of what libminikv computes, written from MINIKV.md, the header
and src/layout.h + src/quant.h (not from the C++ code paths they check)."""
from __future__ import annotations

import math
from typing import List

import numpy as np


# ---- attention (float64) -------------------------------------------------------------
def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """q [L, H, D], k/v [L, Hkv, D] -> [L, H, D]; query head h uses KV head h // (H/Hkv)."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    L, H, D = q.shape
    rep = H // k.shape[1]
    out = np.empty((L, H, D))
    mask = np.triu(np.ones((L, L), dtype=bool), 1)
    for h in range(H):
        s = q[:, h] @ k[:, h // rep].T / math.sqrt(D)
        s[mask] = -np.inf
        p = np.exp(s - s.max(axis=1, keepdims=True))
        out[:, h] = (p / p.sum(axis=1, keepdims=True)) @ v[:, h // rep]
    return out


def decode_attention(q: np.ndarray, k_heads: List[np.ndarray], v_heads: List[np.ndarray]) -> np.ndarray:
    """One query q [H, D] over per-KV-head contexts k_heads[g], v_heads[g] ([N_g, D] each,
    which may differ per head after selection) -> [H, D]."""
    q = np.asarray(q, dtype=np.float64)
    H, D = q.shape
    rep = H // len(k_heads)
    out = np.empty((H, D))
    for h in range(H):
        k = np.asarray(k_heads[h // rep], dtype=np.float64)
        v = np.asarray(v_heads[h // rep], dtype=np.float64)
        s = k @ q[h] / math.sqrt(D)
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ v
    return out


# ---- budgets (MINIKV.md section 2) ------------------------------------------------------
def budget_tokens(ratio: float, n: int) -> int:
    x = ratio * n
    return int(math.floor(x + 1e-9 * (1.0 + x)))  # floor, robust to 0.25f*L rounding


def layer_heavy_ratios(num_layers: int, h: float, r: float, pyramid: bool = False,
                       depth: float = 7.0) -> List[float]:
    if pyramid and num_layers > 1:
        bottom, top = h * (2 - 1 / depth), h / depth
        ratios = [bottom + (top - bottom) * l / (num_layers - 1) for l in range(num_layers)]
    else:
        ratios = [h] * num_layers
    return [max(0.0, min(x, 1.0 - r)) for x in ratios]


def kept_count(prompt_len: int, heavy_ratio: float, recent_ratio: float) -> int:
    n_hh, n_rw = budget_tokens(heavy_ratio, prompt_len), budget_tokens(recent_ratio, prompt_len)
    return prompt_len if n_hh + n_rw >= prompt_len else n_hh + n_rw


# ---- storage accounting (src/layout.h) --------------------------------------------------
def row_bytes(bits: int, head_dim: int, elem: int) -> int:
    return head_dim * elem if bits == 16 else head_dim * bits // 8


def quantized_bytes(n: int, kv_heads: int, head_dim: int, group: int, key_bits: int,
                    value_bits: int, elem: int) -> int:
    """Bytes of n quantized tokens (a multiple of group): codes + scales/mins."""
    per_group = group * (row_bytes(key_bits, head_dim, elem) + row_bytes(value_bits, head_dim, elem))
    if key_bits != 16:
        per_group += 2 * head_dim * elem                   # per-channel (scale, min) of keys
    if value_bits != 16:
        per_group += 2 * group * (head_dim // group) * elem  # per-token (scale, min) of values
    return (n // group) * per_group * kv_heads


def flush_size(flush_tokens: int, group: int, residual_length: int) -> int:
    """F, the tokens one flush quantizes (include/minikv.h, flush_tokens): the whole
    residual for 0, else flush_tokens rounded up to a multiple of group, at most
    residual_length."""
    if flush_tokens == 0:
        return residual_length
    return min(-(-flush_tokens // group) * group, residual_length)


class SlotModel:
    """Bookkeeping of one (sequence, layer): quantized vs 16-bit residual tokens
    (MINIKV.md section 4: tail of < G kept prompt tokens in the residual, flush at R).
    flush_tokens (include/minikv.h; 0 = R) gives F = flush_size(...): a flush quantizes the
    oldest F of the R residual tokens and keeps the newest R - F in the residual."""

    def __init__(self, prompt_len: int, n_keep: int, group: int, residual_length: int,
                 flush_tokens: int = 0):
        self.seen = prompt_len
        self.quantized = n_keep - n_keep % group
        self.residual = n_keep - self.quantized
        self.R = residual_length
        self.F = flush_size(flush_tokens, group, residual_length)
        self.flushes = 0

    def append(self) -> None:
        self.seen += 1
        if self.residual + 1 == self.R:
            self.quantized += self.F
            self.residual = self.R - self.F
            self.flushes += 1
        else:
            self.residual += 1

    @property
    def cached(self) -> int:
        return self.quantized + self.residual

    def used_bytes(self, kv_heads: int, head_dim: int, group: int, key_bits: int,
                   value_bits: int, elem: int) -> int:
        return (quantized_bytes(self.quantized, kv_heads, head_dim, group, key_bits, value_bits, elem)
                + self.residual * 2 * kv_heads * head_dim * elem)


# ---- KIVI quantization (src/quant.h), float32 arithmetic -------------------------------
def _storage(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return x.astype(dtype).astype(np.float32)


def fake_quantize(x: np.ndarray, bits: int, axis: int, dtype: np.dtype) -> np.ndarray:
    """Quantize-dequantize one group: x [G, D] for keys (groups along tokens: axis 0, one
    (scale, min) per channel) or [D//G, G] blocks for values (axis 1)."""
    x = np.asarray(x, dtype=np.float32)
    levels = np.float32(2 ** bits - 1)
    mn = x.min(axis=axis, keepdims=True)
    mx = x.max(axis=axis, keepdims=True)
    scale = _storage((mx - mn) / levels, dtype)
    mn_s = _storage(mn, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.clip((x - mn_s) / scale, np.float32(0), levels)
    codes = np.where(scale > 0, np.rint(t), np.float32(0)).astype(np.float32)
    return (codes * scale + mn_s).astype(np.float32)


def dequantized_context(k_rows: np.ndarray, v_rows: np.ndarray, quantized: int, group: int,
                        key_bits: int, value_bits: int, dtype: np.dtype):
    """k_rows/v_rows [N, D] of one KV head in cache order; the first `quantized` tokens are
    stored quantized in consecutive groups of `group` tokens, the rest 16-bit."""
    k = np.asarray(k_rows, dtype=np.float32).copy()
    v = np.asarray(v_rows, dtype=np.float32).copy()
    D = k.shape[1]
    for g0 in range(0, quantized, group):
        if key_bits != 16:
            k[g0:g0 + group] = fake_quantize(k[g0:g0 + group], key_bits, 0, dtype)
        if value_bits != 16:
            for t in range(g0, g0 + group):
                v[t] = fake_quantize(v[t].reshape(D // group, group), value_bits, 1,
                                     dtype).reshape(D)
    return k, v
