"""Tuning on real sequence lengths: the lengths file, the batches drawn from it, the tasks and entries."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from autotune.runtime.buckets import sample_lengths
from autotune.runtime.lengths import LengthsError, compact, describe, read_length_sample, read_lengths_file
from autotune.tuning.tasks import Task


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("a.json", [3, 0, 7], [3, 0, 7]),
        ("b.json", [[3, 4], [5]], [3, 4, 5]),
        ("c.json", {"100": 2, "7": 1}, [100, 100, 7]),
        ("d.json", {"lengths": [10, 20], "counts": [1, 3]}, [10, 20, 20, 20]),
        ("e.txt", "5, 6\n# comment\n7 8", [5, 6, 7, 8]),
    ],
)
def test_reads_every_format(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    assert read_length_sample(path) == expected


@pytest.mark.parametrize(
    ("name", "content", "batches", "uniform", "batch"),
    [
        ("a.txt", "5 6\n7 7 7\n", [[5, 6], [7, 7, 7]], False, 3),
        ("b.txt", "5\n6\n7\n", None, False, None),  # one length a line: a flat sample, not batches of one
        ("f.txt", "5 6 7 7\n", None, False, None),  # one line: a flat sample, not one batch
        ("c.json", [[8, 8], [3, 3, 3]], [[8, 8], [3, 3, 3]], True, 3),
        ("d.json", [9, 9, 9], None, True, None),
        ("e.json", {"9": 4}, None, True, None),
    ],
)
def test_batches_when_the_file_lists_them(tmp_path, name, content, batches, uniform, batch):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    got = read_lengths_file(path)
    assert (got.batches, got.uniform, got.batch) == (batches, uniform, batch)
    assert got.sample == read_length_sample(path)


def test_reads_npy(tmp_path):
    path = tmp_path / "l.npy"
    np.save(path, np.array([1, 2, 300], dtype=np.int64))
    assert read_length_sample(path) == [1, 2, 300]
    np.save(path, np.array([1.5, 2.0]))
    with pytest.raises(LengthsError, match="integer array"):
        read_length_sample(path)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ([], "no non-zero length"),
        ([0, 0], "no non-zero length"),
        ([5, -1], "negative length -1"),
        ([5, 2.5], "not an integer"),
        ([5, 40000], "longer than the largest bucket"),
        ({"100": -2}, "histogram count"),
        ({"x": 2}, "not an integer length"),
        ({"lengths": [1, 2], "counts": [1]}, "as long as"),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(LengthsError, match=match) as info:
        read_length_sample(path)
    assert str(path) in str(info.value)


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(LengthsError, match="no such file"):
        read_length_sample(tmp_path / "none.json")
    (tmp_path / "x.txt").write_text("ten twenty")
    with pytest.raises(LengthsError, match="not JSON"):
        read_length_sample(tmp_path / "x.txt")


def test_a_pipe_is_named_not_missing(tmp_path):
    """A FIFO (what `--lengths <(cmd)` passes) was 'no such file'; it is named, and never opened (no hang)."""
    import os

    os.mkfifo(tmp_path / "lengths.fifo")
    with pytest.raises(LengthsError, match="lengths.fifo: not a regular file"):
        read_length_sample(tmp_path / "lengths.fifo")


def test_batches_drawn_from_the_sample_belong_to_their_bucket():
    sample = [12] * 50 + [40] * 30 + [700, 1500, 3000]
    for bucket in (256, 1024, 2048, 4096):
        a = sample_lengths(sample, bucket, 32, seed=0)
        assert a == sample_lengths(sample, bucket, 32, seed=0)  # deterministic
        assert len(a) == 32 and max(a) <= bucket and max(a) > bucket // 2
        assert all(n in sample or n == bucket for n in a)
    assert sample_lengths(sample, 1024, 32, seed=0) != sample_lengths(sample, 1024, 32, seed=1)


def test_tasks_carry_the_sample():
    sample = compact(list(range(1, 9000)), n=100)
    assert len(sample) == 100 and sample[0] == 1 and sample[-1] == 8999
    t = Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "jagged", sample=sample)
    plain = Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "jagged")
    assert t.study_name != plain.study_name and t.lengths() != plain.lengths()
    assert Task.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match="jagged"):
        Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "uniform", sample=sample)
    d = describe(sample)
    assert d["count"] == 100 and d["max"] == 8999 and d["p50"] <= d["p90"] <= d["p99"]


@pytest.mark.interpreter
def test_run_with_lengths_records_the_sample(tmp_path):
    """autotune run --lengths: jagged entries are tuned on batches from the file and say so."""
    from autotune.tuning.cli import main

    lengths = tmp_path / "lengths.json"
    lengths.write_text(json.dumps([3, 5, 9, 17, 40, 60, 64] * 10))
    argv = ["run", "--interpret", "--kernel", "fwd", "--distributions", "uniform,jagged", "--trials", "1",
            "--verify", "quick", "--lengths", str(lengths), "--artifacts", str(tmp_path / "art")]  # fmt: skip
    assert main(argv) == 0
    entries = json.loads((tmp_path / "art" / "h100" / "hstu_attention_fwd.json").read_text())["entries"]
    by_dist = {e["distribution"]: e for e in entries}
    assert "lengths" in by_dist["jagged"] and "lengths" not in by_dist["uniform"]
    desc = by_dist["jagged"]["lengths"]
    assert desc["count"] == 70 and desc["max"] == 64 and 0 < desc["batch_fill"] <= 1


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("a.json", '{"lengths": 5}', "'lengths' must be a list"),
        ("b.json", '{"lengths": 5, "counts": [1]}', "'lengths' must be a list"),
        ("c.json", "[" * 100_000 + "]" * 100_000, "JSON not readable"),
        ("d.json", "1" * 5000, "JSON not readable"),
        ("e.txt", "7 " + "1" * 5000, "is not an integer length"),
        ("f.txt", "100.5 200", "'100.5' is not an integer length"),
        ("g.json", "[1, [2, [3]]]", r"length \[2, \[3\]\] is not an integer"),
        ("h.json", '"512"', "expected a list"),
        ("i.json", "512.5", "expected a list"),
        ("j.json", '{"512": 3, "512": 5}', "key '512' appears twice"),  # json kept the last count only
        ("k.json", '{"lengths": [9], "counts": [1], "lengths": [2]}', "key 'lengths' appears twice"),
    ],
)
def test_malformed_files_are_lengths_errors_naming_the_file(tmp_path, name, text, match):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(LengthsError, match=match) as info:
        read_length_sample(path)
    assert str(path) in str(info.value)


def test_an_npz_named_npy_is_a_lengths_error(tmp_path):
    path = tmp_path / "l.npy"
    with open(path, "wb") as f:
        np.savez(f, a=np.array([1, 2]))
    with pytest.raises(LengthsError, match="npz") as info:
        read_length_sample(path)
    assert str(path) in str(info.value)


def test_a_file_of_one_length_is_a_sample_of_one(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("512\n")
    assert read_length_sample(path) == [512]


def test_a_huge_histogram_count_is_subsampled_by_counts(tmp_path):
    """3e9 sequences of one length are never expanded: the strided subsample is built from the counts."""
    from autotune.runtime.lengths import MAX_SAMPLE

    path = tmp_path / "h.json"
    path.write_text(json.dumps({"100": 3_000_000_000, "7": 1_000_000_000}))
    sample = read_length_sample(path)
    assert len(sample) == MAX_SAMPLE and set(sample) == {100, 7}
    assert sample.count(100) == pytest.approx(0.75 * MAX_SAMPLE, abs=2)
    path.write_text(json.dumps({"lengths": [10, 20], "counts": [3, 1]}))
    assert read_length_sample(path) == [10, 10, 10, 20]


def test_a_histogram_count_past_float_range_is_subsampled_exactly(tmp_path):
    """JSON allows 4300-digit ints: a count of 10**400 was an OverflowError (float division), not a sample."""
    from autotune.runtime.lengths import MAX_SAMPLE

    path = tmp_path / "h.json"
    path.write_text(json.dumps({"lengths": [7, 100], "counts": [10**400, 3 * 10**400]}))
    sample = read_length_sample(path)
    assert len(sample) == MAX_SAMPLE and sample.count(7) == MAX_SAMPLE // 4


@pytest.mark.parametrize(
    ("name", "data"),
    [
        ("bom.json", "\ufeff[512, 300]".encode()),  # Notepad, PowerShell -Encoding UTF8
        ("bom.txt", "\ufeff512 300".encode()),
        ("ps.txt", "512\r\n300\r\n".encode("utf-16")),  # Windows PowerShell's `>`
    ],
    ids=["utf8-bom-json", "utf8-bom-text", "utf16-text"],
)
def test_text_with_a_byte_order_mark_is_read(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    assert read_length_sample(path) == [512, 300]


def test_numpy_files_are_known_by_contents_and_any_case_suffix(tmp_path):
    """An np.save array named L.NPY or lengths.bin was decoded as UTF-8 text ("cannot read it as text")."""
    for name in ("L.NPY", "lengths.bin"):
        with open(tmp_path / name, "wb") as f:
            np.save(f, np.array([5, 600]))
        assert read_length_sample(tmp_path / name) == [5, 600]
    with open(tmp_path / "l.npz", "wb") as f:
        np.savez(f, a=np.array([1, 2]))
    with pytest.raises(LengthsError, match="npz"):
        read_length_sample(tmp_path / "l.npz")


def test_a_directory_is_named_as_one(tmp_path):
    with pytest.raises(LengthsError, match="is a directory") as info:
        read_length_sample(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_large_npy_is_checked_and_strided_in_numpy(tmp_path):
    """Past MAX_SAMPLE lengths an .npy keeps the same evenly strided subsample as any file (without a Python int
    per length first); a bad length anywhere is still named, and a subsample holding only zeros is an error (it was
    returned, and tuned as if the file had no real length)."""
    from autotune.runtime.lengths import MAX_SAMPLE

    path = tmp_path / "big.npy"
    arr = np.arange(3 * MAX_SAMPLE + 7, dtype=np.int64) % 4000
    np.save(path, arr)
    step = len(arr) / MAX_SAMPLE
    assert read_length_sample(path) == [int(arr[int(i * step)]) for i in range(MAX_SAMPLE)]
    arr[-1] = 40000
    np.save(path, arr)
    with pytest.raises(LengthsError, match="length 40000 is longer"):
        read_length_sample(path)
    zeros = np.zeros(2 * MAX_SAMPLE + 1, dtype=np.int32)
    zeros[1] = 512  # never a strided index
    np.save(path, zeros)
    with pytest.raises(LengthsError, match="no non-zero length in the sample .*kept of its 2000001"):
        read_length_sample(path)


@pytest.mark.parametrize(("max_len", "batch", "name"), [(1024.0, 4, "max_len"), (float("nan"), 4, "max_len"),
                                                          (True, 4, "max_len"), (64, 2.0, "batch"), (64, True, "batch"),
                                                          (64, 0, "batch")])  # fmt: skip
def test_length_laws_take_only_integer_sizes(max_len, batch, name):
    """A float, NaN or bool size came back as lengths ([nan, nan], [1024.0, ...], [True]) or a TypeError."""
    from autotune.runtime.buckets import sequence_lengths

    for draw in (
        lambda: sequence_lengths(max_len, batch, "uniform", 0),
        lambda: sample_lengths([5], max_len, batch, 0),
    ):
        with pytest.raises(ValueError, match=f"{name} must be an integer >= 1"):
            draw()
    assert sequence_lengths(np.int64(64), np.int32(3), "jagged", 0) == sequence_lengths(64, 3, "jagged", 0)


@pytest.mark.parametrize("sep", ["\n", ","], ids=["one-a-line", "one-line"])
def test_a_large_text_file_is_parsed_in_little_memory(tmp_path, sep):
    """1.5M lengths, one a line or all on one line: a list of words per line held ~300 bytes a length (a 68 MB file
    of 12M lengths took 4.4 GB; 490 MB here, 147 MB on one line); the lengths are now held in one compact array
    while read (89 MB here, mostly the 1M lengths kept), and the strided subsample is kept."""
    import tracemalloc

    from autotune.runtime.lengths import MAX_SAMPLE

    n = MAX_SAMPLE + MAX_SAMPLE // 2
    values = [(i * 7919) % 30000 + 1 for i in range(n)]
    path = tmp_path / "lengths.txt"
    path.write_text(sep.join(map(str, values)) + "\n")
    tracemalloc.start()
    try:
        got = read_lengths_file(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    step = n / MAX_SAMPLE
    assert got.batches is None and got.sample == [values[int(i * step)] for i in range(MAX_SAMPLE)]
    assert peak < 110 * 2**20, f"peak {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_text_batches_and_comments_survive_the_line_parser(tmp_path, monkeypatch, chunk):
    """Lines, comments, commas, CR and CRLF line ends are read as before (whatever the chunks the text is split
    into lines by): batches where a line holds several."""
    from autotune.runtime import lengths

    monkeypatch.setattr(lengths, "_CHUNK", chunk)
    path = tmp_path / "b.txt"
    path.write_bytes(b"# header\r\n5, 6 # two\r\n\r\n7\r8 9\n  \n10")
    got = read_lengths_file(path)
    assert got.sample == [5, 6, 7, 8, 9, 10] and got.batches == [[5, 6], [7], [8, 9], [10]]
    path.write_text("3\n-4\n")
    with pytest.raises(LengthsError, match="negative length -4"):
        read_length_sample(path)


def test_a_text_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from autotune.runtime import lengths

    path = tmp_path / "big.txt"
    path.write_text("512\n" * 1000)
    monkeypatch.setattr(lengths, "MAX_TEXT_BYTES", 3000)
    monkeypatch.setattr(Path, "read_bytes", lambda self: pytest.fail("read a file over the limit"))
    with pytest.raises(LengthsError, match=r"big.txt: the file is 0 MiB, over the 0 MiB .*np.save"):
        read_length_sample(path)


def test_a_large_npy_is_memory_mapped_not_loaded(tmp_path, monkeypatch):
    """np.load read the whole array into memory (a file larger than the host's memory could not be used)."""
    import numpy

    path = tmp_path / "l.npy"
    np.save(path, np.arange(1, 10, dtype=np.int32))
    seen = []
    real_load = numpy.load
    monkeypatch.setattr(numpy, "load", lambda *a, **k: seen.append(k.get("mmap_mode")) or real_load(*a, **k))
    assert read_length_sample(path) == list(range(1, 10)) and seen == ["r"]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"lengths": [5], "512": 3}, r"unknown keys \['512'\] beside 'lengths'"),  # the histogram part was dropped
        ({"lengths": [5], "counts": [2], "note": "x"}, r"unknown keys \['note'\]"),
        ({"counts": [5]}, "'counts' without 'lengths'"),
    ],
)
def test_a_lengths_object_holds_only_lengths_and_counts(tmp_path, content, match):
    path = tmp_path / "h.json"
    path.write_text(json.dumps(content))
    with pytest.raises(LengthsError, match=match) as info:
        read_length_sample(path)
    assert str(path) in str(info.value)


def test_the_recorded_fill_of_a_wide_batch_of_short_lengths_is_never_zero():
    """Four decimals rounded a fill of ~5e-5 (a sample of 1s, batch 65535, bucket 32K) to 0.0: the tuned entry then
    failed the artifact's own check ``fill in (0, 1]`` and could not be written."""
    from autotune.runtime.artifacts import _check_fill
    from autotune.runtime.buckets import batch_fill
    from autotune.tuning.tasks import MAX_BATCH
    from autotune.tuning.tuner import TaskResult

    task = Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 32768, "jagged", batch=MAX_BATCH, sample=(1,))
    entry = TaskResult(task).entry()
    exact = batch_fill(task.lengths(), task.max_len)
    for fill in (entry["fill"], entry["lengths"]["batch_fill"]):
        _check_fill(fill, "fill")
        assert fill == pytest.approx(exact, rel=1e-3)
    plain = TaskResult(Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "uniform")).entry()
    assert plain["fill"] == 1.0


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--gpu", "h100", "--dry-run", "--kernel", "fwd", "--dims", "32", "--buckets", "256"],
        ["tasks", "--from-model", "tiny", "--gpu", "h100"],
    ],
    ids=["run", "tasks"],
)
def test_an_empty_lengths_path_is_a_usage_error(capsys, argv):
    """`--lengths "$UNSET"` was dropped without a word: the run tuned the synthetic law, not the user's lengths."""
    from autotune.tuning.cli import main

    assert main([*argv, "--lengths", ""]) == 2
    assert "--lengths '': an empty path; name a lengths file" in capsys.readouterr().err
    with pytest.raises(LengthsError, match="an empty path"):
        read_lengths_file("  ")
    with pytest.raises(TypeError, match="path must be a lengths file path"):
        read_lengths_file(None)


@pytest.mark.parametrize(
    ("sample", "match"),
    [
        ((), "at least one non-zero length"),
        ((0, 0), "at least one non-zero length"),
        ((5, -1), r"ints in \[0, 32768\], got -1"),
        ((5, 40000), "got 40000"),
        ((True, 5), "got True"),
        ((5.0,), "got 5.0"),
        ([5, 6], "must be a tuple"),
    ],
)
def test_a_task_refuses_a_sample_no_lengths_file_gives(sample, match):
    """An empty sample (a task read back from a farm's storage) tuned a whole study, then failed to describe it in
    the entry (IndexError); a list made the task unhashable."""
    with pytest.raises(ValueError, match=match):
        Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "jagged", sample=sample)
    d = Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 2, 1024, "jagged", sample=(5,)).to_dict()
    if isinstance(sample, tuple):
        with pytest.raises(ValueError, match=match):
            Task.from_dict({**d, "sample": list(sample)})


class _Boom:
    """Unpickling it leaves a file behind: the proof that a lengths file was unpickled."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


@pytest.mark.parametrize("name", ["evil.npy", "evil.bin"])
def test_a_pickle_bearing_npy_is_refused_never_unpickled(tmp_path, name):
    marker = tmp_path / "unpickled"
    path = tmp_path / name
    with open(path, "wb") as f:
        np.save(f, np.array([_Boom(str(marker)), 5], dtype=object), allow_pickle=True)
    with pytest.raises(LengthsError, match="not a readable .npy array") as info:
        read_length_sample(path)
    assert str(path) in str(info.value) and not marker.exists()


def test_the_recorded_fill_is_the_fill_dispatch_computes_for_the_timed_call():
    """The tuner times a batch drawn from a sample with max_seq_len = its longest length (3000 here, in the 4K
    bucket); the entry recorded L / (B x bucket), 1.37x below the fill dispatch computes for that very call."""
    import torch

    from autotune.runtime import dispatch
    from autotune.tuning.tuner import TaskResult
    from kernel_templates.hstu_attention.tuning import make_inputs_fwd

    sample = (12, 40, 100, 700, 1500, 3000)
    task = Task("hstu_attention_fwd", "h100", "bfloat16", 32, 32, 1, 4096, "jagged", batch=8, sample=sample)
    lengths = task.lengths()
    inputs = make_inputs_fwd(task, lengths, 0, "cpu", torch.float32)
    rows, batch = inputs["q"].shape[0], inputs["seq_offsets"].shape[0] - 1
    timed = dispatch.call_fill(rows, batch, inputs["max_seq_len"])
    assert inputs["max_seq_len"] == 3000
    entry = TaskResult(task).entry()
    assert entry["fill"] == entry["lengths"]["batch_fill"] == pytest.approx(timed, rel=1e-3)
    assert dispatch.fill_bin(entry["fill"]) == dispatch.fill_bin(timed)
