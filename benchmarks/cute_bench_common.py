"""What the CuTe-vs-Triton attention benchmarks (bench_cute.py, bench_cute_bwd.py) share.

The command line, the masks and short jagged lengths of the small reference check, the timing row,
the config feasibility filter and the main loop (check every config, then time every shape, writing
the JSON after each step so a time limit keeps what was measured). Each script supplies its configs,
its small check and its per-shape timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import triton

# mask name -> (contextual_seq_len, with num_targets, max_attn_len)
MASKS = {
    "causal": (0, False, 0),
    "targets": (0, True, 0),
    "context": (7, False, 0),
    "window": (0, False, 100),
    "all": (5, True, 60),
}
# Empty, length-1 and non-tile-multiple sequences for the small reference check.
CHECK_LENGTHS = [0, 1, 77, 300, 129, 0, 513]


def parse_args(extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dist", nargs="+", default=["uniform", "jagged"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", type=int, default=None, help="time only the first N configs per head dim")
    p.add_argument("--l2-groups", type=int, nargs="+", default=None, help="time each config with each l2_group")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--json", default=None)
    if extra is not None:
        extra(p)
    return p.parse_args()


def time_row(rows: list[dict], backend: str, cfg: Any, fn: Callable[[], Any], flops: float, **shape: Any) -> None:
    """Median ``do_bench`` time of ``fn`` (warm-up, L2 flush) as a row of ``rows``, printed as it lands."""
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    tf = flops / ms / 1e9
    rows.append(dict(backend=backend, config=cfg.to_dict(), **shape, median_ms=ms, tflops=tf))
    d, n, dist = shape["dqk"], shape["len"], shape["dist"]
    print(f"  {backend:6s} d={d} n={n:5d} {dist:7s} {cfg.to_dict()}: {ms:.3f} ms {tf:6.1f} TFLOP/s", flush=True)


def feasible(check: Callable[[], None], cfg: Any, d: int) -> bool:
    """``check()`` raises ValueError for a config the launcher would reject: say so and skip it."""
    try:
        check()
    except ValueError as e:
        print(f"skip {cfg.to_dict()} d={d}: {e}")
        return False
    return True


def write_json(path: str | None, default_name: str, result: dict) -> None:
    path = path or (os.path.join(os.environ["OUT"], default_name) if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def run(
    a: argparse.Namespace,
    configs_for: Callable[[int, str], list],
    small_check: Callable[[Any, int, torch.dtype], dict],
    bench_shape: Callable[..., list[dict]],
    tag: Callable[[Any, int], str],
    json_name: str,
) -> None:
    """Check each feasible config against the reference, then time every (dim, length, distribution)."""
    dtype = getattr(torch, a.dtype)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    result = dict(device=dev, checks={}, rows=[])
    for d in a.dims:
        configs = configs_for(d, a.dtype)[: a.configs]
        if a.l2_groups:
            configs = [dataclasses.replace(c, l2_group=g) for c in configs for g in a.l2_groups]
        if not a.skip_check:
            for cfg in configs:
                t = time.time()
                errs = small_check(cfg, d, dtype)
                result["checks"][tag(cfg, d)] = errs
                print(f"check d={d} {cfg.to_dict()}: {errs} ({time.time() - t:.1f}s)", flush=True)
                write_json(a.json, json_name, result)
        for n in a.lengths:
            for dist in a.dist:
                result["rows"] += bench_shape(d, n, dist, dtype, a.batch, a.heads, configs)
                write_json(a.json, json_name, result)
