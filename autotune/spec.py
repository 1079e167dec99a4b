"""One spec per op: the single record the tuner's registry, the artifacts and the runtime dispatch read.

An op (``hstu_attention``, ``gemm_silu``, ``layer_norm``, ...) has one or more *kernels*, each tuned
on its own and written to its own artifact file (``hstu_attention_fwd``, ``hstu_attention_bwd``).
A kernel has *backends* (``triton``, ``cute``, ``torch``); each names, as ``"module:attr"`` strings
imported only when used, its runtime launcher, its config class, its search space and its tuner
adapter, plus the template files hashed into artifacts and what it needs to run. Strings keep this
module (and ``import autotune``) free of torch, triton and cutlass.

Adding an op = a template folder (kernels, ``config.py``, ``reference.py``, ``tuning.py``), a
search space under ``search_spaces/``, and a ``spec.py`` in the template folder defining ``SPEC``
(an ``OpSpec``) whose module is listed in ``SPEC_MODULES`` (or registered with ``register``).

Contracts of the named callables (``inputs`` is the dict ``make_inputs`` returns):

- ``KernelSpec.make_inputs(task, lengths, seed, device, dtype) -> dict`` (a task is read as the HSTU
  layer owning the op: tokens = sum(lengths), hidden = heads x dv, head dims dqk/dv);
- ``KernelSpec.reference(inputs, compute_dtype) -> tuple`` (fp32 oracle when compute_dtype is float32);
- ``KernelSpec.flops(inputs) -> float`` (docs/CONTRACTS.md convention; memory-bound ops count their FLOPs too,
  and ``bytes`` gives their HBM traffic for GB/s);
- ``KernelSpec.alloc_out(inputs) -> tuple | None``: NaN-filled outputs the correctness check proves written;
- ``BackendSpec.tune_launch(inputs, config, out) -> tuple`` of outputs in ``output_names`` order;
- ``BackendSpec.launcher``: the runtime call (explicit tensors, ``config=``), what the custom ops run;
- ``BackendSpec.config``: a frozen dataclass with ``to_dict`` / strict ``from_dict``;
- ``BackendSpec.space``: a ``search_spaces.base.SearchSpace`` over that config class.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from functools import cache
from typing import Any

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

__all__ = ["BackendSpec", "KernelSpec", "OpSpec", "kernel", "kernels", "register", "resolve", "specs"]

# Modules defining ``SPEC``; imported lazily by ``specs()``.
SPEC_MODULES: list[str] = [
    "kernel_templates.hstu_attention.spec",
    "kernel_templates.gemm_silu.spec",
    "kernel_templates.layer_norm.spec",
    "kernel_templates.fused_ln_mul_dropout.spec",
    "kernel_templates.linear_residual.spec",
]


_EXTRA: dict[str, OpSpec] = {}
_LOADED: dict[str, OpSpec] = {}
_ON_CHANGE: list[Callable[[], None]] = []  # caches built from specs (registry views, dispatch choices)


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn`` whenever the set of specs changes, so caches derived from them are dropped."""
    _ON_CHANGE.append(fn)


def _changed() -> None:
    _kernel_index.cache_clear()
    resolve.cache_clear()
    for fn in _ON_CHANGE:
        fn()


def register(spec: OpSpec) -> OpSpec:
    """Add (or replace) an op spec at run time, e.g. a test's fake op or a user's plugin."""
    _EXTRA[spec.name] = spec
    _changed()
    return spec


def unregister(name: str) -> None:
    """Drop a registered spec (a built-in one of the same name is seen again)."""
    _EXTRA.pop(name, None)
    _changed()


def _load(module: str) -> OpSpec | None:
    if module not in _LOADED:
        try:
            _LOADED[module] = importlib.import_module(module).SPEC
        except ModuleNotFoundError as e:
            if e.name and module.startswith(e.name):
                return None  # an op not present in this checkout
            raise
    return _LOADED[module]


def specs() -> list[OpSpec]:
    """Every op spec: the built-in modules, then the registered ones (which win on a name clash)."""
    out: dict[str, OpSpec] = {}
    for m in SPEC_MODULES:
        s = _load(m)
        if s is not None:
            out[s.name] = s
    out.update(_EXTRA)
    return list(out.values())


@cache
def _kernel_index() -> dict[str, tuple[OpSpec, KernelSpec]]:
    return {k.name: (s, k) for s in specs() for k in s.kernels}


def kernel(name: str) -> KernelSpec:
    """The spec of an artifact kernel name; ValueError naming the known ones otherwise."""
    idx = _kernel_index()
    if name not in idx:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(sorted(idx))}")
    return idx[name][1]


def kernels() -> list[str]:
    return sorted(_kernel_index())


def op_of(kernel_name: str) -> OpSpec:
    kernel(kernel_name)
    return _kernel_index()[kernel_name][0]


def sources(kernel_name: str, backend: str) -> tuple[str, ...]:
    """Template files whose hash keys ``kernel_name``'s artifacts for ``backend`` (op-wide files too)."""
    op, k = _kernel_index().get(kernel_name, (None, None))
    if k is None:
        return ()
    try:
        b = k.backend(backend)
    except ValueError:
        return ()
    return tuple(dict.fromkeys((*b.sources, *op.sources)))


@cache
def resolve(target: str) -> Any:
    """Import ``module:attr`` once."""
    mod, _, attr = target.partition(":")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def unavailable_reason(b: BackendSpec) -> str | None:
    """Why backend ``b`` cannot run in this process (package missing, no/wrong GPU), or None.

    Checks what the spec declares without importing the backend's modules.
    """
    for mod in b.requires:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed" if mod != "cutlass" else "nvidia-cutlass-dsl not installed"
    import torch

    cuda = torch.cuda.is_available()
    if b.needs_cuda and not cuda:
        return "needs a CUDA GPU"
    if not cuda and not (b.interpretable and os.environ.get("TRITON_INTERPRET", "0") == "1"):
        if not b.interpretable:
            return "needs a CUDA GPU"
        return "needs a CUDA GPU (or TRITON_INTERPRET=1)"
    if b.compute_capability is not None and cuda and torch.cuda.get_device_capability() != b.compute_capability:
        major, minor = b.compute_capability
        return f"needs an sm{major}{minor} GPU"
    return None
