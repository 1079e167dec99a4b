"""GPU benchmark of the CuTe DSL HSTU forward (sm90) beside the Triton forward with its default config.

Each CuTe config is first checked against the reference on a small jagged batch (all masks), then on
every benchmark shape against the Triton forward (|cute - triton| <= one ulp of max|triton| + 1e-5, as
two low-precision kernels may round differently); a config that fails either check is not timed there.
Timing: ``benchmarks.rows.time_ms`` (warm-up, L2 flush between samples; p20/p50/p80, TFLOP/s from p50).
FLOPs follow HSTU.md (fwd = 2H(Dqk+Dv)P). Rows go to ``benchmarks/results/cute_fwd.jsonl`` and, as
before, to ``--json`` (default ``$OUT/bench_cute.json``).

    python benchmarks/bench_cute.py [--dims 256 128] [--lengths 1024 2048 4096 8192] \
        [--dist uniform jagged] [--json $OUT/cute.json]
"""

from __future__ import annotations

import traceback

import torch
from cute_bench_common import CHECK_LENGTHS, MASKS, feasible, parse_args, run, time_row

from autotune.runtime.buckets import sequence_lengths
from benchmarks.cli_args import needs_gpu
from kernel_templates.cute import HSTUCuteFwdConfig, check_fwd_config, hstu_attention_cute_fwd
from kernel_templates.hstu_attention import default_fwd_config, hstu_attention_flops, hstu_attention_reference
from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs
from kernel_templates.hstu_attention.triton_fwd import hstu_attention_fwd
from kernel_templates.tolerance import atol_for

CONFIGS = {
    256: [
        HSTUCuteFwdConfig(128, 64, 2, True),
        HSTUCuteFwdConfig(128, 64, 2, False),
        HSTUCuteFwdConfig(64, 64, 3, True),
        HSTUCuteFwdConfig(128, 96, 1, True),
    ],
    128: [
        HSTUCuteFwdConfig(128, 128, 2, True),
        HSTUCuteFwdConfig(128, 64, 3, True),
        HSTUCuteFwdConfig(192, 64, 2, True),
        HSTUCuteFwdConfig(128, 128, 2, False),
    ],
}


def small_check(cfg: HSTUCuteFwdConfig, d: int, dtype: torch.dtype) -> dict[str, float]:
    """Max error vs the fp32 reference per mask, on a jagged batch with empty/short/odd sequences."""
    errs = {}
    for name, (ctx, targets, window) in MASKS.items():
        inp = make_jagged_inputs(CHECK_LENGTHS, 2, d, d, dtype, "cuda", seed=1, targets=targets)
        args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, ctx, window, None)
        out = torch.full_like(inp.v, float("nan"))
        hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg, out=out)
        ref = hstu_attention_reference(inp.q, inp.k, inp.v, *args).float()
        low = hstu_attention_reference(inp.q, inp.k, inp.v, *args, compute_dtype=dtype)
        try:
            err, _ = check_tolerance(name, out, ref, low)
        except AssertionError as e:
            print(f"  FAIL {cfg.to_dict()} d={d} {name}: {e}", flush=True)
            bad = (out.float() - ref).abs().amax(dim=(1, 2))
            rows = torch.nonzero(~(bad <= atol_for(dtype, ref.abs().max().item()))).flatten()[:20].tolist()
            print(f"    offsets={inp.seq_offsets.tolist()} first bad rows={rows}", flush=True)
            err = float("nan")
        errs[name] = err
    return errs


def bench_shape(d: int, n: int, dist: str, dtype: torch.dtype, batch: int, heads: int, configs) -> list[dict]:
    lengths = sequence_lengths(n, batch, dist, seed=0)  # the tuner's declared distributions
    inp = make_jagged_inputs(lengths, heads, d, d, dtype, "cuda", seed=0, max_seq_len=n)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, None, 0, 0, None)
    fwd_flops, _ = hstu_attention_flops(inp.seq_offsets, heads, d, d)
    tcfg = default_fwd_config(d, d)
    ref = hstu_attention_fwd(inp.q, inp.k, inp.v, *args, tcfg)
    rows = []
    shape = dict(dqk=d, dv=d, len=n, dist=dist, batch=batch, heads=heads, dtype=str(dtype).split(".")[-1])

    def record(backend: str, cfg, fn) -> None:
        time_row(rows, backend, cfg, fn, fwd_flops, **shape)

    record("triton", tcfg, lambda: hstu_attention_fwd(inp.q, inp.k, inp.v, *args, tcfg))
    for cfg in configs:
        try:
            out = hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg)
            diff = (out.float() - ref.float()).abs().max().item()
            # Two bf16/fp16 kernels may round differently: allow one ulp of the largest output.
            tol = (2**-7 if dtype == torch.bfloat16 else 2**-10) * ref.float().abs().max().item() + 1e-5
            if not diff <= tol:
                print(
                    f"  MISMATCH cute vs triton {cfg.to_dict()} d={d} n={n} {dist}: {diff:.3e} > {tol:.3e}; not timed"
                )
                continue
            buf = torch.empty_like(out)

            def run(cfg=cfg, buf=buf):
                return hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg, out=buf)

            record("cute", cfg, run)
            rows[-1]["max_diff_vs_triton"] = diff
        except Exception:
            traceback.print_exc()
    return rows


def main(argv: list[str] | None = None) -> None:
    def configs_for(d: int, dtype: str) -> list[HSTUCuteFwdConfig]:
        return [c for c in CONFIGS.get(d, []) if feasible(lambda c=c: check_fwd_config(c, d, d), c, d)]

    def tag(cfg: HSTUCuteFwdConfig, d: int) -> str:
        return f"d{d}-{cfg.block_m}x{cfg.block_n}s{cfg.num_stages}o{int(cfg.intra_wg_overlap)}g{cfg.l2_group}"

    a = parse_args(argv, dims=tuple(CONFIGS))
    needs_gpu("bench_cute.py")
    run(a, configs_for, small_check, bench_shape, tag, "bench_cute.json", "cute_fwd")


if __name__ == "__main__":
    main()
