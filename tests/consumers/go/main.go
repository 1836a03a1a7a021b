// Command minikvconsumer is a user's first program with the Go binding, built from a
// directory outside the source tree (scripts/bindings-swig.sh copies it out): create →
// prefill → append → decode → stats → close on the CPU backend (New applies the version rule).
package main

import (
	"fmt"
	"log"
	"math"

	"minikv.dev/minikv"
)

func main() {
	const heads, kvHeads, headDim, prompt = 4, 2, 64, 40
	cfg := minikv.DefaultConfig()
	cfg.Backend, cfg.Dtype = minikv.BackendCPU, minikv.DtypeF32
	cfg.NumLayers, cfg.NumHeads, cfg.NumKVHeads, cfg.HeadDim = 1, heads, kvHeads, headDim
	cfg.MaxSequences, cfg.MaxSeqLen = 1, 128
	cache, err := minikv.New(cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer cache.Close()

	q := make([]float32, prompt*heads*headDim)
	k := make([]float32, prompt*kvHeads*headDim)
	v := make([]float32, prompt*kvHeads*headDim)
	for i := range q {
		q[i] = float32(math.Sin(float64(i)))
	}
	for i := range k {
		k[i], v[i] = float32(math.Cos(float64(i))), 0.5 // attention of a constant is that constant
	}
	out := make([]float32, len(q))
	seq := []uint32{0}
	if err := cache.Prefill(0, seq, []int32{0, prompt}, q, k, v, out); err != nil {
		log.Fatal(err)
	}
	if err := cache.Append(0, seq, k[:kvHeads*headDim], v[:kvHeads*headDim]); err != nil {
		log.Fatal(err)
	}
	o := make([]float32, heads*headDim)
	if err := cache.Decode(0, seq, q[:heads*headDim], o); err != nil {
		log.Fatal(err)
	}
	for i, x := range append(out, o...) {
		if math.Abs(float64(x)-0.5) > 1e-6 {
			log.Fatalf("output %d is %g, want 0.5", i, x)
		}
	}
	st, err := cache.MemoryStats()
	if err != nil || st.TokensSeen != prompt+1 {
		log.Fatalf("stats %+v, %v", st, err)
	}
	fmt.Printf("Go consumer OK: libminikv %s, backend %v, %d of %d tokens kept\n",
		minikv.Version(), cache.Backend(), st.TokensCached, st.TokensSeen)
}
