"""Attention on jagged batches of a real length distribution, through the public call, per config source.

    python benchmarks/bench_jagged.py --lengths lengths.npy --artifacts artifacts --other tuned_on_lengths/

For each bucket, draws a batch (``--batch`` sequences, seed ``--seed``) from the lengths file with the
tuner's law (``autotune.runtime.buckets.sample_lengths``) and times ``hstu_attention`` forward and
backward (``--batch`` x bucket, bf16, causal) with the configs dispatch picks from: the entries tuned
on uniform lengths, the entries tuned on the synthetic jagged law (``--artifacts``), and, with
``--other``, the jagged entries of another artifacts folder (e.g. tuned with ``autotune run
--lengths``). TFLOP/s by the HSTU.md convention on the batch's real lengths; rows go to
``benchmarks/results/jagged.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.rows import append_rows, time_ms  # noqa: E402
from kernel_templates.hstu_attention.testing import offsets_from_lengths  # noqa: E402


def _inputs(lengths: list[int], heads: int, d: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lengths)
    q, k, v, do = (torch.randn(total, heads, d, generator=gen, device="cuda").to(dtype) for _ in range(4))
    offsets = offsets_from_lengths(lengths, "cuda", torch.int32)
    return q, k, v, do, offsets


def measure(lengths: list[int], bucket: int, args: argparse.Namespace, label: str, dist: str) -> dict[str, Any]:
    from autotune.runtime.ops import hstu_attention
    from kernel_templates.hstu_attention.reference import hstu_attention_flops

    q, k, v, do, off = _inputs(lengths, args.heads, args.head_dim, args.seed, getattr(torch, args.dtype))
    fwd_flops, bwd_flops = hstu_attention_flops(off.cpu(), args.heads, args.head_dim, args.head_dim, 0, None, 0)[:2]
    qg = q.detach().requires_grad_(True)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return hstu_attention(q, k, v, off, bucket, source="tuned", distribution=dist)

    out = hstu_attention(qg, k, v, off, bucket, source="tuned", distribution=dist)

    def bwd() -> None:
        torch.autograd.grad(out, (qg,), do, retain_graph=True)

    tf, tb = time_ms(fwd), time_ms(bwd)
    return {"bench": "jagged", "configs": label, "distribution_key": dist, "bucket": bucket, "batch": len(lengths),
            "tokens": sum(lengths), "max_len": max(lengths), "fwd_ms": tf["p50_ms"], "bwd_ms": tb["p50_ms"],
            "fwd_tflops": fwd_flops / (tf["p50_ms"] * 1e-3) / 1e12,
            "bwd_tflops": bwd_flops / (tb["p50_ms"] * 1e-3) / 1e12}  # fmt: skip


def add_batch_args(p: argparse.ArgumentParser) -> None:
    """The batch shape and row options the jagged benchmarks share."""
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--no-save", action="store_true")


def check_batch_args(p: argparse.ArgumentParser, args: argparse.Namespace, sizes: str = "--buckets") -> None:
    """Usage errors (naming the option) for shapes no batch can have, before the first GPU timing: a batch of 0
    or a bucket of -1 was a traceback from the first ``measure``, after the artifacts had loaded."""
    from benchmarks.cli_args import at_least, attention_head_dims, usage_errors

    with usage_errors(p):
        at_least(args, 1, "--batch", "--heads", sizes)
        attention_head_dims("--head-dim", args.head_dim, kernel=False)  # the public call pads a smaller head dim


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The batch shape, and the artifacts folders compared: a missing one loaded nothing and timed the
    defaults under its label."""
    from benchmarks.cli_args import existing_folder, usage_errors

    check_batch_args(p, args)
    with usage_errors(p):
        existing_folder("--artifacts", args.artifacts)
        existing_folder("--other", args.other)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", required=True)
    p.add_argument("--artifacts", default="artifacts")
    p.add_argument("--other", default=None, help="a second artifacts folder whose jagged entries are compared")
    p.add_argument("--buckets", type=int, nargs="+", default=[2048, 4096])
    add_batch_args(p)
    args = p.parse_args(argv)
    check_options(p, args)
    import autotune
    from autotune.runtime import dispatch
    from autotune.runtime.buckets import sample_lengths
    from autotune.runtime.lengths import read_length_sample
    from benchmarks.cli_args import needs_gpu

    try:
        sample = read_length_sample(args.lengths)
    except ValueError as e:
        p.error(str(e))
    needs_gpu("bench_jagged.py")
    rows = []
    for bucket in args.buckets:
        lengths = sample_lengths(sample, bucket, args.batch, args.seed)
        sources = [
            (args.artifacts, "uniform", "uniform entries"),
            (args.artifacts, "jagged", "synthetic-jagged entries"),
        ]
        if args.other:
            sources.append((args.other, "jagged", "lengths-file entries"))
        for root, dist, label in sources:
            dispatch.reset()
            autotune.load(root)
            row = measure(lengths, bucket, args, label, dist)
            print(json.dumps(row), flush=True)
            rows.append(row)
    if not args.no_save:
        append_rows("jagged", rows)
    print("| bucket | configs | fwd TFLOP/s | bwd TFLOP/s |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['bucket']} | {r['configs']} | {r['fwd_tflops']:.0f} | {r['bwd_tflops']:.0f} |")


if __name__ == "__main__":
    main()
