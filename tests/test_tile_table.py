"""The compact launch order of the CuTe kernels, on the order alone (CPU): every real tile once, the
heaviest first, nothing outside the batch whatever the offsets say, and one table per unchanged
offsets tensor."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kernel_templates import tensor_memo
from kernel_templates.cute import tile_table as tt

# The tables are built by Triton kernels: on the GPU when there is one, else under the interpreter.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _offsets(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=DEV)


def _real_tiles(lengths: list[int], block: int) -> list[tuple[int, int]]:
    return [(s, b) for s, n in enumerate(lengths) for b in range(-(-n // block))]


def _work(lengths: list[int], block: int, tile: tuple[int, int], direction: str) -> int:
    s, b = tile
    return b + 1 if direction == "fwd" else -(-lengths[s] // block) - b


@pytest.mark.parametrize("direction", tt.DIRECTIONS)
@pytest.mark.parametrize("group", [0, 1, 3])
def test_every_real_tile_once_and_the_table_matches_the_reference(direction, group):
    rng = random.Random(7)
    for _ in range(60):
        block = rng.choice([64, 128, 192])
        max_len = rng.randint(1, 3000)
        lengths = [rng.choice([0, 1, max_len, rng.randint(0, max_len)]) for _ in range(rng.randint(1, 24))]
        rows = sum(lengths)
        max_blocks = -(-max_len // block)
        table = tt.tile_table(_offsets(lengths), rows, block, max_blocks, direction, group)
        got = [tuple(r) for r in table.tolist()]
        assert got == tt.tile_order_reference(lengths, rows, block, max_blocks, direction, group)
        assert len(got) == tt.tile_bound(rows, len(lengths), block, max_blocks)
        live = [t for t in got if t[0] >= 0]
        assert sorted(live) == sorted(_real_tiles(lengths, block))  # each real tile exactly once
        assert got[len(live) :] == [(-1, 0)] * (len(got) - len(live))  # dead entries only at the end


@pytest.mark.parametrize("direction", tt.DIRECTIONS)
def test_one_group_runs_the_heaviest_tiles_first(direction):
    """Group 0 (all sequences): causal work never increases along the table (longest-processing-time)."""
    lengths = [5000, 0, 3, 700, 64, 1, 4096, 129] + [40] * 30
    block = 128
    max_blocks = -(-max(lengths) // block)
    table = tt.tile_order_reference(lengths, sum(lengths), block, max_blocks, direction, 0)
    work = [_work(lengths, block, t, direction) for t in table if t[0] >= 0]
    assert work == sorted(work, reverse=True)
    assert work[0] == max_blocks


def test_groups_keep_a_sequence_together_and_longest_sequences_first():
    lengths = [300, 1000, 0, 1000, 65]
    table = tt.tile_order_reference(lengths, sum(lengths), 64, 16, "fwd", group=1)
    seqs = [s for s, _ in table if s >= 0]
    assert seqs == [1] * 16 + [3] * 16 + [0] * 5 + [4] * 2  # stable: sequence 1 before 3
    blocks = [b for s, b in table if s == 1]
    assert blocks == list(range(15, -1, -1))  # heaviest (last) query block first


def test_bound_covers_every_batch_without_reading_lengths():
    rng = random.Random(3)
    for _ in range(200):
        block = rng.choice([64, 128])
        lengths = [rng.randint(0, 2000) for _ in range(rng.randint(1, 40))]
        max_blocks = max(1, -(-max(lengths) // block))
        assert len(_real_tiles(lengths, block)) <= tt.tile_bound(sum(lengths), len(lengths), block, max_blocks)
    with pytest.raises(ValueError, match="max_blocks"):
        tt.tile_bound(10, 1, 64, 0)


@pytest.mark.parametrize(
    "offsets", [[-8, 5, 29], [0, 20, 3, 29], [40, 50, 60], [0, 2**40, 29], [0, 2**31 + 5, 29], [29, 0, 0]]
)
def test_bad_offsets_keep_every_entry_inside_the_batch(offsets):
    off = torch.tensor(offsets, dtype=torch.int64, device=DEV)
    batch, block, max_blocks = len(offsets) - 1, 64, 2
    for direction in tt.DIRECTIONS:
        table = tt.tile_table(off, 29, block, max_blocks, direction)
        seq, blk = table[:, 0], table[:, 1]
        assert table.dtype == torch.int32 and table.shape == (tt.tile_bound(29, batch, block, max_blocks), 2)
        assert bool(((seq >= -1) & (seq < batch)).all()) and bool(((blk >= 0) & (blk < max_blocks)).all())


@pytest.mark.parametrize(
    "offsets", [[-8, 5, 29], [0, 20, 3, 29], [40, 50, 60], [0, 2**40, 29], [0, 2**31 + 5, 29], [29, 0, 0]]
)
def test_bad_offsets_keep_every_split_row_inside_the_batch(offsets):
    """Every row is written (no stale memory), and each names a sequence of the batch (or none) and a block
    below ``max_blocks``, whatever the offsets say."""
    off = torch.tensor(offsets, dtype=torch.int64, device=DEV)
    batch, max_blocks = len(offsets) - 1, 2
    table = tt.split_tile_table(off, 29, 64, 64, max_blocks, 0, 1, 4, 4)
    seq, blk, code = table[:, 0], table[:, 1], table[:, 2]
    assert table.shape == (tt.tile_bound(29, batch, 64, max_blocks) + tt.split_extra_rows(4, 1), 4)
    assert bool(((seq >= -1) & (seq < batch)).all()) and bool(((blk >= 0) & (blk < max_blocks)).all())
    parts, part = code // 256, code % 256
    assert bool(((parts >= 1) & (parts <= 4) & (part < parts)).all())


def test_bad_direction_is_rejected():
    with pytest.raises(ValueError, match="direction"):
        tt.tile_table(_offsets([3]), 3, 64, 1, "sideways")


def test_seqs_per_group_counts_whole_sequences():
    assert tt.seqs_per_group(0, 4) == 0 and tt.seqs_per_group(8, 4) == 2 and tt.seqs_per_group(2, 4) == 1


def test_one_table_per_unchanged_offsets_tensor(monkeypatch):
    calls = []
    real = tt.tile_table
    monkeypatch.setattr(tt, "tile_table", lambda *a: calls.append(a) or real(*a))
    tt._TABLES.clear()
    off = _offsets([100, 3, 0, 64])
    a = tt.launch_tile_table(off, 167, 64, 2, "fwd", 0)
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is a and len(calls) == 1
    b = tt.launch_tile_table(off, 167, 128, 1, "bwd", 0)  # another block size: its own entry, both kept
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is a and len(calls) == 2 and b is not a
    off.add_(0)  # written: rebuilt
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is not a and len(calls) == 3
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 3)  # a capture: its own table, once
    c = tt.launch_tile_table(off, 167, 64, 2, "fwd", 0)
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is c and c is not a and len(calls) == 4
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 4)  # the next capture does not reuse it
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is not c and len(calls) == 5
    monkeypatch.setattr(tensor_memo, "capture_id", lambda: 0)
    assert tt.launch_tile_table(off, 167, 64, 2, "fwd", 0) is not c and len(calls) == 5
    tt._TABLES.clear()


def test_plain_grid_passes_the_offsets_as_placeholder():
    off = _offsets([5, 7])
    assert tt.tiles_arg(off, off, 12, 2, 64, 1, "fwd", False, 8) is off
    flat = tt.tiles_arg(off, off, 12, 2, 64, 1, "fwd", True, 8)
    assert flat.dim() == 1 and flat.tolist() == [0, 0, 1, 0]


def _parts_by_tile(table: list[tuple[int, int, int, int]]) -> dict[tuple[int, int], list[tuple[int, int, int]]]:
    tiles: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for s, b, code, slot in table:
        if s >= 0:
            tiles.setdefault((s, b), []).append((code // 256, code % 256, slot))
    return tiles


@pytest.mark.parametrize("heads", [1, 4, 8])
@pytest.mark.parametrize("group", [0, 1, 3])
def test_split_table_cuts_each_real_tile_into_parts_that_cover_it_once(heads, group):
    rng = random.Random(11)
    for _ in range(20):  # x 9 parameter pairs
        block_m, block_n = rng.choice([(64, 64), (128, 64), (128, 128), (192, 96)])
        max_len = rng.randint(1, 6000)
        lengths = [rng.choice([0, 1, max_len, rng.randint(0, max_len // 8 + 1)]) for _ in range(rng.randint(1, 24))]
        rows, max_blocks, sm, max_parts = sum(lengths), -(-max_len // block_m), rng.choice([8, 132]), rng.choice([2, 4])
        args = (rows, block_m, block_n, max_blocks, group, heads, sm, max_parts)
        got = [tuple(r) for r in tt.split_tile_table(_offsets(lengths), *args).tolist()]
        assert got == tt.split_order_reference(lengths, *args)
        assert len(got) == tt.tile_bound(rows, len(lengths), block_m, max_blocks) + tt.split_extra_rows(sm, heads)
        tiles = _parts_by_tile(got)
        assert sorted(tiles) == sorted(_real_tiles(lengths, block_m))  # every real tile, and only those
        slots = []
        for parts in tiles.values():
            p = parts[0][0]
            assert 1 <= p <= max_parts and sorted(i for _, i, _ in parts) == list(range(p))
            assert {(pp, sl) for pp, _, sl in parts} == {(p, parts[0][2])}  # one part count and slot per tile
            slots += [parts[0][2] + i for i in range(p - 1)]
        assert sorted(slots) == list(range(len(slots)))  # cut tiles own disjoint partial slots
        assert len(slots) < tt.split_extra_rows(sm, heads)  # the launcher's partial buffer holds them all
        live = sum(s >= 0 for s, *_ in got)
        assert all(r == (-1, 0, 256, 0) for r in got[live:])


def test_split_table_cuts_only_a_batch_carried_by_one_sequence():
    """One 2K sequence among short ones: its heaviest tiles are cut, the heaviest parts run first; a uniform
    batch has enough tiles for every SM and nothing is cut."""
    one_long = [2048] + [40] * 31
    table = tt.split_order_reference(one_long, sum(one_long), 128, 64, 16, 0, 4, 132, 4)
    tiles = _parts_by_tile(table)
    assert tiles[(0, 15)][0][0] == 3 and tiles[(0, 0)][0][0] == 1  # 32 key blocks, per-SM share ~9
    work = [-(-2 * (b + 1) // (code // 256)) for s, b, code, _ in table if s >= 0]  # each part's key blocks
    assert work == sorted(work, reverse=True)
    uniform = [2048] * 32
    table = tt.split_order_reference(uniform, sum(uniform), 128, 64, 16, 1, 4, 132, 4)
    assert all(code == 256 for _, _, code, _ in table)


def test_split_tables_are_memoised_by_their_own_key():
    tt._TABLES.clear()
    off = _offsets([700, 3, 0, 64])
    a = tt.tiles_arg(off, off, 767, 2, 128, 6, "fwd", True, 0, split=(64, 132, 4))
    assert a.numel() == 4 * (tt.tile_bound(767, 4, 128, 6) + tt.split_extra_rows(132, 2))
    assert tt.tiles_arg(off, off, 767, 2, 128, 6, "fwd", True, 0, split=(64, 132, 4)).data_ptr() == a.data_ptr()
    assert tt.tiles_arg(off, off, 767, 2, 128, 6, "fwd", True, 0, split=(64, 132, 2)).data_ptr() != a.data_ptr()
    tt._TABLES.clear()
    with pytest.raises(ValueError, match="max_parts"):
        tt.split_tile_table(off, 767, 128, 64, 6, 0, 2, 132, 0)
    with pytest.raises(ValueError, match="sm_count"):
        tt.split_extra_rows(0, 4)


@pytest.mark.gpu
def test_gpu_one_table_per_capture_rebuilt_by_every_replay():
    """Within one CUDA-graph capture the calls share one table (the eager one is not used); each replay
    rebuilds it from the offsets it finds, and the next capture records its own."""
    first, second = [700, 0, 5, 300, 1, 130], [64, 129, 700, 3, 0, 240]
    off = _offsets(first)
    args = (sum(first), 128, 6, "fwd", 0)
    eager = tt.launch_tile_table(off, *args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        a = tt.launch_tile_table(off, *args)
        b = tt.launch_tile_table(off, *args)
    assert a is b and a is not eager and tensor_memo.capture_id() == 0
    off.copy_(_offsets(second))
    graph.replay()
    torch.cuda.synchronize()
    assert [tuple(r) for r in a.tolist()] == tt.tile_order_reference(second, *args)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        assert tt.launch_tile_table(off, *args) is not a
    tt._TABLES.clear()


def test_capture_id_is_zero_outside_a_capture():
    assert tensor_memo.capture_id() == 0
