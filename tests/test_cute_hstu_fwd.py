"""CuTe DSL HSTU forward (sm90): compiles on CPU (CUTE_DSL_ARCH=sm_90a) and matches the reference on GPU.

CPU: a small grid of configs compiles from fake tensors; the PTX must hold wgmma and TMA
(cp.async.bulk.tensor) so a slow fallback cannot slip in; bad configs fail with ValueError before
compiling. GPU: every mask variant on jagged batches with empty, length-1 and non-tile-multiple
sequences, bf16 and fp16, D = 128 and 256, against the tolerance rule of the Triton tests.
"""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")

from cute_gpu_cases import LENGTHS, MASKS, every_mask_and_dtype  # noqa: E402

from kernel_templates.cute import (  # noqa: E402
    FwdKey,
    HSTUCuteFwdConfig,
    check_fwd_config,
    compile_fwd,
    hstu_attention_cute,
    hstu_attention_cute_fwd,
)
from kernel_templates.cute.op import _CACHE  # noqa: E402

# (config, head dim, dtype, (context, targets, window)): the CPU compile grid (~2 s per compile).
COMPILE_GRID = [
    (HSTUCuteFwdConfig(128, 64, 2, True), 256, "bfloat16", (False, False, False)),
    (HSTUCuteFwdConfig(128, 128, 2, True), 128, "float16", (True, True, True)),
    (HSTUCuteFwdConfig(64, 96, 3, False), 128, "bfloat16", (False, True, False)),
    (HSTUCuteFwdConfig(192, 64, 2, True), 64, "bfloat16", (True, False, True)),
    (HSTUCuteFwdConfig(128, 64, 2, True, l2_group=0, compact=True), 256, "bfloat16", (False, True, False)),
    (HSTUCuteFwdConfig(128, 128, 2, True, tanh_silu=True), 128, "bfloat16", (True, True, True)),
    (HSTUCuteFwdConfig(128, 64, 2, True, l2_group=0, compact=True, split_heavy=4), 256, "bfloat16", (True, True, True)),
]


@pytest.mark.parametrize("case", COMPILE_GRID, ids=lambda c: f"{c[0].block_m}x{c[0].block_n}s{c[0].num_stages}-d{c[1]}")
def test_compiles_with_tma_and_wgmma(case):
    cfg, d, dtype, flags = case
    compiled = compile_fwd(FwdKey(cfg, dtype, d, d, *flags), keep_ptx=True)
    ptx = compiled.ptx
    assert ptx, "no PTX was produced"
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "setmaxnreg" in ptx
    # The second request is served from the cache.
    assert compile_fwd(FwdKey(cfg, dtype, d, d, *flags)) is compiled


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_m=96),
        dict(block_n=48),
        dict(num_stages=0),
        dict(intra_wg_overlap=1),
        dict(l2_group=5),
        dict(compact=1),
        dict(tanh_silu="yes"),
        dict(split_heavy=5),
        dict(split_heavy=2, compact=False),
    ],
)
def test_config_rejects_bad_fields(kwargs):
    with pytest.raises(ValueError):
        HSTUCuteFwdConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, dqk, dv, match",
    [
        (HSTUCuteFwdConfig(), 96, 96, "head dims"),
        (HSTUCuteFwdConfig(), 128, 64, "Dqk == Dv"),
        (HSTUCuteFwdConfig(128, 128, 2), 256, 256, "shared memory"),
        (HSTUCuteFwdConfig(192, 128, 1), 256, 256, "registers"),
    ],
)
def test_infeasible_configs_fail_before_compiling(cfg, dqk, dv, match):
    before = len(_CACHE)
    with pytest.raises(ValueError, match=match):
        check_fwd_config(cfg, dqk, dv)
    with pytest.raises(ValueError, match=match):
        compile_fwd(FwdKey(cfg, "bfloat16", dqk, dv, False, False, False))
    assert len(_CACHE) == before


def _bwd_config_cases():
    from kernel_templates.cute import HSTUCuteBwdConfig
    from kernel_templates.hstu_attention.config import HSTUBwdConfig, HSTUFwdConfig

    return [
        (HSTUFwdConfig(), "bwd_config must be an HSTUCuteBwdConfig"),
        (HSTUBwdConfig(), "bwd_config must be an HSTUCuteBwdConfig"),
        (HSTUCuteFwdConfig(), "bwd_config must be an HSTUCuteBwdConfig"),
        (HSTUCuteBwdConfig(128, 128, 1), "bwd_config: .*(shared memory|registers)"),
    ]


@pytest.mark.parametrize("bwd_config, match", _bwd_config_cases(), ids=lambda x: type(x).__name__)
def test_autograd_entry_rejects_bad_bwd_config_before_running(bwd_config, match):
    """hstu_attention_cute checks bwd_config up front (CPU tensors: any kernel launch would fail)."""
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    inp = make_jagged_inputs([3, 0, 5], 2, 128, 128, torch.bfloat16, "cpu", seed=0, requires_grad=True)
    before = len(_CACHE)
    with pytest.raises(ValueError, match=match):
        hstu_attention_cute(inp.q, inp.k, inp.v, inp.seq_offsets, inp.max_seq_len, bwd_config=bwd_config)
    assert len(_CACHE) == before


def test_config_round_trip():
    cfg = HSTUCuteFwdConfig(64, 128, 3, False)
    assert HSTUCuteFwdConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError):
        HSTUCuteFwdConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_search_space_admits_only_valid_configs():
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.hstu_attention_cute import HSTU_FWD_CUTE

    for d in (128, 256):
        ctx = SpaceContext(GPUS["h100"], "bfloat16", d, d, 4096)
        feasible = HSTU_FWD_CUTE.prune(ctx)
        assert feasible, d
        assert HSTU_FWD_CUTE.why_infeasible(HSTU_FWD_CUTE.default(ctx), ctx) is None
        for c in feasible:
            check_fwd_config(c, d, d)
    bad = SpaceContext(GPUS["h100"], "bfloat16", 128, 64, 4096)
    assert HSTU_FWD_CUTE.prune(bad) == []


# ---------------------------------------------------------------------------------------------- GPU


def _check_case(lengths, heads, d, dtype, cfg, ctx, targets, window, seed=0, sm_count=None):
    from kernel_templates.hstu_attention.reference import hstu_attention_reference
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    inp = make_jagged_inputs(lengths, heads, d, d, dtype, "cuda", seed=seed, targets=targets)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, ctx, window, None)
    out = torch.full_like(inp.v, float("nan"))
    hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg, out=out, sm_count=sm_count)
    torch.cuda.synchronize()
    ref = hstu_attention_reference(inp.q, inp.k, inp.v, *args).float()
    low = hstu_attention_reference(inp.q, inp.k, inp.v, *args, compute_dtype=dtype)
    assert torch.isfinite(out).all()
    check_tolerance("out", out, ref, low)


@every_mask_and_dtype((128, 256))
def test_gpu_matches_reference(mask, dtype, d):
    cfg = HSTUCuteFwdConfig(128, 64, 2, True)
    _check_case(LENGTHS, 2, d, dtype, cfg, **MASKS[mask])


@every_mask_and_dtype((64, 128, 256))
def test_gpu_tanh_silu_matches_reference(mask, dtype, d):
    """SiLU by tanh.approx: within the same tolerance as the ex2 + rcp form on every mask and dtype."""
    cfg = HSTUCuteFwdConfig(128, 64, 2, True, tanh_silu=True)
    _check_case(LENGTHS, 2, d, dtype, cfg, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "cfg",
    [
        HSTUCuteFwdConfig(64, 64, 2, False),
        HSTUCuteFwdConfig(128, 128, 2, False),
        HSTUCuteFwdConfig(192, 96, 3, True),
        HSTUCuteFwdConfig(128, 64, 2, True, l2_group=0, compact=True),
        HSTUCuteFwdConfig(64, 96, 3, False, l2_group=8, compact=True),
    ],
    ids=lambda c: f"{c.block_m}x{c.block_n}s{c.num_stages}o{int(c.intra_wg_overlap)}g{c.l2_group}c{int(c.compact)}",
)
@pytest.mark.parametrize("mask", ["causal", "all"])
def test_gpu_configs(cfg, mask):
    _check_case(LENGTHS, 3, 128, torch.bfloat16, cfg, seed=3, **MASKS[mask])


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("l2_group", [0, 2, 16])
def test_gpu_compact_order_gives_the_grid_result(l2_group):
    """Only the launch order differs: each tile is computed the same way, so the outputs are bitwise
    equal to the plain grid's on a skewed batch (one long sequence, short and empty ones)."""
    from kernel_templates.hstu_attention.testing import make_jagged_inputs

    lengths = [1000, 0, 3, 130, 0, 64, 1, 257] + [17] * 20
    inp = make_jagged_inputs(lengths, 3, 128, 128, torch.bfloat16, "cuda", seed=11)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / 128**0.5, None, 0, 0, None)
    outs = []
    for compact in (False, True):
        out = torch.full_like(inp.v, float("nan"))
        cfg = HSTUCuteFwdConfig(128, 64, 2, True, l2_group=l2_group, compact=compact)
        outs.append(hstu_attention_cute_fwd(inp.q, inp.k, inp.v, *args, cfg, out=out))
    torch.cuda.synchronize()
    assert torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])
    _check_case(lengths, 3, 128, torch.bfloat16, HSTUCuteFwdConfig(128, 64, 2, True, 0, True), seed=11, **MASKS["all"])


def _ref_grads(inp, do, args, compute_dtype):
    from kernel_templates.hstu_attention.reference import hstu_attention_reference

    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    out = hstu_attention_reference(q, k, v, *args, compute_dtype=compute_dtype)
    return out, torch.autograd.grad(out, (q, k, v), do.to(out.dtype))


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("mask", ["causal", "all"])
def test_gpu_autograd_uses_cute_backward(mask):
    """hstu_attention_cute: CuTe forward and CuTe backward, out and dq/dk/dv within the tolerance rule."""
    from kernel_templates.cute import bwd_key, default_cute_bwd_config
    from kernel_templates.cute.bwd_op import _CACHE as BWD_CACHE
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    d, m = 128, MASKS[mask]
    inp = make_jagged_inputs(LENGTHS, 2, d, d, torch.bfloat16, "cuda", seed=5, targets=m["targets"])
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, inp.num_targets, m["ctx"], m["window"], None)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    out = hstu_attention_cute(q, k, v, *args)
    g = torch.Generator().manual_seed(6)
    do = torch.randn(out.shape, generator=g).to(device="cuda", dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.synchronize()
    # The gradients came from the CuTe kernel: its compile cache holds the default backward config.
    key = bwd_key(q, v, inp.num_targets, m["ctx"], m["window"], default_cute_bwd_config(d, d))
    assert key in BWD_CACHE
    ref, ref_grads = _ref_grads(inp, do, args, torch.float32)
    low, low_grads = _ref_grads(inp, do, args, torch.bfloat16)
    check_tolerance("out", out, ref.float(), low)
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, strict=True):
        check_tolerance(name, a, r.float(), lo)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("window", [0, 40])
def test_gpu_kernels_context_path_without_targets(dtype, window):
    """The kernels' own context path (``num_targets=None``, no zero targets put in front): a context of 96
    rows over sequences shorter than it (0, 1, 37, 50), about a tile long and far longer, forward and
    every gradient within the tolerance rule."""
    from kernel_templates.cute import op as raw
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    d, ctx = 128, 96
    inp = make_jagged_inputs([37, 0, 1, 50, 200, 130, 1000], 2, d, d, dtype, "cuda", seed=9)
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, None, ctx, window, None)
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (inp.q, inp.k, inp.v))
    out = raw.hstu_attention_cute(q, k, v, *args)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(10)).to(device="cuda", dtype=dtype)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref, ref_grads = _ref_grads(inp, do, args, torch.float32)
    low, low_grads = _ref_grads(inp, do, args, dtype)
    check_tolerance("out", out, ref.float(), low)
    for name, a, r, lo in zip(("dq", "dk", "dv"), grads, ref_grads, low_grads, strict=True):
        check_tolerance(name, a, r.float(), lo)


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_strided_qkv_slices_of_one_projection():
    """q/k/v as column slices of one (L, 4*H*D) uvqk buffer (the model's layout) need no copies."""
    from kernel_templates.hstu_attention.reference import hstu_attention_reference
    from kernel_templates.hstu_attention.testing import check_tolerance, make_jagged_inputs

    h, d = 2, 128
    inp = make_jagged_inputs(LENGTHS, h, d, d, torch.bfloat16, "cuda", seed=11)
    L = inp.q.shape[0]
    uvqk = torch.randn(L, 4 * h * d, device="cuda", dtype=torch.bfloat16)
    _, v, q, k = (t.view(L, h, d) for t in torch.split(uvqk, h * d, dim=1))
    assert q.stride(0) == 4 * h * d and not q.is_contiguous()
    args = (inp.seq_offsets, inp.max_seq_len, 1.0 / d**0.5, None, 0, 0, None)
    out = hstu_attention_cute_fwd(q, k, v, *args, HSTUCuteFwdConfig(128, 64, 2, True))
    torch.cuda.synchronize()
    qc, kc, vc = (t.contiguous() for t in (q, k, v))
    ref = hstu_attention_reference(qc, kc, vc, *args).float()
    low = hstu_attention_reference(qc, kc, vc, *args, compute_dtype=torch.bfloat16)
    check_tolerance("out", out, ref, low)


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_compact_order_under_cuda_graph_capture():
    """Captured with one batch's offsets and replayed on other offsets (same L and B), the compact kernels
    rebuild their tile table inside the graph: the replay equals an eager call on the new offsets."""
    from kernel_templates.cute import HSTUCuteBwdConfig, hstu_attention_cute_bwd
    from kernel_templates.hstu_attention.testing import offsets_from_lengths

    h, d, max_len = 2, 128, 700
    first, second = [700, 0, 5, 300, 1, 130], [64, 129, 700, 3, 0, 240]
    assert sum(first) == sum(second)
    g = torch.Generator(device="cuda").manual_seed(21)
    q, k, v, do = (torch.randn(sum(first), h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(4))
    off = offsets_from_lengths(first).to(device="cuda", dtype=torch.int32)
    fwd_cfg = HSTUCuteFwdConfig(128, 64, 2, True, l2_group=0, compact=True)
    bwd_cfg = HSTUCuteBwdConfig(64, 128, 2, l2_group=2, compact=True)

    def step(offsets: torch.Tensor):
        args = (offsets, max_len, 1.0 / d**0.5, None, 0, 0, None)
        out = hstu_attention_cute_fwd(q, k, v, *args, fwd_cfg)
        return (out, *hstu_attention_cute_bwd(do, q, k, v, *args, config=bwd_cfg, validate=False))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(off)  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(off)
    off.copy_(offsets_from_lengths(second).to(device="cuda", dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    eager = step(offsets_from_lengths(second).to(device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    for name, a, b in zip(("out", "dq", "dk", "dv"), captured, eager, strict=True):
        if name == "dq":  # partials added in a run-dependent order
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2, msg=name)
        else:
            assert torch.equal(a, b), name


# One long sequence among short and empty ones: its heaviest query tiles are cut into parts.
SKEWED = [1000, 0, 3, 130, 0, 64, 1, 257] + [17] * 20
SPLIT = HSTUCuteFwdConfig(128, 64, 2, True, l2_group=0, compact=True, split_heavy=4)


def _counters_zero() -> bool:
    from kernel_templates.cute.op import _COUNTERS

    return bool(_COUNTERS) and all(int(sem.abs().sum()) == 0 for sem in _COUNTERS.values())


@every_mask_and_dtype((128, 256))
def test_gpu_split_heavy_matches_reference(mask, dtype, d):
    """Heavy tiles cut into parts whose fp32 partials the last part to finish adds: within the tolerance
    on every mask and dtype, and every counter is left zero for the next launch."""
    from kernel_templates.cute import tile_table as tt
    from kernel_templates.hstu_attention.testing import offsets_from_lengths

    off = offsets_from_lengths(SKEWED).to(device="cuda", dtype=torch.int32)
    table = tt.split_tile_table(off, sum(SKEWED), 128, 64, 8, 0, 3, 132, 4)
    assert (table[:, 2] >= 512).any()  # the case does cut tiles
    _check_case(SKEWED, 3, d, dtype, SPLIT, seed=13, **MASKS[mask])
    _check_case(LENGTHS, 2, d, dtype, SPLIT, seed=14, **MASKS[mask])
    assert _counters_zero()


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_split_heavy_on_random_batches_and_sm_counts():
    """Back-to-back launches with different tables (so counters are reused) and SM counts that cut more or
    fewer tiles: each output within the tolerance of the reference."""
    import random

    rng = random.Random(5)
    for i in range(6):
        n = rng.randint(200, 3000)
        lengths = [n] + [rng.choice([0, 1, rng.randint(1, n // 4)]) for _ in range(rng.randint(0, 12))]
        parts = rng.choice([2, 4])
        cfg = HSTUCuteFwdConfig(rng.choice([64, 128]), 64, 2, True, l2_group=0, compact=True, split_heavy=parts)
        _check_case(lengths, 2, 128, torch.bfloat16, cfg, seed=i, sm_count=rng.choice([8, 132]), **MASKS["causal"])
    assert _counters_zero()


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_split_heavy_under_cuda_graph_capture():
    """Captured on one batch and replayed on another (same L and B): the split table is rebuilt inside the
    graph and the replay matches an eager call on the new offsets (partials add in arrival order)."""
    from kernel_templates.hstu_attention.testing import offsets_from_lengths

    h, d, max_len = 2, 128, 1500
    first, second = [1500, 0, 5, 300, 1, 130], [64, 129, 1500, 3, 0, 240]
    g = torch.Generator(device="cuda").manual_seed(8)
    q, k, v = (torch.randn(sum(first), h, d, generator=g, device="cuda").to(torch.bfloat16) for _ in range(3))
    off = offsets_from_lengths(first).to(device="cuda", dtype=torch.int32)

    def step(offsets):
        return hstu_attention_cute_fwd(q, k, v, offsets, max_len, 1.0 / d**0.5, None, 0, 0, None, SPLIT)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step(off)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(off)
    for _ in range(2):  # a second replay finds its counters zero again
        off.copy_(offsets_from_lengths(second).to(device="cuda", dtype=torch.int32))
        graph.replay()
    torch.cuda.synchronize()
    eager = step(offsets_from_lengths(second).to(device="cuda", dtype=torch.int32))
    torch.cuda.synchronize()
    torch.testing.assert_close(captured.float(), eager.float(), rtol=1e-2, atol=1e-2)


class _NotTwiceDifferentiable(torch.autograd.Function):
    """Stands in for the compiled kernels on CPU: right first-order gradients, computed without a graph."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return (q * k).sum(-1, keepdim=True) * v

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        with torch.no_grad():
            s = (do * v).sum(-1, keepdim=True)
            return s * k, s * q, (q * k).sum(-1, keepdim=True) * do


def test_cute_autograd_entry_zero_targets_and_first_order_gradients(monkeypatch):
    """``kernel_templates.cute.hstu_attention_cute`` launches a context without targets with zero targets (the
    kernel variant the drop-in call runs and the tuner times), and a gradient of its gradients raises instead
    of silently treating them as constants; first-order gradients are unchanged."""
    import kernel_templates.cute as cute

    seen = {}

    def kernels(q, k, v, seq_offsets, max_seq_len, alpha, num_targets, *rest, validate=True):
        seen.update(num_targets=num_targets, validate=validate)
        return _NotTwiceDifferentiable.apply(q, k, v)

    monkeypatch.setattr(cute._op, "hstu_attention_cute", kernels)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(10, 2, 32, generator=gen, requires_grad=True) for _ in range(3))
    off = torch.tensor([0, 3, 10], dtype=torch.int32)
    out = cute.hstu_attention_cute(q, k, v, off, 8, None, None, 5)
    assert seen["validate"] is False and torch.equal(seen["num_targets"], torch.zeros(2, dtype=torch.int32))
    cute.hstu_attention_cute(q, k, v, off, 8, None, None, 0)
    assert seen["num_targets"] is None  # no context: targets stay as given
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v), create_graph=True)
    q2, k2, v2 = (t.detach().requires_grad_(True) for t in (q, k, v))
    want = torch.autograd.grad(_NotTwiceDifferentiable.apply(q2, k2, v2).sum(), (q2, k2, v2))
    for got, ref in zip((gq, gk, gv), want, strict=True):
        torch.testing.assert_close(got, ref)
    with pytest.raises(RuntimeError, match="not differentiable"):
        (gq * q).sum().backward()
    with pytest.raises(ValueError, match="seq_offsets must"):
        cute.hstu_attention_cute(q, k, v, off[:1].float(), 8)
