"""CuTe DSL template: jagged HSTU attention forward for Hopper (sm90), TMA + wgmma.

One CTA per (head, sequence, query block); query blocks of a sequence-head launch from the last
(heaviest under causal masks) to the first, so long tiles start early, and ``l2_group``
sequence-heads run together so their K/V stay in L2 (``schedule.grouped_block_order``). With
``compact`` only the real tiles launch, heaviest first over the batch (``tile_table.py``); with ``split_heavy`` the
heaviest tiles' key ranges are cut into parts on separate CTAs, and the last part to finish adds the
others' fp32 partials (HSTU has no softmax state, so partial outputs simply add). Warpgroup 0 is the producer:
one warp issues TMA loads (cp.async.bulk.tensor) of the Q tile and of K/V tiles into a multi-stage
shared-memory ring guarded by mbarriers. The other ``block_m // 64`` warpgroups compute
S = Q K^T with wgmma (operands in shared memory), apply SiLU and the HSTU mask on the fp32
accumulator fragment (no softmax state), convert P to the input dtype in registers and accumulate
O += P V with a register-sourced wgmma.

Jagged sequences: Q/K/V are viewed as 3-D (row, dim, head) TMA tensors over the packed buffer and
each CTA offsets the row coordinate by its sequence start. A tile may read rows of the next sequence
(or zero-filled rows past L): key columns j >= n get P = 0 and query rows i >= n are never stored.
Key blocks follow the Triton template's range logic: [lo, full_end) is mask-free, [full_end, hi)
is masked; blocks outside are skipped. The prologue clamps what it reads from the offsets and targets
to the L rows (``seq_bounds``), so no input makes a CTA store outside them.
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum

from kernel_templates.cute_sm90 import pipeline_groups, stage_bytes, tma_load, tma_pipeline

from .config import HSTUCuteFwdConfig
from .schedule import compact_tile, grouped_block_order, split_tile

LOG2E = math.log2(math.e)
# (MMA warpgroups) -> (registers per MMA thread, registers per producer thread) after setmaxnreg.
_REGS = {1: (256, 56), 2: (240, 24), 3: (160, 32)}


@cute.jit
def _position_id(p: Int32, ctx: Int32, m_id: Int32, has_context: cutlass.Constexpr, has_targets: cutlass.Constexpr):
    """HSTU position id: context tokens -> 0, history counts from 1, targets -> m."""
    pid = p + 1
    if const_expr(has_context):
        pid = cutlass.max(p - ctx + 1, 0)
    if const_expr(has_targets):
        pid = cutlass.min(pid, m_id)
    return pid


@cute.jit
def seq_bounds(mOffsets: cute.Tensor, mTargets: cute.Tensor, b: Int32, num_rows: Int32, has_targets: cutlass.Constexpr):
    """(start, length n, targets) of sequence b, clamped: start to [0, L], end to [start, L], targets to
    [0, n]. No offsets can then move a predicated store (or a TMA coordinate) outside the L rows; valid
    inputs are unchanged, bad ones give wrong rows that the input check reports."""
    seq_start = cutlass.min(cutlass.max(Int32(mOffsets[b]), Int32(0)), num_rows)
    seq_end = cutlass.min(cutlass.max(Int32(mOffsets[b + 1]), seq_start), num_rows)
    n = seq_end - seq_start
    num_t = Int32(0)
    if const_expr(has_targets):
        num_t = cutlass.min(cutlass.max(Int32(mTargets[b]), Int32(0)), n)
    return seq_start, n, num_t


class HSTUFwdSm90:
    """Builds and launches the forward kernel for one (config, dtype, head dims, mask flags)."""

    def __init__(
        self,
        config: HSTUCuteFwdConfig,
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
        self.num_wg = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        self.mma_regs, self.producer_regs = _REGS[self.num_wg]
        self.overlap = config.intra_wg_overlap
        self.split = config.split_heavy > 1

    # ------------------------------------------------------------------ host side (tracing)
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mOffsets: cute.Tensor,
        mTargets: cute.Tensor,
        mTiles: cute.Tensor,
        mWs: cute.Tensor,
        mSem: cute.Tensor,
        alpha: Float32,
        inv_scale: Float32,
        ctx_len: Int32,
        max_attn_len: Int32,
        num_m_blocks: Int32,
        stream: cuda.CUstream,
    ):
        # (L, H, D) -> (L, D, H): rows and the contiguous head dim first, heads as the batch mode.
        mQ = cute.make_tensor(mQ.iterator, cute.select(mQ.layout, mode=[0, 2, 1]))
        mK = cute.make_tensor(mK.iterator, cute.select(mK.layout, mode=[0, 2, 1]))
        mO = cute.make_tensor(mO.iterator, cute.select(mO.layout, mode=[0, 2, 1]))
        # V as the (Dv, L, H) B operand of P V: MN-major (Dv contiguous).
        mVt = cute.make_tensor(mV.iterator, cute.select(mV.layout, mode=[2, 0, 1]))

        tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            (self.num_wg, 1, 1),
            (64, self.tile_n),
        )
        tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.MN,
            Float32,
            (self.num_wg, 1, 1),
            (64, self.dv),
            warpgroup.OperandSource.RMEM,
        )
        sQ_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.dqk), self.dtype, 1
        )
        sK_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.dqk), self.dtype, self.num_stages
        )
        sV_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.COL_MAJOR, (self.tile_m, self.dv, self.tile_n), self.dtype, self.num_stages
        )
        tma_atom_q, tma_q = tma_load(mQ, sQ_layout, (self.tile_m, self.dqk))
        tma_atom_k, tma_k = tma_load(mK, sK_layout, (self.tile_n, self.dqk))
        tma_atom_v, tma_v = tma_load(mVt, sV_layout, (self.dv, self.tile_n))
        self.q_bytes = stage_bytes(self.dtype, sQ_layout)
        self.k_bytes = stage_bytes(self.dtype, sK_layout)
        self.v_bytes = stage_bytes(self.dtype, sV_layout)

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            mbar_v: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            ticket: cute.struct.MemRange[Int32, 2]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]

        self.shared_storage = SharedStorage
        num_heads = cute.size(mQ.shape[2])
        batch = cute.size(mOffsets.shape[0]) - 1
        # Rows every sequence must stay within: those of Q and of O (the only non-TMA accesses).
        num_rows = cutlass.min(cute.size(mQ.shape[0]), cute.size(mO.shape[0]))
        grid = [num_heads, batch, num_m_blocks]
        if const_expr(self.cfg.compact):
            grid = [num_heads * (cute.size(mTiles.shape[0]) // (4 if self.split else 2)), 1, 1]
        self.kernel(
            tma_atom_q,
            tma_q,
            tma_atom_k,
            tma_k,
            tma_atom_v,
            tma_v,
            mO,
            mOffsets,
            mTargets,
            mTiles,
            mWs,
            mSem,
            num_heads,
            num_rows,
            alpha,
            inv_scale,
            ctx_len,
            max_attn_len,
            num_m_blocks,
            tiled_mma_qk,
            tiled_mma_pv,
            sQ_layout,
            sK_layout,
            sV_layout,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mVt: cute.Tensor,
        mO: cute.Tensor,
        mOffsets: cute.Tensor,
        mTargets: cute.Tensor,
        mTiles: cute.Tensor,
        mWs: cute.Tensor,
        mSem: cute.Tensor,
        num_heads: Int32,
        num_rows: Int32,
        alpha: Float32,
        inv_scale: Float32,
        ctx_len: Int32,
        max_attn_len: Int32,
        num_m_blocks: Int32,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        part, parts, slot = Int32(0), Int32(1), Int32(0)
        if const_expr(self.split):
            head, bid_b, m_block, live, part, parts, slot = split_tile(mTiles, num_heads)
        elif const_expr(self.cfg.compact):
            head, bid_b, m_block, live = compact_tile(mTiles, num_heads)
        else:
            head, bid_b, bid_m = grouped_block_order(self.cfg.l2_group)
            m_block = num_m_blocks - 1 - bid_m
            live = Int32(1)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_q)
            cpasync.prefetch_descriptor(tma_atom_k)
            cpasync.prefetch_descriptor(tma_atom_v)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        groups = pipeline_groups(self.num_mma_threads)
        pipe_q = tma_pipeline(storage.mbar_q, 1, groups, self.q_bytes)
        pipe_k = tma_pipeline(storage.mbar_k, self.num_stages, groups, self.k_bytes)
        pipe_v = tma_pipeline(storage.mbar_v, self.num_stages, groups, self.v_bytes)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(1, 1), is_relaxed=True)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        seq_start, n, num_t = seq_bounds(mOffsets, mTargets, bid_b, num_rows, self.has_targets)
        n = n * live  # a compact-grid CTA past the last real tile has no rows to do
        hist_end = n - num_t
        m_id = n - ctx_len + 1 - num_t
        start_m = m_block * self.tile_m
        lo, full_end, hi = self.key_range(start_m, n, hist_end, m_id, ctx_len, max_attn_len)
        blk_lo = lo // self.tile_n
        blk_full = full_end // self.tile_n
        blk_hi = (hi + self.tile_n - 1) // self.tile_n
        if const_expr(self.split):  # this part's share of the key blocks; masked ones stay last
            nb = blk_hi - blk_lo
            first = blk_lo + nb * part // parts
            blk_hi = blk_lo + nb * (part + 1) // parts
            blk_lo = first
            blk_full = cutlass.min(cutlass.max(blk_full, blk_lo), blk_hi)
        sTicket = storage.ticket.get_tensor(cute.make_layout(2))

        pipeline.pipeline_init_wait(cluster_shape_mn=(1, 1))

        if start_m < n:
            if warp_idx < 4:
                cute.arch.setmaxregister_decrease(self.producer_regs)
                if warp_idx == 0:
                    self.load(
                        tma_atom_q, mQ, tma_atom_k, mK, tma_atom_v, mVt, sQ, sK, sV,
                        pipe_q, pipe_k, pipe_v, seq_start, head, m_block, blk_lo, blk_hi,
                    )  # fmt: skip
            else:
                cute.arch.setmaxregister_increase(self.mma_regs)
                self.mma(
                    tiled_mma_qk, tiled_mma_pv, sQ, sK, sV, mO, pipe_q, pipe_k, pipe_v,
                    tidx - 128, seq_start, n, head, m_block, start_m, blk_lo, blk_full, blk_hi,
                    alpha, inv_scale, ctx_len, max_attn_len, m_id, (mWs, mSem, sTicket, num_heads, parts, slot),
                )  # fmt: skip

    @cute.jit
    def key_range(self, start_m: Int32, n: Int32, hist_end: Int32, m_id: Int32, ctx: Int32, w: Int32):
        """Keys rows [start_m, start_m + block_m) may see: (lo, full_end, hi), as in triton_common."""
        hi = cutlass.min(start_m + self.tile_m, n)
        if const_expr(self.has_context):  # noqa: SIM102 (compile-time test around a staged one)
            if start_m < ctx:
                hi = cutlass.max(hi, hist_end)
        lo = Int32(0)
        full_end = Int32(0)
        if const_expr(self.has_window):
            id_min = _position_id(start_m, ctx, m_id, self.has_context, self.has_targets)
            if id_min - w > 0:
                lo = id_min - w + ctx - 1
            lo = (lo // self.tile_n) * self.tile_n
            lo = cutlass.min(lo, (hi // self.tile_n) * self.tile_n)
            full_end = lo
        else:
            full_end = (cutlass.min(start_m, hist_end) // self.tile_n) * self.tile_n
            if const_expr(self.has_targets):  # noqa: SIM102
                if m_id < 1:
                    full_end = Int32(0)
        return lo, full_end, hi

    @cute.jit
    def load(
        self,
        tma_atom_q: cute.CopyAtom,
        mQ: cute.Tensor,
        tma_atom_k: cute.CopyAtom,
        mK: cute.Tensor,
        tma_atom_v: cute.CopyAtom,
        mVt: cute.Tensor,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        seq_start: Int32,
        head: Int32,
        m_block: Int32,
        blk_lo: Int32,
        blk_hi: Int32,
    ):
        """Producer warp: the Q tile once, then K and V tiles of key blocks [blk_lo, blk_hi)."""
        mQ_cur = cute.domain_offset((seq_start, 0), mQ[None, None, head])
        mK_cur = cute.domain_offset((seq_start, 0), mK[None, None, head])
        mV_cur = cute.domain_offset((0, seq_start), mVt[None, None, head])
        gQ = cute.local_tile(mQ_cur, (self.tile_m, self.dqk), (m_block, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, self.dqk), (None, 0))
        gV = cute.local_tile(mV_cur, (self.dv, self.tile_n), (0, None))
        one = cute.make_layout(1)
        tQsQ, tQgQ = cpasync.tma_partition(tma_atom_q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
        tKsK, tKgK = cpasync.tma_partition(tma_atom_k, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        tVsV, tVgV = cpasync.tma_partition(tma_atom_v, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        pipe_q.producer_acquire(q_state)
        cute.copy(tma_atom_q, tQgQ, tQsQ[None, 0], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
            pipe_k.producer_acquire(kv_state)
            bar_k = pipe_k.producer_get_barrier(kv_state)
            cute.copy(tma_atom_k, tKgK[None, blk], tKsK[None, kv_state.index], tma_bar_ptr=bar_k)
            pipe_v.producer_acquire(kv_state)
            bar_v = pipe_v.producer_get_barrier(kv_state)
            cute.copy(tma_atom_v, tVgV[None, blk], tVsV[None, kv_state.index], tma_bar_ptr=bar_v)
            kv_state.advance()

    @cute.jit
    def mma(
        self,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
        sQ: cute.Tensor,
        sK: cute.Tensor,
        sV: cute.Tensor,
        mO: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_k: pipeline.PipelineTmaAsync,
        pipe_v: pipeline.PipelineTmaAsync,
        tidx: Int32,
        seq_start: Int32,
        n: Int32,
        head: Int32,
        m_block: Int32,
        start_m: Int32,
        blk_lo: Int32,
        blk_full: Int32,
        blk_hi: Int32,
        alpha: Float32,
        inv_scale: Float32,
        ctx: Int32,
        w: Int32,
        m_id: Int32,
        split: tuple,
    ):
        """MMA warpgroups: S = Q K^T, P = mask * silu(alpha S), O += P V, then the predicated store
        (of a cut tile: by its last part, after adding the others' partials; ``split`` is what
        ``combine`` needs)."""
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        wg_mma_qk = tiled_mma_qk.get_slice(wg_idx * 128)
        wg_mma_pv = tiled_mma_pv.get_slice(wg_idx * 128)
        thr_mma_qk = tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = tiled_mma_pv.get_slice(tidx)
        tSrQ = tiled_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = tiled_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrV = tiled_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sV))
        acc_s_shape = wg_mma_qk.partition_shape_C((self.tile_m, self.tile_n))
        acc_O = cute.make_rmem_tensor(wg_mma_pv.partition_shape_C((self.tile_m, self.dv)), Float32)
        acc_O.fill(0.0)
        tiled_mma_qk.set(warpgroup.Field.ACCUMULATE, True)
        tiled_mma_pv.set(warpgroup.Field.ACCUMULATE, True)
        # (row, col) of every accumulator element of S within the tile.
        tScS = thr_mma_qk.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        # Output partitions are taken before the main loop: wgmma field updates rebind the tiled MMA.
        mO_cur = cute.domain_offset((seq_start, 0), mO[None, None, head])
        gO = cute.local_tile(mO_cur, (self.tile_m, self.dv), (m_block, 0))
        tOgO = thr_mma_pv.partition_C(gO)
        tOcO = thr_mma_pv.partition_C(cute.make_identity_tensor((self.tile_m, self.dv)))

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        pipe_q.consumer_wait(q_state)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        acc_S = cute.make_rmem_tensor(acc_s_shape, Float32)
        if const_expr(not self.overlap):
            for blk in cutlass.range(blk_lo, blk_hi, unroll=1):
                self.qk_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, kv_state)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(kv_state)
                self.activate(acc_S, tScS, blk, blk >= blk_full, start_m, n, alpha, ctx, w, m_id)
                tOrP = self.to_operand_a(acc_S)
                self.pv_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, pipe_v, kv_state)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(kv_state)
                kv_state.advance()
        else:
            # S_{j+1} = Q K_{j+1}^T is issued before O += P_j V_j, and its SiLU/mask runs while P_j V_j
            # is still on the tensor cores. P_j lives in its own 16-bit registers, S in one fp32 buffer.
            if blk_lo < blk_hi:
                self.qk_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, kv_state)
                warpgroup.wait_group(0)
                pipe_k.consumer_release(kv_state)
                self.activate(acc_S, tScS, blk_lo, blk_lo >= blk_full, start_m, n, alpha, ctx, w, m_id)
                for blk in cutlass.range(blk_lo + 1, blk_hi, unroll=1):
                    tOrP = self.to_operand_a(acc_S)
                    next_state = kv_state.clone()
                    next_state.advance()
                    self.qk_gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, pipe_k, next_state)
                    self.pv_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, pipe_v, kv_state)
                    warpgroup.wait_group(1)
                    pipe_k.consumer_release(next_state)
                    self.activate(acc_S, tScS, blk, blk >= blk_full, start_m, n, alpha, ctx, w, m_id)
                    warpgroup.wait_group(0)
                    pipe_v.consumer_release(kv_state)
                    kv_state = next_state
                tOrP = self.to_operand_a(acc_S)
                self.pv_gemm(tiled_mma_pv, acc_O, tOrP, tOrV, pipe_v, kv_state)
                warpgroup.wait_group(0)
                pipe_v.consumer_release(kv_state)
        if const_expr(self.split):
            if self.combine(acc_O, tidx, head, *split):
                self.epilogue(acc_O, tOgO, tOcO, n, start_m, inv_scale)
        else:
            self.epilogue(acc_O, tOgO, tOcO, n, start_m, inv_scale)

    @cute.jit
    def combine(
        self,
        acc_O: cute.Tensor,
        tidx: Int32,
        head: Int32,
        mWs: cute.Tensor,
        mSem: cute.Tensor,
        sTicket: cute.Tensor,
        num_heads: Int32,
        parts: Int32,
        slot: Int32,
    ) -> cutlass.Boolean:
        """Whether this CTA stores the tile. A cut tile's parts take tickets in the order they finish; all
        but the last write their fp32 partial to slot ``slot + ticket`` and count it written; the last
        waits for those counts (their CTAs are already past their main loops, so the wait is short and
        cannot deadlock), adds the partials and resets both counters for the next launch."""
        last = cutlass.Boolean(True)
        if parts > 1:
            nthr = self.num_mma_threads
            frag = cute.size(acc_O)
            cell = 2 * (slot * num_heads + head)  # (arrived, written) counters of this tile-head
            if tidx == 0:
                sTicket[0] = cute.arch.atomic_add(mSem.iterator + cell, Int32(1), sem="acq_rel", scope="gpu")
            cute.arch.barrier(barrier_id=1, number_of_threads=nthr)
            ticket = sTicket[0]
            if ticket < parts - 1:
                last = cutlass.Boolean(False)
                base = ((slot + ticket) * num_heads + head) * (frag * nthr) + tidx
                for i in cutlass.range_constexpr(frag):
                    mWs[base + i * nthr] = acc_O[i]
                cute.arch.fence_acq_rel_gpu()
                cute.arch.barrier(barrier_id=1, number_of_threads=nthr)
                if tidx == 0:
                    cute.arch.atomic_add(mSem.iterator + cell + 1, Int32(1), sem="release", scope="gpu")
            else:
                if tidx == 0:
                    done = cute.arch.load(mSem.iterator + cell + 1, Int32, sem="acquire", scope="gpu")
                    while done < parts - 1:
                        done = cute.arch.load(mSem.iterator + cell + 1, Int32, sem="acquire", scope="gpu")
                cute.arch.barrier(barrier_id=1, number_of_threads=nthr)
                cute.arch.fence_acq_rel_gpu()
                for t in cutlass.range(parts - 1, unroll=1):
                    base = ((slot + t) * num_heads + head) * (frag * nthr) + tidx
                    for i in cutlass.range_constexpr(frag):
                        acc_O[i] = acc_O[i] + cute.arch.load(mWs.iterator + (base + i * nthr), Float32, cop="cg")
                if tidx == 0:
                    mSem[cell] = Int32(0)
                    mSem[cell + 1] = Int32(0)
        return last

    @cute.jit
    def qk_gemm(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tSrQ: cute.Tensor,
        tSrK: cute.Tensor,
        pipe_k: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
    ):
        """Wait for K tile ``state`` and issue S = Q K^T; commits one wgmma group.

        The accumulator is zero-filled rather than toggling the ACCUMULATE field: field updates made
        inside a staged loop cannot be threaded out of it by the tracer.
        """
        acc.fill(0.0)
        pipe_k.consumer_wait(state)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
            cute.gemm(tiled_mma, acc, tSrQ[None, None, kb, 0], tSrK[None, None, kb, state.index], acc)
        warpgroup.commit_group()

    @cute.jit
    def pv_gemm(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tOrP: cute.Tensor,
        tOrV: cute.Tensor,
        pipe_v: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
    ):
        """Wait for V tile ``state`` and issue O += P V (P from registers); commits one wgmma group."""
        pipe_v.consumer_wait(state)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
            cute.gemm(tiled_mma, acc, tOrP[None, None, kb], tOrV[None, None, kb, state.index], acc)
        warpgroup.commit_group()

    @cute.jit
    def activate(
        self,
        acc_S: cute.Tensor,
        tScS: cute.Tensor,
        blk: Int32,
        masked: cutlass.Boolean,
        start_m: Int32,
        n: Int32,
        alpha: Float32,
        ctx: Int32,
        w: Int32,
        m_id: Int32,
    ):
        """In place on the fp32 fragment: P = silu(alpha * S), zeroed where the mask is false."""
        if const_expr(self.cfg.tanh_silu):
            # silu(x) = h + h tanh(h), h = x / 2: one MUFU op (tanh.approx) per score instead of ex2 + rcp.
            half_alpha = alpha * Float32(0.5)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                h = acc_S[i] * half_alpha
                acc_S[i] = h + h * cute.math.tanh(h, approx=True)
        else:
            scale = alpha * Float32(-LOG2E)
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                s = acc_S[i]
                e = cute.math.exp2(s * scale, fastmath=True)
                acc_S[i] = s * alpha * cute.arch.rcp_approx(e + Float32(1.0))
        if masked:
            start_n = blk * self.tile_n
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                r, c = tScS[i]
                row = start_m + r
                col = start_n + c
                ok = self.valid(row, col, n, ctx, w, m_id)
                acc_S[i] = cutlass.select_(ok, acc_S[i], Float32(0.0))

    @cute.jit
    def to_operand_a(self, acc_S: cute.Tensor) -> cute.Tensor:
        """P in the input dtype, laid out as the register A operand of the P V wgmma."""
        # The fp32 C fragment of Q K^T, converted to 16 bit, is the A fragment of P V (k = 16 per 2 column groups).
        rP = cute.make_rmem_tensor(self._acc_as_operand_a(acc_S.layout), self.dtype)
        rP_as_acc = cute.make_tensor(rP.iterator, acc_S.layout)
        rP_as_acc.store(acc_S.load().to(self.dtype))
        return rP

    @staticmethod
    def _acc_as_operand_a(acc: cute.Layout) -> cute.Layout:
        """Re-view a wgmma C layout ((2, 2, N/8), MMA_M, MMA_N) as an A layout ((2, 2, 2), MMA_M, K/16)."""
        v = acc.shape[0]
        s = acc.stride[0]
        return cute.make_layout(
            ((v[0], v[1], 2), acc.shape[1], (acc.shape[2], v[2] // 2)),
            stride=((s[0], s[1], s[2]), acc.stride[1], (acc.stride[2], 2 * s[2])),
        )

    @cute.jit
    def valid(self, row: Int32, col: Int32, n: Int32, ctx: Int32, w: Int32, m_id: Int32) -> cutlass.Boolean:
        """The HSTU mask M[row, col] (HSTU.md) for keys inside the sequence."""
        ok = col < n
        if const_expr(not (self.has_context or self.has_targets or self.has_window)):
            ok = ok & (col <= row)
        else:
            id_i = _position_id(row, ctx, m_id, self.has_context, self.has_targets)
            id_j = _position_id(col, ctx, m_id, self.has_context, self.has_targets)
            v = (row == col) | (id_i > id_j)
            if const_expr(self.has_window):
                v = v & (id_i - id_j <= w)
            if const_expr(self.has_context):
                v = v | ((id_i == 0) & (id_j < m_id))
            ok = ok & v
        return ok

    @cute.jit
    def epilogue(
        self,
        acc_O: cute.Tensor,
        tOgO: cute.Tensor,
        tOcO: cute.Tensor,
        n: Int32,
        start_m: Int32,
        inv_scale: Float32,
    ):
        """Scale by 1/S, convert, and store rows < n straight from registers (no other sequence is touched)."""
        rO = cute.make_rmem_tensor(acc_O.layout, self.dtype)
        rO.store((acc_O.load() * inv_scale).to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(rO)):
            if start_m + tOcO[i][0] < n:
                tOgO[i] = rO[i]
