"""Each non-attention op of the HSTU layer, every backend, against a plain copy kernel in the same run.

    python benchmarks/bench_layer_ops.py --artifacts artifacts      # tuned (where an entry exists) + defaults

For every kernel of the fused layer (``autotune.runtime.layer.LAYER_KERNELS`` minus attention) and
token count (batch 32 x 1K / 4K / 8K, hidden 1024, 4 heads x 256, bf16), times each backend's default
config and the dispatched one (tuned entry when ``--artifacts`` has one) on the tuner's representative
inputs (``KernelSpec.make_inputs``). Memory-bound ops report GB/s from ``KernelSpec.bytes`` next to the
bandwidth of ``dst.copy_(src)`` moving the same bytes in the same run (the ratio is the figure of
merit); GEMM ops report TFLOP/s. Rows go to ``benchmarks/results/layer_ops.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.cli_args import at_least, attention_head_dims, existing_folder, needs_gpu, usage_errors  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402


def copy_gbps(nbytes: float) -> float:
    """Bandwidth of a device-to-device copy that reads and writes ``nbytes`` in total."""
    n = max(1, int(nbytes // 4))  # bf16 elements read (= written): 2 bytes x 2 directions
    src = torch.randn(n, device="cuda").to(torch.bfloat16)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src))
    return 4 * n / (t["p50_ms"] * 1e-3) / 1e9


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from autotune import spec
    from autotune.runtime import dispatch
    from autotune.runtime.gpus import detect_gpu
    from autotune.runtime.layer import LAYER_KERNELS
    from autotune.tuning.tasks import Task

    gpu = detect_gpu()
    rows = []
    kernels = [k for k in LAYER_KERNELS if not k.startswith("hstu_attention")]
    for n in args.lengths:
        task = Task("layer", gpu, "bfloat16", args.head_dim, args.head_dim, args.heads, n, "uniform", batch=args.batch)
        lengths = [n] * args.batch
        copy_cache: dict[float, float] = {}
        for kind in kernels:
            ks = spec.kernel(kind)
            inputs = spec.resolve(ks.make_inputs)(task, lengths, 0, "cuda", torch.bfloat16)
            nbytes = spec.resolve(ks.bytes)(inputs) if ks.bytes else None
            flops = spec.resolve(ks.flops)(inputs)
            if nbytes and nbytes not in copy_cache:
                copy_cache[nbytes] = copy_gbps(nbytes)
            chosen = dispatch.select(kind, torch.bfloat16, args.head_dim, args.head_dim, args.heads, n, "uniform")
            defaults = spec.resolve(ks.default)(args.head_dim, args.head_dim, args.heads, torch.bfloat16, False)
            variants = [(f"{b} default", b, c) for b, c in defaults.items()]
            if chosen.source != "default":
                cfg = dispatch.decode_config(chosen.backend, kind, chosen.config)
                variants.append((f"{chosen.backend} {chosen.source}", chosen.backend, cfg))
            for label, backend, cfg in variants:
                if not dispatch.backend_available(backend, kind):
                    continue
                launch = spec.resolve(ks.backend(backend).tune_launch)
                try:
                    t = time_ms(lambda launch=launch, cfg=cfg, inputs=inputs: launch(inputs, cfg, None))
                except Exception as e:  # noqa: BLE001 - one failing variant is a row with its reason
                    rows.append({"bench": "layer_ops", "kernel": kind, "variant": label, "error": str(e)[:300]})
                    continue
                row = {"bench": "layer_ops", "kernel": kind, "variant": label, "seq_len": n, "batch": args.batch,
                       "tokens": n * args.batch, "config": cfg.to_dict(), **t,
                       "tflops": flops / (t["p50_ms"] * 1e-3) / 1e12}  # fmt: skip
                if nbytes:
                    row["gbps"] = nbytes / (t["p50_ms"] * 1e-3) / 1e9
                    row["copy_gbps"] = copy_cache[nbytes]
                    row["of_copy"] = row["gbps"] / row["copy_gbps"]
                print(json.dumps({k: v for k, v in row.items() if k != "config"}), flush=True)
                rows.append(row)
    return rows


def render(rows: list[dict[str, Any]]) -> str:
    lines = ["| kernel | variant | tokens | ms | GB/s | copy GB/s | of copy | TFLOP/s |", "|---" * 8 + "|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['variant']} | error: {r['error'][:60]} | | | | | |")
            continue
        gb = (f"{r['gbps']:.0f}", f"{r['copy_gbps']:.0f}", f"{r['of_copy']:.0%}") if "gbps" in r else ("", "", "")
        lines.append(f"| {r['kernel']} | {r['variant']} | {r['tokens']} | {r['p50_ms']:.3f} | {' | '.join(gb)} | "
                     f"{r['tflops']:.1f} |")  # fmt: skip
    return "\n".join(lines)


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before the GPU check: a batch of 0 or a head dim the fused layer has no kernels for failed
    inside the first op's inputs, and a misspelt ``--artifacts`` timed the defaults as if tuned."""
    with usage_errors(p):
        at_least(args, 1, "--lengths", "--batch", "--heads")
        attention_head_dims("--head-dim", args.head_dim, kernel=True)  # a layer plan takes the kernels' head dims only
        existing_folder("--artifacts", args.artifacts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--artifacts", default=None)
    p.add_argument("--allow-same-arch", action="store_true")
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    check_options(p, args)
    needs_gpu("bench_layer_ops.py")
    import autotune

    if args.artifacts:
        autotune.load(args.artifacts, allow_same_arch=args.allow_same_arch)
    rows = bench(args)
    if not args.no_save:
        append_rows("layer_ops", rows)
    print(render(rows))


if __name__ == "__main__":
    main()
