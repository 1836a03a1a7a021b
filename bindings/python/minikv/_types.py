"""Enums, the error type, ctypes mirrors of the C structs, and their Python faces."""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import math
from typing import Any, Union


# ---- enums (values pinned by include/minikv.h) ---------------------------------------
class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    OUT_OF_MEMORY = 2
    CAPACITY_EXCEEDED = 3
    BAD_STATE = 4
    UNSUPPORTED = 5
    DEVICE = 6
    VERSION_MISMATCH = 7
    INTERNAL = 8


class Backend(enum.IntEnum):
    AUTO = 0
    CPU = 1
    CUDA = 2


class DType(enum.IntEnum):
    F16 = 0
    BF16 = 1
    F32 = 2

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.F32 else 2


class BudgetPolicy(enum.IntEnum):
    UNIFORM = 0
    PYRAMID = 1


class ScoreMode(enum.IntEnum):
    CUMULATIVE = 0
    WINDOW = 1


class Preset(enum.IntEnum):
    """Named compression settings (minikv_preset; include/minikv.h documents each)."""
    BALANCED = 0       # the default: 4-bit keys, 2-bit values, G = 32, 4 sinks, uniform
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
        ("reserved_v2_", ctypes.c_uint32),
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


# ---- Python faces -------------------------------------------------------------------
class _LibraryDefault:
    """Sentinel: take this field's value from minikv_config_default()."""

    def __repr__(self) -> str:
        return "<library default>"


LIBRARY_DEFAULT: Any = _LibraryDefault()

_ENUM_FIELDS = {"backend": Backend, "dtype": DType, "budget_policy": BudgetPolicy,
                "score_mode": ScoreMode}
_INT_RANGES = {"device_id": (-(2 ** 31), 2 ** 31 - 1), "max_tokens": (0, 2 ** 64 - 1)}
_FLOAT_FIELDS = {"heavy_ratio", "recent_ratio", "pyramid_depth"}


@dataclasses.dataclass
class Config:
    """Every field of minikv_config (see include/minikv.h for their meaning). A field left
    out takes minikv_config_default()'s value; num_layers, num_heads, num_kv_heads and
    head_dim must be set. Enum fields accept the enum, its int, or its name ("cpu",
    "f16", "float16", "pyramid", ...)."""

    backend: Backend = LIBRARY_DEFAULT
    device_id: int = LIBRARY_DEFAULT
    dtype: DType = LIBRARY_DEFAULT
    num_layers: int = LIBRARY_DEFAULT
    num_heads: int = LIBRARY_DEFAULT
    num_kv_heads: int = LIBRARY_DEFAULT
    head_dim: int = LIBRARY_DEFAULT
    max_sequences: int = LIBRARY_DEFAULT
    max_seq_len: int = LIBRARY_DEFAULT
    max_tokens: int = LIBRARY_DEFAULT
    heavy_ratio: float = LIBRARY_DEFAULT
    recent_ratio: float = LIBRARY_DEFAULT
    budget_policy: BudgetPolicy = LIBRARY_DEFAULT
    pyramid_depth: float = LIBRARY_DEFAULT
    score_mode: ScoreMode = LIBRARY_DEFAULT
    window_size: int = LIBRARY_DEFAULT
    pool_kernel: int = LIBRARY_DEFAULT
    key_bits: int = LIBRARY_DEFAULT
    value_bits: int = LIBRARY_DEFAULT
    group_size: int = LIBRARY_DEFAULT
    residual_length: int = LIBRARY_DEFAULT
    sink_tokens: int = LIBRARY_DEFAULT

    def __post_init__(self) -> None:
        defaults = None
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is LIBRARY_DEFAULT:
                if defaults is None:
                    defaults = library_default_struct()
                value = getattr(defaults, f.name)
            setattr(self, f.name, _check_field(f.name, value))

    def to_struct(self) -> MinikvConfigStruct:
        """The C struct, starting from minikv_config_default() (which sets struct_size)."""
        s = library_default_struct()
        for f in dataclasses.fields(self):
            value = _check_field(f.name, getattr(self, f.name))
            setattr(s, f.name, value if isinstance(value, float) else int(value))
        return s

    @classmethod
    def from_struct(cls, s: MinikvConfigStruct) -> "Config":
        return cls(**{f.name: getattr(s, f.name) for f in dataclasses.fields(cls)})

    @classmethod
    def from_preset(cls, preset: Union[Preset, int, str], **fields: Any) -> "Config":
        """The library's compression setting `preset` (a Preset, its int, or its name:
        "balanced", "paper", "quality", "eviction_only"; minikv_config_preset), every other
        field from minikv_config_default(), then `fields` on top. The paper's exact MiniKV:
        Config.from_preset("paper", num_layers=..., ...)."""
        from ._library import load

        value = _to_enum(Preset, preset, "preset")
        s = library_default_struct()
        lib = load()
        status = lib.minikv_config_preset(ctypes.byref(s), int(value))
        if status != Status.OK:
            raise MinikvError(status, lib.minikv_last_error_message().decode(errors="replace"))
        return dataclasses.replace(cls.from_struct(s), **fields)


def _check_field(name: str, value: Any) -> Any:
    """Converts a field to its Python type; rejects what ctypes would silently wrap."""
    if name in _ENUM_FIELDS:
        return _to_enum(_ENUM_FIELDS[name], value, name)
    if name in _FLOAT_FIELDS:
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise MinikvError(Status.INVALID_ARGUMENT, f"Config.{name} ({value!r}) must be a number")
        value = float(value)
        if math.isfinite(value) and abs(value) > 3.4e38:
            raise MinikvError(Status.INVALID_ARGUMENT, f"Config.{name} ({value!r}) overflows a C float")
        return value
    lo, hi = _INT_RANGES.get(name, (0, 2 ** 32 - 1))
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise MinikvError(Status.INVALID_ARGUMENT, f"Config.{name} ({value!r}) must be an integer")
    value = int(value)
    if not lo <= value <= hi:
        raise MinikvError(Status.INVALID_ARGUMENT,
                          f"Config.{name} ({value}) must be an integer in [{lo}, {hi}]")
    return value


def library_default_struct() -> MinikvConfigStruct:
    from ._library import load

    s = MinikvConfigStruct()
    # The size of this package's struct: the library fills exactly the fields it has.
    load().minikv_config_init(ctypes.byref(s), ctypes.sizeof(s))
    return s


@dataclasses.dataclass(frozen=True)
class MemoryStats:
    """minikv_memory_stats (see include/minikv.h)."""

    pool_bytes: int
    used_bytes: int
    workspace_bytes: int
    tokens_seen: int
    tokens_cached: int
    fp16_equivalent_bytes: int
    compression_ratio: float

    @classmethod
    def from_struct(cls, s: MemoryStatsStruct) -> "MemoryStats":
        return cls(**{f.name: getattr(s, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class SequenceLength:
    """Positions seen (prompt + appended) and tokens kept, for one sequence and layer."""

    seen: int
    cached: int

    def __iter__(self):  # allows `seen, cached = cache.sequence_length(...)`
        return iter((self.seen, self.cached))
