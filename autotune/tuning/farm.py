"""Tuning farm: many worker processes, GPUs and hosts on one task set, through Optuna's RDB storage.

``autotune run --storage postgresql://... [--workers N]`` runs N workers on this host (one per visible
GPU by default, each pinned with ``CUDA_VISIBLE_DEVICES``); another host joins by running the same
command against the same storage. The engine is Optuna's, nothing home-made:

- The task set is a *farm* study (``farm|<gpu>|<digest of tasks and tuning knobs>``) whose enqueued
  trials are the tasks. ``Study.ask`` claims one: ``RDBStorage`` moves a WAITING trial to RUNNING
  under a row lock, so a task is held by one worker at a time and no config is timed twice (each
  task's own study, ``autotune.tuning.tuner._Study``, re-queues config trials a dead holder left RUNNING).
- A worker records heartbeats for its farm trial (its own thread, as ``optimize`` would). A worker
  that dies stops beating; the next ``fail_stale_trials`` of any worker fails its trial and Optuna's
  retry callback enqueues a copy, which another worker claims (``AUTOTUNE_FARM_RETRIES`` times at most). A worker
  whose claim was failed while it still ran (a stalled heartbeat) notices right after its next ``ask``
  (handing that trial back), at its trial's end or before its final writes (``Reporter.check_claim``)
  and drops the task instead of racing the new holder; its task-study writes are checked against its claim
  under the farm's lock as they are made (``_ClaimedStorage``), so none lands after a takeover.
- The farm study records the timing key (GPU model, SMs, driver, CUDA/torch/Triton/CuTe DSL
  versions, template and search-space hashes); a worker with another key refuses to join.
- A host's time budget (``budget_s``) is its deadline: each task it claims gets a share of the time left, and once
  the deadline has passed its workers claim no more (the task each holds ends cut, with its best so far). The tasks
  still queued stay queued for another host or the next join; the host's results name them (``TaskResult.left``).
- Results live in the storage (each farm trial's ``result`` attr, each task study's ``result``).
  A worker merges its entry into the local artifact when it finishes a task and every host merges
  all of the farm's entries at the end (``artifact_io.merge_entries``: file lock, re-read, validated).

Knobs for tests and slow networks (environment): ``AUTOTUNE_FARM_HEARTBEAT`` (s, default 10),
``AUTOTUNE_FARM_GRACE`` (s without heartbeat before a worker counts as dead, default 60),
``AUTOTUNE_FARM_RETRIES`` (default 3), ``AUTOTUNE_FARM_POLL`` (s, default 2), ``AUTOTUNE_FARM_HOST``
(this host's name in worker ids and logs), ``AUTOTUNE_FARM_CONNECT_TIMEOUT`` (s, default 30).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import FrozenTrial, TrialState

from autotune.runtime import artifacts as art
from autotune.runtime import gpus
from autotune.tuning.artifact_io import (
    TIMING_ENV_KEYS,
    artifact_winners,
    merge_entries,
    search_space_hash,
    warm_starts_for,
)
from autotune.tuning.farm_results import (  # noqa: F401 - the farm's results API, re-exported
    failure_reason,
    farm_results,
    finish_order,
    latest_per_task,
    result_trial,
    task_runs,
    unfinished_reason,
)
from autotune.tuning.farm_results import result_of as _result
from autotune.tuning.farm_storage import (  # noqa: F401 - the farm's storage API, re-exported
    MAX_WORKERS,
    FarmError,
    FarmOptions,
    _advisory_lock,
    _retry_callback,
    _safe,
    check_farm_call,
    env_number,
    farm_storage,
    is_farm_url,
    plain_storage,
)
from autotune.tuning.registry import backends_for, load_plugins, plugin_modules
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import Reporter, TaskResult, TuneOptions, failed_result, tune_task, update_artifact
from autotune.tuning.worker import Worker, WorkerError

FARM_PREFIX = "farm|"
EXIT_KEY = 3  # a worker's exit status when its timing key differs from the farm's
SPEC_ENV = "AUTOTUNE_FARM_SPEC"  # a worker's spec (JSON) as its parent hands it over
# Tuning knobs that decide what a farm's results mean: another value is another farm.
FARM_KNOBS = (
    "n_trials",
    "sampler",
    "seed",
    "prune",
    "prune_percentile",
    "spill_limit",
    "backends",
    "cuda_graph",
    "verify",
    "max_verify",
    "compare_rounds",
    "compare_max_rounds",
    "warm_starts",
    "interpret",
    "plugins",
    "eval_timeout_s",  # a config that times out under one limit is timed under another
)
REPO_ROOT = Path(__file__).resolve().parents[2]


class LeaseLost(Exception):  # noqa: N818 - not a RuntimeError: tune_task's callers must not swallow it
    """Another worker failed this worker's claim (its heartbeat stalled): drop the task, never race."""


def timing_key(gpu: str, kernels: list[str], interpret: bool) -> dict[str, Any]:
    """What must match for two workers' timings to share a study: the device and software stack
    (``gpus.environment``), and the code measured (template and search-space hashes per kernel)."""
    env = gpus.environment()
    key: dict[str, Any] = {"gpu": gpu, "interpret": bool(interpret), **{k: env.get(k) for k in TIMING_ENV_KEYS}}
    code = {}
    for k in sorted(kernels):
        hashes = {b.name: art.current_template_hash(k, b.name)[:16] for b in backends_for(k, available_only=False)}
        code[k] = {"space": search_space_hash(k)[:16], **hashes}
    key["code"] = code
    return key


def key_diff(farm_key: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Human-readable differences, 'field: farm X, this worker Y'."""
    out = []
    for k in sorted(set(farm_key) | set(mine)):
        if farm_key.get(k) != mine.get(k):
            out.append(f"{k}: farm {farm_key.get(k)!r}, this worker {mine.get(k)!r}")
    return out


def farm_name(tasks: list[Task], opts: TuneOptions) -> str:
    """``farm|<gpu>|<digest>``: the same command (tasks and tuning knobs) on any host names the same farm."""
    gpu_keys = sorted({t.gpu for t in tasks})
    if len(gpu_keys) != 1:
        raise FarmError(f"a farm tunes one GPU; tasks name {gpu_keys}")
    knobs = {k: getattr(opts, k, None) for k in FARM_KNOBS}
    if knobs["backends"]:  # a set: `--backends cute,triton` on one host and `triton,cute` on another is one farm
        knobs["backends"] = sorted(set(knobs["backends"]))
    blob = json.dumps({"tasks": sorted(t.study_name for t in tasks), "knobs": knobs}, sort_keys=True, default=str)
    return f"{FARM_PREFIX}{gpu_keys[0]}|{hashlib.sha256(blob.encode()).hexdigest()[:12]}"


def join_farm(storage: optuna.storages.RDBStorage, tasks: list[Task], opts: TuneOptions) -> str:
    """Create or join the tasks' farm: check the timing key, enqueue tasks not done, held or waiting.

    A task whose last run ended with an error, or was cut short by a time budget, is queued again, as a re-run
    on one host would retry or resume it (its study keeps the trials measured so far).
    """
    name = farm_name(tasks, opts)
    mine = timing_key(tasks[0].gpu, sorted({t.kernel for t in tasks}), opts.interpret)
    with _advisory_lock(storage, name):
        farm = _load(storage, name, create=True)
        have = farm.user_attrs.get("timing_key")
        if have is None:
            farm.set_user_attr("timing_key", mine)
            farm.set_user_attr("knobs", {k: getattr(opts, k, None) for k in FARM_KNOBS})
            farm.set_user_attr("created", time.time())
        elif have != mine:
            raise FarmError(_refusal(name, have, mine))
        by_task: dict[str, list[FrozenTrial]] = {}
        for t in farm.get_trials(deepcopy=False):
            if "task_key" in t.user_attrs:
                by_task.setdefault(t.user_attrs["task_key"], []).append(t)
        for task in {t.study_name: t for t in tasks}.values():  # a task named twice is queued once, not held twice
            trials = by_task.get(task.study_name, [])
            if any(t.state in (TrialState.WAITING, TrialState.RUNNING) for t in trials):
                continue
            # Done unless its result is an error or was cut by a time budget: a re-run resumes the task's study.
            latest = result_trial(trials) if trials else None
            if latest is not None and latest.state == TrialState.COMPLETE:
                r = _result(latest)
                if not r.get("error") and not r.get("cut"):
                    continue
            attrs = {"task": task.to_dict(), "task_key": task.study_name, "label": task.label()}
            farm.enqueue_trial({}, user_attrs=attrs, skip_if_exists=False)
    return name


def _refusal(name: str, have: dict[str, Any], mine: dict[str, Any]) -> str:
    diff = "; ".join(key_diff(have, mine))
    return (
        f"refusing to join farm {name!r}: its timings were taken with another GPU, stack or code ({diff}). "
        "Run on a matching host (same GPU model and SM count, driver, torch/Triton/CuTe DSL versions, "
        "templates) or use another storage / task set."
    )


def check_key(farm: optuna.Study, interpret: bool) -> None:
    """A worker's own check (its GPU may differ from its parent's): FarmError when the keys differ."""
    have = farm.user_attrs.get("timing_key")
    if have is None:
        raise FarmError(f"{farm.study_name!r} is not a farm study (no timing key)")
    mine = timing_key(have["gpu"], list(have.get("code", {})), interpret)
    if mine != have:
        raise FarmError(_refusal(farm.study_name, have, mine))


def _load(storage: Any, name: str, create: bool = False) -> optuna.Study:
    sampler = optuna.samplers.RandomSampler()
    if create:
        return optuna.create_study(study_name=name, storage=storage, sampler=sampler, load_if_exists=True)
    return optuna.load_study(study_name=name, storage=storage, sampler=sampler)


# ------------------------------------------------------------------------------------------- worker
class _Heartbeat:
    """Beats for one farm trial every ``interval`` s (``ask``/``tell`` runs no heartbeat thread itself)."""

    def __init__(self, storage: Any, trial_id: int, interval: float) -> None:
        self.storage, self.trial_id, self.interval = storage, trial_id, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"heartbeat-{trial_id}", daemon=True)

    def __enter__(self) -> _Heartbeat:
        self.storage.record_heartbeat(self.trial_id)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.storage.record_heartbeat(self.trial_id)
            except Exception as e:  # noqa: BLE001 - a database hiccup: keep beating, say so
                _log(f"heartbeat of trial {self.trial_id} failed: {e}")


class _LeaseReporter(Reporter):
    """Publishes progress on the farm trial (``autotune status``) and checks the claim around each trial."""

    def __init__(self, storage: Any, trial_id: int) -> None:
        self.storage, self.trial_id = storage, trial_id

    def trial_done(self, task: Task, measured: int, status: str, best_ms: float | None) -> None:
        progress = {"measured": measured, "best_ms": best_ms, "status": status, "at": time.time()}
        try:
            self.storage.set_trial_user_attr(self.trial_id, "progress", progress)
        except UpdateFinishedTrialError:
            raise LeaseLost(f"farm trial {self.trial_id} was failed as stale by another worker") from None

    def check_claim(self, task: Task) -> None:
        if self.storage.get_trial(self.trial_id).state != TrialState.RUNNING:
            raise LeaseLost(f"farm trial {self.trial_id} was failed as stale by another worker")


class _ClaimedStorage:
    """A holder's storage for its task study: every write that records an outcome (a study attribute such as
    ``result`` or ``rejected``, a trial attribute, a trial state) is made under the farm's lock, and only while
    this worker's farm claim is RUNNING; once it is not, ``LeaseLost``.

    Optuna guards neither study attributes nor the gap between a trial's attribute writes and its ``tell``, and a
    claim checked before a write can be failed before the write lands (the holder stalls in between). Every
    takeover fails the claim under the same lock (``claim``, ``_release``) and the new holder exists only after
    that, so each write a stale holder makes lands before the takeover, hence before any write of the new holder,
    which it therefore never overwrites: neither the study's record, nor a config trial the new holder is failing
    as interrupted (``_Study._interrupt``) just as the stale holder finishes it (COMPLETE, PRUNED or FAIL). Handing
    back a trial this holder asked (the "interrupted" mark, then the FAIL) needs no claim: it only fails a trial
    still RUNNING, as the new holder would. Any other trial (one the new holder asked) is failed only under the claim.
    """

    _HAND_BACK = ("status", "interrupted")

    def __init__(self, storage: Any, farm_name: str, trial_id: int) -> None:
        self._storage, self._farm, self._tid = storage, farm_name, trial_id
        self._asked: set[int] = set()  # trials this holder moved to RUNNING
        self._handing: set[int] = set()  # trials it marked "interrupted": their FAIL is the hand-back

    def __getattr__(self, name: str) -> Any:
        if name == "_storage":  # not set yet (a copy or unpickling): no endless recursion
            raise AttributeError(name)
        return getattr(self._storage, name)

    @contextlib.contextmanager
    def _claimed(self, needed: bool = True) -> Iterator[None]:
        with _advisory_lock(self._storage, self._farm) if needed else contextlib.nullcontext():
            if needed and self._storage.get_trial(self._tid).state != TrialState.RUNNING:
                raise LeaseLost(f"farm trial {self._tid} was failed as stale by another worker")
            yield

    def create_new_trial(self, study_id: int, template_trial: FrozenTrial | None = None) -> int:
        trial_id = self._storage.create_new_trial(study_id, template_trial)
        if template_trial is None or template_trial.state == TrialState.RUNNING:  # ``ask`` with none waiting
            self._asked.add(trial_id)
        return trial_id

    def set_study_user_attr(self, study_id: int, key: str, value: Any) -> None:
        with self._claimed():
            self._storage.set_study_user_attr(study_id, key, value)

    def set_trial_user_attr(self, trial_id: int, key: str, value: Any) -> None:
        hand_back = (key, value) == self._HAND_BACK
        with self._claimed(not (hand_back and trial_id in self._asked)):
            self._storage.set_trial_user_attr(trial_id, key, value)
        if hand_back:
            self._handing.add(trial_id)

    def set_trial_state_values(self, trial_id: int, state: TrialState, values: Any = None) -> bool:
        with self._claimed(not (state == TrialState.FAIL and trial_id in self._handing)):
            ok = self._storage.set_trial_state_values(trial_id, state, values)
        if ok and state == TrialState.RUNNING:
            self._asked.add(trial_id)
        return ok


def host_label() -> str:
    """This host's name in worker ids and log file names (``AUTOTUNE_FARM_HOST`` overrides it, e.g. in tests): a
    '/' or '..' in it put a worker's log outside the logs folder, or failed to open it, so only letters, digits,
    '.', '_' and '-' are kept (others become '_')."""
    label = re.sub(r"[^A-Za-z0-9._-]", "_", os.environ.get("AUTOTUNE_FARM_HOST") or socket.gethostname())
    return label if label.strip(".") else "host"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def claim(farm: optuna.Study, fopts: FarmOptions, deadline: float | None = None) -> optuna.Trial | None:
    """Fail stale claims (re-queued by the retry callback), then pop one waiting task; None if none, or if
    the host's ``deadline`` has passed (its tasks stay queued for another host or the next join).

    Failing a claim and queueing its copy are two writes: under the farm's lock, so a host joining in
    between (which queues every task with no waiting or running copy) cannot queue the task a second time."""
    with _advisory_lock(farm._storage, farm.study_name):
        optuna.storages.fail_stale_trials(farm)
        _fail_orphans(farm, fopts)
    if past_deadline(deadline) or not farm.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
        return None
    trial = farm.ask()
    if "task" not in trial.user_attrs:  # another worker took the last waiting task: ask made a new trial
        trial.set_user_attr("empty", True)
        farm.tell(trial, state=TrialState.FAIL)
        return None
    return trial


# (farm, trial id) -> this process's monotonic time when it first saw that RUNNING trial with no claim stamped.
_UNSTAMPED: dict[tuple[str, int], float] = {}


def _fail_orphans(farm: optuna.Study, fopts: FarmOptions) -> None:
    """A worker killed between ``ask`` and its first heartbeat leaves a RUNNING trial that Optuna never
    counts as stale (no heartbeat row): fail and re-queue such trials once they are clearly old.

    "Old" is timed by this process's monotonic clock from when it first saw the claim unstamped, not from
    the trial's start: Optuna records that as the claiming host's local wall-clock time, which a host in
    another time zone, or with a skewed clock, cannot compare with its own."""
    now = time.monotonic()
    seen = set()
    for t in farm.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        # A retried copy carries its predecessor's attrs: only a claim stamped with this trial's id counts.
        if t.user_attrs.get("claimed_trial") == t._trial_id:
            continue
        key = (farm.study_name, t._trial_id)
        seen.add(key)
        if now - _UNSTAMPED.setdefault(key, now) < 2 * fopts.grace_s:
            continue
        why = "claimed but never started: its worker died between claiming and its first heartbeat"
        _release(farm, t._trial_id, why, requeue="task" in t.user_attrs)
        del _UNSTAMPED[key]
    for key in [k for k in _UNSTAMPED if k[0] == farm.study_name and k not in seen]:
        del _UNSTAMPED[key]


def _release(farm: optuna.Study, trial_id: int, reason: str, requeue: bool = True) -> None:
    """Fail a claim, saying why, and queue its task again now (Ctrl-C, SIGTERM, orphans), as a stale one
    would be. The caller holds the farm's lock (see ``claim``)."""
    storage = farm._storage
    try:
        storage.set_trial_user_attr(trial_id, "failed_reason", reason)
        if not storage.set_trial_state_values(trial_id, TrialState.FAIL):
            return
    except UpdateFinishedTrialError:
        return
    callback = _retry_callback(storage)
    if requeue and callback is not None:
        callback(farm, copy.deepcopy(storage.get_trial(trial_id)))


def _drained(farm: optuna.Study) -> bool:
    return not farm.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))


def past_deadline(deadline: float | None) -> bool:
    """Whether the host's time budget is spent: its workers then claim no task (``None``: no budget)."""
    return deadline is not None and time.time() >= deadline


def _queued_labels(farm: optuna.Study) -> list[str]:
    """The tasks waiting in the farm, by label (what a host out of budget leaves to others)."""
    waiting = farm.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    tasks = [t for t in waiting if t.user_attrs.get("task_key")]
    return sorted({str(t.user_attrs.get("label") or t.user_attrs["task_key"]) for t in tasks})


def _task_deadline(farm: optuna.Study, deadline: float | None) -> float:
    """This task's share of the host's budget: remaining time x busy workers / tasks left."""
    if deadline is None:
        return float("inf")
    now = time.time()
    left = farm.get_trials(deepcopy=False, states=(TrialState.WAITING, TrialState.RUNNING))
    workers = {t.user_attrs.get("worker") for t in left if t.state == TrialState.RUNNING} or {None}
    remaining = max(0.0, deadline - now)
    return now + min(remaining, remaining * len(workers) / max(1, len(left)))


def _warm_starts(farm: optuna.Study, task: Task, opts: TuneOptions) -> list[tuple[str, dict]]:
    """Winners of the bucket and its neighbours: the farm's finished tasks first, then the artifact's."""
    winners = artifact_winners([task], opts.artifacts_root)
    for t in farm.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        entry = _result(t).get("entry") or {}
        if entry.get("config") and "task" in t.user_attrs:
            other = Task.from_dict(t.user_attrs["task"])
            winners.setdefault(other.family, {})[other.bucket] = (entry["backend"], dict(entry["config"]))
    return warm_starts_for(task, winners, opts.warm_starts)


def _summary(r: TaskResult) -> dict[str, Any]:
    keep = ("statuses", "error", "kept_default", "default_config", "cut")
    return {"entry": r.entry(), **{k: getattr(r, k) for k in keep}}


def _run_one(farm: optuna.Study, trial: optuna.Trial, ctx: dict[str, Any]) -> bool:
    """Tune the claimed task under heartbeats; record its result in the farm, then in the artifact."""
    storage, tid = farm._storage, trial._trial_id
    opts: TuneOptions = dataclasses.replace(ctx["opts"], study_namespace=farm.study_name)
    task = Task.from_dict(trial.user_attrs["task"])
    with _Heartbeat(storage, tid, ctx["fopts"].heartbeat_s):
        try:
            attempt = 1 + len(storage.get_trial(tid).system_attrs.get("retry_history", []))
            claimed = {"worker": ctx["id"], "host": host_label(), "pid": os.getpid(), "attempt": attempt}
            # A retried copy carries its predecessor's attrs: its failure and any result are not this claim's.
            fresh = {"progress": {"measured": 0}, "claimed_at": time.time(), "claimed_trial": tid}
            fresh.update(failed_reason=None, result=None)
            for k, v in {**claimed, **fresh}.items():
                trial.set_user_attr(k, v)
            _log(f"{ctx['id']}: claimed {task.label()} (attempt {attempt})")
            deadline = _task_deadline(farm, ctx["deadline"])
            warm = _warm_starts(farm, task, opts)
            try:
                held = _ClaimedStorage(storage, farm.study_name, tid)
                r = tune_task(task, opts, ctx["worker"], held, deadline, warm, _LeaseReporter(storage, tid))
            except (RuntimeError, WorkerError) as e:  # InfraError among them
                r = failed_result(task, e)
            except Exception as e:  # e.g. Optuna's ValueError at a tell of a trial the new holder failed
                if storage.get_trial(tid).state != TrialState.RUNNING:
                    raise LeaseLost(f"farm trial {tid} was failed as stale by another worker ({e!r})") from e
                if isinstance(e, LeaseLost) or _storage_error(e):
                    raise  # a lost claim, or the storage's error: the task is handed back, another worker retries it
                # Any other error (a KeyError of a bug) is the task's, as in ``run_tasks``: raised, it killed this
                # worker, was reported as an interrupt, and each retry killed one more until none claimed the rest.
                r = failed_result(task, e)
            trial.set_user_attr("result", _summary(r))
            trial.set_user_attr("finished_at", time.time())  # epoch: hosts' clocks agree on it, zones need not
            if farm.tell(trial, r.tuning_s, skip_if_finished=True).state != TrialState.COMPLETE:
                raise LeaseLost(f"farm trial {tid} was failed as stale by another worker before it finished")
        except (LeaseLost, UpdateFinishedTrialError) as e:
            _log(f"{ctx['id']}: lost the claim on {task.label()} ({e}); another worker re-runs it")
            return False
        except BaseException:
            # hand the task back now
            with _advisory_lock(storage, farm.study_name):  # as in ``claim``: fail and re-queue as one
                _release(farm, tid, f"{ctx['id']} was interrupted (Ctrl-C, SIGTERM, or its run died)")
            raise
    _log(f"{ctx['id']}: finished {task.label()}" + (f" with error: {r.error}" if r.error else ""))
    if r.config is not None:
        update_artifact(r, opts, ctx["env"])
    return True


def _storage_error(e: BaseException) -> bool:
    """Whether ``e`` came from the farm's storage (SQLAlchemy, Optuna's storage layer), not from the task."""
    import sqlalchemy.exc

    return isinstance(e, (sqlalchemy.exc.SQLAlchemyError, optuna.exceptions.StorageInternalError))


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _interrupt_once(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker_signals() -> None:
    """The first SIGTERM or SIGINT interrupts a worker; later ones are ignored, so the hand-back of its task
    runs to the end. More do come: Ctrl-C reaches the worker, then its run's SIGTERM; and a killed run's
    threads each re-send the parent-death signal as the kernel re-parents the worker among them."""
    signal.signal(signal.SIGTERM, _interrupt_once)
    signal.signal(signal.SIGINT, _interrupt_once)


def _stop_with_parent(parent: int | None) -> None:
    """Linux: the kernel SIGTERMs this worker when the ``autotune run`` that spawned it dies (SIGKILL, OOM
    killer), so the worker hands its task back at once instead of tuning on unsupervised."""
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took hold
        raise KeyboardInterrupt


def work(spec: dict[str, Any]) -> int:
    """One worker process: claim tasks until the farm has none waiting or running, or until this host's deadline
    has passed (then the task it holds is finished and no other is claimed); 0, or EXIT_KEY."""
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    _worker_signals()
    _stop_with_parent(spec.get("parent"))
    names = {f.name for f in dataclasses.fields(TuneOptions)}
    opts = TuneOptions(**{k: v for k, v in spec["opts"].items() if k in names})
    opts.artifacts_root = Path(opts.artifacts_root)
    fopts = FarmOptions(**spec["farm_options"])
    load_plugins(opts.plugins)
    storage = farm_storage(spec["url"], fopts)
    farm = _load(storage, spec["farm"])
    wid = f"{host_label()}:w{spec['slot']}:{os.getpid()}"
    try:
        check_key(farm, opts.interpret)
    except FarmError as e:
        _log(f"{wid}: {e}")
        return EXIT_KEY
    ctx = {"opts": opts, "fopts": fopts, "id": wid, "deadline": spec.get("deadline"), "env": gpus.environment()}
    ctx["worker"] = Worker(plugin_modules(opts.plugins))
    done = 0
    try:
        while not past_deadline(ctx["deadline"]):
            trial = claim(farm, fopts, ctx["deadline"])
            if trial is not None:
                done += _run_one(farm, trial, ctx)
            elif _drained(farm):
                break
            else:
                time.sleep(fopts.poll_s)
    finally:
        ctx["worker"].close()
    if past_deadline(ctx["deadline"]):
        left = _queued_labels(farm)
        listed = "".join(f"\n  {x}" for x in left)
        _log(
            f"{wid}: this host's time budget is spent; {done} tasks finished here, claiming no more; "
            f"{len(left)} left queued for another host or the next join{listed}"
        )
        return 0
    _log(f"{wid}: farm drained; {done} tasks finished here")
    return 0


# --------------------------------------------------------------------------------------------- host
def visible_gpus() -> list[str]:
    """CUDA device ids a worker may be pinned to (``CUDA_VISIBLE_DEVICES`` order); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def _spawn(slot: int, spec: dict[str, Any], gpu_ids: list[str], log_dir: Path) -> subprocess.Popen:
    env = dict(os.environ)
    # This process's folder, where ``python -m`` finds plugins, after the repository: it never shadows the package.
    here = [os.getcwd()] if {"", os.getcwd()} & set(sys.path) else []
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *here, *filter(None, [env.get("PYTHONPATH")])])
    if gpu_ids:
        env["CUDA_VISIBLE_DEVICES"] = gpu_ids[slot % len(gpu_ids)]
    log_dir.mkdir(parents=True, exist_ok=True)
    # The spec travels in the environment, not argv: its storage URL may hold a password, and any user of
    # the host can read a process's command line (ps), while /proc/PID/environ is the owner's alone.
    env[SPEC_ENV] = json.dumps({**spec, "slot": slot}, default=str)
    with open(log_dir / f"{host_label()}-w{slot}.log", "a") as log:
        cmd = [sys.executable, "-m", "autotune.tuning.farm", "worker"]
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT))


def run_farm(
    tasks: list[Task],
    opts: TuneOptions,
    url: str,
    workers: int | None = None,
    budget_s: float | None = None,
    fopts: FarmOptions | None = None,
    tick: Callable[[str], None] | None = None,
) -> list[TaskResult]:
    """This host's part of the farm: join, run ``workers`` processes until the farm drains, merge the
    farm's results into the local artifacts; returns the tasks' results (as ``run_tasks`` does). With
    ``opts.interpret`` the workers (which inherit this process's environment) and the timing key run under the
    interpreter, called as a library too."""
    check_farm_call(url, workers)
    with gpus.interpreter(opts.interpret):
        return _run_farm(tasks, opts, url, workers, budget_s, fopts, tick)


def _run_farm(
    tasks: list[Task],
    opts: TuneOptions,
    url: str,
    workers: int | None,
    budget_s: float | None,
    fopts: FarmOptions | None,
    tick: Callable[[str], None] | None,
) -> list[TaskResult]:
    fopts = fopts or FarmOptions.from_env()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = farm_storage(url, fopts)
    name = join_farm(storage, tasks, opts)
    farm = _load(storage, name)
    gpu_ids = [] if opts.interpret else visible_gpus()
    n = workers or max(1, len(gpu_ids))
    log_dir = Path(opts.artifacts_root) / tasks[0].gpu / "studies" / "farm-logs"
    spec = {
        "url": url,
        "farm": name,
        # The workers run in the repository: a relative artifacts root is this process's folder, not theirs.
        "opts": {
            **{k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()},
            "artifacts_root": str(Path(opts.artifacts_root).absolute()),
        },
        "farm_options": dataclasses.asdict(fopts),
        "deadline": time.time() + budget_s if budget_s else None,
        "parent": os.getpid(),
    }
    procs: dict[int, subprocess.Popen] = {}
    refused, respawns = [], 0
    with _sigterm_as_interrupt():
        try:
            for i in range(0 if _drained(farm) else n):
                procs[i] = _spawn(i, spec, gpu_ids, log_dir)
            while procs:
                time.sleep(min(0.5, fopts.poll_s))
                _tick(tick, name)
                for slot, p in list(procs.items()):
                    rc = p.poll()
                    if rc is None:
                        continue
                    del procs[slot]
                    if rc == EXIT_KEY:
                        refused.append(slot)
                    elif rc != 0 and respawns < 2 * n and not _drained(farm) and not past_deadline(spec["deadline"]):
                        respawns += 1  # a crashed or killed worker: its task is re-queued, start a fresh one
                        procs[slot] = _spawn(slot, spec, gpu_ids, log_dir)
        except BaseException:
            _stop_all(procs.values())
            raise
    if refused and len(refused) == n and not _drained(farm):
        logs = ", ".join(str(log_dir / f"{host_label()}-w{s}.log") for s in refused)
        raise FarmError(f"every worker refused to join {name!r} (timing key differs; see {logs})")
    merge_farm(storage, name, opts)
    return farm_results(farm, tasks, log_dir, budget_spent=past_deadline(spec["deadline"]))


def _tick(tick: Callable[[str], None] | None, name: str) -> None:
    """Redraw the progress; a failure there (the storage restarting, a network blip) is logged and the
    farm goes on: the display must not stop this host's workers and release their tasks."""
    if tick is None:
        return
    try:
        tick(name)
    except Exception as e:  # noqa: BLE001 - any error of the display, sqlalchemy's included
        _log(f"progress display failed, the workers go on: {str(e).strip().splitlines()[0] if str(e).strip() else e!r}")


def _stop_all(procs: Any) -> None:
    """SIGTERM each live worker (it hands its task back to the farm), then wait for it; a worker still
    alive after 30 s, or when a second interrupt cuts the wait short, is killed."""
    procs = list(procs)
    try:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM of ``autotune run`` (kill, a job scheduler, systemd) stops its workers as Ctrl-C does:
    Python's default action would end this process at once and leave the workers running unsupervised."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def merge_farm(storage: Any, name: str, opts: TuneOptions) -> int:
    """Write each finished task's result (``result_trial``) into this host's artifacts; returns how many."""
    if not opts.write_artifacts:
        return 0
    farm = _load(storage, name)
    done = [t for t in latest_per_task(farm.get_trials(deepcopy=False)).values() if t.state == TrialState.COMPLETE]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    # Tasks that share an artifact entry (one bucket, another batch, cap, sample or seed): the last finished wins,
    # but a result cut by a time budget (its best so far) never replaces one tuned in full, so cut ones go first.
    for t in sorted(done, key=lambda t: (not _result(t).get("cut"), finish_order(t))):
        entry = _result(t).get("entry") or {}
        if entry.get("config") is not None and "task" in t.user_attrs:
            task = t.user_attrs["task"]
            groups.setdefault((task["gpu"], task["kernel"]), []).append(entry)
    env = gpus.environment()
    for (gpu, kernel), entries in sorted(groups.items()):
        merge_entries(kernel, gpu, entries, Path(opts.artifacts_root), env)
    return sum(len(v) for v in groups.values())


def run_farm_cli(
    console: Any,
    tasks: list[Task],
    opts: TuneOptions,
    url: str,
    workers: int | None,
    budget_s: float | None,
    reader: Any = None,
) -> list[TaskResult]:
    """``autotune run`` in farm mode: ``run_farm`` with the farm's status table redrawn while it runs
    (a line per change of the counts when the output is not a terminal). ``reader``: ``url``'s storage where the
    caller has opened it already (the CLI does, to name a bad URL before any output)."""
    from autotune.tuning import farm_status

    fopts = FarmOptions.from_env()
    gpu_ids = [] if opts.interpret else visible_gpus()
    n = workers or max(1, len(gpu_ids))
    if gpu_ids and n > len(gpu_ids):
        console.print(f"[yellow]{n} workers share {len(gpu_ids)} GPU(s): their timings disturb each other[/]")
    if reader is None:
        reader = plain_storage(url)  # before the banner: an unreachable storage is the one thing said
    console.print(
        f"Farm on {_safe(url)}: {n} worker(s) on this host; other hosts join with the same command. "
        f"Progress: autotune status --storage '{_safe(url)}' --watch"
    )
    state: dict[str, Any] = {"at": 0.0, "counts": None, "live": None}

    def tick(name: str) -> None:
        if time.time() - state["at"] < fopts.poll_s:
            return
        state["at"] = time.time()
        snap = farm_status.snapshot(reader, name)
        if state["live"] is not None:
            state["live"].update(farm_status.render(snap, url), refresh=True)
        elif snap["counts"] != state["counts"]:
            c = snap["counts"]
            lost = "".join(f", {c[k]} {k}" for k in ("cut", "failed", "lost") if c[k])
            console.print(f"farm: {c['done']} done, {c['running']} running, {c['waiting']} left{lost}", highlight=False)
        state["counts"] = snap["counts"]

    if not console.is_terminal:
        return run_farm(tasks, opts, url, workers, budget_s, fopts, tick)
    from rich.live import Live

    with Live(console=console, auto_refresh=False) as live:
        state["live"] = live
        return run_farm(tasks, opts, url, workers, budget_s, fopts, tick)


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.tuning.farm worker [SPEC]``: the worker process that ``run_farm`` starts (its spec in
    ``AUTOTUNE_FARM_SPEC`` unless given)."""
    argv = sys.argv[1:] if argv is None else argv
    spec = argv[1] if len(argv) == 2 else os.environ.get(SPEC_ENV)
    if not argv or argv[0] != "worker" or len(argv) > 2 or not spec:
        print(
            f"usage: python -m autotune.tuning.farm worker [SPEC_JSON] (or the spec in {SPEC_ENV}; "
            "started by autotune run --storage postgresql://...)"
        )
        return 2
    try:
        return work(json.loads(spec))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
