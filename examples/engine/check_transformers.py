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
     attention and cache: max |logit difference| over every generated position and the
     whole vocabulary within the tolerance of the dtype (below), and the same greedy text
     (the tokens may part only at a near-tie: where the reference's logits of the two
     tokens differ by at most twice the tolerance);
  3. continuous batching: three prompts with budgets 12, 24, 20 in two slots (the third
     joins when the first leaves, the second still running) give each prompt the tokens
     and logits (same tolerance) it gets when run alone.

Tolerances. On the CPU the engine computes in float32 like the reference; what differs is
where Q, K and V are rounded to the dtype libminikv stores and the BLAS's summation order.
The f32 run isolates the arithmetic (--f32-tol, default 2e-3 on logits of magnitude 10-30;
measured 1.4e-4); the f16 run adds one fp16 rounding of every Q/K/V element in all 30
layers (--f16-tol, default 0.06; measured 0.024; a wrong RoPE, norm or MLP gives errors of
several units). With --backend cuda the engine runs in f16 and bf16 (weights and
activations), and each tolerance is derived on the same GPU: twice the distance of
transformers' own model in that dtype from its float32 model, plus 0.02 (the rule of
flash-attention's tests).

    scripts/fetch-model.sh
    python3 examples/engine/check_transformers.py --engine build/examples/engine/minikv-engine
"""
from __future__ import annotations

import argparse
import copy
import gzip
import inspect
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


def texts() -> list[tuple[str, str]]:
    """(name, text) of the corpus's novels, or of the repository's README.md where the
    corpus is not at hand (a GPU machine)."""
    if os.path.isdir(CORPUS):
        return [(name, novel(name)) for name in NOVELS]
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8", newline="") as f:
        return [("README.md", f.read())]


# ---- a synthetic model, for machines the real one cannot reach ---------------------------
def byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra, out = 256, []
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(extra))
            extra += 1
    return out


def train_bpe(text: str, n_merges: int):
    """Byte-level BPE merges learned greedily from `text` (GPT-2-like word split)."""
    alphabet = byte_alphabet()
    words: dict[tuple, int] = {}
    for w in re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[^\W\d_]+| ?\d+| ?[^\s\w]+|\s+", text):
        key = tuple(alphabet[b] for b in w.encode("utf-8"))
        words[key] = words.get(key, 0) + 1
    merges = []
    for _ in range(n_merges):
        pairs: dict[tuple, int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], p))
        merges.append(best)
        merged = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + c
        words = merged
    return alphabet, merges


def synthetic_gguf(path: str, text: str, seed: int = 0) -> None:
    """A small random LLaMA in GGUF (4 layers, width 512, GQA 8/2 heads of 64, FFN 1024,
    F16 matrices, F32 norms) with a byte-level BPE tokenizer of 400 merges learned from
    `text`: a stand-in for SmolLM2 where its file can not travel (one GPU machine takes 64
    MiB of files). Logits have a spread of a few units, like a trained model's."""
    gguf = import_gguf()
    rng = np.random.default_rng(seed)
    alphabet, merges = train_bpe(text[:200000], 400)
    tokens = alphabet + [a + b for a, b in merges] + ["<|endoftext|>"]
    types = [1] * (len(tokens) - 1) + [3]
    V, d, H, Hkv, D, ff, layers = len(tokens), 512, 8, 2, 64, 1024, 4

    def mat(rows, cols, scale=1.0):
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float16)

    def norm():
        return (1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("synthetic llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(H)
    w.add_head_count_kv(Hkv)
    w.add_rope_dimension_count(D)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{a} {b}" for a, b in merges])
    w.add_eos_token_id(V - 1)
    w.add_tensor("token_embd.weight", mat(V, d, np.sqrt(d)))
    w.add_tensor("output_norm.weight", norm())
    w.add_tensor("output.weight", mat(V, d, 3.0))
    for l in range(layers):
        w.add_tensor(f"blk.{l}.attn_norm.weight", norm())
        w.add_tensor(f"blk.{l}.attn_q.weight", mat(H * D, d))
        w.add_tensor(f"blk.{l}.attn_k.weight", mat(Hkv * D, d))
        w.add_tensor(f"blk.{l}.attn_v.weight", mat(Hkv * D, d))
        w.add_tensor(f"blk.{l}.attn_output.weight", mat(d, H * D))
        w.add_tensor(f"blk.{l}.ffn_norm.weight", norm())
        w.add_tensor(f"blk.{l}.ffn_gate.weight", mat(ff, d))
        w.add_tensor(f"blk.{l}.ffn_up.weight", mat(ff, d))
        w.add_tensor(f"blk.{l}.ffn_down.weight", mat(d, ff))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


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
    samples = [("awkward cases", AWKWARD)]
    for name, text in texts():
        samples.append((name, text[:args.tokenizer_chars] if args.tokenizer_chars else text))
    for what, text in samples:
        ok &= compare_ids(what, tokenizer.encode(text), engine_ids(args.engine, args.model, text),
                          tokenizer.decode)
    gguf = import_gguf()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama3-tokenizer.gguf")
        reader = gguf.GGUFReader(args.model)
        llama3_gguf(gguf, reader, path)
        ref = llama3_reference(reader)
        for what, text in samples[:2]:
            ok &= compare_ids(f"{what} (LLaMA-3 pre-tokenizer)", ref.encode(text),
                              engine_ids(args.engine, path, text), ref.decode)
    return ok


def prompt_tokens(tokenizer, n: int) -> str:
    """Text of paragraphs (reflowed) of a novel (or the README) that tokenizes to at least
    n tokens, cut at n."""
    source = dict(texts()).get("persuasion") or texts()[0][1]
    paras = [re.sub(r"\s*\n\s*", " ", p).strip() for p in re.split(r"\n\s*\n", source)]
    text = "\n\n".join(p for p in paras[40:] if p)
    ids = tokenizer.encode(text[: 8 * n])
    if len(ids) < n:
        raise SystemExit(f"the prompt text has only {len(ids)} tokens")
    return tokenizer.decode(ids[:n])


def reference_greedy(model, ids: list[int], steps: int):
    """Greedy tokens and float32 logits of transformers' model with its own cache."""
    import torch
    import transformers

    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = transformers.DynamicCache(config=model.config)
    x = torch.tensor([ids], device=model.device)
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(steps):
            out = model(input_ids=x, use_cache=True, logits_to_keep=1, **{kw: cache})
            row = out.logits[0, -1].float()
            logits.append(row.cpu().numpy().copy())
            x = row.argmax().reshape(1, 1)
            tokens.append(int(x))
    return tokens, np.stack(logits)


def reference_forced(model, ids: list[int], tokens: list[int]):
    """Logits of the same positions as reference_greedy, teacher-forced on `tokens` in one
    forward pass (for the reference in a 16-bit dtype: same contexts as the float32 one)."""
    import torch

    x = torch.tensor([ids + tokens[:-1]], device=model.device)
    with torch.no_grad():
        return model(input_ids=x, logits_to_keep=len(tokens)).logits[0].float().cpu().numpy()


def compare(what: str, tokens, logits, ref_tokens, ref_logits, tol: float) -> bool:
    """Engine vs reference over the positions with the same context on both sides. The
    greedy tokens may part only where the reference itself can not tell them apart within
    the tolerance: at the first difference, the reference's logits of its token and of the
    engine's token differ by at most 2 tol (logits within tol can swap such a pair)."""
    n = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), min(len(tokens), len(ref_tokens)))
    same = tokens == ref_tokens
    compared = min(n + 1, len(tokens), len(ref_tokens))  # the first differing step still shares its context
    diff = np.abs(logits[:compared] - ref_logits[:compared])
    worst = float(diff.max()) if compared else float("inf")
    step = int(diff.max(axis=1).argmax()) if compared else -1
    good = bool(np.isfinite(logits).all()) and worst <= tol and len(tokens) == len(ref_tokens)
    note = "identical"
    if not same and n < len(tokens) and n < len(ref_tokens):
        margin = float(ref_logits[n][ref_tokens[n]] - ref_logits[n][tokens[n]])
        tie = margin <= 2 * tol
        note = (f"part at generated token {n} where the reference's margin is {margin:.3g} "
                f"({'a near-tie: allowed' if tie else 'MORE than 2 x tolerance'})")
        good &= tie
    elif not same:
        note = f"DIFFER in length ({len(tokens)} vs {len(ref_tokens)})"
    print(f"  {what}: greedy tokens {note}; max |dlogit| {worst:.2e} over {compared} tokens (at {step}; "
          f"tolerance {tol:.3g}), mean {float(diff.mean()) if compared else float('nan'):.2e} -> "
          f"{'ok' if good else 'FAIL'}")
    return good


def run_engine(args, prompt_files, n_new, dtype, logits_path, extra=()):
    """Runs the engine greedily; returns (tokens per prompt, logits per prompt)."""
    cmd = [args.engine, "--model", args.model, "--raw", "-n", ",".join(map(str, n_new)), "--kv", "full",
           "--dtype", dtype, "--backend", args.backend, "--ids", "--quiet", "--dump-logits", logits_path, *extra]
    for f in prompt_files:
        cmd += ["--prompt-file", f]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"engine failed ({run.returncode}): {run.stderr.strip()}")
    if len(prompt_files) == 1:
        tokens = [[int(x) for x in run.stdout.split()]]
        paths = [logits_path]
    else:
        tokens = [[int(x) for x in part.split("\n", 1)[1].split()] for part in run.stdout.split("=== prompt ")[1:]]
        paths = [f"{logits_path}.{i}" for i in range(len(prompt_files))]
    logits = [np.fromfile(p, dtype=np.float32).reshape(len(t), -1) for p, t in zip(paths, tokens)]
    return tokens, logits


def dtypes_and_tolerances(args, model32, ids, ref_tokens, ref_logits):
    """(dtype, tolerance) per engine run. CPU: float32 and float16 caches, fixed tolerances
    (module docstring). CUDA: float16 and bfloat16 everywhere; each tolerance is twice
    transformers' own distance from float32 in that dtype on the same GPU, plus 0.02."""
    if args.backend == "cpu":
        return [("f32", args.f32_tol), ("f16", args.f16_tol)]
    import torch

    out = []
    for name, dt in (("f16", torch.float16), ("bf16", torch.bfloat16)):
        model = copy.deepcopy(model32).to(dtype=dt)  # .to() converts in place: keep the float32 one
        own = float(np.abs(reference_forced(model, ids, ref_tokens) - ref_logits).max())
        del model
        out.append((name, 2 * own + 0.02))
        print(f"  transformers in {name} on {model32.device}: max |dlogit| {own:.3g} from float32 "
              f"-> engine tolerance {2 * own + 0.02:.3g}")
    return out


def check_logits(args, model, tokenizer):
    """Returns (ok, {dtype: tolerance})."""
    text = prompt_tokens(tokenizer, args.prompt_tokens)
    ids = tokenizer.encode(text)
    print(f"logits: {len(ids)}-token prompt + {args.steps} greedy tokens, --kv full, --backend {args.backend}")
    t0 = time.time()
    ref_tokens, ref_logits = reference_greedy(model, ids, args.steps)
    print(f"  transformers (float32, {model.device}): {time.time() - t0:.1f} s; greedy text "
          f"{tokenizer.decode(ref_tokens)!r}")
    ok = True
    tolerances = dtypes_and_tolerances(args, model, ids, ref_tokens, ref_logits)
    with tempfile.TemporaryDirectory() as tmp:
        prompt_file = os.path.join(tmp, "prompt.txt")
        with open(prompt_file, "wb") as f:
            f.write(text.encode("utf-8"))
        for dtype, tol in tolerances:
            t0 = time.time()
            try:
                (tokens,), (logits,) = run_engine(args, [prompt_file], [args.steps], dtype, os.path.join(tmp, "l"))
            except RuntimeError as e:
                print(f"  engine --dtype {dtype}: {e}")
                ok = False
                continue
            ok &= compare(f"engine --dtype {dtype} ({time.time() - t0:.1f} s)", tokens, logits, ref_tokens,
                          ref_logits, tol)
    return ok, dict(tolerances)


def check_batching(args, tokenizer, tolerances) -> bool:
    """Continuous batching: three prompts with different budgets in two slots (the third
    joins when the first leaves, while the second still runs) give each prompt the tokens
    and logits it gets alone."""
    text = prompt_tokens(tokenizer, 400)
    ids = tokenizer.encode(text)
    cuts = [(0, 90), (90, 150), (150, 310)]
    budgets = [12, 24, 20]
    dtype = "f32" if args.backend == "cpu" else "f16"
    tol = tolerances[dtype]
    print(f"continuous batching: prompts of {[b - a for a, b in cuts]} tokens, budgets {budgets}, 2 slots, "
          f"--dtype {dtype}, each against its own run alone")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        files = []
        for i, (a, b) in enumerate(cuts):
            files.append(os.path.join(tmp, f"p{i}.txt"))
            with open(files[-1], "wb") as f:
                f.write(tokenizer.decode(ids[a:b]).encode("utf-8"))
        try:
            together, together_logits = run_engine(args, files, budgets, dtype, os.path.join(tmp, "b"),
                                                   ["--batch", "2"])
            for i, f in enumerate(files):
                (alone,), (alone_logits,) = run_engine(args, [f], [budgets[i]], dtype, os.path.join(tmp, f"s{i}"))
                ok &= compare(f"prompt {i} batched vs alone", together[i], together_logits[i], alone,
                              alone_logits, tol)
        except RuntimeError as e:
            print(f"  {e}")
            ok = False
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", help="the minikv-engine binary (required unless --write-synthetic)")
    p.add_argument("--model", default=default_model_path(), help="SmolLM2 GGUF (fetch-model.sh)")
    p.add_argument("--backend", default="cpu", help="the engine's --backend (cpu)")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=64, help="generated tokens (64)")
    p.add_argument("--tokenizer-chars", type=int, default=200000,
                   help="characters of each novel to tokenize (0 = whole novels)")
    p.add_argument("--f32-tol", type=float, default=2e-3)
    p.add_argument("--f16-tol", type=float, default=0.06,
                   help="CPU f16 runs (--backend cuda derives its tolerances instead)")
    p.add_argument("--skip-tokenizer", action="store_true")
    p.add_argument("--synthetic", action="store_true",
                   help="check on a small random LLaMA written here (F16 GGUF, a BPE tokenizer "
                        "learned from the text) instead of --model")
    p.add_argument("--write-synthetic", metavar="PATH",
                   help="only write that synthetic model to PATH (for compare_runs.py where the "
                        "real model cannot travel) and exit")
    args = p.parse_args()
    if args.write_synthetic:
        synthetic_gguf(args.write_synthetic, texts()[0][1])
        print(f"wrote {args.write_synthetic} ({os.path.getsize(args.write_synthetic) / 1e6:.1f} MB)")
        return 0
    if not args.engine:
        p.error("the following arguments are required: --engine")
    if args.synthetic:
        tmp = tempfile.mkdtemp(prefix="minikv-engine-check-")
        args.model = os.path.join(tmp, "synthetic-llama.gguf")
        synthetic_gguf(args.model, texts()[0][1])
        print(f"synthetic model: {args.model} ({os.path.getsize(args.model) / 1e6:.1f} MB)")

    device = "cpu"
    if args.backend == "cuda":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tokenizer = load_gguf_llama(args.model, device=device)
    ok = True
    if not args.skip_tokenizer:
        ok &= check_tokenizer(args, tokenizer)
    logits_ok, tolerances = check_logits(args, model, tokenizer)
    ok &= logits_ok
    ok &= check_batching(args, tokenizer, tolerances)
    print("check_transformers: " + ("all passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
