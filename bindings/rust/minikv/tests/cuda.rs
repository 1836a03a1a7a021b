//! The raw (device pointer + stream) path on the CUDA backend: buffers allocated with the
//! CUDA runtime, loaded with dlopen at run time so this test builds and links everywhere.
//!
//! Without libcudart, a GPU, or a CUDA build of libminikv the test says so and passes;
//! with MINIKV_REQUIRE_CUDA=1 (set on GPU machines) any of those is a failure.
//! 1. lossless (16-bit, keep everything) on CUDA: every prefill and decode output equals
//!    attention computed here in f64 across flushes and a ragged batch;
//! 2. the defaults (2-bit) on CUDA and on CPU fed the same data agree: identical memory
//!    statistics, and decode outputs close.

mod common;

use core::ffi::{c_char, c_int, c_void};
use std::ffi::CString;

use common::{assert_close, attention, rows, Dims, Rng};
use minikv::{Backend, Config, Dtype, Element, KvCache, Status, F16};

extern "C" {
    fn dlopen(filename: *const c_char, flag: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
}
const RTLD_NOW: c_int = 2;
const H2D: c_int = 1; // cudaMemcpyHostToDevice
const D2H: c_int = 2; // cudaMemcpyDeviceToHost

type MallocFn = unsafe extern "C" fn(*mut *mut c_void, usize) -> c_int;
type FreeFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type MemcpyFn = unsafe extern "C" fn(*mut c_void, *const c_void, usize, c_int) -> c_int;
type StreamCreateFn = unsafe extern "C" fn(*mut *mut c_void) -> c_int;
type StreamFn = unsafe extern "C" fn(*mut c_void) -> c_int;
type CountFn = unsafe extern "C" fn(*mut c_int) -> c_int;

/// The few CUDA runtime entry points the test needs.
struct Cuda {
    malloc: MallocFn,
    free: FreeFn,
    memcpy: MemcpyFn,
    stream_create: StreamCreateFn,
    stream_sync: StreamFn,
    stream_destroy: StreamFn,
    device_count: CountFn,
}

fn required() -> bool {
    std::env::var_os("MINIKV_REQUIRE_CUDA").is_some_and(|v| v != "0")
}

/// Returns None (after saying why) when the test cannot run here.
fn skip(why: &str) -> Option<Cuda> {
    assert!(!required(), "MINIKV_REQUIRE_CUDA is set but {why}");
    eprintln!("CUDA test skipped: {why}");
    None
}

fn load_cuda() -> Option<Cuda> {
    let handle = ["libcudart.so", "libcudart.so.13", "libcudart.so.12"].iter().find_map(|name| {
        let c = CString::new(*name).unwrap();
        // SAFETY: a valid C string; dlopen returns NULL on failure.
        let h = unsafe { dlopen(c.as_ptr(), RTLD_NOW) };
        (!h.is_null()).then_some(h)
    });
    let Some(handle) = handle else { return skip("libcudart.so cannot be loaded") };
    let sym = |name: &str| {
        let c = CString::new(name).unwrap();
        // SAFETY: a live handle and a valid C string.
        let p = unsafe { dlsym(handle, c.as_ptr()) };
        assert!(!p.is_null(), "libcudart lacks {name}");
        p
    };
    // SAFETY: each symbol has the C signature written in `Cuda` (cuda_runtime_api.h).
    let cuda = unsafe {
        Cuda {
            malloc: std::mem::transmute::<*mut c_void, MallocFn>(sym("cudaMalloc")),
            free: std::mem::transmute::<*mut c_void, FreeFn>(sym("cudaFree")),
            memcpy: std::mem::transmute::<*mut c_void, MemcpyFn>(sym("cudaMemcpy")),
            stream_create: std::mem::transmute::<*mut c_void, StreamCreateFn>(sym(
                "cudaStreamCreate",
            )),
            stream_sync: std::mem::transmute::<*mut c_void, StreamFn>(sym("cudaStreamSynchronize")),
            stream_destroy: std::mem::transmute::<*mut c_void, StreamFn>(sym("cudaStreamDestroy")),
            device_count: std::mem::transmute::<*mut c_void, CountFn>(sym("cudaGetDeviceCount")),
        }
    };
    let mut n = 0;
    // SAFETY: valid out pointer.
    if unsafe { (cuda.device_count)(&mut n) } != 0 || n == 0 {
        return skip("no CUDA device");
    }
    Some(cuda)
}

fn ok(what: &str, code: c_int) {
    assert_eq!(code, 0, "{what} failed with cudaError {code}");
}

/// A device buffer of `len` elements of T.
struct DevBuf<'a, T> {
    cuda: &'a Cuda,
    ptr: *mut c_void,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<'a, T: Element> DevBuf<'a, T> {
    fn new(cuda: &'a Cuda, len: usize) -> Self {
        let mut ptr = std::ptr::null_mut();
        // SAFETY: valid out pointer.
        ok("cudaMalloc", unsafe { (cuda.malloc)(&mut ptr, len.max(1) * size_of::<T>()) });
        DevBuf { cuda, ptr, len, _t: std::marker::PhantomData }
    }
    fn from_host(cuda: &'a Cuda, data: &[T]) -> Self {
        let b = Self::new(cuda, data.len());
        // SAFETY: both buffers hold data.len() elements.
        ok("cudaMemcpy H2D", unsafe {
            (cuda.memcpy)(b.ptr, data.as_ptr().cast(), size_of_val(data), H2D)
        });
        b
    }
    fn to_host(&self) -> Vec<T> {
        let mut v = vec![T::from_f32(0.0); self.len];
        // SAFETY: both buffers hold `len` elements; cudaMemcpy waits for prior work.
        ok("cudaMemcpy D2H", unsafe {
            (self.cuda.memcpy)(v.as_mut_ptr().cast(), self.ptr, self.len * size_of::<T>(), D2H)
        });
        v
    }
}

impl<T> Drop for DevBuf<'_, T> {
    fn drop(&mut self) {
        // SAFETY: allocated by cudaMalloc; callers synchronize before dropping.
        unsafe { (self.cuda.free)(self.ptr) };
    }
}

/// `KvCache::new` on the CUDA backend, or None when this libminikv has no CUDA backend.
fn cuda_cache(cfg: &Config) -> Option<KvCache> {
    match KvCache::new(cfg) {
        Ok(c) => Some(c),
        Err(e) if e.status == Status::Unsupported => {
            skip(&format!("libminikv has no CUDA backend ({e})"));
            None
        }
        Err(e) => panic!("create: {e}"),
    }
}

const D: Dims = Dims { heads: 4, kv_heads: 2, head_dim: 64 };

fn to_f64<T: Element>(x: &[T]) -> Vec<f64> {
    x.iter().map(|e| e.to_f32() as f64).collect()
}

fn gen<T: Element>(rng: &mut Rng, n: usize) -> Vec<T> {
    rng.vec(n).into_iter().map(T::from_f32).collect()
}

#[test]
fn cuda_raw_path_equals_f64_attention() {
    let Some(cuda) = load_cuda() else { return };
    let mut cfg = Config::new(2, D.heads as u32, D.kv_heads as u32, D.head_dim as u32);
    cfg.backend = Backend::Cuda;
    cfg.dtype = Dtype::F16;
    cfg.max_sequences = 4;
    cfg.max_seq_len = 128;
    (cfg.key_bits, cfg.value_bits) = (16, 16);
    (cfg.heavy_ratio, cfg.recent_ratio) = (1.0, 0.0); // keep everything: lossless
    cfg.residual_length = 16;
    let Some(mut cache) = cuda_cache(&cfg) else { return };

    // Host slices are refused for a CUDA cache.
    let host = vec![F16::default(); D.q_row()];
    let mut host_out = host.clone();
    let err = cache.decode(0, &[0], &host, &mut host_out).unwrap_err();
    assert_eq!(err.status, Status::InvalidArgument);

    let mut stream = std::ptr::null_mut();
    // SAFETY: valid out pointer.
    ok("cudaStreamCreate", unsafe { (cuda.stream_create)(&mut stream) });
    let sync = || ok("cudaStreamSynchronize", unsafe { (cuda.stream_sync)(stream) });

    let mut rng = Rng::new(21);
    let seq_ids = [2u32, 0, 3];
    let lens = [5usize, 23, 40];
    let cu = [0i32, 5, 28, 68];
    let total = 68;
    let (atol, rtol) = (1e-3, 2e-3); // binary16 outputs after f32 arithmetic
                                     // Per sequence and layer: (key rows, value rows) seen so far.
    type Rows = Vec<Vec<f64>>;
    let mut hist: Vec<Vec<(Rows, Rows)>> = vec![vec![Default::default(); 2]; 3];
    for layer in 0..2u32 {
        let (q, k, v) = (
            gen::<F16>(&mut rng, total * D.q_row()),
            gen::<F16>(&mut rng, total * D.kv_row()),
            gen::<F16>(&mut rng, total * D.kv_row()),
        );
        let (dq, dk, dv) = (
            DevBuf::from_host(&cuda, &q),
            DevBuf::from_host(&cuda, &k),
            DevBuf::from_host(&cuda, &v),
        );
        let dout = DevBuf::<F16>::new(&cuda, total * D.q_row());
        // SAFETY: device buffers of the sizes the layout needs, a live stream; synchronized
        // before they are read or freed.
        unsafe {
            cache.prefill_raw(layer, &seq_ids, &cu, dq.ptr, dk.ptr, dv.ptr, dout.ptr, stream)
        }
        .expect("prefill_raw");
        sync();
        let out = to_f64(&dout.to_host());
        let (qx, kr, vr) =
            (to_f64(&q), rows(&to_f64(&k), D.kv_row()), rows(&to_f64(&v), D.kv_row()));
        for s in 0..3 {
            let (b, e) = (cu[s] as usize, cu[s + 1] as usize);
            for i in b..e {
                let want =
                    attention(D, &qx[i * D.q_row()..(i + 1) * D.q_row()], &kr[b..=i], &vr[b..=i]);
                let what = format!("CUDA prefill layer {layer} seq {s} token {}", i - b);
                assert_close(&what, &out[i * D.q_row()..(i + 1) * D.q_row()], &want, atol, rtol);
            }
            hist[s][layer as usize] = (kr[b..e].to_vec(), vr[b..e].to_vec());
            let every: Vec<i32> = (0..lens[s] as i32).collect();
            assert_eq!(cache.kept_positions(seq_ids[s], layer, 1).unwrap(), every);
        }
    }
    for step in 0..40 {
        for layer in 0..2u32 {
            let (k, v, q) = (
                gen::<F16>(&mut rng, 3 * D.kv_row()),
                gen::<F16>(&mut rng, 3 * D.kv_row()),
                gen::<F16>(&mut rng, 3 * D.q_row()),
            );
            let (dk, dv, dq) = (
                DevBuf::from_host(&cuda, &k),
                DevBuf::from_host(&cuda, &v),
                DevBuf::from_host(&cuda, &q),
            );
            let dout = DevBuf::<F16>::new(&cuda, 3 * D.q_row());
            // SAFETY: as above.
            unsafe {
                cache.append_raw(layer, &seq_ids, dk.ptr, dv.ptr, stream).expect("append_raw");
                cache.decode_raw(layer, &seq_ids, dq.ptr, dout.ptr, stream).expect("decode_raw");
            }
            sync();
            let out = to_f64(&dout.to_host());
            let (kr, vr, qx) =
                (rows(&to_f64(&k), D.kv_row()), rows(&to_f64(&v), D.kv_row()), to_f64(&q));
            for s in 0..3 {
                let h = &mut hist[s][layer as usize];
                h.0.push(kr[s].clone());
                h.1.push(vr[s].clone());
                let want = attention(D, &qx[s * D.q_row()..(s + 1) * D.q_row()], &h.0, &h.1);
                let what = format!("CUDA decode step {step} layer {layer} seq {s}");
                assert_close(&what, &out[s * D.q_row()..(s + 1) * D.q_row()], &want, atol, rtol);
            }
        }
    }
    let stats = cache.memory_stats().unwrap();
    assert_eq!(stats.tokens_seen, 2 * (68 + 3 * 40));
    assert_eq!(stats.tokens_cached, stats.tokens_seen);
    cache.release(0).unwrap();
    sync();
    drop(cache);
    // SAFETY: no work is queued on it any more.
    ok("cudaStreamDestroy", unsafe { (cuda.stream_destroy)(stream) });
}

#[test]
fn cuda_and_cpu_agree_with_the_defaults() {
    let Some(cuda) = load_cuda() else { return };
    let dims = Dims { heads: 8, kv_heads: 2, head_dim: 128 };
    // The defaults: K4V2, G 32, 4 sinks, 25% + 25%, R 64 flushed 32 at a time.
    let mut cfg = Config::new(1, 8, 2, 128);
    cfg.max_sequences = 2;
    cfg.max_seq_len = 1024;
    cfg.backend = Backend::Cuda;
    let Some(mut gpu) = cuda_cache(&cfg) else { return };
    cfg.backend = Backend::Cpu;
    let mut cpu = KvCache::new(&cfg).unwrap();

    let mut rng = Rng::new(5);
    let (seq_ids, cu) = ([1u32, 0], [0i32, 700, 1000]);
    let total = 1000;
    let (q, k, v) = (
        gen::<F16>(&mut rng, total * dims.q_row()),
        gen::<F16>(&mut rng, total * dims.kv_row()),
        gen::<F16>(&mut rng, total * dims.kv_row()),
    );
    let mut cpu_out = vec![F16::default(); total * dims.q_row()];
    cpu.prefill(0, &seq_ids, &cu, &q, &k, &v, &mut cpu_out).unwrap();
    let (dq, dk, dv) =
        (DevBuf::from_host(&cuda, &q), DevBuf::from_host(&cuda, &k), DevBuf::from_host(&cuda, &v));
    let dout = DevBuf::<F16>::new(&cuda, total * dims.q_row());
    // SAFETY: sized device buffers; the NULL stream; cudaMemcpy below waits for the work.
    unsafe {
        gpu.prefill_raw(0, &seq_ids, &cu, dq.ptr, dk.ptr, dv.ptr, dout.ptr, std::ptr::null_mut())
    }
    .expect("prefill_raw");
    assert_close("prefill CUDA vs CPU", &to_f64(&dout.to_host()), &to_f64(&cpu_out), 2e-3, 4e-3);

    let mut worst = 0.0f64;
    for step in 0..150 {
        let (nk, nv, nq) = (
            gen::<F16>(&mut rng, 2 * dims.kv_row()),
            gen::<F16>(&mut rng, 2 * dims.kv_row()),
            gen::<F16>(&mut rng, 2 * dims.q_row()),
        );
        cpu.append(0, &seq_ids, &nk, &nv).unwrap();
        let mut co = vec![F16::default(); 2 * dims.q_row()];
        cpu.decode(0, &seq_ids, &nq, &mut co).unwrap();
        let (dk, dv, dq) = (
            DevBuf::from_host(&cuda, &nk),
            DevBuf::from_host(&cuda, &nv),
            DevBuf::from_host(&cuda, &nq),
        );
        let dout = DevBuf::<F16>::new(&cuda, 2 * dims.q_row());
        // SAFETY: as above.
        unsafe {
            gpu.append_raw(0, &seq_ids, dk.ptr, dv.ptr, std::ptr::null_mut()).expect("append_raw");
            gpu.decode_raw(0, &seq_ids, dq.ptr, dout.ptr, std::ptr::null_mut())
                .expect("decode_raw");
        }
        let what = format!("decode step {step} CUDA vs CPU");
        worst = worst.max(assert_close(&what, &to_f64(&dout.to_host()), &to_f64(&co), 5e-3, 1e-2));
    }
    eprintln!("largest |CUDA - CPU| decode difference over 150 steps: {worst:e}");
    let (g, c) = (gpu.memory_stats().unwrap(), cpu.memory_stats().unwrap());
    assert_eq!(
        (g.used_bytes, g.tokens_seen, g.tokens_cached),
        (c.used_bytes, c.tokens_seen, c.tokens_cached)
    );
    assert_eq!(g.compression_ratio, c.compression_ratio);
    for (id, kvh) in [(0, 0), (1, 1)] {
        let (gk, ck) =
            (gpu.kept_positions(id, 0, kvh).unwrap(), cpu.kept_positions(id, 0, kvh).unwrap());
        let same = gk.iter().filter(|p| ck.binary_search(p).is_ok()).count();
        assert!(
            same + 2 >= ck.len(),
            "seq {id} head {kvh}: only {same} of {} kept positions agree",
            ck.len()
        );
    }
}

#[test]
fn cuda_append_decode_raw_equals_append_then_decode() {
    // One launch where no flush is due, append then decode where one is (R = 16): either
    // way the same bytes as append_raw + decode_raw on a second cache.
    let Some(cuda) = load_cuda() else { return };
    let mut cfg = Config::new(1, D.heads as u32, D.kv_heads as u32, D.head_dim as u32);
    cfg.backend = Backend::Cuda;
    cfg.dtype = Dtype::F16;
    cfg.max_sequences = 2;
    cfg.max_seq_len = 256;
    (cfg.group_size, cfg.residual_length) = (16, 16);
    let Some(mut fused) = cuda_cache(&cfg) else { return };
    let mut split = KvCache::new(&cfg).unwrap();
    let mut rng = Rng::new(9);
    let (seq_ids, cu, total) = ([1u32, 0], [0i32, 90, 150], 150);
    let (q, k) =
        (gen::<F16>(&mut rng, total * D.q_row()), gen::<F16>(&mut rng, total * D.kv_row()));
    let (dq, dk, dout) = (
        DevBuf::from_host(&cuda, &q),
        DevBuf::from_host(&cuda, &k),
        DevBuf::<F16>::new(&cuda, total * D.q_row()),
    );
    for cache in [&mut fused, &mut split] {
        // SAFETY: sized device buffers; the NULL stream; cudaMemcpy waits for the work.
        unsafe {
            cache.prefill_raw(
                0,
                &seq_ids,
                &cu,
                dq.ptr,
                dk.ptr,
                dk.ptr,
                dout.ptr,
                std::ptr::null_mut(),
            )
        }
        .expect("prefill_raw");
    }
    for step in 0..40 {
        let (nq, nk, nv) = (
            gen::<F16>(&mut rng, 2 * D.q_row()),
            gen::<F16>(&mut rng, 2 * D.kv_row()),
            gen::<F16>(&mut rng, 2 * D.kv_row()),
        );
        let (dq, dk, dv) = (
            DevBuf::from_host(&cuda, &nq),
            DevBuf::from_host(&cuda, &nk),
            DevBuf::from_host(&cuda, &nv),
        );
        let (da, db) =
            (DevBuf::<F16>::new(&cuda, 2 * D.q_row()), DevBuf::<F16>::new(&cuda, 2 * D.q_row()));
        // SAFETY: as above.
        unsafe {
            fused
                .append_decode_raw(
                    0,
                    &seq_ids,
                    dq.ptr,
                    dk.ptr,
                    dv.ptr,
                    da.ptr,
                    std::ptr::null_mut(),
                )
                .expect("append_decode_raw");
            split
                .append_raw(0, &seq_ids, dk.ptr, dv.ptr, std::ptr::null_mut())
                .expect("append_raw");
            split
                .decode_raw(0, &seq_ids, dq.ptr, db.ptr, std::ptr::null_mut())
                .expect("decode_raw");
        }
        let bits = |x: Vec<F16>| x.iter().map(|e| e.to_f32().to_bits()).collect::<Vec<_>>();
        assert!(bits(da.to_host()) == bits(db.to_host()), "step {step}: outputs differ");
    }
}
