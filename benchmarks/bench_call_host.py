"""Host time per call of the public HSTU attention call and of its pieces, on a GPU (rows to call_host.jsonl).

    python benchmarks/bench_call_host.py --head-dim 256 --length 1024 --batches 1 16 --sources tuned default

A short call is host-bound when the host needs longer to enqueue it than the GPU to run it. Each case is
timed as the host's enqueue time of blocks of ``--calls`` calls (the GPU is synchronised between blocks,
so its launch queue never fills and throttles the host); p20 / p50 / p80 are over ``--blocks`` blocks.
Cases: the public call without and with autograd, the autograd backward alone, a whole training step,
the chosen backend's forward and backward launchers called directly, and two yardsticks measured in the
same run: one plain torch kernel launch and an autograd step through a trivial ``autograd.Function``.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.rows import append_rows  # noqa: E402


def host_us(fn: Callable[[], Any], calls: int, blocks: int, before_block: Callable[[], None] | None = None) -> dict:
    """p20 / p50 / p80 host microseconds per call of ``fn`` over ``blocks`` blocks of ``calls`` calls."""
    from autotune.tuning.measure import quantile

    for i in range(max(3, calls // 4)):  # warm-up: more calls than a block when blocks are short
        if before_block is not None and i % calls == 0:
            before_block()
        fn()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(blocks):
        if before_block is not None:
            before_block()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        per_call.append((time.perf_counter() - t0) * 1e6 / calls)
        torch.cuda.synchronize()
    return {f"us_p{q}": round(quantile(per_call, q / 100), 2) for q in (20, 50, 80)}


class _Trivial(torch.autograd.Function):
    """The autograd engine's own cost: a forward and backward that only allocate their outputs."""

    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(v)

    @staticmethod
    def backward(ctx, g):
        return torch.empty_like(g), torch.empty_like(g), torch.empty_like(g)


def cases(d: int, heads: int, batch: int, n: int, source: str, calls: int) -> list[tuple[str, dict, Callable]]:
    """(case name, extra row fields, callable) of one shape and kernel source."""
    from autotune.runtime import dispatch, ops
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    inp = make_jagged_inputs([n] * batch, heads, d, d, torch.bfloat16, "cuda", seed=0, max_seq_len=n)
    q, k, v = (t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    qd, kd, vd = inp.q.detach(), inp.k.detach(), inp.v.detach()
    off, do = inp.seq_offsets, torch.randn_like(inp.v)
    fill = dispatch.call_fill(q.shape[0], batch, n)
    fb, fc, bb, bc = ops._choose(q.dtype, d, d, heads, n, None, source, "causal", fill)
    info = {"backend_fwd": fb, "backend_bwd": bb}
    alpha = 1.0 / math.sqrt(d)
    pending: list[torch.Tensor] = []

    def refill() -> None:  # the outputs whose backward a block times, built outside the timed region
        pending.clear()
        pending.extend(ops.hstu_attention(q, k, v, off, n, source=source) for _ in range(calls))

    def bwd() -> None:
        pending.pop().backward(do)

    def step() -> None:
        q.grad = k.grad = v.grad = None
        ops.hstu_attention(q, k, v, off, n, source=source).backward(do)

    fresh: list[torch.Tensor] = []

    def new_offsets() -> None:  # a batch's own offsets tensor per step, as in training: every memo misses
        fresh.clear()
        fresh.extend(off.clone() for _ in range(calls))

    def step_new_offsets() -> None:
        q.grad = k.grad = v.grad = None
        ops.hstu_attention(q, k, v, fresh.pop(), n, source=source).backward(do)

    def trivial() -> None:
        q.grad = k.grad = v.grad = None
        _Trivial.apply(q, k, v).backward(do)

    out = [
        ("public fwd, no grad", info, lambda: ops.hstu_attention(qd, kd, vd, off, n, source=source), None),
        ("public fwd, grad", info, lambda: ops.hstu_attention(q, k, v, off, n, source=source), None),
        ("public bwd (autograd)", info, bwd, refill),
        ("public step (fwd + bwd)", info, step, None),
        ("public step, new offsets tensor", info, step_new_offsets, new_offsets),
        ("torch kernel launch", {}, lambda: do.add_(0), None),
        ("trivial autograd step", {}, trivial, None),
    ]
    if fb != "reference":
        launch_f, cfg_f, index = dispatch.runner(fb, ops.FWD, fc)
        off_f = off if index is None else off.to(index)
        fwd_args = (qd, kd, vd, off_f, n, alpha, None, 0, 0, None, cfg_f)
        out.append(("fwd launcher", {**info, "config": fc}, lambda: launch_f(*fwd_args), None))
    if bb != "reference":
        launch_b, cfg_b, index = dispatch.runner(bb, ops.BWD, bc)
        off_b = off if index is None else off.to(index)
        bwd_args = (do, qd, kd, vd, off_b, n, alpha, None, 0, 0, None, cfg_b)
        out.append(("bwd launcher", {**info, "config": bc}, lambda: launch_b(*bwd_args), None))
    return out


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors naming the option for counts no timing can use (``--calls 0`` divided by zero, ``--blocks 0``
    took a quantile of nothing, both after the artifacts loaded and the inputs were built)."""
    from benchmarks.cli_args import at_least, attention_head_dims, usage_errors

    with usage_errors(p):
        at_least(args, 1, "--calls", "--blocks", "--length", "--heads", "--batches")
        attention_head_dims("--head-dim", args.head_dim, kernel=False)  # the public call pads a smaller head dim


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--sources", nargs="+", default=["tuned", "default"], choices=("tuned", "default"))
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--blocks", type=int, default=21)
    args = p.parse_args(argv)
    check_options(p, args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_call_host.py needs a CUDA GPU")
    import autotune

    autotune.load()
    rows = []
    for source in args.sources:
        for batch in args.batches:
            for name, extra, fn, before in cases(args.head_dim, args.heads, batch, args.length, source, args.calls):
                stats = host_us(fn, args.calls, args.blocks, before)
                row = {"bench": "call_host", "case": name, "source": source, "d": args.head_dim,
                       "heads": args.heads, "batch": batch, "length": args.length, **extra, **stats}  # fmt: skip
                rows.append(row)
                print(f"{source:8s} b{batch:<3d} {name:28s} {stats['us_p50']:8.1f} us  (p20 {stats['us_p20']}, "
                      f"p80 {stats['us_p80']})", flush=True)  # fmt: skip
    append_rows("call_host", rows)


if __name__ == "__main__":
    main()
