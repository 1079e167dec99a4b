"""Plain grid against the compact tile order of the CuTe attention kernels, on uniform and skewed batches.

    python benchmarks/bench_compact.py --buckets 1024 2048 4096 8192 --laws uniform u3 pareto one-long empty \
        --batches 32 128

For each (bucket, law, batch) it takes the shipped artifact's config for the bucket (the ``uniform`` entry
for uniform batches, the ``jagged`` one otherwise; read from the JSON, so entries tuned before ``compact``
existed still serve as the baseline) and times the CuTe forward and backward launchers with that config
as it is (``grid``), with ``compact=True`` (``compact``), and with ``compact=True, l2_group=0`` (one
longest-processing-time order over the whole batch, ``compact-lpt``). bf16, causal, ``--dims`` x
``--heads``. Rows go to ``benchmarks/results/compact_order.jsonl``.
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

from benchmarks.bench_jagged import _inputs  # noqa: E402
from benchmarks.bench_jagged_ratio import LAWS, law_lengths  # noqa: E402
from benchmarks.cli_args import at_least, attention_head_dims, existing_folder, one_of, usage_errors  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402

VARIANTS = ("grid", "compact", "compact-lpt")


def artifact_config(gpu: str, direction: str, d: int, heads: int, bucket: int, dist: str, root: Path) -> dict:
    """The config dict of the artifact entry for this shape (nearest bucket of the same family)."""
    path = root / gpu / f"hstu_attention_{direction}.json"
    entries = [
        e
        for e in json.loads(path.read_text())["entries"]
        if e["dqk"] == d and e["num_heads"] == heads and e["distribution"] == dist and e["backend"] == "cute"
    ]
    if not entries:
        raise SystemExit(f"{path}: no cute entry for d={d} heads={heads} {dist}")
    best = min(entries, key=lambda e: abs(e["bucket"] - bucket))
    return dict(best["config"])


def variant_config(cls: type, base: dict, variant: str):
    """``base`` (an entry from before ``compact`` existed reads as the plain grid) in launch order ``variant``."""
    cfg = cls.from_dict({"compact": False, **base})
    if variant == "compact-lpt":
        return dataclasses.replace(cfg, compact=True, l2_group=0)
    return dataclasses.replace(cfg, compact=variant == "compact")


def measure(lengths: list[int], bucket: int, args: argparse.Namespace, gpu: str, law: str) -> list[dict[str, Any]]:
    from kernel_templates.cute import (
        HSTUCuteBwdConfig,
        HSTUCuteFwdConfig,
        hstu_attention_cute_bwd,
        hstu_attention_cute_fwd,
    )
    from kernel_templates.hstu_attention.reference import hstu_attention_flops

    d, heads = args.head_dim, args.heads
    q, k, v, do, off = _inputs(lengths, heads, d, args.seed)
    fwd_flops, bwd_flops = hstu_attention_flops(off.cpu(), heads, d, d)
    dist = "uniform" if law == "uniform" else "jagged"
    alpha = 1.0 / d**0.5
    rows = []
    for direction, cls, flops in (("fwd", HSTUCuteFwdConfig, fwd_flops), ("bwd", HSTUCuteBwdConfig, bwd_flops)):
        base = artifact_config(gpu, direction, d, heads, bucket, dist, Path(args.artifacts))
        for variant in VARIANTS:
            cfg = variant_config(cls, base, variant)
            if direction == "fwd":
                out = torch.empty_like(v)

                def fn(cfg=cfg, out=out) -> None:
                    hstu_attention_cute_fwd(q, k, v, off, bucket, alpha, None, 0, 0, None, cfg, out=out)
            else:

                def fn(cfg=cfg) -> None:
                    hstu_attention_cute_bwd(do, q, k, v, off, bucket, alpha, config=cfg, validate=False)

            t = time_ms(fn)
            rows.append({
                "bench": "compact_order", "law": law, "bucket": bucket, "batch": len(lengths), "d": d, "heads": heads,
                "tokens": sum(lengths), "direction": direction, "variant": variant, "config": cfg.to_dict(),
                "p20_ms": t["p20_ms"], "p50_ms": t["p50_ms"], "p80_ms": t["p80_ms"],
                "tflops": flops / (t["p50_ms"] * 1e-3) / 1e12,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    return rows


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before the GPU check: a batch of 0 or a misspelt law failed after earlier shapes were timed,
    and a head dim no CuTe kernel has or a missing artifacts folder ended the run at the first artifact read."""
    with usage_errors(p):
        at_least(args, 1, "--buckets", "--batches", "--heads")
        attention_head_dims("--head-dim", args.head_dim, kernel=True)
        one_of("--laws", args.laws, ("uniform", *(law for law in LAWS if law != "file")))  # 'file' needs a sample
        existing_folder("--artifacts", args.artifacts)
        if args.gpu is not None:
            existing_folder("--gpu", str(Path(args.artifacts) / args.gpu))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--laws", nargs="+", default=["uniform", "u3", "pareto", "one-long", "empty"])
    p.add_argument("--batches", type=int, nargs="+", default=[32])
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpu", default=None, help="artifact folder (default: h200 on an H200, else h100)")
    p.add_argument("--artifacts", default=str(Path(__file__).resolve().parents[1] / "artifacts"))
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    check_options(p, args)
    if not torch.cuda.is_available():  # torch's "not compiled with CUDA" AssertionError traceback otherwise
        raise SystemExit("bench_compact.py needs a CUDA GPU")
    gpu = args.gpu or ("h200" if "H200" in torch.cuda.get_device_name() else "h100")
    rows: list[dict[str, Any]] = []
    for bucket in args.buckets:
        for batch in args.batches:
            for law in args.laws:
                lengths = [bucket] * batch if law == "uniform" else law_lengths(law, bucket, batch, args.seed)
                rows += measure(lengths, bucket, args, gpu, law)
    if not args.no_save:
        append_rows("compact_order", rows)
    print("| bucket | batch | law | dir | grid | compact | compact-lpt | best / grid |")
    print("|---|---|---|---|---|---|---|---|")
    by_case: dict[tuple, dict[str, float]] = {}
    for r in rows:
        by_case.setdefault((r["bucket"], r["batch"], r["law"], r["direction"]), {})[r["variant"]] = r["tflops"]
    for (bucket, batch, law, direction), t in by_case.items():
        best = max(t["compact"], t["compact-lpt"]) / t["grid"]
        cells = " | ".join(f"{t[v]:.0f}" for v in VARIANTS)
        print(f"| {bucket} | {batch} | {law} | {direction} | {cells} | {best:.2f} |")


if __name__ == "__main__":
    main()
