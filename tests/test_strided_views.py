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


def _awkward_views(device: str, dtype: torch.dtype, L: int = 200):
    """q with heads not contiguous (an (H, L, D) tensor transposed; its rows are, as the public call asks), k at a
    misaligned address, v a plain column slice."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(HEADS, L, D, generator=gen).to(device, dtype).transpose(0, 1)
    k = torch.randn(L * HEADS * D + 1, generator=gen).to(device, dtype)[1:].view(L, HEADS, D)
    v = torch.randn(L, 2 * HEADS * D, generator=gen).to(device, dtype)[:, HEADS * D :].view(L, HEADS, D)
    return q, k, v


def test_cute_runtime_entry_copies_only_the_views_tma_cannot_read(monkeypatch):
    """The CuTe forward needs contiguous heads and 16-byte aligned rows; dispatch's entry copies a view that
    lacks them (which the Triton backend serves) instead of failing, and passes a column slice as it is."""
    pytest.importorskip("cutlass")
    import kernel_templates.cute as cute_pkg
    from kernel_templates.cute.launch import tma_rows_ok

    assert spec.resolve(spec.kernel("hstu_attention_fwd").backend("cute").launcher) is (
        cute_pkg.hstu_attention_cute_fwd_validated
    )
    seen = {}

    def fake_fwd(q, k, v, *args, out=None):  # the real launcher's check, before it launches anything
        if not all(tma_rows_ok(t) for t in (q, k, v)):
            raise ValueError("q, k and v must be (L, H, D) with contiguous heads and 16-byte aligned rows for TMA")
        seen.update(q=q, k=k, v=v)
        return torch.empty(q.shape[0], q.shape[1], v.shape[2])

    monkeypatch.setattr(cute_pkg, "hstu_attention_cute_fwd", fake_fwd)
    q, k, v = _awkward_views("cpu", torch.bfloat16)
    assert not tma_rows_ok(q) and not tma_rows_ok(k) and tma_rows_ok(v)
    off = torch.tensor([0, 70, 200], dtype=torch.int32)
    cute_pkg.hstu_attention_cute_fwd_validated(q, k, v, off, 130, 0.125, None, 0, 0, None, None)
    assert all(tma_rows_ok(seen[n]) for n in "qkv")
    assert torch.equal(seen["q"], q) and torch.equal(seen["k"], k)
    assert seen["v"] is v, "a view the TMA loads can read is not copied"

    def fake_bwd(do, q, k, v, *args, **kw):
        seen.update(do=do, q=q, k=k, v=v)
        return q, k, v

    monkeypatch.setattr(cute_pkg, "hstu_attention_cute_bwd", fake_bwd)
    seen.clear()
    do = k.detach().clone()  # contiguous and aligned: passed as it is
    cute_pkg.hstu_attention_cute_bwd_validated(do, q, k, v, off, 130, 0.125, None, 0, 0, None, None)
    # The launcher's own .contiguous() serves the transposed q; the misaligned k, contiguous already, is cloned.
    assert seen["do"] is do and seen["v"] is v and seen["q"] is q
    assert tma_rows_ok(seen["k"]) and torch.equal(seen["k"], k)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="needs an sm90 GPU")
def test_public_call_on_views_tma_cannot_read_matches_contiguous():
    """Through the drop-in call (dispatch may pick CuTe): transposed and misaligned q/k views give the same
    output and gradients as their contiguous copies."""
    from autotune.runtime.ops import hstu_attention

    q, k, v = _awkward_views("cuda", torch.bfloat16)
    off = torch.tensor([0, 70, 70, 200], dtype=torch.int64, device="cuda")
    results = []
    for make in (lambda t: t, lambda t: t.contiguous()):
        leaves = [make(t).detach().requires_grad_() for t in (q, k, v)]
        out = hstu_attention(*leaves, off, 130, source="tuned")
        out.float().square().sum().backward()
        results.append([out, *(t.grad for t in leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
