"""The output projection's backward (``linear_residual_bwd``): every order against the fp32 reference, the
launcher's argument checks, its search space, a CPU tuning run that dispatch then serves, and the side stream's
synchronisation on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from autotune import spec
from autotune.runtime import dispatch
from kernel_templates.linear_residual.bwd_impl import ORDERS, LinearResidualBwdConfig
from kernel_templates.linear_residual.launch import linear_residual_bwd
from kernel_templates.linear_residual.tuning import reference_bwd
from kernel_templates.tolerance import error_bound


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _inputs(m: int, n: int, k: int, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "dout": torch.randn(m, n, generator=gen).to(device, dtype),
        "y": torch.randn(m, k, generator=gen).to(device, dtype),
        "weight": (torch.randn(n, k, generator=gen) / k**0.5).to(device, dtype),
    }


def _check(got: tuple, inputs: dict, dtype: torch.dtype) -> None:
    """Each output within the project's tolerance of the fp32 reference (``kernel_templates.tolerance``)."""
    ref32 = reference_bwd(inputs, torch.float32)
    reflo = reference_bwd(inputs, dtype)
    for name, g, r32, rlo in zip(("dy", "dweight"), got, ref32, reflo, strict=True):
        assert g.dtype == dtype and g.shape == r32.shape, name
        assert torch.isfinite(g).all(), name
        err = float((g.float() - r32).abs().max()) if g.numel() else 0.0
        torch_err = float((rlo.float() - r32).abs().max()) if g.numel() else 0.0
        assert err <= error_bound(torch_err, dtype, r32), f"{name}: error {err:.3e}"


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [0, 1, 37])
def test_every_order_matches_the_reference(device, order, dtype, m):
    inputs = _inputs(m, 40, 48, device, dtype)
    cfg = LinearResidualBwdConfig(order)
    _check(linear_residual_bwd(inputs["dout"], inputs["y"], inputs["weight"], config=cfg), inputs, dtype)
    # Into NaN-filled buffers (the tuner's check): every element written, the buffers themselves returned.
    out = (torch.full((m, 48), float("nan"), device=device, dtype=dtype),
           torch.full((40, 48), float("nan"), device=device, dtype=dtype))  # fmt: skip
    got = linear_residual_bwd(inputs["dout"], inputs["y"], inputs["weight"], config=cfg, out=out)
    assert got[0].data_ptr() == out[0].data_ptr() and got[1].data_ptr() == out[1].data_ptr()
    _check(got, inputs, dtype)


@pytest.mark.parametrize("order", ORDERS)
def test_strided_and_wider_dout(device, order):
    """A transposed or column-sliced dout (not contiguous) and an fp32 dout beside fp16 GEMMs give the gradients
    of the contiguous dout in the GEMM dtype."""
    cfg = LinearResidualBwdConfig(order)
    inputs = _inputs(33, 24, 16, device, torch.float32, seed=1)
    y, w = inputs["y"], inputs["weight"]
    want = linear_residual_bwd(inputs["dout"], y, w, config=cfg)
    for dout in (inputs["dout"].t().contiguous().t(), inputs["dout"].repeat_interleave(2, dim=1)[:, ::2]):
        assert not dout.is_contiguous()
        got = linear_residual_bwd(dout, y, w, config=cfg)
        for g, r in zip(got, want, strict=True):
            torch.testing.assert_close(g, r)
    half = _inputs(33, 24, 16, device, torch.float16, seed=1)
    got = linear_residual_bwd(half["dout"].float(), half["y"], half["weight"], config=cfg)
    _check(got, half, torch.float16)


def test_bad_arguments_are_named(device):
    cfg = LinearResidualBwdConfig()
    i = _inputs(5, 4, 6, device, torch.float32)
    dout, y, w = i["dout"], i["y"], i["weight"]
    cases = [
        ((dout[:4], y, w), {}, r"dout must have shape \(5, 4\)"),
        ((dout, y, w[:, :5]), {}, "y \\(M, K\\) and weight \\(N, K\\) must agree"),
        ((dout, y, w.half()), {}, "weight must be torch.float32 like y"),
        ((dout, y.int(), w), {}, "y must be a floating-point tensor"),
        ((dout.long(), y, w), {}, "dout must be a floating-point tensor"),
        ((dout, y, w), {"out": (torch.empty(5, 6, device=device),)}, r"out must be a pair \(dy, dweight\)"),
        ((dout, y, w), {"out": (torch.empty(4, 6, device=device), None)}, r"out\[0\] must be a torch.float32 \(5, 6\)"),
        ((dout, y, w), {"out": (None, torch.empty(4, 6, device=device).half())}, r"out\[1\] must be a torch.float32"),
        ((dout, y, w), {"out": (y, None)}, r"out\[0\] shares memory with the input y"),
        ((dout, y, w), {"pending": ()}, "pending must be a list"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            linear_residual_bwd(*args, config=cfg, **kw)
    with pytest.raises(ValueError, match="order must be one of"):
        LinearResidualBwdConfig("parallel")


def test_inputs_that_require_grad_give_plain_values(device):
    """The launcher runs untracked like every torch launcher: ``torch.mm(out=)`` raised on inputs that require
    grad, and the other path built a graph."""
    i = _inputs(7, 4, 6, device, torch.float32)
    args = (i["dout"].requires_grad_(True), i["y"].requires_grad_(True), i["weight"])
    out = (torch.empty(7, 6, device=device), torch.empty(4, 6, device=device))
    for order in ORDERS:
        got = linear_residual_bwd(*args, config=LinearResidualBwdConfig(order), out=out)
        assert all(g.grad_fn is None and not g.requires_grad for g in got)


def test_space_default_is_feasible_and_streams_are_left_out_under_the_interpreter():
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.linear_residual_bwd_torch import LINEAR_RESIDUAL_BWD_TORCH as space

    for interpret in (False, True):
        ctx = SpaceContext(GPUS["h100"], "bfloat16", 256, 256, 4096, interpret=interpret, num_heads=4)
        default = space.default(ctx)
        assert space.why_infeasible(default, ctx) is None
        orders = [c.order for c in space.prune(ctx)]
        assert orders == (["serial", "wgrad_first"] if interpret else list(ORDERS))
    ks = spec.kernel("linear_residual_bwd")
    assert ks.direction == "bwd" and ks.output_names == ("dy", "dweight")
    defaults = spec.resolve(ks.default)(256, 256, 4, torch.bfloat16, False)
    assert defaults == {"torch": LinearResidualBwdConfig("serial")}
    assert "kernel_templates/linear_residual/bwd_impl.py" in ks.backend("torch").sources


def test_cpu_tuning_run_is_saved_loaded_and_dispatched_by_the_layer(tmp_path):
    """A CPU (interpreter) tuning run of the kernel writes an artifact entry; loaded, dispatch serves it and the
    fused layer's plan runs it; a tuned entry of another order changes the layer's step."""
    from autotune.runtime import artifacts as art
    from autotune.runtime.layer import plan_layer
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions, run_tasks

    kind = "linear_residual_bwd"
    task = Task(kind, "h100", "float32", 32, 32, 2, 256, "uniform", batch=4, seq_cap=16)
    opts = TuneOptions(n_trials=3, sampler="bruteforce", artifacts_root=tmp_path, interpret=True)
    (result,) = run_tasks([task], opts, None)
    assert result.error is None, result.error
    path = art.artifact_path("h100", kind, tmp_path)
    doc = json.loads(path.read_text())
    (entry,) = doc["entries"]
    assert entry["backend"] == "torch" and entry["config"]["order"] in ("serial", "wgrad_first")
    # Another order in the entry (the CPU timings cannot tell the orders apart): dispatch and the plan follow it.
    entry["config"] = {"order": "wgrad_first"}
    path.write_text(json.dumps(doc))
    loaded = dispatch.load(tmp_path, gpu="h100", allow_same_arch=True)
    assert kind in loaded["kernels"], loaded
    choice = dispatch.select(kind, torch.float32, 32, 32, 2, 256, "uniform")
    assert choice.source == "tuned" and json.loads(choice.config) == {"order": "wgrad_first"}
    step = plan_layer(torch.float32, 2, 32, 256, 0.1, 1e-5, 0.0, distribution="uniform").step(kind)
    assert step.source == "tuned" and step.config == LinearResidualBwdConfig("wgrad_first")
    i = _inputs(9, 64, 64, "cpu", torch.float32)
    _check(step.launch(i["dout"], i["y"], i["weight"], config=step.config), i, torch.float32)
    dispatch.reset()
    default = plan_layer(torch.float32, 2, 32, 256, 0.1, 1e-5, 0.0, distribution="uniform").step(kind)
    assert default.source == "default" and default.config == LinearResidualBwdConfig("serial")


@pytest.mark.gpu
def test_side_stream_defers_the_join_and_keeps_freed_inputs_reserved():
    """On CUDA the wgrad runs on a side stream: with ``pending`` the event is handed out (not joined), and inputs
    the caller frees at once are not handed to new allocations the caller's stream overwrites while the side
    stream still reads them (record_stream); joined, dweight is right."""
    cfg = LinearResidualBwdConfig("side_stream")
    i = _inputs(8192, 1024, 1024, "cuda", torch.bfloat16, seed=3)
    pending: list = []
    dout, y = i["dout"].clone(), i["y"].clone()
    dy, dw = linear_residual_bwd(dout, y, i["weight"], config=cfg, pending=pending)
    assert len(pending) == 1 and isinstance(pending[0], torch.cuda.Event)
    del dout, y
    junk = [torch.full((8192, 1024), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    pending[0].wait()
    torch.cuda.synchronize()
    del junk
    _check((dy, dw), i, torch.bfloat16)
    joined = linear_residual_bwd(i["dout"], i["y"], i["weight"], config=cfg)  # no pending: joined on return
    torch.testing.assert_close(joined[1], dw)


@pytest.mark.gpu
def test_fused_layer_with_the_side_stream_matches_serial():
    """The layer's backward with the side-stream step (its join deferred to the end of the backward) gives the
    gradients of the serial step."""
    import dataclasses

    from autotune.runtime.layer import Step, hstu_layer, plan_layer

    plan = plan_layer(torch.bfloat16, 4, 64, 256, 0.1, 1e-5, 0.0, "default")
    side = Step("linear_residual_bwd", "torch", LinearResidualBwdConfig("side_stream"), "tuned")
    side_plan = dataclasses.replace(plan, steps=tuple(side if s.kind == side.kind else s for s in plan.steps))
    hidden, hd = 256, 256
    g = torch.Generator().manual_seed(0)
    shapes = {"ln1_w": (hidden,), "ln1_b": (hidden,), "w_uvqk": (4 * hd, hidden), "b_uvqk": (4 * hd,),
              "ln2_w": (hd,), "ln2_b": (hd,), "w_o": (hidden, hd), "b_o": (hidden,)}  # fmt: skip
    params = {k: (torch.randn(s, generator=g) * 0.1).cuda().requires_grad_(True) for k, s in shapes.items()}
    off = torch.tensor([0, 100, 356, 400], dtype=torch.int32, device="cuda")
    x = torch.randn(400, hidden, generator=g).cuda().bfloat16()
    dout = torch.randn(400, hidden, generator=g).cuda().bfloat16()
    seed = torch.zeros(1, dtype=torch.int64, device="cuda")
    grads = []
    for p in (plan, side_plan):
        out = hstu_layer(x, params, off, p, seed)
        grads.append(torch.autograd.grad(out, list(params.values()), dout))
    for name, a, b in zip(params, grads[1], grads[0], strict=True):
        if name == "w_o":  # dout^T y: the same GEMM on either stream
            assert torch.equal(a, b)
        else:  # the attention backward may sum dQ by atomics, in any order
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


def test_the_side_streams_work_is_joined_when_a_later_backward_step_raises(monkeypatch, device):
    """The layer's backward joins the output projection's side-stream work (its ``pending`` events) at its end.
    A step after the launch that raised left the events unwaited: under CUDA-graph capture that is an unjoined
    fork (capture end then fails with it, hiding the step's own error). They are now waited on the way out."""
    from autotune.runtime.layer import hstu_layer, plan_layer

    class Event:
        waits = 0

        def wait(self) -> None:
            self.waits += 1

    event, launcher = Event(), dispatch.launcher

    def spy(backend, kind):
        fn = launcher(backend, kind)

        def deferred(*args, **kw):
            result = fn(*args, **kw)
            kw["pending"].append(event)  # as the side stream hands out its event
            return result

        def fails(*args, **kw):
            raise RuntimeError("gemm_silu_bwd failed")

        return {"linear_residual_bwd": deferred, "gemm_silu_bwd": fails}.get(kind, fn)

    plan = plan_layer(torch.float32, 2, 32, 16, 0.1, 1e-5, 0.0, "default")
    g = torch.Generator().manual_seed(0)
    shapes = {"ln1_w": (64,), "ln1_b": (64,), "w_uvqk": (256, 64), "b_uvqk": (256,),
              "ln2_w": (64,), "ln2_b": (64,), "w_o": (64, 64), "b_o": (64,)}  # fmt: skip
    params = {k: (torch.randn(s, generator=g) * 0.1).to(device).requires_grad_(True) for k, s in shapes.items()}
    off = torch.tensor([0, 5, 16], dtype=torch.int64, device=device)
    x, seed = torch.randn(16, 64, generator=g).to(device), torch.zeros(1, dtype=torch.int64, device=device)
    out = hstu_layer(x, params, off, plan, seed)
    monkeypatch.setattr(dispatch, "launcher", spy)
    with pytest.raises(RuntimeError, match="gemm_silu_bwd failed"):
        out.sum().backward()
    assert event.waits == 1


@pytest.mark.gpu
def test_side_stream_hands_back_its_event_when_the_dgrad_raises(monkeypatch):
    """A dgrad that raises (say out of memory) after the wgrad was queued on the side stream still records the
    side stream's event and hands it to ``pending``: the layer's join then closes the fork."""
    from kernel_templates.linear_residual import bwd_impl

    def fail(*_args, **_kw):
        raise RuntimeError("dgrad failed")

    monkeypatch.setattr(bwd_impl, "_dgrad", fail)
    i = _inputs(256, 128, 64, "cuda", torch.bfloat16, seed=5)
    pending: list = []
    with pytest.raises(RuntimeError, match="dgrad failed"):
        linear_residual_bwd(
            i["dout"], i["y"], i["weight"], config=LinearResidualBwdConfig("side_stream"), pending=pending
        )
    assert len(pending) == 1 and isinstance(pending[0], torch.cuda.Event)
    pending[0].wait()
    torch.cuda.synchronize()
