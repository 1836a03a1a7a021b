"""minikv.hf: a Hugging Face transformers LLaMA-family model with its KV cache in libminikv.

    import torch, transformers, minikv.hf
    model = transformers.AutoModelForCausalLM.from_pretrained(..., dtype=torch.float16).cuda()
    gen = minikv.hf.MiniKVGenerator(model, max_sequences=4, max_seq_len=8192,
                                    budget_policy="pyramid")     # any minikv.Config field
    tokens = gen.generate(input_ids, max_new_tokens=64)          # greedy; list per sequence
    print(gen.memory_stats().compression_ratio)

How it plugs in. transformers 5.x computes attention through a function chosen by
`config._attn_implementation` from its AttentionInterface registry; the model applies RoPE
to the queries and keys before it calls that function, as libminikv expects. This module
registers one more implementation, "minikv", and MiniKVGenerator runs the model with it:
  * prefill: the prompts of a batch are packed into one row (input_ids [1, total], position
    ids restarting at 0 for each prompt, like FlashAttention's varlen path) and each
    layer's attention is one minikv_prefill call with cu_seqlens;
  * each generated (or teacher-forced) token: input_ids [n, 1] with each sequence's own
    position, and each layer's attention is minikv_append + minikv_decode;
  * several new tokens per sequence at once (`step` with [n, T] ids): per layer, T rounds of
    append + decode, one token after the other, which is exactly T single-token steps.
The model is called with use_cache=False and no transformers Cache: the K/V live only in
libminikv, so transformers keeps none; this module keeps each sequence's next position and
libminikv its lengths (minikv_sequence_length). The model itself is not modified: the
attention implementation is switched to "minikv" only for the duration of each call.

Sliding-window layers (Gemma 3: five of every six layers attend to the last 512 positions
only). libminikv holds and compresses the global ("full_attention") layers only; the local
("sliding_attention") layers keep their last `window` positions in the model's dtype, here
in the adapter (SlidingWindowKV), uncompressed: a local layer never holds more than `window`
tokens, so MiniKV's selection has nothing to gain there, and a ring buffer with a masked
softmax is all it takes. Their attention runs through torch's scaled_dot_product_attention.

One minikv.Cache per generator (num_layers = the model's layers); the backend follows the
model's device (CPU tensors -> CPU backend, CUDA tensors -> CUDA backend on torch's current
stream) and the cache dtype the model's dtype (float32, float16, bfloat16).

Tensor parallelism. A model loaded with transformers' tensor-parallel plan under torchrun
(`from_pretrained(..., distributed_config=transformers.DistributedConfig(tp_plan="auto"))`,
or the older `tp_plan="auto"`; torch.distributed with NCCL on CUDA, gloo on the CPU; needs
accelerate) splits q/k/v_proj column-wise, so each rank's attention sees whole heads:
rank r holds query heads [r*H/W, (r+1)*H/W) and KV heads [r*Hkv/W, (r+1)*Hkv/W) of the W
ranks. Every rank builds its own MiniKVGenerator: its cache holds only its heads, on its own
device. libminikv selects, budgets and quantizes each KV head on its own, so the ranks'
caches together are the single-process cache (tensor_parallel_heads; kv_head_offset maps a
rank's heads to the model's). Every rank must make the same calls with the same prompts
(the model's collectives join them); the logits come back whole on every rank.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from ._config import Config, MemoryStats
from ._types import Backend, DType, MinikvError, Status
from .cache import Cache, cu_seqlens_from_lengths

try:  # torch and transformers are optional dependencies of the binding
    import torch
except ImportError:  # pragma: no cover - exercised only without torch
    torch = None  # type: ignore[assignment]

ATTN_IMPLEMENTATION = "minikv"

__all__ = ["ATTN_IMPLEMENTATION", "MiniKVGenerator", "SlidingWindowKV", "minikv_attention",
           "register", "tensor_parallel_heads"]

_TORCH_TO_MINIKV = {}
if torch is not None:
    _TORCH_TO_MINIKV = {torch.float32: DType.F32, torch.float16: DType.F16,
                        torch.bfloat16: DType.BF16}


def _require_torch() -> None:
    if torch is None:
        raise ImportError("minikv.hf needs PyTorch and transformers: pip install torch transformers")


def register() -> None:
    """Registers the "minikv" attention implementation with transformers (idempotent)."""
    _require_torch()
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, minikv_attention)


class _Call:
    """What one model call asks of the attention layers: which sequences, and how."""

    __slots__ = ("mode", "seq_ids", "cu_seqlens", "cache", "heads", "routes", "window")

    def __init__(self, mode: str, seq_ids: np.ndarray, cache: Cache, heads: Tuple[int, int],
                 cu_seqlens: Optional[np.ndarray] = None,
                 routes: Optional[Sequence[Tuple[bool, int]]] = None,
                 window: Optional["SlidingWindowKV"] = None):
        self.mode = mode  # "prefill" | "decode"
        self.seq_ids = seq_ids
        self.cache = cache
        self.heads = heads  # (query heads, KV heads) of the cache
        self.cu_seqlens = cu_seqlens
        # Per model layer: (True, layer of `window`) for a sliding-window layer, (False,
        # layer of `cache`) otherwise; None: every layer is the cache's, by its own index.
        self.routes = routes
        self.window = window


class SlidingWindowKV:
    """The K/V of a model's sliding-window layers, kept by the adapter: per layer and
    sequence slot, the last `window` positions in the model's dtype. A ring: position p
    lives in slot p % window (attention does not depend on the order of the keys, whose
    RoPE is applied already), so a new token costs one row write and nothing is shifted.

    A query at position i attends to positions (i - window, i], as transformers' sliding
    window mask (and Gemma's training) has it: `window` keys, its own included.

        kv = SlidingWindowKV(layers, max_sequences, num_kv_heads, head_dim, window, dtype, device)
        out = kv.prefill(layer, seq_ids, cu_seqlens, q, k, v, scale)   # q [total, H, D]
        out = kv.append_attend(layer, seq_ids, q, k, v, scale)          # q [n, H, D]
        kv.release(seq_id)
    """

    # Queries per block of the prefill: each block sees block + window - 1 keys, never L x L.
    PREFILL_BLOCK = 512

    def __init__(self, num_layers: int, max_sequences: int, num_kv_heads: int, head_dim: int,
                 window: int, dtype: Any, device: Any):
        _require_torch()
        for name, v in (("num_layers", num_layers), ("max_sequences", max_sequences),
                        ("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("window", window)):
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"SlidingWindowKV: {name} must be a positive int, got {v!r}")
        self.window = int(window)
        self.num_kv_heads = int(num_kv_heads)
        self.head_dim = int(head_dim)
        shape = (num_layers, max_sequences, num_kv_heads, window, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Positions seen, per layer and slot (a step reaches the layers one after the other).
        self.lengths = np.zeros((num_layers, max_sequences), dtype=np.int64)

    def _check(self, layer: int, seq_ids: Sequence[int], q: Any, k: Any, v: Any,
               what: str) -> None:
        if not 0 <= layer < self.lengths.shape[0]:
            raise ValueError(f"SlidingWindowKV.{what}: layer {layer} of {self.lengths.shape[0]}")
        bad = [s for s in seq_ids if not 0 <= s < self.lengths.shape[1]]
        if bad:
            raise ValueError(f"SlidingWindowKV.{what}: sequence slots {bad} outside "
                             f"0..{self.lengths.shape[1] - 1}")
        want = (self.num_kv_heads, self.head_dim)
        if tuple(k.shape[1:]) != want or tuple(v.shape[1:]) != want or q.shape[2] != self.head_dim \
                or q.shape[1] % self.num_kv_heads:
            raise ValueError(f"SlidingWindowKV.{what}: q {list(q.shape)}, k {list(k.shape)}, v "
                             f"{list(v.shape)} do not fit {self.num_kv_heads} KV heads x "
                             f"{self.head_dim}")

    def prefill(self, layer: int, seq_ids: Sequence[int], cu_seqlens: Any, q: Any, k: Any,
                v: Any, scale: float) -> Any:
        """Causal sliding-window attention over packed prompts (q [total, H, D], k/v
        [total, Hkv, D], prompt i = rows cu_seqlens[i]:cu_seqlens[i+1]), each prompt's last
        `window` K/V kept in its slot. Returns [total, H, D]."""
        seq_ids = [int(s) for s in seq_ids]
        self._check(layer, seq_ids, q, k, v, "prefill")
        busy = [s for s in seq_ids if self.lengths[layer, s]]
        if busy:
            raise MinikvError(Status.BAD_STATE, f"SlidingWindowKV.prefill: layer {layer} of "
                                                f"sequence slots {busy} is prefilled already")
        w, rep = self.window, q.shape[1] // self.num_kv_heads
        out = torch.empty_like(q)
        for i, s in enumerate(seq_ids):
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            for q0 in range(a, b, self.PREFILL_BLOCK):
                q1 = min(q0 + self.PREFILL_BLOCK, b)
                k0 = max(a, q0 - w + 1)
                qpos = torch.arange(q0, q1, device=q.device)[:, None]
                kpos = torch.arange(k0, q1, device=q.device)[None, :]
                mask = (kpos <= qpos) & (kpos > qpos - w)
                out[q0:q1] = self._attend(q[q0:q1].transpose(0, 1), k[k0:q1].transpose(0, 1),
                                          v[k0:q1].transpose(0, 1), mask, scale, rep).transpose(0, 1)
            keep = torch.arange(max(a, b - w), b, device=q.device)
            slots = (keep - a) % w
            self.k[layer, s][:, slots] = k[keep].transpose(0, 1)
            self.v[layer, s][:, slots] = v[keep].transpose(0, 1)
            self.lengths[layer, s] = b - a
        return out

    def append_attend(self, layer: int, seq_ids: Sequence[int], q: Any, k: Any, v: Any,
                      scale: float) -> Any:
        """Appends one token per sequence (k/v [n, Hkv, D]) to its window, then its query
        (q [n, H, D]) attends to the window. Returns [n, H, D]."""
        seq_ids = [int(s) for s in seq_ids]
        self._check(layer, seq_ids, q, k, v, "append_attend")
        if len(set(seq_ids)) != len(seq_ids) or not len(seq_ids) == q.shape[0] == k.shape[0] == v.shape[0]:
            raise ValueError(f"SlidingWindowKV.append_attend: {q.shape[0]} queries, {k.shape[0]} "
                             f"keys for sequences {seq_ids} (one each, no repeats)")
        empty = [s for s in seq_ids if not self.lengths[layer, s]]
        if empty:
            raise MinikvError(Status.BAD_STATE, f"SlidingWindowKV.append_attend: layer {layer} "
                                                f"of sequence slots {empty} was not prefilled")
        w = self.window
        slots = torch.as_tensor(seq_ids, device=q.device)
        ring = torch.as_tensor(self.lengths[layer, seq_ids] % w, device=q.device)
        self.k[layer, slots, :, ring] = k
        self.v[layer, slots, :, ring] = v
        self.lengths[layer, seq_ids] += 1
        filled = torch.as_tensor(np.minimum(self.lengths[layer, seq_ids], w), device=q.device)
        mask = (torch.arange(w, device=q.device)[None, :] < filled[:, None])[:, None, None, :]
        out = self._attend(q[:, :, None], self.k[layer, slots], self.v[layer, slots], mask,
                           scale, q.shape[1] // self.num_kv_heads)
        return out[:, :, 0]

    @staticmethod
    def _attend(q: Any, k: Any, v: Any, mask: Any, scale: float, rep: int) -> Any:
        """softmax(q k^T * scale, masked) v with k/v shared by `rep` consecutive query heads;
        q [..., H, t, D], k/v [..., Hkv, s, D], mask broadcastable to [..., H, t, s]."""
        if rep > 1:
            k = k.repeat_interleave(rep, dim=-3)
            v = v.repeat_interleave(rep, dim=-3)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                scale=scale)

    def release(self, seq_id: int) -> None:
        """Forgets sequence slot `seq_id` in every layer (its rows are overwritten later)."""
        self.lengths[:, int(seq_id)] = 0

    def tokens(self) -> Tuple[int, int]:
        """(positions seen, positions kept), summed over layers and slots."""
        return int(self.lengths.sum()), int(np.minimum(self.lengths, self.window).sum())


def minikv_attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any,
                     scaling: Optional[float] = None, dropout: float = 0.0, **kwargs: Any):
    """The attention function transformers calls for attn_implementation="minikv".

    query [b, num_heads, t, head_dim], key/value [b, num_kv_heads, t, head_dim] with RoPE
    applied (the new tokens only: no transformers Cache is in use). Returns the attention
    output [b, t, num_heads, head_dim] and None (no attention weights)."""
    call = kwargs.get("minikv_call")
    if not isinstance(call, _Call):
        raise RuntimeError(
            "attn_implementation='minikv' computes attention only inside MiniKVGenerator calls "
            "(the K/V live in its libminikv cache); run the model through MiniKVGenerator, or set "
            "another attn_implementation")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"minikv.hf: {type(module).__name__} has no layer_idx")
    sliding, cache_layer = (False, layer) if call.routes is None else call.routes[layer]
    if (kwargs.get("sliding_window") is not None) != sliding:
        raise RuntimeError(f"minikv.hf: layer {layer} is called with sliding_window="
                           f"{kwargs.get('sliding_window')} but its config layer type says "
                           f"{'sliding' if sliding else 'full'} attention")
    cache = call.cache
    b, h, t, d = query.shape
    if (h, key.shape[1]) != call.heads:
        raise RuntimeError(
            f"minikv.hf: layer {layer}'s attention has {h} query and {key.shape[1]} KV heads but "
            f"the cache holds {call.heads[0]} and {call.heads[1]} (a tensor-parallel plan that "
            f"does not split q/k/v_proj column-wise into whole heads?)")
    if query.dtype != key.dtype or query.dtype != value.dtype:
        raise TypeError(f"minikv.hf: query/key/value dtypes differ ({query.dtype}, {key.dtype}, "
                        f"{value.dtype})")
    ids = call.seq_ids
    if sliding:
        scale = d ** -0.5 if scaling is None else scaling
        if call.mode == "prefill":
            if b != 1:
                raise RuntimeError("minikv.hf: prefill expects the prompts packed into one row")
            out = call.window.prefill(cache_layer, ids, call.cu_seqlens, query[0].transpose(0, 1),
                                      key[0].transpose(0, 1), value[0].transpose(0, 1), scale)
            return out.unsqueeze(0), None
        if b != len(ids):
            raise RuntimeError(f"minikv.hf: {b} rows for {len(ids)} sequences")
        outs = [call.window.append_attend(cache_layer, ids, query[:, :, i], key[:, :, i],
                                          value[:, :, i], scale) for i in range(t)]
        return torch.stack(outs, dim=1), None

    # libminikv scales logits by 1/sqrt(head_dim); a model with another scale (e.g. a
    # query_pre_attn_scalar) gets it folded into the query.
    if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-6):
        query = query * (scaling * math.sqrt(d))
    if call.mode == "prefill":
        if b != 1:
            raise RuntimeError("minikv.hf: prefill expects the prompts packed into one row")
        # [1, heads, total, d] -> [total, heads, d], the tokens-major layout libminikv takes.
        q = query[0].transpose(0, 1).contiguous()
        k = key[0].transpose(0, 1).contiguous()
        v = value[0].transpose(0, 1).contiguous()
        out = cache.prefill(cache_layer, ids, call.cu_seqlens, q, k, v)
        return out.unsqueeze(0), None

    # decode: t new tokens per sequence, one after the other (append, then attend: one
    # minikv_append_decode call each, a single kernel launch on CUDA where nothing flushes).
    if b != len(ids):
        raise RuntimeError(f"minikv.hf: {b} rows for {len(ids)} sequences")
    outs = [cache.append_decode(cache_layer, ids, query[:, :, i].contiguous(), key[:, :, i].contiguous(),
                                value[:, :, i].contiguous()) for i in range(t)]
    return (outs[0].unsqueeze(1) if t == 1 else torch.stack(outs, dim=1)), None


def _text_config(config: Any) -> Any:
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def tensor_parallel_heads(config: Any, world_size: int) -> Tuple[int, int]:
    """The query and KV heads of each rank's attention when a model with this (transformers)
    config runs tensor-parallel over `world_size` ranks with its heads split column-wise
    (transformers' tp_plan "auto" for the LLaMA family): (num_heads / W, num_kv_heads / W).
    Raises ValueError when `world_size` does not divide num_key_value_heads (a KV head
    cannot be split: its cache, scores and selection belong to one rank). Call it before
    loading the model to fail early; MiniKVGenerator calls it too."""
    tc = _text_config(config)
    num_heads = tc.num_attention_heads
    num_kv_heads = getattr(tc, "num_key_value_heads", None) or num_heads
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"tensor_parallel_heads: world_size must be a positive int, got {world_size!r}")
    if num_kv_heads % world_size or num_heads % world_size:
        divisors = [w for w in range(1, num_kv_heads + 1)
                    if num_kv_heads % w == 0 and num_heads % w == 0]
        raise ValueError(
            f"minikv.hf: tensor parallelism over {world_size} ranks needs num_key_value_heads "
            f"({num_kv_heads}) and num_attention_heads ({num_heads}) to be multiples of the "
            f"world size: each rank keeps whole KV heads in its cache; use a world size in "
            f"{divisors}")
    return num_heads // world_size, num_kv_heads // world_size


def _layer_routes(tc: Any) -> Tuple[List[Tuple[bool, int]], int]:
    """Where each layer of a model with (text) config `tc` keeps its K/V: a list of
    (sliding, index) per layer, index counting the libminikv cache's layers and the
    SlidingWindowKV's layers apart, and the window (0 when no layer is sliding). Raises
    NotImplementedError for attention libminikv cannot compute (other layer types,
    softcapped attention logits, a sliding window on every layer)."""
    layers = tc.num_hidden_layers
    layer_types = getattr(tc, "layer_types", None)
    if getattr(tc, "attn_logit_softcapping", None) is not None:
        raise NotImplementedError("minikv.hf: softcapped attention logits (attn_logit_softcapping) "
                                  "are not supported")
    if getattr(tc, "use_bidirectional_attention", False):
        raise NotImplementedError("minikv.hf: bidirectional attention is not supported")
    if layer_types is None:
        if getattr(tc, "use_sliding_window", False) or (
                getattr(tc, "sliding_window", None) is not None
                and getattr(tc, "use_sliding_window", True)):
            raise NotImplementedError("minikv.hf: a sliding window on every layer is not "
                                      "supported (nothing would be left for libminikv)")
        return [(False, l) for l in range(layers)], 0
    if len(layer_types) != layers:
        raise ValueError(f"minikv.hf: {len(layer_types)} layer_types for {layers} layers")
    other = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if other:
        raise NotImplementedError(f"minikv.hf supports full-attention and sliding-window layers; "
                                  f"this model has layer types {other}")
    if "full_attention" not in layer_types:
        raise NotImplementedError("minikv.hf: every layer is a sliding-window layer; nothing "
                                  "would be left for libminikv")
    window = int(getattr(tc, "sliding_window", None) or 0) if "sliding_attention" in layer_types else 0
    if "sliding_attention" in layer_types and window < 1:
        raise ValueError(f"minikv.hf: sliding-window layers but sliding_window is "
                         f"{getattr(tc, 'sliding_window', None)!r}")
    counts = {True: 0, False: 0}
    routes = []
    for lt in layer_types:
        sliding = lt == "sliding_attention"
        routes.append((sliding, counts[sliding]))
        counts[sliding] += 1
    return routes, window


def _tensor_parallel_rank(model: Any) -> Tuple[int, int]:
    """(world, rank) of the model's tensor-parallel group over its attention heads; (1, 0)
    when the model is not tensor-parallel or its plan leaves the K/V projections whole."""
    world = int(getattr(model, "tp_size", None) or 1)
    plan = getattr(model, "tp_plan", None) or {}
    split = {name.rsplit(".", 1)[-1] for name, style in plan.items() if style == "colwise"}
    if world == 1 or not {"q_proj", "k_proj", "v_proj"} <= split:
        return 1, 0
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise RuntimeError("minikv.hf: the model is tensor-parallel but has no device mesh")
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        mesh = mesh["tp"]
    if mesh.size() != world:
        raise RuntimeError(f"minikv.hf: the model's tensor-parallel mesh has {mesh.size()} ranks, "
                           f"its tp_size says {world}")
    return world, mesh.get_local_rank()


def _as_sequences(input_ids: Any, attention_mask: Any = None) -> List[List[int]]:
    """Prompts as lists of token ids: from a 1-D tensor/list (one prompt), a 2-D tensor
    [batch, len] (with an optional 0/1 attention_mask marking padding, either side), or a
    list of 1-D tensors/lists (a ragged batch)."""
    if torch is not None and isinstance(input_ids, torch.Tensor):
        ids = input_ids.detach().to("cpu")
        if ids.dim() == 1:
            ids = ids.unsqueeze(0)
        if ids.dim() != 2:
            raise ValueError(f"input_ids: expected 1-D or 2-D, got shape {list(ids.shape)}")
        if attention_mask is None:
            return [row.tolist() for row in ids]
        mask = torch.as_tensor(attention_mask).detach().to("cpu").bool()
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {list(mask.shape)} differs from input_ids "
                             f"shape {list(ids.shape)}")
        return [row[m].tolist() for row, m in zip(ids, mask)]
    if attention_mask is not None:
        raise ValueError("attention_mask goes with a 2-D input_ids tensor")
    if isinstance(input_ids, (list, tuple)) and input_ids and all(
            isinstance(x, (int, np.integer)) for x in input_ids):
        return [[int(x) for x in input_ids]]
    if isinstance(input_ids, (list, tuple)):
        seqs = []
        for i, s in enumerate(input_ids):
            s = s.detach().to("cpu").tolist() if torch is not None and isinstance(s, torch.Tensor) \
                else [int(x) for x in s]
            if not isinstance(s, list) or (s and isinstance(s[0], list)):
                raise ValueError(f"input_ids[{i}]: expected a 1-D sequence of token ids")
            seqs.append(s)
        return seqs
    raise TypeError(f"input_ids: expected a tensor or a list of token-id sequences, got "
                    f"{type(input_ids).__name__}")


class MiniKVGenerator:
    """Runs `model` (a transformers causal LM of the LLaMA family: LLaMA, Mistral without
    sliding window, Qwen2, SmolLM, ...; or Gemma 3, whose sliding-window layers the adapter
    keeps itself: `sliding_window`) with its KV cache in one libminikv cache.

        gen = MiniKVGenerator(model, max_sequences=2, max_seq_len=4096,
                              heavy_ratio=0.25, recent_ratio=0.25, budget_policy="pyramid")
        logits = gen.prefill([prompt_a, prompt_b])    # [2, vocab]: each prompt's last token
        logits = gen.step(next_tokens)                # [2, vocab] (next_tokens: [2] ids)
        gen.generate(prompt, max_new_tokens=32)       # greedy: [[token, ...]]
        gen.memory_stats(); gen.reset(); gen.close()

    Keyword arguments are minikv.Config fields (key_bits, value_bits, group_size,
    residual_length, flush_tokens, sink_tokens, heavy_ratio, recent_ratio, budget_policy,
    pyramid_depth, score_mode, window_size, pool_kernel, max_tokens, ...), on top of `preset` (a
    minikv.Preset or its name, e.g. "paper"; None: the library's defaults). The model
    dimensions, dtype, backend and device come from the model. Sequences occupy slots 0..max_sequences-1; `prefill` takes
    the lowest free ones unless given `seq_ids`, and `step` advances the sequences named
    (by default every active one, in prefill order).

    A model whose config.layer_types mixes "full_attention" and "sliding_attention" layers:
    libminikv's cache holds the full-attention layers only (its layer j is the model's
    layer `cache_layers[j]`, and budget_policy="pyramid" spreads over those), and
    `sliding_window` (a SlidingWindowKV, None for other models) keeps the last
    config.sliding_window positions of each sliding-window layer in the model's dtype.

    A tensor-parallel model (DistributedConfig(tp_plan="auto")): one generator per rank,
    each caching its rank's heads (`tp_world`, `tp_rank`; its KV head j is the model's KV
    head kv_head_offset + j); every rank makes the same calls.
    """

    def __init__(self, model: Any, max_sequences: int = 1, max_seq_len: Optional[int] = None,
                 preset: Any = None, **fields: Any):
        _require_torch()
        register()
        self.model = model
        tc = _text_config(model.config)
        routes, window = _layer_routes(tc)
        head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
        # Under tensor parallelism this rank's attention sees only its own heads.
        self.tp_world, self.tp_rank = _tensor_parallel_rank(model)
        num_heads, num_kv_heads = tensor_parallel_heads(tc, self.tp_world)
        self.kv_head_offset = self.tp_rank * num_kv_heads
        self._heads = (num_heads, num_kv_heads)
        param = next(model.parameters())
        dtype = _TORCH_TO_MINIKV.get(param.dtype)
        if dtype is None:
            raise TypeError(f"minikv.hf: the model's dtype {param.dtype} is not float32, float16 "
                            f"or bfloat16")
        self.device = param.device
        backend = Backend.CUDA if param.device.type == "cuda" else Backend.CPU
        if param.device.type not in ("cpu", "cuda"):
            raise ValueError(f"minikv.hf: the model is on {param.device}; libminikv computes on "
                             f"the CPU or a CUDA device")
        for name in ("backend", "device_id", "dtype", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim"):
            if name in fields:
                raise TypeError(f"MiniKVGenerator: {name} comes from the model; do not pass it")
        if max_seq_len is None:
            max_seq_len = int(getattr(tc, "max_position_embeddings", 4096) or 4096)
        make = Config if preset is None else functools.partial(Config.from_preset, preset)
        self.cache_layers = [l for l, (sliding, _) in enumerate(routes) if not sliding]
        self.config = make(backend=backend,
                           device_id=(param.device.index or 0) if backend == Backend.CUDA else 0,
                           dtype=dtype, num_layers=len(self.cache_layers), num_heads=num_heads,
                           num_kv_heads=num_kv_heads, head_dim=head_dim,
                           max_sequences=max_sequences, max_seq_len=max_seq_len, **fields)
        self.cache = Cache(self.config)
        self._routes = routes if window else None
        self.sliding_window = None
        if window:
            self.sliding_window = SlidingWindowKV(
                len(routes) - len(self.cache_layers), self.config.max_sequences, num_kv_heads,
                head_dim, window, param.dtype, param.device)
        self.vocab_size = tc.vocab_size
        self._positions: dict = {}  # slot -> position of its next token
        self._order: List[int] = []  # active slots, in prefill order
        self._broken: set = set()  # slots a failed step left inconsistent across layers

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Frees the libminikv cache. Idempotent."""
        self.cache.close()
        self.sliding_window = None
        self._positions.clear()
        self._order.clear()
        self._broken.clear()

    def __enter__(self) -> "MiniKVGenerator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def reset(self, seq_ids: Optional[Iterable[int]] = None) -> None:
        """Releases the given sequences (default: all); their slots can take new prompts."""
        slots = list(self._order) if seq_ids is None else [int(s) for s in seq_ids]
        for s in slots:
            self._release(s)
            self._positions.pop(s, None)
            self._broken.discard(s)
            if s in self._order:
                self._order.remove(s)

    @property
    def active(self) -> List[int]:
        """The slots holding a sequence, in prefill order."""
        return list(self._order)

    def position(self, seq_id: int) -> int:
        """Tokens seen by sequence `seq_id` (prompt + steps), i.e. its next token's position."""
        return self._positions[seq_id]

    def memory_stats(self) -> MemoryStats:
        """libminikv's statistics: the full-attention layers (all of them for most models;
        sliding_window.tokens() counts the others)."""
        return self.cache.memory_stats()

    def _release(self, seq_id: int) -> None:
        self.cache.release(seq_id)
        if self.sliding_window is not None:
            self.sliding_window.release(seq_id)

    # ---- model calls -------------------------------------------------------------------
    def _run(self, input_ids: Any, position_ids: Any, call: _Call, logits_to_keep: Any) -> Any:
        config = self.model.config
        previous = config._attn_implementation
        config._attn_implementation = ATTN_IMPLEMENTATION
        try:
            with torch.inference_mode():
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=logits_to_keep, minikv_call=call)
        finally:
            config._attn_implementation = previous
        return out.logits

    def prefill(self, input_ids: Any, attention_mask: Any = None,
                seq_ids: Optional[Sequence[int]] = None, all_logits: bool = False) -> Any:
        """Runs the prompts through the model, each layer's attention through minikv_prefill
        (which compresses them into the cache). `input_ids`: one prompt (1-D), a batch
        [n, len] (with an optional attention_mask marking padding), or a list of prompts of
        different lengths. Returns the logits of each prompt's last token [n, vocab], or
        with all_logits=True a list of [len_i, vocab] tensors (every prompt position)."""
        seqs = _as_sequences(input_ids, attention_mask)
        if not seqs or any(len(s) == 0 for s in seqs):
            raise ValueError("prefill: every prompt needs at least one token")
        if seq_ids is None:
            free = [s for s in range(self.config.max_sequences) if s not in self._positions]
            if len(free) < len(seqs):
                raise MinikvError(Status.CAPACITY_EXCEEDED,
                                  f"prefill: {len(seqs)} prompts but {len(free)} free sequence "
                                  f"slots of {self.config.max_sequences}: reset() some first")
            seq_ids = free[:len(seqs)]
        seq_ids = [int(s) for s in seq_ids]
        if len(seq_ids) != len(seqs):
            raise ValueError(f"prefill: {len(seqs)} prompts but {len(seq_ids)} seq_ids")
        busy = [s for s in seq_ids if s in self._positions]
        if busy:
            raise MinikvError(Status.BAD_STATE, f"prefill: sequence slots {busy} hold a sequence; "
                                                f"reset() them first")
        lengths = [len(s) for s in seqs]
        cu = cu_seqlens_from_lengths(lengths)
        dev = self.device
        flat = torch.tensor([t for s in seqs for t in s], dtype=torch.long, device=dev)[None]
        pos = torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).to(dev)[None]
        keep = 0 if all_logits else torch.as_tensor(cu[1:] - 1, dtype=torch.long, device=dev)
        call = _Call("prefill", np.asarray(seq_ids, dtype=np.uint32), self.cache, self._heads, cu,
                     self._routes, self.sliding_window)
        try:
            logits = self._run(flat, pos, call, keep)[0]
        except BaseException:
            # A failure at layer l leaves layers < l prefilled: release the slots, so that
            # the failed prefill changes nothing (as each libminikv call guarantees).
            for s in seq_ids:
                self._release(s)
            raise
        for s, n in zip(seq_ids, lengths):
            self._positions[s] = n
            self._order.append(s)
        if all_logits:
            return [logits[int(cu[i]):int(cu[i + 1])] for i in range(len(seqs))]
        return logits

    def step(self, token_ids: Any, seq_ids: Optional[Sequence[int]] = None) -> Any:
        """Feeds one new token per sequence ([n] ids; or [n, T] ids: T tokens each, one
        after the other) through the model, each layer's attention through minikv_append +
        minikv_decode. Returns the logits [n, vocab] (or [n, T, vocab])."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        single = ids.dim() == 1
        if single:
            ids = ids[:, None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"step: token_ids must be [n] or [n, T], got shape {list(ids.shape)}")
        seq_ids = list(self._order) if seq_ids is None else [int(s) for s in seq_ids]
        if ids.shape[0] != len(seq_ids):
            raise ValueError(f"step: {ids.shape[0]} rows of tokens for {len(seq_ids)} sequences "
                             f"{seq_ids}")
        missing = [s for s in seq_ids if s not in self._positions]
        if missing:
            raise MinikvError(Status.BAD_STATE, f"step: sequences {missing} were not prefilled")
        broken = [s for s in seq_ids if s in self._broken]
        if broken:
            raise MinikvError(Status.BAD_STATE, f"step: sequences {broken} were left part-way "
                                                f"through a failed step; reset() them")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"step: seq_ids {seq_ids} repeat a sequence")
        t = ids.shape[1]
        # Checked here, not by the library part-way through the layers: a step spans one
        # append per layer and cannot be undone once some layers have taken the token.
        over = [s for s in seq_ids if self._positions[s] + t > self.config.max_seq_len]
        if over:
            raise MinikvError(Status.CAPACITY_EXCEEDED,
                              f"step: sequences {over} would exceed max_seq_len "
                              f"({self.config.max_seq_len}) with {t} more tokens")
        starts = [self._positions[s] for s in seq_ids]
        if len(set(starts)) == 1:  # built on the device: no host copy, no stream sync
            pos = torch.arange(starts[0], starts[0] + t, device=self.device).expand(len(starts), t)
        else:
            pos = (torch.tensor(starts)[:, None] + torch.arange(t)[None]).to(self.device)
        call = _Call("decode", np.asarray(seq_ids, dtype=np.uint32), self.cache, self._heads,
                     routes=self._routes, window=self.sliding_window)
        try:
            logits = self._run(ids.to(self.device), pos, call, 0)
        except BaseException:
            # Layers before the failing one took the tokens (e.g. a full block pool with a
            # small max_tokens): these sequences cannot go on consistently.
            self._broken.update(seq_ids)
            raise
        for s in seq_ids:
            self._positions[s] += t
        return logits[:, 0] if single else logits

    def generate(self, input_ids: Any, max_new_tokens: int, attention_mask: Any = None,
                 eos_token_id: Union[None, int, Sequence[int]] = None) -> List[List[int]]:
        """Greedy generation: prefills the prompt(s) (slots taken as in `prefill`), then
        steps until `max_new_tokens` or an EOS token per sequence. Returns the generated
        tokens of each prompt (a list per prompt, EOS included). The sequences stay in the
        cache (memory_stats() describes them) until reset()."""
        if max_new_tokens < 1:
            raise ValueError("generate: max_new_tokens must be >= 1")
        eos = set() if eos_token_id is None else (
            {int(eos_token_id)} if isinstance(eos_token_id, (int, np.integer))
            else {int(e) for e in eos_token_id})
        seqs = _as_sequences(input_ids, attention_mask)
        before = set(self._positions)
        logits = self.prefill(seqs)
        slots = [s for s in self._order if s not in before]
        out: List[List[int]] = [[] for _ in slots]
        live = list(range(len(slots)))
        nxt = logits.argmax(-1).tolist()
        for step in range(max_new_tokens):
            for i, tok in zip(live, nxt):
                out[i].append(int(tok))
            live_next = [i for i, tok in zip(live, nxt) if int(tok) not in eos]
            if step + 1 == max_new_tokens or not live_next:
                break
            feed = [out[i][-1] for i in live_next]
            logits = self.step(feed, [slots[i] for i in live_next])
            live = live_next
            nxt = logits.argmax(-1).tolist()
        return out
