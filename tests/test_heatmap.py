"""The heatmap report on a small synthetic table (CPU): files written, axes and values as given."""

from __future__ import annotations

import csv
import math

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


def test_a_table_error_names_the_option_of_its_file(tmp_path, capsys):
    """--from-csv and --reference both take a CSV: "heatmap table X does not exist" did not say which option."""
    from autotune.tuning.cli import main

    heatmap.write_csv(_rows(), tmp_path / "in.csv")
    argv = ["bench", "--heatmap", "--out", str(tmp_path / "out")]
    assert main([*argv, "--from-csv", str(tmp_path / "in.csv"), "--reference", str(tmp_path / "no.csv")]) == 2
    assert "error: --reference: heatmap table" in capsys.readouterr().err
    assert main([*argv, "--from-csv", str(tmp_path / "no.csv")]) == 2
    assert "error: --from-csv: heatmap table" in capsys.readouterr().err


def test_from_csv_alone_rerenders_without_a_gpu(tmp_path):
    """--from-csv re-renders a table (no GPU needed, as its help says) without --heatmap beside it."""
    from autotune.tuning.cli import main

    heatmap.write_csv(_rows(), tmp_path / "in.csv")
    out = tmp_path / "out"
    assert main(["bench", "--from-csv", str(tmp_path / "in.csv"), "--out", str(out)]) == 0
    assert (out / "heatmap.csv").is_file()


HEADER = "direction,dqk,heads,batch,length,source,ms,tflops,mfu\n"
GOOD = "fwd,128,4,1,128,tuned,0.1,10,0.1\n"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("fwd,128,4,1\n", ":3: 4 fields, the header has 9"),
        ("fwd,128.0,4,1,256,tuned,0.1,10,0.1\n", ":3: column dqk: '128.0' is not a positive integer"),
        ("fwd,128,0,1,256,tuned,0.1,10,0.1\n", ":3: column heads: '0' is not a positive integer"),
        ("fwd,128,4,1,256,tuned,0.1,abc,0.1\n", ":3: column tflops: 'abc' is not a finite"),
        ("fwd,128,4,1,256,tuned,0.1,inf,0.1\n", ":3: column tflops: 'inf' is not a finite"),
        ("fwd,128,4,1,256,tuned,0.1,10,abc\n", ":3: column mfu: 'abc' is not a finite"),
        ("../../escaped,128,4,1,256,tuned,0.1,10,0.1\n", ":3: column direction: '../../escaped' is not one of"),
        ("fwd,128,4,1,256,../x,0.1,10,0.1\n", ":3: column source: '../x' is not a name"),
        ("fwd,128,4,1,256,,0.1,10,0.1\n", ":3: column source: '' is not a name"),
        ("fwd,128,4,1,128,tuned,0.2,99,0.2\n", ":3: cell fwd, 128, 4, 1, 128, tuned again (first at line 2)"),
    ],
    ids=["short", "float-int", "zero", "text", "inf", "mfu", "direction", "source", "empty-source", "duplicate"],
)
def test_read_table_checks_every_row_naming_file_line_and_column(tmp_path, body, expected):
    table = tmp_path / "t.csv"
    table.write_text(HEADER + GOOD + body)
    with pytest.raises(ValueError) as e:
        heatmap.read_table(table)
    assert str(e.value).startswith(str(table)) and expected in str(e.value)


def test_read_table_refuses_an_empty_table_and_a_folder(tmp_path):
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "header.csv").write_text(HEADER)
    with pytest.raises(ValueError, match="is empty"):
        heatmap.read_table(tmp_path / "empty.csv")
    with pytest.raises(ValueError, match="no rows"):
        heatmap.read_table(tmp_path / "header.csv")
    with pytest.raises(ValueError, match="is not a file"):
        heatmap.read_table(tmp_path)
    same_cell_other_source = tmp_path / "two.csv"
    same_cell_other_source.write_text(HEADER + GOOD + GOOD.replace("tuned", "default"))
    assert [r["source"] for r in heatmap.read_table(same_cell_other_source)] == ["tuned", "default"]


def test_a_header_is_read_by_its_stripped_names_and_a_name_twice_is_refused(tmp_path):
    """'tflops,tflops' read the second column silently (DictReader keeps the last); 'direction, dqk, ...' (a space
    after each comma) was 'missing dqk, heads, ...' though every column was there."""
    twice = tmp_path / "twice.csv"
    twice.write_text("direction,dqk,heads,batch,length,tflops,tflops\nfwd,128,4,1,128,10,20\n")
    with pytest.raises(ValueError, match=f"heatmap table {twice}: column tflops given twice"):
        heatmap.read_table(twice)
    spaced = tmp_path / "spaced.csv"
    spaced.write_text("direction, dqk, heads, batch, length, tflops\nfwd, 128, 4, 1, 128, 10\n")
    assert [(r["dqk"], r["tflops"]) for r in heatmap.read_table(spaced)] == [(128, 10.0)]


def test_reference_uses_the_rows_of_one_source(tmp_path, capsys):
    """A reference with tuned and default rows gives ratios against its tuned rows, whatever their order;
    several sources and none tuned is an error naming them; ratio_rows refuses a cell given twice."""
    from autotune.tuning.cli import main

    rows = _rows()
    heatmap.write_csv(rows, tmp_path / "in.csv")
    ref = tmp_path / "ref.csv"
    tuned = [{**r, "tflops": 2 * r["tflops"]} for r in rows if r["source"] == "tuned"]
    heatmap.write_csv(tuned + [r for r in rows if r["source"] == "default"], ref)  # default rows last
    out = tmp_path / "out"
    assert main(["bench", "--heatmap", "--from-csv", str(tmp_path / "in.csv"), "--reference", str(ref),
                 "--out", str(out)]) == 0  # fmt: skip
    with (out / "ratio.csv").open() as f:
        ratios = list(csv.DictReader(f))
    assert {r["source"]: float(r["tflops"]) for r in ratios if r["batch"] == "1" and r["length"] == "128"} == {
        "tuned/reference": pytest.approx(0.5),
        "default/reference": pytest.approx(0.25),
    }
    heatmap.write_csv([{**r, "source": "a" if r["source"] == "tuned" else "b"} for r in rows], ref)
    assert main(["bench", "--heatmap", "--from-csv", str(tmp_path / "in.csv"), "--reference", str(ref),
                 "--out", str(out)]) == 2  # fmt: skip
    assert "holds sources a, b" in capsys.readouterr().err
    with pytest.raises(ValueError, match="twice"):
        heatmap.ratio_rows(rows, rows, "tuned")


def test_cli_reports_bad_inputs_and_outputs_as_usage_errors(tmp_path, capsys):
    from autotune.tuning.cli import main

    table = tmp_path / "in.csv"
    heatmap.write_csv(_rows(), table)
    (tmp_path / "taken").write_text("")
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--out", str(tmp_path / "taken")]) == 2
    assert "--out" in capsys.readouterr().err
    blocked = tmp_path / "blocked"
    blocked.write_text("")
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--out", str(blocked / "sub")]) == 2
    assert "blocked" in capsys.readouterr().err
    assert main(["bench", "--heatmap", "--from-csv", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is not a file" in capsys.readouterr().err
    escaping = tmp_path / "esc.csv"
    escaping.write_text("direction,dqk,heads,batch,length,tflops\n../../escaped,128,4,1,128,10\n")
    out = tmp_path / "a" / "b" / "out"
    assert main(["bench", "--heatmap", "--from-csv", str(escaping), "--out", str(out)]) == 2
    assert "column direction" in capsys.readouterr().err
    assert not list(tmp_path.glob("**/*.png"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--heatmap-lengths", "0"], "--heatmap-lengths: '0' is not a positive integer"),
        (["--heatmap-lengths", "-1"], "--heatmap-lengths: '-1' is not a positive integer"),
        (["--heatmap-lengths", "1.5K"], "--heatmap-lengths: '1.5K'"),
        (["--heatmap-lengths", ","], "--heatmap-lengths ',' names nothing"),
        (["--heatmap-heads", "x"], "--heatmap-heads: 'x'"),
        (["--heatmap-batches", "2.5"], "--heatmap-batches: '2.5'"),
        (["--directions", "fwd,bogus"], "--directions: bogus not among"),
        (["--dims", "128x64"], "--dims: '128x64'"),
        (["--dims", "128,512"], "--dims: '512'"),
        (["--heads", "8"], "--heads: not read by bench --heatmap"),
        (["--masks", "targets"], "--masks: not read by bench --heatmap"),
        (["--distributions", "jagged"], "--distributions: not read by bench --heatmap"),
        (["--heatmap-batches", "128", "--heatmap-lengths", "16K"], "every cell is over"),
        (["--heatmap-batches", "65536", "--heatmap-lengths", "16"], "--heatmap-batches: '65536' is above 65535"),
        (["--heatmap-heads", "40000"], "--heatmap-heads: '40000' is above 32768"),
    ],
)
def test_grid_options_are_usage_errors_before_any_gpu_work(tmp_path, capsys, monkeypatch, argv, message):
    """Every grid option is checked first (it was checked only once a GPU had warmed up: tracebacks, errors that
    named no option, or an empty report with exit 0)."""
    import torch

    from autotune.tuning.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("a GPU check before the options"))
    assert main(["bench", "--heatmap", "--out", str(tmp_path / "o"), *argv]) == 2
    assert message in capsys.readouterr().err


def test_grid_values_are_taken_once_in_order():
    """A value given twice (1K and 1024) is measured once: the CSV of a doubled cell was refused when read back."""
    from autotune.tuning.cli import build_parser
    from autotune.tuning.cli_heatmap import heatmap_grid

    args = build_parser().parse_args(["bench", "--heatmap", "--heatmap-lengths", "1K,1024,1536", "--heatmap-batches",
                                      "2,1,2", "--heatmap-heads", "4,4", "--dims", "128,128x128", "--directions",
                                      "bwd,fwd,bwd"])  # fmt: skip
    assert heatmap_grid(args) == {"dims": [128], "heads": [4], "batches": [2, 1], "lengths": [1024, 1536],
                                  "directions": ["bwd", "fwd"]}  # fmt: skip


def test_a_reference_is_aligned_or_refused_and_old_report_files_go(tmp_path, capsys):
    """A reference that matches none of the cells (other heads) is an error; one with cells missing or zero says
    how many; a new report into the same folder leaves none of the old one's files (a stale ratio map)."""
    from autotune.tuning.cli import main

    table = tmp_path / "in.csv"
    heatmap.write_csv(_rows(), table)
    ref = tmp_path / "ref.csv"
    heatmap.write_csv([{**r, "heads": 8, "source": "reference"} for r in _reference()], ref)
    out = tmp_path / "out"
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--reference", str(ref), "--out", str(out)]) == 2
    assert "none of its cells" in capsys.readouterr().err and not out.exists()
    zero = [{**r, "source": "reference", "tflops": 0.0 if r["length"] == 128 else r["tflops"]} for r in _reference()]
    heatmap.write_csv(zero, ref)
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--reference", str(ref), "--out", str(out)]) == 0
    said = " ".join(capsys.readouterr().out.split())  # the console wraps long lines
    assert "ratios for 2 cells; 2 cells have no reference cell, 2 a reference value of 0" in said
    assert (out / "ratio.csv").is_file() and list(out.glob("*_ratio.png"))
    (out / "mine.txt").write_text("kept")
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--out", str(out)]) == 0
    assert not (out / "ratio.csv").exists() and not list(out.glob("*_ratio.png")) and (out / "mine.txt").is_file()


@pytest.mark.parametrize("name", ["heatmap.csv", "ratio.csv"])
def test_a_reference_among_the_report_files_of_out_is_refused(tmp_path, capsys, name):
    """``--reference runs/heatmap/heatmap.csv`` (the last report, compared with a new one written to the default
    --out) was read, then deleted and overwritten by the new rows, exit 0: the reference table was lost. A usage
    error naming --reference; the reference file and the folder's other report files are left as they were."""
    from autotune.tuning.cli import main

    table = tmp_path / "in.csv"
    heatmap.write_csv(_rows(), table)
    out = tmp_path / "out"
    ref = out / name
    heatmap.write_csv([{**r, "source": "reference"} for r in _reference()], ref)
    before = ref.read_bytes()
    assert main(["bench", "--heatmap", "--from-csv", str(table), "--reference", str(ref), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--reference" in err and "--out" in err, err
    assert ref.read_bytes() == before and sorted(p.name for p in out.iterdir()) == [name]


def test_a_reference_matching_only_cells_without_a_value_is_refused(tmp_path):
    """Cells read back without a TFLOP/s value (empty) matched the reference: exit 0, an empty ratio.csv and no note."""
    rows = [{**r, "tflops": math.nan} for r in _rows()]
    with pytest.raises(ValueError, match="--reference ref.csv: none of its cells"):
        heatmap.write_report(rows, tmp_path / "out", _reference(), reference_name="ref.csv")
    assert not (tmp_path / "out").exists()
    some = [{**r, "tflops": math.nan} if r["batch"] == 1 else r for r in _rows()]  # batch 1: no value, either source
    files = heatmap.write_report(some, tmp_path / "out", _reference(), reference_name="ref.csv")
    assert "ratios for 2 cells; 2 cells have no reference cell, 2 a reference value of 0 or none" in files["notes"][0]


@pytest.mark.parametrize("content", [b"\xff\xfed\x00i\x00", b"\x89PNG\r\n\x1a\n\x00\x00", None])
def test_a_table_that_is_no_utf8_csv_is_named(tmp_path, content):
    table = tmp_path / "t.csv"
    if content is None:  # a cell past the csv module's field limit
        table.write_text(HEADER + "fwd,128,4,1,128,tuned,0.1," + "1" * 200_000 + ",0.1\n")
    else:
        table.write_bytes(content)
    with pytest.raises(ValueError, match=f"heatmap table {table}"):
        heatmap.read_table(table)


def test_an_unwritable_out_folder_is_named_before_any_measuring(tmp_path, capsys, monkeypatch):
    """A measured grid whose --out cannot be made (a file in its path) failed only once every cell was timed."""
    import torch

    from autotune.tuning.cli import main

    blocked = tmp_path / "blocked"
    blocked.write_text("")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: pytest.fail("measuring before --out was checked"))
    assert main(["bench", "--heatmap", "--out", str(blocked / "sub"), "--heatmap-batches", "1"]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "blocked" in err, err


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


def test_a_cell_the_call_refuses_is_left_out_and_the_others_kept(monkeypatch):
    """A length past what a launch grid holds made the call raise mid-grid: the CLI turned it into a usage
    error and every cell timed before it was lost. Now that cell is left out with a warning naming it."""
    from autotune.tuning import measure

    monkeypatch.setattr(measure, "warm_gpu", lambda: None)

    def time_cell(rows, h, d, off, n, source, directions, measure, graph):
        if n > 512:
            raise ValueError(f"max_seq_len: a sequence of {n} rows needs more than the 65535 blocks")
        return dict.fromkeys(directions, 1.0)

    monkeypatch.setattr(heatmap, "_time_cell", time_cell)
    with pytest.warns(UserWarning, match=r"cell d64 h2 b1 length 1024 \(tuned\) left out: max_seq_len"):
        rows = heatmap.measure_grid([64], [2], [1], [256, 1024], ["fwd"], ["tuned"], device="cpu")
    assert [(r["length"], r["direction"]) for r in rows] == [(256, "fwd")] and rows[0]["ms"] == 1.0


def test_bench_help_names_every_heatmap_grid_default():
    """``--heatmap-batches``, ``--heatmap-lengths`` and ``--directions`` had no help at all: ``autotune bench
    --help`` showed neither what they take nor the grid (batch 1-128 x length 128-16K) a bare run measures."""
    from autotune.tuning.cli import build_parser

    bench = next(a for a in build_parser()._actions if a.dest == "cmd" or getattr(a, "choices", None))
    text = bench.choices["bench"].format_help()
    expected = {"--heatmap-batches": "1,2,4,8,16,32,64,128", "--heatmap-lengths": "128,256,512,1K,2K,4K,8K,16K",
                "--heatmap-heads": "default 4", "--directions": "fwd,bwd,both"}  # fmt: skip
    for option, default in expected.items():
        assert option in text and default in text, option


def test_bench_help_names_no_run_only_option():
    """``bench`` shares ``run``'s task options, and its ``--help`` described ``--dtype`` and ``--artifacts`` by
    ``--interpret``, ``--from-model`` and ``--from-onnx``, options only ``run`` takes."""
    from autotune.tuning.cli import build_parser

    sub = next(a for a in build_parser()._actions if getattr(a, "choices", None))
    bench_help = sub.choices["bench"].format_help()
    for option in ("--interpret", "--from-model", "--from-onnx", "runs/interpret"):
        assert option not in bench_help, option
    assert "--interpret" in sub.choices["run"].format_help()


def test_no_nan_or_inf_reaches_a_csv_and_an_overflowing_ratio_is_left_out(tmp_path):
    """A reference value so small that the quotient overflowed (a subnormal 1e-320) wrote 'inf' into ratio.csv and
    its map, and cells read back without a value were written 'nan' into heatmap.csv: both are now left empty."""
    ref = [{**r, "tflops": 1e-320} if (r["batch"], r["length"]) == (1, 128) else r for r in _reference()]
    rows = [{**r, "tflops": math.nan} if (r["batch"], r["length"]) == (4, 4096) else r for r in _rows()]
    files = heatmap.write_report(rows, tmp_path, ref, reference_name="ref.csv")
    for name in ("heatmap.csv", "ratio.csv"):
        text = (tmp_path / name).read_text().lower()
        assert "nan" not in text and "inf" not in text, name
    with (tmp_path / "ratio.csv").open() as f:
        ratios = list(csv.DictReader(f))
    assert len(ratios) == 6 and all(math.isfinite(float(r["tflops"])) for r in ratios)
    assert "ratios for 3 cells; 2 cells have no reference cell, 1 a reference value of 0 or none" in files["notes"][0]
    back = heatmap.read_table(tmp_path / "heatmap.csv")
    assert sum(math.isnan(r["tflops"]) for r in back) == 2 and len(back) == 12
    with pytest.raises(ValueError, match="none of its cells"):
        heatmap.write_report(_rows(), tmp_path / "o", [{**r, "tflops": 1e-320} for r in _reference()])


@pytest.mark.parametrize(
    "argv",
    [
        ["--cuda-graph"],
        ["--reference", "ref.csv"],
        ["--directions", "fwd"],
        ["--heatmap-batches", "4"],
        ["--heatmap-lengths", "2K"],
        ["--heatmap-heads", "8"],
        ["--out", "elsewhere"],
    ],
)
def test_heatmap_options_without_heatmap_are_usage_errors(capsys, monkeypatch, argv):
    """``autotune bench --cuda-graph`` (or ``--reference``, ``--heatmap-*``, ...) without ``--heatmap`` timed plain
    launches of the task grid and wrote nothing there: the options were accepted and ignored without a word."""
    from autotune.runtime import gpus
    from autotune.tuning.cli import main

    monkeypatch.setattr(gpus, "detect_gpu", lambda: pytest.fail("the GPU was looked for before the options"))
    assert main(["bench", "--gpu", "auto", *argv]) == 2
    err = capsys.readouterr().err
    assert f"{argv[0]}: a bench --heatmap option" in err


@pytest.mark.parametrize(
    "argv", [["--heatmap-batches", "4"], ["--directions", "fwd"], ["--dims", "128"], ["--heatmap-heads", "8"]]
)
def test_a_rerender_refuses_grid_options_it_would_ignore(tmp_path, capsys, argv):
    """``--from-csv`` re-renders the table's own cells: ``--dims 128`` or ``--heatmap-batches 4`` beside it were
    accepted and the whole table was drawn anyway."""
    from autotune.tuning.cli import main

    heatmap.write_csv(_rows(), tmp_path / "in.csv")
    rc = main(["bench", "--from-csv", str(tmp_path / "in.csv"), "--out", str(tmp_path / "out"), *argv])
    err = capsys.readouterr().err
    assert rc == 2 and argv[0] in err and "--from-csv" in err, err
    assert not (tmp_path / "out").exists()
