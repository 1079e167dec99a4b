"""An op added by its spec alone is tuned, saved, loaded and dispatched (CPU, interpreter mode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from plugin_specs import registered_plugin

from autotune import spec
from autotune.runtime import artifacts as art
from autotune.runtime import dispatch
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TuneOptions, run_tasks

TESTS = Path(__file__).resolve().parent
PLUGIN = "spec_plugin_op"


@pytest.fixture
def plugin(monkeypatch):
    with registered_plugin(monkeypatch, PLUGIN) as module:
        yield module
    dispatch.reset()


def test_spec_only_op_is_tuned_saved_loaded_and_dispatched(tmp_path, plugin):
    name = plugin.NAME
    assert name in spec.kernels()
    task = Task(name, "h100", "float32", 32, 32, 1, 256, "uniform", batch=4, seq_cap=16)
    opts = TuneOptions(n_trials=3, sampler="bruteforce", artifacts_root=tmp_path, plugins=[PLUGIN], interpret=True)
    (result,) = run_tasks([task], opts, None)
    assert result.error is None, result.error
    path = art.artifact_path("h100", name, tmp_path)
    entry = json.loads(path.read_text())["entries"][0]
    assert entry["backend"] == "torch" and entry["config"] in ({"chunks": 1}, {"chunks": 4}, {"chunks": 16})
    # Dispatch reads the same spec: the tuned entry is chosen and its launcher runs.
    loaded = dispatch.load(tmp_path, gpu="h100", allow_same_arch=True)
    assert name in loaded["kernels"], loaded
    choice = dispatch.select(name, torch.float32, 32, 32, 1, 256, "uniform")
    assert choice.source == "tuned" and json.loads(choice.config) == entry["config"]
    cfg = dispatch.decode_config(choice.backend, name, choice.config)
    x = torch.randn(37)
    torch.testing.assert_close(dispatch.launcher(choice.backend, name)(x, 2.0, config=cfg), x * 2)
    # Unloaded, the spec's default runs.
    dispatch.reset()
    default = dispatch.select(name, torch.float32, 32, 32, 1, 256)
    assert default.source == "default" and json.loads(default.config) == {"chunks": 4}


def test_an_op_registered_after_the_load_runs_its_default(tmp_path, monkeypatch):
    """``autotune.load()`` then a plugin import (the order a training script may take): the plugin's kernel had no
    record in the loaded state, and its first call raised a KeyError from inside dispatch. It runs its spec's
    default, said once, like a kernel whose file is missing; a load after the registration reads its file."""
    dispatch.reset()
    dispatch.load(tmp_path, gpu="h100")
    try:
        with registered_plugin(monkeypatch, PLUGIN) as module:
            with pytest.warns(dispatch.DispatchWarning, match="registered after autotune.load"):
                choice = dispatch.select(module.NAME, torch.float32, 32, 32, 1, 256)
            assert choice.source == "default" and json.loads(choice.config) == {"chunks": 4}
            assert module.NAME in dispatch.load(tmp_path, gpu="h100")["missing"]
    finally:
        dispatch.reset()


def test_spec_strings_all_resolve():
    """Every "module:attr" of every built-in spec imports (CuTe ones: the module file exists)."""
    import importlib.util

    for k in spec.kernels():
        ks = spec.kernel(k)
        for target in (ks.make_inputs, ks.reference, ks.flops, ks.alloc_out, ks.default, ks.bytes):
            if target:
                assert spec.resolve(target) is not None, target
        for b in ks.backends:
            for target in (b.launcher, b.config, b.space, b.tune_launch, b.jit_functions, b.compile_report):
                if not target:
                    continue
                if "cutlass" in b.requires and importlib.util.find_spec("cutlass") is None:
                    mod = target.partition(":")[0]
                    assert importlib.util.find_spec(mod) is not None, target
                    continue
                assert spec.resolve(target) is not None, target
            for src in b.sources:
                assert (TESTS.parent / src).is_file() or Path(src).is_file(), f"{k}/{b.name}: {src} missing"
