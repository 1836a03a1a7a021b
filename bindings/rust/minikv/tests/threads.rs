//! A handle used by two threads at once. `KvCache` is `Send` but not `Sync`, so safe Rust
//! cannot share one between threads (a compile error: the `compile_fail` example on
//! `KvCache`). Through the raw handle (`as_ptr`) the C library detects the overlap: the
//! second call fails with BAD_STATE naming both calls and changes nothing.

use std::ffi::CStr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::thread;

use minikv::{sys, Backend, Config, Dtype, KvCache};

/// The raw handle, shared on purpose to make two calls overlap.
#[derive(Clone, Copy)]
struct Raw(*mut sys::minikv_cache);
// SAFETY: only used to show that the C library rejects the overlapping call.
unsafe impl Send for Raw {}
unsafe impl Sync for Raw {}

impl Raw {
    // A method, so closures capture the whole `Raw` (Send + Sync), not its pointer field.
    fn ptr(self) -> *mut sys::minikv_cache {
        self.0
    }
}

#[test]
fn overlapping_calls_on_one_raw_handle_fail_with_bad_state() {
    const L: usize = 768;
    let mut cfg = Config::new(2, 8, 2, 64);
    cfg.backend = Backend::Cpu;
    cfg.dtype = Dtype::F32;
    cfg.max_sequences = 2;
    cfg.max_seq_len = L as u32;
    let cache = KvCache::new(&cfg).expect("create");
    let raw = Raw(cache.as_ptr());
    let fill =
        |n: usize| (0..n).map(|i| ((i * 7919 % 113) as f32) / 113.0 - 0.5).collect::<Vec<_>>();
    let (q, k, v) = (fill(L * 8 * 64), fill(L * 2 * 64), fill(L * 2 * 64));
    let mut overlaps = 0u32;
    for attempt in 0..50u32 {
        if overlaps > 0 {
            break;
        }
        let (layer, seq) = (attempt % 2, attempt / 2 % 2);
        let phase = AtomicU32::new(0); // 1: the prefill is about to start, 2: it returned
        let prefill_status = thread::scope(|s| {
            let other = s.spawn(|| {
                let mut out = vec![0f32; L * 8 * 64];
                let cu = [0i32, L as i32];
                phase.store(1, Ordering::SeqCst);
                // SAFETY: live handle, host buffers of the sizes the config implies.
                let st = unsafe {
                    sys::minikv_prefill(
                        raw.ptr(),
                        layer,
                        1,
                        &seq,
                        cu.as_ptr(),
                        q.as_ptr().cast(),
                        k.as_ptr().cast(),
                        v.as_ptr().cast(),
                        out.as_mut_ptr().cast(),
                        std::ptr::null_mut(),
                    )
                };
                phase.store(2, Ordering::SeqCst);
                st
            });
            while phase.load(Ordering::SeqCst) == 0 {
                thread::yield_now();
            }
            while phase.load(Ordering::SeqCst) == 1 {
                let mut seen = 0u64;
                // SAFETY: live handle; the library itself refuses the overlap.
                let st = unsafe {
                    sys::minikv_sequence_length(
                        raw.ptr(),
                        seq,
                        layer,
                        &mut seen,
                        std::ptr::null_mut(),
                    )
                };
                if st == sys::minikv_status::MINIKV_ERR_BAD_STATE {
                    // SAFETY: never NULL; copied right away on this thread.
                    let msg = unsafe { CStr::from_ptr(sys::minikv_last_error_message()) };
                    let msg = msg.to_string_lossy();
                    assert!(
                        msg.starts_with(
                            "minikv_sequence_length: the cache is in use by minikv_prefill"
                        ),
                        "{msg}"
                    );
                    overlaps += 1;
                } else {
                    assert_eq!(st, sys::minikv_status::MINIKV_OK);
                    assert!(seen == 0 || seen == L as u64, "seen {seen}");
                }
            }
            other.join().unwrap()
        });
        if prefill_status == sys::minikv_status::MINIKV_OK {
            // SAFETY: live handle.
            assert_eq!(
                unsafe { sys::minikv_sequence_release(raw.ptr(), seq) },
                sys::minikv_status::MINIKV_OK
            );
        } else {
            // The prefill found the handle held by a query: BAD_STATE, nothing changed.
            assert_eq!(prefill_status, sys::minikv_status::MINIKV_ERR_BAD_STATE);
        }
    }
    assert!(overlaps > 0, "no query overlapped a prefill in 50 attempts");
}
