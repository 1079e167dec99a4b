"""Edges of the public attention call: a context longer than its sequence, double backward, inference mode,
the custom op called directly, and arguments of the wrong type. fp32 on CPU (interpreter), bf16 on a GPU."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention import hstu_attention, hstu_attention_reference
from kernel_templates.hstu_attention.testing import offsets_from_lengths
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _qkv(device: str, rows: int, heads: int = 2, d: int = 32, seed: int = 0, grad: bool = True):
    gen = torch.Generator().manual_seed(seed)
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    return [torch.randn(rows, heads, d, generator=gen).to(device, dt).requires_grad_(grad) for _ in range(3)]


class _TritonLaunchers(torch.autograd.Function):
    """The Triton forward and backward launchers with their default configs and ``num_targets=None``."""

    @staticmethod
    def forward(ctx, q, k, v, off, alpha, context):
        from kernel_templates.hstu_attention.config import default_fwd_config

        ctx.save_for_backward(q, k, v, off)
        ctx.args = (alpha, context)
        cfg = default_fwd_config(q.shape[2], v.shape[2], q.device.type == "cpu", q.dtype)
        return hstu_attention_fwd(q, k, v, off, 90, alpha, None, context, 0, None, cfg)

    @staticmethod
    def backward(ctx, do):
        from kernel_templates.hstu_attention.config import default_bwd_config

        q, k, v, off = ctx.saved_tensors
        alpha, context = ctx.args
        cfg = default_bwd_config(q.shape[2], v.shape[2], q.device.type == "cpu", q.dtype)
        dq, dk, dv = hstu_attention_bwd(do.contiguous(), q, k, v, off, 90, alpha, None, context, 0, None, cfg)
        return dq.to(q.dtype), dk, dv, None, None, None


@pytest.mark.parametrize("call", ["public", "template", "triton-launchers"])
def test_context_longer_than_the_sequence_without_targets(device, call):
    """HSTU.md: a sequence no longer than its context has only the diagonal valid; the kernels must agree
    with the reference there as well as on the long sequence beside it (forward and every gradient)."""
    lengths, ctx = [70, 40, 3, 0, 90], 41
    off = offsets_from_lengths(lengths, device)
    q, k, v = _qkv(device, sum(lengths))
    alpha = 1.0 / math.sqrt(32)
    if call == "public":
        out = ops.hstu_attention(q, k, v, off, 90, alpha, None, ctx, source="default")
    elif call == "template":
        out = hstu_attention(q, k, v, off, 90, alpha, None, ctx)
    else:  # the Triton kernels themselves, without targets (no call-level zero targets in front of them)
        out = _TritonLaunchers.apply(q, k, v, off, alpha, ctx)
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = hstu_attention_reference(q32, k32, v32, off, 90, alpha, None, ctx)
    tol = 3e-2 if device == "cuda" else 1e-4
    scale = ref.abs().max().item()
    assert (out.float() - ref).abs().max().item() <= tol * scale
    go = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    refs = torch.autograd.grad(ref, (q32, k32, v32), go)
    for name, g, r in zip("qkv", grads, refs, strict=True):
        err = (g.float() - r).abs().max().item()
        assert err <= tol * r.abs().max().item() + 1e-6, f"d{name}: {err}"


def test_a_gradient_of_the_kernels_gradient_raises_instead_of_dropping_terms(device):
    off = offsets_from_lengths([7, 13], device)
    q, k, v = _qkv(device, 20)
    gq = torch.autograd.grad(ops.hstu_attention(q, k, v, off, 32, source="default").float().pow(2).sum(), q,
                             create_graph=True)[0]  # fmt: skip
    with pytest.raises(RuntimeError, match="not differentiable"):
        torch.autograd.grad((gq.float() * q.float()).sum(), q)
    # create_graph=True without differentiating the attention gradients is fine
    gq = torch.autograd.grad(ops.hstu_attention(q, k, v, off, 32, source="default").sum(), q, create_graph=True)[0]
    assert gq.shape == q.shape


def test_reference_source_keeps_its_double_backward():
    off = offsets_from_lengths([7, 13], "cpu")
    q, k, v = _qkv("cpu", 20)
    gq = torch.autograd.grad(ops.hstu_attention(q, k, v, off, 32, source="reference").pow(2).sum(), q,
                             create_graph=True)[0]  # fmt: skip
    g2 = torch.autograd.grad((gq * q).sum(), q)[0]
    assert (g2 - gq).abs().max() > 1e-6  # the second-order term is there


@pytest.mark.parametrize("lengths", [[], [0, 0]])
def test_reference_backward_of_an_empty_batch(lengths):
    """An empty batch may have ``max_seq_len`` 0 (the other sources' backward runs it): the reference backward
    divided by it up front, a ``ZeroDivisionError``, through autograd and through ``hstu::attention_bwd``.
    Its gradients are now empty, of q, k and v's shapes."""
    off = offsets_from_lengths(lengths, "cpu")
    q, k, v = _qkv("cpu", 0)
    out = ops.hstu_attention(q, k, v, off, 0, source="reference")
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    direct = torch.ops.hstu.attention_bwd(out.detach(), q, k, v, off, None, 0, 0.25, 0, 0, None, "reference", "{}")
    for g, t in zip((*grads, *direct), (q, k, v) * 2, strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype


def test_forward_mode_ad_raises_unless_the_reference_runs(device):
    """The kernels have no jvp: dual inputs that need no grad ran them on the primals and returned no tangent (a
    silent zero derivative). They must raise; the reference source's jvp is the reference's own."""
    import torch.autograd.forward_ad as fwad

    off = offsets_from_lengths([4, 6], device)
    q, k, v = _qkv(device, 10, grad=False)
    dt = torch.randn_like(q)
    with fwad.dual_level():
        for source in ("default", "tuned"):
            with pytest.raises(NotImplementedError, match="forward-mode AD"):
                ops.hstu_attention(fwad.make_dual(q, dt), k, v, off, 8, source=source)
            with pytest.raises(NotImplementedError, match="forward-mode AD"):  # a padded head dim too
                ops.hstu_attention(q[..., :16], k[..., :16], fwad.make_dual(v, dt), off, 8, source=source)
        got = fwad.unpack_dual(ops.hstu_attention(fwad.make_dual(q, dt), k, v, off, 8, source="reference"))
        ref = fwad.unpack_dual(hstu_attention_reference(fwad.make_dual(q, dt), k, v, off, 8, 1 / math.sqrt(32)))
    torch.testing.assert_close(got.tangent, ref.tangent)


def test_torch_func_grad_is_a_named_error_and_vmap_still_runs(device):
    """torch.func.grad failed inside PyTorch's custom-op autograd with an error naming neither hstu_attention
    nor a way out; it is now a NotImplementedError that says to use torch.autograd.grad. vmap (no grad) runs."""
    off = offsets_from_lengths([4, 6], device)
    q, k, v = _qkv(device, 10, grad=False)
    for source in ("default", "reference"):
        with pytest.raises(NotImplementedError, match=r"hstu_attention: torch.func.grad.*torch.autograd.grad"):
            torch.func.grad(lambda t, s=source: ops.hstu_attention(t, k, v, off, 8, source=s).float().sum())(q)
        out = torch.func.vmap(lambda t, s=source: ops.hstu_attention(t, k, v, off, 8, source=s))(
            torch.stack([q, 2 * q])
        )
        torch.testing.assert_close(out[1], ops.hstu_attention(2 * q, k, v, off, 8, source=source))


def test_inference_mode_call_with_async_validation(device):
    with torch.inference_mode():
        off = offsets_from_lengths([4, 6], device)
        q, k, v = _qkv(device, 10, grad=False)
        for _ in range(2):
            out = ops.hstu_attention(q, k, v, off, 8, source="default")
    ref = hstu_attention_reference(q.float(), k.float(), v.float(), off, 8, 1 / math.sqrt(32))
    assert (out.float() - ref).abs().max() <= (3e-2 if device == "cuda" else 1e-4) * ref.abs().max()


def test_inference_mode_call_with_targets_and_async_validation(device):
    """Targets made under inference mode have no version counter: the "async" check of a call with them (the
    default mode) must still run, every call, instead of failing on the counter the offsets-check cache reads."""
    with torch.inference_mode():
        off = offsets_from_lengths([4, 6], device)
        nt = torch.tensor([1, 2], device=device)
        q, k, v = _qkv(device, 10, grad=False)
        for _ in range(2):
            out = ops.hstu_attention(q, k, v, off, 8, num_targets=nt, contextual_seq_len=1, source="default")
        bad = torch.tensor([1, 7], device=device)  # 7 targets in a sequence of 6: still reported
        if device == "cpu":
            with pytest.raises(ValueError, match=r"num_targets\[1\] = 7"):
                ops.hstu_attention(q, k, v, off, 8, num_targets=bad, source="default")
    ref = hstu_attention_reference(q.float(), k.float(), v.float(), off, 8, 1 / math.sqrt(32), nt, 1)
    assert (out.float() - ref).abs().max() <= (3e-2 if device == "cuda" else 1e-4) * ref.abs().max()


def test_custom_op_checks_its_inputs_unless_told_not_to(device):
    fb, fc, bb, bc = ops._choose(torch.float32, 32, 32, 2, 32, None, "default", "causal", None)
    off = offsets_from_lengths([7, 13, 0, 9], device)
    q, k, v = (t.detach() for t in _qkv(device, 29))
    with pytest.raises(ValueError, match="k must have q's shape"):
        torch.ops.hstu.attention_fwd(q, k[:20], v, off, None, 32, 0.2, 0, 0, None, fb, fc, bb, bc, "full")
    with pytest.raises(ValueError, match=r"num_targets must have shape \(4,\)"):
        nt = torch.tensor([1], device=device)
        torch.ops.hstu.attention_fwd(q, k, v, off, nt, 32, 0.2, 0, 0, None, fb, fc, bb, bc, "full")


@pytest.mark.parametrize("alpha", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ["default", "reference"])
def test_custom_ops_called_directly_refuse_a_non_finite_alpha(device, alpha, backend):
    """The public call refuses a NaN or infinite alpha; the custom ops called directly (as a trace runs them) must
    too, unless told not to check, instead of returning NaN outputs and gradients."""
    dt = torch.bfloat16 if device == "cuda" else torch.float32
    fb, fc, bb, bc = ops._choose(dt, 32, 32, 2, 32, None, backend, "causal", None)
    off = offsets_from_lengths([7, 13, 0, 9], device)
    q, k, v = (t.detach() for t in _qkv(device, 29))
    for mode in ("async", "full"):
        with pytest.raises(ValueError, match="alpha must be finite"):
            torch.ops.hstu.attention_fwd(q, k, v, off, None, 32, alpha, 0, 0, None, fb, fc, bb, bc, mode)
        with pytest.raises(ValueError, match="alpha must be finite"):
            torch.ops.hstu.attention_bwd(torch.ones_like(v), q, k, v, off, None, 32, alpha, 0, 0, None, bb, bc, mode)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_offsets": [0, 4, 10]}, "seq_offsets must be a 1-D tensor"),
        ({"num_targets": [1, 2]}, "num_targets must be a 1-D int tensor or None"),
        ({"q": "q"}, "q must be a torch.Tensor"),
        ({"alpha": "x"}, "alpha must be a number"),
        ({"alpha": torch.tensor([0.1, 0.2])}, "alpha must be a number or a one-element real tensor"),
        ({"alpha": torch.tensor(0.2, requires_grad=True)}, "alpha must not require grad"),
        ({"max_seq_len": True}, r"max_seq_len must be an int in \[0, 2\*\*31\)"),
        ({"max_seq_len": 2**40}, r"max_seq_len must be an int in \[0, 2\*\*31\)"),
        ({"contextual_seq_len": True}, "contextual_seq_len must be a non-negative int"),
        ({"contextual_seq_len": 2**31}, "contextual_seq_len must be a non-negative int below 2"),
        ({"max_attn_len": 2**31}, "max_attn_len must be a non-negative int below 2"),
        ({"scaling_seqlen": 2**31}, "scaling_seqlen must be a positive int below 2"),
        ({"distribution": "Jagged"}, "distribution must be None or one of"),
    ],
)
def test_wrong_argument_types_name_the_argument(kwargs, match):
    q, k, v = (t.detach() for t in _qkv("cpu", 10))
    args = {"q": q, "k": k, "v": v, "seq_offsets": torch.tensor([0, 4, 10]), "max_seq_len": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        ops.hstu_attention(**args, source="default")


@pytest.mark.parametrize("call", ["public", "template", "cute"])
def test_every_entry_point_refuses_a_bad_alpha(call):
    """The kernels take alpha as a constant: every entry point refuses what they would misread (a tensor that
    requires grad gets no gradient; inf or NaN make every output NaN), with a ValueError naming alpha."""
    from kernel_templates.cute import hstu_attention_cute

    q, k, v = (t.detach() for t in _qkv("cpu", 10))
    off = torch.tensor([0, 4, 10])
    fn = {"public": ops.hstu_attention, "template": hstu_attention, "cute": hstu_attention_cute}[call]
    bad = ("x", 1j, True, torch.tensor([0.1, 0.2]), torch.tensor(0.2, requires_grad=True), math.inf, math.nan,
           torch.tensor(math.inf))  # fmt: skip
    for alpha in bad:
        with pytest.raises(ValueError, match="alpha must"):
            fn(q, k, v, off, 8, alpha)


def test_alpha_may_be_a_numpy_or_tensor_scalar(device):
    import numpy as np

    q, k, v = (t.detach() for t in _qkv(device, 10))
    off = torch.tensor([0, 4, 10], device=device)
    want = ops.hstu_attention(q, k, v, off, 8, 0.25, source="default")
    scalars = (torch.tensor(0.25), torch.tensor([0.25]), torch.tensor(0.25, device=device))
    for alpha in (np.float32(0.25), np.float64(0.25), *scalars):
        torch.testing.assert_close(ops.hstu_attention(q, k, v, off, 8, alpha, source="default"), want)


def test_gradients_built_with_create_graph_can_be_updated_in_place(device):
    off = offsets_from_lengths([7, 13], device)
    q, k, v = _qkv(device, 20)
    out = ops.hstu_attention(q, k, v, off, 32, source="default")
    (dq,) = torch.autograd.grad(out, q, torch.ones_like(out), create_graph=True)
    dq.mul_(2)  # a plain tensor, not a view of the first-order guard's output
    assert dq.grad_fn is not None


@pytest.mark.interpreter
@pytest.mark.parametrize("call", ["public", "template"])
def test_bf16_on_the_cpu_interpreter_is_right(call):
    """The Triton interpreter's bf16 dot is wrong, so a bf16 call on CPU tensors computes in fp32 and rounds to
    bf16: forward and every gradient within the bf16 tolerance of the fp32 reference (the reference run in bf16
    gives PyTorch's own error), on lengths with an empty, a length-1 and a non-tile-multiple sequence."""
    from kernel_templates.tolerance import error_bound

    lengths = [37, 0, 1, 50]
    off = offsets_from_lengths(lengths, "cpu")
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(sum(lengths), 2, 32, generator=gen, dtype=torch.bfloat16).requires_grad_() for _ in "qkv")
    alpha = 1.0 / math.sqrt(32)
    fn = ops.hstu_attention if call == "public" else hstu_attention
    out = fn(q, k, v, off, 50, alpha, None, 5)
    assert out.dtype == torch.bfloat16
    q32, k32, v32 = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = hstu_attention_reference(q32, k32, v32, off, 50, alpha, None, 5)
    qb, kb, vb = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    ref_bf16 = hstu_attention_reference(qb, kb, vb, off, 50, alpha, None, 5)
    go = torch.randn(ref.shape, generator=gen)
    got = (out, *torch.autograd.grad(out, (q, k, v), go.bfloat16()))
    refs = (ref, *torch.autograd.grad(ref, (q32, k32, v32), go))
    torch_bf16 = (ref_bf16, *torch.autograd.grad(ref_bf16, (qb, kb, vb), go.bfloat16()))
    for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, refs, torch_bf16, strict=True):
        err = (g.float() - r).abs().max().item()
        bound = error_bound((t.float() - r).abs().max().item(), torch.bfloat16, r)
        assert err <= bound, f"{name}: error {err} > {bound}"


@pytest.mark.parametrize(("max_seq_len", "scaling"), [(1 << 24, 64), ((1 << 31) - 1, None)])
@pytest.mark.parametrize("call", ["default", "tuned", "template"])
def test_a_loose_max_seq_len_gives_the_reference_result(device, call, max_seq_len, scaling):
    """max_seq_len only bounds the lengths (and is the default divisor): a bound far above every length (2**24,
    2**31 - 1) gives the reference's output and gradients, where it used to size the launch grids past CUDA's
    limits (a launch error from both backends). On a GPU, "tuned" reads the shipped artifacts (CuTe kernels)."""

    if call == "tuned" and device == "cuda":
        dispatch.load()
    lengths = [70, 0, 1, 33]
    off = offsets_from_lengths(lengths, device)
    q, k, v = _qkv(device, sum(lengths), heads=2, d=128 if device == "cuda" else 32)
    alpha = 1.0 / math.sqrt(q.shape[2])
    if call == "template":
        out = hstu_attention(q, k, v, off, max_seq_len, alpha, scaling_seqlen=scaling)
    else:
        out = ops.hstu_attention(q, k, v, off, max_seq_len, alpha, scaling_seqlen=scaling, source=call)
    _check_against_reference(out, q, k, v, off, max_seq_len, alpha, scaling)


def _check_against_reference(out, q, k, v, off, max_seq_len: int, alpha: float, scaling: int | None = None) -> None:
    """``out`` and its gradients against the fp32 reference, under the tolerance rule (the reference in q's dtype
    gives PyTorch's own error)."""
    from kernel_templates.hstu_attention.testing import check_tolerance

    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.device)
    got = (out, *torch.autograd.grad(out, (q, k, v), go.to(out.dtype)))
    ref_in = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    same = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    ref = hstu_attention_reference(*ref_in, off, max_seq_len, alpha, scaling_seqlen=scaling)
    own = hstu_attention_reference(*same, off, max_seq_len, alpha, scaling_seqlen=scaling, compute_dtype=q.dtype)
    refs = (ref, *torch.autograd.grad(ref, ref_in, go))
    owns = (own, *torch.autograd.grad(own, same, go.to(own.dtype)))
    assert ref.abs().max() > 0
    for name, g, r, t in zip(("out", "dq", "dk", "dv"), got, refs, owns, strict=True):
        check_tolerance(name, g, r, t)


def test_fit_grid_reads_the_longest_sequence_only_past_the_grid(monkeypatch):
    """A launch whose row blocks fit the grid keeps its arguments (no read of the offsets); past the limit, the
    longest sequence is read and launched for with the divisor kept; a sequence longer than the grid holds is a
    ValueError naming max_seq_len."""
    from kernel_templates.hstu_attention import input_check
    from kernel_templates.hstu_attention.testing import offsets_from_lengths

    off = offsets_from_lengths([20, 0, 1, 13], "cpu")
    assert input_check.fit_grid(1 << 20, None, off, 34, (16, 32)) == (1 << 20, None)  # 34 rows: 3 blocks
    monkeypatch.setattr(input_check, "GRID_YZ_MAX", 2)  # 32 rows of 16-row blocks
    assert input_check.fit_grid(32, None, off, 34, (16, None)) == (32, None)
    assert input_check.fit_grid(1 << 20, None, off, 34, (None, None)) == (1 << 20, None)
    with pytest.warns(UserWarning, match="longest sequence was read from seq_offsets"):
        assert input_check.fit_grid(1 << 20, None, off, 34, (16, 32)) == (20, 1 << 20)
        assert input_check.fit_grid(1 << 20, 64, off, 34, (16, 32)) == (20, 64)
    assert input_check.fit_grid(1 << 20, None, offsets_from_lengths([0, 0], "cpu"), 0, (16,)) == (1 << 20, None)
    with pytest.raises(ValueError, match="max_seq_len is below the longest sequence: max_seq_len=33, a sequence of 40"):
        input_check.fit_grid(33, None, offsets_from_lengths([40], "cpu"), 40, (16, 64))
    with pytest.raises(ValueError, match="max_seq_len: a sequence of 40 rows needs more than the 2 blocks of 16"):
        input_check.fit_grid(40, None, offsets_from_lengths([40], "cpu"), 40, (16, 64))


@pytest.mark.parametrize("call", ["default", "template"])
def test_a_launch_past_the_grid_limit_gives_the_reference_result(device, call, monkeypatch):
    """With CUDA's 65535-block grid limit shrunk to one block, a loose max_seq_len over a whole batch's rows
    launches for the longest sequence instead (read from the offsets, warned) and still gives the reference's
    output and gradients; one sequence longer than the grid holds is a ValueError naming max_seq_len, not a
    launch error. Every kernel's block covers at least 16 rows and at most 256."""
    from kernel_templates.hstu_attention import input_check

    monkeypatch.setattr(input_check, "GRID_YZ_MAX", 1)
    lengths = [16, 0, 1, 9, 16, 5, 12, 16] * 5
    off = offsets_from_lengths(lengths, device)
    q, k, v = _qkv(device, sum(lengths), heads=2, d=64 if device == "cuda" else 32)
    alpha = 1.0 / math.sqrt(q.shape[2])

    def attend(q, k, v, off, max_seq_len):
        if call == "template":
            return hstu_attention(q, k, v, off, max_seq_len, alpha)
        return ops.hstu_attention(q, k, v, off, max_seq_len, alpha, source=call)

    with pytest.warns(UserWarning, match="longest sequence was read from seq_offsets"):
        out = attend(q, k, v, off, 1 << 20)
    _check_against_reference(out, q, k, v, off, 1 << 20, alpha)
    long_q, long_k, long_v = _qkv(device, 300, heads=2, d=q.shape[2])
    with pytest.raises(ValueError, match="max_seq_len: a sequence of 300 rows needs more than the 1 blocks"):
        attend(long_q, long_k, long_v, offsets_from_lengths([300], device), 300)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", ["wide-batch", "loose-over-the-grid"])
def test_the_grid_limits_for_real_on_an_sm90_gpu(case):
    """The launches CUDA's 65535-block y/z grid dimensions used to refuse, run for real through the public call on
    the shipped artifacts: a batch of 70000 sequences (more than a grid's y holds), and a loose max_seq_len over
    16.9M rows (more than 65535 blocks of any kernel's 256 rows). Sequences at both ends of the batch are checked,
    output and every gradient, against the fp32 reference (sequences are independent, so their rows' values
    depend on nothing else)."""
    from kernel_templates.hstu_attention.testing import check_tolerance

    dispatch.load()
    gen = torch.Generator().manual_seed(5)
    if case == "wide-batch":
        lengths = torch.randint(0, 5, (70_000,), generator=gen).tolist()
        lengths[1] = 4  # the longest, for max_seq_len
        heads, max_seq_len, scaling = 2, 4, None
    else:
        lengths, heads = [512] * 33_000, 1
        max_seq_len, scaling = sum(lengths), 512  # loose: over 65535 x 256 rows; values of order one
    off = offsets_from_lengths(lengths, "cuda")
    rows = sum(lengths)
    q, k, v = (
        (torch.randn(rows, heads, 64, generator=gen) * 0.5).to("cuda", torch.bfloat16).requires_grad_(True)
        for _ in range(3)
    )
    alpha = 0.125
    out = ops.hstu_attention(q, k, v, off, max_seq_len, alpha, scaling_seqlen=scaling)
    go = torch.randn(out.shape, generator=gen).to("cuda")
    grads = torch.autograd.grad(out, (q, k, v), go.to(out.dtype))
    assert all(torch.isfinite(t).all() for t in (out, *grads))
    for first, last in ((0, 40), (len(lengths) - 40, len(lengths))):
        r0, r1 = off[first].item(), off[last].item()
        sub_off = off[first : last + 1] - r0
        ins = [t.detach()[r0:r1].float().requires_grad_(True) for t in (q, k, v)]
        same = [t.detach()[r0:r1].clone().requires_grad_(True) for t in (q, k, v)]
        args = (sub_off, max_seq_len, alpha)
        ref = hstu_attention_reference(*ins, *args, scaling_seqlen=scaling)
        own = hstu_attention_reference(*same, *args, scaling_seqlen=scaling, compute_dtype=q.dtype)
        g = go[r0:r1]
        refs = (ref, *torch.autograd.grad(ref, ins, g))
        owns = (own, *torch.autograd.grad(own, same, g.bfloat16()))
        for name, got, r, t in zip(("out", "dq", "dk", "dv"), (out, *grads), refs, owns, strict=True):
            check_tolerance(f"{case} {name} rows {r0}:{r1}", got[r0:r1], r, t)


def test_the_cute_entry_names_a_grid_order_config_over_65535_sequences():
    """The CuTe entry (no Triton fallback of its own) refuses a batch its grid-order config cannot launch, naming
    the config, before anything runs; a compact config holds it."""
    from kernel_templates.cute import default_cute_bwd_config, default_cute_fwd_config, hstu_attention_cute
    from kernel_templates.hstu_attention import input_check

    batch = input_check.GRID_YZ_MAX + 1
    q = torch.zeros(batch, 1, 64, dtype=torch.bfloat16)
    off = torch.arange(batch + 1, dtype=torch.int32)
    fc = dataclasses.replace(default_cute_fwd_config(64, 64), compact=False)
    bc = dataclasses.replace(default_cute_bwd_config(64, 64), compact=True, persistent=False)
    with pytest.raises(ValueError, match="fwd_config: a batch of 65536 sequences is over the 65535"):
        hstu_attention_cute(q, q, q, off, 1, fwd_config=fc, bwd_config=bc)
    with pytest.raises(ValueError, match="bwd_config: a batch of 65536"):
        hstu_attention_cute(q, q, q, off, 1, fwd_config=dataclasses.replace(fc, compact=True),
                            bwd_config=dataclasses.replace(bc, compact=False))  # fmt: skip


@pytest.mark.parametrize("source", ["default", "tuned", "reference"])
@pytest.mark.parametrize("validate", ["async", "full", "none"])
def test_meta_tensors_give_shapes_as_the_custom_op_does(source, validate):
    """Meta tensors (shape inference, a model built on the meta device) have no data: the eager path ran the
    kernels' launchers and host checks on them, a NotImplementedError ("Cannot copy out of meta tensor") in every
    mode, while the custom op under the call answers them from its fake. They now get the fake's output and
    gradient shapes, a zero-padded head dim included."""
    for dqk, dv in ((32, 32), (48, 40)):
        q, k, v = (torch.empty(10, 2, d, device="meta", requires_grad=True) for d in (dqk, dqk, dv))
        off, nt = torch.tensor([0, 4, 10], device="meta"), torch.tensor([1, 2], device="meta")
        out = ops.hstu_attention(q, k, v, off, 8, None, nt, 1, 2, source=source, validate=validate)
        assert out.shape == (10, 2, dv) and out.is_meta
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v)] and all(g.is_meta for g in grads)
        with torch.no_grad():
            assert ops.HSTUAttention(source=source, validate=validate)(q, k, v, off, 8).shape == (10, 2, dv)


@pytest.mark.parametrize("order", ["inference-first", "training-first"])
def test_template_context_call_after_an_inference_mode_call(device, order):
    """A context call without targets launches cached zero targets (``op.kernel_targets``), which the template's
    autograd function saves for its backward. Zeros first made under ``torch.inference_mode()`` (an evaluation
    pass) were inference tensors: every later training call of that batch size failed with "Inference tensors
    cannot be saved for backward"."""
    from kernel_templates.hstu_attention import op

    op._ZERO_TARGETS.clear()
    off = offsets_from_lengths([4, 6], device)
    q, k, v = _qkv(device, 10)
    calls = [True, False] if order == "inference-first" else [False, True, False]
    for inference in calls:
        with torch.inference_mode(inference):
            out = hstu_attention(q, k, v, off, 8, contextual_seq_len=2)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    qr, kr, vr = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    ref = hstu_attention_reference(qr, kr, vr, off, 8, 1 / math.sqrt(32), None, 2)
    tol = 3e-2 if device == "cuda" else 1e-4
    assert (out.float() - ref).abs().max() <= tol * ref.abs().max()
    for g, r in zip(grads, torch.autograd.grad(ref.sum(), (qr, kr, vr)), strict=True):
        assert (g.float() - r).abs().max() <= tol * r.abs().max()


@pytest.mark.parametrize(
    ("offsets", "max_seq_len", "message"),
    [
        ([[0, 4, 10]], 8, r"seq_offsets must be a 1-D tensor of B\+1 offsets, got shape \(1, 3\)"),
        ([], 8, r"seq_offsets must be a 1-D tensor of B\+1 offsets, got shape \(0,\)"),
        ([0, 4, 10], -1, r"max_seq_len must be an int in \[0, 2\*\*31\), got -1"),
    ],
)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_backward_op_called_directly_checks_shapes_before_offsets(backend, offsets, max_seq_len, message):
    """``hstu::attention_bwd`` called directly checks its arguments by name, as ``hstu::attention_fwd`` does. It
    read the offsets first: 2-D offsets were "only one element tensors can be converted to Python scalars", empty
    ones an IndexError, and a negative max_seq_len "below the longest sequence"."""
    q, k, v = _qkv("cpu", 10, grad=False)
    off = torch.tensor(offsets, dtype=torch.int64)
    config = "{}" if backend == "reference" else dispatch.select(ops.BWD, q.dtype, 32, 32, 2, 8, None, "default").config
    with pytest.raises(ValueError, match=message):
        torch.ops.hstu.attention_bwd(torch.ones_like(v), q, k, v, off, None, max_seq_len, 0.25, 0, 0, None, backend,
                                     config, "async")  # fmt: skip


@pytest.mark.parametrize("path", ["parameters", "compiled"])
def test_reference_double_backward_through_the_custom_op(path):
    """``source="reference"`` keeps a real double backward (docs/CONTRACTS.md) on the custom op's path too:
    ``nn.Parameter`` inputs (not plain tensors) and ``torch.compile(backend="eager")`` run ``hstu::attention_fwd``,
    whose backward called ``hstu::attention_bwd``, an op without an autograd formula, so a gradient of a gradient
    raised "no autograd formula was registered"."""
    off = offsets_from_lengths([7, 13], "cpu")
    plain = _qkv("cpu", 20, grad=False)

    def call(q, k, v):
        return ops.hstu_attention(q, k, v, off, 32, source="reference")

    if path == "parameters":
        inputs = [torch.nn.Parameter(t.clone()) for t in plain]
    else:
        inputs = [t.clone().requires_grad_(True) for t in plain]
        call = torch.compile(call, backend="eager", fullgraph=True)
    gq = torch.autograd.grad(call(*inputs).pow(2).sum(), inputs[0], create_graph=True)[0]
    g2 = torch.autograd.grad((gq * inputs[0]).sum(), inputs)
    q, k, v = (t.clone().requires_grad_(True) for t in plain)
    rq = torch.autograd.grad(hstu_attention_reference(q, k, v, off, 32, 1 / math.sqrt(32)).pow(2).sum(), q,
                             create_graph=True)[0]  # fmt: skip
    torch.testing.assert_close(gq, rq)
    for got, want in zip(g2, torch.autograd.grad((rq * q).sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want)
