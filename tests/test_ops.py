"""Custom ops hstu::attention_fwd/bwd: opcheck, module vs reference, torch.compile and torch.export."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import default_bwd_config, default_fwd_config, hstu_attention_reference

FWD_CFG = json.dumps(default_fwd_config(32, 32, interpret=True).to_dict(), sort_keys=True)
BWD_CFG = json.dumps(default_bwd_config(32, 32, interpret=True).to_dict(), sort_keys=True)


def _inputs(device: str, d: int = 32, heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, 7, 20, 20, 29], device=device)
    q, k, v = (torch.randn(29, heads, d, generator=gen).to(device) for _ in range(3))
    return q, k, v, offsets


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck_fwd(device, backend):
    q, k, v, off = _inputs(device)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    nt = torch.tensor([1, 0, 0, 2], device=device)
    args = (q, k, v, off, nt, 32, 0.25, 0, 0, None, backend, FWD_CFG, backend, BWD_CFG)
    torch.library.opcheck(torch.ops.hstu.attention_fwd.default, args)


def test_opcheck_bwd(device):
    q, k, v, off = _inputs(device)
    do = torch.randn_like(v)
    args = (do, q, k, v, off, None, 32, 0.25, 0, 0, 40, "triton", BWD_CFG)
    torch.library.opcheck(torch.ops.hstu.attention_bwd.default, args)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_opcheck_bwd_on_transposed_inputs(device, backend):
    """q, k and v that are (H, L, D) tensors transposed: the backward op's gradients must have the strides of its
    fake impl. They followed q's permuted strides in the fake and not always in the op (the Triton dQ accumulator
    and the reference's dK, dV are contiguous), so a compiled backward of such views failed its stride check."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 29, 32, generator=gen).to(device).transpose(0, 1) for _ in range(3))
    off = torch.tensor([0, 7, 20, 20, 29], device=device)
    do = torch.randn(29, 2, 32, generator=gen).to(device)
    cfg = BWD_CFG if backend == "triton" else "{}"
    args = (do, q, k, v, off, None, 32, 0.25, 0, 0, None, backend, cfg)
    torch.library.opcheck(torch.ops.hstu.attention_bwd.default, args)


@pytest.mark.parametrize("source", ["default", "reference"])
def test_module_matches_reference(device, source):
    q, k, v, off = _inputs(device)
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    op_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = ops.HSTUAttention(source=source)(*op_in, off, 32)
    ref = hstu_attention_reference(*ref_in, off, 32, 1 / 32**0.5)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    do = torch.randn_like(out)
    grads = torch.autograd.grad(out, op_in, do)
    ref_grads = torch.autograd.grad(ref, ref_in, do)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("source", ["default", "reference"])
def test_backward_call_gives_the_autograd_gradients(device, source):
    """``backward_call`` (what graph-timed benchmarks capture) runs the same backward as autograd."""
    q, k, v, off = _inputs(device)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ops.hstu_attention(q, k, v, off, 32, source=source)
    do = torch.randn_like(out)
    direct = ops.backward_call(out, do)()
    for g, r in zip(direct, torch.autograd.grad(out, (q, k, v), do), strict=True):
        torch.testing.assert_close(g, r, atol=0, rtol=0)
    with pytest.raises(ValueError, match="eager hstu_attention call"):
        ops.backward_call(q * 2, do)


@pytest.mark.parametrize("dims", [(48, 48), (96, 96), (48, 64), (64, 96)])
def test_backward_call_of_a_zero_padded_head_dim(device, dims):
    """A head dim the call zero-pads (48, 96): ``backward_call`` refused the sliced output ("must be the output
    of an eager hstu_attention call"); it gives autograd's gradients, of the caller's shapes."""
    dqk, dv = dims
    gen = torch.Generator().manual_seed(2)
    off = torch.tensor([0, 7, 20, 20, 29], device=device)
    q, k = (torch.randn(29, 2, dqk, generator=gen).to(device).requires_grad_(True) for _ in range(2))
    v = torch.randn(29, 2, dv, generator=gen).to(device).requires_grad_(True)
    out = ops.hstu_attention(q, k, v, off, 32, source="default")
    do = torch.randn(out.shape, generator=gen).to(device)
    direct = ops.backward_call(out, do)()
    out.backward(do)
    for g, t in zip(direct, (q, k, v), strict=True):
        assert g.shape == t.shape
        torch.testing.assert_close(g, t.grad, atol=0, rtol=0)


@pytest.mark.parametrize("dim", [32, 48])
def test_backward_call_checks_do(device, dim):
    """The backward node trusts ``do``: a short one (rows or head dim) ran, read out of bounds, and another dtype
    failed inside the kernel. Each is a ValueError naming ``do`` when the callable is made."""
    q, k, v, off = _inputs(device, d=dim)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = ops.hstu_attention(q, k, v, off, 32, source="default")
    bad = {
        "do must be a torch.Tensor": "do",
        "do must have shape": torch.randn(20, 2, dim, device=device),
        "do must have shape ": torch.randn(29, 2, 16, device=device),
        "do must have out's dtype": torch.randn(29, 2, dim, device=device, dtype=torch.float64),
        "do must be on out's device": torch.randn(29, 2, dim, device="meta"),
    }
    for message, do in bad.items():
        with pytest.raises(ValueError, match=message):
            ops.backward_call(out, do)


def test_mixed_dtypes_rejected(device):
    q, k, v, off = _inputs(device)
    with pytest.raises(ValueError, match="share a dtype"):
        ops.hstu_attention(q, k.double(), v, off, 32)


def test_torch_compile_traces_the_op_without_graph_breaks(device):
    q, k, v, off = _inputs(device)

    def f(q, k, v, off):
        return ops.hstu_attention(q, k, v, off, 32, source="default") * 2.0

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    qc = q.clone().requires_grad_(True)
    out = compiled(qc, k, v, off)
    torch.testing.assert_close(out, f(q, k, v, off))
    out.sum().backward()
    assert qc.grad is not None and torch.isfinite(qc.grad).all()


@pytest.mark.parametrize("call", ["compiled", "op"])
def test_calls_past_the_launch_grid_through_the_custom_op(device, call, monkeypatch):
    """The custom op sizes its own launches: a compiled call (dispatch sees no offsets there) or a direct
    ``torch.ops.hstu`` call with a loose max_seq_len past CUDA's grid limit (shrunk to one block here) launches
    for the longest sequence with the divisor kept, output and gradients as the reference's, where it was a
    launch error; a sequence longer than the grid holds is a ValueError naming max_seq_len."""
    from kernel_templates.hstu_attention import input_check

    monkeypatch.setattr(input_check, "GRID_YZ_MAX", 1)
    lengths = [16, 0, 1, 9, 16, 5, 12, 16] * 5  # 375 rows; the longest sequence fits one block of every kernel
    off = torch.tensor([0, *itertools.accumulate(lengths)], device=device)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(off[-1].item(), 2, 32, generator=gen).to(device) for _ in range(3))
    loose = 1 << 16

    def attend(q, k, v, off, max_seq_len):
        args = (q, k, v, off, None, max_seq_len, 0.25, 0, 0, None)
        return torch.ops.hstu.attention_fwd(*args, "triton", FWD_CFG, "triton", BWD_CFG)

    run = (
        torch.compile(lambda *a: ops.hstu_attention(*a, source="default"), backend="aot_eager")
        if call == "compiled"
        else attend
    )
    ins = [t.clone().requires_grad_(True) for t in (q, k, v)]
    with pytest.warns(UserWarning, match="longest sequence was read from seq_offsets"):
        out = run(*ins, off, loose) if call == "op" else run(*ins, off, loose, 0.25)
        grads = torch.autograd.grad(out, ins, torch.ones_like(out))
    ref_in = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*ref_in, off, loose, 0.25)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    for g, r in zip(grads, torch.autograd.grad(ref, ref_in, torch.ones_like(ref)), strict=True):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-4)
    long = [torch.randn(300, 2, 32, device=device) for _ in range(3)]
    with pytest.raises(ValueError, match="max_seq_len: a sequence of 300 rows needs more than the 1 blocks"):
        attend(*long, torch.tensor([0, 300], device=device), 300)


def test_torch_compile_fullgraph_across_jagged_batches(device):
    """Every jagged batch has another row count: Dynamo makes it symbolic, and the call must still trace
    into one graph (dispatch gets plain ints and no fill ratio) and match the eager call."""
    f = torch.compile(lambda q, k, v, off: ops.hstu_attention(q, k, v, off, 32, source="default"),
                      backend="aot_eager", fullgraph=True)  # fmt: skip
    for rows in (29, 30, 33):
        gen = torch.Generator().manual_seed(rows)
        q, k, v = (torch.randn(rows, 2, 32, generator=gen).to(device) for _ in range(3))
        off = torch.tensor([0, 7, 20, rows], device=device)
        torch.testing.assert_close(f(q, k, v, off), ops.hstu_attention(q, k, v, off, 32, source="default"))


@pytest.mark.parametrize("targets", [False, True])
def test_torch_compile_dynamic_traces_one_graph(device, targets):
    """``torch.compile(dynamic=True)`` makes every dim and int argument symbolic: dispatch must still get plain
    ints (each specialised by a guard) and the call trace into one graph matching the eager call; it failed
    in ``_choose`` (``assume_constant_result`` cannot take a SymInt)."""

    def f(q, k, v, off, max_seq_len, nt):
        return ops.hstu_attention(q, k, v, off, max_seq_len, num_targets=nt, contextual_seq_len=1, source="default")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows, d, max_seq_len in ((29, 32, 32), (33, 32, 40), (29, 64, 32)):
        gen = torch.Generator().manual_seed(rows)
        q, k, v = (torch.randn(rows, 2, d, generator=gen).to(device).requires_grad_(True) for _ in range(3))
        off = torch.tensor([0, 7, 20, rows], device=device)
        nt = torch.tensor([1, 0, 2], device=device) if targets else None
        out = compiled(q, k, v, off, max_seq_len, nt)
        want = f(q, k, v, off, max_seq_len, nt)
        torch.testing.assert_close(out, want)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        for g, r in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True):
            torch.testing.assert_close(g, r)


@pytest.mark.parametrize("d", [32, 48])
def test_torch_compile_dynamic_with_alpha_and_padded_head_dims(device, d):
    """``torch.compile(fullgraph=True, dynamic=True)`` makes a float alpha (and a padded head dim's default
    alpha, 1/sqrt(Dqk)) a SymFloat: the finiteness check failed to trace it (``math.isfinite``), and a padded
    call whose inputs require grad failed on reading the output's ``grad_fn``. Both now trace into one graph
    whose outputs and gradients match the eager call's, for every alpha."""

    def f(q, k, v, off, alpha):
        return ops.hstu_attention(q, k, v, off, 32, alpha, source="default")

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    gen = torch.Generator().manual_seed(d)
    off = torch.tensor([0, 7, 20, 20, 29], device=device)
    for alpha in (None, 0.25, 0.5):
        q, k, v = (torch.randn(29, 2, d, generator=gen).to(device).requires_grad_(True) for _ in range(3))
        out, want = compiled(q, k, v, off, alpha), f(q, k, v, off, alpha)
        torch.testing.assert_close(out, want)
        grads, wants = (torch.autograd.grad(o.sum(), (q, k, v)) for o in (out, want))
        for g, r in zip(grads, wants, strict=True):
            torch.testing.assert_close(g, r)


def test_torch_export_sees_the_op(device):
    q, k, v, off = _inputs(device)

    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = ops.HSTUAttention(source="default")

        def forward(self, q, k, v, off):
            return self.attn(q, k, v, off, 32)

    ep = torch.export.export(M(), (q, k, v, off))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "hstu.attention_fwd.default" in targets
    torch.testing.assert_close(ep.module()(q, k, v, off), M()(q, k, v, off))


def test_backend_table_is_extensible_and_cute_stays_unimported(device):
    import dataclasses
    import sys

    from autotune import spec

    # A new backend is one more entry in the op's spec: here the Triton launcher under another name.
    op = spec.op_of("hstu_attention_fwd")
    fwd = spec.kernel("hstu_attention_fwd")
    alias = dataclasses.replace(fwd.backend("triton"), name="triton_alias")
    kernels = tuple(dataclasses.replace(k, backends=(*k.backends, alias)) if k is fwd else k for k in op.kernels)
    spec.register(dataclasses.replace(op, kernels=kernels))
    try:
        q, k, v, off = _inputs(device)
        out = torch.ops.hstu.attention_fwd(q, k, v, off, None, 32, 0.25, 0, 0, None, "triton_alias", FWD_CFG, "", "")
        torch.testing.assert_close(out, hstu_attention_reference(q, k, v, off, 32, 0.25), atol=1e-5, rtol=1e-4)
    finally:
        spec.unregister(op.name)
    assert "triton_alias" not in [b.name for b in spec.kernel("hstu_attention_fwd").backends]
    # Nothing chose "cute", so the CuTe DSL is never imported: checked in a fresh interpreter, since other
    # tests in this pytest run (the CuTe compile tests) import it on purpose.
    code = (
        "import sys, torch, autotune.runtime.ops as o; from autotune.runtime import dispatch; "
        "dispatch.select('hstu_attention_fwd', torch.bfloat16, 64, 64, 2, 512); "
        "print('cutlass' in sys.modules)"
    )
    import subprocess

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().endswith("False")
    # The CuTe backend provides both directions (or neither, without CUDA / cutlass).
    assert dispatch.backend_available("cute", "hstu_attention_bwd") == dispatch.backend_available(
        "cute", "hstu_attention_fwd"
    )


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("d", [128, 256])
def test_cute_fwd_and_bwd_through_the_custom_op_on_uvqk_slices(d):
    """The model's path: q/k/v are column slices of one uvqk buffer; dispatch chose CuTe both ways."""
    pytest.importorskip("cutlass")
    from kernel_templates.cute import default_cute_bwd_config, default_cute_fwd_config
    from kernel_templates.hstu_attention.testing import check_tolerance

    h, lengths = 2, [0, 1, 70, 129, 300, 64]
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    L = int(offsets[-1])
    uvqk = torch.randn(L, 4 * h * d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    _, v, q, k = (t.view(L, h, d) for t in torch.split(uvqk, h * d, dim=1))
    fwd_cfg = json.dumps(default_cute_fwd_config(d, d).to_dict(), sort_keys=True)
    bwd_cfg = json.dumps(default_cute_bwd_config(d, d).to_dict(), sort_keys=True)
    args = (offsets, None, max(lengths), d**-0.5, 0, 0, None)
    out = ops.attention_fwd(q, k, v, *args, "cute", fwd_cfg, "cute", bwd_cfg)
    do = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, uvqk, do)
    ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    low_in = [t.detach().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*ref_in, offsets, max(lengths), d**-0.5)
    low = hstu_attention_reference(*low_in, offsets, max(lengths), d**-0.5, compute_dtype=torch.bfloat16)
    ref_g = torch.autograd.grad(ref, ref_in, do.float())
    low_g = torch.autograd.grad(low, low_in, do)
    _, gv, gq, gk = (g.view(L, h, d) for g in torch.split(grad, h * d, dim=1))  # slices of the uvqk gradient
    for name, g, i in (("dq", gq, 0), ("dk", gk, 1), ("dv", gv, 2)):
        check_tolerance(name, g, ref_g[i], low_g[i])


@pytest.mark.parametrize(
    ("kwargs", "mask"),
    [
        ({}, "causal"),
        ({"num_targets": "nt"}, "targets"),
        ({"contextual_seq_len": 2}, "context"),
        ({"contextual_seq_len": 2, "num_targets": "nt"}, "context+targets"),
        ({"max_attn_len": 4}, "window"),
    ],
)
def test_drop_in_call_dispatches_on_its_heads_and_mask(monkeypatch, kwargs, mask):
    """The public call asks dispatch for its own head count and mask features (entries are keyed by both)."""
    q, k, v, off = _inputs("cpu", heads=2)
    asked = []
    real = dispatch.select

    def spy(kind, dtype, dqk, dv, heads, max_seq_len, distribution=None, source="tuned", m="causal", fill=None):
        asked.append((kind, heads, m))
        assert fill == q.shape[0] / ((off.numel() - 1) * 13)  # the batch's fill ratio, from shapes alone
        return real(kind, dtype, dqk, dv, heads, max_seq_len, distribution, source, m, fill)

    monkeypatch.setattr(dispatch, "select", spy)
    if kwargs.get("num_targets") == "nt":
        kwargs = {**kwargs, "num_targets": torch.tensor([1, 0, 0, 2])}
    ops.hstu_attention(q, k, v, off, 13, source="reference", **kwargs)
    assert asked == [("hstu_attention_fwd", 2, mask), ("hstu_attention_bwd", 2, mask)]


def test_short_name_is_the_runtime_module():
    """``autotune.ops.hstu_attention`` (the name the issues and users write) is the runtime call itself."""
    import autotune.ops
    from autotune.ops import HSTUAttention, hstu_attention
    from autotune.runtime import ops as runtime_ops

    assert autotune.ops is runtime_ops
    assert hstu_attention is runtime_ops.hstu_attention and HSTUAttention is runtime_ops.HSTUAttention


def test_cpu_tensors_on_a_gpu_host_are_a_clear_error_naming_the_inputs(monkeypatch):
    """On a GPU host without the interpreter, CPU tensors reached the Triton launch, which failed naming no
    argument ("Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)"). The call now says where the
    inputs are and what runs them; the reference source still takes them."""
    fwd, bwd = (json.dumps(f(32, 32, interpret=True).to_dict()) for f in (default_fwd_config, default_bwd_config))
    choose = ops._choose
    monkeypatch.setattr(ops, "_choose", lambda *a, **kw: ("triton", fwd, "triton", bwd))  # no GPU to fit them to
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "cuda_present", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q, k, v = (torch.randn(5, 2, 32) for _ in range(3))
    off = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match=r"q, k, v and seq_offsets are on cpu: the kernels need them on a CUDA"):
        ops.hstu_attention(q, k, v, off, 3)
    with pytest.raises(ValueError, match="are on cpu"):
        ops.attention_fwd(q, k, v, off, None, 3, 0.2, 0, 0, None, "triton", fwd, "triton", bwd)
    monkeypatch.setattr(ops, "_choose", choose)
    out = ops.hstu_attention(q, k, v, off, 3, source="reference")
    assert out.shape == (5, 2, 32) and torch.isfinite(out).all()
