"""Up-front checks of ``autotune`` option values that the commands would otherwise trip over late.

A folder the run cannot write, a journal path that is a folder, a timeout of 0 or a watch interval of
-1 are the user's mistakes: each is a one-line ``CLIError`` naming the option, raised before any
tuning or re-checking starts, not a traceback after the first task (or the whole re-check) has run.
"""

from __future__ import annotations

import argparse
import math
import re
import tempfile
from pathlib import Path

from autotune.tuning.artifact_io import WARM_START_SCOPES
from autotune.tuning.cli import CLIError


def _folder_problem(folder: Path) -> str | None:
    """Why no file can be made in ``folder`` (created if missing), or None when one can."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} exists and is not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".autotune-probe."):
            pass
    except OSError as e:
        return f"cannot write in {folder} ({e.strerror or e})"
    return None


def writable_folder(option: str, folder: str | Path) -> Path:
    """``folder``, created if missing, once a file could be made in it: the artifacts are written at the
    end of each task, so an unwritable root would otherwise fail only after the first task was tuned."""
    folder = Path(folder)
    problem = _folder_problem(folder)
    if problem:
        raise CLIError(f"{option}: {problem}")
    return folder


def writable_file(option: str, path: str | Path) -> Path:
    """``path`` as a file this process can create or replace (its folder is created if missing)."""
    path = Path(path)
    problem = f"{path} is a folder; name a file" if path.is_dir() else _folder_problem(path.parent)
    if problem:
        raise CLIError(f"{option} {path}: {problem}")
    return path


def positive_seconds(option: str, value: float | None) -> None:
    """A usage error unless ``value`` (when given) is a positive, finite number of seconds."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise CLIError(f"{option} must be a positive number of seconds, got {value}")


def int_in(option: str, value: int, low: int, high: int | None = None) -> None:
    """A usage error naming ``option`` unless ``low <= value`` (and ``value <= high`` when given)."""
    if value < low or (high is not None and value > high):
        span = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise CLIError(f"{option} must be an integer {span}, got {value}")


def check_task_numbers(args: argparse.Namespace) -> None:
    """The task-shaping numbers of ``run`` and ``bench``: a batch past ``MAX_BATCH`` drew its lengths for
    minutes, then could not launch; a negative ``--seq-cap`` was a traceback and 0 meant no cap."""
    from autotune.tuning.tasks import MAX_BATCH, MAX_HEADS

    int_in("--batch", args.batch, 1, MAX_BATCH)
    int_in("--heads", args.heads, 1, MAX_HEADS)
    if args.seq_cap is not None:
        int_in("--seq-cap", args.seq_cap, 1)


def check_run_numbers(args: argparse.Namespace) -> None:
    """Usage errors for numbers ``autotune run`` cannot work with."""
    check_task_numbers(args)
    int_in("--trials", args.trials, 1)
    if args.workers is not None:
        from autotune.tuning.farm_storage import MAX_WORKERS

        int_in("--workers", args.workers, 1)
        if args.workers > MAX_WORKERS:  # each is a process with its own storage connections: 1000 was a fork storm
            raise CLIError(
                f"--workers must be at most {MAX_WORKERS} (worker processes on this host), got {args.workers}"
            )
    if args.storage is not None and not args.storage.strip():  # `--storage "$URL"` with URL unset ran without the farm
        raise CLIError(
            "--storage names nothing; give a postgresql:// or sqlite:/// URL or a journal file, or leave it out"
        )
    if args.backends is not None and not args.backends:
        raise CLIError("--backends names nothing; give at least one backend (e.g. triton)")
    if not math.isfinite(args.eval_timeout) or args.eval_timeout <= 0:
        raise CLIError(f"--eval-timeout must be a positive number of seconds, got {args.eval_timeout}")
    if args.compare_rounds < 1:
        raise CLIError(f"--compare-rounds must be >= 1, got {args.compare_rounds}")
    if args.compare_max_rounds < args.compare_rounds:
        raise CLIError(
            f"--compare-max-rounds ({args.compare_max_rounds}) must be >= --compare-rounds ({args.compare_rounds})"
        )
    if not 0 <= args.seed < 2**32:  # Optuna's samplers seed NumPy's RandomState: it raised inside the first task
        raise CLIError(f"--seed must be an integer in [0, 2**32 - 1], got {args.seed}")
    if args.cuda_graph and args.interpret:  # the interpreter times plain calls: the entries said cuda_graph timing
        raise CLIError("--cuda-graph times CUDA-graph replays on a GPU; under --interpret nothing is replayed")
    if args.warm_starts not in WARM_START_SCOPES:
        raise CLIError(f"--warm-starts must be one of {', '.join(WARM_START_SCOPES)}, got {args.warm_starts!r}")


def check_run_outputs(args: argparse.Namespace, gpu: str, kernels: list[str] = ()) -> None:
    """The folders ``autotune run`` writes (artifacts, and a journal storage given as a path) are usable, and a run
    under ``--interpret`` writes over no GPU-made artifact of ``kernels``."""
    writable_folder("--artifacts", Path(args.artifacts) / gpu)
    if args.interpret:
        _refuse_gpu_artifacts(Path(args.artifacts), gpu, kernels)
    if not args.storage:  # the default journal under --artifacts: a damaged one was Optuna's traceback
        from autotune.tuning.study_storage import journal_problem

        journal = Path(args.artifacts) / gpu / "studies" / "tuning.journal"
        problem = journal_problem(journal)
        if problem:
            raise CLIError(f"--artifacts {args.artifacts}: the studies journal {journal}: {problem}")
    if args.storage and "://" not in args.storage:  # a journal file path
        if _URL_SCHEME.match(args.storage):  # 'postgres:/host/db' made a folder 'postgres:' and ran without the farm
            raise CLIError(f"--storage {args.storage}: a URL needs 'scheme://' (for a journal file named so, "
                           f"write ./{args.storage})")  # fmt: skip
        writable_file("--storage", args.storage)
        from autotune.tuning.study_storage import journal_problem

        problem = journal_problem(Path(args.storage))
        if problem:  # Optuna would append its log to the file before failing on it
            raise CLIError(f"--storage {args.storage}: {problem}")


def _refuse_gpu_artifacts(root: Path, gpu: str, kernels: list[str]) -> None:
    """A usage error naming the first of ``kernels``' artifacts under ``root`` made on a GPU: an interpreter run's
    entries, of another timing environment, would drop its entries (``merge_entries``), and a GPU host rejects the
    file it leaves (``autotune merge`` refuses to put interpreter results in a GPU folder likewise)."""
    from autotune.runtime import artifacts as art

    for kernel in kernels:
        path = art.artifact_path(gpu, kernel, root)
        try:
            env = art.load_artifact(path, check_stale=False, check_configs=False).environment
        except (art.ArtifactError, OSError):
            continue  # missing or unusable: the run's write replaces it (set aside when unusable)
        if not art.interpreter_made(env):
            raise CLIError(
                f"--artifacts {root}: {path} holds entries tuned on a GPU ({env.get('gpu_name')}), which a run under "
                "--interpret would drop; pass another --artifacts (its default is runs/interpret/artifacts)"
            )


# A URL scheme and its colon (RFC 3986), two letters or more: 'C:' of a Windows path is no scheme.
_URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]+:")
