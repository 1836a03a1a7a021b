//! The cache configuration: [`Config`] mirrors `minikv_config` with Rust enums.

use core::mem::MaybeUninit;

use crate::sys;

/// Where the cache lives and computes (`minikv_backend`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Backend {
    /// CUDA when the library was built with it and a device is present, else CPU. Only the
    /// `*_raw` methods accept buffers for such a cache (the memory space is not known).
    Auto,
    /// Host memory; the slice methods ([`KvCache::prefill`](crate::KvCache::prefill), ...) work.
    Cpu,
    /// Device memory of `device_id`; use the `*_raw` methods with device pointers.
    Cuda,
}

/// Element type of q/k/v/out and of the 16-bit storage (`minikv_dtype`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Dtype {
    /// IEEE binary16 ([`F16`](crate::F16) in slices).
    F16,
    /// bfloat16 ([`Bf16`](crate::Bf16) in slices).
    Bf16,
    /// IEEE binary32 (`f32` in slices).
    F32,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::F32 => 4,
        }
    }
}

/// How the heavy-hitter budget is spread over layers (`minikv_budget_policy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BudgetPolicy {
    /// Every layer keeps `heavy_ratio` of its prompt as heavy hitters.
    Uniform,
    /// Lower layers keep more: `h*(2-1/depth)` at layer 0 down to `h/depth` at the top.
    Pyramid,
}

/// How prompt tokens are scored for selection (`minikv_score_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ScoreMode {
    /// H2O: attention each key receives, summed over all prompt queries.
    Cumulative,
    /// SnapKV: summed over the last `window_size` queries, max-pooled.
    Window,
}

/// Named compression settings (`minikv_preset`; `include/minikv.h` documents each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// The default: 4-bit keys, 2-bit values, group 32, 4 sink tokens, pyramid budgets,
    /// window (SnapKV-style) scores, a 64-token residual flushed 32 tokens at a time.
    Balanced,
    /// MiniKV exactly: 2-bit keys and values, group 16, pyramid budgets, no sinks, the whole
    /// 128-token residual flushed at once.
    Paper,
    /// 8-bit keys and values, group 32, 4 sink tokens, uniform budgets, a 128-token
    /// residual flushed whole.
    Quality,
    /// No quantization (16-bit), no sinks, uniform budgets: H2O-style eviction alone (a
    /// 128-token residual flushed whole).
    EvictionOnly,
}

/// Cache configuration. `Config::default()` holds the library's defaults
/// ([`Preset::Balanced`]: 4-bit keys, 2-bit values, group 32, 4 sink tokens, residual 64
/// flushed 32 tokens at a time, heavy = recent = 25%, pyramid budgets, window scores) with
/// the model dimensions at 0; [`Config::new`] sets them and [`Config::apply_preset`]
/// switches the compression fields to another named setting. The library validates the
/// whole config in [`KvCache::new`](crate::KvCache::new); a bad field is an
/// [`Error`](crate::Error) with [`Status::InvalidArgument`](crate::Status) whose message
/// names the field.
///
/// Field meanings are those of `minikv_config` in `include/minikv.h`.
#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub backend: Backend,
    pub device_id: i32,
    pub dtype: Dtype,
    pub num_layers: u32,
    pub num_heads: u32,
    pub num_kv_heads: u32,
    pub head_dim: u32,
    pub max_sequences: u32,
    pub max_seq_len: u32,
    /// Pool capacity in cached tokens over all sequences and layers; 0 = every slot at
    /// `max_seq_len`.
    pub max_tokens: u64,
    pub heavy_ratio: f32,
    pub recent_ratio: f32,
    pub budget_policy: BudgetPolicy,
    pub pyramid_depth: f32,
    pub score_mode: ScoreMode,
    pub window_size: u32,
    pub pool_kernel: u32,
    /// 2, 4, 8, or 16 (= unquantized).
    pub key_bits: u32,
    /// 2, 4, 8, or 16 (= unquantized).
    pub value_bits: u32,
    pub group_size: u32,
    /// R, the tokens kept 16-bit before a flush: a multiple of `group_size`; 64 (the
    /// presets other than [`Preset::Balanced`]: 128).
    pub residual_length: u32,
    /// Attention sinks: the first `sink_tokens` prompt positions kept unquantized in every
    /// layer, counted inside the heavy-hitter budget; 0..=64.
    pub sink_tokens: u32,
    /// Chunked prefill ([`KvCache::prefill_chunk`](crate::KvCache::prefill_chunk)): the most
    /// prompt tokens in flight at once across sequences, whose K/V wait in a staging area
    /// reserved at creation; 0 = off (every prompt in one call).
    pub prefill_staging_tokens: u32,
    /// F, how many tokens a flush quantizes: when the residual holds `residual_length`
    /// tokens (the new one included), its oldest F are quantized and the newest
    /// `residual_length - F` stay 16-bit (a sliding flush, every F tokens). Any value is
    /// valid: it is rounded up to a multiple of `group_size` and capped at
    /// `residual_length` (with group 16, 24 acts as 32; 200 with `residual_length` 64 as
    /// 64); 0 = the whole residual at once (the MiniKV reference). 32 by default (with
    /// `residual_length` 64); the presets other than [`Preset::Balanced`] set 0.
    pub flush_tokens: u32,
}

impl Config {
    /// The defaults with the model dimensions set.
    pub fn new(num_layers: u32, num_heads: u32, num_kv_heads: u32, head_dim: u32) -> Config {
        Config { num_layers, num_heads, num_kv_heads, head_dim, ..Config::default() }
    }

    /// Sets the compression fields (bits, group size, sink tokens, budgets, score mode,
    /// residual length, flush tokens) to `preset` (`minikv_config_preset`); the dimensions,
    /// backend, dtype and sizes keep their values. The paper's exact MiniKV:
    /// `cfg.apply_preset(Preset::Paper)`.
    pub fn apply_preset(&mut self, preset: Preset) {
        let mut c = self.to_raw();
        let p = match preset {
            Preset::Balanced => sys::minikv_preset::MINIKV_PRESET_BALANCED,
            Preset::Paper => sys::minikv_preset::MINIKV_PRESET_PAPER,
            Preset::Quality => sys::minikv_preset::MINIKV_PRESET_QUALITY,
            Preset::EvictionOnly => sys::minikv_preset::MINIKV_PRESET_EVICTION_ONLY,
        };
        // SAFETY: `c` is this crate's whole struct with struct_size set by
        // minikv_config_init, and the call writes only fields within it. It fails only for
        // a NULL pointer, an unknown preset or a struct_size without sink_tokens, none of
        // which can happen here.
        let status = unsafe { sys::minikv_config_preset(&mut c, p) };
        debug_assert_eq!(status, sys::minikv_status::MINIKV_OK);
        *self = Config::from_raw(&c);
    }

    /// The C struct, starting from `minikv_config_default` so `struct_size` (and any field
    /// this crate does not model) is the library's default.
    pub fn to_raw(&self) -> sys::minikv_config {
        let mut c = raw_default();
        c.backend = match self.backend {
            Backend::Auto => sys::minikv_backend::MINIKV_BACKEND_AUTO,
            Backend::Cpu => sys::minikv_backend::MINIKV_BACKEND_CPU,
            Backend::Cuda => sys::minikv_backend::MINIKV_BACKEND_CUDA,
        };
        c.device_id = self.device_id;
        c.dtype = match self.dtype {
            Dtype::F16 => sys::minikv_dtype::MINIKV_DTYPE_F16,
            Dtype::Bf16 => sys::minikv_dtype::MINIKV_DTYPE_BF16,
            Dtype::F32 => sys::minikv_dtype::MINIKV_DTYPE_F32,
        };
        c.num_layers = self.num_layers;
        c.num_heads = self.num_heads;
        c.num_kv_heads = self.num_kv_heads;
        c.head_dim = self.head_dim;
        c.max_sequences = self.max_sequences;
        c.max_seq_len = self.max_seq_len;
        c.max_tokens = self.max_tokens;
        c.heavy_ratio = self.heavy_ratio;
        c.recent_ratio = self.recent_ratio;
        c.budget_policy = match self.budget_policy {
            BudgetPolicy::Uniform => sys::minikv_budget_policy::MINIKV_BUDGET_UNIFORM,
            BudgetPolicy::Pyramid => sys::minikv_budget_policy::MINIKV_BUDGET_PYRAMID,
        };
        c.pyramid_depth = self.pyramid_depth;
        c.score_mode = match self.score_mode {
            ScoreMode::Cumulative => sys::minikv_score_mode::MINIKV_SCORE_CUMULATIVE,
            ScoreMode::Window => sys::minikv_score_mode::MINIKV_SCORE_WINDOW,
        };
        c.window_size = self.window_size;
        c.pool_kernel = self.pool_kernel;
        c.key_bits = self.key_bits;
        c.value_bits = self.value_bits;
        c.group_size = self.group_size;
        c.residual_length = self.residual_length;
        c.sink_tokens = self.sink_tokens;
        c.prefill_staging_tokens = self.prefill_staging_tokens;
        c.flush_tokens = self.flush_tokens;
        c
    }
}

fn raw_default() -> sys::minikv_config {
    let mut c = MaybeUninit::<sys::minikv_config>::zeroed();
    // SAFETY: minikv_config_init writes at most the size it is given, which is this
    // crate's struct; the zeroed start makes every byte initialized regardless. It fails
    // only for a NULL pointer or a size below the first version's, neither possible here.
    unsafe {
        sys::minikv_config_init(
            c.as_mut_ptr(),
            core::mem::size_of::<sys::minikv_config>() as sys::size_t,
        );
        c.assume_init()
    }
}

impl Default for Config {
    /// `minikv_config_default`: the library's own defaults, model dimensions 0.
    fn default() -> Config {
        Config::from_raw(&raw_default())
    }
}

impl Config {
    /// The fields of a C struct. An enum value this crate does not know (impossible within
    /// one major version) falls back to the header's documented default.
    fn from_raw(c: &sys::minikv_config) -> Config {
        Config {
            backend: match c.backend {
                sys::minikv_backend::MINIKV_BACKEND_CPU => Backend::Cpu,
                sys::minikv_backend::MINIKV_BACKEND_CUDA => Backend::Cuda,
                _ => Backend::Auto,
            },
            device_id: c.device_id,
            dtype: match c.dtype {
                sys::minikv_dtype::MINIKV_DTYPE_BF16 => Dtype::Bf16,
                sys::minikv_dtype::MINIKV_DTYPE_F32 => Dtype::F32,
                _ => Dtype::F16,
            },
            num_layers: c.num_layers,
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            max_sequences: c.max_sequences,
            max_seq_len: c.max_seq_len,
            max_tokens: c.max_tokens,
            heavy_ratio: c.heavy_ratio,
            recent_ratio: c.recent_ratio,
            budget_policy: match c.budget_policy {
                sys::minikv_budget_policy::MINIKV_BUDGET_PYRAMID => BudgetPolicy::Pyramid,
                _ => BudgetPolicy::Uniform,
            },
            pyramid_depth: c.pyramid_depth,
            score_mode: match c.score_mode {
                sys::minikv_score_mode::MINIKV_SCORE_WINDOW => ScoreMode::Window,
                _ => ScoreMode::Cumulative,
            },
            window_size: c.window_size,
            pool_kernel: c.pool_kernel,
            key_bits: c.key_bits,
            value_bits: c.value_bits,
            group_size: c.group_size,
            residual_length: c.residual_length,
            sink_tokens: c.sink_tokens,
            prefill_staging_tokens: c.prefill_staging_tokens,
            flush_tokens: c.flush_tokens,
        }
    }
}
