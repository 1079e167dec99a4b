"""Re-check the entries an artifact holds, on this GPU, against the PyTorch reference.

Dispatch serves one entry to calls it was not tuned on: another mask (targets, context, window), the other
half dtype, the bucket's shortest and longest sequences. A tuning run re-checks its winner on those
(``verify``, level "full") unless it ran with ``--verify quick``, and a config recorded before a template
fix was never checked on the new code. ``autotune verify`` re-runs the winner's check for every entry as
committed: the same cases (``worker.verify_cases``), the same tolerance (``measure.check_outputs``), each entry
in a tuner worker process, so a config that crashes or hangs is reported and the rest go on. With
``--write`` the cases that passed are recorded in each entry's ``verified`` list.
"""

from __future__ import annotations

import argparse
import dataclasses
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from autotune.tuning.tasks import Task


def entry_task(kernel: str, gpu: str, entry: dict[str, Any], seq_cap: int | None = None) -> Task:
    """The task an artifact entry answers (its kernel, GPU, dtype, head dims, heads, bucket, law, mask, and the
    batch it was timed on where it records one). The re-check cases draw their own batches."""
    extra = {"batch": int(entry["batch"])} if "batch" in entry else {}
    return Task(
        kernel,
        gpu,
        entry["dtype"],
        int(entry["dqk"]),
        int(entry["dv"]),
        int(entry["num_heads"]),
        int(entry["bucket"]),
        entry["distribution"],
        entry.get("mask", "causal"),
        seq_cap=seq_cap,
        **extra,
    )


def recheck_cases(kernel: str, gpu: str, entry: dict[str, Any], full: bool = True, on_gpu: bool = True) -> set[str]:
    """Labels of the entry's re-check cases (``worker.verify_cases``) on a GPU, or off one."""
    from autotune.tuning.registry import get_op
    from autotune.tuning.worker import verify_cases

    return {label for label, _, _ in verify_cases(get_op(kernel), entry_task(kernel, gpu, entry), full, on_gpu)}


def missing_cases(kernel: str, gpu: str, entry: dict[str, Any], full: bool = True, on_gpu: bool = True) -> set[str]:
    """The re-check cases that the entry's ``verified`` list does not hold."""
    return recheck_cases(kernel, gpu, entry, full, on_gpu) - _verified(entry)


def recheck_status(kernel: str, gpu: str, entry: dict[str, Any], on_gpu: bool) -> str:
    """ "checked/cases" of the full re-check for ``autotune show`` ("?" for a kernel not registered here)."""
    try:
        wanted = recheck_cases(kernel, gpu, entry, True, on_gpu)
    except (KeyError, ValueError):
        return "?"
    return f"{len(wanted & _verified(entry))}/{len(wanted)}"


def _verified(entry: dict[str, Any]) -> set[str]:
    """The entry's ``verified`` cases (strings only: a hand-edited list may hold anything)."""
    cases = entry.get("verified")
    return {c for c in cases if isinstance(c, str)} if isinstance(cases, list) else set()


@dataclasses.dataclass
class Recheck:
    """One entry's re-check: where it is, what ran, and how it ended."""

    kernel: str
    index: int  # position in the artifact's entries
    entry: dict[str, Any]
    status: str = "pending"
    checked: list[str] = dataclasses.field(default_factory=list)
    skipped: list[str] = dataclasses.field(default_factory=list)
    error: str = ""

    def row(self) -> dict[str, Any]:
        """The entry's key (``ENTRY_KEY_FIELDS``), backend and config, and the verdict."""
        from autotune.runtime.artifacts import ENTRY_KEY_FIELDS

        e = self.entry
        return {
            "kernel": self.kernel,
            **{k: e.get(k, "causal" if k == "mask" else None) for k in ENTRY_KEY_FIELDS},
            "backend": e["backend"],
            "config": e["config"],
            "status": self.status,
            "checked": self.checked,
            "skipped": self.skipped,
            "error": self.error,
        }


def _groups(items: list[Recheck], jobs: int) -> list[list[Recheck]]:
    """Entries sharing a config go to one worker (it compiles each kernel variant once); the groups are
    dealt to ``jobs`` queues, largest first, each to the least loaded queue."""
    by_config: dict[tuple, list[Recheck]] = {}
    for r in items:
        key = (r.kernel, r.entry["backend"], r.entry["dqk"], r.entry["dv"], repr(sorted(r.entry["config"].items())))
        by_config.setdefault(key, []).append(r)
    queues: list[list[Recheck]] = [[] for _ in range(max(1, jobs))]
    for group in sorted(by_config.values(), key=len, reverse=True):
        min(queues, key=len).extend(group)
    return [q for q in queues if q]


START_TIMEOUT_S = 300.0  # a new worker's start-up, apart from each entry's own time limit


def _run_queue(
    queue: list[Recheck], gpu: str, level: str, plugins: list[str], timeout_s: float, seq_cap: int | None, done
) -> None:
    """Re-check ``queue`` in one worker process; after any failure (crash, hang, wrong result, an error that
    may leave the process unusable) the next entry gets a new worker."""
    from autotune.tuning.worker import Worker, WorkerError

    worker = Worker(plugins)
    try:
        for r in queue:
            msg = {
                "cmd": "recheck",
                "task": dataclasses.asdict(entry_task(r.kernel, gpu, r.entry, seq_cap)),
                "backend": r.entry["backend"],
                "config": r.entry["config"],
                "level": level,
            }
            try:
                if not worker.alive():  # start-up (spawn, imports, plugins) is not the entry's time
                    worker.call({"cmd": "ping"}, max(timeout_s, START_TIMEOUT_S))
                reply = worker.call(msg, timeout_s)
            except WorkerError as e:
                reply = {"status": e.kind, "error": str(e)}
            r.status = reply.get("status", "crash")
            if r.status != "ok":
                worker.kill()  # a failure may leave the process broken (a sticky error): the next entry gets a new one
            if r.status == "ok" and not reply.get("checked"):
                r.status = "unchecked"  # the space ruled out every case: nothing vouches for the entry
            r.checked = list(reply.get("checked", []))
            r.skipped = list(reply.get("skipped", []))
            r.error = str(reply.get("error", ""))[-600:]
            if r.status == "unchecked" and not r.error:  # the verdict's reason, printed beside it
                why = "; ".join(r.skipped) if r.skipped else "no case to run"
                r.error = f"the config's search space rules out every case here: {why}"[:600]
            done(r)
    finally:
        worker.close()


def recheck_artifacts(
    root: str | Path,
    gpu: str,
    kernels: list[str] | None = None,
    level: str = "full",
    jobs: int = 1,
    plugins: list[str] | None = None,
    timeout_s: float = 900.0,
    seq_cap: int | None = None,
    on_done: Callable[[Recheck], None] | None = None,
    only_missing: bool = False,
    on_unreadable: Callable[[str, str], None] | None = None,
) -> list[Recheck]:
    """Re-check every entry of ``root/gpu/<kernel>.json`` (all kernels there, or ``kernels``) in ``jobs``
    worker processes; returns one ``Recheck`` per entry, in file order. ``only_missing``: just the entries
    whose ``verified`` list lacks a case of the ``level`` (``missing_cases``). A file that cannot be read
    (corrupt JSON, an invalid entry structure) raises ``ArtifactError``, or with ``on_unreadable`` is passed to
    it as (kernel, reason) and the other files are re-checked: one bad file does not hide the rest."""
    from autotune.runtime import artifacts as art
    from autotune.tuning import measure

    if level not in ("full", "quick"):
        raise ValueError(f"level must be 'full' or 'quick', got {level!r}")
    if seq_cap is not None and (isinstance(seq_cap, bool) or not isinstance(seq_cap, int) or seq_cap < 1):
        raise ValueError(f"seq_cap must be an integer >= 1, got {seq_cap!r}")  # else a traceback in a worker thread
    folder = Path(root) / gpu
    on_gpu = measure.device() == "cuda"
    names = kernels or artifact_files(folder, plugins)[0]
    items: list[Recheck] = []
    for kernel in names:
        path = art.artifact_path(gpu, kernel, root)
        if not path.exists():
            raise FileNotFoundError(f"kernels: no artifact {path}")
        try:
            artifact = art.load_artifact(path, check_stale=False, check_configs=False)
        except art.ArtifactError as e:
            if on_unreadable is None:
                raise
            on_unreadable(kernel, str(e))
            continue
        items += [
            Recheck(kernel, i, dict(e))
            for i, e in enumerate(artifact.entries)
            if not only_missing or missing_cases(kernel, gpu, e, level == "full", on_gpu)
        ]
    lock = threading.Lock()

    def done(r: Recheck) -> None:
        if on_done is not None:
            with lock:
                on_done(r)

    runnable = []
    for r in items:
        if reason := _unavailable(r):
            r.status, r.error = "unavailable", reason  # e.g. a CuTe entry under the interpreter: not a crash
            done(r)
        elif reason := _invalid(r):
            r.status, r.error = "invalid", reason
            done(r)
        else:
            runnable.append(r)
    queues = _groups(runnable, jobs)
    threads = [
        threading.Thread(target=_run_queue, args=(q, gpu, level, list(plugins or []), timeout_s, seq_cap, done))
        for q in queues
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return items


def _invalid(r: Recheck) -> str | None:
    """Why ``autotune.load`` refuses the entry's config (``artifacts.validate_config``), or None. The worker's
    ``space.make`` fills a missing field with its default and takes a bool for an int, so such an entry passed
    as a config the runtime never runs (the file is read without that check, for the entries it holds)."""
    from autotune.runtime import artifacts as art

    try:
        art.validate_config(r.kernel, r.entry["backend"], r.entry["config"], f"entries[{r.index}]")
    except art.ArtifactError as e:
        return str(e)
    return None


def _unavailable(r: Recheck) -> str | None:
    """Why the entry's backend cannot run in this process (package missing, no GPU), or None; an unknown
    backend is left to the worker, which reports it as the entry's error."""
    from autotune.tuning.registry import get_backend

    try:
        backend = get_backend(r.kernel, r.entry["backend"])
    except (KeyError, ValueError):
        return None
    reason = backend.available()
    return f"backend {r.entry['backend']!r} cannot run here: {reason}" if reason else None


def artifact_files(folder: Path, plugins: list[str] | None = None) -> tuple[list[str], list[str]]:
    """(registered kernels with a file in ``folder``, names of its other ``*.json`` files): the files
    ``autotune.load`` reads are the kernels'; a notes.json or a copy beside them aborted the re-check or was
    re-checked under its file name as a kernel."""
    from autotune import spec
    from autotune.tuning.registry import load_plugins

    load_plugins(plugins or [])
    known = set(spec.kernels())
    files = sorted(folder.glob("*.json"))
    return [p.stem for p in files if p.stem in known], [p.name for p in files if p.stem not in known]


def write_verified(root: str | Path, gpu: str, results: list[Recheck]) -> list[Path]:
    """Record each passing entry's checked cases in its ``verified`` list (other fields untouched). Configs are
    not re-validated on the write: an entry the re-check found ``invalid`` stays as it was, and the passing
    entries beside it are still recorded (the file was read the same way). The file is re-read under the
    writers' lock and each result goes to the entry of its key that still holds the config re-checked: a tuning
    run may have added entries (moving the others) or re-tuned one while the re-check ran."""
    from autotune.runtime import artifacts as art
    from autotune.tuning.artifact_io import artifact_lock

    written = []
    for kernel in sorted({r.kernel for r in results}):
        path = art.artifact_path(gpu, kernel, root)
        with artifact_lock(path):
            artifact = art.load_artifact(path, check_stale=False, check_configs=False)
            by_key = {art.entry_key(e): e for e in artifact.entries}
            changed = False
            for r in results:
                if r.kernel == kernel and r.status == "ok" and r.checked:
                    entry = by_key.get(art.entry_key(r.entry))
                    if entry is None or (entry["backend"], entry["config"]) != (r.entry["backend"], r.entry["config"]):
                        continue  # removed or re-tuned since: the cases were passed by a config it no longer holds
                    entry["verified"] = sorted(_verified(entry) | {c for c in r.checked if isinstance(c, str)})
                    changed = True
            if changed:
                written.append(art.save_artifact(artifact, path, check_configs=False))
    return written


def add_parser(sub: Any) -> None:
    """``autotune verify``: re-check committed entries (registered by ``autotune.tuning.cli``)."""
    p = sub.add_parser("verify", help="re-check every artifact entry of this GPU against the reference")
    p.add_argument(
        "--gpu",
        default="auto",
        help="GPU whose artifacts to re-check (default: the one present; h100 under --interpret without one)",
    )
    p.add_argument("--kernel", default=None, help="kernels, e.g. fwd,bwd (default: every artifact of the GPU)")
    p.add_argument("--artifacts", default=None, help="artifacts root (default: the package's artifacts/)")
    p.add_argument(
        "--level",
        default="full",
        choices=("full", "quick"),
        help="full = every mask x bf16/fp16 x short/long shapes (default); quick = each entry's own mask and dtype",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes (entries sharing a config share one)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per entry before its worker is killed")
    p.add_argument("--missing", action="store_true", help="only entries whose 'verified' list lacks a case of --level")
    p.add_argument("--write", action="store_true", help="record the passing cases in each entry's 'verified' list")
    p.add_argument("--json", default=None, help="write one row per entry to this JSON file")
    p.add_argument("--plugin", action="append", default=[], help="module that registers more kernels/backends")
    p.add_argument("--interpret", action="store_true", help="run under the Triton interpreter (CPU)")
    p.add_argument("--seq-cap", type=int, default=None, help=argparse.SUPPRESS)  # tests/CI: cap the lengths


def _refuse_interpreter_write(root: Path, gpu: str, kernels: list[str] | None, plugins: list[str]) -> None:
    """A usage error when ``--write`` under ``--interpret`` would record CPU-interpreter cases in an artifact made on
    a GPU: dispatch reads ``verified`` there to serve the other half dtype from an entry (as ``merge`` and
    ``export`` keep interpreter evidence out of GPU folders). Unreadable files are left to the re-check's report."""
    from autotune.runtime import artifacts as art
    from autotune.tuning.cli import CLIError

    for kernel in kernels or artifact_files(root / gpu, plugins)[0]:
        path = art.artifact_path(gpu, kernel, root)
        try:
            env = art.load_artifact(path, check_stale=False, check_configs=False).environment
        except (art.ArtifactError, OSError):
            continue
        if not art.interpreter_made(env):
            raise CLIError(
                f"--write: {path} was tuned on a GPU ({env.get('gpu_name')}); cases passed under --interpret do not "
                "vouch for its entries there (re-check on the GPU, or leave --write out)"
            )


def cmd_verify(args: Any) -> int:
    """Re-check, print one line per entry as it ends and one per failure at the end; exit 1 on any failure."""
    import json

    from autotune.runtime import artifacts as art
    from autotune.tuning.cli import CLIError, _console, kernel_names, load_plugin_modules, resolve_gpu
    from autotune.tuning.cli_checks import int_in, positive_seconds, writable_file, writable_folder
    from autotune.tuning.registry import plugin_modules

    if args.jobs < 1:
        raise CLIError("--jobs must be >= 1")
    positive_seconds("--timeout", args.timeout)  # 0 or nan would fail every entry as a "hang"
    if args.seq_cap is not None:
        int_in("--seq-cap", args.seq_cap, 1)
    if args.json:  # checked now, not after the whole re-check
        writable_file("--json", args.json)
    load_plugin_modules(args.plugin)
    kernels = kernel_names(args.kernel) if args.kernel is not None else None  # ',' re-checked every kernel
    gpu = resolve_gpu(args.gpu, args.interpret, False, "verify re-checks on the GPU (use --interpret without one)")
    root = Path(args.artifacts) if args.artifacts else art.DEFAULT_ROOT
    if not (root / gpu).is_dir():
        raise CLIError(f"--artifacts: no folder {root / gpu}")
    # The rows went over an artifact the re-check had just read (exit 0): its tuned entries were lost, and a kernel's
    # file name in the folder is one autotune.load reads (and rejects as no artifact).
    if args.json and Path(args.json).resolve() in art.artifact_files([gpu], root):
        raise CLIError(f"--json {args.json}: an artifact file of {root / gpu} (the rows would replace it); name "
                       "another file")  # fmt: skip
    if args.write:
        writable_folder("--artifacts", root / gpu)
        if args.interpret:
            _refuse_interpreter_write(root, gpu, kernels, plugin_modules(args.plugin))
    console = _console()
    if not args.kernel and (others := artifact_files(root / gpu, plugin_modules(args.plugin))[1]):
        console.print(f"note: not re-checked, no registered kernel's artifact: {', '.join(others)}")

    def line(r: Recheck) -> None:
        e = r.entry
        what = f"{r.kernel} {e['dtype']} d{e['dqk']}/{e['dv']} h{e['num_heads']} {e['bucket']} {e['distribution']}"
        detail = f"{len(r.checked)} cases" + (f", {len(r.skipped)} skipped" if r.skipped else "")
        console.print(f"{r.status:9s} {what} {e['backend']}: {detail if r.status == 'ok' else r.error[:300]}")

    unreadable: list[Recheck] = []  # one per file not read: no entry of it was re-checked

    def skip_file(kernel: str, reason: str) -> None:
        console.print(f"{'unreadable':9s} {kernel}: {reason[:300]}")
        unreadable.append(
            Recheck(kernel, -1, {"mask": None, "backend": None, "config": None}, "unreadable", error=reason)
        )

    try:
        results = recheck_artifacts(
            root,
            gpu,
            kernels,
            args.level,
            args.jobs,
            plugin_modules(args.plugin),
            args.timeout,
            args.seq_cap,
            on_done=line,
            only_missing=args.missing,
            on_unreadable=skip_file,
        )
    except (FileNotFoundError, art.ArtifactError) as e:
        raise CLIError(str(e)) from None
    # Under --interpret an entry whose backend needs a GPU is reported as not run; on a GPU host an
    # unavailable backend (say the CuTe DSL not installed) fails, so exit 0 still means every entry passed.
    skipped = "unavailable" if args.interpret else None
    not_run = [r for r in results if r.status == skipped]
    bad = [r for r in results if r.status not in ("ok", skipped)]
    ran = len(results) - len(not_run)
    console.print(f"{ran - len(bad)} of {ran} entries passed ({args.level}) on {gpu}")
    if not_run:
        console.print(f"not run under the interpreter: {len(not_run)} entries ({not_run[0].error})")
    for r in bad:
        console.print(f"FAILED {r.kernel} entry {r.index}: {r.status}: {r.error}")
    for r in unreadable:
        console.print(f"FAILED {r.kernel}: file not re-checked: {r.error}")
    if args.write:  # first: the verdicts reach the artifacts even if the --json file fails
        for path in write_verified(root, gpu, results):
            console.print(f"recorded the passing cases in {path}")
    if args.json:
        try:
            Path(args.json).write_text(json.dumps([r.row() for r in results + unreadable], indent=1) + "\n")
        except OSError as e:
            raise CLIError(f"--json {args.json}: cannot write it ({e.strerror or e})") from None
    return 1 if bad or unreadable or (not_run and not ran) else 0  # nothing re-checked vouches for nothing
