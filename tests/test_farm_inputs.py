"""The farm's inputs and edges (a real PostgreSQL where needed, ``tests/pg_fixture.py``): knobs and worker counts it
refuses, what ``autotune status`` reads without writing, the caller's folder as the workers see it, masked passwords."""

from __future__ import annotations

import os
from pathlib import Path

import optuna
import pytest
from farm_fixture import FARM_ENV, one_task_farm
from optuna.trial import TrialState
from pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures pg_server, pg_url
from proc_env import REPO

from autotune.tuning.registry import load_plugins
from autotune.tuning.study_storage import rdb_url

load_plugins(["autotune.tuning.fake"])


def _closed_port_url() -> str:
    from autotune.tuning import pg_local

    return pg_local.storage_url("127.0.0.1", pg_local.free_port(), db="nowhere")


@pytest.mark.parametrize(("heartbeat", "grace"), [("10", "5"), ("10", "10"), ("60", None)])
def test_a_grace_period_within_one_heartbeat_is_refused(monkeypatch, capsys, heartbeat, grace):
    """A grace period no longer than the heartbeat interval (AUTOTUNE_FARM_HEARTBEAT=60 alone meets the default grace
    of 60) counted every live worker as dead between two beats: its task was taken over again and again until its
    retries ran out. It is a one-line error naming both variables, before any worker starts."""
    from autotune.tuning.cli import main

    monkeypatch.setenv("AUTOTUNE_FARM_HEARTBEAT", heartbeat)
    if grace is None:
        monkeypatch.delenv("AUTOTUNE_FARM_GRACE", raising=False)
    else:
        monkeypatch.setenv("AUTOTUNE_FARM_GRACE", grace)
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "2"]
    assert main([*argv, "--workers", "2", "--storage", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert "AUTOTUNE_FARM_GRACE=" in err and "must exceed AUTOTUNE_FARM_HEARTBEAT" in err, err


@pytest.mark.parametrize("workers", [65, 100000])
def test_workers_past_the_host_limit_are_refused_before_any_start(monkeypatch, capsys, workers):
    """``--workers 100000`` (a typo) started that many worker processes, each with its own storage connections."""
    from autotune.tuning import farm
    from autotune.tuning.cli import main

    spawned = []
    monkeypatch.setattr(farm, "_spawn", lambda *a, **k: spawned.append(a))
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "2"]
    assert main([*argv, "--workers", str(workers), "--storage", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    assert f"--workers must be at most {farm.MAX_WORKERS} (worker processes on this host), got {workers}" in (
        capsys.readouterr().err
    )
    for bad in (0, -1, workers, 2.5, True):  # the library call too, before it opens the storage
        with pytest.raises(farm.FarmError, match=r"workers must be an integer in \[1, 64\]"):
            farm.run_farm([], None, "postgresql://nobody@127.0.0.1:1/none", workers=bad)
    assert not spawned


def test_audit_counts_this_farms_measured_trials_only(tmp_path):
    """``status --audit`` counted a config trial whose holder was killed after its "measured" mark (failed as
    interrupted, its config then measured by the next holder) as a config timed twice, and counted the task
    studies of another farm naming the same task (other knobs) as this farm's."""
    from autotune.tuning import farm_status
    from autotune.tuning.tasks import Task

    storage = optuna.storages.InMemoryStorage()
    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    attrs = {"task": task.to_dict(), "task_key": task.study_name, "label": task.label(), "result": {"error": None}}
    for name in ("farm|h100|aaa", "farm|h100|bbb"):
        farm = optuna.create_study(study_name=name, storage=storage)
        farm.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs))
        study = optuna.create_study(study_name=f"{task.study_name}|src0|h100|env0|{name}", storage=storage)
        for state, status in ((TrialState.FAIL, "interrupted"), (TrialState.COMPLETE, "ok")):
            marks = {"config_key": "fake:mode=ok", "measured": True, "status": status}
            value = 1.0 if status == "ok" else None
            study.add_trial(optuna.trial.create_trial(state=state, value=value, user_attrs=marks))
    got = farm_status.audit(storage, "farm|h100|aaa", tmp_path)
    assert (got["tasks"], got["measured"], got["duplicates"]) == (1, 1, 0), got


def test_status_of_a_database_without_optuna_tables_writes_nothing_there(pg_url, tmp_path, capsys):
    """``autotune status`` only reads: on a database that holds no Optuna storage (a fresh one, or the wrong one
    named by mistake) it created Optuna's thirteen tables there. It says there is no farm and leaves it as it was."""
    import sqlalchemy

    from autotune.tuning.cli import main

    empty = tmp_path / "empty.db"
    empty.touch()
    for url in (pg_url, f"sqlite:///{empty}"):
        assert main(["status", "--storage", url]) == 1
        assert "no farm in" in capsys.readouterr().out
        assert main(["status", "--storage", url, "--farm", "farm|h100|x"]) == 2
        assert "no such farm" in capsys.readouterr().err
        engine = sqlalchemy.create_engine(rdb_url(url))
        try:
            assert sqlalchemy.inspect(engine).get_table_names() == [], url
        finally:
            engine.dispose()


def test_a_relative_artifacts_root_is_the_callers_folder_for_the_workers_too(pg_url, tmp_path, monkeypatch):
    """The workers run in the repository: with ``--artifacts rel`` each wrote its entries under the repository's
    ``rel`` (``--artifacts artifacts`` from elsewhere: into the checked-in artifacts), not the caller's."""
    import dataclasses
    import shutil

    from autotune.tuning import farm

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    fopts, task, opts, _ = one_task_farm(pg_url, tmp_path, grace_s=3)
    rel = Path(f"farm-rel-artifacts-{os.getpid()}")
    monkeypatch.chdir(tmp_path)
    try:
        (result,) = farm.run_farm([task], dataclasses.replace(opts, artifacts_root=rel), pg_url, 1, fopts=fopts)
        assert result.error is None and (tmp_path / rel / "h100" / "fake_faults.json").is_file()
        logs = "".join(p.read_text() for p in (tmp_path / rel / "h100" / "studies" / "farm-logs").glob("*.log"))
        assert "finished" in logs, logs[-2000:]
        assert not (REPO / rel).exists()
    finally:
        shutil.rmtree(REPO / rel, ignore_errors=True)


def test_a_plugin_of_the_callers_folder_is_imported_by_the_workers(pg_url, tmp_path, monkeypatch):
    """``python -m autotune.tuning.cli run --plugin myops`` with myops.py in the current folder: the run imported it,
    its workers (started in the repository) could not, and every task ended "still queued"."""
    import dataclasses

    from autotune.tuning import farm

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    (tmp_path / "farm_cwd_plugin.py").write_text("import autotune.tuning.fake  # noqa: F401 - registers fake_faults\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # what `python -m` does with the current folder
    fopts, task, opts, _ = one_task_farm(pg_url, tmp_path, grace_s=3)
    opts = dataclasses.replace(opts, plugins=["farm_cwd_plugin"])
    (result,) = farm.run_farm([task], opts, pg_url, 1, fopts=fopts)
    assert result.error is None and result.config is not None, result.error


def test_a_password_given_as_a_query_parameter_is_not_printed(capsys):
    """libpq also takes the password as ``?password=``: the error naming --storage printed it in full."""
    pytest.importorskip("psycopg", reason="without the PostgreSQL driver the error is its absence (checked apart)")
    from autotune.tuning.cli import main
    from autotune.tuning.farm_storage import _safe

    url = _closed_port_url() + "?sslmode=disable&Password=S3cretPw"
    assert main(["status", "--storage", url]) == 2
    err = capsys.readouterr().err
    assert "cannot open it" in err and "S3cretPw" not in err and "Password=***" in err, err
    assert _safe("postgresql://u:S3cretPw@h/db?password=S3cretPw&x=1") == "postgresql://u:***@h/db?password=***&x=1"


def test_a_task_named_twice_is_queued_once(pg_url, tmp_path):
    """``run_farm`` given one task twice queued it twice: two workers then tuned it at once in one task study, each
    failing the other's running trials as interrupted."""
    from autotune.tuning import farm

    _, task, opts, storage = one_task_farm(pg_url, tmp_path)
    name = farm.join_farm(storage, [task, task], opts)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    assert [(t.state, t.user_attrs["task_key"]) for t in trials] == [(TrialState.WAITING, task.study_name)]


def test_a_farm_on_a_storage_other_than_postgresql_is_refused(tmp_path):
    """``run_farm`` on a sqlite URL ran its workers without the row and advisory locks its claims rely on."""
    from autotune.tuning import farm, tuner
    from autotune.tuning.tasks import Task

    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    opts = tuner.TuneOptions(n_trials=2, interpret=True, plugins=["autotune.tuning.fake"], artifacts_root=tmp_path)
    url = f"sqlite:///{tmp_path / 'farm.db'}"
    with pytest.raises(farm.FarmError, match=r"--storage sqlite:///.*: a farm runs on PostgreSQL"):
        farm.run_farm([task], opts, url, workers=2)
    assert not (tmp_path / "farm.db").exists()


@pytest.mark.parametrize(
    ("given", "label"), [("a/b", "a_b"), ("../..", ".._.."), ("..", "host"), ("", None), ("n1 x", "n1_x")]
)
def test_the_host_label_is_a_safe_file_name_part(monkeypatch, given, label):
    """``AUTOTUNE_FARM_HOST=a/b`` named a log file in a folder that does not exist (a traceback), and '../x' one
    outside the logs folder: the label keeps letters, digits, '.', '_' and '-' only."""
    import re
    import socket

    from autotune.tuning.farm import host_label

    monkeypatch.setenv("AUTOTUNE_FARM_HOST", given)
    got = host_label()
    assert got == (label or re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname()))
    assert "/" not in got and got.strip(".")


def test_status_watch_survives_a_storage_outage(monkeypatch):
    """``autotune status --watch`` ended in a traceback when the storage dropped out between redraws (a restart,
    a network blip); it now says so and keeps watching until the farm is done."""
    import argparse

    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from autotune.tuning import farm_status

    replies = iter(["busy", OSError("server closed the connection unexpectedly"), "busy", "done"])

    def snapshot(storage, name):
        r = next(replies)
        if isinstance(r, Exception):
            raise r
        return {"counts": {"running": int(r == "busy"), "waiting": 0}, "r": r}

    monkeypatch.setattr(farm_status, "plain_storage", lambda url, create=False: object())
    monkeypatch.setattr(farm_status, "farm_names", lambda storage: ["f"])
    monkeypatch.setattr(farm_status, "snapshot", snapshot)
    monkeypatch.setattr(farm_status, "render", lambda snap, url: Text(f"farm {snap['r']}"))
    shown = []
    update = Live.update
    monkeypatch.setattr(Live, "update", lambda self, r, **kw: shown.append(r) or update(self, r, **kw))
    args = argparse.Namespace(storage="postgresql://u@h:1/db", watch=0.01, farm=None, audit=None)
    assert farm_status.cmd_status(args) == 0
    assert next(replies, None) is None  # watched through the outage to the end
    console = Console(width=200, record=True)
    console.print(shown[0])
    assert "storage unreachable (server closed the connection unexpectedly)" in console.export_text()


def test_status_of_a_journal_file_says_the_farm_needs_a_postgresql_url(tmp_path, capsys):
    """A journal file path (a single run's storage) was "Could not parse SQLAlchemy URL"."""
    from autotune.tuning.cli import main

    journal = tmp_path / "tuning.journal"
    journal.write_text("")
    assert main(["status", "--storage", str(journal)]) == 2
    err = capsys.readouterr().err
    assert f"--storage {journal}" in err and "postgresql://" in err and "SQLAlchemy" not in err, err


def test_an_unreachable_farm_storage_is_one_error_before_any_banner(tmp_path, capsys):
    """``autotune run --storage <dead postgresql URL>`` printed its "Farm on ..." banner, then the error; now the
    storage is opened first: one error naming --storage, its password masked, and no banner."""
    pytest.importorskip("psycopg", reason="without the PostgreSQL driver the error is its absence (checked apart)")
    from autotune.tuning.cli import main

    url = _closed_port_url().replace("autotune@", "autotune:S3cretPw@", 1)
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "2"]
    assert main([*argv, "--storage", url, "--artifacts", str(tmp_path / "arts")]) == 2
    out, err = capsys.readouterr()
    assert "Farm on" not in out and "Tuning" not in out, out
    assert "--storage postgresql://autotune:***@" in err and "cannot open it" in err and "S3cretPw" not in err, err


def test_audit_does_not_count_an_entry_verify_wrote_its_cases_into_as_lost(tmp_path):
    """``status --audit`` compared each finished task's entry with the artifact's whole: once ``autotune verify
    --write`` had recorded the re-check cases in it, every such entry counted as lost. A missing or re-tuned entry
    (another config) still does."""
    from autotune.runtime import artifacts as art
    from autotune.tuning import farm_status
    from autotune.tuning.tasks import Task

    storage = optuna.storages.InMemoryStorage()
    farm = optuna.create_study(study_name="farm|h100|aaa", storage=storage)
    entries = []
    for bucket in (256, 512, 1024):
        task = Task("fake_faults", "h100", "float32", 32, 32, 1, bucket, "uniform", batch=2, seq_cap=64)
        entry = {"dtype": "float32", "dqk": 32, "dv": 32, "num_heads": 1, "bucket": bucket, "distribution": "uniform",
                 "mask": "causal", "backend": "fake", "config": {"mode": "ok", "size": 1}, "median_ms": 1.0,
                 "spread_ms": 0.0, "tflops": 1.0, "default_ms": 2.0, "default_tflops": 0.5, "speedup": 2.0,
                 "trials": 2, "tuning_s": 1.0, "verified": ["one-long/causal/float32"]}  # fmt: skip
        attrs = {"task": task.to_dict(), "task_key": task.study_name, "result": {"error": None, "entry": entry}}
        farm.add_trial(optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs))
        entries.append(dict(entry))
    entries[0]["verified"] = ["many-short/causal/float32", "one-long/causal/float32"]  # verify --write added one
    entries[1]["config"] = {"mode": "ok2", "size": 1}  # re-tuned since: the farm's entry is gone
    env = dict.fromkeys(art.ENV_KEYS, None)
    hashes = {"fake": art.current_template_hash("fake_faults", "fake")}
    a = art.Artifact("fake_faults", "h100", env, hashes, "space", entries[:2])  # the 1K entry is missing
    art.save_artifact(a, art.artifact_path("h100", "fake_faults", tmp_path))
    assert farm_status.audit(storage, "farm|h100|aaa", tmp_path)["entries_lost"] == 2
