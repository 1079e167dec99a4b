"""Key split of the CuTe forward: each tuned tile with ``kv_split`` 1, 2 and 4, on skewed and small batches.

    python benchmarks/bench_kv_split.py --buckets 1024 2048 4096 8192 --laws uniform u3 pareto one-long \
        --small-batches 1 2 4

For every head dim and bucket it takes the tuned forward tiles of the GPU's artifact (uniform entry,
falling back to the default config) and times ``hstu_attention_cute_fwd`` with each feasible
``kv_split`` on a batch of ``--batch`` sequences per length law (``bench_jagged_ratio.law_lengths``)
and on uniform batches of ``--small-batches`` sequences. The split pays where a few long query blocks
are the critical path; the tuner decides per bucket. Rows go to ``benchmarks/results/kv_split.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged_ratio import law_lengths  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402


def tuned_fwd_config(gpu: str, d: int, heads: int, bucket: int) -> Any:
    """The artifact's uniform CuTe forward tiles for this shape (its config dict only), else the default."""
    from kernel_templates.cute.config import HSTUCuteFwdConfig
    from kernel_templates.cute.op import default_cute_fwd_config

    path = Path(__file__).resolve().parents[1] / "artifacts" / gpu / "hstu_attention_fwd.json"
    if path.exists():
        for e in json.loads(path.read_text())["entries"]:
            if (e["backend"], e["dqk"], e["num_heads"], e["bucket"], e["distribution"]) == (
                "cute", d, heads, bucket, "uniform"
            ):
                return HSTUCuteFwdConfig.from_dict({"kv_split": 1, **e["config"]})
    return default_cute_fwd_config(d, d)


def time_split(lengths: list[int], bucket: int, d: int, heads: int, cfg: Any, seed: int) -> dict[str, Any]:
    """p20/p50/p80 ms and TFLOP/s of the forward on one batch, and its largest error against kv_split=1."""
    from kernel_templates.cute import hstu_attention_cute_fwd
    from kernel_templates.hstu_attention.reference import hstu_attention_flops
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    inp = make_jagged_inputs(lengths, heads, d, d, torch.bfloat16, "cuda", seed=seed)
    args = (inp.seq_offsets, bucket, 1.0 / d**0.5, None, 0, 0, None)
    out = hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg)
    base = hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, dataclasses.replace(cfg, kv_split=1))
    t = time_ms(lambda: hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg))
    flops, _ = hstu_attention_flops(inp.seq_offsets.cpu(), heads, d, d)
    err = (out.float() - base.float()).abs().max().item() if out.numel() else 0.0
    return {**t, "tflops": flops / (t["p50_ms"] * 1e-3) / 1e12, "max_diff_vs_unsplit": err}


def main(argv: list[str] | None = None) -> None:
    from autotune.runtime.gpus import detect_gpu
    from kernel_templates.cute.config import KV_SPLITS, partial_fits

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--laws", nargs="+", default=["uniform", "u3", "pareto", "one-long"])
    p.add_argument("--small-batches", type=int, nargs="*", default=[1, 2, 4])
    p.add_argument("--dims", type=int, nargs="+", default=[256, 128])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    gpu = detect_gpu()
    rows: list[dict[str, Any]] = []
    for d in args.dims:
        for bucket in args.buckets:
            cfg = tuned_fwd_config(gpu, d, args.heads, bucket)
            batches = [(law, law_lengths(law, bucket, args.batch, args.seed) if law != "uniform"
                        else [bucket] * args.batch) for law in args.laws]  # fmt: skip
            batches += [(f"uniform-b{b}", [bucket] * b) for b in args.small_batches]
            for law, lengths in batches:
                for split in KV_SPLITS:
                    c = dataclasses.replace(cfg, kv_split=split)
                    if not partial_fits(c, d, d):
                        continue
                    r = time_split(lengths, bucket, d, args.heads, c, args.seed)
                    rows.append({"bench": "kv_split", "d": d, "heads": args.heads, "bucket": bucket, "law": law,
                                 "batch": len(lengths), "tokens": sum(lengths), "config": c.to_dict(), **r})  # fmt: skip
                    print(f"d{d} {bucket:5d} {law:12s} split {split}: {r['p50_ms']:.4f} ms {r['tflops']:6.1f} "
                          f"TFLOP/s  diff {r['max_diff_vs_unsplit']:.2e}", flush=True)  # fmt: skip
    if not args.no_save:
        append_rows("kv_split", rows)


if __name__ == "__main__":
    main()
