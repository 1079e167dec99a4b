"""Device time per kernel of one attention backward through the public call (tuned), by kernel group.

    python benchmarks/profile_attention_bwd.py --dims 256 128 --lengths 1024 2048 4096 8192 --batch 16

The CuTe backward accumulates dQ in an fp32 buffer that is zero-filled before and converted to the
input dtype after the kernel; this says what share of the backward those two passes take per shape,
from ``torch.profiler`` device times (median over ``--reps`` calls). JSON to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged import _inputs  # noqa: E402
from benchmarks.cli_args import at_least, attention_head_dims, needs_gpu, usage_errors  # noqa: E402
from benchmarks.profile_model import group_of, is_copy  # noqa: E402


def group(name: str) -> str:
    """Kernel group of a CUDA kernel name: the attention and copy kernels as ``profile_model`` tells them,
    and the fill of the fp32 dQ buffer."""
    if group_of(name) == "attention":
        return "attention"
    if is_copy(name):
        return "convert/copy"
    if "fill" in name.lower() or "memset" in name.lower():
        return "zero-fill"
    return "other"


def profile(lengths: list[int], bucket: int, heads: int, d: int, reps: int) -> dict[str, float]:
    """Median device us per kernel group of one backward call."""
    from autotune.runtime.ops import hstu_attention

    q, k, v, do, off = _inputs(lengths, heads, d, 0)
    qg = q.detach().requires_grad_(True)
    out = hstu_attention(qg, k, v, off, bucket, source="tuned")
    for _ in range(3):
        torch.autograd.grad(out, (qg,), do, retain_graph=True)
    per_rep: dict[str, list[float]] = defaultdict(list)
    for _ in range(reps):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            torch.autograd.grad(out, (qg,), do, retain_graph=True)
            torch.cuda.synchronize()
        sums: dict[str, float] = defaultdict(float)
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                sums[group(e.name)] += e.device_time_total
        for g, t in sums.items():
            per_rep[g].append(t)
    return {g: statistics.median(ts) for g, ts in per_rep.items()}


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before the artifacts load: ``--reps 0`` took the median of nothing, a batch of 0 or a head
    dim above the kernels' failed in the first shape, and a ``--json`` that cannot be written lost every row."""
    from autotune.tuning.cli_checks import writable_file

    with usage_errors(p):
        attention_head_dims("--dims", args.dims, kernel=False)  # the public call pads a smaller head dim
        at_least(args, 1, "--lengths", "--batch", "--heads", "--reps")
        if args.json:
            writable_file("--json", args.json)


def main(argv: list[str] | None = None) -> None:
    import autotune

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    check_options(p, args)
    needs_gpu("profile_attention_bwd.py")
    autotune.load()
    rows = []
    for d in args.dims:
        for n in args.lengths:
            us = profile([n] * args.batch, n, args.heads, d, args.reps)
            total = sum(us.values())
            row = {"d": d, "len": n, "batch": args.batch, "heads": args.heads, "gpu": torch.cuda.get_device_name(),
                   "us": {g: round(t, 1) for g, t in us.items()},
                   "share": {g: round(t / total, 4) for g, t in us.items()}}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
