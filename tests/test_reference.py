"""The reference is the oracle: check it on hand-computed cases, one mask rule at a time."""

from __future__ import annotations

import math

import pytest
import torch

from kernel_templates.hstu_attention import (
    hstu_attention_flops,
    hstu_attention_reference,
    hstu_mask,
    hstu_position_ids,
)


def _rows(mask: torch.Tensor) -> list[list[int]]:
    return [torch.nonzero(r).flatten().tolist() for r in mask]


def test_plain_causal_is_lower_triangular():
    assert torch.equal(hstu_mask(4), torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_targets_see_history_and_themselves_only():
    ids, m = hstu_position_ids(5, num_targets=2)
    assert ids.tolist() == [1, 2, 3, 4, 4] and m == 4
    assert _rows(hstu_mask(5, num_targets=2)) == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 4]]


def test_context_rows_see_all_non_targets():
    ids, m = hstu_position_ids(6, contextual_seq_len=2, num_targets=1)
    assert ids.tolist() == [0, 0, 1, 2, 3, 4] and m == 4
    rows = _rows(hstu_mask(6, contextual_seq_len=2, num_targets=1))
    # context rows 0, 1 see every non-target key (0..4), not the target 5
    assert rows[0] == [0, 1, 2, 3, 4] and rows[1] == [0, 1, 2, 3, 4]
    # history rows are causal and see the context
    assert rows[2] == [0, 1, 2] and rows[4] == [0, 1, 2, 3, 4]
    # the target sees context, history and itself
    assert rows[5] == [0, 1, 2, 3, 4, 5]


def test_window_limits_distance():
    rows = _rows(hstu_mask(5, max_attn_len=1))
    assert rows == [[0], [0, 1], [1, 2], [2, 3], [3, 4]]


def test_window_with_context_keeps_context_rows_full():
    rows = _rows(hstu_mask(5, contextual_seq_len=2, max_attn_len=1))
    # ids [0,0,1,2,3]; row 4 (id 3) sees ids >= 2 -> key 3 and itself; context rows see all
    assert rows[0] == [0, 1, 2, 3, 4]
    assert rows[2] == [0, 1, 2]
    assert rows[4] == [3, 4]


def test_hand_computed_output():
    silu = lambda x: x / (1 + math.exp(-x))
    q = torch.tensor([[[1.0]], [[2.0]]])
    k = torch.tensor([[[1.0]], [[1.0]]])
    v = torch.tensor([[[3.0]], [[5.0]]])
    off = torch.tensor([0, 2])
    out = hstu_attention_reference(q, k, v, off, max_seq_len=2, alpha=1.0)
    expect = [silu(1.0) * 3 / 2, (silu(2.0) * 3 + silu(2.0) * 5) / 2]
    assert out.flatten().tolist() == pytest.approx(expect, rel=1e-6)
    out4 = hstu_attention_reference(q, k, v, off, max_seq_len=2, alpha=1.0, scaling_seqlen=4)
    assert out4.flatten().tolist() == pytest.approx([e / 2 for e in expect], rel=1e-6)


def test_empty_sequences_and_sequences_are_independent():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(7, 2, 4, generator=g) for _ in range(3))
    out = hstu_attention_reference(q, k, v, torch.tensor([0, 0, 3, 3, 7]), 4, 0.5)
    alone = hstu_attention_reference(q[3:], k[3:], v[3:], torch.tensor([0, 4]), 4, 0.5)
    assert torch.allclose(out[3:], alone)


def test_flops_convention():
    off = torch.tensor([0, 4, 10])
    fwd, bwd = hstu_attention_flops(off, num_heads=2, dqk=8, dv=8)
    pairs = 16 // 2 + 36 // 2
    assert fwd == 2 * 2 * 16 * pairs and bwd == pytest.approx(2.5 * fwd)
    # masked variants count the mask exactly
    fwd_t, _ = hstu_attention_flops(off, 2, 8, 8, num_targets=torch.tensor([1, 2]))
    exact = int(hstu_mask(4, num_targets=1).sum() + hstu_mask(6, num_targets=2).sum())
    assert fwd_t == 2 * 2 * 16 * exact
    # plain causal is n^2/2 for odd lengths too (a length-1 sequence is half a pair, not none)
    fwd_odd, _ = hstu_attention_flops(torch.tensor([0, 1, 4, 4]), num_heads=1, dqk=8, dv=8)
    assert fwd_odd == 2 * 16 * (1 / 2 + 9 / 2)


# ----------------------------------------------------------------------- row blocks (bounded memory)

MASKS = [
    {"ctx": 0, "targets": False, "window": 0},
    {"ctx": 2, "targets": True, "window": 0},
    {"ctx": 0, "targets": False, "window": 3},
    {"ctx": 1, "targets": True, "window": 4},
]


def test_row_chunks_cover_every_row_once_within_the_budget():
    from kernel_templates.hstu_attention.reference import row_chunks

    assert row_chunks(0, 4) == []
    assert row_chunks(100, 4) == [(0, 100)]  # short sequences stay one block
    for n, heads, budget in ((37, 2, 150), (37, 2, 1), (1, 8, 3), (64, 4, 4 * 64 * 5)):
        chunks = row_chunks(n, heads, budget)
        assert chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:], strict=False))
        assert all(r1 > r0 and (heads * (r1 - r0) * n <= budget or r1 - r0 == 1) for r0, r1 in chunks)
    assert len(row_chunks(32768, 4)) > 1  # a 32K sequence never builds its (H, n, n) scores in one piece


@pytest.mark.parametrize("m", MASKS)
def test_mask_rows_are_the_full_masks_rows(m):
    n = 11
    full = hstu_mask(n, m["ctx"], 3 if m["targets"] else None, m["window"])
    for r0, r1 in ((0, 4), (4, 5), (5, 11)):
        rows = hstu_mask(n, m["ctx"], 3 if m["targets"] else None, m["window"], rows=(r0, r1))
        assert torch.equal(rows, full[r0:r1])


def _unchunked(monkeypatch):
    """Run the reference with one row block per sequence (the budget made huge)."""
    from kernel_templates.hstu_attention import reference

    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 1 << 40)


@pytest.mark.parametrize("m", MASKS)
def test_row_blocks_give_the_one_block_reference_and_gradients(monkeypatch, m):
    """Forward, autograd gradients, the tuner's backward oracle and the custom op's written-out backward:
    with a budget of a few rows per block each equals the one-block computation (fp32, CPU)."""
    from autotune.runtime.ops import _reference_bwd
    from kernel_templates.hstu_attention import reference
    from kernel_templates.hstu_attention.testing import make_jagged_inputs
    from kernel_templates.hstu_attention.tuning import reference_bwd

    lengths = [13, 0, 1, 29, 7]
    inp = make_jagged_inputs(lengths, 2, 16, 8, torch.float32, "cpu", seed=3, targets=m["targets"])
    do = torch.randn(inp.q.shape[0], 2, 8, generator=torch.Generator().manual_seed(5))
    args = (inp.seq_offsets, inp.max_seq_len, 0.25, inp.num_targets, m["ctx"], m["window"], None)
    inputs = {
        "q": inp.q, "k": inp.k, "v": inp.v, "do": do, "seq_offsets": inp.seq_offsets, "max_seq_len": inp.max_seq_len,
        "alpha": 0.25, "num_targets": inp.num_targets, "contextual_seq_len": m["ctx"], "max_attn_len": m["window"],
        "scaling_seqlen": None,
    }  # fmt: skip

    def everything():
        q, k, v = (t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
        out = hstu_attention_reference(q, k, v, *args)
        grads = torch.autograd.grad(out, (q, k, v), do)
        written = _reference_bwd(
            do, inp.q, inp.k, inp.v, inp.seq_offsets, inp.num_targets, inp.max_seq_len, 0.25, m["ctx"], m["window"],
            None,
        )  # fmt: skip
        return [out.detach(), *grads, *reference_bwd(inputs, torch.float32), *written]

    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 2 * 2 * 29)  # 2 rows per block of the 29-long one
    blocked = everything()
    _unchunked(monkeypatch)
    whole = everything()
    assert blocked[0].abs().max() > 0
    for a, b in zip(blocked, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for i in range(3):  # dq, dk, dv of the tuner's oracle and of the written-out backward match autograd's
        torch.testing.assert_close(whole[4 + i], whole[1 + i], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(whole[7 + i], whole[1 + i], rtol=1e-4, atol=1e-5)


def test_flops_count_masked_pairs_by_row_blocks(monkeypatch):
    from kernel_templates.hstu_attention import reference

    offsets = torch.tensor([0, 9, 9, 30])
    nt = torch.tensor([2, 0, 5])
    want = sum(int(hstu_mask(n, 1, int(t), 4).sum()) for n, t in ((9, 2), (21, 5)))
    monkeypatch.setattr(reference, "ROW_BLOCK_ELEMENTS", 8)
    fwd, bwd = hstu_attention_flops(offsets, 2, 16, 8, 1, nt, 4)
    assert fwd == 2.0 * 2 * (16 + 8) * want and bwd == 2.0 * 2 * (3 * 16 + 2 * 8) * want


def test_an_all_empty_batch_has_zero_output_and_gradients():
    q, k, v = (torch.randn(0, 2, d, requires_grad=True) for d in (8, 8, 4))
    out = hstu_attention_reference(q, k, v, torch.tensor([0, 0, 0]), 4, 0.5)
    assert out.shape == (0, 2, 4)
    grads = torch.autograd.grad(out, (q, k, v), torch.zeros(0, 2, 4))
    assert [tuple(g.shape) for g in grads] == [(0, 2, 8), (0, 2, 8), (0, 2, 4)]
