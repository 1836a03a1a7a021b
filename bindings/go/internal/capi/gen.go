// Package capi is the SWIG-generated, low-level binding of libminikv's C API. It is
// internal: use package minikv, whose Cache owns the handle and converts errors.
//
// capi.go and capi_wrap.c are generated from capi.i and ../../../swig/minikv_core.i by the
// directives below (Debian's swig 4.1, then gofmt); do not edit them. Regenerate with
// `go generate ./...` in bindings/go.
package capi

import "unsafe"

//go:generate swig -go -cgo -intgosize 64 -module capi -I../../../../include -o capi_wrap.c -outdir . capi.i
//go:generate gofmt -w capi.go

// The committed output was generated with -intgosize 64 (Go's int is passed to C as a
// 64-bit intgo): where int has 32 bits this constant overflows and the build stops here
// instead of corrupting arguments. Regenerate with -intgosize 32 for such targets.
const _ = unsafe.Sizeof(int(0)) - 8
