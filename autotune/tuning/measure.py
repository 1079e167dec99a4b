"""Measurement primitives used inside the worker: compiler reports, correctness, timing; and the paired
verdict over interleaved timings that the tuner's winner-vs-default comparison takes.

Timing is ``triton.testing.do_bench`` (warm-up, L2 flush of its 256 MB buffer between repetitions,
median and 20/80 % quantiles). Under the Triton interpreter (CI) a perf_counter loop stands in:
the pipeline runs end to end but the numbers mean nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from autotune.runtime.gpus import interpreting
from kernel_templates.tolerance import error_bound

QUICK = {"warmup": 5, "rep": 20}  # ms: the cheap first measurement every correct config gets
FULL = {"warmup": 25, "rep": 100}  # ms: the full measurement, only for promising configs
# Timed samples a measurement keeps whatever the kernel's length: a 30 ms kernel would otherwise get
# three samples from FULL's 100 ms, too few to tell a 3% gain from noise.
MIN_SAMPLES = {True: 10, False: 30}
FLUSH_MS = 0.2  # rough cost of do_bench's L2 flush per sample, counted when sizing ``rep``
INTERPRET_REPS = {True: 1, False: 3}


class Timing(NamedTuple):
    """One measurement: median and spread (80th - 20th percentile) in ms, and how many samples."""

    median_ms: float
    spread_ms: float
    samples: int


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


def torch_errors(ref32: Sequence[torch.Tensor], ref_lo: Sequence[torch.Tensor]) -> list[float]:
    """PyTorch's own error in the kernel's dtype, per output: max|torch-in-dtype - fp32 ref|.

    Kept instead of the low-precision outputs themselves, so a task's large timing batch holds one
    reference copy, not two.
    """
    return [
        float((lo.detach().float() - r.detach().float()).abs().max()) if r.numel() else 0.0
        for r, lo in zip(ref32, ref_lo, strict=True)
    ]


def check_outputs(
    outs: Sequence[torch.Tensor],
    ref32: Sequence[torch.Tensor],
    torch_errs: Sequence[float],
    names: Sequence[str],
    dtypes: Sequence[torch.dtype] | None = None,
) -> tuple[bool, dict[str, Any]]:
    """The tolerance rule (``kernel_templates.tolerance``): max|kernel - fp32 ref| <= 2 x max|torch-in-dtype -
    fp32 ref| + the slack of the dtype each output must have (``dtypes``: PyTorch's own outputs' in the kernel's
    dtype; default the output's own, which would let an fp16 output of an fp32 task pass by fp16's slack), all
    finite."""
    detail: dict[str, Any] = {}
    ok = True
    if len(outs) != len(names):
        return False, {"outputs": f"{len(outs)} outputs, expected {len(names)} ({', '.join(names)})"}
    wanted = dtypes if dtypes is not None else [getattr(o, "dtype", None) for o in outs]
    for name, o, r, torch_err, dtype in zip(names, outs, ref32, torch_errs, wanted, strict=True):
        if not isinstance(o, torch.Tensor) or o.shape != r.shape:
            detail[name] = f"shape {tuple(getattr(o, 'shape', ()))} != {tuple(r.shape)}"
            ok = False
            continue
        o32, r32 = o.detach().float(), r.detach().float()
        if not bool(torch.isfinite(o32).all()):
            detail[name] = "non-finite values (unwritten poisoned output or overflow)"
            ok = False
            continue
        err = float((o32 - r32).abs().max()) if o32.numel() else 0.0
        bound = error_bound(torch_err, dtype, r32)
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


def _estimate_ms(fn: Callable[[], Any]) -> float:
    """One warm launch timed with CUDA events (sizes the sample count of the real measurement). A first
    call that takes over a second compiled something while the GPU idled: its clocks are brought back
    up (``warm_gpu``) before anything is timed."""
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    if time.perf_counter() - t0 > 1.0:
        warm_gpu(0.3)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return max(start.elapsed_time(end), 1e-3)


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a short list: timings and the tuner's
    interleaved ratios read their median and 20/80 % spread the same way."""
    xs = sorted(xs)
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def warm_gpu(seconds: float = 0.5) -> None:
    """Keep the GPU busy for ``seconds`` (bf16 matmuls) so its clocks are up before timing: a heatmap's
    first cells, timed from idle or right after a compile, measured 2-4x slow (H100, d128 1K)."""
    if device() != "cuda":
        return
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize()


def bench(fn: Callable[[], Any], quick: bool, cuda_graph: bool = False) -> Timing:
    """Median and spread (80th - 20th percentile) of ``fn`` over at least ``MIN_SAMPLES[quick]``
    samples (``do_bench``: warm-up, L2 flush per sample), optionally replayed from a CUDA graph."""
    if device() == "cuda":
        import triton.testing

        p = QUICK if quick else FULL
        if cuda_graph:
            fn = graphed(fn)
        est = _estimate_ms(fn)
        rep = max(p["rep"], MIN_SAMPLES[quick] * (1.5 * est + FLUSH_MS))
        times = [float(t) for t in triton.testing.do_bench(fn, warmup=p["warmup"], rep=rep, return_mode="all")]
        return Timing(quantile(times, 0.5), quantile(times, 0.8) - quantile(times, 0.2), len(times))
    times = []
    for _ in range(INTERPRET_REPS[quick]):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return Timing(times[len(times) // 2], times[-1] - times[0], len(times))


def compare_verdict(a_ms: list[float], b_ms: list[float]) -> dict[str, Any]:
    """Paired verdict of interleaved timings: A (candidate) beats B (default) only when its median
    gain over the per-round ratios B/A exceeds their spread (80th - 20th percentile)."""
    ratios = [b / a for a, b in zip(a_ms, b_ms, strict=True) if a > 0]
    if not ratios:
        return {"rounds": 0, "speedup": None, "spread": None, "beats": False}
    speedup = quantile(ratios, 0.5)
    spread = quantile(ratios, 0.8) - quantile(ratios, 0.2)
    return {
        "rounds": len(ratios),
        "a_ms": quantile(a_ms, 0.5),
        "b_ms": quantile(b_ms, 0.5),
        "speedup": speedup,
        "spread": spread,
        "beats": speedup - 1.0 > spread and speedup > 1.0,
    }


def compare_extended(
    request: Callable[[int], dict[str, Any]], rounds: int, max_rounds: int
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Interleaved comparison that settles a close call: when the first ``rounds`` show a median gain
    inside their spread, ``max_rounds - rounds`` more rounds are timed and the verdict is taken over all
    of them (the spread of a few rounds is set by one or two outliers). Returns the worker's reply to the
    first request and the verdict, or a failed reply (the first's or the extra rounds') and None: the extra
    rounds check their outputs as the first do, so a side that went wrong there has no verdict."""
    first = _timed(request(rounds))
    if first["status"] != "ok":
        return first, None
    a_ms, b_ms = list(first["a_ms"]), list(first["b_ms"])
    verdict = compare_verdict(a_ms, b_ms)
    if not verdict["beats"] and (verdict["speedup"] or 0.0) > 1.0 and max_rounds > rounds:
        more = _timed(request(max_rounds - rounds))
        if more["status"] != "ok":
            return more, None
        verdict = compare_verdict(a_ms + list(more["a_ms"]), b_ms + list(more["b_ms"]))
    return first, verdict


def _timed(reply: dict[str, Any]) -> dict[str, Any]:
    """``reply``, or a failed one ("timing", naming the side) when an ok reply holds a time that is no positive
    finite number (a broken clock): its median divided the TFLOP/s by 0, or was written as NaN."""
    if reply.get("status") != "ok":
        return reply
    for side in ("a", "b"):
        bad = [t for t in reply[f"{side}_ms"] if not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0)]
        if bad:
            error = f"the comparison's timing gave {bad[0]!r} ms, not a positive finite time"
            return {"status": "timing", "side": side, "error": error}
    return reply
