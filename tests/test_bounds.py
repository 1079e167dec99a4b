"""The checks' stray-write detection (``autotune.tuning.bounds``): guard bands around outputs, input prints."""

from __future__ import annotations

import pytest
import torch

from autotune.tuning import bounds


def _nan(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype)


def test_writes_inside_the_outputs_are_not_stray():
    g = bounds.OutputGuard((_nan(5, 3), _nan(4, dtype=torch.float16)))
    a, b = g.outs
    assert torch.isnan(a).all() and torch.isnan(b).all()  # what the op allocated is kept
    a.fill_(1.0)
    b.fill_(2.0)
    assert g.problems(["a", "b"]) == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_store_past_the_end_or_before_the_start_is_named(dtype):
    g = bounds.OutputGuard((torch.zeros(6, 2, dtype=dtype),))
    (o,) = g.outs
    o.as_strided((3,), (1,), o.storage_offset() + o.numel()).fill_(7)  # three elements past the end
    o.as_strided((1,), (1,), o.storage_offset() - 1).fill_(7)
    problems = g.problems(["dq"])
    assert "dq: 3 element(s) written past its last element" in problems
    assert "dq: 1 element(s) written before its first element" in problems


def test_a_store_into_the_gap_of_a_strided_output_is_named():
    wide = _nan(4, 8)
    view = wide[:, 2:5]  # columns of a wider buffer, as the fused layer's d(uvqk) views are
    g = bounds.OutputGuard((view,))
    (o,) = g.outs
    assert o.stride() == view.stride() and o.shape == view.shape
    o.fill_(0.0)
    assert g.problems(["dk"]) == []
    o.as_strided((1,), (1,), o.storage_offset() + 3).fill_(1.0)  # column 5 of row 0: between rows of the view
    assert g.problems(["dk"]) == ["dk: 1 element(s) written between its strided elements"]


def test_non_tensor_outputs_and_empty_outputs_pass_through():
    g = bounds.OutputGuard((None, torch.empty(0, 4)))
    assert g.outs[0] is None and g.outs[1].shape == (0, 4)
    assert g.problems(["x", "y"]) == []


def test_input_prints_see_any_changed_element_and_nothing_else():
    x = torch.randn(1000)
    n = torch.arange(7, dtype=torch.int32)
    inputs = {"x": x, "n": n, "count": 3}
    prints = bounds.InputPrints(inputs)
    assert prints.problems() == []
    x[999] = x[999].item() + 1e-3
    assert prints.problems() == ["input 'x' was written by the launch"]
    x2 = torch.arange(6, dtype=torch.uint8)
    swapped = bounds.InputPrints({"b": x2})
    x2[[0, 1]] = x2[[1, 0]]  # same bytes, other places: the weighted sum sees it
    assert swapped.problems() == ["input 'b' was written by the launch"]


def test_guarded_outputs_start_as_aligned_as_fresh_ones():
    for dtype, numel in ((torch.bfloat16, 1000), (torch.float32, 3001), (torch.int8, 77)):
        (o,) = bounds.OutputGuard((torch.zeros(numel, dtype=dtype),)).outs
        assert (o.storage_offset() * o.element_size()) % bounds.ALIGN_BYTES == 0 and o.data_ptr() % 16 == 0


def test_prints_of_inputs_that_start_mid_word_and_overlapping_outputs():
    half = torch.arange(10, dtype=torch.float16)[1:5]  # contiguous, but 2 bytes into its storage
    prints = bounds.InputPrints({"h": half})
    half[0] = 7
    assert prints.problems() == ["input 'h' was written by the launch"]
    expanded = torch.zeros(1, 4).expand(3, 4)  # stride 0: handed over as it is
    g = bounds.OutputGuard((expanded,))
    assert g.outs[0] is expanded and g.problems(["e"]) == []
