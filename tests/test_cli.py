"""The ``autotune`` CLI: argument and GPU errors, dry run, an end-to-end run under the interpreter, show."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from autotune.runtime import artifacts as art
from autotune.runtime import gpus
from autotune.tuning.cli import main, parse_duration


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_unknown_gpu(capsys):
    rc, text = _run(capsys, "run", "--gpu", "x100", "--dry-run")
    assert rc == 2 and "unknown GPU 'x100'" in text and "h100" in text


def test_mismatching_gpu_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(gpus, "detect_gpu", lambda: "h200")
    rc, text = _run(capsys, "run", "--gpu", "h100")
    assert rc == 2 and "GPU present is h200" in text and "--gpu auto" in text


def test_no_gpu_is_refused_without_dry_run_or_interpret(capsys, monkeypatch):
    def no_gpu():
        raise RuntimeError("no CUDA GPU is present")

    monkeypatch.setattr(gpus, "detect_gpu", no_gpu)
    rc, text = _run(capsys, "run", "--gpu", "h100")
    assert rc == 2 and "--dry-run" in text
    rc, text = _run(capsys, "bench", "--gpu", "auto")
    assert rc == 2 and "no CUDA GPU" in text and "bench measures on the GPU" in text
    rc, text = _run(capsys, "verify", "--gpu", "auto")
    assert rc == 2 and "verify re-checks on the GPU" in text and "--dry-run" not in text  # verify has none


@pytest.mark.parametrize(
    "args, message",
    [
        (["--buckets", "3K"], "bucket '3K'"),
        (["--dims", "48x"], "bad head dims"),
        (["--dims", "48"], "no feasible config"),
        (["--distributions", "zipf"], "unknown distribution"),
        (["--masks", "diagonal"], "unknown mask"),
        (["--kernel", "softmax_attention"], "unknown kernel"),
        (["--time-budget", "soon"], "bad duration"),
        (["--trials", "0"], ">= 1"),
        (["--buckets", ","], "--buckets ',' names nothing"),
        (["--kernel", ","], "--kernel ',' names nothing"),
        (["--distributions", ","], "--distributions ',' names nothing"),
        (["--masks", ","], "--masks ',' names nothing"),
        (["--backends", "triton,nope"], "--backends: nope is no backend"),
        # These named no option (and --backends printed a Python list).
        (["--backends", "nope"], "--backends: nope is no backend of hstu_attention_bwd"),
        (["--distributions", "zipf"], "--distributions: unknown distribution 'zipf'"),
        (["--masks", "diagonal"], "--masks: unknown mask 'diagonal'"),
        (["--backends", ","], "--backends names nothing"),
        (["--time-budget", "nan"], "positive and finite"),
        (["--time-budget", "inf"], "positive and finite"),
        (["--compare-rounds", "0"], "--compare-rounds must be >= 1"),
        (["--compare-rounds", "-2"], "--compare-rounds must be >= 1"),
        (["--compare-rounds", "8", "--compare-max-rounds", "6"], "--compare-max-rounds (6) must be >="),
        (["--eval-timeout", "0"], "--eval-timeout must be a positive"),
        (["--eval-timeout", "-1"], "--eval-timeout must be a positive"),
        (["--eval-timeout", "nan"], "--eval-timeout must be a positive"),
        (["--plugin", "nonexistent_plugin_module"], "--plugin nonexistent_plugin_module: cannot import"),
        (["--warm-starts", "nearest"], "--warm-starts must be one of all, own, got 'nearest'"),
        # The samplers seed NumPy's RandomState: these were a ValueError traceback inside the first task.
        (["--seed", "-1"], "--seed must be an integer in [0, 2**32 - 1], got -1"),
        (["--seed", str(2**32)], "--seed must be an integer in [0, 2**32 - 1]"),
        # A huge batch drew its lengths for minutes (then could not launch): bounded by the grid's y limit.
        (["--batch", str(10**9)], "--batch must be an integer in [1, 65535], got 1000000000"),
        (["--batch", "65536"], "--batch must be an integer in [1, 65535]"),
        (["--batch", "0"], "--batch must be an integer in [1, 65535], got 0"),
        (["--batch", "-3"], "--batch must be an integer in [1, 65535], got -3"),
        (["--heads", str(10**9)], "--heads must be an integer in [1, 32768]"),
        (["--heads", "0"], "--heads must be an integer in [1, 32768]"),
        (["--trials", "-1"], "--trials must be an integer >= 1"),
        (["--workers", "0"], "--workers must be an integer >= 1"),
        (["--seq-cap", "-5"], "--seq-cap must be an integer >= 1"),  # was a ValueError traceback
        (["--seq-cap", "0"], "--seq-cap must be an integer >= 1"),  # was silently no cap
        (["--dims", "0"], "--dims: bad head dims '0'"),  # was 'no feasible config ... d0/0', no option named
        (["--dims", "128x-64"], "--dims: bad head dims"),
        (["--buckets", "0"], "--buckets: bucket '0'"),
        (["--time-budget", "-1"], "--time-budget: duration must be positive"),
        (["--from-model", "tiny", "--batch", "0"], "--batch must be an integer in [1, 65535]"),  # skipped the check
        (["--from-model", "tiny", "--trials", "0"], "--trials must be an integer >= 1"),
    ],
)
def test_bad_arguments(capsys, args, message):
    rc, text = _run(capsys, "run", "--gpu", "h100", "--dry-run", *args)
    assert rc == 2 and message in text and len(text.strip().splitlines()) == 1, text


def test_batch_and_heads_bounds_hold_at_the_limits(capsys):
    from autotune.tuning.tasks import MAX_BATCH, MAX_HEADS, Task
    from kernel_templates.hstu_attention.input_check import GRID_YZ_MAX

    assert MAX_BATCH == GRID_YZ_MAX and MAX_BATCH * MAX_HEADS <= 2**31 - 1  # the grid's y and x limits
    base = ("run", "--gpu", "h100", "--dry-run", "--kernel", "fwd", "--dims", "32", "--buckets", "256")
    rc, text = _run(capsys, *base, "--distributions", "uniform", "--batch", str(MAX_BATCH))
    assert rc == 0, text
    task = ("hstu_attention_fwd", "h100", "float32", 32, 32)
    with pytest.raises(ValueError, match="batch must be in"):
        Task(*task, 1, 256, "uniform", batch=MAX_BATCH + 1)
    with pytest.raises(ValueError, match="num_heads must be in"):
        Task(*task, MAX_HEADS + 1, 256, "uniform")


def test_tasks_command_bounds_its_batch(capsys):
    rc, text = _run(capsys, "tasks", "--from-model", "tiny", "--batch", "70000")
    assert rc == 2 and "--batch must be an integer in [1, 65535], got 70000" in text


def test_parse_duration():
    assert parse_duration("90") == 90 and parse_duration("6m") == 360 and parse_duration("1.5h") == 5400
    assert parse_duration(None) is None


@pytest.mark.parametrize("text", ["", "  "])
def test_an_empty_time_budget_is_a_usage_error_not_no_budget(capsys, text):
    """``--time-budget "$BUDGET"`` with BUDGET unset ran with no budget at all (the GPU default is 40m): only "0" and
    "none" mean that; an empty value names nothing, as an empty ``--storage`` does."""
    rc, out = _run(capsys, "run", "--gpu", "h100", "--dry-run", "--time-budget", text)
    assert rc == 2 and "--time-budget" in out and "names nothing" in out, out


@pytest.mark.parametrize(
    ("argv", "option"),
    [
        (["show", "--gpu", "h100", "--artifacts", ""], "--artifacts"),
        (["merge", "MERGED", "--artifacts", " "], "--artifacts"),
        (
            [
                "run",
                "--gpu",
                "h100",
                "--interpret",
                "--kernel",
                "fake_op",
                "--plugin",
                "autotune.tuning.fake",
                "--trials",
                "1",
                "--artifacts",
                "",
            ],
            "--artifacts",
        ),  # fmt: skip
        (["verify", "--gpu", "h100", "--interpret", "--kernel", "fwd", "--json", ""], "--json"),
    ],
)
def test_an_empty_path_option_is_a_usage_error_not_a_default(capsys, tmp_path, monkeypatch, argv, option):
    """``--artifacts "$DIR"`` with DIR unset merged into (and showed, verified) the package's own artifacts, or ran
    into the working directory; ``--json ""`` wrote nothing without a word. An empty path names nothing."""
    shutil.copytree(art.DEFAULT_ROOT / "h100", tmp_path / "packaged" / "h100", ignore=shutil.ignore_patterns("studies"))
    monkeypatch.setattr(art, "DEFAULT_ROOT", tmp_path / "packaged")  # never the checkout's artifacts
    monkeypatch.chdir(tmp_path)
    merged = str(art.artifact_path("h100", "hstu_attention_bwd", tmp_path / "packaged"))
    rc, text = _run(capsys, *[merged if a == "MERGED" else a for a in argv])
    assert rc == 2 and f"{option} names nothing" in text, text


def test_no_feasible_config_names_the_backends_and_the_dtype(capsys):
    """The message blamed the head dims alone, also when --dtype float32 --backends cute ruled out every config."""
    argv = ("run", "--gpu", "h100", "--dry-run", "--kernel", "fwd", "--dims", "256", "--buckets", "1K")
    rc, text = _run(capsys, *argv, "--distributions", "uniform", "--dtype", "float32", "--backends", "cute")
    assert rc == 2 and "no feasible config for hstu_attention_fwd float32" in text and "in cute" in text, text
    assert "head dims or dtype" in text


def test_cuda_graph_under_the_interpreter_is_a_usage_error(capsys, tmp_path):
    """The interpreter times plain calls: the entries were written with timing 'do_bench+cuda_graph'."""
    rc, text = _run(capsys, "run", "--interpret", "--cuda-graph", "--artifacts", str(tmp_path))
    assert rc == 2 and "--cuda-graph" in text and "--interpret" in text, text
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("budget", ["0", "none", "NONE"])
def test_a_budget_of_0_or_none_is_reported_as_none(capsys, budget):
    """'0' and 'none' mean no budget (parse_duration); the summary line said 'time budget 0'."""
    argv = ("run", "--gpu", "h100", "--dry-run", "--kernel", "fwd", "--dims", "32", "--buckets", "256")
    rc, text = _run(capsys, *argv, "--distributions", "uniform", "--time-budget", budget)
    assert rc == 0 and "time budget none; nothing was run" in text, text


def test_dry_run_lists_tasks_and_space_sizes_without_a_gpu(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    rc, text = _run(capsys, "run", "--gpu", "h100", "--dry-run")
    assert rc == 0
    # 2 kernels x 2 head dims x 4 buckets x 3 length laws
    assert text.count("hstu_attention_fwd bfloat16") == 24 and text.count("hstu_attention_bwd bfloat16") == 24
    assert "triton 640 -> 260" in text  # fwd d256 on h100: full space -> feasible
    assert "d128/128" in text and "8K jagged" in text and "2K sparse" in text


@pytest.mark.parametrize("before", [None, "0"])
def test_interpret_leaves_the_callers_environment_as_it_was(capsys, monkeypatch, before):
    """``main([... "--interpret"])`` turns the interpreter on for its own work only: a library caller (or a test
    session on a GPU host) that runs compiled Triton kernels afterwards must not find TRITON_INTERPRET=1."""
    import os

    from autotune.tuning import cli

    if before is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", before)
    seen = {}

    def cmd_run(args) -> int:
        seen["during"] = os.environ.get("TRITON_INTERPRET")
        return 0

    monkeypatch.setattr(cli, "cmd_run", cmd_run)
    assert cli.main(["run", "--gpu", "h100", "--interpret", "--dry-run"]) == 0
    assert seen["during"] == "1" and os.environ.get("TRITON_INTERPRET") == before


@pytest.mark.interpreter
def test_end_to_end_run_under_the_interpreter_then_show(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    root = tmp_path / "artifacts"
    argv = ["run", "--gpu", "h100", "--interpret", "--trials", "2", "--artifacts", str(root)]
    rc, text = _run(capsys, *argv, "--distributions", "jagged", "--buckets", "256", "--dims", "32", "--heads", "1")
    assert rc == 0, text
    assert "autotune run: h100" in text and "speedup" in text
    for kernel in ("hstu_attention_fwd", "hstu_attention_bwd"):
        a = art.load_artifact(art.artifact_path("h100", kernel, root))
        entry = a.lookup("float32", 32, 32, 256, "jagged")
        assert entry is not None and entry["trials"] >= 1 and entry["speedup"] >= 1.0
        assert entry["median_ms"] <= entry["default_ms"]
        assert a.template_hash["triton"] == art.current_template_hash(kernel)
    assert (root / "h100" / "studies" / "tuning.journal").exists()
    assert "--verify quick" not in text  # the default full re-check needs no follow-up
    # The run's full re-check recorded every case ``autotune verify --missing`` looks for: nothing is left.
    rc, text = _run(capsys, "verify", "--gpu", "h100", "--interpret", "--artifacts", str(root), "--missing")
    assert rc == 0 and "0 of 0 entries passed (full) on h100" in text, text
    rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(root))
    assert rc == 0 and "hstu_attention_fwd on h100" in text and "hstu_attention_bwd on h100" in text
    # Off a GPU the full re-check is 5 masks x (fp32, fp16) on short sequences + 5 masks on the long one.
    assert "re-checked" in text and text.count("15/15") == 2
    path = art.artifact_path("h100", "hstu_attention_fwd", root)
    path.write_text("{not json")
    rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(root))
    assert rc == 1 and "not valid JSON" in text


def test_a_run_cut_by_its_time_budget_says_which_tasks_and_how_to_resume(capsys, monkeypatch, tmp_path):
    """A task the time budget stopped before its trials is marked "cut" in the table and named in a line saying
    the same command resumes it; the resumed run completes it and says nothing of a cut."""
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["run", "--gpu", "h100", "--interpret", "--plugin", "autotune.tuning.fake", "--kernel", "fake_op",
            "--dims", "32", "--heads", "1", "--buckets", "256", "--distributions", "uniform", "--trials", "4",
            "--sampler", "bruteforce", "--eval-timeout", "3", "--artifacts", str(tmp_path / "a")]  # fmt: skip
    rc, text = _run(capsys, *argv, "--time-budget", "0.001s")
    assert rc == 0 and " cut " in text and "1 task(s) stopped at the time budget before 4 trials" in text, text
    rc, text = _run(capsys, *argv)
    assert rc == 0 and "stopped at the time budget" not in text and "4 (" in text, text


def test_an_interpreter_run_refuses_to_write_over_a_gpu_made_artifact(capsys, tmp_path):
    """``run --interpret --artifacts artifacts`` merged its interpreter timings into the GPU's files: the GPU
    entries, of another timing environment, were dropped with a warning (nothing kept aside) and the file became
    one a GPU host rejects. ``merge`` refuses that; the run does too, before tuning, naming the file."""
    from autotune.tuning.fake import FakeConfig

    env = {**dict.fromkeys(art.ENV_KEYS), "gpu_name": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    entry = {"dtype": "float32", "dqk": 32, "dv": 32, "num_heads": 1, "bucket": 512, "distribution": "uniform",
             "mask": "causal", "backend": "fake", "config": FakeConfig(mode="ok").to_dict(), "median_ms": 1.0,
             "spread_ms": 0.0, "tflops": 1.0, "default_ms": 2.0, "default_tflops": 0.5, "speedup": 2.0, "trials": 3,
             "tuning_s": 1.0}  # fmt: skip
    hashes = {"fake": art.current_template_hash("fake_op", "fake")}
    path = art.save_artifact(art.Artifact("fake_op", "h100", env, hashes, "s", [entry]),
                             art.artifact_path("h100", "fake_op", tmp_path))  # fmt: skip
    before = path.read_bytes()
    argv = ["run", "--gpu", "h100", "--interpret", "--plugin", "autotune.tuning.fake", "--kernel", "fake_op",
            "--dims", "32", "--heads", "1", "--buckets", "256", "--distributions", "uniform", "--trials", "2",
            "--sampler", "bruteforce", "--eval-timeout", "3", "--artifacts", str(tmp_path)]  # fmt: skip
    rc, text = _run(capsys, *argv)
    assert rc == 2 and "--artifacts" in text and "tuned on a GPU" in text and path.read_bytes() == before, text


def test_merge_folds_runs_into_one_artifact_and_refuses_stale_files(capsys, tmp_path):
    """Two runs' files (here: the shipped backward artifact split in halves) merge into the entries of
    one; a stale file is refused by name before any target is written."""
    import json

    shipped = art.artifact_path("h100", "hstu_attention_bwd")
    data = json.loads(shipped.read_text())
    halves = []
    for i, part in enumerate((data["entries"][::2], data["entries"][1::2])):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps({**data, "entries": part}))
        halves.append(str(p))
    stale = tmp_path / "stale.json"
    stale.write_text(json.dumps({**data, "template_hash": {b: "0" * 64 for b in data["template_hash"]}}))
    root = tmp_path / "artifacts"
    rc, text = _run(capsys, "merge", *halves, str(stale), "--artifacts", str(root))
    assert rc == 2 and "stale.json" in text and "stale artifact" in text
    assert not art.artifact_path("h100", "hstu_attention_bwd", root).exists()
    rc, text = _run(capsys, "merge", *halves, "--artifacts", str(root))
    assert rc == 0 and text.count("merged") == 2
    merged = art.load_artifact(art.artifact_path("h100", "hstu_attention_bwd", root))
    key = art.entry_key
    assert sorted(map(key, merged.entries)) == sorted(map(key, data["entries"]))
    assert {key(e): e for e in merged.entries} == {key(e): e for e in data["entries"]}


def _committed_bwd_target(tmp_path: Path) -> tuple[dict, Path, Path]:
    """(the committed H100 backward artifact's JSON, an artifacts root under ``tmp_path``, that root's copy of it):
    the merge target a test merges into."""
    import json

    shipped = art.artifact_path("h100", "hstu_attention_bwd")
    root = tmp_path / "artifacts"
    target = art.artifact_path("h100", "hstu_attention_bwd", root)
    target.parent.mkdir(parents=True)
    target.write_text(shipped.read_text())
    return json.loads(shipped.read_text()), root, target


def test_merging_shard_copies_keeps_every_shards_retuned_entries(capsys, tmp_path):
    """A re-tune split over shards runs each on its own copy of the committed artifacts, so each copy still holds the
    entries the other shards re-tuned, as committed. Merged entry by entry, the last copy put those committed entries
    back over the first copy's re-tuned ones: its results were silently lost. Entries a copy holds as the target had
    them are no news; every re-tuned entry lands."""
    import json

    data, root, target = _committed_bwd_target(tmp_path)
    copies = []
    for i in range(2):  # shard i re-tuned entry i; its copy holds the other entries as committed
        d = json.loads(target.read_text())
        d["entries"][i] = {**d["entries"][i], "median_ms": 0.001 * (i + 1), "trials": 99}
        copies.append(tmp_path / f"copy{i}.json")
        copies[-1].write_text(json.dumps(d))
    rc, text = _run(capsys, "merge", *map(str, copies), "--artifacts", str(root))
    assert rc == 0 and text.count("merged 1 entries") == 2, text
    merged = {art.entry_key(e): e for e in art.load_artifact(target).entries}
    for i in range(2):
        assert merged[art.entry_key(data["entries"][i])]["median_ms"] == 0.001 * (i + 1)
    assert len(merged) == len(data["entries"])


def test_merge_refuses_to_drop_entries_of_another_environment_and_interpreter_files(capsys, tmp_path):
    """A file of another timing environment would drop every entry of the target: refused (naming the files
    and the count) unless --replace; a file made under the Triton interpreter never lands in a GPU folder."""
    import json

    data, root, target = _committed_bwd_target(tmp_path)
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**data, "environment": {**data["environment"], "driver": "999.0"}, "entries": []}))
    interp = tmp_path / "interp.json"
    cpu_env = {**data["environment"], "gpu_name": "triton-interpreter (cpu)", "compute_capability": None}
    interp.write_text(json.dumps({**data, "environment": cpu_env}))
    n = len(data["entries"])
    rc, text = _run(capsys, "merge", str(other), "--artifacts", str(root))
    assert rc == 2 and "other.json" in text and f"drop {n} entries" in text and "--replace" in text
    assert len(art.load_artifact(target).entries) == n
    rc, text = _run(capsys, "merge", str(interp), "--artifacts", str(root), "--replace")
    assert rc == 2 and "interp.json" in text and "interpreter" in text
    assert len(art.load_artifact(target).entries) == n
    rc, text = _run(capsys, "merge", str(other), "--artifacts", str(root), "--replace")
    assert rc == 0 and art.load_artifact(target).entries == []


def test_merge_refuses_an_unknown_kernel_and_a_file_that_contradicts_itself(capsys, tmp_path):
    """A file of no registered kernel was a ValueError traceback after the target folders were made, outside the
    root for a kernel named '../../x'; a file whose ``gpu`` and ``environment.gpu_name`` disagree was merged into a
    file that ``autotune.load`` then rejected (with every entry already in it)."""
    import json

    data = json.loads(art.artifact_path("h100", "hstu_attention_fwd").read_text())
    root = tmp_path / "sub" / "artifacts"
    for kernel in ("nope", "../../escape/x"):
        hashes = {b: art.current_template_hash(kernel, b) for b in data["template_hash"]}  # current: not stale
        f = tmp_path / "bad.json"
        f.write_text(json.dumps({**data, "kernel": kernel, "template_hash": hashes}))
        rc, text = _run(capsys, "merge", str(f), "--artifacts", str(root))
        assert rc == 2 and "is no registered kernel" in text and "Traceback" not in text
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["bad.json"]
    f = tmp_path / "contra.json"
    f.write_text(json.dumps({**data, "gpu": "h200"}))  # the environment still names an H100
    rc, text = _run(capsys, "merge", str(f), "--artifacts", str(root))
    assert rc == 2 and "contradicts itself" in text and not root.exists()


def test_show_prints_file_text_as_text(capsys, tmp_path):
    """``show`` gives the verdict ``load`` gives: rich markup in a file's strings (its creation time, its
    library versions) is printed as written, not parsed (a "[/x]" made the table raise)."""
    import json

    data = json.loads(art.artifact_path("h100", "hstu_attention_fwd").read_text())
    data["created"] = "[/bogus]"
    data["environment"] = {**data["environment"], "torch": "[/x] [red]"}
    target = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    target.parent.mkdir(parents=True)
    target.write_text(json.dumps(data))
    rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(tmp_path))
    assert rc == 0 and "created [/bogus]" in text and "torch [/x] [red]" in text


def test_show_names_an_unknown_kernel(capsys, tmp_path):
    """``show --kernel`` with a name no spec registers is a usage error naming it (it printed "no artifacts" and
    exited 1, as for an empty folder); a known kernel without a file still reports the empty folder."""
    rc, text = _run(capsys, "show", "--gpu", "h100", "--kernel", "nope", "--artifacts", str(tmp_path))
    assert rc == 2 and "unknown kernel(s) nope" in text
    rc, text = _run(capsys, "show", "--gpu", "h100", "--kernel", "fwd", "--artifacts", str(tmp_path))
    assert rc == 1 and "no artifacts under" in text


def test_show_names_an_artifacts_root_that_is_a_file(capsys, tmp_path):
    """A file given as the artifacts root read as an empty folder ("no artifacts under ...", exit 1)."""
    (tmp_path / "root").write_text("{}")
    rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(tmp_path / "root"))
    assert rc == 2 and "--artifacts" in text and "not a folder" in text


@pytest.mark.parametrize(
    ("body", "why"),
    [("def f(:\n", "SyntaxError"), ("raise RuntimeError('at import')\n", "RuntimeError: at import")],
)
def test_a_plugin_that_fails_at_import_is_a_usage_error_naming_it(capsys, tmp_path, monkeypatch, body, why):
    """A plugin module that raised anything but ImportError (a syntax error, an error at import) was a traceback
    from ``run``, ``show`` and every other command, not the one-line error a missing module gets."""
    (tmp_path / "broken_plugin_mod.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc, text = _run(capsys, "run", "--gpu", "h100", "--dry-run", "--plugin", "broken_plugin_mod")
    assert rc == 2 and f"--plugin broken_plugin_mod: cannot import it ({why}" in text, text
    monkeypatch.setenv("AUTOTUNE_PLUGINS", "broken_plugin_mod")
    rc, text = _run(capsys, "show", "--gpu", "h100")
    assert rc == 2 and "broken_plugin_mod: cannot import it" in text, text


def _plugin_artifact(root, monkeypatch) -> str:
    """An artifact of the test plugin's kernel under ``root``, the plugin then unregistered and unimported,
    as a fresh ``autotune show`` process would find it."""
    import sys
    from pathlib import Path

    from autotune import spec

    tests = str(Path(__file__).resolve().parent)
    monkeypatch.syspath_prepend(tests)
    import spec_plugin_op as plugin

    env = {k: None for k in art.ENV_KEYS}
    env["gpu_name"] = "NVIDIA H100 80GB HBM3"
    entry = {"dtype": "float32", "dqk": 32, "dv": 32, "num_heads": 1, "bucket": 256, "distribution": "uniform",
             "mask": "causal", "backend": "torch", "config": {"chunks": 1}, "median_ms": 0.01, "spread_ms": 0.001,
             "tflops": 0.0, "default_ms": 0.02, "default_tflops": 0.0, "speedup": 2.0, "trials": 3,
             "tuning_s": 1.0}  # fmt: skip
    hashes = {"torch": art.current_template_hash(plugin.NAME, "torch")}
    artifact = art.Artifact(plugin.NAME, "h100", env, hashes, "abc", [entry])
    art.save_artifact(artifact, art.artifact_path("h100", plugin.NAME, root))
    spec.unregister(plugin.NAME)
    monkeypatch.delitem(sys.modules, "spec_plugin_op")
    return plugin.NAME


def test_show_loads_autotune_plugins_and_names_a_kernel_without_a_spec(capsys, tmp_path, monkeypatch):
    """``show`` never imported ``AUTOTUNE_PLUGINS`` (``merge`` and ``run`` do): a plugin kernel's freshly tuned
    artifact was reported "stale artifact: the torch template ... changed" (its sources hashed as none), with or
    without the variable, and ``--kernel NAME`` was an unknown kernel. Without the plugin the verdict now says
    that no spec registers the kernel."""
    from autotune import spec

    name = _plugin_artifact(tmp_path, monkeypatch)
    try:
        rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(tmp_path))
        text = " ".join(text.split())  # rich wraps long lines
        assert "stale" not in text and f"no registered op spec declares kernel {name!r}" in text
        assert "AUTOTUNE_PLUGINS" in text
        monkeypatch.setenv("AUTOTUNE_PLUGINS", "spec_plugin_op")
        rc, text = _run(capsys, "show", "--gpu", "h100", "--kernel", name, "--artifacts", str(tmp_path))
        text = " ".join(text.split())
        assert "stale" not in text and "no registered op spec" not in text and "chunks=1" in text
    finally:
        spec.unregister(name)


def test_export_loads_autotune_plugins(capsys, tmp_path, monkeypatch):
    """``export`` never imported ``AUTOTUNE_PLUGINS`` (``show`` and ``merge`` do): a plugin kernel's fresh artifact
    was refused as one no spec declares, and ``--kernel NAME`` was an unknown kernel."""
    import json
    import sys

    from autotune import spec
    from autotune.tuning import registry

    monkeypatch.delitem(sys.modules, "spec_plugin_op", raising=False)  # an earlier test's import registers nothing
    monkeypatch.setattr(registry, "_loaded", [m for m in registry._loaded if m != "spec_plugin_op"])  # a fresh process
    name = _plugin_artifact(tmp_path, monkeypatch)
    path = art.artifact_path("h100", name, tmp_path)
    data = json.loads(path.read_text())
    data["environment"]["compute_capability"] = "9.0"  # tuned on the GPU, not the interpreter
    path.write_text(json.dumps(data))
    monkeypatch.setenv("AUTOTUNE_PLUGINS", "spec_plugin_op")
    try:
        argv = ["export", "--gpu", "h100", "--artifacts", str(tmp_path), "--kernel", name, "--out"]
        rc, text = _run(capsys, *argv, str(tmp_path / "bundle"))
        assert rc == 0 and (tmp_path / "bundle" / "h100" / f"{name}.json").is_file(), text
    finally:
        spec.unregister(name)


def test_merge_keeps_the_entries_of_an_invalid_target(capsys, tmp_path):
    """One hand-edited entry made the target invalid and a merge replaced it whole, dropping every other entry
    without --replace: refused; with --replace the old file is renamed aside (no *.json), not lost."""
    import json

    shipped = art.artifact_path("h100", "hstu_attention_bwd")
    data = json.loads(shipped.read_text())
    root = tmp_path / "artifacts"
    target = art.artifact_path("h100", "hstu_attention_bwd", root)
    target.parent.mkdir(parents=True)
    bad = json.loads(shipped.read_text())
    bad["entries"][1]["config"] = {**bad["entries"][1]["config"], "typo": 1}
    target.write_text(json.dumps(bad))
    before = target.read_bytes()
    one = tmp_path / "one.json"
    one.write_text(json.dumps({**data, "entries": data["entries"][:1]}))
    rc, text = _run(capsys, "merge", str(one), "--artifacts", str(root))
    assert rc == 2 and "one.json" in text and "unusable" in text and "--replace" in text
    assert target.read_bytes() == before
    with pytest.warns(RuntimeWarning, match="kept as"):
        rc, text = _run(capsys, "merge", str(one), "--artifacts", str(root), "--replace")
    assert rc == 0 and len(art.load_artifact(target).entries) == 1
    (aside,) = [p for p in target.parent.iterdir() if p.name.startswith(f"{target.name}.unusable-")]
    assert aside.read_bytes() == before


@pytest.mark.parametrize("interpret", [False, True])
def test_quick_verify_hint_is_a_command_that_runs_where_the_run_ran(capsys, interpret):
    """After ``--verify quick`` the run prints the ``autotune verify`` command that re-checks its winners on every
    mask and dtype; under ``--interpret`` that command lacked ``--interpret``, so on the CPU host the run had just
    used it stopped at once with 'no CUDA GPU is present'."""
    import argparse

    from autotune.tuning.cli import _console, _report_run
    from autotune.tuning.task_result import TaskResult
    from autotune.tuning.tasks import Task

    task = Task("hstu_attention_fwd", "h100", "float32", 32, 32, 1, 256, "uniform")
    result = TaskResult(task, backend="triton", config={"block_m": 32}, trials=1, statuses={"ok": 1})
    args = argparse.Namespace(verify="quick", interpret=interpret, artifacts="/tmp/arts", trials=1)
    assert _report_run(_console(), [result], args, "h100") == 0
    hint = next(line for line in capsys.readouterr().out.replace("\n", " ").split("`") if "autotune verify" in line)
    assert ("--interpret" in hint) == interpret, hint


def test_show_of_a_kernel_without_a_file_names_the_kernel(capsys, tmp_path):
    """``autotune show --gpu h200 --kernel linear_residual_bwd`` said 'no artifacts under ... for h200' of a folder
    holding the GPU's other artifacts: the message names the kernels asked for."""
    (tmp_path / "h200").mkdir()
    shutil.copy(art.DEFAULT_ROOT / "h200" / "layer_norm_fwd.json", tmp_path / "h200")
    rc, text = _run(capsys, "show", "--gpu", "h200", "--kernel", "layer_norm_bwd", "--artifacts", str(tmp_path))
    assert rc == 1 and "layer_norm_bwd" in text, text
    rc, text = _run(capsys, "show", "--gpu", "h100", "--artifacts", str(tmp_path))
    assert rc == 1 and f"no artifacts under {tmp_path} for h100" in " ".join(text.split()), text


def test_the_environment_under_the_interpreter_is_the_interpreter_s_on_a_gpu_host(monkeypatch):
    """``run --interpret`` on a GPU host recorded its CPU timings as that GPU's; the next ``--interpret`` run then
    refused the folder as GPU-made. Under TRITON_INTERPRET=1 the block is the interpreter's; without it, the GPU's."""
    from types import SimpleNamespace

    import torch

    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = gpus.environment()
    assert env["compute_capability"] is None and env["sm_count"] is None and art.interpreter_made(env), env
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    env = gpus.environment()
    assert env["gpu_name"] == props.name and env["compute_capability"] == "9.0" and not art.interpreter_made(env)
