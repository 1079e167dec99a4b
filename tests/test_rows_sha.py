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
