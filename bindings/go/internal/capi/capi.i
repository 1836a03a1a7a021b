/* capi.i — the Go module of the SWIG core: the low-level, internal package that cache.go
 * wraps. Regenerate with `go generate ./...` in bindings/go (see gen.go); the output
 * (capi.go, capi_wrap.c) is committed so that `go build` needs no SWIG, and CI regenerates
 * it and fails on any difference (scripts/bindings-swig.sh). */
%module capi

/* Link flags come from the installed minikv.pc (or PKG_CONFIG_PATH for a build tree). */
%insert(cgo_comment_typedefs) %{
#cgo pkg-config: minikv
%}

%include "../../../swig/minikv_core.i"
