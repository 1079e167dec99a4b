"""The whole HSTU layer over dispatched kernels: one autograd function, zero-copy, fused epilogues.

``x -> LN -> uvqk = silu(LN(x) W^T + b) -> u, v, q, k (views) -> attention -> dropout(LN(attn) * u)
-> out = x + y W_o^T + b_o``. Every step runs the kernel ``autotune.runtime.dispatch`` selects for the call's
shape (tuned artifact entry, else the heuristic default): ``layer_norm_fwd/bwd``, ``gemm_silu`` /
``gemm_silu_bwd``, ``hstu_attention_fwd/bwd``, ``ln_mul_dropout_fwd/bwd``, ``linear_residual_fwd/bwd``.

Why one function instead of chaining autograd ops:

- zero copy: q, k, v and u are strided column views of the uvqk output, and the backward writes
  du, dq, dk, dv straight into one preallocated d(uvqk) buffer (no ``cat`` of split's backward);
  with the pre-activation kept (``du_silu``), u's SiLU' runs inside the LN * u + dropout backward, which
  has its rows in registers, and the projection's SiLU' pass covers v, q, k only, writing d pre over the
  d(uvqk) buffer in place (no second (L, 4 H d) buffer);
- the residual's gradient is added inside the input LayerNorm's backward kernel (no separate add);
- what the backward needs of the projection is explicit (``keep``): "pre+uvqk" keeps the
  pre-activation and SiLU's output (forward: the GEMM + SiLU kernel stores both; backward: no
  recompute); "pre" keeps only the pre-activation and recomputes SiLU in the backward (one
  elementwise pass, same memory as keeping uvqk); "uvqk" keeps only SiLU's output and recomputes the
  pre-activation with a GEMM in the backward.
  ``recompute_ln`` keeps only x and the LN statistics and recomputes LN(x).

Precision: activations and GEMMs run in the compute dtype (bf16 under autocast or a bf16 model),
LayerNorm statistics and weight/bias gradient sums in fp32 inside the kernels; parameters stay in
their own dtype (fp32 master weights) and their gradients are returned in it. The plan's dtype is the
compute dtype: ``hstu_layer`` runs its kernels with any ambient autocast turned off (the caller picks the plan's
dtype from it, as ``models.hstu`` does).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch

from autotune.runtime import dispatch, ops
from kernel_templates.hstu_attention.config import SUPPORTED_HEAD_DIMS
from kernel_templates.hstu_attention.input_check import check_alpha, fit_grid, launch_lengths, validate_mode
from kernel_templates.hstu_attention.op import check_max_seq_len, check_offsets_format, first_order_only
from kernel_templates.launch_checks import dense, dropout_p, finite_eps, seed_tensor, unit_columns

LAYER_KERNELS = (
    "layer_norm_fwd",
    "layer_norm_bwd",
    "gemm_silu",
    "gemm_silu_bwd",
    "hstu_attention_fwd",
    "hstu_attention_bwd",
    "ln_mul_dropout_fwd",
    "ln_mul_dropout_bwd",
    "linear_residual_fwd",
    "linear_residual_bwd",
)

# The kernels a length-distribution hint is about. The other ops work token by token: their entries are chosen as
# without a hint (uniform first), so a hint pinned to the attention's "jagged" entries did not send them to
# entries they never had, with one fallback warning each.
ATTENTION_KINDS = frozenset({"hstu_attention_fwd", "hstu_attention_bwd"})

# The kernels' backward is first order: a gradient of the layer's gradients raises this instead of being zero.
SECOND_ORDER = (
    "hstu_layer: the fused layer's gradients are not differentiable (no double backward); "
    "use the unfused layer (models.hstu, layer='unfused') for higher-order gradients"
)


KEEP = ("pre+uvqk", "pre", "uvqk")
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Step:
    """One dispatched kernel: its runtime launcher and decoded config."""

    kind: str
    backend: str
    config: Any
    source: str

    @property
    def launch(self) -> Any:
        return dispatch.launcher(self.backend, self.kind)


@dataclass(frozen=True)
class LayerPlan:
    """Everything the layer's forward and backward need besides tensors (hashable: cached per shape)."""

    dtype: torch.dtype  # compute dtype of activations and GEMMs (the residual stream may be wider)
    heads: int
    head_dim: int
    max_seq_len: int
    alpha: float
    eps: float
    dropout: float
    keep: str  # "pre+uvqk" | "pre" | "uvqk" (see the module docstring)
    recompute_ln: bool
    zero_copy: bool
    du_silu: bool  # with zero_copy and a kept pre-activation: u's SiLU' inside the LN * u + dropout backward
    steps: tuple[Step, ...]
    source: str = "tuned"  # what dispatch chose from; the attention steps are chosen again per call (by fill)
    distribution: str | None = None

    def step(self, kind: str) -> Step:
        for s in self.steps:
            if s.kind == kind:
                return s
        raise KeyError(kind)


_PLANS: dict[tuple, LayerPlan] = {}
_STEPS: dict[tuple, Step] = {}  # one Step per dispatch choice (a config decoded once)


def _step_of(kind: str, c: dispatch.Choice) -> Step:
    key = (kind, c.backend, c.config, c.source)
    s = _STEPS.get(key)
    if s is None:
        s = _STEPS[key] = Step(kind, c.backend, dispatch.decode_config(c.backend, kind, c.config), c.source)
    return s


def plan_layer(
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    max_seq_len: int,
    alpha: float,
    eps: float,
    dropout: float,
    source: str = "tuned",
    distribution: str | None = None,
    keep: str = "pre+uvqk",
    recompute_ln: bool = False,
    zero_copy: bool = True,
    du_silu: bool = True,
) -> LayerPlan:
    """The kernels one layer call runs (cached per shape key; deterministic, never times anything)."""
    if keep not in KEEP:
        raise ValueError(f"keep must be one of {KEEP}, got {keep!r}")
    # The kernels compute in fp16, bf16 or fp32: a float64 plan ran them and returned wrong outputs and
    # gradients without a word (the attention call refuses other dtypes; the layer's kernels trust the plan).
    if dtype not in COMPUTE_DTYPES:
        raise ValueError(f"dtype must be one of {COMPUTE_DTYPES} (the compute dtype), got {dtype!r}")
    # As hstu_attention checks it: a NaN or infinite alpha made every output NaN, a string reached the kernels.
    check_alpha(alpha)
    alpha = float(alpha)
    # The attention launchers take the layer's lengths as validated (the public call's rule: an int32 position, a
    # divisor): a plan of 0 or of 2**31 and more would run with a zero or out-of-range divisor.
    check_max_seq_len(max_seq_len, positive=True)
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {SUPPORTED_HEAD_DIMS} (the attention kernels'), got {head_dim!r}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    for name, flag in (("recompute_ln", recompute_ln), ("zero_copy", zero_copy), ("du_silu", du_silu)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name} must be a bool, got {flag!r}")
    flags = (keep, recompute_ln, zero_copy, du_silu)
    key = (dtype, heads, head_dim, max_seq_len, alpha, eps, dropout, source, distribution, *flags)
    plan = _PLANS.get(key)
    if plan is None:
        finite_eps(eps), dropout_p(dropout)  # refused here, not after the first kernels of a call ran
        if source == "reference":
            raise ValueError("the fused layer has no 'reference' source; use the unfused layer")

        def build(_state: object) -> LayerPlan:
            steps = []
            for kind in LAYER_KERNELS:
                dist = distribution if kind in ATTENTION_KINDS else None
                steps.append(
                    _step_of(kind, dispatch.select(kind, dtype, head_dim, head_dim, heads, max_seq_len, dist, source))
                )
            return LayerPlan(
                dtype, heads, head_dim, max_seq_len, alpha, eps, dropout, *flags, tuple(steps), source, distribution
            )

        plan = dispatch.cache_unless_reloaded(build, lambda p: _PLANS.__setitem__(key, p))
    return plan


dispatch.on_clear(_PLANS.clear)  # other artifacts loaded: plans are chosen again
dispatch.on_clear(_STEPS.clear)


def _attention_step(plan: LayerPlan, kind: str, seq_offsets: torch.Tensor, rows: int, longest: int) -> Step:
    """The plan's attention kernel; with tuned kernels and no declared distribution, the one ``hstu_attention``
    would choose for this call instead: by ``longest``, the longest length the rows allow (``launch_lengths`` of
    the plan's max_seq_len, which the caller computes once for both steps), and the call's fill
    L / (B x max_seq_len) (host-side shape arithmetic, no sync), so a jagged batch runs the entry tuned nearest
    its fill, not the one the plan chose with no batch at hand. The Triton default where the launch grid cannot
    hold the batch."""
    s = plan.step(kind)
    d = plan.head_dim
    batch = seq_offsets.shape[0] - 1
    plain = type(rows) is int and type(batch) is int  # a traced call's symbolic size: the plan's choice, as ops
    if plan.distribution is None and plan.source == "tuned" and plain and not torch.compiler.is_compiling():
        fill = dispatch.call_fill(rows, batch, longest)
        s = _step_of(kind, dispatch.select(kind, plan.dtype, d, d, plan.heads, longest, None, "tuned", fill=fill))
    backend, config = dispatch.for_batch(kind, s.backend, s.config, batch, d, d, plan.dtype, plan.heads)
    if backend == s.backend:
        return s
    return Step(kind, backend, dispatch.decode_config(backend, kind, config), "default")


def _attention_call(plan: LayerPlan, seq_offsets: torch.Tensor, rows: int) -> tuple[Step, Step, int, int | None]:
    """(forward step, backward step, max_seq_len, divisor) of one layer call's attention: lengths that both steps'
    grids can hold. Chosen once, by the forward: the backward launches what the forward chose, as it runs the
    plan's other steps, also when other artifacts were loaded in between (a re-choice then mixed two files)."""
    max_seq_len, scaling = launch_lengths(plan.max_seq_len, None, rows)
    kinds = ("hstu_attention_fwd", "hstu_attention_bwd")
    steps = [_attention_step(plan, k, seq_offsets, rows, max_seq_len) for k in kinds]
    sizes = [dispatch.grid_rows(s.kind, s.backend, s.config) for s in steps]
    max_seq_len, scaling = fit_grid(max_seq_len, scaling, seq_offsets, rows, sizes)
    return steps[0], steps[1], max_seq_len, scaling


def _gemm_silu_step(plan: LayerPlan, hidden: int) -> Step:
    """The plan's GEMM + SiLU step, or the torch composition where the CuTe kernel cannot take the input width
    (TMA reads rows of a multiple of 8 elements; the plan is chosen per heads x head_dim, not per hidden width),
    as the layer's other kernels take any width."""
    s = plan.step("gemm_silu")
    if s.backend != "cute" or hidden % 8 == 0:
        return s
    return Step("gemm_silu", "torch", dispatch.decode_config("torch", "gemm_silu", "{}"), "default")


def _views(uvqk: torch.Tensor, heads: int, d: int) -> tuple[torch.Tensor, ...]:
    """u (L, H*d) and q, k, v (L, H, d): column views of uvqk, no copies."""
    L, hd = uvqk.shape[0], heads * d
    u, v, q, k = (uvqk[:, i * hd : (i + 1) * hd] for i in range(4))
    return u, q.view(L, heads, d), k.view(L, heads, d), v.view(L, heads, d)


_AUTOCAST_DEVICES = frozenset({"cuda", "cpu", "xpu", "mps", "hpu"})  # others: torch.is_autocast_enabled raises


def _plan_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` while the layer's kernels run: the plan's dtype sets their precision. Under an
    ambient autocast the torch backends' GEMMs (the projections) ran in its dtype instead, rounding an fp32 plan's
    outputs and gradients to bf16, and keep="uvqk" failed on a bf16 uvqk beside the plan-dtype weights."""
    if device.type in _AUTOCAST_DEVICES and torch.is_autocast_enabled(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class HSTULayerFunction(torch.autograd.Function):
    """Forward and backward of one HSTU layer through the plan's kernels (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, ln1_w, ln1_b, w_uvqk, b_uvqk, ln2_w, ln2_b, w_o, b_o, seq_offsets, seed, plan: LayerPlan):
        dt = plan.dtype
        w_uvqk_c, b_uvqk_c, w_o_c, b_o_c = (t.to(dt) for t in (w_uvqk, b_uvqk, w_o, b_o))
        cfg = plan.step
        s = cfg("layer_norm_fwd")
        xn, mean1, rstd1 = s.launch(x, ln1_w, ln1_b, plan.eps, config=s.config, out_dtype=dt)
        s = _gemm_silu_step(plan, xn.shape[1])
        # The pre-activation comes out of the same kernel unless the backward recomputes it by a GEMM.
        pre = None if plan.keep == "uvqk" else xn.new_empty((xn.shape[0], w_uvqk_c.shape[0]))
        uvqk = s.launch(xn, w_uvqk_c, b_uvqk_c, config=s.config, pre_out=pre)
        u, q, k, v = _views(uvqk, plan.heads, plan.head_dim)
        if not plan.zero_copy:  # what chaining split + .contiguous() costs (the layer benchmark's baseline)
            u, q, k, v = (t.contiguous() for t in (u, q, k, v))
        s, ctx.attention_bwd, max_seq_len, scaling = _attention_call(plan, seq_offsets, q.shape[0])
        ctx.attention_lengths = (max_seq_len, scaling)
        attn = s.launch(q, k, v, seq_offsets, max_seq_len, plan.alpha, None, 0, 0, scaling, s.config)
        attn2 = attn.view(attn.shape[0], -1)
        s = cfg("ln_mul_dropout_fwd")
        y, mean2, rstd2 = s.launch(attn2, u, ln2_w, ln2_b, plan.eps, plan.dropout, seed, config=s.config)
        out = cfg("linear_residual_fwd").launch(y, w_o_c, b_o_c, x, config=cfg("linear_residual_fwd").config)
        saved_xn = None if plan.recompute_ln else xn
        saved_uvqk = None if plan.keep == "pre" else uvqk
        # The backward sums the bias gradient in fp32 into the master bias's dtype when it has the kept
        # pre-activation (no bf16 rounding and cast back); recomputing pre needs the compute-dtype bias.
        b_uvqk_bwd = b_uvqk_c if pre is None else b_uvqk
        ctx.save_for_backward(
            x, saved_xn, mean1, rstd1, saved_uvqk, pre, attn2, y, mean2, rstd2,
            ln1_w, ln1_b, w_uvqk_c, b_uvqk_bwd, ln2_w, ln2_b, w_o_c, seq_offsets, seed,
        )  # fmt: skip
        ctx.plan = plan
        return out

    @staticmethod
    def backward(ctx, dout):
        with _plan_precision(dout.device):
            return HSTULayerFunction._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout):
        plan: LayerPlan = ctx.plan
        cfg = plan.step
        saved = ctx.saved_tensors  # read once: torch.utils.checkpoint unpacks each saved tensor only once
        (x, xn, mean1, rstd1, uvqk, pre, attn2, y, mean2, rstd2,
         ln1_w, ln1_b, w_uvqk, b_uvqk, ln2_w, ln2_b, w_o, seq_offsets, seed) = saved  # fmt: skip
        dout = dout.contiguous()
        dout_c = dout.to(plan.dtype)
        # Output projection (dy, dW_o); the residual's gradient is dout itself. Work the step leaves on another
        # stream (its events in ``pending``) runs on beside the ops below and is joined before returning.
        pending: list = []
        s = cfg("linear_residual_bwd")
        dy, dw_o = s.launch(dout_c, y, w_o, config=s.config, pending=pending)
        try:
            if xn is None:
                s = cfg("layer_norm_fwd")
                xn = s.launch(x, ln1_w, ln1_b, plan.eps, config=s.config, out_dtype=plan.dtype)[0]
            if uvqk is None:  # keep == "pre": SiLU recomputed from the kept pre-activation
                uvqk = torch.nn.functional.silu(pre)
            L, hd = x.shape[0], plan.heads * plan.head_dim
            d_uvqk = torch.empty((L, 4 * hd), dtype=uvqk.dtype, device=uvqk.device)
            du, dq, dk, dv = _views(d_uvqk, plan.heads, plan.head_dim)
            u, q, k, v = _views(uvqk, plan.heads, plan.head_dim)
            if not plan.zero_copy:  # separate gradient tensors, concatenated below as split's backward does
                u, q, k, v = (t.contiguous() for t in (u, q, k, v))
                du, dq, dk, dv = (torch.empty_like(t) for t in (u, q, k, v))
            s = cfg("ln_mul_dropout_bwd")
            d_attn = torch.empty_like(attn2)
            dw2 = torch.empty_like(ln2_w)
            db2 = torch.empty_like(ln2_b)
            # u's columns go through SiLU' inside this kernel (pre kept, one d(uvqk) buffer): the SiLU' pass below
            # then skips them, and writes d pre over d(uvqk) in place.
            silu_u = plan.zero_copy and plan.du_silu and pre is not None
            more = {"silu_pre": pre[:, :hd]} if silu_u else {}
            res = s.launch(
                dy, attn2, u, ln2_w, ln2_b, mean2, rstd2, plan.dropout, seed, config=s.config,
                out=(d_attn, du, dw2, db2), **more,
            )  # fmt: skip
            s, (max_seq_len, scaling) = ctx.attention_bwd, ctx.attention_lengths
            d_attn3 = d_attn.view(L, plan.heads, plan.head_dim)
            args = (seq_offsets, max_seq_len, plan.alpha, None, 0, 0, scaling)
            s.launch(d_attn3, q, k, v, *args, s.config, out=(dq, dk, dv))
            if not plan.zero_copy:
                d_uvqk = torch.cat([t.reshape(L, hd) for t in (du, dv, dq, dk)], dim=1)
            s = cfg("gemm_silu_bwd")
            more = {"done_cols": hd, "done_db": res[4]} if silu_u else {}
            dxn, dw_uvqk, db_uvqk = s.launch(d_uvqk, xn, w_uvqk, b_uvqk, config=s.config, pre=pre, **more)
            s = cfg("layer_norm_bwd")
            # The output projection's bias gradient is dout's column sum: the LN backward reads dout anyway.
            dx, dw1, db1, db_o = s.launch(
                dxn, x, ln1_w, ln1_b, mean1, rstd1, config=s.config, residual_grad=dout, residual_grad_sum=True
            )
        finally:  # also on an error: a fork left unjoined fails a CUDA-graph capture with its own error
            for event in pending:
                event.wait()  # the caller's stream waits: dW_o is complete before autograd reads it
        grads = (dx, dw1, db1, dw_uvqk, db_uvqk, dw2, db2, dw_o, db_o)
        inputs = (dout, *saved)
        return *first_order_only(grads, inputs, SECOND_ORDER), None, None, None


class LayerNormFunction(torch.autograd.Function):
    """LN(x) over the plan's LayerNorm kernels: fp32 statistics inside, y in the plan's dtype, fp32 weight and
    bias gradients. Unlike torch's layer_norm under autocast it reads a bf16 stream as it is (no fp32 copy of
    x, no fp32 output to cast again for each consumer)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, plan: LayerPlan):
        s = plan.step("layer_norm_fwd")
        y, mean, rstd = s.launch(x, weight, bias, eps, config=s.config, out_dtype=plan.dtype)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.plan = plan
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        s = ctx.plan.step("layer_norm_bwd")
        dx, dw, db = s.launch(dy.contiguous(), x, weight, bias, mean, rstd, config=s.config)
        return *first_order_only((dx, dw, db), (dy, x, weight, bias), SECOND_ORDER), None, None


def _check_plan(plan: Any) -> None:
    """A plan from ``plan_layer`` (``ValueError`` naming it): anything else failed inside as an AttributeError."""
    if not isinstance(plan, LayerPlan):
        raise ValueError(f"plan must be a LayerPlan (from plan_layer), got {type(plan).__name__}")


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, plan: LayerPlan) -> torch.Tensor:
    """LayerNorm of a 2-D (rows, D) activation through ``plan``'s dispatched kernels, output in ``plan.dtype``."""
    _check_plan(plan)
    if (
        isinstance(x, torch.Tensor)
        and not x.is_cuda
        and ops.cuda_present()
        and plan.step("layer_norm_fwd").backend != "torch"
    ):
        ops.check_kernel_device(x, "x, weight and bias")
    return LayerNormFunction.apply(unit_columns(x), weight, bias, eps, plan)


def _check_params(x: torch.Tensor, params: dict[str, torch.Tensor], plan: LayerPlan) -> None:
    """Each parameter of ``hstu_layer`` present, on x's device, of the shape x's width and the plan's heads x
    head_dim give it (``ValueError`` naming it): a wider projection was otherwise read in part without a word."""
    hidden, hd = x.shape[1], plan.heads * plan.head_dim
    shapes = {"ln1_w": (hidden,), "ln1_b": (hidden,), "w_uvqk": (4 * hd, hidden), "b_uvqk": (4 * hd,),
              "ln2_w": (hd,), "ln2_b": (hd,), "w_o": (hidden, hd), "b_o": (hidden,)}  # fmt: skip
    if not isinstance(params, dict) or set(params) != set(shapes):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(f"params must be a dict of {sorted(shapes)}, got {got}")
    for name, shape in shapes.items():
        t = params[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"params[{name!r}] must have shape {shape} (hidden {hidden}, heads {plan.heads} x head_dim "
                f"{plan.head_dim}), got {got}"
            )
        dense(**{f"params[{name!r}]": t})
        if t.device != x.device:
            raise ValueError(f"params[{name!r}] is on {t.device}, x on {x.device}")
        if not t.is_floating_point():  # an integer projection was cast to float without a word
            raise ValueError(f"params[{name!r}] must be a floating-point tensor, got {t.dtype}")


def _check_call(
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    seq_offsets: torch.Tensor,
    plan: LayerPlan,
    seed: torch.Tensor,
    mode: str,
) -> None:
    """The attention op's input rules for the layer's call (``ValueError`` naming the argument); the offsets
    as ``hstu_attention`` checks them in ``mode`` (a device assertion on a GPU for "async"). The dropout seed
    too: its launcher refused a bad one only after the LayerNorm, projection and attention kernels had run."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a 2-D (L, hidden) tensor, got {getattr(x, 'shape', type(x).__name__)}")
    dense(x=x)  # a sparse x failed inside torch (no strides)
    _check_plan(plan)
    _check_params(x, params, plan)
    seed_tensor(seed, x.device)
    check_offsets_format(seq_offsets, x.device)
    backend = plan.step("hstu_attention_fwd").backend
    ops.check_call_offsets(backend, mode, seq_offsets, None, x.shape[0], plan.max_seq_len)
    if not x.is_cuda and ops.cuda_present():
        ops.check_kernel_device(x, "x, params and seq_offsets")


def hstu_layer(
    x: torch.Tensor,
    params: dict[str, torch.Tensor],
    seq_offsets: torch.Tensor,
    plan: LayerPlan,
    seed: torch.Tensor,
    validate: str | bool = "async",
) -> torch.Tensor:
    """One layer on a jagged (L, hidden) activation. ``params``: ln1_w/ln1_b, w_uvqk/b_uvqk, ln2_w/ln2_b, w_o/b_o.

    ``validate`` checks ``seq_offsets`` against x and ``plan.max_seq_len`` as ``hstu_attention`` does ("async":
    no sync, a device assertion on a GPU and a ``ValueError`` on CPU; "full": a ``ValueError`` at the call;
    "none": nothing): the layer's kernels take the offsets as given.
    """
    mode = validate_mode(validate)
    if mode != "none":
        _check_call(x, params, seq_offsets, plan, seed, mode)
    p = params
    if x.shape[0] == 0:  # no tokens: out = x, every parameter gradient zero (no kernel launched)
        return x + sum(t.sum() for t in p.values()).to(x.dtype) * 0
    seq_offsets = seq_offsets.contiguous()  # the kernels index it densely: a strided view read the wrong values
    with _plan_precision(x.device):
        return HSTULayerFunction.apply(
            unit_columns(x), p["ln1_w"], p["ln1_b"], p["w_uvqk"], p["b_uvqk"], p["ln2_w"], p["ln2_b"], p["w_o"],
            p["b_o"], seq_offsets, seed, plan,
        )  # fmt: skip
