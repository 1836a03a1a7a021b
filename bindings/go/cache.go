// Package minikv is the Go binding of libminikv, a KV cache for transformer inference
// compressed with the MiniKV method (arXiv 2411.18077): per layer and KV head it keeps a
// recent window plus the prompt tokens that received the most attention, stores them
// quantized to 2 (or 4) bits, and computes decode attention over the compressed cache.
//
//	cfg := minikv.DefaultConfig()
//	cfg.Backend, cfg.Dtype = minikv.BackendCPU, minikv.DtypeF32
//	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 32, 32, 8, 128
//	cache, err := minikv.New(cfg)
//	if err != nil { ... }
//	defer cache.Close()
//	// per layer: cache.Prefill(layer, seqIDs, cuSeqlens, q, k, v, out)
//	// per generated token and layer: cache.Append(...); cache.Decode(...)
//	// (or both in one call: cache.AppendDecode(...))
//
// Host memory (the CPU backend) goes through the slice methods: []float32 for DtypeF32, raw bit
// patterns in []uint16 for DtypeF16/DtypeBF16 (see F16Bits, BF16Bits). Device memory
// (BackendCUDA) goes through the *Device methods as uintptr addresses plus a cudaStream_t
// (0 = the legacy default stream); those calls are asynchronous and the buffers must
// outlive the queued work. Tensors are dense, row-major, tokens-major:
//
//	prefill q, out: [totalTokens, NumHeads, HeadDim]    k, v: [totalTokens, NumKVHeads, HeadDim]
//	append  k, v:   [len(seqIDs), NumKVHeads, HeadDim]
//	decode  q, out: [len(seqIDs), NumHeads, HeadDim]
//
// Errors are *Error values carrying the library's Status and message; match them with
// errors.Is(err, minikv.ErrCapacityExceeded) and friends. The message is captured inside
// the same cgo call as the failure, so it is right even though goroutines move between OS
// threads.
//
// The package links libminikv through pkg-config (`#cgo pkg-config: minikv`): install the
// library, or point PKG_CONFIG_PATH at an install prefix's lib/pkgconfig.
package minikv

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"

	"minikv.dev/minikv/internal/capi"
)

// Cache is a libminikv cache handle: the compressed KV cache of up to MaxSequences
// sequences, all layers. Its methods may be called from several goroutines; they are
// serialized by a mutex (the C handle is not internally synchronized). Close it when done.
type Cache struct {
	mu      sync.Mutex
	h       capi.CacheHandle // nil once closed
	cfg     Config
	backend Backend // the backend in use (BackendAuto resolved at creation)
}

// Version is the loaded library's version, "MAJOR.MINOR.PATCH".
func Version() string { return capi.Version_string() }

// VersionNumber is the loaded library's major*10000 + minor*100 + patch.
func VersionNumber() uint32 { return uint32(capi.Version_number()) }

// BindingVersionNumber is the version of include/minikv.h this binding was generated from
// (internal/capi), counted as VersionNumber counts.
const BindingVersionNumber = uint32(capi.MINIKV_VERSION_MAJOR*10000 +
	capi.MINIKV_VERSION_MINOR*100 + capi.MINIKV_VERSION_PATCH)

// compatible is libminikv's version rule (MINIKV_VERSION_COMPATIBLE in minikv.h): a library
// serves a binding built against version `built` when it has the same major version and is
// not older.
func compatible(built, loaded uint32) bool {
	return loaded/10000 == built/10000 && loaded >= built
}

// New validates cfg, reserves the whole block pool and workspaces, and returns the cache.
// A bad field gives an *Error with StatusInvalidArgument whose message names the field.
func New(cfg Config) (*Cache, error) {
	if loaded := VersionNumber(); !compatible(BindingVersionNumber, loaded) {
		return nil, errorf(StatusVersionMismatch, fmt.Sprintf(
			"minikv.New: the loaded libminikv is version %s, the binding needs %d.x, at least %d.%d.%d",
			Version(), capi.MINIKV_VERSION_MAJOR, capi.MINIKV_VERSION_MAJOR,
			capi.MINIKV_VERSION_MINOR, capi.MINIKV_VERSION_PATCH))
	}
	c := cfg.toC()
	defer capi.DeleteConfigStruct(c)
	var h capi.CacheHandle
	if err := capi.Cache_create(c, &h); err != nil {
		return nil, convert(err)
	}
	var backend int32
	if err := capi.Cache_backend(h, &backend); err != nil {
		capi.DeleteCacheHandle(h)
		return nil, convert(err)
	}
	cache := &Cache{h: h, cfg: cfg, backend: Backend(backend)}
	// A safety net only: callers should Close (the pool can be gigabytes).
	runtime.SetFinalizer(cache, func(c *Cache) { _ = c.Close() })
	return cache, nil
}

// Config returns the configuration the cache was created with.
func (c *Cache) Config() Config { return c.cfg }

// Backend returns the backend the cache computes with: BackendAuto resolved to BackendCPU
// (use the slice methods) or BackendCUDA (use the *Device methods).
func (c *Cache) Backend() Backend { return c.backend }

// Close frees the pool, the workspaces and the handle. It is idempotent: closing a closed
// Cache returns nil. Every other method of a closed Cache returns an error that matches
// ErrClosed and ErrBadState. For CUDA it first waits for work queued by this cache.
func (c *Cache) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h != nil {
		capi.DeleteCacheHandle(c.h) // minikv_cache_destroy
		c.h = nil
		runtime.SetFinalizer(c, nil)
	}
	return nil
}

// ---- host memory (BackendCPU) ----------------------------------------------------------

// Prefill runs prompt attention for one layer over a batch of prompts packed back to back:
// sequence i (slot seqIDs[i]) owns tokens [cuSeqlens[i], cuSeqlens[i+1]). It writes the
// causal attention output of every prompt token to out, scores the tokens, keeps the
// recent window and heavy hitters, and stores them quantized. DtypeF32 only; see Prefill16.
func (c *Cache) Prefill(layer int, seqIDs []uint32, cuSeqlens []int32, q, k, v, out []float32) error {
	return c.prefillHost("Prefill", DtypeF32, layer, seqIDs, nil, cuSeqlens,
		len(q), len(k), len(v), len(out), f32addr(q), f32addr(k), f32addr(v), f32addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// Prefill16 is Prefill for DtypeF16 and DtypeBF16: elements are raw 16-bit patterns.
func (c *Cache) Prefill16(layer int, seqIDs []uint32, cuSeqlens []int32, q, k, v, out []uint16) error {
	return c.prefillHost("Prefill16", 0, layer, seqIDs, nil, cuSeqlens,
		len(q), len(k), len(v), len(out), u16addr(q), u16addr(k), u16addr(v), u16addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// PrefillChunk is Prefill for the next chunk of each sequence's prompt (chunked prefill,
// minikv_prefill_chunk): the rows of sequence i are the prompt positions that follow those
// already sent for (seqIDs[i], layer), promptLens[i] is the length of its whole prompt (the
// same at every chunk), and the chunk that reaches it completes the prompt as one Prefill
// would. Prompts in more than one chunk need Config.PrefillStagingTokens. DtypeF32 only;
// see PrefillChunk16.
func (c *Cache) PrefillChunk(layer int, seqIDs, promptLens []uint32, cuSeqlens []int32, q, k, v, out []float32) error {
	if promptLens == nil {
		promptLens = []uint32{}
	}
	return c.prefillHost("PrefillChunk", DtypeF32, layer, seqIDs, promptLens, cuSeqlens,
		len(q), len(k), len(v), len(out), f32addr(q), f32addr(k), f32addr(v), f32addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// PrefillChunk16 is PrefillChunk for DtypeF16 and DtypeBF16.
func (c *Cache) PrefillChunk16(layer int, seqIDs, promptLens []uint32, cuSeqlens []int32, q, k, v, out []uint16) error {
	if promptLens == nil {
		promptLens = []uint32{}
	}
	return c.prefillHost("PrefillChunk16", 0, layer, seqIDs, promptLens, cuSeqlens,
		len(q), len(k), len(v), len(out), u16addr(q), u16addr(k), u16addr(v), u16addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// Append adds one new token's K/V (for one layer) to each sequence: k, v are
// [len(seqIDs), NumKVHeads, HeadDim]. When a sequence's residual holds ResidualLength
// tokens, its oldest FlushTokens (rounded up to whole groups; all of them for 0) are
// quantized as one flush. DtypeF32 only; see Append16.
func (c *Cache) Append(layer int, seqIDs []uint32, k, v []float32) error {
	return c.appendHost("Append", DtypeF32, layer, seqIDs, len(k), len(v), f32addr(k), f32addr(v),
		func() { runtime.KeepAlive(k); runtime.KeepAlive(v) })
}

// Append16 is Append for DtypeF16 and DtypeBF16.
func (c *Cache) Append16(layer int, seqIDs []uint32, k, v []uint16) error {
	return c.appendHost("Append16", 0, layer, seqIDs, len(k), len(v), u16addr(k), u16addr(v),
		func() { runtime.KeepAlive(k); runtime.KeepAlive(v) })
}

// Decode computes the attention of one query token per sequence over that sequence's whole
// cached context for layer: q, out are [len(seqIDs), NumHeads, HeadDim]. Append the
// token's K/V first (it then attends to itself). DtypeF32 only; see Decode16.
func (c *Cache) Decode(layer int, seqIDs []uint32, q, out []float32) error {
	return c.decodeHost("Decode", DtypeF32, layer, seqIDs, len(q), len(out), f32addr(q), f32addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(out) })
}

// Decode16 is Decode for DtypeF16 and DtypeBF16.
func (c *Cache) Decode16(layer int, seqIDs []uint32, q, out []uint16) error {
	return c.decodeHost("Decode16", 0, layer, seqIDs, len(q), len(out), u16addr(q), u16addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(out) })
}

// AppendDecode is the engine's step for one layer in one call: Append(layer, seqIDs, k, v)
// then Decode(layer, seqIDs, q, out), with the same result bit for bit, checked as one call
// (a failure appends nothing and leaves out unwritten). q, out are [len(seqIDs), NumHeads,
// HeadDim], k, v [len(seqIDs), NumKVHeads, HeadDim]; out may not overlap an input.
// DtypeF32 only; see AppendDecode16.
func (c *Cache) AppendDecode(layer int, seqIDs []uint32, q, k, v, out []float32) error {
	return c.appendDecodeHost("AppendDecode", DtypeF32, layer, seqIDs, len(q), len(k), len(v), len(out),
		f32addr(q), f32addr(k), f32addr(v), f32addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// AppendDecode16 is AppendDecode for DtypeF16 and DtypeBF16.
func (c *Cache) AppendDecode16(layer int, seqIDs []uint32, q, k, v, out []uint16) error {
	return c.appendDecodeHost("AppendDecode16", 0, layer, seqIDs, len(q), len(k), len(v), len(out),
		u16addr(q), u16addr(k), u16addr(v), u16addr(out),
		func() { runtime.KeepAlive(q); runtime.KeepAlive(k); runtime.KeepAlive(v); runtime.KeepAlive(out) })
}

// ---- device memory (BackendCUDA) -------------------------------------------------------

// PrefillDevice is Prefill with device addresses (of q, k, v, out in cfg.Dtype) and a
// cudaStream_t (0 = legacy default stream). The call is asynchronous: the buffers must stay
// valid until the queued work has run. Lengths cannot be checked here.
func (c *Cache) PrefillDevice(layer int, seqIDs []uint32, cuSeqlens []int32, q, k, v, out, stream uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("PrefillDevice", layer, seqIDs); err != nil {
		return err
	}
	if _, err := c.promptTokens("PrefillDevice", seqIDs, cuSeqlens); err != nil {
		return err
	}
	return convert(capi.Prefill(c.h, uint(layer), seqIDs, cuSeqlens, q, k, v, out, stream))
}

// PrefillChunkDevice is PrefillChunk with device addresses and a stream (asynchronous).
func (c *Cache) PrefillChunkDevice(layer int, seqIDs, promptLens []uint32, cuSeqlens []int32, q, k, v, out, stream uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("PrefillChunkDevice", layer, seqIDs); err != nil {
		return err
	}
	if _, err := c.promptTokens("PrefillChunkDevice", seqIDs, cuSeqlens); err != nil {
		return err
	}
	if err := checkPromptLens("PrefillChunkDevice", seqIDs, promptLens); err != nil {
		return err
	}
	return convert(capi.Prefill_chunk(c.h, uint(layer), seqIDs, cuSeqlens, promptLens, q, k, v, out, stream))
}

// AppendDevice is Append with device addresses and a stream (asynchronous).
func (c *Cache) AppendDevice(layer int, seqIDs []uint32, k, v, stream uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("AppendDevice", layer, seqIDs); err != nil {
		return err
	}
	return convert(capi.Append(c.h, uint(layer), seqIDs, k, v, stream))
}

// DecodeDevice is Decode with device addresses and a stream (asynchronous).
func (c *Cache) DecodeDevice(layer int, seqIDs []uint32, q, out, stream uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("DecodeDevice", layer, seqIDs); err != nil {
		return err
	}
	return convert(capi.Decode(c.h, uint(layer), seqIDs, q, out, stream))
}

// AppendDecodeDevice is AppendDecode with device addresses and a stream (asynchronous): with
// CUDA one kernel launch where no sequence's residual becomes full with this token.
func (c *Cache) AppendDecodeDevice(layer int, seqIDs []uint32, q, k, v, out, stream uintptr) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("AppendDecodeDevice", layer, seqIDs); err != nil {
		return err
	}
	return convert(capi.Append_decode(c.h, uint(layer), seqIDs, q, k, v, out, stream))
}

// ---- sequences and statistics ----------------------------------------------------------

// Release frees every block of sequence seqID (all layers); the slot can take a new
// prompt. Releasing an empty slot is a no-op. For CUDA, release after the work that reads
// the sequence has run (or been queued on the same stream).
func (c *Cache) Release(seqID uint32) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		return closedError("Release")
	}
	return convert(capi.Sequence_release(c.h, uint(seqID)))
}

// SequenceLength reports the positions seen (prompt + appended) and the tokens kept in the
// cache for one sequence and layer; both are 0 for a layer not prefilled.
func (c *Cache) SequenceLength(seqID uint32, layer int) (seen, cached uint64, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("SequenceLength", layer, nil); err != nil {
		return 0, 0, err
	}
	err = convert(capi.Sequence_length(c.h, uint(seqID), uint(layer), &seen, &cached))
	return seen, cached, err
}

// KeptPositions returns the prompt positions (ascending) that KV head kvHead of layer kept
// for seqID. For CUDA it synchronizes with the device (meant for tests and research).
func (c *Cache) KeptPositions(seqID uint32, layer, kvHead int) ([]int32, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.check("KeptPositions", layer, nil); err != nil {
		return nil, err
	}
	if kvHead < 0 {
		return nil, errorf(StatusInvalidArgument, fmt.Sprintf("KeptPositions: kvHead (%d) must be >= 0", kvHead))
	}
	var count uint32
	if err := convert(capi.Kept_positions(c.h, uint(seqID), uint(layer), uint(kvHead), nil, &count)); err != nil {
		return nil, err
	}
	positions := make([]int32, count)
	if count > 0 {
		if err := convert(capi.Kept_positions(c.h, uint(seqID), uint(layer), uint(kvHead), positions, &count)); err != nil {
			return nil, err
		}
	}
	return positions[:count], nil
}

// MemoryStats mirrors minikv_memory_stats: exact byte counts from the cache's bookkeeping.
type MemoryStats struct {
	PoolBytes           uint64  // reserved for KV storage: blocks + residuals + position index
	UsedBytes           uint64  // codes + scales/zero-points + 16-bit tokens in use
	WorkspaceBytes      uint64  // scratch reserved for prefill/decode
	TokensSeen          uint64  // prompt + appended positions, summed over sequences and layers
	TokensCached        uint64  // of those, kept in the cache
	FP16EquivalentBytes uint64  // TokensSeen * NumKVHeads * HeadDim * 2 (K,V) * 2 bytes
	CompressionRatio    float64 // 1 - UsedBytes / FP16EquivalentBytes; 0 when empty
}

// MemoryStats returns the cache's memory statistics.
func (c *Cache) MemoryStats() (MemoryStats, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.h == nil {
		return MemoryStats{}, closedError("MemoryStats")
	}
	st := capi.NewMemoryStatsStruct() // sets struct_size
	defer capi.DeleteMemoryStatsStruct(st)
	if err := capi.Memory_stats_get(c.h, st); err != nil {
		return MemoryStats{}, convert(err)
	}
	return MemoryStats{
		PoolBytes:           st.GetPool_bytes(),
		UsedBytes:           st.GetUsed_bytes(),
		WorkspaceBytes:      st.GetWorkspace_bytes(),
		TokensSeen:          st.GetTokens_seen(),
		TokensCached:        st.GetTokens_cached(),
		FP16EquivalentBytes: st.GetFp16_equivalent_bytes(),
		CompressionRatio:    st.GetCompression_ratio(),
	}, nil
}

// ---- internals ---------------------------------------------------------------------------

// convert turns the capi error (captured inside the cgo call) into an *Error.
func convert(err error) error {
	if err == nil {
		return nil
	}
	if se, ok := err.(*capi.StatusError); ok {
		return &Error{Status: Status(se.Status), Message: se.Message}
	}
	return err
}

func closedError(method string) error {
	return &Error{Status: StatusBadState, Message: "Cache." + method + ": the cache is closed", wrapped: ErrClosed}
}

// check runs under c.mu: the handle is open and the layer is representable.
func (c *Cache) check(method string, layer int, seqIDs []uint32) error {
	if c.h == nil {
		return closedError(method)
	}
	if layer < 0 || uint64(layer) > 0xFFFFFFFF {
		return errorf(StatusInvalidArgument, fmt.Sprintf("Cache.%s: layer (%d) must be in [0, NumLayers)", method, layer))
	}
	if uint64(len(seqIDs)) > 0xFFFFFFFF {
		return errorf(StatusInvalidArgument, fmt.Sprintf("Cache.%s: too many sequences (%d)", method, len(seqIDs)))
	}
	return nil
}

// promptTokens checks that cuSeqlens has len(seqIDs)+1 entries (the library reads that
// many) and returns the total token count. The library validates the values themselves.
func (c *Cache) promptTokens(method string, seqIDs []uint32, cuSeqlens []int32) (int, error) {
	if len(cuSeqlens) != len(seqIDs)+1 {
		return 0, errorf(StatusInvalidArgument, fmt.Sprintf(
			"Cache.%s: cuSeqlens has %d entries, want len(seqIDs)+1 = %d", method, len(cuSeqlens), len(seqIDs)+1))
	}
	total := int(cuSeqlens[len(seqIDs)])
	if total < 0 {
		total = 0
	}
	return total, nil
}

// hostCall checks what the slice methods share: CPU backend and the slice element type.
// dtype 0 with a 16-bit method means "F16 or BF16".
func (c *Cache) hostCall(method string, f32 bool, layer int, seqIDs []uint32) error {
	if err := c.check(method, layer, seqIDs); err != nil {
		return err
	}
	if c.backend != BackendCPU {
		return errorf(StatusInvalidArgument, fmt.Sprintf(
			"Cache.%s: host slices need the CPU backend (this cache computes on CUDA); use %sDevice for device memory",
			method, trimSuffix16(method)))
	}
	if f32 != (c.cfg.Dtype == DtypeF32) {
		want := "[]float32 methods (Prefill, Append, Decode)"
		if c.cfg.Dtype != DtypeF32 {
			want = "[]uint16 methods (Prefill16, Append16, Decode16)"
		}
		return errorf(StatusInvalidArgument, fmt.Sprintf(
			"Cache.%s: the cache's Dtype is %s; use the %s", method, dtypeName(c.cfg.Dtype), want))
	}
	return nil
}

func checkLen(method, name string, got, want int) error {
	if got != want {
		return errorf(StatusInvalidArgument, fmt.Sprintf("Cache.%s: len(%s) is %d, want %d", method, name, got, want))
	}
	return nil
}

// prefillHost runs minikv_prefill, or minikv_prefill_chunk when promptLens is not nil.
func (c *Cache) prefillHost(method string, dtype Dtype, layer int, seqIDs, promptLens []uint32, cuSeqlens []int32,
	nq, nk, nv, nout int, q, k, v, out uintptr, keepAlive func()) error {
	defer keepAlive()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.hostCall(method, dtype == DtypeF32, layer, seqIDs); err != nil {
		return err
	}
	tokens, err := c.promptTokens(method, seqIDs, cuSeqlens)
	if err != nil {
		return err
	}
	hq := tokens * int(c.cfg.NumHeads) * int(c.cfg.HeadDim)
	hkv := tokens * int(c.cfg.NumKVHeads) * int(c.cfg.HeadDim)
	for _, e := range []error{checkLen(method, "q", nq, hq), checkLen(method, "k", nk, hkv),
		checkLen(method, "v", nv, hkv), checkLen(method, "out", nout, hq)} {
		if e != nil {
			return e
		}
	}
	if promptLens == nil {
		return convert(capi.Prefill(c.h, uint(layer), seqIDs, cuSeqlens, q, k, v, out, 0))
	}
	if err := checkPromptLens(method, seqIDs, promptLens); err != nil {
		return err
	}
	return convert(capi.Prefill_chunk(c.h, uint(layer), seqIDs, cuSeqlens, promptLens, q, k, v, out, 0))
}

// checkPromptLens checks that promptLens has one entry per sequence (the library reads that
// many).
func checkPromptLens(method string, seqIDs, promptLens []uint32) error {
	if len(promptLens) != len(seqIDs) {
		return errorf(StatusInvalidArgument, fmt.Sprintf(
			"Cache.%s: promptLens has %d entries, want len(seqIDs) = %d", method, len(promptLens), len(seqIDs)))
	}
	return nil
}

func (c *Cache) appendHost(method string, dtype Dtype, layer int, seqIDs []uint32, nk, nv int,
	k, v uintptr, keepAlive func()) error {
	defer keepAlive()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.hostCall(method, dtype == DtypeF32, layer, seqIDs); err != nil {
		return err
	}
	want := len(seqIDs) * int(c.cfg.NumKVHeads) * int(c.cfg.HeadDim)
	if err := checkLen(method, "k", nk, want); err != nil {
		return err
	}
	if err := checkLen(method, "v", nv, want); err != nil {
		return err
	}
	return convert(capi.Append(c.h, uint(layer), seqIDs, k, v, 0))
}

func (c *Cache) decodeHost(method string, dtype Dtype, layer int, seqIDs []uint32, nq, nout int,
	q, out uintptr, keepAlive func()) error {
	defer keepAlive()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.hostCall(method, dtype == DtypeF32, layer, seqIDs); err != nil {
		return err
	}
	want := len(seqIDs) * int(c.cfg.NumHeads) * int(c.cfg.HeadDim)
	if err := checkLen(method, "q", nq, want); err != nil {
		return err
	}
	if err := checkLen(method, "out", nout, want); err != nil {
		return err
	}
	return convert(capi.Decode(c.h, uint(layer), seqIDs, q, out, 0))
}

func (c *Cache) appendDecodeHost(method string, dtype Dtype, layer int, seqIDs []uint32,
	nq, nk, nv, nout int, q, k, v, out uintptr, keepAlive func()) error {
	defer keepAlive()
	c.mu.Lock()
	defer c.mu.Unlock()
	if err := c.hostCall(method, dtype == DtypeF32, layer, seqIDs); err != nil {
		return err
	}
	hq := len(seqIDs) * int(c.cfg.NumHeads) * int(c.cfg.HeadDim)
	hkv := len(seqIDs) * int(c.cfg.NumKVHeads) * int(c.cfg.HeadDim)
	for _, e := range []error{checkLen(method, "q", nq, hq), checkLen(method, "k", nk, hkv),
		checkLen(method, "v", nv, hkv), checkLen(method, "out", nout, hq)} {
		if e != nil {
			return e
		}
	}
	return convert(capi.Append_decode(c.h, uint(layer), seqIDs, q, k, v, out, 0))
}

// Host slices are passed to C as addresses (the same path as device memory). That is safe
// only for memory that cannot move: f32addr/u16addr make the slice escape to the heap (the
// Go heap never moves objects; a stack-allocated array could move when the stack grows
// before the cgo call), every caller keeps the slice alive across the call
// (runtime.KeepAlive), and the library keeps no pointer after returning. An empty slice
// passes 0 (NULL), which the library reports as an invalid argument.
var (
	escapeNever bool
	escapeSink  interface{}
)

func f32addr(s []float32) uintptr {
	if escapeNever {
		escapeSink = s
	}
	if len(s) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&s[0]))
}

func u16addr(s []uint16) uintptr {
	if escapeNever {
		escapeSink = s
	}
	if len(s) == 0 {
		return 0
	}
	return uintptr(unsafe.Pointer(&s[0]))
}

func trimSuffix16(method string) string {
	if n := len(method); n > 2 && method[n-2:] == "16" {
		return method[:n-2]
	}
	return method
}

func dtypeName(d Dtype) string {
	switch d {
	case DtypeF16:
		return "DtypeF16"
	case DtypeBF16:
		return "DtypeBF16"
	case DtypeF32:
		return "DtypeF32"
	}
	return fmt.Sprintf("Dtype(%d)", int32(d))
}
