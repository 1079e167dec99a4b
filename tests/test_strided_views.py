"""Zero-copy layout: attention on q/k/v views of one uvqk buffer, gradients into one d(uvqk) buffer.

Both backends must give exactly what they give on contiguous copies, and the backward must write
only its own columns of the shared gradient buffer (the u columns keep a sentinel).
"""

from __future__ import annotations

import pytest
import torch
from conftest import IS_SM90

from autotune import spec
from autotune.runtime import dispatch

HEADS, D = 2, 64


def _backends() -> list:
    out = [pytest.param("triton")]
    out.append(pytest.param("cute", marks=pytest.mark.skipif(not IS_SM90, reason="needs an sm90 GPU")))
    return out


def _setup(device: str, dtype: torch.dtype, lengths=(0, 1, 7, 64, 129)):
    gen = torch.Generator().manual_seed(0)
    L, hd = sum(lengths), HEADS * D
    uvqk = torch.randn(L, 4 * hd, generator=gen).to(device, dtype)
    do = torch.randn(L, HEADS, D, generator=gen).to(device, dtype)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    views = [uvqk[:, i * hd : (i + 1) * hd].view(L, HEADS, D) for i in range(4)]
    return uvqk, views, do, offsets, max(lengths)


def _call(backend: str, kind: str, dtype: torch.dtype):
    choice = dispatch.default_choice(kind, D, D, str(dtype).removeprefix("torch."), HEADS)
    cfg = dispatch.decode_config("triton", kind, choice.config) if backend == "triton" else None
    if backend == "cute":
        cls = spec.resolve(spec.kernel(kind).backend("cute").config)
        defaults = spec.resolve(spec.kernel(kind).backend("cute").space).default
        from autotune.runtime.gpus import get_gpu
        from search_spaces.base import SpaceContext

        cfg = defaults(SpaceContext(get_gpu("h100"), "bfloat16", D, D, 256))
        assert isinstance(cfg, cls)
    return dispatch.launcher(backend, kind), cfg


@pytest.mark.parametrize("backend", _backends())
def test_attention_on_views_matches_contiguous(device, backend):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if backend == "cute" and device != "cuda":
        pytest.skip("needs an sm90 GPU")
    uvqk, (u, v, q, k), do, off, n = _setup(device, dtype)
    fwd, fcfg = _call(backend, "hstu_attention_fwd", dtype)
    bwd, bcfg = _call(backend, "hstu_attention_bwd", dtype)
    args = (off, n, 0.125, None, 0, 0, None)
    out_views = fwd(q, k, v, *args, fcfg)
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    out_contig = fwd(qc, kc, vc, *args, fcfg)
    assert torch.equal(out_views, out_contig)
    # Backward straight into the column slices of one gradient buffer; u's columns keep the sentinel.
    grad = torch.full_like(uvqk, 7.0)
    hd = HEADS * D
    dq, dk, dv = (grad[:, i * hd : (i + 1) * hd].view(-1, HEADS, D) for i in (2, 3, 1))
    bwd(do, q, k, v, *args, bcfg, out=(dq, dk, dv))
    ref = bwd(do, qc, kc, vc, *args, bcfg)
    # dk, dv: one writer per element, bit-identical; dq sums blocks with fp32 atomics (order may differ).
    torch.testing.assert_close(dk, ref[1], atol=0, rtol=0)
    torch.testing.assert_close(dv, ref[2], atol=0, rtol=0)
    torch.testing.assert_close(dq, ref[0], atol=1e-3, rtol=1e-2)
    assert (grad[:, :hd] == 7.0).all(), "the backward wrote outside its columns"
