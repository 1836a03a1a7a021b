"""minikv.Cache: the compressed KV cache handle (a thin, checked layer over the C calls)."""
from __future__ import annotations

import ctypes
from typing import Any, Iterable, List, Optional, Sequence, Union

import numpy as np

from . import _tensors as T
from ._library import load
from ._config import Config, MemoryStats, SequenceLength
from ._types import Backend, DType, MemoryStatsStruct, MinikvError, Status

_U32_MAX = 2 ** 32 - 1
_I32_MAX = 2 ** 31 - 1

SeqIds = Union[int, Sequence[int], np.ndarray]


def _u32_array(values: SeqIds, name: str) -> "ctypes.Array[ctypes.c_uint32]":
    arr = np.atleast_1d(np.asarray(values))
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"{name}: expected one id or a non-empty 1-D sequence of ids, got shape "
                         f"{list(arr.shape)}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{name}: ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > _U32_MAX:
        raise ValueError(f"{name}: ids must be in [0, 2^32), got {arr.tolist()}")
    return (ctypes.c_uint32 * arr.size)(*(int(i) for i in arr))


def cu_seqlens_from_lengths(lengths: Iterable[int]) -> np.ndarray:
    """[0, l0, l0+l1, ...]: the prefix sums minikv_prefill takes, as int32."""
    lengths = np.asarray(list(lengths), dtype=np.int64)
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


class Cache:
    """The compressed KV cache of up to `max_sequences` sequences, all layers.

        with minikv.Cache(minikv.Config(num_layers=32, num_heads=32, num_kv_heads=8,
                                        head_dim=128, backend="cpu")) as cache:
            out = cache.prefill(layer, seq_ids, cu_seqlens, q, k, v)
            cache.append(layer, seq_ids, k_new, v_new)
            out = cache.decode(layer, seq_ids, q_new)

    Tensors: numpy arrays or torch CPU tensors for the CPU backend, torch CUDA tensors
    (anything with data_ptr()) for the CUDA backend, dense and in the cache's dtype:
      prefill q, out [total_tokens, num_heads, head_dim]; k, v [total_tokens, num_kv_heads, head_dim]
      append  k, v   [n_seqs, num_kv_heads, head_dim]
      decode  q, out [n_seqs, num_heads, head_dim]
    CPU calls are synchronous. CUDA calls are queued on `stream` (an int cudaStream_t, a
    torch.cuda.Stream, or None = torch's current stream) and return at once: keep the
    tensors alive until that stream has run the work (the outputs returned are).

    A handle is not thread-safe: use it from one thread at a time (a call made while another
    thread's call is using the handle raises MinikvError with Status.BAD_STATE and changes
    nothing). A handle created before os.fork() (multiprocessing's "fork" start method)
    keeps working in the child, which gets its own copy of the cache (CPU backend; CUDA
    does not survive fork). Errors raise MinikvError (with .status and the library's
    message); a failed call changes nothing.
    """

    def __init__(self, config: Optional[Config] = None, **fields: Any):
        self._handle: Optional[ctypes.c_void_p] = None
        if config is None:
            config = Config(**fields)
        elif fields:
            raise TypeError("pass either a Config or keyword fields, not both")
        elif not isinstance(config, Config):
            raise TypeError(f"config must be a minikv.Config, got {type(config).__name__}")
        self._lib = load()
        struct = config.to_struct()
        self._create(struct)
        # AUTO is resolved by the library at create; record the backend it chose, so that
        # memory spaces (host arrays vs device tensors) are checked against the real one.
        chosen = ctypes.c_int()
        self._check(self._lib.minikv_cache_backend(self._handle, ctypes.byref(chosen)))
        struct.backend = Backend(chosen.value)
        self._config = Config.from_struct(struct)

    def _create(self, struct: Any) -> None:
        handle = ctypes.c_void_p()
        status = self._lib.minikv_cache_create(ctypes.byref(struct), ctypes.byref(handle))
        if status != Status.OK:
            raise MinikvError(status, self._lib.minikv_last_error_message().decode(errors="replace"))
        self._handle = handle

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Frees the cache (for CUDA, after the work queued by its calls). Idempotent."""
        handle, self._handle = self._handle, None
        if handle is not None and handle.value:
            self._lib.minikv_cache_destroy(handle)

    @property
    def closed(self) -> bool:
        return self._handle is None

    def __enter__(self) -> "Cache":
        self._live()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:  # a safety net; call close() or use `with`
        try:
            self.close()
        except Exception:
            pass

    # The handle is owned: a copy would free it twice.
    def __copy__(self) -> "Cache":
        raise TypeError("a minikv.Cache owns its native handle and cannot be copied or pickled")

    def __deepcopy__(self, memo: Any) -> "Cache":
        return self.__copy__()

    def __reduce__(self) -> Any:
        return self.__copy__()

    def __repr__(self) -> str:
        c = self._config if hasattr(self, "_config") else None
        if c is None:
            return "<minikv.Cache (not created)>"
        state = "closed" if self.closed else f"{c.backend.name}, {c.dtype.name}"
        return (f"<minikv.Cache {state}: {c.num_layers} layers, {c.num_heads}/{c.num_kv_heads} "
                f"heads x {c.head_dim}, {c.max_sequences} sequences>")

    def _live(self) -> ctypes.c_void_p:
        if self._handle is None:
            raise MinikvError(Status.BAD_STATE, "minikv.Cache: the cache is closed")
        return self._handle

    def _check(self, status: int) -> None:
        if status != Status.OK:
            # This thread's message, read right after the call on the same OS thread. (The
            # handle's own message belongs to whichever call holds the handle: when another
            # thread uses it at the same time, this call fails with BAD_STATE and only the
            # thread's message describes it.)
            message = self._lib.minikv_last_error_message()
            raise MinikvError(status, message.decode(errors="replace"))

    # ---- properties ----------------------------------------------------------------------
    @property
    def config(self) -> Config:
        """The configuration as created (backend resolved: never AUTO). A copy."""
        return Config(**{k: getattr(self._config, k) for k in self._config.__dataclass_fields__})

    @property
    def backend(self) -> Backend:
        return self._config.backend

    @property
    def dtype(self) -> DType:
        return self._config.dtype

    @property
    def handle(self) -> int:
        """The minikv_cache* address (for passing the cache to other native code)."""
        return int(self._live().value)

    def _tensor(self, x: Any, name: str, shape: Sequence[Optional[int]], dims: str,
                writable: bool = False) -> T.Tensor:
        c = self._config
        return T.check(x, name, c.backend, c.dtype, c.device_id, shape, dims, writable)

    # ---- compute -------------------------------------------------------------------------
    def prefill(self, layer: int, seq_ids: SeqIds, cu_seqlens: Any, q: Any, k: Any, v: Any,
                out: Any = None, stream: Any = None) -> Any:
        """Prompt attention of `layer` for a batch of prompts, then their compression into
        the cache. Either pass packed q/k/v ([total_tokens, heads, head_dim]) with
        `cu_seqlens` (n_seqs+1 prefix sums), or pass `cu_seqlens=None` and lists of
        per-sequence q/k/v ([len_i, heads, head_dim] each): the output is then a list of
        per-sequence outputs. Returns `out` (allocated when None)."""
        return self._prefill(layer, seq_ids, None, cu_seqlens, q, k, v, out, stream)

    def prefill_chunk(self, layer: int, seq_ids: SeqIds, prompt_lens: SeqIds, cu_seqlens: Any,
                      q: Any, k: Any, v: Any, out: Any = None, stream: Any = None) -> Any:
        """The next chunk of each sequence's prompt (minikv_prefill_chunk): rows of the
        chunk are the prompt positions that follow the ones sent so far for this sequence
        and layer; `prompt_lens` gives each whole prompt's length (the same at every chunk),
        and the chunk that reaches it completes the prompt (selection and compression, as
        one `prefill` of the whole prompt would). Needs Config.prefill_staging_tokens for
        prompts sent in more than one chunk. Tensors as in `prefill`, for the chunk's rows;
        returns the chunk's output."""
        lens = _u32_array(prompt_lens, "prompt_lens")
        n = len(_u32_array(seq_ids, "seq_ids"))
        if len(lens) != n:
            raise ValueError(f"prompt_lens has {len(lens)} entries; seq_ids has {n}")
        return self._prefill(layer, seq_ids, lens, cu_seqlens, q, k, v, out, stream)

    def _prefill(self, layer: int, seq_ids: SeqIds, prompt_lens: Any, cu_seqlens: Any, q: Any,
                 k: Any, v: Any, out: Any, stream: Any) -> Any:
        """minikv_prefill (prompt_lens None) or minikv_prefill_chunk."""
        handle = self._live()
        c = self._config
        ids = _u32_array(seq_ids, "seq_ids")
        n = len(ids)
        per_sequence = isinstance(q, (list, tuple))
        if per_sequence != isinstance(k, (list, tuple)) or per_sequence != isinstance(v, (list, tuple)):
            raise TypeError("q, k and v must all be packed arrays or all lists of per-sequence arrays")
        stream_ptr, stream_ctx = T.resolve_stream(stream, c.backend, c.device_id)
        with stream_ctx:
            if per_sequence:
                if cu_seqlens is not None:
                    raise ValueError("cu_seqlens must be None when q, k, v are per-sequence lists")
                if out is not None:
                    raise ValueError("out must be None when q, k, v are per-sequence lists (the "
                                     "outputs are returned as a list)")
                if not len(q) == len(k) == len(v) == n:
                    raise ValueError(f"q, k, v have {len(q)}, {len(k)}, {len(v)} sequences; "
                                     f"seq_ids has {n}")
                lengths = []
                for i, (qi, ki, vi) in enumerate(zip(q, k, v)):
                    tq = self._tensor(qi, f"q[{i}]", (None, c.num_heads, c.head_dim),
                                      "[len, num_heads, head_dim]")
                    L = tq.shape[0]
                    self._tensor(ki, f"k[{i}]", (L, c.num_kv_heads, c.head_dim),
                                 "[len, num_kv_heads, head_dim]")
                    self._tensor(vi, f"v[{i}]", (L, c.num_kv_heads, c.head_dim),
                                 "[len, num_kv_heads, head_dim]")
                    if L == 0:
                        raise ValueError(f"q[{i}]: a prompt needs at least one token")
                    lengths.append(L)
                cu = cu_seqlens_from_lengths(lengths)
                packed = self._prefill(layer, ids, prompt_lens, cu, T.concat(q, "q"),
                                       T.concat(k, "k"), T.concat(v, "v"), None, stream)
                return T.split(packed, cu)

            cu = self._cu_seqlens(cu_seqlens, n)
            total = int(cu[-1])
            tq = self._tensor(q, "q", (total, c.num_heads, c.head_dim),
                              "[total_tokens = cu_seqlens[-1], num_heads, head_dim]")
            tk = self._tensor(k, "k", (total, c.num_kv_heads, c.head_dim),
                              "[total_tokens = cu_seqlens[-1], num_kv_heads, head_dim]")
            tv = self._tensor(v, "v", (total, c.num_kv_heads, c.head_dim),
                              "[total_tokens = cu_seqlens[-1], num_kv_heads, head_dim]")
            if out is None:
                out = T.empty_like(q, tq.shape)
            to = self._tensor(out, "out", tq.shape, "q's shape", writable=True)
            T.check_no_overlap(to, [("q", tq), ("k", tk), ("v", tv)])
            cu_c = (ctypes.c_int32 * len(cu))(*(int(x) for x in cu))
            if prompt_lens is None:
                status = self._lib.minikv_prefill(handle, self._layer(layer), n, ids, cu_c,
                                                  tq.ptr, tk.ptr, tv.ptr, to.ptr, stream_ptr)
            else:
                status = self._lib.minikv_prefill_chunk(handle, self._layer(layer), n, ids, cu_c,
                                                        prompt_lens, tq.ptr, tk.ptr, tv.ptr,
                                                        to.ptr, stream_ptr)
            self._check(status)
        return out

    def append(self, layer: int, seq_ids: SeqIds, k: Any, v: Any, stream: Any = None) -> None:
        """Appends one new token's K/V ([n_seqs, num_kv_heads, head_dim]) of `layer` to
        each sequence; when the residual becomes full (residual_length tokens), its oldest
        Config.flush_tokens (rounded up to whole groups; all of them for 0) are quantized
        into the cache (a flush)."""
        handle = self._live()
        c = self._config
        ids = _u32_array(seq_ids, "seq_ids")
        shape = (len(ids), c.num_kv_heads, c.head_dim)
        stream_ptr, stream_ctx = T.resolve_stream(stream, c.backend, c.device_id)
        with stream_ctx:
            tk = self._tensor(k, "k", shape, "[n_seqs, num_kv_heads, head_dim]")
            tv = self._tensor(v, "v", shape, "[n_seqs, num_kv_heads, head_dim]")
            self._check(self._lib.minikv_append(handle, self._layer(layer), len(ids), ids,
                                                tk.ptr, tv.ptr, stream_ptr))

    def decode(self, layer: int, seq_ids: SeqIds, q: Any, out: Any = None,
               stream: Any = None) -> Any:
        """Attention of one query token per sequence ([n_seqs, num_heads, head_dim]) over
        its whole cached context of `layer`. Returns `out` (allocated when None)."""
        handle = self._live()
        c = self._config
        ids = _u32_array(seq_ids, "seq_ids")
        shape = (len(ids), c.num_heads, c.head_dim)
        stream_ptr, stream_ctx = T.resolve_stream(stream, c.backend, c.device_id)
        with stream_ctx:
            tq = self._tensor(q, "q", shape, "[n_seqs, num_heads, head_dim]")
            if out is None:
                out = T.empty_like(q, shape)
            to = self._tensor(out, "out", shape, "[n_seqs, num_heads, head_dim]", writable=True)
            T.check_no_overlap(to, [("q", tq)])
            self._check(self._lib.minikv_decode(handle, self._layer(layer), len(ids), ids,
                                                tq.ptr, to.ptr, stream_ptr))
        return out

    def append_decode(self, layer: int, seq_ids: SeqIds, q: Any, k: Any, v: Any,
                      out: Any = None, stream: Any = None) -> Any:
        """The engine's step for one layer in one call: `append(layer, seq_ids, k, v)` then
        `decode(layer, seq_ids, q, out)`, with the same result bit for bit, checked as one
        call (a failure appends nothing and leaves `out` unwritten). With CUDA: one kernel
        launch where no sequence's residual becomes full. Returns `out` (allocated when
        None)."""
        handle = self._live()
        c = self._config
        ids = _u32_array(seq_ids, "seq_ids")
        q_shape = (len(ids), c.num_heads, c.head_dim)
        kv_shape = (len(ids), c.num_kv_heads, c.head_dim)
        stream_ptr, stream_ctx = T.resolve_stream(stream, c.backend, c.device_id)
        with stream_ctx:
            tq = self._tensor(q, "q", q_shape, "[n_seqs, num_heads, head_dim]")
            tk = self._tensor(k, "k", kv_shape, "[n_seqs, num_kv_heads, head_dim]")
            tv = self._tensor(v, "v", kv_shape, "[n_seqs, num_kv_heads, head_dim]")
            if out is None:
                out = T.empty_like(q, q_shape)
            to = self._tensor(out, "out", q_shape, "[n_seqs, num_heads, head_dim]", writable=True)
            T.check_no_overlap(to, [("q", tq), ("k", tk), ("v", tv)])
            self._check(self._lib.minikv_append_decode(handle, self._layer(layer), len(ids), ids,
                                                       tq.ptr, tk.ptr, tv.ptr, to.ptr, stream_ptr))
        return out

    # ---- sequences and statistics --------------------------------------------------------
    def release(self, seq_id: int) -> None:
        """Frees every block of `seq_id` (all layers), and the staging of a prompt still
        mid-way through prefill_chunk; its slot can take a new prompt."""
        self._check(self._lib.minikv_sequence_release(self._live(), self._u32(seq_id, "seq_id")))

    def sequence_length(self, seq_id: int, layer: int) -> SequenceLength:
        """(seen, cached): positions seen (prompt + appended) and tokens kept."""
        seen, cached = ctypes.c_uint64(), ctypes.c_uint64()
        self._check(self._lib.minikv_sequence_length(
            self._live(), self._u32(seq_id, "seq_id"), self._layer(layer), ctypes.byref(seen),
            ctypes.byref(cached)))
        return SequenceLength(seen.value, cached.value)

    def kept_positions(self, seq_id: int, layer: int, kv_head: int) -> np.ndarray:
        """The prompt positions (ascending, int32) that `kv_head` of `layer` kept."""
        handle = self._live()
        args = (self._u32(seq_id, "seq_id"), self._layer(layer), self._u32(kv_head, "kv_head"))
        count = ctypes.c_uint32()
        self._check(self._lib.minikv_kept_positions(handle, *args, None, 0, ctypes.byref(count)))
        positions = np.zeros(count.value, dtype=np.int32)
        if count.value:
            ptr = positions.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
            self._check(self._lib.minikv_kept_positions(handle, *args, ptr, count.value,
                                                        ctypes.byref(count)))
        return positions

    def memory_stats(self) -> MemoryStats:
        st = MemoryStatsStruct()
        st.struct_size = ctypes.sizeof(MemoryStatsStruct)
        self._check(self._lib.minikv_memory_stats_get(self._live(), ctypes.byref(st)))
        return MemoryStats.from_struct(st)

    # ---- argument helpers ----------------------------------------------------------------
    @staticmethod
    def _u32(value: Any, name: str) -> int:
        if isinstance(value, bool) or not hasattr(value, "__index__"):
            raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
        value = int(value)
        if not 0 <= value <= _U32_MAX:
            raise ValueError(f"{name} ({value}) must be in [0, 2^32)")
        return value

    def _layer(self, layer: Any) -> int:
        return self._u32(layer, "layer")  # the library checks layer < num_layers

    @staticmethod
    def _cu_seqlens(cu_seqlens: Any, n: int) -> np.ndarray:
        if cu_seqlens is None:
            raise ValueError("cu_seqlens is required with packed q, k, v (or pass per-sequence lists)")
        if T.is_torch_like(cu_seqlens):
            cu_seqlens = cu_seqlens.cpu().numpy() if hasattr(cu_seqlens, "cpu") else cu_seqlens
        cu = np.asarray(cu_seqlens)
        if cu.ndim != 1 or cu.dtype.kind not in "iu":
            raise ValueError(f"cu_seqlens: expected a 1-D integer array, got dtype {cu.dtype} "
                             f"shape {list(cu.shape)}")
        if len(cu) != n + 1:
            raise ValueError(f"cu_seqlens has {len(cu)} entries; n_seqs + 1 = {n + 1} expected")
        cu = cu.astype(np.int64)
        if cu[0] != 0:
            raise ValueError(f"cu_seqlens[0] ({cu[0]}) must be 0")
        lengths = np.diff(cu)
        if (lengths < 1).any():
            bad = int(np.argmax(lengths < 1))
            raise ValueError(f"cu_seqlens must increase strictly: sequence {bad} has length "
                             f"{int(lengths[bad])}")
        if cu[-1] > _I32_MAX:
            raise ValueError(f"cu_seqlens[-1] ({cu[-1]}) exceeds int32")
        return cu
