//! The whole lifecycle on the CPU backend with numbers checked: with 16-bit storage and a
//! keep-everything budget the cache is lossless, so every prefill and decode output must
//! equal attention computed here in f64, across several flushes and a ragged batch.

mod common;

use common::{assert_close, attention, rows, Dims, Rng};
use minikv::{Backend, Bf16, Config, Dtype, Element, KvCache, Preset, F16};

const LAYERS: u32 = 2;
const DIMS: Dims = Dims { heads: 4, kv_heads: 2, head_dim: 32 }; // GQA group of 2
const RESIDUAL: u32 = 16;

fn lossless_config(dtype: Dtype) -> Config {
    let mut cfg =
        Config::new(LAYERS, DIMS.heads as u32, DIMS.kv_heads as u32, DIMS.head_dim as u32);
    cfg.apply_preset(Preset::EvictionOnly); // 16-bit, no sinks
    cfg.backend = Backend::Cpu;
    cfg.dtype = dtype;
    cfg.max_sequences = 4;
    cfg.max_seq_len = 128;
    cfg.key_bits = 16;
    cfg.value_bits = 16;
    // heavy 1, recent 0: the heavy-hitter budget is the whole prompt, nothing is evicted.
    cfg.heavy_ratio = 1.0;
    cfg.recent_ratio = 0.0;
    cfg.group_size = 16;
    cfg.residual_length = RESIDUAL;
    cfg
}

/// Host data of type T and the exact values the library sees, as f64.
fn make<T: Element>(rng: &mut Rng, n: usize) -> (Vec<T>, Vec<f64>) {
    let data: Vec<T> = rng.vec(n).into_iter().map(T::from_f32).collect();
    let exact = data.iter().map(|x| x.to_f32() as f64).collect();
    (data, exact)
}

fn to_f64<T: Element>(data: &[T]) -> Vec<f64> {
    data.iter().map(|x| x.to_f32() as f64).collect()
}

/// K and V history of one (sequence, layer): token rows [kv_heads, D].
#[derive(Default, Clone)]
struct History {
    keys: Vec<Vec<f64>>,
    values: Vec<Vec<f64>>,
}

fn run_lossless<T: Element>(seed: u64, steps: usize, atol: f64, rtol: f64) {
    let d = DIMS;
    let mut cache = KvCache::new(&lossless_config(T::DTYPE)).expect("create");
    let mut rng = Rng::new(seed);

    // A ragged batch of three prompts in slots given out of order; 5 < G stays entirely in
    // the residual, 23 and 40 quantize (here: store 16-bit) whole groups and keep a tail.
    let seq_ids = [2u32, 0, 3];
    let lens = [5usize, 23, 40];
    let mut cu = vec![0i32];
    for l in lens {
        cu.push(cu.last().unwrap() + l as i32);
    }
    let total = *cu.last().unwrap() as usize;
    let mut hist = vec![vec![History::default(); LAYERS as usize]; seq_ids.len()];

    for layer in 0..LAYERS {
        let (q, qx) = make::<T>(&mut rng, total * d.q_row());
        let (k, kx) = make::<T>(&mut rng, total * d.kv_row());
        let (v, vx) = make::<T>(&mut rng, total * d.kv_row());
        let mut out = vec![T::from_f32(f32::NAN); total * d.q_row()];
        cache.prefill(layer, &seq_ids, &cu, &q, &k, &v, &mut out).expect("prefill");
        let out = to_f64(&out);
        let (krows, vrows) = (rows(&kx, d.kv_row()), rows(&vx, d.kv_row()));
        for s in 0..seq_ids.len() {
            let (b, e) = (cu[s] as usize, cu[s + 1] as usize);
            // Causal prompt attention: token i sees tokens b..=i of its own prompt.
            for i in b..e {
                let want = attention(
                    d,
                    &qx[i * d.q_row()..(i + 1) * d.q_row()],
                    &krows[b..=i],
                    &vrows[b..=i],
                );
                let what = format!("prefill layer {layer} seq {} token {}", seq_ids[s], i - b);
                assert_close(&what, &out[i * d.q_row()..(i + 1) * d.q_row()], &want, atol, rtol);
            }
            let h = &mut hist[s][layer as usize];
            h.keys.extend_from_slice(&krows[b..e]);
            h.values.extend_from_slice(&vrows[b..e]);
            // Keep-everything budget: every KV head kept every prompt position.
            let every: Vec<i32> = (0..(e - b) as i32).collect();
            for kvh in 0..d.kv_heads as u32 {
                assert_eq!(cache.kept_positions(seq_ids[s], layer, kvh).unwrap(), every);
            }
        }
    }

    // Decode steps: append each sequence's new K/V, then decode its query over prompt +
    // everything appended (the token attends to itself). 40 steps cross the residual
    // boundary (16) two or three times per sequence.
    let n = seq_ids.len();
    let mut worst = 0.0f64;
    for step in 0..steps {
        for layer in 0..LAYERS {
            let (k, kx) = make::<T>(&mut rng, n * d.kv_row());
            let (v, vx) = make::<T>(&mut rng, n * d.kv_row());
            cache.append(layer, &seq_ids, &k, &v).expect("append");
            for s in 0..n {
                let h = &mut hist[s][layer as usize];
                h.keys.push(kx[s * d.kv_row()..(s + 1) * d.kv_row()].to_vec());
                h.values.push(vx[s * d.kv_row()..(s + 1) * d.kv_row()].to_vec());
            }
            let (q, qx) = make::<T>(&mut rng, n * d.q_row());
            let mut out = vec![T::from_f32(f32::NAN); n * d.q_row()];
            cache.decode(layer, &seq_ids, &q, &mut out).expect("decode");
            let out = to_f64(&out);
            for s in 0..n {
                let h = &hist[s][layer as usize];
                let want =
                    attention(d, &qx[s * d.q_row()..(s + 1) * d.q_row()], &h.keys, &h.values);
                let what = format!("decode step {step} layer {layer} seq {}", seq_ids[s]);
                worst = worst.max(assert_close(
                    &what,
                    &out[s * d.q_row()..(s + 1) * d.q_row()],
                    &want,
                    atol,
                    rtol,
                ));
            }
            // A subset in another order reads the same cache.
            if step % 7 == 3 {
                let sub = [seq_ids[2], seq_ids[0]];
                let qsub: Vec<T> = [&q[2 * d.q_row()..3 * d.q_row()], &q[..d.q_row()]].concat();
                let mut osub = vec![T::from_f32(f32::NAN); 2 * d.q_row()];
                cache.decode(layer, &sub, &qsub, &mut osub).expect("decode subset");
                assert_eq!(to_f64(&osub[..d.q_row()]), out[2 * d.q_row()..3 * d.q_row()]);
                assert_eq!(to_f64(&osub[d.q_row()..]), out[..d.q_row()]);
            }
        }
    }
    eprintln!("{:?}: largest |decode - f64 attention| = {worst:e}", T::DTYPE);

    // Bookkeeping: nothing evicted, so cached == seen, per sequence and in the stats.
    let mut seen_sum = 0u64;
    for (s, &id) in seq_ids.iter().enumerate() {
        for layer in 0..LAYERS {
            let len = cache.sequence_length(id, layer).unwrap();
            assert_eq!(len.tokens_seen, (lens[s] + steps) as u64);
            assert_eq!(len.tokens_cached, len.tokens_seen);
            seen_sum += len.tokens_seen;
        }
    }
    let stats = cache.memory_stats().unwrap();
    assert_eq!(stats.tokens_seen, seen_sum);
    assert_eq!(stats.tokens_cached, seen_sum);
    // 16-bit storage of K and V in the dtype: every cached token costs 2 * Hkv * D elements.
    let token_bytes = 2 * d.kv_row() as u64 * T::DTYPE.size() as u64;
    assert_eq!(stats.used_bytes, seen_sum * token_bytes);
    assert_eq!(stats.fp16_equivalent_bytes, seen_sum * 2 * d.kv_row() as u64 * 2);
    let want_ratio = 1.0 - stats.used_bytes as f64 / stats.fp16_equivalent_bytes as f64;
    assert!((stats.compression_ratio - want_ratio).abs() < 1e-12);
    assert!(stats.pool_bytes > 0);

    // Release: the slot is empty, the others are untouched, and the stats follow.
    cache.release(0).unwrap();
    assert_eq!(cache.sequence_length(0, 0).unwrap().tokens_seen, 0);
    assert_eq!(cache.sequence_length(3, 1).unwrap().tokens_seen, (lens[2] + steps) as u64);
    let after = cache.memory_stats().unwrap();
    assert_eq!(after.tokens_seen, seen_sum - LAYERS as u64 * (lens[1] + steps) as u64);
}

#[test]
fn f32_decode_equals_f64_attention_across_flushes() {
    run_lossless::<f32>(1, 40, 2e-5, 2e-5);
}

#[test]
fn f16_decode_equals_f64_attention_across_flushes() {
    // Inputs are exactly representable (the reference uses the rounded values); the outputs
    // are rounded to binary16 after f32 arithmetic: at most half an ulp, 2^-11 of the value
    // (rtol 5e-4).
    run_lossless::<F16>(2, 20, 2e-4, 5e-4);
}

#[test]
fn bf16_decode_equals_f64_attention() {
    // bfloat16 outputs: rounding is at most half an ulp, 2^-8 of the value (rtol 4e-3).
    run_lossless::<Bf16>(3, 18, 1e-3, 4e-3);
}

#[test]
fn released_slot_takes_a_new_prompt() {
    let d = DIMS;
    let mut cache = KvCache::new(&lossless_config(Dtype::F32)).unwrap();
    let mut rng = Rng::new(7);
    for (round, len) in [(0, 30usize), (1, 9)] {
        // Prefill slot 1 on every layer (the first round's prompt is then released).
        let mut last = Vec::new();
        for layer in 0..LAYERS {
            let (q, k, v) =
                (rng.vec(len * d.q_row()), rng.vec(len * d.kv_row()), rng.vec(len * d.kv_row()));
            let mut out = vec![0f32; len * d.q_row()];
            cache.prefill(layer, &[1], &[0, len as i32], &q, &k, &v, &mut out).unwrap();
            last.push((k, v));
        }
        // A second prefill of a prefilled (sequence, layer) is refused and changes nothing.
        let (q, k, v) =
            (rng.vec(len * d.q_row()), rng.vec(len * d.kv_row()), rng.vec(len * d.kv_row()));
        let mut out = vec![0f32; len * d.q_row()];
        let err = cache.prefill(0, &[1], &[0, len as i32], &q, &k, &v, &mut out).unwrap_err();
        assert_eq!(err.status, minikv::Status::BadState, "{err}");
        assert!(err.message.contains("already prefilled"), "{err}");

        // Decode over this round's prompt only: the released one left no trace.
        let (k, v) = &last[1];
        let (nk, nv, q) = (rng.vec(d.kv_row()), rng.vec(d.kv_row()), rng.vec(d.q_row()));
        cache.append(1, &[1], &nk, &nv).unwrap();
        let mut out = vec![0f32; d.q_row()];
        cache.decode(1, &[1], &q, &mut out).unwrap();
        let mut keys = rows(&k.iter().map(|&x| x as f64).collect::<Vec<_>>(), d.kv_row());
        let mut values = rows(&v.iter().map(|&x| x as f64).collect::<Vec<_>>(), d.kv_row());
        keys.push(nk.iter().map(|&x| x as f64).collect());
        values.push(nv.iter().map(|&x| x as f64).collect());
        let q64: Vec<f64> = q.iter().map(|&x| x as f64).collect();
        let want = attention(d, &q64, &keys, &values);
        let got: Vec<f64> = out.iter().map(|&x| x as f64).collect();
        assert_close(&format!("round {round} decode"), &got, &want, 2e-5, 2e-5);
        assert_eq!(cache.sequence_length(1, 1).unwrap().tokens_seen, len as u64 + 1);

        cache.release(1).unwrap();
        assert_eq!(cache.memory_stats().unwrap().tokens_seen, 0);
        cache.release(1).unwrap(); // releasing an empty slot is a no-op
    }
}

#[test]
fn cache_moves_to_another_thread() {
    fn assert_send<T: Send>() {}
    assert_send::<KvCache>();
    let cache = KvCache::new(&lossless_config(Dtype::F32)).unwrap();
    let stats = std::thread::spawn(move || {
        let mut cache = cache;
        let d = DIMS;
        let mut rng = Rng::new(9);
        let (q, k, v) = (rng.vec(3 * d.q_row()), rng.vec(3 * d.kv_row()), rng.vec(3 * d.kv_row()));
        let mut out = vec![0f32; 3 * d.q_row()];
        cache.prefill(0, &[0], &[0, 3], &q, &k, &v, &mut out).unwrap();
        cache.memory_stats().unwrap()
    })
    .join()
    .unwrap();
    assert_eq!(stats.tokens_seen, 3);
}

/// `append_decode` equals `append` then `decode` bit for bit on a quantized cache (GQA,
/// sinks, flushes); a failing `append_decode` appends nothing.
fn append_decode_equals_append_then_decode<T: Element>(seed: u64) {
    let d = DIMS;
    let mut cfg = lossless_config(T::DTYPE);
    cfg.apply_preset(Preset::Balanced); // 4-bit keys, 2-bit values, 4 sinks
    cfg.group_size = 16;
    cfg.residual_length = RESIDUAL;
    let mut fused = KvCache::new(&cfg).unwrap();
    let mut split = KvCache::new(&cfg).unwrap();
    let mut rng = Rng::new(seed);
    let (ids, cu, total) = ([3u32, 1], [0i32, 50, 81], 81usize);
    for layer in 0..LAYERS {
        let (q, _) = make::<T>(&mut rng, total * d.q_row());
        let (k, _) = make::<T>(&mut rng, total * d.kv_row());
        let (v, _) = make::<T>(&mut rng, total * d.kv_row());
        for cache in [&mut fused, &mut split] {
            let mut out = vec![T::from_f32(0.0); total * d.q_row()];
            cache.prefill(layer, &ids, &cu, &q, &k, &v, &mut out).unwrap();
        }
    }
    let bits = |x: &[T]| x.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
    for step in 0..40 {
        // 40 > RESIDUAL: flushes
        for layer in 0..LAYERS {
            let (q, _) = make::<T>(&mut rng, 2 * d.q_row());
            let (k, _) = make::<T>(&mut rng, 2 * d.kv_row());
            let (v, _) = make::<T>(&mut rng, 2 * d.kv_row());
            let mut a = vec![T::from_f32(0.0); 2 * d.q_row()];
            let mut b = a.clone();
            fused.append_decode(layer, &ids, &q, &k, &v, &mut a).unwrap();
            split.append(layer, &ids, &k, &v).unwrap();
            split.decode(layer, &ids, &q, &mut b).unwrap();
            assert!(bits(&a) == bits(&b), "step {step} layer {layer}: outputs differ");
        }
    }
    let before = fused.sequence_length(1, 0).unwrap();
    let (mut q, _) = make::<T>(&mut rng, 2 * d.q_row());
    let (k, _) = make::<T>(&mut rng, 2 * d.kv_row());
    q[3] = T::from_f32(f32::NAN);
    let mut out = vec![T::from_f32(0.0); 2 * d.q_row()];
    let err = fused.append_decode(0, &ids, &q, &k, &k, &mut out).unwrap_err();
    assert_eq!(err.status, minikv::Status::InvalidArgument, "{err}");
    assert!(err.message.contains("minikv_append_decode"), "{err}");
    assert_eq!(fused.sequence_length(1, 0).unwrap(), before, "a failed append_decode appended");
    let err = fused.append_decode(0, &ids, &q[..3], &k, &k, &mut out).unwrap_err();
    assert_eq!(err.status, minikv::Status::InvalidArgument, "{err}");
}

#[test]
fn append_decode_equals_append_then_decode_f32() {
    append_decode_equals_append_then_decode::<f32>(11);
}

#[test]
fn append_decode_equals_append_then_decode_f16() {
    append_decode_equals_append_then_decode::<F16>(12);
}
