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
