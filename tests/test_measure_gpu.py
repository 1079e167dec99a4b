"""The timing primitive on a GPU: plain and CUDA-graph replays agree on a real kernel (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from autotune.tuning import measure


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_timing_matches_stream_timing():
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(a)

    def fn():
        torch.matmul(a, b, out=out)

    plain = measure.bench(fn, quick=False).median_ms
    graph = measure.bench(fn, quick=False, cuda_graph=True).median_ms
    assert plain > 0 and graph > 0
    # A 137 GFLOP matmul: launch overhead is noise, so both ways must agree within 20 %.
    assert abs(plain - graph) / plain < 0.2, (plain, graph)
    torch.testing.assert_close(out.float(), (a.float() @ b.float()), atol=1.0, rtol=2e-2)
