#!/usr/bin/env bash
# scripts/test.sh — installs what is missing, builds libminikv with its tests and examples,
# and runs the whole test suite that this machine can run:
#   0. with nvcc, the library also with one head_dim (MINIKV_CUDA_HEAD_DIMS=128);
#   1. ctest, labels cpu (CPU backend + contract tests) and install (install tree consumed
#      through CMake's find_package and pkg-config); label gpu too when a GPU is visible;
#      first scripts/check-test-registration.sh: every compiled doctest case is registered
#      under a label (the counts of both agree);
#   2. the Python binding's tests (bindings/python/tests) against the built library, then
#      the Python package: its wheel installed into a fresh venv, smoke-tested from outside
#      the source tree; the transformers adapter (torch etc. from PyPI, ~3.5 GB);
#   3. the Go/Java (scripts/bindings-swig.sh) and Rust (scripts/bindings-rust.sh) bindings,
#      each with a consumer project built outside the source tree;
#   4. scripts/reliability.sh: ASan+UBSan and TSan suites, bounded libFuzzer runs;
#   5. the C examples and demo with small flags (the demo checks its exact reference
#      against float64).
# The CUDA backend is compiled whenever nvcc exists (CI has nvcc but no GPU: it must
# compile even though it cannot run there).
#
# Environment (all optional):
#   MINIKV_BUILD_DIR   build directory                (build-test in the repository)
#   MINIKV_CUDA        AUTO | ON | OFF                (AUTO: ON when nvcc is found)
#   MINIKV_CUDA_ARCHITECTURES  CMAKE_CUDA_ARCHITECTURES for the CUDA build
#   MINIKV_BUILD_TYPE  CMake build type               (Release)
#   MINIKV_JOBS        parallel build / test jobs     (nproc)
#   MINIKV_SKIP_WHEEL=1        skip the Python package stage
#   MINIKV_SKIP_HF=1           skip the transformers adapter stage (~3.5 GB from PyPI)
#   MINIKV_SKIP_BINDINGS=1     skip the Go, Java and Rust bindings
#   MINIKV_SKIP_RELIABILITY=1  skip the sanitizer builds and fuzzing (~10 minutes)
#   FUZZ_SECONDS       seconds of fuzzing per target  (60)
#   MINIKV_CORPUS      text corpus of the accuracy smoke test (../shared/data/corpus)
# Works on a fresh Debian 12 as root (CI) or as a user with sudo; safe to run again.
#   scripts/test.sh            run it all;   scripts/test.sh --help   print this and exit
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"
cd "$MINIKV_ROOT"

BUILD=${MINIKV_BUILD_DIR:-$MINIKV_ROOT/build-test}
JOBS=${MINIKV_JOBS:-$(nproc)}
start=$SECONDS

step "dependencies"
install_packages build-essential cmake ninja-build pkg-config doctest-dev libhwy-dev libopenblas-dev
# mypy (Debian's): the Python binding's typing tests and the wheel's type check.
install_packages python3-mypy
PY=""
if [ -d bindings/python/tests ]; then
  PY=$(pick_python)
  if [ -z "$PY" ]; then
    install_packages python3-numpy python3-pytest
    PY=$(pick_python)
    [ -n "$PY" ] || die "no python3 with numpy and pytest, even after installing python3-numpy python3-pytest"
  fi
  note "python: $PY"
fi

step "configure ($BUILD)"
choose_cuda "${MINIKV_CUDA:-AUTO}" compile
configure "$BUILD" -DMINIKV_TESTS=ON -DMINIKV_EXAMPLES=ON "${CUDA_ARGS[@]}"

step "build (-j$JOBS)"
cmake --build "$BUILD" -j "$JOBS"

# MINIKV_CUDA_HEAD_DIMS builds a subset of the kernels' head_dims (README): a subset must
# compile too (-Werror: a layout used only by the head_dims left out warns as unused).
if [ "$CUDA_STATE" = ON ]; then
  step "CUDA library with one head_dim (MINIKV_CUDA_HEAD_DIMS=128)"
  configure "$BUILD/cuda-hd128" "${CUDA_ARGS[@]}" -DMINIKV_CUDA_HEAD_DIMS=128
  cmake --build "$BUILD/cuda-hd128" -j "$JOBS" --target minikv
fi

step "test registration: every compiled doctest case runs under a label"
bash scripts/check-test-registration.sh "$BUILD"

step "ctest: labels cpu and install"
ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -j "$JOBS" -L 'cpu|install'
if [ "$CUDA_STATE" = ON ]; then
  if gpu_visible; then
    step "ctest: label gpu"
    ctest --test-dir "$BUILD" --output-on-failure --no-tests=error -L gpu
  else
    note "CUDA backend compiled; no GPU visible, so the gpu-labelled tests are not run here"
  fi
fi

LIB="$BUILD/libminikv.so"
[ -f "$LIB" ] || die "the build did not produce $LIB"
if [ -n "$PY" ]; then
  step "python binding tests"
  rc=0
  # The tensor-parallel tests (torchrun, two ranks) run once, in the adapter stage below.
  MINIKV_LIBRARY="$LIB" "$PY" -m pytest bindings/python/tests -q \
    --ignore=bindings/python/tests/test_hf_tp.py || rc=$?
  if [ "$rc" = 5 ]; then
    note "pytest collected no test in bindings/python/tests"
  elif [ "$rc" != 0 ]; then
    die "python binding tests failed (pytest exit $rc)"
  fi
fi

# The Python package as a user gets it: `pip wheel ./bindings/python` (scikit-build-core
# builds a CPU libminikv into it), installed into a fresh venv, then a smoke test run from a
# directory outside the source tree without MINIKV_LIBRARY. PyPI: scikit-build-core for the
# build, numpy for the venv. MINIKV_SKIP_WHEEL=1 skips it.
if [ -n "$PY" ] && [ "${MINIKV_SKIP_WHEEL:-0}" != 1 ]; then
  step "python package: wheel, fresh venv, smoke test outside the source tree"
  install_packages python3-venv
  wheel_venv="$BUILD/wheel-venv" wheel_dir="$BUILD/wheel" smoke_dir="$BUILD/wheel-smoke"
  rm -rf "$wheel_venv" "$wheel_dir" "$smoke_dir"
  "$PY" -m venv "$wheel_venv"
  "$wheel_venv/bin/python" -m pip wheel -q --disable-pip-version-check --no-deps \
    --config-settings=build-dir="$BUILD/wheel-build" -w "$wheel_dir" "$MINIKV_ROOT/bindings/python"
  wheel=$(ls "$wheel_dir"/minikv-*.whl)
  case "$wheel" in *-none-any.whl) die "$wheel has no platform tag" ;; esac
  note "built $(basename "$wheel")"
  "$wheel_venv/bin/python" -m pip install -q --disable-pip-version-check "$wheel"
  mkdir -p "$smoke_dir"
  cp "$MINIKV_ROOT/tests/consumers/python/smoke.py" "$smoke_dir/"
  (cd "$smoke_dir" && env -u MINIKV_LIBRARY -u PYTHONPATH "$wheel_venv/bin/python" smoke.py)
  # The installed package's types (py.typed) as mypy sees them: the smoke test passes enum
  # fields by name, as the README does.
  for mypy_py in "$PY" /usr/bin/python3; do
    "$mypy_py" -m mypy --version >/dev/null 2>&1 || continue
    (cd "$smoke_dir" && "$mypy_py" -m mypy --no-incremental \
      --python-executable "$wheel_venv/bin/python" smoke.py)
    break
  done
fi

# The transformers adapter (bindings/python/minikv/hf.py) against a tiny random LLaMA on the
# CPU backend: torch + transformers from PyPI in a venv (PyPI's torch brings CUDA libraries:
# ~3.5 GB download, ~6 GB on disk). Skipped when the disk has less than 12 GB free or
# MINIKV_SKIP_HF=1.
# accelerate: transformers needs it to load a model under a tensor-parallel plan.
HF_PACKAGES=(torch==2.15.0 transformers==5.24.0 gguf==0.19.0 accelerate==1.15.0)
if [ -n "$PY" ] && [ "${MINIKV_SKIP_HF:-0}" != 1 ]; then
  free_kb=$(df -Pk "$BUILD" | awk 'NR==2 {print $4}')
  if [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
    note "transformers adapter tests skipped: less than 12 GB free on $BUILD's disk"
  else
    step "transformers adapter tests (venv: ${HF_PACKAGES[*]})"
    install_packages python3-venv
    venv="$BUILD/hf-venv"
    [ -x "$venv/bin/python" ] || "$PY" -m venv --system-site-packages "$venv"
    "$venv/bin/python" -m pip install -q --disable-pip-version-check "${HF_PACKAGES[@]}" numpy pytest
    # test_hf_tp.py: the adapter under transformers' tensor parallelism, two ranks (torchrun)
    # on the CPU with gloo, against one process. test_gemma3.py: sliding-window layers and the
    # gemma3 loader on tiny random models (the real Gemma 3 only where it was fetched).
    MINIKV_LIBRARY="$LIB" "$venv/bin/python" -m pytest bindings/python/tests/test_hf.py \
      bindings/python/tests/test_hf_tp.py bindings/python/tests/test_gemma3.py -q
    # The system benchmark end to end on a 2-layer model (its pool sizing is checked against
    # the library's kept-token counts); output in the build tree, not bench/results.
    step "system benchmark smoke (scripts/system_bench.py --tiny)"
    MINIKV_LIBRARY="$LIB" "$venv/bin/python" scripts/system_bench.py --tiny --out-dir "$BUILD/system-tiny"
    # The tensor-parallel launchers, two ranks on the CPU with gloo, small sizes: the system
    # benchmark (figures 11 and 13) and generation (examples/python/tp_generate.py).
    step "tensor parallelism: torchrun, 2 ranks, gloo (system_bench.py --tiny, tp_generate.py)"
    torchrun=("$venv/bin/python" -m torch.distributed.run --standalone --nproc-per-node 2)
    OMP_NUM_THREADS=1 MINIKV_NUM_THREADS=1 MINIKV_LIBRARY="$LIB" "${torchrun[@]}" \
      scripts/system_bench.py --device cpu --tiny --figures 11,13 --mem-batches 1,2 --max-batch 2 \
      --gen 8 --latency-prompts 128 --latency-gen 4 --out-dir "$BUILD/system-tiny-tp2"
    OMP_NUM_THREADS=1 MINIKV_NUM_THREADS=1 MINIKV_LIBRARY="$LIB" "${torchrun[@]}" \
      examples/python/tp_generate.py --device cpu --batch 2 --prompt-tokens 64 --new-tokens 8
    # The accuracy evaluation on the real model (SmolLM2-135M from PyPI, ~98 MB), small
    # sizes: 16-bit keep-all must reproduce the model's own attention (--check).
    corpus=${MINIKV_CORPUS:-$MINIKV_ROOT/../shared/data/corpus}
    if [ -d "$corpus" ]; then
      step "accuracy evaluation smoke (SmolLM2-135M, scripts/eval_accuracy.py --check)"
      PIP="$venv/bin/python -m pip" scripts/fetch-model.sh
      MINIKV_CORPUS=$corpus MINIKV_LIBRARY="$LIB" "$venv/bin/python" scripts/eval_accuracy.py \
        --device cpu --contexts 512 --ppl-windows 2 --decode-tokens 16 --passkey-trials 4 \
        --greedy-prompts 2 --greedy-tokens 8 --configs minikv16,pyramid-50,balanced \
        --out "$BUILD/accuracy-smoke.json" --check
      step "simulated storage formats smoke (bench/simulate_kv_quant.py --check)"
      MINIKV_CORPUS=$corpus "$venv/bin/python" bench/simulate_kv_quant.py --contexts 512 \
        --windows 2 --decode-tokens 16 --out "$BUILD/simulated-quant-smoke.json" --check
      # minikv-engine (C, OpenBLAS + libminikv's CPU backend) against transformers on the
      # same model: tokenizer, logits at 16-bit keep-all over 512 + 64 tokens, greedy
      # text, continuous batching.
      if [ -x "$BUILD/examples/engine/minikv-engine" ]; then
        step "minikv-engine vs transformers (SmolLM2-135M, examples/engine/check_transformers.py)"
        MINIKV_CORPUS=$corpus "$venv/bin/python" examples/engine/check_transformers.py \
          --engine "$BUILD/examples/engine/minikv-engine"
      fi
    else
      note "accuracy evaluation smoke skipped: no corpus at $corpus (set MINIKV_CORPUS)"
    fi
  fi
fi

# Go + Java (SWIG) and Rust (bindgen): each script installs its toolchain from Debian, builds
# its own CPU libminikv (under this build directory), regenerates the committed generated
# code and fails on a diff, then runs the binding's tests, example and consumer project.
# MINIKV_SKIP_BINDINGS=1 skips them.
if [ "${MINIKV_SKIP_BINDINGS:-0}" != 1 ]; then
  for lang in swig rust; do
    step "scripts/bindings-$lang.sh"
    MINIKV_BUILD_DIR="$BUILD/bindings-$lang" bash "scripts/bindings-$lang.sh"
  done
fi

# Reliability: sanitizer builds of the suite and bounded fuzzing (MINIKV_SKIP_RELIABILITY=1
# skips; FUZZ_SECONDS bounds each fuzz target).
if [ "${MINIKV_SKIP_RELIABILITY:-0}" != 1 ] && [ -f scripts/reliability.sh ]; then
  step "scripts/reliability.sh"
  bash scripts/reliability.sh
fi

step "C example (examples/c/decode_loop.c)"
"$BUILD/examples/decode_loop"

step "demo (small run)"
backend=cpu
[ "$CUDA_STATE" = ON ] && backend=auto  # the CUDA build's demo picks the GPU when there is one
"$BUILD/tools/minikv_demo" --backend "$backend" --layers 3 --prompt 600 --gen 40 --every 10
"$BUILD/tools/minikv_demo" --backend "$backend" --layers 2 --heads 4 --kv-heads 4 --prompt 300 \
  --gen 140 --batch 2 --dtype bf16 --mode window --policy uniform --group 32 --residual 64 --every 35

step "scripts/test.sh: all passed in $((SECONDS - start)) s"
