"""``autotune verify``: every artifact entry re-checked against the reference, faults isolated per entry."""

from __future__ import annotations

import json

import pytest

from autotune.runtime import artifacts as art
from autotune.tuning import cli, measure
from autotune.tuning.recheck import entry_task, missing_cases, recheck_artifacts, write_verified
from autotune.tuning.registry import load_plugins
from autotune.tuning.worker import verify_dtypes

load_plugins(["autotune.tuning.fake"])
PLUGINS = ["autotune.tuning.fake"]
MODES = {256: "ok", 512: "narrow", 1024: "crash", 2048: "hang", 4096: "ok2"}


def _entry(bucket: int, mode: str) -> dict:
    return {
        "dtype": "float32",
        "dqk": 32,
        "dv": 32,
        "num_heads": 1,
        "bucket": bucket,
        "distribution": "uniform",
        "mask": "causal",
        "backend": "fake",
        "config": {"mode": mode, "size": 2 if mode == "ok2" else 1},
        "median_ms": 1.0,
        "spread_ms": 0.01,
        "tflops": 1.0,
        "default_ms": 2.0,
        "default_tflops": 0.5,
        "speedup": 2.0,
        "trials": 4,
        "tuning_s": 1.0,
    }


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", ",".join(MODES.values()))
    env = {k: None for k in art.ENV_KEYS}
    env["gpu_name"] = "NVIDIA H100 80GB HBM3"
    hashes = {"fake": art.current_template_hash("fake_faults", "fake")}
    entries = [_entry(b, m) for b, m in MODES.items()]
    artifact = art.Artifact("fake_faults", "h100", env, hashes, "space", entries)
    art.save_artifact(artifact, art.artifact_path("h100", "fake_faults", tmp_path))
    return tmp_path


def test_entry_task_is_the_entry_key():
    task = entry_task("fake_faults", "h100", _entry(512, "ok"), seq_cap=16)
    assert (task.kernel, task.gpu, task.dtype, task.dqk, task.dv, task.num_heads) == (
        "fake_faults", "h100", "float32", 32, 32, 1,
    )  # fmt: skip
    assert (task.bucket, task.distribution, task.mask, task.max_len) == (512, "uniform", "causal", 16)


def test_every_entry_gets_its_own_verdict_and_faults_do_not_spread(root):
    results = recheck_artifacts(root, "h100", level="full", jobs=2, plugins=PLUGINS, timeout_s=5.0, seq_cap=16)
    status = {r.entry["bucket"]: r.status for r in results}
    # 'narrow' passes the tuner's check and timed batches; only the re-check's many short sequences see it.
    assert status == {256: "ok", 512: "incorrect", 1024: "crash", 2048: "timeout", 4096: "ok"}
    ok = next(r for r in results if r.entry["bucket"] == 256)
    # The half types the re-check adds: float16 off the GPU (the interpreter's bfloat16 is wrong), both on one.
    halves = verify_dtypes("float32", measure.device() == "cuda")[1:]
    assert ok.checked == [
        "many-short/causal/float32",
        "one-long/causal/float32",
        *(f"many-short/causal/{d}" for d in halves),
    ]
    narrow = next(r for r in results if r.entry["bucket"] == 512)
    assert "many-short" in narrow.error
    written = write_verified(root, "h100", results)
    entries = art.load_artifact(written[0], check_stale=False).entries
    assert entries[0]["verified"] == sorted(ok.checked)
    assert all("verified" not in e for e in entries[1:4])  # failures record nothing


def test_a_sticky_error_does_not_fail_the_next_entry(tmp_path, monkeypatch):
    """A launch that raises and leaves its process broken fails its entry only: the worker is replaced."""
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "sticky,ok")
    env = {k: None for k in art.ENV_KEYS}
    hashes = {"fake": art.current_template_hash("fake_faults", "fake")}
    entries = [_entry(256, "sticky"), _entry(512, "ok")]
    artifact = art.Artifact("fake_faults", "h100", env, hashes, "space", entries)
    art.save_artifact(artifact, art.artifact_path("h100", "fake_faults", tmp_path))
    results = recheck_artifacts(tmp_path, "h100", level="quick", jobs=1, plugins=PLUGINS, timeout_s=5.0, seq_cap=16)
    assert [r.status for r in results] == ["crash", "ok"]


def test_only_missing_skips_entries_already_checked(root):
    first = recheck_artifacts(root, "h100", level="full", jobs=2, plugins=PLUGINS, timeout_s=5.0, seq_cap=16)
    write_verified(root, "h100", first)
    again = recheck_artifacts(
        root, "h100", level="full", jobs=2, plugins=PLUGINS, timeout_s=5.0, seq_cap=16, only_missing=True
    )
    # The two passing entries are skipped; the three failures have nothing recorded and run again.
    assert sorted(r.entry["bucket"] for r in again) == [512, 1024, 2048]


def test_a_config_no_case_can_run_is_not_vouched_for(root, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok")  # the space now rules out every other planted mode
    results = recheck_artifacts(root, "h100", ["fake_faults"], "quick", 1, PLUGINS, 5.0, 16)
    assert {r.entry["bucket"]: r.status for r in results}[4096] == "unchecked"


def test_an_unchecked_entry_says_why(root, monkeypatch, capsys):
    """The verdict's line and its FAILED line name the rule that skipped every case (they were blank)."""
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok")  # size 2 of the 4096 entry's 'ok2' fits no planted mode
    argv = ["verify", "--gpu", "h100", "--artifacts", str(root), "--plugin", PLUGINS[0], "--interpret"]
    out = root / "rows.json"
    assert cli.main([*argv, "--level", "quick", "--timeout", "5", "--seq-cap", "16", "--json", str(out)]) == 1
    row = next(r for r in json.loads(out.read_text()) if r["bucket"] == 4096)
    assert row["status"] == "unchecked" and "rules out every case" in row["error"]
    assert "not planted" in row["error"] or "does not fit" in row["error"]
    failed = next(t for t in capsys.readouterr().out.splitlines() if t.startswith("FAILED fake_faults entry 4"))
    assert "rules out every case" in failed


def test_cli_exit_code_json_and_write(root, tmp_path, capsys):
    out = tmp_path / "rows.json"
    argv = ["verify", "--gpu", "h100", "--artifacts", str(root), "--plugin", PLUGINS[0], "--interpret", "--jobs", "3"]
    code = cli.main([*argv, "--timeout", "5", "--seq-cap", "16", "--json", str(out), "--write"])
    assert code == 1
    rows = json.loads(out.read_text())
    assert [r["status"] for r in rows] == ["ok", "incorrect", "crash", "timeout", "ok"]
    text = capsys.readouterr().out
    assert "2 of 5 entries passed (full) on h100" in text and "FAILED fake_faults entry 1: incorrect" in text
    entries = art.load_artifact(art.artifact_path("h100", "fake_faults", root), check_stale=False).entries
    assert entries[4]["verified"] and "verified" not in entries[2]


def test_cli_refuses_a_missing_folder_and_bad_jobs(tmp_path, capsys):
    assert cli.main(["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--interpret"]) == 2
    assert "no folder" in capsys.readouterr().err
    assert cli.main(["verify", "--gpu", "h100", "--jobs", "0", "--interpret"]) == 2
    capsys.readouterr()
    (tmp_path / "h100").mkdir()
    (tmp_path / "h100" / "hstu_attention_fwd.json").write_text("{not json")
    assert cli.main(["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--interpret"]) == 1  # reported
    assert "FAILED hstu_attention_fwd: file not re-checked" in capsys.readouterr().out
    assert cli.main(["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--kernel", "nope", "--interpret"]) == 2
    assert "--kernel: unknown kernel(s) nope" in capsys.readouterr().err
    assert cli.main(["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--kernel", "bwd", "--interpret"]) == 2
    assert "no artifact" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--timeout", "0"], ["--timeout", "nan"], ["--json", "."]])
def test_cli_refuses_a_bad_timeout_or_json_before_re_checking(root, capsys, bad):
    """A timeout of 0 failed every entry as a hang (exit 1); an unwritable --json was a traceback after the
    whole re-check, and the --write that follows it never happened."""
    argv = ["verify", "--gpu", "h100", "--artifacts", str(root), "--plugin", PLUGINS[0], "--interpret"]
    assert cli.main([*argv, "--seq-cap", "16", "--timeout", "5", "--write", *bad]) == 2
    err = capsys.readouterr().err
    assert bad[0] in err and "Traceback" not in err
    entries = art.load_artifact(art.artifact_path("h100", "fake_faults", root), check_stale=False).entries
    assert not any("verified" in e for e in entries)  # nothing was re-checked


def test_cli_refuses_a_json_onto_an_artifact_of_the_folder(tmp_path, capsys):
    """``--json`` naming an artifact of the re-checked folder wrote the rows over it after the re-check (exit 0 when
    every entry passed): the tuned entries were lost. A usage error naming --json, the file left as it was."""
    (tmp_path / "h100").mkdir()
    path = tmp_path / "h100" / "hstu_attention_fwd.json"
    path.write_text("{not json")
    argv = ["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--interpret", "--json", str(path)]
    assert cli.main(argv) == 2
    assert "--json" in capsys.readouterr().err
    assert path.read_text() == "{not json"


def _committed():
    for path in sorted(art.DEFAULT_ROOT.glob("*/*.json")):
        artifact = art.load_artifact(path, check_stale=False, check_configs=False)
        for entry in artifact.entries:
            yield path, artifact, entry


def test_every_committed_entry_was_re_checked_on_every_case():
    """Committed entries carry the full re-check (``autotune verify --write`` after a quick re-tune): every
    mask the op verifies, bf16 and fp16, the bucket's shortest and longest sequences."""
    seen = 0
    for path, artifact, entry in _committed():
        missing = missing_cases(artifact.kernel, artifact.gpu, entry)
        assert not missing, f"{path} entry {entry['bucket']} d{entry['dqk']} {entry['distribution']}: not {missing}"
        seen += 1
    assert seen > 100


@pytest.mark.gpu
@pytest.mark.slow
def test_committed_entries_of_this_gpu_still_pass_the_full_re_check(tmp_path):
    """On a GPU runner: the present GPU's committed entries, one per kernel and head dim (the first in file
    order), re-checked on every mask and dtype against the current templates."""
    from autotune.runtime.gpus import detect_gpu

    gpu = detect_gpu()
    folder = art.DEFAULT_ROOT / gpu
    if not folder.is_dir():
        pytest.skip(f"no committed artifacts for {gpu}")
    picked = 0
    for path in sorted(folder.glob("*.json")):
        artifact = art.load_artifact(path, check_stale=False, check_configs=False)
        first_per_dim: dict[int, dict] = {}
        for e in artifact.entries:
            first_per_dim.setdefault(e["dqk"], e)
        artifact.entries = list(first_per_dim.values())
        picked += len(artifact.entries)
        art.save_artifact(artifact, art.artifact_path(gpu, artifact.kernel, tmp_path))
    results = recheck_artifacts(tmp_path, gpu, level="full", jobs=4, timeout_s=600.0)
    assert len(results) == picked > 0
    bad = [(r.kernel, r.entry["dqk"], r.entry["bucket"], r.status, r.error) for r in results if r.status != "ok"]
    assert not bad


def test_recheck_status_ignores_non_string_verified_items():
    """A hand-edited ``verified`` list (rejected at load) never crashes ``autotune show``'s column."""
    from autotune.tuning.recheck import recheck_status

    entry = json.loads(art.artifact_path("h100", "hstu_attention_fwd").read_text())["entries"][0]
    good = recheck_status("hstu_attention_fwd", "h100", entry, True)
    assert recheck_status("hstu_attention_fwd", "h100", {**entry, "verified": [[1], {"a": 2}]}, True).startswith("0/")
    assert recheck_status("hstu_attention_fwd", "h100", {**entry, "verified": entry["verified"] + [[1]]}, True) == good
    assert missing_cases("hstu_attention_fwd", "h100", {**entry, "verified": [[1]]})


def test_json_files_of_no_registered_kernel_are_not_re_checked(root, capsys):
    """A notes.json in the GPU folder aborted verify ('top level must be a JSON object'); a copy of an artifact
    under another name was re-checked as a kernel of that name (every entry a crash). autotune.load reads neither."""
    folder = root / "h100"
    (folder / "notes.json").write_text("[1, 2]")
    (folder / "fake_faults.old.json").write_text((folder / "fake_faults.json").read_text())
    argv = ["verify", "--gpu", "h100", "--artifacts", str(root), "--plugin", PLUGINS[0], "--interpret"]
    assert cli.main([*argv, "--timeout", "5", "--seq-cap", "16", "--level", "quick"]) == 1  # the planted faults
    out = capsys.readouterr().out
    assert "note: not re-checked, no registered kernel's artifact: fake_faults.old.json, notes.json" in out
    assert "of 5 entries passed" in out and out.count("fake_faults.old") == 1  # named in the note only


def test_interpreter_reports_gpu_only_entries_as_not_run(tmp_path, capsys, monkeypatch):
    """A CuTe entry re-checked under --interpret was reported as a worker crash (exit 1); it is now
    "unavailable" with the reason, and a re-check that ran nothing still exits 1."""
    from autotune.tuning import registry

    real = registry.unavailable_reason  # a GPU host can run CuTe: say it cannot, as a CPU host does
    monkeypatch.setattr(registry, "unavailable_reason", lambda b: "needs a CUDA GPU" if b.name == "cute" else real(b))
    committed = art.load_artifact(art.artifact_path("h100", "hstu_attention_fwd"), check_stale=False)
    cute = next(e for e in committed.entries if e["backend"] == "cute")
    copy = art.Artifact(
        "hstu_attention_fwd", "h100", committed.environment, committed.template_hash,
        committed.search_space_hash, [dict(cute)],
    )  # fmt: skip
    art.save_artifact(copy, art.artifact_path("h100", "hstu_attention_fwd", tmp_path))
    results = recheck_artifacts(tmp_path, "h100", ["hstu_attention_fwd"], "full", 1, [], 5.0, 16)
    assert [r.status for r in results] == ["unavailable"] and "needs a CUDA GPU" in results[0].error
    argv = ["verify", "--gpu", "h100", "--artifacts", str(tmp_path), "--interpret", "--timeout", "5"]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    assert "0 of 0 entries passed" in out and "not run under the interpreter: 1 entries" in out
    assert "crash" not in out and "FAILED" not in out


@pytest.mark.parametrize("config", [{"mode": "ok"}, {"mode": "ok", "size": True}, {"mode": "ok", "size": 1.0}])
def test_an_entry_config_load_would_refuse_is_invalid_not_vouched_for(tmp_path, monkeypatch, config):
    """A config missing a field (or of another type) runs in the worker as its default-filled config, but
    ``autotune.load`` refuses the file: the re-check names the field instead of passing and writing ``verified``."""
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok")
    env = dict.fromkeys(art.ENV_KEYS, None)
    hashes = {"fake": art.current_template_hash("fake_faults", "fake")}
    path = art.save_artifact(
        art.Artifact("fake_faults", "h100", env, hashes, "space", [_entry(256, "ok")]),
        art.artifact_path("h100", "fake_faults", tmp_path),
    )
    data = json.loads(path.read_text())
    data["entries"][0]["config"] = config  # hand-edited: save_artifact would refuse it
    path.write_text(json.dumps(data))
    (r,) = recheck_artifacts(tmp_path, "h100", level="quick", jobs=1, plugins=PLUGINS, timeout_s=5.0, seq_cap=16)
    assert (r.status, r.checked) == ("invalid", []) and "size" in r.error
    assert write_verified(tmp_path, "h100", [r]) == []


def _two_ok_entries(tmp_path, monkeypatch):
    """A fake_faults file of two passing entries (fast: no crash, no hang), the path it was written to."""
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok")
    env = dict.fromkeys(art.ENV_KEYS, None)
    hashes = {"fake": art.current_template_hash("fake_faults", "fake")}
    entries = [_entry(256, "ok"), _entry(512, "ok")]
    return art.save_artifact(
        art.Artifact("fake_faults", "h100", env, hashes, "space", entries),
        art.artifact_path("h100", "fake_faults", tmp_path),
    )


VERIFY = ["verify", "--gpu", "h100", "--plugin", PLUGINS[0], "--interpret", "--timeout", "5", "--seq-cap", "16"]


def test_write_records_the_passing_entries_beside_an_invalid_one(tmp_path, monkeypatch, capsys):
    """The re-save checked every config, so one hand-edited entry (``"size": "1"``) raised ArtifactError after
    the re-check and no passing entry's ``verified`` was recorded; the invalid entry is now kept as it was."""
    path = _two_ok_entries(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    data["entries"][1]["config"]["size"] = "1"
    path.write_text(json.dumps(data))
    before = json.loads(path.read_text())["entries"][1]
    code = cli.main([*VERIFY, "--artifacts", str(tmp_path), "--level", "quick", "--write"])
    out = capsys.readouterr().out
    assert code == 1 and "FAILED fake_faults entry 1: invalid: entries[1].config.size must be int" in out
    assert "recorded the passing cases" in out
    after = json.loads(path.read_text())["entries"]
    assert after[0]["verified"] and after[1] == before


def test_an_unreadable_file_is_reported_and_the_others_are_re_checked(tmp_path, monkeypatch, capsys):
    """A corrupt file aborted the whole re-check (exit 2, nothing checked); it is now one failure among results."""
    path = _two_ok_entries(tmp_path, monkeypatch)
    (path.parent / "hstu_attention_fwd.json").write_text("{not json")
    rows = tmp_path / "rows.json"
    code = cli.main([*VERIFY, "--artifacts", str(tmp_path), "--level", "quick", "--write", "--json", str(rows)])
    out = capsys.readouterr().out
    assert code == 1 and "2 of 2 entries passed" in out
    assert "FAILED hstu_attention_fwd: file not re-checked" in out and "not valid JSON" in out
    assert all(e["verified"] for e in json.loads(path.read_text())["entries"])
    assert [(r["kernel"], r["status"]) for r in json.loads(rows.read_text())] == [
        ("fake_faults", "ok"), ("fake_faults", "ok"), ("hstu_attention_fwd", "unreadable"),
    ]  # fmt: skip
    assert (path.parent / "hstu_attention_fwd.json").read_text() == "{not json"
    with pytest.raises(art.ArtifactError, match="not valid JSON"):  # the library call still raises without a handler
        recheck_artifacts(tmp_path, "h100", ["hstu_attention_fwd"], "quick", 1, PLUGINS, 5.0, 16)


@pytest.mark.parametrize("cap", [0, -3])
def test_a_seq_cap_below_one_is_refused_before_any_entry_is_re_checked(root, capsys, cap):
    """A task refuses such a cap; in a re-check its ValueError was raised in a worker thread, which left every
    entry 'pending' behind a thread traceback."""
    with pytest.raises(ValueError, match="seq_cap"):
        recheck_artifacts(root, "h100", level="quick", plugins=PLUGINS, timeout_s=5.0, seq_cap=cap)
    argv = ["verify", "--gpu", "h100", "--artifacts", str(root), "--plugin", PLUGINS[0], "--interpret"]
    assert cli.main([*argv, "--seq-cap", str(cap)]) == 2
    err = capsys.readouterr().err
    assert "--seq-cap must be an integer >= 1" in err and "Traceback" not in err


def test_write_after_a_concurrent_writer_records_each_case_on_its_own_entry_only(tmp_path, monkeypatch):
    """``verify --write`` matched its results to the file by position: an entry a tuning run added meanwhile (sorted
    before them) made it raise "changed during the re-check" (a traceback, every verdict lost), and a config a run
    re-tuned at the same key took the cases the replaced config had passed."""
    path = _two_ok_entries(tmp_path, monkeypatch)
    results = recheck_artifacts(tmp_path, "h100", level="quick", jobs=1, plugins=PLUGINS, timeout_s=5.0, seq_cap=16)
    assert [r.status for r in results] == ["ok", "ok"]
    artifact = art.load_artifact(path, check_stale=False)
    artifact.upsert({**_entry(1024, "ok"), "dtype": "bfloat16"})  # sorts before both
    artifact.upsert({**_entry(512, "ok"), "config": {"mode": "ok2", "size": 1}})  # re-tuned meanwhile
    art.save_artifact(artifact, path)
    write_verified(tmp_path, "h100", results)
    entries = {(e["dtype"], e["bucket"]): e for e in art.load_artifact(path, check_stale=False).entries}
    assert entries["float32", 256]["verified"] == sorted(results[0].checked)
    assert "verified" not in entries["float32", 512]  # another config than the one re-checked
    assert "verified" not in entries["bfloat16", 1024]


def test_write_under_the_interpreter_refuses_an_artifact_tuned_on_a_gpu(tmp_path, monkeypatch, capsys):
    """``verify --interpret --write`` recorded cases passed on the CPU interpreter in a GPU-made artifact's
    ``verified`` list, which dispatch reads on the GPU to serve the other half dtype from an entry (as
    ``merge`` and ``export`` never let interpreter evidence into a GPU folder). Refused, the file untouched."""
    path = _two_ok_entries(tmp_path, monkeypatch)
    data = json.loads(path.read_text())
    data["environment"].update(gpu_name="NVIDIA H100 80GB HBM3", compute_capability="9.0", sm_count=132)
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    code = cli.main([*VERIFY, "--artifacts", str(tmp_path), "--level", "quick", "--write"])
    err = capsys.readouterr().err
    assert code == 2 and "--write" in err and "--interpret" in err and path.read_bytes() == before, err
    assert cli.main([*VERIFY, "--artifacts", str(tmp_path), "--level", "quick"]) == 0  # a re-check alone runs
