"""minikv.hf: a transformers LLaMA model with its KV cache in libminikv, against the same
model's own attention (eager, DynamicCache). A tiny randomly initialized LlamaConfig; the
CPU backend (the CUDA test runs only where a GPU is visible). Skipped without torch or
transformers 5.x."""
import math

import numpy as np
import pytest

import minikv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.0")
import minikv.hf as hf  # noqa: E402  (needs torch)

VOCAB = 128
# Keep every token, unquantized: the adapter must then compute exactly the model's attention.
LOSSLESS = dict(key_bits=16, value_bits=16, heavy_ratio=1.0, recent_ratio=0.0, group_size=16,
                residual_length=16)
ATOL = {torch.float32: 2e-5}


def tiny_llama(num_kv_heads=2, dtype=torch.float32, seed=0, layers=2, device="cpu"):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=layers, num_attention_heads=4,
                                   num_key_value_heads=num_kv_heads, head_dim=16,
                                   max_position_embeddings=512, rms_norm_eps=1e-6)
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    # A wider init than the default 0.02 so that attention is far from uniform and the
    # logits far from equal: a wrong cache or position then shows.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    return model.to(device=device, dtype=dtype)


class Reference:
    """The model's own path: eager attention over a transformers DynamicCache."""

    def __init__(self, model):
        self.model = model
        self.cache = transformers.DynamicCache(config=model.config)

    def prefill(self, ids):
        with torch.no_grad():
            return self.model(torch.as_tensor(ids)[None], cache=self.cache, use_cache=True).logits[0]

    def step(self, tok):
        with torch.no_grad():
            return self.model(torch.tensor([[int(tok)]], device=self.model.device),
                              cache=self.cache, use_cache=True).logits[0, -1]


def randint(rng, n):
    return [int(x) for x in rng.integers(0, VOCAB, n)]


def assert_close(got, want, atol, what):
    got, want = got.double(), want.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite logits"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: max |adapter - model| = {err:.3g} > {atol:.3g}"


# ---- exactness with a keep-everything, 16-bit cache ----------------------------------------
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])  # MHA, GQA 2:1, GQA 4:1 (MQA)
def test_lossless_prefill_and_teacher_forcing(rng, num_kv_heads):
    model = tiny_llama(num_kv_heads)
    prompt = randint(rng, 37)
    forced = randint(rng, 45)  # 37 + 45 tokens with residual 16: several flushes
    ref = Reference(model)
    with hf.MiniKVGenerator(model, max_seq_len=128, **LOSSLESS) as gen:
        assert gen.cache.config.num_kv_heads == num_kv_heads and gen.cache.backend == minikv.Backend.CPU
        got = gen.prefill(prompt, all_logits=True)[0]
        assert got.shape == (37, VOCAB)
        assert_close(got, ref.prefill(prompt), ATOL[torch.float32], "prefill, every position")
        for i, tok in enumerate(forced):
            assert_close(gen.step([tok])[0], ref.step(tok), ATOL[torch.float32], f"step {i}")
        assert gen.position(0) == 37 + 45
        for layer in range(2):
            assert tuple(gen.cache.sequence_length(0, layer)) == (82, 82)
        st = gen.memory_stats()
        assert st.tokens_seen == st.tokens_cached == 2 * 82
    assert model.config._attn_implementation == "eager"  # the model is left as it was


def test_greedy_generation_identical(rng):
    model = tiny_llama()
    prompt = randint(rng, 23)
    ref = Reference(model)
    logits, want = ref.prefill(prompt)[-1], []
    for _ in range(48):
        want.append(int(logits.argmax()))
        logits = ref.step(want[-1])
    with hf.MiniKVGenerator(model, max_seq_len=128, **LOSSLESS) as gen:
        got = gen.generate(prompt, max_new_tokens=48)
    assert got == [want]
    assert len(set(want)) > 3  # the model does not just repeat one token


def test_generate_stops_at_eos(rng):
    model = tiny_llama()
    prompt = randint(rng, 10)
    with hf.MiniKVGenerator(model, max_seq_len=64, **LOSSLESS) as gen:
        full = gen.generate(prompt, max_new_tokens=12)[0]
        gen.reset()
        eos = full[5]
        cut = gen.generate(prompt, max_new_tokens=12, eos_token_id=eos)[0]
    assert cut == full[:full.index(eos) + 1]


def test_ragged_batch_matches_each_sequence_alone(rng):
    model = tiny_llama()
    prompts = [randint(rng, n) for n in (30, 17, 5)]
    forced = [randint(rng, 24) for _ in prompts]
    refs = [Reference(model) for _ in prompts]
    atol = ATOL[torch.float32]
    with hf.MiniKVGenerator(model, max_sequences=4, max_seq_len=64, **LOSSLESS) as gen:
        last = gen.prefill([torch.tensor(p) for p in prompts])
        assert gen.active == [0, 1, 2]
        for i, (p, r) in enumerate(zip(prompts, refs)):
            assert_close(last[i], r.prefill(p)[-1], atol, f"prefill of prompt {i}")
        for t in range(24):
            if t % 3 == 2:  # now and then only sequences 2 and 0, in that order
                got = gen.step([forced[2][t], forced[0][t]], seq_ids=[2, 0])
                pairs = [(got[0], 2), (got[1], 0)]
            else:
                got = gen.step([f[t] for f in forced])
                pairs = [(got[i], i) for i in range(3)]
            for row, i in pairs:
                assert_close(row, refs[i].step(forced[i][t]), atol, f"sequence {i}, step {t}")
        assert gen.position(1) == 17 + 16 and gen.position(0) == 30 + 24
        # A released slot takes a new prompt while the others go on.
        gen.reset([1])
        assert gen.active == [0, 2]
        new = randint(rng, 9)
        r_new = Reference(model)
        assert_close(gen.prefill(new)[0], r_new.prefill(new)[-1], atol, "prefill into a freed slot")
        assert gen.active == [0, 2, 1]
        got = gen.step([3, 4, 5])
        for row, (i, r) in zip(got, [(0, refs[0]), (2, refs[2]), (1, r_new)]):
            assert_close(row, r.step({0: 3, 2: 4, 1: 5}[i]), atol, f"after the refill, sequence {i}")


def test_padded_batch_with_attention_mask(rng):
    model = tiny_llama()
    a, b = randint(rng, 12), randint(rng, 7)
    ids = torch.zeros(2, 12, dtype=torch.long)
    mask = torch.zeros(2, 12, dtype=torch.long)
    ids[0], mask[0] = torch.tensor(a), 1
    ids[1, 5:], mask[1, 5:] = torch.tensor(b), 1  # left padding
    with hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=64, **LOSSLESS) as gen:
        got = gen.prefill(ids, attention_mask=mask)
    for row, p in zip(got, (a, b)):
        assert_close(row, Reference(model).prefill(p)[-1], ATOL[torch.float32], "padded prompt")


def test_multi_token_step_equals_single_steps(rng):
    model = tiny_llama()
    prompts = [randint(rng, 20), randint(rng, 11)]
    chunk = [randint(rng, 21), randint(rng, 21)]
    with hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=64, **LOSSLESS) as one, \
            hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=64, **LOSSLESS) as many:
        one.prefill(prompts)
        many.prefill(prompts)
        want = torch.stack([one.step([chunk[0][t], chunk[1][t]]) for t in range(21)], dim=1)
        got = many.step(chunk)
        assert got.shape == (2, 21, VOCAB)
        assert_close(got, want, 1e-5, "21 tokens in one step vs 21 steps")
        assert many.position(1) == 11 + 21
        assert many.memory_stats() == one.memory_stats()


def test_other_attention_scaling_is_folded_into_the_query(rng):
    model = tiny_llama()
    for layer in model.model.layers:
        layer.self_attn.scaling = 0.4  # not 1/sqrt(16)
    prompt, forced = randint(rng, 19), randint(rng, 20)
    ref = Reference(model)
    with hf.MiniKVGenerator(model, max_seq_len=64, **LOSSLESS) as gen:
        assert_close(gen.prefill(prompt)[0], ref.prefill(prompt)[-1], ATOL[torch.float32], "prefill")
        for tok in forced:
            assert_close(gen.step([tok])[0], ref.step(tok), ATOL[torch.float32], "step")


# ---- 16-bit model dtypes ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_models(rng, dtype):
    """The adapter in fp16/bf16 is as close to the float32 model as the model's own
    fp16/bf16 eager path is (flash-attn's test budget: 2x the low-precision error + atol)."""
    model32 = tiny_llama(dtype=torch.float32)
    model = tiny_llama(dtype=dtype)
    prompt, forced = randint(rng, 40), randint(rng, 36)
    ref32, ref = Reference(model32), Reference(model)
    with hf.MiniKVGenerator(model, max_seq_len=128, **LOSSLESS) as gen:
        assert gen.cache.dtype == {torch.float16: minikv.DType.F16,
                                   torch.bfloat16: minikv.DType.BF16}[dtype]
        pairs = [(gen.prefill(prompt)[0], ref.prefill(prompt)[-1], ref32.prefill(prompt)[-1])]
        for tok in forced:
            pairs.append((gen.step([tok])[0], ref.step(tok), ref32.step(tok)))
    atol = 0.02 if dtype == torch.float16 else 0.1
    for i, (got, low, exact) in enumerate(pairs):
        assert got.dtype == dtype and torch.isfinite(got).all()
        budget = 2 * (low.double() - exact.double()).abs().max().item() + atol
        err = (got.double() - exact.double()).abs().max().item()
        assert err <= budget, f"position {i}: |adapter - fp32 model| = {err:.3g} > {budget:.3g}"


# ---- compression with a preset ---------------------------------------------------------------
def test_paper_preset_generates_and_compresses(rng):
    model = tiny_llama(dtype=torch.float16, layers=3)
    prompt = randint(rng, 300)
    # The paper's quantization with uniform budgets (every layer keeps half its prompt).
    with hf.MiniKVGenerator(model, max_seq_len=512, preset="paper", budget_policy="uniform") as gen:
        c = gen.cache.config
        assert (c.key_bits, c.value_bits, c.group_size, c.residual_length) == (2, 2, 16, 128)
        assert c.sink_tokens == 0
        out = gen.generate(prompt, max_new_tokens=40)[0]
        assert len(out) == 40 and all(0 <= t < VOCAB for t in out)
        st = gen.memory_stats()
        seen = 3 * (300 + 39)  # the last generated token is not fed back
        assert st.tokens_seen == seen
        # 50% budget: 150 prompt tokens kept per layer, plus the 39 generated ones.
        assert st.tokens_cached == 3 * (150 + 39)
        assert st.compression_ratio > 0.75, st
        assert tuple(gen.cache.sequence_length(0, 2)) == (339, 189)
        # Heavy hitters (ascending positions) plus the recent window [225, 300).
        kept = gen.cache.kept_positions(0, 1, 0)
        assert len(kept) == 150 and (np.diff(kept) > 0).all()
        assert (kept[-75:] == np.arange(225, 300)).all()


def test_pyramid_budget_keeps_more_in_lower_layers(rng):
    model = tiny_llama(layers=3)
    prompt = randint(rng, 200)
    with hf.MiniKVGenerator(model, max_seq_len=256, preset=minikv.Preset.PAPER) as gen:
        gen.prefill(prompt)
        cached = [gen.cache.sequence_length(0, layer).cached for layer in range(3)]
    assert cached[0] > cached[1] > cached[2]
    assert abs(sum(cached) / 3 - 100) <= 2  # mean budget h + r = 50%


# ---- misuse -----------------------------------------------------------------------------
def test_errors(rng):
    model = tiny_llama()
    with hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=32, **LOSSLESS) as gen:
        with pytest.raises(minikv.MinikvError, match="not prefilled") as e:
            gen.step([1], seq_ids=[0])
        assert e.value.status == minikv.Status.BAD_STATE
        gen.prefill(randint(rng, 5))
        with pytest.raises(minikv.MinikvError, match="reset") as e:
            gen.prefill(randint(rng, 5), seq_ids=[0])
        assert e.value.status == minikv.Status.BAD_STATE
        with pytest.raises(minikv.MinikvError, match="free sequence slots") as e:
            gen.prefill([randint(rng, 3), randint(rng, 3)])
        assert e.value.status == minikv.Status.CAPACITY_EXCEEDED
        with pytest.raises(ValueError, match="2 rows of tokens for 1 sequences"):
            gen.step([1, 2])
        with pytest.raises(minikv.MinikvError, match="max_seq_len") as e:
            gen.step([randint(rng, 28)])  # 5 + 28 > 32, refused before any layer takes a token
        assert e.value.status == minikv.Status.CAPACITY_EXCEEDED
        assert gen.position(0) == 5 and tuple(gen.cache.sequence_length(0, 1)) == (5, 5)
        gen.step([randint(rng, 27)])  # exactly max_seq_len
        assert gen.position(0) == 32
        with pytest.raises(TypeError, match="comes from the model"):
            hf.MiniKVGenerator(model, head_dim=32)
    # A full block pool part-way through the layers: the prefill is undone, the slot freed.
    with hf.MiniKVGenerator(model, max_seq_len=64, max_tokens=48, **LOSSLESS) as gen:
        with pytest.raises(minikv.MinikvError) as e:
            gen.prefill(randint(rng, 40))
        assert e.value.status == minikv.Status.CAPACITY_EXCEEDED
        assert gen.active == [] and gen.memory_stats().tokens_seen == 0
        gen.prefill(randint(rng, 10))
        assert gen.memory_stats().tokens_seen == 20
    # The registered implementation outside a generator call explains itself.
    hf.register()
    model.config._attn_implementation = hf.ATTN_IMPLEMENTATION
    try:
        with pytest.raises(RuntimeError, match="only inside MiniKVGenerator"):
            with torch.no_grad():
                model(torch.tensor([[1, 2, 3]]))
    finally:
        model.config._attn_implementation = "eager"


# ---- CUDA -----------------------------------------------------------------------------------
def test_cuda_backend_matches_the_model(rng):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = tiny_llama(dtype=torch.float16, device="cuda")
    model32 = tiny_llama(dtype=torch.float32, device="cuda")
    prompt, forced = randint(rng, 70), randint(rng, 40)
    ref, ref32 = Reference(model), Reference(model32)
    try:
        gen = hf.MiniKVGenerator(model, max_seq_len=128, **LOSSLESS)
    except minikv.MinikvError as e:
        if e.status == minikv.Status.UNSUPPORTED:
            pytest.skip(f"this libminikv has no CUDA backend: {e}")
        raise
    with gen:
        assert gen.cache.backend == minikv.Backend.CUDA
        pairs = [(gen.prefill(prompt)[0], ref.prefill(prompt)[-1], ref32.prefill(prompt)[-1])]
        for tok in forced:
            pairs.append((gen.step([tok])[0], ref.step(tok), ref32.step(tok)))
    for i, (got, low, exact) in enumerate(pairs):
        budget = 2 * (low.double() - exact.double()).abs().max().item() + 0.02
        err = (got.double() - exact.double()).abs().max().item()
        assert err <= budget, f"position {i}: |adapter - fp32 model| = {err:.3g} > {budget:.3g}"
    assert not math.isnan(err)


# ---- the GGUF loader (minikv.gguf_llama) on a tiny GGUF written here ---------------------------
def _gguf_or_skip():
    from minikv import gguf_llama
    try:
        return gguf_llama, gguf_llama.import_gguf()
    except ImportError as e:
        pytest.skip(str(e))


def _byte_unicode():
    """GPT-2's byte -> printable-character table (what byte-level BPE vocabularies use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _llama_cpp_permute(w, n_head):
    """llama.cpp convert_hf_to_gguf.py's permute() of a Q/K projection (HF -> GGUF)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _write_tiny_gguf(path, model, gguf, tokens, merges):
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges([" ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    names = {"embed_tokens": "token_embd", "norm": "output_norm", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
             "v_proj": "attn_v", "o_proj": "attn_output", "gate_proj": "ffn_gate",
             "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        parts = name.split(".")
        if name == "lm_head.weight":
            out = "output.weight"
        elif parts[1] == "layers":
            out = f"blk.{parts[2]}.{names[parts[-2]]}.weight"
            if parts[-2] == "q_proj":
                a = _llama_cpp_permute(a, cfg.num_attention_heads)
            elif parts[-2] == "k_proj":
                a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        else:
            out = f"{names[parts[1]]}.weight"
        w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loader_rebuilds_the_model(tmp_path):
    gguf_llama, gguf = _gguf_or_skip()
    byte = _byte_unicode()
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [byte[b] for b in range(256)]
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "c"), ("a", "t"), ("Ġc", "at")]
    tokens += ["".join(m) for m in merges]
    torch.manual_seed(1)
    cfg = transformers.LlamaConfig(vocab_size=len(tokens), hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
                                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    cfg._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, gguf, tokens, merges)

    loaded, tok = gguf_llama.load_gguf_llama(str(path))
    assert loaded.config.num_key_value_heads == 2 and not loaded.config.tie_word_embeddings
    sd, want = loaded.state_dict(), model.state_dict()
    for name in want:
        assert torch.equal(sd[name], want[name]), name  # Q/K un-permuted exactly
    text = "<|im_start|>the cat 12345<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ids[0] == 1 and ids[-1] == 2  # control tokens matched whole
    assert tokens.index("Ġcat") in ids and tokens.index("he") in ids
    digits = [tokens[i] for i in ids if tokens[i].strip("Ġ").isdigit()]
    assert digits == ["1", "2", "3", "4", "5"]  # one token per digit (SmolLM's pre-tokenizer)
    x = torch.tensor([ids * 3])
    with torch.no_grad():
        assert_close(loaded(x).logits, model(x).logits, 1e-4, "loaded vs original model")
    # And the loaded model through libminikv, lossless.
    with hf.MiniKVGenerator(loaded, max_seq_len=64, **LOSSLESS) as gen:
        got = gen.prefill(x[0], all_logits=True)[0]
    with torch.no_grad():
        assert_close(got, model(x).logits[0], 1e-4, "loaded model through libminikv")

    # Without the un-permutation the attention is wrong although every shape fits.
    real = gguf_llama.unpermute_qk
    try:
        gguf_llama.unpermute_qk = lambda w, n: w
        broken, _ = gguf_llama.load_gguf_llama(str(path), tokenizer=False)
    finally:
        gguf_llama.unpermute_qk = real
    with torch.no_grad():
        assert (broken(x).logits - model(x).logits).abs().max() > 1e-2
