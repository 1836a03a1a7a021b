//! Chunked prefill (`KvCache::prefill_chunk`) on the CPU backend: a prompt in chunks gives
//! exactly the outputs and kept positions of one `prefill`; decode refuses a sequence
//! mid-prompt; `prompt_lens` of the wrong length is refused before the library is called.

mod common;

use common::Rng;
use minikv::{Backend, Config, Dtype, KvCache, Preset, Status};

const H: usize = 4;
const HKV: usize = 2;
const D: usize = 32;

fn config() -> Config {
    let mut cfg = Config::new(1, H as u32, HKV as u32, D as u32);
    cfg.apply_preset(Preset::Paper);
    cfg.backend = Backend::Cpu;
    cfg.dtype = Dtype::F32;
    cfg.max_sequences = 2;
    cfg.max_seq_len = 128;
    cfg.residual_length = 32;
    cfg.prefill_staging_tokens = 100;
    cfg
}

#[test]
fn chunks_equal_one_call() {
    const L: usize = 100;
    let mut rng = Rng::new(7);
    let (q, k, v) = (rng.vec(L * H * D), rng.vec(L * HKV * D), rng.vec(L * HKV * D));
    let mut whole = KvCache::new(&config()).expect("create");
    let mut chunked = KvCache::new(&config()).expect("create");
    let mut want = vec![f32::NAN; L * H * D];
    whole.prefill(0, &[1], &[0, L as i32], &q, &k, &v, &mut want).expect("prefill");

    let mut got = vec![f32::NAN; L * H * D];
    for (a, b) in [(0usize, 33usize), (33, 34), (34, 100)] {
        chunked
            .prefill_chunk(
                0,
                &[1],
                &[L as u32],
                &[0, (b - a) as i32],
                &q[a * H * D..b * H * D],
                &k[a * HKV * D..b * HKV * D],
                &v[a * HKV * D..b * HKV * D],
                &mut got[a * H * D..b * H * D],
            )
            .expect("prefill_chunk");
        if b < L {
            let err = chunked.decode(0, &[1], &q[..H * D], &mut vec![0.0; H * D]).unwrap_err();
            assert_eq!(err.status, Status::BadState);
            assert!(err.message.contains("mid-prompt"), "{}", err.message);
        }
    }
    assert_eq!(got, want);
    for h in 0..HKV as u32 {
        assert_eq!(
            chunked.kept_positions(1, 0, h).unwrap(),
            whole.kept_positions(1, 0, h).unwrap()
        );
    }
    assert_eq!(chunked.memory_stats().unwrap(), whole.memory_stats().unwrap());

    let err = chunked
        .prefill_chunk(
            0,
            &[0],
            &[5, 5],
            &[0, 1],
            &q[..H * D],
            &k[..HKV * D],
            &v[..HKV * D],
            &mut got[..H * D],
        )
        .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("prompt_lens has 2 entries"), "{}", err.message);
}
