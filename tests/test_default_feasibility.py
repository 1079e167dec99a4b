"""Heuristic defaults obey their own search spaces' rules on every registry GPU, head dim and width: the
tuner's baseline and what dispatch runs without artifacts (no kernels run)."""

from __future__ import annotations

import json

import optuna
import pytest

from autotune import spec
from autotune.runtime import dispatch, gpus
from autotune.runtime.buckets import BUCKETS
from autotune.tuning.tasks import Task, space_context
from autotune.tuning.tuner import TuneOptions, _Study

HEAD_DIMS = (32, 64, 128, 256)
HEADS = (1, 2, 4, 8, 16, 32, 64)  # widths heads x dv from 32 to 16384 (the model presets use 64..1024)
# The GPUs whose committed artifacts were tuned against the template heuristics: their defaults stay those.
TUNED_GPUS = ("h100", "h200")


def _study(kernel: str, gpu: str, dtype: str, d: int, heads: int = 1) -> _Study:
    task = Task(kernel, gpu, dtype, d, d, heads, 4096, "uniform")
    storage = optuna.storages.InMemoryStorage()
    return _Study(task, TuneOptions(interpret=False, write_artifacts=False), None, storage, None)


def _space(kernel: str, backend: str):
    return spec.resolve(spec.kernel(kernel).backend(backend).space)


def _dispatch_default(monkeypatch, kernel: str, gpu: str, dtype: str, d: int, heads: int = 1) -> dict:
    """What dispatch runs without artifacts on ``gpu`` (the running GPU, as a GPU host detects it): the
    spec's preferred backend and its config."""
    monkeypatch.setattr(gpus, "running_gpu", lambda: gpus.GPUS[gpu], raising=False)
    choice = dispatch.preferred_default(kernel, d, d, dtype, heads, interpret=False)
    return {"backend": choice.backend, "config": json.loads(choice.config)}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("gpu", sorted(gpus.GPUS))
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_attention_default_passes_the_gpus_rules(monkeypatch, direction, gpu, d, dtype):
    """An A100 (163 KB of shared memory per block) at head dim 256 started every study, and ran every call
    without artifacts, on the H100 tiles (208 KB forward, 224 KB backward): a default that cannot compile."""
    kernel = f"hstu_attention_{direction}"
    space = _space(kernel, "triton")
    study = _study(kernel, gpu, dtype, d)
    ctx = space_context(study.task, False)
    baseline = space.make(study.default_values)
    assert study.default_backend.name == "triton"
    assert space.why_infeasible(baseline, ctx) is None, (gpu, d, dtype, baseline)
    ran = _dispatch_default(monkeypatch, kernel, gpu, dtype, d)
    assert ran == {"backend": "triton", "config": baseline.to_dict()}  # the tuner's baseline is what runs
    if gpu in TUNED_GPUS:
        assert baseline == space.default(ctx)


def _layer_kernels() -> list[str]:
    return [k for k in spec.kernels() if not k.startswith("hstu_attention")]


@pytest.mark.parametrize("kernel", _layer_kernels())
def test_every_ops_default_passes_its_rules_at_every_width(monkeypatch, kernel):
    """What dispatch runs without artifacts for every other op, on every registry GPU its backend is built
    for, in every dtype, head dim and width the tuner and the model use, passes its space's rules. The
    LayerNorm defaults (and ln_mul_dropout's) broke their own tile rule from width 8192."""
    bad = []
    for gpu in sorted(gpus.GPUS):
        for dtype in ("bfloat16", "float16", "float32"):
            for d in HEAD_DIMS:
                for heads in HEADS:
                    ran = _dispatch_default(monkeypatch, kernel, gpu, dtype, d, heads)
                    backend = spec.kernel(kernel).backend(ran["backend"])
                    if backend.compute_capability not in (None, gpus.GPUS[gpu].compute_capability):
                        continue  # built for another GPU: never runs there
                    space = spec.resolve(backend.space)
                    ctx = space_context(Task(kernel, gpu, dtype, d, d, heads, BUCKETS[-1], "uniform"), False)
                    reason = space.why_infeasible(space.config_cls.from_dict(ran["config"]), ctx)
                    if reason:
                        bad.append(f"{gpu} {dtype} d{d} h{heads} {ran['backend']}: {reason}")
    assert not bad, "\n".join(bad[:20])


@pytest.mark.parametrize("kernel", _layer_kernels())
def test_the_layer_ops_study_baseline_fits_the_widest_layer(kernel):
    """The tuner's baseline of each layer op at width 16384 (64 heads x 256) passes the space's rules."""
    study = _study(kernel, "h100", "bfloat16", 256, heads=64)
    backend = study.default_backend
    ctx = space_context(study.task, False)
    assert backend.space.why_infeasible(backend.space.make(study.default_values), ctx) is None
