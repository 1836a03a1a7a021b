"""Finding, loading and declaring libminikv (ctypes, no compile step).

Discovery order (the first that exists wins):
  1. the MINIKV_LIBRARY environment variable: a libminikv shared library, or a directory
     holding one (an error if it does not load: an explicit choice must not silently fall
     back);
  2. the library next to this package: what `pip install ./bindings/python` bundles;
  3. the build directories of the source tree this package sits in (<repo>/build*/), the
     most recently built first (the package used from a checkout, without installing);
  4. ctypes.util.find_library("minikv") (the system's library path, e.g. /usr/local/lib).
The loaded library must follow libminikv's version rule (MINIKV_VERSION_COMPATIBLE in
include/minikv.h): the binding's major version, and not older than the binding.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading
from pathlib import Path
from typing import List, Optional

from ._types import MemoryStatsStruct, MinikvConfigStruct, MinikvError, Status
from ._version import VERSION

_major, _minor, _patch = (int(part) for part in VERSION.split("."))
#: The version of include/minikv.h this binding was written against, as
#: minikv_version_number() counts: major*10000 + minor*100 + patch.
BINDING_VERSION_NUMBER = _major * 10000 + _minor * 100 + _patch
#: Its major version: the library's must be the same.
BINDING_VERSION_MAJOR = _major


def compatible(loaded: int) -> bool:
    """Whether a library whose minikv_version_number() is `loaded` can serve this binding:
    the same major version, and not older (MINIKV_VERSION_COMPATIBLE in minikv.h)."""
    return loaded // 10000 == BINDING_VERSION_MAJOR and loaded >= BINDING_VERSION_NUMBER

_PACKAGE_DIR = Path(__file__).resolve().parent
_lock = threading.Lock()
_lib: Optional[ctypes.CDLL] = None
_lib_path: Optional[str] = None


def _library_names() -> List[str]:
    return ["libminikv.so", "libminikv.dylib", "minikv.dll"]


def _in_directory(directory: Path) -> List[str]:
    """The libminikv files in `directory`: the plain name first, then versioned files
    (libminikv.so.0, libminikv.so.0.1.0), the shortest name first."""
    found = []
    for name in _library_names():
        exact = directory / name
        if exact.is_file():
            found.append(str(exact))
        found += sorted(glob.glob(str(directory / (name + ".*"))), key=len)
    return found


def _source_root() -> Optional[Path]:
    """The checkout this package sits in (bindings/python/minikv), or None when installed."""
    root = _PACKAGE_DIR.parents[2] if len(_PACKAGE_DIR.parents) > 2 else None
    if root is None or not (root / "include" / "minikv.h").exists():
        return None
    return root


def _repo_build_dirs() -> List[str]:
    root = _source_root()
    if root is None:
        return []
    found = []
    for name in _library_names():
        found += glob.glob(str(root / "build*" / name))
    # The most recently built library first (several build trees may coexist).
    found.sort(key=lambda p: os.path.getmtime(os.path.realpath(p)), reverse=True)
    return found


def candidate_paths() -> List[str]:
    """The paths tried, in order (without the MINIKV_LIBRARY override)."""
    paths = _in_directory(_PACKAGE_DIR) + _repo_build_dirs()
    system = ctypes.util.find_library("minikv")
    if system:
        paths.append(system)
    return paths


def _declare(lib: ctypes.CDLL) -> None:
    c_void_p, c_u32, c_i32, c_u64 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32, ctypes.c_uint64
    P = ctypes.POINTER
    status = ctypes.c_int  # minikv_status is a C enum (int-sized)
    protos = {
        "minikv_version_number": (c_u32, []),
        "minikv_version_string": (ctypes.c_char_p, []),
        "minikv_status_string": (ctypes.c_char_p, [ctypes.c_int]),
        "minikv_last_error_message": (ctypes.c_char_p, []),
        "minikv_config_init": (status, [P(MinikvConfigStruct), ctypes.c_size_t]),
        "minikv_config_preset": (status, [P(MinikvConfigStruct), ctypes.c_int]),
        "minikv_cache_create": (status, [P(MinikvConfigStruct), P(c_void_p)]),
        "minikv_cache_destroy": (None, [c_void_p]),
        "minikv_cache_last_error": (ctypes.c_char_p, [c_void_p]),
        "minikv_cache_backend": (status, [c_void_p, P(ctypes.c_int)]),
        "minikv_prefill": (status, [c_void_p, c_u32, c_u32, P(c_u32), P(c_i32), c_void_p,
                                    c_void_p, c_void_p, c_void_p, c_void_p]),
        "minikv_prefill_chunk": (status, [c_void_p, c_u32, c_u32, P(c_u32), P(c_i32), P(c_u32),
                                          c_void_p, c_void_p, c_void_p, c_void_p, c_void_p]),
        "minikv_append": (status, [c_void_p, c_u32, c_u32, P(c_u32), c_void_p, c_void_p,
                                   c_void_p]),
        "minikv_decode": (status, [c_void_p, c_u32, c_u32, P(c_u32), c_void_p, c_void_p,
                                   c_void_p]),
        "minikv_append_decode": (status, [c_void_p, c_u32, c_u32, P(c_u32), c_void_p,
                                          c_void_p, c_void_p, c_void_p, c_void_p]),
        "minikv_sequence_release": (status, [c_void_p, c_u32]),
        "minikv_sequence_length": (status, [c_void_p, c_u32, c_u32, P(c_u64), P(c_u64)]),
        "minikv_kept_positions": (status, [c_void_p, c_u32, c_u32, c_u32, P(c_i32), c_u32,
                                           P(c_u32)]),
        "minikv_memory_stats_get": (status, [c_void_p, P(MemoryStatsStruct)]),
    }
    for name, (restype, argtypes) in protos.items():
        fn = getattr(lib, name)  # AttributeError names a symbol an old library lacks
        fn.restype = restype
        fn.argtypes = argtypes


def _explicit(value: str, what: str) -> str:
    """The library file an explicit choice names: the file itself, or the library in a
    directory."""
    if os.path.isdir(value):
        found = _in_directory(Path(value))
        if not found:
            raise OSError(f"minikv: {what} is the directory {value!r}, which holds no "
                          f"{' / '.join(_library_names())} (nor a versioned one)")
        return found[0]
    if not os.path.exists(value):
        raise OSError(f"minikv: {what} {value!r} does not exist")
    return value


def _not_found_message() -> str:
    """What to do when no candidate loads: for a checkout, build the library; for an
    installed package, reinstall it or point at a library."""
    root = _source_root()
    explicit = ("set MINIKV_LIBRARY to a libminikv.so (or the directory holding it), e.g. a "
                "CUDA build")
    if root is not None:
        return (f"minikv: cannot find libminikv. Build it in {root} (cmake -S . -B build && "
                f"cmake --build build: build*/ is searched), or pip install {root}/bindings/"
                f"python (bundles it), or {explicit}.")
    return (f"minikv: this installed package ({_PACKAGE_DIR}) has no libminikv next to it and "
            "none was found on the system. Reinstall it from a libminikv checkout with "
            "`pip install <checkout>/bindings/python`, which builds the library into the "
            f"package, or {explicit}, or install libminikv system-wide (cmake --install, then "
            "ldconfig).")


def _open(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    _declare(lib)
    number = lib.minikv_version_number()
    if not compatible(number):
        raise MinikvError(
            Status.VERSION_MISMATCH,
            f"{path} is libminikv {lib.minikv_version_string().decode()}; this Python binding "
            f"({VERSION}) needs {BINDING_VERSION_MAJOR}.x, at least {VERSION}")
    return lib


def load(path: Optional[str] = None) -> ctypes.CDLL:
    """Loads (once) and returns the library. `path` overrides the discovery order; it must
    be given before the first use of the binding."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None:
            if path is not None and os.path.realpath(path) != os.path.realpath(_lib_path):
                raise RuntimeError(f"minikv: {_lib_path} is already loaded; cannot switch to {path}")
            return _lib
        explicit = path or os.environ.get("MINIKV_LIBRARY")
        if explicit:
            what = "the path given to minikv.load()" if path else "MINIKV_LIBRARY"
            chosen = _explicit(explicit, what)
            try:
                _lib = _open(chosen)
            except (OSError, AttributeError) as e:
                raise OSError(f"minikv: {what} names {chosen!r}, which does not load as "
                              f"libminikv: {e}") from e
            _lib_path = chosen
            return _lib
        errors = []
        for candidate in candidate_paths():
            try:
                _lib, _lib_path = _open(candidate), candidate
                return _lib
            except (OSError, AttributeError, MinikvError) as e:
                errors.append(f"  {candidate}: {e}")
        tried = "\n".join(errors) if errors else "  (no candidate found)"
        raise OSError(_not_found_message() + "\nTried:\n" + tried)


def library_path() -> str:
    """The file the binding loaded (loading it if needed)."""
    load()
    assert _lib_path is not None
    return _lib_path
