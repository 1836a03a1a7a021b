//! Test helpers: a deterministic generator and float64 attention oracles.
#![allow(dead_code)] // each test file uses its own subset

/// Deterministic uniform values in [-1, 1) (64-bit LCG, top bits).
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next(&mut self) -> f32 {
        self.0 =
            self.0.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.next()).collect()
    }
}

/// Shapes of one layer.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Dims {
    pub fn q_row(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_row(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}

/// Attention of one query row `q` [heads, D] over `keys`/`values` (token rows
/// [kv_heads, D] each), GQA mapping head h -> KV head h / (heads / kv_heads), scale
/// 1/sqrt(D), max-subtracted softmax, all in f64. Returns [heads, D].
pub fn attention(d: Dims, q: &[f64], keys: &[Vec<f64>], values: &[Vec<f64>]) -> Vec<f64> {
    let group = d.heads / d.kv_heads;
    let scale = 1.0 / (d.head_dim as f64).sqrt();
    let mut out = vec![0.0; d.q_row()];
    for h in 0..d.heads {
        let kvh = h / group;
        let qh = &q[h * d.head_dim..(h + 1) * d.head_dim];
        let logits: Vec<f64> = keys
            .iter()
            .map(|k| {
                let kh = &k[kvh * d.head_dim..(kvh + 1) * d.head_dim];
                qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f64>() * scale
            })
            .collect();
        let max = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
        let sum: f64 = weights.iter().sum();
        for (w, v) in weights.iter().zip(values) {
            let vh = &v[kvh * d.head_dim..(kvh + 1) * d.head_dim];
            for (o, x) in out[h * d.head_dim..(h + 1) * d.head_dim].iter_mut().zip(vh) {
                *o += w / sum * x;
            }
        }
    }
    out
}

/// Checks every element: finite, and |got - want| <= atol + rtol * |want|. Returns the
/// largest absolute error (for messages).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], atol: f64, rtol: f64) -> f64 {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = 0.0f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}[{i}] = {g} is not finite");
        let err = (g - w).abs();
        assert!(err <= atol + rtol * w.abs(), "{what}[{i}]: got {g}, want {w} (|err| {err:e})");
        worst = worst.max(err);
    }
    worst
}

/// Splits a token-major buffer into rows of `row` elements, as f64.
pub fn rows(data: &[f64], row: usize) -> Vec<Vec<f64>> {
    data.chunks(row).map(|r| r.to_vec()).collect()
}
