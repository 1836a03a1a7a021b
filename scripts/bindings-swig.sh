#!/usr/bin/env bash
# Builds and checks the SWIG bindings (Go and Java) against a CPU build of libminikv, as CI
# runs them:
#   1. installs Debian's swig, golang-go, default-jdk, junit5 (and pkg-config, cmake, ninja)
#      when missing;
#   2. builds libminikv (CPU only) into the build directory and installs it into
#      <build>/prefix (the binding finds it through that prefix's minikv.pc);
#   3. regenerates the committed SWIG output of the Go binding (bindings/go/internal/capi:
#      capi.go, capi_wrap.c) with its own `go generate` directives, and fails if it differs;
#      checks that no generated Java is committed (CMake generates it at build time);
#   4. Go: gofmt, go vet (also with -tags cuda) and go test for the binding, then vet and
#      run examples/go (the GPU test itself, `go test -tags cuda`, needs a CUDA build);
#   5. Java: builds the JNI library, minikv.jar, the JUnit 5 tests and examples/java with
#      CMake (bindings/java) and runs them with ctest (the junit5 console launcher);
#   6. consumers outside the source tree, as a user's project would be: a Go module using
#      the binding through `replace` and then vendored (tests/consumers/go), and a Java
#      program against the installed jar and JNI library (tests/consumers/java).
# Exits non-zero on the first failure. Nothing is written into the source tree.
#
# Environment (all optional):
#   MINIKV_BUILD_DIR  build directory        (build-swig in the repository)
#   MINIKV_JOBS       parallel build jobs    (nproc)
set -euo pipefail
# shellcheck source=scripts/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
help_if_asked "$@"
no_arguments "$@"
root=$MINIKV_ROOT
build="${MINIKV_BUILD_DIR:-$root/build-swig}"
jobs="${MINIKV_JOBS:-$(nproc)}"
prefix="$build/prefix"

step "tools"
install_packages swig golang-go default-jdk junit5 pkg-config cmake ninja-build libhwy-dev
swig -version | sed -n 's/^SWIG Version /swig /p'
go version
javac -version
[ -f /usr/share/java/junit-platform-console-standalone.jar ] ||
  die "junit5 is installed but /usr/share/java/junit-platform-console-standalone.jar is missing"

step "libminikv (CPU) -> $build, installed into $prefix"
cmake -S "$root" -B "$build" -G Ninja -DMINIKV_CUDA=OFF -DMINIKV_TESTS=OFF \
  -DMINIKV_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" >/dev/null
ninja -C "$build" -j "$jobs" minikv
cmake --install "$build" >/dev/null
export PKG_CONFIG_PATH="$prefix/lib/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$prefix/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
pkg-config --exists minikv || die "pkg-config cannot find minikv.pc under $prefix"
note "pkg-config minikv: $(pkg-config --cflags --libs minikv)"

step "committed SWIG output of the Go binding is up to date"
# Regenerate in a scratch copy of the tree the directives expect (capi.i includes
# ../../../swig/minikv_core.i, swig gets -I../../../../include), with gen.go's own
# //go:generate lines as the single source of the commands.
gen="$build/swig-regen"
rm -rf "$gen"
mkdir -p "$gen/bindings/go/internal" "$gen/bindings/swig"
cp -r "$root/include" "$gen/include"
cp "$root/bindings/swig/minikv_core.i" "$gen/bindings/swig/"
cp "$root/bindings/go/go.mod" "$gen/bindings/go/"
mkdir "$gen/bindings/go/internal/capi"
cp "$root/bindings/go/internal/capi/capi.i" "$root/bindings/go/internal/capi/gen.go" \
  "$gen/bindings/go/internal/capi/"
(cd "$gen/bindings/go/internal/capi" && GOFLAGS=-mod=mod GOPROXY=off go generate .)
stale=0
for f in capi.go capi_wrap.c; do
  if ! diff -u "$root/bindings/go/internal/capi/$f" "$gen/bindings/go/internal/capi/$f"; then
    stale=1
  fi
done
[ "$stale" = 0 ] || die "bindings/go/internal/capi is stale: run 'go generate ./...' in bindings/go and commit it"
note "capi.go and capi_wrap.c match bindings/swig/minikv_core.i and include/minikv.h"
if git -C "$root" ls-files bindings/java | grep -E '(_wrap\.c|MinikvNative(JNI|Constants)?\.java)$'; then
  die "generated Java/JNI files are committed under bindings/java: CMake generates them"
fi

# Go: no module proxy (standard library only; the example reaches the binding by replace).
export GOPROXY=off GOFLAGS=-mod=readonly GOTOOLCHAIN=local
export CGO_ENABLED=1

step "Go binding: gofmt, go vet, go test (bindings/go)"
(
  cd "$root/bindings/go"
  unformatted="$(gofmt -l .)"
  [ -z "$unformatted" ] || die "gofmt would change: $unformatted"
  go vet ./...
  go vet -tags cuda ./... # the GPU test (device_test.go) must keep compiling
  go test -count=1 ./...
)

step "Go example (examples/go)"
(
  cd "$root/examples/go"
  unformatted="$(gofmt -l .)"
  [ -z "$unformatted" ] || die "gofmt would change: $unformatted"
  go vet ./...
  go run .
)

# A user's module outside the source tree: go.mod's replace points at the checkout; the
# program finds libminikv at run time by the rpath cgo was told to record (no
# LD_LIBRARY_PATH). Then vendored: `go mod vendor` from a scratch copy of the binding, the
# copy deleted, and the program built from vendor/ alone.
step "Go consumer outside the source tree (tests/consumers/go): replace, then vendored"
consumer="$build/go-consumer" binding_copy="$build/go-consumer-binding"
rm -rf "$consumer" "$binding_copy"
mkdir -p "$consumer"
cp "$root/tests/consumers/go/main.go" "$consumer/"
sed "s|@MINIKV_GO_BINDING@|$root/bindings/go|" "$root/tests/consumers/go/go.mod.in" >"$consumer/go.mod"
(
  cd "$consumer"
  go vet .
  CGO_LDFLAGS="-Wl,-rpath,$prefix/lib" go build -o consumer .
  env -u LD_LIBRARY_PATH ./consumer
  cp -r "$root/bindings/go" "$binding_copy"
  sed "s|@MINIKV_GO_BINDING@|$binding_copy|" "$root/tests/consumers/go/go.mod.in" >go.mod
  go mod vendor
  rm -rf "$binding_copy" consumer
  go build -mod=vendor -o consumer .
  ./consumer
)

step "Java binding: build (bindings/java -> $build/java)"
cmake -S "$root/bindings/java" -B "$build/java" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$prefix" >/dev/null
ninja -C "$build/java" -j "$jobs"

step "Java binding: JUnit 5 tests and examples/java (ctest)"
# -V shows the tests' output (the example's numbers); pipefail makes ctest's status count.
if ! ctest --test-dir "$build/java" --output-on-failure -V 2>&1 |
  grep -vE '^[0-9]+: (Test command|Working Directory|Test timeout)|^[0-9]+: *$'; then
  die "Java tests failed"
fi

# The installed binding, as a user's project sees it: cmake --install puts minikv.jar in
# share/java and libminikv_jni.so in lib/jni; a program outside the source tree compiles
# against the jar and runs with java.library.path only (the JNI library finds libminikv
# by its rpath: no LD_LIBRARY_PATH).
step "Java consumer outside the source tree (tests/consumers/java), against the install"
cmake --install "$build/java" --prefix "$prefix" >/dev/null
consumer="$build/java-consumer"
rm -rf "$consumer" && mkdir -p "$consumer"
cp "$root/tests/consumers/java/Consumer.java" "$consumer/"
(
  cd "$consumer"
  javac -Xlint:all -Werror -cp "$prefix/share/java/minikv.jar" Consumer.java
  env -u LD_LIBRARY_PATH java -Xcheck:jni -cp "$prefix/share/java/minikv.jar:." \
    -Djava.library.path="$prefix/lib/jni" Consumer
)

step "SWIG bindings (Go, Java): all checks passed"
