"""CuTe DSL GEMM + bias + SiLU (sm90): compiles on CPU (CUTE_DSL_ARCH=sm_90a), matches the reference on GPU.

CPU: a grid of configs (tiles, k-tiles, clusters with TMA multicast, rasters, dtypes, no bias, K and N
tails) compiles from fake tensors; the PTX must hold wgmma, TMA loads/stores and tanh.approx (the
fused SiLU) so a slow fallback cannot slip in; bad configs and bad inputs fail with ValueErrors that
name the culprit, before compiling; the search space admits only configs the launcher accepts; the
tuner op is registered. GPU: against the fp32 reference with the project's tolerance rule, M not a
tile multiple, M = 1, bf16 and fp16, several configs, and the autograd gradients.
"""

from __future__ import annotations

import pytest
import torch

from kernel_templates.gemm_silu import (
    GemmSiluConfig,
    GemmSiluKey,
    check_gemm_silu_config,
    default_gemm_silu_config,
    gemm_silu,
    gemm_silu_pre_reference,
    gemm_silu_reference,
    smem_bytes,
    validate_gemm_silu_inputs,
)
from kernel_templates.gemm_silu.config import EPI_N, EPI_STAGES, accumulator_regs
from kernel_templates.gemm_silu.op import _CACHE
from kernel_templates.gemm_silu.reference import silu_grad

C = GemmSiluConfig
BF16 = torch.bfloat16

# (config, dtype, N, K, bias): the CPU compile grid (~1 s per compile).
COMPILE_GRID = [
    (C(128, 256, 64, 1, 1, 4, "n"), "bfloat16", 4096, 1024, True),
    (C(128, 256, 64, 2, 1, 4, "n"), "bfloat16", 4096, 1024, True),
    (C(128, 128, 64, 1, 2, 5, "m"), "float16", 4096, 1024, True),
    (C(128, 128, 64, 2, 2, 4, "n"), "bfloat16", 1024, 4096, False),
    (C(64, 128, 64, 1, 1, 6, "n"), "bfloat16", 4096, 1024, True),
    (C(192, 128, 64, 1, 1, 4, "n"), "bfloat16", 4096, 1024, True),
    (C(128, 192, 32, 1, 1, 6, "n"), "bfloat16", 4096, 1000, True),
    (C(128, 96, 128, 1, 1, 3, "n"), "float16", 1000, 1024, True),
    (C(192, 64, 64, 1, 2, 6, "m"), "float16", 1024, 512, True),
]


def _id(case) -> str:
    c, dt, n, k, b = case
    tile = f"{c.tile_m}x{c.tile_n}x{c.tile_k}c{c.cluster_m}{c.cluster_n}s{c.num_stages}{c.raster}"
    tile += "-pp" if c.pingpong else "-p" if c.persistent else ""
    return f"{tile}-{dt}-n{n}k{k}b{int(b)}"


@pytest.mark.parametrize("case", COMPILE_GRID, ids=_id)
def test_compiles_with_tma_and_wgmma(case):
    pytest.importorskip("cutlass")
    from kernel_templates.gemm_silu import compile_gemm_silu

    cfg, dtype, n, k, bias = case
    compiled = compile_gemm_silu(GemmSiluKey(cfg, dtype, n, k, bias), keep_ptx=True)
    ptx = compiled.ptx
    assert ptx, "no PTX was produced"
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA loads and the TMA store of the epilogue
    assert "tanh.approx" in ptx  # SiLU fused in the epilogue
    assert "setmaxnreg" in ptx  # warp-specialised register split
    if cfg.cluster_size > 1:
        assert "multicast" in ptx
    assert compile_gemm_silu(GemmSiluKey(cfg, dtype, n, k, bias)) is compiled


# (config, dtype, N, K, bias, pre-activation stored): persistent tile walks and the second output.
PERSISTENT_GRID = [
    (C(128, 256, 64, 1, 1, 3, "n", True), "bfloat16", 4096, 1024, True, True),
    (C(128, 192, 32, 1, 1, 5, "m", True), "float16", 4096, 1000, False, False),
    (C(128, 256, 64, 2, 1, 4, "n"), "bfloat16", 4096, 1024, True, True),
    (C(192, 96, 64, 1, 1, 4, "n", True), "bfloat16", 96, 512, True, True),
    (C(128, 256, 64, 2, 1, 4, "n", True), "bfloat16", 4096, 1024, True, True),
    (C(128, 128, 64, 1, 2, 5, "m", True), "float16", 4096, 1000, False, False),
    (C(64, 256, 64, 2, 1, 4, "n", True, True), "bfloat16", 4096, 1024, True, True),
    (C(64, 256, 64, 1, 1, 4, "m", True, True), "float16", 4096, 1000, False, False),
]


@pytest.mark.parametrize("case", PERSISTENT_GRID, ids=lambda c: _id(c[:5]) + f"-p{int(c[0].persistent)}pre{int(c[5])}")
def test_compiles_persistent_and_with_the_pre_activation(case):
    """The persistent walk reads the grid size (``%nctaid``); the pre-activation adds a second TMA store."""
    pytest.importorskip("cutlass")
    from kernel_templates.gemm_silu import compile_gemm_silu

    cfg, dtype, n, k, bias, pre = case
    ptx = compile_gemm_silu(GemmSiluKey(cfg, dtype, n, k, bias, pre), keep_ptx=True).ptx
    assert "wgmma.mma_async" in ptx and "tanh.approx" in ptx
    assert ("%nctaid.x" in ptx) == cfg.persistent
    stores = ptx.count("cp.async.bulk.tensor.2d.global.shared")
    single = compile_gemm_silu(GemmSiluKey(cfg, dtype, n, k, bias, False), keep_ptx=True).ptx
    assert stores == (2 if pre else 1) * single.count("cp.async.bulk.tensor.2d.global.shared") > 0


def test_persistent_runs_clusters_of_at_most_two_ctas():
    with pytest.raises(ValueError, match="persistent"):
        GemmSiluConfig(persistent=1)
    with pytest.raises(ValueError, match="persistent"):
        check_gemm_silu_config(C(128, 128, 64, 2, 2, 4, "n", True), 4096, 1024)
    for pair in (C(128, 256, 64, 2, 1, 4, "n", True), C(128, 256, 64, 1, 2, 4, "m", True)):
        check_gemm_silu_config(pair, 4096, 1024)


def test_pingpong_needs_a_persistent_walk_of_one_warpgroup_tiles():
    """Each of the two warpgroups holds a whole tile: accumulators and buffers are counted per tile in flight."""
    with pytest.raises(ValueError, match="pingpong"):
        GemmSiluConfig(pingpong=1)
    for bad in (C(64, 128, 64, 1, 1, 4, "n", False, True), C(128, 128, 64, 1, 1, 4, "n", True, True)):
        with pytest.raises(ValueError, match="pingpong"):
            check_gemm_silu_config(bad, 4096, 1024)
    with pytest.raises(ValueError, match="registers"):  # 128 x 256 fp32 in one warpgroup
        check_gemm_silu_config(C(128, 256, 64, 1, 1, 3, "n", True, True), 4096, 1024)
    ping, single = C(64, 256, 64, 2, 1, 4, "n", True, True), C(64, 256, 64, 2, 1, 4, "n", True)
    assert ping.mma_warpgroups == 2 * single.mma_warpgroups == 2
    assert accumulator_regs(ping) == accumulator_regs(single) == 128  # a whole 64 x 256 tile per warpgroup
    assert smem_bytes(ping) - smem_bytes(single) == EPI_STAGES * 64 * EPI_N * 2 + 4 * 256
    check_gemm_silu_config(ping, 4096, 1024)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(tile_m=96), "tile_m"),
        (dict(tile_m=256), "tile_m"),
        (dict(tile_n=48), "tile_n"),
        (dict(tile_k=16), "tile_k"),
        (dict(cluster_m=4), "cluster_m"),
        (dict(cluster_n=0), "cluster_n"),
        (dict(num_stages=1), "num_stages"),
        (dict(num_stages=True), "num_stages"),
        (dict(raster="x"), "raster"),
    ],
)
def test_config_rejects_bad_fields(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GemmSiluConfig(**kwargs)


@pytest.mark.parametrize(
    "cfg, n, k, match",
    [
        (C(192, 256, 128, 1, 1, 4), 4096, 1024, "shared memory"),
        (C(192, 256, 64, 1, 1, 2), 4096, 1024, "registers"),
        (C(), 4100, 1024, "N"),
        (C(), 4096, 1020, "K"),
    ],
)
def test_infeasible_configs_fail_before_compiling(cfg, n, k, match):
    before = len(_CACHE)
    with pytest.raises(ValueError, match=match):
        check_gemm_silu_config(cfg, n, k)
    from kernel_templates.gemm_silu import compile_gemm_silu

    with pytest.raises(ValueError, match=match):
        compile_gemm_silu(GemmSiluKey(cfg, "bfloat16", n, k, True))
    assert len(_CACHE) == before


def test_config_round_trip_and_default():
    cfg = C(64, 128, 32, 2, 1, 6, "m")
    assert GemmSiluConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown fields"):
        GemmSiluConfig.from_dict({**cfg.to_dict(), "bogus": 1})
    for m, n, k in [(131072, 4096, 1024), (65536, 1024, 4096), (1, 4096, 1024), (300, 96, 64)]:
        d = default_gemm_silu_config(m, n, k)
        check_gemm_silu_config(d, n, k)
        assert smem_bytes(d) <= 227 * 1024


@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
def test_the_space_default_is_feasible_at_every_head_dim(d):
    """The default divides the per-head widths the space checks (4 d output columns, d hidden): with head dim
    32 or 96 its 64-column k-tile was rejected by the space's own rule, so a task had no feasible default."""
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.gemm_silu_cute import GEMM_SILU_CUTE

    ctx = SpaceContext(GPUS["h100"], "bfloat16", d, d, 4096, False)
    assert GEMM_SILU_CUTE.why_infeasible(GEMM_SILU_CUTE.default(ctx), ctx) is None


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.zeros(4, 64), torch.zeros(64, 64), None), "x must be bfloat16 or float16"),
        (lambda: (torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.float16), None), "weight"),
        (lambda: (torch.zeros(4, 64, 1, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), None), "x"),
        (lambda: (torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 32, dtype=torch.bfloat16), None), "weight"),
        (lambda: (torch.zeros(4, 60, dtype=torch.bfloat16), torch.zeros(64, 60, dtype=torch.bfloat16), None), "K"),
        (lambda: (torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(60, 64, dtype=torch.bfloat16), None), "N"),
        (lambda: (torch.zeros(4, 64, dtype=BF16), torch.zeros(64, 64, dtype=BF16), torch.zeros(8)), "bias"),
    ],
)
def test_bad_inputs_raise_naming_the_argument(make, match):
    x, w, b = make()
    with pytest.raises(ValueError, match=match):
        validate_gemm_silu_inputs(x, w, b)
    with pytest.raises(ValueError, match=match):
        gemm_silu(x, w, b)


def test_bad_out_and_config_raise():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    w = torch.zeros(64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out"):
        gemm_silu(x, w, None, out=torch.zeros(4, 32, dtype=torch.bfloat16))
    good = torch.zeros(4, 64, dtype=torch.bfloat16)
    for bad, match in ((torch.zeros(4, 32, dtype=torch.bfloat16), "pre_out"), (good.t(), "pre_out"),
                       (torch.zeros(4, 64), "pre_out"), (good, "different")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            validate_gemm_silu_inputs(x, w, None, good, bad)
    with pytest.raises(ValueError, match="config"):
        gemm_silu(x, w, None, config={"tile_m": 128})


def test_cute_launcher_refuses_outputs_that_share_memory():
    """The CuTe launcher's check (before any compile or launch): outputs of one buffer at different offsets, an
    output over an input, an output whose rows repeat. Column blocks of one buffer are separate outputs."""
    m, n, k = 6, 64, 32
    x, w, b = torch.zeros(m, k, dtype=BF16), torch.zeros(n, k, dtype=BF16), torch.zeros(n, dtype=BF16)
    flat = torch.empty(m * n + n, dtype=BF16)
    over_x = torch.empty(m * n, dtype=BF16)
    cases = [
        (flat[: m * n].view(m, n), flat[n:].view(m, n), x, "different"),
        (torch.empty(m, n, dtype=BF16), torch.empty(1, n, dtype=BF16).expand(m, n), x, "pre_out"),
        (over_x.view(m, n), None, over_x[: m * k].view(m, k), "out shares memory with the input x"),
    ]
    for out, pre, xx, match in cases:
        with pytest.raises(ValueError, match=match):
            validate_gemm_silu_inputs(xx, w, b, out, pre)
    both = torch.empty(m, 2 * n, dtype=BF16)
    with pytest.raises(ValueError, match="contiguous"):  # column blocks are apart, but TMA wants dense rows
        validate_gemm_silu_inputs(x, w, b, both[:, :n], both[:, n:])
    validate_gemm_silu_inputs(x, w, b, torch.empty(m, n, dtype=BF16), torch.empty(m, n, dtype=BF16))


def test_reference_matches_definition_and_grad():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, 64, generator=g, dtype=torch.float64)
    w = torch.randn(48, 64, generator=g, dtype=torch.float64) / 8
    b = torch.randn(48, generator=g, dtype=torch.float64)
    pre = x @ w.t() + b
    want = pre / (1 + torch.exp(-pre))
    got = gemm_silu_reference(x, w, b)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, atol=1e-5)
    low = gemm_silu_reference(x.bfloat16(), w.bfloat16(), b.bfloat16(), torch.bfloat16)
    assert low.dtype == torch.bfloat16 and torch.allclose(low.double(), want, atol=0.1)
    p = pre.clone().requires_grad_(True)
    torch.nn.functional.silu(p).sum().backward()
    assert torch.allclose(silu_grad(pre).double(), p.grad, atol=1e-6)


def test_search_space_admits_only_valid_configs():
    from autotune.runtime.gpus import GPUS
    from search_spaces.base import SpaceContext
    from search_spaces.gemm_silu_cute import GEMM_SILU_CUTE, gemm_dims

    for d in (128, 256):
        ctx = SpaceContext(GPUS["h100"], "bfloat16", d, d, 4096)
        feasible = GEMM_SILU_CUTE.prune(ctx)
        assert feasible
        assert GEMM_SILU_CUTE.why_infeasible(GEMM_SILU_CUTE.default(ctx), ctx) is None
        n, k = gemm_dims(ctx)
        for c in feasible:
            check_gemm_silu_config(c, 4 * n, 4 * k)
    assert GEMM_SILU_CUTE.prune(SpaceContext(GPUS["a100"], "bfloat16", 256, 256, 4096)) == []
    assert GEMM_SILU_CUTE.prune(SpaceContext(GPUS["h100"], "float32", 256, 256, 4096)) == []


def test_tuner_op_is_registered():
    from autotune.tuning.registry import backends_for, get_op, load_plugins
    from autotune.tuning.tasks import Task

    load_plugins()
    op = get_op("gemm_silu")
    assert {b.name for b in backends_for("gemm_silu", available_only=False)} == {"cute", "torch"}
    task = Task("gemm_silu", "h100", "float32", 32, 32, 2, 256, "uniform", batch=2, seq_cap=16)
    inputs = op.make_inputs(task, [16, 5], 0, "cpu", torch.float32)
    assert inputs["x"].shape == (21, 64) and inputs["weight"].shape == (256, 64) and inputs["bias"].shape == (256,)
    assert op.flops(inputs) == 2 * 21 * 256 * 64
    torch_backend = next(b for b in backends_for("gemm_silu", available_only=False) if b.name == "torch")
    out = op.alloc_out(inputs)
    assert op.output_names == ("y", "pre") and len(out) == 2 and all(torch.isnan(t).all() for t in out)
    y, pre = torch_backend.launch(inputs, torch_backend.space.default(None), out)
    assert y is out[0] and pre is out[1]
    ref_y, ref_pre = op.reference(inputs, torch.float32)
    assert torch.allclose(y, ref_y, atol=1e-5) and torch.allclose(pre, ref_pre, atol=1e-5)
    y2, pre2 = torch_backend.launch(inputs, torch_backend.space.default(None), None)  # buffers of its own
    assert torch.equal(y2, y) and torch.equal(pre2, pre)
    with pytest.raises(ValueError, match=r"\(y, pre\)"):
        torch_backend.launch(inputs, torch_backend.space.default(None), out[:1])


def test_torch_backend_stores_the_pre_activation_and_refuses_bad_buffers():
    from kernel_templates.gemm_silu.launch import gemm_silu_fwd_torch

    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(7, 16, generator=g), torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    pre = torch.full((7, 24), float("nan"))
    y = gemm_silu_fwd_torch(x, w, b, pre_out=pre)
    assert torch.allclose(pre, torch.addmm(b, x, w.t())) and torch.equal(y, torch.nn.functional.silu(pre))
    for bad, match in ((torch.zeros(7, 23), "pre_out"), (torch.zeros(7, 24, dtype=torch.float64), "pre_out")):
        with pytest.raises(ValueError, match=match):
            gemm_silu_fwd_torch(x, w, b, pre_out=bad)
    with pytest.raises(ValueError, match="different"):
        gemm_silu_fwd_torch(x, w, b, out=pre, pre_out=pre)


def test_torch_backend_refuses_outputs_that_share_memory():
    """out and pre_out of one buffer at different offsets, an output over x or W: each left a silently wrong
    result (the addmm reads an operand it overwrote, or SiLU's store clobbers the pre-activation); an output whose
    rows share memory failed inside torch. Column blocks of one buffer do not overlap: taken, and right."""
    from kernel_templates.gemm_silu.launch import gemm_silu_fwd_torch

    g = torch.Generator().manual_seed(2)
    m, n = 5, 8
    x, w, b = torch.randn(m, n, generator=g), torch.randn(n, n, generator=g), torch.randn(n, generator=g)
    ref_pre = torch.addmm(b, x, w.t())
    flat = torch.empty(m * n + n)
    cases = [
        ({"out": flat[: m * n].view(m, n), "pre_out": flat[n:].view(m, n)}, "different"),
        ({"out": flat[n:].view(m, n), "pre_out": flat[: m * n].view(m, n)}, "different"),
        ({"out": torch.empty(m, n), "pre_out": "x"}, "pre_out shares memory with the input x"),
        ({"pre_out": "w"}, "pre_out shares memory with the input weight"),
        ({"out": "x"}, "out shares memory with the input x"),
        ({"pre_out": torch.empty(1, n).expand(m, n)}, "pre_out has elements that share memory"),
    ]
    for kw, match in cases:
        xc, wc = x.clone(), w.clone()
        kw = {k: xc if v == "x" else wc[:m] if v == "w" else v for k, v in kw.items()}
        with pytest.raises(ValueError, match=match):
            gemm_silu_fwd_torch(xc, wc, b, **kw)
    both = torch.full((m, 2 * n), float("nan"))
    y = gemm_silu_fwd_torch(x, w, b, out=both[:, :n], pre_out=both[:, n:])
    assert y.data_ptr() == both.data_ptr()
    torch.testing.assert_close(both[:, n:], ref_pre)
    torch.testing.assert_close(both[:, :n], torch.nn.functional.silu(ref_pre))
    # Zero rows: empty buffers share nothing, even one tensor given for both.
    empty = torch.empty(0, n)
    assert gemm_silu_fwd_torch(x[:0], w, b, out=empty, pre_out=empty).shape == (0, n)


def test_torch_backend_writes_silu_into_out_without_a_temporary():
    """With out and pre_out, SiLU writes out itself: the tuner timed the torch backend with an extra (M, N)
    temporary and copy, a cost the fused layer (out=None) never pays."""
    from kernel_templates.gemm_silu.launch import gemm_silu_fwd_torch

    x, w, b = torch.randn(7, 16), torch.randn(24, 16), torch.randn(24)

    def copies(**kw) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            gemm_silu_fwd_torch(x, w, b, **kw)
        return sum(e.name == "aten::copy_" for e in prof.events())

    y, pre = torch.empty(7, 24), torch.empty(7, 24)
    assert copies(out=y, pre_out=pre) == copies(pre_out=torch.empty(7, 24))
    torch.testing.assert_close(y, torch.nn.functional.silu(pre), rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- GPU


def _inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0, bias: bool = True):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to("cuda", dtype)
    b = (torch.randn(n, generator=g) * 0.5).to("cuda", dtype) if bias else None
    return x, w, b


def _check(m, n, k, dtype, cfg, bias=True, seed=0):
    from kernel_templates.hstu_attention.testing import check_tolerance

    x, w, b = _inputs(m, n, k, dtype, seed, bias)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    gemm_silu(x, w, b, config=cfg, out=out)
    torch.cuda.synchronize()
    ref = gemm_silu_reference(x, w, b)
    low = gemm_silu_reference(x, w, b, compute_dtype=dtype)
    check_tolerance("out", out, ref, low)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("m", [1, 77, 1000, 4096 + 45])
def test_gpu_default_config(m, dtype):
    _check(m, 4096, 1024, dtype, None)


GPU_GRID = [
    (C(128, 256, 64, 2, 1, 4, "n"), "bfloat16", 4096, 1024, True),
    (C(128, 128, 64, 1, 2, 5, "m"), "bfloat16", 1024, 4096, True),
    (C(128, 128, 64, 2, 2, 4, "n"), "bfloat16", 1024, 1024, False),
    (C(64, 128, 64, 1, 1, 6, "n"), "bfloat16", 512, 256, True),
    (C(192, 128, 64, 1, 1, 4, "n"), "bfloat16", 1024, 512, True),
    (C(192, 64, 64, 1, 2, 6, "m"), "float16", 1024, 512, True),
    (C(128, 192, 32, 1, 1, 6, "n"), "bfloat16", 1000, 1000, True),
    (C(128, 96, 128, 1, 1, 3, "n"), "bfloat16", 520, 1032, True),
    (C(64, 256, 64, 2, 1, 5, "n", True, True), "bfloat16", 1000, 1000, True),
    (C(64, 128, 32, 1, 2, 6, "m", True, True), "float16", 520, 1032, False),
]


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", GPU_GRID, ids=_id)
def test_gpu_configs(case):
    cfg, dtype, n, k, bias = case
    _check(1337, n, k, getattr(torch, dtype), cfg, bias=bias, seed=3)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "cfg",
    [None, C(128, 256, 64, 1, 1, 4, "n"), C(192, 128, 64, 1, 1, 4, "m", True), C(128, 256, 64, 2, 1, 4, "n")]
    + [C(128, 256, 64, 2, 1, 3, "n", True), C(128, 128, 64, 1, 2, 4, "m", True)]
    + [C(64, 256, 64, 1, 1, 4, "m", True, True), C(64, 256, 64, 2, 1, 4, "n", True, True)],
    ids=["default", "grid", "persistent-m", "cluster"] + ["persistent-c21", "persistent-c12-m"] + ["pp", "pp-c21"],
)
@pytest.mark.parametrize("m", [1, 77, 4096 + 45, 40000])
def test_gpu_pre_activation_output(cfg, m):
    """y and the stored pre-activation against the fp32 reference; every element written (NaN-filled outputs),
    on grids of fewer and of more tiles than SMs."""
    from kernel_templates.gemm_silu.op import gemm_silu_fwd
    from kernel_templates.hstu_attention.testing import check_tolerance

    x, w, b = _inputs(m, 1024, 512, torch.bfloat16, seed=m)
    y, pre = (torch.full((m, 1024), float("nan"), dtype=torch.bfloat16, device="cuda") for _ in "yp")
    gemm_silu_fwd(x, w, b, cfg, out=y, pre_out=pre)
    ref_y, low_y = gemm_silu_reference(x, w, b), gemm_silu_reference(x, w, b, torch.bfloat16)
    ref_pre, low_pre = gemm_silu_pre_reference(x, w, b), gemm_silu_pre_reference(x, w, b, torch.bfloat16)
    check_tolerance("y", y, ref_y, low_y)
    check_tolerance("pre", pre, ref_pre, low_pre)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize(
    "tile_m, tile_n, cluster_m, pingpong",
    [(128, 96, 1, False), (128, 160, 1, False), (128, 224, 1, False), (128, 160, 2, False), (64, 96, 1, True),
     (64, 160, 2, True)],
)  # fmt: skip
def test_gpu_persistent_odd_store_counts(tile_m, tile_n, cluster_m, pingpong):
    """tile_n / 32 sub-tiles, an odd count: the next tile's first store reuses the buffer of the last one."""
    cfg = C(tile_m, tile_n, 64, cluster_m, 1, 4, "n", True, pingpong)
    _check(40000, 3 * 7 * 32 * 2, 512, torch.bfloat16, cfg, seed=tile_n)


def _random_shapes(count: int, seed: int) -> list[tuple]:
    """(m, n, k, dtype, bias, pre): M from 1 to ~60K, N multiples of 8 (often of 256, where the default is the
    pingpong pair), K multiples of 8 with tails past every k-tile."""
    import random

    rng = random.Random(seed)
    shapes = []
    for _ in range(count):
        n = 256 * rng.randint(1, 12) if rng.random() < 0.7 else 8 * rng.randint(1, 300)
        k = 8 * rng.randint(1, 300)
        m = rng.choice([1, rng.randint(2, 700), rng.randint(700, 60000), rng.randint(20000, 60000)])
        shapes.append((m, n, k, rng.choice([torch.bfloat16, torch.float16]), rng.random() < 0.7, rng.random() < 0.6))
    return shapes


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("case", _random_shapes(20, seed=2027), ids=lambda c: f"m{c[0]}n{c[1]}k{c[2]}")
def test_gpu_default_config_on_random_shapes(case):
    """The default config (the pingpong pair for a large M and N a multiple of 256) on shapes nobody tuned:
    y and the pre-activation against the fp32 reference, NaN-filled outputs."""
    from kernel_templates.gemm_silu.op import gemm_silu_fwd
    from kernel_templates.hstu_attention.testing import check_tolerance

    m, n, k, dtype, bias, pre = case
    x, w, b = _inputs(m, n, k, dtype, seed=m + n + k, bias=bias)
    y, p = (torch.full((m, n), float("nan"), dtype=dtype, device="cuda") for _ in "yp")
    gemm_silu_fwd(x, w, b, None, out=y, pre_out=p if pre else None)
    check_tolerance("y", y, gemm_silu_reference(x, w, b), gemm_silu_reference(x, w, b, dtype))
    if pre:
        check_tolerance("pre", p, gemm_silu_pre_reference(x, w, b), gemm_silu_pre_reference(x, w, b, dtype))


@pytest.mark.gpu
@pytest.mark.sm90
def test_gpu_empty_m():
    x, w, b = _inputs(0, 256, 128, torch.bfloat16)
    assert gemm_silu(x, w, b).shape == (0, 256)


@pytest.mark.gpu
@pytest.mark.sm90
@pytest.mark.parametrize("bias", [True, False])
def test_gpu_autograd(bias):
    x, w, b = _inputs(300, 512, 256, torch.bfloat16, seed=5, bias=bias)
    leaves = [t.requires_grad_(True) for t in (x, w, b) if t is not None]
    y = gemm_silu(x, w, b)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    ref = gemm_silu_reference(*ref_leaves, *([] if bias else [None]))
    ref_grads = torch.autograd.grad(ref, ref_leaves, dy.float())
    low_leaves = [t.detach().requires_grad_(True) for t in leaves]
    low = gemm_silu_reference(*low_leaves, *([] if bias else [None]), compute_dtype=torch.bfloat16)
    low_grads = torch.autograd.grad(low, low_leaves, dy)
    from kernel_templates.hstu_attention.testing import check_tolerance

    for name, g, r, lo in zip(("dx", "dw", "db"), grads, ref_grads, low_grads, strict=False):
        # Wider slack than the bf16 row of the table: dW and db sum all 300 rows in fp32 in both the kernel and
        # torch, so torch's own error says little of the kernel's (a different order over rounded dY * SiLU').
        check_tolerance(name, g, r, lo, atol=1e-2 * r.abs().max().item() + 1e-4)
