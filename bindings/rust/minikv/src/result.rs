//! Errors: every fallible call returns [`Result<T>`], whose [`Error`] carries the C
//! library's status and the detail message it wrote for that very call.

use core::ffi::{c_char, CStr};
use std::fmt;

use crate::sys;

/// Why a call failed: the C library's `minikv_status` (values pinned by the header).
///
/// `MINIKV_OK` has no variant: a successful call returns `Ok`. The enum is
/// `#[non_exhaustive]` because the C enum is append-only.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum Status {
    /// A NULL pointer, an out-of-range id or size, a bad config field, a slice of the
    /// wrong length or element type.
    InvalidArgument = 1,
    /// A host or device allocation failed.
    OutOfMemory = 2,
    /// The block pool is full, or a sequence reached `max_seq_len`. Nothing changed:
    /// release or preempt sequences and retry.
    CapacityExceeded = 3,
    /// The call is valid but not now (decode before prefill, a layer prefilled twice).
    BadState = 4,
    /// Valid but not built or supported here (CUDA backend absent, head_dim not compiled).
    Unsupported = 5,
    /// A CUDA runtime error; the message has CUDA's text.
    Device = 6,
    /// A struct size the library cannot read, or a library of another major version.
    VersionMismatch = 7,
    /// A bug in libminikv (or a status this crate does not know); please report it.
    Internal = 8,
}

impl Status {
    /// The status for a C code; `None` for `MINIKV_OK` (0) and codes this crate does not know.
    pub fn from_code(code: u32) -> Option<Status> {
        Some(match code {
            1 => Status::InvalidArgument,
            2 => Status::OutOfMemory,
            3 => Status::CapacityExceeded,
            4 => Status::BadState,
            5 => Status::Unsupported,
            6 => Status::Device,
            7 => Status::VersionMismatch,
            8 => Status::Internal,
            _ => return None,
        })
    }

    /// The pinned C value (`MINIKV_ERR_*`).
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The C library's static text for this status (`minikv_status_string`).
    pub fn description(self) -> &'static str {
        // SAFETY: minikv_status_string never returns NULL and points to static storage.
        unsafe { static_str(sys::minikv_status_string(sys::minikv_status(self.code()))) }
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.description())
    }
}

/// A failed call: the status and the library's detail message, e.g.
/// `minikv_cache_create: num_heads (12) must be a multiple of num_kv_heads (8)`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    /// What kind of failure; match on this, never on the message.
    pub status: Status,
    /// The library's detail for this failure (never empty).
    pub message: String,
}

impl Error {
    /// An error raised by this crate itself (before calling C), e.g. a slice of the wrong length.
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, message: message.into() }
    }

    /// The error for a non-OK status `code` with the C message `msg` (NULL allowed). A code
    /// this crate does not know becomes `Internal`, with the code in the message.
    ///
    /// # Safety
    /// `msg` is NULL or a NUL-terminated string valid for the duration of the call.
    pub(crate) unsafe fn from_c(code: sys::minikv_status, msg: *const c_char) -> Error {
        let mut message = if msg.is_null() {
            String::new()
        } else {
            CStr::from_ptr(msg).to_string_lossy().into_owned()
        };
        let status = match Status::from_code(code.0) {
            Some(s) => s,
            None => {
                message = format!("unknown minikv_status {}: {message}", code.0);
                Status::Internal
            }
        };
        if message.is_empty() {
            message = status.description().to_owned();
        }
        Error { status, message }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} [{:?}]", self.message, self.status)
    }
}

impl std::error::Error for Error {}

/// `Result<T, minikv::Error>`.
pub type Result<T> = std::result::Result<T, Error>;

/// # Safety
/// `p` is a non-NULL, NUL-terminated string in static storage.
pub(crate) unsafe fn static_str(p: *const c_char) -> &'static str {
    CStr::from_ptr(p).to_str().unwrap_or("(non-UTF-8 text from libminikv)")
}
