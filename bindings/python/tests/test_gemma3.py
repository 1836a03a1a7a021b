"""Gemma 3 through minikv.hf: the sliding-window layers the adapter keeps itself
(SlidingWindowKV), the routing of layers between it and libminikv, the gemma3 GGUF loader
(minikv.gguf_gemma3) on a tiny random model written as a GGUF, and an independent float64
forward written from llama.cpp's gemma3 graph. The real Gemma 3 270M runs only where
`MINIKV_FETCH_GEMMA3=1 scripts/fetch-model.sh` has fetched it. Skipped without torch or
transformers 5.x."""
import math
import os

import numpy as np
import pytest

import minikv

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", minversion="5.0")
import minikv.hf as hf  # noqa: E402  (needs torch)
from minikv import gguf_gemma3  # noqa: E402
from test_hf import Reference  # noqa: E402  (the model's own eager attention + DynamicCache)

VOCAB = 96
WINDOW = 8
LOSSLESS = dict(key_bits=16, value_bits=16, heavy_ratio=1.0, recent_ratio=0.0, group_size=16,
                residual_length=16)


def tiny_gemma3(layers=7, window=WINDOW, seed=0, rope_theta=50000.0):
    """A random Gemma 3 with llama.cpp's layer pattern (layer 5 global, the rest local)."""
    torch.manual_seed(seed)
    cfg = transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        sliding_window=window, query_pre_attn_scalar=32, rms_norm_eps=1e-6,
        layer_types=gguf_gemma3.gemma3_layer_types(layers),
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": rope_theta},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    cfg._attn_implementation = "eager"
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            else:  # RMSNorm weights: Gemma scales by 1 + w, so w near 0 with some spread
                p.normal_(0.0, 0.3)
    return model


def randint(rng, n):
    return [int(x) for x in rng.integers(0, VOCAB, n)]


def assert_close(got, want, atol, what):
    got, want = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert torch.isfinite(got).all(), f"{what}: non-finite values"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: max |got - want| = {err:.3g} > {atol:.3g}"


# ---- SlidingWindowKV against masked float64 attention ---------------------------------------
def window_attention(q, k, v, qpos, kpos, window, scale):
    """float64 reference: q [t, H, D] at positions qpos attends to k/v [s, Hkv, D] at kpos
    with kpos <= qpos and qpos - kpos < window."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = np.zeros_like(q)
    for h in range(q.shape[1]):
        s = q[:, h] @ k[:, h // rep].T * scale
        ok = (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] - kpos[None, :] < window)
        s = np.where(ok, s, -np.inf)
        p = np.exp(s - s.max(1, keepdims=True))
        out[:, h] = (p / p.sum(1, keepdims=True)) @ v[:, h // rep]
    return out


@pytest.mark.parametrize("heads,kv_heads", [(4, 1), (4, 2), (2, 2)])
def test_sliding_window_kv_prefill_and_steps(rng, monkeypatch, heads, kv_heads):
    # Small prefill blocks: blocks that start inside, at and past the first window.
    monkeypatch.setattr(hf.SlidingWindowKV, "PREFILL_BLOCK", 3)
    d, scale, lengths, steps = 8, 0.3, [13, 5, 8], 11
    kv = hf.SlidingWindowKV(2, 4, kv_heads, d, WINDOW, torch.float32, "cpu")
    slots = [3, 0, 1]
    total = sum(lengths)
    full = {s: [rng.standard_normal((n + steps, h, d)).astype(np.float32)
                for h in (heads, kv_heads, kv_heads)] for s, n in zip(slots, lengths)}
    pq, pk, pv = (torch.from_numpy(np.concatenate([full[s][i][:n] for s, n in zip(slots, lengths)]))
                  for i in range(3))
    cu = hf.cu_seqlens_from_lengths(lengths)
    out = kv.prefill(1, slots, cu, pq, pk, pv, scale)
    assert out.shape == (total, heads, d)
    for i, (s, n) in enumerate(zip(slots, lengths)):
        q, k, v = full[s]
        pos = np.arange(n)
        want = window_attention(q[:n], k[:n], v[:n], pos, pos, WINDOW, scale)
        assert_close(out[cu[i]:cu[i + 1]], want, 2e-5, f"prefill of slot {s}")
    assert kv.tokens() == (total, sum(min(n, WINDOW) for n in lengths))

    # Steps: slot 1 (8 tokens, a full window) and slot 3 take tokens; slot 0 waits.
    for t in range(steps):
        active = [1, 3] if t % 3 else [3, 1]
        n = {s: lengths[slots.index(s)] + t for s in active}
        q = torch.from_numpy(np.stack([full[s][0][n[s]] for s in active]))
        k = torch.from_numpy(np.stack([full[s][1][n[s]] for s in active]))
        v = torch.from_numpy(np.stack([full[s][2][n[s]] for s in active]))
        got = kv.append_attend(1, active, q, k, v, scale)
        for j, s in enumerate(active):
            pos = np.arange(n[s] + 1)
            want = window_attention(full[s][0][n[s]:n[s] + 1], full[s][1][:n[s] + 1],
                                    full[s][2][:n[s] + 1], pos[-1:], pos, WINDOW, scale)
            assert_close(got[j:j + 1], want, 2e-5, f"step {t} of slot {s}")
    assert kv.lengths[1].tolist() == [5, 8 + steps, 0, 13 + steps]
    assert kv.lengths[0].tolist() == [0, 0, 0, 0]  # the other layer is untouched
    assert kv.tokens() == (total + 2 * steps, 3 * WINDOW - 3)


def test_sliding_window_kv_errors(rng):
    kv = hf.SlidingWindowKV(1, 2, 1, 4, WINDOW, torch.float32, "cpu")
    x = torch.zeros(3, 1, 4)
    cu = hf.cu_seqlens_from_lengths([3])
    with pytest.raises(minikv.MinikvError, match="not prefilled") as e:
        kv.append_attend(0, [0], x[:1], x[:1], x[:1], 1.0)
    assert e.value.status == minikv.Status.BAD_STATE
    kv.prefill(0, [0], cu, x, x, x, 1.0)
    with pytest.raises(minikv.MinikvError, match="prefilled already") as e:
        kv.prefill(0, [0], cu, x, x, x, 1.0)
    assert e.value.status == minikv.Status.BAD_STATE
    with pytest.raises(ValueError, match="outside 0..1"):
        kv.prefill(0, [2], cu, x, x, x, 1.0)
    with pytest.raises(ValueError, match="layer 1 of 1"):
        kv.prefill(1, [1], cu, x, x, x, 1.0)
    with pytest.raises(ValueError, match="do not fit 1 KV heads x 4"):
        kv.prefill(0, [1], cu, x, torch.zeros(3, 2, 4), x, 1.0)
    with pytest.raises(ValueError, match="one each"):
        kv.append_attend(0, [0, 0], x[:2], x[:2], x[:2], 1.0)
    assert kv.tokens() == (3, 3)  # the failed calls changed nothing
    kv.release(0)
    assert kv.tokens() == (0, 0)
    kv.prefill(0, [0], cu, x, x, x, 1.0)  # the slot takes a new prompt
    with pytest.raises(ValueError, match="window must be a positive int"):
        hf.SlidingWindowKV(1, 2, 1, 4, 0, torch.float32, "cpu")


# ---- which layer goes where ------------------------------------------------------------------
def test_layer_routes():
    cfg = tiny_gemma3(layers=12).config
    routes, window = hf._layer_routes(cfg)
    assert window == WINDOW
    assert [l for l, (sliding, _) in enumerate(routes) if not sliding] == [5, 11]
    assert routes[5] == (False, 0) and routes[11] == (False, 1)
    assert routes[4] == (True, 4) and routes[6] == (True, 5) and routes[10] == (True, 9)
    llama = transformers.LlamaConfig(num_hidden_layers=3)
    assert hf._layer_routes(llama) == ([(False, 0), (False, 1), (False, 2)], 0)

    cfg.layer_types = ["sliding_attention"] * 12
    with pytest.raises(NotImplementedError, match="every layer is a sliding-window layer"):
        hf._layer_routes(cfg)
    cfg.layer_types = ["chunked_attention"] + ["full_attention"] * 11
    with pytest.raises(NotImplementedError, match="chunked_attention"):
        hf._layer_routes(cfg)
    cfg.layer_types = ["full_attention"] * 12
    cfg.attn_logit_softcapping = 50.0
    with pytest.raises(NotImplementedError, match="softcapped"):
        hf._layer_routes(cfg)


# ---- a tiny Gemma 3 through the adapter, lossless --------------------------------------------
def test_tiny_gemma3_lossless_ragged_batch(rng):
    model = tiny_gemma3()
    prompts = [randint(rng, 19), randint(rng, 5)]  # past and within the window
    forced = [randint(rng, 14) for _ in prompts]
    refs = [Reference(model) for _ in prompts]
    with hf.MiniKVGenerator(model, max_sequences=2, max_seq_len=64, **LOSSLESS) as gen:
        assert gen.cache_layers == [5] and gen.config.num_layers == 1
        assert gen.sliding_window.lengths.shape == (6, 2)
        got = gen.prefill(prompts, all_logits=True)
        for i, (p, ref) in enumerate(zip(prompts, refs)):
            assert_close(got[i], ref.prefill(p), 2e-5, f"prefill of prompt {i}, every position")
        for t in range(14):
            logits = gen.step([f[t] for f in forced])
            for i, ref in enumerate(refs):
                assert_close(logits[i], ref.step(forced[i][t]), 2e-5, f"step {t} of prompt {i}")
        assert tuple(gen.cache.sequence_length(0, 0)) == (33, 33)
        assert gen.sliding_window.tokens() == (6 * (33 + 19), 6 * (WINDOW + WINDOW))
        gen.reset([0])
        assert gen.sliding_window.lengths[:, 0].tolist() == [0] * 6
        # The window is what the model sees: a longer one gives other logits.
        with torch.no_grad():
            model.config.sliding_window = 64
            wide = model(torch.tensor([prompts[0]])).logits[0]
            model.config.sliding_window = WINDOW
        assert (wide[-1] - got[0][-1]).abs().max() > 1e-2


def test_failed_prefill_releases_the_windows(rng):
    model = tiny_gemma3()
    with hf.MiniKVGenerator(model, max_sequences=1, max_seq_len=16, **LOSSLESS) as gen:
        with pytest.raises(minikv.MinikvError):
            gen.prefill(randint(rng, 17))  # past max_seq_len: libminikv's layer 5 refuses it
        assert gen.sliding_window.tokens() == (0, 0) and gen.active == []
        gen.prefill(randint(rng, 12))
        assert gen.sliding_window.tokens() == (6 * 12, 6 * WINDOW)


def test_pyramid_budget_spreads_over_the_global_layers(rng):
    model = tiny_gemma3(layers=18)
    with hf.MiniKVGenerator(model, max_seq_len=256, preset="paper") as gen:
        gen.prefill(randint(rng, 200))
        assert gen.cache_layers == [5, 11, 17]
        cached = [gen.cache.sequence_length(0, layer).cached for layer in range(3)]
        st = gen.memory_stats()
    assert cached[0] > cached[1] > cached[2]
    assert st.tokens_seen == 3 * 200 and abs(sum(cached) / 3 - 100) <= 2


# ---- the gemma3 GGUF loader ------------------------------------------------------------------
GEMMA3_270M_METADATA = {
    "general.architecture": "gemma3", "gemma3.context_length": 32768,
    "gemma3.embedding_length": 640, "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048,
    "gemma3.attention.head_count": 4, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
    "gemma3.attention.key_length": 256, "gemma3.attention.value_length": 256,
    "gemma3.rope.freq_base": 1000000.0, "gemma3.attention.sliding_window": 512,
    "gemma3.attention.head_count_kv": 1, "tokenizer.ggml.tokens": ["t"] * 262144,
    "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
    "tokenizer.ggml.padding_token_id": 0,
}


def fields_of(meta):
    return gguf_gemma3.gemma3_config_fields(lambda key, default: meta.get(key, default))


def test_gemma3_config_fields():
    f = fields_of(GEMMA3_270M_METADATA)
    assert (f["num_hidden_layers"], f["num_attention_heads"], f["num_key_value_heads"],
            f["head_dim"], f["vocab_size"], f["sliding_window"]) == (18, 4, 1, 256, 262144, 512)
    assert [l for l, t in enumerate(f["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert f["rope_parameters"] == {
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert f["query_pre_attn_scalar"] == 256 and "final_logit_softcapping" not in f
    cfg = transformers.Gemma3TextConfig(**f)
    assert cfg.layer_types == f["layer_types"] and cfg.hidden_activation == "gelu_pytorch_tanh"

    big = dict(GEMMA3_270M_METADATA, **{"gemma3.block_count": 62, "gemma3.embedding_length": 5376,
                                        "gemma3.attention.head_count": 32,
                                        "gemma3.rope.scaling.type": "linear",
                                        "gemma3.rope.scaling.factor": 8.0,
                                        "gemma3.final_logit_softcapping": 30.0})
    f = fields_of(big)
    assert f["query_pre_attn_scalar"] == 168  # 27B: hidden / heads, as llama.cpp
    assert f["rope_parameters"]["full_attention"] == {"rope_type": "linear", "rope_theta": 1e6,
                                                      "factor": 8.0}
    assert f["final_logit_softcapping"] == 30.0
    with pytest.raises(ValueError, match="architecture is 'llama'"):
        fields_of(dict(GEMMA3_270M_METADATA, **{"general.architecture": "llama"}))
    with pytest.raises(ValueError, match="no gemma3.attention.sliding_window"):
        fields_of({k: v for k, v in GEMMA3_270M_METADATA.items() if "sliding" not in k})
    with pytest.raises(ValueError, match="rope scaling 'yarn'"):
        fields_of(dict(GEMMA3_270M_METADATA, **{"gemma3.rope.scaling.type": "yarn"}))
    assert gguf_gemma3.gemma3_tensor_name("blk.3.post_ffw_norm.weight") == \
        "model.layers.3.post_feedforward_layernorm.weight"
    with pytest.raises(ValueError, match="unexpected tensor 'blk.0.ffn_gate_exps.weight'"):
        gguf_gemma3.gemma3_tensor_name("blk.0.ffn_gate_exps.weight")


def _gguf_or_skip():
    from minikv import gguf_llama
    try:
        return gguf_llama.import_gguf()
    except ImportError as e:
        pytest.skip(str(e))


_GGUF_NAMES = {v: k for k, v in gguf_gemma3._LAYER_NAMES.items()}


def write_tiny_gemma3_gguf(path, model, gguf):
    """What llama.cpp's converter writes for a Gemma 3: RMSNorm weights as 1 + w."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_parameters["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied to the embedding
        a = t.detach().float().numpy().copy()
        if name.endswith("norm.weight"):
            a += 1.0
        parts = name.split(".")
        if parts[1] == "layers":
            out = f"blk.{parts[2]}.{_GGUF_NAMES['.'.join(parts[3:-1])]}.weight"
        else:
            out = {"model.embed_tokens.weight": "token_embd.weight",
                   "model.norm.weight": "output_norm.weight"}[name]
        w.add_tensor(out, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gemma3_reference_logits(reader, gguf, ids, last=None):
    """Logits of the last `last` positions (all by default) of a gemma3 GGUF in float64,
    written from llama.cpp's graph rather than transformers': the stored norm weights used
    as they are (the converter added the 1), NeoX RoPE (pairs i, i + D/2), base 10000 on the
    sliding-window layers ((l + 1) % 6 != 0), window of `attention.sliding_window` keys,
    scale 1/sqrt(head_dim), tanh-approximated GELU, tied output."""
    def meta(key):
        return reader.fields["gemma3." + key].contents()

    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        t = tensors[name]
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64)
        return w.reshape([int(d) for d in reversed(t.shape.tolist())])

    hidden, heads, kv_heads = meta("embedding_length"), meta("attention.head_count"), \
        meta("attention.head_count_kv")
    d, eps, window = meta("attention.key_length"), meta("attention.layer_norm_rms_epsilon"), \
        meta("attention.sliding_window")
    n = len(ids)
    pos = np.arange(n)

    def rms(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def rope(x, base):
        angle = pos[:, None] * base ** (-np.arange(0, d, 2) / d)[None]
        c, s = np.cos(angle)[:, None], np.sin(angle)[:, None]
        a, b = x[..., :d // 2], x[..., d // 2:]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))

    embed = weight("token_embd.weight")
    x = embed[np.asarray(ids)] * math.sqrt(hidden)
    for layer in range(meta("block_count")):
        p = f"blk.{layer}."
        local = (layer + 1) % 6 != 0
        h = rms(x, weight(p + "attn_norm.weight"))
        q = rms((h @ weight(p + "attn_q.weight").T).reshape(n, heads, d), weight(p + "attn_q_norm.weight"))
        k = rms((h @ weight(p + "attn_k.weight").T).reshape(n, kv_heads, d), weight(p + "attn_k_norm.weight"))
        v = (h @ weight(p + "attn_v.weight").T).reshape(n, kv_heads, d)
        base = 10000.0 if local else meta("rope.freq_base")
        q, k = rope(q, base), rope(k, base)
        attn = window_attention(q, k, v, pos, pos, window if local else n, 1 / math.sqrt(d))
        x = x + rms(attn.reshape(n, heads * d) @ weight(p + "attn_output.weight").T,
                    weight(p + "post_attention_norm.weight"))
        h = rms(x, weight(p + "ffn_norm.weight"))
        m = gelu(h @ weight(p + "ffn_gate.weight").T) * (h @ weight(p + "ffn_up.weight").T)
        x = x + rms(m @ weight(p + "ffn_down.weight").T, weight(p + "post_ffw_norm.weight"))
    x = rms(x[-(last or n):], weight("output_norm.weight"))
    return x @ (weight("output.weight") if "output.weight" in tensors else embed).T


def test_gguf_loader_rebuilds_tiny_gemma3(tmp_path, rng):
    gguf = _gguf_or_skip()
    model = tiny_gemma3(layers=7)
    path = tmp_path / "tiny-gemma3.gguf"
    write_tiny_gemma3_gguf(path, model, gguf)
    loaded, tok = gguf_gemma3.load_gguf_gemma3(str(path), tokenizer=False)
    assert tok is None and loaded.config.tie_word_embeddings
    assert loaded.config.layer_types == model.config.layer_types
    sd, want = loaded.state_dict(), model.state_dict()
    assert set(sd) == set(want)
    for name in want:
        assert_close(sd[name], want[name], 1e-6, name)  # norms: (1 + w) - 1 in float32
    ids = randint(rng, 21)  # past the window of 8
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
        assert_close(loaded(torch.tensor([ids])).logits[0], logits, 1e-4, "loaded vs original")
    reference = gemma3_reference_logits(gguf.GGUFReader(str(path)), gguf, ids)
    assert_close(logits, reference, 1e-4, "transformers' Gemma3 vs the float64 llama.cpp-style forward")


GEMMA3_FILE = gguf_gemma3.default_gemma3_path()


@pytest.mark.skipif(not os.path.isfile(GEMMA3_FILE),
                    reason="Gemma 3 270M not fetched (MINIKV_FETCH_GEMMA3=1 scripts/fetch-model.sh)")
def test_gemma3_270m_matches_the_float64_forward(rng):
    gguf = _gguf_or_skip()
    model, _ = gguf_gemma3.load_gguf_gemma3(GEMMA3_FILE, tokenizer=False)
    assert model.config.layer_types.count("full_attention") == 3 and model.config.sliding_window == 512
    ids = [2] + [int(x) for x in rng.integers(300, 20000, 699)]  # past the 512-token window
    reference = gemma3_reference_logits(gguf.GGUFReader(GEMMA3_FILE), gguf, ids, last=8)
    with torch.no_grad():
        logits = model(torch.tensor([ids]), logits_to_keep=8).logits[0]
    assert_close(logits, reference, 2e-3, "Gemma 3 270M, float32 vs float64")  # |logits| ~ 70
    # Through libminikv, keep-all 16-bit: the same logits.
    with hf.MiniKVGenerator(model, max_seq_len=720, **LOSSLESS) as gen:
        got = gen.prefill(ids[:-4], all_logits=True)[0][-4:]
        steps = [gen.step([t])[0] for t in ids[-4:]]
    assert_close(got, logits[:4], 2e-3, "Gemma 3 270M through libminikv, prefill")
    assert_close(torch.stack(steps), reference[-4:], 2e-3, "Gemma 3 270M through libminikv, steps")
