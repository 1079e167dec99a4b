"""Compact launch order of the CuTe HSTU kernels: only the real tiles of a jagged batch, heaviest first.

The plain grid is (heads, sequences, blocks of the longest sequence). In a skewed batch most of its
CTAs find their block past the end of a short sequence and exit, each after holding an SM for its
prologue. With ``compact`` the kernels launch ``heads x bound`` CTAs instead, where ``bound`` (from
``tile_bound``, host-known without a sync) is at least the number of real tiles, and CTA ``t`` reads
``(sequence, block)`` of tile ``t // heads`` from a small table this module builds on the device from
the offsets (sequence ``-1``: past the last real tile, the CTA exits). The table's order:

- sequences by block count, longest first (stable), in groups of ``seqs_per_group`` consecutive ones
  (the tiles of one group run together, so their K/V (forward) or Q/dO (backward) is re-read from L2);
- within a group, rounds of equal causal work, heaviest first (longest-processing-time order): a forward
  query block ``m`` walks ``m + 1`` key blocks, a backward key block ``j`` of a sequence of ``nb``
  blocks walks ``nb - j`` query blocks; within a round, by sequence rank.

``tile_order_reference`` is the same order in plain Python, for tests.
"""

from __future__ import annotations

import torch

from kernel_templates.tensor_memo import MISS, TensorMemo, capturing

DIRECTIONS = ("fwd", "bwd")
_TABLES = TensorMemo()


def tile_bound(rows: int, batch: int, block: int, max_blocks: int) -> int:
    """Upper bound on the real tiles: sum ceil(n_b / block) <= L // block + B, and <= B x max_blocks."""
    if batch < 1 or max_blocks < 1 or block < 1:
        raise ValueError(f"tile_bound needs batch, block and max_blocks >= 1, got {batch}, {block}, {max_blocks}")
    return min(batch * max_blocks, max(rows, 0) // block + batch)


def seqs_per_group(l2_group: int, num_heads: int) -> int:
    """Sequences launched together for an ``l2_group`` of sequence-heads (0: all, one LPT order)."""
    return 0 if l2_group == 0 else max(1, l2_group // max(1, num_heads))


def tile_table(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int = 0
) -> torch.Tensor:
    """(bound, 2) int32 table of (sequence, block) in launch order; rows past the real tiles hold (-1, 0).

    Sync-free (no host read of the offsets): lengths are clamped to [0, max_blocks x block], so any
    offsets give a table whose entries stay inside the batch and the block range.
    """
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    dev = offsets.device
    batch = offsets.numel() - 1
    bound = tile_bound(rows, batch, block, max_blocks)
    off = offsets.to(torch.int64)
    lengths = (off[1:] - off[:-1]).clamp(0, max_blocks * block)
    nb = (lengths + block - 1) // block
    nb_sorted, perm = torch.sort(nb, descending=True, stable=True)
    rank = torch.arange(batch, device=dev)
    per_group = batch if group <= 0 else group
    lead = nb_sorted[(rank // per_group) * per_group]  # block count of each group's longest sequence
    blk = torch.arange(max_blocks, device=dev)
    # Work rank inside the group: 0 for the heaviest tiles (forward: the last block of the longest).
    if direction == "fwd":
        work_rank = lead[:, None] - 1 - blk[None, :]
    else:
        work_rank = lead[:, None] - (nb_sorted[:, None] - blk[None, :])
    real = blk[None, :] < nb_sorted[:, None]
    key = ((rank // per_group)[:, None] * (max_blocks + 1) + work_rank) * batch + rank[:, None]
    key = torch.where(real, key, torch.iinfo(torch.int64).max)
    order = torch.argsort(key.flatten(), stable=True)[:bound]
    r, b = order // max_blocks, order % max_blocks
    live = real.flatten()[order]
    seq = torch.where(live, perm[r], -1)
    table = torch.stack((seq, torch.where(live, b, 0)), dim=1)
    return table.to(torch.int32).contiguous()


def launch_tile_table(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int
) -> torch.Tensor:
    """``tile_table`` once per unchanged offsets tensor: the layers of a step share one table per block
    size. Under CUDA-graph capture it is always built, so replays rebuild it from the offsets they get."""
    if capturing() or type(offsets) is not torch.Tensor:
        return tile_table(offsets, rows, block, max_blocks, direction, group)
    key = (rows, block, max_blocks, direction, group)
    table = _TABLES.get(offsets, key)
    if table is MISS:
        table = tile_table(offsets, rows, block, max_blocks, direction, group)
        _TABLES.put(offsets, table, key)
    return table


def tiles_fake():
    """Fake of the compact tile table (flat int32 pairs, dynamic length); the offsets stand in for it
    when the config launches the plain grid."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)


def tiles_arg(
    seq_offsets: torch.Tensor,
    offsets: torch.Tensor,
    rows: int,
    heads: int,
    block: int,
    max_blocks: int,
    direction: str,
    compact: bool,
    l2_group: int,
) -> torch.Tensor:
    """The table a launch passes: the compact order's (sequence, block) pairs, flat, or the int32 offsets
    as a placeholder the plain grid never reads."""
    if not compact:
        return offsets
    group = seqs_per_group(l2_group, heads)
    return launch_tile_table(seq_offsets, rows, block, max_blocks, direction, group).view(-1)


def tile_order_reference(
    lengths: list[int], rows: int, block: int, max_blocks: int, direction: str, group: int = 0
) -> list[tuple[int, int]]:
    """The table of ``tile_table`` for host lengths, in plain Python (the order a test checks)."""
    batch = len(lengths)
    nb = [(min(max(n, 0), max_blocks * block) + block - 1) // block for n in lengths]
    ranked = sorted(range(batch), key=lambda s: -nb[s])  # stable: ties keep sequence order
    per_group = batch if group <= 0 else group
    tiles = []
    for r, s in enumerate(ranked):
        lead = nb[ranked[(r // per_group) * per_group]]
        for b in range(nb[s]):
            work_rank = lead - 1 - b if direction == "fwd" else lead - (nb[s] - b)
            tiles.append(((r // per_group, work_rank, r), (s, b)))
    tiles.sort(key=lambda t: t[0])
    out = [t[1] for t in tiles]
    bound = tile_bound(rows, batch, block, max_blocks)
    return (out + [(-1, 0)] * bound)[:bound]
