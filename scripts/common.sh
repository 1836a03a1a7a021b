# shellcheck shell=bash
# Shared helpers of the scripts in scripts/ and bench/ and of .ci/run. Source it; not a
# program. Everything here is idempotent: a second run installs nothing and reuses the build.
#
# The conventions every script follows:
#   - its header comment says what it does and lists its settings; `--help` (or -h) as the
#     first argument prints that header and exits, with no other effect (help_if_asked);
#   - settings are environment variables with the same names everywhere: MINIKV_BUILD_DIR,
#     MINIKV_CUDA (AUTO|ON|OFF), MINIKV_CUDA_ARCHITECTURES, MINIKV_BUILD_TYPE, MINIKV_JOBS,
#     MINIKV_LIBRARY (a built libminikv.so to use instead of building one), OUT (where
#     results and logs go);
#   - step / note / die for output, install_packages for Debian packages.

MINIKV_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Prints the header comment of script $1 (after the shebang, up to the first line that is
# not a comment).
script_header() {
  sed -n '2,/^[^#]/{/^#/{s/^# \{0,1\}//;p}}' "$1"
}

# When the first argument is --help or -h: prints the calling script's header and exits 0.
help_if_asked() {
  case "${1:-}" in
    -h|--help) script_header "${BASH_SOURCE[1]}"; exit 0 ;;
  esac
}

step() { printf '\n==> %s\n' "$*"; }
note() { printf '    %s\n' "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# The build directory is MINIKV_BUILD_DIR in every script: stops, saying so, when the first
# argument names a directory (some scripts took it as their first argument).
no_positional_build_dir() {
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ] && { [ -d "$1" ] || [[ "$1" == */* ]]; }; then
    die "the build directory is a setting now: MINIKV_BUILD_DIR=$1 $(basename "${BASH_SOURCE[1]}") (see --help)"
  fi
}

# For scripts that take no arguments (their settings are environment variables): stops on
# any argument instead of ignoring it.
no_arguments() {
  [ $# -eq 0 ] || die "$(basename "${BASH_SOURCE[1]}") takes no arguments, got '$*' (settings are environment variables: see --help)"
}

# The A/B scripts' LABEL=PATH arguments, up to a "--", into the arrays ab_labels and
# ab_paths; ab_shift = how many arguments that was (the "--" included). $1 names PATH in
# messages.
parse_ab_args() {
  local what=$1
  shift
  ab_labels=() ab_paths=() ab_shift=0
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do
    case $1 in
      *=*) ab_labels+=("${1%%=*}") ab_paths+=("${1#*=}") ;;
      *) die "expected LABEL=$what, got '$1' (see --help)" ;;
    esac
    shift
    ab_shift=$((ab_shift + 1))
  done
  [ $# -gt 0 ] && ab_shift=$((ab_shift + 1))
  [ ${#ab_labels[@]} -ge 2 ] || die "name at least two (LABEL=$what)"
}

# Stops when a setting is given under its former name $1 (now $2).
renamed_setting() {
  [ -z "${!1:-}" ] || die "$1 is now $2 (the same name in every script): set $2=${!1}"
}

# Installs the Debian packages among "$@" that are not installed yet (nothing when all are).
# Root runs apt-get itself; others go through sudo.
install_packages() {
  local missing=() p
  for p in "$@"; do
    if [ "$(dpkg-query -W -f='${db:Status-Status}' "$p" 2>/dev/null)" != installed ]; then
      missing+=("$p")
    fi
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  command -v apt-get >/dev/null || die "missing packages (${missing[*]}) and no apt-get: install them by hand"
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || die "missing packages (${missing[*]}): run as root or install sudo"
    sudo=(sudo)
  fi
  note "installing Debian packages: ${missing[*]}"
  # Wait for a lock held by another apt instead of failing at once.
  local apt=("${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 -q)
  "${apt[@]}" update -qq || die "apt-get update failed"
  "${apt[@]}" install -y --no-install-recommends "${missing[@]}" ||
    die "apt-get install ${missing[*]} failed"
}

# Path of nvcc (CUDACXX, /usr/local/cuda/bin/nvcc, or PATH), or nothing.
find_nvcc() {
  if [ -n "${CUDACXX:-}" ] && [ -x "${CUDACXX}" ]; then echo "$CUDACXX"
  elif [ -x /usr/local/cuda/bin/nvcc ]; then echo /usr/local/cuda/bin/nvcc
  else command -v nvcc 2>/dev/null || true
  fi
}

# Fills the array CUDA_ARGS with the CMake flags that choose the CUDA backend.
#   $1: the request, AUTO | ON | OFF (MINIKV_CUDA)
#   $2: "compile" to build CUDA whenever nvcc exists (CI: it must compile, it cannot run),
#       "run" to build it only when a GPU is visible too (the demo: no long kernel build
#       on a machine that could not use it).
# Sets CUDA_STATE (read by the scripts) to ON or OFF.
# shellcheck disable=SC2034
choose_cuda() {
  local request=${1:-AUTO} purpose=${2:-compile} nvcc
  request=$(printf '%s' "$request" | tr '[:lower:]' '[:upper:]')
  CUDA_ARGS=()
  CUDA_STATE=OFF
  case "$request" in AUTO|ON|OFF) ;; *) die "MINIKV_CUDA must be AUTO, ON or OFF (got '$1')" ;; esac
  if [ "$request" = OFF ]; then
    CUDA_ARGS=(-DMINIKV_CUDA=OFF); return 0
  fi
  if [ ! -f "$MINIKV_ROOT/kernels/CMakeLists.txt" ]; then
    [ "$request" = ON ] && die "MINIKV_CUDA=ON but kernels/CMakeLists.txt does not exist yet"
    note "CUDA backend: off (kernels/CMakeLists.txt does not exist yet)"
    CUDA_ARGS=(-DMINIKV_CUDA=OFF); return 0
  fi
  nvcc=$(find_nvcc)
  if [ -z "$nvcc" ]; then
    [ "$request" = ON ] && die "MINIKV_CUDA=ON but nvcc was not found (set CUDACXX)"
    note "CUDA backend: off (no nvcc)"
    CUDA_ARGS=(-DMINIKV_CUDA=OFF); return 0
  fi
  if ! cmake_handles_cuda "$nvcc"; then
    local why="this CMake's FindCUDAToolkit fails on a CUDA toolkit without libnvToolsExt (CUDA >= 13); a newer CMake ('pip install cmake') has the fix"
    [ "$request" = ON ] && die "MINIKV_CUDA=ON but $why"
    note "CUDA backend: off ($why)"
    CUDA_ARGS=(-DMINIKV_CUDA=OFF); return 0
  fi
  if [ "$request" = AUTO ] && [ "$purpose" = run ] && ! gpu_visible; then
    note "CUDA backend: off (nvcc found but no GPU visible; MINIKV_CUDA=ON builds it anyway)"
    CUDA_ARGS=(-DMINIKV_CUDA=OFF); return 0
  fi
  note "CUDA backend: on ($nvcc)"
  CUDA_STATE=ON
  CUDA_ARGS=(-DMINIKV_CUDA=ON "-DCMAKE_CUDA_COMPILER=$nvcc")
  if [ -n "${MINIKV_CUDA_ARCHITECTURES:-}" ]; then
    CUDA_ARGS+=("-DCMAKE_CUDA_ARCHITECTURES=$MINIKV_CUDA_ARCHITECTURES")
  fi
}

# False for the one known CMake/CUDA clash: Debian 12's CMake 3.25.1 FindCUDAToolkit sets a
# property on CUDA::nvToolsExt without checking that the target exists, and CUDA 13 ships no
# libnvToolsExt, so find_package(CUDAToolkit) is a hard configure error. (Images that patched
# the module, as the CI image did, pass.)
cmake_handles_cuda() {
  local nvcc=$1 root bin ver module
  root=$(cd "$(dirname "$nvcc")/.." && pwd)
  bin=$(readlink -f "$(command -v cmake)")
  ver=$(cmake --version | sed -n '1s/^cmake version \([0-9]*\.[0-9]*\).*/\1/p')
  module="$(dirname "$bin")/../share/cmake-$ver/Modules/FindCUDAToolkit.cmake"
  [ -f "$module" ] || return 0
  if grep -q 'if(CMAKE_MINIMUM_REQUIRED_VERSION VERSION_GREATER_EQUAL 3.25)' "$module" &&
     ! compgen -G "$root/lib64/libnvToolsExt*" >/dev/null && ! compgen -G "$root/lib/libnvToolsExt*" >/dev/null; then
    return 1
  fi
  return 0
}

# True when an NVIDIA GPU can be used here.
gpu_visible() {
  command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '
}

# Configures (first run) or re-configures (later runs, cheap) a Ninja build.
#   $1: build dir; then extra CMake arguments.
configure() {
  local build=$1; shift
  if [ -f "$build/CMakeCache.txt" ] && ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$build/CMakeCache.txt"; then
    die "$build was configured with another CMake generator: remove it or set MINIKV_BUILD_DIR"
  fi
  cmake -S "$MINIKV_ROOT" -B "$build" -G Ninja \
    -DCMAKE_BUILD_TYPE="${MINIKV_BUILD_TYPE:-Release}" "$@"
}

# A Python 3 with numpy and pytest (the current python3, else Debian's), or nothing.
pick_python() {
  local py
  for py in python3 /usr/bin/python3; do
    if command -v "$py" >/dev/null 2>&1 && "$py" -c 'import numpy, pytest' >/dev/null 2>&1; then
      command -v "$py"; return 0
    fi
  done
}
