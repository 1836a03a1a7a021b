"""minikv.gguf_gemma3: a transformers Gemma3ForCausalLM (and its tokenizer) from a GGUF file
of the gemma3 architecture (Gemma 3's text models), read with the pure-Python `gguf` package.

    from minikv.gguf_gemma3 import load_gguf_gemma3
    model, tokenizer = load_gguf_gemma3(".models/gemma-3-270m-q4_k_m.gguf")

`MINIKV_FETCH_GEMMA3=1 scripts/fetch-model.sh` fetches Gemma 3 270M into .models/.

What the GGUF leaves out and llama.cpp hard-codes, filled in here the same way:
  * the layer pattern: every 6th layer (5, 11, 17, ...) attends to the whole context, the
    others to a sliding window of `attention.sliding_window` tokens;
  * the local layers' RoPE base, 10000 (`rope.freq_base` is the global layers');
  * the attention scale: 1/sqrt(head_dim) (query_pre_attn_scalar = head_dim), except for
    the 62-layer 27B model, where it is 1/sqrt(hidden / heads).
And what llama.cpp's converter changed: it stores every RMSNorm weight as 1 + w (ggml's norm
multiplies by the weight; Gemma's by 1 + weight); transformers wants w, so 1 is taken off.
Q and K are not permuted for Gemma (ggml reads them with NeoX RoPE, transformers' layout).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .gguf_llama import _field, build_from_gguf, hf_tensor_name, import_gguf, models_dir

__all__ = ["GEMMA3_MODEL_FILE", "gemma3_config_fields", "gemma3_layer_types",
           "gemma3_tensor_name", "load_gguf_gemma3"]

GEMMA3_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"
SLIDING_WINDOW_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3
LOCAL_ROPE_THETA = 10000.0  # llama.cpp: hparams.rope_freq_base_train_swa for gemma3


def default_gemma3_path() -> str:
    """The Gemma 3 file that `MINIKV_FETCH_GEMMA3=1 scripts/fetch-model.sh` fetches."""
    return os.path.join(models_dir(), GEMMA3_MODEL_FILE)


def gemma3_layer_types(num_layers: int) -> List[str]:
    """transformers' layer_types of a gemma3 model: layer l is global ("full_attention")
    when (l + 1) is a multiple of 6, local ("sliding_attention") otherwise."""
    return ["full_attention" if (l + 1) % SLIDING_WINDOW_PATTERN == 0 else "sliding_attention"
            for l in range(num_layers)]


def gemma3_config_fields(get: Callable[[str, Any], Any]) -> Dict[str, Any]:
    """Gemma3TextConfig arguments from GGUF metadata; `get(key, default)` reads one key
    (None when absent and no default). Raises ValueError for another architecture or a
    setting this mapping does not know."""
    arch = get("general.architecture", None)
    if arch != "gemma3":
        raise ValueError(f"load_gguf_gemma3: the GGUF's architecture is {arch!r}, not 'gemma3'")
    a = "gemma3."

    def need(key: str) -> Any:
        v = get(a + key, None)
        if v is None:
            raise ValueError(f"load_gguf_gemma3: the GGUF has no {a + key}")
        return v

    hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
    layers = int(need("block_count"))
    head_dim = int(get(a + "attention.key_length", hidden // heads))
    value_dim = int(get(a + "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise ValueError(f"load_gguf_gemma3: key length {head_dim} != value length {value_dim}")
    full_rope: Dict[str, Any] = {"rope_type": "default",
                                 "rope_theta": float(get(a + "rope.freq_base", 1000000.0))}
    scaling = get(a + "rope.scaling.type", None)
    if scaling == "linear":  # the 4B-27B models: position interpolation on the global layers
        full_rope = dict(full_rope, rope_type="linear",
                         factor=float(need("rope.scaling.factor")))
    elif scaling not in (None, "none"):
        raise ValueError(f"load_gguf_gemma3: rope scaling {scaling!r} is not supported")
    tokens = get("tokenizer.ggml.tokens", None)
    vocab = get(a + "vocab_size", None)
    if vocab is None:
        if tokens is None:
            raise ValueError("load_gguf_gemma3: the GGUF has neither gemma3.vocab_size nor a "
                             "token list")
        vocab = len(tokens)
    softcap = {k: float(v) for k, v in (
        ("final_logit_softcapping", get(a + "final_logit_softcapping", None)),
        ("attn_logit_softcapping", get(a + "attn_logit_softcapping", None))) if v is not None}
    return dict(
        vocab_size=int(vocab), hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(get(a + "attention.head_count_kv", heads)),
        head_dim=head_dim,
        max_position_embeddings=int(get(a + "context_length", 32768)),
        rms_norm_eps=float(get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
        sliding_window=int(need("attention.sliding_window")),
        layer_types=gemma3_layer_types(layers),
        query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
        rope_parameters={"full_attention": full_rope,
                         "sliding_attention": {"rope_type": "default",
                                               "rope_theta": LOCAL_ROPE_THETA}},
        hidden_activation="gelu_pytorch_tanh",
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=get("tokenizer.ggml.eos_token_id", None),
        pad_token_id=get("tokenizer.ggml.padding_token_id", None),
        **softcap,
    )


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gemma3_tensor_name(name: str) -> str:
    """The transformers Gemma3ForCausalLM parameter of a GGUF tensor name."""
    return hf_tensor_name(name, _LAYER_NAMES, "load_gguf_gemma3", "a gemma3 text layout")


def _tokenizer(path: str) -> Any:
    """transformers' own GGUF tokenizer conversion (SentencePiece vocabulary and scores)."""
    import transformers
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                      gguf_file=os.path.basename(path))


def load_gguf_gemma3(path: Optional[str] = None, dtype: Any = None, device: Any = "cpu",
                     tokenizer: bool = True) -> Tuple[Any, Any]:
    """(model, tokenizer) from a gemma3 GGUF file (default: default_gemma3_path()). The
    model is a transformers Gemma3ForCausalLM in eval mode, in `dtype` (torch.float32 by
    default) on `device`, with sdpa attention; the tokenizer transformers' GemmaTokenizer
    (it prepends <bos>), or None when tokenizer=False (converting the 262K-token vocabulary
    takes ~30 s)."""
    import transformers

    gguf = import_gguf()
    path = path or default_gemma3_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file (MINIKV_FETCH_GEMMA3=1 "
                                f"scripts/fetch-model.sh fetches Gemma 3 270M into .models/)")
    reader = gguf.GGUFReader(path)
    fields = gemma3_config_fields(lambda key, default: _field(reader, key, default))
    names = {t.name for t in reader.tensors}
    cfg = transformers.Gemma3TextConfig(tie_word_embeddings="output.weight" not in names, **fields)

    def norm_minus_one(name: str, w: np.ndarray) -> np.ndarray:
        return w - 1.0 if name.endswith("norm.weight") else w

    model = build_from_gguf(transformers.Gemma3ForCausalLM, cfg, reader, gemma3_tensor_name,
                            norm_minus_one, dtype, device, "load_gguf_gemma3")
    return model, (_tokenizer(path) if tokenizer else None)
