"""Farm results of tasks cut by a time budget, and of hand-edited finish times (in-memory farm studies: no server).

A cut task's result is its best so far: the merge must not let it replace a full result of its artifact entry, and
``autotune status`` must not count it as done, since the next join queues it again."""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from autotune.runtime import artifacts as art
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TaskResult, TuneOptions

load_plugins(["autotune.tuning.fake"])
BASE = {"backend": "fake", "median_ms": 1.0, "spread_ms": 0.0, "tflops": 1.0}


def _task(batch: int = 2, bucket: int = 256) -> Task:
    return Task("fake_faults", "h100", "float32", 32, 32, 1, bucket, "uniform", batch=batch, seq_cap=64)


def _finish(
    study: optuna.Study, task: Task, size: int, finished_at: Any, local: dt.datetime, cut: bool = False
) -> None:
    """A farm trial of ``task`` that finished with config size ``size`` (``finished_at`` as stored, any value)."""
    entry = TaskResult(task, config={"mode": "ok", "size": size}, **BASE).entry()
    result = {"entry": entry, "error": None, "cut": cut}
    attrs = {"task": task.to_dict(), "task_key": task.study_name, "label": task.label(), "result": result}
    if finished_at is not None:
        attrs["finished_at"] = finished_at
    trial = optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)
    trial.datetime_start, trial.datetime_complete = local - dt.timedelta(seconds=1), local
    study.add_trial(trial)


def _merged_sizes(storage: Any, study: optuna.Study, root: Path) -> list[int]:
    from autotune.tuning import farm

    farm.merge_farm(storage, study.study_name, TuneOptions(artifacts_root=root))
    return [e["config"]["size"] for e in art.load_artifact(art.artifact_path("h100", "fake_faults", root)).entries]


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), "2000", True])
def test_a_finished_at_that_is_no_finite_epoch_falls_back_to_the_completion_time(tmp_path, garbage):
    """A hand-edited ``finished_at`` of NaN was taken as the finish time: a NaN sort key left the merge unsorted, and
    the task finished first was merged last. Any value that is no finite epoch falls back to ``datetime_complete``."""
    from autotune.tuning.farm_results import finish_order

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="farm|h100|nan", storage=storage)
    now = dt.datetime.now()
    # In trial order: the last finished (epoch), the garbage one (finished between), the first finished (epoch).
    _finish(study, _task(batch=2), 3, now.timestamp(), now)
    _finish(study, _task(batch=4), 2, garbage, now - dt.timedelta(minutes=5))
    _finish(study, _task(batch=8), 1, (now - dt.timedelta(minutes=10)).timestamp(), now - dt.timedelta(minutes=10))
    middle = study.get_trials(deepcopy=False)[1]
    assert finish_order(middle) == pytest.approx((now - dt.timedelta(minutes=5)).timestamp())
    assert _merged_sizes(storage, study, tmp_path) == [3]


def test_a_cut_result_never_replaces_a_full_result_of_its_entry(tmp_path):
    """Two tasks of one artifact entry (one bucket, other batches): one tuned in full, the other cut by a time budget
    after it. The merge wrote the cut task's best so far over the full result; a full result now wins over any cut
    one, and among full results the last finished still wins."""
    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="farm|h100|cut", storage=storage)
    now = dt.datetime.now()
    _finish(study, _task(batch=2), 1, now.timestamp() - 60, now - dt.timedelta(minutes=1))
    _finish(study, _task(batch=4), 2, now.timestamp(), now, cut=True)
    assert _merged_sizes(storage, study, tmp_path / "a") == [1]
    _finish(study, _task(batch=8), 3, now.timestamp() - 30, now - dt.timedelta(seconds=30))
    assert _merged_sizes(storage, study, tmp_path / "b") == [3]


def test_status_shows_a_cut_task_as_cut_not_done(tmp_path):
    """``autotune status`` counted a task the time budget cut as done, though the next join queues it again; it is
    counted and labelled "cut" until a run finishes it, and a re-queued one is waiting."""
    from autotune.tuning import farm_status

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="farm|h100|status", storage=storage)
    now = dt.datetime.now()
    cut, full = _task(bucket=256), _task(bucket=512)
    _finish(study, cut, 1, now.timestamp(), now, cut=True)
    _finish(study, full, 1, now.timestamp(), now)
    snap = farm_status.snapshot(storage, study.study_name)
    assert snap["counts"]["cut"] == 1 and snap["counts"]["done"] == 1, snap["counts"]
    assert [r["state"] for r in snap["tasks"]] == ["cut", "done"]
    text = _rendered(farm_status.render(snap, "postgresql://h/db"))
    assert "1 done" in text and "1 cut" in text, text
    attrs = {"task": cut.to_dict(), "task_key": cut.study_name, "label": cut.label()}
    study.enqueue_trial({}, user_attrs=attrs)  # the next join queues the cut task again
    snap = farm_status.snapshot(storage, study.study_name)
    assert (snap["counts"]["cut"], snap["counts"]["waiting"]) == (0, 1)


def _rendered(renderable: Any) -> str:
    from rich.console import Console

    console = Console(width=200, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 - closed with the console
    console.print(renderable)
    return console.export_text()
