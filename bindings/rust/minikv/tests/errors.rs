//! Failures: each gives the right Status and a message that names what is wrong, and a
//! failed call changes nothing.

use minikv::{Backend, Config, Dtype, Error, KvCache, Preset, Status};

fn small() -> Config {
    let mut cfg = Config::new(1, 2, 1, 16);
    cfg.apply_preset(Preset::Paper); // G = 16 fits head_dim 16
    cfg.backend = Backend::Cpu;
    cfg.dtype = Dtype::F32;
    cfg.max_sequences = 2;
    cfg.max_seq_len = 64;
    cfg.residual_length = 16;
    cfg
}

fn create_err(cfg: &Config) -> Error {
    KvCache::new(cfg).expect_err("the config must be refused")
}

/// A named edit of a valid config and the texts its error message must contain.
type BadCase = (&'static str, Box<dyn Fn(&mut Config)>, &'static [&'static str]);

#[test]
fn bad_config_names_the_field() {
    let cases: Vec<BadCase> = vec![
        (
            "GQA",
            Box::new(|c| (c.num_heads, c.num_kv_heads) = (12, 8)),
            &["num_heads (12)", "num_kv_heads (8)"],
        ),
        ("head_dim", Box::new(|c| c.head_dim = 100), &["head_dim (100)"]),
        ("layers", Box::new(|c| c.num_layers = 0), &["num_layers (0)"]),
        ("key_bits", Box::new(|c| c.key_bits = 3), &["key_bits (3)"]),
        ("group", Box::new(|c| c.group_size = 8), &["group_size (8)"]),
        ("residual", Box::new(|c| c.residual_length = 24), &["residual_length (24)"]),
        ("ratio", Box::new(|c| c.heavy_ratio = 1.5), &["heavy_ratio (1.5)"]),
        ("pool_kernel", Box::new(|c| c.pool_kernel = 4), &["pool_kernel (4)"]),
        ("device", Box::new(|c| c.device_id = -1), &["device_id (-1)"]),
    ];
    for (name, edit, needles) in cases {
        let mut cfg = small();
        edit(&mut cfg);
        let err = create_err(&cfg);
        assert_eq!(err.status, Status::InvalidArgument, "{name}: {err}");
        assert_eq!(err.status.code(), 1);
        for needle in needles {
            assert!(err.message.contains(needle), "{name}: {:?} lacks {needle:?}", err.message);
        }
        // Display has the message and the status; std::error::Error works with `?`/Box.
        let shown = err.to_string();
        assert!(shown.contains(&err.message) && shown.contains("InvalidArgument"), "{shown}");
        let boxed: Box<dyn std::error::Error> = Box::new(err);
        assert!(!boxed.to_string().is_empty());
    }
    // Model dimensions left at 0 (Config::default) are refused too.
    let err = create_err(&Config::default());
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("num_layers"), "{err}");
}

#[test]
fn status_values_are_pinned() {
    let all = [
        (Status::InvalidArgument, 1, "MINIKV_ERR_INVALID_ARGUMENT"),
        (Status::OutOfMemory, 2, "MINIKV_ERR_OUT_OF_MEMORY"),
        (Status::CapacityExceeded, 3, "MINIKV_ERR_CAPACITY_EXCEEDED"),
        (Status::BadState, 4, "MINIKV_ERR_BAD_STATE"),
        (Status::Unsupported, 5, "MINIKV_ERR_UNSUPPORTED"),
        (Status::Device, 6, "MINIKV_ERR_DEVICE"),
        (Status::VersionMismatch, 7, "MINIKV_ERR_VERSION_MISMATCH"),
        (Status::Internal, 8, "MINIKV_ERR_INTERNAL"),
    ];
    for (status, code, name) in all {
        assert_eq!(status.code(), code);
        assert_eq!(Status::from_code(code), Some(status));
        assert!(status.description().starts_with(name), "{}", status.description());
    }
    assert_eq!(Status::from_code(0), None);
    assert_eq!(Status::from_code(99), None);
    assert_eq!(minikv::version_number(), minikv::HEADER_VERSION_NUMBER);
    assert_eq!(minikv::version_string(), env!("CARGO_PKG_VERSION"));
}

#[test]
fn state_errors_change_nothing() {
    let mut cache = KvCache::new(&small()).unwrap();
    let (q_row, kv_row) = (2 * 16, 16);
    let q = vec![0.5f32; 4 * q_row];
    let kv = vec![0.25f32; 4 * kv_row];
    let mut out = vec![0f32; 4 * q_row];

    // Decode and append before prefill.
    let err = cache.decode(0, &[0], &q[..q_row], &mut out[..q_row]).unwrap_err();
    assert_eq!(err.status, Status::BadState, "{err}");
    assert!(
        err.message.contains("minikv_decode") && err.message.contains("not been prefilled"),
        "{err}"
    );
    let err = cache.append(0, &[1], &kv[..kv_row], &kv[..kv_row]).unwrap_err();
    assert_eq!(err.status, Status::BadState, "{err}");

    // Ids and layers out of range.
    let err = cache.prefill(1, &[0], &[0, 4], &q, &kv, &kv, &mut out).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("layer (1)"), "{err}");
    let err = cache.prefill(0, &[5], &[0, 4], &q, &kv, &kv, &mut out).unwrap_err();
    assert!(err.message.contains("seq_ids[0] (5)"), "{err}");
    let err = cache.release(2).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("seq_id (2)"), "{err}");
    let err = cache.sequence_length(0, 3).unwrap_err();
    assert!(err.message.contains("layer (3)"), "{err}");
    let err = cache.kept_positions(0, 0, 1).unwrap_err();
    assert!(err.message.contains("kv_head (1)"), "{err}");
    let err = cache.kept_positions(0, 0, 0).unwrap_err();
    assert_eq!(err.status, Status::BadState, "{err}");

    // Checked here before C: slice lengths, cu_seqlens length, element type.
    let err = cache.prefill(0, &[0], &[0, 4], &q[..q_row], &kv, &kv, &mut out).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("q has 32 elements") && err.message.contains("128"), "{err}");
    let err = cache.prefill(0, &[0], &[0, 4], &q, &kv, &kv[1..], &mut out).unwrap_err();
    assert!(err.message.contains("v has 63"), "{err}");
    let err = cache.prefill(0, &[0], &[0, 4], &q, &kv, &kv, &mut out[..5]).unwrap_err();
    assert!(err.message.contains("out has 5"), "{err}");
    let err = cache.prefill(0, &[0, 1], &[0, 4], &q, &kv, &kv, &mut out).unwrap_err();
    assert!(err.message.contains("cu_seqlens has 2 entries"), "{err}");
    let err = cache.prefill(0, &[0], &[0, -4], &q, &kv, &kv, &mut out).unwrap_err();
    assert!(err.message.contains("must be >= 0"), "{err}");
    let half = vec![minikv::F16::default(); 4 * q_row];
    let mut half_out = half.clone();
    let err = cache.decode(0, &[0], &half[..q_row], &mut half_out[..q_row]).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("F16") && err.message.contains("F32"), "{err}");
    // A bad length checked by C: cu_seqlens[0] must be 0.
    let err = cache.prefill(0, &[0], &[1, 4], &q, &kv, &kv, &mut out).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("cu_seqlens[0] (1)"), "{err}");
    // Repeated ids in one call.
    let err = cache.append(0, &[0, 0], &kv[..2 * kv_row], &kv[..2 * kv_row]).unwrap_err();
    assert!(err.message.contains("appears twice"), "{err}");

    // Nothing of that changed the cache.
    assert_eq!(cache.memory_stats().unwrap().tokens_seen, 0);
    assert_eq!(cache.sequence_length(0, 0).unwrap().tokens_seen, 0);

    // The same prompt now succeeds.
    cache.prefill(0, &[0], &[0, 4], &q, &kv, &kv, &mut out).unwrap();
    assert_eq!(cache.sequence_length(0, 0).unwrap().tokens_seen, 4);
}

#[test]
fn auto_backend_is_resolved_at_create() {
    let mut cfg = small();
    cfg.backend = Backend::Auto; // CPU on a machine without CUDA, CUDA on a GPU machine
    let mut cache = KvCache::new(&cfg).unwrap();
    assert_ne!(cache.config().backend, Backend::Auto);
    let q = vec![0f32; 32];
    let mut out = vec![0f32; 32];
    let err = cache.decode(0, &[0], &q, &mut out).unwrap_err();
    if cache.config().backend == Backend::Cpu {
        // Host slices are accepted; C then reports the missing prefill.
        assert_eq!(err.status, Status::BadState, "{err}");
    } else {
        // A CUDA cache refuses host slices before calling C.
        assert_eq!(err.status, Status::InvalidArgument);
        assert!(err.message.contains("Backend::Cpu") && err.message.contains("_raw"), "{err}");
    }
}

#[test]
fn raw_calls_check_the_stream_for_cpu() {
    let mut cache = KvCache::new(&small()).unwrap();
    let (q, k) = (vec![0.1f32; 2 * 32], vec![0.1f32; 2 * 16]);
    let mut out = vec![0f32; 2 * 32];
    let mut fake_stream = 0u8;
    let err = unsafe {
        cache.prefill_raw(
            0,
            &[0],
            &[0, 2],
            q.as_ptr().cast(),
            k.as_ptr().cast(),
            k.as_ptr().cast(),
            out.as_mut_ptr().cast(),
            (&mut fake_stream as *mut u8).cast(),
        )
    }
    .unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);
    assert!(err.message.contains("stream must be NULL"), "{err}");
    unsafe {
        cache
            .prefill_raw(
                0,
                &[0],
                &[0, 2],
                q.as_ptr().cast(),
                k.as_ptr().cast(),
                k.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                std::ptr::null_mut(),
            )
            .unwrap();
    }
    assert_eq!(cache.sequence_length(0, 0).unwrap().tokens_seen, 2);
}

#[test]
fn full_pool_is_capacity_exceeded_until_a_release() {
    let mut cfg = small();
    cfg.key_bits = 16;
    cfg.value_bits = 16;
    cfg.heavy_ratio = 1.0;
    cfg.recent_ratio = 0.0;
    cfg.max_tokens = 32; // two blocks of 16 tokens
    let mut cache = KvCache::new(&cfg).unwrap();
    let (q_row, kv_row, len) = (32, 16, 40);
    let q = vec![0.1f32; len * q_row];
    let kv = vec![0.2f32; len * kv_row];
    let mut out = vec![0f32; len * q_row];
    // 40 kept tokens: 32 in two blocks, 8 in the residual.
    cache.prefill(0, &[0], &[0, len as i32], &q, &kv, &kv, &mut out).unwrap();
    let err = cache
        .prefill(
            0,
            &[1],
            &[0, 16],
            &q[..16 * q_row],
            &kv[..16 * kv_row],
            &kv[..16 * kv_row],
            &mut out[..16 * q_row],
        )
        .unwrap_err();
    assert_eq!(err.status, Status::CapacityExceeded, "{err}");
    assert!(err.message.contains("release"), "{err}");
    assert_eq!(cache.sequence_length(1, 0).unwrap().tokens_seen, 0);
    // Appends fill the residual until a flush needs a third block.
    for _ in 0..7 {
        cache.append(0, &[0], &kv[..kv_row], &kv[..kv_row]).unwrap();
    }
    let err = cache.append(0, &[0], &kv[..kv_row], &kv[..kv_row]).unwrap_err();
    assert_eq!(err.status, Status::CapacityExceeded, "{err}");
    assert_eq!(
        cache.sequence_length(0, 0).unwrap().tokens_seen,
        47,
        "the failed append changed nothing"
    );

    cache.release(0).unwrap();
    cache
        .prefill(
            0,
            &[1],
            &[0, 16],
            &q[..16 * q_row],
            &kv[..16 * kv_row],
            &kv[..16 * kv_row],
            &mut out[..16 * q_row],
        )
        .unwrap();
    assert_eq!(cache.sequence_length(1, 0).unwrap().tokens_cached, 16);
}

#[test]
fn max_seq_len_is_capacity_exceeded() {
    let mut cfg = small();
    cfg.max_seq_len = 5;
    let mut cache = KvCache::new(&cfg).unwrap();
    let q = vec![0.1f32; 4 * 32];
    let kv = vec![0.2f32; 4 * 16];
    let mut out = vec![0f32; 4 * 32];
    cache.prefill(0, &[0], &[0, 4], &q, &kv, &kv, &mut out).unwrap();
    cache.append(0, &[0], &kv[..16], &kv[..16]).unwrap();
    let err = cache.append(0, &[0], &kv[..16], &kv[..16]).unwrap_err();
    assert_eq!(err.status, Status::CapacityExceeded);
    assert!(err.message.contains("max_seq_len"), "{err}");
}
