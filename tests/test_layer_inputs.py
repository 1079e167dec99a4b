"""``hstu_layer`` on shapes and inputs the tuned tasks never cover, against a PyTorch formulation of the layer.

Widths and head counts of no preset (hidden 96 = 3 x 32, hidden unequal to heads x head_dim), batches of empty,
length-1 and non-tile-multiple sequences, fp16, parameters of other dtypes and strides, the dropout mask (kept
fraction, scaling, the same mask in the backward for every keep/recompute switch), and bad plans by name.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autotune.runtime import dispatch, ops
from autotune.runtime.layer import hstu_layer, layer_norm, plan_layer
from kernel_templates.hstu_attention.reference import hstu_attention_reference

EPS = 1e-5
NAMES = ("ln1_w", "ln1_b", "w_uvqk", "b_uvqk", "ln2_w", "ln2_b", "w_o", "b_o")


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _params(hidden: int, heads: int, d: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    hd = heads * d
    shapes = [(hidden,), (hidden,), (4 * hd, hidden), (4 * hd,), (hd,), (hd,), (hidden, hd), (hidden,)]
    p = {n: torch.randn(*s, generator=g) * 0.2 for n, s in zip(NAMES, shapes, strict=True)}
    p["ln1_w"] += 1
    p["ln2_w"] += 1
    return p


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int64)


def _reference(x, p, off, heads, d, max_seq_len, mask=None, p_drop=0.0):
    """The layer in fp32 PyTorch ops; ``mask``: the dropout's kept entries of LN(attn) * u."""
    L, hidden = x.shape
    hd = heads * d
    xn = F.layer_norm(x, (hidden,), p["ln1_w"], p["ln1_b"], EPS)
    u, v, q, k = F.silu(xn @ p["w_uvqk"].T + p["b_uvqk"]).split(hd, 1)
    q, k, v = (t.reshape(L, heads, d) for t in (q, k, v))
    a = hstu_attention_reference(q, k, v, off, max_seq_len, 1 / math.sqrt(d)).reshape(L, hd)
    y = F.layer_norm(a, (hd,), p["ln2_w"], p["ln2_b"], EPS) * u
    if mask is not None:
        y = y * mask / (1 - p_drop)
    return x + y @ p["w_o"].T + p["b_o"]


def _grads(fn, x, p, dout):
    xs = x.detach().clone().requires_grad_(True)
    ps = {n: t.detach().clone().requires_grad_(True) for n, t in p.items()}
    out = fn(xs, ps)
    gs = torch.autograd.grad(out, [xs, *ps.values()], dout.to(out.dtype))
    return out.detach(), dict(zip(("x", *NAMES), gs, strict=True))


def _assert_close(got: torch.Tensor, want: torch.Tensor, name: str, tol: float) -> None:
    err = ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol:.0e})"


@pytest.mark.interpreter  # CPU tensors through the Triton interpreter; fp32 tolerances tf32 would miss
@pytest.mark.parametrize(
    ("hidden", "heads", "d", "lengths", "dtype", "keep"),
    [
        (96, 3, 32, [0, 1, 5, 17, 33, 0, 9], torch.float32, "pre+uvqk"),
        (80, 2, 32, [3, 7, 0, 13], torch.float32, "pre"),  # hidden unequal to heads x head_dim
        (100, 1, 64, [67, 2, 45], torch.float32, "uvqk"),  # a width of no multiple of 8
        (64, 2, 32, [1], torch.float32, "pre+uvqk"),
        (64, 2, 32, [0, 1, 5, 17, 33, 0, 9], torch.float16, "pre+uvqk"),
    ],
)
def test_untuned_shapes_match_the_pytorch_layer(hidden, heads, d, lengths, dtype, keep):
    off = _offsets(lengths)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(int(off[-1]), hidden, generator=g).to(dtype)
    dout = torch.randn(x.shape, generator=g).to(dtype)
    p = _params(hidden, heads, d)
    msl = max(lengths)
    plan = plan_layer(dtype, heads, d, msl, 1 / math.sqrt(d), EPS, 0.0, "default", keep=keep)
    seed = torch.zeros(1, dtype=torch.int64)
    out, grads = _grads(lambda xs, ps: hstu_layer(xs, ps, off, plan, seed, validate="full"), x, p, dout)
    want, want_grads = _grads(lambda xs, ps: _reference(xs, ps, off, heads, d, msl), x.float(), p, dout.float())
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    _assert_close(out, want, "out", tol)
    for name, g_ in want_grads.items():
        _assert_close(grads[name], g_, f"d{name}", tol)


@pytest.mark.interpreter  # CPU tensors through the Triton interpreter; fp32 tolerances tf32 would miss
def test_parameters_of_other_dtypes_and_strides_get_gradients_in_their_own_dtype():
    """fp64 and fp16 master parameters, a transposed weight and strided vectors: the result of contiguous fp32 ones,
    each gradient in its parameter's dtype."""
    off = _offsets([0, 5, 7, 19])
    g = torch.Generator().manual_seed(2)
    x, dout = torch.randn(31, 64, generator=g), torch.randn(31, 64, generator=g)
    p = _params(64, 2, 32)
    odd = {n: (t.double() if i % 2 else t.half().float()) for i, (n, t) in enumerate(p.items())}
    odd["ln1_w"] = odd["ln1_w"].half()
    odd["w_uvqk"] = odd["w_uvqk"].T.contiguous().T
    wide = torch.zeros(128, dtype=odd["ln2_w"].dtype)
    wide[::2] = odd["ln2_w"]
    odd["ln2_w"] = wide[::2]
    plan = plan_layer(torch.float32, 2, 32, 32, 1 / math.sqrt(32), EPS, 0.0, "default")
    seed = torch.zeros(1, dtype=torch.int64)
    out, grads = _grads(lambda xs, ps: hstu_layer(xs, ps, off, plan, seed), x, odd, dout)
    ref = {n: t.float() for n, t in odd.items()}
    want, want_grads = _grads(lambda xs, ps: _reference(xs, ps, off, 2, 32, 32), x, ref, dout)
    _assert_close(out, want, "out", 1e-4)
    for name, g_ in want_grads.items():
        if name != "x":
            assert grads[name].dtype == odd[name].dtype, name
        _assert_close(grads[name], g_, f"d{name}", 2e-3 if name == "ln1_w" else 1e-4)


@pytest.mark.interpreter  # CPU tensors through the Triton interpreter; fp32 tolerances tf32 would miss
@pytest.mark.parametrize(("keep", "recompute_ln", "zero_copy"), [("pre+uvqk", False, True), ("pre", True, False)])
def test_dropout_keeps_one_minus_p_scaled_and_the_backward_uses_the_forward_mask(keep, recompute_ln, zero_copy):
    """With W_o = I the layer's output minus x is the dropped LN(attn) * u: its kept entries are ~(1 - p), scaled by
    1 / (1 - p); the gradients are those of the PyTorch layer under that very mask."""
    p_drop = 0.4
    off = _offsets([0, 37, 1, 70, 0, 29])
    g = torch.Generator().manual_seed(3)
    x, dout = torch.randn(137, 64, generator=g), torch.randn(137, 64, generator=g)
    p = _params(64, 2, 32)
    seed = torch.tensor([99])

    def plan(drop: float):
        return plan_layer(torch.float32, 2, 32, 128, 1 / math.sqrt(32), EPS, drop, "default",
                          keep=keep, recompute_ln=recompute_ln, zero_copy=zero_copy)  # fmt: skip

    eye = {**p, "w_o": torch.eye(64), "b_o": torch.zeros(64)}
    with torch.no_grad():
        y0 = hstu_layer(x, eye, off, plan(0.0), seed) - x
        y = hstu_layer(x, eye, off, plan(p_drop), seed) - x
    mask = y != 0
    assert abs(mask.float().mean().item() - (1 - p_drop)) < 0.02
    _assert_close(y[mask], y0[mask] / (1 - p_drop), "kept entries", 1e-5)
    out, grads = _grads(lambda xs, ps: hstu_layer(xs, ps, off, plan(p_drop), seed), x, p, dout)
    want, want_grads = _grads(lambda xs, ps: _reference(xs, ps, off, 2, 32, 128, mask=mask, p_drop=p_drop), x, p, dout)
    _assert_close(out, want, "out", 1e-4)
    for name, g_ in want_grads.items():
        _assert_close(grads[name], g_, f"d{name}", 1e-4)


def test_a_bad_plan_is_a_value_error_naming_it():
    """Anything but a LayerPlan failed inside the call as an AttributeError; heads=True was taken for 1 head and
    refused by dispatch under another name."""
    p = _params(64, 2, 32)
    x, off, seed = torch.randn(5, 64), _offsets([5]), torch.zeros(1, dtype=torch.int64)
    for bad in (None, "default", {"heads": 2}):
        with pytest.raises(ValueError, match="plan must be a LayerPlan"):
            hstu_layer(x, p, off, bad, seed)
        with pytest.raises(ValueError, match="plan must be a LayerPlan"):
            layer_norm(x, p["ln1_w"], p["ln1_b"], EPS, bad)
    with pytest.raises(ValueError, match="heads must be a positive int"):
        plan_layer(torch.float32, True, 32, 32, 0.1, EPS, 0.0, "default")


def test_cpu_tensors_on_a_gpu_host_are_a_clear_error_naming_the_layer_inputs(monkeypatch):
    """On a GPU host without the interpreter, a CPU activation reached the first Triton launch, which failed naming
    no argument; the layer and its LayerNorm now say where the inputs are."""
    plan = plan_layer(torch.float32, 2, 32, 32, 0.1, EPS, 0.0, "default")
    p = _params(64, 2, 32)
    x, off, seed = torch.randn(5, 64), _offsets([5]), torch.zeros(1, dtype=torch.int64)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(ops, "cuda_present", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="x, params and seq_offsets are on cpu: the kernels need them on a CUDA"):
        hstu_layer(x, p, off, plan, seed)
    if plan.step("layer_norm_fwd").backend != "torch":
        with pytest.raises(ValueError, match="x, weight and bias are on cpu"):
            layer_norm(x, p["ln1_w"], p["ln1_b"], EPS, plan)


@pytest.mark.interpreter  # CPU tensors through the Triton interpreter; fp32 tolerances tf32 would miss
@pytest.mark.parametrize("keep", ["pre+uvqk", "uvqk"])
def test_an_ambient_autocast_leaves_the_plans_precision(keep):
    """The plan fixes the compute dtype. Under an ambient autocast the torch backends' GEMMs ran in its dtype:
    an fp32 plan's output and gradients came back rounded to bf16 (errors ~0.03 and ~0.1), and keep="uvqk"
    failed on a bf16 uvqk beside fp32 weights ("weight must be torch.bfloat16 like y"). Forward and backward
    under autocast now match the call without it."""
    hidden, heads, d, lengths = 64, 2, 32, [3, 5]
    off, p = _offsets(lengths), _params(hidden, heads, d)
    x = torch.randn(int(off[-1]), hidden, generator=torch.Generator().manual_seed(2))
    plan = plan_layer(torch.float32, heads, d, max(lengths), 1 / math.sqrt(d), EPS, 0.0, "default", keep=keep)
    seed = torch.zeros(1, dtype=torch.int64)

    def call(xs, ps):
        return hstu_layer(xs, ps, off, plan, seed, validate="full")

    dout = torch.randn(x.shape, generator=torch.Generator().manual_seed(3))
    want, want_grads = _grads(call, x, p, dout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, grads = _grads(call, x, p, dout)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=0, atol=0, msg=lambda m, n=name: f"d{n}: {m}")
