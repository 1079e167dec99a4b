"""Planted faults against the tuner's trust rules (CPU, the ``fake_faults`` op of ``autotune.tuning.fake``).

Each planted config is the fastest of its study, so only a working rule keeps it out of the
artifact: the best correct config must win and no wrong config may be written.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import optuna
import pytest
from plugin_specs import decide_raises_for_bucket, trials_by_mode
from proc_env import child_env

from autotune.runtime import artifacts as art
from autotune.tuning.measure import compare_extended, compare_verdict
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TuneOptions, make_storage, run_tasks

load_plugins(["autotune.tuning.fake"])
OK = {"mode": "ok", "size": 1}


def _task(batch: int = 8) -> Task:
    return Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=batch, seq_cap=16)


def _opts(tmp_path, **kw) -> TuneOptions:
    base = dict(
        n_trials=10,
        sampler="bruteforce",
        artifacts_root=tmp_path,
        eval_timeout_s=4.0,
        plugins=["autotune.tuning.fake"],
        interpret=True,
        setup_backoff_s=0.05,
    )
    base.update(kw)
    return TuneOptions(**base)


def _trials(tmp_path, task: Task) -> dict[str, optuna.trial.FrozenTrial]:
    return trials_by_mode(tmp_path, task, "fake.mode")


def _written(tmp_path) -> dict:
    entry = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries[0]
    return entry["config"]


def _plant(monkeypatch, modes: str) -> None:
    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", modes)


def test_sticky_unknown_error_does_not_poison_later_configs(tmp_path, monkeypatch):
    _plant(monkeypatch, "sticky,ok,ok2")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path), None)
    by_mode = _trials(tmp_path, task)
    assert by_mode["sticky"].user_attrs["status"] in ("compile", "crash")
    # Every config measured after the sticky one ran on a healthy worker.
    assert by_mode["ok"].user_attrs["status"] == "ok" and by_mode["ok2"].user_attrs["status"] == "ok"
    assert by_mode["slow"].user_attrs["status"] == "ok"
    assert r.error is None and r.config == OK and _written(tmp_path) == OK


def test_config_wrong_only_on_the_timed_batch_never_wins(tmp_path, monkeypatch):
    _plant(monkeypatch, "bigwrong,ok")
    task = _task(batch=8)
    (r,) = run_tasks([task], _opts(tmp_path))
    t = _trials(tmp_path, task)["bigwrong"]
    assert t.user_attrs["status"] == "incorrect" and "timed batch" in t.user_attrs["error"]
    assert t.state != optuna.trial.TrialState.COMPLETE
    assert r.config == OK and _written(tmp_path) == OK


def test_config_wrong_only_on_other_shapes_is_rejected_by_the_final_recheck(tmp_path, monkeypatch):
    _plant(monkeypatch, "narrow,ok")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path))
    narrow = _trials(tmp_path, task)["narrow"]
    assert narrow.user_attrs["status"] == "ok"  # correct on everything it was timed on ...
    assert narrow.user_attrs["config_key"] in r.rejected  # ... but refused at the end
    assert "many-short" in r.rejected[narrow.user_attrs["config_key"]]
    assert r.config == OK and _written(tmp_path) == OK
    assert any(c.startswith("many-short/") for c in r.verified) and any(c.startswith("one-long/") for c in r.verified)
    assert r.statuses.get("incorrect", 0) >= 1
    entry = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries[0]
    assert entry["verified"] == r.verified and entry["compare"]["beats"] and entry["compare"]["rounds"] == 6


def test_nan_output_is_incorrect(tmp_path, monkeypatch):
    _plant(monkeypatch, "nan,ok")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path))
    t = _trials(tmp_path, task)["nan"]
    assert t.user_attrs["status"] == "incorrect" and "non-finite" in t.user_attrs["error"]
    assert r.config == OK


@pytest.mark.parametrize(("mode", "what"), [("overrun", "past its last element"), ("clobber", "input 'x'")])
def test_config_writing_outside_its_outputs_never_wins(tmp_path, monkeypatch, mode, what):
    """Right values in the output, a stray write beside it: the guarded check refuses it, names the write,
    and the configs after it run on a fresh worker (its inputs may be the ones it overwrote)."""
    _plant(monkeypatch, f"{mode},ok")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path))
    by_mode = _trials(tmp_path, task)
    t = by_mode[mode]
    assert t.user_attrs["status"] == "incorrect" and what in t.user_attrs["error"], t.user_attrs
    assert t.state != optuna.trial.TrialState.COMPLETE
    assert by_mode["ok"].user_attrs["status"] == "ok" and by_mode["slow"].user_attrs["status"] == "ok"
    assert r.error is None and r.config == OK and _written(tmp_path) == OK


@pytest.mark.parametrize(("mode", "status"), [("hang", "timeout"), ("crash", "crash")])
def test_hang_and_crash_are_retried_once_on_a_fresh_worker(tmp_path, monkeypatch, mode, status):
    _plant(monkeypatch, f"{mode},ok")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path, eval_timeout_s=3.0))
    t = _trials(tmp_path, task)[mode]
    assert t.user_attrs["status"] == status and t.user_attrs["attempts"] == 2
    assert "first_error" in t.user_attrs
    assert _trials(tmp_path, task)["ok"].user_attrs["status"] == "ok"
    assert r.config == OK and _written(tmp_path) == OK


def test_setup_dying_twice_is_infrastructure_not_a_config_failure(tmp_path, monkeypatch):
    _plant(monkeypatch, "ok,ok2")
    counter = tmp_path / "deaths"
    monkeypatch.setenv("AUTOTUNE_FAKE_SETUP_DEATHS", f"{counter}:2")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path))
    assert counter.read_text() == "2"
    statuses = {m: t.user_attrs["status"] for m, t in _trials(tmp_path, task).items()}
    assert statuses == {"slow": "ok", "ok": "ok", "ok2": "ok"}
    assert r.error is None and r.config == OK and r.default_ms is not None


def test_setup_that_never_works_fails_the_task_but_charges_no_config(tmp_path, monkeypatch):
    _plant(monkeypatch, "ok")
    counter = tmp_path / "deaths"
    monkeypatch.setenv("AUTOTUNE_FAKE_SETUP_DEATHS", f"{counter}:3")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path, setup_retries=3))
    assert r.error and r.error.startswith("infrastructure") and r.config is None
    assert not art.artifact_path("h100", "fake_faults", tmp_path).exists()
    # The set-up deaths are used up: a re-run measures every config, none was recorded as failed.
    (again,) = run_tasks([task], _opts(tmp_path))
    statuses = {m: t.user_attrs["status"] for m, t in _trials(tmp_path, task).items()}
    assert statuses == {"slow": "ok", "ok": "ok"} and again.config == OK


_KILLED_RUN = """
import sys
from pathlib import Path
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TuneOptions, run_tasks
load_plugins(["autotune.tuning.fake"])
task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=8, seq_cap=16)
opts = TuneOptions(n_trials=10, sampler="bruteforce", artifacts_root=Path(sys.argv[1]), eval_timeout_s=120,
                   plugins=["autotune.tuning.fake"], interpret=True)
run_tasks([task], opts)
"""


def test_kill_during_the_defaults_trial_then_resume_measures_the_default(tmp_path, monkeypatch):
    _plant(monkeypatch, "ok")
    env = child_env(AUTOTUNE_FAKE_DEFAULT_SLEEP="60")
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_RUN), str(tmp_path)], env=env, start_new_session=True
    )
    task = _task()
    storage = make_storage(None, task.gpu, tmp_path)
    deadline = time.time() + 120
    running = None
    try:
        while running is None and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
            for name in optuna.get_all_study_names(storage):
                for t in optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False):
                    if t.state == optuna.trial.TrialState.RUNNING and t.user_attrs.get("config_key"):
                        running = t
        assert running is not None and running.user_attrs["config_key"] == "fake:mode=slow"
    finally:
        with contextlib.suppress(ProcessLookupError):  # it may have ended on its own (the assertion says why)
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    (r,) = run_tasks([task], _opts(tmp_path))
    trials = _trials(tmp_path, task)
    assert trials["slow"].user_attrs["status"] == "ok" and r.default_ms is not None
    assert r.config == OK and r.speedup > 1.0
    entry = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries[0]
    assert entry["default_ms"] is not None and entry["config"] == OK
    storage = make_storage(None, task.gpu, tmp_path)
    name = optuna.get_all_study_names(storage)[0]
    states = [t.user_attrs.get("status") for t in optuna.load_study(study_name=name, storage=storage).trials]
    assert "interrupted" in states and optuna.trial.TrialState.RUNNING not in [
        t.state for t in optuna.load_study(study_name=name, storage=storage).trials
    ]


def test_a_default_that_timed_out_is_measured_again_on_resume_and_nothing_is_written_without_it(tmp_path, monkeypatch):
    """A default that timed out (a short --eval-timeout, a busy machine) writes no winner: nothing was
    compared with it. The resumed run measures the default again, then compares the winner with it."""
    _plant(monkeypatch, "ok")
    monkeypatch.setenv("AUTOTUNE_FAKE_DEFAULT_SLEEP", "30")
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path, eval_timeout_s=1.5))
    assert _trials(tmp_path, task)["slow"].user_attrs["status"] == "timeout"
    assert r.config is None and r.error and "default" in r.error
    assert not art.artifact_path("h100", "fake_faults", tmp_path).exists()
    monkeypatch.delenv("AUTOTUNE_FAKE_DEFAULT_SLEEP")
    (again,) = run_tasks([task], _opts(tmp_path))
    assert _trials(tmp_path, task)["slow"].user_attrs["status"] == "ok"
    assert again.error is None and again.config == OK and again.default_ms is not None
    entry = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries[0]
    assert entry["default_ms"] is not None and entry["compare"]["rounds"] >= 6


def test_a_task_cut_by_its_budget_that_then_raises_stays_cut(tmp_path, monkeypatch):
    """The budget cut the task, then the worker's set-up failed during the final re-checks: the error result,
    built fresh from the exception, dropped the cut, so the task was listed as failed with no word that the same
    command resumes it. It keeps the cut (and its measured trials) with its error, and a re-run resumes it."""
    from autotune.tuning import tuner

    _plant(monkeypatch, "ok,ok2")
    real_decide = tuner._decide

    def setup_gone_at_the_recheck(s: tuner._Study, result: tuner.TaskResult) -> object:
        def no_setup() -> None:
            raise tuner.InfraError("worker set-up failed 3 times; last: CUDA out of memory")

        monkeypatch.setattr(s, "ensure_setup", no_setup)
        return real_decide(s, result)

    monkeypatch.setattr(tuner, "_decide", setup_gone_at_the_recheck)
    task = _task()
    (r,) = run_tasks([task], _opts(tmp_path), 0.01)
    assert r.error and r.error.startswith("infrastructure") and "CUDA out of memory" in r.error
    assert r.cut and 1 <= r.trials < 10 and r.config is None
    monkeypatch.setattr(tuner, "_decide", real_decide)
    (again,) = run_tasks([task], _opts(tmp_path))
    assert again.error is None and not again.cut and again.config == OK


def test_a_config_that_timed_out_under_a_shorter_eval_timeout_is_timed_again_on_resume(tmp_path, monkeypatch):
    """A resumed plain run (no farm namespace) with a longer --eval-timeout times again the configs that timed
    out under the shorter one (a long compile); under the same limit a timeout stays final."""
    _plant(monkeypatch, "ok")
    monkeypatch.setenv("AUTOTUNE_FAKE_OK_FIRST_SLEEP", "4")
    task = _task()

    def ok_trials() -> list[optuna.trial.FrozenTrial]:
        storage = make_storage(None, task.gpu, tmp_path)
        name = next(n for n in optuna.get_all_study_names(storage) if n.startswith(task.study_name + "|src"))
        trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
        return [t for t in trials if t.params.get("fake.mode") == "ok" and not t.user_attrs.get("duplicate")]

    (first,) = run_tasks([task], _opts(tmp_path, eval_timeout_s=1.5))
    (ok,) = ok_trials()
    assert ok.user_attrs["status"] == "timeout" and first.config != OK
    run_tasks([task], _opts(tmp_path, eval_timeout_s=1.5))
    assert len(ok_trials()) == 1  # the same limit: not timed again
    (again,) = run_tasks([task], _opts(tmp_path, eval_timeout_s=30.0))
    timed = ok_trials()
    assert [t.user_attrs["status"] for t in timed] == ["timeout", "ok"]
    assert [t.user_attrs["eval_timeout_s"] for t in timed] == [1.5, 30.0]
    assert again.error is None and again.config == OK and _written(tmp_path) == OK


def test_compare_verdict_needs_a_gain_beyond_the_spread():
    steady = compare_verdict([1.0] * 6, [1.10] * 6)
    assert steady["beats"] and steady["speedup"] == pytest.approx(1.10) and steady["rounds"] == 6
    assert not compare_verdict([1.0] * 6, [1.0] * 6)["beats"]
    noisy = compare_verdict([1.0] * 6, [0.9, 1.3, 0.95, 1.25, 1.0, 1.2])
    assert noisy["speedup"] > 1.0 and not noisy["beats"]  # a median gain inside the noise is not kept
    assert not compare_verdict([1.0] * 6, [0.95] * 6)["beats"]


def test_a_close_comparison_is_settled_by_more_rounds():
    """A gain inside the spread of the first rounds (one outlier) gets more rounds before the verdict;
    a loss or a clear gain does not, and more rounds never turn a steady tie into a win."""
    calls: list[int] = []

    def worker(first_b: list[float], more_b: float):
        def request(n: int) -> dict:
            calls.append(n)
            b = first_b if len(calls) == 1 else [more_b] * n
            return {"status": "ok", "a_ms": [1.0] * n, "b_ms": b[:n]}

        return request

    close = [1.09, 0.85, 1.30, 0.90, 1.25, 1.10]  # median gain 1.095, spread wider than the gain
    assert compare_verdict([1.0] * 6, close)["speedup"] > 1.0 and not compare_verdict([1.0] * 6, close)["beats"]
    reply, verdict = compare_extended(worker(close, 1.09), 6, 18)
    assert calls == [6, 12] and verdict["beats"] and verdict["rounds"] == 18 and reply["status"] == "ok"
    calls.clear()
    _, verdict = compare_extended(worker(close, 1.0), 6, 18)
    assert calls == [6, 12] and not verdict["beats"]  # the extra rounds say tie: the default stays
    calls.clear()
    _, verdict = compare_extended(worker([0.95] * 6, 1.2), 6, 18)
    assert calls == [6] and not verdict["beats"]  # a loss is not re-timed
    calls.clear()
    _, verdict = compare_extended(worker([1.2] * 6, 1.0), 6, 18)
    assert calls == [6] and verdict["beats"] and verdict["rounds"] == 6
    calls.clear()
    _, verdict = compare_extended(worker(close, 1.09), 6, 6)
    assert calls == [6] and not verdict["beats"]  # no extension asked
    failed, verdict = compare_extended(lambda n: {"status": "incorrect", "side": "b"}, 6, 18)
    assert verdict is None and failed["side"] == "b"


def test_autotune_run_exits_nonzero_naming_the_failed_task(tmp_path, monkeypatch, capsys):
    from autotune.tuning.cli import main

    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok")
    monkeypatch.setenv("AUTOTUNE_FAKE_SETUP_DEATHS", f"{tmp_path / 'deaths'}:100")
    argv = [
        "run",
        "--interpret",
        "--kernel",
        "fake_faults",
        "--plugin",
        "autotune.tuning.fake",
        "--artifacts",
        str(tmp_path),
    ]
    code = main([*argv, "--trials", "2", "--distributions", "uniform"])
    out = capsys.readouterr()
    assert code != 0
    assert "fake_faults" in out.out + out.err and "infrastructure" in out.out + out.err


_ORPHAN_PARENT = """
import time
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.worker import Worker
load_plugins(["autotune.tuning.fake"])
task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=8, seq_cap=16)
w = Worker(["autotune.tuning.fake"])
assert w.call({"cmd": "setup", "task": task.to_dict()}, 120)["status"] == "ok"
w._conn.send({"cmd": "evaluate", "backend": "fake", "config": {"mode": "hang"}, "quick": True})
time.sleep(1)  # the worker is now inside the hanging launch, not reading its pipe
print(w._proc.pid, flush=True)
time.sleep(600)
"""


def test_worker_dies_with_a_killed_tuner():
    """kill -9 of the tuner process takes its worker along even inside a launch that never returns
    (Linux PR_SET_PDEATHSIG): an orphan would keep the GPU busy under the next tuner's timings."""
    if not sys.platform.startswith("linux"):
        pytest.skip("parent-death signal is Linux-only")
    env = child_env()
    parent = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_ORPHAN_PARENT)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        worker_pid = int(parent.stdout.readline())
        os.kill(worker_pid, 0)  # alive
        parent.kill()
        parent.wait(30)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                os.kill(worker_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        with pytest.raises(ProcessLookupError):
            os.kill(worker_pid, 0)
    finally:
        parent.kill()


def test_an_output_less_precise_than_the_task_is_judged_by_the_tasks_tolerance():
    """The check's slack is the dtype each output must have (PyTorch's own output's), not the output's own:
    an fp16 output of an fp32 task passed by fp16's slack; an fp32 output of an fp16 task is fine."""
    import torch

    from autotune.tuning import measure

    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, 32, generator=gen)
    half = ref.half()
    assert measure.check_outputs([half], [ref], [0.0], ["out"])[0]  # judged by its own dtype: passes
    ok, detail = measure.check_outputs([half], [ref], [0.0], ["out"], [torch.float32])
    assert not ok and detail["out"]["err"] > detail["out"]["bound"], detail
    assert measure.check_outputs([ref.clone()], [ref], [1e-3], ["out"], [torch.float16])[0]


def test_a_storage_path_that_is_no_journal_is_refused_and_left_as_it_was(tmp_path, capsys):
    """Optuna appends its journal to any file: a SQLite database or a notes file named as ``--storage`` was
    written into, then the run died with a traceback (a KeyError, a UnicodeDecodeError, an AssertionError)."""
    import sqlite3

    from autotune.tuning.cli import main

    db = tmp_path / "tuning.db"
    with contextlib.closing(sqlite3.connect(db)) as conn:
        conn.execute("create table t (a)")
        conn.commit()
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake"]
    for path in (db, notes):
        before = path.read_bytes()
        rc = main([*argv, "--artifacts", str(tmp_path / "art"), "--storage", str(path)])
        out = capsys.readouterr()
        assert rc == 2 and f"--storage {path}" in out.err and "not an Optuna journal" in out.err, out
        with pytest.raises(ValueError, match="not an Optuna journal"):
            make_storage(str(path), "h100", tmp_path)
        assert path.read_bytes() == before
    journal = tmp_path / "empty.journal"
    journal.touch()
    optuna.create_study(study_name="s", storage=make_storage(str(journal), "h100", tmp_path))
    assert optuna.get_all_study_names(make_storage(str(journal), "h100", tmp_path)) == ["s"]


def test_a_config_found_wrong_in_the_extra_comparison_rounds_has_no_verdict():
    """The extra rounds of a close call check the outputs after timing too, but a failed reply to them was dropped
    and the first rounds' verdict stood: a candidate that went wrong there was still written when the default had
    failed its re-check (a winner then needs no gain)."""
    close = [1.09, 0.85, 1.30, 0.90, 1.25, 1.10]
    replies = iter([{"status": "ok", "a_ms": [1.0] * 6, "b_ms": close}, {"status": "incorrect", "side": "a"}])
    failed, verdict = compare_extended(lambda n: next(replies), 6, 18)
    assert verdict is None and failed == {"status": "incorrect", "side": "a"}


def test_a_task_that_raises_an_unexpected_error_ends_alone(tmp_path, monkeypatch):
    """A task whose tuning raised anything but a RuntimeError (a KeyError of a bug, an Optuna ValueError) ended the
    whole run with a traceback: the tasks after it were never tuned. It now ends that task alone, with the error's
    type and message kept as its reason, and the next task is tuned and written."""

    first, second = _task(), Task("fake_faults", "h100", "float32", 32, 32, 1, 512, "uniform", batch=8, seq_cap=16)
    decide_raises_for_bucket(monkeypatch, first.bucket)
    bad, good = run_tasks([first, second], _opts(tmp_path, n_trials=2))
    assert bad.config is None and bad.error == "KeyError: 'planted'" and not bad.cut
    assert good.error is None and good.config is not None
    entries = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries
    assert [e["bucket"] for e in entries] == [512]
