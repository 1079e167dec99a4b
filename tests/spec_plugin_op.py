"""A test op defined only by its spec: kernel, reference, tuner adapter and the spec (``plugin_specs.torch_op_spec``),
in one module.

``tests/test_spec_end_to_end.py`` tunes it, saves the artifact, loads it and dispatches a call to it
without any other registration; the tuner's workers import this module as a plugin.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from plugin_specs import torch_op_spec

from autotune.spec import register
from kernel_templates.config_base import JsonConfig
from search_spaces.base import SearchSpace

NAME = "spec_plugin_scale"


@dataclass(frozen=True)
class ScaleConfig(JsonConfig):
    """``chunks``: how many pieces the launcher splits the rows into (all correct; 1 is fastest)."""

    kind: ClassVar[str] = "spec_plugin_scale"
    chunks: int = 4


def scale(x: torch.Tensor, factor: float, *, config: ScaleConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The runtime launcher: ``out = x * factor``, written chunk by chunk (slower with more chunks)."""
    out = torch.empty_like(x) if out is None else out
    for piece, dst in zip(x.chunk(config.chunks), out.chunk(config.chunks), strict=True):
        for _ in range(config.chunks):  # more chunks: more (redundant) work, so the tuner has a winner
            torch.mul(piece, factor, out=dst)
    return out


def make_inputs(task, lengths, seed, device, dtype) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(sum(lengths) * 64, generator=gen).to(device, dtype), "factor": 3.0}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    return (inputs["x"].to(compute_dtype) * inputs["factor"],)


def flops(inputs: dict) -> float:
    return float(inputs["x"].numel())


def alloc_out(inputs: dict) -> tuple:
    return (torch.full_like(inputs["x"], float("nan")),)


def tune_launch(inputs: dict, config: ScaleConfig, out: tuple | None) -> tuple:
    return (scale(inputs["x"], inputs["factor"], config=config, out=out[0] if out else None),)


def defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict:
    return {"torch": ScaleConfig()}


SPACE = SearchSpace(f"{NAME}/torch", ScaleConfig, {"chunks": (1, 4, 16)}, (), lambda ctx: ScaleConfig())

SPEC = register(torch_op_spec(__name__, NAME, "scale", "ScaleConfig"))
