"""Search spaces, feasibility pruning, GPU registry, buckets and length distributions (no kernels run)."""

from __future__ import annotations

import itertools
import json

import pytest

from autotune.runtime.buckets import BUCKETS, bucket_for, neighbours, parse_bucket, sequence_lengths
from autotune.runtime.gpus import GPUS, get_gpu, gpu_from_name
from kernel_templates.hstu_attention.config import HSTUBwdConfig, HSTUFwdConfig
from search_spaces.base import SearchSpace, SpaceContext
from search_spaces.hstu_triton import HSTU_BWD_TRITON, HSTU_FWD_TRITON, fwd_smem_bytes


def ctx(gpu="h100", d=256, max_len=4096, interpret=False, dtype="bfloat16"):
    return SpaceContext(GPUS[gpu], dtype, d, d, max_len, interpret)


def test_full_space_is_the_product_of_choices():
    for space in (HSTU_FWD_TRITON, HSTU_BWD_TRITON):
        expected = 1
        for choices in space.params.values():
            expected *= len(choices)
        full = space.full()
        assert len(full) == expected
        assert len(set(full)) == expected  # frozen, hashable, distinct


def test_prune_removes_configs_over_shared_memory_and_keeps_feasible_ones():
    c = ctx("h100", 256)
    feasible = HSTU_FWD_TRITON.prune(c)
    assert 0 < len(feasible) < len(HSTU_FWD_TRITON.full())
    assert all(fwd_smem_bytes(cfg, c) <= GPUS["h100"].smem_per_block for cfg in feasible)
    big = HSTUFwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=2)  # ~360 KB at d256
    assert "shared memory" in HSTU_FWD_TRITON.why_infeasible(big, c)
    # A100 has less shared memory than H100: its feasible set is strictly smaller.
    assert len(HSTU_FWD_TRITON.prune(ctx("a100", 256))) < len(feasible)


def test_register_and_length_rules():
    c = ctx("h100", 256, max_len=4096)
    too_many_regs = HSTUFwdConfig(block_m=256, block_n=64, num_warps=4, num_stages=1)
    assert "registers" in HSTU_FWD_TRITON.why_infeasible(too_many_regs, c)
    short = ctx("h100", 64, max_len=40)
    assert "longest sequence" in HSTU_FWD_TRITON.why_infeasible(HSTUFwdConfig(128, 64, 8, 2), short)
    atomic_with_dq_block = HSTUBwdConfig(64, 64, 8, 2, "atomic", 32)
    assert "dq_block_m" in HSTU_BWD_TRITON.why_infeasible(atomic_with_dq_block, c)
    assert "dq_block_n" in HSTU_BWD_TRITON.why_infeasible(HSTUBwdConfig(64, 64, 8, 2, "tma", dq_block_n=32), c)
    assert "spelled 0" in HSTU_BWD_TRITON.why_infeasible(HSTUBwdConfig(64, 64, 8, 2, "separate", dq_block_n=64), c)
    tiny_dq = HSTUBwdConfig(64, 64, 8, 2, "separate", 16, dq_block_n=16)
    assert "dQ tile 16x16" in HSTU_BWD_TRITON.why_infeasible(tiny_dq, c)


@pytest.mark.parametrize("gpu", ["h100", "h200", "b200"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_heuristic_defaults_are_feasible_on_hopper_and_blackwell(gpu, d):
    for space in (HSTU_FWD_TRITON, HSTU_BWD_TRITON):
        c = ctx(gpu, d)
        assert space.why_infeasible(space.default(c), c) is None


def test_interpreter_space_is_small_and_unsupported_head_dims_prune_everything():
    c = ctx("h100", 32, max_len=64, interpret=True, dtype="float32")
    assert 1 <= len(HSTU_FWD_TRITON.prune(c)) <= 16
    assert HSTU_FWD_TRITON.prune(ctx("h100", 48)) == []


def test_space_hash_is_stable_and_tracks_the_declaration():
    assert HSTU_FWD_TRITON.hash() == HSTU_FWD_TRITON.hash()
    assert HSTU_FWD_TRITON.hash() != HSTU_BWD_TRITON.hash()
    narrower = SearchSpace(
        HSTU_FWD_TRITON.name,
        HSTUFwdConfig,
        {**HSTU_FWD_TRITON.params, "num_stages": (1, 2)},
        HSTU_FWD_TRITON.rules,
        HSTU_FWD_TRITON.default,
    )
    assert narrower.hash() != HSTU_FWD_TRITON.hash()


def test_gpu_registry():
    assert {"h100", "h200"} <= set(GPUS)
    h100 = get_gpu("H100")
    assert h100.compute_capability == (9, 0) and h100.sm_count == 132 and h100.peak_bf16_tflops == 989.0
    assert gpu_from_name("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_from_name("NVIDIA H200") == "h200"
    assert gpu_from_name("NVIDIA GeForce RTX 4090") is None
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("x100")


def test_buckets_contract():
    assert BUCKETS[0] == 256 and BUCKETS[-1] == 32768
    assert bucket_for(1) == 256 and bucket_for(256) == 256 and bucket_for(257) == 512
    assert bucket_for(4096) == 4096 and bucket_for(10**6) == 32768 and bucket_for(0) == 256
    for bad in (float("nan"), -5, 2.5, True, "512"):  # NaN was the largest bucket, -5 the smallest
        with pytest.raises(ValueError, match="max_seq_len"):
            bucket_for(bad)
    assert parse_bucket("4K") == 4096 and parse_bucket("512") == 512
    with pytest.raises(ValueError):
        parse_bucket("3K")
    assert neighbours(256) == (512,) and neighbours(4096) == (2048, 8192)


def test_length_distributions_are_deterministic_and_shaped():
    assert sequence_lengths(1024, 8, "uniform", 0) == [1024] * 8
    a = sequence_lengths(4096, 32, "jagged", 0)
    assert a == sequence_lengths(4096, 32, "jagged", 0)
    assert a != sequence_lengths(4096, 32, "jagged", 1)
    assert max(a) == 4096 and min(a) >= 1
    assert sum(a) / len(a) < 0.5 * 4096  # heavy-tailed: most sequences are short
    for n, b in itertools.product((1, 64), (1, 5)):
        assert max(sequence_lengths(n, b, "jagged", 3)) == n


def test_triton_bwd_space_admits_the_measured_best_d256_split_config():
    """32x128 w8 s2 separate with dkv_split compiled and ran at D=256 on an H100 (178 TFLOP/s at 4K,
    docs/runs/triton_dkv_split_sweep_h100_s4.log): the shared-memory model must not reject it."""
    from autotune.runtime.gpus import get_gpu
    from kernel_templates.hstu_attention import HSTUBwdConfig, default_bwd_config
    from search_spaces.base import SpaceContext
    from search_spaces.hstu_triton import HSTU_BWD_TRITON

    ctx = SpaceContext(get_gpu("h100"), "bfloat16", 256, 256, 4096)
    cfg = HSTUBwdConfig(32, 128, 8, 2, "separate", 0, dkv_split=True)
    assert HSTU_BWD_TRITON.why_infeasible(cfg, ctx) is None
    # ... while the 3-stage one (296 KB per ptxas) stays out.
    assert "shared memory" in HSTU_BWD_TRITON.why_infeasible(
        HSTUBwdConfig(32, 128, 8, 3, "separate", 0, dkv_split=True), ctx
    )
    # 3 stages fit once the dQ kernel has its own 128x32 tiles (268 TFLOP/s,
    # docs/runs/triton_bwd_sweep2_h100_s5.log): the d256 default, so the model must admit it without
    # the P^T tile that the key-block kernel keeps in registers.
    best = HSTUBwdConfig(32, 128, 8, 3, "separate", 128, dkv_split=True, dq_block_n=32)
    assert HSTU_BWD_TRITON.why_infeasible(best, ctx) is None
    assert best == default_bwd_config(256, 256)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_heuristic_defaults_fit_the_gpu_in_every_dtype(d, dtype):
    """What dispatch runs without artifacts must pass the space's own resource model: fp32 needs twice
    the shared memory of half types, so its defaults are smaller at head dims 128 and 256."""
    from autotune.runtime import dispatch
    from kernel_templates.hstu_attention.config import default_bwd_config, default_fwd_config

    ctx = SpaceContext(get_gpu("h100"), dtype, d, d, 4096)
    for kind, space, fn in (
        ("hstu_attention_fwd", HSTU_FWD_TRITON, default_fwd_config),
        ("hstu_attention_bwd", HSTU_BWD_TRITON, default_bwd_config),
    ):
        config = fn(d, d, False, dtype)
        assert config == space.default(ctx)
        assert space.why_infeasible(config, ctx) is None
        # dispatch hands the call's dtype to the same heuristic
        expected = fn(d, d, dispatch._interpreting(), dtype).to_dict()
        assert json.loads(dispatch.default_choice(kind, d, d, dtype).config) == expected
