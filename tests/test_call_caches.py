"""The public call's per-tensor caches: the "async" offsets check and the index-dtype cast run once per
unchanged tensor; under CUDA-graph capture once per capture, never from an eager call or another capture
(replays change the tensor's contents, so each graph records the check and the cast once)."""

from __future__ import annotations

import json

import pytest
import torch

from autotune.runtime import dispatch, ops
from kernel_templates import tensor_memo


@pytest.fixture(autouse=True)
def _clean_caches():
    ops._CHECKED.clear()
    ops._CAST.clear()
    yield
    ops._CHECKED.clear()
    ops._CAST.clear()


@pytest.fixture
def checks(monkeypatch):
    seen = []
    monkeypatch.setattr(ops, "check_offsets", lambda mode, off, nt, rows, n: seen.append((mode, rows, n)))
    return seen


def test_async_check_once_per_unchanged_tensor(checks):
    off = torch.tensor([0, 3, 7, 7, 12])
    for _ in range(3):
        ops.check_call_offsets("triton", "async", off, None, 12, 8)
    assert len(checks) == 1
    off.add_(0)  # written: its version moves on
    ops.check_call_offsets("triton", "async", off, None, 12, 8)
    ops.check_call_offsets("triton", "async", off, None, 12, 6)  # another max_seq_len
    ops.check_call_offsets("triton", "async", off.clone(), None, 12, 6)  # another tensor, same values
    assert len(checks) == 4
    ops.check_call_offsets("triton", "full", off, None, 12, 6)  # "full" always reads the offsets
    assert len(checks) == 5 and checks[-1][0] == "full"


def test_async_check_recorded_once_per_graph_capture(checks, monkeypatch):
    off = torch.tensor([0, 3, 7])
    ops.check_call_offsets("triton", "async", off, None, 7, 4)
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 11)  # the eager check is not seen by a graph
    for _ in range(3):
        ops.check_call_offsets("triton", "async", off, None, 7, 4)
    assert len(checks) == 2
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 12)  # another capture records its own
    ops.check_call_offsets("triton", "async", off, None, 7, 4)
    assert len(checks) == 3
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: None)  # a capture of unknown id: every call
    for _ in range(2):
        ops.check_call_offsets("triton", "async", off, None, 7, 4)
    assert len(checks) == 5
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 0)  # eager again: the eager entry holds
    ops.check_call_offsets("triton", "async", off, None, 7, 4)
    assert len(checks) == 5


def test_index_cast_once_per_unchanged_tensor(monkeypatch):
    off = torch.tensor([0, 3, 7, 7, 12], dtype=torch.int64)
    a = ops._index_as(off, torch.int32)
    assert a.dtype == torch.int32 and a.tolist() == off.tolist()
    assert ops._index_as(off, torch.int32) is a
    off[1] = 4
    b = ops._index_as(off, torch.int32)
    assert b is not a and b.tolist() == [0, 4, 7, 7, 12]
    assert (
        ops._index_as(b, torch.int32) is b
        and ops._index_as(off, None) is off
        and ops._index_as(None, torch.int32) is None
    )
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 5)
    c, d = ops._index_as(off, torch.int32), ops._index_as(off, torch.int32)
    assert c is not b and d is c and c.tolist() == b.tolist()  # recorded once in the capture
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 6)
    assert ops._index_as(off, torch.int32) is not c


def test_index_cast_cache_is_keyed_by_dtype():
    """One tensor asked for in two dtypes gets each, not the first one cached."""
    off = torch.tensor([0, 3, 7], dtype=torch.int64)
    a = ops._index_as(off, torch.int32)
    b = ops._index_as(off, torch.int16)
    assert a.dtype == torch.int32 and b.dtype == torch.int16 and b.tolist() == off.tolist()
    assert ops._index_as(off, torch.int32).dtype == torch.int32


def test_async_check_repeats_for_other_targets(checks):
    """The skip needs the same targets tensor, unchanged: another one (or one written since) is checked."""
    off, nt = torch.tensor([0, 3, 7]), torch.tensor([1, 2])
    for _ in range(2):
        ops.check_call_offsets("triton", "async", off, nt, 7, 4)
    assert len(checks) == 1
    ops.check_call_offsets("triton", "async", off, nt.clone(), 7, 4)
    nt.add_(0)
    ops.check_call_offsets("triton", "async", off, nt, 7, 4)
    ops.check_call_offsets("triton", "async", off, None, 7, 4)
    assert len(checks) == 4


def test_backends_declare_their_index_dtype(monkeypatch):
    assert dispatch.index_dtype("cute", ops.FWD) == torch.int32 and dispatch.index_dtype("cute", ops.BWD) == torch.int32
    assert dispatch.index_dtype("triton", ops.FWD) is None and dispatch.index_dtype("reference", ops.BWD) is None
    # the launcher of an int32 backend gets the cached int32 offsets and targets
    seen = []
    monkeypatch.setattr(dispatch, "index_dtype", lambda backend, kind: torch.int32)
    monkeypatch.setattr(dispatch, "launcher", lambda backend, kind: lambda *a: seen.append(a) or a[0])
    monkeypatch.setattr(dispatch, "decode_config", lambda backend, kind, cfg: None)
    q = torch.zeros(7, 1, 32)
    off, nt = torch.tensor([0, 3, 7]), torch.tensor([1, 2])
    for _ in range(2):
        ops._fwd_impl(q, q, q, off, nt, 4, 1.0, 0, 0, None, "triton", "{}", "none")
    (a1, b1), (a2, b2) = ((args[3], args[6]) for args in seen)
    assert a1.dtype == b1.dtype == torch.int32 and a1 is a2 and b1 is b2


def test_dispatch_runner_follows_replaced_resolvers(monkeypatch):
    """The cached (launcher, config, index dtype) of a choice is resolved again when a resolver is replaced,
    without a ``dispatch.reset()``."""
    from kernel_templates.hstu_attention import default_fwd_config

    cfg = json.dumps(default_fwd_config(32, 32, interpret=True).to_dict())
    first = dispatch.runner("triton", ops.FWD, cfg)[0]
    assert dispatch.runner("triton", ops.FWD, cfg)[0] is first
    stub = lambda *a: None  # noqa: E731
    monkeypatch.setattr(dispatch, "launcher", lambda backend, kind: stub)
    monkeypatch.setattr(dispatch, "decode_config", lambda backend, kind, cfg: None)
    assert dispatch.runner("triton", ops.FWD, cfg)[0] is stub


@pytest.mark.parametrize("source", ["reference", "default"])
def test_call_without_gradients_skips_autograd(source, device):
    """No input needs a gradient (or grad mode is off): the same result, straight from the implementation."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(21, 2, 32, generator=g).to(device) for _ in range(3))
    off = torch.tensor([0, 1, 1, 13, 21], device=device)
    plain = ops.hstu_attention(q, k, v, off, 12, source=source)
    assert plain.grad_fn is None
    qg = q.clone().requires_grad_()
    tracked = ops.hstu_attention(qg, k, v, off, 12, source=source)
    assert tracked.grad_fn is not None
    with torch.no_grad():
        assert ops.hstu_attention(qg, k, v, off, 12, source=source).grad_fn is None
    torch.testing.assert_close(plain, tracked.detach(), atol=0, rtol=0)


def test_inference_tensors_are_never_memoised(checks):
    """Inference tensors carry no version counter: every call checks (and casts) them again, no error."""
    with torch.inference_mode():
        off = torch.tensor([0, 3, 7])
        for _ in range(2):
            ops.check_call_offsets("triton", "async", off, None, 7, 4)
        assert ops._index_as(off, torch.int32).tolist() == [0, 3, 7]
    assert len(checks) == 2 and len(ops._CAST) == 0
