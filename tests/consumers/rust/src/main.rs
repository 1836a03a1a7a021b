//! A user's first program with the Rust bindings, built from a directory outside the source
//! tree (scripts/bindings-rust.sh copies it out) against an installed libminikv found by
//! pkg-config: create, prefill, append, decode, stats on the CPU backend (`KvCache::new`
//! applies the version rule).

use minikv::{Backend, Config, Dtype, KvCache};

fn main() -> minikv::Result<()> {
    let (heads, kv_heads, head_dim, prompt) = (4, 2, 64, 40);
    let mut cfg = Config::new(1, heads as u32, kv_heads as u32, head_dim as u32);
    cfg.backend = Backend::Cpu;
    cfg.dtype = Dtype::F32;
    cfg.max_seq_len = 128;
    let mut cache = KvCache::new(&cfg)?;

    let q: Vec<f32> = (0..prompt * heads * head_dim).map(|i| (i as f32).sin()).collect();
    let k: Vec<f32> = (0..prompt * kv_heads * head_dim).map(|i| (i as f32).cos()).collect();
    let v = vec![0.5f32; k.len()]; // attention of a constant is that constant
    let mut out = vec![0f32; q.len()];
    cache.prefill(0, &[0], &[0, prompt as i32], &q, &k, &v, &mut out)?;
    cache.append(0, &[0], &k[..kv_heads * head_dim], &v[..kv_heads * head_dim])?;
    let mut o = vec![0f32; heads * head_dim];
    cache.decode(0, &[0], &q[..heads * head_dim], &mut o)?;
    assert!(out.iter().chain(&o).all(|x| (x - 0.5).abs() <= 1e-6), "outputs must be 0.5");
    let stats = cache.memory_stats()?;
    assert_eq!(stats.tokens_seen, prompt as u64 + 1);
    println!(
        "Rust consumer OK: libminikv {}, backend {:?}, {} of {} tokens kept",
        minikv::version_string(),
        cache.config().backend,
        stats.tokens_cached,
        stats.tokens_seen
    );
    Ok(())
}
