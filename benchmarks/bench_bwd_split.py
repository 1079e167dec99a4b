"""CuTe backward with split key blocks (``m_chunk``) against the unsplit config, on one GPU run.

    python benchmarks/bench_bwd_split.py --buckets 1024 2048 4096 --laws uniform u3 one-long \
        --batches 1 32 --chunks 0 2 4 8

For every (bucket, law, batch) it times ``hstu_attention_cute_bwd`` (bf16, causal, launcher only: no
dispatch) with the base config of ``--block`` and each ``m_chunk`` of ``--chunks``, after checking
each split result against the unsplit one on the same inputs (dq, dk, dv within 1e-2 of the largest
value: the split only reorders fp32 additions). Rows go to ``benchmarks/results/bwd_split.jsonl``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.bench_jagged_ratio import law_lengths  # noqa: E402
from benchmarks.rows import append_rows, time_ms  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--buckets", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--laws", nargs="+", default=["uniform", "u3", "one-long"])
    p.add_argument("--batches", type=int, nargs="+", default=[32])
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 2, 4, 8])
    p.add_argument("--block", default="64,64,1", help="block_m,block_n,num_stages[,do_stages[,dq_serial]]")
    p.add_argument("--l2-group", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=256)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--no-save", action="store_true")
    args = p.parse_args(argv)
    from kernel_templates.cute import HSTUCuteBwdConfig, hstu_attention_cute_bwd
    from kernel_templates.hstu_attention.reference import hstu_attention_flops

    parts = args.block.split(",")
    base = HSTUCuteBwdConfig(int(parts[0]), int(parts[1]), int(parts[2]), l2_group=args.l2_group,
                             do_stages=int(parts[3]) if len(parts) > 3 else None,
                             dq_serial=len(parts) > 4 and parts[4] == "1")  # fmt: skip
    d, heads = args.head_dim, args.heads
    rows = []
    for bucket in args.buckets:
        for law in args.laws:
            for batch in args.batches:
                lengths = [bucket] * batch if law == "uniform" else law_lengths(law, bucket, batch, args.seed)
                gen = torch.Generator(device="cuda").manual_seed(args.seed)
                total = sum(lengths)
                q, k, v, do = (torch.randn(total, heads, d, generator=gen, device="cuda").to(torch.bfloat16)
                               for _ in range(4))  # fmt: skip
                off = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                flops = hstu_attention_flops(off.cpu(), heads, d, d)[1]
                ref = None
                for m_chunk in args.chunks:
                    cfg = dataclasses.replace(base, m_chunk=m_chunk)

                    def run(cfg=cfg):
                        return hstu_attention_cute_bwd(do, q, k, v, off, bucket, d**-0.5, config=cfg, validate=False)

                    got = run()
                    if ref is None:
                        ref = got
                    err = max(((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)).item()
                              for a, b in zip(got, ref, strict=True))  # fmt: skip
                    t = time_ms(run)
                    row = {"bench": "bwd_split", "bucket": bucket, "law": law, "batch": batch, "tokens": total,
                           "d": d, "heads": heads, "config": cfg.to_dict(), "m_chunk": m_chunk, "rel_err": err,
                           **t, "tflops": flops / (t["p50_ms"] * 1e-3) / 1e12}  # fmt: skip
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    if err > 1e-2:
                        raise SystemExit(f"m_chunk={m_chunk} differs from the unsplit result by {err:.3g}")
    if not args.no_save:
        append_rows("bwd_split", rows)
    print("| bucket | law | batch | " + " | ".join(f"m_chunk {c}" for c in args.chunks) + " |")
    print("|---|---|---|" + "---|" * len(args.chunks))
    for i in range(0, len(rows), len(args.chunks)):
        grp = rows[i : i + len(args.chunks)]
        cells = " | ".join(f"{r['tflops']:.0f} ({r['p50_ms']:.3f} ms)" for r in grp)
        print(f"| {grp[0]['bucket']} | {grp[0]['law']} | {grp[0]['batch']} | {cells} |")


if __name__ == "__main__":
    main()
