"""Every backend of the layer's ops through the launcher its spec names (CPU, Triton under the interpreter):
the torch backends take the Triton ones' checks (they broadcast a short ``u`` or gradient, resized a wrong
``out``, took eps < 0 or p > 1 without a word), and buffers or dtypes the kernels would get wrong are named."""

from __future__ import annotations

import pytest
import torch

from autotune import spec
from autotune.runtime.layer import hstu_layer, plan_layer

pytestmark = pytest.mark.interpreter


def _launcher(kind: str, backend: str):
    return spec.resolve(spec.kernel(kind).backend(backend).launcher)


L, D = 8, 64


def _ln_inputs():
    x, w, b = torch.randn(L, D), torch.randn(D), torch.randn(D)
    y, mean, rstd = _launcher("layer_norm_fwd", "torch")(x, w, b, 1e-5)
    return x, w, b, mean, rstd


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_layer_norm_launchers_name_bad_arguments(backend):
    fwd, bwd = _launcher("layer_norm_fwd", backend), _launcher("layer_norm_bwd", backend)
    x, w, b, mean, rstd = _ln_inputs()
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        fwd(x, w, b, -1.0)
    with pytest.raises(ValueError, match="out must"):
        fwd(x, w, b, 1e-5, out=torch.empty(2, L, D))
    with pytest.raises(ValueError, match=r"residual_grad must have shape \(8, 64\)"):
        bwd(torch.randn(L, D), x, w, b, mean, rstd, residual_grad=torch.randn(D))


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_ln_mul_dropout_launchers_name_bad_arguments(backend):
    fwd, bwd = _launcher("ln_mul_dropout_fwd", backend), _launcher("ln_mul_dropout_bwd", backend)
    x, u, w, b = torch.randn(L, D), torch.randn(L, D), torch.randn(D), torch.randn(D)
    seed = torch.tensor([3], dtype=torch.int64)
    with pytest.raises(ValueError, match=r"u must have shape \(8, 64\)"):
        fwd(x, torch.randn(1, D), w, b, 1e-5, 0.1, seed)
    with pytest.raises(ValueError, match=r"dropout p must be a number in \[0, 1\)"):
        fwd(x, u, w, b, 1e-5, 1.5, seed)
    with pytest.raises(ValueError, match="seed"):
        fwd(x, u, w, b, 1e-5, 0.1, torch.tensor([1.5]))
    _, mean, rstd = fwd(x, u, w, b, 1e-5, 0.1, seed)
    shared = torch.empty(L, D)
    with pytest.raises(ValueError, match="share memory"):
        bwd(torch.randn(L, D), x, u, w, b, mean, rstd, 0.1, seed, out=(shared, shared, None, None))
    halves = torch.empty(L, 2 * D)  # two column halves of one buffer do not overlap: taken
    dx, du = halves[:, :D], halves[:, D:]
    got = bwd(torch.randn(L, D), x, u, w, b, mean, rstd, 0.1, seed, out=(dx, du, None, None))
    assert got[0].data_ptr() == dx.data_ptr() and got[1].data_ptr() == du.data_ptr() and got[2].shape == (D,)


@pytest.mark.parametrize("kind", ["layer_norm_bwd", "ln_mul_dropout_bwd"])
def test_torch_backward_takes_out_without_parameter_grads_like_triton(kind):
    """The torch backends failed on an ``out`` whose dweight and dbias are None, which the Triton launchers take
    (and the launch checks allow): both now write the row gradients there and return computed parameter grads."""
    x, w, b, mean, rstd = _ln_inputs()
    dy, dx = torch.randn(L, D), torch.empty(L, D)
    if kind == "layer_norm_bwd":
        args, out = (dy, x, w, b, mean, rstd), (dx, None, None)
    else:
        u, seed = torch.randn(L, D), torch.tensor([5], dtype=torch.int64)
        args, out = (dy, x, u, w, b, mean, rstd, 0.0, seed), (dx, torch.empty(L, D), None, None)
    from kernel_templates.layer_norm.config import default_bwd_config

    kw = {"config": default_bwd_config(D)} if kind == "layer_norm_bwd" else {}
    want = _launcher(kind, "triton")(*args, **kw)
    got = _launcher(kind, "torch")(*args, out=out)
    assert got[0] is dx
    for g, t in zip(got, want, strict=True):
        torch.testing.assert_close(g, t, rtol=1e-4, atol=1e-4)


def test_gemm_silu_torch_forward_and_the_backward_recompute_name_bad_arguments():
    fwd, bwd = _launcher("gemm_silu", "torch"), _launcher("gemm_silu_bwd", "triton")
    x, w, b = torch.randn(L, 32), torch.randn(64, 32), torch.randn(64)
    with pytest.raises(ValueError, match=r"out must be a torch.float32 \(8, 64\) tensor"):
        fwd(x, w, b, out=torch.empty(3, 3))
    with pytest.raises(ValueError, match="bias must be torch.float32 like x"):
        fwd(x, w, b.half())
    torch.testing.assert_close(fwd(x, w, b), torch.nn.functional.silu(x @ w.t() + b))
    with pytest.raises(ValueError, match="bias must be torch.float16 like x to recompute"):
        bwd(torch.randn(L, 64).half(), x.half(), w.half(), b)


def _grad_calls() -> dict:
    """{id: (kind, args, keywords)} per torch-backend launcher: inputs that require grad, ``out`` buffers."""
    x, u, w, b = (torch.randn(*s, requires_grad=True) for s in ((L, D), (L, D), (D,), (D,)))
    seed = torch.tensor([7], dtype=torch.int64)
    with torch.no_grad():
        _, mean, rstd = _launcher("layer_norm_fwd", "torch")(x, w, b, 1e-5)
        _, m2, r2 = _launcher("ln_mul_dropout_fwd", "torch")(x, u, w, b, 1e-5, 0.1, seed)
    xk, wk, bk = torch.randn(L, 32, requires_grad=True), torch.randn(D, 32, requires_grad=True), torch.randn(D)
    dy, pre = torch.randn(L, D, requires_grad=True), torch.randn(L, D)

    def rows(*shapes):
        return tuple(None if s is None else torch.empty(*s) for s in shapes)

    from kernel_templates.linear_residual.bwd_impl import LinearResidualBwdConfig
    from kernel_templates.linear_residual.impl import LinearResidualConfig

    return {
        "ln_fwd": ("layer_norm_fwd", (x, w, b, 1e-5), {"out": torch.empty(L, D)}),
        "ln_bwd": ("layer_norm_bwd", (dy, x, w, b, mean, rstd), {"out": rows((L, D), (D,), (D,))}),
        "lnmd_fwd": ("ln_mul_dropout_fwd", (x, u, w, b, 1e-5, 0.1, seed), {"out": torch.empty(L, D)}),
        "lnmd_bwd": (
            "ln_mul_dropout_bwd",
            (dy, x, u, w, b, m2, r2, 0.1, seed),
            {"out": rows((L, D), (L, D), None, None)},
        ),
        "gemm_silu": ("gemm_silu", (xk, wk, bk), {"out": torch.empty(L, D), "pre_out": torch.empty(L, D)}),
        "gemm_silu_bwd": ("gemm_silu_bwd", (dy, xk, wk, bk), {"pre": pre, "out": rows((L, 32), (D, 32), (D,))}),
        "linear_residual": (
            "linear_residual_fwd",
            (torch.randn(L, 32, requires_grad=True), wk, bk, dy),
            {"out": torch.empty(L, D), "config": LinearResidualConfig("addmm")},
        ),
        "linear_residual_bwd": (
            "linear_residual_bwd",
            (dy, torch.randn(L, 32, requires_grad=True), wk),
            {"out": rows((L, 32), (D, 32)), "config": LinearResidualBwdConfig("wgrad_first")},
        ),
    }


GRAD_CASES = [
    "ln_fwd", "ln_bwd", "lnmd_fwd", "lnmd_bwd", "gemm_silu", "gemm_silu_bwd", "linear_residual", "linear_residual_bwd",
]  # fmt: skip


def test_grad_cases_cover_every_torch_launcher_call():
    assert sorted(_grad_calls()) == sorted(GRAD_CASES)


@pytest.mark.parametrize("case", GRAD_CASES)  # built inside the test: the calls launch kernels
def test_torch_backends_with_inputs_that_require_grad_compute_values_like_the_kernels(case):
    """``torch.addmm(..., out=)`` raised on inputs that require grad, and the other torch backends built autograd
    graphs, where the kernels of the other backends compute plain values: every torch launcher now runs
    untracked, with or without ``out``, and gives what the same call on detached inputs gives."""
    kind, args, kw = _grad_calls()[case]
    names = [b.name for b in spec.kernel(kind).backends]
    launch = _launcher(kind, "torch" if "torch" in names else names[0])
    got = launch(*args, **kw)
    plain_kw = {k: v for k, v in kw.items() if k not in ("out", "pre_out")}
    plain = launch(*(a.detach() if isinstance(a, torch.Tensor) else a for a in args), **plain_kw)
    got_t, plain_t = (r if isinstance(r, tuple) else (r,) for r in (got, plain))
    assert len(got_t) == len(plain_t)
    for g, p in zip(got_t, plain_t, strict=True):
        if g is not None:
            assert g.grad_fn is None and not g.requires_grad
            torch.testing.assert_close(g, p)


def test_layer_plan_and_params_are_checked_before_any_kernel():
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        plan_layer(torch.float32, 2, 32, 32, 0.1, -1.0, 0.0, "default")
    with pytest.raises(ValueError, match=r"dropout p must be a number in \[0, 1\)"):
        plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 1.0, "default")
    plan = plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.0, "default")
    hidden, hd = 64, 64
    params = {"ln1_w": torch.ones(hidden), "ln1_b": torch.zeros(hidden), "w_uvqk": torch.randn(4 * hd, hidden),
              "b_uvqk": torch.zeros(4 * hd), "ln2_w": torch.ones(hd), "ln2_b": torch.zeros(hd),
              "w_o": torch.randn(hidden, hd), "b_o": torch.zeros(hidden)}  # fmt: skip
    x, off = torch.randn(10, hidden), torch.tensor([0, 4, 10])
    with pytest.raises(ValueError, match=r"params\['w_uvqk'\] must be a floating-point tensor"):
        hstu_layer(x, {**params, "w_uvqk": params["w_uvqk"].long()}, off, plan, torch.zeros(1, dtype=torch.int64))


@pytest.mark.parametrize("keep", ["pre+uvqk", "pre", "uvqk"])
def test_layer_runs_the_torch_projection_where_the_cute_kernel_cannot_take_the_width(keep):
    """The plan is chosen per heads x head_dim, not per hidden width; the CuTe GEMM + SiLU needs a width of a
    multiple of 8 (TMA rows), which the layer's other kernels do not. Since the layer runs that kernel in every
    keep mode (not only "uvqk"), a width of 100 failed on a GPU in the default mode: the torch composition runs
    it instead, with the same output and gradients."""
    import dataclasses

    from autotune.runtime.layer import Step
    from kernel_templates.gemm_silu.config import GemmSiluConfig

    plan = plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.0, "default", keep=keep)
    cute = Step("gemm_silu", "cute", GemmSiluConfig(), "tuned")
    cute_plan = dataclasses.replace(plan, steps=tuple(cute if s.kind == "gemm_silu" else s for s in plan.steps))
    hidden, hd = 100, 64
    g = torch.Generator().manual_seed(3)
    shapes = {"ln1_w": (hidden,), "ln1_b": (hidden,), "w_uvqk": (4 * hd, hidden), "b_uvqk": (4 * hd,),
              "ln2_w": (hd,), "ln2_b": (hd,), "w_o": (hidden, hd), "b_o": (hidden,)}  # fmt: skip
    params = {k: (torch.randn(s, generator=g) * 0.1).requires_grad_(True) for k, s in shapes.items()}
    x, off = torch.randn(10, hidden, generator=g), torch.tensor([0, 4, 10], dtype=torch.int32)
    dout, seed = torch.randn(10, hidden, generator=g), torch.zeros(1, dtype=torch.int64)
    results = []
    for p in (plan, cute_plan):
        out = hstu_layer(x, params, off, p, seed)
        results.append((out.detach(), torch.autograd.grad(out, list(params.values()), dout)))
    (want, want_grads), (got, got_grads) = results
    assert torch.equal(got, want)
    for name, a, b in zip(params, got_grads, want_grads, strict=True):
        assert torch.equal(a, b), name


def test_layer_refuses_a_bad_seed_before_any_kernel(monkeypatch):
    """The dropout seed was checked only by the LN * u + dropout launcher, after the LayerNorm, the projection and
    the attention had run; on a call with no tokens it was not checked at all."""
    from autotune.runtime import dispatch

    plan = plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.1, "default")
    hidden, hd = 64, 64
    params = {"ln1_w": torch.ones(hidden), "ln1_b": torch.zeros(hidden), "w_uvqk": torch.randn(4 * hd, hidden),
              "b_uvqk": torch.zeros(4 * hd), "ln2_w": torch.ones(hd), "ln2_b": torch.zeros(hd),
              "w_o": torch.randn(hidden, hd), "b_o": torch.zeros(hidden)}  # fmt: skip
    launched = []
    real = dispatch.launcher
    monkeypatch.setattr(dispatch, "launcher", lambda backend, kind: launched.append(kind) or real(backend, kind))
    for rows, off in ((10, torch.tensor([0, 4, 10])), (0, torch.tensor([0]))):
        x = torch.randn(rows, hidden)
        for bad in (torch.zeros(1), 3, torch.zeros(2, dtype=torch.int64), torch.tensor([True])):
            with pytest.raises(ValueError, match="seed must be"):
                hstu_layer(x, params, off, plan, bad)
    assert launched == []
    out = hstu_layer(torch.randn(10, hidden), params, torch.tensor([0, 4, 10]), plan, torch.tensor([5]))
    assert out.shape == (10, hidden) and torch.isfinite(out).all() and "ln_mul_dropout_fwd" in launched


def test_launchers_name_a_config_of_the_wrong_class():
    """A config that is not the kernel's config class (a JSON string, a dict, None where the kernel has no default)
    failed inside the launcher as an AttributeError ('str' object has no attribute 'block_rows')."""
    x, w, b, mean, rstd = _ln_inputs()
    u, seed = torch.randn(L, D), torch.tensor([1])
    w2 = torch.randn(32, D)
    calls = {
        ("layer_norm_fwd", "triton"): lambda c: _launcher("layer_norm_fwd", "triton")(x, w, b, 1e-5, config=c),
        ("layer_norm_bwd", "triton"): lambda c: _launcher("layer_norm_bwd", "triton")(x, x, w, b, mean, rstd, config=c),
        ("ln_mul_dropout_fwd", "triton"): lambda c: _launcher("ln_mul_dropout_fwd", "triton")(
            x, u, w, b, 1e-5, 0.1, seed, config=c
        ),
        ("ln_mul_dropout_bwd", "triton"): lambda c: _launcher("ln_mul_dropout_bwd", "triton")(
            x, x, u, w, b, mean, rstd, 0.1, seed, config=c
        ),
        ("gemm_silu_bwd", "triton"): lambda c: _launcher("gemm_silu_bwd", "triton")(
            torch.randn(L, 32), x, w2, None, config=c
        ),
        ("linear_residual_fwd", "torch"): lambda c: _launcher("linear_residual_fwd", "torch")(
            x, w2, None, torch.randn(L, 32), config=c
        ),
        ("linear_residual_bwd", "torch"): lambda c: _launcher("linear_residual_bwd", "torch")(
            torch.randn(L, 32), x, w2, config=c
        ),
    }
    for (kind, backend), call in calls.items():
        cls = spec.resolve(spec.kernel(kind).backend(backend).config).__name__
        bad = ['{"block_rows": 4}', {"block_rows": 4}]
        if kind.startswith(("layer_norm", "linear_residual")):  # no default config inside: None is refused too
            bad.append(None)
        for config in bad:
            with pytest.raises(ValueError, match=f"config must be a {cls}"):
                call(config)
        assert call(spec.resolve(spec.kernel(kind).backend(backend).config)()) is not None


def test_overlap_of_row_views_is_exact_without_a_byte_map(monkeypatch):
    """Column blocks of one buffer (dx and du in a d(uvqk)-like buffer) were told apart by a byte map of the whole
    buffer: an allocation of its size and a flag read back (a device sync on a GPU) per call. Row views of one
    row stride are decided by arithmetic; every answer agrees with marking the elements one by one."""
    import random

    from kernel_templates import launch_checks

    rng = random.Random(0)
    buf = torch.zeros(400)

    def view() -> torch.Tensor:
        rows, w = rng.randint(1, 6), rng.randint(1, 8)
        return buf.as_strided((rows, w), (rng.choice([1, 2, w, w + 3, 10]), 1), rng.randint(0, 100))

    def elements(t: torch.Tensor) -> set[int]:
        off, (s0, s1) = t.storage_offset(), t.stride()
        return {off + i * s0 + j * s1 for i in range(t.shape[0]) for j in range(t.shape[1])}

    for a, b in [(view(), view()) for _ in range(500)]:
        assert launch_checks._overlap(a, b) == bool(elements(a) & elements(b)), (a.stride(), b.stride())
    zeros = torch.zeros

    def no_byte_map(*args, **kwargs):
        assert kwargs.get("dtype") != torch.bool, "byte map allocated"
        return zeros(*args, **kwargs)

    monkeypatch.setattr(torch, "zeros", no_byte_map)
    x, u, w, b = torch.randn(L, D), torch.randn(L, D), torch.randn(D), torch.randn(D)
    seed = torch.tensor([1])
    mean, rstd = torch.zeros(L), torch.ones(L)
    d = torch.empty(L, 4 * D)
    bwd = _launcher("ln_mul_dropout_bwd", "triton")
    bwd(x, x, u, w, b, mean, rstd, 0.1, seed, out=(d[:, :D], d[:, D : 2 * D], None, None))
    with pytest.raises(ValueError, match=r"out\[0\] and out\[1\] must be different tensors"):
        bwd(x, x, u, w, b, mean, rstd, 0.1, seed, out=(d[:, :D], d[:, D - 1 : 2 * D - 1], None, None))


def test_an_out_view_that_addresses_an_element_twice_is_refused():
    """``out`` of strides (3, 2) over shape (3, 4) writes element 6 twice, yet spans more addresses than it has
    elements, so the span test passed it: the output projection and the torch GEMM + SiLU returned values wrong by
    ~7 without a word. Every layout is now told exactly (checked against listing each view's addresses)."""
    import itertools
    import random

    y, w, b, r = torch.randn(3, 5), torch.randn(4, 5), torch.randn(4), torch.randn(3, 4)
    calls = {
        "linear_residual_fwd": lambda out, c: _launcher("linear_residual_fwd", "torch")(y, w, b, r, config=c, out=out),
        "gemm_silu": lambda out, c: _launcher("gemm_silu", "torch")(y, w, b, config=c, out=out),
    }
    for kind, call in calls.items():
        config = spec.resolve(spec.kernel(kind).backend("torch").config)()
        with pytest.raises(ValueError, match=r"out has elements that share memory \(strides \(3, 2\)\)"):
            call(torch.zeros(100).as_strided((3, 4), (3, 2)), config)
        spread = torch.zeros(100).as_strided((3, 4), (2, 3))  # 12 distinct addresses: taken
        assert call(spread, config) is not None
    from kernel_templates.launch_checks import _writes_twice

    rng = random.Random(0)
    for _ in range(500):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 3)))
        strides = tuple(rng.randint(0, 7) for _ in shape)
        grid = itertools.product(*map(range, shape))
        offsets = [sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in grid]
        view = torch.empty(200).as_strided(shape, strides)
        assert _writes_twice(view) == (len(set(offsets)) < len(offsets)), (shape, strides)


def test_sparse_tensors_are_named_by_every_entry():
    """A sparse tensor has no strided memory: it failed inside torch or the launcher ("Sparse CSR tensors do not
    have strides", "Cannot access data pointer", "reshape is not implemented for sparse tensors"), naming no
    argument. Each entry names it."""
    from kernel_templates.fused_ln_mul_dropout import fused_ln_mul_dropout

    x, w, b, mean, rstd = _ln_inputs()
    w2, r = torch.randn(32, D), torch.randn(L, 32)
    calls = [
        ("x", lambda: _launcher("layer_norm_fwd", "triton")(x.to_sparse_csr(), w, b, 1e-5, config=None)),
        ("weight", lambda: _launcher("layer_norm_bwd", "torch")(x, x, w.to_sparse(), b, mean, rstd)),
        ("x", lambda: fused_ln_mul_dropout(x.to_sparse(), x.to_sparse(), w, b)),
        ("y", lambda: _launcher("linear_residual_fwd", "torch")(x.to_sparse(), w2, None, r, config=None)),
        ("out", lambda: _launcher("linear_residual_fwd", "torch")(x, w2, None, r, config=None, out=r.to_sparse())),
        ("pre_out", lambda: _launcher("gemm_silu", "torch")(x, w2, None, pre_out=r.to_sparse())),
        (r"out\[1\]", lambda: _launcher("gemm_silu_bwd", "torch")(r, x, w2, None, out=(x, w2.to_sparse(), None))),
    ]
    for name, call in calls:
        with pytest.raises(ValueError, match=f"{name} must be a dense \\(strided\\) tensor"):
            call()
    plan = plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.0, "default")
    params = {"ln1_w": torch.ones(D), "ln1_b": torch.zeros(D), "w_uvqk": torch.randn(256, D),
              "b_uvqk": torch.zeros(256), "ln2_w": torch.ones(64), "ln2_b": torch.zeros(64),
              "w_o": torch.randn(D, 64), "b_o": torch.zeros(D)}  # fmt: skip
    off, seed = torch.tensor([0, 3, L]), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"x must be a dense \(strided\) tensor"):
        hstu_layer(x.to_sparse(), params, off, plan, seed)
    with pytest.raises(ValueError, match=r"params\['w_o'\] must be a dense \(strided\) tensor"):
        hstu_layer(x, {**params, "w_o": params["w_o"].to_sparse()}, off, plan, seed)


def test_an_out_over_an_input_is_found_across_storages():
    """Two storages may wrap one memory (``from_numpy`` of two slices of an array): the overlap test compared
    storages first, took an ``out`` two rows into y, and ``addmm(out=)`` returned values wrong without a word.
    Byte spans decide now; tensors of no memory (meta) are not compared."""
    import numpy as np

    from kernel_templates.launch_checks import outputs_apart

    arr = np.random.default_rng(0).standard_normal((10, 8)).astype(np.float32)
    y, out = torch.from_numpy(arr[:6]), torch.from_numpy(arr[2:8])
    assert y.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
    launch = _launcher("linear_residual_fwd", "torch")
    config = spec.resolve(spec.kernel("linear_residual_fwd").backend("torch").config)("addmm")
    with pytest.raises(ValueError, match="out shares memory with the input y"):
        launch(y, torch.randn(8, 8), None, torch.randn(6, 8), config=config, out=out)
    apart = torch.from_numpy(arr[6:])
    assert launch(y[:4], torch.randn(8, 8), None, torch.randn(4, 8), config=config, out=apart) is apart
    meta = torch.empty(6, 8, device="meta")
    outputs_apart({"y": meta}, {"out": torch.empty(6, 8, device="meta")})  # no memory to share
