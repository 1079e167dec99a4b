"""``autotune tasks`` / ``autotune export`` and the ``--from-model`` / ``--from-onnx`` tasks of ``autotune run``.

autotune tasks --from-model seed                  # templated ops of the seed model, merged, with counts
autotune tasks --from-onnx model.onnx --json t.json
autotune run --gpu h100 --from-model seed         # tune exactly the tasks the model runs
autotune export --gpu h100 --out bundle/          # artifact JSONs + manifest, for autotune.load("bundle")

``autotune.tuning.cli`` registers these (``add_parsers``, ``add_run_args``) and hands the commands to
``COMMANDS``; the graph reading is ``autotune.tuning.graph_tasks``, the bundle ``autotune.runtime.bundle``.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import format_bucket
from autotune.runtime.gpus import GPUS
from autotune.tuning.cli import GPU_DEFAULTS, CLIError, _console, _kernels, _nonempty, _split, kernel_names

# Grid options of ``autotune run`` that a graph's task list replaces (refused when changed).
GRID_OPTIONS = ("kernel", "buckets", "dims", "heads", "distributions", "masks")


def add_run_args(run: argparse.ArgumentParser) -> None:
    """``autotune run`` options that take the tasks from a model graph instead of the grid."""
    src = run.add_mutually_exclusive_group()
    src.add_argument(
        "--from-model",
        metavar="PRESET_OR_MODULE",
        help="tune the ops of torch.export of a model preset or module:factory (see `autotune tasks`)",
    )
    src.add_argument(
        "--from-onnx",
        metavar="FILE",
        help="tune the ops of an ONNX file written by models.export, in the file's dtype (under --interpret in "
        "--dtype, float32 unless given, as --from-model)",
    )
    src.add_argument(
        "--from-artifact",
        action="store_true",
        help="the tasks are the entries of each --kernel's artifact for --gpu under --artifacts, stale or not "
        "(a re-measure after a source edit: with --trials 1 --warm-starts own), each at the batch size it records "
        "(an entry from before entries recorded one: the --batch default); an explicit --batch, or --interpret, "
        "re-measures every entry at --batch instead",
    )
    run.add_argument(
        "--shard",
        metavar="K/N",
        default=None,
        help="run the K-th of N shares of the tasks (whole families each): one device call's part of a long run, "
        "each into its own --artifacts copy, joined by `autotune merge`",
    )
    run.add_argument(
        "--lengths",
        metavar="FILE",
        help="real sequence lengths (.npy, JSON list / batches / histogram, or text): the jagged tasks draw their "
        "batches from them (with --from-*: also the length distribution and, listed as batches, the batch size "
        "where the graph does not fix them; without it the model's own length law is used)",
    )


def refuse_grid_options(args: argparse.Namespace, options: Sequence[str], source: str, why: str) -> None:
    """A task source that decides the tasks itself refuses grid options the user set (given at all: a
    default's value is ignored too)."""
    changed = [o for o in options if o in args.given]
    if changed:
        flags = ", ".join("--" + o for o in changed)
        raise CLIError(f"{flags} cannot be combined with {source}: {why}")


def artifact_task_list(args: argparse.Namespace, gpu: str, sample: tuple[int, ...] | None) -> list:
    """The tasks of ``autotune run --from-artifact``: the entries of each kernel's artifact (the grid options but
    --kernel must stay unset: the entries decide the shapes, laws and buckets). A ``--batch`` the user gave applies
    to every entry; otherwise each keeps the batch it records."""
    from autotune.tuning.tasks import tasks_from_artifact

    options = [o for o in (*GRID_OPTIONS, "dtype") if o != "kernel"]
    refuse_grid_options(args, options, "--from-artifact", "the artifact's entries decide the tasks")
    _nonempty("--kernel", str(args.kernel))
    # --interpret times its tiny default batch: an entry's GPU batch would run for minutes under the interpreter
    force = "batch" in args.given or bool(args.interpret)
    kernels, root = _kernels(args.kernel), Path(args.artifacts)
    try:
        tasks = tasks_from_artifact(kernels, gpu, root, args.batch, args.seq_cap, sample, force_batch=force)
    except ValueError as e:
        raise CLIError(str(e)) from None
    if sample is not None and not any(t.sample for t in tasks):  # it was read, then ignored without a word
        raise CLIError(
            f"--lengths {args.lengths}: no entry of the artifacts was tuned on a lengths sample (each is re-measured "
            "on the law it was tuned on); leave --lengths out"
        )
    return tasks


def _add_graph_source(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--from-model",
        metavar="PRESET_OR_MODULE",
        help="a models.config preset, or module:factory returning (module, args[, dynamic_shapes])",
    )
    src.add_argument("--from-onnx", metavar="FILE", help="an ONNX file written by `python -m models.export`")
    p.add_argument(
        "--lengths",
        metavar="FILE",
        help="real sequence lengths (.npy, JSON list / batches / histogram, or text, one batch per line): "
        "the jagged tasks' lengths, and the length distribution and batch size where the graph does not fix them",
    )


def add_parsers(sub: Any) -> None:
    """Register ``autotune tasks`` and ``autotune export``."""
    tasks = sub.add_parser("tasks", help="list the tuning tasks of a model graph (torch.export or ONNX)")
    _add_graph_source(tasks)
    tasks.add_argument("--gpu", default="auto", help="GPU the tasks are for (default: the GPU present, else h100)")
    tasks.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="--from-model PRESET: the autocast dtype training runs (default bfloat16; a module:factory is "
        "exported as it is given; --from-onnx: the file's dtype, and --dtype is refused)",
    )
    tasks.add_argument("--inference", action="store_true", help="forward only (no backward tasks)")
    tasks.add_argument(
        "--batch",
        type=int,
        default=GPU_DEFAULTS["batch"],
        help="representative batch when neither the graph nor --lengths gives one",
    )
    tasks.add_argument("--json", metavar="FILE", help="also write the tasks as JSON")
    tasks.add_argument(
        "--lengths-out",
        metavar="FILE",
        help="also write the graph's length sample (the model's, or --lengths') as a JSON lengths file: what "
        "`autotune run --from-artifact --lengths FILE` needs to re-measure entries tuned on it",
    )
    export = sub.add_parser("export", help="write a self-contained artifact bundle (JSONs + manifest)")
    export.add_argument("--gpu", required=True, help=f"GPU key: {', '.join(sorted(GPUS))}")
    export.add_argument("--out", required=True, help="bundle directory (missing or empty)")
    export.add_argument("--artifacts", help="artifacts root (default: the packaged artifacts)")
    export.add_argument(
        "--kernel",
        help="kernels to export, comma-separated: fwd, bwd, layer or spec names (default: all of the GPU's); a kernel "
        "named alone must have an artifact, a member of layer without one is reported (the bundle runs its default "
        "config, as dispatch does)",
    )


def _tasks_gpu(arg: str) -> tuple[str, str | None]:
    """(GPU key, note): the named one, else the one present, else h100 (said in the note)."""
    name = arg.lower()
    if name != "auto":
        if name not in GPUS:
            raise CLIError(f"unknown GPU {arg!r}; known: {', '.join(sorted(GPUS))} or 'auto'")
        return name, None
    from autotune.runtime.gpus import detect_gpu

    try:
        return detect_gpu(), None
    except RuntimeError:
        return "h100", "no GPU detected: tasks listed for h100 (pass --gpu)"


def extract(
    args: argparse.Namespace,
    gpu: str,
    dtype: str,
    training: bool,
    batch: int,
    seq_cap: int | None,
    interpret: bool = False,
):
    """(GraphOps, [GraphTask]) of the --from-model / --from-onnx source; CLIError for bad input. ``interpret``:
    an ONNX file's ops take ``dtype`` too (the interpreter's, as --from-model exports under), not the file's."""
    from autotune.runtime.lengths import read_lengths_file
    from autotune.tuning.graph_tasks import (
        GraphTaskError,
        build_tasks,
        note_lengths_file,
        ops_from_model,
        ops_from_onnx,
    )

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.export internals
            if args.from_onnx:
                graph = ops_from_onnx(args.from_onnx, training=training)
                if interpret:
                    _interpreter_dtype(graph, dtype)
            else:
                graph = ops_from_model(args.from_model, dtype=dtype, training=training)
        lengths = read_lengths_file(args.lengths) if args.lengths is not None else None
        tasks = build_tasks(graph, gpu, lengths, seq_cap, default_batch=batch)
        if lengths is not None:
            note_lengths_file(graph, lengths, args.lengths, tasks)
        return graph, tasks
    except (GraphTaskError, ValueError) as e:
        raise CLIError(str(e)) from None


def _refuse_onnx_dtype(args: argparse.Namespace, given: bool) -> None:
    """An ONNX file's ops keep the dtype it holds: a ``--dtype`` given beside ``--from-onnx`` was dropped unsaid."""
    if args.from_onnx and given:
        raise CLIError("--dtype cannot be combined with --from-onnx: the file's ops keep the dtype it holds (export "
                       "the model in another)")  # fmt: skip


def _interpreter_dtype(graph: Any, dtype: str) -> None:
    """Give every op of ``graph`` the run's ``dtype`` (--interpret: float32 unless --dtype says otherwise), with a
    note naming the dtypes the file held: the interpreter tunes the dtype it runs, whatever the source."""
    import dataclasses

    held = sorted({op.dtype for op in graph.ops} - {dtype})
    graph.ops = [dataclasses.replace(op, dtype=dtype) for op in graph.ops]
    if held:
        graph.notes.append(f"--interpret: the file's {', '.join(held)} ops are tuned in {dtype} (--dtype)")


def print_tasks(graph: Any, tasks: list, gpu: str) -> None:
    """The merged task table, then the rows range and the notes."""
    from rich.markup import escape
    from rich.table import Table

    console = _console()
    table = Table(title=f"{len(tasks)} tasks for {gpu} from {graph.source}")
    for col in ("kernel", "dtype", "dims", "heads", "bucket", "dist", "mask", "batch", "count", "nodes"):
        table.add_column(col, justify="right" if col in ("heads", "batch", "count") else "left")
    for gt in tasks:
        t = gt.task
        nodes = ", ".join(gt.nodes[:3]) + (f", ... (+{len(gt.nodes) - 3})" if len(gt.nodes) > 3 else "")
        table.add_row(
            t.kernel,
            t.dtype,
            f"{t.dqk}/{t.dv}",
            str(t.num_heads),
            format_bucket(t.bucket),
            t.distribution,
            t.mask,
            str(t.batch),
            str(gt.count),
            escape(nodes),
        )
    console.print(table)
    if graph.rows:
        lo, hi = graph.rows
        console.print(
            f"dynamic rows: {lo}..{hi if hi >= 0 else 'unbounded'}; each node's bucket is bucket_for(max_seq_len)"
        )
    for note in graph.notes:
        console.print(f"note: {escape(note)}")


def cmd_tasks(args: argparse.Namespace) -> int:
    """``autotune tasks``: print (and optionally write) the merged tasks of a model graph."""
    from autotune.tuning.graph_tasks import tasks_to_json

    gpu, note = _tasks_gpu(args.gpu)
    from autotune.tuning.cli_checks import int_in
    from autotune.tuning.tasks import MAX_BATCH

    int_in("--batch", args.batch, 1, MAX_BATCH)
    # An output may overwrite neither an input (it was read) nor the other output.
    files = (("--from-onnx", args.from_onnx), ("--lengths", args.lengths), ("--json", args.json))
    for out, path in (("--json", args.json), ("--lengths-out", args.lengths_out)):
        for option, given in files:
            if option != out and path and given and Path(path).resolve() == Path(given).resolve():
                raise CLIError(f"{out} {path}: is the {option} file; name another file")
    _refuse_onnx_dtype(args, args.dtype is not None)
    graph, tasks = extract(args, gpu, args.dtype or "bfloat16", not args.inference, args.batch, None)
    sample = tasks_sample(graph, tasks)
    if args.lengths_out and not sample:
        raise CLIError(f"--lengths-out {args.lengths_out}: {graph.source} has no length sample (full lengths)")
    print_tasks(graph, tasks, gpu)
    if note:
        _console().print(f"note: {note}")
    if args.json:
        _write_text("--json", args.json, json.dumps(tasks_to_json(graph, tasks), indent=2) + "\n")
    if args.lengths_out:  # the tasks' (compacted) sample: its digest is the one their entries record
        _write_text("--lengths-out", args.lengths_out, json.dumps(list(sample)) + "\n")
    return 0


def tasks_sample(graph: Any, tasks: list) -> tuple[int, ...] | None:
    """The length sample ``--lengths-out`` writes: the one the jagged tasks carry, whose digest their entries record
    (``--lengths``' when it replaces the model's: writing the model's then gave a file ``run --from-artifact`` refused
    as another sample), else the model's own (None for full lengths)."""
    return next((gt.task.sample for gt in tasks if gt.task.sample), None) or graph.lengths


def _write_text(option: str, path: str, text: str) -> None:
    """Write one of ``autotune tasks``' output files; a failure is a usage error naming the option."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    except OSError as e:
        raise CLIError(f"{option} {path}: cannot write it ({e.strerror or e})") from None


def graph_task_list(args: argparse.Namespace, gpu: str) -> list:
    """The tasks of ``autotune run --from-model/--from-onnx`` (the grid options must stay unset)."""
    refuse_grid_options(args, GRID_OPTIONS, "--from-model/--from-onnx", "the graph decides the tasks")
    if not args.interpret:  # under --interpret the ops take --dtype (``_interpreter_dtype``)
        _refuse_onnx_dtype(args, "dtype" in args.given)
    graph, tasks = extract(args, gpu, args.dtype, True, args.batch, args.seq_cap, args.interpret)
    if not tasks:
        raise CLIError(f"no templated op found in {graph.source}")
    print_tasks(graph, tasks, gpu)
    return [gt.task for gt in tasks]


def cmd_export(args: argparse.Namespace) -> int:
    """``autotune export``: a bundle of the GPU's usable artifacts with a manifest."""
    from autotune.runtime.bundle import BundleError, export_bundle

    gpu = args.gpu.lower()
    if gpu not in GPUS:
        raise CLIError(f"unknown GPU {args.gpu!r}; known: {', '.join(sorted(GPUS))}")
    from autotune import spec
    from autotune.tuning.cli import load_plugin_modules

    load_plugin_modules([])  # AUTOTUNE_PLUGINS: their kernels' artifacts are checked and exported too
    kernels, missing_ok = None, spec.kernels()  # every kernel's file the folder holds; the others are reported
    if args.kernel is not None:  # the spellings run, show and verify take: fwd, bwd, layer or spec names
        kernels = kernel_names(args.kernel)  # unknown names: a usage error listing the known ones
        missing_ok = _group_only(args.kernel)
    try:
        manifest = export_bundle(gpu, args.out, args.artifacts, kernels, missing_ok)
    except BundleError as e:
        print(f"autotune: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full disk or an unwritable parent: named, not a traceback (nothing is left at --out)
        print(f"autotune: error: --out {args.out}: cannot write the bundle ({e.strerror or e})", file=sys.stderr)
        return 1
    console = _console()
    for f in manifest["files"]:
        console.print(f"  {f['path']}: {f['entries']} entries, sha256 {f['sha256'][:12]}")
    from rich.markup import escape

    for kernel, why in manifest["missing"].items():
        console.print(f"  [yellow]missing {kernel}[/]: {escape(why)}")
    if manifest["ignored"]:
        names = escape(", ".join(manifest["ignored"]))
        console.print(f"  not exported: {names} (no registered kernel's; a plugin's kernel needs AUTOTUNE_PLUGINS)")
    console.print(
        f"wrote {args.out}/manifest.json ({gpu}, {manifest['gpu_name']}); load with autotune.load({args.out!r})"
    )
    return 0


def _group_only(text: str) -> list[str]:
    """The kernels ``--kernel`` names only through a group (``layer``): a group exports the members that have a
    file and reports the others, while a kernel named on its own must have one."""
    alone = {k for part in _split(text) if part != "layer" for k in _kernels(part)}
    return [k for k in _kernels(text) if k not in alone]


COMMANDS = {"tasks": cmd_tasks, "export": cmd_export}
