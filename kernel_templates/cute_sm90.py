"""Hopper (sm90) building blocks shared by the CuTe DSL kernels: TMA loads and their mbarrier rings.

Plain Python helpers called while a kernel is traced (host side for the TMA atoms, device side for
the pipelines), so they add no code of their own to the PTX: each kernel states only what differs,
its tiles and stage counts.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import pipeline
from cutlass.cute.nvgpu import cpasync

FIRST_STAGE = (None, None, 0)


def tma_load(gmem: cute.Tensor, smem_layout, tile: tuple[int, int]):
    """(atom, TMA tensor) loading ``tile`` boxes of ``gmem`` into one stage of ``smem_layout``."""
    one = cute.slice_(smem_layout, FIRST_STAGE)
    return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), gmem, one, tile)


def stage_bytes(dtype: type[cutlass.Numeric], smem_layout) -> int:
    """Bytes one TMA load brings into one stage: the transaction count its mbarrier waits for."""
    return cute.size_in_bytes(dtype, cute.slice_(smem_layout, FIRST_STAGE))


def pipeline_groups(num_mma_threads: int, multicast: int = 1):
    """(producer, consumers): one TMA-issuing thread; every MMA warp of each CTA that reads a stage."""
    producer = pipeline.CooperativeGroup(pipeline.Agent.Thread, 1)
    consumers = pipeline.CooperativeGroup(pipeline.Agent.Thread, multicast * (num_mma_threads // 32))
    return producer, consumers


def tma_pipeline(barriers, num_stages: int, groups, tx_count: int, **kwargs) -> pipeline.PipelineTmaAsync:
    """A ``num_stages`` ring of TMA-filled buffers; the sync is deferred to one ``pipeline_init_arrive``
    after all rings of the kernel are set up."""
    producer, consumers = groups
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=num_stages,
        producer_group=producer,
        consumer_group=consumers,
        tx_count=tx_count,
        defer_sync=True,
        **kwargs,
    )
