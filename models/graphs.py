"""The whole training step (forward, backward, Adam) as CUDA graphs: one capture per batch shape, replays after.

A graph fixes every tensor shape, and jagged batches change their row count every step. So a batch is
padded up to a capacity, the next multiple of ``granularity`` rows, with ``slots`` extra padding
sequences (each at most ``max_seq_len`` long, possibly empty) so the sequence count is fixed as well.
Padding rows weigh 0 in the loss and the real rows 1 / (real rows): the loss, and so every gradient and
update, is the one the unpadded batch gives (attention never mixes sequences; every other op is per
row). One graph is captured per (capacity, batch size); all share one memory pool, which is safe
because the graphs run one after another on one stream and keep no state between replays besides the
parameters and the optimizer's, which live outside the pool.

Capturing changes nothing about training: the optimizer's state is created before the first capture by
a step with zero gradients (which moves no parameter) and its step counters reset, and the warm-up
passes that compile kernels before a capture discard their gradients.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from kernel_templates.hstu_attention.testing import offsets_from_lengths

from .data import JaggedBatch


def graph_capacity(num_tokens: int, granularity: int) -> int:
    """Rows of the captured batch: ``num_tokens`` rounded up to a multiple of ``granularity`` (at least one)."""
    if granularity < 1:
        raise ValueError(f"granularity must be >= 1, got {granularity}")
    return max(1, math.ceil(num_tokens / granularity)) * granularity


def padding_slots(granularity: int, max_seq_len: int) -> int:
    """Padding sequences every captured batch carries: enough for ``granularity`` rows of padding, the most any
    batch needs (an empty batch pads one whole granule, ``graph_capacity(0, granularity)``; any other at most
    ``granularity - 1`` rows), and at least one so every captured batch has the same sequence count."""
    return max(1, math.ceil(granularity / max_seq_len))


def padding_lengths(pad: int, slots: int, max_seq_len: int) -> list[int]:
    """``pad`` rows as ``slots`` sequences of at most ``max_seq_len`` (full ones first, then empty ones)."""
    if not 0 <= pad <= slots * max_seq_len:
        raise ValueError(f"{pad} padding rows do not fit {slots} sequences of at most {max_seq_len}")
    full, rest = divmod(pad, max_seq_len)
    out = [max_seq_len] * full + ([rest] if rest else [])
    return out + [0] * (slots - len(out))


def padded_offsets(lengths: list[int], capacity: int, slots: int, max_seq_len: int) -> torch.Tensor:
    """Host offsets of ``lengths`` followed by ``slots`` padding sequences filling up to ``capacity`` rows."""
    n = sum(lengths)
    if n > capacity:
        raise ValueError(f"batch has {n} rows, more than the capacity {capacity}")
    return offsets_from_lengths(list(lengths) + padding_lengths(capacity - n, slots, max_seq_len))


def pad_batch(batch: JaggedBatch, capacity: int, slots: int, max_seq_len: int) -> JaggedBatch:
    """``batch`` padded to ``capacity`` rows and ``len(batch.lengths) + slots`` sequences, with loss weights.

    Padding rows hold item 0, action 0, position 0 and zero labels in sequences of their own, so the
    real rows see exactly what they saw before; they weigh 0 in the loss, the real rows 1 / (real rows)."""
    offsets = padded_offsets(batch.lengths, capacity, slots, max_seq_len)
    dev = batch.items.device

    def buffer(t: torch.Tensor) -> torch.Tensor:
        return t.new_empty((capacity, *t.shape[1:]))

    out = JaggedBatch(
        buffer(batch.items), buffer(batch.prev_actions), buffer(batch.positions), buffer(batch.labels),
        torch.empty_like(offsets, device=dev), [int(v) for v in offsets.diff()],
        torch.empty(capacity, dtype=torch.float32, device=dev),
    )  # fmt: skip
    load_padded(out, batch, offsets)
    return out


def load_padded(static: JaggedBatch, batch: JaggedBatch, offsets: torch.Tensor) -> None:
    """Write ``batch`` and its padding into the buffers of a padded batch (asynchronous device work only;
    ``offsets`` is the host tensor from :func:`padded_offsets`)."""
    n = batch.num_tokens
    for dst, src in ((static.items, batch.items), (static.prev_actions, batch.prev_actions),
                     (static.positions, batch.positions), (static.labels, batch.labels)):  # fmt: skip
        dst[:n].copy_(src, non_blocking=True)
        dst[n:].zero_()
    static.weights[:n].fill_(1.0 / max(n, 1))
    static.weights[n:].zero_()
    static.seq_offsets.copy_(offsets, non_blocking=True)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    static: JaggedBatch
    loss: torch.Tensor


class GraphedTrainStep:
    """``step(batch) -> loss``: the training step of ``model`` and ``opt`` replayed from CUDA graphs.

    ``opt`` must be built with ``capturable=True``. ``granularity`` (rows) trades padding against the
    number of graphs: a uniform-length batch is captured once; a jagged stream gets one graph per
    capacity it reaches. ``captures`` and ``padding_rows`` say what that cost."""

    def __init__(
        self,
        model: torch.nn.Module,
        opt: torch.optim.Optimizer,
        amp: contextlib.AbstractContextManager,
        max_seq_len: int,
        granularity: int,
        warmup_passes: int = 2,
    ) -> None:
        if not torch.cuda.is_available():
            raise ValueError("cuda_graph needs a CUDA device")
        if not all(g.get("capturable", False) for g in opt.param_groups):
            raise ValueError("cuda_graph needs an optimizer built with capturable=True")
        self.model, self.opt, self.amp = model, opt, amp
        self.max_seq_len, self.granularity = max_seq_len, granularity
        self.slots = padding_slots(granularity, max_seq_len)
        self.warmup_passes = warmup_passes
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Captured] = {}
        self.captures = 0
        self.padding_rows = 0

    def __call__(self, batch: JaggedBatch) -> torch.Tensor:
        """One training step on ``batch`` (already on the GPU); returns its loss (a fresh device tensor)."""
        capacity = graph_capacity(batch.num_tokens, self.granularity)
        self.padding_rows += capacity - batch.num_tokens
        key = (capacity, len(batch.lengths))
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(pad_batch(batch, capacity, self.slots, self.max_seq_len))
        else:
            load_padded(entry.static, batch, padded_offsets(batch.lengths, capacity, self.slots, self.max_seq_len))
        entry.graph.replay()
        return entry.loss.clone()

    def _loss(self, batch: JaggedBatch) -> torch.Tensor:
        with self.amp:
            return self.model.loss(batch)

    def _capture(self, static: JaggedBatch) -> _Captured:
        """Warm up on ``static`` (the graph's input buffers, holding this step's batch) and capture."""
        self._init_optimizer_state()
        self.opt.zero_grad(set_to_none=True)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup_passes):  # compile kernels, size workspaces; gradients discarded
                self._loss(static).backward()
                self.opt.zero_grad(set_to_none=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                loss = self._loss(static)
                loss.backward()
                self.opt.step()
        except RuntimeError as exc:
            raise RuntimeError(
                f"capturing the training step as a CUDA graph failed (an operation synchronised with the host "
                f"or is not capturable): {exc}; train without cuda_graph"
            ) from exc
        self.captures += 1
        # Keep the output alone: its autograd graph would keep this capture's gradient-accumulation nodes
        # alive into the next capture's warm-up (on another stream).
        return _Captured(graph, static, loss.detach())

    @torch.no_grad()
    def _init_optimizer_state(self) -> None:
        """Create the optimizer state outside any graph (a capture must not allocate or zero it).

        A step with zero gradients creates the state (Adam's moments stay zero); the parameters it
        touched are put back and the step counters reset, so the first real step is the eager one."""
        params = [p for g in self.opt.param_groups for p in g["params"] if p.requires_grad]
        missing = [p for p in params if not self.opt.state.get(p)]
        if not missing:
            return
        ids = {id(p) for p in missing}
        saved = [p.detach().clone() for p in missing]
        for p in params:
            p.grad = torch.zeros_like(p) if id(p) in ids else None
        self.opt.step()
        for p, before in zip(missing, saved, strict=True):
            p.copy_(before)
            step = self.opt.state[p].get("step")
            if torch.is_tensor(step):
                step.zero_()
        self.opt.zero_grad(set_to_none=True)
