"""A value derived from a tensor, kept while that same tensor object is unchanged.

The layers of one training step pass the same offsets tensor to every attention call; what a call
derives from it (a dtype cast, a check, the compact tile table of the CuTe kernels) is then computed
once a step instead of once per kernel. Under CUDA-graph capture a value is shared only within that
capture: replays change the contents of the same tensor, so a value computed eagerly or in another
capture is stale there, while one recorded earlier in the same capture is recomputed by every replay
before its later uses read it.
"""

from __future__ import annotations

import weakref

import torch

MISS = object()


def capturing() -> bool:
    """Whether a CUDA graph is being captured on this thread's stream (no per-tensor caches then).

    A capture needs an initialised CUDA context, so that flag is tested first: ``torch.cuda.is_available``
    (environment and NVML queries) cost about as much as the rest of this check, on every launch."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def capture_id() -> int | None:
    """0 when no CUDA graph is being captured on this thread's stream, else the capture's id (unique in
    the process); None when capturing but the id cannot be read (no ``cuda.bindings``)."""
    if not capturing():
        return 0
    try:
        from cuda.bindings import runtime
    except ImportError:
        return None
    res = runtime.cudaStreamGetCaptureInfo(torch.cuda.current_stream().cuda_stream)
    return int(res[2]) if int(res[0]) == 0 and int(res[2]) != 0 else None


class TensorMemo:
    """Values keyed by a tensor's identity and an extra key, valid while the tensor is not written.

    Keyed by (id, key), so one tensor can hold several values (a table per block size); a weakref proves
    the entry is the same object (a new tensor at a reused id misses) and the version counter proves it
    was not written since (writes through ``.data``, or to memory shared with numpy, bypass that
    counter; inference tensors have none and are never memoised). At most ``capacity`` eager entries
    (cleared past that). Under graph capture the entries live apart, for the one capture under way:
    eager ones are not seen there, and a new capture drops the last one's (which hold the memory of that
    graph's pool).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._entries: dict[tuple, tuple] = {}
        self._capacity = capacity
        self._capture: tuple[int, dict[tuple, tuple]] = (0, {})

    def _scope(self) -> dict[tuple, tuple] | None:
        cid = capture_id()
        if cid == 0:
            return self._entries
        if cid is None:  # capturing, but which capture is unknown: no memo
            return None
        if self._capture[0] != cid:
            self._capture = (cid, {})
        return self._capture[1]

    def get(self, t: torch.Tensor, key: tuple = ()) -> object:
        """The value stored for ``t`` with ``key`` in the current scope, or ``MISS``."""
        entries = self._scope()
        hit = None if entries is None else entries.get((id(t), key))
        # A hit is the same object ``put`` stored, and ``put`` never stores an inference tensor.
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        return MISS

    def put(self, t: torch.Tensor, value: object, key: tuple = ()) -> None:
        entries = self._scope()
        if entries is None or t.is_inference():  # no version counter: nothing would prove it unwritten
            return
        if len(entries) > self._capacity:
            entries.clear()
        entries[(id(t), key)] = (weakref.ref(t), t._version, value)

    def clear(self) -> None:
        self._entries.clear()
        self._capture = (0, {})

    def __len__(self) -> int:
        return len(self._entries) + len(self._capture[1])
