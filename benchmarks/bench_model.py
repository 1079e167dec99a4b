"""End-to-end HSTU model benchmark: reference vs default vs tuned kernels, same seed and data.

    python benchmarks/bench_model.py --preset seed --artifacts artifacts
    python benchmarks/bench_model.py --preset tiny --device cpu --steps 3       # smoke test
    python benchmarks/bench_model.py --kernels tuned tuned:layer=fused,precision=bf16 --base tuned
    python benchmarks/bench_model.py --kernels tuned --cuda-graph --base tuned   # eager and graphed steps

Each kernel source trains the same model (same init, same batches) for ``--steps`` timed steps
after ``--warmup`` untimed ones; the PyTorch reference (O(n^2) memory per sequence, fp32 attention)
runs ``--reference-steps`` only. Prints a table (tokens/s, ms/step, model TFLOP/s, MFU, peak memory,
speed-up over the default kernels) and writes JSON to ``--json`` or ``$OUT/bench_model_<preset>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from autotune.runtime import dispatch  # noqa: E402
from autotune.tuning.cli import CLIError  # noqa: E402
from autotune.tuning.cli_checks import writable_file  # noqa: E402
from benchmarks.cli_args import at_least  # noqa: E402
from models.config import KERNEL_SOURCES, PRESETS, get_config  # noqa: E402
from models.train import check_device, check_kernels, check_precision, default_dtype, parse_overrides, run  # noqa: E402


def plan(args: argparse.Namespace, device: torch.device) -> list[tuple[str, Any, int, int]]:
    """(variant, config, steps, warm-up) of every run, each checked before the first starts (a bad later
    variant would otherwise end the benchmark after the earlier ones had run, with nothing written)."""
    overrides = parse_overrides(args.set)
    if "kernels" in overrides:
        raise ValueError("--set kernels=...: the kernel source is each variant's own (--kernels tuned default ...)")
    at_least(args, 1, "--log-every")  # run() refused these two with a traceback
    at_least(args, 0, "--workers")
    check_device(device)  # --device cuda on a host without one was run()'s traceback at the first variant
    runs = []
    for variant in args.kernels:
        source, own = parse_variant(variant)
        if "kernels" in own:
            raise ValueError(f"--kernels {variant!r}: the source goes before the ':' (tuned:layer=fused)")
        cfg = get_config(args.preset, **{**overrides, **own, "kernels": source})
        if cfg.cuda_graph and device.type != "cuda":
            raise ValueError(f"--kernels {variant!r}: CUDA graphs need a CUDA device, got --device {device}")
        if cfg.graph_tokens and not cfg.cuda_graph:  # else ignored: the variant ran eagerly under its name
            raise ValueError(f"--kernels {variant!r}: graph_tokens pads the batches of CUDA-graph steps: "
                             "add cuda_graph=true (or --cuda-graph)")  # fmt: skip
        check_precision(cfg, args.dtype or default_dtype(device))
        check_kernels(cfg, device)
        steps = args.reference_steps if source == "reference" else args.steps
        warmup = min(args.warmup, 1) if source == "reference" else args.warmup
        if steps < 1 or warmup < 0:
            name = "--reference-steps" if source == "reference" else "--steps"
            raise ValueError(f"{name} must be >= 1 and --warmup >= 0, got {steps} and {args.warmup}")
        runs.append((variant, cfg, steps, warmup))
    if args.base is not None and args.base not in args.kernels:
        raise ValueError(f"--base {args.base!r} is none of the variants run: {args.kernels}")
    return runs


def bench(args: argparse.Namespace, console: Console, device: torch.device) -> list[dict[str, Any]]:
    """Run every planned variant in this process, one after the other; a variant that runs out of memory or
    whose loss diverges gets an error row, and the others still run."""
    results = []
    for variant, cfg, steps, warmup in plan(args, device):
        dispatch.reset()
        console.rule(f"{args.preset}: {variant} ({steps} steps + {warmup} warm-up)")
        try:
            res = run(cfg, steps, device, warmup, args.dtype, args.artifacts, args.gpu, args.log_every,
                      args.workers, progress=not args.no_progress, console=console,
                      prime=False if args.no_prime else None)  # fmt: skip
        except torch.cuda.OutOfMemoryError as exc:
            res = {"kernels": cfg.kernels, "error": f"out of memory: {str(exc).splitlines()[0]}"}
        except FloatingPointError as exc:
            res = {"kernels": cfg.kernels, "error": str(exc)}
        res["preset"], res["variant"] = args.preset, variant
        results.append(res)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """``source[:key=value,key=value]`` -> (kernel source, config overrides)."""
    source, _, rest = text.partition(":")
    if source not in KERNEL_SOURCES:
        raise ValueError(f"--kernels {text!r}: the source must be one of {KERNEL_SOURCES}")
    return source, parse_overrides([kv for kv in rest.split(",") if kv]) if rest else {}


def with_graph_twins(variants: list[str]) -> list[str]:
    """Each non-reference variant followed by the same variant replayed from CUDA graphs."""
    out = []
    for v in variants:
        out.append(v)
        if not v.startswith("reference"):
            out.append(f"{v}{',' if ':' in v else ':'}cuda_graph=true")
    return out


def table(results: list[dict[str, Any]], preset: str, base_name: str = "default") -> Table:
    """Rich table; speed-up is tokens/s over the ``base_name`` variant's tokens/s."""
    base = next((r.get("tokens_per_s") for r in results if r.get("variant", r["kernels"]) == base_name), None)
    t = Table(title=f"HSTU model, preset {preset}")
    for col in ("variant", "steps", "tokens/s", "ms/step", "TFLOP/s", "MFU", "peak mem GiB", "loss", f"vs {base_name}"):
        t.add_column(col, justify="right")
    t.add_column("graphs (timed) / padding")
    t.add_column("dispatch")
    for r in results:
        if "error" in r:
            t.add_row(r.get("variant", r["kernels"]), "-", "-", "-", "-", "-", "-", "-", "-", "-", r["error"])
            continue
        graphs = "-"
        if r.get("cuda_graph"):
            graphs = f"{r['graph_captures']} ({r['graph_captures_timed']}) / {r['graph_padding_share']:.1%}"
        fb = r["dispatch"]["warnings"]
        t.add_row(
            r.get("variant", r["kernels"]),
            str(r["steps"]),
            f"{r['tokens_per_s']:,.0f}",
            f"{r['step_ms']:.1f}",
            f"{r['tflops']:.1f}",
            "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}",
            "n/a" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']:.2f}",
            f"{r['first_loss']:.3f}->{r['final_loss']:.3f}",
            f"{r['tokens_per_s'] / base:.2f}x" if base else "-",
            graphs,
            f"{len(fb)} fallback(s)" if fb else "ok",
        )
    return t


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="seed", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument(
        "--kernels",
        nargs="+",
        default=["default", "tuned", "reference"],
        help="variants: a kernel source, optionally with config overrides (tuned:layer=fused,precision=bf16)",
    )
    p.add_argument("--base", default=None, help="the variant the speed-up column divides by (default: default)")
    p.add_argument("--cuda-graph", action="store_true", help="also run every variant replayed from CUDA graphs")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--reference-steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--no-prime",
        action="store_true",
        help="skip the untimed pass over the timed batches (compiles of kernels they select land in the timing)",
    )
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, choices=("bf16", "fp32"), help="bf16 (default on GPU) or fp32")
    p.add_argument("--artifacts", default=None, help="tuned artifact directory (default: the packaged artifacts)")
    p.add_argument("--gpu", default=None, help="artifact GPU name (default: detected)")
    p.add_argument(
        "--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides (repeatable)"
    )
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    if args.cuda_graph:
        args.kernels = with_graph_twins(args.kernels)
    out = args.json or (
        os.path.join(os.environ["OUT"], f"bench_model_{args.preset}.json") if os.environ.get("OUT") else None
    )
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        plan(args, device)
        if out:  # written after every variant ran: a folder or an unwritable path would lose them all
            writable_file("--json", out)
    except (ValueError, RuntimeError, CLIError) as e:  # RuntimeError: torch.device's message for a bad --device
        p.error(str(e))
    console = Console(stderr=True)
    results = bench(args, console, device)
    Console(width=max(140, Console().width)).print(table(results, args.preset, args.base or "default"))
    for r in results:
        for w in r.get("dispatch", {}).get("warnings", []):
            console.print(f"[yellow]{r['kernels']}: dispatch fallback:[/yellow] {w}")
    if out:
        Path(out).write_text(json.dumps({"preset": args.preset, "results": results}, indent=2))
        console.print(f"wrote {out}")
    return results


if __name__ == "__main__":
    main()
