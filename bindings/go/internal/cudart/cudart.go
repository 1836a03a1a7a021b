//go:build cuda

// Package cudart is the handful of CUDA runtime calls the device tests need (allocate,
// copy, streams), loaded with dlopen at run time so nothing CUDA is needed to build. Test
// support only; built with -tags cuda.
package cudart

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef int (*memcpy_fn)(void *, const void *, size_t, int);
typedef int (*stream_create_fn)(void **);
typedef int (*stream_fn)(void *);
typedef int (*count_fn)(int *);
typedef const char *(*error_string_fn)(int);

static malloc_fn p_malloc;
static free_fn p_free;
static memcpy_fn p_memcpy;
static stream_create_fn p_stream_create;
static stream_fn p_stream_sync, p_stream_destroy;
static count_fn p_device_count;
static error_string_fn p_error_string;

// 0 on success, 1: no libcudart, 2: a symbol is missing.
static int cudart_load(void) {
	const char *names[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"};
	void *lib = NULL;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !lib; ++i) lib = dlopen(names[i], RTLD_NOW);
	if (!lib) return 1;
	p_malloc = (malloc_fn)dlsym(lib, "cudaMalloc");
	p_free = (free_fn)dlsym(lib, "cudaFree");
	p_memcpy = (memcpy_fn)dlsym(lib, "cudaMemcpy");
	p_stream_create = (stream_create_fn)dlsym(lib, "cudaStreamCreate");
	p_stream_sync = (stream_fn)dlsym(lib, "cudaStreamSynchronize");
	p_stream_destroy = (stream_fn)dlsym(lib, "cudaStreamDestroy");
	p_device_count = (count_fn)dlsym(lib, "cudaGetDeviceCount");
	p_error_string = (error_string_fn)dlsym(lib, "cudaGetErrorString");
	return p_malloc && p_free && p_memcpy && p_stream_create && p_stream_sync && p_stream_destroy &&
	               p_device_count && p_error_string ? 0 : 2;
}
static int cudart_device_count(int *n) { return p_device_count(n); }
static int cudart_malloc(uintptr_t *p, size_t n) {
	void *d = NULL;
	int rc = p_malloc(&d, n);
	*p = (uintptr_t)d;
	return rc;
}
static int cudart_free(uintptr_t p) { return p_free((void *)p); }
static int cudart_to_device(uintptr_t dst, const void *src, size_t n) { return p_memcpy((void *)dst, src, n, 1); }
static int cudart_to_host(void *dst, uintptr_t src, size_t n) { return p_memcpy(dst, (const void *)src, n, 2); }
static int cudart_stream_create(uintptr_t *s) {
	void *p = NULL;
	int rc = p_stream_create(&p);
	*s = (uintptr_t)p;
	return rc;
}
static int cudart_stream_sync(uintptr_t s) { return p_stream_sync((void *)s); }
static int cudart_stream_destroy(uintptr_t s) { return p_stream_destroy((void *)s); }
static const char *cudart_error_string(int rc) { return p_error_string(rc); }
*/
import "C"

import (
	"errors"
	"fmt"
	"unsafe"
)

func check(call string, rc C.int) error {
	if rc == 0 {
		return nil
	}
	return fmt.Errorf("%s: CUDA error %d (%s)", call, int(rc), C.GoString(C.cudart_error_string(rc)))
}

// Load opens libcudart and checks that a device is visible.
func Load() error {
	switch C.cudart_load() {
	case 1:
		return errors.New("libcudart.so cannot be loaded (dlopen)")
	case 2:
		return errors.New("libcudart lacks a needed symbol")
	}
	var n C.int
	if err := check("cudaGetDeviceCount", C.cudart_device_count(&n)); err != nil {
		return err
	}
	if n == 0 {
		return errors.New("no CUDA device")
	}
	return nil
}

// Malloc allocates n bytes of device memory.
func Malloc(n int) (uintptr, error) {
	var p C.uintptr_t
	err := check("cudaMalloc", C.cudart_malloc(&p, C.size_t(n)))
	return uintptr(p), err
}

// Free releases device memory.
func Free(p uintptr) error { return check("cudaFree", C.cudart_free(C.uintptr_t(p))) }

// ToDevice copies n bytes from host memory src (pinned by cgo for the call) to dst.
func ToDevice(dst uintptr, src unsafe.Pointer, n int) error {
	return check("cudaMemcpy H2D", C.cudart_to_device(C.uintptr_t(dst), src, C.size_t(n)))
}

// ToHost copies n bytes from device memory src to host memory dst (synchronous).
func ToHost(dst unsafe.Pointer, src uintptr, n int) error {
	return check("cudaMemcpy D2H", C.cudart_to_host(dst, C.uintptr_t(src), C.size_t(n)))
}

// StreamCreate creates a stream; the handle is a cudaStream_t as an address.
func StreamCreate() (uintptr, error) {
	var s C.uintptr_t
	err := check("cudaStreamCreate", C.cudart_stream_create(&s))
	return uintptr(s), err
}

// StreamSynchronize waits for the work queued on s.
func StreamSynchronize(s uintptr) error {
	return check("cudaStreamSynchronize", C.cudart_stream_sync(C.uintptr_t(s)))
}

// StreamDestroy destroys s.
func StreamDestroy(s uintptr) error {
	return check("cudaStreamDestroy", C.cudart_stream_destroy(C.uintptr_t(s)))
}
