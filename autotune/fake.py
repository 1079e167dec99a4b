"""An injectable fake kernel for tests: configs that crash, hang, are wrong, or are just slow.

Registered only when this module is imported (``plugins=["autotune.fake"]``); its worker imports it
too. The 'wrong' and 'nan' configs are the fastest, so a tuner that skipped the correctness check
would pick them.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from autotune.registry import Backend, Op, register_backend, register_op
from search_spaces.base import SearchSpace

FAKE_OP = "fake_op"
# AUTOTUNE_FAKE_FAST_DEFAULT=1 makes the default ('slow') the fastest correct config.
_DEFAULT_S = 0.0 if os.environ.get("AUTOTUNE_FAKE_FAST_DEFAULT") == "1" else 0.02
SLEEP_S = {"slow": _DEFAULT_S, "ok": 0.004, "ok2": 0.006, "wrong": 0.0, "nan": 0.0, "crash": 0.0, "hang": 0.0}


@dataclass(frozen=True)
class FakeConfig:
    mode: str = "slow"
    size: int = 1


def _launch(inputs: dict, config: FakeConfig, out: tuple | None) -> tuple:
    if config.mode == "crash":
        os._exit(7)
    if config.mode == "hang":
        time.sleep(3600)
    time.sleep(SLEEP_S[config.mode])
    o = out[0] if out else torch.empty_like(inputs["x"])
    if config.mode == "nan":
        return (o,)  # never writes: the poisoned buffer shows it
    o.copy_(inputs["x"] * 2 + (1.0 if config.mode == "wrong" else 0.0))
    return (o,)


def _only_ok2_is_big(c: FakeConfig, ctx) -> str | None:
    """Jointly (not marginally) infeasible configs: size 2 fits only mode 'ok2'."""
    return f"size 2 does not fit mode {c.mode!r}" if c.size == 2 and c.mode != "ok2" else None


FAKE_SPACE = SearchSpace(
    "fake_op/fake",
    FakeConfig,
    {"mode": tuple(SLEEP_S), "size": (1, 2)},
    (_only_ok2_is_big,),
    lambda ctx: FakeConfig(),
)

register_op(
    Op(
        FAKE_OP,
        make_inputs=lambda task, lengths, seed, device, dtype: {
            "x": torch.randn(sum(lengths) + 1, generator=torch.Generator().manual_seed(seed)).to(device)
        },
        reference=lambda inputs, dtype: (inputs["x"].float() * 2,),
        flops=lambda inputs: float(inputs["x"].numel()),
        alloc_out=lambda inputs: (torch.full_like(inputs["x"], float("nan")),),
    )
)
register_backend(Backend(FAKE_OP, "fake", FAKE_SPACE, _launch, template_files=("autotune/fake.py",)))
