"""CuTe DSL (CUTLASS Python API) templates for Hopper: jagged HSTU attention forward and backward."""

from __future__ import annotations

import torch

from kernel_templates.hstu_attention.input_check import (
    GRID_YZ_MAX,
    check_alpha,
    fit_grid,
    launch_lengths,
    launch_mask_lengths,
)
from kernel_templates.hstu_attention.op import first_order_only, kernel_targets, validate_hstu_inputs

from . import op as _op
from .bwd_config import HSTUCuteBwdConfig, bwd_smem_bytes, check_bwd_config, default_cute_bwd_config
from .bwd_op import BwdKey, bwd_key, compile_bwd, hstu_attention_cute_bwd
from .config import CUTE_HEAD_DIMS, HSTUCuteFwdConfig, check_fwd_config, smem_bytes
from .launch import tma_rows_ok
from .op import (
    FwdKey,
    compile_fwd,
    default_cute_fwd_config,
    fwd_key,
    hstu_attention_cute_fwd,
)


class _FirstOrderInputs(torch.autograd.Function):
    """q, k, v passed through; in a backward that builds a graph, the CuTe gradients reaching them are tied to
    them by ``first_order_only``, so a gradient of those gradients raises instead of being silently zero."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple:
        ctx.save_for_backward(q, k, v)
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> tuple:
        return first_order_only((dq, dk, dv), ctx.saved_tensors)


def hstu_attention_cute(
    q, k, v, seq_offsets, max_seq_len, alpha=None, num_targets=None, contextual_seq_len=0, max_attn_len=0,
    scaling_seqlen=None, fwd_config=None, bwd_config=None, validate=True,
):  # fmt: skip
    """Jagged HSTU attention with the CuTe DSL kernels in both directions (``op.hstu_attention_cute``), with
    what the drop-in call adds in front of the same kernels: a context without targets runs with zero targets
    (``kernel_targets``: the same mask, and the kernel variant the drop-in call runs and the tuner times), and
    the gradients are first order only (a double backward raises)."""
    if alpha is not None:
        check_alpha(alpha)
    if validate:
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    contextual_seq_len, max_attn_len = launch_mask_lengths(contextual_seq_len, max_attn_len, q.shape[0])
    # The kernels index offsets and targets densely (an int32 strided view would be read as if compact).
    seq_offsets = seq_offsets.contiguous()
    num_targets = kernel_targets(None if num_targets is None else num_targets.contiguous(), contextual_seq_len,
                                 seq_offsets)  # fmt: skip
    fwd_config = fwd_config or default_cute_fwd_config(q.shape[2], v.shape[2])
    bwd_config = bwd_config or default_cute_bwd_config(q.shape[2], v.shape[2])
    max_seq_len, scaling_seqlen = _launch_lengths(q, seq_offsets, max_seq_len, scaling_seqlen, fwd_config, bwd_config)
    q, k, v = (tma_ready(t) for t in (q, k, v))
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        q, k, v = _FirstOrderInputs.apply(q, k, v)
    return _op.hstu_attention_cute(
        q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
        fwd_config, bwd_config, validate=False,
    )  # fmt: skip


def _launch_lengths(q, seq_offsets, max_seq_len, scaling_seqlen, fwd_config, bwd_config) -> tuple[int, int | None]:
    """(max_seq_len, divisor) both configs' launch grids hold, as the drop-in call sizes them (``launch_lengths``,
    ``fit_grid``); a batch over ``GRID_YZ_MAX`` sequences with a grid-order config (sequences in y) is a
    ``ValueError`` naming the config, where the drop-in call would run the Triton kernels instead."""
    from kernel_templates.hstu_attention.spec import grid_rows_cute_bwd, grid_rows_cute_fwd

    max_seq_len, scaling_seqlen = launch_lengths(max_seq_len, scaling_seqlen, q.shape[0])
    configs = (("fwd_config", fwd_config, HSTUCuteFwdConfig), ("bwd_config", bwd_config, HSTUCuteBwdConfig))
    if any(not isinstance(c, cls) for _, c, cls in configs):
        return max_seq_len, scaling_seqlen  # the op's config check names it
    batch = seq_offsets.shape[0] - 1
    for name, c, _ in configs:
        if batch > GRID_YZ_MAX and not c.compact:
            raise ValueError(
                f"{name}: a batch of {batch} sequences is over the {GRID_YZ_MAX} its launch grid holds (the grid "
                "order puts sequences in y); use a config with compact=True"
            )
    sizes = (grid_rows_cute_fwd(fwd_config), grid_rows_cute_bwd(bwd_config))
    return fit_grid(max_seq_len, scaling_seqlen, seq_offsets, q.shape[0], sizes)


def tma_ready(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when the TMA loads can read it (``tma_rows_ok``: contiguous heads, 16-byte aligned rows, as
    a column slice of the uvqk projection is), else a contiguous copy: a view that the input checks and the
    Triton backend accept (a transposed one, a misaligned slice) must not fail where dispatch picks CuTe. A
    clone, not ``.contiguous()``: a misaligned view can be contiguous, and ``.contiguous()`` returns it as is."""
    return t if tma_rows_ok(t) else t.clone(memory_format=torch.contiguous_format)


def hstu_attention_cute_fwd_validated(
    q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, config,
    out=None,
):  # fmt: skip
    """``hstu_attention_cute_fwd`` as dispatch launches it, on inputs its caller validated. A q, k or v the TMA
    loads cannot read makes the launcher raise before it launches anything; it is then copied (``tma_ready``)
    and the call made again, as the backward does, so the common case pays no second layout check."""
    args = (seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, config)
    try:
        return hstu_attention_cute_fwd(q, k, v, *args, out=out)
    except ValueError:
        if all(tma_rows_ok(t) for t in (q, k, v)):  # not the inputs' layout (``out``'s, say): the caller's error
            raise
    return hstu_attention_cute_fwd(*(tma_ready(t) for t in (q, k, v)), *args, out=out)


def hstu_attention_cute_bwd_validated(
    do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen, config,
    out=None,
):  # fmt: skip
    """``hstu_attention_cute_bwd`` as dispatch launches it: like every runtime launcher it takes inputs its
    caller (``autotune.runtime.ops``, the fused layer) has validated, so the call does not check them a second
    time. ``out=(dq, dk, dv)`` receives the gradients (the fused layer's d(uvqk) slices). The launcher copies
    inputs the TMA loads cannot read with ``.contiguous()``, which keeps a misaligned contiguous view as it is:
    an input not on a 16-byte boundary is cloned here."""
    do, q, k, v = (t if t.data_ptr() % 16 == 0 else tma_ready(t) for t in (do, q, k, v))
    return hstu_attention_cute_bwd(
        do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len,
        scaling_seqlen, config=config, out=out, validate=False,
    )  # fmt: skip


__all__ = [
    "CUTE_HEAD_DIMS",
    "BwdKey",
    "FwdKey",
    "HSTUCuteBwdConfig",
    "HSTUCuteFwdConfig",
    "bwd_key",
    "bwd_smem_bytes",
    "check_bwd_config",
    "check_fwd_config",
    "compile_bwd",
    "compile_fwd",
    "default_cute_bwd_config",
    "default_cute_fwd_config",
    "fwd_key",
    "hstu_attention_cute",
    "hstu_attention_cute_bwd",
    "hstu_attention_cute_bwd_validated",
    "hstu_attention_cute_fwd",
    "hstu_attention_cute_fwd_validated",
    "smem_bytes",
    "tma_ready",
]
