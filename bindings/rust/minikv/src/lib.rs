//! Safe Rust bindings to libminikv, the MiniKV compressed KV cache (arXiv 2411.18077):
//! per layer and KV head it keeps a recent window plus the prompt's heavy-hitter tokens,
//! quantizes them to 2 (or 4) bits KIVI-style, and computes decode attention directly over
//! the compressed cache.
//!
//! ```no_run
//! use minikv::{Backend, Config, Dtype, KvCache};
//!
//! # fn main() -> minikv::Result<()> {
//! let mut cfg = Config::new(1, 4, 2, 64); // layers, heads, KV heads, head_dim
//! cfg.backend = Backend::Cpu;
//! cfg.dtype = Dtype::F32;
//! cfg.max_seq_len = 512;
//! let mut cache = KvCache::new(&cfg)?;
//!
//! let (h, hkv, d, len) = (4, 2, 64, 100);
//! let (q, k, v) = (vec![0.1f32; len * h * d], vec![0.2f32; len * hkv * d], vec![0.3f32; len * hkv * d]);
//! let mut out = vec![0f32; len * h * d];
//! cache.prefill(0, &[0], &[0, len as i32], &q, &k, &v, &mut out)?; // prompt of slot 0
//! cache.append(0, &[0], &k[..hkv * d], &v[..hkv * d])?;            // a new token's K/V
//! let mut dec = vec![0f32; h * d];
//! cache.decode(0, &[0], &q[..h * d], &mut dec)?;                   // its attention output
//! println!("compression {:.3}", cache.memory_stats()?.compression_ratio);
//! cache.release(0)?;
//! # Ok(()) }
//! ```
//!
//! - [`KvCache`] owns the C handle and destroys it on drop; it is `Send`, not `Sync`.
//! - Every fallible call returns [`Result<T>`]; [`Error`] carries the [`Status`] and the
//!   library's message for that call (read from the handle right after the call).
//! - Host buffers are slices of an [`Element`] type (`f32`, [`F16`], [`Bf16`]) whose
//!   lengths are checked against the [`Config`] before calling C; they need
//!   [`Backend::Cpu`]. Device buffers (CUDA) go through the `unsafe` `*_raw` methods with
//!   raw pointers and a `cudaStream_t` as `*mut c_void`.
//! - The raw C API is re-exported as [`sys`].
//!
//! A cache cannot be used after it is dropped: the compiler refuses it.
//! ```compile_fail,E0382
//! let cache = minikv::KvCache::new(&minikv::Config::new(1, 1, 1, 16)).unwrap();
//! drop(cache);
//! cache.memory_stats();
//! ```

pub use minikv_sys as sys;

mod cache;
mod config;
mod element;
mod result;

pub use cache::{KvCache, MemoryStats, SequenceLength};
pub use config::{Backend, BudgetPolicy, Config, Dtype, Preset, ScoreMode};
pub use element::{Bf16, Element, F16};
pub use result::{Error, Result, Status};

/// `major*10000 + minor*100 + patch` of the header these bindings were generated from.
pub const HEADER_VERSION_NUMBER: u32 = sys::MINIKV_VERSION_NUMBER;

/// `major*10000 + minor*100 + patch` of the loaded library.
pub fn version_number() -> u32 {
    // SAFETY: no arguments, never fails.
    unsafe { sys::minikv_version_number() }
}

/// The loaded library's version, "MAJOR.MINOR.PATCH".
pub fn version_string() -> &'static str {
    // SAFETY: never NULL, static storage.
    unsafe { result::static_str(sys::minikv_version_string()) }
}

/// libminikv's version rule (`MINIKV_VERSION_COMPATIBLE` in minikv.h): a library serves
/// bindings generated from version `built` when it has the same major version and is not
/// older. [`KvCache::new`] applies it to the loaded library.
pub(crate) fn compatible(built: u32, loaded: u32) -> bool {
    loaded / 10_000 == built / 10_000 && loaded >= built
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn version_rule() {
        let built = HEADER_VERSION_NUMBER;
        let major = built / 10_000;
        assert_eq!(major, sys::MINIKV_VERSION_MAJOR);
        assert_eq!(
            env!("CARGO_PKG_VERSION"),
            format!(
                "{}.{}.{}",
                sys::MINIKV_VERSION_MAJOR,
                sys::MINIKV_VERSION_MINOR,
                sys::MINIKV_VERSION_PATCH
            )
        );
        for (loaded, want) in [
            (built, true),
            (built + 1, true),
            (built + 100, true),
            (major * 10_000 + 9_999, true),
            ((major + 1) * 10_000, false),
            ((major + 1) * 10_000 + built % 10_000, false),
        ] {
            assert_eq!(compatible(built, loaded), want, "loaded {loaded}");
        }
        if built % 10_000 != 0 {
            assert!(!compatible(built, built - 1));
        }
        assert!(compatible(built, version_number()), "loaded {}", version_string());
    }
}
