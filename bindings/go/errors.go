package minikv

import "errors"

// Status is a libminikv status code (minikv_status). The values are pinned by the C ABI.
//
// A Status is also an error, so every non-OK status doubles as the sentinel that errors.Is
// matches: errors.Is(err, minikv.ErrCapacityExceeded).
type Status int

// The statuses of minikv.h, with their pinned values.
const (
	StatusOK               Status = 0
	StatusInvalidArgument  Status = 1
	StatusOutOfMemory      Status = 2
	StatusCapacityExceeded Status = 3
	StatusBadState         Status = 4
	StatusUnsupported      Status = 5
	StatusDevice           Status = 6
	StatusVersionMismatch  Status = 7
	StatusInternal         Status = 8
)

// Sentinels for errors.Is, one per failure status.
const (
	// ErrInvalidArgument: a bad argument or config field; the message names it.
	ErrInvalidArgument = StatusInvalidArgument
	// ErrOutOfMemory: a host or device allocation failed.
	ErrOutOfMemory = StatusOutOfMemory
	// ErrCapacityExceeded: the block pool is full or a sequence reached MaxSeqLen; nothing
	// changed, release sequences and retry.
	ErrCapacityExceeded = StatusCapacityExceeded
	// ErrBadState: the call is valid but not now (decode before prefill, prefill twice, a
	// closed Cache).
	ErrBadState = StatusBadState
	// ErrUnsupported: valid but not built or not supported here (e.g. no CUDA backend).
	ErrUnsupported = StatusUnsupported
	// ErrDevice: a CUDA runtime error.
	ErrDevice = StatusDevice
	// ErrVersionMismatch: the loaded library cannot read the binding's structs.
	ErrVersionMismatch = StatusVersionMismatch
	// ErrInternal: a bug in libminikv.
	ErrInternal = StatusInternal
)

// ErrClosed is wrapped by the error of every call on a closed Cache (whose Status is
// StatusBadState).
var ErrClosed = errors.New("minikv: the cache is closed")

var statusNames = [...]string{
	"MINIKV_OK",
	"MINIKV_ERR_INVALID_ARGUMENT",
	"MINIKV_ERR_OUT_OF_MEMORY",
	"MINIKV_ERR_CAPACITY_EXCEEDED",
	"MINIKV_ERR_BAD_STATE",
	"MINIKV_ERR_UNSUPPORTED",
	"MINIKV_ERR_DEVICE",
	"MINIKV_ERR_VERSION_MISMATCH",
	"MINIKV_ERR_INTERNAL",
}

// String returns the C name of the status ("MINIKV_ERR_BAD_STATE").
func (s Status) String() string {
	if s >= 0 && int(s) < len(statusNames) {
		return statusNames[s]
	}
	return "MINIKV_STATUS_UNKNOWN"
}

// Error makes a Status usable as a sentinel error.
func (s Status) Error() string { return "minikv: " + s.String() }

// Error is the error of a failed call: the status and the library's message (which names
// the call and the offending argument).
type Error struct {
	Status  Status
	Message string
	wrapped error
}

func (e *Error) Error() string { return e.Status.String() + ": " + e.Message }

// Is matches the sentinel of the error's status (a Status value).
func (e *Error) Is(target error) bool {
	s, ok := target.(Status)
	return ok && s == e.Status
}

// Unwrap returns ErrClosed for calls on a closed Cache, else nil.
func (e *Error) Unwrap() error { return e.wrapped }

func errorf(status Status, message string) error {
	return &Error{Status: status, Message: message}
}
