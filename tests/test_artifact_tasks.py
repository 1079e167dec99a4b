"""``autotune run --from-artifact`` / ``--shard``: re-measuring exactly the entries an artifact holds, in shares."""

from __future__ import annotations

import json
import shutil

import pytest

from autotune.runtime import artifacts as art
from autotune.runtime.lengths import describe
from autotune.tuning.cli import main
from autotune.tuning.tasks import shard, tasks_from_artifact


def _copy(tmp_path, gpu="h100", kernel="hstu_attention_bwd"):
    path = art.artifact_path(gpu, kernel, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy(art.artifact_path(gpu, kernel), path)
    return path


def _key(e_or_t) -> tuple:
    get = e_or_t.get if isinstance(e_or_t, dict) else lambda k: getattr(e_or_t, k)
    return tuple(get(k) for k in ("dtype", "dqk", "dv", "num_heads", "bucket", "distribution", "mask"))


def test_one_task_per_entry_of_a_stale_artifact_too(tmp_path, monkeypatch):
    path = _copy(tmp_path)
    entries = art.load_artifact(path, check_stale=False).entries
    monkeypatch.setattr(art, "current_template_hash", lambda kernel, backend="triton": "edited")
    with pytest.raises(art.ArtifactError, match="stale"):
        art.load_artifact(path)
    tasks = tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=32)
    assert sorted(_key(t) for t in tasks) == sorted(_key(e) for e in entries)
    assert len(tasks) == len(entries) and all(t.gpu == "h100" and t.batch == 32 for t in tasks)
    for a, b in zip(tasks, tasks[1:], strict=False):  # a family's buckets in ascending order, one run
        if a.family == b.family:
            assert a.bucket < b.bucket
    with pytest.raises(ValueError, match="no artifact"):
        tasks_from_artifact(["hstu_attention_fwd"], "h100", tmp_path, batch=32)


def test_an_entry_tuned_on_a_lengths_sample_needs_that_sample(tmp_path):
    path = _copy(tmp_path)
    doc = json.loads(path.read_text())
    sample = (5, 9, 40, 300, 1000, 77)
    jagged = next(e for e in doc["entries"] if e["distribution"] == "jagged")
    jagged["lengths"] = {**describe(sample), "batch_fill": 0.5}
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="was tuned on a lengths sample .*pass that sample with --lengths"):
        tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=32)
    with pytest.raises(ValueError, match="lengths sample"):
        tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=32, sample=(1, 2, 3))
    tasks = tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=32, sample=sample)
    with_sample = [t for t in tasks if t.sample is not None]
    assert [_key(t) for t in with_sample] == [_key(jagged)] and with_sample[0].sample == sample


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_cover_every_task_once_and_keep_families_whole(n):
    tasks = tasks_from_artifact(["hstu_attention_bwd"], "h100", art.DEFAULT_ROOT, batch=32)
    parts = [shard(tasks, f"{k}/{n}") for k in range(1, n + 1)]
    assert sorted(map(_key, (t for p in parts for t in p))) == sorted(map(_key, tasks))
    for i, p in enumerate(parts):
        others = {t.family for j, q in enumerate(parts) if j != i for t in q}
        assert not others & {t.family for t in p}
    # Shards are 1-based; int() let " 1/2", "+1/2", "1_0/20" and non-ASCII digits through.
    for bad in ("0/2", "3/2", "1/0", "1", "a/b", "1/2/3", " 1/2", "1/2 ", "+1/2", "-1/2", "1/-2", "1_0/20", "\uff11/2"):
        with pytest.raises(ValueError, match="shard must be K/N"):
            shard(tasks, bad)


def _run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


def test_cli_from_artifact_lists_the_entries_and_refuses_grid_options(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("COLUMNS", "200")
    kernel = "ln_mul_dropout_fwd"
    path = _copy(tmp_path, kernel=kernel)
    count = len(art.load_artifact(path, check_stale=False).entries)
    base = ("run", "--gpu", "h100", "--dry-run", "--artifacts", str(tmp_path), "--kernel", kernel, "--from-artifact")
    rc, text = _run(capsys, *base)
    assert rc == 0 and text.count(f"{kernel} bfloat16") == count > 0
    rc, text = _run(capsys, *base, "--shard", "1/1")
    assert rc == 0 and text.count(f"{kernel} bfloat16") == count
    rc, text = _run(capsys, *base, "--dims", "256")
    assert rc == 2 and "--dims cannot be combined with --from-artifact" in text
    rc, text = _run(capsys, *base, "--shard", "4/3")
    assert rc == 2 and "--shard must be K/N" in text
    with pytest.raises(SystemExit):  # argparse: one task source at a time
        main([*base, "--from-model", "tiny"])
    assert "not allowed with argument --from-artifact" in capsys.readouterr().err


def test_cli_an_empty_shard_is_nothing_to_do(capsys, tmp_path):
    """A shard past the family count (one family here, 8 shards) was a run of 0 tasks that still made its
    --artifacts folder (with --backends: a usage error, since no kernel declared the backend)."""
    base = ("run", "--gpu", "h100", "--interpret", "--kernel", "fwd", "--distributions", "uniform")
    root = tmp_path / "artifacts"
    rc, text = _run(capsys, *base, "--artifacts", str(root), "--backends", "triton", "--shard", "5/8")
    assert (
        rc == 0
        and text.strip() == "autotune: --shard 5/8 holds no tasks (fewer task families than shards); nothing to do"
    )
    assert not root.exists()
    for bad in (" 1/2", "1/0", "0/2", "1/2/3", "a/b", "-1/2"):
        rc, text = _run(capsys, *base, f"--shard={bad}")
        assert rc == 2 and text.strip().startswith("autotune: error: --shard must be K/N"), (bad, text)


def test_cli_from_artifact_refuses_a_lengths_file_no_entry_was_tuned_on(capsys, tmp_path):
    """``--from-artifact --lengths FILE`` over entries none of which was tuned on a lengths sample re-measured them
    on the synthetic laws: the file was read, then ignored without a word."""
    kernel = "ln_mul_dropout_fwd"
    _copy(tmp_path, kernel=kernel)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("5\n9\n40\n300\n")
    base = ("run", "--gpu", "h100", "--dry-run", "--artifacts", str(tmp_path), "--kernel", kernel, "--from-artifact")
    rc, text = _run(capsys, *base, "--lengths", str(lengths))
    assert rc == 2 and "--lengths" in text and "no entry" in text, text


def _record_batch(path, batch: int) -> tuple:
    """Give the artifact's first entry a recorded batch size; its key."""
    doc = json.loads(path.read_text())
    doc["entries"][0]["batch"] = batch
    path.write_text(json.dumps(doc))
    return _key(doc["entries"][0])


def test_an_entry_is_re_measured_at_the_batch_it_records(tmp_path):
    """Entries did not record their batch, so ``--from-artifact`` timed every one at ``--batch``: another
    measurement than the one the entry holds. An entry that records one keeps it; older entries take ``batch``."""
    path = _copy(tmp_path)
    assert all("batch" not in e for e in art.load_artifact(path, check_stale=False).entries)  # committed: none
    key = _record_batch(path, 7)
    tasks = tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=32)
    assert {_key(t): t.batch for t in tasks if t.batch != 32} == {key: 7}
    forced = tasks_from_artifact(["hstu_attention_bwd"], "h100", tmp_path, batch=16, force_batch=True)
    assert len(forced) == len(tasks) and {t.batch for t in forced} == {16}


def test_cli_from_artifact_takes_the_recorded_batch_unless_batch_is_given(monkeypatch, tmp_path):
    import autotune.tuning.cli as cli

    kernel = "ln_mul_dropout_fwd"
    key = _record_batch(_copy(tmp_path, kernel=kernel), 5)
    seen: list = []
    monkeypatch.setattr(cli, "_dry_run", lambda console, tasks, args: seen.append(tasks) or 0)
    base = ["run", "--gpu", "h100", "--dry-run", "--artifacts", str(tmp_path), "--kernel", kernel, "--from-artifact"]
    assert main(base) == 0
    assert {_key(t): t.batch for t in seen[-1] if t.batch != 32} == {key: 5}  # the others: --batch's default
    assert main([*base, "--batch", "32"]) == 0  # given, even at the default's value: every entry at it
    assert {t.batch for t in seen[-1]} == {32} and len(seen[-1]) == len(seen[0])


def test_cli_from_artifact_under_interpret_keeps_the_interpreters_batch(monkeypatch, tmp_path):
    """An entry's recorded GPU batch (say 32) would run for minutes under the Triton interpreter, whose runs time
    a tiny default batch: ``--interpret`` re-measures every entry at ``--batch``, as an explicit one does."""
    import autotune.tuning.cli as cli

    kernel = "ln_mul_dropout_fwd"
    _record_batch(_copy(tmp_path, kernel=kernel), 32)
    seen: list = []
    monkeypatch.setattr(cli, "_dry_run", lambda console, tasks, args: seen.append(tasks) or 0)
    argv = ["run", "--gpu", "h100", "--dry-run", "--interpret", "--artifacts", str(tmp_path), "--kernel", kernel]
    assert main([*argv, "--from-artifact"]) == 0
    assert seen and {t.batch for t in seen[-1]} == {cli.INTERPRET_DEFAULTS["batch"]}
