"""Launch order shared by the CuTe DSL HSTU kernels: which (head, sequence, block) a CTA owns.

The grid is (heads, sequences, blocks); the hardware launches CTAs x-fastest. With ``l2_group == 0``
the CTAs in flight are every sequence-head at one block index, and none of them share K/V (forward)
or Q/dO (backward), so each re-reads its operands from HBM. With ``l2_group == g`` all blocks of g
sequence-heads launch before the next g, and the CTAs in flight re-read the same operands from L2.
Within a sequence-head, block index 0 launches first (callers map it to the heaviest block).
``compact_tile`` is the other order: only the real tiles of the batch, from a device-side table;
``split_tile`` reads the split table, whose rows also name a part of a tile's key range.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@cute.jit
def grouped_block_order(l2_group: cutlass.Constexpr):
    """(head, sequence, i) of this CTA; i = 0 is the first block launched for its sequence-head."""
    bid_x, bid_y, bid_z = cute.arch.block_idx()
    num_heads, num_seqs, num_blocks = cute.arch.grid_dim()
    head = Int32(bid_x)
    seq = Int32(bid_y)
    i = Int32(bid_z)
    if const_expr(l2_group > 0):
        num_bh = Int32(num_heads) * Int32(num_seqs)
        lin = (Int32(bid_z) * Int32(num_seqs) + Int32(bid_y)) * Int32(num_heads) + Int32(bid_x)
        per_group = Int32(num_blocks) * l2_group
        grp = lin // per_group
        r = lin - grp * per_group
        g_size = cutlass.min(num_bh - grp * l2_group, Int32(l2_group))
        i = r // g_size
        bh = grp * l2_group + (r - i * g_size)
        seq = bh // Int32(num_heads)
        head = bh - seq * Int32(num_heads)
    return head, seq, i


@cute.jit
def _table_row(t: Int32, num_heads: Int32, width: cutlass.Constexpr):
    """(head, first int of the row) of launch entry ``t``: entry t runs table row t // num_heads for
    head t % num_heads; rows are ``width`` ints."""
    p = t // num_heads
    return t - p * num_heads, p * width


@cute.jit
def compact_tile_at(mTiles: cute.Tensor, t: Int32, num_heads: Int32):
    """(head, sequence, block, live) of entry ``t`` of the compact order (``tile_table.py``): two ints per
    row; ``live`` is 0 past the last real tile. A persistent CTA walks entries by index."""
    head, r = _table_row(t, num_heads, 2)
    seq = Int32(mTiles[r])
    return head, cutlass.max(seq, Int32(0)), Int32(mTiles[r + 1]), Int32(seq >= 0)


@cute.jit
def compact_tile(mTiles: cute.Tensor, num_heads: Int32):
    """``compact_tile_at`` of this CTA's block index."""
    bid_x, _, _ = cute.arch.block_idx()
    return compact_tile_at(mTiles, Int32(bid_x), num_heads)


@cute.jit
def split_tile(mTiles: cute.Tensor, num_heads: Int32):
    """(head, sequence, block, live, part, parts, slot) of this CTA in a split table (``split_tile_table``):
    four ints per row (sequence, block, parts * 256 + part, slot)."""
    bid_x, _, _ = cute.arch.block_idx()
    head, r = _table_row(Int32(bid_x), num_heads, 4)
    seq = Int32(mTiles[r])
    code = Int32(mTiles[r + 2])
    parts = code // 256
    block, slot = Int32(mTiles[r + 1]), Int32(mTiles[r + 3])
    return head, cutlass.max(seq, Int32(0)), block, Int32(seq >= 0), code - parts * 256, parts, slot
