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
import triton
import triton.language as tl

from kernel_templates.tensor_memo import MISS, TensorMemo

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
    return _tile_rows(offsets, rows, block, max_blocks, direction, group)


def _tile_rows(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int
) -> torch.Tensor:
    """``tile_table``'s (bound, 2) int32 rows in four launches: the sequences ranked by block count and
    how many have more than ``v`` blocks (``_ranked``), the prefix sums of the ranked counts, and every
    tile written at its place (``_place_kernel``).

    A tile's place has a closed form, so nothing is sorted: in group ``g`` (ranked sequences
    ``[gs, ge)``, the first one with ``lead`` blocks), the tiles of work rank ``w`` belong to the
    sequences with at least ``v = lead - w`` blocks, a prefix of the group in rank order, so the tiles
    before (sequence ``r``, work rank ``w``) number ``tiles of groups < g + sum_{s in g} max(0, nb_s - v)
    + (r - gs)``. A forward query block ``b`` has ``v = b + 1``, a backward key block ``v = nb_r - b``.
    """
    batch = offsets.numel() - 1
    bound = tile_bound(rows, batch, block, max_blocks)
    per_group = batch if group <= 0 else group
    nb, perm, above = _ranked(offsets, block, max_blocks)
    table = torch.empty((bound, 2), dtype=torch.int32, device=offsets.device)
    _place_kernel[(batch,)](
        nb, torch.cumsum(nb, 0), perm, above, table, batch, per_group, bound, FWD=direction == "fwd", BT=64
    )
    return table


def _ranked(offsets: torch.Tensor, block: int, max_blocks: int) -> tuple[torch.Tensor, ...]:
    """(block counts, most first, ties in sequence order; the sequence of each rank; ``above[v]``, the
    sequences with more than ``v`` blocks for v in [0, max_blocks]), int64, on the device."""
    batch = offsets.numel() - 1
    nb = torch.empty(batch, dtype=torch.int64, device=offsets.device)
    perm = torch.empty(batch, dtype=torch.int64, device=offsets.device)
    above = torch.empty(max_blocks + 1, dtype=torch.int64, device=offsets.device)
    _rank_kernel[(triton.cdiv(batch, 32),)](offsets, nb, perm, batch, block, max_blocks * block, BLOCK=32, CHUNK=128)
    _count_kernel[(triton.cdiv(max_blocks + 1, 64),)](nb, above, batch, max_blocks, batch.bit_length(), BT=64)
    return nb, perm, above


@triton.jit
def _rank_kernel(off_ptr, nb_ptr, perm_ptr, batch, block, max_len, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    """Ranks sequences by block count, most first, ties in sequence order (a stable sort, by counting):
    writes the ranked block counts and the sequence of each rank. Lengths are clamped to [0, max_len]."""
    s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = s < batch
    lo = tl.load(off_ptr + s, mask=live, other=0).to(tl.int64)
    hi = tl.load(off_ptr + s + 1, mask=live, other=0).to(tl.int64)
    nb = (tl.minimum(tl.maximum(hi - lo, 0), max_len) + block - 1) // block
    rank = tl.zeros([BLOCK], dtype=tl.int64)
    for c in range(0, batch, CHUNK):
        t = c + tl.arange(0, CHUNK)
        lo2 = tl.load(off_ptr + t, mask=t < batch, other=0).to(tl.int64)
        hi2 = tl.load(off_ptr + t + 1, mask=t < batch, other=0).to(tl.int64)
        nb2 = (tl.minimum(tl.maximum(hi2 - lo2, 0), max_len) + block - 1) // block
        ahead = (nb2[None, :] > nb[:, None]) | ((nb2[None, :] == nb[:, None]) & (t[None, :] < s[:, None]))
        rank += tl.sum((ahead & (t < batch)[None, :]).to(tl.int64), axis=1)
    tl.store(nb_ptr + rank, nb, mask=live)
    tl.store(perm_ptr + rank, s.to(tl.int64), mask=live)


@triton.jit
def _count_kernel(nb_ptr, above_ptr, batch, max_blocks, search_steps, BT: tl.constexpr):
    """``above[v]``: how many ranked sequences have more than ``v`` blocks (a binary search of the ranked
    counts), once per launch, so the placing kernels read it with one load instead of a chain of them."""
    v = tl.program_id(0) * BT + tl.arange(0, BT)
    lo = tl.zeros([BT], tl.int64)
    hi = tl.zeros([BT], tl.int64) + batch
    for _ in range(search_steps):
        mid = (lo + hi) // 2
        more = (tl.load(nb_ptr + mid, mask=mid < hi, other=0) > v) & (mid < hi)
        lo = tl.where(more, mid + 1, lo)
        hi = tl.where(more, hi, mid)
    tl.store(above_ptr + v, lo, mask=v <= max_blocks)


@triton.jit
def _place_kernel(
    nb_ptr, ends_ptr, perm_ptr, above_ptr, table_ptr, batch, per_group, bound, FWD: tl.constexpr, BT: tl.constexpr
):
    """Program ``r`` writes the tiles of the sequence ranked ``r`` at their places (``_tile_rows``), and
    every ``batch``-th row of the padding past the real tiles. Places at or past ``bound`` (offsets that
    overstate the rows) are dropped, as the sorted order's tail would be."""
    r = tl.program_id(0)
    gs = (r // per_group) * per_group
    ge = tl.minimum(gs + per_group, batch)
    nb_r = tl.load(nb_ptr + r)
    seq = tl.load(perm_ptr + r).to(tl.int32)
    start = tl.load(ends_ptr + gs) - tl.load(nb_ptr + gs)  # tiles of the groups before
    total = tl.load(ends_ptr + batch - 1)
    for b0 in range(0, nb_r, BT):
        b = b0 + tl.arange(0, BT)
        v = b + 1 if FWD else nb_r - b
        k = tl.minimum(tl.maximum(tl.load(above_ptr + v, mask=b < nb_r, other=0), gs), ge)  # members above v: [gs, k)
        above = tl.where(k > gs, tl.load(ends_ptr + k - 1, mask=k > gs, other=0) - start, 0)  # their blocks
        place = start + above - v * (k - gs) + (r - gs)
        ok = (b < nb_r) & (place < bound)
        tl.store(table_ptr + 2 * place, tl.zeros([BT], tl.int32) + seq, mask=ok)
        tl.store(table_ptr + 2 * place + 1, b.to(tl.int32), mask=ok)
    pad = bound - total
    for k0 in range(0, tl.cdiv(pad, batch), BT):
        j = total + r + batch * (k0 + tl.arange(0, BT))
        ok = j < bound
        tl.store(table_ptr + 2 * j, tl.full([BT], -1, tl.int32), mask=ok)
        tl.store(table_ptr + 2 * j + 1, tl.zeros([BT], tl.int32), mask=ok)


def launch_tile_table(
    offsets: torch.Tensor, rows: int, block: int, max_blocks: int, direction: str, group: int
) -> torch.Tensor:
    """``tile_table`` once per unchanged offsets tensor: the layers of a step share one table per block
    size. Under CUDA-graph capture, once per capture: the first use records the build, which every replay
    reruns on the offsets it gets before the later uses read the table (``TensorMemo``)."""
    return _memo(offsets, (rows, block, max_blocks, direction, group), tile_table)


def _memo(offsets: torch.Tensor, key: tuple, build) -> torch.Tensor:
    if type(offsets) is not torch.Tensor:
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


def split_tile_table(
    offsets: torch.Tensor, rows: int, block_m: int, block_n: int, max_blocks: int, group: int, heads: int,
    sm_count: int, max_parts: int,
) -> torch.Tensor:  # fmt: skip
    """(tile_bound + split_extra_rows, 4) int32 rows (sequence, block, parts * 256 + part, slot). A query
    tile walking ``w`` key blocks of ``block_n`` (causal: ``ceil((block + 1) block_m / block_n)``) is cut
    into ``p = round(w / share)`` parts, ``share`` the per-SM share of all heads' causal work but at least
    ``MIN_PART_BLOCKS``, ``p`` in [1, max_parts]: rounding keeps ``p - 1 < w / share``, so the parts of
    all cut tiles add at most ``split_extra_rows``. ``slot`` numbers the cut tiles' partial outputs (a cut
    tile owns slots [slot, slot + parts - 1)). Order: ``tile_table``'s groups of ``group`` sequences (L2
    reuse); within a group, parts by their work, heaviest first, ties in ``tile_table``'s order. Rows past
    the real parts hold (-1, 0, 256, 0). Sync-free, like ``tile_table``: three launches (``_ranked``,
    ``_split_kernel``), every place in closed form.
    """
    if not 1 <= max_parts <= 255:
        raise ValueError(f"max_parts must be in [1, 255], got {max_parts}")
    batch = offsets.numel() - 1
    size = tile_bound(rows, batch, block_m, max_blocks) + split_extra_rows(sm_count, heads)
    nb, perm, above = _ranked(offsets, block_m, max_blocks)
    table = torch.empty((size, 4), dtype=torch.int32, device=offsets.device)
    _split_kernel[(batch,)](
        nb, perm, above, table, batch, batch if group <= 0 else group, size, max_blocks, block_m, block_n,
        heads, MIN_PART_BLOCKS * sm_count, 2 * sm_count, max_parts, BT=64,
    )  # fmt: skip
    return table


@triton.jit
def _parts(w, share, sm2, max_parts):
    """Parts of a tile of work ``w``: ``(2 w sm + share) // (2 share)`` in [1, max_parts]."""
    return tl.minimum(tl.maximum((w * sm2 + share) // (2 * share), 1), max_parts)


@triton.jit
def _split_kernel(
    nb_ptr, perm_ptr, above_ptr, table_ptr, batch, per_group, size, max_blocks, block_m, block_n, heads, min_share,
    sm2, max_parts, BT: tl.constexpr,
):  # fmt: skip
    """Program ``r`` writes the parts of the sequence ranked ``r`` at their places, and every ``batch``-th
    padding row. The tiles of block ``b`` number ``C(b)`` (sequences with more than ``b`` blocks), so the
    batch's work, the rows and slots of the groups before and the parts ahead of a tile inside its group
    are sums over blocks: part work ``pw``, ahead when heavier, or as heavy and first in ``tile_table``'s
    order (a later block, or the same block of a sequence ranked before)."""
    r = tl.program_id(0)
    gs = (r // per_group) * per_group
    ge = tl.minimum(gs + per_group, batch)
    nb_r = tl.load(nb_ptr + r)
    seq = tl.load(perm_ptr + r).to(tl.int32)
    total = tl.zeros([BT], tl.int64)
    for c in range(0, max_blocks, BT):
        bb = c + tl.arange(0, BT)
        w = ((bb + 1) * block_m + block_n - 1) // block_n
        total += w * tl.load(above_ptr + bb, mask=bb < max_blocks, other=0)
    share = tl.maximum(tl.sum(total) * heads, min_share)  # share x sm_count
    tiles_before = tl.zeros([BT], tl.int64)
    slots_before = tl.zeros([BT], tl.int64)
    real_rows = tl.zeros([BT], tl.int64)
    for c in range(0, max_blocks, BT):
        bb = c + tl.arange(0, BT)
        cnt = tl.load(above_ptr + bb, mask=bb < max_blocks, other=0)
        p = _parts(((bb + 1) * block_m + block_n - 1) // block_n, share, sm2, max_parts)
        tiles_before += tl.minimum(cnt, gs)
        slots_before += tl.minimum(cnt, gs) * (p - 1)
        real_rows += cnt * p
    rows_before = tl.sum(tiles_before) + tl.sum(slots_before)
    slot_base = tl.sum(slots_before)
    for b0 in range(0, nb_r, BT):
        b = b0 + tl.arange(0, BT)
        w = ((b + 1) * block_m + block_n - 1) // block_n
        p = _parts(w, share, sm2, max_parts)
        pw = (w + p - 1) // p
        ahead = tl.zeros([BT], tl.int64)
        slot = tl.zeros([BT], tl.int64)
        for c in range(0, max_blocks, BT):
            b2 = c + tl.arange(0, BT)
            cnt = tl.load(above_ptr + b2, mask=b2 < max_blocks, other=0)
            members = tl.minimum(tl.maximum(cnt - gs, 0), ge - gs)  # of this group, with a tile at b2
            w2 = ((b2 + 1) * block_m + block_n - 1) // block_n
            p2 = _parts(w2, share, sm2, max_parts)
            pw2 = (w2 + p2 - 1) // p2
            later = b2[None, :] > b[:, None]
            first = (pw2[None, :] > pw[:, None]) | ((pw2[None, :] == pw[:, None]) & later)
            ahead += tl.sum(tl.where(first, (members * p2)[None, :], 0), axis=1)
            slot += tl.sum(tl.where(later, (members * (p2 - 1))[None, :], 0), axis=1)
        place = rows_before + ahead + (r - gs) * p
        slot = tl.where(p > 1, slot_base + slot + (r - gs) * (p - 1), 0).to(tl.int32)
        for i in range(0, max_parts):
            j = place + i
            ok = (b < nb_r) & (i < p) & (j < size)
            tl.store(table_ptr + 4 * j, tl.zeros([BT], tl.int32) + seq, mask=ok)
            tl.store(table_ptr + 4 * j + 1, b.to(tl.int32), mask=ok)
            tl.store(table_ptr + 4 * j + 2, (p * 256 + i).to(tl.int32), mask=ok)
            tl.store(table_ptr + 4 * j + 3, slot, mask=ok)
    real = tl.sum(real_rows)
    for k0 in range(0, tl.cdiv(size - real, batch), BT):
        j = real + r + batch * (k0 + tl.arange(0, BT))
        ok = j < size
        tl.store(table_ptr + 4 * j, tl.full([BT], -1, tl.int32), mask=ok)
        tl.store(table_ptr + 4 * j + 1, tl.zeros([BT], tl.int32), mask=ok)
        tl.store(table_ptr + 4 * j + 2, tl.full([BT], 256, tl.int32), mask=ok)
        tl.store(table_ptr + 4 * j + 3, tl.zeros([BT], tl.int32), mask=ok)


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
