"""GPU benchmark of the CuTe DSL HSTU backward (sm90) beside the Triton backward with its default config.

Each CuTe config is first checked against the fp32 reference on a small jagged batch (every mask,
the project's tolerance rule), then on every benchmark shape against the Triton backward
(|cute - triton| <= 1e-2 max|triton| per gradient; the fp32 reference is too large there); a config that
fails either check is not timed there. Timing: ``benchmarks.rows.time_ms`` (warm-up, L2 flush between
samples; p20/p50/p80, TFLOP/s from p50). FLOPs follow HSTU.md (bwd = 2H(3Dqk + 2Dv)P,
``hstu_attention_flops(...)[1]``). Rows go to ``benchmarks/results/cute_bwd.jsonl`` and, as before, to
``--json`` (default ``$OUT/bench_cute_bwd.json``).

    python benchmarks/bench_cute_bwd.py [--dims 256 128] [--lengths 1024 2048 4096 8192] \
        [--dist uniform jagged] [--json $OUT/cute_bwd.json]
"""

from __future__ import annotations

import traceback

import torch
from cute_bench_common import CHECK_LENGTHS, MASKS, feasible, parse_args, run, time_row

from autotune.runtime.buckets import sequence_lengths
from benchmarks.cli_args import needs_gpu
from kernel_templates.cute import HSTUCuteBwdConfig, check_bwd_config, hstu_attention_cute_bwd
from kernel_templates.hstu_attention import default_bwd_config, hstu_attention_flops, hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs
from kernel_templates.hstu_attention.triton_bwd import hstu_attention_bwd
from kernel_templates.tolerance import atol_for

CONFIGS = {
    256: [
        HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True),
        HSTUCuteBwdConfig(64, 64, 1),
        HSTUCuteBwdConfig(128, 64, 1),
    ],
    128: [
        HSTUCuteBwdConfig(64, 128, 2),
        HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True),
        HSTUCuteBwdConfig(64, 128, 3, do_stages=2, swap_sdp=True),
        HSTUCuteBwdConfig(64, 128, 2, do_stages=1),
        HSTUCuteBwdConfig(64, 64, 2),
        HSTUCuteBwdConfig(128, 64, 2, do_stages=2, dq_serial=True),
        HSTUCuteBwdConfig(128, 64, 1),
    ],
    64: [HSTUCuteBwdConfig(64, 128, 2), HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True), HSTUCuteBwdConfig(128, 64, 2)],
}


def _ref_grads(q, k, v, do, args, compute_dtype):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = hstu_attention_reference(q, k, v, *args, compute_dtype=compute_dtype)
    return torch.autograd.grad(out, (q, k, v), do.to(out.dtype))


def small_check(cfg: HSTUCuteBwdConfig, d: int, dtype: torch.dtype) -> dict[str, dict[str, float]]:
    """Max error of dq/dk/dv vs the fp32 reference per mask, on a jagged batch with empty/short/odd sequences."""
    errs = {}
    for name, (ctx, targets, window) in MASKS.items():
        inp = make_jagged_inputs(CHECK_LENGTHS, 2, d, d, dtype, "cuda", seed=1, targets=targets)
        do = torch.randn_like(inp.v)
        args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, ctx, window, None)
        bufs = tuple(torch.full_like(t, float("nan")) for t in (inp.q, inp.k, inp.v))
        got = hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs)
        ref = _ref_grads(inp.q, inp.k, inp.v, do, args, torch.float32)
        low = _ref_grads(inp.q, inp.k, inp.v, do, args, dtype)
        errs[name] = {}
        for gname, a, r, lo in zip(("dq", "dk", "dv"), got, ref, low, strict=True):
            try:
                err, _ = check_tolerance(gname, a, r.float(), lo)
            except AssertionError as e:
                bad = ~((a.float() - r.float()).abs().amax(dim=(1, 2)) <= atol_for(dtype, r.float().abs().max().item()))
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
    shape = dict(dqk=d, dv=d, len=n, dist=dist, batch=batch, heads=heads, dtype=str(dtype).split(".")[-1])

    def record(backend: str, cfg, fn) -> None:
        time_row(rows, backend, cfg, fn, bwd_flops, **shape)

    record("triton", tcfg, lambda: hstu_attention_bwd(do, inp.q, inp.k, inp.v, *args, tcfg))
    for cfg in configs:
        try:
            got = hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg)
            rel = {}
            for name, a, r in zip(("dq", "dk", "dv"), got, ref, strict=True):
                rel[name] = (a.float() - r.float()).abs().max().item() / max(r.float().abs().max().item(), 1e-30)
            if not all(x <= 1e-2 for x in rel.values()):
                print(f"  MISMATCH cute vs triton {cfg.to_dict()} d={d} n={n} {dist}: {rel}; not timed", flush=True)
                continue
            bufs = tuple(torch.empty_like(t) for t in got)

            def run(cfg=cfg, bufs=bufs):
                return hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs, validate=False)

            record("cute", cfg, run)
            rows[-1]["rel_diff_vs_triton"] = rel
        except Exception:
            traceback.print_exc()
    return rows


def main(argv: list[str] | None = None) -> None:
    def configs_for(d: int, dtype: str) -> list[HSTUCuteBwdConfig]:
        return [c for c in CONFIGS.get(d, []) if feasible(lambda c=c: check_bwd_config(c, dtype, d, d), c, d)]

    def tag(cfg: HSTUCuteBwdConfig, d: int) -> str:
        serial = "serial" if cfg.dq_serial else ""
        swap = "swap" if cfg.swap_sdp else ""
        return f"d{d}-{cfg.block_m}x{cfg.block_n}s{cfg.num_stages}do{cfg.do_stages}{serial}{swap}g{cfg.l2_group}"

    a = parse_args(argv, dims=tuple(CONFIGS))
    needs_gpu("bench_cute_bwd.py")
    run(a, configs_for, small_check, bench_shape, tag, "bench_cute_bwd.json", "cute_bwd")


if __name__ == "__main__":
    main()
