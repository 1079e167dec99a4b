"""Benchmark: per-call host cost of each ``validate`` mode of ``autotune.runtime.ops.hstu_attention``.

Times ``--calls`` forward calls on a small jagged batch (so the kernels are short and the host is what
is measured), ``--repeats`` times, and reports medians in microseconds per call:

- ``enqueue_us``: CPU time to issue the calls (synchronised before, not after: the host cost);
- ``wall_us``: the same loop with a synchronisation after it (host + device, whichever bounds);
- ``launches``: CUDA kernels per call (torch.profiler), so "async" shows its one extra launch;
- ``extra_us``: ``enqueue_us`` minus that of ``validate="none"``.

Modes: "none", "async" (default: host shape checks + one check-kernel launch, no sync), "full" (host
shape checks + the offsets read on the host: one sync per call). Also the parts alone: the host shape
check, the check kernel's launch, the host offsets check. Rows go to ``--json`` or
``$OUT/bench_validation.json``.

    python benchmarks/bench_validation.py [--calls 2000] [--repeats 7] [--source default] [--json PATH] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.runtime import dispatch, ops  # noqa: E402
from benchmarks.cli_args import at_least, attention_head_dims, existing_folder, needs_gpu, usage_errors  # noqa: E402
from kernel_templates.hstu_attention import input_check as ic  # noqa: E402
from kernel_templates.hstu_attention.op import validate_hstu_inputs  # noqa: E402


def make_inputs(batch: int, length: int, heads: int, dim: int) -> dict[str, Any]:
    """A small uniform batch: ``batch`` sequences of ``length`` rows, bf16 on the GPU."""
    g = torch.Generator().manual_seed(0)
    rows = batch * length
    q, k, v = (torch.randn(rows, heads, dim, generator=g).to("cuda", torch.bfloat16) for _ in range(3))
    off = torch.arange(0, rows + 1, length, device="cuda", dtype=torch.int64)
    return dict(q=q, k=k, v=v, seq_offsets=off, max_seq_len=length)


def time_loop(fn: Callable[[], object], calls: int, repeats: int) -> tuple[float, float]:
    """(median enqueue us per call, median wall us per call) over ``repeats`` loops of ``calls``."""
    enqueue, wall = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        enqueue.append((t1 - t0) / calls * 1e6)
        wall.append((t2 - t0) / calls * 1e6)
    return statistics.median(enqueue), statistics.median(wall)


def count_launches(fn: Callable[[], object]) -> int:
    """CUDA kernels one call launches (memsets and copies excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    return sum(1 for n in names if "memcpy" not in n.lower() and "memset" not in n.lower())


def profile_calls(fn: Callable[[], object], calls: int, top: int = 30) -> str:
    """cProfile of ``calls`` calls: where the host time of one call goes, by own time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    if args.source == "tuned":
        import autotune

        autotune.load(args.artifacts, allow_same_arch=True)  # the tuned configs, as training loads them
    inp = make_inputs(args.batch, args.length, args.heads, args.dim)
    shape = f"B{args.batch} n{args.length} H{args.heads} D{args.dim} bf16"
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for mode in ("none", "async", "full"):

            def call(mode: str = mode) -> object:
                return ops.hstu_attention(**inp, source=args.source, validate=mode)

            call()  # compile, dispatch
            backend = ",".join(sorted({c.backend for c in dispatch.cached_choices().values()}))
            enq, wall = time_loop(call, args.calls, args.repeats)
            if args.profile and mode == "none":
                print(f"cProfile of {args.calls} calls, validate='none', {args.source}:")
                print(profile_calls(call, args.calls))
            rows.append(dict(what=f"hstu_attention validate={mode!r}", mode=mode, enqueue_us=enq, wall_us=wall,
                             launches=count_launches(call), backend=backend))  # fmt: skip
        q, k, v, off, n = (inp[x] for x in ("q", "k", "v", "seq_offsets", "max_seq_len"))
        parts = {
            "host shape check (validate_hstu_inputs, check_offsets=False)": lambda: validate_hstu_inputs(
                q, k, v, off, n, None, 0, 0, None, check_offsets=False
            ),
            "check kernel launch (launch_offsets_check)": lambda: ic.launch_offsets_check(off, None, q.shape[0], n),
            "host offsets check (check_offsets_host, syncs)": lambda: ic.check_offsets_host(off, None, q.shape[0], n),
        }
        for what, fn in parts.items():
            fn()
            enq, wall = time_loop(fn, args.calls, args.repeats)
            rows.append(dict(what=what, mode=None, enqueue_us=enq, wall_us=wall, launches=None))
    base = rows[0]["enqueue_us"]
    for r in rows:
        r.update(shape=shape, source=args.source, calls=args.calls, repeats=args.repeats,
                 gpu=torch.cuda.get_device_name(), torch=torch.__version__)  # fmt: skip
        if r["mode"] is not None:
            r["extra_us"] = r["enqueue_us"] - base
    return rows


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> str | None:
    """The JSON path, once every option is usable: ``--calls 0`` divided by zero after the first compile, a head
    dim the kernels lack failed in the host shape check's row (it is timed as the kernels take it), and a
    ``--json`` that cannot be written lost the rows at the end."""
    from autotune.tuning.cli_checks import writable_file

    path = args.json or (os.path.join(os.environ["OUT"], "bench_validation.json") if os.environ.get("OUT") else None)
    with usage_errors(p):
        at_least(args, 1, "--calls", "--repeats", "--batch", "--length", "--heads")
        attention_head_dims("--dim", args.dim, kernel=True)
        existing_folder("--artifacts", args.artifacts)
        if path:
            writable_file("--json", path)
    return path


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--source", default="default", choices=["default", "tuned"])
    p.add_argument("--artifacts", default=None, help="artifacts root for --source tuned (default: the shipped ones)")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="print a cProfile of the validate='none' calls")
    args = p.parse_args(argv)
    path = check_options(p, args)
    needs_gpu("bench_validation.py")
    rows = bench(args)
    print(f"{'what':66s} {'enqueue us':>11s} {'wall us':>9s} {'extra us':>9s} {'launches':>8s}")
    for r in rows:
        extra = f"{r['extra_us']:9.2f}" if "extra_us" in r else " " * 9
        launches = str(r["launches"]) if r["launches"] is not None else ""
        backend = r.get("backend", "")
        print(f"{r['what']:66s} {r['enqueue_us']:11.2f} {r['wall_us']:9.2f} {extra} {launches:>8s} {backend}")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(rows, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
