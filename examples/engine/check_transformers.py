#!/usr/bin/env python3
"""examples/engine/check_transformers.py — minikv-engine against Hugging Face transformers on
the real SmolLM2-135M-Instruct (scripts/fetch-model.sh fetches it).

Checks, each failing the script when it does not hold:
  1. tokenizer: the engine's token ids equal transformers' (the fast tokenizer
     minikv.gguf_llama builds from the same GGUF) on text from every novel of the corpus and
     on a string of awkward cases (special tokens, digits, contractions, runs of spaces and
     line breaks, non-Latin scripts, bytes outside the vocabulary); and LLaMA-3's
     pre-tokenizer the same way, through a tokenizer-only GGUF written here with
     tokenizer.ggml.pre = "llama-bpe" (SmolLM2's vocabulary, LLaMA-3's expression and
     ignore_merges, as in LLaMA-3's tokenizer.json);
  2. logits: a prompt of --prompt-tokens tokens of a novel, then --steps greedy decode
     steps, through the engine with a keep-everything 16-bit cache (--kv full: key_bits =
     value_bits = 16, nothing evicted), against transformers' float32 model with its own
     attention and cache: the generated tokens must be equal (greedy text matches) and
     max |logit difference| over every generated position and the whole vocabulary within
     the tolerance of the cache dtype (below).

Tolerances. The engine computes in float32 like the reference; what differs is where Q, K
and V are rounded to the dtype libminikv stores (f16 keeps 11 significant bits) and the
summation order of the BLAS. The f32 run isolates the arithmetic (--f32-tol, default 2e-3
on logits of magnitude ~10-30); the f16 run adds one fp16 rounding of every Q/K/V element
in all 30 layers (--f16-tol, default 0.1: measured 0.02-0.04 on this prompt; an error in
RoPE, the norm or the MLP gives differences of several units).

    scripts/fetch-model.sh
    python3 examples/engine/check_transformers.py --engine build/examples/engine/minikv-engine
"""
from __future__ import annotations

import argparse
import gzip
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bindings", "python"))

from minikv.gguf_llama import _tokenizer, default_model_path, import_gguf, load_gguf_llama  # noqa: E402

CORPUS = os.environ.get("MINIKV_CORPUS") or os.path.join(ROOT, "..", "shared", "data", "corpus")
NOVELS = ["emma", "mansfieldpark", "northangerabbey", "persuasion", "prideprejudice",
          "sensesensibility"]
AWKWARD = ("Hello world!  It's 2024, they'RE here... \t\n\n  x  \u00e9t\u00e9 na\u00efve "
           "\u4f60\u597d\u4e16\u754c 123456 v2.0.1 \u0663\u0664\u0665 <|im_start|>user\nHi"
           "<|im_end|>\n<|im_start|>  a\x04b \x1c\x1c \u2003\u2003z \U0001F600\U0001F600 "
           "'ll 've 'd I'M (parenthesis) --dash-- x=y+1 \r\n\r\n  \n   end   ")
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                  r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def novel(name: str) -> str:
    with gzip.open(os.path.join(CORPUS, f"austen_{name}.txt.gz"), "rt", encoding="utf-8",
                   newline="") as f:
        return f.read()


def engine_ids(engine: str, model: str, text: str, extra=()) -> list[int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
    try:
        out = subprocess.run([engine, "--model", model, "--prompt-file", f.name, "--tokenize",
                              "--raw", *extra], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    return [int(x) for x in out.split()]


def compare_ids(what: str, ref: list[int], got: list[int], decode) -> bool:
    if ref == got:
        print(f"  {what}: {len(ref)} tokens, identical")
        return True
    i = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    print(f"  {what}: DIFFERENT ({len(ref)} reference, {len(got)} engine tokens), first at {i}: "
          f"reference {ref[i:i + 6]} {decode(ref[i:i + 6])!r}, engine {got[i:i + 6]}")
    return False


def llama3_gguf(gguf, source_reader, path: str) -> None:
    """A tokenizer-only GGUF: SmolLM2's vocabulary and merges, pre-tokenizer llama-bpe."""
    w = gguf.GGUFWriter(path, "llama")
    fields = source_reader.fields
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(list(fields["tokenizer.ggml.tokens"].contents()))
    w.add_token_types(list(fields["tokenizer.ggml.token_type"].contents()))
    w.add_token_merges(list(fields["tokenizer.ggml.merges"].contents()))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama3_reference(reader):
    """transformers' tokenizer with LLaMA-3's pre-tokenizer over SmolLM2's vocabulary."""
    from tokenizers import Regex, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = _tokenizer(reader).backend_tokenizer  # a fresh one: this one is changed
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    backend.model.ignore_merges = True
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def check_tokenizer(args, tokenizer) -> bool:
    print("tokenizer: engine vs transformers")
    ok = True
    texts = [("awkward cases", AWKWARD)]
    for name in NOVELS:
        text = novel(name)
        texts.append((name, text[:args.tokenizer_chars] if args.tokenizer_chars else text))
    for what, text in texts:
        ok &= compare_ids(what, tokenizer.encode(text), engine_ids(args.engine, args.model, text),
                          tokenizer.decode)
    gguf = import_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama3-tokenizer.gguf")
        reader = gguf.GGUFReader(args.model)
        llama3_gguf(gguf, reader, path)
        ref = llama3_reference(reader)
        for what, text in texts[:2]:
            ok &= compare_ids(f"{what} (LLaMA-3 pre-tokenizer)", ref.encode(text),
                              engine_ids(args.engine, path, text), ref.decode)
    return ok


def prompt_tokens(tokenizer, n: int) -> str:
    """Text of a novel's paragraphs (reflowed) that tokenizes to at least n tokens, cut at n."""
    paras = [re.sub(r"\s*\n\s*", " ", p).strip() for p in re.split(r"\n\s*\n", novel("persuasion"))]
    text = "\n\n".join(p for p in paras[40:] if p)
    ids = tokenizer.encode(text[: 8 * n])
    if len(ids) < n:
        raise SystemExit(f"the prompt text has only {len(ids)} tokens")
    return tokenizer.decode(ids[:n])


def reference_greedy(model, ids: list[int], steps: int):
    """Greedy tokens and float32 logits of transformers' model with its own cache."""
    import torch
    import transformers

    cache = transformers.DynamicCache(config=model.config)
    x = torch.tensor([ids])
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
            row = out.logits[0, -1].float()
            logits.append(row.numpy().copy())
            x = row.argmax().reshape(1, 1)
            tokens.append(int(x))
    return tokens, np.stack(logits)


def check_logits(args, model, tokenizer) -> bool:
    text = prompt_tokens(tokenizer, args.prompt_tokens)
    ids = tokenizer.encode(text)
    print(f"logits: {len(ids)}-token prompt + {args.steps} greedy tokens, --kv full")
    t0 = time.time()
    ref_tokens, ref_logits = reference_greedy(model, ids, args.steps)
    print(f"  transformers (float32, CPU): {time.time() - t0:.1f} s")
    ok = True
    for dtype, tol in (("f32", args.f32_tol), ("f16", args.f16_tol)):
        with tempfile.TemporaryDirectory() as tmp:
            prompt_file, logits_file = os.path.join(tmp, "prompt.txt"), os.path.join(tmp, "logits.f32")
            with open(prompt_file, "wb") as f:
                f.write(text.encode("utf-8"))
            t0 = time.time()
            run = subprocess.run([args.engine, "--model", args.model, "--prompt-file", prompt_file,
                                  "--raw", "-n", str(args.steps), "--kv", "full", "--dtype", dtype,
                                  "--backend", args.backend, "--ids", "--quiet",
                                  "--dump-logits", logits_file],
                                 capture_output=True, text=True)
            if run.returncode != 0:
                print(f"  engine --dtype {dtype} failed ({run.returncode}): {run.stderr.strip()}")
                ok = False
                continue
            tokens = [int(x) for x in run.stdout.split()]
            logits = np.fromfile(logits_file, dtype=np.float32).reshape(len(tokens), -1)
        seconds = time.time() - t0
        same = tokens == ref_tokens[:len(tokens)] and len(tokens) == len(ref_tokens)
        n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        n = min(n, len(ref_tokens))  # positions with the same context on both sides
        diff = np.abs(logits[:n] - ref_logits[:n])
        worst = float(diff.max()) if n else float("inf")
        step = int(diff.max(axis=1).argmax()) if n else -1
        good = same and bool(np.isfinite(logits).all()) and worst <= tol
        print(f"  engine --backend {args.backend} --dtype {dtype}: {seconds:.1f} s; greedy tokens "
              f"{'identical' if same else f'DIFFER from position {n}'}; max |dlogit| {worst:.2e} "
              f"(at generated token {step}; tolerance {tol:g}); mean |dlogit| "
              f"{float(diff.mean()) if n else float('nan'):.2e} -> {'ok' if good else 'FAIL'}")
        if not same:
            top2 = np.sort(ref_logits[n])[-2:] if n < len(ref_logits) else None
            print(f"    reference top-2 logit margin at {n}: "
                  f"{float(top2[1] - top2[0]) if top2 is not None else float('nan'):.3g}")
        ok &= good
    print(f"  greedy text: {tokenizer.decode(ref_tokens)!r}")
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", required=True, help="the minikv-engine binary")
    p.add_argument("--model", default=default_model_path(), help="SmolLM2 GGUF (fetch-model.sh)")
    p.add_argument("--backend", default="cpu", help="the engine's --backend (cpu)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=64, help="generated tokens (64)")
    p.add_argument("--tokenizer-chars", type=int, default=200000,
                   help="characters of each novel to tokenize (0 = whole novels)")
    p.add_argument("--f32-tol", type=float, default=2e-3)
    p.add_argument("--f16-tol", type=float, default=0.1)
    p.add_argument("--skip-tokenizer", action="store_true")
    args = p.parse_args()

    model, tokenizer = load_gguf_llama(args.model)
    ok = True
    if not args.skip_tokenizer:
        ok &= check_tokenizer(args, tokenizer)
    ok &= check_logits(args, model, tokenizer)
    print("check_transformers: " + ("all passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
