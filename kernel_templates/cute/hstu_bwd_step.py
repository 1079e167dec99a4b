"""The per-query-block steps of the CuTe DSL HSTU backward (``hstu_bwd_sm90.HSTUBwdSm90``).

The MMA warpgroups' work on one query block of a key tile (the five products, the SiLU and its
derivative with the HSTU mask, the dQ hand-off to the dQ warp) and the dK/dV stores from registers, as
a mixin over the kernel object's tile shape and flags (``tile_m``, ``tile_n``, ``swap``, ``cfg``, ...).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import warpgroup

from .hstu_fwd_sm90 import HSTUFwdSm90

LOG2E = math.log2(math.e)
# Named barriers (0 is __syncthreads): P/dS tile handoff among MMA threads, dQ buffer full / empty
# (with dq_serial, warpgroup w uses BAR_DQ_FULL + 2w / BAR_DQ_EMPTY + 2w).
BAR_PDS, BAR_DQ_FULL, BAR_DQ_EMPTY = 1, 2, 3


class _Mmas(NamedTuple):
    """The tiled MMAs of the five products (S and dP share one)."""

    sdp: cute.TiledMma
    dk: cute.TiledMma
    dv: cute.TiledMma
    dq: cute.TiledMma


class _Frags(NamedTuple):
    """One MMA thread's operands (A/B of S, dP, dV, dK, dQ), accumulators, and register / smem tiles of
    P and dS, built once per CTA; with ``swap_sdp`` vA and kA are the register P^T and dS^T and rP, rdS,
    tPsP, tdSsdS are None."""

    sA: cute.Tensor
    sB: cute.Tensor
    pA: cute.Tensor
    pB: cute.Tensor
    vA: cute.Tensor
    vB: cute.Tensor
    kA: cute.Tensor
    kB: cute.Tensor
    qA: cute.Tensor
    qB: cute.Tensor
    acc_S: cute.Tensor
    acc_dP: cute.Tensor
    acc_dK: cute.Tensor
    acc_dV: cute.Tensor
    acc_dQ: cute.Tensor
    rP: object
    rdS: object
    tScS: cute.Tensor
    tPsP: object
    tdSsdS: object
    tdQsdQ: cute.Tensor
    thr_sdp: object
    sdS: cute.Tensor


class _Row(NamedTuple):
    """The key tile's scalars a query-block step needs: where its keys start, the sequence length, the
    first mask-free block, the mask's position ids and lengths, the scales, and the thread index."""

    start_n: Int32
    n: Int32
    blk_full: Int32
    m_id: Int32
    ctx: Int32
    w: Int32
    alpha: Float32
    dq_scale: Float32
    tidx: Int32


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
    def step(self, mm: _Mmas, f: _Frags, row: _Row, pipe_q, pipe_do, st_q, st_do, blk: Int32):
        """One query block (unswapped): S, dP; P and dS to shared memory; dK, dV, dQ products."""
        start_m = blk * self.tile_m
        masked = (blk < row.blk_full) | (start_m + self.tile_m > row.n)
        pipe_q.consumer_wait(st_q)
        self.gemm(mm.sdp, f.acc_S, f.sA, f.sB, st_q.index, 0, True)
        pipe_do.consumer_wait(st_do)
        self.gemm(mm.sdp, f.acc_dP, f.pA, f.pB, st_do.index, 0, True)
        warpgroup.wait_group(1)
        self.activate(f.acc_S, f.rP, f.tScS, masked, start_m, row)
        # Every warpgroup has finished the previous block's reads of sP / sdS.
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        cute.autovec_copy(f.rP, f.tPsP)
        warpgroup.wait_group(0)
        for i in cutlass.range_constexpr(cute.size(f.acc_dP)):
            f.acc_dP[i] = f.acc_dP[i] * f.acc_S[i]
        f.rdS.store(f.acc_dP.load().to(self.dtype))
        cute.autovec_copy(f.rdS, f.tdSsdS)
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        # Issue dK, dV and dQ in the order that frees the scarcer buffer first, then retire them in
        # that order: dK frees Q, dV frees dO, dQ goes to the dQ warp.
        order = self.product_order()
        for i in cutlass.range_constexpr(3):
            if const_expr(order[i] == "dk"):
                self.gemm(mm.dk, f.acc_dK, f.kA, f.kB, 0, st_q.index, False)
            elif const_expr(order[i] == "dv"):
                self.gemm(mm.dv, f.acc_dV, f.vA, f.vB, 0, st_do.index, False)
            else:
                self.gemm(mm.dq, f.acc_dQ, f.qA, f.qB, 0, 0, True)
        for i in cutlass.range_constexpr(3):
            warpgroup.wait_group(2 - i)
            if const_expr(order[i] == "dk"):
                pipe_q.consumer_release(st_q)
            elif const_expr(order[i] == "dv"):
                pipe_do.consumer_release(st_do)
            else:
                self.stage_dq(f.acc_dQ, f.tdQsdQ, row.dq_scale, row.tidx)

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
    def step_swapped(self, mm: _Mmas, f: _Frags, row: _Row, pipe_q, pipe_do, st_q, st_do, blk: Int32, buf_base: Int32):
        """One query block with ``swap_sdp``: S^T, dP^T; dV += P^T dO and dK += dS^T Q from registers;
        dS^T to buffer (blk - buf_base) % 2, then dQ. Two buffers: a warpgroup writes buffer b only after
        the barrier of the previous block, which the other passed after its dQ read of b had retired."""
        start_m = blk * self.tile_m
        masked = (blk < row.blk_full) | (start_m + self.tile_m > row.n)
        buf = (blk - buf_base) % 2
        pipe_q.consumer_wait(st_q)
        self.gemm(mm.sdp, f.acc_S, f.sA, f.sB, 0, st_q.index, True)
        pipe_do.consumer_wait(st_do)
        self.gemm(mm.sdp, f.acc_dP, f.pA, f.pB, 0, st_do.index, True)
        warpgroup.wait_group(1)
        self.activate(f.acc_S, cute.make_tensor(f.vA.iterator, f.acc_S.layout), f.tScS, masked, start_m, row)
        self.gemm_rs(mm.dv, f.acc_dV, f.vA, f.vB, st_do.index)
        warpgroup.wait_group(1)
        for i in cutlass.range_constexpr(cute.size(f.acc_dP)):
            f.acc_dP[i] = f.acc_dP[i] * f.acc_S[i]
        rdSt_acc = cute.make_tensor(f.kA.iterator, f.acc_S.layout)
        rdSt_acc.store(f.acc_dP.load().to(self.dtype))
        self.gemm_rs(mm.dk, f.acc_dK, f.kA, f.kB, st_q.index)
        cute.autovec_copy(rdSt_acc, f.thr_sdp.partition_C(f.sdS[None, None, buf]))
        cute.arch.fence_view_async_shared()
        cute.arch.barrier(barrier_id=BAR_PDS, number_of_threads=self.num_mma_threads)
        self.gemm(mm.dq, f.acc_dQ, f.qA, f.qB, buf, 0, True)
        warpgroup.wait_group(2)
        pipe_do.consumer_release(st_do)
        warpgroup.wait_group(1)
        pipe_q.consumer_release(st_q)
        warpgroup.wait_group(0)
        self.stage_dq(f.acc_dQ, f.tdQsdQ, row.dq_scale, row.tidx)

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
    def activate(self, acc_S: cute.Tensor, rP: cute.Tensor, tScS: cute.Tensor, masked, start_m: Int32, row: _Row):
        """rP = M silu(alpha S) in 16 bit; acc_S becomes M silu'(alpha S) (fp32) for dS = dP * silu'."""
        if masked:
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                r, c = tScS[i]
                if const_expr(self.swap):  # S^T: rows are keys, columns queries
                    r, c = c, r
                ok = self.valid(start_m + r, row.start_n + c, row.n, row.ctx, row.w, row.m_id)
                s = acc_S[i] * row.alpha
                sig = self.sigmoid(s)
                acc_S[i] = cutlass.select_(ok, sig * (Float32(1.0) + s * (Float32(1.0) - sig)), Float32(0.0))
                rP[i] = Float32(cutlass.select_(ok, s * sig, Float32(0.0))).to(self.dtype)
        else:
            for i in cutlass.range_constexpr(cute.size(acc_S)):
                s = acc_S[i] * row.alpha
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
        """The HSTU mask M[row, col] (HSTU.md, the forward's), also false for rows past the sequence end."""
        return HSTUFwdSm90.valid(self, row, col, n, ctx, w, m_id) & (row < n)

    @cute.jit
    def epilogue(self, acc: cute.Tensor, tg: cute.Tensor, tc: cute.Tensor, n: Int32, start_n: Int32, scale: Float32):
        """Scale, convert, and store key rows < n straight from registers (no other sequence is touched)."""
        r = cute.make_rmem_tensor(acc.layout, self.dtype)
        r.store((acc.load() * scale).to(self.dtype))
        for i in cutlass.range_constexpr(cute.size(r)):
            if start_n + tc[i][0] < n:
                tg[i] = r[i]
