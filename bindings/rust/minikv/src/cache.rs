//! [`KvCache`]: the owned cache handle.

use core::ffi::c_void;
use core::ptr::{self, NonNull};
use std::fmt;

use crate::result::{Error, Result, Status};
use crate::{sys, Backend, Config, Element};

/// Positions seen and tokens kept for one sequence and layer
/// ([`KvCache::sequence_length`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequenceLength {
    /// Prompt + appended positions.
    pub tokens_seen: u64,
    /// Of those, the tokens kept in the cache (quantized + residual).
    pub tokens_cached: u64,
}

/// Memory use of the whole cache ([`KvCache::memory_stats`]); `minikv_memory_stats`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct MemoryStats {
    /// Reserved for KV storage: blocks + residuals + position index.
    pub pool_bytes: u64,
    /// Codes + scales/zero-points of quantized tokens + 16-bit tokens.
    pub used_bytes: u64,
    /// Scratch reserved for prefill/decode.
    pub workspace_bytes: u64,
    /// Prompt + appended positions, summed over sequences and layers.
    pub tokens_seen: u64,
    /// Of those, kept in the cache.
    pub tokens_cached: u64,
    /// `tokens_seen * num_kv_heads * head_dim * 2 (K,V) * 2 bytes`.
    pub fp16_equivalent_bytes: u64,
    /// `1 - used_bytes / fp16_equivalent_bytes`; 0 when empty.
    pub compression_ratio: f64,
}

/// The compressed KV cache of up to `max_sequences` sequences, all layers; frees
/// everything on drop (`minikv_cache_destroy`, which for CUDA first waits for this cache's
/// queued work).
///
/// `Send` but not `Sync`: the handle is not internally synchronized (even a failing query
/// records its message in the handle), so calls that change it take `&mut self` and the
/// handle moves between threads but is never shared. (Sharing the raw handle from
/// [`as_ptr`](Self::as_ptr) anyway makes the C library fail an overlapping call with
/// `Status::BadState`.)
///
/// ```compile_fail
/// fn shared_between_threads<T: Sync>() {}
/// shared_between_threads::<minikv::KvCache>();
/// ```
///
/// Host buffers go through the slice methods ([`prefill`](Self::prefill),
/// [`append`](Self::append), [`decode`](Self::decode)), which check every length and the
/// element type against the config before calling C, and need a cache created with
/// the CPU backend (`Backend::Auto` resolves at create). Device buffers go through the `unsafe` `*_raw` methods.
///
/// Tensor layouts (tokens-major, contiguous; H = num_heads, Hkv = num_kv_heads,
/// D = head_dim):
/// - prefill `q`, `out`: `[total_tokens, H, D]`; `k`, `v`: `[total_tokens, Hkv, D]`
/// - append `k`, `v`: `[n_seqs, Hkv, D]`
/// - decode `q`, `out`: `[n_seqs, H, D]`
pub struct KvCache {
    raw: NonNull<sys::minikv_cache>,
    config: Config,
}

// SAFETY: a handle may be used from any thread, one at a time (minikv.h, "Threading");
// &mut self on mutators and the absence of Sync give exactly that.
unsafe impl Send for KvCache {}

impl fmt::Debug for KvCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KvCache").field("raw", &self.raw).field("config", &self.config).finish()
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        // SAFETY: the handle came from minikv_cache_create and is destroyed once.
        unsafe { sys::minikv_cache_destroy(self.raw.as_ptr()) }
    }
}

impl KvCache {
    /// Validates `config`, chooses the backend and reserves the whole block pool and
    /// workspaces (`minikv_cache_create`). A bad field is [`Status::InvalidArgument`] with a
    /// message naming it; a loaded library that does not follow the version rule (the major
    /// version of the header these bindings were generated from, and not older) is
    /// [`Status::VersionMismatch`].
    pub fn new(config: &Config) -> Result<KvCache> {
        if !crate::compatible(crate::HEADER_VERSION_NUMBER, crate::version_number()) {
            return Err(Error::new(
                Status::VersionMismatch,
                format!(
                    "the loaded libminikv is version {} but these bindings need {}.x, at least \
                     {}.{}.{}",
                    crate::version_string(),
                    sys::MINIKV_VERSION_MAJOR,
                    sys::MINIKV_VERSION_MAJOR,
                    sys::MINIKV_VERSION_MINOR,
                    sys::MINIKV_VERSION_PATCH
                ),
            ));
        }
        let raw_cfg = config.to_raw();
        let mut out: *mut sys::minikv_cache = ptr::null_mut();
        // SAFETY: both pointers are valid for the call; the config is read only during it.
        let status = unsafe { sys::minikv_cache_create(&raw_cfg, &mut out) };
        if status != sys::minikv_status::MINIKV_OK {
            // No handle: the detail is in this thread's message, read before any other call.
            // SAFETY: minikv_last_error_message never returns NULL.
            return Err(unsafe { Error::from_c(status, sys::minikv_last_error_message()) });
        }
        let raw = NonNull::new(out).ok_or_else(|| {
            Error::new(Status::Internal, "minikv_cache_create returned MINIKV_OK and a NULL handle")
        })?;
        // AUTO is resolved at create: record the backend actually chosen, so the host-slice
        // methods know whether they may hand host memory over.
        let mut resolved = sys::minikv_backend::MINIKV_BACKEND_AUTO;
        // SAFETY: the handle is live and `resolved` is a valid out pointer.
        let status = unsafe { sys::minikv_cache_backend(raw.as_ptr(), &mut resolved) };
        let mut config = config.clone();
        config.backend = match resolved {
            sys::minikv_backend::MINIKV_BACKEND_CPU => Backend::Cpu,
            sys::minikv_backend::MINIKV_BACKEND_CUDA => Backend::Cuda,
            _ => config.backend,
        };
        let cache = KvCache { raw, config };
        cache.check(status)?;
        Ok(cache)
    }

    /// The configuration the cache was created with, `backend` resolved (never `Auto`).
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// The C handle, for calls through [`minikv_sys`](crate::sys). It stays owned by `self`:
    /// do not destroy it, and do not use it after `self` is dropped.
    pub fn as_ptr(&self) -> *mut sys::minikv_cache {
        self.raw.as_ptr()
    }

    /// `Ok` for MINIKV_OK, else the error with this thread's message, read right away (on
    /// the thread that made the call). The handle's own message belongs to whichever call
    /// holds the handle: a call made while another thread uses it (through `as_ptr`) fails
    /// with `BadState`, and only the thread's message describes that.
    fn check(&self, status: sys::minikv_status) -> Result<()> {
        if status == sys::minikv_status::MINIKV_OK {
            return Ok(());
        }
        // SAFETY: minikv_last_error_message never returns NULL; the text stays valid until
        // this thread's next minikv call, and Error::from_c copies it now.
        Err(unsafe { Error::from_c(status, sys::minikv_last_error_message()) })
    }

    // ---- the compute calls over host slices (CPU backend) ---------------------------

    /// Prefill of one layer for a batch of prompts (`minikv_prefill`): causal attention of
    /// each prompt into `out`, then selection and quantization into the cache.
    ///
    /// `seq_ids[s]` is the slot of prompt `s`, whose tokens are
    /// `cu_seqlens[s]..cu_seqlens[s + 1]` of the packed `q`, `k`, `v`, `out`
    /// (`cu_seqlens.len() == seq_ids.len() + 1`, `cu_seqlens[0] == 0`). Lengths are
    /// checked against the config: `q.len() == out.len() == total * num_heads * head_dim`
    /// and `k.len() == v.len() == total * num_kv_heads * head_dim`, with
    /// `total = cu_seqlens[n_seqs]`. On error nothing changed.
    #[allow(clippy::too_many_arguments)] // mirrors the C call: q, k, v, out of one batch
    pub fn prefill<T: Element>(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        cu_seqlens: &[i32],
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
    ) -> Result<()> {
        self.check_prefill_host("minikv_prefill", seq_ids, cu_seqlens, q, k, v, out)?;
        // SAFETY: host slices of the checked sizes on a CPU cache; `out` is exclusive.
        unsafe {
            self.prefill_raw(
                layer,
                seq_ids,
                cu_seqlens,
                q.as_ptr().cast(),
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        }
    }

    /// Chunked prefill (`minikv_prefill_chunk`): the next chunk of each sequence's prompt.
    ///
    /// The rows of sequence `s` (`cu_seqlens[s]..cu_seqlens[s + 1]`, slices as in
    /// [`prefill`](Self::prefill)) are the prompt positions that follow those already sent
    /// for (`seq_ids[s]`, `layer`); `prompt_lens[s]` is the length of its whole prompt (the
    /// same at every chunk), and the chunk that reaches it completes the prompt exactly as
    /// one `prefill` of the whole prompt would. Prompts sent in more than one chunk need
    /// [`Config::prefill_staging_tokens`](crate::Config::prefill_staging_tokens); a sequence
    /// mid-prompt refuses `append` and `decode`, and [`release`](Self::release) abandons
    /// its prompt. On error nothing changed.
    #[allow(clippy::too_many_arguments)] // mirrors the C call
    pub fn prefill_chunk<T: Element>(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        prompt_lens: &[u32],
        cu_seqlens: &[i32],
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
    ) -> Result<()> {
        self.check_prefill_host("minikv_prefill_chunk", seq_ids, cu_seqlens, q, k, v, out)?;
        // SAFETY: host slices of the checked sizes on a CPU cache; `out` is exclusive.
        unsafe {
            self.prefill_chunk_raw(
                layer,
                seq_ids,
                prompt_lens,
                cu_seqlens,
                q.as_ptr().cast(),
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        }
    }

    /// The host-slice checks of a prefill call: CPU cache, element type, slice lengths.
    #[allow(clippy::too_many_arguments)]
    fn check_prefill_host<T: Element>(
        &self,
        call: &str,
        seq_ids: &[u32],
        cu_seqlens: &[i32],
        q: &[T],
        k: &[T],
        v: &[T],
        out: &[T],
    ) -> Result<()> {
        self.check_host::<T>(call)?;
        let total = prefill_total(call, seq_ids, cu_seqlens)?;
        let (qo, kv) = (self.q_row(), self.kv_row());
        check_len(call, "q", q.len(), total, qo)?;
        check_len(call, "k", k.len(), total, kv)?;
        check_len(call, "v", v.len(), total, kv)?;
        check_len(call, "out", out.len(), total, qo)
    }

    /// Appends one new token's K/V for `layer` to each sequence of `seq_ids`
    /// (`minikv_append`); `k.len() == v.len() == n_seqs * num_kv_heads * head_dim`. When a
    /// residual becomes full, its oldest `flush_tokens` (rounded up to whole groups; all of
    /// them for 0) are quantized into the pool here (a flush). On error nothing changed.
    pub fn append<T: Element>(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        k: &[T],
        v: &[T],
    ) -> Result<()> {
        const CALL: &str = "minikv_append";
        self.check_host::<T>(CALL)?;
        let kv = self.kv_row();
        check_len(CALL, "k", k.len(), seq_ids.len(), kv)?;
        check_len(CALL, "v", v.len(), seq_ids.len(), kv)?;
        // SAFETY: host slices of the checked sizes on a CPU cache.
        unsafe {
            self.append_raw(layer, seq_ids, k.as_ptr().cast(), v.as_ptr().cast(), ptr::null_mut())
        }
    }

    /// Attention of one query token per sequence over its whole cached context for `layer`
    /// (`minikv_decode`); `q.len() == out.len() == n_seqs * num_heads * head_dim`. Append
    /// the token first: it then attends to itself.
    pub fn decode<T: Element>(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        q: &[T],
        out: &mut [T],
    ) -> Result<()> {
        const CALL: &str = "minikv_decode";
        self.check_host::<T>(CALL)?;
        let qo = self.q_row();
        check_len(CALL, "q", q.len(), seq_ids.len(), qo)?;
        check_len(CALL, "out", out.len(), seq_ids.len(), qo)?;
        // SAFETY: host slices of the checked sizes on a CPU cache; `out` is exclusive.
        unsafe {
            self.decode_raw(
                layer,
                seq_ids,
                q.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        }
    }

    /// The engine's step for one layer in one call (`minikv_append_decode`): what
    /// [`append`](Self::append) of `k`, `v` and then [`decode`](Self::decode) of `q` into
    /// `out` do, with the same result bit for bit, checked as one call: on error no token
    /// was appended and `out` was not written. `q.len() == out.len() == n_seqs * num_heads *
    /// head_dim`, `k.len() == v.len() == n_seqs * num_kv_heads * head_dim`.
    pub fn append_decode<T: Element>(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        q: &[T],
        k: &[T],
        v: &[T],
        out: &mut [T],
    ) -> Result<()> {
        const CALL: &str = "minikv_append_decode";
        self.check_host::<T>(CALL)?;
        let (qo, kv) = (self.q_row(), self.kv_row());
        check_len(CALL, "q", q.len(), seq_ids.len(), qo)?;
        check_len(CALL, "k", k.len(), seq_ids.len(), kv)?;
        check_len(CALL, "v", v.len(), seq_ids.len(), kv)?;
        check_len(CALL, "out", out.len(), seq_ids.len(), qo)?;
        // SAFETY: host slices of the checked sizes on a CPU cache; `out` is exclusive, so it
        // overlaps no input.
        unsafe {
            self.append_decode_raw(
                layer,
                seq_ids,
                q.as_ptr().cast(),
                k.as_ptr().cast(),
                v.as_ptr().cast(),
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        }
    }

    // ---- the compute calls over raw (device) pointers --------------------------------

    /// [`prefill`](Self::prefill) over raw pointers in the backend's memory space: device
    /// memory of `device_id` for CUDA (e.g. a framework tensor's data pointer), host memory
    /// for CPU. `seq_ids` and `cu_seqlens` are host slices and are checked
    /// (`cu_seqlens.len() == seq_ids.len() + 1`); the library checks ids, lengths and state.
    ///
    /// # Safety
    /// - `q`, `out` point to `cu_seqlens[n] * num_heads * head_dim` elements and `k`, `v` to
    ///   `cu_seqlens[n] * num_kv_heads * head_dim` elements of the cache's dtype, in the
    ///   memory space of the cache's backend; `out` does not overlap the inputs.
    /// - `stream` is a valid `cudaStream_t` of the cache's device, or NULL (the legacy
    ///   default stream); it must be NULL for the CPU backend.
    /// - CUDA calls are asynchronous: every buffer stays valid, and `out` unread, until the
    ///   work queued on `stream` has run.
    #[allow(clippy::too_many_arguments)] // mirrors the C call
    pub unsafe fn prefill_raw(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        cu_seqlens: &[i32],
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let n = n_seqs("minikv_prefill", seq_ids)?;
        check_cu_len("minikv_prefill", seq_ids, cu_seqlens)?;
        let status = sys::minikv_prefill(
            self.raw.as_ptr(),
            layer,
            n,
            seq_ids.as_ptr(),
            cu_seqlens.as_ptr(),
            q,
            k,
            v,
            out,
            stream,
        );
        self.check(status)
    }

    /// [`prefill_chunk`](Self::prefill_chunk) over raw pointers in the backend's memory space.
    /// `prompt_lens` is checked (`prompt_lens.len() == seq_ids.len()`).
    ///
    /// # Safety
    /// As for [`prefill_raw`](Self::prefill_raw), for the chunk's rows.
    #[allow(clippy::too_many_arguments)] // mirrors the C call
    pub unsafe fn prefill_chunk_raw(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        prompt_lens: &[u32],
        cu_seqlens: &[i32],
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        const CALL: &str = "minikv_prefill_chunk";
        let n = n_seqs(CALL, seq_ids)?;
        check_cu_len(CALL, seq_ids, cu_seqlens)?;
        if prompt_lens.len() != seq_ids.len() {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "{CALL}: prompt_lens has {} entries; seq_ids has {}",
                    prompt_lens.len(),
                    seq_ids.len()
                ),
            ));
        }
        let status = sys::minikv_prefill_chunk(
            self.raw.as_ptr(),
            layer,
            n,
            seq_ids.as_ptr(),
            cu_seqlens.as_ptr(),
            prompt_lens.as_ptr(),
            q,
            k,
            v,
            out,
            stream,
        );
        self.check(status)
    }

    /// [`append`](Self::append) over raw pointers in the backend's memory space.
    ///
    /// # Safety
    /// - `k`, `v` point to `seq_ids.len() * num_kv_heads * head_dim` elements of the cache's
    ///   dtype in the memory space of the cache's backend.
    /// - `stream` is a valid `cudaStream_t` of the cache's device or NULL; NULL for CPU.
    /// - `k` and `v` stay valid until the work queued on `stream` has run.
    pub unsafe fn append_raw(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        k: *const c_void,
        v: *const c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let n = n_seqs("minikv_append", seq_ids)?;
        let status =
            sys::minikv_append(self.raw.as_ptr(), layer, n, seq_ids.as_ptr(), k, v, stream);
        self.check(status)
    }

    /// [`decode`](Self::decode) over raw pointers in the backend's memory space.
    ///
    /// # Safety
    /// - `q`, `out` point to `seq_ids.len() * num_heads * head_dim` elements of the cache's
    ///   dtype in the memory space of the cache's backend, and do not overlap.
    /// - `stream` is a valid `cudaStream_t` of the cache's device or NULL; NULL for CPU.
    /// - `q` stays valid, and `out` unread, until the work queued on `stream` has run.
    pub unsafe fn decode_raw(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        q: *const c_void,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let n = n_seqs("minikv_decode", seq_ids)?;
        let status =
            sys::minikv_decode(self.raw.as_ptr(), layer, n, seq_ids.as_ptr(), q, out, stream);
        self.check(status)
    }

    /// [`append_decode`](Self::append_decode) over raw pointers in the backend's memory
    /// space. With CUDA it is one kernel launch where no sequence's residual becomes full.
    ///
    /// # Safety
    /// - `q`, `out` point to `seq_ids.len() * num_heads * head_dim` elements and `k`, `v` to
    ///   `seq_ids.len() * num_kv_heads * head_dim` elements of the cache's dtype in the
    ///   memory space of the cache's backend (the library refuses an `out` overlapping an
    ///   input).
    /// - `stream` is a valid `cudaStream_t` of the cache's device or NULL; NULL for CPU.
    /// - The inputs stay valid, and `out` unread, until the work queued on `stream` has run.
    #[allow(clippy::too_many_arguments)] // mirrors the C call
    pub unsafe fn append_decode_raw(
        &mut self,
        layer: u32,
        seq_ids: &[u32],
        q: *const c_void,
        k: *const c_void,
        v: *const c_void,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        let n = n_seqs("minikv_append_decode", seq_ids)?;
        let status = sys::minikv_append_decode(
            self.raw.as_ptr(),
            layer,
            n,
            seq_ids.as_ptr(),
            q,
            k,
            v,
            out,
            stream,
        );
        self.check(status)
    }

    // ---- sequences and statistics ------------------------------------------------------

    /// Frees every block of sequence `seq_id` (all layers), and the staging of a prompt still
    /// mid-way through [`prefill_chunk`](Self::prefill_chunk); the slot can take a new prompt.
    /// Releasing an empty slot is a no-op. For CUDA, call it after the work that reads the
    /// sequence has run (or was queued on the stream the library uses next).
    pub fn release(&mut self, seq_id: u32) -> Result<()> {
        // SAFETY: live handle.
        let status = unsafe { sys::minikv_sequence_release(self.raw.as_ptr(), seq_id) };
        self.check(status)
    }

    /// Positions seen and tokens cached for one sequence and layer (0 and 0 for a layer
    /// not prefilled).
    pub fn sequence_length(&self, seq_id: u32, layer: u32) -> Result<SequenceLength> {
        let mut len = SequenceLength::default();
        // SAFETY: live handle, valid out pointers.
        let status = unsafe {
            sys::minikv_sequence_length(
                self.raw.as_ptr(),
                seq_id,
                layer,
                &mut len.tokens_seen,
                &mut len.tokens_cached,
            )
        };
        self.check(status)?;
        Ok(len)
    }

    /// The prompt positions (ascending) that KV head `kv_head` of `layer` kept for
    /// `seq_id`. For CUDA this synchronizes with the device.
    pub fn kept_positions(&self, seq_id: u32, layer: u32, kv_head: u32) -> Result<Vec<i32>> {
        let raw = self.raw.as_ptr();
        let mut total = 0u32;
        // SAFETY: capacity 0 with a NULL array asks for the count only.
        let status = unsafe {
            sys::minikv_kept_positions(raw, seq_id, layer, kv_head, ptr::null_mut(), 0, &mut total)
        };
        self.check(status)?;
        let mut positions = vec![0i32; total as usize];
        let mut written = 0u32;
        // SAFETY: `positions` holds `total` elements; `&self` and !Sync keep the handle
        // unchanged between the two calls.
        let status = unsafe {
            sys::minikv_kept_positions(
                raw,
                seq_id,
                layer,
                kv_head,
                positions.as_mut_ptr(),
                total,
                &mut written,
            )
        };
        self.check(status)?;
        positions.truncate(written.min(total) as usize);
        Ok(positions)
    }

    /// Bytes reserved and used, tokens seen and cached, and the compression ratio of the
    /// whole cache, exact from host bookkeeping.
    pub fn memory_stats(&self) -> Result<MemoryStats> {
        // SAFETY: an all-zero minikv_memory_stats is a valid value (integers and a double).
        let mut s: sys::minikv_memory_stats = unsafe { core::mem::zeroed() };
        s.struct_size = core::mem::size_of::<sys::minikv_memory_stats>() as u32;
        // SAFETY: live handle; `s` is writable and its struct_size says how much.
        let status = unsafe { sys::minikv_memory_stats_get(self.raw.as_ptr(), &mut s) };
        self.check(status)?;
        Ok(MemoryStats {
            pool_bytes: s.pool_bytes,
            used_bytes: s.used_bytes,
            workspace_bytes: s.workspace_bytes,
            tokens_seen: s.tokens_seen,
            tokens_cached: s.tokens_cached,
            fp16_equivalent_bytes: s.fp16_equivalent_bytes,
            compression_ratio: s.compression_ratio,
        })
    }

    // ---- helpers -----------------------------------------------------------------------

    /// Elements of one token row of q/out and of k/v.
    fn q_row(&self) -> usize {
        self.config.num_heads as usize * self.config.head_dim as usize
    }
    fn kv_row(&self) -> usize {
        self.config.num_kv_heads as usize * self.config.head_dim as usize
    }

    /// Slices are host memory of one element type: only a CPU cache of that dtype reads them.
    fn check_host<T: Element>(&self, call: &str) -> Result<()> {
        if self.config.backend != Backend::Cpu {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "{call}: slices are host memory, which only a cache created with \
                     Backend::Cpu reads (this cache has Backend::{:?}); use the *_raw method \
                     with pointers in the backend's memory",
                    self.config.backend
                ),
            ));
        }
        if T::DTYPE != self.config.dtype {
            return Err(Error::new(
                Status::InvalidArgument,
                format!(
                    "{call}: the slices hold {:?} elements but the cache's dtype is {:?}",
                    T::DTYPE,
                    self.config.dtype
                ),
            ));
        }
        Ok(())
    }
}

fn n_seqs(call: &str, seq_ids: &[u32]) -> Result<u32> {
    u32::try_from(seq_ids.len()).map_err(|_| {
        Error::new(
            Status::InvalidArgument,
            format!("{call}: {} seq_ids do not fit in a u32", seq_ids.len()),
        )
    })
}

fn check_cu_len(call: &str, seq_ids: &[u32], cu_seqlens: &[i32]) -> Result<()> {
    if cu_seqlens.len() != seq_ids.len() + 1 {
        return Err(Error::new(
            Status::InvalidArgument,
            format!(
                "{call}: cu_seqlens has {} entries; it must have seq_ids.len() + 1 = {}",
                cu_seqlens.len(),
                seq_ids.len() + 1
            ),
        ));
    }
    Ok(())
}

/// The packed token count `cu_seqlens[n]` (the library checks the prefix sums themselves:
/// each length in [1, max_seq_len], so no token past it is read).
fn prefill_total(call: &str, seq_ids: &[u32], cu_seqlens: &[i32]) -> Result<usize> {
    check_cu_len(call, seq_ids, cu_seqlens)?;
    let last = cu_seqlens[cu_seqlens.len() - 1];
    usize::try_from(last).map_err(|_| {
        Error::new(
            Status::InvalidArgument,
            format!("{call}: cu_seqlens[{}] ({last}) must be >= 0", cu_seqlens.len() - 1),
        )
    })
}

fn check_len(call: &str, name: &str, got: usize, rows: usize, row: usize) -> Result<()> {
    // saturating: an overflowing product can never equal a real slice length.
    let want = rows.saturating_mul(row);
    if got != want {
        return Err(Error::new(
            Status::InvalidArgument,
            format!(
                "{call}: {name} has {got} elements; the batch needs {rows} rows x {row} = {want}"
            ),
        ));
    }
    Ok(())
}
