"""Train the HSTU ranking model on synthetic jagged data and report throughput.

    python -m models.train --preset tiny --kernels reference --steps 20
    python -m models.train --preset seed --kernels tuned --steps 30 --json out.json

Reports tokens/s, model TFLOP/s (attention by docs/CONTRACTS.md, fwd + bwd; GEMMs as 6 x params x tokens),
MFU against the GPU registry's peak, and peak GPU memory; the same numbers go to ``--json``.
Warm-up steps (Triton compilation, allocator growth) are excluded from the timings.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import distributed
from .config import (
    KERNEL_SOURCES,
    LAYER_IMPLS,
    PRECISIONS,
    PRESETS,
    RECOMPUTE,
    ModelConfig,
    get_config,
    parse_overrides,
)
from .data import JaggedBatch, make_loader
from .hstu import HSTURankingModel
from .metrics import detect_gpu_name, model_flops_utilization, peak_tflops, step_flops


def autocast_context(device: torch.device, dtype: str, cache: bool = True) -> contextlib.AbstractContextManager:
    """bf16 autocast (or none for fp32). ``cache=False`` for CUDA graphs: no cast weights kept across steps."""
    if dtype == "fp32":
        return contextlib.nullcontext()
    if dtype != "bf16":
        raise ValueError(f"dtype must be 'bf16' or 'fp32', got {dtype!r}")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=cache)


def train_step(
    model: HSTURankingModel,
    opt: torch.optim.Optimizer,
    batch: JaggedBatch,
    amp: contextlib.AbstractContextManager,
    loss_fn: Any = None,
    timer: list | None = None,
    update: bool = True,
) -> torch.Tensor:
    """One forward/backward/Adam step; returns the loss (a device tensor, no host sync). ``update=False``
    drops the gradients instead of stepping (the untimed priming pass).

    ``loss_fn`` (default ``model.loss``) is the DDP-wrapped loss in data-parallel runs. ``timer``
    (CUDA only) gets the (start, end) events of the forward: a rank's own compute, with no
    collective inside, which the backward's overlapped all-reduce would hide."""
    events = None
    if timer is not None:
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    with amp:
        loss = (loss_fn or model.loss)(batch)
    if events is not None:
        events[1].record()
        timer.append(events)
    loss.backward()
    if update:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def build(cfg: ModelConfig, device: torch.device) -> tuple[HSTURankingModel, torch.optim.Optimizer]:
    """Model and Adam, seeded by ``cfg.seed`` (same init for every kernel source)."""
    torch.manual_seed(cfg.seed)
    model = HSTURankingModel(cfg).to(device)
    fused = device.type == "cuda"
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=fused, capturable=cfg.cuda_graph)
    return model, opt


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class _Tally:
    """What the timed steps of one run add up: tokens, FLOPs, losses, per-rank balance and timings."""

    tokens: int = 0
    real_tokens: int = 0  # rows the graphed steps computed on, padding excluded
    captures_before: int = 0
    pad_before: int = 0
    elapsed: float = 0.0
    flops: dict[str, float] = field(default_factory=lambda: {"attention": 0.0, "gemm": 0.0, "total": 0.0})
    losses: list[tuple[int, float]] = field(default_factory=list)
    imbalances: list[float] = field(default_factory=list)
    fwd_events: list = field(default_factory=list)


@dataclass
class _Run:
    """A prepared run: device, process group, model, optimiser and how each step is taken."""

    cfg: ModelConfig
    device: torch.device
    dtype: str
    dist_info: Any
    gpu_name: str | None
    dispatch_summary: Any
    model: HSTURankingModel
    opt: torch.optim.Optimizer
    amp: contextlib.AbstractContextManager
    graphed: Any = None
    loss_fn: Any = None


def run(
    cfg: ModelConfig,
    steps: int,
    device: str | torch.device = "cpu",
    warmup: int = 2,
    dtype: str | None = None,
    artifacts: str | None = None,
    gpu: str | None = None,
    log_every: int = 10,
    workers: int = 0,
    progress: bool = True,
    console: Console | None = None,
    balance: str = "workload",
    allow_same_arch: bool = False,
    prime: bool | None = None,
) -> dict[str, Any]:
    """Train ``warmup + steps`` steps and return the metrics dict (losses, tokens/s, TFLOP/s, MFU).

    ``prime`` (default: on a CUDA device, eager steps) runs the timed batches' forward and backward once,
    untimed and without an optimizer step, before the clock starts: dispatch picks kernels per batch (max
    length, fill ratio), so a jagged batch may select a config no warm-up step compiled, and that compile
    would land in the timed steps of whichever variant ran first.

    Under torchrun (``WORLD_SIZE`` > 1) every rank trains its shard of a global batch of
    ``batch_size x world`` sequences through DDP; ``balance`` "workload" gives ranks equal attention
    + GEMM work (``models.distributed``), "none" equal sequence counts.
    """
    for name, val, low in (("steps", steps, 1), ("warmup", warmup, 0), ("log_every", log_every, 1),
                           ("workers", workers, 0)):  # fmt: skip
        if isinstance(val, bool) or not isinstance(val, int) or val < low:
            raise ValueError(f"{name} must be an int >= {low}, got {val!r}")
    if balance not in distributed.BALANCE:
        raise ValueError(f"balance must be one of {distributed.BALANCE}, got {balance!r}")
    if prime is not None and not isinstance(prime, bool):
        raise ValueError(f"prime must be a bool or None, got {prime!r}")
    if not isinstance(cfg, ModelConfig):
        raise ValueError(f"cfg must be a ModelConfig (models.config.get_config), got {type(cfg).__name__}")
    cfg.validate()  # a config built without replace/get_config: its bad field named, not a later symptom
    if cfg.graph_tokens and not cfg.cuda_graph:  # as the CLI says it: else the steps ran eagerly, padding unused
        raise ValueError("graph_tokens pads the batches of cuda_graph steps: set cuda_graph=True too")
    if dtype not in (None, "bf16", "fp32"):  # else found by autocast_context after the model was built
        raise ValueError(f"dtype must be 'bf16', 'fp32' or None, got {dtype!r}")
    if not isinstance(device, (str, torch.device)):
        raise ValueError(f"device must be a str or torch.device (cpu, cuda[:N]), got {device!r}")
    r = _prepare(cfg, torch.device(device), dtype, artifacts, gpu, allow_same_arch)
    prime = (r.device.type == "cuda" and r.graphed is None) if prime is None else prime
    if r.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(r.device)
    global_cfg = cfg.replace(batch_size=cfg.batch_size * r.dist_info.world)
    loader = iter(make_loader(global_cfg, warmup + steps, workers=workers, pin=r.device.type == "cuda"))
    console = console or Console(stderr=True)
    tally = _train(r, loader, steps, warmup, log_every, balance, progress, console, prime)
    world_tokens, rank_fwd_ms = _reduce_ranks(r, tally)
    return {**_report(r, tally, steps, warmup, balance, world_tokens, rank_fwd_ms), "primed": prime}


def default_dtype(device: str | torch.device) -> str:
    """The compute dtype when none is given: bf16 autocast on a GPU, fp32 elsewhere."""
    return "bf16" if torch.device(device).type == "cuda" else "fp32"


def check_precision(cfg: ModelConfig, dtype: str) -> None:
    """precision="bf16" keeps activations in the run's compute dtype: with dtype "fp32" that is fp32, a run
    that would be reported as bf16 precision while computing in fp32."""
    if cfg.precision == "bf16" and dtype == "fp32":
        raise ValueError(
            "precision='bf16' keeps activations in the compute dtype, which dtype='fp32' makes fp32: "
            "pass dtype 'bf16' (--dtype bf16, a GPU's default) or precision 'autocast'"
        )


def check_device(device: torch.device) -> None:
    """Training runs on the CPU or a CUDA GPU that is there: another device type (meta, ...) fails inside the first
    step's autocast, and a missing GPU with torch's bare assertion after the set-up."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:N], got {str(device)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this host")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: this host has {torch.cuda.device_count()} CUDA device(s)")


def check_kernels(cfg: ModelConfig, device: torch.device) -> None:
    """Kernels 'default' and 'tuned' are Triton / CuTe GPU kernels: on the CPU only the Triton interpreter runs
    them. Without it the first step failed deep inside dispatch, after the set-up."""
    if cfg.kernels != "reference" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(
            f"--kernels {cfg.kernels} runs Triton/CuTe GPU kernels, which need a CUDA device or TRITON_INTERPRET=1 "
            "on the CPU: pass --kernels reference (PyTorch attention) to train on the CPU"
        )


def _prepare(
    cfg: ModelConfig,
    device: torch.device,
    dtype: str | None,
    artifacts: str | None,
    gpu: str | None,
    allow_same_arch: bool,
) -> _Run:
    """Device and process group, the tuned artifacts (``kernels="tuned"``), model, Adam and the step form."""
    check_device(device)
    check_kernels(cfg, device)
    if cfg.cuda_graph and device.type != "cuda":
        raise ValueError(f"cuda_graph needs a CUDA device, got device {str(device)!r}")
    dist_info = distributed.setup(device.type)
    if cfg.cuda_graph and dist_info.enabled:
        raise ValueError("cuda_graph is for one process; data-parallel training (torchrun) runs eagerly")
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
        torch.cuda.set_device(device)
    dtype = dtype or default_dtype(device)
    check_precision(cfg, dtype)
    # The registry key, as autotune.load reads it: "H100" loaded h100's artifacts but found no peak (MFU None).
    gpu_name = (gpu.strip().lower() if isinstance(gpu, str) else gpu) or detect_gpu_name(device)
    dispatch_summary = None
    if cfg.kernels == "tuned":
        import autotune

        dispatch_summary = autotune.load(artifacts, gpu=gpu_name, allow_same_arch=allow_same_arch)
    model, opt = build(cfg, device)
    amp = autocast_context(device, dtype, cache=not cfg.cuda_graph)
    r = _Run(cfg, device, dtype, dist_info, gpu_name, dispatch_summary, model, opt, amp)
    if cfg.cuda_graph:
        from .graphs import GraphedTrainStep

        r.graphed = GraphedTrainStep(model, opt, amp, cfg.max_seq_len, cfg.graph_tokens or cfg.max_seq_len)
    if dist_info.enabled:
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        r.loss_fn = DistributedDataParallel(distributed.LossModule(model), device_ids=ids)
    return r


def _prime(r: _Run, batches: list, balance: str, weight: Any) -> None:
    """Forward and backward of each batch, untimed: the kernels its shape selects compile now. No optimizer
    step, gradients dropped, and the RNG streams restored, so training goes on exactly as unprimed."""
    devices = [r.device] if r.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        for batch in batches:
            if r.dist_info.enabled:
                batch, _ = distributed.shard(batch, r.dist_info.rank, r.dist_info.world, balance, weight)
            train_step(r.model, r.opt, batch.to(r.device), r.amp, r.loss_fn, update=False)


def _train(
    r: _Run,
    loader: Any,
    steps: int,
    warmup: int,
    log_every: int,
    balance: str,
    progress: bool,
    console: Console,
    prime: bool = False,
) -> _Tally:
    """Take every step; the timed ones (after ``warmup``) add to the tally, primed first when ``prime``.
    Losses are read back every ``log_every`` steps, so steps between reads run without a host sync."""
    cfg, device, dist_info, graphed = r.cfg, r.device, r.dist_info, r.graphed
    dense = r.model.dense_params()
    weight = distributed.token_weight(cfg)
    tally = _Tally()
    pending: list[tuple[int, torch.Tensor]] = []
    t0 = time.perf_counter()
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*cols, TimeRemainingColumn(), TextColumn("{task.fields[loss]}"), console=console,
                  disable=not progress, transient=False) as bar:  # fmt: skip
        task = bar.add_task(f"{cfg.kernels} train", total=warmup + steps, loss="")
        for step in range(warmup + steps):
            if step == warmup:
                if prime:
                    timed = [next(loader) for _ in range(steps)]
                    _prime(r, timed, balance, weight)
                    loader = iter(timed)
                _sync(device)
                t0 = time.perf_counter()
                tally.captures_before = graphed.captures if graphed else 0
                tally.pad_before = graphed.padding_rows if graphed else 0
            batch = next(loader)
            if dist_info.enabled:
                batch, imb = distributed.shard(batch, dist_info.rank, dist_info.world, balance, weight)
                if step >= warmup:  # of the timed steps, as every other number of the report (warm-up's too skewed it)
                    tally.imbalances.append(imb)
            if step >= warmup:
                tally.tokens += batch.num_tokens
                for key, val in step_flops(cfg, batch.lengths, dense).items():
                    tally.flops[key] += val
            timer = tally.fwd_events if (step >= warmup and dist_info.enabled and device.type == "cuda") else None
            if graphed is not None:
                if step >= warmup:
                    tally.real_tokens += batch.num_tokens
                pending.append((step, graphed(batch.to(device))))
            else:
                pending.append((step, train_step(r.model, r.opt, batch.to(device), r.amp, r.loss_fn, timer)))
            if (step + 1) % log_every == 0 or step + 1 == warmup + steps:
                tally.losses.extend(_read_losses(pending, dist_info, cfg.lr))
                pending.clear()
                bar.update(task, loss=f"loss {tally.losses[-1][1]:.4f}")
                if not progress and dist_info.rank == 0:  # the global mean: once, not once per rank
                    console.print(f"step {step + 1}: loss {tally.losses[-1][1]:.4f}")
            bar.advance(task)
    _sync(device)
    tally.elapsed = time.perf_counter() - t0
    return tally


def _read_losses(pending: list[tuple[int, torch.Tensor]], dist_info: Any, lr: float) -> list[tuple[int, float]]:
    """The pending steps' losses on the host (one sync): in data-parallel runs the global batch's mean, summed
    over the ranks' shares; a non-finite loss stops the run (``FloatingPointError``), since every later step
    and the throughput measured on it would be of a diverged model."""
    values = torch.stack([v.float().reshape(()) for _, v in pending])
    if dist_info.enabled:
        import torch.distributed as dist

        dist.all_reduce(values)
        values /= dist_info.world  # each rank's loss is world / global rows x its rows' sum
    out = [(s, float(v)) for (s, _), v in zip(pending, values.tolist(), strict=True)]
    bad = next(((s, v) for s, v in out if not math.isfinite(v)), None)
    if bad is not None:
        raise FloatingPointError(f"the loss is {bad[1]} at step {bad[0] + 1}: training diverged (lr={lr})")
    return out


def _reduce_ranks(r: _Run, tally: _Tally) -> tuple[int, list[float] | None]:
    """(tokens of every rank, each rank's forward ms per step); in data-parallel runs the slowest rank
    sets ``tally.elapsed`` and the FLOPs become the world's."""
    if not r.dist_info.enabled:
        return tally.tokens, None
    import torch.distributed as dist

    # Every FLOP count, not the total alone: the report's attention and GEMM TFLOP per step were this rank's shard
    # (half the world's on two ranks) beside a total, tokens/s and MFU of the world's.
    keys = ("attention", "gemm", "total")
    agg = torch.tensor([float(tally.tokens), *(tally.flops[k] for k in keys)], dtype=torch.float64, device=r.device)
    times = torch.tensor([tally.elapsed], dtype=torch.float64, device=r.device)
    dist.all_reduce(agg)  # summed tokens and FLOPs of every rank
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank sets the step time
    world_tokens, tally.elapsed = int(agg[0]), float(times[0])
    tally.flops.update(zip(keys, (float(v) for v in agg[1:]), strict=True))
    rank_fwd_ms = None
    if tally.fwd_events:
        events = tally.fwd_events
        mine = torch.tensor([sum(a.elapsed_time(b) for a, b in events) / len(events)], device=r.device)
        every = [torch.zeros_like(mine) for _ in range(r.dist_info.world)]
        dist.all_gather(every, mine)
        rank_fwd_ms = [float(t) for t in every]
    return world_tokens, rank_fwd_ms


def _report(
    r: _Run,
    tally: _Tally,
    steps: int,
    warmup: int,
    balance: str,
    world_tokens: int,
    rank_fwd_ms: list[float] | None,
) -> dict[str, Any]:
    """The metrics dict of ``run``."""
    device, graphed, elapsed, imbalances = r.device, r.graphed, tally.elapsed, tally.imbalances
    tflops = tally.flops["total"] / elapsed / 1e12
    peak = peak_tflops(r.gpu_name)
    return {
        "kernels": r.cfg.kernels,
        "device": str(device),
        "gpu": r.gpu_name,
        "dtype": r.dtype,
        "steps": steps,
        "warmup": warmup,
        "timed_s": elapsed,
        "step_ms": 1e3 * elapsed / steps,
        "tokens": world_tokens,
        "tokens_per_s": world_tokens / elapsed,
        "world": r.dist_info.world,
        "balance": balance if r.dist_info.enabled else None,
        "imbalance_mean": sum(imbalances) / len(imbalances) if imbalances else None,
        "imbalance_max": max(imbalances) if imbalances else None,
        # per-rank forward compute (ms per step) and its spread (slowest / fastest rank)
        "rank_fwd_ms": rank_fwd_ms,
        "rank_fwd_spread": max(rank_fwd_ms) / min(rank_fwd_ms) if rank_fwd_ms and min(rank_fwd_ms) > 0 else None,
        "imbalance_per_step": imbalances,
        "cuda_graph": r.cfg.cuda_graph,
        # graphs captured in all / in the timed steps (their warm-up and capture are timed), and the
        # padding rows the graphs computed on as a share of the real rows of the timed steps
        "graph_captures": graphed.captures if graphed else None,
        "graph_captures_timed": graphed.captures - tally.captures_before if graphed else None,
        "graph_padding_share": (graphed.padding_rows - tally.pad_before) / max(tally.real_tokens, 1)
        if graphed
        else None,
        "tflops": tflops,
        "attention_tflop_per_step": tally.flops["attention"] / steps / 1e12,
        "gemm_tflop_per_step": tally.flops["gemm"] / steps / 1e12,
        "peak_tflops": peak,
        "mfu": model_flops_utilization(tflops, peak, r.dist_info.world),  # tflops and FLOPs are the world's
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "dense_params": r.model.dense_params(),
        "total_params": sum(p.numel() for p in r.model.parameters()),
        "first_loss": tally.losses[0][1],
        "final_loss": tally.losses[-1][1],
        "losses": tally.losses,
        "config": r.cfg.to_dict(),
        "dispatch": _dispatch_report(r.dispatch_summary),
        "versions": {"torch": torch.__version__, "python": platform.python_version(), "triton": _triton_version()},
    }


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


def _dispatch_report(loaded: dict[str, Any] | None) -> dict[str, Any]:
    """Which configs ran (from dispatch's cache) and every fallback warning issued. A call without a distribution
    hint is chosen by its fill too, so one kernel and bucket can hold a choice per fill bin: each says its fill."""
    from autotune.runtime import dispatch

    choices = [
        {"kind": k[0], "dtype": str(k[1]), "dqk": k[2], "dv": k[3], "heads": k[4], "length_bucket": k[5],
         "distribution": k[6], "source": k[7], "mask": k[8],
         "fill": None if k[9] is None else round(2.0 ** (k[9] / dispatch.FILL_STEPS), 4),
         "backend": c.backend, "config": json.loads(c.config), "chosen_from": c.source, "bucket": c.bucket}
        for k, c in dispatch.cached_choices().items()
    ]  # fmt: skip
    return {"loaded": loaded, "choices": choices, "warnings": list(dispatch.WARNINGS)}


def print_summary(result: dict[str, Any], console: Console) -> None:
    """One line per metric."""
    fmt = lambda v, f: "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, f)  # noqa: E731
    console.print(
        f"[bold]{result['kernels']}[/bold]: loss {result['first_loss']:.4f} -> {result['final_loss']:.4f} | "
        f"{fmt(result['tokens_per_s'], ',.0f')} tokens/s | {fmt(result['step_ms'], '.1f')} ms/step | "
        f"{fmt(result['tflops'], '.1f')} TFLOP/s | MFU {fmt(result['mfu'], '.1%')} | "
        f"peak mem {fmt(result['peak_memory_gib'], '.2f')} GiB"
    )


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.train", description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="tiny", help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--kernels", default=None, help=f"{' | '.join(KERNEL_SOURCES)} (default: the preset's, 'default')")
    p.add_argument(
        "--layer", default=None, help=f"{' | '.join(LAYER_IMPLS)} (fused: one autograd function over tuned kernels)"
    )
    p.add_argument(
        "--precision",
        default=None,
        help=f"{' | '.join(PRECISIONS)} (autocast: fp32 residual stream; bf16: fused layer)",
    )
    p.add_argument(
        "--recompute",
        default=None,
        help=f"{' | '.join(RECOMPUTE)} (fused layer; pre: the pre-activation by a GEMM, SiLU's output kept)",
    )
    p.add_argument(
        "--cuda-graph",
        action="store_true",
        help="replay the training step from CUDA graphs (batches padded to a multiple of --graph-tokens rows)",
    )
    p.add_argument("--graph-tokens", type=int, default=None, help="padding granularity in rows (default max_seq_len)")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation)")
    p.add_argument(
        "--no-prime",
        action="store_true",
        help="skip the untimed forward/backward of the timed batches (on by default on a GPU, eager steps)",
    )
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when available)")
    p.add_argument(
        "--dtype", default=None, choices=("bf16", "fp32"), help="bf16 (autocast; GPU default) or fp32 (CPU default)"
    )
    p.add_argument(
        "--artifacts",
        default=None,
        help="tuned artifact directory (kernels=tuned; default: the packaged artifacts, autotune.load())",
    )
    p.add_argument("--gpu", default=None, help="artifact GPU name (default: detected)")
    p.add_argument(
        "--allow-same-arch",
        action="store_true",
        help="accept artifacts of a same-architecture GPU (H100 on H200)",
    )
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--set", nargs="*", action="extend", default=[], metavar="KEY=VALUE", help="config overrides (repeatable)"
    )
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers for data generation")
    p.add_argument("--json", default=None, help="write the metrics here")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--balance",
        default="workload",
        choices=distributed.BALANCE,
        help="data-parallel shards (torchrun): equal attention+GEMM work (default) or equal counts",
    )
    return p


def _check_cli_args(args: argparse.Namespace, cfg: ModelConfig, device: str) -> None:
    """What ``run`` would refuse only after set-up, and a ``--json`` path that could not be written after
    the whole run: ``ValueError`` naming the option."""
    for name, low in (("steps", 1), ("warmup", 0), ("workers", 0), ("log_every", 1)):
        if getattr(args, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    check_device(torch.device(device))
    distributed.env_info()  # torchrun's variables, named when unusable
    if cfg.cuda_graph and torch.device(device).type != "cuda":
        raise ValueError(f"--cuda-graph needs a CUDA device, got --device {device}")
    if cfg.graph_tokens and not cfg.cuda_graph:
        raise ValueError("--graph-tokens (graph_tokens) pads the batches of --cuda-graph steps: pass --cuda-graph too")
    check_precision(cfg, args.dtype or default_dtype(device))
    check_kernels(cfg, torch.device(device))
    if cfg.kernels != "tuned":  # only --kernels tuned loads artifacts: with others both were ignored without a word
        given = [o for o, v in (("--artifacts", args.artifacts), ("--allow-same-arch", args.allow_same_arch)) if v]
        if given:
            raise ValueError(f"{given[0]} picks the tuned artifacts, which only --kernels tuned loads "
                             f"(kernels is {cfg.kernels!r}): pass --kernels tuned too")  # fmt: skip
    if args.artifacts is not None and not Path(args.artifacts).is_dir():  # else every kernel fell back, warned
        raise ValueError(f"--artifacts {args.artifacts}: no such folder (an artifacts root: <gpu>/<kernel>.json)")
    from autotune.runtime.artifacts import artifact_files
    from autotune.runtime.gpus import GPUS

    if args.gpu is not None and args.gpu.lower() not in GPUS:
        raise ValueError(f"--gpu {args.gpu!r}: unknown GPU key; known: {', '.join(sorted(GPUS))}")
    if args.json and not writable_file_path(Path(args.json)):
        raise ValueError(f"--json {args.json}: not a writable file path")
    if args.json and Path(args.json).resolve() in artifact_files(GPUS, args.artifacts):
        # main removes the --json file before the run and writes the metrics there after it: a tuned artifact was
        # deleted (the run fell back to the defaults) and replaced by a file autotune.load rejects
        raise ValueError(f"--json {args.json}: an artifact file of {args.artifacts or 'the packaged artifacts'} "
                         "(the metrics would replace it); name another file")  # fmt: skip
    if args.json and cfg.lengths_file and Path(args.json).resolve() == Path(cfg.lengths_file).resolve():
        # main removes the --json file before the run, and every batch reads the lengths file: the user's lengths
        # were deleted and the first batch failed on the missing file (a traceback)
        raise ValueError(f"--json {args.json}: is the lengths_file the batches draw from; name another file")


def writable_file_path(path: Path) -> bool:
    """Whether ``path`` can be written after its missing folders are made: not a folder, and its nearest
    existing ancestor (where ``mkdir(parents=True)`` starts) a writable folder, not a file."""
    if path.is_dir():
        return False
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    return parent.is_dir() and os.access(parent, os.W_OK)


def _json_safe(obj: Any) -> Any:
    """``obj`` with every non-finite float as None: ``json`` writes NaN and Infinity, which are not JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    """A report as strict JSON (a non-finite number as null; anything else not JSON as its str), its missing
    folders made, written atomically: a reader never sees half a report."""
    from autotune.runtime.artifacts import write_atomically

    text = json.dumps(_json_safe(obj), indent=2, default=str, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, lambda tmp: Path(tmp).write_text(text))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = make_parser()
    args = parser.parse_args(argv)
    console = Console(stderr=True)
    try:
        overrides = parse_overrides(args.set)
    except ValueError as e:
        parser.error(str(e))
    if args.kernels is not None:  # else the preset's, or what --set kernels=... says
        overrides["kernels"] = args.kernels
    for name in ("layer", "precision", "recompute"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    if args.seed is not None:
        overrides["seed"] = args.seed
    if args.cuda_graph:
        overrides["cuda_graph"] = True
    if args.graph_tokens is not None:
        overrides["graph_tokens"] = args.graph_tokens
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        cfg = get_config(args.preset, **overrides)
        _check_cli_args(args, cfg, device)
    except (ValueError, RuntimeError) as e:  # RuntimeError: torch.device's message for a bad --device
        parser.error(str(e))
    rank0 = distributed.env_info().rank == 0
    if args.json and rank0:  # a run that fails writes no JSON: an older file there would read as this run's
        Path(args.json).unlink(missing_ok=True)
    try:
        with distributed.group_scope():  # under torchrun: the group run() joins is left at the end
            result = run(cfg, args.steps, device, args.warmup, args.dtype, args.artifacts, args.gpu, args.log_every,
                         args.workers, progress=not args.no_progress and rank0, console=console,
                         balance=args.balance, allow_same_arch=args.allow_same_arch,
                         prime=False if args.no_prime else None)  # fmt: skip
    except FloatingPointError as e:
        console.print(f"[red]error:[/red] {e}")
        raise SystemExit(1) from None
    result["preset"] = args.preset
    if not rank0:
        return result
    print_summary(result, console)
    for w in result["dispatch"]["warnings"]:
        console.print(f"[yellow]dispatch fallback:[/yellow] {w}")
    if args.json:
        write_json(Path(args.json), result)
    return result


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
