"""Injectable fake kernels for tests: configs that crash, hang, are wrong, poison the process, or are slow.

Registered (``autotune.spec.register``, the same op spec every real op has) only when this module is
imported (``plugins=["autotune.tuning.fake"]``); its worker imports it too. Two ops:

- ``fake_op``: modes slow (the default), ok, ok2, wrong, nan, crash, hang. The 'wrong' and 'nan'
  configs are the fastest, so a tuner that skipped the correctness check would pick them.
- ``fake_faults``: the planted faults of the tuner's trust tests, each the fastest config of its
  study so only a working check keeps it out. ``AUTOTUNE_FAKE_MODES`` (read in the tuner process by
  a feasibility rule) lists the modes a test lets the sampler see:

  * ``sticky``: raises an unknown error and leaves the process broken (every later launch in it
    fails too), like a sticky CUDA error whose message matches no fatal marker;
  * ``bigwrong``: correct on the 5-sequence check batch, wrong on larger batches (a grid too small
    for many sequences);
  * ``narrow``: correct on the check and timed batches, wrong on many short sequences (only the
    final re-check of the winner sees it);
  * ``overrun``: right output, plus one element stored past its end (where the storage has room: the
    checks' guard band; elsewhere torch refuses it, as an out-of-bounds store would fault);
  * ``clobber``: right output, computed before it overwrites an element of its input;
  * ``nan``, ``crash``, ``hang``, ``wrong``: as in ``fake_op``.

Environment hooks for process-level faults: ``AUTOTUNE_FAKE_SETUP_DEATHS=PATH:N`` makes the first N
worker set-ups die (a counter in PATH), ``AUTOTUNE_FAKE_DEFAULT_SLEEP=S`` makes the default sleep S
seconds per launch (a test kills the run during it), ``AUTOTUNE_FAKE_OK_FIRST_SLEEP=S`` makes the first 'ok'
launch of each worker sleep S seconds (a compile longer than a short ``--eval-timeout``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch

from autotune.spec import register
from kernel_templates.config_base import JsonConfig
from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec
from search_spaces.base import SearchSpace

FAKE_OP = "fake_op"
FAULTS_OP = "fake_faults"
# AUTOTUNE_FAKE_FAST_DEFAULT=1 makes the default ('slow') the fastest correct config.
_DEFAULT_S = 0.0 if os.environ.get("AUTOTUNE_FAKE_FAST_DEFAULT") == "1" else 0.02
SLEEP_S = {"slow": _DEFAULT_S, "ok": 0.004, "ok2": 0.006, "wrong": 0.0, "nan": 0.0, "crash": 0.0, "hang": 0.0}
FAULT_SLEEP_S = {**SLEEP_S, "sticky": 0.0, "bigwrong": 0.001, "narrow": 0.002, "overrun": 0.0, "clobber": 0.0}
CHECK_BATCH = 5  # sequences in the worker's check batch (autotune.tuning.worker.check_lengths)
_BROKEN: list[str] = []  # set by a 'sticky' launch: this process is unusable from then on
_FIRST_DONE: list[str] = []  # modes whose first launch in this process ran (AUTOTUNE_FAKE_OK_FIRST_SLEEP)


@dataclass(frozen=True)
class FakeConfig(JsonConfig):
    kind: ClassVar[str] = "fake"
    mode: str = "slow"
    size: int = 1


def _launch(inputs: dict, config: FakeConfig, out: tuple | None) -> tuple:
    mode = config.mode
    if _BROKEN:
        raise RuntimeError(f"device left in an unrecognised state by an earlier launch ({_BROKEN[0]})")
    if mode == "crash":
        os._exit(7)
    if mode == "hang":
        time.sleep(3600)
    if mode == "sticky":
        _BROKEN.append("sticky")
        raise RuntimeError("launch failed with an unrecognised status")
    delay = FAULT_SLEEP_S[mode]
    if mode == "ok" and os.environ.get("AUTOTUNE_FAKE_OK_FIRST_SLEEP") and mode not in _FIRST_DONE:
        _FIRST_DONE.append(mode)
        delay = float(os.environ["AUTOTUNE_FAKE_OK_FIRST_SLEEP"])
    if mode == "slow" and os.environ.get("AUTOTUNE_FAKE_DEFAULT_SLEEP"):
        delay = float(os.environ["AUTOTUNE_FAKE_DEFAULT_SLEEP"])
    time.sleep(delay)
    o = out[0] if out else torch.empty_like(inputs["x"])
    if mode == "nan":
        return (o,)  # never writes: the poisoned buffer shows it
    seqs = inputs["n_seqs"]
    wrong = mode == "wrong" or (mode == "bigwrong" and seqs > CHECK_BATCH) or (mode == "narrow" and seqs > 40)
    o.copy_(inputs["x"] * 2 + (1.0 if wrong else 0.0))
    if mode == "overrun":
        o.as_strided((1,), (1,), o.storage_offset() + o.numel()).fill_(0.0)
    if mode == "clobber":
        inputs["x"][0] += 1.0
    return (o,)


def _only_ok2_is_big(c: FakeConfig, ctx) -> str | None:
    """Jointly (not marginally) infeasible configs: size 2 fits only mode 'ok2'."""
    return f"size 2 does not fit mode {c.mode!r}" if c.size == 2 and c.mode != "ok2" else None


def _only_listed_modes(c: FakeConfig, ctx) -> str | None:
    """The fault modes a test plants (``AUTOTUNE_FAKE_MODES``); the default is always allowed."""
    listed = {m.strip() for m in os.environ.get("AUTOTUNE_FAKE_MODES", "").split(",") if m.strip()}
    return None if c.mode == "slow" or c.mode in listed else f"mode {c.mode!r} not planted"


def _make_inputs(task, lengths, seed, device, dtype) -> dict:
    spec = os.environ.get("AUTOTUNE_FAKE_SETUP_DEATHS")
    if spec:
        path, _, count = spec.rpartition(":")
        counter = Path(path)
        died = int(counter.read_text() or 0) if counter.exists() else 0
        if died < int(count):
            counter.write_text(str(died + 1))
            os._exit(9)  # the worker dies while setting up, as on host OOM
    x = torch.randn(sum(lengths) + 1, generator=torch.Generator().manual_seed(seed)).to(device)
    return {"x": x, "n_seqs": len(lengths)}


def _reference(inputs: dict, dtype: torch.dtype) -> tuple:
    return (inputs["x"].float() * 2,)


def _flops(inputs: dict) -> float:
    return float(inputs["x"].numel())


def _alloc_out(inputs: dict) -> tuple:
    return (torch.full_like(inputs["x"], float("nan")),)


def _defaults(dqk: int, dv: int, num_heads: int, dtype: object, interpret: bool) -> dict[str, FakeConfig]:
    return {"fake": FakeConfig()}


def fake_launcher(x: torch.Tensor, *, config: FakeConfig, out: torch.Tensor | None = None) -> torch.Tensor:
    """The runtime call: what dispatch runs for a fake kernel (same code as the tuner's launch)."""
    return _launch({"x": x, "n_seqs": 1}, config, (out,) if out is not None else None)[0]


def _spec(name: str, space: str) -> OpSpec:
    backend = BackendSpec(
        name="fake",
        launcher="autotune.tuning.fake:fake_launcher",
        config="autotune.tuning.fake:FakeConfig",
        space=f"autotune.tuning.fake:{space}",
        tune_launch="autotune.tuning.fake:_launch",
        sources=("autotune/tuning/fake.py",),
        interpretable=True,
    )
    kernel = KernelSpec(
        name=name,
        direction="fwd",
        make_inputs="autotune.tuning.fake:_make_inputs",
        reference="autotune.tuning.fake:_reference",
        flops="autotune.tuning.fake:_flops",
        alloc_out="autotune.tuning.fake:_alloc_out",
        backends=(backend,),
        default="autotune.tuning.fake:_defaults",
    )
    return OpSpec(name=name, kernels=(kernel,))


FAKE_SPACE = SearchSpace(
    "fake_op/fake", FakeConfig, {"mode": tuple(SLEEP_S), "size": (1, 2)}, (_only_ok2_is_big,), lambda ctx: FakeConfig()
)
FAULTS_SPACE = SearchSpace(
    "fake_faults/fake", FakeConfig, {"mode": tuple(FAULT_SLEEP_S)}, (_only_listed_modes,), lambda ctx: FakeConfig()
)

FAKE_SPEC = register(_spec(FAKE_OP, "FAKE_SPACE"))
FAULTS_SPEC = register(_spec(FAULTS_OP, "FAULTS_SPACE"))
