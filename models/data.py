"""Synthetic jagged user histories for the HSTU ranking model, deterministic from a seed.

Each user has a hidden taste (a few item categories). Items are drawn from the taste with
probability ``taste_prob`` (else any category), with Zipf popularity inside a category. Labels,
per position and task: task 0 ("click") = the item's category is in the user's taste; task 1
("like") = click and a popular item; further tasks = click and a hash of the item. The taste is only
visible through the history, so the task needs attention and the loss falls as the model learns it.
The model sees item i together with the action of event i-1 (so nothing leaks into position i).

Sample ``i`` depends only on (seed, i); batch ``j`` holds samples ``j*B .. j*B+B-1``, whatever the
number of DataLoader workers, so every kernel source trains on the same data.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .config import ModelConfig, file_lengths


def sample_length(rng: np.random.Generator, cfg: ModelConfig) -> int:
    """One sequence length: full (= max), uniform in [min, max], heavy-tailed (max * u^3), or a draw from
    the config's lengths file raised to min_seq_len."""
    if cfg.length_dist == "full":
        return cfg.max_seq_len
    if cfg.length_dist == "uniform":
        return int(rng.integers(cfg.min_seq_len, cfg.max_seq_len + 1))
    if cfg.length_dist == "file":
        lengths = file_lengths(cfg.lengths_file)
        return int(max(cfg.min_seq_len, lengths[int(rng.integers(len(lengths)))]))
    n = math.ceil(cfg.max_seq_len * float(rng.random()) ** 3)
    return int(min(cfg.max_seq_len, max(cfg.min_seq_len, n)))


def length_sample(cfg: ModelConfig, n: int = 4096, seed: int = 0) -> list[int]:
    """``n`` seeded draws of ``sample_length``: the data config's length law as a sample, so the tuner
    (``autotune run --from-model``) draws its representative batches from the lengths training sees."""
    cfg.validate()  # a config built directly: an unknown length_dist drew heavy-tailed lengths without a word
    rng = np.random.default_rng(seed)
    return [sample_length(rng, cfg) for _ in range(n)]


def _zipf_probs(n: int, alpha: float) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return p / p.sum()


@dataclass
class Sample:
    """One user's history: item ids, the previous event's action, labels (n, tasks)."""

    items: np.ndarray
    prev_actions: np.ndarray
    labels: np.ndarray


class SyntheticSequences:
    """Deterministic generator of user histories: ``gen[i]`` is the same for a given seed."""

    def __init__(self, cfg: ModelConfig) -> None:
        cfg.validate()  # a config built directly (not by get_config/replace): its bad field named, not a numpy error
        self.cfg = cfg
        self.items_per_cat = cfg.num_items // cfg.num_categories
        self.rank_probs = _zipf_probs(self.items_per_cat, cfg.zipf_alpha)
        self.popular = max(1, self.items_per_cat // 10)

    def __getitem__(self, index: int) -> Sample:
        cfg = self.cfg
        rng = np.random.default_rng([cfg.seed, index])
        n = sample_length(rng, cfg)
        taste = rng.choice(cfg.num_categories, size=cfg.taste_size, replace=False)
        from_taste = rng.random(n) < cfg.taste_prob
        cats = np.where(from_taste, taste[rng.integers(0, cfg.taste_size, n)], rng.integers(0, cfg.num_categories, n))
        ranks = rng.choice(self.items_per_cat, size=n, p=self.rank_probs)
        items = ranks * cfg.num_categories + cats
        click = np.isin(cats, taste) ^ (rng.random(n) < cfg.label_noise)
        labels = np.zeros((n, cfg.num_tasks), dtype=np.float32)
        labels[:, 0] = click
        if cfg.num_tasks > 1:
            labels[:, 1] = click & (ranks < self.popular)
        for t in range(2, cfg.num_tasks):
            labels[:, t] = click & ((items * 2654435761 >> 7) % (t + 1) == 0)
        actions = 1 + labels[:, 0].astype(np.int64) + 2 * labels[:, min(1, cfg.num_tasks - 1)].astype(np.int64)
        prev_actions = np.concatenate([[0], actions[:-1]]).astype(np.int64)
        return Sample(items.astype(np.int64), prev_actions, labels)


@dataclass
class JaggedBatch:
    """Concatenated sequences and their offsets (the HSTU jagged layout)."""

    items: torch.Tensor  # (L,) int64
    prev_actions: torch.Tensor  # (L,) int64
    positions: torch.Tensor  # (L,) int64, position inside its sequence
    labels: torch.Tensor  # (L, tasks) float32
    seq_offsets: torch.Tensor  # (B+1,) int64
    lengths: list[int]
    # (L,) float32 loss weight per row, or None for the plain mean: padded batches (CUDA graphs) give
    # their padding rows weight 0 and the real rows 1 / real rows, so the loss is the real rows' mean.
    weights: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.items.shape[0])

    def to(self, device: torch.device | str) -> JaggedBatch:
        nb = torch.device(device).type == "cuda"
        return JaggedBatch(
            *(t.to(device, non_blocking=nb) for t in (self.items, self.prev_actions, self.positions, self.labels)),
            self.seq_offsets.to(device, non_blocking=nb),
            self.lengths,
            None if self.weights is None else self.weights.to(device, non_blocking=nb),
        )

    def pin_memory(self) -> JaggedBatch:
        return JaggedBatch(
            *(t.pin_memory() for t in (self.items, self.prev_actions, self.positions, self.labels, self.seq_offsets)),
            self.lengths,
            None if self.weights is None else self.weights.pin_memory(),
        )


def collate_jagged(samples: list[Sample]) -> JaggedBatch:
    """Concatenate samples into one jagged batch with ``seq_offsets``; ``ValueError`` for no samples (the
    batch's task count comes from its samples' labels)."""
    if not samples:
        raise ValueError("samples is empty: a jagged batch needs at least one (possibly empty) sequence")
    lengths = [len(s.items) for s in samples]
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
    cat = lambda xs, dt: torch.from_numpy(np.concatenate(xs).astype(dt, copy=False))  # noqa: E731
    return JaggedBatch(
        items=cat([s.items for s in samples], np.int64),
        prev_actions=cat([s.prev_actions for s in samples], np.int64),
        positions=torch.from_numpy(positions),
        labels=cat([s.labels for s in samples], np.float32).reshape(-1, samples[0].labels.shape[1]),
        seq_offsets=torch.from_numpy(offsets),
        lengths=lengths,
    )


class SyntheticJaggedDataset(IterableDataset):
    """Iterable of collated batches; batch j is fixed by (seed, j), workers take batches j % W."""

    def __init__(self, cfg: ModelConfig, num_batches: int | None = None, start: int = 0) -> None:
        self.cfg = cfg
        self.gen = SyntheticSequences(cfg)
        self.num_batches = num_batches
        self.start = start

    def batch(self, j: int) -> JaggedBatch:
        b = self.cfg.batch_size
        return collate_jagged([self.gen[j * b + i] for i in range(b)])

    def __iter__(self) -> Iterator[JaggedBatch]:
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        j = self.start + wid
        while self.num_batches is None or j < self.start + self.num_batches:
            yield self.batch(j)
            j += nw


def make_loader(cfg: ModelConfig, num_batches: int | None = None, workers: int = 0, pin: bool = False) -> DataLoader:
    """A DataLoader over whole batches (batch_size=None keeps batch order across workers)."""
    return DataLoader(
        SyntheticJaggedDataset(cfg, num_batches),
        batch_size=None,
        num_workers=workers,
        pin_memory=pin,
        persistent_workers=False,
    )
