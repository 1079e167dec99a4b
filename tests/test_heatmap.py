"""The heatmap report on a small synthetic table (CPU): files written, axes and values as given."""

from __future__ import annotations

import csv

import pytest

from autotune.tuning import heatmap


def _rows() -> list[dict]:
    rows = []
    for source, scale in (("tuned", 2.0), ("default", 1.0)):
        for b in (1, 4):
            for n in (128, 1024, 4096):
                tf = scale * b * n / 1000.0
                rows.append(dict(direction="fwd", dqk=128, heads=4, batch=b, length=n, source=source, ms=1.0,
                                 tflops=tf, mfu=tf / 989.0))  # fmt: skip
    return rows


def _reference() -> list[dict]:
    return [
        dict(direction="fwd", dqk=128, heads=4, batch=b, length=n, tflops=1.6 * b * n / 1000.0)
        for b in (1, 4)
        for n in (128, 1024)  # 4096 missing: no ratio there
    ]


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_report_writes_csv_and_heatmaps_with_the_given_axes_and_values(tmp_path):
    files = heatmap.write_report(_rows(), tmp_path, _reference())
    names = sorted(p.name for p in files["png"])
    assert names == sorted(
        [
            "fwd_d128_h4_default_tflops.png",
            "fwd_d128_h4_default_mfu.png",
            "fwd_d128_h4_tuned_tflops.png",
            "fwd_d128_h4_tuned_mfu.png",
            "fwd_d128_h4_default_vs_reference_ratio.png",
            "fwd_d128_h4_tuned_vs_reference_ratio.png",
        ]
    )
    for p in files["png"]:
        w, h = _png_size(p)
        assert w > 100 and h > 100
    back = heatmap.read_table(tmp_path / "heatmap.csv")
    assert len(back) == 12
    cell = next(r for r in back if r["source"] == "tuned" and r["batch"] == 4 and r["length"] == 1024)
    assert cell["tflops"] == pytest.approx(2.0 * 4 * 1024 / 1000.0)
    batches, lengths, grid = heatmap._grid([r for r in back if r["source"] == "tuned"], "tflops")
    assert batches == [1, 4] and lengths == [128, 1024, 4096]
    assert grid[1][2] == pytest.approx(2.0 * 4 * 4096 / 1000.0)
    with (tmp_path / "ratio.csv").open() as f:
        ratios = list(csv.DictReader(f))
    assert len(ratios) == 8  # 2 sources x 2 batches x 2 lengths the reference has
    tuned = [float(r["tflops"]) for r in ratios if r["source"] == "tuned/reference"]
    assert tuned == pytest.approx([2.0 / 1.6] * 4)


def test_reference_table_needs_its_key_columns(tmp_path):
    bad = tmp_path / "ref.csv"
    bad.write_text("direction,batch,tflops\nfwd,1,3.0\n")
    with pytest.raises(ValueError, match="missing"):
        heatmap.read_table(bad)
    with pytest.raises(ValueError, match="does not exist"):
        heatmap.read_table(tmp_path / "nope.csv")


def test_cli_rerenders_a_csv_without_a_gpu(tmp_path):
    from autotune.tuning.cli import main

    heatmap.write_csv(_rows(), tmp_path / "in.csv")
    ref = tmp_path / "ref.csv"
    heatmap.write_csv([{**r, "source": "reference"} for r in _reference()], ref)
    out = tmp_path / "out"
    assert main(["bench", "--heatmap", "--from-csv", str(tmp_path / "in.csv"), "--reference", str(ref),
                 "--out", str(out)]) == 0  # fmt: skip
    assert (out / "heatmap.csv").is_file() and (out / "ratio.csv").is_file()
    assert len(list(out.glob("*.png"))) == 6
    assert main(["bench", "--heatmap", "--from-csv", str(tmp_path / "missing.csv"), "--out", str(out)]) == 2


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_gpu_measure_grid_times_every_direction(cuda_graph):
    """Every direction of a small grid is timed, graph replays included (the backward and the forward +
    backward run the autograd node directly when captured)."""
    rows = heatmap.measure_grid(
        [64], [2], batches=[2], lengths=[256], directions=("fwd", "bwd", "both"), sources=("default",),
        cuda_graph=cuda_graph,
    )  # fmt: skip
    assert sorted(r["direction"] for r in rows) == ["both", "bwd", "fwd"]
    ms = {r["direction"]: r["ms"] for r in rows}
    assert all(t > 0 for t in ms.values())
    assert ms["both"] > 0.5 * ms["bwd"]
