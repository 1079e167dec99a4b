"""Bandwidth of the uvqk backward's SiLU' pass per config, against an elementwise op of the same traffic.

    python benchmarks/bench_silu_pass.py [--tokens 131072] [--width 4096]

The pass (``kernel_templates.gemm_silu.triton_bwd._silu_bwd_kernel``) reads dy and the pre-activation and
writes d_pre (three bf16 tensors of tokens x width) plus small fp32 dbias partials. The yardstick is
``torch.add(a, b, out=c)`` on the same tensors (two reads, one write) in the same run; the figure of
merit is the ratio. Every config of the search space that fits (``check_bwd_config``) is timed, so a
config that leaves bandwidth on the table shows here and not only inside the whole backward's time,
where the two GEMMs dominate. Rows go to ``benchmarks/results/silu_pass.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cli_args import at_least, needs_gpu, usage_errors  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace, configs: list) -> None:
    """Usage errors before the GPU check: ``--tokens 0`` or a ``--width`` no config of the search space fits
    timed nothing and then failed on the ratios of no rows."""
    from kernel_templates.gemm_silu.bwd_config import check_bwd_config

    with usage_errors(p):
        at_least(args, 1, "--tokens", "--width")
        if all(check_bwd_config(cfg, args.width) is not None for cfg in configs):
            raise ValueError(f"--width {args.width}: no config of the search space fits it")


def main(argv: list[str] | None = None) -> None:
    import triton

    from kernel_templates.gemm_silu.bwd_config import check_bwd_config
    from kernel_templates.gemm_silu.triton_bwd import _silu_bwd_kernel
    from search_spaces.gemm_silu_bwd_triton import GEMM_SILU_BWD_TRITON

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=131072)
    p.add_argument("--width", type=int, default=4096, help="4 x heads x head_dim")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    check_options(p, args, GEMM_SILU_BWD_TRITON.full())
    needs_gpu("bench_silu_pass.py")
    m, n = args.tokens, args.width
    dy, pre = (torch.randn(m, n, device="cuda").to(torch.bfloat16) for _ in range(2))
    d_pre = torch.empty_like(dy)
    gb = 3 * m * n * dy.element_size() / 1e9
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = time_ms(lambda: torch.add(dy, pre, out=d_pre))["p50_ms"]
    print(f"torch.add (same traffic): {gb / base:.2f} TB/s")
    rows = []
    for cfg in GEMM_SILU_BWD_TRITON.full():
        if check_bwd_config(cfg, n) is not None:
            continue
        progs = max(1, min(triton.cdiv(m, cfg.block_m), cfg.row_programs_per_sm * sms))
        rows_per_prog = triton.cdiv(triton.cdiv(m, progs), cfg.block_m) * cfg.block_m
        progs = triton.cdiv(m, rows_per_prog)
        db_part = torch.empty((progs, n), dtype=torch.float32, device="cuda")

        def run(cfg=cfg, progs=progs, rows_per_prog=rows_per_prog, db_part=db_part) -> None:
            _silu_bwd_kernel[(progs, triton.cdiv(n, cfg.block_n))](
                dy, pre, d_pre, db_part, m, n, rows_per_prog, n, n, n,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            )  # fmt: skip

        t = time_ms(run)
        rows.append({"bench": "silu_pass", "tokens": m, "width": n, "config": cfg.to_dict(), **t,
                     "tbps": gb / t["p50_ms"], "add_tbps": gb / base, "ratio_to_add": base / t["p50_ms"]})  # fmt: skip
    rows.sort(key=lambda r: r["p50_ms"])
    ratios = [r["ratio_to_add"] for r in rows]
    print(f"{len(rows)} configs: ratio to torch.add best {ratios[0]:.2f}, median {ratios[len(ratios) // 2]:.2f}, "
          f"worst {ratios[-1]:.2f}")  # fmt: skip
    for r in rows[:3] + rows[-3:]:
        print(f"  {r['config']}: {r['tbps']:.2f} TB/s ({r['ratio_to_add']:.2f})")
    if not args.no_save:
        append_rows("silu_pass", rows)


if __name__ == "__main__":
    main()
