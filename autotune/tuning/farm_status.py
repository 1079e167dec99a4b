"""``autotune status --storage URL [--farm NAME] [--watch [S]]``: a farm's progress from its storage.

Tasks done / running / left, trials per worker and the best time so far, read from the farm study's
trials (``autotune.tuning.farm``); ``--watch`` redraws every S seconds until the farm drains. The same storage
opens in optuna-dashboard for per-trial detail (README, "Tuning farm").
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.tuning.farm import FARM_PREFIX
from autotune.tuning.farm_results import failure_reason, result_trial, task_runs
from autotune.tuning.farm_storage import FarmError, NoOptunaTables, _safe, is_farm_url, plain_storage

STATE_STYLE = {"done": "green", "cut": "yellow", "failed": "red", "lost": "red", "running": "yellow", "waiting": "dim"}


def farm_names(storage: Any) -> list[str]:
    return sorted(n for n in optuna.get_all_study_names(storage) if n.startswith(FARM_PREFIX))


def _task_state(trials: list[FrozenTrial]) -> tuple[str, FrozenTrial]:
    """A task's state over all its farm trials (claims, retries, re-runs) and the trial that shows it:
    a held or queued run, else the one whose result speaks for the task (``farm.result_trial``). A result cut
    by a time budget is "cut", not "done", and not "failed" when it also ended with an error (shown with it): the
    budget stopped its run, and the farm's next join queues the task again."""
    for state, name in ((TrialState.RUNNING, "running"), (TrialState.WAITING, "waiting")):
        held = [t for t in trials if t.state == state]
        if held:
            return name, held[-1]
    t = result_trial(trials)
    if t.state != TrialState.COMPLETE:
        return "lost", t
    result = t.user_attrs.get("result") or {}
    return ("cut" if result.get("cut") else "failed" if result.get("error") else "done"), t


def snapshot(storage: Any, name: str) -> dict[str, Any]:
    """Plain data of one farm: counts, one row per task, one row per worker."""
    farm = optuna.load_study(study_name=name, storage=storage)
    trials = [t for t in farm.get_trials(deepcopy=False) if "task_key" in t.user_attrs]
    tasks, counts = [], {k: 0 for k in ("done", "cut", "failed", "running", "waiting", "lost")}
    for runs in task_runs(trials).values():
        state, t = _task_state(runs)
        counts[state] += 1
        entry = (t.user_attrs.get("result") or {}).get("entry") or {}
        progress = t.user_attrs.get("progress") or {}
        best = entry.get("median_ms") if state in ("done", "cut", "failed") else progress.get("best_ms")
        tasks.append(
            {
                "task": t.user_attrs.get("label", t.user_attrs["task_key"]),
                "state": state,
                "worker": t.user_attrs.get("worker") if state != "waiting" else None,
                "claims": sum(1 for r in runs if r.state != TrialState.WAITING),
                "trials": entry.get("trials", progress.get("measured")),
                "best_ms": best,
                "speedup": entry.get("speedup"),
                "error": failure_reason(t) if state == "lost" else (t.user_attrs.get("result") or {}).get("error"),
            }
        )
    workers: dict[str, dict[str, Any]] = {}
    for t in trials:
        wid = t.user_attrs.get("worker")
        if wid is None or t.state == TrialState.WAITING:
            continue
        w = workers.setdefault(wid, {"worker": wid, "done": 0, "lost": 0, "trials": 0, "running": None})
        w["trials"] += (t.user_attrs.get("progress") or {}).get("measured") or 0
        if t.state == TrialState.COMPLETE:
            w["done"] += 1
        elif t.state == TrialState.RUNNING:
            w["running"] = t.user_attrs.get("label")
        elif t.state == TrialState.FAIL:
            w["lost"] += 1
    key = farm.user_attrs.get("timing_key", {})
    return {"farm": name, "counts": counts, "tasks": tasks, "workers": sorted(workers.values(), key=str), "key": key}


def audit(storage: Any, name: str, root: str | Path) -> dict[str, Any]:
    """The farm's evidence: tasks finished, configs measured twice in one task study (must be 0) and
    finished tasks whose entry is missing from or differs in the artifacts under ``root`` (must be 0), re-check
    cases recorded since (``verify --write``) aside."""
    from autotune.runtime import artifacts as art
    from autotune.tuning.decide import RETRY_STATUSES
    from autotune.tuning.farm_results import latest_per_task

    farm = optuna.load_study(study_name=name, storage=storage)
    latest = latest_per_task(farm.get_trials(deepcopy=False))
    done = [t for t in latest.values() if t.state == TrialState.COMPLETE and (t.user_attrs.get("result") or {})]
    # This farm's task studies only (their names end with it): another farm naming a task has its own study.
    # A trial its holder was killed in (failed as interrupted, its config queued again) was never measured, even
    # when the kill came after the trial's "measured" mark and before its tell.
    prefixes = tuple(k + "|src" for k in latest)
    measured = duplicates = 0
    for study in optuna.get_all_study_names(storage):
        if study.startswith(prefixes) and study.endswith("|" + name):
            trials = optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
            keys = [
                t.user_attrs["config_key"]
                for t in trials
                if t.user_attrs.get("measured") and t.user_attrs.get("status") not in RETRY_STATUSES
            ]
            measured, duplicates = measured + len(keys), duplicates + len(keys) - len(set(keys))
    lost, artifacts = 0, {}
    for t in done:
        entry, task = t.user_attrs["result"].get("entry") or {}, t.user_attrs["task"]
        if entry.get("config") is None:
            continue
        key = (task["gpu"], task["kernel"])
        if key not in artifacts:
            artifacts[key] = art.load_artifact_or_none(art.artifact_path(*key, root), check_stale=False)
        a = artifacts[key]
        hit = (
            a.lookup(
                task["dtype"],
                task["dqk"],
                task["dv"],
                task["bucket"],
                task["distribution"],
                task["num_heads"],
                task["mask"],
            )
            if a
            else None
        )
        lost += hit is None or _unverified(hit) != _unverified(entry)
    finished = sum(1 for t in done if not t.user_attrs["result"].get("error"))
    return {
        "tasks": len(latest),
        "finished": finished,
        "measured": measured,
        "duplicates": duplicates,
        "entries_lost": lost,
    }


def _unverified(entry: dict[str, Any]) -> dict[str, Any]:
    """An entry without its ``verified`` cases, which ``autotune verify --write`` adds to after the farm wrote it."""
    return {k: v for k, v in entry.items() if k != "verified"}


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render(snap: dict[str, Any], url: str) -> Any:
    """Rich renderable: a title line, the tasks table and the workers table."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    c, key = snap["counts"], snap["key"]
    title = Text.from_markup(
        f"[bold]{escape(snap['farm'])}[/] on {escape(_safe(url))}: [green]{c['done']} done[/], "
        f"[yellow]{c['running']} running[/], {c['waiting']} left"
        + (f", [yellow]{c['cut']} cut[/] (queued again at the next join)" if c["cut"] else "")
        + (f", [red]{c['failed']} failed[/]" if c["failed"] else "")
        + (f", [red]{c['lost']} lost[/]" if c["lost"] else "")
        + f"\n{escape(str(key.get('gpu_name')))} ({key.get('sm_count')} SMs), driver {key.get('driver')}, "
        f"torch {key.get('torch')}, triton {key.get('triton')}, cute-dsl {key.get('cutlass_dsl')}"
    )
    tasks = Table(title="tasks")
    for col in ("task", "state", "worker", "claims", "trials", "best ms", "speedup"):
        tasks.add_column(col, justify="right" if col in ("claims", "trials", "best ms", "speedup") else "left")
    for r in snap["tasks"]:
        style = STATE_STYLE.get(r["state"], "")
        state = r["state"] + (f": {r['error'][:40]}" if r["error"] else "")
        tasks.add_row(
            escape(r["task"]),
            f"[{style}]{escape(state)}[/]" if style else escape(state),
            escape(r["worker"] or "-"),
            str(r["claims"]),
            _fmt(r["trials"], "d"),
            _fmt(r["best_ms"], ".4f"),
            _fmt(r["speedup"], ".2f") + ("x" if r["speedup"] else ""),
        )
    workers = Table(title="workers")
    for col in ("worker", "tasks done", "trials", "lost claims", "running"):
        workers.add_column(col)
    for w in snap["workers"]:
        workers.add_row(
            escape(w["worker"]), str(w["done"]), str(w["trials"]), str(w["lost"]), escape(w["running"] or "-")
        )
    return Group(title, tasks, workers)


def cmd_status(args: Any) -> int:
    """Print (or with ``--watch`` keep redrawing) the farms of a storage; 1 when it holds none."""
    from rich.console import Group
    from rich.live import Live
    from rich.markup import escape

    from autotune.tuning.cli import CLIError, _console
    from autotune.tuning.cli_checks import positive_seconds

    positive_seconds("--watch", args.watch)  # 0 would silently not watch, -1 or nan crash time.sleep
    if args.watch is not None and getattr(args, "audit", None) is not None:  # the audit prints once: watch was ignored
        raise CLIError("--audit prints the farm's evidence once; it cannot be combined with --watch")
    if getattr(args, "audit", None) is not None and not Path(args.audit).is_dir():  # a typo read as entries lost
        raise CLIError(f"--audit {args.audit}: no such artifacts folder")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    console = _console()
    if "://" not in args.storage:  # a journal file: what SQLAlchemy then said ("Could not parse") named no fix
        raise CLIError(
            f"--storage {args.storage}: not a database URL; a tuning farm needs a postgresql:// URL "
            "(postgresql://USER@HOST:PORT/DB; a journal file holds the studies of a single-process run, never a farm)"
        )
    if args.storage.startswith("sqlite:///"):
        path = Path(args.storage[len("sqlite:///") :])
        if str(path) != ":memory:" and not path.is_file():  # opening it would create an empty database there
            raise CLIError(f"--storage {args.storage}: no such database file ({path})")
    try:
        storage = plain_storage(args.storage, create=False)  # a read: no Optuna tables made in a database
    except NoOptunaTables:
        storage = None
    except FarmError as e:
        raise CLIError(str(e)) from None
    farms = farm_names(storage) if storage is not None else []
    if args.farm and args.farm not in farms:
        known = ", ".join(repr(n) for n in farms) or "none"
        raise CLIError(f"--farm {args.farm!r}: no such farm in {_safe(args.storage)} (farms there: {known})")
    names = [args.farm] if args.farm else farms
    if not names:
        hint = "start one: autotune run --storage URL"
        if not is_farm_url(args.storage):
            hint = "farms live in PostgreSQL storage; a sqlite storage holds the studies of single-process runs"
        console.print(f"no farm in {_safe(args.storage)} ({hint})")
        return 1

    def view() -> tuple[Any, bool]:
        snaps = [snapshot(storage, n) for n in names]
        busy = any(s["counts"]["running"] or s["counts"]["waiting"] for s in snaps)
        return Group(*(render(s, args.storage) for s in snaps)), busy

    if getattr(args, "audit", None):
        for n in names:
            console.print(f"{n}: " + ", ".join(f"{k} {v}" for k, v in audit(storage, n, args.audit).items()))
        return 0
    renderable, busy = view()
    if not args.watch:
        console.print(renderable)
        return 0
    with Live(renderable, console=console, auto_refresh=False) as live:
        try:
            while busy:
                time.sleep(args.watch)
                try:
                    renderable, busy = view()
                    live.update(renderable, refresh=True)
                except Exception as e:  # noqa: BLE001 - a storage restart or network blip: say so, keep watching
                    why = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                    note = f"[yellow]storage unreachable ({escape(why[:200])}); retrying every {args.watch:g} s[/]"
                    live.update(Group(renderable, note), refresh=True)
        except KeyboardInterrupt:
            pass
    return 0
