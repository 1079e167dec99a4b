"""The search: one Optuna study per task, evaluated by a worker subprocess.

Per trial: feasibility rules (no GPU time) -> compile + compiler report + spill limit -> correctness
against the reference on poisoned outputs (the check batch, then the timed batch itself) -> quick
timing, ``trial.report`` / ``should_prune`` -> full timing for promising configs. Every trial keeps
``status`` (ok, infeasible, spill, compile, incorrect, timeout, crash, pruned; interrupted and infra
for trials that were not the config's fault and run again) and the compiler report as user attrs.

Trust rules: a crash or timeout is retried once on a fresh worker before it counts; after any failed
request the worker must pass a known-good launch or it is replaced; worker set-up failures are
infrastructure, retried and never charged to a config. Studies live in Optuna storage (a journal
file under artifacts/<gpu>/studies/ by default), so an interrupted run resumes (its RUNNING trials
are queued again). At the end the fastest config is re-checked on other shapes, masks and dtypes of
its bucket, then timed interleaved with the default and kept only if it wins by more than the spread.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.trial import TrialState

from autotune.runtime import artifacts as art
from autotune.runtime.defaults import baseline_backend, space_default
from autotune.runtime.gpus import environment, interpreter, interpreting
from autotune.tuning.artifact_io import (
    TIMING_ENV_KEYS,
    WARM_START_SCOPES,
    artifact_winners,
    completed_hints,
    merge_entries,
    search_space_hash,
    warm_starts_for,
)
from autotune.tuning.decide import DEFAULT_REMEASURE, RETRY_STATUSES
from autotune.tuning.decide import decide as _decide
from autotune.tuning.registry import Backend, backends_for, get_op
from autotune.tuning.study_storage import make_storage
from autotune.tuning.task_result import InfraError, TaskResult, failed_result
from autotune.tuning.tasks import Task, space_context
from autotune.tuning.worker import Worker, WorkerError
from search_spaces.base import SpaceContext

SAMPLERS = ("tpe", "random", "bruteforce", "gp")
FAIL_STATES = {"compile": TrialState.FAIL, "incorrect": TrialState.FAIL, "timeout": TrialState.FAIL}
FAIL_STATES.update({"crash": TrialState.FAIL, "spill": TrialState.PRUNED, "infeasible": TrialState.PRUNED})
VERIFY_LEVELS = ("full", "quick")


@dataclass
class TuneOptions:
    """Knobs of a tuning run (the CLI fills them)."""

    n_trials: int = 14
    sampler: str = "tpe"
    seed: int = 0
    storage: str | None = None
    artifacts_root: Path = art.DEFAULT_ROOT
    eval_timeout_s: float = 60.0
    setup_timeout_s: float = 900.0
    spill_limit: int = 512
    prune: bool = True
    prune_percentile: float = 50.0
    backends: list[str] | None = None
    plugins: list[str] = field(default_factory=list)
    interpret: bool = False
    write_artifacts: bool = True
    cuda_graph: bool = False  # time replays of a captured CUDA graph (no launch overhead)
    verify: str = "full"  # final re-check of the winner: "full" (masks x dtypes x shapes) or "quick"
    verify_timeout_s: float = 900.0  # the re-check compiles every mask and dtype variant
    max_verify: int = 4  # candidates re-checked before falling back to the default
    compare_rounds: int = 6  # interleaved winner/default timing rounds
    compare_max_rounds: int = 18  # rounds an inconclusive comparison (a gain inside the spread) extends to
    # Configs measured before the sampler's (``artifact_io.warm_starts_for``): "all" or "own" (the bucket's last
    # winner only, for a re-measure).
    warm_starts: str = "all"
    setup_retries: int = 3
    setup_backoff_s: float = 1.0
    # A farm's name, set by its workers: a task study then belongs to one farm, so two farms (commands of
    # other knobs) naming the same task on one storage never fail each other's live trials as interrupted,
    # and a config timed under one farm's limits is timed again under another's (``farm.FARM_KNOBS``).
    study_namespace: str | None = None

    def __post_init__(self) -> None:
        """A knob no run can work with is a ValueError naming it here: a misspelt ``verify`` ran the quick
        re-check, a zero timeout failed every config as a hang, zero set-up retries died in an IndexError."""
        for name, allowed in (("sampler", SAMPLERS), ("verify", VERIFY_LEVELS), ("warm_starts", WARM_START_SCOPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("eval_timeout_s", "setup_timeout_s", "verify_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        # A negative spill limit failed every config as "spill"; a negative seed failed the sampler's set-up.
        lows = {"n_trials": 0, "setup_retries": 1, "max_verify": 0, "compare_rounds": 1, "spill_limit": 0, "seed": 0}
        for name, low in {**lows, "compare_max_rounds": self.compare_rounds}.items():
            if not isinstance(getattr(self, name), int) or getattr(self, name) < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {getattr(self, name)!r}")
        if self.seed >= 2**32:  # the samplers seed NumPy's RandomState
            raise ValueError(f"seed must be an integer in [0, 2**32 - 1], got {self.seed!r}")
        for name, high in (("prune_percentile", 100.0), ("setup_backoff_s", math.inf)):
            v = getattr(self, name)
            if not isinstance(v, int | float) or math.isnan(v) or not 0 <= v <= high or v == math.inf:
                raise ValueError(f"{name} must be a number in [0, {high:g}], got {v!r}")


class Reporter:
    """Progress callbacks (the CLI draws rich progress bars); the base class is silent."""

    def task_start(self, task: Task, index: int, total: int, n_trials: int) -> None: ...
    def trial_done(self, task: Task, measured: int, status: str, best_ms: float | None) -> None: ...
    def check_claim(self, task: Task) -> None:
        """After each ``ask`` and before the study's final writes (re-checks, result): a farm worker whose
        task another worker took over (its heartbeat stalled) raises here rather than take the new holder's
        queued trials or overwrite its record."""

    def task_end(self, result: TaskResult) -> None: ...


class _BruteForce(optuna.samplers.BruteForceSampler):
    """Exhaustive search; exhaustion ends the tuner's loop (Study.stop only works inside optimize)."""

    def after_trial(self, study, trial, state, values) -> None:
        return None


def make_sampler(name: str, seed: int, n_trials: int) -> optuna.samplers.BaseSampler:
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    if name == "tpe":
        startup = max(3, n_trials // 3)
        return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup, multivariate=True, group=True)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "bruteforce":
        return _BruteForce(seed=seed)
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed)
    raise ValueError(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")


@dataclass
class Launch:
    """One config of one backend, bound to a task's inputs: ``run()`` launches it."""

    backend: str
    config: Any
    run: Any


def bench_launches(
    task: Task, artifact: art.Artifact | None, device: str = "cuda"
) -> tuple[float, Launch, Launch | None]:
    """(FLOPs, default, tuned) launches of ``task`` on its representative batch, as ``autotune bench``
    times them: the study's baseline (``defaults.baseline_backend``'s default) and the config
    ``artifact`` holds for the task (None without a usable entry)."""
    import torch

    op = get_op(task.kernel)
    backends = {b.name: b for b in backends_for(task.kernel)}
    inputs = op.make_inputs(task, task.lengths(), 1, device, getattr(torch, task.dtype))
    out = op.alloc_out(inputs)

    def bind(backend: Backend, config: Any) -> Launch:
        return Launch(backend.name, config, lambda: backend.launch(inputs, config, out))

    first = backends[baseline_backend(task.kernel, task.dqk, task.dv, task.num_heads, task.dtype, False, backends)]
    default = bind(first, space_default(first.space, space_context(task, False)))
    # The entry the run wrote for this very task (its key), not any of the bucket's heads or masks.
    key = (task.dtype, task.dqk, task.dv, task.bucket, task.distribution, task.num_heads, task.mask)
    entry = artifact.lookup(*key) if artifact else None
    tuned = None
    if entry is not None and entry["backend"] in backends:
        b = backends[entry["backend"]]
        tuned = bind(b, b.space.make(entry["config"]))
    return op.flops(inputs), default, tuned


def study_name(task: Task, backends: list[str], cuda_graph: bool = False) -> str:
    """The task's study name plus a digest of what its trials measured (backends, template sources, spaces)
    and how (CUDA-graph replays are timed apart: their times never meet plain launches' in one study).

    A resumed run reuses the study only while the measured code is the same; an edited template or
    space starts a fresh study instead of trusting timings of code that no longer exists.
    """
    parts = [search_space_hash(task.kernel)]
    parts += [f"{b}:{art.current_template_hash(task.kernel, b)}" for b in sorted(backends)]
    digest = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:12]
    timing = "|graph" if cuda_graph else ""
    return f"{task.study_name}|src{digest}|{task.gpu}|env{environment_digest()}{timing}"


@functools.lru_cache(maxsize=2)
def _environment_cached(interpret: bool) -> tuple[tuple[str, Any], ...]:
    env = environment()  # the interpreter's block under TRITON_INTERPRET=1, which ``interpret`` keys
    return tuple((k, env.get(k)) for k in TIMING_ENV_KEYS)


def environment_digest() -> str:
    """Digest of this process's timing environment (GPU model, SMs, driver, CUDA, torch, Triton, CuTe DSL):
    studies and farms of different digests never share trials, as their timings do not compare."""
    return hashlib.sha256(repr(_environment_cached(interpreting())).encode()).hexdigest()[:10]


def _choices(backend: Backend, ctx: SpaceContext, default_values: dict[str, Any]) -> dict[str, tuple]:
    """Per param, the choices used by at least one feasible config (so the sampler wastes few asks on
    infeasible ones), plus the backend default's value (so it can be enqueued)."""
    space = backend.space
    feasible = [space.values(c) for c in space.prune(ctx)]
    out = {}
    for p, choices in space.params.items():
        used = {v[p] for v in feasible}
        keep = tuple(c for c in choices if c in used) if used else tuple(choices)
        extra = default_values.get(p)
        out[p] = keep if extra is None or extra in keep else (*keep, extra)
    return out


def _params(backend: str, values: dict[str, Any]) -> dict[str, Any]:
    return {"backend": backend, **{f"{backend}.{k}": v for k, v in values.items()}}


def _key(backend: str, values: dict[str, Any]) -> str:
    return backend + ":" + ",".join(f"{k}={values[k]}" for k in sorted(values))


def _key_of_params(params: dict[str, Any]) -> str | None:
    """The config key of a trial's (fixed or sampled) params."""
    backend = params.get("backend")
    if backend is None:
        return None
    prefix = f"{backend}."
    return _key(backend, {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)})


def _config_dict(config: Any) -> dict[str, Any]:
    return config.to_dict() if hasattr(config, "to_dict") else dataclasses.asdict(config)


def _other_limits(t: optuna.trial.FrozenTrial, opts: TuneOptions) -> str | None:
    """Why a trial of an earlier run is measured again under this run's limits, which a plain study's name
    lacks: a timeout under a shorter (or unrecorded) --eval-timeout may have cut off a long compile, and a
    --spill-limit of the other side of its spill count turns "ok" into "spill" or back, and a config pruned after
    its quick timing is fully timed by a run that prunes nothing (--no-prune). None: it stands."""
    status, spills = t.user_attrs.get("status"), t.user_attrs.get("n_spills")
    if status == "timeout" and t.user_attrs.get("eval_timeout_s", 0.0) < opts.eval_timeout_s:
        return "timed out under a shorter --eval-timeout"
    if status == "pruned" and not opts.prune:
        return "pruned by an earlier run; this one times every correct config (--no-prune)"
    if isinstance(spills, int) and (status == "spill") != (spills > opts.spill_limit) and status in ("ok", "spill"):
        return f"{spills} spills, measured under another --spill-limit"
    return None


class _Study:
    """One task's study: sampling, bookkeeping of evaluated configs, the worker calls and their failures."""

    def __init__(self, task: Task, opts: TuneOptions, worker: Worker, storage: Any, reporter: Reporter) -> None:
        self.task, self.opts, self.worker, self.reporter = task, opts, worker, reporter
        self.backends = {b.name: b for b in backends_for(task.kernel, opts.backends)}
        if not self.backends:
            raise RuntimeError(f"no available backend for {task.kernel} (asked: {opts.backends or 'any'})")
        self.ctx = space_context(task, opts.interpret)
        # The baseline is what runs without artifacts: the first backend of the spec's defaults.
        dims = (task.dqk, task.dv, task.num_heads, task.dtype)
        first = self.backends[baseline_backend(task.kernel, *dims, opts.interpret, self.backends)]
        self.default_backend = first
        self.defaults = {n: b.space.values(space_default(b.space, self.ctx)) for n, b in self.backends.items()}
        self.default_values = self.defaults[first.name]
        self.default_key = _key(first.name, self.default_values)
        self.choices = {n: _choices(b, self.ctx, self.defaults[n]) for n, b in self.backends.items()}
        self.study = optuna.create_study(
            study_name=study_name(task, list(self.backends), opts.cuda_graph)
            + (f"|{opts.study_namespace}" if opts.study_namespace else ""),
            storage=storage,
            sampler=make_sampler(opts.sampler, opts.seed, opts.n_trials),
            pruner=optuna.pruners.PercentilePruner(opts.prune_percentile, n_startup_trials=3, n_warmup_steps=0),
            direction="minimize",
            load_if_exists=True,
        )
        self.study.set_user_attr("task", task.to_dict())
        self.rejected: dict[str, str] = dict(self.study.user_attrs.get("rejected", {}))
        self.seen: dict[str, optuna.trial.FrozenTrial] = {}
        self.flops: float | None = None
        self._requeue_interrupted()
        done = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)
        again: dict[str, tuple[optuna.trial.FrozenTrial, str]] = {}  # verdicts of other limits: measured again
        for t in self.study.get_trials(deepcopy=False, states=done):
            k, status = t.user_attrs.get("config_key"), t.user_attrs.get("status")
            if not k or t.user_attrs.get("duplicate") or status in RETRY_STATUSES:
                continue
            why = _other_limits(t, opts)
            if why:
                again[k] = (t, why)
                self.seen.pop(k, None)
            else:
                self.seen[k] = t
                again.pop(k, None)
        for t, why in again.values():
            self._requeue(t, f"requeued: {why}")
        # A default that timed out or crashed in an earlier run is measured again: the cause may have been
        # the environment (a short --eval-timeout, a busy GPU), and no winner is written without it.
        last_default = self.seen.get(self.default_key)
        if last_default is not None and last_default.user_attrs.get("status") in DEFAULT_REMEASURE:
            del self.seen[self.default_key]

    def _requeue_interrupted(self) -> None:
        """Trials a killed run left RUNNING are failed ("interrupted") and queued again.

        A journal or SQLite study belongs to one ``autotune run`` at a time, so any RUNNING trial
        found on opening it lost its process.
        """
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
            self._interrupt(t)

    def _interrupt(self, t: optuna.trial.FrozenTrial) -> None:
        """Fail a trial no process will finish ("interrupted": not its config's fault) and queue its config
        again: its params, or those it was enqueued with if it was asked but not yet suggested. A trial
        another process finished first (a stalled holder hands it back as the new holder fails it) is left
        to that process, so its config is queued once."""
        storage = self.study._storage
        try:
            storage.set_trial_user_attr(t._trial_id, "status", "interrupted")
            storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        except UpdateFinishedTrialError:
            return
        self._requeue(t, "requeued after an interrupted run")

    def _requeue(self, t: optuna.trial.FrozenTrial, source: str) -> None:
        """Queue ``t``'s config again: its params, or those it was enqueued with if it was asked but not yet
        suggested."""
        params = t.params or t.system_attrs.get("fixed_params") or {}
        key = t.user_attrs.get("config_key") or _key_of_params(params)
        backend = t.user_attrs.get("backend") or params.get("backend")
        if key and backend in self.backends:
            prefix = f"{backend}."
            values = {k[len(prefix) :]: v for k, v in params.items() if k.startswith(prefix)}
            if values:
                self.queue(backend, values, source)

    @property
    def measured(self) -> int:
        return sum(1 for t in self.seen.values() if t.user_attrs.get("measured"))

    def space_size(self) -> int:
        """Number of distinct configs Optuna can propose (the loop ends once all were seen)."""
        return sum(math.prod(len(c) for c in choices.values()) for choices in self.choices.values())

    def queue(self, backend: str, values: dict[str, Any], source: str) -> str | None:
        """Enqueue a config unless it was measured or is already waiting (Optuna's own skip_if_exists
        also skips configs whose only trial failed for reasons that were not the config's).
        Returns the config's key when it is (or already was) waiting, None when it cannot be asked."""
        choices = self.choices.get(backend)
        if choices is None or any(values.get(p) not in c for p, c in choices.items()):
            return None
        key = _key(backend, {p: values[p] for p in choices})
        if key in self.seen:
            return key
        for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            if _key_of_params(t.system_attrs.get("fixed_params", {})) == key:
                return key
        params = _params(backend, {p: values[p] for p in choices})
        self.study.enqueue_trial(params, user_attrs={"source": source}, skip_if_exists=False)
        return key

    # ------------------------------------------------------------------------------- worker calls
    def ensure_setup(self) -> None:
        """The worker holds this task's inputs; set-up failures are retried and never charged to a
        config (a GPU still held by a dying worker, host OOM, ...): ``InfraError`` after the last try."""
        if self.worker.alive() and self.worker.task_key == self.task.study_name and self.flops is not None:
            return
        msg = {"cmd": "setup", "task": self.task.to_dict(), "cuda_graph": self.opts.cuda_graph}
        errors = []
        for attempt in range(self.opts.setup_retries):
            if attempt:
                time.sleep(min(8.0, self.opts.setup_backoff_s * 2 ** (attempt - 1)))
            self.worker.task_key = None
            try:
                reply = self.worker.call(msg, self.opts.setup_timeout_s)
            except WorkerError as e:
                errors.append(f"{e.kind}: {e}")
                continue
            if reply.get("status") == "ok":
                self.worker.task_key, self.flops = self.task.study_name, reply["flops"]
                return
            errors.append(str(reply.get("error")))
            self.worker.kill()
        raise InfraError(f"worker set-up for {self.task.label()} failed {len(errors)} times; last: {errors[-1]}")

    def request(self, msg: dict[str, Any], timeout: float | None = None) -> dict[str, Any]:
        """One request about one config. A crash or timeout is retried once on a fresh worker before it
        counts; after any other non-ok reply the worker is proven healthy (or replaced) before the next, and
        a failure on a worker that then fails its probe is retried once on the fresh one: the worker may have
        been broken before this request (a stray write of an earlier config's timing loop)."""
        timeout = timeout or self.opts.eval_timeout_s
        first: dict[str, Any] | None = None
        for attempt in (1, 2):
            self.ensure_setup()
            try:
                reply = self.worker.call(msg, timeout)
            except WorkerError as e:
                reply = {"status": e.kind, "error": str(e)}
            if reply.get("status") == "ok":
                break
            if reply.get("status") in ("crash", "timeout"):
                self.worker.kill()
                retry = True
            else:
                retry = self.heal() is False
            if attempt == 2 or not retry:
                break
            first = reply
        reply["attempts"] = attempt
        if first is not None:
            reply["first_error"] = str(first.get("error"))[-400:]
        return reply

    def known_good(self) -> tuple[str, dict[str, Any]] | None:
        """A config that ran correctly in this study (the default first), for health probes."""
        default = self.seen.get(self.default_key)
        if default is not None and default.user_attrs.get("status") == "ok":
            return self.default_backend.name, self.default_values
        best = self.best()
        return (best.user_attrs["backend"], self.values_of(best)) if best else None

    def heal(self) -> bool | None:
        """After a failed request: a known-good launch and a sync must pass, else the worker is replaced
        (a sticky CUDA error, or memory a bad config overwrote, must not fail the configs after it).
        Returns whether the probe passed; None when there was no worker or no known-good config to probe."""
        good = self.known_good()
        if not self.worker.alive() or good is None:
            self.worker.kill()
            return None
        try:
            reply = self.worker.call({"cmd": "probe", "backend": good[0], "config": good[1]}, self.opts.eval_timeout_s)
        except WorkerError:
            reply = {"status": "crash"}
        if reply.get("status") != "ok":
            self.worker.kill()
            return False
        return True

    def values_of(self, trial: optuna.trial.FrozenTrial) -> dict[str, Any]:
        backend = trial.user_attrs["backend"]
        return {p: trial.params[f"{backend}.{p}"] for p in self.choices[backend]}

    # ------------------------------------------------------------------------------------ trials
    def step(self) -> str:
        """Ask, evaluate and tell one trial; returns its status."""
        self.ensure_setup()  # before ask: an infrastructure failure then holds no trial
        trial = self.study.ask()
        self._keep_claim(trial)
        bname = trial.suggest_categorical("backend", list(self.backends))
        backend = self.backends[bname]
        values = {p: trial.suggest_categorical(f"{bname}.{p}", c) for p, c in self.choices[bname].items()}
        key = _key(bname, values)
        trial.set_user_attr("config_key", key)
        trial.set_user_attr("backend", bname)
        if key in self.seen:
            prev = self.seen[key]
            trial.set_user_attr("duplicate", True)
            trial.set_user_attr("status", prev.user_attrs.get("status", "?"))
            self.study.tell(trial, prev.value if prev.state == TrialState.COMPLETE else None, state=prev.state)
            return "duplicate"
        try:
            return self._evaluate(trial, bname, backend, values, key)
        except InfraError as e:
            trial.set_user_attr("status", "infra")
            trial.set_user_attr("error", str(e)[-800:])
            self.study.tell(trial, state=TrialState.FAIL)
            self.queue(bname, values, "requeued after an infrastructure failure")
            raise

    def _keep_claim(self, trial: optuna.Trial) -> None:
        """Right after ``ask``: a farm holder whose task was taken over while it stalled hands the trial back
        (it may be one the new holder queued and counts on) and stops, instead of timing it and pushing the
        study past ``n_trials``. After ``ask``, not before, so no stall between check and ask slips through:
        a trial asked before the takeover is RUNNING when the new holder opens the study, which fails and
        re-queues it (``_requeue_interrupted``); this holder's ``tell`` of it then fails."""
        try:
            _check_claim(self.reporter, self.task)
        except BaseException:
            self._interrupt(self.study._storage.get_trial(trial._trial_id))
            raise

    def _evaluate(self, trial, bname: str, backend: Backend, values: dict[str, Any], key: str) -> str:
        is_default = key == self.default_key
        attrs: dict[str, Any] = {"is_default": is_default}
        try:
            config = backend.space.make(values)
            reason = None if is_default else backend.space.why_infeasible(config, self.ctx)
        except ValueError as e:
            config, reason = None, f"invalid config: {e}"
        if reason:
            return self._finish(trial, key, {**attrs, "status": "infeasible", "reason": reason}, None)
        attrs["config"] = _config_dict(config)
        msg = {"cmd": "evaluate", "backend": bname, "config": values, "quick": not is_default}
        res = self.request({**msg, "spill_limit": self.opts.spill_limit})
        attrs.update(measured=True, status=res["status"], attempts=res["attempts"])
        attrs["eval_timeout_s"] = self.opts.eval_timeout_s  # a resume with a longer limit times its timeouts again
        for k in ("compile_s", "error", "check", "first_error", "samples"):
            if k in res:
                attrs[k] = res[k] if k != "error" else str(res[k])[-800:]
        report = res.get("report") or {}
        for k in ("n_regs", "n_spills", "shared"):
            attrs[k] = report.get(k)
        if res["status"] != "ok":
            return self._finish(trial, key, attrs, None)
        attrs["quick_ms"] = res["median_ms"]
        if is_default:
            attrs.update(median_ms=res["median_ms"], spread_ms=res["spread_ms"])
            return self._finish(trial, key, attrs, res["median_ms"])
        trial.report(res["median_ms"], step=0)
        if self.opts.prune and trial.should_prune():
            return self._finish(trial, key, {**attrs, "status": "pruned"}, None, TrialState.PRUNED)
        full = self.request({"cmd": "time", "backend": bname, "config": values})
        if full["status"] != "ok":
            return self._finish(trial, key, {**attrs, **full, "error": str(full.get("error"))[-800:]}, None)
        attrs.update(median_ms=full["median_ms"], spread_ms=full["spread_ms"], samples=full.get("samples"))
        return self._finish(trial, key, attrs, full["median_ms"])

    def _finish(
        self, trial, key: str, attrs: dict[str, Any], value: float | None, state: TrialState | None = None
    ) -> str:
        if value is not None and (not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0):
            # Below the timer's resolution or a broken clock: no time to rank by (a 0 divided the TFLOP/s).
            attrs = {**attrs, "status": "timing", "error": f"timing gave {value!r} ms, not a positive finite time"}
            value = None
        status = attrs["status"]
        if value is not None and self.flops:
            attrs["tflops"] = self.flops / (value * 1e-3) / 1e12
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        if value is not None:
            frozen = self.study.tell(trial, value)
        else:
            frozen = self.study.tell(trial, state=state or FAIL_STATES.get(status, TrialState.FAIL))
        self.seen[key] = frozen
        return status

    def ranked(self) -> list[optuna.trial.FrozenTrial]:
        """Correct, timed configs, fastest first, without those the final re-check rejected."""
        ok = [
            t
            for k, t in self.seen.items()
            if t.state == TrialState.COMPLETE and t.user_attrs.get("status") == "ok" and k not in self.rejected
        ]
        return sorted(ok, key=lambda t: t.value)

    def best(self) -> optuna.trial.FrozenTrial | None:
        ranked = self.ranked()
        return ranked[0] if ranked else None

    def reject(self, trial: optuna.trial.FrozenTrial, reason: str) -> None:
        """A config that failed the final re-check never wins this study again (kept across resumes)."""
        self.rejected[trial.user_attrs["config_key"]] = reason[-800:]
        self.study.set_user_attr("rejected", self.rejected)


def _ensure_default(s: _Study) -> None:
    """The default is measured in every study, whatever the budget or an earlier kill left behind."""
    for _ in range(3):
        if s.default_key in s.seen:
            return
        s.queue(s.default_backend.name, s.default_values, "default")
        s.step()


def _check_claim(reporter: Reporter, task: Task) -> None:
    """``reporter.check_claim``; reporters are duck-typed (the CLI's progress bars), so it may be absent."""
    check = getattr(reporter, "check_claim", None)
    if check is not None:
        check(task)


def tune_task(
    task: Task,
    opts: TuneOptions,
    worker: Worker,
    storage: Any,
    deadline: float,
    warm_starts: list[tuple[str, dict[str, Any]]] = (),
    reporter: Reporter | None = None,
) -> TaskResult:
    """Tune one task until ``opts.n_trials`` measured trials, the deadline, or an exhausted space.

    The first trials are every backend's default and the warm starts (the bucket's last winner first).
    """
    reporter = reporter or Reporter()
    t0 = time.time()
    s = _Study(task, opts, worker, storage, reporter)
    first = [s.queue(s.default_backend.name, s.default_values, "default")]
    first += [s.queue(bname, values, f"default of {bname}") for bname, values in s.defaults.items()]
    first += [
        s.queue(bname, hint, "warm-start")
        for bname, values in warm_starts
        for hint in completed_hints(values, s.choices.get(bname, {}))
    ]
    first_keys = {k for k in first if k is not None}  # measured whatever the budget says
    result = TaskResult(task, timing="do_bench+cuda_graph" if opts.cuda_graph else "do_bench")
    asks, dup_streak, limit, size = 0, 0, 50 * opts.n_trials + 200, s.space_size()
    while asks < limit and len(s.seen) < size and dup_streak < 40:
        firsts_done = first_keys <= s.seen.keys()
        if firsts_done and (s.measured >= opts.n_trials or time.time() > deadline):
            result.cut = s.measured < opts.n_trials
            break
        status = s.step()
        asks += 1
        dup_streak = dup_streak + 1 if status == "duplicate" else 0
        best = s.best()
        reporter.trial_done(task, s.measured, status, best.value if best else None)
    try:
        return _conclude(s, result, t0)
    except BaseException as e:
        if result.cut:  # whoever builds the error result keeps the cut (``failed_result``)
            e.cut_after = s.measured  # type: ignore[attr-defined]
        raise


def _conclude(s: _Study, result: TaskResult, t0: float) -> TaskResult:
    """After the trials: measure the default if missing, decide the winner, record and report the result."""
    task, reporter = s.task, s.reporter
    _check_claim(reporter, task)
    _ensure_default(s)
    chosen = _decide(s, result)
    for k, t in s.seen.items():
        st = "incorrect" if k in s.rejected else t.user_attrs.get("status", "?")
        result.statuses[st] = result.statuses.get(st, 0) + 1
    result.trials, result.rejected = s.measured, dict(s.rejected)
    default = s.seen.get(s.default_key)
    result.default_config = s.default_values
    if default is not None and default.state == TrialState.COMPLETE:
        result.default_ms = default.value
    if chosen is None:
        result.error = result.error or "no config was correct on every check (see trial statuses and rejected)"
    else:
        bname = chosen.user_attrs["backend"]
        result.backend = bname
        result.config = _config_dict(s.backends[bname].space.make(s.values_of(chosen)))
        result.median_ms, result.spread_ms = chosen.value, chosen.user_attrs.get("spread_ms", 0.0)
        result.samples = chosen.user_attrs.get("samples")
        cmp = result.comparison
        if cmp and cmp.get("rounds"):
            result.default_ms = cmp["b_ms"]
            result.median_ms = cmp["b_ms"] if result.kept_default else cmp["a_ms"]
        flops = s.flops or 0.0
        result.tflops = flops / (result.median_ms * 1e-3) / 1e12
        if result.default_ms:
            result.default_tflops = flops / (result.default_ms * 1e-3) / 1e12
            result.speedup = result.default_ms / result.median_ms
    result.tuning_s = time.time() - t0
    _check_claim(reporter, task)
    s.study.set_user_attr("result", {k: v for k, v in result.entry().items()})
    reporter.task_end(result)
    return result


def update_artifact(result: TaskResult, opts: TuneOptions, env: dict[str, Any]) -> Path | None:
    """Upsert the task's entry into artifacts/<gpu>/<kernel>.json (locked re-read, atomic write)."""
    if result.config is None or not opts.write_artifacts:
        return None
    t = result.task
    return merge_entries(t.kernel, t.gpu, [result.entry()], opts.artifacts_root, env)


def run_tasks(
    tasks: list[Task], opts: TuneOptions, time_budget_s: float | None = None, reporter: Reporter | None = None
) -> list[TaskResult]:
    """Tune ``tasks`` in order with one worker; each task gets an equal share of the remaining budget.
    A plugin that cannot be imported raises its ImportError here, before any worker starts. A task that raises
    ends with its error (type and message) and the run goes on; an interrupt ends the run."""
    with interpreter(opts.interpret):  # the workers inherit it: ``interpret`` runs the kernels on the CPU
        return _run_tasks(tasks, opts, time_budget_s, reporter)


def _run_tasks(
    tasks: list[Task], opts: TuneOptions, time_budget_s: float | None, reporter: Reporter | None
) -> list[TaskResult]:
    from autotune.tuning.registry import load_plugins, plugin_modules

    load_plugins(opts.plugins)
    reporter = reporter or Reporter()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    for t in tasks:
        get_op(t.kernel)
    worker = Worker(plugin_modules(opts.plugins))
    storages: dict[str, Any] = {}
    env = environment()
    winners = artifact_winners(tasks, opts.artifacts_root)
    start = time.time()
    results = []
    try:
        for i, task in enumerate(tasks):
            if task.gpu not in storages:
                storages[task.gpu] = make_storage(opts.storage, task.gpu, opts.artifacts_root)
            if time_budget_s is None:
                deadline = float("inf")
            else:
                deadline = time.time() + max(0.0, start + time_budget_s - time.time()) / (len(tasks) - i)
            reporter.task_start(task, i, len(tasks), opts.n_trials)
            try:
                warm = warm_starts_for(task, winners, opts.warm_starts)
                r = tune_task(task, opts, worker, storages[task.gpu], deadline, warm, reporter)
            except Exception as e:  # noqa: BLE001 - one task's fault (a RuntimeError, InfraError, a bug) ends it alone
                r = failed_result(task, e)
                reporter.task_end(r)
            results.append(r)
            if r.config is not None:
                winners.setdefault(task.family, {})[task.bucket] = (r.backend, r.config)
                update_artifact(r, opts, env)
    finally:
        worker.close()
    return results
