"""A test op whose default is its fastest config and wrong only on many short sequences.

The default passes the check batch and the timed batch, so only the final re-check of the winner
(``worker.verify_lengths``: 96 short sequences) sees it; the op's other config is correct everywhere and
slower, so it never beats the default in the interleaved comparison. The tuner's workers import this
module as a plugin (``tests/test_tuner_decide.py``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from plugin_specs import torch_op_spec

from autotune.spec import register
from kernel_templates.config_base import JsonConfig
from search_spaces.base import SearchSpace

NAME = "spec_plugin_bad_default"
SLEEP_S = {"narrow": 0.0, "ok": 0.01}  # the default ('narrow') is the fastest
WRONG_ABOVE = 40  # sequences: more than the check (5) and timed batches hold, fewer than the re-check's 96


@dataclass(frozen=True)
class ModeConfig(JsonConfig):
    kind: ClassVar[str] = NAME
    mode: str = "narrow"


def double(x: torch.Tensor, n_seqs: int, *, config: ModeConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = 2 x``, off by one when the 'narrow' config gets more than ``WRONG_ABOVE`` sequences."""
    time.sleep(SLEEP_S[config.mode])
    out = torch.empty_like(x) if out is None else out
    wrong = config.mode == "narrow" and n_seqs > WRONG_ABOVE
    return out.copy_(x * 2 + (1.0 if wrong else 0.0))


def make_inputs(task, lengths, seed, device, dtype) -> dict:
    x = torch.randn(sum(lengths) + 1, generator=torch.Generator().manual_seed(seed)).to(device)
    return {"x": x, "n_seqs": len(lengths)}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    return (inputs["x"].float() * 2,)


def flops(inputs: dict) -> float:
    return float(inputs["x"].numel())


def alloc_out(inputs: dict) -> tuple:
    return (torch.full_like(inputs["x"], float("nan")),)


def tune_launch(inputs: dict, config: ModeConfig, out: tuple | None) -> tuple:
    return (double(inputs["x"], inputs["n_seqs"], config=config, out=out[0] if out else None),)


def defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict:
    return {"torch": ModeConfig()}


SPACE = SearchSpace(f"{NAME}/torch", ModeConfig, {"mode": tuple(SLEEP_S)}, (), lambda ctx: ModeConfig())

SPEC = register(torch_op_spec(__name__, NAME, "double", "ModeConfig"))
