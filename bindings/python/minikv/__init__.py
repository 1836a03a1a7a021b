"""minikv: Python binding of libminikv, the MiniKV compressed KV cache (arXiv 2411.18077).

Pure ctypes: it loads libminikv.so at first use (MINIKV_LIBRARY=/path/to/libminikv.so, a
library next to this package, the source tree's build*/ directories, or the system's
library path, in that order).

    import numpy as np, minikv
    cfg = minikv.Config(backend="cpu", dtype="f32", num_layers=1, num_heads=8,
                        num_kv_heads=2, head_dim=64, max_sequences=4, max_seq_len=1024)
    with minikv.Cache(cfg) as cache:
        out = cache.prefill(0, [0, 1], None, [q0, q1], [k0, k1], [v0, v1])
        cache.append(0, [0, 1], k_new, v_new)
        o = cache.decode(0, [0, 1], q_new)
        print(cache.memory_stats().compression_ratio)
"""
from ._library import (BINDING_VERSION_MAJOR, BINDING_VERSION_NUMBER, candidate_paths,
                       library_path, load)
from ._config import Config, MemoryStats, SequenceLength
from ._types import Backend, BudgetPolicy, DType, MinikvError, Preset, ScoreMode, Status
from ._version import VERSION
from .cache import Cache, cu_seqlens_from_lengths

__all__ = [
    "Backend", "BudgetPolicy", "Cache", "Config", "DType", "MemoryStats", "MinikvError",
    "Preset", "ScoreMode", "SequenceLength", "Status", "cu_seqlens_from_lengths", "library_path",
    "library_version", "load", "status_string", "BINDING_VERSION_MAJOR",
    "BINDING_VERSION_NUMBER", "candidate_paths", "__version__",
]

__version__ = VERSION


def library_version() -> str:
    """The loaded libminikv's version, "MAJOR.MINOR.PATCH"."""
    return load().minikv_version_string().decode()


def status_string(status: int) -> str:
    """The library's static text for a status value."""
    return load().minikv_status_string(int(status)).decode()
