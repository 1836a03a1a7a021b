#!/usr/bin/env bash
# scripts/version.sh — libminikv's version, written once in include/minikv.h
# (MINIKV_VERSION_MAJOR/MINOR/PATCH) and carried into every file that needs it: the Python
# package (pyproject.toml, minikv/_version.py), the Rust crates and their lock files, and the
# version constants of the committed SWIG and bindgen output. The list is
# cmake/SyncVersion.cmake; CTest's version.consistent runs the check.
#
#   scripts/version.sh            prints the version
#   scripts/version.sh --check    fails, naming each file, when one differs from the header
#   scripts/version.sh X.Y.Z      writes X.Y.Z into the header and every listed file (then
#                                 add a CHANGELOG.md section and commit)
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"

case "${1:-}" in
  "")
    sed -n 's/^#define MINIKV_VERSION_\(MAJOR\|MINOR\|PATCH\) \([0-9]*\)$/\2/p' \
      "$MINIKV_ROOT/include/minikv.h" | paste -sd. ;;
  --check)
    cmake -DMODE=check -P "$MINIKV_ROOT/cmake/SyncVersion.cmake" ;;
  [0-9]*)
    cmake -DMODE=write "-DVERSION=$1" -P "$MINIKV_ROOT/cmake/SyncVersion.cmake" ;;
  *)
    die "unknown argument '$1' (see scripts/version.sh --help)" ;;
esac
