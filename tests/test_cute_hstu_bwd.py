"""CuTe DSL HSTU backward (sm90): compiles on CPU (CUTE_DSL_ARCH=sm_90a) and matches the reference on GPU.

CPU: a small grid of configs compiles from fake tensors; the PTX must hold wgmma, TMA loads and the
TMA reduce-add of dQ (cp.reduce.async.bulk.tensor) so a slow fallback cannot slip in; bad configs and
bad inputs fail with ValueError before compiling. GPU: dq/dk/dv against the fp32 reference on jagged
batches with empty, length-1 and non-tile-multiple sequences, every mask option, bf16 and fp16,
D = 128 and 256, with the project's tolerance rule (2x PyTorch-in-dtype error + atol).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cute_gpu_cases import LENGTHS, MASKS, every_mask_and_dtype  # noqa: E402

from kernel_templates.cute import (  # noqa: E402
    BwdKey,
    HSTUCuteBwdConfig,
    check_bwd_config,
    compile_bwd,
    default_cute_bwd_config,
    hstu_attention_cute_bwd,
)
from kernel_templates.cute.bwd_op import _CACHE  # noqa: E402

# (config, head dim, dtype, (context, targets, window)): the CPU compile grid (~2-3 s per compile).
COMPILE_GRID = [
    (HSTUCuteBwdConfig(64, 64, 1), 256, "bfloat16", (False, False, False)),
    (HSTUCuteBwdConfig(64, 128, 2), 128, "float16", (True, True, True)),
    (HSTUCuteBwdConfig(128, 64, 1), 128, "bfloat16", (False, True, False)),
    (HSTUCuteBwdConfig(64, 128, 2), 64, "bfloat16", (True, False, True)),
    (HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True), 256, "bfloat16", (False, False, False)),
    (HSTUCuteBwdConfig(128, 64, 2, do_stages=2, dq_serial=True), 128, "float16", (True, True, False)),
    (HSTUCuteBwdConfig(64, 128, 2, l2_group=0, compact=True), 128, "bfloat16", (False, True, True)),
    (HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True), 128, "bfloat16", (True, True, True)),
    (HSTUCuteBwdConfig(64, 128, 1, dq_serial=True, swap_sdp=True), 64, "float16", (False, False, False)),
    (HSTUCuteBwdConfig(64, 64, 1, tanh_silu=True), 256, "bfloat16", (True, True, True)),
    (
        HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True, compact=True, persistent=True),
        256,
        "bfloat16",
        (True,) * 3,
    ),
    (HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True, compact=True, persistent=True), 128, "float16", (False,) * 3),
]


def _cfg_id(c: HSTUCuteBwdConfig) -> str:
    serial = "serial" if c.dq_serial else ""
    flags = ("c" if c.compact else "") + ("t" if c.swap_sdp else "") + ("h" if c.tanh_silu else "")
    flags += "p" if c.persistent else ""
    return f"{c.block_m}x{c.block_n}s{c.num_stages}do{c.do_stages}{serial}g{c.l2_group}{flags}"


@pytest.mark.parametrize("case", COMPILE_GRID, ids=lambda c: f"{_cfg_id(c[0])}-d{c[1]}")
def test_compiles_with_tma_and_wgmma(case):
    cfg, d, dtype, flags = case
    compiled = compile_bwd(BwdKey(cfg, dtype, d, d, *flags), keep_ptx=True)
    ptx = compiled.ptx
    assert ptx, "no PTX was produced"
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "cp.reduce.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx
    # setmaxnreg.inc only draws on registers the producer released (a shortfall hangs every CTA).
    dec = int(re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+(\d+)", ptx).group(1))
    inc = int(re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+(\d+)", ptx).group(1))
    threads = 128 * (cfg.mma_warpgroups + 1)
    launch = (65536 // threads) // 8 * 8
    assert (inc - launch) * (threads - 128) <= (launch - dec) * 128, (dec, inc, launch)
    assert compile_bwd(BwdKey(cfg, dtype, d, d, *flags)) is compiled


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_m=96),
        dict(block_n=32),
        dict(num_stages=0),
        dict(num_stages=True),
        dict(mma_warpgroups=3),
        dict(dq_mode="bogus"),
        dict(l2_group=32),
        dict(do_stages=0),
        dict(num_stages=1, do_stages=2),
        dict(do_stages=1.0),
        dict(dq_serial=1),
        dict(compact="yes"),
        dict(swap_sdp=None),
        dict(tanh_silu=0),
        dict(persistent=1),
        dict(persistent=True, compact=False),
    ],
)
def test_config_rejects_bad_fields(kwargs):
    field = next(iter(kwargs))
    with pytest.raises(ValueError, match=field):
        HSTUCuteBwdConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, dtype, dqk, dv, match",
    [
        (HSTUCuteBwdConfig(), "bfloat16", 96, 96, "head dims"),
        (HSTUCuteBwdConfig(), "bfloat16", 128, 64, "Dqk == Dv"),
        (HSTUCuteBwdConfig(), "float32", 128, 128, "dtype"),
        (HSTUCuteBwdConfig(64, 64, 2), "bfloat16", 256, 256, "shared memory"),
        (HSTUCuteBwdConfig(64, 64, 2, do_stages=1), "bfloat16", 256, 256, "shared memory"),
        (HSTUCuteBwdConfig(64, 64, 2, do_stages=2, dq_serial=True), "bfloat16", 256, 256, "shared memory"),
        (HSTUCuteBwdConfig(64, 128, 1), "bfloat16", 256, 256, "shared memory|registers"),
        (HSTUCuteBwdConfig(128, 128, 1), "bfloat16", 128, 128, "shared memory|registers"),
        (HSTUCuteBwdConfig(64, 64, 2, swap_sdp=True), "bfloat16", 128, 128, "swap_sdp needs block_n == 64"),
        (HSTUCuteBwdConfig(128, 128, 2, swap_sdp=True), "bfloat16", 64, 64, "registers"),
    ],
)
def test_infeasible_configs_fail_before_compiling(cfg, dtype, dqk, dv, match):
    before = len(_CACHE)
    with pytest.raises(ValueError, match=match):
        check_bwd_config(cfg, dtype, dqk, dv)
    with pytest.raises(ValueError, match=match):
        compile_bwd(BwdKey(cfg, dtype, dqk, dv, False, False, False))
    assert len(_CACHE) == before


def test_config_round_trip_and_defaults():
    cfg = HSTUCuteBwdConfig(64, 128, 2)
    assert cfg.do_stages == 2 and not cfg.dq_serial  # dO buffers default to the Q count
    assert HSTUCuteBwdConfig.from_dict(cfg.to_dict()) == cfg
    serial = HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True)
    assert HSTUCuteBwdConfig.from_dict(serial.to_dict()) == serial
    old = {k: v for k, v in cfg.to_dict().items() if k not in ("do_stages", "dq_serial")}
    with pytest.raises(ValueError, match=r"missing fields \['do_stages', 'dq_serial'\]"):
        HSTUCuteBwdConfig.from_dict(old)  # written before the two fields: never filled with defaults
    with pytest.raises(ValueError, match="bogus"):
        HSTUCuteBwdConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    for d in (64, 128, 256):
        check_bwd_config(default_cute_bwd_config(d, d), "bfloat16", d, d)


def test_search_space_admits_only_valid_configs():
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.hstu_attention_cute import HSTU_BWD_CUTE

    for d in (64, 128, 256):
        ctx = SpaceContext(GPUS["h100"], "bfloat16", d, d, 4096)
        feasible = HSTU_BWD_CUTE.prune(ctx)
        assert feasible, d
        assert HSTU_BWD_CUTE.why_infeasible(HSTU_BWD_CUTE.default(ctx), ctx) is None
        for c in feasible:
            check_bwd_config(c, "bfloat16", d, d)
    assert HSTU_BWD_CUTE.prune(SpaceContext(GPUS["h100"], "bfloat16", 128, 64, 4096)) == []


def test_search_space_buffers_and_dq_serial_rules():
    """At D=256 only two buffer layouts fit 227 KB: one Q + one dO with the whole fp32 dQ tile, or two Q
    + one dO with ``dq_serial``. Everywhere, ``dq_serial`` and single buffers appear only where the
    roomier variant does not fit."""
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.hstu_attention_cute import HSTU_BWD_CUTE

    ctx = SpaceContext(GPUS["h100"], "bfloat16", 256, 256, 4096)
    layouts = {(c.block_m, c.block_n, c.num_stages, c.do_stages, c.dq_serial) for c in HSTU_BWD_CUTE.prune(ctx)}
    assert layouts == {(64, 64, 1, 1, False), (64, 64, 2, 1, True)}
    for d in (64, 128):
        ctx = SpaceContext(GPUS["h100"], "bfloat16", d, d, 4096)
        for c in HSTU_BWD_CUTE.prune(ctx):
            assert c.do_stages <= c.num_stages
            if c.dq_serial:
                with pytest.raises(ValueError, match="shared memory"):
                    check_bwd_config(dataclasses.replace(c, dq_serial=False), "bfloat16", d, d)


def _inputs(device: str = "cpu", dtype=torch.bfloat16, d: int = 128):
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    inp = make_jagged_inputs([3, 0, 5], 2, d, d, dtype, device, seed=0)
    return inp, torch.randn_like(inp.v)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(do=a["do"][:, :1]), "do"),
        (lambda a: a.update(do=a["do"].float()), "do"),
        (lambda a: a.update(q=a["q"].float(), k=a["k"].float(), v=a["v"].float(), do=a["do"].float()), "q"),
        (lambda a: a.update(seq_offsets=a["seq_offsets"].flip(0)), "seq_offsets"),
        (lambda a: a.update(max_seq_len=-1), "max_seq_len"),
        (lambda a: a.update(k=a["k"][:, :, :64]), "k"),
    ],
)
def test_bad_inputs_raise(mutate, match):
    inp, do = _inputs()
    a = dict(do=do, q=inp.q, k=inp.k, v=inp.v, seq_offsets=inp.seq_offsets, max_seq_len=inp.max_seq_len)
    mutate(a)
    with pytest.raises(ValueError, match=match):
        hstu_attention_cute_bwd(
            a["do"], a["q"], a["k"], a["v"], a["seq_offsets"], a["max_seq_len"], 0.1, check_offsets=True
        )


# ---------------------------------------------------------------------------------------------- GPU


def _ref_grads(inp, do, args, compute_dtype):
    from kernel_templates.hstu_attention.reference import hstu_attention_reference

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    out = hstu_attention_reference(q, k, v, *args, compute_dtype=compute_dtype)
    return torch.autograd.grad(out, (q, k, v), do.to(out.dtype))


def check_case(lengths, heads, d, dtype, cfg, ctx, targets, window, seed=0, scaling=None) -> dict[str, float]:
    """Run the CuTe backward into NaN-poisoned buffers and apply the tolerance rule to dq, dk, dv."""
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    inp = make_jagged_inputs(lengths, heads, d, d, dtype, "cuda", seed=seed, targets=targets)
    g = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(inp.v.shape, generator=g).to(device="cuda", dtype=dtype)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, ctx, window, scaling)
    bufs = tuple(torch.full_like(t, float("nan")) for t in (inp.q, inp.k, inp.v))
    grads = hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs)
    torch.cuda.synchronize()
    ref = _ref_grads(inp, do, args, torch.float32)
    low = _ref_grads(inp, do, args, dtype)
    errs = {}
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref, low, strict=True):
        errs[name], _ = check_tolerance(name, a, r.float(), lo)
    return errs


@every_mask_and_dtype((128, 256))
def test_gpu_matches_reference(mask, dtype, d):
    check_case(LENGTHS, 2, d, dtype, default_cute_bwd_config(d, d), **MASKS[mask])


# Non-default configs the GPU runs (at d256 only 64x64 s1 and 64x64 s2/dO1 with dq_serial fit).
GPU_CONFIGS = [
    (HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True), 256),
    (HSTUCuteBwdConfig(128, 64, 2, do_stages=2, dq_serial=True), 128),
    (HSTUCuteBwdConfig(64, 128, 2, do_stages=1), 64),
    (HSTUCuteBwdConfig(64, 64, 2), 128),
    (HSTUCuteBwdConfig(128, 64, 1), 128),
    (HSTUCuteBwdConfig(64, 128, 2), 64),
    (HSTUCuteBwdConfig(128, 64, 2), 64),
    (HSTUCuteBwdConfig(64, 64, 1, l2_group=0, compact=True), 256),
    (HSTUCuteBwdConfig(64, 128, 2, l2_group=8, compact=True), 128),
    (HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True), 128),
    (HSTUCuteBwdConfig(64, 128, 3, do_stages=2, swap_sdp=True), 64),
    (HSTUCuteBwdConfig(64, 128, 1, dq_serial=True, compact=True, swap_sdp=True), 128),
    (HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True, tanh_silu=True), 128),
    (HSTUCuteBwdConfig(64, 64, 1, tanh_silu=True), 256),
    (HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True, compact=True, persistent=True, tanh_silu=True), 256),
    (HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True, compact=True, persistent=True), 128),
    (HSTUCuteBwdConfig(128, 64, 2, l2_group=2, compact=True, persistent=True), 64),
]


@pytest.mark.parametrize("cfg, d", GPU_CONFIGS)
def test_gpu_test_configs_are_feasible(cfg, d):
    """Checked on CPU, so a GPU run never spends device time on a config the launcher must reject."""
    check_bwd_config(cfg, "bfloat16", d, d)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "cfg, d",
    GPU_CONFIGS,
    ids=lambda x: _cfg_id(x) if isinstance(x, HSTUCuteBwdConfig) else f"d{x}",
)
@pytest.mark.parametrize("mask", ["causal", "all"])
def test_gpu_configs(cfg, d, mask):
    check_case(LENGTHS, 3, d, torch.bfloat16, cfg, seed=3, **MASKS[mask])


@every_mask_and_dtype((64, 128))
def test_gpu_tanh_silu_matches_reference(mask, dtype, d):
    """sigmoid by tanh.approx, plain and swapped: within the tolerance of the ex2 + rcp form."""
    for cfg in (
        HSTUCuteBwdConfig(64, 64, 2, tanh_silu=True),
        HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True, tanh_silu=True),
    ):
        check_case(LENGTHS, 2, d, dtype, cfg, seed=8, **MASKS[mask])


@every_mask_and_dtype((64, 128))
def test_gpu_swapped_sdp_matches_reference(mask, dtype, d):
    """S^T / dP^T with P^T and dS^T as register operands: every mask, both dtypes, and a sequence of
    many query blocks, so both dS^T buffers are reused many times."""
    cfg = HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True)
    check_case(LENGTHS, 2, d, dtype, cfg, seed=5, **MASKS[mask])
    check_case([1000, 17, 600], 2, d, dtype, cfg, seed=6, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_scaling_seqlen_and_long_sequence():
    """scaling_seqlen instead of N, and one sequence long enough for many key and query blocks."""
    check_case([5, 130, 77], 2, 128, torch.bfloat16, None, ctx=0, targets=False, window=0, scaling=300)
    check_case([1000, 17, 600], 1, 256, torch.bfloat16, None, ctx=0, targets=False, window=0, seed=9)


def _same_tiles_same_result(lengths, heads, d, cfg_a, cfg_b, seed):
    """Two launch orders of the same tiles: dK and dV (one CTA or tile per key block) bitwise equal; dQ,
    whose fp32 partials add in another order, by tolerance; no NaN left in ``cfg_b``'s outputs."""
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    inp = make_jagged_inputs(lengths, heads, d, d, torch.bfloat16, "cuda", seed=seed)
    do = torch.randn_like(inp.v)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, None, 0, 0, None)
    grads = []
    for cfg in (cfg_a, cfg_b):
        bufs = tuple(torch.full_like(t, float("nan")) for t in (inp.q, inp.k, inp.v))
        grads.append(hstu_attention_cute_bwd(do, inp.q, inp.k, inp.v, *args, config=cfg, out=bufs))
    torch.cuda.synchronize()
    assert all(torch.isfinite(g).all() for g in grads[1])
    assert torch.equal(grads[0][1], grads[1][1]) and torch.equal(grads[0][2], grads[1][2])
    torch.testing.assert_close(grads[0][0].float(), grads[1][0].float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("l2_group", [0, 2, 16])
def test_gpu_compact_order_gives_the_grid_result(l2_group):
    """Only the launch order differs: dK and dV (one CTA per key tile) are bitwise equal to the plain
    grid's on a skewed batch; dQ sums its partials in another order, so it is checked by tolerance."""
    lengths = [1000, 0, 3, 130, 0, 64, 1, 257] + [17] * 20
    grid = HSTUCuteBwdConfig(64, 128, 2, l2_group=l2_group)
    _same_tiles_same_result(lengths, 3, 128, grid, dataclasses.replace(grid, compact=True), seed=12)
    lpt = HSTUCuteBwdConfig(64, 128, 2, l2_group=0, compact=True)
    check_case(lengths, 3, 128, torch.bfloat16, lpt, seed=12, **MASKS["all"])


PERSISTENT = {
    256: [HSTUCuteBwdConfig(64, 64, 2, do_stages=1, dq_serial=True, l2_group=2, compact=True, persistent=True)],
    128: [
        HSTUCuteBwdConfig(64, 128, 2, l2_group=0, compact=True, persistent=True),
        HSTUCuteBwdConfig(64, 128, 2, swap_sdp=True, l2_group=16, compact=True, persistent=True),
    ],
}


@every_mask_and_dtype((128, 256))
def test_gpu_persistent_matches_reference(mask, dtype, d):
    """One CTA per SM walking the tile table: every mask and dtype, on the short jagged batch (fewer
    tiles than SMs) and on one of 40 sequences x 3 heads, so each CTA runs several tiles of different
    sequences and the Q/dO ring, the K/V buffer and the dS^T parity run on across tiles."""
    lengths = [300, 0, 1, 77, 513] * 8
    for cfg in PERSISTENT[d]:
        check_case(LENGTHS, 2, d, dtype, cfg, seed=14, **MASKS[mask])
        check_case(lengths, 3, d, dtype, cfg, seed=15, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("d", [128, 256])
def test_gpu_persistent_gives_the_compact_grid_result(d):
    """The persistent CTAs run each tile exactly as a compact-grid CTA does: dK and dV bitwise equal on a
    skewed batch with many more tiles than SMs; dQ (partials summed in another order) by tolerance."""
    lengths = [2000, 0, 3, 130, 0, 64, 1, 257] + [700] * 12 + [17] * 20
    cfg = PERSISTENT[d][0]
    _same_tiles_same_result(lengths, 4, d, dataclasses.replace(cfg, persistent=False), cfg, seed=16)
