"""Hostile configs of a jagged two-output op (``spec_plugin_hostile``) against the tuner's trust rules (CPU).

Each planted config is the fastest of its study: only a working check keeps it out. The study must go on
past it, record why it failed, and write the best correct config.
"""

from __future__ import annotations

import optuna
import pytest
from plugin_specs import registered_plugin, trials_by_mode

from autotune.runtime import artifacts as art
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TuneOptions, run_tasks
from autotune.tuning.worker import check_lengths

PLUGIN = "spec_plugin_hostile"
OK = {"mode": "ok"}
CORRECT = ({"mode": "ok"}, {"mode": "slow"})  # which of the two wins is the timing's call (a busy CPU)


@pytest.fixture
def plugin(monkeypatch):
    with registered_plugin(monkeypatch, PLUGIN) as module:
        yield module


def _task(plugin, batch: int = 8) -> Task:
    return Task(plugin.NAME, "h100", "float32", 32, 32, 1, 256, "uniform", batch=batch, seq_cap=16)


def _opts(tmp_path, **kw) -> TuneOptions:
    base = dict(
        n_trials=6, sampler="bruteforce", artifacts_root=tmp_path, eval_timeout_s=20.0, plugins=[PLUGIN],
        interpret=True, compare_rounds=6, compare_max_rounds=12, setup_backoff_s=0.05,
    )  # fmt: skip
    base.update(kw)
    return TuneOptions(**base)


def _trials(tmp_path, task: Task) -> dict[str, optuna.trial.FrozenTrial]:
    return trials_by_mode(tmp_path, task, "torch.mode")


def _written(tmp_path, plugin) -> dict:
    return art.load_artifact(art.artifact_path("h100", plugin.NAME, tmp_path)).entries[0]


@pytest.mark.parametrize(
    ("mode", "status", "why"),
    [
        ("gradwrong", "incorrect", "'dx'"),
        ("len1", "incorrect", "check batch"),
        ("empty", "incorrect", "non-finite"),
        ("nanbig", "incorrect", "timed batch"),
        ("raises", "compile", "hostile launch refuses to run"),
    ],
)
def test_a_hostile_config_never_wins_and_keeps_its_reason(tmp_path, monkeypatch, plugin, mode, status, why):
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", f"{mode},ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    by_mode = _trials(tmp_path, task)
    t = by_mode[mode]
    assert t.user_attrs["status"] == status and why in t.user_attrs["error"], t.user_attrs
    assert t.state != optuna.trial.TrialState.COMPLETE
    assert by_mode["ok"].user_attrs["status"] == "ok" and by_mode["slow"].user_attrs["status"] == "ok"
    assert r.error is None and r.config in CORRECT and _written(tmp_path, plugin)["config"] == r.config


def test_a_hang_times_out_and_the_study_goes_on(tmp_path, monkeypatch, plugin):
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "hang,ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path, eval_timeout_s=3.0))
    t = _trials(tmp_path, task)["hang"]
    assert t.user_attrs["status"] == "timeout" and t.user_attrs["attempts"] == 2
    assert r.error is None and r.config in CORRECT


def test_an_infeasible_default_is_not_written_as_verified(tmp_path, monkeypatch, plugin):
    """A default its own space's rules refuse is measured (it is the baseline), but a re-check that could
    check no case vouches for nothing: it is not written, the re-checked candidate is."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "ok")
    monkeypatch.setenv("AUTOTUNE_HOSTILE_BAD_DEFAULT", "1")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    assert r.error is None and r.config == OK and r.verified
    entry = _written(tmp_path, plugin)
    assert entry["config"] == OK and entry["verified"]


def test_an_infeasible_default_with_no_rival_is_not_written_unchecked(tmp_path, monkeypatch, plugin):
    """Alone in its study, a default whose every re-check case its rules rule out was written as the winner
    with an empty ``verified`` list: nothing had vouched for it. It is refused as unchecked, with the reason."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "")
    monkeypatch.setenv("AUTOTUNE_HOSTILE_BAD_DEFAULT", "1")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    assert r.config is None and r.error and not r.kept_default
    assert "unchecked" in r.rejected["torch:mode=slow"] and "ruled out every case" in r.rejected["torch:mode=slow"]
    assert not art.artifact_path("h100", plugin.NAME, tmp_path).exists()


def test_the_check_batch_holds_two_odd_lengths_beside_the_longest_a_single_and_an_empty_one():
    """The two middle lengths were any random lengths, both even (tile multiples) for some seeds: a kernel
    wrong on partial tiles then passed the first check."""
    for max_len in (1, 2, 3, 64, 256, 1000, 4096):
        for seed in range(40):
            lengths = check_lengths(max_len, seed)
            assert lengths[0] == max_len and lengths[3:] == [1, 0]
            assert all(n % 2 == 1 and 1 <= n <= max_len for n in lengths[1:3]), (max_len, seed, lengths)


def test_a_stray_write_into_the_timed_batch_does_not_fail_the_configs_after_it(tmp_path, monkeypatch, plugin):
    """A write far outside its outputs that lands in the timed batch's inputs (no guard reaches that far) left the
    health probe, which checked the check batch only, passing: every later timed check, the correct configs'
    and the final comparison's, failed on the corrupted inputs. The probe checks the timed batch too."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "farwrite,ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    by_mode = _trials(tmp_path, task)
    assert by_mode["farwrite"].user_attrs["status"] == "incorrect"
    assert by_mode["ok"].user_attrs["status"] == "ok" and by_mode["slow"].user_attrs["status"] == "ok"
    assert r.error is None and not r.rejected and r.config in CORRECT


def test_a_stray_write_made_only_while_timed_is_caught(tmp_path, monkeypatch, plugin):
    """Right on every checked launch, writing into other batches' inputs only in its timing loop: it won the
    study. The held batches' inputs and references are fingerprinted after the timed launches."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "latewrite,ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    by_mode = _trials(tmp_path, task)
    t = by_mode["latewrite"]
    assert t.user_attrs["status"] == "incorrect" and "while timed" in t.user_attrs["error"], t.user_attrs
    assert by_mode["ok"].user_attrs["status"] == "ok" and by_mode["slow"].user_attrs["status"] == "ok"
    assert r.error is None and r.config in CORRECT


def test_a_config_wrong_after_its_first_launches_fails_after_timing(tmp_path, monkeypatch, plugin):
    """Right on its first two launches in a process (the check and timed batches), wrong on every launch after:
    the timed launches' output is checked too, so the trial fails, not only the final re-check."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "stale,ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    t = _trials(tmp_path, task)["stale"]
    assert t.user_attrs["status"] == "incorrect" and "after its timed launches" in t.user_attrs["error"]
    assert r.error is None and r.config in CORRECT


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_config_failing_on_a_worker_found_broken_is_measured_again(tmp_path, monkeypatch, plugin, seed):
    """A config whose timing loop broke other kernels' state passed its checks; the config after it then failed
    its check and kept that verdict, though the health probe found the worker broken. A request whose worker
    fails the probe after it is run again once on a fresh worker."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "poison,ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path, seed=seed))
    by_mode = _trials(tmp_path, task)
    assert by_mode["ok"].user_attrs["status"] == "ok", by_mode["ok"].user_attrs
    assert by_mode["slow"].user_attrs["status"] == "ok", by_mode["slow"].user_attrs
    assert r.error is None and r.config in CORRECT


@pytest.mark.parametrize(
    ("field", "value"), [("dqk", 0), ("dv", -1), ("seq_cap", 0), ("seq_cap", -4), ("batch", 2.5), ("seed", 1.5)]
)
def test_a_task_refuses_a_shape_no_study_can_measure(field, value):
    """A zero head dim made empty inputs on which every config, wrong or not, passed; a zero ``seq_cap`` was taken
    as no cap (the whole bucket, minutes per check on a CPU); a fractional batch failed deep in the length draw."""
    kw = {"dqk": 32, "dv": 32, field: value}
    dims = (kw.pop("dqk"), kw.pop("dv"))
    with pytest.raises(ValueError, match=field):
        Task("fake_op", "h100", "float32", *dims, 1, 256, "uniform", **kw)


def test_a_resume_under_another_spill_limit_measures_the_configs_it_turns_over_again(tmp_path, monkeypatch, plugin):
    """A study resumed with a lower --spill-limit kept the 'ok' verdict of a config over it, which then won; one
    resumed with a higher limit kept the 'spill' verdict of a config now under it. Both are measured again."""
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "ok")
    task = _task(plugin)
    spills = plugin.OK_SPILLS
    (r,) = run_tasks([task], _opts(tmp_path, spill_limit=spills))
    assert _trials(tmp_path, task)["ok"].user_attrs["status"] == "ok"
    (r,) = run_tasks([task], _opts(tmp_path, spill_limit=spills - 1, n_trials=20))
    assert _trials(tmp_path, task)["ok"].user_attrs["status"] == "spill"
    assert r.error is None and r.config == {"mode": "slow"}
    (r,) = run_tasks([task], _opts(tmp_path, spill_limit=spills, n_trials=20))
    assert _trials(tmp_path, task)["ok"].user_attrs["status"] == "ok"
    assert r.error is None and r.config in CORRECT


def test_a_plugin_that_cannot_be_imported_is_named_not_a_dying_worker(tmp_path):
    """The worker died importing it (exit code 1) on every set-up: each task failed as 'infrastructure' after
    its retries, the module named nowhere (and a plugin's own kernel was 'unknown' unless the caller had imported
    the plugin itself). The tuner imports the plugins first; a worker names the failure in its replies."""
    from autotune.tuning.worker import Worker

    task = Task("fake_op", "h100", "float32", 32, 32, 1, 256, "uniform", batch=8, seq_cap=16)
    opts = _opts(tmp_path, plugins=["autotune.tuning.fake", "no_such_plugin_module"])
    with pytest.raises(ImportError, match="no_such_plugin_module"):
        run_tasks([task], opts)
    worker = Worker(["no_such_plugin_module"])
    try:
        reply = worker.call({"cmd": "ping"}, 120)
    finally:
        worker.close()
    assert reply["status"] == "crash" and "no_such_plugin_module" in reply["error"]


@pytest.mark.parametrize("bad_ms", [0.0, float("nan"), -1.0])
def test_a_timing_of_no_positive_finite_time_fails_its_trial_and_the_study_goes_on(
    tmp_path, monkeypatch, plugin, bad_ms
):
    """A median of 0 ms (below the timer's resolution) raised ZeroDivisionError in the TFLOP/s and ended the run;
    NaN or a negative time would have ranked first. The trial fails with the reason, a correct config wins."""
    from autotune.tuning import tuner

    request = tuner._Study.request

    def lying_clock(self, msg, timeout=None):
        reply = request(self, msg, timeout)
        if msg.get("cmd") == "time" and msg.get("config") == OK and reply.get("status") == "ok":
            reply = {**reply, "median_ms": bad_ms}
        return reply

    monkeypatch.setattr(tuner._Study, "request", lying_clock)
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "ok")
    task = _task(plugin)
    (r,) = run_tasks([task], _opts(tmp_path))
    t = _trials(tmp_path, task)["ok"]
    assert t.user_attrs["status"] == "timing" and "not a positive finite time" in t.user_attrs["error"], t.user_attrs
    assert t.state != optuna.trial.TrialState.COMPLETE
    assert r.error is None and r.config == {"mode": "slow"}


def test_a_default_whose_clock_gave_no_time_writes_nothing_and_is_timed_again(tmp_path, monkeypatch, plugin):
    """A default timed at 0 ms (a broken clock: the environment, as a timeout may be) counted as a default that ran
    wrong: the fastest config was written with no comparison, and a resumed study never timed the default again."""
    from autotune.tuning import tuner

    request = tuner._Study.request

    def lying_clock(self, msg, timeout=None):
        reply = request(self, msg, timeout)
        if msg.get("cmd") == "evaluate" and msg.get("config") == {"mode": "slow"} and reply.get("status") == "ok":
            reply = {**reply, "median_ms": 0.0}
        return reply

    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "ok")
    task = _task(plugin)
    with monkeypatch.context() as m:
        m.setattr(tuner._Study, "request", lying_clock)
        (r,) = run_tasks([task], _opts(tmp_path))
    assert r.config is None and "default config could not be measured (status timing" in r.error, r.error
    assert not art.artifact_path("h100", plugin.NAME, tmp_path).exists()
    (r,) = run_tasks([task], _opts(tmp_path))  # the clock works again: the default is timed, a winner written
    assert _trials(tmp_path, task)["slow"].user_attrs["status"] == "ok"
    assert r.error is None and r.config in CORRECT and r.default_ms


@pytest.mark.parametrize("bad_ms", [0.0, float("nan")])
def test_a_comparison_whose_clock_gave_no_time_decides_nothing(tmp_path, monkeypatch, plugin, bad_ms):
    """The interleaved comparison's times were taken as given: a median of 0 ms for the winner raised
    ZeroDivisionError in the TFLOP/s (a NaN one wrote an entry the artifact refused) and ended the whole run. Such
    a reply is a failed comparison: the study goes on and writes a correct config."""
    from autotune.tuning import tuner

    request = tuner._Study.request

    def lying_clock(self, msg, timeout=None):
        reply = request(self, msg, timeout)
        if msg.get("cmd") == "compare" and reply.get("status") == "ok":
            n = len(reply["a_ms"])
            reply = {**reply, "a_ms": [bad_ms] * (n - 2) + [1.0, 1.0], "b_ms": [2.0] * n}
        return reply

    monkeypatch.setattr(tuner._Study, "request", lying_clock)
    monkeypatch.setenv("AUTOTUNE_HOSTILE_MODES", "ok")
    (r,) = run_tasks([_task(plugin)], _opts(tmp_path))
    assert r.error is None and r.config in CORRECT and r.median_ms > 0 and r.tflops >= 0
