package minikv_test

import (
	"errors"
	"fmt"
	"math"
	"math/rand"
	"strings"
	"sync"
	"testing"

	"minikv.dev/minikv"
)

// ---- float64 reference attention -----------------------------------------------------

// attend returns softmax(q K^T / sqrt(D)) V for one token's query q [H*D] over rows of
// keys/values [Hkv*D] (GQA: query head h reads KV head h / (H/Hkv)).
func attend(q []float64, keys, vals [][]float64, H, Hkv, D int) []float64 {
	out := make([]float64, H*D)
	group := H / Hkv
	scale := 1 / math.Sqrt(float64(D))
	logits := make([]float64, len(keys))
	for h := 0; h < H; h++ {
		kh := h / group
		qh := q[h*D : (h+1)*D]
		maxLogit := math.Inf(-1)
		for t, k := range keys {
			dot := 0.0
			for d := 0; d < D; d++ {
				dot += qh[d] * k[kh*D+d]
			}
			logits[t] = dot * scale
			maxLogit = math.Max(maxLogit, logits[t])
		}
		sum := 0.0
		for t := range keys {
			logits[t] = math.Exp(logits[t] - maxLogit)
			sum += logits[t]
		}
		for t, v := range vals {
			p := logits[t] / sum
			for d := 0; d < D; d++ {
				out[h*D+d] += p * v[kh*D+d]
			}
		}
	}
	return out
}

// maxAbsDiff fails on NaN/Inf and returns max |got - want|.
func maxAbsDiff(t *testing.T, what string, got []float32, want []float64) float64 {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	worst := 0.0
	for i := range got {
		g := float64(got[i])
		if math.IsNaN(g) || math.IsInf(g, 0) {
			t.Fatalf("%s: element %d is %v", what, i, g)
		}
		worst = math.Max(worst, math.Abs(g-want[i]))
	}
	return worst
}

// tensor draws n values uniform in [-1, 1), passed through round (identity for F32,
// F16 rounding for the 16-bit tests) so the reference sees exactly what the cache sees.
func tensor(rng *rand.Rand, n int, round func(float32) float32) ([]float32, []float64) {
	f := make([]float32, n)
	d := make([]float64, n)
	for i := range f {
		f[i] = round(float32(rng.Float64()*2 - 1))
		d[i] = float64(f[i])
	}
	return f, d
}

func identity(x float32) float32 { return x }

// ---- configs ---------------------------------------------------------------------------

const (
	tH, tHkv, tD = 4, 2, 32 // GQA group of 2
	tLayers      = 2
)

// exactConfig keeps every prompt token (heavy_ratio 1, recent 0) unquantized (bits 16,
// no sinks: PresetEvictionOnly) with a small residual so decoding crosses many flushes.
func exactConfig(dtype minikv.Dtype) minikv.Config {
	cfg := minikv.DefaultConfig()
	if err := cfg.ApplyPreset(minikv.PresetEvictionOnly); err != nil {
		panic(err)
	}
	cfg.Backend = minikv.BackendCPU
	cfg.Dtype = dtype
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = tLayers, tH, tHkv, tD
	cfg.MaxSequences, cfg.MaxSeqLen = 4, 256
	cfg.HeavyRatio, cfg.RecentRatio = 1, 0
	cfg.KeyBits, cfg.ValueBits = 16, 16
	cfg.GroupSize, cfg.ResidualLength = 16, 16
	return cfg
}

func mustNew(t *testing.T, cfg minikv.Config) *minikv.Cache {
	t.Helper()
	c, err := minikv.New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return c
}

// history is the float64 K/V rows one (sequence, layer) has seen, for the reference.
type history struct{ keys, vals [][]float64 }

// model drives a cache with the F32 slice methods and checks every output against attend.
type model struct {
	t    *testing.T
	c    *minikv.Cache
	rng  *rand.Rand
	hist map[[2]int]*history // (seq, layer)
	tol  float64
	max  float64 // worst error seen
}

func (m *model) prefill(seqIDs []uint32, lens []int) {
	m.t.Helper()
	cu := []int32{0}
	for _, l := range lens {
		cu = append(cu, cu[len(cu)-1]+int32(l))
	}
	total := int(cu[len(cu)-1])
	for layer := 0; layer < tLayers; layer++ {
		q, qd := tensor(m.rng, total*tH*tD, identity)
		k, kd := tensor(m.rng, total*tHkv*tD, identity)
		v, vd := tensor(m.rng, total*tHkv*tD, identity)
		out := make([]float32, total*tH*tD)
		if err := m.c.Prefill(layer, seqIDs, cu, q, k, v, out); err != nil {
			m.t.Fatalf("Prefill(layer %d): %v", layer, err)
		}
		for s, id := range seqIDs {
			h := &history{}
			m.hist[[2]int{int(id), layer}] = h
			for tok := int(cu[s]); tok < int(cu[s+1]); tok++ {
				h.keys = append(h.keys, kd[tok*tHkv*tD:(tok+1)*tHkv*tD])
				h.vals = append(h.vals, vd[tok*tHkv*tD:(tok+1)*tHkv*tD])
				want := attend(qd[tok*tH*tD:(tok+1)*tH*tD], h.keys, h.vals, tH, tHkv, tD)
				m.checkRow(fmt.Sprintf("prefill seq %d layer %d token %d", id, layer, tok),
					out[tok*tH*tD:(tok+1)*tH*tD], want)
			}
		}
	}
}

func (m *model) step(seqIDs []uint32) {
	m.t.Helper()
	n := len(seqIDs)
	for layer := 0; layer < tLayers; layer++ {
		k, kd := tensor(m.rng, n*tHkv*tD, identity)
		v, vd := tensor(m.rng, n*tHkv*tD, identity)
		if err := m.c.Append(layer, seqIDs, k, v); err != nil {
			m.t.Fatalf("Append(layer %d): %v", layer, err)
		}
		q, qd := tensor(m.rng, n*tH*tD, identity)
		out := make([]float32, n*tH*tD)
		if err := m.c.Decode(layer, seqIDs, q, out); err != nil {
			m.t.Fatalf("Decode(layer %d): %v", layer, err)
		}
		for s, id := range seqIDs {
			h := m.hist[[2]int{int(id), layer}]
			h.keys = append(h.keys, kd[s*tHkv*tD:(s+1)*tHkv*tD])
			h.vals = append(h.vals, vd[s*tHkv*tD:(s+1)*tHkv*tD])
			want := attend(qd[s*tH*tD:(s+1)*tH*tD], h.keys, h.vals, tH, tHkv, tD)
			m.checkRow(fmt.Sprintf("decode seq %d layer %d position %d", id, layer, len(h.keys)-1),
				out[s*tH*tD:(s+1)*tH*tD], want)
		}
	}
}

func (m *model) checkRow(what string, got []float32, want []float64) {
	m.t.Helper()
	d := maxAbsDiff(m.t, what, got, want)
	m.max = math.Max(m.max, d)
	if d > m.tol {
		m.t.Fatalf("%s: max |out - reference| = %g > %g", what, d, m.tol)
	}
}

// ---- the lifecycle ---------------------------------------------------------------------

func TestLifecycleExactAttention(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF32)
	c := mustNew(t, cfg)
	defer c.Close()
	m := &model{t: t, c: c, rng: rand.New(rand.NewSource(1)), hist: map[[2]int]*history{}, tol: 2e-5}

	// A ragged batch in non-contiguous slots.
	seqs, lens := []uint32{0, 2, 3}, []int{37, 50, 21}
	m.prefill(seqs, lens)
	for s, id := range seqs {
		for layer := 0; layer < tLayers; layer++ {
			for kv := 0; kv < tHkv; kv++ {
				pos, err := c.KeptPositions(id, layer, kv)
				if err != nil {
					t.Fatal(err)
				}
				if len(pos) != lens[s] {
					t.Fatalf("seq %d layer %d head %d kept %d positions, want all %d", id, layer, kv, len(pos), lens[s])
				}
				for i, p := range pos {
					if p != int32(i) {
						t.Fatalf("seq %d kept position[%d] = %d", id, i, p)
					}
				}
			}
		}
	}

	// 40 steps with residual_length 16: every sequence flushes two or three times.
	const steps = 40
	for i := 0; i < steps; i++ {
		m.step(seqs)
	}
	for s, id := range seqs {
		seen, cached, err := c.SequenceLength(id, 1)
		if err != nil {
			t.Fatal(err)
		}
		if want := uint64(lens[s] + steps); seen != want || cached != want {
			t.Fatalf("SequenceLength(%d) = (%d, %d), want (%d, %d)", id, seen, cached, want, want)
		}
	}

	// Stats: 16-bit F32 storage keeps 4 bytes per element, twice the FP16 reference, so
	// the "compression" is exactly -1.
	checkStats := func(tokens uint64) {
		t.Helper()
		st, err := c.MemoryStats()
		if err != nil {
			t.Fatal(err)
		}
		perToken := uint64(2 * tHkv * tD)
		if st.TokensSeen != tokens || st.TokensCached != tokens ||
			st.UsedBytes != tokens*perToken*4 || st.FP16EquivalentBytes != tokens*perToken*2 {
			t.Fatalf("stats %+v, want %d tokens seen and cached, %d used bytes", st, tokens, tokens*perToken*4)
		}
		if tokens > 0 && st.CompressionRatio != -1 {
			t.Fatalf("compression ratio %v, want -1", st.CompressionRatio)
		}
		if st.PoolBytes == 0 || st.PoolBytes < st.UsedBytes {
			t.Fatalf("pool bytes %d, used %d", st.PoolBytes, st.UsedBytes)
		}
	}
	total := uint64(0)
	for _, l := range lens {
		total += uint64(l+steps) * tLayers
	}
	checkStats(total)

	// Release a sequence: its tokens leave the stats, and it cannot be decoded.
	if err := c.Release(2); err != nil {
		t.Fatal(err)
	}
	total -= uint64(50+steps) * tLayers
	checkStats(total)
	if seen, cached, err := c.SequenceLength(2, 0); err != nil || seen != 0 || cached != 0 {
		t.Fatalf("released SequenceLength = (%d, %d, %v)", seen, cached, err)
	}
	q := make([]float32, tH*tD)
	out := make([]float32, tH*tD)
	if err := c.Decode(0, []uint32{2}, q, out); !errors.Is(err, minikv.ErrBadState) {
		t.Fatalf("Decode of a released sequence: %v, want ErrBadState", err)
	}
	if err := c.Release(2); err != nil { // releasing an empty slot is a no-op
		t.Fatal(err)
	}

	// Reuse the slot with a new prompt and keep decoding the whole batch.
	m.prefill([]uint32{2}, []int{29})
	for i := 0; i < 20; i++ {
		m.step([]uint32{3, 0, 2})
	}
	total += 2*20*tLayers + uint64(29+20)*tLayers // seqs 0 and 3 grew by 20; seq 2 is new
	checkStats(total)
	t.Logf("worst |decode - float64 attention| over the lifecycle: %.3g", m.max)

	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

// F16 storage: the reference uses the same fp16-rounded inputs; the output is rounded to
// fp16 once (relative 2^-11).
func TestLifecycleExactAttentionF16(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF16)
	c := mustNew(t, cfg)
	defer c.Close()
	rng := rand.New(rand.NewSource(2))
	round := func(x float32) float32 { return minikv.F16Float(minikv.F16Bits(x)) }
	bits := func(f []float32) []uint16 {
		b := make([]uint16, len(f))
		for i, x := range f {
			b[i] = minikv.F16Bits(x)
		}
		return b
	}
	floats := func(b []uint16) []float32 {
		f := make([]float32, len(b))
		for i, x := range b {
			f[i] = minikv.F16Float(x)
		}
		return f
	}
	const L, layer = 45, 1
	q, qd := tensor(rng, L*tH*tD, round)
	k, kd := tensor(rng, L*tHkv*tD, round)
	v, vd := tensor(rng, L*tHkv*tD, round)
	out := make([]uint16, L*tH*tD)
	if err := c.Prefill16(layer, []uint32{1}, []int32{0, L}, bits(q), bits(k), bits(v), out); err != nil {
		t.Fatal(err)
	}
	var keys, vals [][]float64
	worst := 0.0
	for tok := 0; tok < L; tok++ {
		keys = append(keys, kd[tok*tHkv*tD:(tok+1)*tHkv*tD])
		vals = append(vals, vd[tok*tHkv*tD:(tok+1)*tHkv*tD])
		want := attend(qd[tok*tH*tD:(tok+1)*tH*tD], keys, vals, tH, tHkv, tD)
		worst = math.Max(worst, maxAbsDiff(t, "prefill f16", floats(out[tok*tH*tD:(tok+1)*tH*tD]), want))
	}
	for step := 0; step < 35; step++ {
		k, kd := tensor(rng, tHkv*tD, round)
		v, vd := tensor(rng, tHkv*tD, round)
		if err := c.Append16(layer, []uint32{1}, bits(k), bits(v)); err != nil {
			t.Fatal(err)
		}
		keys, vals = append(keys, kd), append(vals, vd)
		q, qd := tensor(rng, tH*tD, round)
		out := make([]uint16, tH*tD)
		if err := c.Decode16(layer, []uint32{1}, bits(q), out); err != nil {
			t.Fatal(err)
		}
		worst = math.Max(worst, maxAbsDiff(t, "decode f16", floats(out), attend(qd, keys, vals, tH, tHkv, tD)))
	}
	if worst > 1e-3 {
		t.Fatalf("F16: max |out - reference| = %g > 1e-3", worst)
	}
	t.Logf("F16 worst error %.3g", worst)
}

// ---- compression -----------------------------------------------------------------------

// quantizedBytes mirrors src/layout.h: n quantized tokens (a multiple of G) of all KV
// heads in codes and scale/min pairs.
func quantizedBytes(cfg minikv.Config, n uint64) uint64 {
	elem := uint64(2)
	if cfg.Dtype == minikv.DtypeF32 {
		elem = 4
	}
	D, G := uint64(cfg.HeadDim), uint64(cfg.GroupSize)
	row := func(bits uint32) uint64 {
		if bits == 16 {
			return D * elem
		}
		return D * uint64(bits) / 8
	}
	perGroup := G * (row(cfg.KeyBits) + row(cfg.ValueBits))
	if cfg.KeyBits != 16 {
		perGroup += 2 * D * elem // per-channel scale and min for G tokens
	}
	if cfg.ValueBits != 16 {
		perGroup += 2 * G * (D / G) * elem // per-token scale and min per G channels
	}
	return n / G * perGroup * uint64(cfg.NumKVHeads)
}

// expectedUsed simulates the uniform-policy bookkeeping: the kept prompt tokens
// (floor(h*L) + floor(r*L), or all), the first multiple of G quantized and the rest in
// the 16-bit residual, then `steps` appends flushing the oldest F (flushSize) of the R
// residual tokens when the residual fills.
func expectedUsed(cfg minikv.Config, prompt, steps int) (used, cached uint64) {
	elem := uint64(2)
	if cfg.Dtype == minikv.DtypeF32 {
		elem = 4
	}
	budget := func(ratio float32) uint64 {
		x := float64(ratio) * float64(prompt)
		return uint64(math.Floor(x + 1e-9*(1+x)))
	}
	// UNIFORM (no clipping); the sinks take heavy-hitter slots; WINDOW scores always keep
	// the scoring window.
	sinks := uint64(cfg.SinkTokens)
	if sinks > uint64(prompt) {
		sinks = uint64(prompt)
	}
	heavy, recent := budget(cfg.HeavyRatio), budget(cfg.RecentRatio)
	if window := uint64(cfg.WindowSize); cfg.ScoreMode == minikv.ScoreWindow && recent < window {
		recent = window
		if recent > uint64(prompt) {
			recent = uint64(prompt)
		}
	}
	if heavy < sinks {
		heavy = sinks // the sinks fill the heavy-hitter share and may exceed it
	}
	keep := heavy + recent
	if keep >= uint64(prompt) {
		keep = uint64(prompt)
	}
	G, R, F := uint64(cfg.GroupSize), uint64(cfg.ResidualLength), flushSize(cfg)
	rest := keep - sinks
	quantized, residual := rest-rest%G, rest%G
	for i := 0; i < steps; i++ {
		if residual+1 == R {
			quantized, residual = quantized+F, R-F
		} else {
			residual++
		}
	}
	denseBytes := (sinks + residual) * 2 * uint64(cfg.NumKVHeads) * uint64(cfg.HeadDim) * elem
	return quantizedBytes(cfg, quantized) + denseBytes, sinks + quantized + residual
}

// flushSize is F, the tokens one flush quantizes (flush_tokens in include/minikv.h): the
// whole residual for 0, else FlushTokens rounded up to a multiple of GroupSize, at most
// ResidualLength.
func flushSize(cfg minikv.Config) uint64 {
	G, R, F := uint64(cfg.GroupSize), uint64(cfg.ResidualLength), uint64(cfg.FlushTokens)
	if F == 0 {
		return R
	}
	if F = (F + G - 1) / G * G; F > R {
		return R
	}
	return F
}

func u16tensor(rng *rand.Rand, n int) []uint16 {
	b := make([]uint16, n)
	for i := range b {
		b[i] = minikv.F16Bits(float32(rng.NormFloat64()))
	}
	return b
}

// The paper's setting: MHA, head_dim 128, a 4096-token prompt, 512 generated tokens,
// 2-bit keys and values, G = 16, FP16 — MiniKV's ≈ 86% compression.
func TestCompressionPaperSetting(t *testing.T) {
	if testing.Short() {
		t.Skip("4096-token prefill")
	}
	cfg := minikv.DefaultConfig()
	if err := cfg.ApplyPreset(minikv.PresetPaper); err != nil {
		t.Fatal(err)
	}
	cfg.Backend = minikv.BackendCPU
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 1, 1, 128
	cfg.MaxSeqLen = 4096 + 512
	c := mustNew(t, cfg)
	defer c.Close()
	rng := rand.New(rand.NewSource(3))
	const L, gen = 4096, 512
	out := make([]uint16, L*128)
	if err := c.Prefill16(0, []uint32{0}, []int32{0, L}, u16tensor(rng, L*128), u16tensor(rng, L*128),
		u16tensor(rng, L*128), out); err != nil {
		t.Fatal(err)
	}
	dec := make([]uint16, 128)
	for i := 0; i < gen; i++ {
		if err := c.Append16(0, []uint32{0}, u16tensor(rng, 128), u16tensor(rng, 128)); err != nil {
			t.Fatal(err)
		}
		if err := c.Decode16(0, []uint32{0}, u16tensor(rng, 128), dec); err != nil {
			t.Fatal(err)
		}
	}
	st, err := c.MemoryStats()
	if err != nil {
		t.Fatal(err)
	}
	used, cached := expectedUsed(cfg, L, gen)
	fp16 := uint64(L+gen) * 128 * 2 * 2
	want := 1 - float64(used)/float64(fp16)
	if st.UsedBytes != used || st.TokensCached != cached || st.TokensSeen != L+gen || st.FP16EquivalentBytes != fp16 {
		t.Fatalf("stats %+v, want used %d, cached %d, seen %d, fp16 %d", st, used, cached, L+gen, fp16)
	}
	if math.Abs(st.CompressionRatio-want) > 1e-12 || math.Abs(want-0.8611) > 5e-4 {
		t.Fatalf("compression %.6f, layout says %.6f, paper ≈ 0.861", st.CompressionRatio, want)
	}
	t.Logf("compression %.4f (used %d of %d fp16 bytes)", st.CompressionRatio, st.UsedBytes, fp16)
}

// The default storage (PresetBalanced: 4-bit keys, 2-bit values, G 32, 4 sinks, budget
// 50%, a sliding flush: FlushTokens 32 of ResidualLength 64, the first flush at the
// residual's 64th token, then one every 32, each quantizing the oldest 32 and keeping the
// newest 32 16-bit) on a ragged batch: the byte count follows the layout through several
// flushes, per sequence and layer. Uniform budgets, the ones expectedUsed models (the
// default's pyramid gives each layer its own).
func TestCompressionRaggedDefaults(t *testing.T) {
	cfg := raggedConfig()
	if cfg.ResidualLength != 64 || cfg.FlushTokens != 32 {
		t.Fatalf("default residual %d flushed %d at a time, want 64 and 32", cfg.ResidualLength, cfg.FlushTokens)
	}
	const steps = 100
	checkRaggedCompression(t, cfg, steps)
	// The accounting checked differs from a whole flush's (FlushTokens ignored) for some
	// sequence, so the check above tells them apart.
	whole := cfg
	whole.FlushTokens = 0
	differ := false
	for _, l := range []int{100, 37, 258} {
		a, _ := expectedUsed(cfg, l, steps)
		b, _ := expectedUsed(whole, l, steps)
		differ = differ || a != b
	}
	if !differ {
		t.Fatal("the sliding and whole flushes give the same bytes: the test cannot tell them apart")
	}
}

// The same storage flushing the whole residual at once (FlushTokens 0, the MiniKV
// reference), with ResidualLength 32: many flushes of 32 tokens.
func TestCompressionWholeFlush(t *testing.T) {
	cfg := raggedConfig()
	cfg.ResidualLength, cfg.FlushTokens = 32, 0
	checkRaggedCompression(t, cfg, 45)
}

// Any FlushTokens is valid: it is rounded up to a multiple of GroupSize and capped at
// ResidualLength. With GroupSize 16 and ResidualLength 64, caches fed the same tokens give
// the same decode outputs (bit for bit) and memory stats at every step when their
// FlushTokens round to the same F: 24 and 32; 1 and 16; 200, 2^32-1 and 0 (the whole
// residual). The three F give different caches (so the comparisons can fail), and each
// follows expectedUsed with the rounded F.
func TestFlushTokensRoundUp(t *testing.T) {
	base := raggedConfig()
	if err := base.ApplyPreset(minikv.PresetPaper); err != nil { // G 16
		t.Fatal(err)
	}
	base.Dtype, base.NumLayers, base.MaxSequences, base.MaxSeqLen, base.ResidualLength = minikv.DtypeF32, 1, 1, 256, 64
	groups := [][]uint32{{24, 32}, {1, 16}, {200, math.MaxUint32, 0}}
	rounded := []uint64{32, 16, 64}
	type run struct {
		cfg   minikv.Config
		cache *minikv.Cache
	}
	var runs []run
	for g, same := range groups {
		for _, f := range same {
			cfg := base
			cfg.FlushTokens = f
			if flushSize(cfg) != rounded[g] {
				t.Fatalf("flushSize(%d) = %d, want %d", f, flushSize(cfg), rounded[g])
			}
			c := mustNew(t, cfg)
			defer c.Close()
			if got := c.Config().FlushTokens; got != f {
				t.Fatalf("the cache reports FlushTokens %d, created with %d", got, f)
			}
			runs = append(runs, run{cfg, c})
		}
	}
	const L = 40
	rng := rand.New(rand.NewSource(5))
	q, _ := tensor(rng, L*tH*64, identity)
	k, _ := tensor(rng, L*tHkv*64, identity)
	v, _ := tensor(rng, L*tHkv*64, identity)
	for _, r := range runs {
		if err := r.cache.Prefill(0, []uint32{0}, []int32{0, L}, q, k, v, make([]float32, L*tH*64)); err != nil {
			t.Fatal(err)
		}
	}
	differ := map[[2]int]int{} // steps where the first caches of two groups differ in bytes
	for step := 1; step <= 160; step++ {
		nk, _ := tensor(rng, tHkv*64, identity)
		nv, _ := tensor(rng, tHkv*64, identity)
		nq, _ := tensor(rng, tH*64, identity)
		outs := make([][]float32, len(runs))
		used := make([]uint64, len(runs))
		for i, r := range runs {
			outs[i] = make([]float32, tH*64)
			if err := r.cache.Append(0, []uint32{0}, nk, nv); err != nil {
				t.Fatal(err)
			}
			if err := r.cache.Decode(0, []uint32{0}, nq, outs[i]); err != nil {
				t.Fatal(err)
			}
			st, err := r.cache.MemoryStats()
			if err != nil {
				t.Fatal(err)
			}
			used[i] = st.UsedBytes
			if want, _ := expectedUsed(r.cfg, L, step); used[i] != want {
				t.Fatalf("FlushTokens %d, step %d: used %d bytes, want %d", r.cfg.FlushTokens, step, used[i], want)
			}
		}
		var first []int // index of each group's first cache
		at := 0
		for _, same := range groups {
			first = append(first, at)
			for i := at + 1; i < at+len(same); i++ {
				if used[i] != used[at] {
					t.Fatalf("step %d: FlushTokens %d used %d bytes, %d used %d", step,
						runs[i].cfg.FlushTokens, used[i], runs[at].cfg.FlushTokens, used[at])
				}
				for j := range outs[i] {
					if math.Float32bits(outs[i][j]) != math.Float32bits(outs[at][j]) {
						t.Fatalf("step %d: decode of FlushTokens %d differs from %d's at %d", step,
							runs[i].cfg.FlushTokens, runs[at].cfg.FlushTokens, j)
					}
				}
			}
			at += len(same)
		}
		for a := range first {
			for b := a + 1; b < len(first); b++ {
				if used[first[a]] != used[first[b]] {
					differ[[2]int{a, b}]++
				}
			}
		}
	}
	for _, pair := range [][2]int{{0, 1}, {0, 2}, {1, 2}} {
		if differ[pair] <= 20 {
			t.Fatalf("groups %v differ in only %d steps: the comparisons cannot tell them apart", pair, differ[pair])
		}
	}
}

// raggedConfig is the default storage on the CPU with uniform budgets and the test
// dimensions (head_dim 64), for checkRaggedCompression.
func raggedConfig() minikv.Config {
	cfg := minikv.DefaultConfig()
	cfg.Backend, cfg.BudgetPolicy = minikv.BackendCPU, minikv.BudgetUniform
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = tLayers, tH, tHkv, 64
	cfg.MaxSequences, cfg.MaxSeqLen = 3, 512
	return cfg
}

// checkRaggedCompression runs a ragged batch of three prompts and `steps` appends on cfg
// (from raggedConfig) and checks the memory stats against expectedUsed.
func checkRaggedCompression(t *testing.T, cfg minikv.Config, steps int) {
	t.Helper()
	c := mustNew(t, cfg)
	defer c.Close()
	rng := rand.New(rand.NewSource(4))
	seqs, lens := []uint32{2, 0, 1}, []int{100, 37, 258}
	cu := []int32{0}
	for _, l := range lens {
		cu = append(cu, cu[len(cu)-1]+int32(l))
	}
	total := int(cu[3])
	for layer := 0; layer < tLayers; layer++ {
		out := make([]uint16, total*tH*64)
		if err := c.Prefill16(layer, seqs, cu, u16tensor(rng, total*tH*64), u16tensor(rng, total*tHkv*64),
			u16tensor(rng, total*tHkv*64), out); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < steps; i++ {
		for layer := 0; layer < tLayers; layer++ {
			if err := c.Append16(layer, seqs, u16tensor(rng, 3*tHkv*64), u16tensor(rng, 3*tHkv*64)); err != nil {
				t.Fatal(err)
			}
			if err := c.Decode16(layer, seqs, u16tensor(rng, 3*tH*64), make([]uint16, 3*tH*64)); err != nil {
				t.Fatal(err)
			}
		}
	}
	var used, cached, seen uint64
	for s, l := range lens {
		u, k := expectedUsed(cfg, l, steps)
		used, cached, seen = used+u*tLayers, cached+k*tLayers, seen+uint64(l+steps)*tLayers
		if _, got, err := c.SequenceLength(seqs[s], 1); err != nil || got != k {
			t.Fatalf("seq %d cached %d (%v), want %d", seqs[s], got, err, k)
		}
	}
	st, err := c.MemoryStats()
	if err != nil {
		t.Fatal(err)
	}
	fp16 := seen * tHkv * 64 * 4
	if st.UsedBytes != used || st.TokensCached != cached || st.TokensSeen != seen || st.FP16EquivalentBytes != fp16 {
		t.Fatalf("stats %+v, want used %d cached %d seen %d", st, used, cached, seen)
	}
	if want := 1 - float64(used)/float64(fp16); math.Abs(st.CompressionRatio-want) > 1e-12 {
		t.Fatalf("compression %v, want %v", st.CompressionRatio, want)
	}
}

// ---- errors ----------------------------------------------------------------------------

func TestBadConfigNamesTheField(t *testing.T) {
	base := exactConfig(minikv.DtypeF32)
	cases := []struct {
		field string
		edit  func(*minikv.Config)
	}{
		{"num_heads (12) must be a multiple of num_kv_heads (8)", func(c *minikv.Config) { c.NumHeads, c.NumKVHeads = 12, 8 }},
		{"head_dim (20)", func(c *minikv.Config) { c.HeadDim = 20 }},
		{"key_bits (3)", func(c *minikv.Config) { c.KeyBits = 3 }},
		{"group_size (24)", func(c *minikv.Config) { c.GroupSize = 24 }},
		{"heavy_ratio", func(c *minikv.Config) { c.HeavyRatio = 1.5 }},
		{"num_layers (0)", func(c *minikv.Config) { c.NumLayers = 0 }},
	}
	for _, tc := range cases {
		cfg := base
		tc.edit(&cfg)
		c, err := minikv.New(cfg)
		if err == nil {
			c.Close()
			t.Fatalf("%s: New succeeded", tc.field)
		}
		if c != nil {
			t.Fatalf("%s: New returned a cache with its error", tc.field)
		}
		var me *minikv.Error
		if !errors.As(err, &me) || me.Status != minikv.StatusInvalidArgument || !errors.Is(err, minikv.ErrInvalidArgument) {
			t.Fatalf("%s: error %#v, want *Error with StatusInvalidArgument", tc.field, err)
		}
		if errors.Is(err, minikv.ErrBadState) {
			t.Fatalf("%s: matches the wrong sentinel", tc.field)
		}
		if !strings.Contains(me.Message, tc.field) {
			t.Fatalf("message %q does not name %q", me.Message, tc.field)
		}
	}
}

func TestLibraryErrors(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF32)
	cfg.MaxTokens = 32 // two blocks of 16 tokens
	c := mustNew(t, cfg)
	defer c.Close()
	n := tH * tD
	q, out := make([]float32, n), make([]float32, n)

	err := c.Decode(0, []uint32{0}, q, out)
	if !errors.Is(err, minikv.ErrBadState) || !strings.Contains(err.Error(), "minikv_decode") {
		t.Fatalf("decode before prefill: %v", err)
	}

	// 100 kept tokens need 6 blocks: CAPACITY_EXCEEDED, and nothing changes.
	const L = 100
	big := func(heads int) []float32 { return make([]float32, L*heads*tD) }
	err = c.Prefill(0, []uint32{1}, []int32{0, L}, big(tH), big(tHkv), big(tHkv), big(tH))
	if !errors.Is(err, minikv.ErrCapacityExceeded) {
		t.Fatalf("prefill past capacity: %v", err)
	}
	if st, _ := c.MemoryStats(); st.TokensSeen != 0 || st.UsedBytes != 0 {
		t.Fatalf("failed prefill changed the stats: %+v", st)
	}
	if seen, _, _ := c.SequenceLength(1, 0); seen != 0 {
		t.Fatalf("failed prefill left %d tokens", seen)
	}
	// A prompt that fits still works, and a second prefill of the same layer is BAD_STATE.
	small := func(heads int) []float32 { return make([]float32, 20*heads*tD) }
	if err := c.Prefill(0, []uint32{1}, []int32{0, 20}, small(tH), small(tHkv), small(tHkv), small(tH)); err != nil {
		t.Fatal(err)
	}
	err = c.Prefill(0, []uint32{1}, []int32{0, 20}, small(tH), small(tHkv), small(tHkv), small(tH))
	if !errors.Is(err, minikv.ErrBadState) || !strings.Contains(err.Error(), "already prefilled") {
		t.Fatalf("second prefill: %v", err)
	}
	if err := c.Release(99); !errors.Is(err, minikv.ErrInvalidArgument) || !strings.Contains(err.Error(), "seq_id (99)") {
		t.Fatalf("Release(99): %v", err)
	}
}

// The binding's own checks: lengths, dtype and backend of the slice methods.
func TestSliceChecks(t *testing.T) {
	c := mustNew(t, exactConfig(minikv.DtypeF32))
	defer c.Close()
	n := tH * tD
	cases := []struct {
		want string
		err  error
	}{
		{"len(q) is 3", c.Decode(0, []uint32{0}, make([]float32, 3), make([]float32, n))},
		{"len(out)", c.Decode(0, []uint32{0}, make([]float32, n), nil)},
		{"cuSeqlens has 1 entries", c.Prefill(0, []uint32{0}, []int32{0}, nil, nil, nil, nil)},
		{"len(k)", c.Append(0, []uint32{0, 1}, make([]float32, tHkv*tD), make([]float32, 2*tHkv*tD))},
		{"Dtype is DtypeF32", c.Decode16(0, []uint32{0}, make([]uint16, n), make([]uint16, n))},
		{"layer (-1)", c.Decode(-1, []uint32{0}, make([]float32, n), make([]float32, n))},
	}
	for _, tc := range cases {
		if !errors.Is(tc.err, minikv.ErrInvalidArgument) || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("want INVALID_ARGUMENT naming %q, got %v", tc.want, tc.err)
		}
	}
	cfg := exactConfig(minikv.DtypeF32)
	cfg.Backend = minikv.BackendAuto
	auto := mustNew(t, cfg)
	defer auto.Close()
	if c.Backend() != minikv.BackendCPU {
		t.Fatalf("an explicit CPU cache reports backend %d", c.Backend())
	}
	// AUTO resolves at creation: host slices are accepted exactly when it resolved to CPU.
	err := auto.Decode(0, []uint32{0}, make([]float32, n), make([]float32, n))
	switch auto.Backend() {
	case minikv.BackendCPU: // a build without CUDA, or no GPU: the library answers
		if !errors.Is(err, minikv.ErrBadState) || !strings.Contains(err.Error(), "minikv_decode") {
			t.Fatalf("AUTO→CPU cache, decode before prefill: %v", err)
		}
	case minikv.BackendCUDA:
		if !errors.Is(err, minikv.ErrInvalidArgument) || !strings.Contains(err.Error(), "DecodeDevice") {
			t.Fatalf("AUTO→CUDA cache with host slices: %v", err)
		}
	default:
		t.Fatalf("AUTO resolved to %d", auto.Backend())
	}
}

func TestUseAfterClose(t *testing.T) {
	c := mustNew(t, exactConfig(minikv.DtypeF32))
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	n := tH * tD
	errs := []error{
		c.Decode(0, []uint32{0}, make([]float32, n), make([]float32, n)),
		c.Prefill(0, []uint32{0}, []int32{0, 1}, nil, nil, nil, nil),
		c.AppendDevice(0, []uint32{0}, 0, 0, 0),
		c.Release(0),
	}
	_, err := c.MemoryStats()
	errs = append(errs, err)
	_, err = c.KeptPositions(0, 0, 0)
	errs = append(errs, err)
	_, _, err = c.SequenceLength(0, 0)
	errs = append(errs, err)
	for i, err := range errs {
		if !errors.Is(err, minikv.ErrClosed) || !errors.Is(err, minikv.ErrBadState) {
			t.Fatalf("call %d after Close: %v, want ErrClosed / ErrBadState", i, err)
		}
	}
	if err := c.Close(); err != nil {
		t.Fatalf("Close after Close: %v", err)
	}
}

// Each failing call's message belongs to that call although goroutines hop between OS
// threads (the message is read inside the same cgo call as the failure).
func TestErrorMessagesPerCall(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF32)
	var wg sync.WaitGroup
	failures := make(chan string, 64)
	for g := 0; g < 16; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			c, err := minikv.New(cfg)
			if err != nil {
				failures <- err.Error()
				return
			}
			defer c.Close()
			for i := 0; i < 200; i++ {
				id := uint32(1000 + 16*i + g)
				err := c.Release(id)
				if want := fmt.Sprintf("seq_id (%d)", id); err == nil || !strings.Contains(err.Error(), want) {
					failures <- fmt.Sprintf("goroutine %d: %v, want a message naming %s", g, err, want)
					return
				}
			}
		}(g)
	}
	wg.Wait()
	close(failures)
	for f := range failures {
		t.Error(f)
	}
}

func TestVersion(t *testing.T) {
	v := minikv.Version()
	n := minikv.VersionNumber()
	if want := fmt.Sprintf("%d.%d.%d", n/10000, n/100%100, n%100); v != want {
		t.Fatalf("Version() = %q, VersionNumber() = %d", v, n)
	}
}

func TestHalfConversions(t *testing.T) {
	for _, tc := range []struct {
		f    float32
		bits uint16
	}{
		{1, 0x3c00}, {-2, 0xc000}, {65504, 0x7bff}, {65520, 0x7c00}, {0.1, 0x2e66},
		{5.960464477539063e-08, 0x0001}, {2.9e-08, 0x0000}, {3.0e-08, 0x0001},
		{float32(math.Inf(-1)), 0xfc00}, {6.103515625e-05, 0x0400}, {6.1e-05, 0x03ff},
	} {
		if got := minikv.F16Bits(tc.f); got != tc.bits {
			t.Errorf("F16Bits(%g) = %#04x, want %#04x", tc.f, got, tc.bits)
		}
	}
	for h := 0; h < 1<<16; h++ {
		f := minikv.F16Float(uint16(h))
		if f != f {
			if g := minikv.F16Bits(f); g&0x7c00 != 0x7c00 || g&0x3ff == 0 {
				t.Fatalf("F16 NaN %#04x came back as %#04x", h, g)
			}
			continue
		}
		if g := minikv.F16Bits(f); g != uint16(h) {
			t.Fatalf("F16 round trip %#04x -> %g -> %#04x", h, f, g)
		}
		if g := minikv.BF16Bits(minikv.BF16Float(uint16(h))); g != uint16(h) && uint16(h)&0x7f80 != 0x7f80 {
			t.Fatalf("BF16 round trip %#04x -> %#04x", h, g)
		}
	}
	if got := minikv.BF16Bits(1.00390625); got != 0x3f80 { // halfway: rounds to even
		t.Errorf("BF16Bits(1+2^-8) = %#04x, want 0x3f80", got)
	}
	if got := minikv.BF16Bits(1.01171875); got != 0x3f82 { // 1 + 3*2^-8: halfway, rounds up to even
		t.Errorf("BF16Bits(1+3*2^-8) = %#04x, want 0x3f82", got)
	}
}

// ---- presets and sinks -------------------------------------------------------------------

// Each preset sets its compression fields and leaves the rest; an unknown one is an error
// that changes nothing.
func TestPresets(t *testing.T) {
	cases := []struct {
		p                         minikv.Preset
		keyBits, valueBits, group uint32
		sinks                     uint32
		policy                    minikv.BudgetPolicy
		scores                    minikv.ScoreMode
		residual, flush           uint32
	}{
		// BALANCED flushes 32 tokens of a 64-token residual, the others the whole 128.
		{minikv.PresetBalanced, 4, 2, 32, 4, minikv.BudgetPyramid, minikv.ScoreWindow, 64, 32},
		{minikv.PresetPaper, 2, 2, 16, 0, minikv.BudgetPyramid, minikv.ScoreCumulative, 128, 0},
		{minikv.PresetQuality, 8, 8, 32, 4, minikv.BudgetUniform, minikv.ScoreCumulative, 128, 0},
		{minikv.PresetEvictionOnly, 16, 16, 16, 0, minikv.BudgetUniform, minikv.ScoreCumulative, 128, 0},
	}
	for _, tc := range cases {
		cfg := minikv.DefaultConfig()
		cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim, cfg.MaxSeqLen = 3, 8, 2, 96, 777
		cfg.Dtype, cfg.Backend = minikv.DtypeBF16, minikv.BackendCPU
		cfg.HeavyRatio, cfg.ResidualLength, cfg.FlushTokens = 0.9, 512, 96
		cfg.ScoreMode = minikv.ScoreWindow
		if tc.scores == minikv.ScoreWindow {
			cfg.ScoreMode = minikv.ScoreCumulative
		}
		if err := cfg.ApplyPreset(tc.p); err != nil {
			t.Fatalf("preset %d: %v", tc.p, err)
		}
		if cfg.KeyBits != tc.keyBits || cfg.ValueBits != tc.valueBits || cfg.GroupSize != tc.group ||
			cfg.SinkTokens != tc.sinks || cfg.BudgetPolicy != tc.policy || cfg.HeavyRatio != 0.25 ||
			cfg.RecentRatio != 0.25 || cfg.ResidualLength != tc.residual || cfg.FlushTokens != tc.flush ||
			cfg.ScoreMode != tc.scores {
			t.Fatalf("preset %d gave %+v", tc.p, cfg)
		}
		if cfg.NumLayers != 3 || cfg.NumHeads != 8 || cfg.NumKVHeads != 2 || cfg.HeadDim != 96 ||
			cfg.MaxSeqLen != 777 || cfg.Dtype != minikv.DtypeBF16 || cfg.Backend != minikv.BackendCPU {
			t.Fatalf("preset %d changed a non-compression field: %+v", tc.p, cfg)
		}
	}
	if d, b := minikv.DefaultConfig(), minikv.DefaultConfig(); b.ApplyPreset(minikv.PresetBalanced) != nil || d != b {
		t.Fatalf("the default is not PresetBalanced: %+v vs %+v", d, b)
	}
	cfg := minikv.DefaultConfig()
	before := cfg
	err := cfg.ApplyPreset(minikv.Preset(7))
	var me *minikv.Error
	if !errors.As(err, &me) || me.Status != minikv.StatusInvalidArgument || !strings.Contains(me.Message, "preset (7)") {
		t.Fatalf("unknown preset: %v", err)
	}
	if cfg != before {
		t.Fatalf("a failed ApplyPreset changed the config: %+v", cfg)
	}
}

// Sink tokens are the first kept positions of every head, inside the budget; a prompt
// shorter than the sinks keeps all of it; decode (bits 16) attends over exactly the kept
// rows.
func TestSinkTokens(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF32)
	cfg.NumLayers = 1
	cfg.HeavyRatio, cfg.RecentRatio, cfg.SinkTokens = 0.25, 0.25, 6
	c := mustNew(t, cfg)
	defer c.Close()
	rng := rand.New(rand.NewSource(21))
	lens := []int{80, 3}
	total := lens[0] + lens[1]
	q, _ := tensor(rng, total*tH*tD, identity)
	k, kd := tensor(rng, total*tHkv*tD, identity)
	v, vd := tensor(rng, total*tHkv*tD, identity)
	if err := c.Prefill(0, []uint32{0, 1}, []int32{0, 80, 83}, q, k, v, make([]float32, total*tH*tD)); err != nil {
		t.Fatal(err)
	}
	for h := 0; h < tHkv; h++ {
		kept, err := c.KeptPositions(0, 0, h)
		if err != nil {
			t.Fatal(err)
		}
		if len(kept) != 20+20 { // 20 heavy-hitter slots (6 of them the sinks) + 20 recent
			t.Fatalf("head %d kept %d positions", h, len(kept))
		}
		for i := 0; i < 6; i++ {
			if kept[i] != int32(i) {
				t.Fatalf("head %d: kept[%d] = %d, want the sink %d", h, i, kept[i], i)
			}
		}
		short, err := c.KeptPositions(1, 0, h)
		if err != nil || len(short) != 3 || short[0] != 0 || short[2] != 2 {
			t.Fatalf("a 3-token prompt with 6 sinks kept %v (%v)", short, err)
		}
	}
	// Decode over exactly the kept rows of sequence 0.
	qn, qnd := tensor(rng, tH*tD, identity)
	out := make([]float32, tH*tD)
	if err := c.Decode(0, []uint32{0}, qn, out); err != nil {
		t.Fatal(err)
	}
	want := make([]float64, tH*tD)
	for g := 0; g < tHkv; g++ {
		kept, _ := c.KeptPositions(0, 0, g)
		keys, vals := make([][]float64, len(kept)), make([][]float64, len(kept))
		for i, p := range kept {
			keys[i] = make([]float64, tHkv*tD)
			vals[i] = make([]float64, tHkv*tD)
			copy(keys[i][g*tD:], kd[(int(p)*tHkv+g)*tD:(int(p)*tHkv+g+1)*tD])
			copy(vals[i][g*tD:], vd[(int(p)*tHkv+g)*tD:(int(p)*tHkv+g+1)*tD])
		}
		full := attend(qnd, keys, vals, tH, tHkv, tD)
		for h := g * (tH / tHkv); h < (g+1)*(tH/tHkv); h++ {
			copy(want[h*tD:(h+1)*tD], full[h*tD:(h+1)*tD])
		}
	}
	if worst := maxAbsDiff(t, "decode over sinks + kept", out, want); worst > 1e-5 {
		t.Fatalf("decode differs from attention over the kept rows by %g", worst)
	}
}

func TestEnumNames(t *testing.T) {
	for got, want := range map[string]string{
		fmt.Sprint(minikv.BackendAuto): "AUTO", fmt.Sprint(minikv.BackendCPU): "CPU",
		fmt.Sprint(minikv.BackendCUDA): "CUDA", fmt.Sprint(minikv.DtypeF16): "F16",
		fmt.Sprint(minikv.DtypeBF16): "BF16", fmt.Sprint(minikv.DtypeF32): "F32",
		fmt.Sprint(minikv.BudgetUniform): "UNIFORM", fmt.Sprint(minikv.BudgetPyramid): "PYRAMID",
		fmt.Sprint(minikv.ScoreCumulative): "CUMULATIVE", fmt.Sprint(minikv.ScoreWindow): "WINDOW",
		fmt.Sprint(minikv.PresetBalanced): "BALANCED", fmt.Sprint(minikv.PresetEvictionOnly): "EVICTION_ONLY",
		minikv.Backend(7).String(): "Backend(7)", minikv.Dtype(-1).String(): "Dtype(-1)",
	} {
		if got != want {
			t.Errorf("got %q, want %q", got, want)
		}
	}
	cfg := minikv.DefaultConfig()
	cfg.Backend = minikv.BackendCPU
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 2, 1, 32
	cache, err := minikv.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer cache.Close()
	if s := fmt.Sprintf("%v on %s", cache.Backend(), cache.Config().Dtype); s != "CPU on F16" {
		t.Errorf("a cache prints as %q", s)
	}
}

// The bulk converters are the scalar ones, element by element, and feed a 16-bit cache
// straight from float32 data.
func TestBulkHalfConversions(t *testing.T) {
	rng := rand.New(rand.NewSource(3))
	src := []float32{0, -0.0, 1, -2, 65504, 65520, 1e-8, float32(math.Inf(1)), float32(math.NaN())}
	for i := 0; i < 1000; i++ {
		src = append(src, float32(rng.NormFloat64()*math.Pow(2, float64(rng.Intn(40)-20))))
	}
	f16, bf16 := minikv.F16BitsSlice(src), minikv.BF16BitsSlice(src)
	if len(f16) != len(src) || len(bf16) != len(src) {
		t.Fatalf("lengths %d, %d for %d values", len(f16), len(bf16), len(src))
	}
	back16, backBF := minikv.F16FloatSlice(f16), minikv.BF16FloatSlice(bf16)
	for i, f := range src {
		if f16[i] != minikv.F16Bits(f) || bf16[i] != minikv.BF16Bits(f) {
			t.Fatalf("%g: bulk %#04x/%#04x, scalar %#04x/%#04x", f, f16[i], bf16[i],
				minikv.F16Bits(f), minikv.BF16Bits(f))
		}
		if math.Float32bits(back16[i]) != math.Float32bits(minikv.F16Float(f16[i])) ||
			math.Float32bits(backBF[i]) != math.Float32bits(minikv.BF16Float(bf16[i])) {
			t.Fatalf("%g: bulk back %g/%g", f, back16[i], backBF[i])
		}
	}
	for _, dtype := range []minikv.Dtype{minikv.DtypeF16, minikv.DtypeBF16} {
		cfg := minikv.DefaultConfig()
		cfg.Backend, cfg.Dtype = minikv.BackendCPU, dtype
		cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 2, 1, 32
		cache, err := minikv.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		toBits := minikv.F16BitsSlice
		toFloat := minikv.F16FloatSlice
		if dtype == minikv.DtypeBF16 {
			toBits, toFloat = minikv.BF16BitsSlice, minikv.BF16FloatSlice
		}
		const tokens = 8
		q, k, v := make([]float32, tokens*2*32), make([]float32, tokens*32), make([]float32, tokens*32)
		for i := range q {
			q[i] = float32(rng.NormFloat64())
		}
		for i := range k {
			k[i], v[i] = float32(rng.NormFloat64()), 0.75 // attention of a constant is that constant
		}
		out := make([]uint16, len(q))
		if err := cache.Prefill16(0, []uint32{0}, []int32{0, tokens}, toBits(q), toBits(k), toBits(v), out); err != nil {
			t.Fatal(err)
		}
		for i, x := range toFloat(out) {
			if x != 0.75 {
				t.Fatalf("%v: output %d is %g, want 0.75", dtype, i, x)
			}
		}
		cache.Close()
	}
}

// A Cache used from two goroutines at once: its mutex serializes the calls, so each
// succeeds and sees the state before or after the other (the C library itself would fail
// the overlapping call with MINIKV_ERR_BAD_STATE; the wrapper never lets that happen).
// Goroutine A prefills and releases a long prompt; this goroutine queries meanwhile.
func TestConcurrentUseIsSerialized(t *testing.T) {
	const L = 512
	cfg := minikv.DefaultConfig()
	cfg.Backend = minikv.BackendCPU
	cfg.Dtype = minikv.DtypeF32
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 8, 2, 64
	cfg.MaxSequences, cfg.MaxSeqLen = 1, L
	c := mustNew(t, cfg)
	defer c.Close()
	rng := rand.New(rand.NewSource(5))
	tensor := func(heads int) []float32 {
		x := make([]float32, L*heads*64)
		for i := range x {
			x[i] = float32(rng.NormFloat64())
		}
		return x
	}
	q, k, v, out := tensor(8), tensor(2), tensor(2), make([]float32, L*8*64)
	done := make(chan error)
	go func() {
		for i := 0; i < 4; i++ {
			if err := c.Prefill(0, []uint32{0}, []int32{0, L}, q, k, v, out); err != nil {
				done <- err
				return
			}
			if err := c.Release(0); err != nil {
				done <- err
				return
			}
		}
		done <- nil
	}()
	queries := 0
	for {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("prefill goroutine: %v", err)
			}
			if queries == 0 {
				t.Fatal("no query ran")
			}
			return
		default:
		}
		seen, _, err := c.SequenceLength(0, 0)
		if err != nil || (seen != 0 && seen != L) {
			t.Fatalf("query during a prefill: seen %d, %v", seen, err)
		}
		queries++
	}
}

// TestPrefillChunk: a prompt sent in chunks (PrefillChunk) gives exactly the outputs and the
// kept positions of one Prefill; decode refuses a sequence mid-prompt; a mismatched
// promptLens is refused before the library is called.
func TestPrefillChunk(t *testing.T) {
	cfg := exactConfig(minikv.DtypeF32)
	cfg.NumLayers = 1
	cfg.HeavyRatio, cfg.RecentRatio = 0.25, 0.25
	cfg.PrefillStagingTokens = 100
	whole, chunked := mustNew(t, cfg), mustNew(t, cfg)
	defer whole.Close()
	defer chunked.Close()
	rng := rand.New(rand.NewSource(33))
	const L = 100
	q, _ := tensor(rng, L*tH*tD, identity)
	k, _ := tensor(rng, L*tHkv*tD, identity)
	v, _ := tensor(rng, L*tHkv*tD, identity)
	want := make([]float32, L*tH*tD)
	if err := whole.Prefill(0, []uint32{1}, []int32{0, L}, q, k, v, want); err != nil {
		t.Fatal(err)
	}
	got := make([]float32, L*tH*tD)
	for _, cut := range [][2]int{{0, 30}, {30, 31}, {31, 100}} {
		a, b := cut[0], cut[1]
		if err := chunked.PrefillChunk(0, []uint32{1}, []uint32{L}, []int32{0, int32(b - a)},
			q[a*tH*tD:b*tH*tD], k[a*tHkv*tD:b*tHkv*tD], v[a*tHkv*tD:b*tHkv*tD], got[a*tH*tD:b*tH*tD]); err != nil {
			t.Fatal(err)
		}
		if b < L {
			err := chunked.Decode(0, []uint32{1}, q[:tH*tD], make([]float32, tH*tD))
			if !errors.Is(err, minikv.ErrBadState) || !strings.Contains(err.Error(), "mid-prompt") {
				t.Fatalf("decode mid-prompt: %v, want ErrBadState naming mid-prompt", err)
			}
		}
	}
	for i := range got {
		if got[i] != want[i] {
			t.Fatalf("output element %d: chunked %v, one call %v", i, got[i], want[i])
		}
	}
	for h := 0; h < tHkv; h++ {
		a, _ := chunked.KeptPositions(1, 0, h)
		b, _ := whole.KeptPositions(1, 0, h)
		if fmt.Sprint(a) != fmt.Sprint(b) {
			t.Fatalf("head %d kept %v in chunks, %v in one call", h, a, b)
		}
	}
	err := chunked.PrefillChunk(0, []uint32{2}, nil, []int32{0, 1}, q[:tH*tD], k[:tHkv*tD], v[:tHkv*tD], got[:tH*tD])
	if !errors.Is(err, minikv.ErrInvalidArgument) || !strings.Contains(err.Error(), "promptLens has 0 entries") {
		t.Fatalf("nil promptLens: %v", err)
	}
}

// AppendDecode equals Append then Decode bit for bit (quantized cache, GQA, flushes, F32 and
// F16), and a failing AppendDecode appends nothing.
func TestAppendDecodeEqualsAppendThenDecode(t *testing.T) {
	for _, dtype := range []minikv.Dtype{minikv.DtypeF32, minikv.DtypeF16} {
		cfg := exactConfig(dtype)
		if err := cfg.ApplyPreset(minikv.PresetBalanced); err != nil {
			t.Fatal(err)
		}
		cfg.GroupSize, cfg.ResidualLength = 16, 16
		fused, split := mustNew(t, cfg), mustNew(t, cfg)
		rng := rand.New(rand.NewSource(31))
		ids, cu := []uint32{2, 0}, []int32{0, 70, 101}
		for layer := 0; layer < tLayers; layer++ {
			q, _ := tensor(rng, 101*tH*tD, identity)
			k, _ := tensor(rng, 101*tHkv*tD, identity)
			v, _ := tensor(rng, 101*tHkv*tD, identity)
			for _, c := range []*minikv.Cache{fused, split} {
				var err error
				if dtype == minikv.DtypeF32 {
					err = c.Prefill(layer, ids, cu, q, k, v, make([]float32, 101*tH*tD))
				} else {
					err = c.Prefill16(layer, ids, cu, minikv.F16BitsSlice(q), minikv.F16BitsSlice(k),
						minikv.F16BitsSlice(v), make([]uint16, 101*tH*tD))
				}
				if err != nil {
					t.Fatal(err)
				}
			}
		}
		for step := 0; step < 40; step++ { // 40 > ResidualLength: flushes
			for layer := 0; layer < tLayers; layer++ {
				q, _ := tensor(rng, 2*tH*tD, identity)
				k, _ := tensor(rng, 2*tHkv*tD, identity)
				v, _ := tensor(rng, 2*tHkv*tD, identity)
				var same bool
				if dtype == minikv.DtypeF32 {
					a, b := make([]float32, 2*tH*tD), make([]float32, 2*tH*tD)
					if err := fused.AppendDecode(layer, ids, q, k, v, a); err != nil {
						t.Fatal(err)
					}
					if err := split.Append(layer, ids, k, v); err != nil {
						t.Fatal(err)
					}
					if err := split.Decode(layer, ids, q, b); err != nil {
						t.Fatal(err)
					}
					same = len(a) == len(b)
					for i := range a {
						same = same && math.Float32bits(a[i]) == math.Float32bits(b[i])
					}
				} else {
					qh, kh, vh := minikv.F16BitsSlice(q), minikv.F16BitsSlice(k), minikv.F16BitsSlice(v)
					a, b := make([]uint16, 2*tH*tD), make([]uint16, 2*tH*tD)
					if err := fused.AppendDecode16(layer, ids, qh, kh, vh, a); err != nil {
						t.Fatal(err)
					}
					if err := split.Append16(layer, ids, kh, vh); err != nil {
						t.Fatal(err)
					}
					if err := split.Decode16(layer, ids, qh, b); err != nil {
						t.Fatal(err)
					}
					same = len(a) == len(b)
					for i := range a {
						same = same && a[i] == b[i]
					}
				}
				if !same {
					t.Fatalf("dtype %v step %d layer %d: AppendDecode differs from Append + Decode", dtype, step, layer)
				}
			}
		}
		// A NaN in q fails the whole call: no token appended.
		seenBefore, _, _ := fused.SequenceLength(0, 0)
		q, _ := tensor(rng, 2*tH*tD, identity)
		k, _ := tensor(rng, 2*tHkv*tD, identity)
		q[5] = float32(math.NaN())
		var err error
		if dtype == minikv.DtypeF32 {
			err = fused.AppendDecode(0, ids, q, k, k, make([]float32, 2*tH*tD))
		} else {
			err = fused.AppendDecode16(0, ids, minikv.F16BitsSlice(q), minikv.F16BitsSlice(k),
				minikv.F16BitsSlice(k), make([]uint16, 2*tH*tD))
		}
		if !errors.Is(err, minikv.ErrInvalidArgument) || !strings.Contains(err.Error(), "minikv_append_decode") {
			t.Fatalf("AppendDecode with a NaN query: %v", err)
		}
		if seenAfter, _, _ := fused.SequenceLength(0, 0); seenAfter != seenBefore {
			t.Fatalf("a failed AppendDecode appended: %d -> %d positions", seenBefore, seenAfter)
		}
		if dtype == minikv.DtypeF32 { // the binding's own length check
			err := fused.AppendDecode(0, ids, q[:3], k, k, make([]float32, 2*tH*tD))
			if !errors.Is(err, minikv.ErrInvalidArgument) || !strings.Contains(err.Error(), "len(q) is 3") {
				t.Fatalf("AppendDecode with a short q: %v", err)
			}
		}
		fused.Close()
		split.Close()
	}
}
