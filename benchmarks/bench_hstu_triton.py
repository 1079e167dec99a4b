"""GPU benchmark of the Triton HSTU attention templates (forward and backward TFLOP/s).

Times with ``benchmarks.rows.time_ms`` (warm-up, L2 flush between samples; p20/p50/p80, TFLOP/s from
p50), on random jagged inputs, after checking each timed config against the reference on a small batch
(a sweep config is checked with the other direction's default). FLOPs follow HSTU.md:
fwd = 2H(Dqk+Dv)P, bwd = 2H(3Dqk+2Dv)P. Rows (GPU, versions, git sha, shape, ``fwd_``/``bwd_`` p20/p50/p80)
are appended to ``benchmarks/results/hstu_triton.jsonl``; ``--json`` (default ``$OUT/bench_triton.json``)
also writes them, as before, to one file.

    python benchmarks/bench_hstu_triton.py --lengths 1024 2048 4096 8192 --dims 256 \
        --dist uniform jagged [--sweep] [--json $OUT/triton.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune.runtime.buckets import sequence_lengths  # noqa: E402
from benchmarks.cli_args import (  # noqa: E402
    at_least,
    attention_head_dims,
    l2_groups,
    length_distributions,
    needs_gpu,
    usage_errors,
)
from benchmarks.rows import append_rows, environment, time_ms  # noqa: E402
from kernel_templates.hstu_attention import (  # noqa: E402
    HSTUBwdConfig,
    HSTUFwdConfig,
    default_bwd_config,
    default_fwd_config,
    hstu_attention_flops,
    hstu_attention_reference,
)
from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs  # noqa: E402
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd  # noqa: E402
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd  # noqa: E402

FWD_SWEEP = [
    HSTUFwdConfig(bm, bn, w, s)
    for bm, bn, w, s in [
        (128, 64, 8, 2),
        (128, 64, 8, 3),
        (128, 128, 8, 2),
        (64, 64, 4, 2),
        (64, 128, 4, 2),
        (128, 32, 8, 2),
        (128, 64, 4, 2),
        (64, 64, 4, 3),
        (128, 128, 8, 1),
    ]
]
BWD_SWEEP = [
    HSTUBwdConfig(bm, bn, w, s, mode)
    for bm, bn, w, s, mode in [
        (64, 64, 8, 2, "atomic"),
        (64, 64, 4, 2, "atomic"),
        (32, 64, 4, 2, "atomic"),
        (64, 128, 8, 2, "atomic"),
        (32, 128, 8, 2, "atomic"),
        (64, 64, 8, 1, "atomic"),
        (128, 64, 8, 2, "atomic"),
        (64, 64, 8, 2, "separate"),
        (64, 128, 8, 1, "atomic"),
        (64, 64, 8, 2, "tma"),
        (64, 64, 8, 1, "tma"),
        (32, 64, 4, 2, "tma"),
        (64, 32, 4, 2, "tma"),
        (32, 64, 8, 2, "tma"),
        (64, 128, 8, 1, "tma"),
        (128, 64, 8, 1, "tma"),
    ]
] + [
    HSTUBwdConfig(bm, bn, w, s, mode, dqm, dkv_split=True)
    for bm, bn, w, s, mode, dqm in [
        (64, 64, 8, 2, "separate", 0),
        (64, 64, 8, 2, "separate", 128),
        (64, 128, 8, 2, "separate", 0),
        (64, 128, 8, 1, "separate", 0),
        (32, 128, 8, 2, "separate", 0),
        (64, 64, 4, 2, "separate", 0),
        (64, 64, 8, 2, "tma", 0),
    ]
]


def small_check(dim: int, fc: HSTUFwdConfig, bc: HSTUBwdConfig) -> None:
    """Correctness of a config on a small jagged bf16 batch (raises AssertionError when wrong)."""
    inp = make_jagged_inputs([300, 1, 0, 257, 64], 2, dim, dim, torch.bfloat16, "cuda", seed=1)
    args = (inp.seq_offsets, inp.max_seq_len, dim**-0.5, None, 0, 0, None)
    out = hstu_attention_fwd(inp.q, inp.k, inp.v, *args, fc)
    do = torch.randn_like(out)
    dq, dk, dv = hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, bc)
    leaves = [t.detach().requires_grad_(True) for t in (inp.q, inp.k, inp.v)]
    ref = hstu_attention_reference(*leaves, *args).float()
    rg = torch.autograd.grad(ref, leaves, do.float())
    low = hstu_attention_reference(*leaves, *args, compute_dtype=torch.bfloat16)
    lg = torch.autograd.grad(low, leaves, do)
    for name, a, r, lo in zip(("out", "dq", "dk", "dv"), (out, dq, dk, dv), (ref, *rg), (low, *lg), strict=True):
        check_tolerance(name, a, r, lo)


def bench_inputs(n: int, dim: int, dist: str, batch: int, heads: int):
    """(inputs, launch args after q/k/v, fwd FLOPs, bwd FLOPs) of one benchmark batch: bf16, causal,
    lengths from the tuner's declared distributions, longest sequence ``n``."""
    lengths = sequence_lengths(n, batch, dist, seed=0)
    inp = make_jagged_inputs(lengths, heads, dim, dim, torch.bfloat16, "cuda", seed=2, max_seq_len=n)
    args = (inp.seq_offsets, n, dim**-0.5, None, 0, 0, None)
    return inp, args, *hstu_attention_flops(inp.seq_offsets, heads, dim, dim)


def timed(prefix: str, fn: Callable[[], object]) -> dict[str, float]:
    """``time_ms`` of ``fn`` as ``<prefix>_p20_ms`` .. ``<prefix>_samples``, plus ``<prefix>_ms`` = p50 (the
    number the tables print, under the key earlier JSON readers use)."""
    t = time_ms(fn)
    return {**{f"{prefix}_{k}": v for k, v in t.items()}, f"{prefix}_ms": t["p50_ms"]}


def bench_one(n: int, dim: int, dist: str, fc, bc, batch: int, heads: int) -> dict:
    inp, args, fwd_flops, bwd_flops = bench_inputs(n, dim, dist, batch, heads)
    row = dict(n=n, dim=dim, dist=dist, batch=batch, heads=heads, tokens=int(inp.seq_offsets[-1]))
    if fc is not None:
        out = torch.empty_like(inp.v)
        row.update(
            fwd_cfg=fc.to_dict(), **timed("fwd", lambda: hstu_attention_fwd(inp.q, inp.k, inp.v, *args, fc, out=out))
        )
        row["fwd_tflops"] = fwd_flops / row["fwd_ms"] * 1e-9
    if bc is not None:
        do = torch.randn_like(inp.v)
        row.update(bwd_cfg=bc.to_dict(), **timed("bwd", lambda: hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, bc)))
        row["bwd_tflops"] = bwd_flops / row["bwd_ms"] * 1e-9
    return row


def check_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Usage errors before the GPU is touched: a head dim no Triton kernel has, a misspelt ``--dist`` or a batch
    of 0 failed after earlier shapes were timed, and a ``--json`` that cannot be written lost every row."""
    from autotune.tuning.cli_checks import writable_file

    with usage_errors(p):
        attention_head_dims("--dims", a.dims, kernel=True)
        at_least(a, 1, "--lengths", "--batch", "--heads", "--sweep-len")
        length_distributions("--dist", a.dist)
        l2_groups("--l2-groups", a.l2_groups)
        if a.json:
            writable_file("--json", a.json)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dims", type=int, nargs="+", default=[256])
    p.add_argument("--dist", nargs="+", default=["uniform", "jagged"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--sweep", action="store_true", help="time the sweep configs at --sweep-len first")
    p.add_argument("--sweep-len", type=int, default=4096)
    p.add_argument("--sweep-kind", choices=["fwd", "bwd", "both"], default="both")
    p.add_argument(
        "--l2-groups", type=int, nargs="+", default=None, help="time the defaults with each launch-order l2_group"
    )
    p.add_argument("--json", default=None, help="also write the rows here (default: $OUT/bench_triton.json)")
    p.add_argument("--no-save", action="store_true", help="do not append rows to benchmarks/results")
    a = p.parse_args(argv)
    check_options(p, a)
    needs_gpu("bench_hstu_triton.py")
    rows: list[dict] = []
    t0 = time.time()
    print(f"GPU: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    if a.sweep:
        for dim in a.dims:
            for fc in FWD_SWEEP if a.sweep_kind != "bwd" else []:
                try:
                    small_check(dim, fc, default_bwd_config(dim, dim))  # raises when wrong: not timed
                    r = bench_one(a.sweep_len, dim, "uniform", fc, None, a.batch, a.heads)
                    print(f"sweep fwd d{dim} {fc}: {r['fwd_tflops']:.1f} TFLOP/s", flush=True)
                    rows.append(dict(r, kind="sweep"))
                except Exception as e:  # a config that does not compile (smem) is reported, not fatal
                    print(f"sweep fwd d{dim} {fc}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
            for bc in BWD_SWEEP if a.sweep_kind != "fwd" else []:
                try:
                    small_check(dim, default_fwd_config(dim, dim), bc)  # raises when wrong: not timed
                    r = bench_one(a.sweep_len, dim, "uniform", None, bc, a.batch, a.heads)
                    print(f"sweep bwd d{dim} {bc}: {r['bwd_tflops']:.1f} TFLOP/s", flush=True)
                    rows.append(dict(r, kind="sweep"))
                except Exception as e:
                    print(f"sweep bwd d{dim} {bc}: FAILED {type(e).__name__}: {str(e)[:120]}", flush=True)
    for dim in a.dims:
        fc0, bc0 = default_fwd_config(dim, dim), default_bwd_config(dim, dim)
        for group in a.l2_groups or [None]:
            fc, bc = fc0, bc0
            if group is not None:
                fc, bc = dataclasses.replace(fc0, l2_group=group), dataclasses.replace(bc0, l2_group=group)
            small_check(dim, fc, bc)
            for dist in a.dist:
                for n in a.lengths:
                    r = bench_one(n, dim, dist, fc, bc, a.batch, a.heads)
                    rows.append(dict(r, kind="default"))
                    print(
                        f"default d{dim} l2_group={fc.l2_group} {dist:8s} n={n:5d}: fwd {r['fwd_tflops']:6.1f} TFLOP/s"
                        f" ({r['fwd_ms']:.3f} ms)  bwd {r['bwd_tflops']:6.1f} TFLOP/s ({r['bwd_ms']:.3f} ms)",
                        flush=True,
                    )
    print(f"total {time.time() - t0:.0f} s")
    if not a.no_save:
        append_rows("hstu_triton", rows)
    path = a.json or (os.path.join(os.environ["OUT"], "bench_triton.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), env=environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
