"""The offsets check of jagged HSTU attention: what no shape check can see, in three modes.

``seq_offsets`` (and ``num_targets``) live on the device, so whether they start at 0, end at the row
count L, never decrease, fit ``max_seq_len`` and bound the targets is only known after reading them.
The kernels clamp what they read (``triton_common.seq_info`` and the CuTe prologues), so a bad batch
can give wrong rows but never an out-of-bounds access; this module tells the caller about it:

- ``"full"``: read the offsets on the host (one host-device sync) and raise ``ValueError`` naming the
  argument and the offending value, at the call.
- ``"async"`` (the default of ``autotune.runtime.ops.hstu_attention``): on a CUDA device, one extra launch of
  a one-program Triton kernel that loops over the batch and fails a device-side assertion naming the
  argument (printed on stderr by the CUDA runtime). No sync and no allocation: the error surfaces at
  the next synchronisation as ``RuntimeError: CUDA error: device-side assert triggered`` and, as with
  every device assertion (PyTorch's index checks included), the process's CUDA context is lost. Re-run
  with ``validate="full"`` to get the ``ValueError`` with the values. On CPU (the Triton interpreter,
  the reference) the host check is as cheap as a launch, so "async" raises the ``ValueError`` at the call.
- ``"none"``: no check; the kernels' clamps still keep every access in bounds.
"""

from __future__ import annotations

import math
import numbers
import os
import warnings
from collections.abc import Iterable

import torch
import triton
import triton.language as tl

from kernel_templates.grid_limits import GRID_YZ_MAX

VALIDATE_MODES = ("async", "full", "none")

# Error bits of one offsets check; the device kernel writes the same mask (literals there, same order).
BAD_START, BAD_END, DECREASING, TOO_LONG, BAD_TARGETS = 1, 2, 4, 8, 16
MESSAGES = {
    BAD_START: "seq_offsets must start at 0",
    BAD_END: "seq_offsets must end at L = q.shape[0] (q, k, v are (L, H, D), not (H, L, D))",
    DECREASING: "seq_offsets must be non-decreasing",
    TOO_LONG: "max_seq_len is below the longest sequence",
    BAD_TARGETS: "num_targets must be within [0, sequence length] for every sequence",
}
_BLOCK = 512


def validate_mode(validate: bool | str) -> str:
    """The mode name of a ``validate`` argument: True/False are the old spellings of "async"/"none"."""
    if validate is True:
        return "async"
    if validate is False:
        return "none"
    if isinstance(validate, str) and validate in VALIDATE_MODES:
        return validate
    raise ValueError(f"validate must be one of {VALIDATE_MODES} (or True/False), got {validate!r}")


def launch_lengths(max_seq_len: int, scaling_seqlen: int | None, rows: int) -> tuple[int, int | None]:
    """(the length a launch is sized for, the divisor to pass): ``max_seq_len`` capped at q's row count.

    No sequence is longer than q has rows, so the capped launch still covers every real tile, while a loose
    upper bound (say 2**24) would size the kernels' grids past CUDA's limits (a launch error) and their tile
    tables for tiles that cannot exist. When it caps, the divisor (``scaling_seqlen``, default max_seq_len)
    is passed explicitly, so the result is unchanged."""
    if max_seq_len <= rows or rows < 1:
        return max_seq_len, scaling_seqlen
    return rows, max_seq_len if scaling_seqlen is None else scaling_seqlen


def launch_mask_lengths(contextual_seq_len: int, max_attn_len: int, rows: int) -> tuple[int, int]:
    """(context, window) a launch takes: each capped at ``rows + 1``, which leaves every sequence's mask as it is.

    The kernels add a position id, the window and the context in int32: a window near 2**31 (an "unbounded"
    one) wrapped in the backward's row range and dropped every gradient term, and a context and window both
    that large wrapped the forward's key range to rows outside the sequence (an out-of-bounds read). No
    sequence has more than ``rows`` positions (the kernels clamp the offsets to them), so its ids differ by at
    most ``rows`` and a window above that masks nothing, and a context longer than the sequence leaves the
    diagonal alone whatever its length; both keep their on/off flags (kernel variant and dispatch mask)."""
    return min(contextual_seq_len, rows + 1), min(max_attn_len, rows + 1)


def fit_grid(
    max_seq_len: int, scaling_seqlen: int | None, seq_offsets: torch.Tensor, rows: int, block_rows: Iterable[int | None]
) -> tuple[int, int | None]:
    """(max_seq_len, divisor) that every launch grid can hold: the arguments as given while each kernel's
    ``cdiv(launch length, rows per block)`` fits ``GRID_YZ_MAX`` (``block_rows``: rows one grid block covers
    per kernel, None for one whose grid holds any length), as on every call but huge ones.

    A launch length over it comes from a loose ``max_seq_len`` over a batch of millions of rows, or from a
    sequence that long. The longest sequence is then read from the offsets (one host-device sync, warned)
    and launched for, with the divisor passed explicitly so the result is unchanged; a sequence itself too
    long for the grid, or a CUDA graph being captured (no sync allowed), is a ``ValueError`` naming
    max_seq_len, instead of a launch error."""
    sizes = [b for b in block_rows if b]
    limit = GRID_YZ_MAX * min(sizes) if sizes else 0
    if not sizes or rows < 1 or launch_lengths(max_seq_len, scaling_seqlen, rows)[0] <= limit:
        return max_seq_len, scaling_seqlen  # (no rows: nothing is launched)
    if seq_offsets.is_cuda and torch.cuda.is_current_stream_capturing():
        raise ValueError(
            f"max_seq_len: {max_seq_len} over {rows} rows sizes a launch grid past CUDA's {GRID_YZ_MAX} blocks "
            f"({min(sizes)} rows each), and the longest sequence cannot be read during CUDA graph capture; "
            f"pass a max_seq_len of at most {limit}"
        )
    longest = int((seq_offsets[1:] - seq_offsets[:-1]).max()) if seq_offsets.numel() > 1 else 0
    if longest > max_seq_len:
        raise ValueError(f"{MESSAGES[TOO_LONG]}: max_seq_len={max_seq_len}, a sequence of {longest} rows")
    if longest > limit:
        raise ValueError(
            f"max_seq_len: a sequence of {longest} rows needs more than the {GRID_YZ_MAX} blocks of {min(sizes)} "
            f"rows a launch grid holds; sequences of at most {limit} rows run"
        )
    warnings.warn(
        f"max_seq_len={max_seq_len} over {rows} rows sizes a launch grid past CUDA's limit: the longest "
        "sequence was read from seq_offsets (a host-device sync per such call); a max_seq_len closer to the "
        "longest sequence avoids it",
        stacklevel=3,
    )
    return max(longest, 1), max_seq_len if scaling_seqlen is None else scaling_seqlen


def check_alpha(alpha: object) -> None:
    """A finite real number (a numpy scalar too) or a one-element finite real tensor, else a ``ValueError`` naming
    alpha. The kernels take alpha as a constant: a tensor that requires grad would silently get no gradient, a
    tensor of several elements failed in ``float()`` with a message that did not say which argument, and an
    infinite or NaN alpha made every output NaN."""
    if isinstance(alpha, torch.Tensor):
        if alpha.numel() != 1 or alpha.is_complex() or alpha.dtype == torch.bool:
            raise ValueError(f"alpha must be a number or a one-element real tensor, got {alpha!r}")
        if alpha.requires_grad:
            raise ValueError("alpha must not require grad: the kernels take it as a constant (no gradient reaches it)")
    elif alpha is None:  # hstu_attention defaults None before checking; the plan and the launchers have no default
        raise ValueError("alpha must be a number, got None (only hstu_attention defaults it to 1/sqrt(Dqk))")
    elif isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
        raise ValueError(f"alpha must be a number or None (1/sqrt(Dqk)), got {alpha!r}")
    if not math.isfinite(float(alpha)):
        raise ValueError(f"alpha must be finite, got {float(alpha)}")


def describe(bits: int) -> list[str]:
    """The messages of an error mask, in bit order."""
    return [msg for bit, msg in MESSAGES.items() if bits & bit]


_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_INTS = (torch.int32, torch.int64)


def shapes_look_valid(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_offsets: torch.Tensor,
    max_seq_len: int,
    num_targets: torch.Tensor | None,
    contextual_seq_len: int,
    max_attn_len: int,
    scaling_seqlen: int | None,
    head_dims: tuple[int, ...] | None,
) -> bool:
    """True only when ``validate_hstu_inputs(check_offsets=False)`` would pass: its fast path (about
    2 us instead of 5 on the host). False means "look closer", and the slow path names the argument."""
    if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)):
        return False
    if not isinstance(seq_offsets, torch.Tensor):
        return False
    qs, vs, dev, dt = q.shape, v.shape, q.device, q.dtype
    if len(qs) != 3 or qs[1] < 1 or k.shape != qs or len(vs) != 3 or vs[0] != qs[0] or vs[1] != qs[1]:
        return False
    if dt not in _FLOATS or k.dtype != dt or v.dtype != dt:
        return False
    if qs[2] < 1 or vs[2] < 1 or (head_dims is not None and (qs[2] not in head_dims or vs[2] not in head_dims)):
        return False
    if (qs[2] > 1 and (q.stride(2) != 1 or k.stride(2) != 1)) or (vs[2] > 1 and v.stride(2) != 1):
        return False
    if k.device != dev or v.device != dev or seq_offsets.device != dev:
        return False
    if seq_offsets.dim() != 1 or seq_offsets.numel() < 1 or seq_offsets.dtype not in _INTS:
        return False
    if type(max_seq_len) is not int or not 0 < max_seq_len < 2**31:
        return False
    if type(contextual_seq_len) is not int or not 0 <= contextual_seq_len < 2**31:
        return False
    if type(max_attn_len) is not int or not 0 <= max_attn_len < 2**31:
        return False
    if scaling_seqlen is not None and (type(scaling_seqlen) is not int or not 0 < scaling_seqlen < 2**31):
        return False
    if num_targets is None:
        return True
    return (
        isinstance(num_targets, torch.Tensor)
        and num_targets.device == dev
        and num_targets.dim() == 1
        and num_targets.numel() == seq_offsets.numel() - 1
        and num_targets.dtype in _INTS
    )


def offsets_problems(
    seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, rows: int, max_seq_len: int
) -> tuple[int, list[str]]:
    """(error mask, messages with the offending values) of the offsets, computed on the host.

    The mask is the device kernel's (same rules, in int64); the messages name the argument and say
    where it goes wrong. Reads the offsets (and targets) on the host: one sync on a GPU.
    """
    off = seq_offsets.detach().to("cpu", torch.int64)
    batch = off.numel() - 1
    bits, found = 0, []
    if num_targets is not None and tuple(num_targets.shape) != (batch,):
        bits |= BAD_TARGETS
        found.append(f"num_targets must have shape ({batch},) (one per sequence), got {tuple(num_targets.shape)}")
        num_targets = None
    first, last = int(off[0]), int(off[-1])
    if first != 0:
        bits |= BAD_START
        found.append(f"{MESSAGES[BAD_START]}, got seq_offsets[0] = {first}")
    if last != rows:
        bits |= BAD_END
        found.append(f"seq_offsets must end at L = {rows} (q.shape[0]), got seq_offsets[-1] = {last}"
                     " (q, k, v are (L, H, D), not (H, L, D))")  # fmt: skip
    if batch <= 0:
        return bits, found
    lengths = off[1:] - off[:-1]
    if bool((lengths < 0).any()):
        bits |= DECREASING
        i = int(torch.nonzero(lengths < 0)[0])
        pair = f"seq_offsets[{i}] = {int(off[i])} > seq_offsets[{i + 1}] = {int(off[i + 1])}"
        found.append(f"{MESSAGES[DECREASING]}, got {pair}")
    longest = int(lengths.max())
    if longest > max_seq_len:
        bits |= TOO_LONG
        i = int(torch.argmax(lengths))
        found.append(f"max_seq_len={max_seq_len} is below the longest sequence ({longest}, sequence {i})")
    if num_targets is not None:
        nt = num_targets.detach().to("cpu", torch.int64)
        bad = (nt < 0) | (nt > lengths)
        if bool(bad.any()):
            bits |= BAD_TARGETS
            i = int(torch.nonzero(bad)[0])
            found.append(f"{MESSAGES[BAD_TARGETS]}, got num_targets[{i}] = {int(nt[i])} for length {int(lengths[i])}")
    return bits, found


def check_offsets_host(
    seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, rows: int, max_seq_len: int
) -> None:
    """Raise ``ValueError`` naming every bad argument (one sync on a GPU); the "full" mode."""
    _, found = offsets_problems(seq_offsets, num_targets, rows, max_seq_len)
    if found:
        raise ValueError("; ".join(found))


# B, L and max_seq_len change every batch: one compile for all of them. debug=True keeps the
# device assertions (Triton drops them otherwise); every integer op here is int64, so the debug
# overflow checks never fire.
@triton.jit(debug=True, do_not_specialize=["B", "L", "max_seq_len"])
def _offsets_check_kernel(
    seq_offsets,
    num_targets,
    err,
    B,
    L,
    max_seq_len,
    HAS_TARGETS: tl.constexpr,
    WRITE_ERR: tl.constexpr,
    ASSERT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program: the error mask of ``offsets_problems`` (bits 1 start, 2 end, 4 decreasing,
    8 too long, 16 targets), stored to ``err`` and/or asserted."""
    first = tl.load(seq_offsets).to(tl.int64)
    last = tl.load(seq_offsets + B).to(tl.int64)
    dec = tl.zeros([BLOCK], dtype=tl.int32)
    too_long = tl.zeros([BLOCK], dtype=tl.int32)
    tgt = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, B, BLOCK):
        idx = i + tl.arange(0, BLOCK).to(tl.int64)
        ok = idx < B
        s = tl.load(seq_offsets + idx, mask=ok, other=0).to(tl.int64)
        e = tl.load(seq_offsets + idx + 1, mask=ok, other=0).to(tl.int64)
        n = e - s
        dec = dec | ((n < 0) & ok).to(tl.int32)
        too_long = too_long | ((n > max_seq_len) & ok).to(tl.int32)
        if HAS_TARGETS:
            t = tl.load(num_targets + idx, mask=ok, other=0).to(tl.int64)
            tgt = tgt | (((t < 0) | (t > n)) & ok).to(tl.int32)
    bad_start = (first != 0).to(tl.int32)
    bad_end = (last != L).to(tl.int32)
    n_dec = tl.max(dec, axis=0)
    n_long = tl.max(too_long, axis=0)
    n_tgt = tl.max(tgt, axis=0)
    if WRITE_ERR:
        tl.store(err, bad_start | (bad_end << 1) | (n_dec << 2) | (n_long << 3) | (n_tgt << 4))
    if ASSERT:
        tl.device_assert(bad_start == 0, "hstu_attention: seq_offsets must start at 0")
        tl.device_assert(bad_end == 0, "hstu_attention: seq_offsets must end at L = q.shape[0] (q, k, v in (L, H, D))")
        tl.device_assert(n_dec == 0, "hstu_attention: seq_offsets must be non-decreasing")
        tl.device_assert(n_long == 0, "hstu_attention: max_seq_len is below the longest sequence")
        tl.device_assert(n_tgt == 0, "hstu_attention: num_targets must be within [0, sequence length]")


def launch_offsets_check(
    seq_offsets: torch.Tensor,
    num_targets: torch.Tensor | None,
    rows: int,
    max_seq_len: int,
    err: torch.Tensor | None = None,
    assert_on_device: bool = True,
) -> None:
    """One launch of the check kernel on the current stream: asserts on the device and/or stores the
    error mask into ``err`` (an int32 tensor of one element). Under the interpreter it runs on CPU.

    The kernel indexes densely, so strided offsets or targets (a table's column) are compacted first."""
    seq_offsets = seq_offsets.contiguous()
    num_targets = None if num_targets is None else num_targets.contiguous()
    _offsets_check_kernel[(1,)](
        seq_offsets,
        seq_offsets if num_targets is None else num_targets,
        seq_offsets if err is None else err,
        seq_offsets.numel() - 1,
        rows,
        max_seq_len,
        HAS_TARGETS=num_targets is not None,
        WRITE_ERR=err is not None,
        ASSERT=assert_on_device,
        BLOCK=_BLOCK,
        num_warps=4,
    )


def check_offsets(
    mode: str, seq_offsets: torch.Tensor, num_targets: torch.Tensor | None, rows: int, max_seq_len: int
) -> None:
    """The offsets check of one call in ``mode`` (see the module docstring for what each costs)."""
    if mode == "none":
        return
    if mode == "async" and seq_offsets.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
        launch_offsets_check(seq_offsets, num_targets, rows, max_seq_len)
        return
    check_offsets_host(seq_offsets, num_targets, rows, max_seq_len)


def check_launch(
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
) -> None:
    """The Triton launchers' own host checks (no sync), a ``ValueError`` naming the argument: they are exported
    and the tuner calls them directly, and the kernels trust what these say. Called directly, a ``num_targets``
    shorter than the batch was read past its end, and a negative context with a window moved the forward's key
    range below the sequence (both out-of-bounds reads); a NaN alpha made every output NaN. The fast path is
    ``shapes_look_valid`` (about 2 us); the offsets' contents stay the kernels' clamps' business."""
    args = (q, k, v, seq_offsets, max_seq_len, num_targets, contextual_seq_len, max_attn_len, scaling_seqlen)
    if not shapes_look_valid(*args, None):
        from .op import validate_hstu_inputs  # (op imports this module)

        validate_hstu_inputs(*args, check_offsets=False, check_head_dims=False)
    if type(alpha) is not float or not -math.inf < alpha < math.inf:
        check_alpha(alpha)


def check_out(name: str, t: object, shape: tuple[int, ...], device: torch.device) -> None:
    """An output buffer a launcher is given: a floating-point tensor of ``shape`` on ``device`` whose last dim is
    contiguous (the kernels store rows through the row and head strides only), else a ``ValueError`` naming it."""
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape {shape}, got {got}")
    if t.dtype not in _FLOATS or t.device != device:
        raise ValueError(f"{name} must be float16, bfloat16 or float32 on {device}, got {t.dtype} on {t.device}")
    if shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got strides {t.stride()}")


def validate_hstu_grad(do: torch.Tensor, q: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ``ValueError`` naming ``do`` when the output gradient does not match the validated q and v:
    shape (L, H, Dv), q's dtype and q's device."""
    check_grad(do, (q.shape[0], q.shape[1], v.shape[2]), q.dtype, q.device, "q's")


def check_grad(do: object, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, of: str) -> None:
    """``do`` is a tensor of ``shape``, ``dtype`` and ``device`` (``of``'s, in the message), else a ``ValueError``
    naming it: the backward kernels trust do's shape (a short one is read out of bounds)."""
    if not isinstance(do, torch.Tensor):
        raise ValueError(f"do must be a torch.Tensor, got {type(do).__name__}")
    if do.shape != shape:
        raise ValueError(f"do must have shape {tuple(shape)}, got {tuple(do.shape)}")
    if do.dtype != dtype:
        raise ValueError(f"do must have {of} dtype {dtype}, got {do.dtype}")
    if do.device != device:
        raise ValueError(f"do must be on {of} device {device}, got {do.device}")
