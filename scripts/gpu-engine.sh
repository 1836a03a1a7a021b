#!/usr/bin/env bash
# scripts/gpu-engine.sh — minikv-engine on a GPU machine, in one go:
#   1. builds libminikv with CUDA (sm_90a by default) and minikv-engine (its CUDA backend,
#      and its CPU backend where a CBLAS is installed);
#   2. the correctness check on the real SmolLM2-135M against transformers on the same GPU
#      (examples/engine/check_transformers.py --backend cuda: logits at 16-bit keep-all
#      within tolerances derived from transformers' own f16/bf16 error, greedy text,
#      continuous batching), and a short generation with the default MiniKV cache — when
#      the model (MINIKV_GGUF, or .models/ from scripts/fetch-model.sh), torch +
#      transformers and the corpus (MINIKV_CORPUS, or ../shared/data/corpus) are there;
#   3. the benchmark (minikv-engine --bench): latency vs context at batch 1 and tokens/s at
#      the largest batch within 40 GB, LLaMA-2-7B and Llama-3-8B shapes, full 16-bit cache
#      vs MiniKV.
# Everything is written under $OUT (default <build>/engine): engine-build.log,
# engine-check.log, engine-generate.log, engine-bench.log, engine-bench-<stamp>.json and,
# where matplotlib is installed, its two PNGs (examples/engine/plot_bench.py).
#
#   scripts/gpu-engine.sh [build-dir] [minikv-engine --bench flags...]
#   e.g. scripts/gpu-engine.sh build-gpu-engine --contexts 1024,4096,32768,131072
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-gpu-engine}
shift || true
out=${OUT:-$build/engine}
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
note() { printf '    %s\n' "$*"; }

echo "==> build (log: $out/engine-build.log)"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMINIKV_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHS:-90a}" -DMINIKV_TESTS=OFF -DMINIKV_EXAMPLES=ON \
  >"$out/engine-build.log" 2>&1 || { tail -30 "$out/engine-build.log"; exit 1; }
ninja -C "$build" -j "${JOBS:-$(nproc)}" minikv-engine >>"$out/engine-build.log" 2>&1 ||
  { tail -40 "$out/engine-build.log"; exit 1; }
engine=$build/examples/engine/minikv-engine
commit=${MINIKV_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export MINIKV_COMMIT=$commit
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/    /' || true

echo "==> correctness: SmolLM2-135M, engine (CUDA) vs transformers"
model=${MINIKV_GGUF:-${MINIKV_MODELS_DIR:-$root/.models}/SmolLM2-135M-Instruct.Q4_1.gguf}
corpus=${MINIKV_CORPUS:-$root/../shared/data/corpus}
check_rc=0
if [ ! -f "$model" ]; then
  note "skipped: no $model (scripts/fetch-model.sh, or set MINIKV_GGUF)"
elif [ ! -d "$corpus" ]; then
  note "skipped: no corpus at $corpus (set MINIKV_CORPUS)"
elif ! python3 -c 'import torch, transformers, numpy' 2>/dev/null; then
  note "skipped: python3 has no torch + transformers + numpy"
else
  MINIKV_CORPUS=$corpus python3 "$root/examples/engine/check_transformers.py" --engine "$engine" \
    --backend cuda --model "$model" 2>&1 | tee "$out/engine-check.log" || check_rc=$?
  "$engine" --model "$model" --backend cuda -n 64 --prompt-file <(python3 - "$corpus" <<'EOF'
import gzip, os, sys
text = gzip.open(os.path.join(sys.argv[1], "austen_persuasion.txt.gz"), "rt", encoding="utf-8").read()
print(text[20000:60000] + "\n\nIn one sentence, what is this passage about?")
EOF
  ) 2>&1 | tee "$out/engine-generate.log" || check_rc=$?
fi

echo "==> benchmark (log: $out/engine-bench.log)"
stamp=$(date -u +%Y%m%d-%H%M%S)
bench_rc=0
"$engine" --bench --backend cuda --json "$out/engine-bench-$stamp.json" --commit "$commit" "$@" 2>&1 |
  tee "$out/engine-bench.log" || bench_rc=$?
if [ "$bench_rc" = 0 ] && python3 -c 'import matplotlib' 2>/dev/null; then
  python3 "$root/examples/engine/plot_bench.py" "$out/engine-bench-$stamp.json" || true
fi
if [ "$check_rc" != 0 ] || [ "$bench_rc" != 0 ]; then
  echo "gpu-engine.sh: check exit $check_rc, bench exit $bench_rc"
  exit 1
fi
echo "==> gpu-engine.sh: done ($out)"
