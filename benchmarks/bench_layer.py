"""One HSTU layer, forward + backward, column by column: what each step of the fused layer buys.

    python benchmarks/bench_layer.py --artifacts artifacts                 # H100/H200: table + JSON rows
    python benchmarks/bench_layer.py --from-json rows.jsonl --png layer.png  # re-render without a GPU

Shape of the seed layer benchmark: batch 32, 4 heads, head dim 256, hidden 1024, bf16, every sequence
of the bucket's length (1K-8K). FLOPs as that benchmark counts them: attention 3.5x its forward, the
two projections 3x theirs. Columns (each adds one thing to the previous):

1. ``default unfused``: heuristic kernels, nn modules chained by autograd (split, cat, casts);
2. ``+ tuned attention``: the tuned attention artifacts;
3. ``+ tuned fused ops``: the whole layer through ``autotune.runtime.layer`` with every op dispatched, but
   q/k/v/u copied out of uvqk and their gradients concatenated (``zero_copy=False``);
4. ``+ zero copy``: views and one d(uvqk) buffer;
5. ``+ SiLU' of u fused``: u's SiLU' inside the LN * u + dropout backward, the SiLU' pass in place (the default);
6. ``+ recompute``: SiLU(uvqk) and LN(x) recomputed in the backward (less memory, more time);
7. the forward through the fused GEMM + SiLU kernel, its pre-activation recomputed by a GEMM.

``--law`` times jagged batches instead (the heavy-tailed laws of ``bench_jagged_ratio.py``), and
``--attention-hint`` sets the model's ``attention_hint``: "auto" matches each batch's attention kernels by its fill,
"jagged" pins the entries tuned on the synthetic law (rows record law, fill and hint).

Memory: ``saved_gib`` is what the forward leaves for the backward (allocated after the forward minus
before it), the figure recompute lowers; ``peak_mem_gib`` is the peak of one forward + backward.

Each column's output and input gradient are compared with column 1 on the same inputs (max error
relative to the largest value), so a fast column that is wrong shows up in the same table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged_ratio import law_lengths  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402
from kernel_templates.hstu_attention.testing import offsets_from_lengths  # noqa: E402
from models.config import ATTENTION_HINTS  # noqa: E402

COLUMNS: list[tuple[str, dict[str, Any]]] = [
    ("default unfused", {"kernels": "default", "layer": "unfused"}),
    ("+ tuned attention", {"kernels": "tuned", "layer": "unfused"}),
    ("+ tuned fused ops", {"kernels": "tuned", "layer": "fused", "zero_copy": False}),
    ("+ zero copy", {"kernels": "tuned", "layer": "fused", "zero_copy": True, "du_silu": False}),
    ("+ SiLU' of u fused", {"kernels": "tuned", "layer": "fused", "zero_copy": True}),
    ("+ recompute", {"kernels": "tuned", "layer": "fused", "zero_copy": True, "recompute": "uvqk+ln"}),
    ("fused GEMM+SiLU, pre recomputed", {"kernels": "tuned", "layer": "fused", "zero_copy": True, "recompute": "pre"}),
]


def layer_flops(lengths: list[int], heads: int, d: int, hidden: int) -> float:
    """Forward + backward FLOPs: attention 3.5x its forward (HSTU.md convention), GEMMs 3x."""
    from kernel_templates.hstu_attention.reference import hstu_attention_flops

    offsets = offsets_from_lengths(lengths)
    attn_fwd = hstu_attention_flops(offsets, heads, d, d, 0, None, 0)[0]
    tokens = sum(lengths)
    gemm_fwd = 2 * tokens * hidden * 4 * heads * d + 2 * tokens * heads * d * hidden
    return 3.5 * attn_fwd + 3 * gemm_fwd


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12))


def run_column(cfg: Any, x: torch.Tensor, offsets: torch.Tensor, dout: torch.Tensor, state: dict) -> dict[str, Any]:
    """Time one column's layer (fwd + bwd) and measure its peak memory and its error against column 1."""
    from models.hstu import HSTULayer

    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(x.device)
    layer.train()
    xg = x.detach().clone().requires_grad_(True)

    def step() -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=x.is_cuda):
            out = layer(xg, offsets)
        out.backward(dout)
        return out

    out = step()  # compiles; the result is compared below
    ref = state.setdefault("ref", (out.detach(), xg.grad.detach().clone()))
    err = {"out_rel_err": _rel_err(out.detach(), ref[0]), "dx_rel_err": _rel_err(xg.grad, ref[1])}
    if x.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = layer(xg, offsets)
        err["saved_gib"] = (torch.cuda.memory_allocated() - base) / 2**30
        out.backward(dout)
        del out
        torch.cuda.synchronize()
        err["peak_mem_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {**time_ms(step), **err}


def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    import autotune
    from models.config import get_config

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.artifacts:
        autotune.load(args.artifacts, gpu=args.gpu, allow_same_arch=args.allow_same_arch)
    rows = []
    for n in args.lengths:
        lengths = [n] * args.batch if args.law == "full" else law_lengths(args.law, n, args.batch, args.seed)
        base = get_config(
            "seed", max_seq_len=n, min_seq_len=min(256, n), batch_size=args.batch, dropout=args.dropout,
            num_heads=args.heads, head_dim=args.head_dim, hidden_dim=args.heads * args.head_dim,
            length_dist="full" if args.law == "full" else "heavy_tailed", attention_hint=args.attention_hint,
        )  # fmt: skip
        if device.type != "cuda":
            base = base.replace(num_heads=2, head_dim=32, hidden_dim=64)
        gen = torch.Generator(device="cpu").manual_seed(n)
        L, hidden = sum(lengths), base.hidden_dim
        x = torch.randn(L, hidden, generator=gen).to(device, torch.bfloat16 if device.type == "cuda" else torch.float32)
        dout = torch.randn(L, hidden, generator=gen).to(device, x.dtype)
        offsets = offsets_from_lengths(lengths, device, torch.int32)
        flops = layer_flops(lengths, base.num_heads, base.head_dim, hidden)
        state: dict = {}
        for name, overrides in COLUMNS:
            if args.columns and name not in args.columns:
                continue
            cfg = base.replace(**overrides)
            try:
                r = run_column(cfg, x, offsets, dout, state)
                r["tflops"] = flops / (r["p50_ms"] * 1e-3) / 1e12
            except Exception as e:  # noqa: BLE001 - a failing column is a row with its reason, not a crash
                r = {"error": f"{type(e).__name__}: {e}"[:500]}
            jagged = {"law": args.law, "fill": round(L / (args.batch * n), 4), "attention_hint": args.attention_hint}
            row = {"bench": "layer", "column": name, "seq_len": n, "batch": args.batch, "heads": base.num_heads,
                   "head_dim": base.head_dim, "hidden": hidden, "dtype": str(x.dtype).removeprefix("torch."),
                   "flops": flops, **(jagged if args.law != "full" or args.attention_hint != "auto" else {}),
                   **overrides, **r}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return rows


def _length_label(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def _series(rows: list[dict[str, Any]]) -> tuple[list[str], dict[tuple[str, int], dict[str, Any]]]:
    """(series names in column order, row per (series, length)). A series is a column, and for jagged rows its law
    and attention hint too: rows of one column under two hints (``--law pareto`` run with ``--attention-hint auto``
    and ``jagged``, then rendered together) took one cell, the last row hiding the other."""

    def name(r: dict[str, Any]) -> str:
        return f"{r['column']} ({r['law']}, hint {r['attention_hint']})" if "law" in r else r["column"]

    order = {c: i for i, (c, _) in enumerate(COLUMNS)}
    names = sorted({name(r) for r in rows}, key=lambda s: (order.get(s.split(" (")[0], len(order)), s))
    return names, {(name(r), r["seq_len"]): r for r in rows}


def figure(rows: list[dict[str, Any]]) -> Any:
    """Bar chart per length and column: TFLOP/s, and beside it peak memory where the rows have it (a GPU run),
    since what recompute buys is memory, not speed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["seq_len"] for r in rows})
    names, cell = _series(rows)
    panels = [("tflops", "TFLOP/s (fwd + bwd)")]
    if any(r.get("peak_mem_gib") is not None for r in rows):
        panels.append(("peak_mem_gib", "peak memory (GiB, fwd + bwd)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(9 * len(panels), 4.5), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, (key, label) in zip(axes[0], panels, strict=True):
        for i, c in enumerate(names):
            vals = [cell.get((c, n), {}).get(key) or 0.0 for n in lengths]
            ax.bar([j + i * width for j in range(len(lengths))], vals, width, label=c)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))])
        ax.set_xticklabels([_length_label(n) for n in lengths])
        ax.set_ylabel(label)
        gpu = rows[0].get("gpu")
        ax.set_title(f"One HSTU layer, {gpu}" if gpu else "One HSTU layer")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def render(rows: list[dict[str, Any]], png: str | None) -> str:
    """Markdown table (TFLOP/s and peak GiB per column and length) and an optional bar chart (``figure``)."""
    lengths = sorted({r["seq_len"] for r in rows})
    names, cell = _series(rows)

    def fmt(r: dict | None) -> str:
        if r is None:
            return "-"
        if "error" in r:
            return "error"
        if r.get("tflops") is None:  # a NaN timing, written as null (rows.append_rows)
            return "nan"
        mem = f" / {r['peak_mem_gib']:.1f} GiB" if r.get("peak_mem_gib") is not None else ""
        return f"{r['tflops']:.0f}{mem}"

    head = "| column | " + " | ".join(_length_label(n) for n in lengths) + " |"
    lines = [head, "|---" * (len(lengths) + 1) + "|"]
    lines += ["| " + c + " | " + " | ".join(fmt(cell.get((c, n))) for n in lengths) + " |" for c in names]
    if png:
        figure(rows).savefig(png, dpi=120)
    return "\n".join(lines)


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors before any layer runs: a misspelt ``--columns`` name ran no column at all (an empty table,
    nothing said), a length or batch below 1 failed inside the first column, a head dim without a kernel of its
    own made every fused column an error row, and a missing ``--from-json`` was a traceback."""
    from autotune.tuning.cli_checks import writable_file
    from benchmarks.bench_jagged import check_batch_args
    from benchmarks.cli_args import (
        at_least,
        attention_head_dims,
        existing_file,
        existing_folder,
        probability,
        usage_errors,
    )

    names = [name for name, _ in COLUMNS]
    unknown = [c for c in args.columns or [] if c not in names]
    if unknown:
        p.error(f"--columns: unknown column(s) {unknown}; known: {names}")
    check_batch_args(p, args, "--lengths")
    at_least(args, 0, "--seed")
    with usage_errors(p):
        probability("--dropout", args.dropout)
        if any(o["layer"] == "fused" for c, o in COLUMNS if not args.columns or c in args.columns):
            attention_head_dims("--head-dim", args.head_dim, kernel=True)  # the fused layer's views need one
        existing_folder("--artifacts", args.artifacts)
        existing_file("--from-json", args.from_json)
        if args.png:  # written after every column ran
            writable_file("--png", args.png)
    if not args.from_json and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        # Every column was an error row, appended to benchmarks/results/layer.jsonl.
        p.error("bench_layer.py needs a CUDA GPU (or TRITON_INTERPRET=1 to run the Triton kernels on the CPU)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument(
        "--law",
        default="full",
        choices=("full", "u3", "pareto", "one-long"),
        help="sequence lengths: all at the length (full), or a heavy-tailed law of bench_jagged_ratio.py",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the law's lengths")
    p.add_argument(
        "--attention-hint",
        default="auto",
        choices=ATTENTION_HINTS,
        help="the model's attention_hint: auto = uniform for full lengths, else matched by fill",
    )
    p.add_argument("--columns", nargs="*", default=None, help="only these columns")
    p.add_argument("--artifacts", default=None, help="tuned artifacts folder (default: the packaged ones)")
    p.add_argument("--gpu", default=None)
    p.add_argument("--allow-same-arch", action="store_true", help="H100 artifacts on an H200")
    p.add_argument("--from-json", default=None, help="render rows from this .jsonl instead of running")
    p.add_argument("--png", default=None)
    p.add_argument("--no-save", action="store_true", help="do not append rows to benchmarks/results")
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    args = p.parse_args(argv)
    check_options(p, args)
    if args.from_json:
        rows = [json.loads(line) for line in Path(args.from_json).read_text().splitlines() if line.strip()]
        rows = [r for r in rows if r.get("bench") == "layer"]
    else:
        import autotune

        if args.artifacts is None:
            autotune.load(allow_same_arch=args.allow_same_arch)
        rows = bench(args)
        if not args.no_save:
            append_rows("layer", rows)
    print(render(rows, args.png))


if __name__ == "__main__":
    main()
