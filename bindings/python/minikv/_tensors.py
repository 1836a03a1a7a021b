"""Turning Python array objects into the raw pointers libminikv takes, after checking them.

Supported: numpy arrays (host memory: CPU backend) and anything exposing data_ptr(),
.dtype, .shape, .is_contiguous() and .is_cuda (PyTorch tensors: host tensors for the CPU
backend, CUDA tensors for the CUDA backend). Every check happens before the C call: the
library trusts pointers and cannot see a shape, so a wrong shape here would be a wild
memory access there.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

from ._types import Backend, DType

_NUMPY_DTYPES = {DType.F16: np.dtype(np.float16), DType.F32: np.dtype(np.float32)}
_TORCH_DTYPES = {"torch.float16": DType.F16, "torch.bfloat16": DType.BF16,
                 "torch.float32": DType.F32}
_DTYPE_TEXT = {DType.F16: "float16", DType.BF16: "bfloat16", DType.F32: "float32"}


def is_torch_like(x: Any) -> bool:
    return callable(getattr(x, "data_ptr", None)) and not isinstance(x, np.ndarray)


def is_array(x: Any) -> bool:
    return isinstance(x, np.ndarray) or is_torch_like(x)


class Tensor:
    """A checked tensor argument: its address, byte size and where it lives."""

    __slots__ = ("obj", "ptr", "nbytes", "shape", "on_device")

    def __init__(self, obj: Any, ptr: int, nbytes: int, shape: Tuple[int, ...], on_device: bool):
        self.obj, self.ptr, self.nbytes, self.shape, self.on_device = obj, ptr, nbytes, shape, on_device


def _shape_text(shape: Sequence[Optional[int]]) -> str:
    return "[" + ", ".join("*" if d is None else str(d) for d in shape) + "]"


def check(x: Any, name: str, backend: Backend, dtype: DType, device_id: int,
          shape: Sequence[Optional[int]], dims: str, writable: bool = False) -> Tensor:
    """Validates `x` for a call on a cache with this backend/dtype. `shape` is the expected
    shape (None = any size in that dimension), `dims` names its dimensions for messages."""
    if isinstance(x, np.ndarray):
        if backend == Backend.CUDA:
            raise ValueError(f"{name}: a numpy array is host memory, but this cache uses the CUDA "
                             f"backend: pass a CUDA tensor (e.g. a torch.Tensor on "
                             f"cuda:{device_id})")
        if dtype == DType.BF16:
            raise ValueError(f"{name}: the cache's dtype is BF16, which numpy cannot hold: pass "
                             f"torch.bfloat16 tensors")
        if x.dtype != _NUMPY_DTYPES[dtype]:
            raise ValueError(f"{name}: dtype {x.dtype} does not match the cache's dtype "
                             f"{dtype.name} ({_DTYPE_TEXT[dtype]})")
        if not x.flags.c_contiguous:
            raise ValueError(f"{name}: the array is not C-contiguous (use np.ascontiguousarray)")
        if not x.flags.aligned:
            raise ValueError(f"{name}: the array is not aligned to its element size")
        if writable and not x.flags.writeable:
            raise ValueError(f"{name}: the output array is read-only")
        actual = tuple(int(d) for d in x.shape)
        ptr, nbytes, on_device = int(x.ctypes.data), int(x.nbytes), False
    elif is_torch_like(x):
        for attr in ("dtype", "shape", "is_contiguous"):
            if not hasattr(x, attr):
                raise TypeError(f"{name}: {type(x).__name__} has data_ptr() but no .{attr}; pass "
                                f"a numpy array or a torch.Tensor")
        got = _TORCH_DTYPES.get(str(x.dtype))
        if got != dtype:
            raise ValueError(f"{name}: dtype {x.dtype} does not match the cache's dtype "
                             f"{dtype.name} ({_DTYPE_TEXT[dtype]})")
        on_device = bool(getattr(x, "is_cuda", False))
        if backend == Backend.CPU and on_device:
            raise ValueError(f"{name}: the tensor is on {x.device}, but this cache uses the CPU "
                             f"backend: pass host memory")
        if backend == Backend.CUDA:
            if not on_device:
                raise ValueError(f"{name}: the tensor is in host memory, but this cache uses the "
                                 f"CUDA backend: pass a tensor on cuda:{device_id}")
            index = getattr(getattr(x, "device", None), "index", None)
            if index is not None and index != device_id:
                raise ValueError(f"{name}: the tensor is on cuda:{index}, the cache on "
                                 f"cuda:{device_id}")
        if not x.is_contiguous():
            raise ValueError(f"{name}: the tensor is not contiguous (call .contiguous())")
        actual = tuple(int(d) for d in x.shape)
        itemsize = dtype.itemsize
        nbytes = itemsize
        for d in actual:
            nbytes *= d
        ptr = int(x.data_ptr())
    else:
        raise TypeError(f"{name}: expected a numpy array or a tensor with data_ptr() (torch), "
                        f"got {type(x).__name__}")
    if len(actual) != len(shape) or any(e is not None and e != a for e, a in zip(shape, actual)):
        raise ValueError(f"{name}: shape {list(actual)} does not match {dims} = "
                         f"{_shape_text(shape)}")
    return Tensor(x, ptr, nbytes, actual, on_device)


def check_no_overlap(out: Tensor, inputs: Sequence[Tuple[str, Tensor]], out_name: str = "out") -> None:
    """The library's outputs may not alias its inputs."""
    for name, t in inputs:
        if out.nbytes and t.nbytes and out.ptr < t.ptr + t.nbytes and t.ptr < out.ptr + out.nbytes:
            raise ValueError(f"{out_name} overlaps {name} in memory; the output may not alias an input")


def empty_like(x: Any, shape: Tuple[int, ...]) -> Any:
    """A new uninitialized array of `shape` with x's kind, dtype and device."""
    if isinstance(x, np.ndarray):
        return np.empty(shape, dtype=x.dtype)
    return x.new_empty(shape)


def concat(parts: Sequence[Any], name: str) -> Any:
    if all(isinstance(p, np.ndarray) for p in parts):
        return np.ascontiguousarray(np.concatenate(parts, axis=0))
    if all(is_torch_like(p) for p in parts):
        torch = sys.modules.get("torch")
        if torch is None:
            raise TypeError(f"{name}: cannot concatenate tensors of type {type(parts[0]).__name__}")
        return torch.cat(list(parts), dim=0).contiguous()
    raise TypeError(f"{name}: the per-sequence arrays must all be numpy arrays or all torch tensors")


def split(packed: Any, cu_seqlens: np.ndarray) -> List[Any]:
    return [packed[int(cu_seqlens[i]):int(cu_seqlens[i + 1])] for i in range(len(cu_seqlens) - 1)]


def resolve_stream(stream: Any, backend: Backend, device_id: int) -> Tuple[Optional[int], Any]:
    """(the cudaStream_t as an int, or None for NULL; a context manager that makes torch
    allocate and compute on that stream while the binding prepares arguments)."""
    if backend != Backend.CUDA:
        if stream is not None and stream != 0:
            raise ValueError("stream must be None for the CPU backend (its calls are synchronous)")
        return None, contextlib.nullcontext()
    torch = sys.modules.get("torch")
    torch_cuda = torch is not None and torch.cuda.is_available()
    if stream is None:
        if torch_cuda:
            current = torch.cuda.current_stream(device_id)
            return int(current.cuda_stream) or None, contextlib.nullcontext()
        return None, contextlib.nullcontext()  # the legacy default stream
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream / ExternalStream
        ptr = int(stream.cuda_stream)
        return ptr or None, torch.cuda.stream(stream) if torch_cuda else contextlib.nullcontext()
    if hasattr(stream, "ptr"):  # cupy.cuda.Stream
        ptr = int(stream.ptr)
    elif isinstance(stream, int) and not isinstance(stream, bool):
        ptr = int(stream)
    else:
        raise TypeError(f"stream: expected None, an int (cudaStream_t), a torch.cuda.Stream or an "
                        f"object with .cuda_stream/.ptr, got {type(stream).__name__}")
    if ptr < 0:
        raise ValueError(f"stream ({ptr}) must be a cudaStream_t address (>= 0)")
    if torch_cuda:
        wrapped = (torch.cuda.default_stream(device_id) if ptr == 0
                   else torch.cuda.ExternalStream(ptr, device=device_id))
        return ptr or None, torch.cuda.stream(wrapped)
    return ptr or None, contextlib.nullcontext()
