"""Registry of tunable kernels, so the tuner is backend-agnostic.

An *op* says what is computed (inputs, fp32 reference, FLOPs); a *backend* says how (a search
space and a launch function). A task's study searches over every available backend of its op with a
categorical ``backend`` parameter, so a CuTe DSL implementation competes with the Triton one.

How to register a backend (e.g. the CuTe DSL one), in a module of your own::

    from autotune.registry import Backend, register_backend
    from search_spaces.hstu_cute import HSTU_FWD_CUTE          # a search_spaces.base.SearchSpace

    def _launch(inputs, config, out):                          # -> tuple of output tensors
        return (my_cute_fwd(inputs["q"], ..., config=config, out=out[0] if out else None),)

    register_backend(Backend(
        op="hstu_attention_fwd", name="cute", space=HSTU_FWD_CUTE, launch=_launch,
        template_files=("kernel_templates/cute/hstu_fwd.py",),   # hashed into artifacts
        available=lambda: None if cutlass_present() else "nvidia-cutlass-dsl not installed",
    ))

then make the module known to the tuner (its worker subprocess imports it too): add it to
``PLUGIN_MODULES`` below, or set ``AUTOTUNE_PLUGINS=my.module``, or pass ``autotune run --plugin
my.module``. ``inputs`` is the dict the op's ``make_inputs`` builds (see ``autotune/hstu_ops.py``);
``out`` is the op's poisoned (NaN-filled) output buffers or None. ``jit_functions`` (optional)
returns the Triton JITFunctions the launch runs so their compiler reports (registers, spills, shared
memory) are recorded; other backends may instead return them from ``compile_report(inputs, config)``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from search_spaces.base import SearchSpace

PLUGIN_MODULES: list[str] = ["autotune.hstu_ops", "autotune.gemm_ops"]


@dataclass(frozen=True)
class Op:
    """What a kernel computes; shared by its backends. Names are the artifact kernel names."""

    name: str
    make_inputs: Callable[..., dict]  # (task, lengths, seed, device, dtype) -> inputs
    reference: Callable[[dict, Any], tuple]  # (inputs, compute torch dtype) -> outputs
    flops: Callable[[dict], float]  # inputs -> FLOPs of one call (HSTU.md convention)
    alloc_out: Callable[[dict], tuple | None] = lambda inputs: None  # NaN-filled outputs or None
    output_names: tuple[str, ...] = ("out",)
    direction: str = "fwd"
    verify_masks: tuple[str, ...] = ()  # mask features a winner is re-checked on (empty: the task's own)


@dataclass(frozen=True)
class Backend:
    """One implementation of an op: its search space and how to launch a config."""

    op: str
    name: str
    space: SearchSpace
    launch: Callable[[dict, Any, tuple | None], tuple]
    template_files: tuple[str, ...] = ()
    jit_functions: Callable[[], Sequence[Any]] = lambda: ()
    compile_report: Callable[[dict, Any], dict] | None = None
    available: Callable[[], str | None] = lambda: None


_OPS: dict[str, Op] = {}
_BACKENDS: dict[tuple[str, str], Backend] = {}
_loaded: list[str] = []


def cute_available() -> str | None:
    """Why the CuTe DSL backends cannot run here (package missing, no Hopper sm90 GPU), or None.

    Shared by every CuTe backend's ``available``; imports lazily so ``import autotune`` stays light.
    """
    import importlib.util

    if importlib.util.find_spec("cutlass") is None:
        return "nvidia-cutlass-dsl not installed"
    import torch

    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    if torch.cuda.get_device_capability() != (9, 0):
        return "needs an sm90 (Hopper) GPU"
    return None


def register_op(op: Op) -> Op:
    _OPS[op.name] = op
    return op


def register_backend(backend: Backend) -> Backend:
    """Register (or replace) a backend and tell the artifacts which files its template hash covers."""
    from autotune.artifacts import register_template_sources

    _BACKENDS[(backend.op, backend.name)] = backend
    if backend.template_files:
        register_template_sources(backend.op, backend.name, backend.template_files)
    return backend


def plugin_modules(extra: Sequence[str] = ()) -> list[str]:
    env = [m for m in os.environ.get("AUTOTUNE_PLUGINS", "").split(",") if m.strip()]
    out: list[str] = []
    for m in [*PLUGIN_MODULES, *env, *extra]:
        if m.strip() and m.strip() not in out:
            out.append(m.strip())
    return out


def load_plugins(extra: Sequence[str] = ()) -> list[str]:
    """Import the registering modules (built-in, AUTOTUNE_PLUGINS, ``extra``); returns their names."""
    mods = plugin_modules(extra)
    for m in mods:
        if m not in _loaded:
            importlib.import_module(m)
            _loaded.append(m)
    return mods


def get_op(name: str) -> Op:
    try:
        return _OPS[name]
    except KeyError:
        raise ValueError(f"unknown kernel {name!r}; registered: {', '.join(sorted(_OPS)) or 'none'}") from None


def ops() -> list[str]:
    return sorted(_OPS)


def backends_for(op: str, only: Sequence[str] | None = None, available_only: bool = True) -> list[Backend]:
    """Backends of ``op`` (sorted by name), optionally only the named / the available ones."""
    out = []
    for (o, name), b in sorted(_BACKENDS.items()):
        if o != op or (only and name not in only):
            continue
        if available_only and b.available() is not None:
            continue
        out.append(b)
    return out


def get_backend(op: str, name: str) -> Backend:
    try:
        return _BACKENDS[(op, name)]
    except KeyError:
        raise ValueError(f"no backend {name!r} registered for {op!r}") from None
