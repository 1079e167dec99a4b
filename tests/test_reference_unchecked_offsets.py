"""``source="reference"`` with ``validate="none"`` reads the offsets as the kernels do.

The kernels clamp every sequence (start to [0, L], end to [start, L], targets to [0, n]), so bad offsets give wrong
rows of the call's (L, H, Dv) output, never a failure. The reference source read them as given: offsets past L or
below 0 failed inside torch on a shape mismatch naming no argument, decreasing ones returned more rows than q has,
and one huge offset built a list of 2**40 row blocks (the process ran out of memory).
"""

from __future__ import annotations

import pytest
import torch

from autotune.runtime import ops
from kernel_templates.hstu_attention import hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance

L, H, D = 29, 2, 32
MAX_LEN = 40

# (bad offsets, bad targets, the offsets and targets the kernels' clamps read them as)
CASES = [
    ([-8, 5, 29], None, [0, 5, 29], None),
    ([0, 10, 45], None, [0, 10, 29], None),
    ([0, 2**40, 29], None, [0, 29, 29], None),
    ([0, 9, 29], [-3, 100], [0, 9, 29], [0, 20]),
]


def _qkv(seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu") -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(L, H, D, generator=g).to(device, dtype).requires_grad_(True) for _ in range(3)]


def _call(offsets: list[int], targets: list[int] | None, source: str, validate: str, qkv=None):
    q, k, v = qkv or _qkv()
    nt = None if targets is None else torch.tensor(targets, device=q.device)
    off = torch.tensor(offsets, device=q.device)
    out = ops.hstu_attention(q, k, v, off, MAX_LEN, 0.3, nt, 2, 0, source=source, validate=validate)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return out, grads


def _reference(qkv: list[torch.Tensor], offsets: list[int], targets: list[int] | None, dtype: torch.dtype):
    """The reference on valid offsets in ``dtype`` (fp32: the oracle; a half type: PyTorch's own error)."""
    ins = [t.detach().to(dtype).requires_grad_(True) for t in qkv]
    dev = qkv[0].device
    nt = None if targets is None else torch.tensor(targets, device=dev)
    off = torch.tensor(offsets, device=dev)
    out = hstu_attention_reference(*ins, off, MAX_LEN, 0.3, nt, 2, 0, compute_dtype=dtype)
    return out, torch.autograd.grad(out, ins, torch.ones_like(out))


@pytest.mark.parametrize("offsets,targets,clamped,clamped_targets", CASES)
def test_reference_source_clamps_unchecked_offsets_as_the_kernels_do(
    device, offsets, targets, clamped, clamped_targets
):
    out, grads = _call(offsets, targets, "reference", "none")
    assert out.shape == (L, H, D)
    want, want_grads = _call(clamped, clamped_targets, "reference", "full")
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    # The kernels read the same bad offsets as the clamped ones (fp32 under the interpreter, bf16 on a GPU).
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    qkv = _qkv(0, dtype, device)
    kernel, kernel_grads = _call(offsets, targets, "default", "none", qkv)
    ref, ref_grads = _reference(qkv, clamped, clamped_targets, torch.float32)
    own, own_grads = _reference(qkv, clamped, clamped_targets, dtype)
    check_tolerance("out", kernel, ref, own)
    for g, r, o in zip(kernel_grads, ref_grads, own_grads, strict=True):
        check_tolerance("grad", g, r, o)


def test_reference_source_keeps_the_row_count_for_decreasing_offsets():
    """Decreasing offsets: a wrong result of q's row count (zeros where no sequence reads), not L + 17 rows."""
    out, grads = _call([0, 20, 3, 29], None, "reference", "none")
    assert out.shape == (L, H, D)
    assert all(g.shape == (L, H, D) and torch.isfinite(g).all() for g in grads)
