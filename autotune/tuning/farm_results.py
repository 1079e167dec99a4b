"""What a tuning farm's trials say: each task's result by one rule, why a task did not finish, finish order.

Read by the farm's run (results, merged artifacts) and by ``autotune status`` alike, so neither can let an
errored re-run or a lost claim hide a task's result.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TaskResult


def result_of(t: FrozenTrial) -> dict[str, Any]:
    """The result summary a worker recorded on its farm trial (empty before it finished)."""
    return t.user_attrs.get("result") or {}


def finish_order(t: FrozenTrial) -> float:
    """When a farm trial finished, as an epoch time: ``finished_at`` (written by the worker before its tell);
    Optuna's ``datetime_complete`` is a naive local time of the finishing host, so two hosts in other time zones
    ordered by it merged the earlier result last. A ``finished_at`` that is no finite number (a hand-edited
    NaN, infinity, string or bool) falls back to the latter: a NaN key left the merge's sort unsorted."""
    at = t.user_attrs.get("finished_at")
    if isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at):
        return float(at)
    return t.datetime_complete.timestamp() if t.datetime_complete else 0.0


def task_runs(trials: list[FrozenTrial]) -> dict[str, list[FrozenTrial]]:
    """Task key -> the task's farm trials (claims, retries, re-runs) in number order; empty asks have none."""
    runs: dict[str, list[FrozenTrial]] = {}
    for t in sorted(trials, key=lambda t: t.number):
        if t.user_attrs.get("task_key"):
            runs.setdefault(t.user_attrs["task_key"], []).append(t)
    return runs


def result_trial(runs: list[FrozenTrial]) -> FrozenTrial:
    """The run whose result speaks for a task (its runs in number order): the latest that finished without
    error, else the latest finished one, else the latest claim. The one rule of the run's results, the
    artifacts it merges and ``autotune status``, so none of them lets an errored re-run hide a result."""
    complete = [t for t in runs if t.state == TrialState.COMPLETE]
    ok = [t for t in complete if not result_of(t).get("error")]
    return (ok or complete or runs)[-1]


def latest_per_task(trials: list[FrozenTrial]) -> dict[str, FrozenTrial]:
    """Task key -> the trial that speaks for the task (``result_trial``)."""
    return {key: result_trial(runs) for key, runs in task_runs(trials).items()}


def failure_reason(t: FrozenTrial) -> str:
    """Why a farm trial failed: the reason its releaser recorded (interrupt, orphan) or, for one that
    another worker's ``fail_stale_trials`` failed (nothing can write to it then), a lost heartbeat."""
    if t.user_attrs.get("failed_reason"):
        return str(t.user_attrs["failed_reason"])
    holder = t.user_attrs.get("worker") or "its worker"
    return f"{holder} stopped heartbeating (killed, crashed, or stalled past the grace period)"


def unfinished_reason(t: FrozenTrial | None, logs: Path | None = None) -> str:
    """A task's error when its latest farm trial did not complete: lost for good, still queued or held."""
    see = f"; worker logs: {logs}" if logs else ""
    if t is None:
        return "not finished in the farm (never queued)"
    if t.state == TrialState.FAIL:
        attempts = 1 + len(t.system_attrs.get("retry_history", []))
        return f"lost after {attempts} attempt(s), retries exhausted (AUTOTUNE_FARM_RETRIES): {failure_reason(t)}{see}"
    if t.state == TrialState.RUNNING:
        return f"not finished in the farm: still held by {t.user_attrs.get('worker') or 'a worker'}{see}"
    return f"not finished in the farm: still queued, no worker of this host was left to claim it{see}"


def left_reason(t: FrozenTrial) -> str:
    """Why a host whose time budget ran out returns without a task queued or held in the farm, and who runs it."""
    if t.state == TrialState.RUNNING:
        holder = t.user_attrs.get("worker") or "another worker"
        return f"held by {holder} when this host's time budget ran out; it finishes there"
    return "still queued when this host's time budget ran out; another host or the next run tunes it"


def farm_results(
    farm: optuna.Study, tasks: list[Task], logs: Path | None = None, budget_spent: bool = False
) -> list[TaskResult]:
    """Each task's latest result in the farm (an error result, saying why, for a task that did not finish).

    ``budget_spent``: this host stopped claiming at its deadline, so a task still queued or held elsewhere was left
    for a later join (``TaskResult.left``), not failed: an earlier run's error is no verdict on it, while an earlier
    run's config (a cut one's best so far) is still its result."""
    runs = task_runs(farm.get_trials(deepcopy=False))
    out = []
    for task in tasks:
        t = result_trial(runs[task.study_name]) if task.study_name in runs else None
        pending = [r for r in runs.get(task.study_name, []) if r.state in (TrialState.WAITING, TrialState.RUNNING)]
        if budget_spent and pending and (t.state != TrialState.COMPLETE or result_of(t).get("error")):
            out.append(TaskResult(task, left=left_reason(pending[-1])))
            continue
        if t is None or t.state != TrialState.COMPLETE:
            out.append(TaskResult(task, error=unfinished_reason(t, logs)))
            continue
        out.append(_task_result(task, result_of(t)))
    return out


def _task_result(task: Task, s: dict[str, Any]) -> TaskResult:
    e = s.get("entry") or {}
    fields = ("backend", "config", "median_ms", "spread_ms", "tflops", "default_ms", "default_tflops", "speedup")
    r = TaskResult(task, **{k: e.get(k) for k in fields})
    r.trials, r.tuning_s, r.timing = e.get("trials", 0), e.get("tuning_s", 0.0), e.get("timing", "do_bench")
    r.verified, r.samples, r.comparison = list(e.get("verified", [])), e.get("samples"), e.get("compare")
    r.statuses, r.error = dict(s.get("statuses") or {}), s.get("error")
    r.kept_default, r.default_config = bool(s.get("kept_default")), s.get("default_config")
    r.cut = bool(s.get("cut"))
    return r
