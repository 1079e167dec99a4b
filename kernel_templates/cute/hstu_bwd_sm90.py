"""CuTe DSL template: jagged HSTU attention backward for Hopper (sm90), TMA + wgmma.

One CTA per (head, sequence, key block); key blocks of a sequence-head launch from the first
(heaviest under causal masks: every later query sees it) to the last, and ``l2_group`` sequence-heads
run together so their Q/dO stay in L2 (``schedule.grouped_block_order``; with ``compact`` only the real
tiles launch, heaviest first over the batch, ``tile_table.py``). The K and V tiles are loaded
once by TMA; warp 0 of the producer warpgroup streams Q and dO tiles of the query blocks that can
see this key block through mbarrier rings of ``num_stages`` (Q) and ``do_stages`` (dO) buffers. Two
MMA warpgroups then, per query block:

    S = Q K^T, dP = dO V^T                     (wgmma, operands in shared memory)
    P = M silu(alpha S), D = M silu'(alpha S)  (fp32 fragments; no softmax, so no LSE / dPsum)
    dS = dP * D                                (P and dS go to shared memory as 16-bit tiles)
    dV += P^T dO, dK += dS^T Q                 (fp32 in registers for the whole CTA)
    dQ_partial = (alpha/S) dS K                (fp32, to shared memory)

With ``swap_sdp`` the warpgroups compute S^T = K Q^T and dP^T = V dO^T, each owning 64 keys: P^T and
dS^T then are register A operands of dV and dK, so only dS^T goes to shared memory (two buffers, so
one barrier per query block), and dQ reads it transposed (MN-major A).

The operand with fewer buffers (dO, or Q when the counts are equal) is released first: its product
is issued first and its buffer freed as soon as that wgmma group retires, so the next tile's TMA
load overlaps the remaining products. Warp 1 of the producer warpgroup adds each dQ partial to an
fp32 (L, H, Dqk) buffer with a TMA reduce-add (cp.reduce.async.bulk.tensor), guarded by named
barriers (buffer empty / full); with ``dq_serial`` the MMA warpgroups pass their slices through one
half-size buffer in turns, each with its own barrier pair. dV *= 1/S and dK *= alpha/S are applied
once in the epilogue, dQ's alpha/S per partial in registers; the launcher only converts dQ to the
input dtype. Unscaled 16-bit dS keeps fp16 clear of subnormals.

Jagged sequences: Q/K/V/dO are 3-D (row, dim, head) TMA views over the packed buffers with the row
coordinate offset by the sequence start, so a tile may hold rows of the next sequence. Those rows
and keys are masked (P = dS = 0) on every block that can hold them (the last query block, and every
block of a key tile that crosses the sequence end); a zero dS row adds exactly 0 to the next
sequence's dQ, and dK/dV rows past the end are never stored. Query-block ranges follow
``triton_common.row_range_for_keys``: [lo, full_start) masked, [full_start, hi) mask-free. Offsets
and targets are clamped to the L rows in the prologue (``hstu_fwd_sm90.seq_bounds``).
"""

from __future__ import annotations

from typing import NamedTuple

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from kernel_templates.cute_sm90 import FIRST_STAGE, pipeline_groups, stage_bytes, tma_load, tma_pipeline

from .bwd_config import BWD_MMA_REGS, HSTUCuteBwdConfig, wgmma_split
from .hstu_bwd_step import BAR_DQ_EMPTY, BAR_DQ_FULL, BwdSteps, _Frags, _Mmas, _Row
from .hstu_fwd_sm90 import HSTUFwdSm90, _position_id, seq_bounds
from .schedule import compact_tile, compact_tile_at, grouped_block_order

PRODUCER_REGS = 24
SCHED_STAGES = 2  # slots of the persistent tile ring (producer warp -> MMA warpgroups and dQ warp)


def _row_major_smem(dtype: type[cutlass.Numeric], rows: int, cols: int, stages: int):
    """Swizzled (rows, cols, stages) tile, cols contiguous; serves as K-major and (transposed) MN-major."""
    atom_kind = sm90_utils.get_smem_layout_atom(LayoutEnum.ROW_MAJOR, dtype, cols)
    atom = warpgroup.make_smem_layout_atom(atom_kind, dtype)
    return cute.tile_to_shape(atom, (rows, cols, stages), order=(0, 1, 2))


def _transpose(t: cute.Tensor) -> cute.Tensor:
    """Swap the first two modes of a staged smem tensor (same bytes, e.g. Q -> Q^T)."""
    shape = (t.shape[1], t.shape[0], *t.shape[2:])
    order = (1, 0, *range(2, cute.rank(t)))
    return cute.composition(t, cute.make_ordered_layout(shape, order=order))


class _TileCtx(NamedTuple):
    """What maps a tile index to its sequence, head and key block: the batch's offsets and targets, the
    compact tile table, and the sizes and mask lengths the row ranges need."""

    offsets: cute.Tensor
    targets: cute.Tensor
    tiles: cute.Tensor
    num_heads: Int32
    num_rows: Int32
    ctx_len: Int32
    max_attn_len: Int32
    # Persistent only (None otherwise): the tile ring's pipeline and slots, and the device tile counter.
    sched_pipe: object
    sched_smem: object
    counter: object


class _Operand(NamedTuple):
    """One TMA-loaded operand: its copy atom, the (rows, dim, heads) global view and the smem stages."""

    atom: cute.CopyAtom
    gmem: cute.Tensor
    smem: cute.Tensor


class _Loads(NamedTuple):
    """What the producer warp loads (Q, dO, K, V) and the rings it fills."""

    q: _Operand
    do: _Operand
    k: _Operand
    v: _Operand
    pipe_kv: pipeline.PipelineTmaAsync
    pipe_q: pipeline.PipelineTmaAsync
    pipe_do: pipeline.PipelineTmaAsync


class HSTUBwdSm90(BwdSteps):
    """Builds and launches the backward kernel for one (config, dtype, head dims, mask flags)."""

    def __init__(
        self,
        config: HSTUCuteBwdConfig,
        dtype: type[cutlass.Numeric],
        dqk: int,
        dv: int,
        has_context: bool,
        has_targets: bool,
        has_window: bool,
    ) -> None:
        self.cfg = config
        self.dtype = dtype
        self.dqk = dqk
        self.dv = dv
        self.has_context = has_context
        self.has_targets = has_targets
        self.has_window = has_window
        self.tile_m = config.block_m
        self.tile_n = config.block_n
        self.num_stages = config.num_stages
        self.do_stages = config.do_stages
        self.dq_serial = config.dq_serial
        self.num_wg = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        self.mma_regs = BWD_MMA_REGS[self.num_wg]
        # setmaxnreg.inc only draws on registers this CTA released: the launch gives every thread
        # 64K / threads (rounded down to 8); the producer's release must cover the MMA increase, or
        # the MMA warpgroups block forever in setmaxnreg.inc.
        launch_regs = (65536 // self.num_threads) // 8 * 8
        freed = (launch_regs - PRODUCER_REGS) * 128
        if (self.mma_regs - launch_regs) * self.num_mma_threads > freed:
            raise ValueError(
                f"setmaxnreg budget: {self.num_wg} MMA warpgroups at {self.mma_regs} registers need more than "
                f"the producer warpgroup releases ({freed} registers at {PRODUCER_REGS} per thread)"
            )
        self.split_sdp, self.split_dkv, self.split_dq = wgmma_split(config)
        # The fp32 dQ tile in shared memory: whole, or one warpgroup's slice of it with dq_serial.
        am, an = self.split_dq
        self.dq_tile = (self.tile_m // am, self.dqk // an) if self.dq_serial else (self.tile_m, self.dqk)
        self.swap = config.swap_sdp
        # (rows, cols) of the S / dP accumulators: (queries, keys), or (keys, queries) when swapped.
        self.sdp_tile = (self.tile_n, self.tile_m) if self.swap else (self.tile_m, self.tile_n)

    def _tiled_mma_rs(self, split: tuple[int, int], n_total: int):
        """A from registers (K-major), B from shared memory (MN-major): dV = P^T dO and dK = dS^T Q."""
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            (split[0], split[1], 1),
            (64, n_total // split[1]),
            warpgroup.OperandSource.RMEM,
        )

    def _tiled_mma(self, a_major, b_major, split: tuple[int, int], n_total: int):
        return sm90_utils.make_trivial_tiled_mma(
            self.dtype, self.dtype, a_major, b_major, Float32, (split[0], split[1], 1), (64, n_total // split[1])
        )

    # ------------------------------------------------------------------ host side (tracing)
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mOffsets: cute.Tensor,
        mTargets: cute.Tensor,
        mTiles: cute.Tensor,
        mCounter: cute.Tensor,
        alpha: Float32,
        inv_scale: Float32,
        ctx_len: Int32,
        max_attn_len: Int32,
        num_n_blocks: Int32,
        num_ctas: Int32,
        stream: cuda.CUstream,
    ):
        # (L, H, D) -> (L, D, H): rows and the contiguous head dim first, heads as the batch mode.
        mQ, mK, mV, mdO, mdQ, mdK, mdV = [
            cute.make_tensor(t.iterator, cute.select(t.layout, mode=[0, 2, 1]))
            for t in (mQ, mK, mV, mdO, mdQ, mdK, mdV)
        ]
        K_, MN_ = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
        tiled_mma_sdp = self._tiled_mma(K_, K_, self.split_sdp, self.sdp_tile[1])
        if const_expr(self.swap):
            tiled_mma_dk = self._tiled_mma_rs(self.split_dkv, self.dqk)
            tiled_mma_dv = self._tiled_mma_rs(self.split_dkv, self.dv)
            tiled_mma_dq = self._tiled_mma(MN_, MN_, self.split_dq, self.dqk)
        else:
            tiled_mma_dk = self._tiled_mma(MN_, MN_, self.split_dkv, self.dqk)
            tiled_mma_dv = self._tiled_mma(MN_, MN_, self.split_dkv, self.dv)
            tiled_mma_dq = self._tiled_mma(K_, MN_, self.split_dq, self.dqk)

        sQ_layout = _row_major_smem(self.dtype, self.tile_m, self.dqk, self.num_stages)
        sdO_layout = _row_major_smem(self.dtype, self.tile_m, self.dv, self.do_stages)
        sK_layout = _row_major_smem(self.dtype, self.tile_n, self.dqk, 1)
        sV_layout = _row_major_smem(self.dtype, self.tile_n, self.dv, 1)
        # P and dS (queries x keys), or with swap_sdp two dS^T buffers (keys x queries) and no P.
        sPdS_layout = _row_major_smem(self.dtype, *self.sdp_tile, 2 if self.swap else 1)
        sdQ_layout = _row_major_smem(Float32, *self.dq_tile, 1)

        tma_atom_q, tma_q = tma_load(mQ, sQ_layout, (self.tile_m, self.dqk))
        tma_atom_do, tma_do = tma_load(mdO, sdO_layout, (self.tile_m, self.dv))
        tma_atom_k, tma_k = tma_load(mK, sK_layout, (self.tile_n, self.dqk))
        tma_atom_v, tma_v = tma_load(mV, sV_layout, (self.tile_n, self.dv))
        tma_atom_dq, tma_dq = cpasync.make_tiled_tma_atom(
            cpasync.CopyReduceBulkTensorTileS2GOp(), mdQ, cute.slice_(sdQ_layout, FIRST_STAGE), self.dq_tile
        )
        self.q_bytes = stage_bytes(self.dtype, sQ_layout)
        self.do_bytes = stage_bytes(self.dtype, sdO_layout)
        self.kv_bytes = stage_bytes(self.dtype, sK_layout) + stage_bytes(self.dtype, sV_layout)

        @cute.struct
        class SharedStorage:
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_q: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_do: cute.struct.MemRange[cutlass.Int64, self.do_stages * 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            if const_expr(not self.swap):  # P stays in registers when swapped
                sP: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdS: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sPdS_layout)], 1024]
            sdQ: cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sdQ_layout)], 1024]
            if const_expr(self.cfg.persistent):
                mbar_sched: cute.struct.MemRange[cutlass.Int64, SCHED_STAGES * 2]
                sched: cute.struct.MemRange[Int32, SCHED_STAGES]

        self.shared_storage = SharedStorage
        num_heads = cute.size(mQ.shape[2])
        batch = cute.size(mOffsets.shape[0]) - 1
        # Rows every sequence must stay within: those of Q and of dK, dV (the only non-TMA accesses).
        num_rows = cutlass.min(cute.size(mQ.shape[0]), cutlass.min(cute.size(mdK.shape[0]), cute.size(mdV.shape[0])))
        grid = [num_heads, batch, num_n_blocks]
        num_tiles = num_heads * (cute.size(mTiles.shape[0]) // 2)  # compact table rows x heads
        if const_expr(self.cfg.persistent):
            grid = [cutlass.min(num_tiles, num_ctas), 1, 1]
        elif const_expr(self.cfg.compact):
            grid = [num_tiles, 1, 1]
        self.kernel(
            tma_atom_q, tma_q, tma_atom_do, tma_do, tma_atom_k, tma_k, tma_atom_v, tma_v, tma_atom_dq, tma_dq,
            mdK, mdV, mOffsets, mTargets, mTiles, mCounter, num_heads, num_tiles, num_rows, alpha, inv_scale, ctx_len,
            max_attn_len,
            tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout, sdQ_layout,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )  # fmt: skip

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_do: cute.CopyAtom,
        mdO: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mV: cute.Tensor,
        tma_atom_dq: cute.CopyAtom,
        mdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mOffsets: cute.Tensor,
        mTargets: cute.Tensor,
        mTiles: cute.Tensor,
        mCounter: cute.Tensor,
        num_heads: Int32,
        num_tiles: Int32,
        num_rows: Int32,
        alpha: Float32,
        inv_scale: Float32,
        ctx_len: Int32,
        max_attn_len: Int32,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sdQ_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            for atom in (tma_atom_q, tma_atom_do, tma_atom_k, tma_atom_v, tma_atom_dq):
                cpasync.prefetch_descriptor(atom)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)  # as the forward does
        groups = pipeline_groups(self.num_mma_threads)
        pipe_kv = tma_pipeline(storage.mbar_kv, 1, groups, self.kv_bytes)
        pipe_q = tma_pipeline(storage.mbar_q, self.num_stages, groups, self.q_bytes)
        pipe_do = tma_pipeline(storage.mbar_do, self.do_stages, groups, self.do_bytes)
        sched_pipe, sched_smem = None, None
        if const_expr(self.cfg.persistent):
            sched_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_sched.data_ptr(),
                num_stages=SCHED_STAGES,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_threads + 32),
                defer_sync=True,
            )
            sched_smem = storage.sched.get_tensor(cute.make_layout(SCHED_STAGES))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sP = sdS if const_expr(self.swap) else storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner)
        sdQ = storage.sdQ.get_tensor(sdQ_layout.outer, swizzle=sdQ_layout.inner)
        tc = _TileCtx(
            mOffsets, mTargets, mTiles, num_heads, num_rows, ctx_len, max_attn_len, sched_pipe, sched_smem, mCounter
        )

        # The tiles this CTA runs: [first, num_tiles) with a stride of the grid when persistent, else the
        # one tile of its block index (range(0, 1): the tile comes from the block index, not t).
        first, end, step = Int32(0), Int32(1), Int32(1)
        go = cutlass.Boolean(True)
        if const_expr(self.cfg.persistent):
            bid_x, _, _ = cute.arch.block_idx()
            grid_x, _, _ = cute.arch.grid_dim()
            first, end, step = Int32(bid_x), num_tiles, Int32(grid_x)
        else:
            only = self.tile(tc, first)
            go = only[3] < only[2]  # start_n < n: a real key tile (an empty CTA exits at once)

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if go:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(PRODUCER_REGS)
                if warp_idx == 0:
                    loads = _Loads(
                        _Operand(tma_atom_q, mQ, sQ), _Operand(tma_atom_do, mdO, sdO), _Operand(tma_atom_k, mK, sK),
                        _Operand(tma_atom_v, mV, sV), pipe_kv, pipe_q, pipe_do,
                    )  # fmt: skip
                    self.load(loads, tc, first, end, step)
                if warp_idx == 1:
                    self.store_dq(tma_atom_dq, mdQ, sdQ, tc, first, end, step)
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma(
                    tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq,
                    sQ, sdO, sK, sV, sP, sdS, sdQ, mdK, mdV, pipe_kv, pipe_q, pipe_do,
                    tidx - 128, tc, first, end, step, alpha, inv_scale,
                )  # fmt: skip

    @cute.jit
    def tile(self, tc: _TileCtx, t: Int32):
        """(head, seq_start, n, start_n, n_block, blk_lo, blk_full, blk_hi, m_id) of tile ``t`` (persistent)
        or of this CTA's block index; a tile past the sequence end has an empty query-block range."""
        if const_expr(self.cfg.persistent):
            head, bid_b, n_block, live = compact_tile_at(tc.tiles, t, tc.num_heads)
        elif const_expr(self.cfg.compact):
            head, bid_b, n_block, live = compact_tile(tc.tiles, tc.num_heads)
        else:
            head, bid_b, n_block = grouped_block_order(self.cfg.l2_group)
            live = Int32(1)
        seq_start, n, num_t = seq_bounds(tc.offsets, tc.targets, bid_b, tc.num_rows, self.has_targets)
        n = n * live  # a compact-table entry past the last real tile has no rows to do
        hist_end = n - num_t
        m_id = n - tc.ctx_len + 1 - num_t
        start_n = n_block * self.tile_n
        lo, full_start, hi = self.row_range(start_n, n, hist_end, m_id, tc.ctx_len, tc.max_attn_len)
        blk_lo = lo // self.tile_m
        blk_hi = (hi + self.tile_m - 1) // self.tile_m
        blk_full = full_start // self.tile_m
        if start_n + self.tile_n > n:
            # The key tile crosses the sequence end: its last keys belong to the next sequence.
            blk_full = blk_hi
        if start_n >= n:
            blk_hi = blk_lo
        return head, seq_start, n, start_n, n_block, blk_lo, blk_full, blk_hi, m_id

    @cute.jit
    def first_tile(self, tc: _TileCtx, first: Int32, producer: cutlass.Constexpr[bool]):
        """(first tile, scheduler-ring state) of this role. Persistent: the producer warp publishes its
        block index as the first tile, the other roles take tiles from the ring."""
        kind = pipeline.PipelineUserType.Producer if const_expr(producer) else pipeline.PipelineUserType.Consumer
        st = pipeline.make_pipeline_state(kind, SCHED_STAGES)
        t = first
        if const_expr(self.cfg.persistent):
            if const_expr(producer):
                st = self.publish(tc, st, t)
            else:
                t, st = self.take(tc, st)
        return t, st

    @cute.jit
    def next_tile(
        self, tc: _TileCtx, t: Int32, step: Int32, st: pipeline.PipelineState, producer: cutlass.Constexpr[bool]
    ):
        """The role's next tile: t + step on a plain grid; persistent, the producer draws the next table
        entry from the device counter (grid + the count of earlier draws) and publishes it, the others
        take it from the ring. A tile >= num_tiles ends every role's loop."""
        nxt = t + step
        if const_expr(self.cfg.persistent):
            if const_expr(producer):
                lane = cute.arch.lane_idx()
                drawn = Int32(0)
                if lane == 0:
                    drawn = cute.arch.atomic_add(tc.counter.iterator, Int32(1))
                nxt = step + cute.arch.shuffle_sync(drawn, 0)
                st = self.publish(tc, st, nxt)
            else:
                nxt, st = self.take(tc, st)
        return nxt, st

    @cute.jit
    def publish(self, tc: _TileCtx, st: pipeline.PipelineState, t: Int32):
        """Producer warp: tile ``t`` into the next ring slot (lane 0 writes and arrives)."""
        tc.sched_pipe.producer_acquire(st)
        if cute.arch.lane_idx() == 0:
            tc.sched_smem[st.index] = t
            tc.sched_pipe.producer_commit(st)
        st.advance()
        return st

    @cute.jit
    def take(self, tc: _TileCtx, st: pipeline.PipelineState):
        """MMA or dQ thread: the next tile from the ring (every thread reads, then arrives on empty)."""
        tc.sched_pipe.consumer_wait(st)
        t = Int32(tc.sched_smem[st.index])
        tc.sched_pipe.consumer_release(st)
        st.advance()
        return t, st

    @cute.jit
    def row_range(self, start_n: Int32, n: Int32, hist_end: Int32, m_id: Int32, ctx: Int32, w: Int32):
        """Rows that may see keys [start_n, start_n + block_n): (lo, full_start, hi), as in triton_common.

        [lo, full_start) needs the mask, [full_start, hi) does not (rows < n). Caller ensures start_n < n.
        """
        end_n = cutlass.min(start_n + self.tile_n, n)
        lo = (start_n // self.tile_m) * self.tile_m
        if const_expr(self.has_context):  # noqa: SIM102 (compile-time test around a staged one)
            if (start_n < hist_end) & (ctx > 0):
                lo = Int32(0)
        hi = n
        full_start = Int32(0)
        if const_expr(self.has_window):
            limit_id = _position_id(end_n - 1, ctx, m_id, self.has_context, self.has_targets) + w
            hi_w = cutlass.min(n, limit_id + ctx)
            if const_expr(self.has_targets):  # noqa: SIM102
                if m_id <= limit_id:
                    hi_w = n
            hi = hi_w
            full_start = (hi + self.tile_m - 1) // self.tile_m * self.tile_m
        else:
            full_start = (end_n + self.tile_m - 1) // self.tile_m * self.tile_m
            if end_n > hist_end:
                full_start = (hi + self.tile_m - 1) // self.tile_m * self.tile_m
            if const_expr(self.has_targets):  # noqa: SIM102
                if m_id < 1:
                    full_start = (hi + self.tile_m - 1) // self.tile_m * self.tile_m
        full_start = cutlass.max(full_start, lo)
        return lo, full_start, hi

    @cute.jit
    def load(self, ld: _Loads, tc: _TileCtx, first: Int32, end: Int32, step: Int32):
        """Producer warp, per tile: K and V, and the Q and dO tiles of query blocks [blk_lo, blk_hi).
        Persistent, K/V go after the first Q/dO pair: that pair loads while the last tile still runs,
        and K/V wait for the MMA warpgroups to release the last tile's."""
        st_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        st_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        st_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.do_stages)
        t, st_s = self.first_tile(tc, first, True)
        while t < end:
            head, seq_start, _, _, n_block, blk_lo, _, blk_hi, _ = self.tile(tc, t)
            if blk_lo < blk_hi:
                st_kv, st_q, st_do = self.load_tile(ld, st_kv, st_q, st_do, seq_start, head, n_block, blk_lo, blk_hi)
            t, st_s = self.next_tile(tc, t, step, st_s, True)

    @cute.jit
    def load_tile(
        self,
        ld: _Loads,
        st_kv: pipeline.PipelineState,
        st_q: pipeline.PipelineState,
        st_do: pipeline.PipelineState,
        seq_start: Int32,
        head: Int32,
        n_block: Int32,
        blk_lo: Int32,
        blk_hi: Int32,
    ):
        """One key tile's loads; returns the advanced (kv, q, do) producer states."""
        one = cute.make_layout(1)

        def part(op: _Operand, tile, coord):
            g = cute.local_tile(cute.domain_offset((seq_start, 0), op.gmem[None, None, head]), tile, coord)
            return cpasync.tma_partition(op.atom, 0, one, cute.group_modes(op.smem, 0, 2), cute.group_modes(g, 0, 2))

        pipe_kv, pipe_q, pipe_do = ld.pipe_kv, ld.pipe_q, ld.pipe_do
        tma_atom_k, tma_atom_v, tma_atom_q, tma_atom_do = ld.k.atom, ld.v.atom, ld.q.atom, ld.do.atom
        tKsK, tKgK = part(ld.k, (self.tile_n, self.dqk), (n_block, 0))
        tVsV, tVgV = part(ld.v, (self.tile_n, self.dv), (n_block, 0))
        tQsQ, tQgQ = part(ld.q, (self.tile_m, self.dqk), (None, 0))
        tOsO, tOgO = part(ld.do, (self.tile_m, self.dv), (None, 0))
        if const_expr(not self.cfg.persistent):
            self.load_kv(tma_atom_k, tma_atom_v, tKgK, tKsK, tVgV, tVsV, pipe_kv, st_kv)
        for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
            pipe_q.producer_acquire(st_q)
            bar_q = pipe_q.producer_get_barrier(st_q)
            cute.copy(tma_atom_q, tQgQ[None, blk], tQsQ[None, st_q.index], tma_bar_ptr=bar_q)
            pipe_do.producer_acquire(st_do)
            bar_do = pipe_do.producer_get_barrier(st_do)
            cute.copy(tma_atom_do, tOgO[None, blk], tOsO[None, st_do.index], tma_bar_ptr=bar_do)
            if const_expr(self.cfg.persistent):  # noqa: SIM102 (compile-time test around a staged one)
                if blk == blk_lo:
                    self.load_kv(tma_atom_k, tma_atom_v, tKgK, tKsK, tVgV, tVsV, pipe_kv, st_kv)
            st_q.advance()
            st_do.advance()
        st_kv.advance()
        return st_kv, st_q, st_do

    @cute.jit
    def load_kv(self, tma_atom_k, tma_atom_v, tKgK, tKsK, tVgV, tVsV, pipe_kv, st_kv):
        """K and V of the key tile into their one buffer, once the MMA warpgroups released it."""
        pipe_kv.producer_acquire(st_kv)
        bar_kv = pipe_kv.producer_get_barrier(st_kv)
        cute.copy(tma_atom_k, tKgK, tKsK[None, 0], tma_bar_ptr=bar_kv)
        cute.copy(tma_atom_v, tVgV, tVsV[None, 0], tma_bar_ptr=bar_kv)

    @cute.jit
    def store_dq(
        self,
        tma_atom_dq: cute.CopyAtom,
        mdQ: cute.Tensor,
        sdQ: cute.Tensor,
        tc: _TileCtx,
        first: Int32,
        end: Int32,
        step: Int32,
    ):
        """dQ warp: TMA reduce-add of each dQ partial tile (or of each warpgroup's slice, in turns, with
        ``dq_serial``) into the fp32 dQ buffer, tile after tile in the MMA warpgroups' order."""
        t, st_s = self.first_tile(tc, first, False)
        while t < end:
            head, seq_start, _, _, _, blk_lo, _, blk_hi, _ = self.tile(tc, t)
            gdQ = cute.local_tile(cute.domain_offset((seq_start, 0), mdQ[None, None, head]), self.dq_tile, (None, None))
            tsdQ, tgdQ = cpasync.tma_partition(
                tma_atom_dq, 0, cute.make_layout(1), cute.group_modes(sdQ, 0, 2), cute.group_modes(gdQ, 0, 2)
            )
            if const_expr(self.dq_serial):
                am = self.split_dq[0]
                sync_wg = 128 + 32
                for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                    for w in cutlass.range_constexpr(self.num_wg):
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY + 2 * w, number_of_threads=sync_wg)
                        cute.arch.barrier(barrier_id=BAR_DQ_FULL + 2 * w, number_of_threads=sync_wg)
                        cute.copy(tma_atom_dq, tsdQ[None, 0], tgdQ[None, blk * am + w % am, w // am])
                        cute.arch.cp_async_bulk_commit_group()
            else:
                sync_threads = self.num_mma_threads + 32
                for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    cute.arch.barrier_arrive(barrier_id=BAR_DQ_EMPTY, number_of_threads=sync_threads)
                    cute.arch.barrier(barrier_id=BAR_DQ_FULL, number_of_threads=sync_threads)
                    cute.copy(tma_atom_dq, tsdQ[None, 0], tgdQ[None, blk, 0])
                    cute.arch.cp_async_bulk_commit_group()
            t, st_s = self.next_tile(tc, t, step, st_s, False)
        cute.arch.cp_async_bulk_wait_group(0)

    @cute.jit
    def mma(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        sQ: cute.Tensor,
        sdO: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        sP: cute.Tensor,
        sdS: cute.Tensor,
        sdQ: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        pipe_kv: pipeline.PipelineTmaAsync,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_do: pipeline.PipelineTmaAsync,
        tidx: Int32,
        tc: _TileCtx,
        first: Int32,
        end: Int32,
        step: Int32,
        alpha: Float32,
        inv_scale: Float32,
    ):
        """MMA warpgroups: per key tile, the five products per query block, dK/dV in registers, dQ
        partials to smem, then dK/dV stored from registers."""
        wg = cute.arch.make_warp_uniform(tidx // 128) * 128
        wg_sdp = tiled_mma_sdp.get_slice(wg)
        wg_dk = tiled_mma_dk.get_slice(wg)
        wg_dv = tiled_mma_dv.get_slice(wg)
        wg_dq = tiled_mma_dq.get_slice(wg)
        # (A, B) of S and dP: (Q, K) and (dO, V), or (K, Q) and (V, dO) for S^T and dP^T.
        sdp_ops = ((sK, sQ), (sV, sdO)) if const_expr(self.swap) else ((sQ, sK), (sdO, sV))
        tSrA = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sdp_ops[0][0]))
        tSrB = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sdp_ops[0][1]))
        tPrA = tiled_mma_sdp.make_fragment_A(wg_sdp.partition_A(sdp_ops[1][0]))
        tPrB = tiled_mma_sdp.make_fragment_B(wg_sdp.partition_B(sdp_ops[1][1]))
        tVrdOt = tiled_mma_dv.make_fragment_B(wg_dv.partition_B(_transpose(sdO)))
        tKrQt = tiled_mma_dk.make_fragment_B(wg_dk.partition_B(_transpose(sQ)))
        # dQ = dS K: dS from the (queries, keys) tile, or read transposed from the dS^T buffers.
        tQrdS = tiled_mma_dq.make_fragment_A(wg_dq.partition_A(_transpose(sdS) if const_expr(self.swap) else sdS))
        tQrKt = tiled_mma_dq.make_fragment_B(wg_dq.partition_B(_transpose(sK)))

        acc_S = cute.make_rmem_tensor(wg_sdp.partition_shape_C(self.sdp_tile), Float32)
        acc_dP = cute.make_rmem_tensor(wg_sdp.partition_shape_C(self.sdp_tile), Float32)
        acc_dV = cute.make_rmem_tensor(wg_dv.partition_shape_C((self.tile_n, self.dv)), Float32)
        acc_dK = cute.make_rmem_tensor(wg_dk.partition_shape_C((self.tile_n, self.dqk)), Float32)
        acc_dQ = cute.make_rmem_tensor(wg_dq.partition_shape_C((self.tile_m, self.dqk)), Float32)

        # Thread-level partitions of the P / dS / dQ smem tiles and of the dK / dV outputs.
        thr_sdp = tiled_mma_sdp.get_slice(tidx)
        tScS = thr_sdp.partition_C(cute.make_identity_tensor(self.sdp_tile))
        if const_expr(self.dq_serial):
            # sdQ holds one warpgroup's slice: partition it as that warpgroup's own single-atom MMA.
            K_, MN_ = warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.MN
            mma_dq_one = self._tiled_mma(K_, MN_, (1, 1), self.dq_tile[1])
            tdQsdQ = mma_dq_one.get_slice(tidx % 128).partition_C(sdQ[None, None, 0])
        else:
            tdQsdQ = tiled_mma_dq.get_slice(tidx).partition_C(sdQ[None, None, 0])
        thr_dk = tiled_mma_dk.get_slice(tidx)
        thr_dv = tiled_mma_dv.get_slice(tidx)
        tdKcdK = thr_dk.partition_C(cute.make_identity_tensor((self.tile_n, self.dqk)))
        tdVcdV = thr_dv.partition_C(cute.make_identity_tensor((self.tile_n, self.dv)))
        dq_scale = alpha * inv_scale
        if const_expr(self.swap):
            # P^T and dS^T as register A operands of dV and dK; dS^T goes to smem through thr_sdp.
            tVrPt = cute.make_rmem_tensor(HSTUFwdSm90._acc_as_operand_a(acc_S.layout), self.dtype)
            tKrdSt = cute.make_rmem_tensor(HSTUFwdSm90._acc_as_operand_a(acc_S.layout), self.dtype)
            rP, rdS, tPsP, tdSsdS = None, None, None, None
        else:
            tPsP = thr_sdp.partition_C(sP[None, None, 0])
            tdSsdS = thr_sdp.partition_C(sdS[None, None, 0])
            tVrPt = tiled_mma_dv.make_fragment_A(wg_dv.partition_A(_transpose(sP)))
            tKrdSt = tiled_mma_dk.make_fragment_A(wg_dk.partition_A(_transpose(sdS)))
            rP = cute.make_rmem_tensor(acc_S.layout, self.dtype)
            rdS = cute.make_rmem_tensor(acc_S.layout, self.dtype)
        mm = _Mmas(tiled_mma_sdp, tiled_mma_dk, tiled_mma_dv, tiled_mma_dq)
        f = _Frags(
            tSrA, tSrB, tPrA, tPrB, tVrPt, tVrdOt, tKrdSt, tKrQt, tQrdS, tQrKt, acc_S, acc_dP, acc_dK, acc_dV, acc_dQ,
            rP, rdS, tScS, tPsP, tdSsdS, tdQsdQ, thr_sdp, sdS,
        )  # fmt: skip

        st_kv = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        st_q = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        st_do = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.do_stages)
        # Blocks done so far (mod 2): a persistent CTA's dS^T buffers alternate across its tiles too.
        parity = Int32(0)
        t, st_s = self.first_tile(tc, first, False)
        while t < end:
            head, seq_start, n, start_n, n_block, blk_lo, blk_full, blk_hi, m_id = self.tile(tc, t)
            row = _Row(start_n, n, blk_full, m_id, tc.ctx_len, tc.max_attn_len, alpha, dq_scale, tidx)
            acc_dV.fill(0.0)
            acc_dK.fill(0.0)
            if blk_lo < blk_hi:
                pipe_kv.consumer_wait(st_kv)
                if const_expr(self.swap):
                    for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                        self.step_swapped(mm, f, row, pipe_q, pipe_do, st_q, st_do, blk, blk_lo - parity)
                        st_q.advance()
                        st_do.advance()
                else:
                    for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                        self.step(mm, f, row, pipe_q, pipe_do, st_q, st_do, blk)
                        st_q.advance()
                        st_do.advance()
                if const_expr(self.cfg.persistent):
                    pipe_kv.consumer_release(st_kv)  # every product of the tile has retired
                st_kv.advance()
                parity = (parity + blk_hi - blk_lo) % 2
            gdK = cute.local_tile(
                cute.domain_offset((seq_start, 0), mdK[None, None, head]), (self.tile_n, self.dqk), (n_block, 0)
            )
            gdV = cute.local_tile(
                cute.domain_offset((seq_start, 0), mdV[None, None, head]), (self.tile_n, self.dv), (n_block, 0)
            )
            self.epilogue(acc_dK, thr_dk.partition_C(gdK), tdKcdK, n, start_n, alpha * inv_scale)
            self.epilogue(acc_dV, thr_dv.partition_C(gdV), tdVcdV, n, start_n, inv_scale)
            t, st_s = self.next_tile(tc, t, step, st_s, False)
