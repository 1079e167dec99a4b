"""Where a training step of the HSTU model spends its GPU time, per kernel (torch.profiler).

    python benchmarks/profile_model.py --preset seed --kernels default tuned --steps 3

Trains ``--warmup`` untimed steps (compilation, allocator growth), then profiles ``--steps`` steps
and prints, per kernel source, the CUDA kernels with the most total device time (per step) and the
share of the step they take, grouped into attention / GEMM / other. Writes JSON to ``--json`` or
``$OUT/profile_model_<preset>.json``. The totals are device-busy time: they do not include host gaps.
``--by-op`` adds the device time of each aten operator with its input shapes, which names the call
behind an "other" kernel (a cast, a residual add, a bias gradient's sum).
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
from models.config import KERNEL_SOURCES, PRESETS, get_config  # noqa: E402
from models.data import make_loader  # noqa: E402
from models.train import autocast_context, build, parse_overrides, train_step  # noqa: E402

# Substrings of kernel names -> group (first match wins).
GROUPS = (
    ("attention", ("hstu_fwd", "hstu_bwd", "HSTUFwd", "HSTUBwd")),
    ("gemm", ("gemm", "Gemm", "sm90_xmma", "nvjet", "cutlass")),
)


# Kernels that only move or cast data: torch's copy/cast kernels and cat (CuTe kernel names contain
# "CopyAtom" from their template arguments: not copies).
COPY_KEYS = ("copy_kernel", "CatArrayBatchedCopy")


def is_copy(name: str) -> bool:
    return any(k in name for k in COPY_KEYS)


def group_of(name: str) -> str:
    for group, keys in GROUPS:
        if any(k in name for k in keys):
            return group
    return "other"


def _by_op(prof: Any, steps: int) -> list[dict]:
    """Device time per step of each aten operator and input shapes, outermost first: which call launched the
    "other" kernels (a parent's time includes its children's, so an ``aten::linear`` row holds its addmm)."""
    rows = []
    for ev in prof.key_averages(group_by_input_shape=True):
        ms = getattr(ev, "device_time_total", 0.0) / 1e3 / steps
        if ev.device_type == torch.autograd.DeviceType.CPU and ev.key.startswith("aten::") and ms >= 0.05:
            rows.append(dict(op=ev.key, shapes=str(ev.input_shapes), ms_per_step=ms, calls=ev.count // steps))
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:60]


def profile_source(
    preset: str, kernels: str, steps: int, warmup: int, artifacts: str, overrides: dict, by_op: bool = False
) -> dict:
    """Per-kernel device time (ms per step) for one kernel source; with ``by_op`` also per aten operator."""
    cfg = get_config(preset, **{**overrides, "kernels": kernels})
    device = torch.device("cuda")
    if kernels == "tuned":
        import autotune

        autotune.load(artifacts)
    model, opt = build(cfg, device)
    amp = autocast_context(device, "bf16")
    loader = iter(make_loader(cfg, warmup + steps, pin=True))
    for _ in range(warmup):
        train_step(model, opt, next(loader).to(device), amp)
    batches = [next(loader).to(device) for _ in range(steps)]
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=by_op) as prof:
        for batch in batches:
            train_step(model, opt, batch, amp)
        torch.cuda.synchronize()
    ops = _by_op(prof, steps) if by_op else []
    rows = []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "self_device_time_total", 0.0)
        if dev_us > 0 and ev.device_type == torch.autograd.DeviceType.CUDA:
            rows.append(dict(name=ev.key, ms_per_step=dev_us / 1e3 / steps, calls=ev.count // steps))
    rows.sort(key=lambda r: -r["ms_per_step"])
    total = sum(r["ms_per_step"] for r in rows)
    groups: dict[str, float] = {}
    for r in rows:
        r["group"] = group_of(r["name"])
        groups[r["group"]] = groups.get(r["group"], 0.0) + r["ms_per_step"]
    copies = [r for r in rows if is_copy(r["name"])]
    copy_kernels = {"calls": sum(r["calls"] for r in copies), "ms_per_step": sum(r["ms_per_step"] for r in copies)}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    dispatch.reset()
    overrides = {k: v for k, v in overrides.items() if k != "kernels"}
    return dict(kernels=kernels, overrides=overrides, device_ms_per_step=total, groups=groups,
                copy_kernels=copy_kernels, top=rows[:40], ops=ops)  # fmt: skip


def show(result: dict, console: Console, top: int) -> None:
    total = result["device_ms_per_step"]
    groups = ", ".join(f"{g} {ms:.1f} ms ({ms / total:.0%})" for g, ms in sorted(result["groups"].items()))
    cp = result["copy_kernels"]
    label = " ".join([result["kernels"], *(f"{k}={v}" for k, v in result.get("overrides", {}).items())])
    t = Table(
        title=f"{label}: {total:.1f} ms of device time per step; {groups}; "
        f"copy kernels {cp['calls']} calls, {cp['ms_per_step']:.1f} ms"
    )
    for col in ("ms/step", "share", "calls/step", "group", "kernel"):
        t.add_column(col, justify="right" if col != "kernel" else "left")
    for r in result["top"][:top]:
        name = r["name"] if len(r["name"]) < 90 else r["name"][:87] + "..."
        t.add_row(f"{r['ms_per_step']:.2f}", f"{r['ms_per_step'] / total:.1%}", str(r["calls"]), r["group"], name)
    console.print(t)
    if result.get("ops"):
        t = Table(title="per aten operator (a parent's time includes its children's)")
        for col in ("ms/step", "calls/step", "operator", "input shapes"):
            t.add_column(col, justify="right" if col.startswith(("ms", "calls")) else "left")
        for r in result["ops"][:top]:
            t.add_row(f"{r['ms_per_step']:.2f}", str(r["calls"]), r["op"], r["shapes"][:80])
        console.print(t)


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace, out: str | None) -> dict[str, Any]:
    """The ``--set`` overrides, once every option is usable: a bad preset, override or step count, or a ``--json``
    that cannot be written, is a usage error before the first source is profiled, not a traceback after it (the
    JSON, written last, lost every profile)."""
    from autotune.tuning.cli import CLIError
    from autotune.tuning.cli_checks import int_in, writable_file

    try:
        overrides = parse_overrides(args.set)
        if "kernels" in overrides:
            raise ValueError("--set kernels=...: the kernel source is each --kernels value's own")
        for kernels in args.kernels:
            get_config(args.preset, **{**overrides, "kernels": kernels})
        int_in("--steps", args.steps, 1)
        int_in("--warmup", args.warmup, 0)
        if out:
            writable_file("--json", out)
    except (ValueError, CLIError) as e:
        p.error(str(e))
    return overrides


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="seed", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--kernels", nargs="+", default=["default", "tuned"], choices=KERNEL_SOURCES)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument(
        "--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides (repeatable)"
    )
    p.add_argument("--json", default=None)
    p.add_argument("--by-op", action="store_true", help="also device time per aten operator and input shapes")
    args = p.parse_args(argv)
    out = args.json or (
        os.path.join(os.environ["OUT"], f"profile_model_{args.preset}.json") if os.environ.get("OUT") else None
    )
    overrides = check_options(p, args, out)
    if not torch.cuda.is_available():
        raise SystemExit("profile_model.py needs a CUDA GPU")
    console = Console(width=160)
    results = []
    for kernels in args.kernels:
        res = profile_source(args.preset, kernels, args.steps, args.warmup, args.artifacts, overrides, args.by_op)
        show(res, console, args.top)
        results.append(res)
    if out:
        Path(out).write_text(json.dumps({"preset": args.preset, "results": results}, indent=2))
    return results


if __name__ == "__main__":
    main()
