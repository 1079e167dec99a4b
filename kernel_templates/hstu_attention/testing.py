"""Helpers to build jagged inputs and apply the project's tolerance rule (shared by tests, tuner, benches).

Tolerance rule (``kernel_templates.tolerance``): a kernel's error against the fp32 reference may be at most
twice the error of PyTorch computing the same thing in the kernel's dtype, plus a small slack per dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernel_templates.tolerance import ERR_FACTOR, error_bound


def offsets_from_lengths(
    lengths: Sequence[int], device: torch.device | str = "cpu", dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """(B+1,) offsets from lengths (int64 unless ``dtype`` says otherwise, e.g. int32 for the kernels)."""
    off = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        off[1:] = torch.tensor(list(lengths), dtype=torch.int64).cumsum(0)
    return off.to(device=device, dtype=dtype)


@dataclass
class JaggedInputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_offsets: torch.Tensor
    max_seq_len: int
    num_targets: torch.Tensor | None


def make_jagged_inputs(
    lengths: Sequence[int],
    num_heads: int,
    dqk: int,
    dv: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    max_seq_len: int | None = None,
    targets: bool = False,
    requires_grad: bool = False,
) -> JaggedInputs:
    """Random q, k, v on jagged offsets (never zeros), optionally random num_targets per sequence."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    total = int(sum(lengths))

    def rnd(d: int) -> torch.Tensor:
        t = torch.randn(total, num_heads, d, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        return t.requires_grad_(requires_grad)

    q, k, v = rnd(dqk), rnd(dqk), rnd(dv)
    nt = None
    if targets:
        nt = torch.tensor(
            [int(torch.randint(0, max(n, 0) + 1, (1,), generator=g)) if n > 0 else 0 for n in lengths],
            dtype=torch.int64,
        ).to(device)
    n_max = max_seq_len if max_seq_len is not None else max(list(lengths) + [1])
    return JaggedInputs(q, k, v, offsets_from_lengths(lengths, device), n_max, nt)


def max_abs_err(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return (a.float() - b.float()).abs().max().item()


def check_tolerance(
    name: str, kernel: torch.Tensor, ref32: torch.Tensor, ref_lowp: torch.Tensor, atol: float | None = None
) -> tuple[float, float]:
    """Raise AssertionError unless the tolerance rule holds (max norm): |kernel - ref32| <= 2 |ref_lowp -
    ref32| + the slack of the kernel's dtype (``kernel_templates.tolerance``); ``atol`` replaces that slack
    only where a caller says why. Returns (kernel error, bound). NaN never passes."""
    if kernel.shape != ref32.shape:
        raise AssertionError(f"{name}: shape {tuple(kernel.shape)} != reference {tuple(ref32.shape)}")
    if kernel.numel() and not torch.isfinite(kernel.float()).all():
        raise AssertionError(f"{name}: non-finite values in kernel output")
    err, torch_err = max_abs_err(kernel, ref32), max_abs_err(ref_lowp, ref32)
    bound = error_bound(torch_err, kernel.dtype, ref32) if atol is None else ERR_FACTOR * torch_err + atol
    if not err <= bound:
        raise AssertionError(f"{name}: max error {err:.3e} exceeds bound {bound:.3e} (2x PyTorch-in-dtype + atol)")
    return err, bound


def check_call_and_grads(
    tag: str, out: torch.Tensor, inputs: Sequence[torch.Tensor], ref_args: tuple, dtype: torch.dtype, seed: int
) -> None:
    """``out`` of a call on ``inputs`` (q, k, v, requiring grad), then its gradients for a seeded random ``do``,
    against the fp32 reference (``ref_args``: its arguments after q, k, v) under the tolerance rule, PyTorch's own
    error measured in ``dtype``. An empty batch checks the output only."""
    from .reference import hstu_attention_reference

    r32 = [t.detach().float().requires_grad_(True) for t in inputs]
    rlo = [t.detach().clone().requires_grad_(True) for t in inputs]
    ref = hstu_attention_reference(*r32, *ref_args)
    own = hstu_attention_reference(*rlo, *ref_args, compute_dtype=dtype)
    check_tolerance(f"out {tag}", out, ref, own)
    if not out.numel():
        return
    go = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed)).to(out.device)
    got = torch.autograd.grad(out, tuple(inputs), go.to(out.dtype))
    refs = torch.autograd.grad(ref, r32, go)
    owns = torch.autograd.grad(own, rlo, go.to(own.dtype))
    for name, g, r, t in zip(("dq", "dk", "dv"), got, refs, owns, strict=True):
        check_tolerance(f"{name} {tag}", g, r, t)
