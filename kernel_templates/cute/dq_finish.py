"""The CuTe backward finishes dQ itself: the last key block to add into a query block converts it.

Every key-block CTA of a sequence-head adds its fp32 dQ partials into an fp32 buffer with TMA
reduce-adds. Each query block m has an arrival counter in a zeroed int32 array, laid out
(sequence, head, m) with ``m_cap`` = ceil(max_seq_len / block_m) blocks per sequence-head. Every
participating CTA (key blocks with start < n, at most the grid's block count) arrives exactly once
on every query block of its sequence: at once for the blocks it never touches, and for the others
after all its reduce-adds have completed (at the end of its loop, so the dQ stream never waits on a
fence or an atomic). The CTA whose arrival completes the count owns the
block: it overwrites the counter with ``mark`` (a value no arrival can produce) and, after its own
work, reads the block's fp32 rows back from L2 and stores them in the input dtype. So no pass zeroes
and converts dQ around the kernel but one memset of buffer and counters. Blocks at or past ``m_cap``
(only bad offsets make sequences that long) are never converted, and nothing outside the buffers is
touched.

Memory order: the reducing thread waits for its bulk group to complete, fences the async proxy
against the generic one, and arrives with an acq_rel atomic at GPU scope; the owner's acquire then
sees every partial, and its MMA threads read after a named barrier with the arriving threads.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32


def expected_arrivals(n: Int32, tile_n: int, num_n_blocks: Int32) -> Int32:
    """CTAs of a sequence of n rows that do work: key blocks starting before n, within the grid."""
    return cutlass.min((n + tile_n - 1) // tile_n, num_n_blocks)


@cute.jit
def arrive(mCount: cute.Tensor, index: Int32, expected: Int32, mark: Int32) -> Int32:
    """One arrival on a query block's counter; 1 when it was the last (the block is then marked)."""
    last = Int32(0)
    old = cute.arch.atomic_add(mCount.iterator + index, Int32(1), sem="acq_rel", scope="gpu")
    if old == expected - 1:
        mCount[index] = mark
        last = Int32(1)
    return last


@cute.jit
def reduces_done():
    """Wait until this thread's bulk reduce groups have completed, then order their (async-proxy) writes
    before the thread's later generic-proxy operations at GPU scope. Every lane runs it, so the lane
    that issued the TMA need not be the one that arrives."""
    cute.arch.cp_async_bulk_wait_group(0)
    cute.arch.fence_proxy("async.global")
    cute.arch.fence_acq_rel_gpu()
    cute.arch.sync_warp()


@cute.jit
def arrive_range(mCount: cute.Tensor, base: Int32, lo: Int32, hi: Int32, expected: Int32, mark: Int32) -> Int32:
    """A warp arrives on query blocks [lo, hi), one per lane at a time; 1 on lanes that became owners."""
    last = Int32(0)
    for m in cutlass.range(lo + cute.arch.lane_idx(), hi, 32, unroll=1):
        last = last | arrive(mCount, base + m, expected, mark)
    return last


@cute.jit
def arrive_untouched(
    mCount: cute.Tensor,
    base: Int32,
    m_blocks: Int32,
    blk_lo: Int32,
    blk_hi: Int32,
    expected: Int32,
    mark: Int32,
    t: Int32,
    threads: cutlass.Constexpr,
) -> Int32:
    """Idle producer threads: arrive on every query block outside [blk_lo, blk_hi), strided by thread."""
    last = Int32(0)
    for m in cutlass.range(t, m_blocks, threads, unroll=1):
        if (m < blk_lo) | (m >= blk_hi):
            last = last | arrive(mCount, base + m, expected, mark)
    return last


@cute.jit
def convert_block(
    mAcc: cute.Tensor,
    mOut: cute.Tensor,
    seq_start: Int32,
    head: Int32,
    m: Int32,
    rows: Int32,
    tidx: Int32,
    tile_m: cutlass.Constexpr,
    d: cutlass.Constexpr,
    threads: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
):
    """Rows [0, rows) of query block m of (L, D, H) ``mAcc`` (fp32) to ``mOut`` (dtype): 16-byte loads,
    all issued before the first store."""
    cols = d // 4
    thr = cute.make_layout((threads // cols, cols), stride=(cols, 1))
    val = cute.make_layout((1, 4))
    universal = cute.nvgpu.CopyUniversalOp()
    load = cute.make_tiled_copy_tv(cute.make_copy_atom(universal, Float32, num_bits_per_copy=128), thr, val)
    store = cute.make_tiled_copy_tv(cute.make_copy_atom(universal, dtype, num_bits_per_copy=4 * dtype.width), thr, val)
    g_acc = cute.local_tile(cute.domain_offset((seq_start, 0), mAcc[None, None, head]), (tile_m, d), (m, 0))
    g_out = cute.local_tile(cute.domain_offset((seq_start, 0), mOut[None, None, head]), (tile_m, d), (m, 0))
    thr_load = load.get_slice(tidx)
    t_acc = thr_load.partition_S(g_acc)
    t_out = store.get_slice(tidx).partition_D(g_out)
    t_crd = thr_load.partition_S(cute.make_identity_tensor((tile_m, d)))
    r_acc = cute.make_fragment_like(t_acc)
    for i in cutlass.range_constexpr(cute.size(t_acc, mode=[1])):
        for j in cutlass.range_constexpr(cute.size(t_acc, mode=[2])):
            if t_crd[0, i, j][0] < rows:
                cute.copy(load, t_acc[None, i, j], r_acc[None, i, j])
    r_out = cute.make_fragment_like(r_acc, dtype)
    r_out.store(r_acc.load().to(dtype))
    for i in cutlass.range_constexpr(cute.size(t_acc, mode=[1])):
        for j in cutlass.range_constexpr(cute.size(t_acc, mode=[2])):
            if t_crd[0, i, j][0] < rows:
                cute.copy(store, r_out[None, i, j], t_out[None, i, j])


@cute.jit
def convert_owned(
    mAcc: cute.Tensor,
    mOut: cute.Tensor,
    mCount: cute.Tensor,
    masks: cute.Tensor,
    base: Int32,
    m_blocks: Int32,
    mark: Int32,
    seq_start: Int32,
    n: Int32,
    head: Int32,
    tidx: Int32,
    bar_id: int,
    tile_m: cutlass.Constexpr,
    d: cutlass.Constexpr,
    threads: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
):
    """MMA threads: find the query blocks this CTA owns (``threads`` counters per round, one ballot word
    per warp in ``masks``) and convert each of them together."""
    warp = tidx // 32
    for start in cutlass.range(0, m_blocks, threads, unroll=1):
        m = start + tidx
        mine = cutlass.Boolean(False)
        if m < m_blocks:
            mine = Int32(mCount[base + m]) == mark
        word = cute.arch.vote_ballot_sync(mine)
        if cute.arch.lane_idx() == 0:
            masks[warp] = word
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
        for w in cutlass.range(threads // 32, unroll=1):
            bits = Int32(masks[w])
            if bits != 0:
                for j in cutlass.range(32, unroll=1):
                    if ((bits >> j) & 1) != 0:
                        blk = start + w * 32 + j
                        rows = cutlass.min(n - blk * tile_m, Int32(tile_m))
                        convert_block(mAcc, mOut, seq_start, head, blk, rows, tidx, tile_m, d, threads, dtype)
        cute.arch.barrier(barrier_id=bar_id, number_of_threads=threads)
