"""Data-parallel training (two gloo processes) and the workload-balanced split of jagged batches (CPU)."""

from __future__ import annotations

import os
import socket

import pytest
import torch

from autotune.runtime.buckets import sequence_lengths
from models import distributed
from models.config import get_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, out: str, balance: str, warmup: int = 0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import torch.distributed as dist

    from models import train

    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    captured = {}
    real_build = train.build

    def build(cfg, device):
        model, opt = real_build(cfg, device)
        captured["model"] = model
        return model, opt

    train.build = build
    result = train.run(cfg, steps=3, warmup=warmup, progress=False, balance=balance)
    torch.save({"params": captured["model"].state_dict(), "result": result}, f"{out}/rank{rank}.pt")
    _leave(dist)


def _mismatch(a: torch.Tensor, b: torch.Tensor) -> dict:
    """How two ranks' copies of one parameter differ: elements, largest difference, NaNs, first differing rows."""
    bad = a != b
    rows = (bad.reshape(bad.shape[0], -1).any(1) if a.dim() else bad.reshape(1)).nonzero().flatten()
    return {
        "elements": f"{int(bad.sum())}/{a.numel()}",
        "max_abs": float((a - b).abs().nan_to_num(nan=float("inf")).max()),
        "nan": (int(a.isnan().sum()), int(b.isnan().sum())),
        "rows": rows[:8].tolist(),
    }


@pytest.mark.parametrize("balance", ["workload", "none"])
def test_two_gloo_ranks_end_with_identical_parameters(tmp_path, balance):
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path), balance), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert r0["params"].keys() == r1["params"].keys()
    # Every differing parameter, with how it differs (a few last bits, NaNs, whole rows a rank updated alone).
    diffs = {n: _mismatch(p, r1["params"][n]) for n, p in r0["params"].items() if not torch.equal(p, r1["params"][n])}
    assert not diffs, diffs
    res = r0["result"]
    assert res["world"] == 2 and len(res["imbalance_per_step"]) == 3 and res["imbalance_mean"] >= 1.0
    assert res["tokens"] == r1["result"]["tokens"] > 0  # summed over ranks on both
    # Training moved the weights away from their seeded initialisation.
    from models.train import build

    init, _ = build(get_config("tiny", kernels="reference", dropout=0.0), torch.device("cpu"))
    assert any(not torch.equal(p, r0["params"][n]) for n, p in init.state_dict().items())


def test_a_data_parallel_report_counts_the_world_flops_of_each_part(tmp_path):
    """The attention and GEMM TFLOP per step were rank 0's shard alone (about half the world's on two ranks) while
    the total, tokens/s and MFU beside them were the world's: each part is the world's too, and they add up."""
    import torch.multiprocessing as mp

    from models.data import make_loader
    from models.hstu import HSTURankingModel
    from models.metrics import step_flops

    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path), "workload"), nprocs=2, join=True)
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    dense = HSTURankingModel(cfg).dense_params()
    want = {"attention": 0.0, "gemm": 0.0}
    for batch in make_loader(cfg.replace(batch_size=cfg.batch_size * 2), 3):  # the 3 global batches both ranks drew
        for key in want:
            want[key] += step_flops(cfg, batch.lengths, dense)[key] / 3 / 1e12
    for rank in (0, 1):
        res = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)["result"]
        got = {key: res[f"{key}_tflop_per_step"] for key in want}
        assert got == pytest.approx(want, rel=1e-9), (rank, got, want)
        assert res["tflops"] * res["timed_s"] / 3 == pytest.approx(got["attention"] + got["gemm"], rel=1e-9)


def test_a_data_parallel_report_gives_the_imbalance_of_the_timed_steps(tmp_path):
    """imbalance_per_step, its mean and max held the warm-up steps too, beside tokens/s, step time and per-rank
    forward times of the timed steps alone (docs/RESULTS.md: 15 timed steps after 3 warm-up): the timed steps' only."""
    import torch.multiprocessing as mp

    from models.data import make_loader

    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path), "none", 2), nprocs=2, join=True)
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    batches = list(make_loader(cfg.replace(batch_size=cfg.batch_size * 2), 5))
    weight = distributed.token_weight(cfg)
    want = [distributed.split(b.lengths, 2, "none", weight)[1] for b in batches[2:]]  # after the 2 warm-up steps
    res = torch.load(tmp_path / "rank0.pt", weights_only=False)["result"]
    assert res["imbalance_per_step"] == pytest.approx(want)
    assert (res["imbalance_mean"], res["imbalance_max"]) == pytest.approx((sum(want) / 3, max(want)))


def _grad_rank_main(rank: int, world: int, port: int, out: str) -> None:
    """One DDP backward on this rank's shard (equal sequence counts): the ranks hold unequal row counts, so
    each rank's mean loss would weigh the rows of the smaller shard more."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from models.train import build

    dist.init_process_group("gloo")
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    batch = _global_batch(cfg, world)
    model, _ = build(cfg, torch.device("cpu"))
    sub, _ = distributed.shard(batch, rank, world, "none", distributed.token_weight(cfg))
    ddp = DistributedDataParallel(distributed.LossModule(model))  # kept: its reducer all-reduces in backward
    ddp(sub).backward()
    torch.save({"grads": {n: p.grad for n, p in model.named_parameters()}, "rows": sub.num_tokens}, f"{out}/g{rank}.pt")
    _leave(dist)


def _leave(dist) -> None:
    """End a rank once every rank has saved its results. Not by tearing the gloo group down: its destructor joins
    the worker threads while holding the GIL, and a worker still holding the backward's all-reduce (whose thread
    state keeps a Python object) waits for the GIL to free it, a deadlock seen as a hung CI run."""
    dist.barrier()
    os._exit(0)  # what mp.spawn counts as success


def _cli_rank_main(rank: int, world: int, port: int, out: str, joined_before: bool) -> None:
    """``python -m models.train`` as torchrun starts it on this rank; then whether a process group is left."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    import torch.distributed as dist

    from models import train

    if joined_before:  # a caller's own group: not the CLI's to destroy
        dist.init_process_group("gloo")
    args = ["--preset", "tiny", "--kernels", "reference", "--device", "cpu", "--steps", "2", "--warmup", "0"]
    result = train.main([*args, "--no-progress", "--log-every", "1"])
    torch.save({"initialized": dist.is_initialized(), "world": result["world"]}, f"{out}/cli{rank}.pt")
    if dist.is_initialized():
        _leave(dist)
    os._exit(0)


@pytest.mark.parametrize("joined_before", [False, True])
def test_the_training_cli_destroys_the_process_group_it_created(tmp_path, joined_before):
    """Under torchrun ``python -m models.train`` joined a group and never destroyed it (its resources were left to
    process exit); it now destroys it after a barrier (the safe order for gloo), and only a group it made."""
    import torch.multiprocessing as mp

    mp.spawn(_cli_rank_main, args=(2, _free_port(), str(tmp_path), joined_before), nprocs=2, join=True)
    for rank in (0, 1):
        done = torch.load(tmp_path / f"cli{rank}.pt", weights_only=False)
        assert done == {"initialized": joined_before, "world": 2}


def _log_rank_main(rank: int, world: int, port: int, out: str) -> None:
    """``python -m models.train --no-progress`` on this rank, its printed lines saved to ``out/log{rank}.txt``."""
    import contextlib
    import io

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))  # fmt: skip
    from models import train

    args = ["--preset", "tiny", "--kernels", "reference", "--device", "cpu", "--steps", "2", "--warmup", "0"]
    text = io.StringIO()
    with contextlib.redirect_stderr(text):  # the console writes to stderr
        train.main([*args, "--no-progress", "--log-every", "1"])
    with open(f"{out}/log{rank}.txt", "w") as f:
        f.write(text.getvalue())
    os._exit(0)


def test_only_rank_zero_prints_the_step_losses(tmp_path):
    """Under torchrun every rank printed "step N: loss ...", so each line came once per rank; the loss is the
    global mean already, so rank 0 alone prints it."""
    import torch.multiprocessing as mp

    mp.spawn(_log_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    logs = [(tmp_path / f"log{rank}.txt").read_text() for rank in (0, 1)]
    assert "step 1: loss" in logs[0] and "step 2: loss" in logs[0], logs[0]
    assert "step " not in logs[1], logs[1]


def _global_batch(cfg, world: int):
    from models.data import make_loader

    return next(iter(make_loader(cfg.replace(batch_size=cfg.batch_size * world), 1)))


def test_data_parallel_gradient_is_the_global_batch_gradient(tmp_path):
    """Each rank's loss is its share of the global batch's mean (rows weigh world / global rows), so DDP's average
    over ranks is the global batch's gradient when ranks hold unequal row counts (as both splits give them)."""
    import torch.multiprocessing as mp

    from models.train import build

    mp.spawn(_grad_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    g0, g1 = (torch.load(tmp_path / f"g{r}.pt", weights_only=False) for r in (0, 1))
    cfg = get_config("tiny", kernels="reference", dropout=0.0)
    model, _ = build(cfg, torch.device("cpu"))
    model.loss(_global_batch(cfg, 2)).backward()
    assert g0["rows"] != g1["rows"]  # the case a per-rank mean gets wrong
    for name, p in model.named_parameters():
        for g in (g0, g1):
            got = g["grads"][name]
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_balanced_split_evens_heavy_tailed_work():
    cfg = get_config("seed")
    weight = distributed.token_weight(cfg)
    worse = []
    for seed in range(5):
        lengths = sequence_lengths(4096, 256, "jagged", seed)
        balanced, imb = distributed.split(lengths, 8, "workload", weight)
        plain, plain_imb = distributed.split(lengths, 8, "none", weight)
        assert sorted(i for s in balanced for i in s) == list(range(len(lengths)))  # each sequence once
        assert imb <= 1.05 and imb < plain_imb
        assert all(balanced_shard for balanced_shard in balanced)  # no idle rank
        assert distributed.split(lengths, 8, "workload", weight) == (balanced, imb)  # deterministic
        worse.append(plain_imb)
    assert max(worse) > 1.2  # the plain split is what the balance fixes


def test_split_edge_cases_and_bad_balance():
    shards, imb = distributed.split([5, 0, 3], 4, "workload", 1.0)
    assert sorted(i for s in shards for i in s) == [0, 1, 2] and imb >= 1.0
    assert distributed.plain_split(5, 2) == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="balance"):
        distributed.split([1, 2], 2, "random", 1.0)


def test_select_sequences_keeps_rows_and_offsets():
    from models.data import make_loader

    batch = next(iter(make_loader(get_config("tiny"), 1)))
    sub = distributed.select_sequences(batch, [2, 0])
    assert sub.lengths == [batch.lengths[2], batch.lengths[0]]
    off = batch.seq_offsets.tolist()
    assert torch.equal(sub.items, torch.cat([batch.items[off[2] : off[3]], batch.items[off[0] : off[1]]]))
    assert sub.seq_offsets.tolist() == [0, sub.lengths[0], sum(sub.lengths)]


def test_group_scope_destroys_its_group_when_the_closing_barrier_fails(monkeypatch):
    """A barrier that raised on leaving (a peer gone after this rank finished) skipped the destroy: the group the
    scope made was left behind in the process. It is now destroyed whatever the barrier does."""
    import torch.distributed as dist

    from models import distributed

    def barrier(*args, **kw):
        raise RuntimeError("peer gone")

    monkeypatch.setattr(dist, "barrier", barrier)
    with pytest.raises(RuntimeError, match="peer gone"), distributed.group_scope():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    initialized = dist.is_initialized()
    if initialized:
        dist.destroy_process_group()
    assert not initialized


@pytest.mark.parametrize(
    ("env", "match"),
    [({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 without RANK: start data-parallel runs with torchrun"),
     ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an int"),
     ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 / LOCAL_RANK=0 do not fit WORLD_SIZE=2"),
     ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "x"}, "LOCAL_RANK='x' is not an int")],
)  # fmt: skip
def test_unusable_torchrun_variables_are_a_usage_error_naming_them(env, match, monkeypatch, capsys):
    """A stray WORLD_SIZE (no torchrun) was a bare KeyError on RANK, after the config and CLI checks."""
    from models.train import main

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    for name, val in env.items():
        monkeypatch.setenv(name, val)
    monkeypatch.setattr("models.train.run", lambda *a, **k: pytest.fail("run() started"))
    with pytest.raises(SystemExit) as e:
        main(["--preset", "tiny", "--kernels", "reference", "--device", "cpu", "--no-progress"])
    assert e.value.code == 2 and match in capsys.readouterr().err
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")):
        distributed.setup("cpu")


def test_a_single_process_ignores_rank_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "x")
    assert distributed.env_info() == distributed.DistInfo()
