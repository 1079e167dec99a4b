"""The model benchmark's command line (CPU): every variant is checked before the first one runs, and a variant
whose loss diverges gets an error row while the others still run."""

from __future__ import annotations

import json

import pytest

from benchmarks import bench_model

BASE = ["--preset", "tiny", "--device", "cpu", "--steps", "1", "--warmup", "0", "--no-progress"]


@pytest.fixture(autouse=True)
def _interpreter_on_the_cpu(monkeypatch):
    """BASE runs on the CPU, where GPU kernel variants need the interpreter: set as CI sets it, so a GPU host
    (where it is off) checks the same options instead of stopping at the --kernels refusal first."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--kernels", "default", "reference", "--reference-steps", "0"], "--reference-steps must be >= 1"),
        (["--kernels", "reference", "--set", "kernels=default"], "the kernel source is each variant's own"),
        (["--kernels", "reference:kernels=default"], "the source goes before the ':'"),
        (["--kernels", "default", "nope"], "the source must be one of"),
        (["--kernels", "default", "default:foo=1"], "foo"),
        (["--kernels", "default", "default:layer=fused,precision=bf16"], "precision='bf16'"),
        (["--kernels", "default", "--cuda-graph"], "CUDA graphs need a CUDA device"),
        (["--kernels", "reference", "--base", "tuned"], "--base 'tuned' is none of the variants"),
        (["--kernels", "reference", "--dtype", "fp16"], "invalid choice"),
        (["--kernels", "reference", "--device", "meta"], "device must be cpu or cuda[:N], got 'meta'"),
        (["--kernels", "reference", "default:graph_tokens=8"], "graph_tokens pads the batches of CUDA-graph steps"),
    ],
)
def test_bad_variants_are_usage_errors_before_anything_runs(argv, match, monkeypatch, capsys):
    monkeypatch.setattr(bench_model, "run", lambda *a, **kw: pytest.fail("a variant ran before every one was checked"))
    with pytest.raises(SystemExit) as e:
        bench_model.main([*BASE, *argv])
    assert e.value.code == 2 and match in capsys.readouterr().err


def test_gpu_kernels_on_a_cpu_without_the_interpreter_are_refused_before_anything_runs(monkeypatch, capsys):
    """A 'default' variant on a CPU without TRITON_INTERPRET=1 ran the reference variant first, then failed in
    dispatch with a traceback."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(bench_model, "run", lambda *a, **kw: pytest.fail("a variant ran before every one was checked"))
    with pytest.raises(SystemExit) as e:
        bench_model.main([*BASE, "--kernels", "reference", "default"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--kernels default runs Triton/CuTe GPU kernels" in err, err


def test_repeated_set_options_all_apply_and_a_diverged_variant_keeps_the_others(tmp_path, monkeypatch):
    seen = []

    def fake_run(cfg, steps, *a, **kw):
        seen.append(cfg)
        if cfg.kernels == "default":
            raise FloatingPointError("the loss is nan at step 2: training diverged (lr=1.0)")
        return {"kernels": cfg.kernels, "tokens_per_s": 1.0, "steps": steps, "step_ms": 1.0, "tflops": 1.0,
                "mfu": None, "peak_memory_gib": None, "first_loss": 0.7, "final_loss": 0.6,
                "dispatch": {"warnings": []}}  # fmt: skip

    monkeypatch.setattr(bench_model, "run", fake_run)
    out = tmp_path / "b.json"
    results = bench_model.main([*BASE, "--kernels", "default", "reference", "--set", "num_layers=1", "--set",
                                "dropout=0.0", "--json", str(out)])  # fmt: skip
    assert [(c.kernels, c.num_layers, c.dropout) for c in seen] == [("default", 1, 0.0), ("reference", 1, 0.0)]
    assert "training diverged" in results[0]["error"] and results[1]["final_loss"] == 0.6
    assert [r["variant"] for r in json.loads(out.read_text())["results"]] == ["default", "reference"]


@pytest.mark.parametrize("where, match", [("", "is a folder; name a file"), ("file/b.json", "is not a folder")])
def test_an_unwritable_json_is_a_usage_error_before_anything_runs(where, match, tmp_path, monkeypatch, capsys):
    """The JSON was written after every variant had run: ``--json`` naming a folder (or a path under a file)
    ended the benchmark with a traceback there, and every result was lost."""
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(bench_model, "run", lambda *a, **kw: pytest.fail("a variant ran before --json was checked"))
    with pytest.raises(SystemExit) as e:
        bench_model.main([*BASE, "--kernels", "reference", "--json", str(tmp_path / where)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--json {tmp_path / where}" in err and match in err, err


def test_artifacts_default_to_the_packaged_ones(tmp_path, monkeypatch):
    """Without --artifacts the tuned variant loads the shipped artifacts (autotune.load()), not ./artifacts."""
    seen = []

    def fake_run(cfg, steps, device, warmup, dtype, artifacts, *a, **kw):
        seen.append(artifacts)
        return {"kernels": cfg.kernels, "tokens_per_s": 1.0, "steps": steps, "step_ms": 1.0, "tflops": 1.0,
                "mfu": None, "peak_memory_gib": None, "first_loss": 0.7, "final_loss": 0.6,
                "dispatch": {"warnings": []}}  # fmt: skip

    monkeypatch.setattr(bench_model, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    bench_model.main([*BASE, "--kernels", "reference"])
    assert seen == [None]
