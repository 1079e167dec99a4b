"""A jagged test op with hostile configs, each the fastest of its study, for the tuner's trust tests.

The op takes jagged ``x`` (``offsets`` bound its sequences) and returns ``y`` (each sequence's sum) and ``dx``
(``2 x``, standing in for a gradient). ``AUTOTUNE_HOSTILE_MODES`` (read in the tuner by a feasibility rule) lists
the modes a test lets the sampler see; the default ('slow') is correct and slowest, 'ok' correct and faster:

* ``gradwrong``: ``y`` right, ``dx`` off by one (a backward kernel wrong on one gradient);
* ``len1``: ``y`` of a length-1 sequence is 0 (a tile path that drops a lone row);
* ``empty``: ``y`` is a mean times a length, NaN for an empty sequence;
* ``nanbig``: ``y`` NaN when the batch has more than ``CHECK_BATCH`` sequences;
* ``raises``: every launch raises a plain ValueError;
* ``stale``: right on its first two launches in a process, off by one after (stale workspace state);
* ``hang``: never returns.
* ``farwrite``: right outputs, but a launch on a batch of at most ``CHECK_BATCH`` sequences adds 1 to the largest
  other ``x`` this process made (an overrun far past the guard, landing in another batch's inputs).
* ``latewrite``: right on every checked launch; from its third launch in a process on (the timing), adds 1 to
  every other ``x`` this process made (a stray write only a timed loop makes).
* ``poison``: right on every launch of its own; from its third launch in a process on, every launch of another
  mode in the process gets ``dx`` off by one (a stray write into state other kernels use).

``AUTOTUNE_HOSTILE_BAD_DEFAULT=1`` makes the default infeasible under its own space's rules. The compiler report
(``report``) gives 'ok' ``OK_SPILLS`` spills, every other mode none.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import ClassVar

import torch
from plugin_specs import torch_op_spec

from autotune.spec import register
from kernel_templates.config_base import JsonConfig
from search_spaces.base import SearchSpace

NAME = "spec_plugin_hostile"
SLEEP_S = {
    "slow": 0.03,
    "ok": 0.01,
    "gradwrong": 0.0,
    "len1": 0.0,
    "empty": 0.0,
    "nanbig": 0.0,
    "raises": 0.0,
    "stale": 0.0,
    "hang": 0.0,
    "farwrite": 0.0,
    "latewrite": 0.0,
    "poison": 0.0,
}
CHECK_BATCH = 5  # sequences in the worker's check batch
OK_SPILLS = 100
_LAUNCHES: dict[str, int] = {}  # launches per mode in this process ('stale')
_MADE: list[torch.Tensor] = []  # every ``x`` this process made ('farwrite')


@dataclass(frozen=True)
class HostileConfig(JsonConfig):
    kind: ClassVar[str] = NAME
    mode: str = "slow"


def segsum(
    x: torch.Tensor,
    offsets: torch.Tensor,
    *,
    config: HostileConfig,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y, dx)``: per-sequence sums of ``x`` and ``2 x``, with the config's planted fault."""
    mode = config.mode
    if mode == "raises":
        raise ValueError("hostile launch refuses to run")
    if mode == "hang":
        time.sleep(3600)
    _LAUNCHES[mode] = _LAUNCHES.get(mode, 0) + 1
    time.sleep(SLEEP_S[mode])
    n = offsets.numel() - 1
    y, dx = out if out is not None else (torch.empty(n, dtype=x.dtype), torch.empty_like(x))
    lens = (offsets[1:] - offsets[:-1]).to(x.dtype)
    seg = torch.repeat_interleave(torch.arange(n), (offsets[1:] - offsets[:-1]).long())
    sums = torch.zeros(n, dtype=x.dtype).index_add_(0, seg, x)
    if mode == "empty":
        sums = sums / lens * lens
    if mode == "len1":
        sums = torch.where(lens == 1, torch.zeros_like(sums), sums)
    if mode == "nanbig" and n > CHECK_BATCH:
        sums = torch.full_like(sums, float("nan"))
    y.copy_(sums)
    wrong = mode == "gradwrong" or (mode == "stale" and _LAUNCHES[mode] > 2)
    wrong = wrong or (mode != "poison" and _LAUNCHES.get("poison", 0) > 2)
    dx.copy_(x * 2 + (1.0 if wrong else 0.0))
    if mode == "farwrite" and n <= CHECK_BATCH:
        others = [t for t in _MADE if t.data_ptr() != x.data_ptr()]
        if others:
            max(others, key=torch.Tensor.numel).add_(1.0)
    if mode == "latewrite" and _LAUNCHES[mode] > 2:
        for t in _MADE:
            if t.data_ptr() != x.data_ptr():
                t.add_(1.0)
    return y, dx


def make_inputs(task, lengths, seed, device, dtype) -> dict:
    x = torch.randn(sum(lengths), generator=torch.Generator().manual_seed(seed)).to(device)
    offsets = torch.tensor([0, *torch.tensor(lengths, dtype=torch.long).cumsum(0).tolist()], dtype=torch.long)
    _MADE.append(x)
    return {"x": x, "offsets": offsets.to(device)}


def reference(inputs: dict, compute_dtype: torch.dtype) -> tuple:
    x, offsets = inputs["x"].to(compute_dtype), inputs["offsets"]
    return torch.stack([s.sum() for s in torch.split(x, (offsets[1:] - offsets[:-1]).tolist())]), x * 2


def flops(inputs: dict) -> float:
    return float(inputs["x"].numel())


def alloc_out(inputs: dict) -> tuple:
    n = inputs["offsets"].numel() - 1
    return torch.full((n,), float("nan")), torch.full_like(inputs["x"], float("nan"))


def tune_launch(inputs: dict, config: HostileConfig, out: tuple | None) -> tuple:
    return segsum(inputs["x"], inputs["offsets"], config=config, out=out)


def defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict:
    return {"torch": HostileConfig()}


def report(inputs: dict, config: HostileConfig) -> dict:
    """The compiler report the tuner reads after the first launch."""
    return {"n_regs": 32, "n_spills": OK_SPILLS if config.mode == "ok" else 0, "shared": 0}


def _only_planted(c: HostileConfig, ctx) -> str | None:
    """The modes a test plants; the default is allowed unless the test makes it infeasible."""
    if c.mode == "slow":
        return "the default is planted infeasible" if os.environ.get("AUTOTUNE_HOSTILE_BAD_DEFAULT") == "1" else None
    listed = {m.strip() for m in os.environ.get("AUTOTUNE_HOSTILE_MODES", "").split(",") if m.strip()}
    return None if c.mode in listed else f"mode {c.mode!r} not planted"


SPACE = SearchSpace(
    f"{NAME}/torch", HostileConfig, {"mode": tuple(SLEEP_S)}, (_only_planted,), lambda ctx: HostileConfig()
)

_SPEC = torch_op_spec(__name__, NAME, "segsum", "HostileConfig")
_BACKEND = dataclasses.replace(_SPEC.kernels[0].backends[0], compile_report=f"{__name__}:report")
_KERNEL = dataclasses.replace(_SPEC.kernels[0], direction="bwd", output_names=("y", "dx"), backends=(_BACKEND,))
SPEC = register(dataclasses.replace(_SPEC, kernels=(_KERNEL,)))
