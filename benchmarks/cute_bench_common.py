"""What the CuTe-vs-Triton attention benchmarks (bench_cute.py, bench_cute_bwd.py) share.

The command line, the masks and short jagged lengths of the small reference check, the timing row
(``benchmarks.rows.time_ms``: p20/p50/p80, the tables print p50), the config feasibility filter and the
main loop (check every config, then time every shape with the configs that passed, appending the rows to
``benchmarks/results/<name>.jsonl`` and writing the JSON after each step so a time limit keeps what was
measured). Each script supplies its configs, its small check and its per-shape timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cli_args import usage_errors  # noqa: E402
from benchmarks.rows import append_rows, environment, time_ms  # noqa: E402

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


def parse_args(
    argv: list[str] | None = None,
    dims: tuple[int, ...] | None = None,
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
) -> argparse.Namespace:
    """The shared command line, checked (``check_options``); ``dims``: the head dims the script has configs for."""
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dist", nargs="+", default=["uniform", "jagged"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--configs", type=int, default=None, help="time only the first N configs per head dim")
    p.add_argument("--l2-groups", type=int, nargs="+", default=None, help="time each config with each l2_group")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--json", default=None, help="also write checks and rows here (default: $OUT/bench_cute*.json)")
    p.add_argument("--no-save", action="store_true", help="do not append rows to benchmarks/results")
    if extra is not None:
        extra(p)
    a = p.parse_args(argv)
    check_options(p, a, dims)
    return a


def check_options(p: argparse.ArgumentParser, a: argparse.Namespace, dims: tuple[int, ...] | None) -> None:
    """Usage errors before the first compile: a head dim without CuTe configs timed Triton alone, ``--configs 0``
    timed no CuTe config, a misspelt ``--dist`` failed after the first shapes; ``--json`` is first written after
    the first config's check, so a bad path would end the run there."""
    from autotune.tuning.cli_checks import writable_file
    from benchmarks.cli_args import at_least, attention_head_dims, l2_groups, length_distributions

    with usage_errors(p):
        attention_head_dims("--dims", a.dims, kernel=True)
        lacking = [d for d in a.dims if dims is not None and d not in dims]
        if lacking:
            raise ValueError(f"--dims: no CuTe configs for head dim(s) {lacking}; this script has them for {dims}")
        at_least(a, 1, "--lengths", "--batch", "--heads", "--configs")
        length_distributions("--dist", a.dist)
        l2_groups("--l2-groups", a.l2_groups)
        if a.json:
            writable_file("--json", a.json)


def time_row(rows: list[dict], backend: str, cfg: Any, fn: Callable[[], Any], flops: float, **shape: Any) -> None:
    """``time_ms`` of ``fn`` (warm-up, L2 flush) as a row of ``rows``, printed as it lands; ``median_ms`` is
    p50 (the number printed, under the key earlier JSON readers use)."""
    t = time_ms(fn, rep_ms=100)
    ms = t["p50_ms"]
    tf = flops / ms / 1e9
    rows.append(dict(backend=backend, config=cfg.to_dict(), **shape, **t, median_ms=ms, tflops=tf))
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


def failed(errs: dict) -> bool:
    """Whether a small check's errors (per mask, maybe per gradient) hold a NaN: its mark of a failed mask."""
    return any(failed(e) if isinstance(e, dict) else not math.isfinite(e) for e in errs.values())


def write_json(path: str | None, default_name: str, result: dict) -> None:
    path = path or (os.path.join(os.environ["OUT"], default_name) if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def run(
    a: argparse.Namespace,
    configs_for: Callable[[int, str], list],
    small_check: Callable[[Any, int, torch.dtype], dict],
    bench_shape: Callable[..., list[dict]],
    tag: Callable[[Any, int], str],
    json_name: str,
    rows_name: str,
) -> None:
    """Check each feasible config against the reference, then time every (dim, length, distribution) with
    the configs that passed (a failed one is never timed)."""
    dtype = getattr(torch, a.dtype)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    result = dict(device=dev, env=environment(), checks={}, rows=[])
    for d in a.dims:
        configs = configs_for(d, a.dtype)[: a.configs]
        if a.l2_groups:
            configs = [dataclasses.replace(c, l2_group=g) for c in configs for g in a.l2_groups]
        if not a.skip_check:
            passed = []
            for cfg in configs:
                t = time.time()
                errs = small_check(cfg, d, dtype)
                result["checks"][tag(cfg, d)] = errs
                print(f"check d={d} {cfg.to_dict()}: {errs} ({time.time() - t:.1f}s)", flush=True)
                write_json(a.json, json_name, result)
                if failed(errs):
                    print(f"not timed d={d} {cfg.to_dict()}: failed its check", flush=True)
                else:
                    passed.append(cfg)
            configs = passed
        for n in a.lengths:
            for dist in a.dist:
                rows = bench_shape(d, n, dist, dtype, a.batch, a.heads, configs)
                result["rows"] += rows
                write_json(a.json, json_name, result)
                if not a.no_save:
                    append_rows(rows_name, rows)
