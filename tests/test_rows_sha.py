"""Benchmark rows name the code they timed: HEAD's sha, marked dirty when tracked files differ."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from benchmarks.rows import git_sha


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_git_sha_marks_a_tree_that_differs_from_head(tmp_path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "one")
    head = git("rev-parse", "--short", "HEAD").strip()
    assert git_sha(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")  # what a snapshot copied over an older .git looks like
    assert git_sha(tmp_path) == head + "+dirty"
    assert git_sha(tmp_path / "missing") is None


@pytest.fixture
def results(tmp_path, monkeypatch):
    """``append_rows`` writing under tmp_path (results/ and $OUT), with a fixed environment."""
    from benchmarks import rows

    monkeypatch.setattr(rows, "RESULTS", tmp_path / "results")
    monkeypatch.setattr(rows, "environment", lambda: {"gpu": "cpu", "git_sha": "abc"})
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    return tmp_path


def test_a_row_that_cannot_be_written_appends_none(results):
    """The rows before an unwritable one went to results/ (and none to $OUT): a half-appended table."""
    from benchmarks.rows import append_rows

    with pytest.raises(TypeError, match=r"append_rows\('t'\): row 1 cannot be written as JSON"):
        append_rows("t", [{"p50_ms": 1.0}, {"p50_ms": object()}])
    assert not list(results.glob("**/*.jsonl"))


def test_rows_are_strict_json_with_nan_as_null_and_numpy_scalars_as_numbers(results):
    """A NaN timing was written as NaN (no strict JSON reader takes the line) and a numpy.float32 was a TypeError."""
    import json

    import numpy as np

    from benchmarks.rows import append_rows

    def strict(text: str) -> dict:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))

    paths = append_rows("t", [{"p50_ms": float("nan"), "n": np.int64(3), "t": np.float32(0.5), "q": [float("inf")]}])
    for path in paths:
        assert [strict(line) for line in path.read_text().splitlines()] == [
            {"gpu": "cpu", "git_sha": "abc", "p50_ms": None, "n": 3, "t": 0.5, "q": [None]}
        ]
