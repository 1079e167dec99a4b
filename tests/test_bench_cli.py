"""The benchmarks' command lines on CPU: a bad option value is a usage error naming the option before any GPU
work, and what a benchmark writes or reports is what its options asked for (the GPU parts are stubbed)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

import autotune
from benchmarks import (
    bench_call_host,
    bench_jagged,
    bench_jagged_ratio,
    bench_layer,
    bench_sdpa,
    cute_bench_common,
    profile_model,
)


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
        (bench_jagged.main, ["--lengths", "/nonexistent/lengths.json"], "--lengths /nonexistent/lengths.json"),
        (bench_sdpa.main, ["--lengths", "0"], "--lengths must be an integer >= 1, got 0"),
        (bench_sdpa.main, ["--heads", "0"], "--heads must be an integer >= 1"),
    ],
)
def test_bad_batch_options_are_usage_errors_before_any_timing(main, argv, match, monkeypatch, capsys):
    """``--laws file`` without ``--lengths`` timed the uniform batch of the first bucket, then raised a ValueError
    traceback from ``law_lengths``; a batch of 0 or a negative bucket failed inside the first timing."""
    _no_gpu_work(monkeypatch, bench_jagged, bench_jagged_ratio, bench_sdpa)
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--preset", "nope"], "unknown preset 'nope'"),
        (["--set", "num_layers=two"], "num_layers takes an int"),
        (["--set", "kernels=reference"], "the kernel source is each --kernels value's own"),
        (["--steps", "0"], "--steps must be an integer >= 1, got 0"),
        (["--json", "{tmp}"], "is a folder; name a file"),
        (["--json", "{tmp}/file/profile.json"], "exists and is not a folder"),
    ],
)
def test_profile_model_options_are_checked_before_any_profile(argv, match, tmp_path, monkeypatch, capsys):
    """A ``--json`` that cannot be written failed after every source had been profiled (all of it lost), and
    ``--steps 0`` divided by zero after the warm-up steps: usage errors now, before the CUDA check."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(profile_model, "profile_source", lambda *a, **kw: pytest.fail("profiled before the check"))
    with pytest.raises(SystemExit) as e:
        profile_model.main(["--kernels", "default", *(a.format(tmp=tmp_path) for a in argv)])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_profile_model_applies_every_repeated_set_and_creates_the_json_folder(tmp_path, monkeypatch):
    """``--set a=1 --set b=2`` profiled with ``b`` only (the second list replaced the first), silently."""
    seen = []

    def fake_profile(preset, kernels, steps, warmup, artifacts, overrides, by_op=False):
        seen.append(overrides)
        return {"kernels": kernels, "overrides": overrides, "device_ms_per_step": 1.0, "groups": {"other": 1.0},
                "copy_kernels": {"calls": 0, "ms_per_step": 0.0}, "top": [], "ops": []}  # fmt: skip

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(profile_model, "profile_source", fake_profile)
    out = tmp_path / "new" / "p.json"
    argv = ["--preset", "tiny", "--kernels", "default", "--set", "num_layers=1", "--set", "dropout=0.0"]
    profile_model.main([*argv, "--json", str(out)])
    assert seen == [{"num_layers": 1, "dropout": 0.0}]
    assert json.loads(out.read_text())["results"][0]["overrides"] == {"num_layers": 1, "dropout": 0.0}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--columns", "zero copy"], "--columns: unknown column(s) ['zero copy']"),
        (["--lengths", "1024", "0"], "--lengths must be an integer >= 1, got 0"),
        (["--batch", "0"], "--batch must be an integer >= 1"),
        (["--dropout", "1.5"], "--dropout must be in [0, 1)"),
    ],
)
def test_bench_layer_options_are_checked_before_any_layer_runs(argv, match, monkeypatch, capsys):
    """A misspelt ``--columns`` name (``"zero copy"`` for ``"+ zero copy"``) ran nothing and printed an empty
    table, appending no rows, without a word."""
    _no_gpu_work(monkeypatch)
    monkeypatch.setattr(bench_layer, "bench", lambda *a, **kw: pytest.fail("a layer ran before the check"))
    with pytest.raises(SystemExit) as e:
        bench_layer.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_bench_layer_without_a_gpu_or_the_interpreter_is_a_usage_error(monkeypatch, capsys):
    """On a CPU without TRITON_INTERPRET=1 every column was an error row, appended to benchmarks/results."""
    _no_gpu_work(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench_layer, "bench", lambda *a, **kw: pytest.fail("a layer ran without a GPU"))
    monkeypatch.setattr(bench_layer, "append_rows", lambda *a, **kw: pytest.fail("rows were appended"))
    with pytest.raises(SystemExit) as e:
        bench_layer.main(["--lengths", "64", "--batch", "2"])
    assert e.value.code == 2 and "bench_layer.py needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.interpreter
@pytest.mark.parametrize(("hint", "want"), [("auto", None), ("jagged", "jagged")])
def test_bench_layer_times_a_law_s_batches_under_the_attention_hint(hint, want, monkeypatch):
    """``--law`` times a heavy-tailed batch (its fill recorded) and ``--attention-hint`` reaches the fused layer's
    plan: "auto" leaves the attention to the fill match (no distribution), "jagged" pins it."""
    import models.hstu

    seen = []
    plan_layer = models.hstu.plan_layer
    monkeypatch.setattr(models.hstu, "plan_layer", lambda *a, **kw: seen.append(a[8]) or plan_layer(*a, **kw))
    argv = ["--lengths", "64", "--batch", "4", "--law", "one-long", "--columns", "+ zero copy",
            "--attention-hint", hint, "--no-save"]  # fmt: skip
    (row,) = bench_layer.bench(bench_layer.parser().parse_args(argv))
    assert "error" not in row, row
    assert (row["law"], row["attention_hint"]) == ("one-long", hint) and 0 < row["fill"] < 1
    assert seen and set(seen) == {want}


@pytest.mark.parametrize("calls", [1, 2, 5])
def test_call_host_refills_a_backward_block_during_the_warm_up(calls, monkeypatch):
    """The warm-up made ``max(3, calls // 4)`` calls from one refill of ``calls`` outputs: with ``--calls`` 1 or 2
    the backward case popped an empty list (IndexError) after the forward cases had been timed."""
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    pending: list[int] = []
    popped = []
    stats = bench_call_host.host_us(
        lambda: popped.append(pending.pop()), calls, 2, lambda: pending.__setitem__(slice(None), range(calls))
    )
    assert len(popped) == max(3, calls // 4) + 2 * calls and set(stats) == {"us_p20", "us_p50", "us_p80"}


@pytest.mark.parametrize(
    "argv, match",
    [(["--calls", "0"], "--calls must be an integer >= 1"), (["--blocks", "0"], "--blocks must be an integer >= 1"),
     (["--batches", "1", "0"], "--batches must be an integer >= 1, got 0")],
)  # fmt: skip
def test_call_host_counts_are_usage_errors_before_any_timing(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    _no_gpu_work(monkeypatch)
    with pytest.raises(SystemExit) as e:
        bench_call_host.main(argv)
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_cute_benchmarks_check_json_up_front_and_create_out(tmp_path, monkeypatch, capsys):
    """``--json`` under a missing or non-folder path, or a ``$OUT`` not made yet, raised from the first write,
    after the first config's check had compiled and run."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(sys, "argv", ["bench_cute.py", "--json", str(tmp_path / "file" / "x.json")])
    with pytest.raises(SystemExit) as e:
        cute_bench_common.parse_args()
    assert e.value.code == 2 and "--json" in capsys.readouterr().err
    monkeypatch.setenv("OUT", str(tmp_path / "out" / "new"))
    cute_bench_common.write_json(None, "bench_cute.json", {"rows": []})
    assert json.loads((tmp_path / "out" / "new" / "bench_cute.json").read_text()) == {"rows": []}


def _layer_rows() -> list[dict]:
    """Two columns at a sub-1K and a 1K length, with TFLOP/s and peak memory as a GPU run writes them."""
    rows = []
    for column, tflops, mem in (("default unfused", 100.0, 9.0), ("+ recompute", 150.0, 5.0)):
        for n in (512, 1024):
            rows.append({"bench": "layer", "column": column, "seq_len": n, "tflops": tflops + n / 512,
                         "peak_mem_gib": mem + n / 1024, "gpu": "H100"})  # fmt: skip
    return rows


def test_bench_layer_render_writes_tflops_and_peak_memory_bars_with_length_labels(tmp_path):
    """The chart labelled a 512-row length "0K" (the table said 512) and drew TFLOP/s only, though the columns'
    point is the memory recompute saves: a second panel now holds each column's peak memory."""
    pytest.importorskip("matplotlib")
    rows = _layer_rows()
    table = bench_layer.render(rows, str(tmp_path / "layer.png"))
    assert (tmp_path / "layer.png").stat().st_size > 0
    assert "| column | 512 | 1K |" in table and "| + recompute | 151 / 5.5 GiB | 152 / 6.0 GiB |" in table
    fig = bench_layer.figure(rows)
    speed, memory = fig.axes[:2]
    for ax in (speed, memory):
        assert [t.get_text() for t in ax.get_xticklabels()] == ["512", "1K"]
    assert "TFLOP/s" in speed.get_ylabel() and "GiB" in memory.get_ylabel()
    heights = sorted(round(p.get_height(), 3) for p in memory.patches)
    assert heights == sorted(round(r["peak_mem_gib"], 3) for r in rows)


def test_bench_layer_render_keeps_one_series_per_law_and_attention_hint():
    """Rows of one column and length timed under two attention hints (a --law run with --attention-hint auto, one
    with jagged, rendered together from --from-json) took one table cell: the last row hid the other."""
    pytest.importorskip("matplotlib")
    rows = [{"bench": "layer", "column": "+ zero copy", "seq_len": 1024, "tflops": t, "law": "pareto",
             "fill": 0.2, "attention_hint": hint} for hint, t in (("auto", 120.0), ("jagged", 100.0))]  # fmt: skip
    rows.append({"bench": "layer", "column": "default unfused", "seq_len": 1024, "tflops": 80.0})
    table = bench_layer.render(rows, None)
    assert "| default unfused | 80 |" in table
    assert (
        "| + zero copy (pareto, hint auto) | 120 |" in table and "| + zero copy (pareto, hint jagged) | 100 |" in table
    )
    assert table.index("default unfused") < table.index("hint auto") < table.index("hint jagged")
    assert sorted(p.get_height() for p in bench_layer.figure(rows).axes[0].patches) == [80.0, 100.0, 120.0]


def test_bench_layer_chart_of_cpu_rows_has_no_memory_panel():
    """CPU rows carry no peak memory: one panel, and the title names no GPU with a dangling comma."""
    pytest.importorskip("matplotlib")
    rows = [{k: v for k, v in r.items() if k not in ("peak_mem_gib", "gpu")} for r in _layer_rows()]
    fig = bench_layer.figure(rows)
    assert len(fig.axes) == 1 and not fig.axes[0].get_title().endswith(", ")


@pytest.mark.parametrize(
    "name", ["bench_jagged_ratio", "bench_sdpa", "bench_compact", "sweep_triton_bwd", "bench_layer_ops"]
)
def test_gpu_benchmarks_say_they_need_a_gpu(name, monkeypatch):
    """Without CUDA, bench_jagged_ratio and bench_sdpa died of a CUDA generator's RuntimeError and bench_compact
    and sweep_triton_bwd of torch's "not compiled with CUDA" AssertionError, as tracebacks."""
    import importlib
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))  # sweep's sibling import
    module = importlib.import_module(f"benchmarks.{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(autotune, "load", lambda *a, **kw: pytest.fail("artifacts loaded without a GPU"))
    with pytest.raises(SystemExit, match=f"{name}.py needs a CUDA GPU"):
        module.main([])
