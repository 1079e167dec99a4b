"""Benchmark: CuTe sm90 GEMM + bias + SiLU vs ``F.silu(F.linear(x, W, b))`` on the uvqk projection shapes.

Times each config with ``benchmarks.rows.time_ms`` (warm-up, L2 flush between samples; p20/p50/p80),
reports TFLOP/s = 2 M N K / p50, and checks every timed config against the fp32 reference with the
project's tolerance rule (error <= 2 x PyTorch-in-dtype error + 1e-3 x max|ref|) before timing it.
Rows (GPU, versions, git sha, shape, p20/p50/p80) are appended to ``benchmarks/results/gemm_silu.jsonl``;
``--json`` also writes them, as before, to one file.

    python benchmarks/bench_gemm_silu.py --json runs/gemm_silu.json
    python benchmarks/bench_gemm_silu.py --m 65536 --nk 4096x1024 --configs default
    python benchmarks/bench_gemm_silu.py --pre --m 131072 --nk 4096x1024 \
        --configs default,128x256s4p,cfg:128/256/64/2/1/4/n/1

``--pre`` times what a training step runs: y and the stored pre-activation, both checked (the torch row is
addmm into the pre-activation, then SiLU into y; ``addmm`` alone, the cuBLAS GEMM, is the floor). A
``cfg:`` name is a config's fields in order, split by ``/`` (booleans as 0/1).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.rows import append_rows, environment, time_ms  # noqa: E402
from kernel_templates.gemm_silu import (  # noqa: E402
    GemmSiluConfig,
    default_gemm_silu_config,
    gemm_silu_flops,
    gemm_silu_fwd,
    gemm_silu_pre_reference,
    gemm_silu_reference,
    gemm_silu_torch,
)
from kernel_templates.gemm_silu.launch import gemm_silu_fwd_torch  # noqa: E402

# Hand-picked alternatives to the heuristic default (the tuner searches the full space).
EXTRA_CONFIGS = {
    "128x256c21": GemmSiluConfig(128, 256, 64, 2, 1, 4, "n"),
    "128x256s4p": GemmSiluConfig(128, 256, 64, 1, 1, 4, "n", True),
    "192x128": GemmSiluConfig(192, 128, 64, 1, 1, 4, "n"),
    "128x128s6": GemmSiluConfig(128, 128, 64, 1, 1, 6, "n"),
}


def config_named(name: str, m: int, n: int, k: int) -> GemmSiluConfig:
    """``default``, a name of EXTRA_CONFIGS, or ``cfg:`` and the fields in order split by ``/`` (booleans 0/1)."""
    if name == "default":
        return default_gemm_silu_config(m, n, k)
    if name.startswith("cfg:"):
        fields = name[4:].split("/")
        # The config's own fields and types, so a new tunable needs no edit here.
        readers = {"int": int, "str": str, "bool": lambda f: bool(int(f))}
        kinds = [readers[f.type] for f in dataclasses.fields(GemmSiluConfig)]
        if not 1 <= len(fields) <= len(kinds):
            raise ValueError(f"--configs {name!r}: expected up to {len(kinds)} fields")
        return GemmSiluConfig(*(read(f) for read, f in zip(kinds, fields, strict=False)))
    if name not in EXTRA_CONFIGS:
        raise ValueError(f"--configs: unknown config {name!r} (default, {', '.join(EXTRA_CONFIGS)} or cfg:...)")
    return EXTRA_CONFIGS[name]


def _parse_nk(text: str) -> list[tuple[int, int]]:
    out = []
    for part in text.split(","):
        n, k = part.lower().split("x")
        out.append((int(n), int(k)))
    return out


def check_options(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[list[int], list[tuple], list[str]]:
    """(M values, (N, K) pairs, config names), once every option is usable: a malformed ``--m`` or ``--nk`` was a
    ValueError traceback, an unknown ``--configs`` name failed after the torch rows of the first shape were timed,
    and a ``--json`` that cannot be written lost every row at the end."""
    from autotune.tuning.cli_checks import int_in, writable_file
    from benchmarks.cli_args import positive, usage_errors

    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        p.error(f"--m must be comma-separated integers, got {args.m!r}")
    try:
        nks = _parse_nk(args.nk)
    except ValueError:
        p.error(f"--nk must be comma-separated NxK pairs (4096x1024), got {args.nk!r}")
    names = [c.strip() for c in args.configs.split(",") if c.strip()]
    with usage_errors(p):
        for m in ms:
            int_in("--m", m, 1)
        for n, k in nks:
            int_in("--nk", n, 1)
            int_in("--nk", k, 1)
        if not names:
            raise ValueError(f"--configs names no config, got {args.configs!r}")
        for name in names:  # the config of the first shape: an unknown name or a bad field raises here
            try:
                config_named(name, ms[0], *nks[0])
            except ValueError as e:
                raise ValueError(str(e) if str(e).startswith("--configs") else f"--configs {name!r}: {e}") from None
        positive("--rep", args.rep)
        if args.json:
            writable_file("--json", args.json)
    return ms, nks, names


def check(out: torch.Tensor, ref32: torch.Tensor, ref_lo: torch.Tensor) -> tuple[bool, float, float]:
    """(ok, error, bound) under the tolerance rule (max norm, NaN never passes)."""
    err = (out.float() - ref32).abs().max().item()
    bound = 2.0 * (ref_lo.float() - ref32).abs().max().item() + 1e-3 * ref32.abs().max().item()
    return bool(torch.isfinite(out).all().item()) and err <= bound, err, bound


def bench_shape(
    m: int, n: int, k: int, dtype: torch.dtype, names: list[str], rep_ms: float, pre: bool = False
) -> list[dict[str, Any]]:
    """One row per config of this shape; a config is timed only once its outputs passed the check."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    b = (torch.randn(n, generator=g, device="cuda") * 0.5).to(dtype)
    ref32 = gemm_silu_reference(x, w, b)
    ref_lo = gemm_silu_torch(x, w, b)
    pre32 = gemm_silu_pre_reference(x, w, b) if pre else None
    pre_lo = gemm_silu_pre_reference(x, w, b, dtype) if pre else None
    flops = gemm_silu_flops(m, n, k)
    rows: list[dict[str, Any]] = []
    pre_out = torch.empty(m, n, dtype=dtype, device="cuda") if pre else None

    def record(name: str, config: dict | None, fn, out: torch.Tensor, pre_got: torch.Tensor | None = None) -> None:
        ok, err, bound = check(out, ref32, ref_lo)
        if pre_got is not None:
            ok_p, err_p, bound_p = check(pre_got, pre32, pre_lo)
            ok, err, bound = ok and ok_p, max(err, err_p), min(bound, bound_p)
        row = {"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "name": name, "config": config}
        row.update(correct=ok, max_err=err, bound=bound, pre=pre)
        if ok:
            t = time_ms(fn, rep_ms=rep_ms)
            ms = t["p50_ms"]
            row.update(t, ms=ms, tflops=flops / (ms * 1e-3) / 1e12)
        rows.append(row)
        tf = f"{row['tflops']:7.1f} TFLOP/s  {row['ms']:.3f} ms" if ok else "INCORRECT (not timed)"
        print(f"  {name:14s} {tf}  err {err:.2e} <= {bound:.2e}", flush=True)

    print(f"M={m} N={n} K={k} {dtype}{' y + pre' if pre else ''}", flush=True)
    out = torch.empty(m, n, dtype=dtype, device="cuda")
    if pre:
        record("addmm", None, lambda: torch.addmm(b, x, w.t(), out=pre_out), ref_lo)
        rows[-1].update(correct=None, note="the cuBLAS GEMM alone (no SiLU): a floor, not checked")

        def torch_pair() -> None:  # the torch backend's launcher, as the layer and the tuner call it
            gemm_silu_fwd_torch(x, w, b, out=out, pre_out=pre_out)

        torch_pair()
        record("torch", None, torch_pair, out, pre_out)
    else:
        record("torch", None, lambda: gemm_silu_torch(x, w, b), ref_lo)
    for name in names:
        cfg = config_named(name, m, n, k)
        out.fill_(float("nan"))
        if pre:
            pre_out.fill_(float("nan"))
        try:
            t0 = time.perf_counter()
            gemm_silu_fwd(x, w, b, cfg, out=out, pre_out=pre_out)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - report and go on with the other configs
            rows.append({"m": m, "n": n, "k": k, "dtype": str(dtype).removeprefix("torch."), "name": name,
                         "config": cfg.to_dict(), "error": repr(e)[:500]})  # fmt: skip
            print(f"  {name:14s} FAILED: {e!r}"[:300], flush=True)
            continue
        record(name, cfg.to_dict(), lambda cfg=cfg: gemm_silu_fwd(x, w, b, cfg, out=out, pre_out=pre_out), out, pre_out)
        rows[-1]["first_call_s"] = compile_s
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--m", default="32768,65536,131072", help="token counts M, comma-separated")
    p.add_argument("--nk", default="4096x1024,1024x4096", help="N x K pairs, comma-separated")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--configs", default="default," + ",".join(EXTRA_CONFIGS), help="default and/or extra names")
    p.add_argument("--rep", type=float, default=50.0, help="time_ms budget per config (ms; at least 20 samples)")
    p.add_argument("--pre", action="store_true", help="time y and the stored pre-activation (a training step)")
    p.add_argument("--json", default=None, help="also write the rows here (one JSON file)")
    p.add_argument("--no-save", action="store_true", help="do not append rows to benchmarks/results")
    args = p.parse_args(argv)
    ms, nks, names = check_options(p, args)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("bench_gemm_silu: needs an sm90 (Hopper) GPU", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    rows: list[dict[str, Any]] = []
    for n, k in nks:
        for m in ms:
            rows += bench_shape(m, n, k, dtype, names, args.rep, args.pre)
            torch.cuda.empty_cache()
    if not args.no_save:
        append_rows("gemm_silu", rows)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "env": environment(), "rows": rows}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0 if all(r.get("correct") is not False and "error" not in r for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
