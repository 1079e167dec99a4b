"""Backward of ``out = residual + y W^T + b``: dy = dout W (dgrad) and dW = dout^T y (wgrad) on cuBLAS, in
the order the tuner picks per shape (``ORDERS``).

- ``serial``: dgrad, then wgrad, on the caller's stream (what the layer ran untuned);
- ``wgrad_first``: wgrad, then dgrad: another operand's tail is in L2 when the second GEMM starts, and the
  dgrad, which the next op of the layer's backward reads, is written last, nearer to its reader;
- ``side_stream``: wgrad on a side CUDA stream, beside the dgrad on the caller's stream (two GEMMs of
  different shapes whose wave tails can fill each other's idle SMs). With ``pending`` the caller's stream
  is not joined here: the layer lets the wgrad run on beside the ops after it and joins at the end of its
  backward. Without CUDA it runs ``serial``.

The bias gradient (dout's column sum) is not computed here: the layer's input LayerNorm backward sums dout
while it reads it for the residual gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from kernel_templates.config_base import JsonConfig

ORDERS = ("serial", "wgrad_first", "side_stream")


@dataclass(frozen=True)
class LinearResidualBwdConfig(JsonConfig):
    kind: ClassVar[str] = "linear_residual_bwd"
    order: str = "serial"

    def __post_init__(self) -> None:
        if self.order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {self.order!r}")


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device, made once (a stream per call would cost a driver call each time)."""
    s = _SIDE_STREAMS.get(device)
    if s is None:
        s = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return s


def _dgrad(g: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return g @ weight if out is None else torch.mm(g, weight, out=out)


def _wgrad(g: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return g.t() @ y if out is None else torch.mm(g.t(), y, out=out)


def _side_stream(
    g: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, out: tuple, pending: list | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """wgrad on the side stream after everything queued so far on the caller's stream; dgrad on the caller's."""
    main = torch.cuda.current_stream(g.device)
    side = side_stream(g.device)
    dw = out[1] if out[1] is not None else y.new_empty((weight.shape[0], y.shape[1]))  # allocated on main
    side.wait_stream(main)  # dout, y and dw's memory are ready (their writers and dw's last readers are done)
    with torch.cuda.stream(side):
        _wgrad(g, y, dw)
    # The allocator may hand a freed block to the caller's stream at once: each tensor the side stream uses
    # stays reserved until the side stream's work queued now is done.
    for t in (g, y, dw):
        t.record_stream(side)
    try:
        dy = _dgrad(g, weight, out[0])
    finally:  # joined or handed back even when the dgrad raises: an unjoined fork fails a graph capture
        done = torch.cuda.Event()
        done.record(side)
        if pending is None:
            main.wait_event(done)
        else:
            pending.append(done)
    return dy, dw


def linear_residual_bwd(
    dout: torch.Tensor,
    y: torch.Tensor,
    weight: torch.Tensor,
    *,
    config: LinearResidualBwdConfig,
    out: tuple | None = None,
    pending: list | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dy, dweight) in y's dtype (the GEMM dtype). ``out``: (dy, dweight) buffers or Nones. ``pending``: a list
    that receives the event of work left running on another stream (the caller waits on it before reading dweight);
    None joins before returning."""
    g = dout.to(y.dtype)
    out = (None, None) if out is None else tuple(out)
    if config.order == "side_stream" and g.is_cuda:
        return _side_stream(g, y, weight, out, pending)
    if config.order == "wgrad_first":
        dw = _wgrad(g, y, out[1])
        return _dgrad(g, weight, out[0]), dw
    dy = _dgrad(g, weight, out[0])
    return dy, _wgrad(g, y, out[1])
