#!/usr/bin/env bash
# Builds and checks the Rust bindings against a CPU build of libminikv (what CI runs):
#   1. installs Debian's bindgen and pkg-config (and cmake, ninja) when missing;
#   2. builds libminikv (CPU only) into the build directory and installs it into
#      <build>/install (for the pkg-config route);
#   3. regenerates bindings/rust/minikv-sys/src/bindings.rs and fails if it differs from
#      the committed file;
#   4. with MINIKV_LIB_DIR and LD_LIBRARY_PATH set: cargo test, clippy (-D warnings),
#      fmt --check and rustdoc (-D warnings) for both crates, then runs examples/rust;
#   5. builds the example again finding the library through the pkg-config program only,
#      then a consumer crate outside the source tree (tests/consumers/rust) the same way,
#      run with the rpath it was linked with, and checks that the build fails with a clear
#      message when neither route finds the library.
# Cargo output goes to <build>/cargo (CARGO_TARGET_DIR), nothing into the source tree.
#
# Environment (all optional):
#   MINIKV_BUILD_DIR  build directory        (build-rust in the repository)
#   MINIKV_JOBS       parallel build jobs    (nproc)
#   CI=true           a missing Rust toolchain fails instead of skipping
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"
root=$MINIKV_ROOT
build="${MINIKV_BUILD_DIR:-$root/build-rust}"
jobs="${MINIKV_JOBS:-$(nproc)}"
sys="$root/bindings/rust/minikv-sys"
safe="$root/bindings/rust/minikv"
example="$root/examples/rust"

step "tools"
install_packages bindgen pkg-config cmake ninja-build libhwy-dev
# The crates' rust-version (Cargo.toml) is the oldest Rust they build with. Debian 12's own
# rustc is 1.63, so the toolchain comes from the machine (rustup); CI machines have one.
# Without it, a developer machine skips the Rust checks with this note, while CI (CI=true)
# fails.
need=$(sed -n 's/^rust-version = "1\.\([0-9]*\)"$/\1/p' "$safe/Cargo.toml")
[[ "$need" =~ ^[0-9]+$ ]] || die "no rust-version = \"1.N\" in $safe/Cargo.toml"
rust_ok=0
if command -v cargo >/dev/null 2>&1 && command -v rustc >/dev/null 2>&1; then
  minor=$(rustc --version | sed -E 's/^rustc 1\.([0-9]+).*/\1/')
  [[ "$minor" =~ ^[0-9]+$ ]] && ((minor >= need)) && rust_ok=1
fi
if ((rust_ok == 0)); then
  msg="Rust bindings: no Rust >= 1.$need toolchain (cargo + rustc) on PATH; install one with rustup"
  [[ "${CI:-}" == true ]] && die "$msg"
  note "$msg: Rust checks skipped"
  exit 0
fi
cargo --version; bindgen --version; pkg-config --version

step "libminikv (CPU) -> $build"
cmake -S "$root" -B "$build" -G Ninja -DMINIKV_CUDA=OFF -DMINIKV_TESTS=OFF \
  -DMINIKV_EXAMPLES=OFF -DCMAKE_INSTALL_PREFIX="$build/install" >/dev/null
ninja -C "$build" -j "$jobs" minikv
cmake --install "$build" >/dev/null
pc_dir="$(dirname "$(find "$build/install" -name minikv.pc -print -quit)")"
lib_dir_installed="$(pkg-config --variable=libdir "$pc_dir/minikv.pc")"

step "bindgen output is up to date"
fresh="$build/bindings.rs"
"$sys/update_bindings.sh" "$fresh"
if ! diff -u "$sys/src/bindings.rs" "$fresh"; then
  die "bindings/rust/minikv-sys/src/bindings.rs is stale: run bindings/rust/minikv-sys/update_bindings.sh and commit it"
fi
note "bindings.rs matches include/minikv.h"

export CARGO_TARGET_DIR="$build/cargo"
export CARGO_TERM_COLOR=never
# The build-tree route: MINIKV_LIB_DIR (pkg-config is skipped so an installed libminikv
# elsewhere on the machine cannot be picked instead).
export MINIKV_LIB_DIR="$build" MINIKV_NO_PKG_CONFIG=1
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

have_clippy=1; cargo clippy --version >/dev/null 2>&1 || have_clippy=0
have_fmt=1; cargo fmt --version >/dev/null 2>&1 || have_fmt=0
for crate in "$sys" "$safe" "$example"; do
  step "cargo checks: ${crate#"$root"/}"
  (
    cd "$crate"
    if [[ "$crate" != "$example" ]]; then
      cargo test --offline
      RUSTDOCFLAGS="-D warnings" cargo doc --offline --no-deps --quiet
    fi
    if ((have_clippy)); then cargo clippy --offline --all-targets --quiet -- -D warnings
    else note "clippy not installed: skipped"; fi
    if ((have_fmt)); then cargo fmt --check
    else note "rustfmt not installed: skipped"; fi
  )
done

step "example (MINIKV_LIB_DIR route)"
(cd "$example" && cargo run --offline --release --quiet)

step "example (pkg-config route: $pc_dir)"
(
  cd "$example"
  unset MINIKV_LIB_DIR MINIKV_NO_PKG_CONFIG
  export PKG_CONFIG_PATH="$pc_dir" LD_LIBRARY_PATH="$lib_dir_installed"
  cargo run --offline --release --quiet | tail -n 2
)

# A user's crate outside the source tree, depending on the checkout's minikv crate by path:
# libminikv found by the pkg-config program only, and at run time by the rpath the build
# recorded (no LD_LIBRARY_PATH). Its own target dir: RUSTFLAGS differ from the checks above.
step "Rust consumer outside the source tree (tests/consumers/rust)"
consumer="$build/rust-consumer"
rm -rf "$consumer" && mkdir -p "$consumer"
cp -r "$root/tests/consumers/rust/src" "$consumer/"
sed "s|@MINIKV_RUST_CRATE@|$safe|" "$root/tests/consumers/rust/Cargo.toml.in" >"$consumer/Cargo.toml"
(
  cd "$consumer"
  unset MINIKV_LIB_DIR MINIKV_NO_PKG_CONFIG
  export PKG_CONFIG_PATH="$pc_dir" CARGO_TARGET_DIR="$consumer/target"
  RUSTFLAGS="-C link-arg=-Wl,-rpath,$lib_dir_installed" cargo build --offline --release --quiet
  env -u LD_LIBRARY_PATH target/release/minikv-consumer
)

step "no library found: a clear build error"
(
  cd "$sys"
  unset MINIKV_LIB_DIR
  export MINIKV_NO_PKG_CONFIG=1
  if log="$(cargo build --offline 2>&1)"; then
    die "minikv-sys built without any way to find libminikv"
  fi
  grep -q "cannot find libminikv" <<<"$log" || die "no clear message: $log"
  note "ok: $(grep -m1 'cannot find libminikv' <<<"$log" | sed 's/^ *//')"
)

step "Rust bindings: all checks passed"
