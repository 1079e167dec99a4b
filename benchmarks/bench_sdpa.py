"""HSTU attention through the public call beside torch SDPA's softmax attention, same shape, same run.

    python benchmarks/bench_sdpa.py --head-dim 128 --batch 32 --lengths 1024 2048 4096 8192

Uniform batches (every sequence of the given length), bf16, causal. HSTU runs ``hstu_attention(...,
source="tuned")``; SDPA runs ``scaled_dot_product_attention(is_causal=True)`` on (B, H, N, D) tensors under
each of its fused backends that accepts the shape (flash, cuDNN), and the faster one is the reference.
Both are credited the FLOPs the HSTU row counts (``hstu_attention_flops``: forward 4 N^2/2 D per head,
backward 2.5x; the same causal shape), so the TFLOP/s ratio is the time ratio. Rows go to
``benchmarks/results/sdpa_ratio.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged import add_batch_args, check_batch_args  # noqa: E402
from benchmarks.bench_jagged_ratio import measure  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402


def sdpa_row(n: int, args: argparse.Namespace, fwd_flops: float, bwd_flops: float) -> dict[str, Any]:
    """The faster of SDPA's flash and cuDNN backends on a (batch, heads, n, head_dim) causal problem, with
    TFLOP/s from the FLOPs the HSTU row counted (same causal shape)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    shape = (args.batch, args.heads, n, args.head_dim)
    dtype = getattr(torch, args.dtype)  # the HSTU row's dtype: the comparison is one shape, one dtype
    q, k, v, do = (torch.randn(shape, generator=gen, device="cuda").to(dtype) for _ in range(4))
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    best: dict[str, Any] | None = None
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        try:
            with sdpa_kernel(backend):
                out = sdpa(qg, kg, vg, is_causal=True)

                def fwd() -> torch.Tensor:
                    with torch.no_grad():
                        return sdpa(q, k, v, is_causal=True)

                def bwd(out: torch.Tensor = out) -> None:
                    torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

                tf, tb = time_ms(fwd), time_ms(bwd)
        except RuntimeError as e:  # the backend does not take this shape / dtype on this GPU
            print(f"sdpa {backend.name}: {e}".splitlines()[0], flush=True)
            continue
        row = {
            "sdpa_backend": backend.name, "sdpa_fwd_ms": tf["p50_ms"], "sdpa_bwd_ms": tb["p50_ms"],
            "sdpa_fwd_tflops": fwd_flops / (tf["p50_ms"] * 1e-3) / 1e12,
            "sdpa_bwd_tflops": bwd_flops / (tb["p50_ms"] * 1e-3) / 1e12,
        }  # fmt: skip
        if best is None or row["sdpa_bwd_ms"] < best["sdpa_bwd_ms"]:
            best = row
    return best or {}


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The batch shape, and an ``--artifacts`` folder that exists (a missing one loaded nothing: the defaults
    were timed as the tuned configs)."""
    from benchmarks.cli_args import existing_folder, usage_errors

    check_batch_args(p, args, "--lengths")
    with usage_errors(p):
        existing_folder("--artifacts", args.artifacts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--artifacts", default=None, help="artifacts root (default: the shipped ones)")
    p.add_argument("--source", default="tuned", choices=("tuned", "default"))
    add_batch_args(p)
    p.set_defaults(cuda_graph=False)  # both sides timed as eager calls, host time included
    args = p.parse_args(argv)
    check_options(p, args)
    if not torch.cuda.is_available():  # a CUDA generator's RuntimeError traceback otherwise
        raise SystemExit("bench_sdpa.py needs a CUDA GPU")
    import autotune

    autotune.load(args.artifacts)
    rows = []
    for n in args.lengths:
        ours = measure([n] * args.batch, n, args, None)
        ref = sdpa_row(n, args, ours["fwd_flops"], ours["bwd_flops"])
        row = {"bench": "sdpa_ratio", "d": args.head_dim, "heads": args.heads, "source": args.source, **ours, **ref}
        if ref:
            row.update(fwd_vs_sdpa=ref["sdpa_fwd_ms"] / ours["fwd_ms"],
                       bwd_vs_sdpa=ref["sdpa_bwd_ms"] / ours["bwd_ms"])  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not args.no_save:
        append_rows("sdpa_ratio", rows)
    print("| length | HSTU fwd / bwd TFLOP/s | SDPA fwd / bwd TFLOP/s (backend) | bwd HSTU / SDPA |")
    print("|---|---|---|---|")
    for r in rows:
        sd = "-"
        if "sdpa_backend" in r:
            sd = f"{r['sdpa_fwd_tflops']:.0f} / {r['sdpa_bwd_tflops']:.0f} ({r['sdpa_backend']})"
        ratio = f"{r['bwd_vs_sdpa']:.0%}" if "bwd_vs_sdpa" in r else "-"
        print(f"| {r['bucket']} | {r['fwd_tflops']:.0f} / {r['bwd_tflops']:.0f} | {sd} | {ratio} |")


if __name__ == "__main__":
    main()
