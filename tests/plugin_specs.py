"""What the test plugins (``spec_plugin_op``, ``spec_plugin_bad_default``) and the tuner tests share: the spec of a
one-kernel op with one interpretable torch backend, loading a plugin the tuner's worker processes can import too,
and reading back or breaking the tuner's verdicts."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from kernel_templates.spec_base import BackendSpec, KernelSpec, OpSpec

TESTS = Path(__file__).resolve().parent


def torch_op_spec(module: str, name: str, launcher: str, config: str) -> OpSpec:
    """The op ``name`` whose callables (make_inputs, reference, flops, alloc_out, defaults, SPACE, tune_launch,
    ``launcher``, ``config``) all live in ``module``, hashed as that module's file."""
    return OpSpec(
        name=name,
        kernels=(
            KernelSpec(
                name=name,
                direction="fwd",
                make_inputs=f"{module}:make_inputs",
                reference=f"{module}:reference",
                flops=f"{module}:flops",
                alloc_out=f"{module}:alloc_out",
                default=f"{module}:defaults",
                backends=(
                    BackendSpec(
                        name="torch",
                        launcher=f"{module}:{launcher}",
                        config=f"{module}:{config}",
                        space=f"{module}:SPACE",
                        tune_launch=f"{module}:tune_launch",
                        sources=(f"tests/{module}.py",),
                        interpretable=True,
                    ),
                ),
            ),
        ),
    )


@contextlib.contextmanager
def registered_plugin(monkeypatch: Any, module: str) -> Iterator[ModuleType]:
    """The plugin ``module``, registered here and on the workers' PYTHONPATH; unregistered and forgotten after
    (a registered leftover made later tests see a plugin they had not loaded, and skip loading it)."""
    from autotune import spec
    from autotune.tuning import registry

    def forget() -> None:
        sys.modules.pop(module, None)
        if module in registry._loaded:
            registry._loaded.remove(module)

    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    forget()  # an earlier test's import (say AUTOTUNE_PLUGINS in a CLI test) must not stand in for registering it
    registry.load_plugins([module])
    plugin = __import__(module)
    try:
        yield plugin
    finally:
        spec.unregister(plugin.NAME)
        forget()


def trials_by_mode(root: Path, task: Any, param: str) -> dict[str, Any]:
    """The last non-duplicate trial of each value of ``param`` (e.g. 'torch.mode') in ``task``'s study under
    ``root``: what a test of the tuner's verdicts reads back."""
    import optuna

    from autotune.tuning.tuner import make_storage

    storage = make_storage(None, task.gpu, root)
    name = next(n for n in optuna.get_all_study_names(storage) if n.startswith(task.study_name + "|src"))
    out = {}
    for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
        if not t.user_attrs.get("duplicate") and param in t.params:
            out[t.params[param]] = t
    return out


def decide_raises_for_bucket(monkeypatch: Any, bucket: int) -> None:
    """The tuner's verdict step raises a ``KeyError`` (a bug's error, not a RuntimeError) for tasks of ``bucket`` and
    runs as usual for the others: what a test of one task's unexpected failure plants."""
    from autotune.tuning import tuner

    decide = tuner._decide

    def broken(s: Any, result: Any) -> Any:
        if s.task.bucket == bucket:
            raise KeyError("planted")
        return decide(s, result)

    monkeypatch.setattr(tuner, "_decide", broken)
