"""``autotune show`` and ``autotune merge``: the commands that read and fold artifact files.

Apart from ``cli.py`` (the parser and the tuning/bench commands) to keep each module one job.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import format_bucket
from autotune.runtime.gpus import GPUS
from autotune.tuning.cli import CLIError, _console, _fmt, config_str, kernel_names, load_plugin_modules


def cmd_merge(args: argparse.Namespace) -> int:
    """Fold artifacts written by other runs (another device call, host or checkout) into
    ``<artifacts>/<gpu>/<kernel>.json``, entry by entry, as a tuning run would have written them: each
    file must be valid and current (its templates unchanged) and, for a GPU folder, made on a GPU (not
    the Triton interpreter). A target tuned in another timing environment would lose its entries
    (``artifact_io.merge_entries``): refused unless ``--replace``."""
    from autotune import spec
    from autotune.runtime import artifacts as art
    from autotune.tuning.artifact_io import EnvironmentMismatch, environment_differences, merge_entries

    root = Path(args.artifacts) if args.artifacts else art.DEFAULT_ROOT
    load_plugin_modules([])  # AUTOTUNE_PLUGINS: their kernels' artifacts merge too
    loaded = []
    for f in args.files:  # every file is checked before any target is touched
        try:
            a = art.load_artifact(f)
        except art.ArtifactError as e:
            raise CLIError(f"cannot merge {f}: {e}") from None
        if a.kernel not in spec.kernels():  # it names the target file: '../x' would leave the root
            raise CLIError(
                f"cannot merge {f}: kernel {a.kernel!r:.60} is no registered kernel (known: "
                f"{', '.join(spec.kernels())}; a plugin's kernel needs AUTOTUNE_PLUGINS=module)"
            )
        contradiction = art.check_origin(a, None, a.gpu, None)[0]
        if contradiction:  # dispatch would reject the merged file, and every entry already in it
            raise CLIError(f"cannot merge {f}: {contradiction}")
        if a.gpu.lower() in GPUS and art.interpreter_made(a.environment):
            raise CLIError(
                f"cannot merge {f} into {root / a.gpu}: it was made under the Triton interpreter / on a CPU "
                f"(environment.gpu_name {a.environment.get('gpu_name')!r}); its timings say nothing about {a.gpu}"
            )
        loaded.append((f, a))
    # Entries a merge would drop: a target (or an earlier file of this merge) of another timing environment.
    targets: dict[Path, tuple[dict, int, str]] = {}
    bases: dict[Path, Any] = {}  # each target as it was before this merge (None: none, or one set aside)
    losses = []
    plans = []  # (file, artifact, its entries that are news to the target)
    for f, a in loaded:
        path = art.artifact_path(a.gpu, a.kernel, root)
        if path not in targets:
            old, unusable = _merge_target(path, a.kernel, a.gpu)
            if unusable:
                losses.append(f"{f} would replace {path}, which {unusable} (its entries would be set aside)")
            targets[path] = (old.environment, len(old.entries), str(path)) if old else ({}, 0, str(path))
            bases[path] = old
        env, count, owner = targets[path]
        plans.append((f, a, _changed_entries(a, bases[path], env)))
        differ = environment_differences(env, a.environment)
        if count and differ:
            losses.append(f"{f} would drop {count} entries of {owner} ({', '.join(differ)})")
            count = 0
        targets[path] = (a.environment, count + len(a.entries), f)
    if losses and not args.replace:
        raise CLIError(
            "refusing to drop entries of a target (another timing environment, or a file dispatch rejects): "
            + "; ".join(losses)
            + " (pass --replace to drop them)"
        )
    from autotune.tuning.cli_checks import writable_folder

    for path in targets:  # before any file is merged: all targets or none
        writable_folder("--artifacts", path.parent)
    for f, a, news in plans:
        try:
            path = merge_entries(a.kernel, a.gpu, news, root, a.environment, replace=args.replace)
        except EnvironmentMismatch as e:
            raise CLIError(f"cannot merge {f}: {e} (pass --replace to drop them)") from None
        same = len(a.entries) - len(news)
        print(f"merged {len(news)} entries of {f} into {path}" + (f" ({same} as the target had them)" if same else ""))
    return 0


def _changed_entries(a: Any, base: Any, env: dict[str, Any]) -> list[dict[str, Any]]:
    """The entries of ``a`` that are news to the merge target as it was before the merge (``base``; ``env``: the
    target's timing environment when ``a`` is merged): a shard's copy of the committed artifacts still holds every
    entry another shard re-tuned, as committed, and merged last it put those old entries back over the re-tuned
    ones. An entry equal to the target's own is skipped, unless an environment differs (the write then drops the
    target's entries, and the file's are all it keeps)."""
    from autotune.runtime import artifacts as art
    from autotune.tuning.artifact_io import environment_differences

    if base is None or environment_differences(base.environment, env) or environment_differences(env, a.environment):
        return list(a.entries)
    had = {art.entry_key(e): e for e in base.entries}
    return [e for e in a.entries if had.get(art.entry_key(e)) != e]


def _merge_target(path: Path, kernel: str, gpu: str) -> tuple[Any, str | None]:
    """(the merge target's artifact or None, why its entries would be lost or None). A stale target is replaced
    as a re-tune replaces it (its entries are of old templates); an invalid one (a hand-edit typo in one entry)
    or another kernel's file under this name is not: without ``--replace`` its good entries were dropped."""
    from autotune.runtime import artifacts as art

    if not os.path.lexists(path):
        return None, None
    try:
        old = art.load_artifact(path, check_stale=False)
    except art.ArtifactError as e:
        return None, f"is unusable ({e})"
    if art.stale_reason(old):
        return None, None
    if (old.kernel, old.gpu) != (kernel, gpu):
        return None, f"holds kernel {old.kernel!r} of gpu {old.gpu!r}"
    return old, None


def cmd_show(args: argparse.Namespace) -> int:
    """Print each artifact with the verdict ``autotune.load(root, gpu=<its folder>)`` would act on in this
    process (one function decides both: ``autotune.runtime.artifacts.assess_artifact``). Exit 1 if a file is
    unreadable or invalid; stale or foreign files are shown with the reason they are not used."""
    from rich.markup import escape
    from rich.table import Table

    from autotune.runtime.artifacts import DEFAULT_ROOT, assess_artifact
    from autotune.runtime.gpus import running_environment
    from autotune.tuning.recheck import recheck_status

    console = _console()
    load_plugin_modules([])  # AUTOTUNE_PLUGINS: their kernels' specs hash and check their artifacts
    root = Path(args.artifacts) if args.artifacts else DEFAULT_ROOT
    gpus = sorted(GPUS) if args.gpu in (None, "all") else [args.gpu.lower()]
    if args.gpu not in (None, "all") and args.gpu.lower() not in GPUS:
        raise CLIError(f"unknown GPU {args.gpu!r}; known: {', '.join(sorted(GPUS))}")
    if root.exists() and not root.is_dir():  # a file root read as "no artifacts", exit 1
        raise CLIError(f"--artifacts {root}: not a folder")
    paths = [p for g in gpus for p in sorted((root / g).glob("*.json"))]
    asked = ""
    if args.kernel is not None:  # ',' showed every kernel, 'fwd,nope' ignored nope; a file's kernel is shown
        kernels = set(kernel_names(args.kernel, {p.stem for p in paths}))
        paths = [p for p in paths if p.stem in kernels]
        asked = f" of {', '.join(sorted(kernels))}"
    if not paths:
        console.print(f"no artifacts under {root} for {', '.join(gpus)}{asked}")
        return 1
    running = running_environment()
    bad = 0
    for path in paths:
        v = assess_artifact(path, path.parent.name, running)
        a = v.artifact
        if a is None:
            console.print(f"[red]UNUSABLE: {escape(v.reason)}[/]")
            bad += 1
            continue
        env = a.environment
        if v.usable:
            verdict = "[green]usable[/]"
        else:
            hint = " (usable with allow_same_arch=True)" if v.same_arch else ""
            verdict = f"[red]NOT USED{hint}[/]"
        title = escape(f"{a.kernel} on {a.gpu} ({env.get('gpu_name')}), created {a.created}")
        table = Table(title=f"{title}: {verdict}")
        for col in ("dtype", "dims", "heads", "bucket", "dist", "mask", "backend", "config", "ms", "TFLOP/s"):
            table.add_column(col)
        for col in ("default TFLOP/s", "speedup", "trials", "tuning s", "re-checked"):
            table.add_column(col)
        on_gpu = env.get("cuda") is not None  # tuned on a GPU: the full re-check covers bf16 and fp16
        for e in a.entries:
            table.add_row(
                e["dtype"],
                f"{e['dqk']}/{e['dv']}",
                str(e["num_heads"]),
                format_bucket(e["bucket"]),
                e["distribution"],
                e["mask"],
                escape(e["backend"]),
                escape(config_str(e["config"])),
                f"{e['median_ms']:.3f}",
                f"{e['tflops']:.1f}",
                _fmt(e["default_tflops"]),
                _fmt(e["speedup"], ".2f"),
                str(e["trials"]),
                f"{e['tuning_s']:.0f}",
                recheck_status(a.kernel, a.gpu, e, on_gpu),
            )
        console.print(table)
        versions = (
            f"  torch {env.get('torch')}, triton {env.get('triton')}, cuda {env.get('cuda')}, "
            f"driver {env.get('driver')}; search space {a.search_space_hash[:12]}"
        )
        console.print(escape(versions))
        lines = [f"[red]not used: {escape(v.reason)}[/]"] if v.reason else []
        lines += [f"[yellow]note: {escape(n)}[/]" for n in v.notes] + [f"info: {escape(i)}" for i in v.info]
        for line in lines:
            console.print(f"  {line}")
    return 1 if bad else 0
