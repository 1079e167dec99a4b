"""``autotune bench --heatmap``: the batch x length grid's options, checked before any GPU work, and the command.

The measuring and the report (CSV, PNG heatmaps, ratio maps against a reference table) are
``autotune.tuning.heatmap``'s; this module reads the command line into that grid.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from autotune.tuning.cli import CLIError, _console, _nonempty, resolve_gpu

# ``bench``'s task options, which the heatmap's own grid options replace (refused beside --heatmap).
TASK_OPTIONS = ("heads", "batch", "buckets", "kernel", "dtype", "distributions", "masks")


def _named(option: str, read: Any) -> Any:
    """``read()``, a table's errors prefixed by the option that named the file (both options take a CSV)."""
    try:
        return read()
    except (OSError, ValueError) as e:
        raise CLIError(f"{option}: {e}") from None


def _ints(option: str, text: str, parse: Any = int, high: int | None = None) -> list[int]:
    """The distinct positive integers (at most ``high``) of a comma-separated ``option``, in order; a usage error
    naming it."""
    out: list[int] = []
    for part in _nonempty(option, text):
        try:
            value = parse(part)
        except ValueError:
            value = None
        if not isinstance(value, int) or value <= 0:
            raise CLIError(f"{option}: {part!r} is not a positive integer")
        if high is not None and value > high:
            raise CLIError(f"{option}: {part!r} is above {high}, the most a launch grid takes")
        if value not in out:
            out.append(value)
    return out


def _length(text: str) -> int:
    """'1K' -> 1024, '1536' -> 1536 (any positive length; K only for whole multiples of 1024)."""
    t = text.strip().lower()
    return int(t[:-1]) * 1024 if t.endswith("k") else int(t)


def heatmap_grid(args: argparse.Namespace) -> dict[str, Any]:
    """The measured grid of ``bench --heatmap``, every option checked before any GPU work (usage errors
    naming the option): distinct positive values (batches and heads within the tasks' launch-grid bounds,
    ``MAX_BATCH`` and ``MAX_HEADS``), head dims the kernels have (Dqk = Dv), known directions,
    and at least one cell within the grid's token cap. Task options the grid does not read are refused."""
    from autotune.tuning import heatmap
    from autotune.tuning.tasks import MAX_BATCH, MAX_HEADS, parse_dims
    from kernel_templates.hstu_attention.config import SUPPORTED_HEAD_DIMS

    ignored = [f"--{k.replace('_', '-')}" for k in TASK_OPTIONS if getattr(args, k, None) is not None]
    if ignored:
        raise CLIError(f"{', '.join(ignored)}: not read by bench --heatmap (use --heatmap-heads, --heatmap-batches, "
                       "--heatmap-lengths, --dims, --directions)")  # fmt: skip
    try:
        pairs = parse_dims(args.dims or "256,128")
    except ValueError as e:
        raise CLIError(f"--dims: {e}") from None
    for dqk, dv in pairs:
        if dqk != dv or dqk not in SUPPORTED_HEAD_DIMS:
            shown = f"{dqk}" if dqk == dv else f"{dqk}x{dv}"
            raise CLIError(f"--dims: '{shown}': the heatmap times Dqk = Dv, one of {SUPPORTED_HEAD_DIMS}")
    dims = list(dict.fromkeys(dqk for dqk, _ in pairs))
    directions = list(dict.fromkeys(_nonempty("--directions", args.directions)))
    unknown = [d for d in directions if d not in heatmap.DIRECTIONS]
    if unknown:
        raise CLIError(f"--directions: {', '.join(unknown)} not among {', '.join(heatmap.DIRECTIONS)}")
    grid = {
        "dims": dims,
        "heads": _ints("--heatmap-heads", args.heatmap_heads, high=MAX_HEADS),
        "batches": _ints("--heatmap-batches", args.heatmap_batches, high=MAX_BATCH),
        "lengths": _ints("--heatmap-lengths", args.heatmap_lengths, _length),
        "directions": directions,
    }
    if not any(b * n <= heatmap.MAX_TOKENS for b in grid["batches"] for n in grid["lengths"]):
        raise CLIError(f"--heatmap-batches x --heatmap-lengths: every cell is over {heatmap.MAX_TOKENS} tokens")
    return grid


def _refuse_grid_options(args: argparse.Namespace) -> None:
    """``--from-csv`` draws the table's own cells: a grid option beside it (given, or set off its default) was
    accepted and ignored."""
    from autotune.tuning.cli import HEATMAP_OPTIONS

    grid = ("heatmap_batches", "heatmap_lengths", "heatmap_heads", "directions")
    given = [k for k in grid if getattr(args, k) != HEATMAP_OPTIONS[k]]
    given += [k for k in ("dims", *TASK_OPTIONS) if getattr(args, k, None) is not None]
    if given:
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given)
        raise CLIError(f"{flags}: --from-csv re-renders the cells its table holds; it measures no grid")


def cmd_heatmap(args: argparse.Namespace) -> int:
    """``bench --heatmap``: measure the batch x length grid on the GPU (or re-render ``--from-csv``),
    then write CSV and PNG heatmaps, with ratio maps against ``--reference`` when given."""
    from autotune.tuning import heatmap
    from autotune.tuning.cli_checks import writable_folder

    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise CLIError(f"--out {args.out}: exists and is not a folder")
    # The report replaces its files in --out: a reference there (the last run's heatmap.csv, the natural thing to
    # compare a new run with) was read, then deleted and overwritten by the new rows, exit 0.
    replaced = {(Path(args.out) / f).resolve() for f in heatmap.REPORT_FILES if "*" not in f}
    if args.reference and Path(args.reference).resolve() in replaced:
        raise CLIError(f"--reference {args.reference}: a file the report writes in --out {args.out} (it would be "
                       "replaced); copy it elsewhere or pass another --out")  # fmt: skip
    if args.from_csv:
        _refuse_grid_options(args)
    grid = None if args.from_csv else heatmap_grid(args)
    if args.cuda_graph and args.from_csv:
        raise CLIError("--cuda-graph: --from-csv re-renders rows timed earlier; it times nothing")
    try:
        heatmap.check_plotting()
        reference = None
        if args.reference:
            table = _named("--reference", lambda: heatmap.read_table(args.reference))
            reference = _named("--reference", lambda: heatmap.reference_rows(table, args.reference))
        if args.from_csv:
            rows = _named("--from-csv", lambda: heatmap.read_table(args.from_csv))
        else:
            import torch

            # Before the measuring: a folder that cannot be written lost the whole grid's timings at the end.
            writable_folder("--out", args.out)
            if not torch.cuda.is_available():
                raise CLIError("bench --heatmap measures on a CUDA GPU (or pass --from-csv FILE to re-render)")
            from autotune.runtime.gpus import get_gpu

            gpu = resolve_gpu(args.gpu, False, False)
            import autotune

            autotune.load(args.artifacts, gpu)
            rows = heatmap.measure_grid(**grid, peak_tflops=get_gpu(gpu).peak_bf16_tflops, cuda_graph=args.cuda_graph)
        files = heatmap.write_report(rows, args.out, reference, reference_name=args.reference)
    except (OSError, ValueError) as e:
        raise CLIError(str(e)) from None
    from rich.markup import escape

    for note in files["notes"]:
        _console().print(f"[yellow]note:[/yellow] {escape(note)}")
    _console().print(
        f"heatmap: {len(rows)} cells -> {', '.join(str(f) for f in files['csv'])}, {len(files['png'])} PNGs"
    )
    return 0
