"""Custom ops ``hstu::attention_fwd`` / ``hstu::attention_bwd`` and the drop-in function and module.

The ops are registered with ``torch.library.custom_op`` (fake impls for tracing, autograd through
``register_autograd``), so ``torch.compile`` traces them without graph breaks and ``torch.export``
sees them as single nodes. Configs cross the op boundary as (backend name, JSON string) because
custom ops cannot take dataclasses; ``autotune.runtime.dispatch`` picks them, so model code never names a
backend or tile size.

Eager calls on plain tensors (no compile, export or tensor-subclass tracing active) skip the custom
op's Python dispatch (about 14 us a call) and run the same implementation through an autograd
function; anything traced still sees the custom op. The offsets check of "async" validation runs
once per offsets tensor: a call with the same, unmodified tensor object (its version counter
unchanged) and the same row count and ``max_seq_len`` is not checked again, so the layers of one
step share one check; likewise a backend that reads int32 offsets gets one cast per unchanged tensor.
Neither cache applies while a CUDA graph is captured: the graph records the check and the cast, which
replays then run on whatever the tensor holds.
"""

import functools
import math
import operator
import weakref

import torch
from torch import nn
from torch.autograd import forward_ad

from autotune.runtime import dispatch
from autotune.runtime.buckets import DISTRIBUTIONS
from autotune.runtime.gpus import interpreting
from kernel_templates.hstu_attention.config import SUPPORTED_HEAD_DIMS, padded_head_dim
from kernel_templates.hstu_attention.input_check import (
    check_alpha,
    check_offsets,
    fit_grid,
    launch_lengths,
    launch_mask_lengths,
    validate_mode,
)
from kernel_templates.hstu_attention.op import (
    check_grad,
    check_mask_lengths,
    first_order_only,
    kernel_targets,
    validate_hstu_grad,
    validate_hstu_inputs,
)
from kernel_templates.tensor_memo import MISS, TensorMemo

FWD = "hstu_attention_fwd"
BWD = "hstu_attention_bwd"


def _reference_sequences(
    seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, rows: int
) -> list[tuple[int, int, int | None]]:
    """(start, end, targets) of each sequence as the kernels read them (``triton_common.seq_info``): start in
    [0, L], end in [start, L], targets in [0, n]. Valid inputs are unchanged; with ``validate="none"`` bad offsets
    then give wrong rows of the call's shape, as the kernels do, where the reference failed inside torch on a
    shape mismatch, returned more rows than q has, or built a list of 2**40 row blocks for one huge offset."""
    offsets = seq_offsets.tolist()
    targets = None if num_targets is None else num_targets.tolist()
    seqs = []
    for b in range(len(offsets) - 1):
        start = min(max(int(offsets[b]), 0), rows)
        end = min(max(int(offsets[b + 1]), start), rows)
        t = None if targets is None else min(max(int(targets[b]), 0), end - start)
        seqs.append((start, end, t))
    return seqs


def _reference_fwd(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, attn_len, scaling):
    from kernel_templates.hstu_attention.reference import hstu_attention_reference

    rows = q.shape[0]
    # Each sequence on its own rows, as the reference computes them anyway; unchecked offsets (gaps, overlaps) leave
    # zeros where no sequence reads.
    out = torch.zeros((rows, q.shape[1], v.shape[2]), dtype=q.dtype, device=q.device)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        for start, end, t in _reference_sequences(seq_offsets, num_targets, rows):
            if end > start:
                nt = None if t is None else torch.tensor([t], dtype=torch.int64)
                out[start:end] = hstu_attention_reference(
                    q[start:end], k[start:end], v[start:end], torch.tensor([0, end - start], dtype=torch.int64),
                    max_seq_len, alpha, nt, ctx_len, attn_len, scaling,
                )  # fmt: skip
    return out


def _reference_bwd(do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, attn_len, scaling):
    """The HSTU backward in fp32 PyTorch, a block of query rows of one sequence at a time (``row_chunks``:
    bounded memory for any length); dK and dV add up over the blocks.

    Written out rather than autograd: autograd is off inside a custom op's implementation. Autocast
    is off too, so the reference stays fp32 inside a bf16-autocast model.
    """
    from kernel_templates.hstu_attention.reference import hstu_mask, row_chunks, score_scale

    dq = torch.zeros_like(q)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=t.device) for t in (k, v))
    # Divided per block, as the forward does: an empty batch's max_seq_len may be 0 (no block is ever scaled).
    scale = score_scale(max_seq_len, scaling)
    with torch.autocast(q.device.type, enabled=False):
        for start, end, nt in _reference_sequences(seq_offsets, num_targets, q.shape[0]):
            kb, vb = (t[start:end].float().transpose(0, 1) for t in (k, v))  # (H, n, D)
            for r0, r1 in row_chunks(end - start, q.shape[1]):
                rows = slice(start + r0, start + r1)
                qb, dob = (t[rows].float().transpose(0, 1) for t in (q, do))  # (H, rows, D)
                mask = hstu_mask(end - start, ctx_len, nt, attn_len, device=q.device, rows=(r0, r1)).float()
                mask = mask / scale
                s = alpha * torch.matmul(qb, kb.transpose(1, 2))
                sig = torch.sigmoid(s)
                p = s * sig * mask
                ds = torch.matmul(dob, vb.transpose(1, 2)) * mask * alpha * sig * (1 + s * (1 - sig))
                dq[rows] = torch.matmul(ds, kb).transpose(0, 1).to(q.dtype)
                dk[start:end] += torch.matmul(ds.transpose(1, 2), qb).transpose(0, 1)
                dv[start:end] += torch.matmul(p.transpose(1, 2), dob).transpose(0, 1)
    return dq, dk.to(k.dtype), dv.to(v.dtype)


_FWD_SCHEMA = (
    "(Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, int max_seq_len, float alpha, "
    "int contextual_seq_len, int max_attn_len, int? scaling_seqlen, str backend, str config, str bwd_backend, "
    "str bwd_config, str validate='async') -> Tensor"
)
_BWD_SCHEMA = (
    "(Tensor do, Tensor q, Tensor k, Tensor v, Tensor seq_offsets, Tensor? num_targets, int max_seq_len, "
    "float alpha, int contextual_seq_len, int max_attn_len, int? scaling_seqlen, str backend, str config, "
    "str validate='async') -> (Tensor, Tensor, Tensor)"
)


# Offsets that passed an "async" check, with the targets (a weakref) and rows / max_seq_len it was for.
_CHECKED = TensorMemo()


def check_call_offsets(backend: str, validate: str, seq_offsets, num_targets, rows: int, max_seq_len: int) -> None:
    """The offsets check of one op call; the reference reads the offsets on the host anyway, so its
    "async" is "full" (a ValueError at the call). An "async" check of an unchanged offsets tensor
    already checked with the same unchanged targets, rows and ``max_seq_len`` is skipped (never for targets
    made under inference mode, which have no version counter)."""
    mode = validate_mode(validate)
    if backend == "reference" and mode == "async":
        mode = "full"
    # Targets made under inference mode have no version counter to prove them unchanged: checked every call.
    if mode != "async" or (num_targets is not None and num_targets.is_inference()):
        check_offsets(mode, seq_offsets, num_targets, rows, max_seq_len)
        return
    key = (None if num_targets is None else num_targets._version, rows, max_seq_len)
    ref_nt = _CHECKED.get(seq_offsets, key)
    if ref_nt is not MISS and (ref_nt() if ref_nt is not None else None) is num_targets:
        return
    check_offsets(mode, seq_offsets, num_targets, rows, max_seq_len)
    _CHECKED.put(seq_offsets, weakref.ref(num_targets) if num_targets is not None else None, key)


# Index tensors a backend wants in another dtype (the CuTe kernels read int32 offsets) or that are strided,
# cast or compacted once per unchanged tensor rather than once per call; keyed by the target dtype.
_CAST = TensorMemo()


def _index_as(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """``t`` contiguous and in ``dtype`` (the backend's index dtype; None: its own), from a cache while ``t``
    is unchanged.

    The kernels index offsets and targets densely, so a strided view (a column of a per-sequence table) is
    compacted first; read as it is, it gave the neighbouring column's values. Layers of one step pass the
    same offsets: one cast a step instead of one per kernel. Under CUDA-graph capture, one recorded cast
    per capture (``TensorMemo``), which every replay reruns on the new contents."""
    if t is None or ((dtype is None or t.dtype == dtype) and t.is_contiguous()):
        return t
    dtype = t.dtype if dtype is None else dtype
    if type(t) is not torch.Tensor:
        return t.to(dtype).contiguous()
    out = _CAST.get(t, (dtype,))
    if out is MISS:
        out = t.to(dtype).contiguous()
        _CAST.put(t, out, (dtype,))
    return out


# Explicit schemas: no reliance on annotation inference across torch versions.
@torch.library.custom_op("hstu::attention_fwd", mutates_args=(), schema=_FWD_SCHEMA)
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    backend: str,
    config: str,
    bwd_backend: str,
    bwd_config: str,
    validate: str = "async",
) -> torch.Tensor:
    """Forward with an explicit backend/config. ``bwd_*`` ride along for the autograd backward.

    ``validate`` checks shapes, dtypes and devices (naming the argument) and the offsets as
    ``hstu_attention`` documents; "none" trusts them.
    """
    if validate_mode(validate) != "none":
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
            check_offsets=False, check_head_dims=backend != "reference",
        )  # fmt: skip
        if not math.isfinite(alpha):  # a NaN or infinite alpha made every output NaN
            check_alpha(alpha)
    backend, config, max_seq_len, scaling_seqlen = _fit_launch(
        FWD, backend, config, q, v, seq_offsets, max_seq_len, scaling_seqlen
    )
    return _fwd_impl(
        q, k, v, seq_offsets, num_targets, max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen,
        backend, config, validate,
    )  # fmt: skip


def _fit_launch(
    kind: str,
    backend: str,
    config: str,
    q: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    scaling: int | None,
) -> tuple[str, str, int, int | None]:
    """(backend, config, max_seq_len, divisor) that CUDA's 65535-block grid can launch, for calls that reach the
    custom op without the eager public call's sizing (``torch.compile``, a direct ``torch.ops.hstu`` call): a
    batch over the grid's y dimension leaves a grid-order CuTe config for the Triton default
    (``dispatch.for_batch``), and a loose max_seq_len past the grid launches for the longest sequence with the
    divisor kept (``fit_grid``). Both leave every ordinary call as it is, without reading the offsets."""
    if backend == "reference":
        return backend, config, max_seq_len, scaling
    batch = seq_offsets.shape[0] - 1  # for_batch keeps the choice unless the batch is over the grid's y dimension
    backend, config = dispatch.for_batch(kind, backend, config, batch, q.shape[2], v.shape[2], q.dtype, q.shape[1])
    sizes = (dispatch.grid_rows(kind, backend, config),)
    max_seq_len, scaling = fit_grid(max_seq_len, scaling, seq_offsets, q.shape[0], sizes)
    return backend, config, max_seq_len, scaling


def _fwd_impl(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, backend, config, validate):
    check_call_offsets(backend, validate, seq_offsets, num_targets, q.shape[0], max_seq_len)
    if backend == "reference":
        return _reference_fwd(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling)
    if not q.is_cuda and validate != "none" and cuda_present():  # after every argument check, before the launch
        check_kernel_device(q)
    launcher, cfg, index = dispatch.runner(backend, FWD, config)
    seq_offsets, num_targets = _index_as(seq_offsets, index), _index_as(num_targets, index)
    num_targets = kernel_targets(num_targets, ctx_len, seq_offsets)
    max_seq_len, scaling = launch_lengths(max_seq_len, scaling, q.shape[0])
    ctx_len, win = launch_mask_lengths(ctx_len, win, q.shape[0])
    return launcher(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, ctx_len, win, scaling, cfg)


@attention_fwd.register_fake
def _(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx, win, scaling, backend, config, bb, bc, validate=""):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@torch.library.custom_op("hstu::attention_bwd", mutates_args=(), schema=_BWD_SCHEMA)
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    max_seq_len: int,
    alpha: float,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    backend: str,
    config: str,
    validate: str = "async",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) with an explicit backend/config; recomputes S from q, k.

    The autograd backward passes ``validate="none"``: its forward checked the same offsets. The gradients are
    contiguous, as the fake impl says: the launchers follow q, k and v's strides in some modes and not in others,
    and a compiled backward of permuted views failed the stride check of the fake's strides.
    """
    grads = _bwd_impl(
        do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, contextual_seq_len, max_attn_len, scaling_seqlen,
        backend, config, validate, fit=True,
    )  # fmt: skip
    return tuple(g.contiguous() for g in grads)


def _bwd_impl(
    do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, backend, config, validate,
    fit: bool = False,
):  # fmt: skip
    """``fit``: size the launch for the grid here (``_fit_launch``; the custom op), not in the public call.

    Shapes before offsets, as the forward op checks them: the offsets check indexes the offsets and takes
    ``max_seq_len`` as a bound, so 2-D or empty offsets failed inside it naming nothing, and a negative
    ``max_seq_len`` was reported as below the longest sequence."""
    if validate_mode(validate) != "none":  # the autograd backward passes "none": its forward checked these
        _check_bwd_inputs(do, q, k, v, seq_offsets, max_seq_len, num_targets, ctx_len, win, scaling, backend)
        if not math.isfinite(alpha):
            check_alpha(alpha)
    check_call_offsets(backend, validate, seq_offsets, num_targets, q.shape[0], max_seq_len)
    if backend == "reference":
        return _reference_bwd(do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling)
    if fit:
        fitted = _fit_launch(BWD, backend, config, q, v, seq_offsets, max_seq_len, scaling)
        backend, config, max_seq_len, scaling = fitted
    launcher, cfg, index = dispatch.runner(backend, BWD, config)
    seq_offsets, num_targets = _index_as(seq_offsets, index), _index_as(num_targets, index)
    num_targets = kernel_targets(num_targets, ctx_len, seq_offsets)
    max_seq_len, scaling = launch_lengths(max_seq_len, scaling, q.shape[0])
    ctx_len, win = launch_mask_lengths(ctx_len, win, q.shape[0])
    dq, dk, dv = launcher(do, q, k, v, seq_offsets, max_seq_len, alpha, num_targets, ctx_len, win, scaling, cfg)
    return dq.to(q.dtype), dk, dv


def _check_bwd_inputs(do, q, k, v, seq_offsets, max_seq_len, num_targets, ctx_len, win, scaling, backend) -> None:
    """Shapes, dtypes and devices of a direct backward call (no launcher checks them), naming the argument."""
    validate_hstu_inputs(
        q, k, v, seq_offsets, max_seq_len, num_targets, ctx_len, win, scaling,
        check_offsets=False, check_head_dims=backend != "reference",
    )  # fmt: skip
    validate_hstu_grad(do, q, v)


@attention_bwd.register_fake
def _(do, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx, win, scaling, backend, config, validate=""):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))  # contiguous, as the op returns them


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling = inputs[:10]
    bb, bc = inputs[12:14]
    ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
    ctx.args = (max_seq_len, alpha, ctx_len, win, scaling, bb, bc)


def _saved_backward(ctx, do: torch.Tensor, bwd) -> tuple:
    """The gradients of an attention node from what its forward saved, through ``bwd`` (the custom op, or the
    implementation for the eager autograd function); None for its 12 non-tensor inputs."""
    q, k, v, seq_offsets, num_targets = ctx.saved_tensors
    max_seq_len, alpha, ctx_len, win, scaling, bb, bc = ctx.args
    dq, dk, dv = bwd(
        do.contiguous(), q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, bb, bc, "none"
    )
    if bb != "reference":  # the written-out reference backward is itself differentiable
        dq, dk, dv = first_order_only((dq, dk, dv), (do, q, k, v))
    return dq, dk, dv, *([None] * 12)


def _backward(ctx, do):
    """The custom op's backward. The reference's, run eagerly, is the implementation itself, as the eager autograd
    function runs it: ``hstu::attention_bwd`` has no autograd formula, so a double backward through it (q, k, v as
    ``nn.Parameter``s, which take the custom op, or ``torch.compile(backend="eager")``) raised. Traced, the op."""
    eager_reference = ctx.args[5] == "reference" and _eager(do)
    return _saved_backward(ctx, do, _bwd_impl if eager_reference else attention_bwd)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


@torch.compiler.assume_constant_result
def _choose(
    dtype: torch.dtype,
    dqk: int,
    dv: int,
    heads: int,
    max_seq_len: int,
    distribution: str | None,
    source: str,
    mask: str = "causal",
    fill: float | None = None,
) -> tuple[str, str, str, str]:
    """(fwd backend, fwd config, bwd backend, bwd config) for the call's shape, heads and mask features
    (and fill ratio, without a distribution hint). Under torch.compile the result is a trace-time
    constant (dispatch is deterministic), so the graph holds the op with plain strings."""
    fwd = dispatch.select(FWD, dtype, dqk, dv, heads, max_seq_len, distribution, source, mask, fill)
    bwd = dispatch.select(BWD, dtype, dqk, dv, heads, max_seq_len, distribution, source, mask, fill)
    return fwd.backend, fwd.config, bwd.backend, bwd.config


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
    *,
    source: str = "tuned",
    distribution: str | None = None,
    validate: str | bool = "async",
) -> torch.Tensor:
    """Jagged HSTU attention (contract: docs/CONTRACTS.md) with the config dispatch picks for this shape.

    q, k, v must share one dtype (cast before calling under autocast). Head dims the kernels lack (up to
    256, say 48 or 96) run zero-padded to the next kernel head dim (32, 64, 128, 256). ``source`` is "tuned"
    (artifacts from ``autotune.load``, with fallbacks), "default" (heuristic) or "reference".
    ``distribution`` ("uniform" / "jagged" / "sparse") picks the entries tuned on that length distribution;
    None (default) lets dispatch match the batch's fill ratio L / (B x max_seq_len) to the fill each
    entry was tuned on (shapes only, no sync); when none is close, the lowest-fill entry for a call
    more skewed than every tuned batch, else the uniform entry.

    No offsets make a kernel read or write out of bounds: the kernels clamp what they read from
    ``seq_offsets`` and ``num_targets``; tensors of the wrong shape are stopped by the host checks (all
    modes but "none"). ``validate`` says how bad inputs are reported (True/False are the old spellings of
    "async"/"none"):

    - "async" (default): shapes, dtypes, strides and devices checked on the host (about 2 us, no
      sync), plus one launch of a one-program check kernel on a GPU (no sync, no allocation): bad
      offsets (not starting at 0, decreasing, not ending at ``q.shape[0]``, e.g. (H, L, D) tensors),
      a ``max_seq_len`` below the longest sequence or ``num_targets`` outside [0, length] fail a
      device assertion naming the argument (on stderr); the error surfaces at the next
      synchronisation as "device-side assert triggered" and the CUDA context is lost, as with any
      device assertion. On CPU, and with source="reference" (which reads the offsets anyway), the
      same check runs on the host and raises ``ValueError`` at the call.
    - "full": the shape checks plus the offsets read on the host: one host-device sync per call
      (tens of microseconds, the CPU can no longer run ahead of the GPU, and no CUDA-graph capture);
      ``ValueError`` naming the argument and the bad value, at the call. For debugging and for data
      you do not trust.
    - "none": no check at all: bad shapes or offsets give wrong results (never an out-of-bounds
      access through the offsets; shapes and strides are trusted).

    ``benchmarks/bench_validation.py`` measures the per-call host cost of each mode.
    """
    mode = validate_mode(validate)
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        name, t = next((n, t) for n, t in (("q", q), ("k", k), ("v", v)) if not isinstance(t, torch.Tensor))
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k and v must share a dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if forward_ad._current_level >= 0 and source != "reference":  # inside a dual level only: no cost otherwise
        _refuse_tangents(q, k, v)
    if torch._C._are_functorch_transforms_active() and torch.is_grad_enabled():
        _refuse_func_grad(q, k, v)
    if distribution is not None and distribution not in DISTRIBUTIONS:
        _refuse_distribution(distribution)
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) a float alpha (or the default of a padded
    # head dim, 1/sqrt(a symbolic Dqk)) is a SymFloat, which a comparison guards on and math.isfinite cannot trace.
    if alpha is not None and (type(alpha) is not float or not -math.inf < alpha < math.inf):
        check_alpha(alpha)
    if source != "reference" and (q.dim() == 3 and v.dim() == 3) and _needs_padding(q.shape[2], v.shape[2]):
        return _padded_call(
            q, k, v, seq_offsets, max_seq_len, alpha, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
            source, distribution, mode,
        )  # fmt: skip
    if mode != "none":
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen,
            check_offsets=False, check_head_dims=source != "reference",
        )  # fmt: skip
    # Dispatch takes plain ints: under torch.compile a dynamic dim or int argument is specialised here (a
    # guard; ``int()`` would keep it symbolic), and the fill ratio, which changes with every jagged batch, is left
    # out (dispatch then uses the bucket alone). Eager calls take the cheap ``int()``.
    compiling = torch.compiler.is_compiling()
    as_int = _static_int if compiling else int
    dqk, dv, heads = as_int(q.shape[2]), as_int(v.shape[2]), as_int(q.shape[1])
    max_seq_len, ctx_len, win = as_int(max_seq_len), as_int(contextual_seq_len), as_int(max_attn_len)
    mask = dispatch.mask_of(ctx_len, num_targets is not None, win)
    rows, batch = q.shape[0], seq_offsets.shape[0] - 1
    # The fill ratio is host-side shape arithmetic (no sync); traced calls with symbolic rows keep None.
    plain = not compiling and type(rows) is int and type(batch) is int
    # No sequence is longer than q has rows, so a loose max_seq_len chooses by the rows (as it launches).
    longest = launch_lengths(max_seq_len, None, rows)[0] if plain else max_seq_len
    fill = dispatch.call_fill(rows, batch, longest) if plain else None
    fwd_backend, fwd_config, bwd_backend, bwd_config = _choose(
        q.dtype, dqk, dv, heads, longest, distribution, source, mask, fill
    )
    if plain and batch > dispatch.GRID_YZ_MAX:
        fwd_backend, fwd_config = dispatch.for_batch(FWD, fwd_backend, fwd_config, batch, dqk, dv, q.dtype, heads)
        bwd_backend, bwd_config = dispatch.for_batch(BWD, bwd_backend, bwd_config, batch, dqk, dv, q.dtype, heads)
    if alpha is None:
        alpha = 1.0 / math.sqrt(dqk)
    scaling = None if scaling_seqlen is None else as_int(scaling_seqlen)
    if plain:  # a launch past the grid's limit reads the longest sequence instead (never on ordinary calls)
        sizes = (dispatch.grid_rows(FWD, fwd_backend, fwd_config), dispatch.grid_rows(BWD, bwd_backend, bwd_config))
        max_seq_len, scaling = fit_grid(max_seq_len, scaling, seq_offsets, rows, sizes)
    args = (
        q, k, v, seq_offsets, num_targets, max_seq_len, float(alpha), ctx_len,
        win, scaling, fwd_backend, fwd_config, bwd_backend, bwd_config, mode,
    )  # fmt: skip
    if _eager(q, k, v):
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return _fwd_impl(*args[:10], fwd_backend, fwd_config, mode)  # nothing to differentiate
        return _AttentionFunction.apply(*args)
    return attention_fwd(*args)


def _refuse_tangents(*tensors: torch.Tensor) -> None:
    """A ``NotImplementedError`` for dual tensors (forward-mode AD): the kernels have no jvp, and a call whose
    inputs need no grad ran them on the primals and returned an output with no tangent (a zero derivative)."""
    if any(forward_ad.unpack_dual(t).tangent is not None for t in tensors):
        raise NotImplementedError(
            "hstu_attention: the kernels have no forward-mode AD (jvp); use source='reference' for it"
        )


def _refuse_func_grad(*tensors: torch.Tensor) -> None:
    """A ``NotImplementedError`` under a torch.func transform that differentiates (``grad``, ``vjp``, ``jacrev``):
    a custom op's autograd formula (``register_autograd``) is not a function those transforms take, and PyTorch's
    own error named neither this call nor a way out. ``vmap`` alone (nothing requires grad) still runs."""
    if any(t.requires_grad for t in tensors):
        raise NotImplementedError(
            "hstu_attention: torch.func.grad / vjp / jacrev cannot differentiate the attention custom op; "
            "use torch.autograd.grad (or loss.backward()) for its gradients"
        )


def _static_int(x: object) -> int:
    """``x`` as a plain int. Under ``torch.compile(dynamic=True)`` dims and int arguments are symbolic, and
    ``int()`` keeps them so (``_choose`` then cannot trace); ``operator.index`` specialises one with a guard.
    A float (only unchecked calls, ``validate="none"``, get here with one) is truncated as ``int()`` does."""
    return int(x) if isinstance(x, float) else operator.index(x)


def _refuse_large_head_dims(dqk: int, dv: int) -> None:
    """A head dim above the kernels' largest is refused as such: the template's "must be one of (32, 64, 128,
    256)" read as if 48 or 96 were refused too, which this call pads."""
    for name, d in (("q/k head dim (Dqk)", dqk), ("v head dim (Dv)", dv)):
        if d > SUPPORTED_HEAD_DIMS[-1]:
            raise ValueError(
                f"{name} must be at most {SUPPORTED_HEAD_DIMS[-1]} (a smaller one is zero-padded to the next of "
                f"{SUPPORTED_HEAD_DIMS}), got {d}"
            )


def _needs_padding(dqk: int, dv: int) -> bool:
    """A head dim the kernels lack while a larger one covers both; one above the largest is refused here, off
    the hot path (a kernel head dim never gets past the first test)."""
    dims = (dqk, dv)
    if any(d not in SUPPORTED_HEAD_DIMS for d in dims):
        _refuse_large_head_dims(dqk, dv)
        return all(padded_head_dim(d) is not None for d in dims)
    return False


@functools.cache
def cuda_present() -> bool:
    """Whether this process has a CUDA device, asked once: a CPU host's calls (the interpreter's) skip the device
    check below at the cost of a cached call."""
    return torch.cuda.is_available()


def check_kernel_device(t: torch.Tensor, names: str = "q, k, v and seq_offsets") -> None:
    """The kernels take CUDA tensors, or CPU ones under the Triton interpreter. On a GPU host, CPU tensors reached
    the launch and failed there, naming no argument ("Pointer argument (at 0) cannot be accessed from Triton"). A
    trace (``torch.export`` of a model on CPU example inputs, for its tasks) runs no kernel and passes."""
    if t.device.type == "cpu" and not interpreting() and cuda_present() and not dispatch.tracing():
        raise ValueError(
            f"{names} are on {t.device}: the kernels need them on a CUDA device (or set TRITON_INTERPRET=1 to run "
            "the Triton kernels on the CPU); the 'reference' source runs on any device"
        )


def _padded_call(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, ctx_len, win, scaling, source, dist, mode):
    """``hstu_attention`` for head dims the kernels lack (say 48, 96 or 192): q, k and v zero-padded to the next
    kernel head dim, which changes no score (zero columns add nothing to q k^T) and only adds zero output
    columns, sliced off; gradients flow back through the pad. ``alpha`` defaults from the true Dqk."""
    if mode != "none":
        validate_hstu_inputs(
            q, k, v, seq_offsets, max_seq_len, num_targets, ctx_len, win, scaling,
            check_offsets=False, check_head_dims=False,
        )  # fmt: skip
    dqk, dv = q.shape[2], v.shape[2]
    pqk, pv = padded_head_dim(dqk), padded_head_dim(dv)
    if alpha is None:
        alpha = 1.0 / math.sqrt(dqk)
    q, k = (torch.nn.functional.pad(t, (0, pqk - dqk)) for t in (q, k))
    v = torch.nn.functional.pad(v, (0, pv - dv))
    padded = hstu_attention(
        q, k, v, seq_offsets, max_seq_len, alpha, num_targets, ctx_len, win, scaling,
        source=source, distribution=dist, validate=mode,
    )  # fmt: skip
    out = padded[..., :dv].contiguous()
    # What backward_call needs to find the kernels: eager outputs only (a traced one has no node to run, and
    # reading grad_fn broke torch.compile(fullgraph=True) of inputs that require grad).
    if _eager(out) and out.grad_fn is not None and padded.grad_fn is not None:
        out.grad_fn.metadata[_PADDED] = (padded.grad_fn, dqk, dv, pv)
    return out


# Metadata key on the output node of a zero-padded call: (the attention node, Dqk, Dv, padded Dv).
_PADDED = "hstu_attention.padded"


def _eager(*tensors: torch.Tensor) -> bool:
    """Plain tensors with data (meta tensors have none: the custom op's fake gives their shapes) and nothing
    tracing: the custom op's dispatch can be skipped."""
    return (
        all(type(t) is torch.Tensor and not t.is_meta for t in tensors)
        and not torch.compiler.is_compiling()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._are_functorch_transforms_active()
    )


class _AttentionFunction(torch.autograd.Function):
    """The eager path of ``hstu::attention_fwd``: the same implementation and backward, without the
    custom op's Python dispatch."""

    @staticmethod
    def forward(
        ctx, q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, fb, fc, bb, bc, mode
    ):
        out = _fwd_impl(q, k, v, seq_offsets, num_targets, max_seq_len, alpha, ctx_len, win, scaling, fb, fc, mode)
        ctx.save_for_backward(q, k, v, seq_offsets, num_targets)
        ctx.args = (max_seq_len, alpha, ctx_len, win, scaling, bb, bc)
        return out

    @staticmethod
    def backward(ctx, do):
        return _saved_backward(ctx, do, _bwd_impl)


def backward_call(out: torch.Tensor, do: torch.Tensor):
    """A callable running the backward of ``out`` (an eager ``hstu_attention`` output) for ``do`` directly,
    not through the autograd engine: the kernels a ``backward()`` launches for this call, in the caller's
    thread and stream, so a benchmark can capture them in a CUDA graph. Returns (dq, dk, dv) of the caller's
    shapes: for a zero-padded head dim, ``do`` is padded and the gradients sliced, as autograd does.

    ``do`` is checked here, by name (the backward node trusts it: a short one was read out of bounds)."""
    node = out.grad_fn if isinstance(out, torch.Tensor) else None
    padded = None if node is None else node.metadata.get(_PADDED)
    if padded is not None:
        node = padded[0]
    if node is None or not isinstance(node, _AttentionFunction._backward_cls):
        raise ValueError("out must be the output of an eager hstu_attention call that requires grad")
    check_grad(do, out.shape, out.dtype, out.device, "out's")

    def run():
        with torch.no_grad():  # as the engine runs a backward without create_graph
            if padded is None:
                return node.apply(do)[:3]
            _, dqk, dv, pv = padded
            dq, dk, dv_ = node.apply(torch.nn.functional.pad(do, (0, pv - dv)))[:3]
            return dq[..., :dqk], dk[..., :dqk], dv_[..., :dv]

    return run


def _refuse_distribution(distribution: object) -> None:
    """The length-law hint must be None or a known law (a typo would silently serve the nearest entry)."""
    raise ValueError(f"distribution must be None or one of {DISTRIBUTIONS}, got {distribution!r}")


class HSTUAttention(nn.Module):
    """Drop-in jagged HSTU attention module: ``(q, k, v, seq_offsets, max_seq_len) -> out``.

    Holds no parameters; it fixes the kernel source, the length distribution hint and the
    ``validate`` mode of ``hstu_attention`` ("async" by default).
    """

    def __init__(
        self,
        source: str = "tuned",
        distribution: str | None = None,
        contextual_seq_len: int = 0,
        max_attn_len: int = 0,
        validate: str | bool = "async",
    ) -> None:
        super().__init__()
        if source not in dispatch.SOURCES:
            raise ValueError(f"source={source!r}: unknown kernel source; expected one of {dispatch.SOURCES}")
        # Checked here as the call checks them: a module built with a typo failed only at its first call.
        if distribution is not None and distribution not in DISTRIBUTIONS:
            _refuse_distribution(distribution)
        check_mask_lengths(contextual_seq_len, max_attn_len)
        self.validate = validate_mode(validate)
        self.source = source
        self.distribution = distribution
        self.contextual_seq_len = contextual_seq_len
        self.max_attn_len = max_attn_len

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        seq_offsets: torch.Tensor,
        max_seq_len: int,
        alpha: float | None = None,
        num_targets: torch.Tensor | None = None,
        scaling_seqlen: int | None = None,
    ) -> torch.Tensor:
        """``hstu_attention`` with the module's fixed settings. The mask lengths are fixed at construction, so the
        eighth positional argument here is ``scaling_seqlen`` (the function's is ``contextual_seq_len``)."""
        return hstu_attention(
            q,
            k,
            v,
            seq_offsets,
            max_seq_len,
            alpha,
            num_targets,
            self.contextual_seq_len,
            self.max_attn_len,
            scaling_seqlen,
            source=self.source,
            distribution=self.distribution,
            validate=self.validate,
        )

    def extra_repr(self) -> str:
        return f"source={self.source!r}, distribution={self.distribution!r}, validate={self.validate!r}"
