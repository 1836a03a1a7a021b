// Package capi is the SWIG-generated, low-level binding of libminikv's C API. It is
// internal: use package minikv, whose Cache owns the handle and converts errors.
//
// capi.go and capi_wrap.c are generated from capi.i and ../../../swig/minikv_core.i by the
// directives below (Debian's swig 4.1, then gofmt); do not edit them. Regenerate with
// `go generate ./...` in bindings/go.
package capi

//go:generate swig -go -cgo -intgosize 64 -module capi -I../../../../include -o capi_wrap.c -outdir . capi.i
//go:generate gofmt -w capi.go
