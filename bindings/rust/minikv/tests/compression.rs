//! With the paper's preset (2-bit keys and values, G = 16, R = 128, heavy = recent = 25%),
//! the compression ratio the library reports equals the one computed here from the storage
//! layout (src/layout.h, `quantized_bytes`), in the paper's setting: MHA, head_dim 128,
//! a 4096-token prompt and 512 generated tokens, fp16 -> about 86% smaller. The defaults
//! (`Preset::Balanced`, with 4 sink tokens and a 64-token residual flushed 32 tokens at a
//! time) follow the same accounting, so do other sliding flushes (`flush_tokens`, rounded up
//! to whole groups and capped at the residual), and every preset sets its compression
//! fields.

mod common;

use common::Rng;
use minikv::{Backend, BudgetPolicy, Config, Dtype, KvCache, Preset, ScoreMode, F16};

/// Bytes of `n` quantized tokens (a multiple of G) of all KV heads: codes plus the
/// (scale, min) pairs, as src/layout.h lays them out (positions are bookkeeping).
fn quantized_bytes(cfg: &Config, n: u64) -> u64 {
    let (d, g, e) = (cfg.head_dim as u64, cfg.group_size as u64, cfg.dtype.size() as u64);
    let row = |bits: u32| if bits == 16 { d * e } else { d * bits as u64 / 8 };
    let mut per_group = g * (row(cfg.key_bits) + row(cfg.value_bits));
    if cfg.key_bits != 16 {
        per_group += 2 * d * e; // keys: per channel, one (scale, min) per group of G tokens
    }
    if cfg.value_bits != 16 {
        per_group += 2 * g * (d / g) * e; // values: per token, one pair per G channels
    }
    n / g * per_group * cfg.num_kv_heads as u64
}

/// What one (sequence, layer) holds after a prompt of `prompt` tokens and `generated`
/// appends, following MINIKV.md (uniform budgets): keep the first min(S, L) tokens as
/// 16-bit sinks inside the heavy-hitter share, max(floor(h L), sinks) + floor(r L) tokens
/// in all, quantize whole groups of the rest, keep the tail 16-bit, flush the residual when
/// it reaches R tokens: its oldest F (`flush_size`) are quantized, the newest R - F stay.
fn expected_used_bytes(cfg: &Config, prompt: u64, generated: u64) -> u64 {
    let sinks = (cfg.sink_tokens as u64).min(prompt);
    let heavy = ((cfg.heavy_ratio as f64 * prompt as f64).floor() as u64).max(sinks);
    let keep = heavy + (cfg.recent_ratio as f64 * prompt as f64).floor() as u64;
    // A budget of the whole prompt (h + r >= 1) keeps every token.
    let whole = cfg.heavy_ratio as f64 + cfg.recent_ratio as f64 >= 1.0;
    let keep = if whole { prompt } else { keep.min(prompt) };
    let g = cfg.group_size as u64;
    let rest = keep - sinks;
    let mut quantized = rest - rest % g;
    let mut residual = rest % g;
    let (r, f) = (cfg.residual_length as u64, flush_size(cfg));
    for _ in 0..generated {
        if residual + 1 == r {
            quantized += f;
            residual = r - f;
        } else {
            residual += 1;
        }
    }
    let dense_token = 2 * cfg.num_kv_heads as u64 * cfg.head_dim as u64 * cfg.dtype.size() as u64;
    quantized_bytes(cfg, quantized) + (sinks + residual) * dense_token
}

/// F, the tokens one flush quantizes (`flush_tokens` in include/minikv.h): the whole
/// residual for 0, else `flush_tokens` rounded up to a multiple of G, at most R.
fn flush_size(cfg: &Config) -> u64 {
    let (g, r) = (cfg.group_size as u64, cfg.residual_length as u64);
    match cfg.flush_tokens as u64 {
        0 => r,
        f => ((f + g - 1) / g * g).min(r),
    }
}

#[test]
fn paper_compression_matches_the_layout() {
    const PROMPT: usize = 4096;
    const GENERATED: usize = 512;
    let mut cfg = Config::new(1, 2, 2, 128); // MHA: 2 query heads, 2 KV heads
    cfg.apply_preset(Preset::Paper);
    cfg.backend = Backend::Cpu;
    cfg.max_seq_len = (PROMPT + GENERATED) as u32;
    let defaults = Config::default();
    assert_eq!(
        (cfg.key_bits, cfg.value_bits, cfg.group_size, cfg.residual_length, cfg.sink_tokens),
        (2, 2, 16, 128, 0)
    );
    assert_eq!((cfg.heavy_ratio, cfg.recent_ratio), (0.25, 0.25));
    assert_eq!(cfg.dtype, Dtype::F16);
    assert_eq!(defaults.backend, Backend::Auto);

    let mut cache = KvCache::new(&cfg).unwrap();
    let (q_row, kv_row) = (2 * 128, 2 * 128);
    let mut rng = Rng::new(11);
    let mut gen = |n: usize| -> Vec<F16> { rng.vec(n).into_iter().map(F16::from_f32).collect() };
    let (q, k, v) = (gen(PROMPT * q_row), gen(PROMPT * kv_row), gen(PROMPT * kv_row));
    let mut out = vec![F16::default(); PROMPT * q_row];
    cache.prefill(0, &[0], &[0, PROMPT as i32], &q, &k, &v, &mut out).unwrap();
    assert!(out.iter().all(|x| x.to_f32().is_finite()));

    let fp16 = |seen: u64| seen * kv_row as u64 * 2 * 2;
    let check = |cache: &KvCache, generated: usize| {
        let s = cache.memory_stats().unwrap();
        let seen = (PROMPT + generated) as u64;
        let used = expected_used_bytes(&cfg, PROMPT as u64, generated as u64);
        assert_eq!(s.tokens_seen, seen);
        assert_eq!(s.used_bytes, used, "after {generated} generated tokens");
        assert_eq!(s.fp16_equivalent_bytes, fp16(seen));
        let ratio = 1.0 - used as f64 / fp16(seen) as f64;
        assert!((s.compression_ratio - ratio).abs() < 1e-12, "{} vs {ratio}", s.compression_ratio);
        s
    };
    let after_prefill = check(&cache, 0);
    assert_eq!(after_prefill.tokens_cached, 2048); // 25% heavy + 25% recent of 4096

    // The recent window [3072, 4096) is kept whole, plus 1024 heavy hitters before it.
    for kvh in 0..2 {
        let kept = cache.kept_positions(0, 0, kvh).unwrap();
        assert_eq!(kept.len(), 2048);
        assert!(kept.windows(2).all(|w| w[0] < w[1]), "ascending");
        assert_eq!(kept[1024..], (3072..4096).collect::<Vec<i32>>()[..]);
        assert!(kept[..1024].iter().all(|&p| p < 3072));
    }

    let mut dec = vec![F16::default(); q_row];
    for step in 1..=GENERATED {
        let (nk, nv, nq) = (gen(kv_row), gen(kv_row), gen(q_row));
        cache.append(0, &[0], &nk, &nv).unwrap();
        cache.decode(0, &[0], &nq, &mut dec).unwrap();
        assert!(dec.iter().all(|x| x.to_f32().is_finite() && x.to_f32().abs() <= 1.01));
        if step == 100 {
            check(&cache, step); // 100 tokens in the residual, no flush yet
        }
    }
    let s = check(&cache, GENERATED);
    assert_eq!(s.tokens_cached, 2048 + 512);
    // The paper's headline: MiniKV's cache is about 86% smaller than the fp16 one
    // (2.4 GB -> 0.33 GB on LLaMA-2-7B).
    eprintln!(
        "compression_ratio = {:.6}, used {} of fp16 {}",
        s.compression_ratio, s.used_bytes, s.fp16_equivalent_bytes
    );
    assert!((s.compression_ratio - 0.861).abs() < 0.001, "{}", s.compression_ratio);
}

#[test]
fn default_compression_with_sinks_matches_the_layout() {
    const PROMPT: usize = 1000;
    let mut cfg = Config::new(1, 4, 2, 64);
    cfg.backend = Backend::Cpu;
    cfg.max_seq_len = 1200;
    assert_eq!(
        (cfg.key_bits, cfg.value_bits, cfg.group_size, cfg.sink_tokens),
        (4, 2, 32, 4),
        "the defaults are Preset::Balanced"
    );
    // A sliding flush: the oldest 32 tokens of a full 64-token residual.
    assert_eq!((cfg.residual_length, cfg.flush_tokens), (64, 32));
    let whole = Config { flush_tokens: 0, ..cfg.clone() };
    let mut cache = KvCache::new(&cfg).unwrap();
    let (q_row, kv_row) = (4 * 64, 2 * 64);
    let mut rng = Rng::new(12);
    let mut gen = |n: usize| -> Vec<F16> { rng.vec(n).into_iter().map(F16::from_f32).collect() };
    let (q, k, v) = (gen(PROMPT * q_row), gen(PROMPT * kv_row), gen(PROMPT * kv_row));
    let mut out = vec![F16::default(); PROMPT * q_row];
    cache.prefill(0, &[0], &[0, PROMPT as i32], &q, &k, &v, &mut out).unwrap();
    for kvh in 0..2 {
        let kept = cache.kept_positions(0, 0, kvh).unwrap();
        assert_eq!(kept.len(), 500); // 250 heavy-hitter slots (4 of them the sinks) + 250 recent
        assert_eq!(kept[..4], [0, 1, 2, 3], "the sinks come first");
    }
    let mut dec = vec![F16::default(); q_row];
    let mut differed = 0;
    for step in 1..=150u64 {
        cache.append(0, &[0], &gen(kv_row), &gen(kv_row)).unwrap();
        cache.decode(0, &[0], &gen(q_row), &mut dec).unwrap();
        if step % 10 == 0 {
            let s = cache.memory_stats().unwrap();
            let want = expected_used_bytes(&cfg, PROMPT as u64, step);
            assert_eq!(s.used_bytes, want, "after {step} appends");
            assert_eq!(s.tokens_cached, 500 + step);
            differed += (want != expected_used_bytes(&whole, PROMPT as u64, step)) as u32;
        }
    }
    // The accounting checked is not a whole flush's (which a library ignoring the default
    // flush_tokens would follow).
    assert!(differed >= 5, "sliding and whole flushes differ at only {differed} checks");
}

/// `flush_tokens` = 32 of `residual_length` = 64 (G = 32): the first flush at the residual's
/// 64th token, then one every 32 appends, each quantizing the oldest 32 and keeping 32
/// 16-bit. The byte count follows that after every step, and differs from a whole flush's.
#[test]
fn sliding_flush_matches_the_layout() {
    const PROMPT: usize = 300;
    let mut cfg = Config::new(1, 4, 2, 64);
    cfg.backend = Backend::Cpu;
    cfg.budget_policy = BudgetPolicy::Uniform;
    cfg.max_seq_len = 600;
    cfg.residual_length = 64;
    cfg.flush_tokens = 32;
    assert_eq!(cfg.group_size, 32);
    let whole = Config { flush_tokens: 0, ..cfg.clone() };
    let mut cache = KvCache::new(&cfg).unwrap();
    assert_eq!(cache.config().flush_tokens, 32);
    let (q_row, kv_row) = (4 * 64, 2 * 64);
    let mut rng = Rng::new(13);
    let mut gen = |n: usize| -> Vec<F16> { rng.vec(n).into_iter().map(F16::from_f32).collect() };
    let (q, k, v) = (gen(PROMPT * q_row), gen(PROMPT * kv_row), gen(PROMPT * kv_row));
    let mut out = vec![F16::default(); PROMPT * q_row];
    cache.prefill(0, &[0], &[0, PROMPT as i32], &q, &k, &v, &mut out).unwrap();
    let mut dec = vec![F16::default(); q_row];
    let mut differed = 0;
    for step in 1..=200u64 {
        cache.append(0, &[0], &gen(kv_row), &gen(kv_row)).unwrap();
        cache.decode(0, &[0], &gen(q_row), &mut dec).unwrap();
        assert!(dec.iter().all(|x| x.to_f32().is_finite()));
        let s = cache.memory_stats().unwrap();
        let want = expected_used_bytes(&cfg, PROMPT as u64, step);
        assert_eq!(s.used_bytes, want, "after {step} appends");
        assert_eq!(s.tokens_cached, 150 + step);
        if want != expected_used_bytes(&whole, PROMPT as u64, step) {
            differed += 1;
        }
    }
    // A library that flushed all R tokens would fail the checks above most of the way.
    assert!(differed > 80, "sliding and whole flushes differ at only {differed} steps");
}

/// Any `flush_tokens` is valid: it is rounded up to a multiple of `group_size` and capped at
/// `residual_length`. With G = 16 and R = 64, caches fed the same tokens give the same
/// decode outputs (bit for bit) and memory stats at every step when their `flush_tokens`
/// round to the same F: 24 and 32; 1 and 16; 200, `u32::MAX` and 0 (the whole residual).
/// The three F differ from each other (so the comparisons can fail), and each follows the
/// layout's accounting with the rounded F.
#[test]
fn flush_tokens_round_up_to_whole_groups() {
    const PROMPT: usize = 40;
    let mut cfg = Config::new(1, 4, 2, 64);
    cfg.apply_preset(Preset::Paper); // G = 16
    cfg.backend = Backend::Cpu;
    cfg.budget_policy = BudgetPolicy::Uniform;
    cfg.max_seq_len = 256;
    cfg.residual_length = 64;
    let groups: [&[u32]; 3] = [&[24, 32], &[1, 16], &[200, u32::MAX, 0]];
    let rounded = [32, 16, 64];
    let mut caches = Vec::new();
    for (same, f) in groups.iter().zip(rounded) {
        for &flush in same.iter() {
            let c = Config { flush_tokens: flush, ..cfg.clone() };
            assert_eq!(flush_size(&c), f, "flush_tokens {flush}");
            let cache = KvCache::new(&c).unwrap_or_else(|e| panic!("flush_tokens {flush}: {e}"));
            assert_eq!(cache.config().flush_tokens, flush);
            caches.push((c, cache));
        }
    }
    let (q_row, kv_row) = (4 * 64, 2 * 64);
    let mut rng = Rng::new(14);
    let mut gen = |n: usize| -> Vec<F16> { rng.vec(n).into_iter().map(F16::from_f32).collect() };
    let (q, k, v) = (gen(PROMPT * q_row), gen(PROMPT * kv_row), gen(PROMPT * kv_row));
    let mut out = vec![F16::default(); PROMPT * q_row];
    for (_, cache) in caches.iter_mut() {
        cache.prefill(0, &[0], &[0, PROMPT as i32], &q, &k, &v, &mut out).unwrap();
    }
    let mut differ = [0u32; 3]; // steps where F = 32 vs 16, 32 vs 64, 16 vs 64 differ
    for step in 1..=160u64 {
        let (nk, nv, nq) = (gen(kv_row), gen(kv_row), gen(q_row));
        let mut seen = Vec::new(); // (flush_tokens, decode output, used bytes) of each cache
        for (c, cache) in caches.iter_mut() {
            cache.append(0, &[0], &nk, &nv).unwrap();
            let mut dec = vec![F16::default(); q_row];
            cache.decode(0, &[0], &nq, &mut dec).unwrap();
            let used = cache.memory_stats().unwrap().used_bytes;
            let want = expected_used_bytes(c, PROMPT as u64, step);
            assert_eq!(used, want, "flush_tokens {}: after {step} appends", c.flush_tokens);
            seen.push((c.flush_tokens, dec, used)); // F16 compares its bits
        }
        let mut first = Vec::new(); // the first cache of each group
        let mut at = 0;
        for same in groups {
            let (f0, dec0, used0) = &seen[at];
            for (f, dec, used) in &seen[at + 1..at + same.len()] {
                assert!(dec == dec0, "decode of flush_tokens {f} vs {f0}, step {step}");
                assert_eq!(used, used0, "bytes of flush_tokens {f} vs {f0}, step {step}");
            }
            first.push(*used0);
            at += same.len();
        }
        for (i, (a, b)) in [(0, 1), (0, 2), (1, 2)].into_iter().enumerate() {
            differ[i] += (first[a] != first[b]) as u32;
        }
    }
    assert!(differ.iter().all(|&n| n > 20), "the rounded flushes differ too rarely: {differ:?}");
}

#[test]
fn presets_set_the_compression_fields() {
    // BALANCED flushes 32 of a 64-token residual, the others the whole 128-token one.
    let cases = [
        (Preset::Balanced, 4, 2, 32, 4, BudgetPolicy::Pyramid, ScoreMode::Window, 64, 32),
        (Preset::Paper, 2, 2, 16, 0, BudgetPolicy::Pyramid, ScoreMode::Cumulative, 128, 0),
        (Preset::Quality, 8, 8, 32, 4, BudgetPolicy::Uniform, ScoreMode::Cumulative, 128, 0),
        (Preset::EvictionOnly, 16, 16, 16, 0, BudgetPolicy::Uniform, ScoreMode::Cumulative, 128, 0),
    ];
    for (preset, kb, vb, g, sinks, policy, scores, residual, flush) in cases {
        let mut cfg = Config::new(3, 8, 2, 96);
        cfg.backend = Backend::Cpu;
        cfg.dtype = Dtype::Bf16;
        cfg.max_seq_len = 777;
        // Every compression field starts elsewhere than the preset puts it.
        let other =
            if scores == ScoreMode::Window { ScoreMode::Cumulative } else { ScoreMode::Window };
        (cfg.heavy_ratio, cfg.residual_length, cfg.score_mode) = (0.9, 512, other);
        cfg.flush_tokens = 96;
        cfg.apply_preset(preset);
        assert_eq!((cfg.residual_length, cfg.flush_tokens), (residual, flush), "{preset:?}");
        assert_eq!(
            (cfg.key_bits, cfg.value_bits, cfg.group_size, cfg.sink_tokens, cfg.budget_policy),
            (kb, vb, g, sinks, policy),
            "{preset:?}"
        );
        assert_eq!((cfg.heavy_ratio, cfg.recent_ratio), (0.25, 0.25));
        assert_eq!(cfg.score_mode, scores, "{preset:?}");
        // Everything else keeps its value.
        assert_eq!((cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), (3, 8, 2, 96));
        assert_eq!((cfg.backend, cfg.dtype, cfg.max_seq_len), (Backend::Cpu, Dtype::Bf16, 777));
    }
    let mut balanced = Config::default();
    balanced.apply_preset(Preset::Balanced);
    assert_eq!(balanced, Config::default());
}
