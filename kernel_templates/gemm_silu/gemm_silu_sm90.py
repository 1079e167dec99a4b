"""CuTe DSL template: ``y = silu(x @ W^T + b)`` for Hopper (sm90), TMA + wgmma, warp-specialised.

One CTA per (tile_m x tile_n) output tile, or (``persistent``) one CTA per SM walking tiles with a
stride of the grid: the producer then loads the next tile's first k-tiles while the consumers run the
epilogue, and the epilogue's TMA stores drain to global memory under the next tile's main loop. A
persistent cluster of two CTAs walks pairs of tiles (adjacent along M or N) in step, so each x or W
k-tile the pair shares is read from L2 once and multicast.
Warpgroup 0 is the producer: one warp issues TMA loads
(cp.async.bulk.tensor, multicast across the cluster when cluster_m/cluster_n > 1) of the x and W
k-tiles into a ``num_stages`` shared-memory ring guarded by mbarriers. The other warpgroups are the
consumers: they run wgmma on the ring into an fp32 accumulator (one wgmma group in flight, the
previous stage released as soon as its group retires), then the epilogue adds the bias (staged once
per tile in shared memory as fp32) and applies SiLU in fp32 on the accumulator fragment, converts to
the input dtype, writes (tile_m x 32) sub-tiles to shared memory with stmatrix and drains them to
global memory with TMA stores (double-buffered). With ``pingpong`` the two MMA warpgroups each own
a whole tile (alternate tiles of the CTA's walk) and take turns on the tensor cores through a pair of
named barriers: one warpgroup's epilogue runs under the other's main loop. With ``has_pre`` the epilogue also stores the
pre-activation ``x @ W^T + b`` (a second output, so a training step keeps it for SiLU's backward without
a separate SiLU pass over it).

Ragged shapes: M (jagged token count) is dynamic and needs no tile multiple: TMA loads zero-fill rows
past M and TMA stores clip them; the same holds for N and K tails (multiples of 8 for 16-byte rows).
"""

from __future__ import annotations

import math

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warp, warpgroup
from cutlass.tensor_utils import LayoutEnum

from kernel_templates.cute_sm90 import pipeline_groups, tma_pipeline

from .config import EPI_N, EPI_STAGES, REGS, GemmSiluConfig

LOG2E = math.log2(math.e)
EPI_BARRIER = 1  # named barrier id of the MMA warpgroups (0 is __syncthreads); pingpong: 1 and 2
MMA_ORDER_BARRIER = 3  # pingpong: warpgroup w waits on MMA_ORDER_BARRIER + w for its turn (3 and 4)


class GemmSiluSm90:
    """Builds and launches the kernel for one (config, dtype, bias or not); N and K are static."""

    def __init__(
        self, config: GemmSiluConfig, dtype: type[cutlass.Numeric], has_bias: bool, has_pre: bool = False
    ) -> None:
        self.cfg = config
        self.dtype = dtype
        self.has_bias = has_bias
        self.has_pre = has_pre
        self.persistent = config.persistent
        self.pingpong = config.pingpong
        self.tiles_in_flight = config.tiles_in_flight
        self.tile_m, self.tile_n, self.tile_k = config.tile_m, config.tile_n, config.tile_k
        self.cluster_mn = (config.cluster_m, config.cluster_n)
        self.num_stages = config.num_stages
        self.num_wg = config.mma_warpgroups
        self.num_mma_threads = 128 * self.num_wg
        # The threads that compute one tile: every MMA warpgroup, or one with pingpong.
        self.tile_threads = self.num_mma_threads // self.tiles_in_flight
        self.num_threads = 128 * (self.num_wg + 1)
        self.mma_regs, self.producer_regs = REGS[self.num_wg]
        self.epi_tile = (self.tile_m, EPI_N)
        self.raster_n = config.raster == "n"

    # ------------------------------------------------------------------ host side (tracing)
    @cute.jit
    def __call__(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mBias: cute.Tensor,
        mC: cute.Tensor,
        mPre: cute.Tensor,
        max_ctas: Int32,
        stream: cuda.CUstream,
    ):
        """mPre: the pre-activation output (read only with ``has_pre``); max_ctas: the persistent grid
        (the SM count), ignored otherwise."""
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.dtype,
            self.dtype,
            warpgroup.OperandMajorMode.K,
            warpgroup.OperandMajorMode.K,
            Float32,
            (self.num_wg // self.tiles_in_flight, 1, 1),
            (64, self.tile_n),
        )
        sA_layout = sm90_utils.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, self.dtype, self.num_stages)
        sB_layout = sm90_utils.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, self.dtype, self.num_stages)
        sC_layout = sm90_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, EPI_STAGES * self.tiles_in_flight
        )
        cm, cn = self.cluster_mn
        # x tiles are shared by the cluster_n CTAs of a cluster row, W tiles by the cluster_m CTAs of a column.
        op_a = cpasync.CopyBulkTensorTileG2SMulticastOp() if cn > 1 else cpasync.CopyBulkTensorTileG2SOp()
        op_b = cpasync.CopyBulkTensorTileG2SMulticastOp() if cm > 1 else cpasync.CopyBulkTensorTileG2SOp()
        sA_one = cute.slice_(sA_layout, (None, None, 0))
        sB_one = cute.slice_(sB_layout, (None, None, 0))
        tma_atom_a, tma_a = cpasync.make_tiled_tma_atom(op_a, mA, sA_one, (self.tile_m, self.tile_k), num_multicast=cn)
        tma_atom_b, tma_b = cpasync.make_tiled_tma_atom(op_b, mB, sB_one, (self.tile_n, self.tile_k), num_multicast=cm)
        sC_one = cute.slice_(sC_layout, (None, None, 0))
        tma_atom_c, tma_c = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mC, sC_one, self.epi_tile)
        tma_atom_p, tma_p = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mPre, sC_one, self.epi_tile)
        self.tx_bytes = cute.size_in_bytes(self.dtype, sA_one) + cute.size_in_bytes(self.dtype, sB_one)
        self.k_tiles = (cute.size(mA, mode=[1]) + self.tile_k - 1) // self.tile_k  # K is static

        @cute.struct
        class SharedStorage:
            mbar: cute.struct.MemRange[cutlass.Int64, self.num_stages * 2]
            sBias: cute.struct.Align[cute.struct.MemRange[Float32, self.tile_n * self.tiles_in_flight], 16]
            sA: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sB_layout)], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sC_layout)], 1024]

        self.shared_storage = SharedStorage
        m = cute.size(mA, mode=[0])
        n = cute.size(mB, mode=[0])
        tiles_m = (m + self.tile_m - 1) // self.tile_m
        tiles_n = (n + self.tile_n - 1) // self.tile_n
        # Whole clusters: CTAs past M or N only load zeros (TMA fill) and store nothing (TMA clip).
        grid_m = (tiles_m + cm - 1) // cm * cm
        grid_n = (tiles_n + cn - 1) // cn * cn
        if const_expr(self.persistent):
            # One cluster per cm x cn SMs (pairs sit on a TPC), each walking whole cluster tiles.
            clusters = cutlass.min(cutlass.max(max_ctas // (cm * cn), 1), (grid_m // cm) * (grid_n // cn))
            grid_m = clusters * cm
            grid_n = cn
        self.kernel(
            tma_atom_a,
            tma_a,
            tma_atom_b,
            tma_b,
            tma_atom_c,
            tma_c,
            tma_atom_p,
            tma_p,
            mBias,
            tiled_mma,
            cute.make_layout((cm, cn, 1)),
            sA_layout,
            sB_layout,
            sC_layout,
        ).launch(
            grid=[grid_m, grid_n, 1],
            block=[self.num_threads, 1, 1],
            cluster=[cm, cn, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_atom_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC: cute.Tensor,
        tma_atom_p: cute.CopyAtom,
        mP: cute.Tensor,
        mBias: cute.Tensor,
        tiled_mma: cute.TiledMma,
        cta_layout_mnk: cute.Layout,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        tidx, _, _ = cute.arch.thread_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_c)
            if const_expr(self.has_pre):
                cpasync.prefetch_descriptor(tma_atom_p)
        cta_rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cta_layout_mnk.get_flat_coord(cta_rank)

        storage = cutlass.utils.SmemAllocator().allocate(self.shared_storage)
        cm, cn = self.cluster_mn
        # Each consumer warp releases a stage to every CTA that multicast into it (its row and column).
        mcast_size = cm + cn - 1
        groups = pipeline_groups(self.tile_threads, mcast_size)  # a stage is read by one tile's warpgroups
        pipe = tma_pipeline(
            storage.mbar,
            self.num_stages,
            groups,
            self.tx_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cta_layout_mnk.shape)),
        )
        pipeline.pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        sBias = storage.sBias.get_tensor(cute.make_layout(self.tile_n * self.tiles_in_flight))
        m, n = cute.size(mA, mode=[0]), cute.size(mB, mode=[0])
        tiles_m = (m + self.tile_m - 1) // self.tile_m
        tiles_n = (n + self.tile_n - 1) // self.tile_n
        # The tiles this CTA runs: [first, end) with a stride of the grid when persistent, else its own.
        # Persistent indices count cluster tiles (cm x cn output tiles); every CTA of a cluster walks the
        # same ones, so their rings stay in step for the multicast loads.
        first, end, step = Int32(0), Int32(1), Int32(1)
        if const_expr(self.persistent):
            bid_x, _, _ = cute.arch.block_idx()
            grid_x, _, _ = cute.arch.grid_dim()
            clusters_m, clusters_n = (tiles_m + cm - 1) // cm, (tiles_n + cn - 1) // cn
            first, end, step = Int32(bid_x // cm), clusters_m * clusters_n, Int32(grid_x // cm)

        pipeline.pipeline_init_wait(cluster_shape_mn=self.cluster_mn)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
                t = first
                while t < end:
                    pid_m, pid_n = self.tile_coords(tiles_m, tiles_n, t, cluster_coord)
                    gA = cute.local_tile(mA, (self.tile_m, self.tile_k), (pid_m, None))
                    gB = cute.local_tile(mB, (self.tile_n, self.tile_k), (pid_n, None))
                    state = self.load(
                        tma_atom_a, tma_atom_b, gA, gB, sA, sB, pipe, state, cta_layout_mnk, cluster_coord
                    )
                    t += step
                # Stay resident until every consumer (local and remote) released every stage.
                pipe.producer_tail(state)
        else:
            cute.arch.setmaxregister_increase(self.mma_regs)
            mma_tidx = tidx - 128
            # slot: which of the tiles in flight this thread computes (its warpgroup with pingpong, else 0);
            # tile_tidx: its index among that tile's threads.
            slot = cute.arch.make_warp_uniform(mma_tidx // self.tile_threads)
            tile_tidx = mma_tidx % self.tile_threads
            # Tiles i = slot, slot + 2, ... of the CTA's walk; their k-tiles sit at ring positions
            # i * k_tiles on, so a pingpong warpgroup starts k_tiles in and skips the other's k-tiles.
            skip = slot * self.k_tiles
            read = pipeline.PipelineState(self.num_stages, skip, skip % self.num_stages, (skip // self.num_stages) % 2)
            if const_expr(self.pingpong):  # noqa: SIM102 (compile-time test around a staged one)
                if slot == 0:  # the first turn on the tensor cores is warpgroup 0's
                    cute.arch.barrier_arrive(barrier_id=MMA_ORDER_BARRIER, number_of_threads=256)
            t = first + slot * step
            while t < end:
                pid_m, pid_n = self.tile_coords(tiles_m, tiles_n, t, cluster_coord)
                gC = cute.local_tile(mC, (self.tile_m, self.tile_n), (pid_m, pid_n))
                gP = cute.local_tile(mP, (self.tile_m, self.tile_n), (pid_m, pid_n))
                self.stage_bias(mBias, sBias, pid_n, n, tile_tidx, slot)
                acc, read = self.mainloop(tiled_mma, sA, sB, pipe, read, tile_tidx, slot)
                if const_expr(self.pingpong):
                    read.advance(self.k_tiles)
                self.epilogue(
                    tiled_mma, acc, sBias, sC, gC, gP, tma_atom_c, tma_atom_p, tile_tidx, slot, tile_tidx < 32
                )
                t += step * self.tiles_in_flight

    @cute.jit
    def tile_coords(self, tiles_m: Int32, tiles_n: Int32, t: Int32, cluster_coord: tuple):
        """(pid_m, pid_n) of cluster tile ``t`` (persistent) or of this CTA; the raster order ("n": N
        tiles fastest) walks clusters, on a grid or in the persistent order."""
        cm, cn = self.cluster_mn
        pid_m, pid_n = t, t
        if const_expr(self.persistent):
            clusters_m, clusters_n = (tiles_m + cm - 1) // cm, (tiles_n + cn - 1) // cn
            if const_expr(self.raster_n):
                pid_m, pid_n = t // clusters_n, t % clusters_n
            else:
                pid_m, pid_n = t % clusters_m, t // clusters_m
            pid_m, pid_n = pid_m * cm + cluster_coord[0], pid_n * cn + cluster_coord[1]
        else:
            bidx, bidy, _ = cute.arch.block_idx()
            pid_m, pid_n = Int32(bidx), Int32(bidy)
            if const_expr(self.raster_n):
                clusters_m = (tiles_m + cm - 1) // cm
                clusters_n = (tiles_n + cn - 1) // cn
                linear = bidx // cm + clusters_m * (bidy // cn)
                pid_m = (linear // clusters_n) * cm + bidx % cm
                pid_n = (linear % clusters_n) * cn + bidy % cn
        return pid_m, pid_n

    @cute.jit
    def load(
        self,
        tma_atom_a: cute.CopyAtom,
        tma_atom_b: cute.CopyAtom,
        gA: cute.Tensor,
        gB: cute.Tensor,
        sA: cute.Tensor,
        sB: cute.Tensor,
        pipe: pipeline.PipelineTmaAsync,
        state: pipeline.PipelineState,
        cta_layout_mnk: cute.Layout,
        cluster_coord: tuple,
    ):
        """Producer warp: TMA (multicast) loads of one tile's x and W k-tiles into the stage ring;
        returns the advanced ring state."""
        cm, cn = self.cluster_mn
        a_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (0, None, 0)).shape)
        b_cta_layout = cute.make_layout(cute.slice_(cta_layout_mnk, (None, 0, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, cluster_coord[1], a_cta_layout, cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
        )
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, cluster_coord[0], b_cta_layout, cute.group_modes(sB, 0, 2), cute.group_modes(gB, 0, 2)
        )
        for kt in cutlass.range(self.k_tiles, unroll=1):
            pipe.producer_acquire(state)
            bar = pipe.producer_get_barrier(state)
            if const_expr(cn > 1):
                mask_a = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=1)
                cute.copy(tma_atom_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar, mcast_mask=mask_a)
            else:
                cute.copy(tma_atom_a, tAgA[None, kt], tAsA[None, state.index], tma_bar_ptr=bar)
            if const_expr(cm > 1):
                mask_b = cute.make_layout_image_mask(cta_layout_mnk, cluster_coord, mode=0)
                cute.copy(tma_atom_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar, mcast_mask=mask_b)
            else:
                cute.copy(tma_atom_b, tBgB[None, kt], tBsB[None, state.index], tma_bar_ptr=bar)
            pipe.producer_commit(state)
            state.advance()
        return state

    @cute.jit
    def stage_bias(self, mBias: cute.Tensor, sBias: cute.Tensor, pid_n: Int32, n: Int32, tile_tidx: Int32, slot: Int32):
        """bias[n0 : n0 + tile_n] as fp32 in the slot's shared-memory row (zeros past N or without bias)."""
        n0 = pid_n * self.tile_n
        for i in cutlass.range_constexpr((self.tile_n + self.tile_threads - 1) // self.tile_threads):
            j = tile_tidx + i * self.tile_threads
            if j < self.tile_n:
                v = Float32(0.0)
                if const_expr(self.has_bias):  # noqa: SIM102 (compile-time test around a staged one)
                    if n0 + j < n:
                        v = mBias[n0 + j].to(Float32)
                sBias[slot * self.tile_n + j] = v

    @cute.jit
    def mainloop(
        self,
        tiled_mma: cute.TiledMma,
        sA: cute.Tensor,
        sB: cute.Tensor,
        pipe: pipeline.PipelineTmaAsync,
        read: pipeline.PipelineState,
        tile_tidx: Int32,
        slot: Int32,
    ):
        """(acc, ring state): acc = x_tile @ W_tile^T over all k-tiles; one wgmma group in flight, each
        stage released as soon as the group that read it retired. With pingpong the warpgroup waits for
        its turn first and hands the turn over once its last k-tile's wgmma is issued."""
        wg_idx = cute.arch.make_warp_uniform(tile_tidx // 128)
        wg_mma = tiled_mma.get_slice(wg_idx * 128)
        tCrA = tiled_mma.make_fragment_A(wg_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(wg_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(wg_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        # Zero-filled once, ACCUMULATE always on: field updates inside staged loops are not threaded out.
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        num_kb = cute.size(tCrA, mode=[2])
        release = read.clone()
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=MMA_ORDER_BARRIER + slot, number_of_threads=256)
        pipe.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(num_kb):
            cute.gemm(tiled_mma, acc, tCrA[None, None, kb, read.index], tCrB[None, None, kb, read.index], acc)
        warpgroup.commit_group()
        read.advance()
        for _kt in cutlass.range(1, self.k_tiles, unroll=1):
            pipe.consumer_wait(read)
            warpgroup.fence()
            for kb in cutlass.range_constexpr(num_kb):
                cute.gemm(tiled_mma, acc, tCrA[None, None, kb, read.index], tCrB[None, None, kb, read.index], acc)
            warpgroup.commit_group()
            # The previous k-tile's group has retired: its stage can be refilled.
            warpgroup.wait_group(1)
            pipe.consumer_release(release)
            release.advance()
            read.advance()
        if const_expr(self.pingpong):
            cute.arch.barrier_arrive(barrier_id=MMA_ORDER_BARRIER + 1 - slot, number_of_threads=256)
        warpgroup.wait_group(0)
        pipe.consumer_release(release)
        return acc, read

    @cute.jit
    def epilogue(
        self,
        tiled_mma: cute.TiledMma,
        acc: cute.Tensor,
        sBias: cute.Tensor,
        sC: cute.Tensor,
        gC: cute.Tensor,
        gP: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        tma_atom_p: cute.CopyAtom,
        tile_tidx: Int32,
        slot: Int32,
        is_store_warp: cutlass.Boolean,
    ):
        """acc + bias (stored as the pre-activation with ``has_pre``), SiLU in fp32, convert, stmatrix to
        smem, TMA-store (tile_m x 32) sub-tiles through the double-buffered smem ring."""
        epi_bar = EPI_BARRIER + slot  # the slot's own barrier (slot is 0 without pingpong)
        cute.arch.barrier(barrier_id=epi_bar, number_of_threads=self.tile_threads)  # sBias is staged
        thr_mma = tiled_mma.get_slice(tile_tidx)
        tCcC = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            acc[i] = acc[i] + sBias[slot * self.tile_n + tCcC[i][1]]

        copy_atom_r2s = sm90_utils.sm90_get_smem_store_op(
            LayoutEnum.ROW_MAJOR, elem_ty_d=self.dtype, elem_ty_acc=Float32
        )
        copy_atom_c = cute.make_copy_atom(warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        tiled_copy_r2s = cute.make_tiled_copy_S(copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma))
        thr_copy_r2s = tiled_copy_r2s.get_slice(tile_tidx)
        tRS_sD = thr_copy_r2s.partition_D(sC)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        rD_layout = cute.make_layout(cute.shape(thr_copy_r2s.partition_S(sC))[:3])
        tRS_rD = cute.make_rmem_tensor_like(rD_layout, Float32)
        size_rD = cute.size(tRS_rD)

        gC_epi = cute.zipped_divide(gC, self.epi_tile)
        gP_epi = cute.zipped_divide(gP, self.epi_tile)
        bSG_sD, bSG_gD = cpasync.tma_partition(tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gC_epi)
        _, bSG_gP = cpasync.tma_partition(tma_atom_p, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), gP_epi)
        epi_shape = gC_epi.shape[1]
        epi_order = cute.make_layout(epi_shape, stride=(epi_shape[1], 1))
        store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=EPI_STAGES,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.tile_threads),
        )
        outputs = 2 if const_expr(self.has_pre) else 1
        for e in cutlass.range_constexpr(cute.size(gC_epi, mode=[1])):
            for v in cutlass.range_constexpr(size_rD):
                tRS_rD[v] = tRS_rAcc[e * size_rD + v]
            for o in cutlass.range_constexpr(outputs):
                if const_expr(o == outputs - 1):
                    for v in cutlass.range_constexpr(size_rD):
                        # silu(v) = v sigmoid(v) = h + h tanh(h), h = v / 2: one MUFU op (tanh.approx).
                        h = tRS_rD[v] * Float32(0.5)
                        tRS_rD[v] = h + h * cute.math.tanh(h, fastmath=True)
                rOut = cute.make_rmem_tensor_like(rD_layout, self.dtype)
                rOut.store(tRS_rD.load().to(self.dtype))
                buf = slot * EPI_STAGES + (e * outputs + o) % EPI_STAGES
                cute.copy(tiled_copy_r2s, rOut, tRS_sD[None, None, None, buf])
                # Make the generic-proxy smem writes visible to the TMA (async proxy), then one warp stores.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=epi_bar, number_of_threads=self.tile_threads)
                if is_store_warp:
                    dst = bSG_gD if const_expr(o == outputs - 1) else bSG_gP
                    atom = tma_atom_c if const_expr(o == outputs - 1) else tma_atom_p
                    cute.copy(atom, bSG_sD[None, buf], dst[None, epi_order.get_hier_coord(e)])
                    store_pipe.producer_commit()
                    store_pipe.producer_acquire()
                cute.arch.barrier(barrier_id=epi_bar, number_of_threads=self.tile_threads)
        if is_store_warp:
            # The smem ring is free for the next tile once the TMA has read it; the global writes drain
            # on their own (under the next tile's main loop when persistent).
            store_pipe.producer_tail()
        if const_expr(self.persistent and (cute.size(gC_epi, mode=[1]) * outputs) % EPI_STAGES != 0):
            # An odd store count per tile: the next tile's first sub-tile goes to the buffer this tile's
            # last store may still be reading, so every thread waits for the store warp's tail.
            cute.arch.barrier(barrier_id=epi_bar, number_of_threads=self.tile_threads)
