"""GPU benchmark of the CuTe DSL HSTU backward (sm90) beside the Triton backward with its default config.

Each CuTe config is first checked against the fp32 reference on a small jagged batch (every mask,
the project's tolerance rule), then on every benchmark shape against the Triton backward
(|cute - triton| <= 1e-2 max|triton| per gradient; the fp32 reference is too large there). Timing:
``triton.testing.do_bench`` (warm-up, L2 flush between reps, median). FLOPs follow HSTU.md
(bwd = 2H(3Dqk + 2Dv)P, ``hstu_attention_flops(...)[1]``).

    python benchmarks/bench_cute_bwd.py [--dims 256 128] [--lengths 1024 2048 4096 8192] \
        [--dist uniform jagged] [--json $OUT/cute_bwd.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
import traceback

import torch
import triton

from autotune.buckets import sequence_lengths
from kernel_templates.cute import HSTUCuteBwdConfig, check_bwd_config, hstu_attention_cute_bwd
from kernel_templates.hstu_attention import default_bwd_config, hstu_attention_flops, hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd

CONFIGS = {
    256: [HSTUCuteBwdConfig(64, 64, 1), HSTUCuteBwdConfig(128, 64, 1)],
    128: [HSTUCuteBwdConfig(64, 128, 2), HSTUCuteBwdConfig(64, 64, 2), HSTUCuteBwdConfig(128, 64, 1)],
    64: [HSTUCuteBwdConfig(64, 128, 2), HSTUCuteBwdConfig(128, 64, 2)],
}
MASKS = {
    "causal": (0, False, 0),
    "targets": (0, True, 0),
    "context": (7, False, 0),
    "window": (0, False, 100),
    "all": (5, True, 60),
}


def _ref_grads(q, k, v, do, args, compute_dtype):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = hstu_attention_reference(q, k, v, *args, compute_dtype=compute_dtype)
    return torch.autograd.grad(out, (q, k, v), do.to(out.dtype))


def small_check(cfg: HSTUCuteBwdConfig, d: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Max error of dq/dk/dv vs the fp32 reference per mask, on a jagged batch with empty/short/odd sequences."""
    errs = {}
    for name, (ctx, targets, window) in MASKS.items():
        inp = make_jagged_inputs([0, 1, 77, 300, 129, 0, 513], 2, d, d, dtype, "cuda", seed=1, targets=targets)
        do = torch.randn_like(inp.v)
        args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, ctx, window, None)
        bufs = tuple(torch.full_like(t, float("nan")) for t in (inp.q, inp.k, inp.v))
        got = hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs)
        ref = _ref_grads(inp.q, inp.k, inp.v, do, args, torch.float32)
        low = _ref_grads(inp.q, inp.k, inp.v, do, args, dtype)
        errs[name] = {}
        for gname, a, r, lo in zip(("dq", "dk", "dv"), got, ref, low, strict=True):
            scale = r.float().abs().max().item()
            try:
                err, _ = check_tolerance(gname, a, r.float(), lo, atol=2e-3 * scale + 1e-5)
            except AssertionError as e:
                bad = ~((a.float() - r.float()).abs().amax(dim=(1, 2)) <= 2e-3 * scale + 1e-5)
                rows = torch.nonzero(bad).flatten()[:16].tolist()
                print(f"  FAIL {cfg.to_dict()} d={d} {name}: {e}; first bad rows {rows}", flush=True)
                err = float("nan")
            errs[name][gname] = err
    return errs


def bench_shape(d: int, n: int, dist: str, dtype: torch.dtype, batch: int, heads: int, configs) -> list[dict]:
    lengths = sequence_lengths(n, batch, dist, seed=0)  # the tuner's declared distributions
    inp = make_jagged_inputs(lengths, heads, d, d, dtype, "cuda", seed=0, max_seq_len=n)
    do = torch.randn_like(inp.v)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, None, 0, 0, None)
    bwd_flops = hstu_attention_flops(inp.seq_offsets.cpu(), heads, d, d)[1]
    tcfg = default_bwd_config(d, d)
    ref = hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, tcfg)
    rows = []

    def record(backend: str, cfg, fn) -> None:
        ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        tf = bwd_flops / ms / 1e9
        rows.append(
            dict(backend=backend, config=cfg.to_dict(), dqk=d, dv=d, len=n, dist=dist, batch=batch, heads=heads,
                 dtype=str(dtype).split(".")[-1], median_ms=ms, tflops=tf)
        )  # fmt: skip
        print(f"  {backend:6s} d={d} n={n:5d} {dist:7s} {cfg.to_dict()}: {ms:.3f} ms {tf:6.1f} TFLOP/s", flush=True)

    record("triton", tcfg, lambda: hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, tcfg))
    for cfg in configs:
        try:
            got = hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg)
            rel = {}
            for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
                rel[name] = (a.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-30)
            if not all(x <= 1e-2 for x in rel.values()):
                print(f"  MISMATCH cute vs triton {cfg.to_dict()} d={d} n={n} {dist}: {rel}", flush=True)
            bufs = tuple(torch.empty_like(t) for t in got)

            def run(cfg=cfg, bufs=bufs):
                return hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs, validate=False)

            record("cute", cfg, run)
            rows[-1]["rel_diff_vs_triton"] = rel
        except Exception:
            traceback.print_exc()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--dist", nargs="+", default=["uniform", "jagged"])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--configs", type=int, default=None, help="time only the first N configs per head dim")
    p.add_argument("--skip-check", action="store_true")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    dev = torch.cuda.get_device_name()
    print(f"device: {dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    result = dict(device=dev, checks={}, rows=[])
    for d in a.dims:
        configs = [c for c in CONFIGS.get(d, []) if _feasible(c, d, a.dtype)][: a.configs]
        if not a.skip_check:
            for cfg in configs:
                t = time.time()
                errs = small_check(cfg, d, dtype)
                result["checks"][f"d{d}-{cfg.block_m}x{cfg.block_n}s{cfg.num_stages}"] = errs
                print(f"check d={d} {cfg.to_dict()}: {errs} ({time.time() - t:.1f}s)", flush=True)
                _write(a.json, result)
        for n in a.lengths:
            for dist in a.dist:
                result["rows"] += bench_shape(d, n, dist, dtype, a.batch, a.heads, configs)
                _write(a.json, result)  # after every shape, so a time limit keeps what was measured


def _write(path: str | None, result: dict) -> None:
    path = path or (os.path.join(os.environ["OUT"], "bench_cute_bwd.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _feasible(cfg: HSTUCuteBwdConfig, d: int, dtype: str) -> bool:
    try:
        check_bwd_config(cfg, dtype, d, d)
    except ValueError as e:
        print(f"skip {cfg.to_dict()} d={d}: {e}")
        return False
    return True


if __name__ == "__main__":
    main()
