"""Autograd function and public entry point of the Triton jagged HSTU attention."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from kernel_templates.launch_checks import config_fields
from kernel_templates.tensor_memo import capturing

from .config import SUPPORTED_HEAD_DIMS, HSTUBwdConfig, HSTUFwdConfig, default_bwd_config, default_fwd_config
from .input_check import check_grad as check_grad  # (re-exported: ops and the CuTe launchers import it from here)
from .input_check import check_offsets_host, shapes_look_valid
from .input_check import validate_hstu_grad as validate_hstu_grad
from .triton_bwd import hstu_attention_bwd_validated
from .triton_fwd import hstu_attention_fwd_validated

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_SEQ_LEN_LIMIT = 2**31  # the kernels index positions in int32


def _is_int(x: object) -> bool:
    """A Python int that is not a bool (True would pass for 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def check_max_seq_len(max_seq_len: object, positive: bool = False) -> None:
    """Raise ``ValueError`` naming ``max_seq_len`` unless it is an int below 2**31 (an int32 position), and above 0
    where ``positive``: the fused layer always divides by it, the public call only without a ``scaling_seqlen``."""
    low = 1 if positive else 0
    if not _is_int(max_seq_len) or not low <= max_seq_len < MAX_SEQ_LEN_LIMIT:
        what = "a positive int below 2**31" if positive else "an int in [0, 2**31)"
        raise ValueError(f"max_seq_len must be {what}, got {max_seq_len!r}")


def check_mask_lengths(contextual_seq_len: object, max_attn_len: object) -> None:
    """Raise ``ValueError`` naming ``contextual_seq_len`` or ``max_attn_len`` unless each is a non-negative int
    below 2**31: the kernels take them as int32 (a larger context or window would wrap to a negative one). The
    call's validation and ``HSTUAttention``'s constructor (which fixes them for every call) share it."""
    if not _is_int(contextual_seq_len) or not 0 <= contextual_seq_len < MAX_SEQ_LEN_LIMIT:
        raise ValueError(f"contextual_seq_len must be a non-negative int below 2**31, got {contextual_seq_len!r}")
    if not _is_int(max_attn_len) or not 0 <= max_attn_len < MAX_SEQ_LEN_LIMIT:
        raise ValueError(f"max_attn_len must be a non-negative int below 2**31 (0 = no window), got {max_attn_len!r}")


def kernel_targets(
    num_targets: torch.Tensor | None, contextual_seq_len: int, seq_offsets: torch.Tensor
) -> torch.Tensor | None:
    """The targets a kernel launch gets: zeros for a call with context and no targets.

    The mask (docs/CONTRACTS.md) is the same for "no targets" and "zero targets". Every call with a context then runs
    one kernel variant, the targets path, which is the one the tuner times for context tasks. Both
    backends' context-only paths are right as well (the Triton one since its guard fix; the CuTe one
    measured on a GPU, ``test_gpu_kernels_context_path_without_targets``). The zeros are made once per
    (B, dtype, device) and only read.
    """
    if num_targets is not None or int(contextual_seq_len) <= 0:
        return num_targets
    key = (seq_offsets.shape[0] - 1, seq_offsets.dtype, seq_offsets.device)
    zeros = _ZERO_TARGETS.get(key)
    if zeros is None:
        # Never an inference tensor: the template's autograd function saves these zeros for its backward, and
        # zeros kept from an inference-mode call failed every later training call of that batch size there.
        with torch.inference_mode(False):
            zeros = torch.zeros(key[0], dtype=key[1], device=key[2])
        if not capturing():  # one made inside a graph capture belongs to that graph's pool: not kept
            if len(_ZERO_TARGETS) >= 64:
                _ZERO_TARGETS.clear()
            _ZERO_TARGETS[key] = zeros
    return zeros


_ZERO_TARGETS: dict[tuple, torch.Tensor] = {}  # read-only zeros per (batch, dtype, device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_offsets_format(seq_offsets: Any, device: torch.device | None) -> None:
    """``seq_offsets`` is a 1-D int32/int64 tensor of B+1 offsets (on ``device`` when given), or a
    ``ValueError`` naming it: the one home of this rule for the attention call and the fused layer."""
    if not isinstance(seq_offsets, torch.Tensor) or seq_offsets.dim() != 1 or seq_offsets.numel() < 1:
        got = (
            f"shape {tuple(seq_offsets.shape)}" if isinstance(seq_offsets, torch.Tensor) else type(seq_offsets).__name__
        )
        raise ValueError(f"seq_offsets must be a 1-D tensor of B+1 offsets, got {got}")
    if seq_offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seq_offsets must be int32 or int64, got {seq_offsets.dtype}")
    if device is not None and seq_offsets.device != device:
        raise ValueError(f"seq_offsets is on {seq_offsets.device}, the inputs on {device}")


def validate_hstu_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    check_offsets: bool = True,
    check_head_dims: bool = True,
) -> None:
    """Raise ``ValueError`` naming the argument when inputs break the contract (docs/CONTRACTS.md).

    ``check_offsets`` reads the offsets on the host (one sync; ``input_check`` has the sync-free
    device check); ``check_head_dims`` limits head dims to the kernels' (the reference takes any).
    """
    dims = SUPPORTED_HEAD_DIMS if check_head_dims else None
    args = (q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen)
    if shapes_look_valid(*args, dims):
        if check_offsets:
            check_offsets_host(seq_offsets, num_targets, q.shape[0], max_seq_len)
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have rank 3 (L, H, D), got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {t.dtype}")
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must have shape (L, H, Dv) = ({q.shape[0]}, {q.shape[1]}, Dv), got {tuple(v.shape)}")
    if q.shape[1] < 1:  # an empty launch grid (or dispatch's num_heads error, naming no argument)
        raise ValueError(f"q, k and v must have at least one head (L, H, D with H >= 1), got q {tuple(q.shape)}")
    for name, d in (("q/k head dim (Dqk)", q.shape[2]), ("v head dim (Dv)", v.shape[2])):
        if check_head_dims and d not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"{name} must be one of {SUPPORTED_HEAD_DIMS}, got {d}")
        if d < 1:
            raise ValueError(f"{name} must be at least 1, got {d}")
    check_offsets_format(seq_offsets, None)
    if num_targets is not None and not isinstance(num_targets, torch.Tensor):
        raise ValueError(f"num_targets must be a 1-D int tensor or None, got {type(num_targets).__name__}")
    devices = {str(t.device) for t in (q, k, v, seq_offsets)} | (
        set() if num_targets is None else {str(num_targets.device)}
    )
    if len(devices) != 1:
        raise ValueError(f"q, k, v, seq_offsets and num_targets must be on one device, got {sorted(devices)}")
    check_max_seq_len(max_seq_len)
    batch = seq_offsets.numel() - 1
    if num_targets is not None:
        if num_targets.dim() != 1 or num_targets.numel() != batch:
            raise ValueError(f"num_targets must have shape ({batch},), got {tuple(num_targets.shape)}")
        if num_targets.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"num_targets must be int32 or int64, got {num_targets.dtype}")
    check_mask_lengths(contextual_seq_len, max_attn_len)
    if scaling_seqlen is not None and (not _is_int(scaling_seqlen) or not 0 < scaling_seqlen < MAX_SEQ_LEN_LIMIT):
        raise ValueError(f"scaling_seqlen must be a positive int below 2**31 or None, got {scaling_seqlen!r}")
    if scaling_seqlen is None and max_seq_len == 0 and q.shape[0] > 0:
        raise ValueError("max_seq_len must be positive when it is the divisor (scaling_seqlen is None)")
    if check_offsets:
        check_offsets_host(seq_offsets, num_targets, q.shape[0], max_seq_len)


class HSTUAttentionFunction(torch.autograd.Function):
    """Triton forward and backward; the backward recomputes S from q, k (no saved P). It launches the
    unchecked entries: ``hstu_attention`` validated the inputs and configs (unless told not to), and the autograd
    engine hands the backward a ``do`` of the output's shape, dtype and device."""

    @staticmethod
    def forward(
        ctx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        alpha: float,
        num_targets: torch.Tensor | None,
        contextual_seq_len: int,
        max_attn_len: int,
        scaling_seqlen: int | None,
        fwd_config: HSTUFwdConfig,
        bwd_config: HSTUBwdConfig,
    ) -> torch.Tensor:
        out = hstu_attention_fwd_validated(
            q,
            k,
            v,
            seq_offsets,
            max_seq_len,
            alpha,
            num_targets,
            contextual_seq_len,
            max_attn_len,
            scaling_seqlen,
            fwd_config,
        )
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.args = (max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen, bwd_config)
        return out

    @staticmethod
    def backward(ctx, do: torch.Tensor):
        q, k, v, seq_offsets, num_targets = ctx.saved_tensors
        max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen, bwd_config = ctx.args
        dq, dk, dv = hstu_attention_bwd_validated(
            do,
            q,
            k,
            v,
            seq_offsets,
            max_seq_len,
            alpha,
            num_targets,
            contextual_seq_len,
            max_attn_len,
            scaling_seqlen,
            bwd_config,
        )
        dq, dk, dv = first_order_only((dq, dk, dv), (do, q, k, v))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


ATTENTION_SECOND_ORDER = (
    "hstu_attention: the kernels' gradients are not differentiable (no double backward); "
    "use source='reference' for higher-order gradients"
)


class _FirstOrderOnly(torch.autograd.Function):
    """A kernel gradient passed through unchanged, whose own gradient raises when anything needs it."""

    @staticmethod
    def forward(ctx, message: str, grad: torch.Tensor, *sources: torch.Tensor) -> torch.Tensor:
        ctx.message = message
        return grad.clone()  # not a view: the caller may update it in place

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(ctx.message)


def first_order_only(grads: tuple, sources: tuple, message: str = ATTENTION_SECOND_ORDER) -> tuple:
    """``grads`` as they are, unless the backward builds a graph (``create_graph=True``): then each is tied to
    ``sources`` through a node that raises ``message`` when differentiated, so a gradient of a gradient fails
    loudly instead of treating the kernels' gradients as constants (silently dropping second-order terms)."""
    if not torch.is_grad_enabled() or not any(isinstance(t, torch.Tensor) and t.requires_grad for t in sources):
        return grads
    return tuple(g if g is None else _FirstOrderOnly.apply(message, g, *sources) for g in grads)


def hstu_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    alpha: float | None = None,
    num_targets: torch.Tensor | None = None,
    contextual_seq_len: int = 0,
    max_attn_len: int = 0,
    scaling_seqlen: int | None = None,
    fwd_config: HSTUFwdConfig | None = None,
    bwd_config: HSTUBwdConfig | None = None,
    validate: bool | str = True,
) -> torch.Tensor:
    """Jagged HSTU attention with the Triton templates (contract: the HSTU attention section of ``docs/CONTRACTS.md``).

    ``alpha`` defaults to 1/sqrt(Dqk); configs default to the heuristic for the head dims. ``validate``:
    True / "full" / "async" check every input on the host (one sync), False / "none" check nothing.
    """
    from .input_check import check_alpha, fit_grid, launch_lengths, launch_mask_lengths, validate_mode
    from .spec import grid_rows_triton_bwd, grid_rows_triton_fwd

    if alpha is not None:
        check_alpha(alpha)
    if validate_mode(validate) != "none":
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen
        )
    max_seq_len, scaling_seqlen = launch_lengths(max_seq_len, scaling_seqlen, q.shape[0])
    contextual_seq_len, max_attn_len = launch_mask_lengths(contextual_seq_len, max_attn_len, q.shape[0])
    # The kernels index offsets and targets densely: a strided view (a table's column) is compacted first.
    seq_offsets = seq_offsets.contiguous()
    num_targets = kernel_targets(None if num_targets is None else num_targets.contiguous(), contextual_seq_len,
                                 seq_offsets)  # fmt: skip
    if alpha is None:
        alpha = 1.0 / math.sqrt(q.shape[2])
    interp = _interpreting()
    if fwd_config is None:  # not ``or``: a falsy non-config ({}, 0) ran the default instead of being refused
        fwd_config = default_fwd_config(q.shape[2], v.shape[2], interp, q.dtype)
    if bwd_config is None:
        bwd_config = default_bwd_config(q.shape[2], v.shape[2], interp, q.dtype)
    if not isinstance(fwd_config, HSTUFwdConfig):
        raise ValueError(f"fwd_config must be an HSTUFwdConfig, got {type(fwd_config).__name__}")
    if not isinstance(bwd_config, HSTUBwdConfig):
        raise ValueError(f"bwd_config must be an HSTUBwdConfig, got {type(bwd_config).__name__}")
    config_fields(fwd_config, "fwd_config")  # a float tile or launch-order group failed inside Triton
    config_fields(bwd_config, "bwd_config")
    sizes = (grid_rows_triton_fwd(fwd_config), grid_rows_triton_bwd(bwd_config))
    max_seq_len, scaling_seqlen = fit_grid(max_seq_len, scaling_seqlen, seq_offsets, q.shape[0], sizes)
    return HSTUAttentionFunction.apply(
        q,
        k,
        v,
        seq_offsets,
        max_seq_len,
        float(alpha),
        num_targets,
        contextual_seq_len,
        max_attn_len,
        scaling_seqlen,
        fwd_config,
        bwd_config,
    )
