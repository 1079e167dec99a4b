"""A value derived from a tensor, kept while that same tensor object is unchanged.

The layers of one training step pass the same offsets tensor to every attention call; what a call
derives from it (a dtype cast, a check, the compact tile table of the CuTe kernels) is then computed
once a step instead of once per kernel. Under CUDA-graph capture callers skip the memo, since replays
change the contents of the same tensor.
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


class TensorMemo:
    """Values keyed by a tensor's identity and an extra key, valid while the tensor is not written.

    Keyed by (id, key), so one tensor can hold several values (a table per block size); a weakref proves
    the entry is the same object (a new tensor at a reused id misses) and the version counter proves it
    was not written since. At most ``capacity`` entries (cleared past that).
    """

    def __init__(self, capacity: int = 64) -> None:
        self._entries: dict[int, tuple] = {}
        self._capacity = capacity

    def get(self, t: torch.Tensor, key: tuple = ()) -> object:
        """The value stored for ``t`` with ``key``, or ``MISS``."""
        hit = self._entries.get((id(t), key))
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2]
        return MISS

    def put(self, t: torch.Tensor, value: object, key: tuple = ()) -> None:
        if len(self._entries) > self._capacity:
            self._entries.clear()
        self._entries[(id(t), key)] = (weakref.ref(t), t._version, value)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
