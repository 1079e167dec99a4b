"""Measurement primitives used inside the worker: compiler reports, correctness, timing.

Timing is ``triton.testing.do_bench`` (warm-up, L2 flush of its 256 MB buffer between repetitions,
median and 20/80 % quantiles). Under the Triton interpreter (CI) a perf_counter loop stands in:
the pipeline runs end to end but the numbers mean nothing.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

QUICK = {"warmup": 5, "rep": 20}  # ms: the cheap first measurement every correct config gets
FULL = {"warmup": 25, "rep": 100}  # ms: the full measurement, only for promising configs
INTERPRET_REPS = {True: 1, False: 3}
ATOL_REL = 1e-3  # small absolute tolerance, relative to the reference's largest magnitude
ERR_FACTOR = 2.0  # kernel error may be up to 2x PyTorch's own error in the kernel's dtype


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device() -> str:
    return "cuda" if torch.cuda.is_available() and not interpreting() else "cpu"


def synchronize() -> None:
    if device() == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def capture_compiled(jit_functions: Sequence[Any]) -> Iterator[list]:
    """Collect the compiled kernels that launches of ``jit_functions`` return (JITFunction.run).

    The launched kernel object carries the compiler's report (n_regs, n_spills, metadata.shared);
    the instance attribute shadows the class method only inside this block.
    """
    captured: list = []
    patched = []
    for fn in jit_functions:
        original = getattr(fn, "run", None)
        if original is None or "run" in vars(fn):
            continue

        def run(*args, _orig=original, **kwargs):
            kernel = _orig(*args, **kwargs)
            if kernel is not None:
                captured.append(kernel)
            return kernel

        fn.run = run
        patched.append(fn)
    try:
        yield captured
    finally:
        for fn in patched:
            with contextlib.suppress(AttributeError):
                del fn.run


def compile_report(kernels: Sequence[Any]) -> dict[str, Any]:
    """Registers, spills and shared memory of compiled Triton kernels (None under the interpreter)."""
    per = []
    for k in kernels:
        try:
            per.append(
                {
                    "name": getattr(k, "name", None) or str(getattr(k.metadata, "name", "?")),
                    "n_regs": int(k.n_regs),
                    "n_spills": int(k.n_spills),
                    "shared": int(getattr(k.metadata, "shared", 0)),
                }
            )
        except Exception:  # noqa: BLE001 - a report is best effort (interpreter, other backends)
            continue
    seen, uniq = set(), []
    for p in per:
        if p["name"] not in seen:
            seen.add(p["name"])
            uniq.append(p)
    if not uniq:
        return {"n_regs": None, "n_spills": None, "shared": None, "kernels": []}
    return {
        "n_regs": max(p["n_regs"] for p in uniq),
        "n_spills": sum(p["n_spills"] for p in uniq),
        "shared": max(p["shared"] for p in uniq),
        "kernels": uniq,
    }


def poison_allocator(nbytes: int) -> None:
    """Fill soon-to-be-reused cached GPU memory with NaN, so outputs a kernel never writes read NaN.

    For launches that allocate their own outputs (no ``out=``): the caching allocator hands the
    freed NaN block to the next allocations of similar size.
    """
    if device() != "cuda" or nbytes <= 0:
        return
    buf = torch.full((nbytes // 4 + 1,), float("nan"), dtype=torch.float32, device="cuda")
    del buf


def check_outputs(
    outs: Sequence[torch.Tensor], ref32: Sequence[torch.Tensor], ref_lo: Sequence[torch.Tensor], names: Sequence[str]
) -> tuple[bool, dict[str, Any]]:
    """Tolerance rule: max|kernel - fp32 ref| <= 2 x max|torch-in-dtype - fp32 ref| + atol, all finite."""
    detail: dict[str, Any] = {}
    ok = True
    for name, o, r, lo in zip(names, outs, ref32, ref_lo, strict=True):
        if o.shape != r.shape:
            detail[name] = f"shape {tuple(o.shape)} != {tuple(r.shape)}"
            ok = False
            continue
        o32, r32 = o.detach().float(), r.detach().float()
        if not bool(torch.isfinite(o32).all()):
            detail[name] = "non-finite values (unwritten poisoned output or overflow)"
            ok = False
            continue
        err = float((o32 - r32).abs().max()) if o32.numel() else 0.0
        torch_err = float((lo.detach().float() - r32).abs().max()) if o32.numel() else 0.0
        atol = ATOL_REL * float(r32.abs().max() if r32.numel() else 0.0) + 1e-6
        bound = ERR_FACTOR * torch_err + atol
        detail[name] = {"err": err, "bound": bound}
        ok = ok and err <= bound
    return ok, detail


def graphed(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured once into a CUDA graph; the replay drops the host's launch overhead from the timing.

    The L2 flush stays: ``do_bench`` clears its buffer before every replay, outside the graph.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compile and allocate outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bench(fn: Callable[[], Any], quick: bool, cuda_graph: bool = False) -> tuple[float, float]:
    """(median ms, spread ms = 80th - 20th percentile) of ``fn``, optionally replayed from a CUDA graph."""
    if device() == "cuda":
        import triton.testing

        p = QUICK if quick else FULL
        if cuda_graph:
            fn = graphed(fn)
        q20, q50, q80 = triton.testing.do_bench(fn, warmup=p["warmup"], rep=p["rep"], quantiles=[0.2, 0.5, 0.8])
        return float(q50), float(q80 - q20)
    times = []
    for _ in range(INTERPRET_REPS[quick]):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return times[len(times) // 2], times[-1] - times[0]
