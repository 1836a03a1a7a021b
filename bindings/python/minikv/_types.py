"""Enums, the error type and the ctypes mirrors of the C structs: declarations only, no
library call (minikv._config holds the Python faces, filled from the library)."""
from __future__ import annotations

import ctypes
import enum
from typing import Any, Union


# ---- enums (values pinned by include/minikv.h) ---------------------------------------
class _NamedIntEnum(enum.IntEnum):
    """An IntEnum that prints as its member name ("CPU"), as repr and the C names suggest,
    on every Python version (3.11 made str() and format() of an IntEnum print the number).
    A format spec ("{:d}") still formats the number."""

    def __str__(self) -> str:
        return self.name

    def __format__(self, spec: str) -> str:
        return self.name if not spec else format(self.value, spec)


class Status(_NamedIntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_MEMORY = 2
    CAPACITY_EXCEEDED = 3
    BAD_STATE = 4
    UNSUPPORTED = 5
    DEVICE = 6
    VERSION_MISMATCH = 7
    INTERNAL = 8


class Backend(_NamedIntEnum):
    AUTO = 0
    CPU = 1
    CUDA = 2


class DType(_NamedIntEnum):
    F16 = 0
    BF16 = 1
    F32 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2


class BudgetPolicy(_NamedIntEnum):
    UNIFORM = 0
    PYRAMID = 1


class ScoreMode(_NamedIntEnum):
    CUMULATIVE = 0
    WINDOW = 1


class Preset(_NamedIntEnum):
    """Named compression settings (minikv_preset; include/minikv.h documents each)."""
    BALANCED = 0       # the default: 4-bit keys, 2-bit values, G = 32, 4 sinks, pyramid, window scores
    PAPER = 1          # MiniKV exactly: 2-bit keys and values, G = 16, pyramid, no sinks
    QUALITY = 2        # 8-bit keys and values, G = 32, 4 sinks, uniform
    EVICTION_ONLY = 3  # 16-bit, no sinks, uniform (H2O-style eviction alone)


_DTYPE_ALIASES = {
    "f16": DType.F16, "fp16": DType.F16, "float16": DType.F16, "half": DType.F16,
    "bf16": DType.BF16, "bfloat16": DType.BF16,
    "f32": DType.F32, "fp32": DType.F32, "float32": DType.F32, "float": DType.F32,
}


def _to_enum(cls: type, value: Any, field: str) -> enum.IntEnum:
    """An enum member from a member, an int, or a (case-insensitive) name."""
    if isinstance(value, str):
        key = value.strip().lower().replace("torch.", "")
        if cls is DType and key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
        for member in cls:
            if member.name.lower() == key:
                return member
        raise MinikvError(Status.INVALID_ARGUMENT,
                          f"Config.{field} ({value!r}) must be one of "
                          f"{', '.join(m.name for m in cls)}")
    if isinstance(value, enum.IntEnum) and not isinstance(value, cls):
        raise MinikvError(Status.INVALID_ARGUMENT,
                          f"Config.{field} ({value!r}) must be a {cls.__name__}")
    try:
        return cls(int(value))
    except (ValueError, TypeError):
        # An unknown value is passed on as an int so that the library's validation (which
        # names the field and its allowed values) answers, as it would for a C caller.
        if isinstance(value, int) and not isinstance(value, bool) and -2**31 <= value < 2**31:
            return value  # type: ignore[return-value]
        raise MinikvError(Status.INVALID_ARGUMENT,
                          f"Config.{field} ({value!r}) must be a {cls.__name__}") from None


# ---- the error --------------------------------------------------------------------
class MinikvError(Exception):
    """A libminikv call failed. `.status` is a Status (or the raw int for a value this
    binding does not know), `.message` the library's detail of the failure."""

    def __init__(self, status: Union[Status, int], message: str):
        try:
            status = Status(status)
        except ValueError:
            status = int(status)
        self.status = status
        self.message = message
        name = status.name if isinstance(status, Status) else f"status {status}"
        super().__init__(f"MINIKV_ERR_{name}: {message}" if status != 0 else message)


# ---- ctypes mirrors (same field order and C types as include/minikv.h) ---------------
_c_enum = ctypes.c_int  # the C enums of minikv.h have int size and alignment


class MinikvConfigStruct(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("backend", _c_enum),
        ("device_id", ctypes.c_int32),
        ("dtype", _c_enum),
        ("num_layers", ctypes.c_uint32),
        ("num_heads", ctypes.c_uint32),
        ("num_kv_heads", ctypes.c_uint32),
        ("head_dim", ctypes.c_uint32),
        ("max_sequences", ctypes.c_uint32),
        ("max_seq_len", ctypes.c_uint32),
        ("max_tokens", ctypes.c_uint64),
        ("heavy_ratio", ctypes.c_float),
        ("recent_ratio", ctypes.c_float),
        ("budget_policy", _c_enum),
        ("pyramid_depth", ctypes.c_float),
        ("score_mode", _c_enum),
        ("window_size", ctypes.c_uint32),
        ("pool_kernel", ctypes.c_uint32),
        ("key_bits", ctypes.c_uint32),
        ("value_bits", ctypes.c_uint32),
        ("group_size", ctypes.c_uint32),
        ("residual_length", ctypes.c_uint32),
        ("reserved_v1_", ctypes.c_uint32),
        ("sink_tokens", ctypes.c_uint32),
        ("prefill_staging_tokens", ctypes.c_uint32),
        ("flush_tokens", ctypes.c_uint32),
        ("reserved_v3_", ctypes.c_uint32),
    ]


class MemoryStatsStruct(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("pool_bytes", ctypes.c_uint64),
        ("used_bytes", ctypes.c_uint64),
        ("workspace_bytes", ctypes.c_uint64),
        ("tokens_seen", ctypes.c_uint64),
        ("tokens_cached", ctypes.c_uint64),
        ("fp16_equivalent_bytes", ctypes.c_uint64),
        ("compression_ratio", ctypes.c_double),
    ]
