"""The tuner's view of the op specs: resolved callables per kernel and backend.

Every kernel the tuner can tune is described once, by its op's spec (``autotune.spec``; a
``spec.py`` in each template folder). This module resolves a spec's ``"module:attr"`` strings into
the callables the tuner and its workers run. ``Op`` and ``Backend`` are those resolved views; nothing
registers them by hand.

Extra ops (a test's fake kernels, a user's plugin) call ``autotune.spec.register(OpSpec(...))`` in a
module the tuner imports: list it in ``AUTOTUNE_PLUGINS=my.module`` or pass ``autotune run --plugin
my.module`` (its worker subprocesses import it too).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

from autotune import spec as specs
from autotune.spec import unavailable_reason
from kernel_templates.spec_base import BackendSpec, KernelSpec

PLUGIN_MODULES: list[str] = []  # built-in ops come from autotune.spec.SPEC_MODULES
_loaded: list[str] = []


@dataclass(frozen=True)
class Op:
    """What a kernel computes; shared by its backends. Names are the artifact kernel names."""

    name: str
    make_inputs: Callable[..., dict]  # (task, lengths, seed, device, dtype) -> inputs
    reference: Callable[[dict, Any], tuple]  # (inputs, compute torch dtype) -> outputs
    flops: Callable[[dict], float]  # inputs -> FLOPs of one call (docs/CONTRACTS.md convention)
    alloc_out: Callable[[dict], tuple | None] = lambda inputs: None  # NaN-filled outputs or None
    output_names: tuple[str, ...] = ("out",)
    direction: str = "fwd"
    verify_masks: tuple[str, ...] = ()  # mask features a winner is re-checked on (empty: the task's own)


@dataclass(frozen=True)
class Backend:
    """One implementation of a kernel: its search space and how the tuner launches a config."""

    op: str
    name: str
    space: Any  # search_spaces.base.SearchSpace
    launch: Callable[[dict, Any, tuple | None], tuple]
    template_files: tuple[str, ...] = ()
    jit_functions: Callable[[], Sequence[Any]] = lambda: ()
    compile_report: Callable[[dict, Any], dict] | None = None
    available: Callable[[], str | None] = lambda: None


def cute_available() -> str | None:
    """Why the CuTe DSL backends cannot run here, or None (what every CuTe backend spec declares)."""
    return unavailable_reason(
        BackendSpec("cute", None, None, None, None, requires=("cutlass",), needs_cuda=True, compute_capability=(9, 0))
    )


def _maybe(target: str | None) -> Any:
    return specs.resolve(target) if target else None


@cache
def _op_view(name: str) -> Op:
    k: KernelSpec = specs.kernel(name)
    return Op(
        name=k.name,
        make_inputs=specs.resolve(k.make_inputs),
        reference=specs.resolve(k.reference),
        flops=specs.resolve(k.flops),
        alloc_out=_maybe(k.alloc_out) or (lambda inputs: None),
        output_names=k.output_names,
        direction=k.direction,
        verify_masks=k.verify_masks,
    )


@cache
def _backend_view(kernel: str, name: str) -> Backend:
    b = specs.kernel(kernel).backend(name)
    if b.space is None or b.tune_launch is None:
        raise ValueError(f"{kernel}: backend {name!r} is not tunable (no search space or tuner launch in its spec)")
    return Backend(
        op=kernel,
        name=b.name,
        space=specs.resolve(b.space),
        launch=specs.resolve(b.tune_launch),
        template_files=specs.sources(kernel, name),
        jit_functions=_maybe(b.jit_functions) or (lambda: ()),
        compile_report=_maybe(b.compile_report),
        available=lambda b=b: unavailable_reason(b),
    )


def clear() -> None:
    """Forget resolved views (after ``autotune.spec.register`` replaced an op)."""
    _op_view.cache_clear()
    _backend_view.cache_clear()


specs.on_change(clear)


def plugin_modules(extra: Sequence[str] = ()) -> list[str]:
    env = [m for m in os.environ.get("AUTOTUNE_PLUGINS", "").split(",") if m.strip()]
    out: list[str] = []
    for m in [*PLUGIN_MODULES, *env, *extra]:
        if m.strip() and m.strip() not in out:
            out.append(m.strip())
    return out


def load_plugins(extra: Sequence[str] = ()) -> list[str]:
    """Import the modules that register extra op specs (AUTOTUNE_PLUGINS, ``extra``); returns their names."""
    mods = plugin_modules(extra)
    for m in mods:
        if m not in _loaded:
            importlib.import_module(m)
            _loaded.append(m)
    return mods


def get_op(name: str) -> Op:
    return _op_view(name)


def ops() -> list[str]:
    return specs.kernels()


def backends_for(op: str, only: Sequence[str] | None = None, available_only: bool = True) -> list[Backend]:
    """Tunable backends of kernel ``op`` (sorted by name), optionally only the named / the available ones."""
    out = []
    for b in sorted(specs.kernel(op).backends, key=lambda b: b.name):
        if (only and b.name not in only) or b.space is None or b.tune_launch is None:
            continue
        view = _backend_view(op, b.name)
        if available_only and view.available() is not None:
            continue
        out.append(view)
    return out


def get_backend(op: str, name: str) -> Backend:
    try:
        return _backend_view(op, name)
    except ValueError as e:
        raise ValueError(f"no backend {name!r} registered for {op!r}: {e}") from None
