"""Triton HSTU backward configs timed whole and per kernel (GPU), to see which part to tune.

Each config is the positional fields of ``HSTUBwdConfig`` as comma-separated values, e.g.
``32,128,8,2,separate,0,8,1,64`` = block_m 32, block_n 128, 8 warps, 2 stages, separate dQ, dq_block_m
0 (= block_m), l2_group 8, dkv_split on, dq_block_n 64. Trailing fields may be left out (defaults).
The whole backward is timed with ``benchmarks.rows.time_ms`` (warm-up, L2 flush; p20/p50/p80, TFLOP/s
from p50); the split between the key-block passes and the dQ kernel comes from ``torch.profiler`` device
times over the same call. Every config is first checked against the reference on a small jagged batch
(one that fails is not timed). Rows go to ``benchmarks/results/sweep_triton_bwd.jsonl`` and to ``--json``.

    python benchmarks/sweep_triton_bwd.py --dim 256 --n 4096 --dist uniform \
        --configs 64,64,8,2,separate 32,128,8,2,separate,0,8,1 [--json $OUT/sweep.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import triton
from bench_hstu_triton import bench_inputs, small_check  # the defaults' benchmark's batch and check

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import (  # noqa: E402
    at_least,
    attention_head_dims,
    length_distributions,
    needs_gpu,
    usage_errors,
)
from benchmarks.rows import append_rows, environment, time_ms  # noqa: E402
from kernel_templates.hstu_attention import (  # noqa: E402
    HSTUBwdConfig,
    default_bwd_config,
    default_fwd_config,
)
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd  # noqa: E402


def parse_config(text: str) -> HSTUBwdConfig:
    """``HSTUBwdConfig`` from its positional fields as CSV (see the module docstring)."""
    fields = dataclasses.fields(HSTUBwdConfig)
    parts = text.split(",")
    if len(parts) > len(fields):
        raise ValueError(f"config {text!r}: at most {len(fields)} fields ({', '.join(f.name for f in fields)})")
    kw = {}
    for f, raw in zip(fields, parts, strict=False):
        if f.name == "dq_mode":
            kw[f.name] = raw
        elif f.name == "dkv_split":
            kw[f.name] = raw.lower() in ("1", "true", "split")
        else:
            kw[f.name] = int(raw)
    return HSTUBwdConfig(**kw)


def kernel_split_ms(fn, reps: int = 10) -> dict[str, float]:
    """Mean device ms per call of each Triton kernel that ``fn`` launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for ev in prof.key_averages():
        us = getattr(ev, "self_device_time_total", 0.0)
        if us > 0 and "_hstu_bwd" in ev.key:
            out[ev.key] = us / 1e3 / reps
    return out


def time_config(bc: HSTUBwdConfig, n: int, dim: int, dist: str, batch: int, heads: int) -> dict:
    inp, args, _, bwd_flops = bench_inputs(n, dim, dist, batch, heads)
    do = torch.randn_like(inp.v)

    def fn():
        return hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, bc)

    t = time_ms(fn)
    ms = t["p50_ms"]  # the number printed, under the key earlier JSON readers use
    parts = kernel_split_ms(fn)
    shape = dict(n=n, dim=dim, dist=dist, batch=batch, heads=heads, tokens=int(inp.seq_offsets[-1]))
    return dict(shape, cfg=bc.to_dict(), **t, ms=ms, tflops=bwd_flops / ms * 1e-9, parts=parts)


def check_options(p: argparse.ArgumentParser, a: argparse.Namespace) -> list[HSTUBwdConfig]:
    """The configs to time, once every option is usable: a malformed ``--configs`` value, a head dim no Triton
    kernel has, a misspelt ``--dist`` or a batch of 0 was a traceback or a failed row per config, and a
    ``--json`` that cannot be written lost every row at the end."""
    from autotune.tuning.cli_checks import writable_file

    with usage_errors(p):
        attention_head_dims("--dim", a.dim, kernel=True)
        at_least(a, 1, "--n", "--batch", "--heads")
        length_distributions("--dist", a.dist)
        if a.json:
            writable_file("--json", a.json)
        configs = []
        for text in a.configs:
            try:
                configs.append(parse_config(text))
            except (ValueError, TypeError) as e:
                raise ValueError(f"--configs {text!r}: {e}") from None
    return configs or [default_bwd_config(a.dim, a.dim)]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", nargs="+", default=[], help="positional HSTUBwdConfig fields, CSV; none = default")
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n", type=int, nargs="+", default=[4096])
    p.add_argument("--dist", nargs="+", default=["uniform"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--no-check", action="store_true", help="skip the small-batch correctness check")
    p.add_argument("--json", default=None, help="also write the rows here (one JSON file)")
    p.add_argument("--no-save", action="store_true", help="do not append rows to benchmarks/results")
    a = p.parse_args(argv)
    configs = check_options(p, a)
    needs_gpu("sweep_triton_bwd.py")  # torch's "not compiled with CUDA" AssertionError traceback otherwise
    print(f"GPU: {torch.cuda.get_device_name()} torch {torch.__version__} triton {triton.__version__}", flush=True)
    rows = []
    for bc in configs:
        t0 = time.time()
        try:
            if not a.no_check:
                small_check(a.dim, default_fwd_config(a.dim, a.dim), bc)
            for dist in a.dist:
                for n in a.n:
                    r = time_config(bc, n, a.dim, dist, a.batch, a.heads)
                    rows.append(r)
                    parts = " + ".join(f"{k.split('_hstu_bwd_')[-1]} {v:.2f}" for k, v in r["parts"].items())
                    print(
                        f"d{a.dim} {dist} n={n} {bc}: {r['tflops']:.1f} TFLOP/s ({r['ms']:.3f} ms; {parts})"
                        f" [{time.time() - t0:.0f}s]",
                        flush=True,
                    )
        except Exception as e:  # a config over the smem limit, or a wrong one, is reported and skipped
            print(f"d{a.dim} {bc}: FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
            rows.append(dict(dim=a.dim, cfg=bc.to_dict(), error=f"{type(e).__name__}: {str(e)[:300]}"))
    if not a.no_save:
        append_rows("sweep_triton_bwd", rows)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), env=environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
