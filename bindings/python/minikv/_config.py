"""The Python faces of the C structs: Config (every minikv_config field, defaults from the
library), MemoryStats and SequenceLength."""
from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import TYPE_CHECKING, Any, Union

from ._library import load
from ._types import (Backend, BudgetPolicy, DType, MemoryStatsStruct, MinikvConfigStruct,
                     MinikvError, Preset, ScoreMode, Status, _to_enum)


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
    """Every field of minikv_config but struct_size and the reserved_* padding (see
    include/minikv.h for their meaning). A field left out takes minikv_config_default()'s
    value; num_layers, num_heads, num_kv_heads and head_dim must be set. Enum fields accept
    the enum, its int, or its name ("cpu", "f16", "float16", "pyramid", ...).

    flush_tokens is F, how many tokens a flush quantizes: when the residual holds
    residual_length tokens (the new one included), its oldest F are quantized and the
    newest residual_length - F stay 16-bit (a sliding flush, every F tokens). Any value is
    valid: it is rounded up to a multiple of group_size and capped at residual_length
    (group_size 16: 8 acts as 16, 24 as 32; 200 with residual_length 64 as 64, the whole
    residual); 0 = the whole residual at once, as in the MiniKV reference. The defaults
    (Preset.BALANCED) are residual_length 64 and flush_tokens 32; the other presets set
    residual_length 128 and flush_tokens 0."""

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
    prefill_staging_tokens: int = LIBRARY_DEFAULT
    flush_tokens: int = LIBRARY_DEFAULT

    if TYPE_CHECKING:
        # The generated __init__ as type checkers should see it: an enum field also takes
        # the enum's name or int, which __post_init__ converts (the fields then hold the
        # enum). Same parameters, in the same order, as the fields (test_typing.py checks).
        def __init__(self, backend: Union[Backend, str, int] = ..., device_id: int = ...,
                     dtype: Union[DType, str, int] = ..., num_layers: int = ...,
                     num_heads: int = ..., num_kv_heads: int = ..., head_dim: int = ...,
                     max_sequences: int = ..., max_seq_len: int = ..., max_tokens: int = ...,
                     heavy_ratio: float = ..., recent_ratio: float = ...,
                     budget_policy: Union[BudgetPolicy, str, int] = ...,
                     pyramid_depth: float = ..., score_mode: Union[ScoreMode, str, int] = ...,
                     window_size: int = ..., pool_kernel: int = ..., key_bits: int = ...,
                     value_bits: int = ..., group_size: int = ...,
                     residual_length: int = ..., sink_tokens: int = ...,
                     prefill_staging_tokens: int = ..., flush_tokens: int = ...) -> None: ...

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
