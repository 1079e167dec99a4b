"""``autotune``: tune (run), inspect (show), re-check (verify) and benchmark (bench) the registered kernels.

autotune run --gpu h100                       # fwd+bwd, bf16, b32 h4, d256/128, 1K-8K, uniform+jagged+sparse
autotune run --gpu auto --time-budget 6m      # the same, cut to a few minutes
autotune run --gpu h100 --dry-run             # tasks and space sizes, no GPU needed
autotune run --gpu h100 --interpret           # whole pipeline under the Triton interpreter (CI)
autotune show --gpu h100
autotune verify --gpu auto --jobs 12 --write    # every committed entry re-checked, every mask and dtype
autotune bench --gpu auto --buckets 4K --dims 256
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Collection
from pathlib import Path
from typing import Any

from autotune.runtime.buckets import DISTRIBUTIONS, format_bucket, parse_bucket
from autotune.runtime.gpus import GPUS

KERNEL_ALIASES = {"fwd": "hstu_attention_fwd", "bwd": "hstu_attention_bwd"}
GPU_DEFAULTS: dict[str, Any] = {
    "kernel": "fwd,bwd",
    "buckets": "1K,2K,4K,8K",
    "dims": "256,128",
    "heads": 4,
    "batch": 32,
    "dtype": "bfloat16",
    "distributions": "uniform,jagged,sparse",
    "masks": "causal",
    "trials": 16,
    "time_budget": "40m",  # 48 tasks; compile ~1-3 s per new config, shared across buckets
}
INTERPRET_DEFAULTS: dict[str, Any] = {
    "kernel": "fwd,bwd",
    "buckets": "256",
    "dims": "32",
    "heads": 1,
    "batch": 2,
    "dtype": "float32",
    "distributions": "uniform,jagged",
    "masks": "causal",
    "trials": 3,
    "time_budget": None,
    "seq_cap": 64,
}
# ``bench`` options only ``--heatmap`` (or ``--from-csv``) reads, with their defaults: the plain bench refuses them.
HEATMAP_OPTIONS: dict[str, Any] = {
    "cuda_graph": False,
    "heatmap_batches": "1,2,4,8,16,32,64,128",
    "heatmap_lengths": "128,256,512,1K,2K,4K,8K,16K",
    "heatmap_heads": "4",
    "directions": "fwd,bwd,both",
    "reference": None,
    "out": "runs/heatmap",
}
ABBREV = {"block_m": "m", "block_n": "n", "num_warps": "w", "num_stages": "s", "dq_block_m": "dqm", "dq_block_n": "dqn"}


class CLIError(Exception):
    """A usage problem: printed as 'autotune: error: ...', exit status 2."""


def _console():
    """A console that keeps tables readable when output goes to a log file (no terminal: 80 columns)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def parse_duration(text: str | None) -> float | None:
    """'90', '90s', '6m', '1.5h' -> seconds; None/'none'/'0' -> no budget. An empty value (an unset variable's
    ``"$BUDGET"``) names nothing: it ran with no budget at all."""
    if text is not None and not text.strip():
        raise CLIError("--time-budget names nothing; give a duration (e.g. 6m), or 0 or none for no budget")
    if text is None or text.strip().lower() in ("none", "0"):
        return None
    t = text.strip().lower()
    scale = {"s": 1, "m": 60, "h": 3600}.get(t[-1])
    try:
        value = float(t[:-1]) * scale if scale else float(t)
    except ValueError:
        raise CLIError(f"--time-budget: bad duration {text!r}: use e.g. 90s, 6m, 1.5h") from None
    if not math.isfinite(value) or value <= 0:
        raise CLIError(f"--time-budget: duration must be positive and finite, got {text!r}")
    return value


def load_plugin_modules(names: list[str]) -> None:
    """``registry.load_plugins``, with an import failure as a usage error naming the module."""
    from autotune.tuning.registry import load_plugins, plugin_modules

    for name in plugin_modules(names):
        try:
            load_plugins([name])
        except (Exception, SystemExit) as e:  # noqa: BLE001 - a syntax error or a raise at import too: not a traceback
            option = "--plugin" if name in names else "AUTOTUNE_PLUGINS"
            why = str(e) if isinstance(e, ImportError) else f"{type(e).__name__}: {e}"
            raise CLIError(f"{option} {name}: cannot import it ({why})") from None


def _split(text: str) -> list[str]:
    return [p.strip() for p in text.split(",") if p.strip()]


def _nonempty(option: str, text: str) -> list[str]:
    """The comma-separated values of ``option``; a usage error when it names none."""
    values = _split(text)
    if not values:
        raise CLIError(f"{option} {text!r} names nothing; give at least one value")
    return values


def _kernels(text: str) -> list[str]:
    """Kernel names; "fwd"/"bwd" are the attention kernels, "layer" every other kernel of the fused layer."""
    out: list[str] = []
    for k in _split(text):
        if k == "layer":
            from autotune.runtime.layer import LAYER_KERNELS

            out += [n for n in LAYER_KERNELS if not n.startswith("hstu_attention")]
        else:
            out.append(KERNEL_ALIASES.get(k, k))
    return list(dict.fromkeys(out))


def kernel_names(text: str, also: Collection[str] = ()) -> list[str]:
    """The kernels ``--kernel`` names (as ``_kernels`` reads them); a usage error when it names none or one
    neither registered (plugins loaded first) nor in ``also``."""
    from autotune import spec

    _nonempty("--kernel", text)
    names = _kernels(text)
    unknown = [k for k in names if k not in spec.kernels() and k not in also]
    if unknown:
        raise CLIError(f"--kernel: unknown kernel(s) {', '.join(unknown)}; known: {', '.join(spec.kernels())}")
    return names


def resolve_gpu(arg: str, interpret: bool, dry_run: bool, needs: str = "tuning needs the GPU (use --dry-run or "
                "--interpret without one)") -> str:  # fmt: skip
    """The registry key to tune for; refuses when the GPU present does not match ``--gpu`` (``needs``: what
    the command says it needs the GPU for when there is none)."""
    from autotune.runtime.gpus import detect_gpu

    name = arg.lower()
    if name != "auto" and name not in GPUS:
        raise CLIError(f"unknown GPU {arg!r}; known: {', '.join(sorted(GPUS))} or 'auto'")
    if interpret or dry_run:
        if name != "auto":
            return name
        try:
            return detect_gpu()
        except RuntimeError:
            if interpret:
                return "h100"  # interpreter runs only need a target for the feasibility rules
            raise CLIError("--gpu auto needs a GPU; name one (e.g. --gpu h100) for a dry run") from None
    try:
        present = detect_gpu()
    except RuntimeError as e:
        raise CLIError(f"{e}; {needs}") from None
    if name != "auto" and present != name:
        raise CLIError(f"--gpu {name} but the GPU present is {present}; pass --gpu {present} or --gpu auto")
    return present


def _fill_defaults(args: argparse.Namespace) -> None:
    """Fill the unset options; ``args.given`` keeps the ones the user set (even to a default's value)."""
    defaults = INTERPRET_DEFAULTS if args.interpret else GPU_DEFAULTS
    args.given = {k for k in defaults if getattr(args, k, None) is not None}
    for k, v in defaults.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.artifacts is None:
        root = Path(__file__).resolve().parents[2]
        args.artifacts = str(root / ("runs/interpret/artifacts" if args.interpret else "artifacts"))


def build_task_list(args: argparse.Namespace, gpu: str) -> list:
    """The run's tasks (grid, model graph or artifact entries), then its ``--shard`` share of them."""
    from autotune.tuning.tasks import shard

    tasks = _all_tasks(args, gpu)
    if getattr(args, "shard", None) is None:
        return tasks
    try:
        return shard(tasks, args.shard)
    except ValueError as e:
        raise CLIError(f"--{e}") from None


def _all_tasks(args: argparse.Namespace, gpu: str) -> list:
    from autotune.tuning.tasks import MASKS, build_tasks, parse_dims

    if getattr(args, "from_model", None) or getattr(args, "from_onnx", None):
        from autotune.tuning.cli_graph import graph_task_list

        return graph_task_list(args, gpu)
    kernels = kernel_names(str(args.kernel))
    _nonempty("--dims", str(args.dims))
    try:
        buckets = [parse_bucket(b) for b in _nonempty("--buckets", args.buckets)]
    except ValueError as e:
        raise CLIError(f"--buckets: {e}") from None
    try:
        dims = parse_dims(args.dims)
    except ValueError as e:
        raise CLIError(f"--dims: {e}") from None
    dists = _nonempty("--distributions", args.distributions)
    for d in dists:
        if d not in DISTRIBUTIONS:
            raise CLIError(f"--distributions: unknown distribution {d!r}; choose from {', '.join(DISTRIBUTIONS)}")
    masks = _nonempty("--masks", args.masks)
    for m in masks:
        if m not in MASKS:
            raise CLIError(f"--masks: unknown mask {m!r}; choose from {', '.join(MASKS)}")
    sample = None
    if getattr(args, "lengths", None) is not None:  # `--lengths ""` (an unset variable) tuned the synthetic law
        from autotune.runtime.lengths import compact, read_length_sample

        try:
            sample = compact(read_length_sample(args.lengths))
        except ValueError as e:
            raise CLIError(str(e)) from None
        if "jagged" not in dists and not getattr(args, "from_artifact", False):
            raise CLIError("--lengths tunes the jagged entries: keep 'jagged' in --distributions")
    if getattr(args, "from_artifact", False):
        from autotune.tuning.cli_graph import artifact_task_list

        return artifact_task_list(args, gpu, sample)
    try:
        return build_tasks(
            kernels, gpu, args.dtype, dims, args.heads, buckets, dists, masks, args.batch, args.seq_cap,
            sample=sample,
        )  # fmt: skip
    except ValueError as e:
        raise CLIError(str(e)) from None


def config_str(config: dict[str, Any] | None) -> str:
    if not config:
        return "-"
    parts = []
    for k, v in config.items():
        if k in ("dq_block_m", "dq_block_n") and not v:
            continue
        parts.append(str(v) if k == "dq_mode" else f"{ABBREV.get(k, k + '=')}{v}")
    return " ".join(parts)


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def cmd_run(args: argparse.Namespace) -> int:
    console = _console()
    _fill_defaults(args)
    budget = parse_duration(args.time_budget)
    if budget is None:  # '0' and 'none' mean no budget: the summary lines say so
        args.time_budget = None
    from autotune.tuning.cli_checks import check_run_numbers, check_run_outputs

    check_run_numbers(args)
    gpu = resolve_gpu(args.gpu, args.interpret, args.dry_run)
    from autotune.tuning.registry import backends_for, get_op

    load_plugin_modules(args.plugin)
    tasks = build_task_list(args, gpu)
    if not tasks and args.shard is not None:  # a farm or device-call worker with nothing to do is no error
        print(f"autotune: --shard {args.shard} holds no tasks (fewer task families than shards); nothing to do")
        return 0
    declared: set[str] = set()
    for k in sorted({t.kernel for t in tasks}):
        try:
            get_op(k)
        except ValueError as e:
            raise CLIError(str(e)) from None
        if not backends_for(k, args.backends, available_only=False):
            raise CLIError(f"--backends: {', '.join(args.backends)} is no backend of {k}")
        declared |= {b.name for b in backends_for(k, None, available_only=False)}
    unknown = [b for b in args.backends or () if b not in declared]
    if unknown:
        known = ", ".join(sorted(declared))
        raise CLIError(f"--backends: {', '.join(unknown)} is no backend of these kernels ({known})")
    from autotune.tuning.tasks import space_context

    for t in tasks:
        ctx = space_context(t, args.interpret)
        backends = backends_for(t.kernel, args.backends, available_only=False)
        if not any(b.space.prune(ctx) for b in backends):  # say where it looked: a --backends or --dtype may be why
            where = ", ".join(b.name for b in backends) + (" under --interpret" if args.interpret else "")
            raise CLIError(f"no feasible config for {t.label()} in {where} (unsupported head dims or dtype?)")
    if args.dry_run:
        return _dry_run(console, tasks, args)
    check_run_outputs(args, gpu, sorted({t.kernel for t in tasks}))
    from autotune.tuning.tuner import TuneOptions, run_tasks

    opts = TuneOptions(
        n_trials=args.trials,
        sampler=args.sampler,
        seed=args.seed,
        storage=args.storage,
        artifacts_root=Path(args.artifacts),
        eval_timeout_s=args.eval_timeout,
        prune=not args.no_prune,
        cuda_graph=args.cuda_graph,
        backends=args.backends,
        plugins=list(args.plugin),
        interpret=args.interpret,
        verify=args.verify,
        compare_rounds=args.compare_rounds,
        compare_max_rounds=args.compare_max_rounds,
        warm_starts=args.warm_starts,
    )
    opened = _check_storage(args)
    mode = " [yellow](Triton interpreter: timings are meaningless)[/]" if args.interpret else ""
    console.print(
        f"Tuning {len(tasks)} tasks on [bold]{gpu}[/], {args.trials} trials each, sampler {args.sampler}, "
        f"budget {args.time_budget or 'none'}{mode}"
    )
    from autotune.tuning.farm import run_farm_cli
    from autotune.tuning.farm_storage import FarmError, is_farm_url

    if is_farm_url(args.storage):
        try:
            results = run_farm_cli(console, tasks, opts, args.storage, args.workers, budget, reader=opened)
        except FarmError as e:
            raise CLIError(str(e)) from None
    else:
        with _RichReporter(console) as reporter:
            results = run_tasks(tasks, opts, budget, reporter)
    return _report_run(console, results, args, gpu)


def _check_storage(args: argparse.Namespace) -> Any:
    """Open an RDB ``--storage`` before the run says anything: a wrong or unreachable URL is one error naming
    the option (password masked), not a banner and then the error, nor a failure inside the first task. Returns
    the opened storage (None for a journal file), which a farm run reads its progress through."""
    from autotune.tuning.farm_storage import FarmError, FarmOptions, check_farm_call, is_farm_url, plain_storage

    if args.workers is not None and (args.workers < 1 or not is_farm_url(args.storage)):
        raise CLIError("--workers N needs N >= 1 and --storage postgresql://... (scripts/pg_local.sh start DIR)")
    if not args.storage or "://" not in args.storage:  # a journal file (or the default one)
        return None
    try:
        if is_farm_url(args.storage):  # the farm's own checks first: they need no server
            check_farm_call(args.storage, args.workers)
            FarmOptions.from_env()
        return plain_storage(args.storage)  # a farm's PostgreSQL or another RDB (sqlite, ...)
    except FarmError as e:
        raise CLIError(str(e)) from None


def _report_run(console, results: list, args: argparse.Namespace, gpu: str) -> int:
    """The run's table and notes; 1 when a task failed. A task cut by the time budget says so even when it also
    ended with an error (the same command resumes it), and one a farm host's budget left unclaimed is no failure:
    it stays queued for another host or the next run."""
    from rich.table import Table

    table = Table(title=f"autotune run: {gpu}")
    for col in ("kernel", "dims", "dist", "bucket", "best config", "ms", "TFLOP/s", "default TFLOP/s", "speedup"):
        table.add_column(col, justify="right" if col in ("ms", "TFLOP/s", "default TFLOP/s", "speedup") else "left")
    table.add_column("trials (status)")
    failed = [r for r in results if r.error]
    left = [r for r in results if r.left]
    for r in results:
        t = r.task
        statuses = " ".join(f"{k}:{v}" for k, v in sorted(r.statuses.items()))
        best = f"{r.backend} {config_str(r.config)}" + (" (default)" if r.kept_default else "") if r.config else "-"
        if r.error:
            best = f"[red]{r.error[:60]}[/]"
        elif r.left:
            best = "[yellow]left for a later join[/]"
        table.add_row(
            t.kernel.replace("hstu_attention_", ""),
            f"{t.dqk}/{t.dv}",
            t.distribution,
            format_bucket(t.bucket),
            best,
            _fmt(r.median_ms, ".3f"),
            _fmt(r.tflops),
            _fmt(r.default_tflops),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
            "-" if r.left else f"{r.trials} ({statuses})" + (" cut" if r.cut else ""),
        )
    console.print(table)
    cut = sum(1 for r in results if r.cut and not r.error)
    if cut:
        console.print(
            f'{cut} task(s) stopped at the time budget before {args.trials} trials ("cut"): their best so far was '
            "written; the same command resumes their studies (a farm queues them again)."
        )
    if left:
        console.print(
            f"{len(left)} task(s) left queued when this host's time budget ran out (not failed): another host "
            "running the same command, or its next run here, tunes them:"
        )
        for r in left:
            console.print(f"  {r.task.label()}: {r.left}", markup=False, soft_wrap=True)
    console.print(f"Artifacts: {args.artifacts}/{gpu}/<kernel>.json")
    if args.verify == "quick" and len(results) > len(failed) + len(left):
        console.print(
            "Winners were re-checked on their own mask and dtype only (--verify quick): "
            f"`autotune verify --gpu {gpu} --artifacts {args.artifacts}{' --interpret' if args.interpret else ''} "
            "--missing --write` re-checks them on every "
            "mask and dtype before they are committed."
        )
    if failed:
        console.print(f"[red]{len(failed)} of {len(results)} tasks failed[/] (no artifact entry written for them):")
        for r in failed:
            resume = " (cut by the time budget first: the same command resumes it)" if r.cut else ""
            console.print(f"  {r.task.label()}: {r.error}{resume}", markup=False, soft_wrap=True)
    return 1 if failed else 0


def _dry_run(console, tasks: list, args: argparse.Namespace) -> int:
    from rich.table import Table

    from autotune.tuning.registry import backends_for
    from autotune.tuning.tasks import space_context

    table = Table(title=f"dry run: {len(tasks)} tasks on {tasks[0].gpu if tasks else '?'}")
    for col in ("task", "batch", "lengths (mean/max)", "configs: full -> feasible"):
        table.add_column(col)
    for t in tasks:
        lengths = t.lengths()
        ctx = space_context(t, args.interpret)
        sizes = []
        for b in backends_for(t.kernel, args.backends, available_only=False):
            sizes.append(f"{b.name} {len(b.space.full())} -> {len(b.space.prune(ctx))}")
        table.add_row(t.label(), str(t.batch), f"{sum(lengths) / len(lengths):.0f}/{max(lengths)}", "; ".join(sizes))
    console.print(table)
    console.print(f"{args.trials} trials per task, time budget {args.time_budget or 'none'}; nothing was run.")
    return 0


class _RichReporter:
    """Progress bars: one for the tasks, one for the current task's trials."""

    def __init__(self, console) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
        self.tasks_bar = None
        self.trial_bar = None

    def __enter__(self) -> _RichReporter:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def task_start(self, task, index: int, total: int, n_trials: int) -> None:
        if self.tasks_bar is None:
            self.tasks_bar = self.progress.add_task("tasks", total=total)
        if self.trial_bar is not None:
            self.progress.remove_task(self.trial_bar)
        self.trial_bar = self.progress.add_task(f"  {task.label()}", total=n_trials)

    def trial_done(self, task, measured: int, status: str, best_ms: float | None) -> None:
        best = f" best {best_ms:.3f} ms" if best_ms else ""
        self.progress.update(self.trial_bar, completed=measured, description=f"  {task.label()} [{status}]{best}")

    def task_end(self, result) -> None:
        self.progress.advance(self.tasks_bar)


def cmd_bench(args: argparse.Namespace) -> int:
    """Time default vs tuned configs in this process on the given shapes (GPU only)."""
    from rich.table import Table

    if args.heatmap or args.from_csv:  # --from-csv is a heatmap re-render (no GPU): it implies --heatmap
        from autotune.tuning.cli_heatmap import cmd_heatmap

        return cmd_heatmap(args)
    given = [f"--{k.replace('_', '-')}" for k, v in HEATMAP_OPTIONS.items() if getattr(args, k) != v]
    if given:  # `bench --cuda-graph` timed plain launches: the heatmap's options were ignored without a word
        raise CLIError(f"{', '.join(given)}: a bench --heatmap option; add --heatmap (or leave it out)")
    _fill_defaults(args)
    args.trials, args.seq_cap = 1, None
    from autotune.tuning.cli_checks import check_task_numbers

    check_task_numbers(args)
    gpu = resolve_gpu(args.gpu, False, False, "bench measures on the GPU")
    import torch

    if not torch.cuda.is_available():
        raise CLIError("bench needs a CUDA GPU")
    load_plugin_modules(args.plugin)
    console = _console()
    tasks = build_task_list(args, gpu)
    table = Table(title=f"autotune bench: {gpu}")
    for col in ("kernel", "dims", "dist", "bucket", "tuned config", "default TFLOP/s", "tuned TFLOP/s", "speedup"):
        table.add_column(col)
    for t in tasks:
        table.add_row(*_bench_row(t, gpu, args))
        torch.cuda.empty_cache()
    console.print(table)
    return 0


def _bench_row(t, gpu: str, args: argparse.Namespace) -> list[str]:

    from autotune.runtime.artifacts import artifact_path, load_artifact_or_none
    from autotune.tuning import measure
    from autotune.tuning.tuner import bench_launches

    artifact = load_artifact_or_none(artifact_path(gpu, t.kernel, args.artifacts))
    flops, default, tuned = bench_launches(t, artifact)
    d_ms = measure.bench(default.run, quick=False).median_ms
    row_cfg, tuned_tf, speed = "(no artifact entry: default)", None, None
    if tuned is not None:
        t_ms = measure.bench(tuned.run, quick=False).median_ms
        row_cfg = f"{tuned.backend} {config_str(tuned.config.to_dict())}"
        tuned_tf, speed = flops / t_ms / 1e9, d_ms / t_ms
    return [
        t.kernel.replace("hstu_attention_", ""),
        f"{t.dqk}/{t.dv}",
        t.distribution,
        format_bucket(t.bucket),
        row_cfg,
        f"{flops / d_ms / 1e9:.1f}",
        _fmt(tuned_tf),
        _fmt(speed, ".2f"),
    ]


def _add_task_args(p: argparse.ArgumentParser, run: bool = False) -> None:
    """The task options ``run`` and ``bench`` share; ``run``: the help names the options only ``run`` takes."""
    p.add_argument("--gpu", default="auto", help=f"target GPU: {', '.join(sorted(GPUS))} or auto (default)")
    p.add_argument(
        "--kernel",
        help="kernels, comma-separated: fwd, bwd (attention), layer (the fused layer's other ops) or spec names "
        "(default fwd,bwd)",
    )
    p.add_argument("--buckets", help="length buckets, e.g. 1K,2K,4K,8K (256..32K)")
    p.add_argument("--dims", help="head dims, e.g. 256,128 or 128x64 (Dqk x Dv)")
    p.add_argument("--heads", type=int, help="number of heads (default 4)")
    p.add_argument("--batch", type=int, help="sequences per representative batch (default 32)")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        help="default bfloat16; float32 with --interpret, where --from-model and --from-onnx tune in it too "
        "(--from-onnx without --interpret: the file's dtype, and --dtype is refused)"
        if run
        else "default bfloat16",
    )
    p.add_argument(
        "--distributions", help="uniform,jagged,sparse (default all; sparse: one long sequence among short ones)"
    )
    p.add_argument("--masks", help="mask features: causal (default), targets, context, window, ...")
    p.add_argument("--plugin", action="append", default=[], help="module that registers more kernels/backends")
    p.add_argument(
        "--artifacts",
        help="artifacts root (default: the package's artifacts/, runs/interpret/artifacts beside it with --interpret)"
        if run
        else "artifacts root (default: the package's artifacts/)",
    )
    p.add_argument("--seq-cap", type=int, default=None, help=argparse.SUPPRESS)  # tests/CI: cap real lengths


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="autotune", description="Tune HSTU attention kernels per GPU and bucket.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="tune and write artifacts/<gpu>/<kernel>.json")
    _add_task_args(run, run=True)
    run.add_argument("--trials", type=int, help="measured trials per task (default 16; 3 with --interpret)")
    run.add_argument(
        "--time-budget",
        help="wall-clock budget for the whole run, e.g. 6m; 0 or none: no budget (default 40m; none with --interpret)",
    )
    run.add_argument(
        "--storage",
        help="Optuna storage: postgresql://USER@HOST:PORT/DB runs a tuning farm (many workers and hosts on one "
        "task set); sqlite:///x.db or a journal file path: this process alone",
    )
    run.add_argument(
        "--workers",
        type=int,
        default=None,
        help="farm worker processes on this host (default: one per visible GPU, each pinned with "
        "CUDA_VISIBLE_DEVICES; 1 without one; at most 64); needs --storage postgresql://...",
    )
    run.add_argument(
        "--sampler", default="tpe", choices=("tpe", "random", "bruteforce", "gp"), help="Optuna sampler (default tpe)"
    )
    run.add_argument("--seed", type=int, default=0, help="sampler seed, in [0, 2**32) (default 0)")
    run.add_argument("--backends", type=_split, default=None, help="restrict to these backends, e.g. triton")
    run.add_argument("--eval-timeout", type=float, default=60.0, help="seconds per compile/check/time request")
    run.add_argument("--no-prune", action="store_true", help="fully time every correct config")
    run.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays (no launch overhead; GPU only)")
    run.add_argument(
        "--verify",
        default="full",
        choices=("full", "quick"),
        help="final re-check of each winner: full = every mask x bf16/fp16 x short/long shapes (default); "
        "quick = the task's own mask and dtype on short/long shapes",
    )
    run.add_argument("--compare-rounds", type=int, default=6, help="interleaved winner/default timing rounds")
    run.add_argument(
        "--compare-max-rounds",
        type=int,
        default=18,
        help="rounds a close comparison (a gain inside the spread of the first rounds) extends to",
    )
    run.add_argument(
        "--warm-starts",
        default="all",
        help="configs measured before the sampler's: all = the bucket's last winner, its neighbours' and the "
        "other laws' and head counts' winners (default); own = the bucket's last winner only (with --trials 1: "
        "a re-measure of the default and the last winner after a change that leaves the device code as it was)",
    )
    run.add_argument("--dry-run", action="store_true", help="print tasks and space sizes; run nothing")
    run.add_argument(
        "--interpret",
        action="store_true",
        help="run under the Triton interpreter on a tiny shape (its defaults: fwd,bwd, bucket 256, dims 32, "
        "heads 1, batch 2, float32, uniform,jagged, 3 trials, no time budget; --gpu auto without a GPU: h100)",
    )
    show = sub.add_parser("show", help="print what artifacts hold")
    show.add_argument("--gpu", default=None, help="GPU (default: all)")
    show.add_argument("--kernel", default=None, help="kernels, comma-separated: fwd, bwd, layer or spec names")
    show.add_argument("--artifacts", default=None, help="artifacts root (default: the package's artifacts/)")
    merge = sub.add_parser("merge", help="fold artifacts written by other runs into artifacts/<gpu>/<kernel>.json")
    merge.add_argument("files", nargs="+", help="artifact JSON files (each: one kernel on one GPU)")
    merge.add_argument(
        "--artifacts", default=None, help="artifacts root to merge into (default: the package's artifacts/)"
    )
    merge.add_argument(
        "--replace",
        action="store_true",
        help="drop the entries of a target tuned in another timing environment (GPU, driver, versions)",
    )
    bench = sub.add_parser(
        "bench", help="time default vs tuned configs (GPU only; --heatmap --from-csv re-renders without one)"
    )
    _add_task_args(bench)
    bench.add_argument("--heatmap", action="store_true", help="batch x length heatmaps (TFLOP/s, MFU), CSV + PNG")
    bench.add_argument(
        "--cuda-graph", action="store_true", help="heatmap: time CUDA-graph replays of each call (no host time)"
    )
    heat = HEATMAP_OPTIONS
    bench.add_argument("--heatmap-batches", default=heat["heatmap_batches"], help="default %(default)s")
    bench.add_argument("--heatmap-lengths", default=heat["heatmap_lengths"], help="default %(default)s")
    bench.add_argument(
        "--heatmap-heads", default=heat["heatmap_heads"], help="head counts, e.g. 1,2,4,8 (default %(default)s)"
    )
    bench.add_argument("--directions", default=heat["directions"], help="heatmap directions (default %(default)s)")
    bench.add_argument(
        "--reference",
        help="CSV with direction,dqk,heads,batch,length,tflops (and optionally source): ratio maps against it; "
        "of a table with several sources the 'tuned' rows are used (several sources, none tuned: an error)",
    )
    bench.add_argument(
        "--from-csv", help="re-render a heatmap CSV written earlier (no GPU needed; one row per cell and source)"
    )
    bench.add_argument("--out", default=heat["out"], help="heatmap output folder (default %(default)s)")
    status = sub.add_parser("status", help="progress of a tuning farm: tasks, workers, best so far")
    status.add_argument("--storage", required=True, help="the farm's storage URL (postgresql://...)")
    status.add_argument("--farm", default=None, help="one farm study (default: every farm in the storage)")
    status.add_argument(
        "--audit", metavar="ARTIFACTS", help="print tasks finished, configs timed twice, entries missing in ARTIFACTS"
    )
    status.add_argument(
        "--watch", type=float, nargs="?", const=2.0, default=None, metavar="S", help="redraw every S s (2) until done"
    )
    from autotune.tuning import cli_graph, recheck

    cli_graph.add_run_args(run)
    cli_graph.add_parsers(sub)
    recheck.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from autotune.runtime.gpus import interpreter

    with interpreter(bool(getattr(args, "interpret", False))):  # restored after: a library caller's process
        return _dispatch_command(args)


# Options that name something, with what they name. Given empty (an unset variable's "$DIR"), each was taken as left
# out: ``Path("")`` was the working directory and ``if args.artifacts`` the package's own artifacts (merged into,
# verified and written by ``--write``), ``--farm ""`` showed every farm, ``--plugin ""`` loaded nothing.
NAMING_OPTIONS = {
    **dict.fromkeys(
        ("artifacts", "out", "json", "lengths_out", "audit", "reference", "from_csv", "from_onnx"), "a path"
    ),
    "farm": "a farm name",
    "plugin": "a module name",
}


def _check_names(args: argparse.Namespace) -> None:
    """A usage error for a naming option (or one ``--plugin`` of several) given as an empty or blank string."""
    for name, what in NAMING_OPTIONS.items():
        value = getattr(args, name, None)
        values = value if isinstance(value, list) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            raise CLIError(f"--{name.replace('_', '-')} names nothing; give {what} (or leave the option out)")


def _dispatch_command(args: argparse.Namespace) -> int:
    """Run the parsed command; a ``CLIError`` is the one-line usage error (exit 2)."""
    try:
        _check_names(args)
        if args.command == "run":
            return cmd_run(args)
        if args.command in ("show", "merge"):
            from autotune.tuning import cli_artifacts

            return cli_artifacts.cmd_show(args) if args.command == "show" else cli_artifacts.cmd_merge(args)
        if args.command == "verify":
            from autotune.tuning.recheck import cmd_verify

            return cmd_verify(args)
        if args.command == "status":
            from autotune.tuning.farm_status import cmd_status

            return cmd_status(args)
        if args.command in ("tasks", "export"):
            from autotune.tuning.cli_graph import COMMANDS

            return COMMANDS[args.command](args)
        args.interpret = False
        return cmd_bench(args)
    except CLIError as e:
        print(f"autotune: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autotune: interrupted; re-run the same command to resume the studies", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy: the commands that live in other modules
    # (status, verify, tasks, export) raise autotune.tuning.cli.CLIError, which this copy's class would not catch.
    from autotune.tuning.cli import main as _main

    sys.exit(_main())
