"""A farm host's time budget (``autotune run --storage ... --time-budget``) on a real PostgreSQL
(``tests/pg_fixture.py``): once the host's deadline has passed its workers claim nothing more, finish the task
they hold, and the run names the tasks it left queued for another host or the next join; a task cut by the budget
keeps its cut mark when it also ended with an error."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import optuna
from farm_fixture import FARM_ENV, one_task_farm, rdb_storage, run_one
from optuna.trial import TrialState
from pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures pg_server, pg_url

from autotune.tuning.registry import load_plugins

load_plugins(["autotune.tuning.fake"])


def _spec(url: str, name: str, opts: Any, fopts: Any, deadline: float | None) -> dict[str, Any]:
    """A worker's spec, as ``run_farm`` hands it over (no parent: the worker runs in this process)."""
    plain = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}
    return {"url": url, "farm": name, "opts": plain, "farm_options": dataclasses.asdict(fopts),
            "deadline": deadline, "slot": 0}  # fmt: skip


def _states(study: optuna.Study) -> list[TrialState]:
    return [t.state for t in study.get_trials(deepcopy=False) if "task_key" in t.user_attrs]


def test_a_worker_past_its_hosts_deadline_finishes_its_task_and_claims_no_other(pg_url, tmp_path, monkeypatch):
    """The host's budget runs out while a worker holds its first of three tasks. It finishes that one (its best so
    far, marked cut) and then claims nothing: the other two stay queued for another host or the next join.
    Before, it went on claiming every queued task and measured each one's first trials for a cut result."""
    from autotune.tuning import farm

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    tasks = [dataclasses.replace(task, batch=b) for b in (2, 4, 8)]
    name = farm.join_farm(storage, tasks, opts)
    real_run_one = farm._run_one

    def budget_spent_while_holding(study: optuna.Study, trial: optuna.Trial, ctx: dict[str, Any]) -> bool:
        ctx["deadline"] = time.time() - 1  # the host's deadline passes after this claim
        return real_run_one(study, trial, ctx)

    monkeypatch.setattr(farm, "_run_one", budget_spent_while_holding)
    monkeypatch.setattr(farm, "_worker_signals", lambda: None)  # this process's handlers stay pytest's
    assert farm.work(_spec(pg_url, name, opts, fopts, time.time() + 600)) == 0
    study = optuna.load_study(study_name=name, storage=storage)
    assert sorted(_states(study), key=str) == [TrialState.COMPLETE, TrialState.WAITING, TrialState.WAITING]
    (held,) = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert held.user_attrs["result"]["cut"] and held.user_attrs["result"]["entry"]["config"] is not None


def test_a_host_out_of_budget_reports_the_tasks_it_left_for_a_later_join(pg_url, tmp_path, monkeypatch, capsys):
    """A host whose budget is spent before its workers start claims nothing: its run exits 0 and its table and
    summary name each task as left queued for a later join, not as failed; the same command then tunes them."""
    from autotune.tuning.cli import main
    from autotune.tuning.farm_status import farm_names

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "artifacts"
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "2",
            "--sampler", "bruteforce", "--buckets", "256,512", "--dims", "32", "--distributions", "uniform",
            "--artifacts", str(root), "--storage", pg_url, "--workers", "1"]  # fmt: skip
    assert main([*argv, "--time-budget", "0.01s"]) == 0
    out = capsys.readouterr().out
    assert "tasks failed" not in out and "2 task(s) left queued" in out, out
    assert out.count("still queued when this host's time budget ran out") == 2, out
    storage = rdb_storage(pg_url)
    (name,) = farm_names(storage)
    study = optuna.load_study(study_name=name, storage=storage)
    assert _states(study) == [TrialState.WAITING, TrialState.WAITING]
    assert main(argv) == 0
    assert _states(study) == [TrialState.COMPLETE, TrialState.COMPLETE]


def test_a_task_cut_and_errored_is_shown_cut_and_queued_again(pg_url, tmp_path, monkeypatch):
    """A task the budget cut whose decision then failed (no config correct among the few measured) records both
    marks; ``autotune status`` showed it "failed", as if its run had ended for good. It is "cut" (with its error),
    and the next join queues it again."""
    from autotune.tuning import farm, farm_status, tuner

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)

    def nothing_correct(s: Any, result: tuner.TaskResult) -> None:
        result.error = "no config was correct on every check"

    monkeypatch.setattr(tuner, "_decide", nothing_correct)
    monkeypatch.setattr(farm, "_task_deadline", lambda farm_study, deadline: time.time() - 1)
    assert run_one(study, farm.claim(study, fopts), opts, fopts, "w") is True
    result = study.get_trials(deepcopy=False)[0].user_attrs["result"]
    assert result["cut"] and result["error"], result
    (row,) = farm_status.snapshot(storage, study.study_name)["tasks"]
    assert row["state"] == "cut" and "no config was correct" in row["error"], row
    (r,) = farm.farm_results(study, [task])
    assert r.cut and r.error
    farm.join_farm(storage, [task], opts)
    assert _states(study) == [TrialState.COMPLETE, TrialState.WAITING]


def test_the_run_table_marks_a_cut_task_that_errored_as_cut(tmp_path, monkeypatch, capsys):
    """``autotune run`` marked a task "cut" only when it had no error: one cut and then errored was listed as
    failed with no word that the budget stopped it and that the same command resumes it."""
    from autotune.tuning import tuner
    from autotune.tuning.cli import main

    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok,ok2")

    def nothing_correct(s: Any, result: tuner.TaskResult) -> None:
        result.error = "no config was correct on every check"

    monkeypatch.setattr(tuner, "_decide", nothing_correct)
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "3",
            "--sampler", "bruteforce", "--buckets", "256", "--dims", "32", "--distributions", "uniform",
            "--artifacts", str(tmp_path / "a"), "--time-budget", "0.01s"]  # fmt: skip
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "1 of 1 tasks failed" in out, out
    assert "cut by the time budget" in out, out


def test_a_farm_task_cut_and_then_raising_keeps_its_cut(pg_url, tmp_path, monkeypatch):
    """The budget cut the task, then the worker's set-up failed during the final re-checks: ``_run_one`` built a
    fresh error result and the cut was lost, so ``autotune status`` showed the task "failed". It is "cut" with
    its error, and the next join queues it again."""
    from autotune.tuning import farm, farm_status, tuner

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)

    def setup_gone_at_the_recheck(s: Any, result: tuner.TaskResult) -> None:
        raise tuner.InfraError("worker set-up failed 3 times; last: CUDA out of memory")

    monkeypatch.setattr(tuner, "_decide", setup_gone_at_the_recheck)
    monkeypatch.setattr(farm, "_task_deadline", lambda farm_study, deadline: time.time() - 1)
    assert run_one(study, farm.claim(study, fopts), opts, fopts, "w") is True
    result = study.get_trials(deepcopy=False)[0].user_attrs["result"]
    assert result["cut"] and result["error"].startswith("infrastructure"), result
    (row,) = farm_status.snapshot(storage, study.study_name)["tasks"]
    assert row["state"] == "cut" and "CUDA out of memory" in row["error"], row
    farm.join_farm(storage, [task], opts)
    assert _states(study) == [TrialState.COMPLETE, TrialState.WAITING]
