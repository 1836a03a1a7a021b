//go:build cuda

// The device path (PrefillDevice/AppendDevice/DecodeDevice with uintptr addresses and a
// stream) on the CUDA backend. Built only with -tags cuda, and then it requires libcudart, a
// GPU and a CUDA build of libminikv (a missing piece is a failure, not a skip):
//
//	go test -tags cuda -run Device ./...
package minikv_test

import (
	"math"
	"math/rand"
	"testing"
	"unsafe"

	"minikv.dev/minikv"
	"minikv.dev/minikv/internal/cudart"
)

// devBuf is device memory holding n uint16 elements.
type devBuf struct {
	t   *testing.T
	ptr uintptr
	n   int
}

func newDev(t *testing.T, n int) *devBuf {
	t.Helper()
	p, err := cudart.Malloc(2 * n)
	if err != nil {
		t.Fatal(err)
	}
	return &devBuf{t, p, n}
}

func upload(t *testing.T, host []uint16) *devBuf {
	t.Helper()
	d := newDev(t, len(host))
	if err := cudart.ToDevice(d.ptr, unsafe.Pointer(&host[0]), 2*len(host)); err != nil {
		t.Fatal(err)
	}
	return d
}

func (d *devBuf) host() []uint16 {
	d.t.Helper()
	h := make([]uint16, d.n)
	if err := cudart.ToHost(unsafe.Pointer(&h[0]), d.ptr, 2*d.n); err != nil {
		d.t.Fatal(err)
	}
	return h
}

func (d *devBuf) free() {
	if err := cudart.Free(d.ptr); err != nil {
		d.t.Error(err)
	}
}

func needCUDA(t *testing.T, cfg minikv.Config) *minikv.Cache {
	t.Helper()
	if err := cudart.Load(); err != nil {
		t.Fatalf("-tags cuda needs the CUDA runtime and a GPU: %v", err)
	}
	cfg.Backend = minikv.BackendCUDA
	c, err := minikv.New(cfg)
	if err != nil {
		t.Fatalf("a CUDA cache (is libminikv built with the CUDA backend?): %v", err)
	}
	if c.Backend() != minikv.BackendCUDA {
		t.Fatalf("backend %d", c.Backend())
	}
	return c
}

func halves(b []uint16) []float32 {
	f := make([]float32, len(b))
	for i, x := range b {
		f[i] = minikv.F16Float(x)
	}
	return f
}

// f16Tensor draws n fp16 values in [-1, 1) and returns their bits and float64 values.
func f16Tensor(rng *rand.Rand, n int) ([]uint16, []float64) {
	b := make([]uint16, n)
	d := make([]float64, n)
	for i := range b {
		b[i] = minikv.F16Bits(float32(rng.Float64()*2 - 1))
		d[i] = float64(minikv.F16Float(b[i]))
	}
	return b, d
}

// Lossless (16-bit, keep everything) on CUDA through device addresses and a created stream:
// every prefill and decode output equals float64 attention, across flushes (R = 16) and a
// ragged batch in non-contiguous slots.
func TestDeviceExactAttention(t *testing.T) {
	const D = 64 // CUDA builds compile head_dim 64 and 128
	cfg := exactConfig(minikv.DtypeF16)
	cfg.HeadDim = D
	c := needCUDA(t, cfg)
	defer c.Close()
	stream, err := cudart.StreamCreate()
	if err != nil {
		t.Fatal(err)
	}
	defer cudart.StreamDestroy(stream)
	rng := rand.New(rand.NewSource(11))
	seqs := []uint32{2, 0} // prompts of 37 and 50 tokens
	cu := []int32{0, 37, 87}
	const total, tol = 87, 2e-3
	keys := map[[2]int][][]float64{}
	vals := map[[2]int][][]float64{}
	worst := 0.0
	for layer := 0; layer < tLayers; layer++ {
		q, qd := f16Tensor(rng, total*tH*D)
		k, kd := f16Tensor(rng, total*tHkv*D)
		v, vd := f16Tensor(rng, total*tHkv*D)
		dq, dk, dv, dout := upload(t, q), upload(t, k), upload(t, v), newDev(t, total*tH*D)
		if err := c.PrefillDevice(layer, seqs, cu, dq.ptr, dk.ptr, dv.ptr, dout.ptr, stream); err != nil {
			t.Fatal(err)
		}
		if err := cudart.StreamSynchronize(stream); err != nil {
			t.Fatal(err)
		}
		out := halves(dout.host())
		for _, b := range []*devBuf{dq, dk, dv, dout} {
			b.free()
		}
		for s, id := range seqs {
			key := [2]int{int(id), layer}
			for tok := int(cu[s]); tok < int(cu[s+1]); tok++ {
				keys[key] = append(keys[key], kd[tok*tHkv*D:(tok+1)*tHkv*D])
				vals[key] = append(vals[key], vd[tok*tHkv*D:(tok+1)*tHkv*D])
				want := attend(qd[tok*tH*D:(tok+1)*tH*D], keys[key], vals[key], tH, tHkv, D)
				worst = math.Max(worst, maxAbsDiff(t, "device prefill", out[tok*tH*D:(tok+1)*tH*D], want))
			}
		}
	}
	for step := 0; step < 40; step++ {
		for layer := 0; layer < tLayers; layer++ {
			k, kd := f16Tensor(rng, 2*tHkv*D)
			v, vd := f16Tensor(rng, 2*tHkv*D)
			q, qd := f16Tensor(rng, 2*tH*D)
			dk, dv, dq, dout := upload(t, k), upload(t, v), upload(t, q), newDev(t, 2*tH*D)
			if err := c.AppendDevice(layer, seqs, dk.ptr, dv.ptr, stream); err != nil {
				t.Fatal(err)
			}
			if err := c.DecodeDevice(layer, seqs, dq.ptr, dout.ptr, stream); err != nil {
				t.Fatal(err)
			}
			if err := cudart.StreamSynchronize(stream); err != nil {
				t.Fatal(err)
			}
			out := halves(dout.host())
			for _, b := range []*devBuf{dq, dk, dv, dout} {
				b.free()
			}
			for s, id := range seqs {
				key := [2]int{int(id), layer}
				keys[key] = append(keys[key], kd[s*tHkv*D:(s+1)*tHkv*D])
				vals[key] = append(vals[key], vd[s*tHkv*D:(s+1)*tHkv*D])
				want := attend(qd[s*tH*D:(s+1)*tH*D], keys[key], vals[key], tH, tHkv, D)
				worst = math.Max(worst, maxAbsDiff(t, "device decode", out[s*tH*D:(s+1)*tH*D], want))
			}
		}
	}
	if worst > tol {
		t.Fatalf("CUDA: max |out - float64 attention| = %g > %g", worst, tol)
	}
	st, err := c.MemoryStats()
	if err != nil {
		t.Fatal(err)
	}
	if want := uint64(37+50+2*40) * tLayers; st.TokensSeen != want || st.TokensCached != want {
		t.Fatalf("stats %+v, want %d tokens", st, want)
	}
	// Host slices are refused on a CUDA cache (they would be read as device addresses).
	if err := c.Decode16(0, seqs, make([]uint16, 2*tH*D), make([]uint16, 2*tH*D)); err == nil {
		t.Fatal("host slices accepted by a CUDA cache")
	}
	t.Logf("CUDA worst error vs float64 attention: %.3g", worst)
}

// The defaults (PresetBalanced: 4-bit keys, 2-bit values, 4 sinks) on CUDA and on CPU, fed
// the same data: identical memory statistics and close decode outputs.
func TestDeviceMatchesCPU(t *testing.T) {
	cfg := minikv.DefaultConfig()
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 8, 2, 128
	cfg.MaxSequences, cfg.MaxSeqLen = 2, 1200
	gpu := needCUDA(t, cfg)
	defer gpu.Close()
	cfg.Backend = minikv.BackendCPU
	cpu := mustNew(t, cfg)
	defer cpu.Close()
	rng := rand.New(rand.NewSource(12))
	seqs, cu := []uint32{1, 0}, []int32{0, 700, 1000}
	const total, qRow, kvRow = 1000, 8 * 128, 2 * 128
	normal := func(n int) []uint16 {
		b := make([]uint16, n)
		for i := range b {
			b[i] = minikv.F16Bits(float32(rng.NormFloat64()))
		}
		return b
	}
	closeTo := func(what string, got, want []uint16, atol, rtol float64) float64 {
		t.Helper()
		worst := 0.0
		for i := range want {
			g, w := float64(minikv.F16Float(got[i])), float64(minikv.F16Float(want[i]))
			d := math.Abs(g - w)
			if math.IsNaN(g) || d > atol+rtol*math.Abs(w) {
				t.Fatalf("%s: element %d is %g, CPU %g", what, i, g, w)
			}
			worst = math.Max(worst, d)
		}
		return worst
	}
	q, k, v := normal(total*qRow), normal(total*kvRow), normal(total*kvRow)
	cpuOut := make([]uint16, total*qRow)
	if err := cpu.Prefill16(0, seqs, cu, q, k, v, cpuOut); err != nil {
		t.Fatal(err)
	}
	dq, dk, dv, dout := upload(t, q), upload(t, k), upload(t, v), newDev(t, total*qRow)
	if err := gpu.PrefillDevice(0, seqs, cu, dq.ptr, dk.ptr, dv.ptr, dout.ptr, 0); err != nil {
		t.Fatal(err)
	}
	closeTo("prefill CUDA vs CPU", dout.host(), cpuOut, 2e-3, 4e-3) // cudaMemcpy waits
	for _, b := range []*devBuf{dq, dk, dv, dout} {
		b.free()
	}
	worst := 0.0
	for step := 0; step < 150; step++ {
		nk, nv, nq := normal(2*kvRow), normal(2*kvRow), normal(2*qRow)
		co := make([]uint16, 2*qRow)
		if err := cpu.Append16(0, seqs, nk, nv); err != nil {
			t.Fatal(err)
		}
		if err := cpu.Decode16(0, seqs, nq, co); err != nil {
			t.Fatal(err)
		}
		dk, dv, dq, dout := upload(t, nk), upload(t, nv), upload(t, nq), newDev(t, 2*qRow)
		if err := gpu.AppendDevice(0, seqs, dk.ptr, dv.ptr, 0); err != nil {
			t.Fatal(err)
		}
		if err := gpu.DecodeDevice(0, seqs, dq.ptr, dout.ptr, 0); err != nil {
			t.Fatal(err)
		}
		worst = math.Max(worst, closeTo("decode CUDA vs CPU", dout.host(), co, 5e-3, 1e-2))
		for _, b := range []*devBuf{dq, dk, dv, dout} {
			b.free()
		}
	}
	g, err := gpu.MemoryStats()
	if err != nil {
		t.Fatal(err)
	}
	c, _ := cpu.MemoryStats()
	if g.UsedBytes != c.UsedBytes || g.TokensSeen != c.TokensSeen || g.TokensCached != c.TokensCached ||
		g.CompressionRatio != c.CompressionRatio {
		t.Fatalf("stats differ: CUDA %+v, CPU %+v", g, c)
	}
	for _, p := range [][2]int{{0, 0}, {1, 1}} {
		gk, err := gpu.KeptPositions(uint32(p[0]), 0, p[1])
		if err != nil {
			t.Fatal(err)
		}
		ck, _ := cpu.KeptPositions(uint32(p[0]), 0, p[1])
		in := map[int32]bool{}
		for _, x := range ck {
			in[x] = true
		}
		same := 0
		for _, x := range gk {
			if in[x] {
				same++
			}
		}
		// Scores are fp32 sums in a different order: a near-tie may swap a token or two.
		if len(gk) != len(ck) || same+2 < len(ck) {
			t.Fatalf("seq %d head %d: %d of %d kept positions agree", p[0], p[1], same, len(ck))
		}
	}
	t.Logf("largest |CUDA - CPU| decode difference over 150 steps: %.3g; compression %.4f", worst, g.CompressionRatio)
}

// AppendDecodeDevice (one launch where no flush is due) equals AppendDevice then
// DecodeDevice on another cache bit for bit, across flushes (R = 16).
func TestDeviceAppendDecode(t *testing.T) {
	cfg := minikv.DefaultConfig()
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, 8, 2, 64
	cfg.MaxSequences, cfg.MaxSeqLen, cfg.GroupSize, cfg.ResidualLength = 2, 400, 16, 16
	fused, split := needCUDA(t, cfg), needCUDA(t, cfg)
	defer fused.Close()
	defer split.Close()
	rng := rand.New(rand.NewSource(13))
	seqs, cu := []uint32{1, 0}, []int32{0, 150, 250}
	q, _ := f16Tensor(rng, 250*8*64)
	k, _ := f16Tensor(rng, 250*2*64)
	dq, dk, dv, dout := upload(t, q), upload(t, k), upload(t, k), newDev(t, 250*8*64)
	for _, c := range []*minikv.Cache{fused, split} {
		if err := c.PrefillDevice(0, seqs, cu, dq.ptr, dk.ptr, dv.ptr, dout.ptr, 0); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range []*devBuf{dq, dk, dv, dout} {
		b.free()
	}
	for step := 0; step < 40; step++ {
		q, _ := f16Tensor(rng, 2*8*64)
		k, _ := f16Tensor(rng, 2*2*64)
		v, _ := f16Tensor(rng, 2*2*64)
		dq, dk, dv, da, db := upload(t, q), upload(t, k), upload(t, v), newDev(t, 2*8*64), newDev(t, 2*8*64)
		if err := fused.AppendDecodeDevice(0, seqs, dq.ptr, dk.ptr, dv.ptr, da.ptr, 0); err != nil {
			t.Fatal(err)
		}
		if err := split.AppendDevice(0, seqs, dk.ptr, dv.ptr, 0); err != nil {
			t.Fatal(err)
		}
		if err := split.DecodeDevice(0, seqs, dq.ptr, db.ptr, 0); err != nil {
			t.Fatal(err)
		}
		a, b := da.host(), db.host()
		for i := range a {
			if a[i] != b[i] {
				t.Fatalf("step %d element %d: AppendDecodeDevice %#04x, AppendDevice + DecodeDevice %#04x", step, i, a[i], b[i])
			}
		}
		for _, x := range []*devBuf{dq, dk, dv, da, db} {
			x.free()
		}
	}
}
