"""Data-parallel training helpers: the process group, the per-rank shard of a global jagged batch, and
the workload-balanced split.

Every rank draws the same global batch (``batch_size x world`` sequences; the synthetic loader is
deterministic per seed) and keeps its shard. The plain split gives each rank an equal count of
consecutive sequences; the balanced split (as in NVIDIA's HSTU benchmark) gives ranks equal
*work*: a sequence of n tokens costs ``n^2 + w n`` (its attention pairs, plus the per-token GEMMs of
a layer measured in attention pairs, ``token_weight``), assigned most costly first to the least
loaded rank (LPT), which keeps the slowest rank within a few percent of the mean where the batch
allows it.
"""

from __future__ import annotations

import contextlib
import heapq
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kernel_templates.hstu_attention.testing import offsets_from_lengths

BALANCE = ("none", "workload")


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job (world 1: no process group)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1


def _env_int(name: str, default: str | None) -> int:
    raw = os.environ.get(name, default)
    if raw is None:
        world = os.environ["WORLD_SIZE"]
        raise ValueError(f"WORLD_SIZE={world} without {name}: start data-parallel runs with torchrun")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an int") from None


def env_info() -> DistInfo:
    """This process's place from torchrun's ``WORLD_SIZE``/``RANK``/``LOCAL_RANK``, without joining anything:
    ``ValueError`` naming the variable when they are unusable (a stray ``WORLD_SIZE`` was a bare KeyError)."""
    world = _env_int("WORLD_SIZE", "1")
    if world <= 1:
        return DistInfo()
    rank, local_rank = _env_int("RANK", None), _env_int("LOCAL_RANK", "0")
    if not 0 <= rank < world or local_rank < 0:
        raise ValueError(f"RANK={rank} / LOCAL_RANK={local_rank} do not fit WORLD_SIZE={world}")
    return DistInfo(rank, world, local_rank)


def setup(device_type: str) -> DistInfo:
    """Join the job torchrun started (``WORLD_SIZE``/``RANK``/``LOCAL_RANK``): NCCL on GPUs, gloo on CPU."""
    info = env_info()
    if not info.enabled:
        return info
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
    return info


@contextlib.contextmanager
def group_scope() -> Iterator[None]:
    """Destroy, on leaving, a process group ``setup`` created inside (never one that existed before: a caller's).

    On a clean exit every rank first meets at a barrier: a gloo group's destructor joins its worker threads
    holding the GIL, and one still holding a peer's collective in flight (DDP's last all-reduce) waits for the
    GIL, a deadlock (seen as a hung run). After a failure no barrier: a failed peer would never reach it."""
    import torch.distributed as dist

    existed = dist.is_available() and dist.is_initialized()
    clean = False
    try:
        yield
        clean = True
    finally:
        if not existed and dist.is_available() and dist.is_initialized():
            try:
                if clean:
                    dist.barrier()
            finally:  # a barrier that raised (a peer gone) still leaves no group behind
                dist.destroy_process_group()


def token_weight(cfg: Any) -> float:
    """Per-token GEMM FLOPs of a layer in units of one attention pair's FLOPs.

    Attention: 2 H (Dqk + Dv) FLOPs per (query, key) pair. GEMMs: uvqk 2 hidden x 4 H D and the output
    projection 2 H D x hidden per token, i.e. 10 hidden H D. The ratio is the ``w`` of ``n^2 + w n``
    (causal halves the pairs: n^2 / 2 pairs, so w doubles)."""
    h, d, hidden = cfg.num_heads, cfg.head_dim, cfg.hidden_dim
    return 2.0 * (10.0 * hidden * h * d) / (2.0 * h * (d + d))


def sequence_cost(n: int, weight: float) -> float:
    """Work of one sequence of ``n`` tokens: n^2 attention pairs (x2 for causal's n^2/2) + weight x n."""
    return float(n) * n + weight * n


def plain_split(num: int, world: int) -> list[list[int]]:
    """Consecutive, equal-count shards (what a sampler without workload knowledge does)."""
    per, extra = divmod(num, world)
    out, start = [], 0
    for r in range(world):
        size = per + (1 if r < extra else 0)
        out.append(list(range(start, start + size)))
        start += size
    return out


def balanced_split(costs: list[float], world: int) -> list[list[int]]:
    """Longest-processing-time-first: each sequence, most costly first, goes to the least loaded rank
    (ties: the lower rank). Deterministic; every index lands on exactly one rank, in ascending order."""
    heap = [(0.0, r) for r in range(world)]
    shards: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(heap)
        shards[r].append(i)
        heapq.heappush(heap, (load + costs[i], r))
    return [sorted(s) for s in shards]


def imbalance(shards: list[list[int]], costs: list[float]) -> float:
    """Max over mean of the per-rank work (1.0 = perfectly even)."""
    loads = [sum(costs[i] for i in s) for s in shards]
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


def split(lengths: list[int], world: int, balance: str, weight: float) -> tuple[list[list[int]], float]:
    """The shards of one global batch and their imbalance."""
    if balance not in BALANCE:
        raise ValueError(f"balance must be one of {BALANCE}, got {balance!r}")
    costs = [sequence_cost(n, weight) for n in lengths]
    shards = balanced_split(costs, world) if balance == "workload" else plain_split(len(lengths), world)
    return shards, imbalance(shards, costs)


def select_sequences(batch: Any, indices: list[int]) -> Any:
    """The jagged sub-batch of ``batch`` holding sequences ``indices`` (in that order)."""
    from models.data import JaggedBatch

    off = batch.seq_offsets.tolist()
    rows = [torch.arange(off[i], off[i + 1]) for i in indices]
    idx = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    lengths = [batch.lengths[i] for i in indices]
    return JaggedBatch(
        batch.items[idx], batch.prev_actions[idx], batch.positions[idx], batch.labels[idx],
        offsets_from_lengths(lengths), lengths,
    )  # fmt: skip


def shard(batch: Any, rank: int, world: int, balance: str, weight: float) -> tuple[Any, float]:
    """This rank's sub-batch of the global ``batch`` and the split's imbalance.

    Each row weighs ``world / global rows``: the rank's loss is then its share of the global batch's mean
    (not its own mean), and DDP's average over ranks gives the global batch's gradient whatever the ranks'
    row counts, which a workload-balanced split makes unequal."""
    shards, imb = split(batch.lengths, world, balance, weight)
    sub = select_sequences(batch, shards[rank])
    sub.weights = torch.full((sub.num_tokens,), world / max(batch.num_tokens, 1), dtype=torch.float32)
    return sub, imb


class LossModule(torch.nn.Module):
    """``forward(batch) = model.loss(batch)``: lets DDP wrap the loss, so its hooks see each step."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> torch.Tensor:
        return self.model.loss(batch)
