"""The per-call host path shared by the CuTe HSTU launchers (forward and backward), kept to dict lookups.

A short call is host-bound: on an H100 the d256 1K forward of one sequence runs in about 25 us on the
GPU, while building a key dataclass, hashing and re-checking the config, taking the compile cache's lock
and testing strides one by one took about 40 us of Python per launch. ``LaunchCache`` answers the
compiled kernel of a (config object, call signature) with one dict lookup; the config is checked and
the kernel compiled only on a miss, through the launcher's ``KernelCache``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from kernel_templates.cute_runtime import CompiledKernel


class LaunchCache:
    """Compiled kernels by (config object, call signature), in front of a launcher's ``KernelCache``.

    Keyed by the config's identity: dispatch decodes each artifact config once (one object per config),
    and hashing a frozen config dataclass costs more than the rest of the lookup. The entry holds the
    config, so its id is not reused while the entry lives; an entry whose config is not the caller's
    object (an id reused after ``clear``) is rebuilt. At most ``capacity`` entries (cleared past that),
    so callers building a fresh config per call cannot grow it without bound.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._entries: dict[tuple, tuple[object, CompiledKernel[Any]]] = {}
        self._capacity = capacity

    def get(self, config: object, signature: tuple, build: Callable[[], CompiledKernel[Any]]) -> CompiledKernel[Any]:
        """The kernel for ``config`` and ``signature`` (dtype, head dims, mask flags); ``build`` on a miss."""
        key = (id(config), signature)
        hit = self._entries.get(key)
        if hit is not None and hit[0] is config:
            return hit[1]
        compiled = build()
        if len(self._entries) >= self._capacity:
            self._entries.clear()
        self._entries[key] = (config, compiled)
        return compiled

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


def call_signature(
    q: torch.Tensor, v: torch.Tensor, num_targets: torch.Tensor | None, contextual_seq_len: int, max_attn_len: int
) -> tuple[torch.dtype, int, int, bool, bool, bool]:
    """(dtype, dqk, dv, has_context, has_targets, has_window): what a compiled kernel specialises on besides
    its config, the same for the forward and the backward."""
    return (q.dtype, q.shape[2], v.shape[2], contextual_seq_len > 0, num_targets is not None, max_attn_len > 0)


def jagged_args(
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_seq_len: int,
    scaling_seqlen: int | None,
    block: int,
) -> tuple[torch.Tensor, torch.Tensor, float, int]:
    """(int32 offsets, int32 targets, 1 / scale, blocks of the longest sequence) of a launch.

    The kernels index in int32; without targets the offsets stand in for them (the kernel never reads
    that argument), and the score scale 1 / S defaults to 1 / max_seq_len as HSTU.md defines it.
    """
    offsets = seq_offsets if seq_offsets.dtype == torch.int32 else seq_offsets.to(torch.int32)
    targets = offsets if num_targets is None else num_targets.to(torch.int32)
    scale = scaling_seqlen if scaling_seqlen is not None else max_seq_len
    return offsets, targets, 1.0 / float(scale), -(-max_seq_len // block)


def tma_rows_ok(t: torch.Tensor) -> bool:
    """Whether ``t`` is (L, H, D) with contiguous heads and 16-byte aligned rows, as the TMA loads need
    (a column slice of a wider projection qualifies: only the row stride is free)."""
    s_row, s_head, s_col = t.stride()
    return s_col == 1 and s_head == t.shape[2] and s_row % 8 == 0 and t.data_ptr() % 16 == 0


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (a persistent grid's CTA count, the split's per-SM share),
    read once per device."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
