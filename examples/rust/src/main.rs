//! A decode loop over a MiniKV-compressed KV cache through the safe Rust bindings:
//! create -> prefill (a ragged batch of two prompts) -> append + decode per generated
//! token and layer -> memory statistics -> release -> destroy (drop).
//!
//! Q/K/V are synthetic (a real engine passes its projections, keys with RoPE applied).
//! For one (sequence, layer) the example keeps the exact fp32 K/V too and reports how far
//! the decode output over the 2-bit cache is from exact attention.
//!
//!   MINIKV_LIB_DIR=build LD_LIBRARY_PATH=build cargo run --release

use minikv::{Backend, Config, KvCache, F16};

const LAYERS: u32 = 2;
const HEADS: usize = 8;
const KV_HEADS: usize = 2; // GQA: 4 query heads per KV head
const HEAD_DIM: usize = 64;
const GENERATED: usize = 64;

/// Deterministic values in [-1, 1), with a few "attention sink" keys that get large
/// logits so the heavy-hitter selection has something to find.
struct Gen(u64);
impl Gen {
    fn next(&mut self) -> f32 {
        self.0 =
            self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    fn tokens(&mut self, n: usize, row: usize, sink_every: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..n * row).map(|_| self.next()).collect();
        for t in (0..n).step_by(sink_every) {
            x[t * row..(t + 1) * row].iter_mut().for_each(|e| *e = 1.5);
        }
        x
    }
}

/// Exact attention of one query row [HEADS, D] over K/V rows [KV_HEADS, D], in f64.
fn exact_attention(q: &[f32], keys: &[Vec<f32>], values: &[Vec<f32>]) -> Vec<f64> {
    let mut out = vec![0.0; HEADS * HEAD_DIM];
    for h in 0..HEADS {
        let kvh = h / (HEADS / KV_HEADS);
        let qh = &q[h * HEAD_DIM..(h + 1) * HEAD_DIM];
        let logits: Vec<f64> = keys
            .iter()
            .map(|k| {
                let kh = &k[kvh * HEAD_DIM..(kvh + 1) * HEAD_DIM];
                qh.iter().zip(kh).map(|(a, b)| (a * b) as f64).sum::<f64>()
                    / (HEAD_DIM as f64).sqrt()
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = w.iter().sum();
        for (wt, v) in w.iter().zip(values) {
            for d in 0..HEAD_DIM {
                out[h * HEAD_DIM + d] += wt / sum * v[kvh * HEAD_DIM + d] as f64;
            }
        }
    }
    out
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("libminikv {} (bindings for {})", minikv::version_string(), {
        let n = minikv::HEADER_VERSION_NUMBER;
        format!("{}.{}.{}", n / 10000, n / 100 % 100, n % 100)
    });

    // The defaults (Preset::Balanced: 4-bit keys, 2-bit values, group 32, 4 sink tokens,
    // residual 128, 25% heavy + 25% recent), F16 tensors, CPU backend (host slices).
    let mut cfg = Config::new(LAYERS, HEADS as u32, KV_HEADS as u32, HEAD_DIM as u32);
    cfg.backend = Backend::Cpu;
    cfg.max_sequences = 4;
    cfg.max_seq_len = 1024;
    let mut cache = KvCache::new(&cfg)?;

    let (q_row, kv_row) = (HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM);
    let seq_ids = [0u32, 1];
    let lens = [300usize, 180];
    let cu = [0, lens[0] as i32, (lens[0] + lens[1]) as i32];
    let total = lens[0] + lens[1];
    let mut gen = Gen(42);

    // Exact K/V of sequence 0, layer 0 (what an uncompressed cache would hold).
    let (mut exact_k, mut exact_v) = (Vec::new(), Vec::new());
    for layer in 0..LAYERS {
        let q = gen.tokens(total, q_row, 1000);
        let k = gen.tokens(total, kv_row, 37);
        let v = gen.tokens(total, kv_row, 1000);
        let mut out = vec![F16::default(); total * q_row];
        cache.prefill(
            layer,
            &seq_ids,
            &cu,
            &F16::from_f32_slice(&q),
            &F16::from_f32_slice(&k),
            &F16::from_f32_slice(&v),
            &mut out,
        )?;
        if layer == 0 {
            let rounded = |x: &[f32]| -> Vec<Vec<f32>> {
                x.chunks(kv_row)
                    .map(|r| r.iter().map(|&e| F16::from_f32(e).to_f32()).collect())
                    .collect()
            };
            exact_k = rounded(&k[..lens[0] * kv_row]);
            exact_v = rounded(&v[..lens[0] * kv_row]);
        }
    }
    for (s, &id) in seq_ids.iter().enumerate() {
        let kept = cache.kept_positions(id, 0, 0)?;
        println!(
            "prompt {id}: {} tokens, layer 0 / KV head 0 kept {} (first {:?}, ..., last {})",
            lens[s],
            kept.len(),
            &kept[..4.min(kept.len())],
            kept.last().unwrap()
        );
    }

    // Generation: each step appends the new token's K/V, then decodes its query.
    let mut out = vec![F16::default(); seq_ids.len() * q_row];
    let mut last = (Vec::new(), Vec::new());
    for _ in 0..GENERATED {
        for layer in 0..LAYERS {
            let k = gen.tokens(seq_ids.len(), kv_row, 1000);
            let v = gen.tokens(seq_ids.len(), kv_row, 1000);
            let q = gen.tokens(seq_ids.len(), q_row, 1000);
            cache.append(layer, &seq_ids, &F16::from_f32_slice(&k), &F16::from_f32_slice(&v))?;
            cache.decode(layer, &seq_ids, &F16::from_f32_slice(&q), &mut out)?;
            if layer == 0 {
                let round = |x: &[f32]| x.iter().map(|&e| F16::from_f32(e).to_f32()).collect();
                exact_k.push(round(&k[..kv_row]));
                exact_v.push(round(&v[..kv_row]));
                let got: Vec<f64> = out[..q_row].iter().map(|x| x.to_f32() as f64).collect();
                last = (round(&q[..q_row]), got);
            }
        }
    }
    let want = exact_attention(&last.0, &exact_k, &exact_v);
    let err: f64 = want.iter().zip(&last.1).map(|(w, g)| (w - g).powi(2)).sum::<f64>().sqrt();
    let norm: f64 = want.iter().map(|w| w * w).sum::<f64>().sqrt();
    println!(
        "last decode of sequence 0, layer 0: relative L2 error vs exact attention {:.4}",
        err / norm
    );

    let len = cache.sequence_length(0, 0)?;
    let stats = cache.memory_stats()?;
    println!(
        "sequence 0 layer 0: {} positions seen, {} cached",
        len.tokens_seen, len.tokens_cached
    );
    println!(
        "cache: {} B used for {} tokens seen ({} cached) vs {} B in fp16: {:.1}% smaller; \
         pool {} B, workspace {} B",
        stats.used_bytes,
        stats.tokens_seen,
        stats.tokens_cached,
        stats.fp16_equivalent_bytes,
        100.0 * stats.compression_ratio,
        stats.pool_bytes,
        stats.workspace_bytes
    );

    cache.release(0)?;
    cache.release(1)?;
    assert_eq!(cache.memory_stats()?.tokens_seen, 0);
    drop(cache); // minikv_cache_destroy
    println!("done");
    Ok(())
}
