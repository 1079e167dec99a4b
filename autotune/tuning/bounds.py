"""What a checked launch may touch: its outputs, nothing else.

A config that stores a tile past the last row of its output, into the gaps of a strided output, or
into one of its inputs can still leave correct values in the output itself, so comparing outputs with
the reference does not see it. In a training step such a write corrupts a neighbouring tensor. The
tuner's checks therefore hand the kernel outputs embedded in larger buffers whose other bytes hold a
known pattern (``OutputGuard``), and fingerprint the inputs before the launch (``InputPrints``); a
launch that changed either is wrong whatever its outputs say.

The guard catches overruns up to its width on each side (the output's own size, at least
``MIN_GUARD`` and at most ``MAX_GUARD`` elements: a whole tile of the check batches); a write
farther away can land anywhere, which is why such a worker is replaced after the verdict.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PATTERN = 0xA5  # byte every guard byte holds before the launch
MIN_GUARD = 1024  # elements on each side of an output, at least
MAX_GUARD = 1 << 20  # and at most (the timed batch's outputs are large; an overrun is a tile or a row)
ALIGN_BYTES = 256  # guards are whole multiples of this, so TMA and vectorised paths see an aligned output


def _span(t: torch.Tensor) -> int:
    """Elements from the first to the last element ``t`` addresses (its strided footprint)."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride(), strict=True))


class _Embedded:
    """One output placed inside a pattern-filled buffer: [guard | footprint | guard]."""

    def __init__(self, t: torch.Tensor) -> None:
        if any(s < 0 for s in t.stride()):
            raise ValueError("outputs with negative strides cannot be guarded")
        span = _span(t)
        per_line = max(1, ALIGN_BYTES // t.element_size())  # the output starts as aligned as a fresh allocation
        self.guard = -(-min(max(span, MIN_GUARD), MAX_GUARD) // per_line) * per_line
        self.span = span
        self.buf = torch.empty(2 * self.guard + span, dtype=t.dtype, device=t.device)
        self.buf.view(torch.uint8).fill_(PATTERN)
        self.view = self.buf.as_strided(t.shape, t.stride(), self.guard)
        self.view.copy_(t)  # keeps what the op allocated (NaN fill) inside the output
        self.gaps: torch.Tensor | None = None
        if span != t.numel():  # strided with holes (or overlapping): remember which elements are the output's
            inside = torch.zeros(span, dtype=torch.bool, device=t.device)
            inside.as_strided(t.shape, t.stride()).fill_(True)
            self.gaps = ~inside

    def _changed(self, elems: torch.Tensor) -> torch.Tensor:
        """Per element of a 1-D slice of ``buf``: whether any of its bytes left the pattern."""
        b = elems.reshape(-1).view(torch.uint8).reshape(elems.numel(), -1)
        return (b != PATTERN).any(dim=1)

    def problems(self, name: str) -> list[str]:
        g, span = self.guard, self.span
        out = []
        before = int(self._changed(self.buf[:g]).sum())
        after = int(self._changed(self.buf[g + span :]).sum())
        if before:
            out.append(f"{name}: {before} element(s) written before its first element")
        if after:
            out.append(f"{name}: {after} element(s) written past its last element")
        if self.gaps is not None:
            hit = int((self._changed(self.buf[g : g + span]) & self.gaps).sum())
            if hit:
                out.append(f"{name}: {hit} element(s) written between its strided elements")
        return out


class OutputGuard:
    """Outputs for a checked launch, each inside a pattern-filled buffer (``outs``); ``problems`` after
    the launch (and a sync) names every output whose surroundings changed."""

    def __init__(self, outs: Any) -> None:
        self._embedded: list[_Embedded | None] = []
        wrapped = []
        for t in outs if isinstance(outs, (tuple, list)) else (outs,):
            # An output whose elements overlap (a stride-0 dim) cannot be copied into a fresh footprint: as is.
            e = _Embedded(t) if isinstance(t, torch.Tensor) and _span(t) >= t.numel() else None
            self._embedded.append(e)
            wrapped.append(e.view if e is not None else t)
        self.outs = type(outs)(wrapped) if isinstance(outs, (tuple, list)) else wrapped[0]

    def problems(self, names: Sequence[str]) -> list[str]:
        found = []
        for i, e in enumerate(self._embedded):
            if e is not None:
                found += e.problems(names[i] if i < len(names) else f"output {i}")
        return found


CHUNK = 1 << 24  # words per fingerprint step (bounds the int64 temporaries of large inputs)


def _fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """A plain and a position-weighted sum of the tensor's 32-bit words (bytes when its size is not a
    multiple of 4), with int64 wrap-around: any changed word moves them, barring a collision a kernel
    bug will not aim for. Integer sums are exact in any order, so the same bytes give the same print."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    aligned = raw.numel() % 4 == 0 and (raw.storage_offset() % 4 == 0)
    words = raw.view(torch.int32) if aligned else raw
    plain = weighted = 0
    for start in range(0, words.numel(), CHUNK):
        c = words[start : start + CHUNK].to(torch.int64)
        pos = torch.arange(start + 1, start + 1 + c.numel(), device=c.device, dtype=torch.int64) % 65521
        plain += int(c.sum())
        weighted += int((c * pos).sum())
    return plain, weighted


class InputPrints:
    """Fingerprints of every tensor input before a launch; ``problems`` names the ones it changed."""

    def __init__(self, inputs: dict[str, Any]) -> None:
        self._inputs = inputs
        self._prints = {k: _fingerprint(v) for k, v in inputs.items() if isinstance(v, torch.Tensor)}

    def problems(self) -> list[str]:
        return [
            f"input {k!r} was written by the launch"
            for k, p in self._prints.items()
            if _fingerprint(self._inputs[k]) != p
        ]
