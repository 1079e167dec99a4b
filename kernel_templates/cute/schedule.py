"""Launch order shared by the CuTe DSL HSTU kernels: which (head, sequence, block) a CTA owns.

The grid is (heads, sequences, blocks); the hardware launches CTAs x-fastest. With ``l2_group == 0``
the CTAs in flight are every sequence-head at one block index, and none of them share K/V (forward)
or Q/dO (backward), so each re-reads its operands from HBM. With ``l2_group == g`` all blocks of g
sequence-heads launch before the next g, and the CTAs in flight re-read the same operands from L2.
Within a sequence-head, block index 0 launches first (callers map it to the heaviest block).
With ``split > 1`` the grid's z extent is ``blocks * split`` and the ``split`` consecutive z indices of
one block form a thread-block cluster that shares the block's work (the forward's key split).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@cute.jit
def grouped_block_order(l2_group: cutlass.Constexpr, split: cutlass.Constexpr = 1):
    """(head, sequence, i, part) of this CTA; i = 0 is the first block launched for its sequence-head,
    part in [0, split) its share of the block's work (always 0 without a split)."""
    bid_x, bid_y, bid_zz = cute.arch.block_idx()
    num_heads, num_seqs, num_zz = cute.arch.grid_dim()
    bid_z = Int32(bid_zz) // split
    part = Int32(bid_zz) - bid_z * split
    num_blocks = Int32(num_zz) // split
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
    return head, seq, i, part
