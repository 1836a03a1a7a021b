#!/usr/bin/env bash
# scripts/gpu-engine.sh — minikv-engine on a GPU machine. Steps (STEPS, default all three):
#   build  libminikv with CUDA (sm_90a unless MINIKV_CUDA_ARCHS) and minikv-engine (its CUDA
#          backend; its CPU backend too where a CBLAS is installed); incremental;
#   check  examples/engine/check_transformers.py --backend cuda: the engine against
#          transformers on the same GPU — tokenizer, logits at 16-bit keep-all within
#          tolerances derived from transformers' own f16/bf16 error, greedy text,
#          continuous batching — on SmolLM2-135M when its GGUF is here (MINIKV_GGUF, or
#          .models/ from scripts/fetch-model.sh), else on a small random LLaMA the check
#          writes itself (--synthetic); then, with the real model, a long-prompt generation
#          through the default MiniKV cache. Needs python3 with torch + transformers and the
#          `gguf` package (installed, or .models/python from fetch-model.sh, carried);
#   bench  minikv-engine --bench: latency vs context at batch 1 and tokens/s at the largest
#          batch within 40 GB, LLaMA-2-7B and Llama-3-8B shapes, full 16-bit cache vs MiniKV
#          (extra arguments go to it, e.g. --random llama2-7b to run one model per call).
# Writes under $OUT (default <build>/engine): engine-build.log, engine-check.log,
# engine-generate.log, engine-bench-<stamp>.log, engine-bench-<stamp>.json and, where matplotlib is
# installed, its two PNGs (examples/engine/plot_bench.py).
#
#   scripts/gpu-engine.sh [build-dir] [minikv-engine --bench flags...]
#   STEPS="build check" scripts/gpu-engine.sh        # then: STEPS="build bench" ...
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${1:-$root/build-gpu-engine}
shift || true
out=${OUT:-$build/engine}
steps=" ${STEPS:-build check bench} "
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
note() { printf '    %s\n' "$*"; }
engine=$build/examples/engine/minikv-engine
commit=${MINIKV_COMMIT:-$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)}
export MINIKV_COMMIT=$commit
status=0

if [[ $steps == *" build "* ]]; then
  echo "==> build (log: $out/engine-build.log)"
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DMINIKV_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHS:-90a}" -DMINIKV_TESTS=OFF -DMINIKV_EXAMPLES=ON \
    >>"$out/engine-build.log" 2>&1 || { tail -30 "$out/engine-build.log"; exit 1; }
  ninja -C "$build" -j "${JOBS:-$(nproc)}" minikv-engine >>"$out/engine-build.log" 2>&1 ||
    { tail -40 "$out/engine-build.log"; exit 1; }
  grep -h 'minikv-engine:' "$out/engine-build.log" | tail -1 | sed 's/^-- /    /'
fi
[ -x "$engine" ] || { echo "gpu-engine.sh: no $engine (run the build step)"; exit 1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/    /' || true

if [[ $steps == *" check "* ]]; then
  echo "==> check: the engine (CUDA) vs transformers (log: $out/engine-check.log)"
  model=${MINIKV_GGUF:-${MINIKV_MODELS_DIR:-$root/.models}/SmolLM2-135M-Instruct.Q4_1.gguf}
  if ! python3 -c 'import torch, transformers, numpy' 2>/dev/null; then
    note "skipped: python3 has no torch + transformers + numpy"
  else
    what=(--model "$model")
    [ -f "$model" ] || { what=(--synthetic); note "no $model: on a synthetic model"; }
    python3 "$root/examples/engine/check_transformers.py" --engine "$engine" --backend cuda "${what[@]}" \
      2>&1 | tee "$out/engine-check.log" || status=1
    if [ -f "$model" ]; then
      echo "==> a long prompt through the default MiniKV cache (log: $out/engine-generate.log)"
      corpus=${MINIKV_CORPUS:-$root/../shared/data/corpus}
      source_text=$root/README.md
      [ -f "$corpus/austen_persuasion.txt.gz" ] && source_text=$corpus/austen_persuasion.txt.gz
      "$engine" --model "$model" --backend cuda -n 64 --prompt-file <(python3 - "$source_text" <<'EOF'
import gzip, sys
path = sys.argv[1]
text = (gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8")).read()
print(text[20000:60000] + "\n\nIn one sentence, what is this text about?")
EOF
      ) 2>&1 | tee "$out/engine-generate.log" || status=1
    fi
  fi
fi

if [[ $steps == *" bench "* ]]; then
  echo "==> bench"
  stamp=$(date -u +%Y%m%d-%H%M%S)
  bench_ok=1
  "$engine" --bench --backend cuda --json "$out/engine-bench-$stamp.json" --commit "$commit" "$@" 2>&1 |
    tee "$out/engine-bench-$stamp.log" || { bench_ok=0; status=1; }
  if [ "$bench_ok" = 1 ] && python3 -c 'import matplotlib' 2>/dev/null; then
    python3 "$root/examples/engine/plot_bench.py" "$out/engine-bench-$stamp.json" || true
  fi
fi
[ "$status" = 0 ] || { echo "gpu-engine.sh: a step failed (logs in $out)"; exit 1; }
echo "==> gpu-engine.sh: done ($out)"
