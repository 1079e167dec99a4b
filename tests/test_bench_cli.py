"""The benchmarks' command lines on CPU: a bad option value is a usage error naming the option before any GPU
work, and what a benchmark writes or reports is what its options asked for (the GPU parts are stubbed)."""

from __future__ import annotations

import pytest

import autotune
from benchmarks import bench_jagged_ratio, bench_sdpa


def _no_gpu_work(monkeypatch: pytest.MonkeyPatch, *modules: object) -> None:
    """Fail the test if any benchmark step that would touch the GPU (or load artifacts) starts."""
    monkeypatch.setattr(
        autotune, "load", lambda *a, **kw: pytest.fail("artifacts loaded before the options were checked")
    )
    for module in modules:
        monkeypatch.setattr(module, "measure", lambda *a, **kw: pytest.fail("a batch was timed before the check"))


@pytest.mark.parametrize(
    "main, argv, match",
    [
        (bench_jagged_ratio.main, ["--laws", "file"], "--laws file needs --lengths FILE"),
        (bench_jagged_ratio.main, ["--batch", "0"], "--batch must be an integer >= 1"),
        (bench_jagged_ratio.main, ["--buckets", "1024", "-1"], "--buckets must be an integer >= 1, got -1"),
        (bench_jagged_ratio.main, ["--head-dim", "512"], "--head-dim must be an integer in [1, 256]"),
        (bench_jagged_ratio.main, ["--lengths", "/nonexistent/lengths.json"], "--lengths /nonexistent/lengths.json"),
        (bench_sdpa.main, ["--lengths", "0"], "--lengths must be an integer >= 1, got 0"),
        (bench_sdpa.main, ["--heads", "0"], "--heads must be an integer >= 1"),
    ],
)
def test_bad_batch_options_are_usage_errors_before_any_timing(main, argv, match, monkeypatch, capsys):
    """``--laws file`` without ``--lengths`` timed the uniform batch of the first bucket, then raised a ValueError
    traceback from ``law_lengths``; a batch of 0 or a negative bucket failed inside the first timing."""
    _no_gpu_work(monkeypatch, bench_jagged_ratio, bench_sdpa)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err
