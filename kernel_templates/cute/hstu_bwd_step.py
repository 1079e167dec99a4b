"""The per-query-block steps of the CuTe DSL HSTU backward (``hstu_bwd_sm90.HSTUBwdSm90``).

The MMA warpgroups' work on one query block of a key tile (the five products, the SiLU and its
derivative with the HSTU mask, the dQ hand-off to the dQ warp) and the dK/dV stores from registers, as
a mixin over the kernel object's tile shape and flags (``tile_m``, ``tile_n``, ``swap``, ``cfg``, ...).
"""

from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import warpgroup

from .hstu_fwd_sm90 import _position_id

LOG2E = math.log2(math.e)
# Named barriers (0 is __syncthreads): P/dS tile handoff among MMA threads, dQ buffer full / empty
# (with dq_serial, warpgroup w uses BAR_DQ_FULL + 2w / BAR_DQ_EMPTY + 2w).
BAR_PDS, BAR_DQ_FULL, BAR_DQ_EMPTY = 1, 2, 3


class BwdSteps:
    """Query-block steps and the dK/dV epilogue of the backward kernel (mixed into ``HSTUBwdSm90``)."""

    @cute.jit
    def gemm(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        tA: cute.Tensor,
        tB: cute.Tensor,
        ia,
        ib,
        zero_init: cutlass.Constexpr[bool],
    ):
        """acc (+)= A[ia] B[ib] over the k-blocks; commits one wgmma group (no wait).

        A fresh MMA atom per call carries the ACCUMULATE field (off for the first k-block when
        ``zero_init``): zero-filling the accumulator instead makes ptxas serialise the wgmmas.
        """
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, not zero_init)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, kb, ia], tB[None, None, kb, ib], acc)
            atom.set(warpgroup.Field.ACCUMULATE, True)
        warpgroup.commit_group()

    @cute.jit
    def step(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tSrA: cute.Tensor,
        tSrB: cute.Tensor,
        tPrA: cute.Tensor,
        tPrB: cute.Tensor,
        tVrdOt: cute.Tensor,
        tKrQt: cute.Tensor,
        tQrdS: cute.Tensor,
        tQrKt: cute.Tensor,
        tVrPt: cute.Tensor,
        tKrdSt: cute.Tensor,
        acc_S: cute.Tensor,
        acc_dP: cute.Tensor,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        acc_dQ: cute.Tensor,
        rP: cute.Tensor,
        rdS: cute.Tensor,
        tScS: cute.Tensor,
        tPsP: cute.Tensor,
        tdSsdS: cute.Tensor,
        tdQsdQ: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_do: pipeline.PipelineTmaAsync,
        st_q: pipeline.PipelineState,
        st_do: pipeline.PipelineState,
        blk: Int32,
        blk_full: Int32,
        start_n: Int32,
        n: Int32,
        alpha: Float32,
        dq_scale: Float32,
        ctx: Int32,
        w: Int32,
        m_id: Int32,
        tidx: Int32,
    ):
        """One query block (unswapped): S, dP; P and dS to shared memory; dK, dV, dQ products."""
        start_m = blk * self.tile_m
        masked = (blk < blk_full) | (start_m + self.tile_m > n)
        pipe_q.consumer_wait(st_q)
        self.gemm(tiled_mma_sdp, acc_S, tSrA, tSrB, st_q.index, 0, True)
        pipe_do.consumer_wait(st_do)
        self.gemm(tiled_mma_sdp, acc_dP, tPrA, tPrB, st_do.index, 0, True)
        warpgroup.wait_group(1)
        self.activate(acc_S, rP, tScS, masked, start_m, start_n, n, alpha, ctx, w, m_id)
        # Every warpgroup has finished the previous block's reads of sP / sdS.
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        cute.autovec_copy(rP, tPsP)
        warpgroup.wait_group(0)
        for i in cutlass.range_constexpr(cute.size(acc_dP)):
            acc_dP[i] = acc_dP[i] * acc_S[i]
        rdS.store(acc_dP.load().to(self.dtype))
        cute.autovec_copy(rdS, tdSsdS)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        # Issue dK, dV and dQ in the order that frees the scarcer buffer first, then retire them in
        # that order: dK frees Q, dV frees dO, dQ goes to the dQ warp.
        order = self.product_order()
        for i in cutlass.range_constexpr(3):
            if const_expr(order[i] == "dk"):
                self.gemm(tiled_mma_dk, acc_dK, tKrdSt, tKrQt, 0, st_q.index, False)
            elif const_expr(order[i] == "dv"):
                self.gemm(tiled_mma_dv, acc_dV, tVrPt, tVrdOt, 0, st_do.index, False)
            else:
                self.gemm(tiled_mma_dq, acc_dQ, tQrdS, tQrKt, 0, 0, True)
        for i in cutlass.range_constexpr(3):
            warpgroup.wait_group(2 - i)
            if const_expr(order[i] == "dk"):
                pipe_q.consumer_release(st_q)
            elif const_expr(order[i] == "dv"):
                pipe_do.consumer_release(st_do)
            else:
                self.stage_dq(acc_dQ, tdQsdQ, dq_scale, tidx)

    def product_order(self) -> tuple[str, str, str]:
        """Issue order of the dK, dV, dQ products (unswapped): with single buffers free Q and dO before dQ
        so both next loads overlap it; with fewer dO buffers free dO first, so the dQ store overlaps dK;
        otherwise free Q first, so the dQ store overlaps dV."""
        if self.num_stages == 1:
            return ("dk", "dv", "dq")
        if self.do_stages < self.num_stages:
            return ("dv", "dq", "dk")
        return ("dk", "dq", "dv")

    @cute.jit
    def step_swapped(
        self,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
        tSrK: cute.Tensor,
        tSrQ: cute.Tensor,
        tPrV: cute.Tensor,
        tPrdO: cute.Tensor,
        tVrdOt: cute.Tensor,
        tKrQt: cute.Tensor,
        tQrdS: cute.Tensor,
        tQrKt: cute.Tensor,
        acc_S: cute.Tensor,
        acc_dP: cute.Tensor,
        acc_dK: cute.Tensor,
        acc_dV: cute.Tensor,
        acc_dQ: cute.Tensor,
        rPt: cute.Tensor,
        rdSt: cute.Tensor,
        tScS: cute.Tensor,
        thr_sdp: cute.TiledMma,
        sdS: cute.Tensor,
        tdQsdQ: cute.Tensor,
        pipe_q: pipeline.PipelineTmaAsync,
        pipe_do: pipeline.PipelineTmaAsync,
        st_q: pipeline.PipelineState,
        st_do: pipeline.PipelineState,
        blk: Int32,
        buf_base: Int32,
        blk_full: Int32,
        start_n: Int32,
        n: Int32,
        alpha: Float32,
        dq_scale: Float32,
        ctx: Int32,
        w: Int32,
        m_id: Int32,
        tidx: Int32,
    ):
        """One query block with ``swap_sdp``: S^T, dP^T; dV += P^T dO and dK += dS^T Q from registers;
        dS^T to buffer (blk - buf_base) % 2, then dQ. Two buffers: a warpgroup writes buffer b only after
        the barrier of the previous block, which the other passed after its dQ read of b had retired."""
        start_m = blk * self.tile_m
        masked = (blk < blk_full) | (start_m + self.tile_m > n)
        buf = (blk - buf_base) % 2
        pipe_q.consumer_wait(st_q)
        self.gemm(tiled_mma_sdp, acc_S, tSrK, tSrQ, 0, st_q.index, True)
        pipe_do.consumer_wait(st_do)
        self.gemm(tiled_mma_sdp, acc_dP, tPrV, tPrdO, 0, st_do.index, True)
        warpgroup.wait_group(1)
        self.activate(
            acc_S, cute.make_tensor(rPt.iterator, acc_S.layout), tScS, masked, start_m, start_n, n, alpha, ctx, w, m_id
        )
        self.gemm_rs(tiled_mma_dv, acc_dV, rPt, tVrdOt, st_do.index)
        warpgroup.wait_group(1)
        for i in cutlass.range_constexpr(cute.size(acc_dP)):
            acc_dP[i] = acc_dP[i] * acc_S[i]
        rdSt_acc = cute.make_tensor(rdSt.iterator, acc_S.layout)
        rdSt_acc.store(acc_dP.load().to(self.dtype))
        self.gemm_rs(tiled_mma_dk, acc_dK, rdSt, tKrQt, st_q.index)
        cute.autovec_copy(rdSt_acc, thr_sdp.partition_C(sdS[None, None, buf]))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        self.gemm(tiled_mma_dq, acc_dQ, tQrdS, tQrKt, buf, 0, True)
        warpgroup.wait_group(2)
        pipe_do.consumer_release(st_do)
        warpgroup.wait_group(1)
        pipe_q.consumer_release(st_q)
        warpgroup.wait_group(0)
        self.stage_dq(acc_dQ, tdQsdQ, dq_scale, tidx)

    @cute.jit
    def gemm_rs(self, tiled_mma: cute.TiledMma, acc: cute.Tensor, tA: cute.Tensor, tB: cute.Tensor, ib):
        """acc += A B[ib] with A in registers (16-bit, A-operand layout); commits one wgmma group."""
        warpgroup.fence()
        atom = cute.make_mma_atom(tiled_mma.op)
        atom.set(warpgroup.Field.ACCUMULATE, True)
        for kb in cutlass.range_constexpr(cute.size(tA, mode=[2])):
            cute.gemm(atom, acc, tA[None, None, kb], tB[None, None, kb, ib], acc)
        warpgroup.commit_group()

    @cute.jit
    def stage_dq(self, acc_dQ: cute.Tensor, tdQsdQ: cute.Tensor, dq_scale: Float32, tidx: Int32):
        """Scale the dQ partial by alpha/S and hand it to the dQ warp through shared memory (the whole
        tile at once, or this warpgroup's slice on its own barrier pair with ``dq_serial``)."""
        for i in cutlass.range_constexpr(cute.size(acc_dQ)):
            acc_dQ[i] = acc_dQ[i] * dq_scale
        if const_expr(self.dq_serial):
            wg_idx = cute.arch.make_warp_uniform(tidx // 128)
            cute.arch.barrier(barrier_id=BAR_DQ_EMPTY + 2 * wg_idx, number_of_threads=128 + 32)
            cute.autovec_copy(acc_dQ, tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL + 2 * wg_idx, number_of_threads=128 + 32)
        else:
            sync_dq = self.num_mma_threads + 32
            cute.arch.barrier(barrier_id=BAR_DQ_EMPTY, number_of_threads=sync_dq)
            cute.autovec_copy(acc_dQ, tdQsdQ)
            cute.arch.fence_view_async_shared()
            cute.arch.barrier_arrive(barrier_id=BAR_DQ_FULL, number_of_threads=sync_dq)

    @cute.jit
    def activate(
        self,
        acc_S: cute.Tensor,
        rP: cute.Tensor,
        tScS: cute.Tensor,
        masked: cutlass.Boolean,
        start_m: Int32,
        start_n: Int32,
        n: Int32,
        alpha: Float32,
        ctx: Int32,
        w: Int32,
        m_id: Int32,
    ):
        """rP = M silu(alpha S) in 16 bit; acc_S becomes M silu'(alpha S) (fp32) for dS = dP * silu'."""
        if masked:
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                r, c = tScS[i]
                if const_expr(self.swap):  # S^T: rows are keys, columns queries
                    r, c = c, r
                ok = self.valid(start_m + r, start_n + c, n, ctx, w, m_id)
                s = acc_S[i] * alpha
                sig = self.sigmoid(s)
                acc_S[i] = cutlass.select_(ok, sig * (Float32(1.0) + s * (Float32(1.0) - sig)), Float32(0.0))
                rP[i] = Float32(cutlass.select_(ok, s * sig, Float32(0.0))).to(self.dtype)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                s = acc_S[i] * alpha
                sig = self.sigmoid(s)
                acc_S[i] = sig * (Float32(1.0) + s * (Float32(1.0) - sig))
                rP[i] = (s * sig).to(self.dtype)

    @cute.jit
    def sigmoid(self, s: Float32) -> Float32:
        """1 / (1 + e^-s): by tanh.approx (one MUFU op) with ``tanh_silu``, else by ex2 and rcp."""
        sig = Float32(0.0)
        if const_expr(self.cfg.tanh_silu):
            sig = Float32(0.5) + Float32(0.5) * cute.math.tanh(s * Float32(0.5), approx=True)
        else:
            sig = cute.arch.rcp_approx(cute.math.exp2(s * Float32(-LOG2E), fastmath=True) + Float32(1.0))
        return sig

    @cute.jit
    def valid(self, row: Int32, col: Int32, n: Int32, ctx: Int32, w: Int32, m_id: Int32) -> cutlass.Boolean:
        """The HSTU mask M[row, col] (HSTU.md), false for rows or keys past the sequence end."""
        ok = (col < n) & (row < n)
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
    def epilogue(self, acc: cute.Tensor, tg: cute.Tensor, tc: cute.Tensor, n: Int32, start_n: Int32, scale: Float32):
        """Scale, convert, and store key rows < n straight from registers (no other sequence is touched)."""
        r = cute.make_rmem_tensor(acc.layout, self.dtype)
        r.store((acc.load() * scale).to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(r)):
            if start_n + tc[i][0] < n:
                tg[i] = r[i]
