#!/usr/bin/env bash
# scripts/gpu-engine.sh — minikv-engine (examples/engine) on a GPU machine. Steps:
#   build  libminikv with CUDA and minikv-engine (its CUDA backend; its CPU backend too
#          where a CBLAS is installed); incremental;
#   check  examples/engine/check_transformers.py --backend cuda: the engine against
#          transformers on the same GPU (tokenizer, logits at 16-bit keep-all within
#          tolerances derived from transformers' own f16/bf16 error, greedy text,
#          continuous batching), on SmolLM2-135M when its GGUF is here, else on a small
#          random LLaMA the check writes itself (--synthetic); with the real model, then a
#          long prompt through the default MiniKV cache. Needs python3 with torch +
#          transformers and the `gguf` package (installed, or .models/python from
#          scripts/fetch-model.sh);
#   compare  examples/engine/compare_runs.py on SmolLM2-135M's GGUF, or on MINIKV_GGUF (python3
#          with numpy; a GPU machine that cannot take SmolLM2's 98 MB can take the 19 MB
#          synthetic model of `check_transformers.py --write-synthetic F`, written where the
#          gguf package is, with MINIKV_CPU_REFERENCE made there on the same F): greedy
#          tokens and logits of the fused-GEMV decode step vs cuBLAS
#          (--no-gemv), full and default-MiniKV caches, batch 1 and 3; against the CPU
#          backend's run too: here where this build has the CPU backend, else from
#          MINIKV_CPU_REFERENCE (a runs/cpu directory of compare_runs.py --variants cpu
#          made on a machine with OpenBLAS);
#   bench  minikv-engine --bench: latency vs context at batch 1 and tokens/s at the largest
#          batch within 40 GB, LLaMA-2-7B and Llama-3-8B shapes, the full 16-bit cache vs
#          MiniKV settings; the arguments go to it (e.g. --random llama2-7b: one model).
# Writes to $OUT: engine-build.log, engine-check.log, engine-generate.log, engine-compare.log,
# engine-bench-<stamp>.log and .json, and (with matplotlib) the JSON's two PNGs.
#
#   scripts/gpu-engine.sh [minikv-engine --bench flags...]
#   STEPS="build check" scripts/gpu-engine.sh; STEPS="build bench" scripts/gpu-engine.sh
# Environment (all optional):
#   STEPS              which steps, in this order     (build check compare bench)
#   MINIKV_BUILD_DIR   build directory                (build-gpu-engine in the repository)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES (90a)
#   MINIKV_JOBS        parallel build jobs            (nproc)
#   MINIKV_GGUF        SmolLM2's GGUF                 (.models/SmolLM2-135M-Instruct.Q4_1.gguf)
#   MINIKV_CORPUS      text for the checks            (../shared/data/corpus, else README.md)
#   OUT                results and logs               (<build>/engine)
#   MINIKV_CPU_REFERENCE  compare: the CPU backend's runs from elsewhere
#   MINIKV_COMMIT      commit label when .git is absent
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_positional_build_dir "$@"

build=${MINIKV_BUILD_DIR:-$MINIKV_ROOT/build-gpu-engine}
out=${OUT:-$build/engine}
steps=" ${STEPS:-build check compare bench} "
mkdir -p "$out"
export PATH=$PATH:/usr/local/cuda/bin
engine=$build/examples/engine/minikv-engine
export MINIKV_COMMIT=${MINIKV_COMMIT:-$(git -C "$MINIKV_ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
status=0

if [[ $steps == *" build "* ]]; then
  step "build (log: $out/engine-build.log)"
  configure "$build" -DMINIKV_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES="${MINIKV_CUDA_ARCHITECTURES:-90a}" -DMINIKV_TESTS=OFF \
    -DMINIKV_EXAMPLES=ON >>"$out/engine-build.log" 2>&1 || { tail -30 "$out/engine-build.log"; exit 1; }
  ninja -C "$build" -j "${MINIKV_JOBS:-$(nproc)}" minikv-engine >>"$out/engine-build.log" 2>&1 ||
    { tail -40 "$out/engine-build.log"; exit 1; }
  note "$(grep -h 'minikv-engine:' "$out/engine-build.log" | tail -1 | sed 's/^-- //')"
fi
[ -x "$engine" ] || die "no $engine (run the build step)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/    /' || true

if [[ $steps == *" check "* ]]; then
  step "check: the engine (CUDA) against transformers (log: $out/engine-check.log)"
  model=${MINIKV_GGUF:-$MINIKV_ROOT/.models/SmolLM2-135M-Instruct.Q4_1.gguf}
  if ! python3 -c 'import torch, transformers, numpy' 2>/dev/null; then
    note "skipped: python3 has no torch + transformers + numpy"
  else
    what=(--model "$model")
    [ -f "$model" ] || { what=(--synthetic); note "no $model: on a synthetic model"; }
    python3 "$MINIKV_ROOT/examples/engine/check_transformers.py" --engine "$engine" --backend cuda \
      "${what[@]}" 2>&1 | tee "$out/engine-check.log" || status=1
    if [ -f "$model" ]; then
      step "a long prompt through the default MiniKV cache (log: $out/engine-generate.log)"
      corpus=${MINIKV_CORPUS:-$MINIKV_ROOT/../shared/data/corpus}
      source_text=$MINIKV_ROOT/README.md
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

if [[ $steps == *" compare "* ]]; then
  step "compare: fused GEMV decode vs cuBLAS vs the CPU backend (log: $out/engine-compare.log)"
  model=${MINIKV_GGUF:-$MINIKV_ROOT/.models/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ ! -f "$model" ]; then
    note "skipped: no $model (scripts/fetch-model.sh)"; status=1
  else
    variants=(cuda "cuda --no-gemv")
    reference=()
    if [ -n "${MINIKV_CPU_REFERENCE:-}" ]; then reference=(--reference "$MINIKV_CPU_REFERENCE")
    elif "$engine" --random tiny --backend cpu --prompt x -n 1 --quiet >/dev/null 2>&1; then
      variants=(cpu "${variants[@]}") # this build has the CPU backend
    else note "no CPU backend in this build and no MINIKV_CPU_REFERENCE: GEMV vs cuBLAS only"
    fi
    python3 "$MINIKV_ROOT/examples/engine/compare_runs.py" --engine "$engine" --model "$model" \
      --out "$out/compare" "${reference[@]}" --variants "${variants[@]}" 2>&1 |
      tee "$out/engine-compare.log" || status=1
  fi
fi

if [[ $steps == *" bench "* ]]; then
  stamp=$(date -u +%Y%m%d-%H%M%S)
  step "bench (log: $out/engine-bench-$stamp.log)"
  bench_ok=1
  "$engine" --bench --backend cuda --json "$out/engine-bench-$stamp.json" --commit "$MINIKV_COMMIT" "$@" 2>&1 |
    tee "$out/engine-bench-$stamp.log" || { bench_ok=0; status=1; }
  if [ "$bench_ok" = 1 ] && python3 -c 'import matplotlib' 2>/dev/null; then
    python3 "$MINIKV_ROOT/examples/engine/plot_bench.py" "$out/engine-bench-$stamp.json" || true
  fi
fi
[ "$status" = 0 ] || die "a step failed (logs in $out)"
step "gpu-engine.sh: done ($out)"
