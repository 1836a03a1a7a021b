// Command example runs create → prefill → append → decode → stats → destroy with libminikv's
// Go binding on the CPU backend, in the paper's setting (FP16, 2-bit keys and values, group
// 16, heavy and recent budgets of 25% each): one layer, GQA 8/2 heads of 128, two prompts of
// 1000 and 600 tokens, 200 decode steps. It prints the compression and the error of the last
// decode against exact float64 attention over every token the "model" produced.
//
// The synthetic data has what makes eviction work on real models: a few prompt tokens (5%)
// whose keys share a direction with every query, so they draw most of the attention.
//
//	PKG_CONFIG_PATH=<prefix>/lib/pkgconfig LD_LIBRARY_PATH=<prefix>/lib go run .
package main

import (
	"errors"
	"fmt"
	"log"
	"math"
	"math/rand"

	"minikv.dev/minikv"
)

const (
	heads, kvHeads, headDim = 8, 2, 128
	steps                   = 200
)

var (
	rng   = rand.New(rand.NewSource(7))
	topic [kvHeads][headDim]float64 // one unit direction per KV head
)

func main() {
	cfg := minikv.DefaultConfig() // PresetBalanced: F16, K4V2, G=32, 4 sinks, R=128, h=r=0.25
	cfg.Backend = minikv.BackendCPU
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, heads, kvHeads, headDim
	cfg.MaxSequences, cfg.MaxSeqLen = 2, 2048
	fmt.Printf("libminikv %s: %d-bit keys, %d-bit values, group %d, %d sinks, residual %d, heavy %.2f, recent %.2f\n",
		minikv.Version(), cfg.KeyBits, cfg.ValueBits, cfg.GroupSize, cfg.SinkTokens, cfg.ResidualLength,
		cfg.HeavyRatio, cfg.RecentRatio)

	for h := range topic {
		n := 0.0
		for i := range topic[h] {
			topic[h][i] = rng.NormFloat64()
			n += topic[h][i] * topic[h][i]
		}
		for i := range topic[h] {
			topic[h][i] /= math.Sqrt(n)
		}
	}
	seqIDs := []uint32{0, 1}
	lens := []int{1000, 600}
	cu := []int32{0, int32(lens[0]), int32(lens[0] + lens[1])}
	total := lens[0] + lens[1]
	q := make([]float32, total*heads*headDim)
	k := make([]float32, total*kvHeads*headDim)
	v := make([]float32, total*kvHeads*headDim)
	for t := 0; t < total; t++ {
		query(q, t)
		keyValue(k, v, t, rng.Float64() < 0.05)
	}
	// Every K/V row each sequence ever got, as the FP16 values the cache received.
	var keys, vals [2][]float32
	for s := range keys {
		row := int(cu[s]) * kvHeads * headDim
		keys[s] = append([]float32{}, k[row:row+lens[s]*kvHeads*headDim]...)
		vals[s] = append([]float32{}, v[row:row+lens[s]*kvHeads*headDim]...)
	}

	cache, err := minikv.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close() // minikv_cache_destroy

	if err := cache.Prefill16(0, seqIDs, cu, minikv.F16BitsSlice(q), minikv.F16BitsSlice(k),
		minikv.F16BitsSlice(v), make([]uint16, len(q))); err != nil {
		log.Fatal(err)
	}
	q1 := make([]float32, 2*heads*headDim)
	out := make([]uint16, 2*heads*headDim)
	for step := 0; step < steps; step++ {
		k1 := make([]float32, 2*kvHeads*headDim)
		v1 := make([]float32, 2*kvHeads*headDim)
		for s := 0; s < 2; s++ {
			keyValue(k1, v1, s, false)
			query(q1, s)
		}
		if err := cache.Append16(0, seqIDs, minikv.F16BitsSlice(k1), minikv.F16BitsSlice(v1)); err != nil {
			log.Fatal(err)
		}
		for s := 0; s < 2; s++ {
			r := s * kvHeads * headDim
			keys[s] = append(keys[s], k1[r:r+kvHeads*headDim]...)
			vals[s] = append(vals[s], v1[r:r+kvHeads*headDim]...)
		}
		if err := cache.Decode16(0, seqIDs, minikv.F16BitsSlice(q1), out); err != nil {
			log.Fatal(err)
		}
	}

	st, err := cache.MemoryStats()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("tokens seen %d, kept %d; %d bytes in use vs %d for an FP16 cache: compression %.1f%%\n",
		st.TokensSeen, st.TokensCached, st.UsedBytes, st.FP16EquivalentBytes, 100*st.CompressionRatio)
	for s := 0; s < 2; s++ {
		exact := attend(q1[s*heads*headDim:(s+1)*heads*headDim], keys[s], vals[s])
		var diff, norm float64
		for i, e := range exact {
			d := float64(minikv.F16Float(out[s*heads*headDim+i])) - e
			diff, norm = diff+d*d, norm+e*e
		}
		fmt.Printf("sequence %d: last decode vs exact attention, relative L2 error %.4f\n", s, math.Sqrt(diff/norm))
	}

	// Errors carry the library's status and message, matched with errors.Is.
	err = cache.Decode16(0, []uint32{7}, make([]uint16, heads*headDim), make([]uint16, heads*headDim))
	if errors.Is(err, minikv.ErrInvalidArgument) {
		fmt.Println("a bad call returns:", err)
	}
}

// query fills row t of q: noise plus 2.5 along its KV head's topic.
func query(q []float32, t int) {
	for h := 0; h < heads; h++ {
		for i := 0; i < headDim; i++ {
			q[(t*heads+h)*headDim+i] = round(rng.NormFloat64() + 2.5*topic[h/(heads/kvHeads)][i])
		}
	}
}

// keyValue fills row t of k and v; an important token's key has 2.5*sqrt(D) along the topic.
func keyValue(k, v []float32, t int, important bool) {
	for h := 0; h < kvHeads; h++ {
		for i := 0; i < headDim; i++ {
			along := 0.0
			if important {
				along = 2.5 * math.Sqrt(headDim) * topic[h][i]
			}
			k[(t*kvHeads+h)*headDim+i] = round(rng.NormFloat64() + along)
			v[(t*kvHeads+h)*headDim+i] = round(rng.NormFloat64())
		}
	}
}

func round(x float64) float32 { return minikv.F16Float(minikv.F16Bits(float32(x))) }

// attend is exact float64 attention of one token's query over all rows of keys/vals.
func attend(q, keys, vals []float32) []float64 {
	n := len(keys) / (kvHeads * headDim)
	out := make([]float64, heads*headDim)
	p := make([]float64, n)
	for h := 0; h < heads; h++ {
		kh := h / (heads / kvHeads)
		maxLogit, sum := math.Inf(-1), 0.0
		for t := 0; t < n; t++ {
			dot := 0.0
			for i := 0; i < headDim; i++ {
				dot += float64(q[h*headDim+i]) * float64(keys[(t*kvHeads+kh)*headDim+i])
			}
			p[t] = dot / math.Sqrt(headDim)
			maxLogit = math.Max(maxLogit, p[t])
		}
		for t := range p {
			p[t] = math.Exp(p[t] - maxLogit)
			sum += p[t]
		}
		for t := range p {
			for i := 0; i < headDim; i++ {
				out[h*headDim+i] += p[t] / sum * float64(vals[(t*kvHeads+kh)*headDim+i])
			}
		}
	}
	return out
}
