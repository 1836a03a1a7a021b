package minikv

import (
	"fmt"

	"minikv.dev/minikv/internal/capi"
)

// Backend selects where the cache lives and computes (minikv_backend).
type Backend int32

const (
	// BackendAuto: CUDA when built and a device is present, else CPU; Cache.Backend tells
	// which one a cache got, so which methods (slices or *Device) it takes.
	BackendAuto Backend = 0
	// BackendCPU: host memory, synchronous calls; use the slice methods.
	BackendCPU Backend = 1
	// BackendCUDA: device memory of DeviceID; use the *Device methods.
	BackendCUDA Backend = 2
)

// Dtype is the element type of q/k/v/out and of the 16-bit storage (minikv_dtype).
type Dtype int32

const (
	DtypeF16  Dtype = 0 // IEEE binary16, as raw bits in []uint16
	DtypeBF16 Dtype = 1 // bfloat16, as raw bits in []uint16
	DtypeF32  Dtype = 2 // IEEE binary32, []float32
)

// BudgetPolicy distributes the heavy-hitter budget over layers (minikv_budget_policy).
type BudgetPolicy int32

const (
	BudgetUniform BudgetPolicy = 0 // every layer keeps HeavyRatio of its prompt
	BudgetPyramid BudgetPolicy = 1 // lower layers keep more, mean HeavyRatio
)

// ScoreMode chooses how prompt tokens are scored for eviction (minikv_score_mode).
type ScoreMode int32

const (
	ScoreCumulative ScoreMode = 0 // H2O: attention summed over all prompt queries
	ScoreWindow     ScoreMode = 1 // SnapKV: last WindowSize queries, max-pooled
)

// Preset names a compression setting (minikv_preset; include/minikv.h documents each).
// PresetBalanced keeps a 64-token residual flushed 32 tokens at a time (ResidualLength 64,
// FlushTokens 32); the others flush a 128-token residual whole (128, 0).
type Preset int32

const (
	PresetBalanced     Preset = 0 // the default: 4-bit keys, 2-bit values, G 32, 4 sinks, pyramid, window scores
	PresetPaper        Preset = 1 // MiniKV exactly: 2-bit keys and values, G 16, pyramid, no sinks
	PresetQuality      Preset = 2 // 8-bit keys and values, G 32, 4 sinks, uniform
	PresetEvictionOnly Preset = 3 // 16-bit, no sinks, uniform (H2O-style eviction alone)
)

// enumName is the name of value v of an enum type (names indexed by value), or
// "<Type>(<v>)" for a value this binding does not know.
func enumName(typeName string, names []string, v int32) string {
	if v >= 0 && int(v) < len(names) {
		return names[v]
	}
	return fmt.Sprintf("%s(%d)", typeName, v)
}

// String is the backend's name, as in the C API: "AUTO", "CPU" or "CUDA".
func (b Backend) String() string {
	return enumName("Backend", []string{"AUTO", "CPU", "CUDA"}, int32(b))
}

// String is the dtype's name, as in the C API: "F16", "BF16" or "F32".
func (d Dtype) String() string { return enumName("Dtype", []string{"F16", "BF16", "F32"}, int32(d)) }

// String is the policy's name, as in the C API: "UNIFORM" or "PYRAMID".
func (p BudgetPolicy) String() string {
	return enumName("BudgetPolicy", []string{"UNIFORM", "PYRAMID"}, int32(p))
}

// String is the mode's name, as in the C API: "CUMULATIVE" or "WINDOW".
func (m ScoreMode) String() string {
	return enumName("ScoreMode", []string{"CUMULATIVE", "WINDOW"}, int32(m))
}

// String is the preset's name, as in the C API: "BALANCED", "PAPER", "QUALITY" or
// "EVICTION_ONLY".
func (p Preset) String() string {
	return enumName("Preset", []string{"BALANCED", "PAPER", "QUALITY", "EVICTION_ONLY"}, int32(p))
}

// Config mirrors minikv_config. Start from DefaultConfig (PresetBalanced), optionally
// ApplyPreset, then set the model dimensions; a zero Config is not valid.
type Config struct {
	Backend        Backend
	DeviceID       int32
	Dtype          Dtype
	NumLayers      uint32 // required
	NumHeads       uint32 // query heads, a multiple of NumKVHeads
	NumKVHeads     uint32 // required
	HeadDim        uint32 // a multiple of 16, at most 256
	MaxSequences   uint32 // sequence slots: seq ids in [0, MaxSequences)
	MaxSeqLen      uint32 // longest prompt + generation of one sequence
	MaxTokens      uint64 // pool capacity in cached tokens; 0 = every slot at MaxSeqLen
	HeavyRatio     float32
	RecentRatio    float32
	BudgetPolicy   BudgetPolicy
	PyramidDepth   float32
	ScoreMode      ScoreMode
	WindowSize     uint32
	PoolKernel     uint32
	KeyBits        uint32 // 2, 4, 8 or 16 (unquantized)
	ValueBits      uint32 // 2, 4, 8 or 16
	GroupSize      uint32 // 16, 32, 64 or 128
	ResidualLength uint32 // R, tokens kept 16-bit before a flush: a multiple of GroupSize
	SinkTokens     uint32 // first prompt positions always kept unquantized, inside the budget; 0..64
	// PrefillStagingTokens sizes the staging area of chunked prefill (PrefillChunk): the most
	// prompt tokens in flight at once across sequences (their K/V wait there, every layer);
	// 0 = off (every prompt in one call). At most MaxSequences x MaxSeqLen.
	PrefillStagingTokens uint32
	// FlushTokens is F, how many tokens a flush quantizes: when the residual holds
	// ResidualLength tokens (the new one included), its oldest F are quantized and the
	// newest ResidualLength - F stay 16-bit (a sliding flush, every F tokens). Any value is
	// valid: it is rounded up to a multiple of GroupSize and capped at ResidualLength (with
	// GroupSize 16, 24 acts as 32; 200 with ResidualLength 64 as 64); 0 = the whole residual
	// at once (the MiniKV reference). 32 by default (with ResidualLength 64); the presets
	// other than PresetBalanced set 0 (with ResidualLength 128).
	FlushTokens uint32
}

// DefaultConfig returns the library's defaults (minikv_config_default, PresetBalanced): F16,
// 4-bit keys and 2-bit values, group 32, 4 sink tokens, residual 64 flushed 32 tokens at a
// time, heavy and recent ratios 0.25 with pyramid budgets, window scores, Backend Auto.
// Model dimensions are zero and must be set.
func DefaultConfig() Config {
	c := capi.NewConfigStruct()
	defer capi.DeleteConfigStruct(c)
	return configFromC(c)
}

// ApplyPreset sets the compression fields (bits, group size, sinks, budget, score mode,
// residual length, flush tokens) to a named setting (minikv_config_preset), leaving the
// dimensions, backend, dtype and sizes as they are. An unknown preset is an *Error with
// StatusInvalidArgument, and cfg is unchanged.
func (cfg *Config) ApplyPreset(p Preset) error {
	c := cfg.toC()
	defer capi.DeleteConfigStruct(c)
	if err := capi.Config_preset(c, capi.Enum_SS_minikv_preset(p)); err != nil {
		return convert(err)
	}
	*cfg = configFromC(c)
	return nil
}

// configFromC reads every field of a C config.
func configFromC(c capi.ConfigStruct) Config {
	return Config{
		Backend:        Backend(c.GetBackend()),
		DeviceID:       int32(c.GetDevice_id()),
		Dtype:          Dtype(c.GetDtype()),
		NumLayers:      uint32(c.GetNum_layers()),
		NumHeads:       uint32(c.GetNum_heads()),
		NumKVHeads:     uint32(c.GetNum_kv_heads()),
		HeadDim:        uint32(c.GetHead_dim()),
		MaxSequences:   uint32(c.GetMax_sequences()),
		MaxSeqLen:      uint32(c.GetMax_seq_len()),
		MaxTokens:      c.GetMax_tokens(),
		HeavyRatio:     c.GetHeavy_ratio(),
		RecentRatio:    c.GetRecent_ratio(),
		BudgetPolicy:   BudgetPolicy(c.GetBudget_policy()),
		PyramidDepth:   c.GetPyramid_depth(),
		ScoreMode:      ScoreMode(c.GetScore_mode()),
		WindowSize:     uint32(c.GetWindow_size()),
		PoolKernel:     uint32(c.GetPool_kernel()),
		KeyBits:        uint32(c.GetKey_bits()),
		ValueBits:      uint32(c.GetValue_bits()),
		GroupSize:      uint32(c.GetGroup_size()),
		ResidualLength: uint32(c.GetResidual_length()),
		SinkTokens:     uint32(c.GetSink_tokens()),

		PrefillStagingTokens: uint32(c.GetPrefill_staging_tokens()),
		FlushTokens:          uint32(c.GetFlush_tokens()),
	}
}

// toC fills a new C config (struct_size set by its constructor); the caller deletes it.
func (cfg *Config) toC() capi.ConfigStruct {
	c := capi.NewConfigStruct()
	c.SetBackend(capi.Enum_SS_minikv_backend(cfg.Backend))
	c.SetDevice_id(int(cfg.DeviceID))
	c.SetDtype(capi.Enum_SS_minikv_dtype(cfg.Dtype))
	c.SetNum_layers(uint(cfg.NumLayers))
	c.SetNum_heads(uint(cfg.NumHeads))
	c.SetNum_kv_heads(uint(cfg.NumKVHeads))
	c.SetHead_dim(uint(cfg.HeadDim))
	c.SetMax_sequences(uint(cfg.MaxSequences))
	c.SetMax_seq_len(uint(cfg.MaxSeqLen))
	c.SetMax_tokens(cfg.MaxTokens)
	c.SetHeavy_ratio(cfg.HeavyRatio)
	c.SetRecent_ratio(cfg.RecentRatio)
	c.SetBudget_policy(capi.Enum_SS_minikv_budget_policy(cfg.BudgetPolicy))
	c.SetPyramid_depth(cfg.PyramidDepth)
	c.SetScore_mode(capi.Enum_SS_minikv_score_mode(cfg.ScoreMode))
	c.SetWindow_size(uint(cfg.WindowSize))
	c.SetPool_kernel(uint(cfg.PoolKernel))
	c.SetKey_bits(uint(cfg.KeyBits))
	c.SetValue_bits(uint(cfg.ValueBits))
	c.SetGroup_size(uint(cfg.GroupSize))
	c.SetResidual_length(uint(cfg.ResidualLength))
	c.SetSink_tokens(uint(cfg.SinkTokens))
	c.SetPrefill_staging_tokens(uint(cfg.PrefillStagingTokens))
	c.SetFlush_tokens(uint(cfg.FlushTokens))
	return c
}

// elemBytes is the size of one q/k/v/out element.
func (cfg *Config) elemBytes() int {
	if cfg.Dtype == DtypeF32 {
		return 4
	}
	return 2
}
