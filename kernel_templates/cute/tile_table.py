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

``split_tile_table`` (forward, ``split_heavy > 1``) also cuts the heaviest query tiles' key range into
parts that run on separate CTAs, when the batch's causal work is carried by a few long sequences (a
part walks about the per-SM share of the batch's work); the parts' fp32 outputs are added by the last
one to finish (``hstu_fwd_sm90.py``). Groups are kept; within a group, parts run heaviest first.

``tile_order_reference`` and ``split_order_reference`` are the same orders in plain Python, for tests.
"""

from __future__ import annotations

import torch

from kernel_templates.tensor_memo import MISS, TensorMemo, capturing

DIRECTIONS = ("fwd", "bwd")
_TABLES = TensorMemo()
# A split part walks at least this many key blocks: each part reloads its Q tile and the parts but the
# last write (and the last reads) an fp32 tile of partial output.
MIN_PART_BLOCKS = 4
SPLIT_ROW = 4  # ints per row of a split table: sequence, block, parts * 256 + part, partial slot


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
    return _tile_rows(offsets, rows, block, max_blocks, direction, group)[0].to(torch.int32).contiguous()


def _tile_rows(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tile_table``'s rows as int64, and the launch group of each row (that of its sequence)."""
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
    return torch.stack((seq, torch.where(live, b, 0)), dim=1), r // per_group


def launch_tile_table(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int
) -> torch.Tensor:
    """``tile_table`` once per unchanged offsets tensor: the layers of a step share one table per block
    size. Under CUDA-graph capture it is always built, so replays rebuild it from the offsets they get."""
    return _memo(offsets, (rows, block, max_blocks, direction, group), tile_table)


def _memo(offsets: torch.Tensor, key: tuple, build) -> torch.Tensor:
    if capturing() or type(offsets) is not torch.Tensor:
        return build(offsets, *key)
    table = _TABLES.get(offsets, key)
    if table is MISS:
        table = build(offsets, *key)
        _TABLES.put(offsets, table, key)
    return table


def split_extra_rows(sm_count: int, heads: int) -> int:
    """Rows a split adds to the table, at most: a tile is cut into p parts only if each part walks at
    least the per-SM share of the batch's causal work, so the parts of all cut tiles number at most
    ``sm_count / heads``; host-known, no sync."""
    if sm_count < 1 or heads < 1:
        raise ValueError(f"split_extra_rows needs sm_count and heads >= 1, got {sm_count}, {heads}")
    return sm_count // heads + 1


def _split_parts(work: torch.Tensor, heads: int, sm_count: int, max_parts: int) -> torch.Tensor:
    """Parts per tile: work / share rounded to nearest, share = max(the per-SM share of all heads' work,
    MIN_PART_BLOCKS), clamped to [1, max_parts]. Rounding keeps parts - 1 < work / share, so the parts of
    all cut tiles add at most sm_count / heads rows (``split_extra_rows``). Dead rows (work 0) stay one."""
    total = work.sum() * heads
    share = torch.clamp(total, min=MIN_PART_BLOCKS * sm_count)  # share x sm_count, kept integral
    return torch.clamp((2 * work * sm_count + share) // (2 * share), 1, max_parts)


def split_tile_table(
    offsets: torch.Tensor, rows: int, block_m: int, block_n: int, max_blocks: int, group: int, heads: int,
    sm_count: int, max_parts: int,
) -> torch.Tensor:  # fmt: skip
    """(tile_bound + split_extra_rows, 4) int32 rows (sequence, block, parts * 256 + part, slot). A query
    tile walking ``w`` key blocks of ``block_n`` (causal: ``ceil((block + 1) block_m / block_n)``) is cut
    into ``_split_parts`` parts; ``slot`` numbers the cut tiles' partial outputs (a cut tile owns slots
    [slot, slot + parts - 1)). Order: ``tile_table``'s groups of ``group`` sequences (L2 reuse), heaviest
    part first within a group. Rows past the real parts hold (-1, 0, 256, 0). Sync-free, like ``tile_table``.
    """
    if not 1 <= max_parts <= 255:
        raise ValueError(f"max_parts must be in [1, 255], got {max_parts}")
    base, grp = _tile_rows(offsets, rows, block_m, max_blocks, "fwd", group)
    dev = base.device
    seq, blk = base[:, 0], base[:, 1]
    live = seq >= 0
    work = torch.where(live, ((blk + 1) * block_m + block_n - 1) // block_n, 0)
    parts = _split_parts(work, heads, sm_count, max_parts)
    cut = parts > 1
    slot = torch.cumsum(parts - 1, 0) - (parts - 1)  # first partial slot of each cut tile
    size = base.shape[0] + split_extra_rows(sm_count, heads)
    ends = torch.cumsum(parts, 0)
    j = torch.arange(size, device=dev)
    src = torch.searchsorted(ends, j, right=True).clamp(max=base.shape[0] - 1)  # base row of output row j
    part = j - (ends[src] - parts[src])
    real = (j < ends[-1]) & live[src]
    span = max_blocks * block_m // block_n + 2  # above any part's work
    part_work = (work[src] + parts[src] - 1) // parts[src]
    key = torch.where(real, grp[src] * span + span - 1 - part_work, torch.iinfo(torch.int64).max)
    order = torch.argsort(key, stable=True)
    src, part, real = src[order], part[order], real[order]
    table = torch.stack(
        (
            torch.where(real, seq[src], -1),
            torch.where(real, blk[src], 0),
            torch.where(real, parts[src] * 256 + part, 256),
            torch.where(real & cut[src], slot[src], 0),
        ),
        dim=1,
    )
    return table.to(torch.int32).contiguous()


def split_order_reference(
    lengths: list[int], rows: int, block_m: int, block_n: int, max_blocks: int, group: int, heads: int,
    sm_count: int, max_parts: int,
) -> list[tuple[int, int, int, int]]:  # fmt: skip
    """The table of ``split_tile_table`` for host lengths, in plain Python."""
    base = [t for t in tile_order_reference(lengths, rows, block_m, max_blocks, "fwd", group) if t[0] >= 0]
    _, ranked = _ranked_reference(lengths, block_m, max_blocks)
    per_group = len(lengths) if group <= 0 else group
    grp = {s: r // per_group for r, s in enumerate(ranked)}
    work = [-(-(b + 1) * block_m // block_n) for _, b in base]
    share = max(sum(work) * heads, MIN_PART_BLOCKS * sm_count)
    parts = [min(max((2 * w * sm_count + share) // (2 * share), 1), max_parts) for w in work]
    rows_out, slot = [], 0
    for (s, b), w, p in zip(base, work, parts, strict=True):
        for i in range(p):
            rows_out.append(((grp[s], -(-w // p)), (s, b, p * 256 + i, slot if p > 1 else 0)))
        slot += p - 1
    rows_out.sort(key=lambda r: (r[0][0], -r[0][1]))  # stable
    size = tile_bound(rows, len(lengths), block_m, max_blocks) + split_extra_rows(sm_count, heads)
    out = [r[1] for r in rows_out]
    return out + [(-1, 0, 256, 0)] * (size - len(out))


def tiles_fake(dtype=None):
    """Fake of a flat 1-D launch array of dynamic length: the compact tile table (int32, the default; the
    offsets stand in for it when the config launches the plain grid), or another flat array of ``dtype``."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    return make_fake_tensor(dtype or cutlass.Int32, (cute.sym_int(),), stride=(1,), assumed_align=4)


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
    split: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """The table a launch passes: the compact order's (sequence, block) pairs, flat, the split table's rows
    when ``split`` = (block_n, sm_count, max_parts) is given, or the int32 offsets as a placeholder the
    plain grid never reads."""
    if split is not None:
        key = (rows, block, split[0], max_blocks, seqs_per_group(l2_group, heads), heads, split[1], split[2])
        return _memo(seq_offsets, key, split_tile_table).view(-1)
    if not compact:
        return offsets
    group = seqs_per_group(l2_group, heads)
    return launch_tile_table(seq_offsets, rows, block, max_blocks, direction, group).view(-1)


def tile_order_reference(
    lengths: list[int], rows: int, block: int, max_blocks: int, direction: str, group: int = 0
) -> list[tuple[int, int]]:
    """The table of ``tile_table`` for host lengths, in plain Python (the order a test checks)."""
    batch = len(lengths)
    nb, ranked = _ranked_reference(lengths, block, max_blocks)
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


def _ranked_reference(lengths: list[int], block: int, max_blocks: int) -> tuple[list[int], list[int]]:
    """(blocks per sequence, sequences by block count, longest first) of host lengths, clamped as the
    device tables clamp them; stable, so ties keep sequence order."""
    nb = [(min(max(n, 0), max_blocks * block) + block - 1) // block for n in lengths]
    return nb, sorted(range(len(lengths)), key=lambda s: -nb[s])
