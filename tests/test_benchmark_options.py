"""Every benchmark's command line on CPU: an unusable option value is a usage error (exit status 2) naming the
option, before the GPU check, the artifact load or the first input; the default options pass the checks."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch

import autotune

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
MISSING = "/nonexistent/hstu-autotune-benchmark-input"


def _script(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (its folder on the path: the CuTe scripts and the sweep import their
    siblings by bare name, as when run as scripts)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(autouse=True)
def _no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """No CUDA, and no artifacts load: a check that let a bad value through fails on one of them instead."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(autotune, "load", lambda *a, **kw: pytest.fail("artifacts loaded before the checks"))
    monkeypatch.delenv("OUT", raising=False)


BAD = [
    ("bench_compact", ["--batches", "32", "0"], "--batches must be an integer >= 1, got 0"),
    ("bench_compact", ["--head-dim", "96"], "--head-dim must be one of (32, 64, 128, 256)"),
    ("bench_compact", ["--laws", "uniform", "file"], "--laws: unknown file"),
    ("bench_compact", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_compact", ["--gpu", "h999"], f"--gpu {BENCHMARKS.parent / 'artifacts' / 'h999'}: no such folder"),
    ("bench_cute", ["--dims", "256", "64"], "--dims: no CuTe configs for head dim(s) [64]"),
    ("bench_cute", ["--dist", "pareto"], "--dist: unknown pareto"),
    ("bench_cute", ["--configs", "0"], "--configs must be an integer >= 1, got 0"),
    ("bench_cute", ["--l2-groups", "3"], "--l2-groups: unknown 3"),
    ("bench_cute", ["--dtype", "float32"], "argument --dtype: invalid choice: 'float32'"),
    ("bench_cute_bwd", ["--dims", "96"], "--dims must be one of"),
    ("bench_cute_bwd", ["--lengths", "1024", "0"], "--lengths must be an integer >= 1, got 0"),
    ("bench_cute_bwd", ["--batch", "0"], "--batch must be an integer >= 1, got 0"),
    ("bench_gemm_silu", ["--m", "1024,x"], "--m must be comma-separated integers"),
    ("bench_gemm_silu", ["--m", "0"], "--m must be an integer >= 1, got 0"),
    ("bench_gemm_silu", ["--nk", "4096"], "--nk must be comma-separated NxK pairs"),
    ("bench_gemm_silu", ["--nk", "4096x0"], "--nk must be an integer >= 1, got 0"),
    ("bench_gemm_silu", ["--configs", "default,nope"], "--configs: unknown config 'nope'"),
    ("bench_gemm_silu", ["--configs", "cfg:100"], "--configs 'cfg:100': GemmSiluConfig.tile_m"),
    ("bench_gemm_silu", ["--configs", ","], "--configs names no config"),
    ("bench_gemm_silu", ["--rep", "0"], "--rep must be a positive number, got 0.0"),
    ("bench_gemm_silu", ["--json", "{tmp}"], "--json {tmp}: {tmp} is a folder; name a file"),
    ("bench_hstu_triton", ["--dims", "48"], "--dims must be one of"),
    ("bench_hstu_triton", ["--dist", "u3"], "--dist: unknown u3"),
    ("bench_hstu_triton", ["--sweep-len", "0"], "--sweep-len must be an integer >= 1, got 0"),
    ("bench_hstu_triton", ["--heads", "0"], "--heads must be an integer >= 1, got 0"),
    ("bench_hstu_triton", ["--l2-groups", "3"], "--l2-groups: unknown 3"),
    ("bench_hstu_triton", ["--json", "{tmp}"], "--json {tmp}: {tmp} is a folder; name a file"),
    ("bench_layer_ops", ["--head-dim", "48"], "--head-dim must be one of"),
    ("bench_layer_ops", ["--lengths", "0"], "--lengths must be an integer >= 1, got 0"),
    ("bench_layer_ops", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_sdpa", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_sdpa", ["--head-dim", "300"], "--head-dim must be an integer in [1, 256], got 300"),
    ("bench_silu_pass", ["--tokens", "0"], "--tokens must be an integer >= 1, got 0"),
    ("bench_silu_pass", ["--width", "-4"], "--width must be an integer >= 1, got -4"),
    ("bench_silu_pass", ["--width", "8"], "--width 8: no config of the search space fits it"),
    ("bench_validation", ["--calls", "0"], "--calls must be an integer >= 1, got 0"),
    ("bench_validation", ["--repeats", "0"], "--repeats must be an integer >= 1, got 0"),
    ("bench_validation", ["--dim", "48"], "--dim must be one of"),
    ("bench_validation", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_validation", ["--json", "{tmp}"], "--json {tmp}: {tmp} is a folder; name a file"),
    ("profile_attention_bwd", ["--reps", "0"], "--reps must be an integer >= 1, got 0"),
    ("profile_attention_bwd", ["--dims", "256", "512"], "--dims must be an integer in [1, 256], got 512"),
    ("profile_attention_bwd", ["--json", "{tmp}"], "--json {tmp}: {tmp} is a folder; name a file"),
    ("profile_call_host", ["--steps", "0"], "--steps must be an integer >= 1, got 0"),
    ("profile_call_host", ["--head-dim", "0"], "--head-dim must be an integer in [1, 256], got 0"),
    ("profile_call_host", ["--out", "{tmp}/file"], "--out: {tmp}/file exists and is not a folder"),
    ("sweep_triton_bwd", ["--configs", "64,x"], "--configs '64,x'"),
    ("sweep_triton_bwd", ["--configs", "63,64"], "--configs '63,64'"),
    ("sweep_triton_bwd", ["--dim", "96"], "--dim must be one of"),
    ("sweep_triton_bwd", ["--dist", "pareto"], "--dist: unknown pareto"),
    ("sweep_triton_bwd", ["--n", "4096", "0"], "--n must be an integer >= 1, got 0"),
    ("bench_model", ["--log-every", "0"], "--log-every must be an integer >= 1, got 0"),
    ("bench_model", ["--workers", "-1"], "--workers must be an integer >= 0, got -1"),
    ("bench_jagged_ratio", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_jagged", ["--lengths", MISSING, "--other", MISSING], f"--other {MISSING}: no such folder"),
    ("bench_jagged", ["--lengths", MISSING, "--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_layer", ["--head-dim", "48"], "--head-dim must be one of"),
    ("bench_layer", ["--head-dim", "48", "--columns", "+ zero copy"], "--head-dim must be one of"),
    ("bench_layer", ["--from-json", MISSING], f"--from-json {MISSING}: no such file"),
    ("bench_layer", ["--png", "{tmp}"], "--png {tmp}: {tmp} is a folder; name a file"),
    ("bench_layer", ["--artifacts", MISSING], f"--artifacts {MISSING}: no such folder"),
    ("bench_call_host", ["--head-dim", "300"], "--head-dim must be an integer in [1, 256], got 300"),
]


@pytest.mark.parametrize("name, argv, match", BAD, ids=[f"{n}{' '.join(a)}" for n, a, _ in BAD])
def test_a_bad_option_is_a_usage_error_naming_it(name, argv, match, tmp_path, monkeypatch, capsys):
    """A batch of 0, a head dim no kernel has, a misspelt name or a missing input folder: exit status 2 and the
    option in the message, not a traceback after earlier shapes ran, an empty table or 'needs a CUDA GPU'."""
    (tmp_path / "file").write_text("")
    module = _script(name, monkeypatch)
    with pytest.raises(SystemExit) as e:
        module.main([a.format(tmp=tmp_path) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    message = err.strip().splitlines()[-1]  # the usage lines above it name every option
    assert ": error: " in message and match.format(tmp=tmp_path) in message, err


NEEDS_GPU = [
    "bench_compact",
    "bench_cute",
    "bench_cute_bwd",
    "bench_hstu_triton",
    "bench_layer_ops",
    "bench_sdpa",
    "bench_silu_pass",
    "bench_validation",
    "profile_attention_bwd",
    "sweep_triton_bwd",
    "bench_jagged_ratio",
    "bench_call_host",
]


@pytest.mark.parametrize("name", NEEDS_GPU)
def test_the_default_options_pass_the_checks(name, monkeypatch):
    """The defaults get past every check to the GPU check (a check must not refuse what the script runs)."""
    module = _script(name, monkeypatch)
    with pytest.raises(SystemExit, match=f"{name}.py needs a CUDA GPU"):
        module.main([])


def test_bench_jagged_and_profile_call_host_pass_the_checks_with_their_own_inputs(tmp_path, monkeypatch):
    """bench_jagged needs a lengths file, profile_call_host writes under ``--out``: with them, the GPU check."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([100, 200, 300, 4000]))
    with pytest.raises(SystemExit, match="bench_jagged.py needs a CUDA GPU"):
        _script("bench_jagged", monkeypatch).main(["--lengths", str(lengths)])
    with pytest.raises(SystemExit, match="profile_call_host.py needs a CUDA GPU"):
        _script("profile_call_host", monkeypatch).main(["--out", str(tmp_path / "prof")])


def test_bench_gemm_silu_defaults_reach_the_hopper_check(monkeypatch, capsys):
    module = _script("bench_gemm_silu", monkeypatch)
    assert module.main([]) == 2
    assert "needs an sm90 (Hopper) GPU" in capsys.readouterr().err


def test_bench_layer_defaults_reach_the_run_and_a_rows_file_renders(tmp_path, monkeypatch, capsys):
    """The default options reach the layer run; a ``--from-json`` file that exists is rendered."""
    module = _script("bench_layer", monkeypatch)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # no GPU here (``_no_gpu``): the interpreter runs the columns
    monkeypatch.setattr(autotune, "load", lambda *a, **kw: None)
    monkeypatch.setattr(module, "bench", lambda args: [])
    module.main(["--no-save"])
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"bench": "layer", "column": "default unfused", "seq_len": 1024, "tflops": 100.0}))
    module.main(["--from-json", str(rows)])
    assert "| default unfused | 100 |" in capsys.readouterr().out


def test_bench_model_cpu_options_reach_the_run(monkeypatch):
    module = _script("bench_model", monkeypatch)
    reached = []
    monkeypatch.setattr(module, "bench", lambda args, console, device: reached.append(device) or [])
    monkeypatch.setattr(module, "table", lambda *a: "")
    module.main(["--preset", "tiny", "--device", "cpu", "--kernels", "reference"])
    assert reached == [torch.device("cpu")]
