"""The fused HSTU layer (autotune.runtime.layer) against the unfused one, and its switches.

On CPU (Triton interpreter, fp32) the fused layer runs every dispatched kernel's default; on a GPU
the same tests run bf16 with the GPU backends. Compared: output and every gradient (x and all eight
parameters) on jagged batches with empty, length-1 and non-tile-multiple sequences.
"""

from __future__ import annotations

import pytest
import torch

from autotune.runtime import dispatch
from models.config import get_config
from models.hstu import HSTULayer, HSTURankingModel

LENGTHS = [0, 1, 5, 17, 32, 0, 9]


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def _dtype(device: str) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def _batch(device: str, hidden: int, lengths: list[int] = LENGTHS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), hidden, generator=gen).to(device)
    dout = torch.randn(sum(lengths), hidden, generator=gen).to(device)
    return x, offsets, dout


def _run(cfg, x, offsets, dout, device, state_dict=None, seed=0):
    """Output and gradients (x first, then parameters by name) of one layer call under autocast;
    ``seed`` seeds torch's generator after the layer is built (the dropout mask's seed is drawn from it)."""
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    if state_dict is not None:
        layer.load_state_dict(state_dict)
    torch.manual_seed(seed)
    xg = x.clone().requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out = layer(xg, offsets)
    out.float().backward(dout.float())
    grads = {"x": xg.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    return out.detach().float(), grads, layer.state_dict()


def _params(layer: HSTULayer) -> dict[str, torch.Tensor]:
    """``hstu_layer``'s parameter dict of an ``HSTULayer``."""
    return {"ln1_w": layer.input_norm.weight, "ln1_b": layer.input_norm.bias, "w_uvqk": layer.uvqk.weight,
            "b_uvqk": layer.uvqk.bias, "ln2_w": layer.attn_norm.weight, "ln2_b": layer.attn_norm.bias,
            "w_o": layer.out_proj.weight, "b_o": layer.out_proj.bias}  # fmt: skip


def _close(a: torch.Tensor, b: torch.Tensor, name: str, device: str) -> None:
    """fp32: tight; bf16 (GPU): relative to the largest value, as bf16 GEMM chains allow."""
    a, b = a.float(), b.float()
    scale = b.abs().max().clamp_min(1e-6)
    tol = 1e-4 if device == "cpu" else 3e-2
    err = ((a - b).abs().max() / scale).item()
    assert err <= tol, f"{name}: max error {err:.2e} of the largest value (tolerance {tol:.0e})"


def test_fused_layer_matches_unfused(device):
    cfg = get_config("tiny", dropout=0.0, max_seq_len=32)
    x, off, dout = _batch(device, cfg.hidden_dim)
    ref_out, ref_grads, sd = _run(cfg, x, off, dout, device)
    out, grads, _ = _run(cfg.replace(layer="fused"), x, off, dout, device, sd)
    _close(out, ref_out, "out", device)
    for name, g in ref_grads.items():
        _close(grads[name], g, f"d{name}", device)
    # Rows of empty and length-1 sequences are finite and the residual passes through.
    assert torch.isfinite(out).all() and torch.isfinite(grads["x"]).all()


@pytest.mark.parametrize("recompute", ["uvqk", "ln", "uvqk+ln", "pre", "pre+ln"])
def test_recompute_gives_identical_gradients(device, recompute):
    """Recomputing LN(x) redoes the same kernel: bit-identical. Recomputing SiLU ("uvqk") redoes the torch
    backend's SiLU bit for bit; after the CuTe kernel's fused SiLU (its own formula, from the fp32
    pre-activation) it is equal within rounding. Recomputing the pre-activation ("pre") is a GEMM outside the
    forward's kernel: equal within rounding."""
    cfg = get_config("tiny", dropout=0.2, max_seq_len=32, layer="fused")
    x, off, dout = _batch(device, cfg.hidden_dim, seed=1)
    base_out, base_grads, sd = _run(cfg, x, off, dout, device, seed=5)
    out, grads, _ = _run(cfg.replace(recompute=recompute), x, off, dout, device, sd, seed=5)
    d = cfg.head_dim
    silu_backend = dispatch.select("gemm_silu", _dtype(device), d, d, cfg.num_heads, 32, None).backend
    if recompute.startswith("pre") or (recompute.startswith("uvqk") and silu_backend != "torch"):
        _close(out, base_out, "out", device)
        for name, g in base_grads.items():
            _close(grads[name], g, f"d{name}", device)
        return
    assert torch.equal(out, base_out)
    for name, g in base_grads.items():
        assert torch.equal(grads[name], g), f"d{name} differs with recompute={recompute}"


@pytest.mark.parametrize("reentrant", [False, True])
def test_fused_layer_under_activation_checkpointing(device, reentrant):
    """``torch.utils.checkpoint`` (non-reentrant, torch's recommended mode) lets a backward unpack each saved tensor
    once; the layer's backward read ``ctx.saved_tensors`` twice and failed with a CheckpointError. Checkpointed, the
    layer gives the plain call's output and gradients (the dropout mask too: the RNG state is replayed)."""
    from torch.utils.checkpoint import checkpoint

    cfg = get_config("tiny", dropout=0.2, max_seq_len=32, layer="fused")
    x, off, dout = _batch(device, cfg.hidden_dim, seed=4)
    out, grads, sd = _run(cfg, x, off, dout, device, seed=3)
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    layer.load_state_dict(sd)
    torch.manual_seed(3)
    xg = x.clone().requires_grad_(True)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        out2 = checkpoint(layer, xg, off, use_reentrant=reentrant)
    out2.float().backward(dout.float())
    grads2 = {"x": xg.grad, **{n: p.grad for n, p in layer.named_parameters()}}
    _close(out2.detach().float(), out, "out", device)
    for name, g in grads.items():
        _close(grads2[name], g, f"d{name}", device)


def test_zero_copy_views_match_copies(device):
    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    x, off, dout = _batch(device, cfg.hidden_dim, seed=2)
    out, grads, sd = _run(cfg, x, off, dout, device)
    out2, grads2, _ = _run(cfg.replace(zero_copy=False), x, off, dout, device, sd)
    _close(out2, out, "out", device)
    for name, g in grads.items():
        _close(grads2[name], g, f"d{name}", device)


@pytest.mark.parametrize("recompute", ["none", "uvqk", "pre"])
def test_du_silu_gives_the_gradients_of_the_silu_pass(device, recompute):
    """u's SiLU' inside the LN * u + dropout backward (and the pass in place over the other columns) against the
    pass over every column: same output, gradients within one rounding of d pre (only where the pre-activation
    is kept; "pre" recomputes it and runs the pass as before)."""
    cfg = get_config("tiny", dropout=0.2, max_seq_len=32, layer="fused", recompute=recompute)
    x, off, dout = _batch(device, cfg.hidden_dim, seed=6)
    base_out, base_grads, sd = _run(cfg.replace(du_silu=False), x, off, dout, device, seed=3)
    out, grads, _ = _run(cfg, x, off, dout, device, sd, seed=3)
    assert torch.equal(out, base_out)
    for name, g in base_grads.items():
        _close(grads[name], g, f"d{name}", device)


@pytest.mark.parametrize("order", ["wgrad_first", "side_stream"])
def test_output_projection_backward_runs_the_dispatched_order(device, monkeypatch, order):
    """The layer's backward runs ``linear_residual_bwd`` as dispatch chooses it: with another order chosen (as a
    tuned entry would), the launcher is called with that config, and the output and every gradient still match the
    unfused layer (the side stream's work joined before the backward returns; on CPU it runs serial)."""
    import dataclasses

    from kernel_templates.linear_residual.bwd_impl import LinearResidualBwdConfig

    kind, select, launcher = "linear_residual_bwd", dispatch.select, dispatch.launcher
    seen = []

    def tuned(k, *args, **kw):
        c = select(k, *args, **kw)
        return dataclasses.replace(c, config=f'{{"order": "{order}"}}', source="tuned") if k == kind else c

    def spy(backend, k):
        fn = launcher(backend, k)
        if k != kind:
            return fn

        def run(*args, **kw):
            seen.append(kw["config"])
            assert isinstance(kw.get("pending"), list)
            return fn(*args, **kw)

        return run

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32)
    x, off, dout = _batch(device, cfg.hidden_dim, seed=4)
    ref_out, ref_grads, sd = _run(cfg, x, off, dout, device)
    monkeypatch.setattr(dispatch, "select", tuned)
    monkeypatch.setattr(dispatch, "launcher", spy)
    out, grads, _ = _run(cfg.replace(layer="fused"), x, off, dout, device, sd)
    assert seen and all(c == LinearResidualBwdConfig(order) for c in seen)
    _close(out, ref_out, "out", device)
    for name, g in ref_grads.items():
        _close(grads[name], g, f"d{name}", device)


def test_layer_flags_are_checked():
    from autotune.runtime.layer import plan_layer

    with pytest.raises(ValueError, match="du_silu must be a bool"):
        get_config("tiny", layer="fused", du_silu="yes")
    for name in ("recompute_ln", "zero_copy", "du_silu"):
        with pytest.raises(ValueError, match=f"{name} must be a bool"):
            plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.0, "default", **{name: 1})


def test_dropout_mask_comes_from_the_generator(device):
    """Another torch seed draws another mask; the same seed gives the same output and gradients."""
    cfg = get_config("tiny", dropout=0.5, max_seq_len=32, layer="fused")
    x, off, dout = _batch(device, cfg.hidden_dim, lengths=[32, 32], seed=3)
    a, ga, sd = _run(cfg, x, off, dout, device, seed=1)
    b, gb, _ = _run(cfg, x, off, dout, device, sd, seed=2)
    assert not torch.equal(a, b)
    a2, ga2, _ = _run(cfg, x, off, dout, device, sd, seed=1)
    assert torch.equal(a, a2) and torch.equal(ga["uvqk.weight"], ga2["uvqk.weight"])
    _close(ga["out_proj.bias"], dout.float().sum(0), "db_o", device)


def test_fused_model_trains_like_unfused(device):
    """Three steps of the tiny model: the fused layer's losses follow the unfused layer's."""
    from models.data import SyntheticJaggedDataset
    from models.train import build

    base = get_config("tiny", dropout=0.0)
    data = SyntheticJaggedDataset(base)
    losses = {}
    for layer in ("unfused", "fused"):
        model, opt = build(base.replace(layer=layer), torch.device(device))
        assert isinstance(model, HSTURankingModel)
        seq = []
        for step in range(3):
            loss = model.loss(data.batch(step).to(device))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            seq.append(loss.item())
        losses[layer] = seq
    for a, b in zip(losses["fused"], losses["unfused"], strict=True):
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), losses


def test_config_rejects_unsupported_combinations():
    with pytest.raises(ValueError, match="layer"):
        get_config("tiny", layer="fast")
    with pytest.raises(ValueError, match="recompute"):
        get_config("tiny", recompute="everything", layer="fused")
    with pytest.raises(ValueError, match="need layer='fused'"):
        get_config("tiny", precision="bf16")
    with pytest.raises(ValueError, match="kernels must be"):
        get_config("tiny", layer="fused", kernels="reference")


@pytest.mark.parametrize(
    ("offsets", "max_seq_len", "match"),
    [
        ([0, 40, 43], 32, "max_seq_len=32 is below the longest sequence"),
        ([0, 4, 8], 32, "seq_offsets must end at L = 10"),
        ([0, 6, 4, 10], 32, "non-decreasing"),
        ([1, 4, 10], 32, "seq_offsets must start at 0"),
    ],
)
def test_fused_layer_rejects_bad_offsets_like_the_attention_call(offsets, max_seq_len, match):
    """The layer's kernels take the offsets as given: the call checks them first, as ``hstu_attention`` does."""
    from autotune.runtime.layer import hstu_layer, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=max_seq_len, layer="fused")
    layer = HSTULayer(cfg)
    rows = 43 if offsets[-1] == 43 else 10
    x = torch.randn(rows, cfg.hidden_dim)
    off = torch.tensor(offsets, dtype=torch.int64)
    with pytest.raises(ValueError, match=match):
        layer(x, off)
    plan = plan_layer(torch.float32, cfg.num_heads, cfg.head_dim, max_seq_len, 0.1, cfg.eps, 0.0, "default")
    params = _params(layer)
    seed = torch.zeros(1, dtype=torch.int64)
    for mode in ("full", "async"):
        with pytest.raises(ValueError, match=match):
            hstu_layer(x, params, off, plan, seed, validate=mode)
    with pytest.raises(ValueError, match="seq_offsets must be int32 or int64"):
        hstu_layer(x, params, off.float(), plan, seed)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        hstu_layer(x[None], params, off, plan, seed)


def test_fused_layer_launches_past_the_grid_limit_for_the_longest_sequence(device, monkeypatch):
    """The layer's attention steps size their launch as the public call does: with the grid limit shrunk to one
    block, a loose max_seq_len over the batch's rows launches for the longest sequence (read from the offsets,
    warned), giving the same output and gradients as a launch within the limit."""
    from autotune.runtime.layer import hstu_layer, plan_layer
    from kernel_templates.hstu_attention import input_check

    cfg = get_config("tiny", dropout=0.0, max_seq_len=4096, layer="fused")
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    x, off, dout = _batch(device, cfg.hidden_dim, [0, 1, 5, 16, 16, 0, 9, 16, 16] * 3)
    dt = _dtype(device)
    plan = plan_layer(dt, cfg.num_heads, cfg.head_dim, 4096, 0.1, cfg.eps, 0.0, "default")
    params = _params(layer)
    seed = torch.zeros(1, dtype=torch.int64, device=device)

    def run():
        xg = x.to(dt).clone().requires_grad_(True)
        out = hstu_layer(xg, params, off, plan, seed)
        grads = torch.autograd.grad(out, [xg, *params.values()], dout.to(out.dtype))
        return out, grads

    want, want_grads = run()
    monkeypatch.setattr(input_check, "GRID_YZ_MAX", 1)
    with pytest.warns(UserWarning, match="longest sequence was read from seq_offsets"):
        got, got_grads = run()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    tol = 1e-6 if device == "cpu" else 2e-2  # a GPU backward's dQ may sum by atomics, in any order
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


@pytest.mark.parametrize("hint", [None, "uniform"])
def test_fused_layer_chooses_attention_by_the_calls_fill(device, monkeypatch, hint):
    """With tuned kernels and no distribution declared, the layer's attention kernels are chosen per call as
    ``hstu_attention`` chooses them: by the longest length the rows allow and the batch's fill
    L / (B x max_seq_len), the same choice in forward and backward (a jagged batch runs the entry for its fill, not
    the plan's, which was chosen with no batch at hand). A declared distribution keeps the plan's choice. Output
    and gradients match the plan's own."""
    import dataclasses
    import json

    from autotune.runtime.layer import hstu_layer, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    params = _params(layer)
    x, off, dout = _batch(device, cfg.hidden_dim)  # 64 rows in 7 sequences of at most 32
    dt = _dtype(device)
    plan = plan_layer(dt, cfg.num_heads, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "tuned", hint)  # no file: defaults
    seed = torch.zeros(1, dtype=torch.int64, device=device)

    def run():
        xg = x.to(dt).clone().requires_grad_(True)
        out = hstu_layer(xg, params, off, plan, seed)
        return out, torch.autograd.grad(out, [xg, *params.values()], dout.to(out.dtype))

    want, want_grads = run()
    select, launcher, asked, launched = dispatch.select, dispatch.launcher, [], {}

    def by_fill(kind, *args, **kw):  # for skewed batches, a choice other than the plan's (its l2_group)
        c = select(kind, *args, **kw)
        if not kind.startswith("hstu_attention"):
            return c
        asked.append((kind, args[4], args[5], kw.get("fill")))
        config = json.loads(c.config)
        if kw.get("fill") is not None and kw["fill"] < 0.5:
            config["l2_group"] = 1 if config["l2_group"] != 1 else 2
        return dataclasses.replace(c, config=json.dumps(config), source="tuned")

    def spy(backend, kind):
        fn = launcher(backend, kind)

        def run(*args, **kw):
            launched[kind] = args[-1]  # the config, after q, k, v and the launch arguments
            return fn(*args, **kw)

        return run if kind.startswith("hstu_attention") else fn

    monkeypatch.setattr(dispatch, "select", by_fill)
    monkeypatch.setattr(dispatch, "launcher", spy)
    got, got_grads = run()
    fill = 64 / (7 * 32) if hint is None else None
    # Each attention call sizes its launch for both kinds (their grids must agree): forward and backward ask alike.
    assert set(asked) == (
        {("hstu_attention_bwd", 32, None, fill), ("hstu_attention_fwd", 32, None, fill)} if hint is None else set()
    )
    for kind in ("hstu_attention_fwd", "hstu_attention_bwd"):
        changed = launched[kind].l2_group != plan.step(kind).config.l2_group
        assert changed == (hint is None), (kind, launched[kind], plan.step(kind).config)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    tol = 1e-6 if device == "cpu" else 2e-2  # a GPU backward's dQ may sum by atomics, in any order
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_fused_layer_backward_launches_the_attention_config_its_forward_chose(device, monkeypatch):
    """The attention kernels chosen by fill were chosen again by the backward: artifacts loaded between a call's
    forward and backward (another thread, a reload) gave its backward the new files' attention config beside the
    plan's other steps. The backward launches what the forward chose, and asks dispatch nothing."""
    import dataclasses
    import json

    from autotune.runtime.layer import hstu_layer, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    torch.manual_seed(0)
    params = _params(HSTULayer(cfg).to(device))
    x, off, dout = _batch(device, cfg.hidden_dim)
    dt = _dtype(device)
    plan = plan_layer(dt, cfg.num_heads, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "tuned", None)
    xg = x.to(dt).clone().requires_grad_(True)
    out = hstu_layer(xg, params, off, plan, torch.zeros(1, dtype=torch.int64, device=device))
    select, launcher, asked, launched = dispatch.select, dispatch.launcher, [], {}

    def reloaded(kind, *args, **kw):  # what other artifacts choose for the same call
        asked.append(kind)
        c = select(kind, *args, **kw)
        config = json.loads(c.config)
        if kind.startswith("hstu_attention"):
            config["l2_group"] = 1 if config["l2_group"] != 1 else 2
        return dataclasses.replace(c, config=json.dumps(config))

    def spy(backend, kind):
        fn = launcher(backend, kind)

        def run(*args, **kw):
            launched[kind] = args[-1]
            return fn(*args, **kw)

        return run

    monkeypatch.setattr(dispatch, "select", reloaded)
    monkeypatch.setattr(dispatch, "launcher", spy)
    out.backward(dout.to(out.dtype))
    assert launched["hstu_attention_bwd"] == plan.step("hstu_attention_bwd").config  # no file: the plan's default
    assert not [k for k in asked if k.startswith("hstu_attention")]


def test_a_symbolic_batch_takes_the_plans_attention_step():
    """``hstu_attention`` matches by fill only when rows and batch are plain ints; the layer checked the rows alone,
    so a traced call with a symbolic batch (a fake tensor's SymInt) computed a symbolic fill and failed in
    ``fill_bin``. It takes the plan's step, as the public call takes the bucket's entry."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    from autotune.runtime import layer

    mode = FakeTensorMode(shape_env=ShapeEnv())
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC])
    offsets = mode.from_tensor(torch.zeros(8, dtype=torch.int32), symbolic_context=dynamic)
    assert type(offsets.shape[0]) is torch.SymInt
    plan = layer.plan_layer(torch.float32, 2, 32, 32, 0.1, 1e-5, 0.0, "tuned", None)
    for kind in ("hstu_attention_fwd", "hstu_attention_bwd"):
        assert layer._attention_step(plan, kind, offsets, 64, 32) is plan.step(kind)


def test_fused_layer_names_a_parameter_of_the_wrong_shape(device):
    """``hstu_layer`` reads its parameters by the plan's heads x head_dim: one of another shape (a projection
    with extra rows was read in part, silently), a missing one or a plan of other heads is a ValueError naming
    it; ``plan_layer`` refuses a head dim the attention kernels lack."""
    from autotune.runtime.layer import hstu_layer, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    layer = HSTULayer(cfg).to(device)
    x, off, _ = _batch(device, cfg.hidden_dim)
    plan = plan_layer(torch.float32, cfg.num_heads, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "default")
    params = _params(layer)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    wide = torch.cat([params["w_uvqk"], params["w_uvqk"][:32]])
    for bad, match in (
        ({**params, "w_uvqk": wide}, r"params\['w_uvqk'\] must have shape"),
        ({**params, "b_uvqk": params["b_uvqk"][:-1]}, r"params\['b_uvqk'\] must have shape"),
        ({k: t for k, t in params.items() if k != "w_o"}, "params must be a dict of"),
    ):
        with pytest.raises(ValueError, match=match):
            hstu_layer(x, bad, off, plan, seed)
    other = plan_layer(torch.float32, cfg.num_heads * 2, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "default")
    with pytest.raises(ValueError, match=r"params\['w_uvqk'\] must have shape .* heads 4"):
        hstu_layer(x, params, off, other, seed)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        plan_layer(torch.float32, cfg.num_heads, 48, 32, 0.1, cfg.eps, 0.0, "default")
    assert hstu_layer(x, params, off, plan, seed).shape == x.shape


@pytest.mark.parametrize(
    "override, match",
    [
        ({"dtype": torch.float64}, "dtype must be one of"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"alpha": float("nan")}, "alpha must be finite"),
        ({"alpha": float("inf")}, "alpha must be finite"),
        ({"alpha": "0.1"}, "alpha must be a number"),
        # None was refused with "alpha must be a number or None": the plan has no default alpha
        ({"alpha": None}, r"alpha must be a number, got None \(only hstu_attention defaults it"),
        ({"head_dim": 32.0}, "head_dim must be one of"),
        ({"max_seq_len": 0}, "max_seq_len must be a positive int below 2"),
        ({"max_seq_len": 2**31}, "max_seq_len must be a positive int below 2"),
        ({"max_seq_len": 32.0}, "max_seq_len must be a positive int below 2"),
    ],
)
def test_plan_refuses_what_the_kernels_would_compute_wrongly(override, match):
    """A float64 plan ran the kernels and returned wrong outputs and gradients (errors of order 1), and a NaN or
    infinite alpha NaN outputs, without a word: the attention call refuses both, so the layer's plan does too. Its
    max_seq_len as well: the attention launchers take the layer's lengths unchecked."""
    from autotune.runtime.layer import plan_layer

    args = {"dtype": torch.float32, "heads": 2, "head_dim": 32, "max_seq_len": 32, "alpha": 0.1, "eps": 1e-5,
            "dropout": 0.0, "source": "default", **override}  # fmt: skip
    with pytest.raises(ValueError, match=match):
        plan_layer(**args)


def test_a_plan_built_across_a_load_is_not_kept(tmp_path, monkeypatch):
    """``autotune.load`` in another thread while a plan's kernels are chosen (simulated by a load inside the
    first choice): the plan, made of the old state's choices, was cached after the load dropped the plans, so
    every later layer call kept running it. It is used once and chosen again from the new state."""
    import warnings

    from autotune.runtime.layer import plan_layer

    select = dispatch.select

    def load_meanwhile(*args, **kwargs):
        monkeypatch.setattr(dispatch, "select", select)
        dispatch.load(tmp_path, gpu="h100")  # no files there: every kernel's default, from a new state
        return select(*args, **kwargs)

    monkeypatch.setattr(dispatch, "select", load_meanwhile)
    args = {"dtype": torch.float32, "heads": 2, "head_dim": 32, "max_seq_len": 32, "alpha": 0.1, "eps": 1e-5,
            "dropout": 0.0}  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.DispatchWarning)
        first = plan_layer(**args)
        second = plan_layer(**args)
        assert second is not first and plan_layer(**args) is second


@pytest.mark.parametrize("view", ["every_other_column", "transposed"])
def test_layer_ops_on_column_strided_x_match_contiguous(device, view):
    """``hstu_layer`` and ``layer_norm`` on an x whose columns are strided (a ``[:, ::2]`` slice, a transpose)
    give the output and gradients of ``x.contiguous()``, the gradient reaching the view's base: the kernels
    step columns by 1, and such an x was a ValueError from the LayerNorm launcher."""
    from autotune.runtime.layer import hstu_layer, layer_norm, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    dt = _dtype(device)
    plan = plan_layer(dt, cfg.num_heads, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "default")
    params = _params(layer)
    _, off, _ = _batch(device, cfg.hidden_dim)
    rows, hidden = int(off[-1]), cfg.hidden_dim
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(*((rows, 2 * hidden) if view == "every_other_column" else (hidden, rows)), generator=gen)
    seed = torch.zeros(1, dtype=torch.int64, device=device)

    def make(b: torch.Tensor) -> torch.Tensor:
        return b[:, ::2] if view == "every_other_column" else b.t()

    calls = {
        "layer_norm": lambda x: layer_norm(x, params["ln1_w"], params["ln1_b"], cfg.eps, plan),
        "hstu_layer": lambda x: hstu_layer(x, params, off, plan, seed),
    }
    for name, call in calls.items():
        results = []
        for copy in (False, True):
            b = base.to(device, dt).clone().requires_grad_(True)
            x = make(b)
            assert x.shape == (rows, hidden) and x.stride(1) != 1
            out = call(x.contiguous() if copy else x)
            out.float().backward(torch.linspace(-1, 1, out.numel(), device=device).view(out.shape))
            results.append((out.detach().float(), b.grad))
        (got, got_grad), (want, want_grad) = results
        _close(got, want, f"{name} output", device)
        _close(got_grad, want_grad, f"{name} gradient of x", device)


@pytest.mark.parametrize("call", ["hstu_layer", "layer_norm"])
def test_a_gradient_of_the_fused_layers_gradient_raises_instead_of_dropping_terms(call, device):
    """The layer's kernels give first-order gradients only. Under ``create_graph=True`` they were returned as
    constants, so a second derivative silently lost the layer's terms (here it was exactly the 6x of the x**3
    term beside the layer). It now raises, naming the layer; ``create_graph`` alone still works."""
    from autotune.runtime.layer import hstu_layer, layer_norm, plan_layer

    cfg = get_config("tiny", dropout=0.0, max_seq_len=32, layer="fused")
    torch.manual_seed(0)
    layer = HSTULayer(cfg).to(device)
    plan = plan_layer(torch.float32, cfg.num_heads, cfg.head_dim, 32, 0.1, cfg.eps, 0.0, "default")
    params = _params(layer)
    x, off, _ = _batch(device, cfg.hidden_dim, [3, 0, 7])
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    fns = {
        "hstu_layer": lambda t: hstu_layer(t, params, off, plan, seed),
        "layer_norm": lambda t: layer_norm(t, params["ln1_w"], params["ln1_b"], cfg.eps, plan),
    }
    xg = x.clone().requires_grad_(True)
    loss = fns[call](xg).pow(2).sum() + xg.pow(3).sum()
    (gx,) = torch.autograd.grad(loss, xg, create_graph=True)
    with pytest.raises(RuntimeError, match="fused layer's gradients are not differentiable"):
        torch.autograd.grad(gx.sum(), xg)
    (gw,) = torch.autograd.grad(fns[call](xg).sum(), params["ln1_w"], create_graph=True)
    assert gw.shape == params["ln1_w"].shape


@pytest.mark.parametrize("hint", ["jagged", "sparse", "uniform", None])
def test_a_pinned_hint_reaches_only_the_attention_kernels(monkeypatch, hint):
    """The model's ``attention_hint`` is about the attention calls' lengths: the layer's token-wise ops (LayerNorms,
    GEMMs, the residual projection) are chosen as without a hint, so a pinned "jagged" did not send them to entries
    they were never tuned on (one fallback warning each)."""
    from autotune.runtime import layer as layer_mod

    asked: dict[str, str | None] = {}
    select = dispatch.select

    def spy(kind, dtype, dqk, dv, heads, max_seq_len, distribution=None, *args, **kw):
        asked[kind] = distribution
        return select(kind, dtype, dqk, dv, heads, max_seq_len, distribution, *args, **kw)

    monkeypatch.setattr(dispatch, "select", spy)
    monkeypatch.setattr(layer_mod, "_PLANS", {})
    layer_mod.plan_layer(torch.float32, 2, 32, 64, 0.1, 1e-5, 0.0, "tuned", hint)
    assert set(asked) == set(layer_mod.LAYER_KERNELS)
    for kind, dist in asked.items():
        assert dist == (hint if kind.startswith("hstu_attention") else None), kind
