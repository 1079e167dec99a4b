"""Argument checks of the layer ops' runtime launchers (``<op>/launch.py`` of the input LayerNorm, LN(x) * u +
dropout, the uvqk projection's backward and the output projection), in front of their hashed kernels.

The LayerNorm-family Triton kernels read 1-D parameters and row statistics as contiguous arrays and trust the shapes of
the tensors they are given. These checks run in front of them (``<op>/launch.py``, the launchers the
specs name), so a strided weight is made contiguous instead of read wrongly, and a short ``dout``,
``mean`` or ``out`` buffer, an integer tensor, a tensor on another device, an ``out`` buffer whose
columns are strided or whose rows overlap, an output that shares memory with an input or another output
(``outputs_apart``), or a seed that is not one integer is a ``ValueError`` naming it instead of an
out-of-bounds access or a silently wrong result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from kernel_templates.config_types import config_type_error

F = TypeVar("F", bound=Callable[..., Any])


def untracked(launcher: F) -> F:
    """Run a torch-backend launcher without recording autograd, as the kernels of the other backends run.

    Launchers compute values (the layer's autograd functions own the backward); with inputs that require
    grad, ``torch.addmm(..., out=)`` and friends would raise instead, and the other ops would build a
    graph nobody uses, so a backend swap would change what a call does.
    """

    @functools.wraps(launcher)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return launcher(*args, **kwargs)

    return run  # type: ignore[return-value]


def config_of(config: Any, cls: type, optional: bool = False) -> None:
    """``config`` an instance of the kernel's config class (or None where the kernel picks its default): another
    object failed inside the kernel's launcher as an AttributeError naming an attribute, not the argument. Its
    fields are held to their defaults' types (``config_fields``)."""
    if not isinstance(config, cls) and not (optional and config is None):
        allowed = f"a {cls.__name__}" + (" or None" if optional else "")
        raise ValueError(f"config must be {allowed}, got {type(config).__name__}")
    if config is not None:
        config_fields(config)


def config_fields(config: Any, name: str = "config") -> None:
    """``ValueError`` naming ``name.field`` unless each field of a config dataclass holds its default's type, the
    rule a JSON config is held to (``config_types.config_type_error``). The config classes' own checks are
    membership tests, which take 8.0 for 8 and True for 1: a built config with ``l2_group=8.0`` or
    ``dq_block_m=32.0`` reached the Triton kernel as a float constexpr and failed inside Triton, naming no argument."""
    if _CHECKED_CONFIGS.get(id(config)) is config:  # the launchers' hot path: dispatch serves the same objects
        return
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    problem = config_type_error(type(config), values)
    if problem:
        raise ValueError(f"{name}.{problem}")
    if len(_CHECKED_CONFIGS) >= 256:
        _CHECKED_CONFIGS.clear()
    _CHECKED_CONFIGS[id(config)] = config  # kept alive, so its id is not reused while it is here


# Config objects whose fields passed ``config_fields``, by identity (not equality: a config with l2_group=8.0 equals
# and hashes as one with 8). Frozen dataclasses, so a checked object stays valid (``object.__setattr__`` on one
# bypasses the freeze and this memo alike).
_CHECKED_CONFIGS: dict[int, Any] = {}


def width(x: torch.Tensor) -> int:
    """D of a 2-D (rows, D) floating-point input with D >= 1 (a 0-wide row has no mean), named ``x`` otherwise."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"x must be 2-D (rows, D) with D >= 1, got shape {tuple(getattr(x, 'shape', ()))}")
    floating(x.device, x=x)
    return x.shape[1]


def floating(device: torch.device | None, anchor: str = "x", **named: torch.Tensor | None) -> None:
    """Each named tensor (None skipped) floating-point on ``device`` (the ``anchor`` input's): the kernels would
    truncate an integer tensor's values into an integer output, and read another device's pointer (a sparse
    tensor: ``dense``)."""
    for name, t in named.items():
        if t is None:
            continue
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {getattr(t, 'dtype', type(t).__name__)}")
        dense(**{name: t})
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, {anchor} on {device}")


def dense(**named: object) -> None:
    """Each named tensor strided (anything else is left to the other checks): a sparse tensor has no strided
    memory to read or write, and failed inside torch or the launcher naming no argument."""
    for name, t in named.items():
        if isinstance(t, torch.Tensor) and t.layout != torch.strided:
            raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")


def out_rows(name: str, t: torch.Tensor, shape: tuple[int, int], device: torch.device) -> None:
    """An output buffer the kernels write row by row: ``shape``, floating-point on ``device``, contiguous
    columns and rows that do not overlap (the kernels index it as ``row * stride(0) + col``)."""
    same_shape(name, t, shape)
    floating(device, **{name: t})
    rows, d = shape
    if (d > 1 and t.stride(1) != 1) or (rows > 1 and t.stride(0) < d):
        raise ValueError(f"{name} must have contiguous, non-overlapping rows, got strides {t.stride()}")


def seed_tensor(seed: torch.Tensor, device: torch.device) -> None:
    """The dropout seed: one integer on x's device (the kernels load element 0 as the Philox key)."""
    if not isinstance(seed, torch.Tensor) or seed.numel() != 1 or seed.dtype.is_floating_point or seed.is_complex():
        got = f"{seed.dtype} of {seed.numel()} elements" if isinstance(seed, torch.Tensor) else type(seed).__name__
        raise ValueError(f"seed must be a one-element integer tensor, got {got}")
    if seed.dtype == torch.bool or seed.device != device:
        raise ValueError(f"seed must be an integer tensor on {device}, got {seed.dtype} on {seed.device}")


def finite_eps(eps: object) -> float:
    """``eps`` as a float, when it is a positive finite real number (NaN passes an ``eps <= 0`` test; a NumPy
    scalar is one)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0.0 < float(eps) < math.inf:
        raise ValueError(f"eps must be a positive finite number, got {eps!r}")
    return float(eps)


def dropout_p(p: object) -> float:
    """``p`` as a float, when it is a real number in [0, 1) (a string or bool would reach the kernel's comparison)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= float(p) < 1.0:
        raise ValueError(f"dropout p must be a number in [0, 1), got {p!r}")
    return float(p)


def vectors(d: int, device: torch.device, **named: torch.Tensor) -> list[torch.Tensor]:
    """Each named 1-D floating-point tensor of shape (d,) on ``device``, contiguous (copied when strided: the
    kernels index it densely)."""
    out = []
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.shape != (d,):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{' and '.join(named)} must have shape ({d},), got {name} {got}")
        floating(device, **{name: t})
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


def row_stats(rows: int, device: torch.device, **named: torch.Tensor) -> list[torch.Tensor]:
    """Each named statistics tensor float32 of shape (rows,) on ``device``, contiguous (copied when strided)."""
    out = []
    for name, t in named.items():
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.shape != (rows,):
            got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else repr(t)
            raise ValueError(f"{name} must be float32 of shape ({rows},), got {got}")
        floating(device, **{name: t})
        out.append(t if t.is_contiguous() else t.contiguous())
    return out


def dense_if_empty(t: Any) -> Any:
    """A tensor of no elements as a fresh contiguous one (anything else as it is): its strides address nothing,
    yet autograd hands the gradient of an empty output as an expanded (0, 0)-strided view, which the kernels'
    launchers refused ("must have contiguous columns") instead of returning empty and zero gradients."""
    return t.new_empty(t.shape) if isinstance(t, torch.Tensor) and t.numel() == 0 else t


def unit_columns(x: Any) -> Any:
    """``x``, or a contiguous copy when its columns are strided (a ``[:, ::2]`` slice, a transpose): the row
    kernels step rows by ``stride(0)`` and columns by 1. Taken before an autograd function, the copy's gradient
    flows back to the view."""
    if isinstance(x, torch.Tensor) and x.dim() == 2 and x.shape[1] > 1 and x.stride(1) != 1:
        return x.contiguous()
    return x


def same_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {getattr(t, 'shape', t)!r}")


def grad_outs(out: tuple | None, shape: tuple[int, int], device: torch.device, first: int) -> None:
    """An ``out`` tuple of a backward: ``first`` row buffers of ``shape`` (``out_rows``), then dweight and dbias
    of shape (D,), both given or both None (the kernels' launchers write the pair or neither)."""
    if out is None:
        return
    if not isinstance(out, (tuple, list)) or len(out) != first + 2:
        got = f"{type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ValueError(f"out must be a tuple of {first + 2} tensors, got {got}")
    for i in range(first):
        out_rows(f"out[{i}]", out[i], shape, device)
    dw, db = out[first], out[first + 1]
    if (dw is None) != (db is None):
        raise ValueError(f"out[{first}] and out[{first + 1}] (dweight, dbias) must both be tensors or both be None")
    if dw is not None:
        for i, t in ((first, dw), (first + 1, db)):
            same_shape(f"out[{i}]", t, (shape[1],))
            floating(device, **{f"out[{i}]": t})


def fill_outs(out: tuple | None, res: tuple) -> tuple:
    """A torch backend's results written into ``out`` as the Triton launchers do: each given buffer receives its
    result and is returned; a None buffer (dweight and dbias may be) returns the computed tensor."""
    if out is None:
        return res
    done = []
    for dst, src in zip(out, res, strict=True):
        if dst is None:
            done.append(src)
        else:
            dst.copy_(src)
            done.append(dst)
    return tuple(done)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, end) byte addresses of the elements ``t`` addresses (its strided footprint; strides are >= 0)."""
    first = t.data_ptr()
    if t.is_contiguous():
        return first, first + t.numel() * t.element_size()
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    return first, first + (last + 1) * t.element_size()


def _row_views_meet(a: torch.Tensor, b: torch.Tensor) -> bool | None:
    """Whether two 2-D views with contiguous columns and one row stride share an element (None: not such views).
    Column blocks of one buffer (the layer's d(uvqk) slices) are told apart by arithmetic, with no byte map: that
    would allocate the buffer's size again and read a flag back (a device sync)."""
    size = a.element_size()
    if not (a.dim() == b.dim() == 2 and b.element_size() == size and a.stride(1) == b.stride(1) == 1):
        return None
    s, delta = a.stride(0), b.data_ptr() - a.data_ptr()
    if s < 1 or b.stride(0) != s or delta % size:
        return None
    d = delta // size
    (ra, wa), (rb, wb) = a.shape, b.shape
    # row i of a covers [i s, i s + wa), row j of b [d + j s, d + j s + wb): they meet when -wb < d + (j - i) s < wa
    lo, hi = max(1 - ra, -((wb + d - 1) // s)), min(rb - 1, (wa - 1 - d) // s)
    return lo <= hi


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors share a byte: exact (interleaved column blocks of one buffer do not overlap). Tensors
    on one device whose footprints meet (of one storage or not: two storages may wrap one memory, as two
    ``from_numpy`` views of an array do) are told apart by layout where that suffices, else element by element
    (a rare case: a byte map of the shared span on their device)."""
    if not a.numel() or not b.numel() or a.device != b.device:
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if a.is_contiguous() and b.is_contiguous():  # each fills its footprint
        return True
    rows = _row_views_meet(a, b)
    if rows is not None:
        return rows
    lo = min(a0, b0)
    mark = torch.zeros(max(a1, b1) - lo, dtype=torch.bool, device=a.device)

    def bytes_of(t: torch.Tensor) -> torch.Tensor:
        e = t.element_size()
        return mark.as_strided((*t.shape, e), (*(st * e for st in t.stride()), 1), t.data_ptr() - lo)

    bytes_of(a).fill_(True)
    return bool(bytes_of(b).any())


_MAX_COUNTED = 1 << 22  # elements of an unusual layout whose addresses are listed to find a repeat


def _writes_twice(t: torch.Tensor) -> bool:
    """Whether a view addresses some element more than once (a stride-0 or self-overlapping view). Strides that
    each step past the extent of the smaller ones cannot meet; other layouts are counted out exactly from their
    shape and strides (metadata only: nothing is read from the device)."""
    if t.is_contiguous():
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride(), strict=True) if n > 1)
    if dims and dims[0][0] == 0:
        return True
    extent = 0
    for st, n in dims:
        if st <= extent:
            if t.numel() > _MAX_COUNTED:  # too many to list: at least fewer addresses than elements is caught
                return sum((n_ - 1) * st_ for st_, n_ in dims) + 1 < t.numel()
            offsets = torch.zeros((), dtype=torch.int64)
            for st_, n_ in dims:
                offsets = (offsets.unsqueeze(-1) + torch.arange(n_, dtype=torch.int64) * st_).flatten()
            return bool(offsets.unique().numel() < offsets.numel())
        extent += (n - 1) * st
    return False


def outputs_apart(inputs: dict[str, torch.Tensor | None], outputs: dict[str, torch.Tensor | None]) -> None:
    """``ValueError`` naming the output unless each given output has its own memory: no element written twice
    (a stride-0 or self-overlapping view), none shared with another output or with an input (a kernel or
    ``addmm(out=)`` reads inputs while it writes: silently wrong results, not errors). Skipped while
    torch.compile traces (fake tensors have no memory). Only tensors whose byte spans meet are compared further."""
    if torch.compiler.is_compiling():
        return
    given = [(n, t, _span(t)) for n, t in outputs.items() if _in_memory(t)]
    reads = [(n, t, _span(t)) for n, t in inputs.items() if _in_memory(t)]
    for i, (name, t, (first, end)) in enumerate(given):
        if _writes_twice(t):
            raise ValueError(f"{name} has elements that share memory (strides {t.stride()}): each needs its own")
        for iname, inp, (i0, i1) in reads:
            if i0 < end and first < i1 and _overlap(t, inp):
                raise ValueError(f"{name} shares memory with the input {iname}: the kernel would read what it wrote")
        for other, u, (u0, u1) in given[:i]:
            if u0 < end and first < u1 and _overlap(t, u):
                raise ValueError(f"{other} and {name} must be different tensors: they share memory")


def _in_memory(t: object) -> bool:
    """A tensor with elements in memory (a meta tensor has none: every one's address is 0)."""
    return isinstance(t, torch.Tensor) and t.numel() > 0 and t.device.type != "meta"
