"""Jagged / uniform throughput of attention through the public call, per bucket and length law.

    python benchmarks/bench_jagged_ratio.py --buckets 1024 2048 4096 8192 --laws u3 pareto one-long \
        --lengths benchmarks/data/lognormal_lengths.json

For each bucket N it times ``hstu_attention`` forward and backward (``--batch`` sequences, bf16 or ``--dtype
float16``, causal, tuned configs) on a uniform batch (every length N) and on heavy-tailed batches whose
longest sequence is N, and reports each as a share of the uniform TFLOP/s. Dispatch sees only what the host
knows (bucket and fill ratio) unless ``--hints`` also times the explicit ``distribution="jagged"`` hint. It
also times the batch's longest sequence alone (``alone``): no schedule of one-CTA-per-tile kernels can finish
the batch before that, so ``alone / batch`` says how much of the batch time is the critical path.

Laws (each batch has one sequence of exactly N; the rest drawn with the seed):

- ``u3``: the tuner's synthetic law, ``ceil(N u^3)`` (``autotune.runtime.buckets.sequence_lengths``);
- ``pareto``: ``min(N, ceil(N/32 * u^(-1/1.2)))``, a power law with median ~N/18 and a tail to N;
- ``one-long``: one sequence of N, the others uniform in [1, N/16] (most of the work in one sequence);
- ``file``: drawn from ``--lengths`` by ``autotune.runtime.buckets.sample_lengths``;
- ``empty``: one sequence of N, the others empty: the launch grid of a batch with the work of the longest
  sequence alone, so ``batch - alone`` is what the grid's empty tiles cost.

Rows (GPU, versions, git sha, shape, p20/p50/p80) go to ``benchmarks/results/jagged_ratio.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged import _inputs, add_batch_args, check_batch_args  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402

LAWS = ("u3", "pareto", "one-long", "file", "empty")


def law_lengths(law: str, n_max: int, batch: int, seed: int, sample: tuple[int, ...] | None = None) -> list[int]:
    """Lengths of one batch of ``law`` whose longest sequence is ``n_max`` (deterministic in ``seed``)."""
    from autotune.runtime.buckets import sample_lengths, sequence_lengths

    if law == "u3":
        return sequence_lengths(n_max, batch, "jagged", seed)
    if law == "file":
        if sample is None:
            raise ValueError("law 'file' needs --lengths FILE")
        return sample_lengths(sample, n_max, batch, seed)
    rng = random.Random(f"{law}:{seed}:{n_max}:{batch}")
    if law == "pareto":
        lengths = [min(n_max, math.ceil(n_max / 32 * (1.0 - rng.random()) ** (-1 / 1.2))) for _ in range(batch)]
    elif law == "one-long":
        lengths = [rng.randint(1, max(1, n_max // 16)) for _ in range(batch)]
    elif law == "empty":
        lengths = [0] * batch
    else:
        raise ValueError(f"unknown law {law!r}; known: {', '.join(LAWS)}")
    lengths[rng.randrange(batch)] = n_max
    return lengths


def measure(lengths: list[int], bucket: int, args: argparse.Namespace, hint: str | None) -> dict[str, Any]:
    """Forward and backward p20/p50/p80 and TFLOP/s of one batch through the public call."""
    from autotune.runtime.ops import hstu_attention
    from kernel_templates.hstu_attention.reference import hstu_attention_flops

    q, k, v, do, off = _inputs(lengths, args.heads, args.head_dim, args.seed, getattr(torch, args.dtype))
    fwd_flops, bwd_flops = hstu_attention_flops(off.cpu(), args.heads, args.head_dim, args.head_dim)
    qg = q.detach().requires_grad_(True)

    def fwd() -> torch.Tensor:
        with torch.no_grad():
            return hstu_attention(q, k, v, off, bucket, source=args.source, distribution=hint)

    out = hstu_attention(qg, k, v, off, bucket, source=args.source, distribution=hint)

    def bwd() -> None:
        torch.autograd.grad(out, (qg,), do, retain_graph=True)

    if args.cuda_graph:  # replays of the same kernels: the host's time is left out
        from autotune.runtime.ops import backward_call
        from autotune.tuning.measure import graphed

        tf, tb = time_ms(graphed(fwd)), time_ms(graphed(backward_call(out, do)))
    else:
        tf, tb = time_ms(fwd), time_ms(bwd)
    fill = sum(lengths) / (len(lengths) * bucket)
    return {
        "bucket": bucket, "batch": len(lengths), "tokens": sum(lengths), "fill": round(fill, 4), "hint": hint,
        "dtype": args.dtype, "source": args.source,
        "timing": "cuda_graph" if args.cuda_graph else "call",
        "fwd_flops": fwd_flops, "bwd_flops": bwd_flops,
        "fwd_p20_ms": tf["p20_ms"], "fwd_ms": tf["p50_ms"], "fwd_p80_ms": tf["p80_ms"],
        "bwd_p20_ms": tb["p20_ms"], "bwd_ms": tb["p50_ms"], "bwd_p80_ms": tb["p80_ms"],
        "fwd_tflops": fwd_flops / (tf["p50_ms"] * 1e-3) / 1e12, "bwd_tflops": bwd_flops / (tb["p50_ms"] * 1e-3) / 1e12,
    }  # fmt: skip


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before any batch is timed: the batch shape, ``--laws file`` without a lengths file
    (``law_lengths`` raised after the uniform batch was timed) and a missing ``--artifacts`` folder (loaded
    nothing: the defaults were timed as the tuned configs)."""
    from benchmarks.cli_args import existing_folder, usage_errors

    check_batch_args(p, args)
    if "file" in args.laws and not args.lengths:
        p.error("--laws file needs --lengths FILE")
    with usage_errors(p):
        existing_folder("--artifacts", args.artifacts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--laws", nargs="*", default=["u3", "pareto", "one-long"], choices=LAWS, help="none: uniform only")
    p.add_argument("--lengths", default=None, help="a lengths file: adds the 'file' law")
    p.add_argument("--artifacts", default=None, help="artifacts root (default: the shipped ones)")
    p.add_argument("--allow-same-arch", action="store_true")
    p.add_argument("--source", default="tuned", choices=("tuned", "default"))
    p.add_argument("--hints", action="store_true", help="also time with distribution='jagged' for jagged batches")
    p.add_argument("--no-alone", action="store_true", help="skip timing the longest sequence alone")
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="time CUDA-graph replays of the same calls (kernels only; the backward without the autograd engine)",
    )
    add_batch_args(p)
    args = p.parse_args(argv)
    check_options(p, args)
    import autotune
    from autotune.runtime.lengths import read_length_sample

    try:
        sample = read_length_sample(args.lengths) if args.lengths else None
    except ValueError as e:
        p.error(str(e))
    if not torch.cuda.is_available():  # a CUDA generator's RuntimeError traceback otherwise
        raise SystemExit("bench_jagged_ratio.py needs a CUDA GPU")
    autotune.load(args.artifacts, allow_same_arch=args.allow_same_arch)
    laws = list(args.laws) + (["file"] if sample is not None and "file" not in args.laws else [])
    rows: list[dict[str, Any]] = []
    for bucket in args.buckets:
        base = measure([bucket] * args.batch, bucket, args, None)
        rows.append({"bench": "jagged_ratio", "law": "uniform", "d": args.head_dim, "heads": args.heads, **base})
        print(json.dumps(rows[-1]), flush=True)
        for law in laws:
            lengths = law_lengths(law, bucket, args.batch, args.seed, sample)
            hints: list[str | None] = [None, "jagged"] if args.hints else [None]
            for hint in hints:
                r = measure(lengths, bucket, args, hint)
                r.update(fwd_ratio=r["fwd_tflops"] / base["fwd_tflops"], bwd_ratio=r["bwd_tflops"] / base["bwd_tflops"])
                if not args.no_alone and hint is None:
                    alone = measure([bucket], bucket, args, None)
                    r.update(alone_fwd_ms=alone["fwd_ms"], alone_bwd_ms=alone["bwd_ms"])
                rows.append({"bench": "jagged_ratio", "law": law, "d": args.head_dim, "heads": args.heads, **r})
                print(json.dumps(rows[-1]), flush=True)
    if not args.no_save:
        append_rows("jagged_ratio", rows)
    print("| bucket | law | hint | fill | fwd TFLOP/s (share) | bwd TFLOP/s (share) | alone / batch ms fwd, bwd |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        fr = f" ({r['fwd_ratio']:.0%})" if "fwd_ratio" in r else ""
        br = f" ({r['bwd_ratio']:.0%})" if "bwd_ratio" in r else ""
        alone = (f"{r['alone_fwd_ms']:.3f} / {r['fwd_ms']:.3f}, {r['alone_bwd_ms']:.3f} / {r['bwd_ms']:.3f}"
                 if "alone_fwd_ms" in r else "")  # fmt: skip
        print(f"| {r['bucket']} | {r['law']} | {r['hint'] or '-'} | {r['fill']:.2f} | {r['fwd_tflops']:.0f}{fr} "
              f"| {r['bwd_tflops']:.0f}{br} | {alone} |")  # fmt: skip


if __name__ == "__main__":
    main()
