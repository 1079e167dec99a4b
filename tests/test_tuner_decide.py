"""What a study writes and re-checks (CPU, interpreter): the final decision (``tuner._decide``), the re-check's
cases and the knobs a run takes.

A default that fails the final re-check is never written; a candidate that passed its re-check then wins
whatever its comparison with the default said, in the run that found the default wrong, not only in a re-run.
"""

from __future__ import annotations

import pytest
from plugin_specs import registered_plugin

from autotune.runtime import artifacts as art
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TuneOptions, run_tasks

PLUGIN = "spec_plugin_bad_default"


@pytest.fixture
def plugin(monkeypatch):
    with registered_plugin(monkeypatch, PLUGIN) as module:
        yield module


def test_a_default_failing_its_recheck_leaves_the_rechecked_candidate_the_winner(tmp_path, plugin):
    task = Task(plugin.NAME, "h100", "float32", 32, 32, 1, 256, "uniform", batch=8, seq_cap=16)
    opts = TuneOptions(
        n_trials=2, sampler="bruteforce", artifacts_root=tmp_path, eval_timeout_s=30.0, plugins=[PLUGIN],
        interpret=True, compare_rounds=2, compare_max_rounds=2,
    )  # fmt: skip
    (r,) = run_tasks([task], opts)
    assert "torch:mode=narrow" in r.rejected and "many-short" in r.rejected["torch:mode=narrow"]
    assert r.error is None and r.config == {"mode": "ok"} and not r.kept_default
    assert r.comparison is not None and r.verified
    entry = art.load_artifact(art.artifact_path("h100", plugin.NAME, tmp_path)).entries[0]
    assert entry["config"] == {"mode": "ok"}


def test_a_full_recheck_covers_the_tasks_own_mask_when_the_op_lists_other_masks(plugin):
    """An op whose ``verify_masks`` lacks the task's mask: "full" re-checked only the listed masks, so a
    winner tuned on the window mask was never re-checked on it (while "quick" would have)."""
    import dataclasses

    from autotune.tuning.registry import get_op
    from autotune.tuning.worker import verify_cases

    op = dataclasses.replace(get_op(plugin.NAME), verify_masks=("causal",))
    task = Task(plugin.NAME, "h100", "float32", 32, 32, 1, 256, "uniform", mask="window", seq_cap=16)
    quick = {label for label, _, _ in verify_cases(op, task, False, False)}
    full = {label for label, _, _ in verify_cases(op, task, True, False)}
    assert quick == {"many-short/window/float32", "one-long/window/float32"}
    assert quick <= full and "many-short/causal/float16" in full


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("verify", "Full"),  # ran the quick re-check (the worker reads anything but "full" as quick)
        ("eval_timeout_s", 0),  # every config failed as a hang
        ("setup_timeout_s", -1.0),
        ("setup_retries", 0),  # an IndexError once the worker was first set up
        ("warm_starts", "every"),
        ("compare_max_rounds", 2),  # below compare_rounds (6)
        ("spill_limit", -1),  # every config failed as "spill", the default too
        ("seed", -1),  # the sampler refused it once the study was opened
        ("seed", 2**32),
        ("prune_percentile", 150.0),
        ("prune_percentile", float("nan")),
        ("setup_backoff_s", -1.0),
    ],
)
def test_tune_options_refuse_a_knob_no_run_can_work_with(knob, value):
    with pytest.raises(ValueError, match=knob):
        TuneOptions(**{knob: value})
