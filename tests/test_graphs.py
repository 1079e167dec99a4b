"""CUDA-graph training steps (models.graphs): padding rules and loss equivalence on CPU, the optimizer
state set-up, config errors; on a GPU, graphed training takes the same steps as eager training."""

from __future__ import annotations

import pytest
import torch

from autotune.runtime import dispatch
from models.config import get_config
from models.data import Sample, SyntheticJaggedDataset, collate_jagged
from models.graphs import (
    GraphedTrainStep,
    graph_capacity,
    pad_batch,
    padded_offsets,
    padding_lengths,
    padding_slots,
)
from models.train import build, parse_overrides, run


@pytest.fixture(autouse=True)
def _fresh_dispatch():
    dispatch.reset()
    yield
    dispatch.reset()


def test_capacity_and_padding_sequences():
    assert [graph_capacity(n, 32) for n in (0, 1, 31, 32, 33, 64)] == [32, 32, 32, 32, 64, 64]
    # 33 is 2, not 1: an empty batch pads a whole 33-row granule, more than one sequence of 32 holds.
    assert padding_slots(32, 32) == 1 and padding_slots(33, 32) == 2 and padding_slots(34, 32) == 2
    assert padding_slots(1, 32) == 1  # every captured batch has the same sequence count
    assert padding_lengths(0, 2, 32) == [0, 0]
    assert padding_lengths(70, 3, 32) == [32, 32, 6]
    assert padding_lengths(64, 3, 32) == [32, 32, 0]
    with pytest.raises(ValueError, match="do not fit"):
        padding_lengths(97, 3, 32)
    with pytest.raises(ValueError, match="granularity"):
        graph_capacity(5, 0)
    with pytest.raises(ValueError, match="capacity"):
        padded_offsets([10, 20], 16, 1, 32)


def test_padding_slots_hold_every_batch_including_an_empty_one():
    """Every batch, an empty one too (its capacity is one whole granule), pads into ``padding_slots`` sequences
    of at most max_seq_len; an empty batch needs one more when granularity - 1 is a multiple of max_seq_len."""
    for msl in (1, 5, 32):
        for gran in (1, 2, 6, 7, 31, 32, 33, 64, 65, 100):
            slots = padding_slots(gran, msl)
            for n in sorted({0, 1, gran - 1, gran, gran + 1, 3 * msl}):
                lengths = [msl] * (n // msl) + ([n % msl] if n % msl else [])
                offsets = padded_offsets(lengths, graph_capacity(n, gran), slots, msl)
                assert int(offsets[-1]) == graph_capacity(n, gran) and len(offsets) == len(lengths) + slots + 1
                assert int(offsets.diff().max()) <= msl, (msl, gran, n)


@pytest.mark.parametrize("granularity", [1, 7, 32, 100])
def test_pad_batch_layout(granularity):
    cfg = get_config("tiny")
    batch = SyntheticJaggedDataset(cfg).batch(3)
    n, b = batch.num_tokens, len(batch.lengths)
    cap, slots = graph_capacity(n, granularity), padding_slots(granularity, cfg.max_seq_len)
    padded = pad_batch(batch, cap, slots, cfg.max_seq_len)
    assert padded.num_tokens == cap and len(padded.lengths) == b + slots
    assert padded.lengths[:b] == batch.lengths and all(0 <= x <= cfg.max_seq_len for x in padded.lengths)
    assert padded.seq_offsets.tolist()[: b + 1] == batch.seq_offsets.tolist() and int(padded.seq_offsets[-1]) == cap
    for name in ("items", "prev_actions", "positions", "labels"):
        real, pad = getattr(padded, name)[:n], getattr(padded, name)[n:]
        assert torch.equal(real, getattr(batch, name)) and not pad.any(), name
    assert torch.allclose(padded.weights[:n], torch.full((n,), 1.0 / n)) and not padded.weights[n:].any()


@pytest.mark.parametrize("kernels", ["reference", "default"])
def test_padded_batch_gives_the_same_loss_and_gradients(kernels, device):
    """Padding sequences change nothing: the loss and every gradient equal the unpadded batch's."""
    cfg = get_config("tiny", kernels=kernels, dropout=0.0)
    model, _ = build(cfg, torch.device(device))
    data = SyntheticJaggedDataset(cfg)
    # a full sequence, an empty one, a length-1 one and a non-tile-multiple one; granularity 45 needs two
    # padding sequences (max_seq_len 32)
    cut = lambda s, n: Sample(s.items[:n], s.prev_actions[:n], s.labels[:n])  # noqa: E731
    batch = collate_jagged([data.gen[0], cut(data.gen[1], 0), cut(data.gen[2], 1), cut(data.gen[3], 13)])
    assert batch.lengths[1:] == [0, 1, 13]
    batch = batch.to(device)
    for granularity in (16, 45):
        grads = []
        for b in (batch, pad_batch(batch, graph_capacity(batch.num_tokens, granularity),
                                   padding_slots(granularity, cfg.max_seq_len), cfg.max_seq_len)):  # fmt: skip
            model.zero_grad(set_to_none=True)
            loss = model.loss(b)
            loss.backward()
            grads.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        torch.testing.assert_close(grads[1][0], grads[0][0], atol=1e-6, rtol=1e-6)
        for name, g in grads[0][1].items():
            torch.testing.assert_close(grads[1][1][name], g, atol=1e-6, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


def test_optimizer_state_created_without_moving_parameters():
    """The pre-capture set-up makes Adam's state, leaves parameters alone and the next step is the eager one."""
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    graphed_model, graphed_opt = build(cfg, torch.device("cpu"))
    eager_model, eager_opt = build(cfg, torch.device("cpu"))
    before = [p.detach().clone() for p in graphed_model.parameters()]
    step = GraphedTrainStep.__new__(GraphedTrainStep)  # the set-up alone: no CUDA needed
    step.opt = graphed_opt
    step._init_optimizer_state()
    assert all(torch.equal(p, q) for p, q in zip(graphed_model.parameters(), before, strict=True))
    for p in graphed_model.parameters():
        st = graphed_opt.state[p]
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
        assert p.grad is None
    batch = SyntheticJaggedDataset(cfg).batch(0)
    for model, opt in ((graphed_model, graphed_opt), (eager_model, eager_opt)):
        model.loss(batch).backward()
        opt.step()
    for p, q in zip(graphed_model.parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=0, rtol=0)


def test_config_and_cli_errors():
    with pytest.raises(ValueError, match="cuda_graph must be a bool"):
        get_config("tiny", cuda_graph=1)
    with pytest.raises(ValueError, match="graph_tokens must be an int >= 0"):
        get_config("tiny", graph_tokens=-4)
    assert parse_overrides(["cuda_graph=true", "zero_copy=False", "graph_tokens=64"]) == {
        "cuda_graph": True, "zero_copy": False, "graph_tokens": 64,
    }  # fmt: skip
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda_graph needs a CUDA device"):
            run(get_config("tiny", cuda_graph=True), steps=1, device="cpu", progress=False)


@pytest.mark.gpu
@pytest.mark.parametrize("length_dist", ["full", "heavy_tailed"])
def test_graphed_training_takes_the_eager_steps(length_dist):
    """Same init and batches, dropout 0, fp32: graphed and eager training give the same losses and weights."""
    cfg = get_config("tiny", kernels="default", dropout=0.0, length_dist=length_dist, batch_size=6)
    kw = dict(steps=5, device="cuda", warmup=1, dtype="fp32", log_every=1, progress=False)
    eager = run(cfg, **kw)
    graphed = run(cfg.replace(cuda_graph=True, graph_tokens=24), **kw)
    assert graphed["cuda_graph"] and graphed["graph_captures"] >= 1
    if length_dist == "full":
        assert graphed["graph_captures"] == 1 and graphed["graph_padding_share"] == 0
    e, g = (torch.tensor([v for _, v in r["losses"]]) for r in (eager, graphed))
    torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_graphed_bf16_model_trains():
    """bf16 autocast with dropout, jagged batches, several graphs: finite losses that fall."""
    cfg = get_config("tiny", kernels="default", length_dist="heavy_tailed", lr=3e-3, cuda_graph=True, graph_tokens=16)
    res = run(cfg, steps=40, device="cuda", warmup=0, dtype="bf16", log_every=1, progress=False)
    losses = [v for _, v in res["losses"]]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-8:]) / 8 < sum(losses[:8]) / 8
    assert res["graph_captures"] > 1
