"""The search end to end on a fake kernel (crash, hang, wrong, NaN configs) and on the real templates
under the Triton interpreter (resume of an interrupted study)."""

from __future__ import annotations

import dataclasses
import warnings

import optuna
import pytest

from autotune.runtime import artifacts as art
from autotune.tuning.fake import FakeConfig
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import Reporter, TuneOptions, make_storage, run_tasks

load_plugins(["autotune.tuning.fake"])


def _fake_task(**kw) -> Task:
    return Task("fake_op", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=16, **kw)


def _opts(tmp_path, **kw) -> TuneOptions:
    base = dict(
        n_trials=8,
        sampler="bruteforce",
        artifacts_root=tmp_path,
        eval_timeout_s=3.0,
        plugins=["autotune.tuning.fake"],
        interpret=True,
    )
    base.update(kw)
    return TuneOptions(**base)


def _trials(tmp_path, task: Task) -> list[optuna.trial.FrozenTrial]:
    names = optuna.get_all_study_names(make_storage(None, task.gpu, tmp_path))
    name = next(n for n in names if n.startswith(task.study_name + "|src"))
    study = optuna.load_study(study_name=name, storage=make_storage(None, task.gpu, tmp_path))
    return study.get_trials(deepcopy=False)


def test_crash_hang_and_wrong_configs_are_survived_and_never_win(tmp_path):
    task = _fake_task()
    (result,) = run_tasks([task], _opts(tmp_path))
    assert result.error is None
    # 'wrong' and 'nan' are the fastest configs; only the correctness check keeps them out.
    assert result.config == {"mode": "ok", "size": 1}
    assert result.speedup > 1.0 and not result.kept_default
    by_mode = {}
    for t in _trials(tmp_path, task):
        if not t.user_attrs.get("duplicate"):
            by_mode.setdefault(t.params["fake.mode"], set()).add(t.user_attrs["status"])
    assert "crash" in by_mode["crash"]
    assert "timeout" in by_mode["hang"]
    assert by_mode["wrong"] == {"incorrect"} | ({"infeasible"} if len(by_mode["wrong"]) > 1 else set())
    assert "incorrect" in by_mode["nan"]  # the poisoned output was never written
    failed = [t for t in _trials(tmp_path, task) if t.user_attrs.get("status") in ("crash", "timeout", "incorrect")]
    assert all(t.state != optuna.trial.TrialState.COMPLETE for t in failed)
    assert all("error" in t.user_attrs for t in failed)
    infeasible = [t for t in _trials(tmp_path, task) if t.user_attrs.get("status") == "infeasible"]
    assert infeasible
    assert all(t.params["fake.size"] == 2 and t.params["fake.mode"] != "ok2" for t in infeasible)
    assert not any(t.user_attrs.get("measured") for t in infeasible)  # rejected before compiling
    a = art.load_artifact(art.artifact_path("h100", "fake_op", tmp_path))
    entry = a.lookup("float32", 32, 32, 256, "uniform")
    assert entry["config"] == {"mode": "ok", "size": 1} and entry["trials"] == result.trials


def test_tuned_is_never_slower_than_default(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_FAKE_FAST_DEFAULT", "1")  # the default ('slow') becomes the fastest correct config
    (result,) = run_tasks([_fake_task()], _opts(tmp_path, n_trials=4, sampler="random"))
    assert result.kept_default and result.config == {"mode": "slow", "size": 1}
    assert result.speedup == pytest.approx(1.0)
    entry = art.load_artifact(art.artifact_path("h100", "fake_op", tmp_path)).entries[0]
    assert entry["config"] == {"mode": "slow", "size": 1} and entry["median_ms"] == entry["default_ms"]


class _Interrupt(Reporter):
    def __init__(self, after: int) -> None:
        self.after = after

    def trial_done(self, task, measured, status, best_ms) -> None:
        if measured >= self.after:
            raise KeyboardInterrupt


@pytest.mark.interpreter
def test_a_task_cut_by_the_time_budget_says_so_and_a_rerun_completes_it(tmp_path):
    """A run whose budget ends before the task's trials are measured writes its best so far, marked ``cut`` (the
    farm re-queues such a task at its next join); a re-run without the budget resumes the study to its trials."""
    opts = _opts(tmp_path, n_trials=6)
    (cut,) = run_tasks([_fake_task()], opts, time_budget_s=1e-9)
    assert cut.cut and cut.config is not None and cut.trials < 6
    (done,) = run_tasks([_fake_task()], opts)
    assert not done.cut and done.trials == 6


def test_interrupted_study_resumes_where_it_stopped(tmp_path):
    """Real forward template under the interpreter: stop after 2 measured trials, then resume to 4."""
    task = Task("hstu_attention_fwd", "h100", "float32", 32, 32, 1, 256, "jagged", batch=2, seq_cap=64)
    opts = TuneOptions(n_trials=4, sampler="random", artifacts_root=tmp_path, interpret=True, eval_timeout_s=120)
    with pytest.raises(KeyboardInterrupt):
        run_tasks([task], opts, reporter=_Interrupt(after=2))
    first = [t for t in _trials(tmp_path, task) if t.user_attrs.get("measured")]
    assert len(first) == 2
    assert not art.artifact_path("h100", task.kernel, tmp_path).exists()
    (result,) = run_tasks([task], opts)
    measured = [t for t in _trials(tmp_path, task) if t.user_attrs.get("measured")]
    assert result.trials == 4 and len(measured) == 4
    assert [t.number for t in measured[:2]] == [t.number for t in first]  # kept, not re-run
    assert len({t.user_attrs["config_key"] for t in measured}) == 4
    for t in measured:  # every compiled trial carries its report and check
        assert {"status", "n_regs", "n_spills", "shared", "compile_s"} <= set(t.user_attrs)
    assert art.load_artifact(art.artifact_path("h100", task.kernel, tmp_path)).entries[0]["trials"] == 4


def test_edited_template_starts_a_fresh_study(monkeypatch):
    from autotune.runtime import artifacts as art
    from autotune.tuning.tuner import study_name

    task = _fake_task()
    before = study_name(task, ["triton"])
    assert before.startswith(task.study_name + "|src") and study_name(task, ["triton"]) == before
    assert study_name(task, ["triton", "cute"]) != before
    assert study_name(task, ["triton"], cuda_graph=True) != before  # graph replays are timed in their own study
    monkeypatch.setattr(art, "current_template_hash", lambda kernel, backend="triton": "edited")
    assert study_name(task, ["triton"]) != before


def test_every_timing_of_a_cuda_graph_session_replays_a_graph(monkeypatch):
    """With --cuda-graph, the trials' times and the winner-vs-default comparison (whose times the entry records)
    are all graph replays: the comparison had timed plain launches under the "do_bench+cuda_graph" label."""
    from autotune.tuning import measure, worker

    flags: list[bool] = []
    real = measure.bench

    def spy(fn, quick, cuda_graph=False):
        flags.append(cuda_graph)
        return real(fn, quick)

    monkeypatch.setattr(measure, "bench", spy)
    session = worker._Session({"task": _fake_task().to_dict(), "cuda_graph": True})
    ok = {"backend": "fake", "config": {"mode": "ok", "size": 1}}
    slow = {"backend": "fake", "config": {"mode": "slow", "size": 1}}
    assert session.time(ok)["status"] == "ok"
    assert session.compare({"a": ok, "b": slow, "rounds": 2})["status"] == "ok"
    assert len(flags) >= 5 and all(flags), flags


def test_a_run_in_another_timing_environment_keeps_the_files_old_entries_aside(tmp_path):
    """A run after a torch or driver update writes its entry over a file tuned in the old environment: the file's
    entries are dropped (their timings do not compare), and before, with a warning as their only trace, every tuned
    entry of the file was lost for one new one. The old file is now kept aside, as an invalid one is."""
    import json

    task = _fake_task()
    path = art.artifact_path("h100", "fake_op", tmp_path)
    other = dataclasses.replace(task, bucket=512)
    run_tasks([other], _opts(tmp_path, n_trials=2))
    data = json.loads(path.read_text())
    data["environment"]["torch"] = "0.0-before-the-update"
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    with pytest.warns(RuntimeWarning, match="dropping 1 entries.*kept as"):
        run_tasks([task], _opts(tmp_path, n_trials=2))
    assert [e["bucket"] for e in art.load_artifact(path).entries] == [256]
    (aside,) = [p for p in path.parent.iterdir() if p.name.startswith(f"{path.name}.unusable-")]
    assert aside.read_bytes() == before


def test_a_failed_write_over_a_file_of_another_environment_leaves_the_file_in_place(tmp_path):
    """The old file is kept aside by a copy, not a rename: renamed before the new content was built and checked, a
    write that then failed (here an invalid entry) left no artifact at all, and the kernel ran its defaults."""
    import json

    from autotune.runtime.artifacts import ArtifactError
    from autotune.tuning.artifact_io import merge_entries

    task = _fake_task()
    path = art.artifact_path("h100", "fake_op", tmp_path)
    run_tasks([task], _opts(tmp_path, n_trials=2))
    data = json.loads(path.read_text())
    before = path.read_bytes()
    env = {**data["environment"], "torch": "9.9-after-the-update"}
    bad = {**data["entries"][0], "median_ms": "fast"}
    with pytest.raises(ArtifactError), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        merge_entries("fake_op", "h100", [bad], tmp_path, env)
    assert path.read_bytes() == before


def test_retune_after_a_template_edit_starts_from_the_stale_artifacts_winner(tmp_path, monkeypatch):
    """An edited template makes the artifact stale (dispatch refuses it), but its winner is still the
    best first guess: the fresh study measures it right after the default."""
    from autotune.tuning.artifact_io import artifact_winners, warm_starts_for
    from autotune.tuning.tuner import study_name

    task = _fake_task()
    (first,) = run_tasks([task], _opts(tmp_path))
    assert first.config == {"mode": "ok", "size": 1}
    path = art.artifact_path("h100", "fake_op", tmp_path)
    monkeypatch.setattr(art, "current_template_hash", lambda kernel, backend="triton": "edited")
    with pytest.raises(art.ArtifactError, match="stale"):
        art.load_artifact(path)
    assert warm_starts_for(task, artifact_winners([task], tmp_path))[0] == ("fake", {"mode": "ok", "size": 1})
    (again,) = run_tasks([task], _opts(tmp_path, n_trials=2, sampler="random"))
    assert again.config == {"mode": "ok", "size": 1} and again.trials == 2
    storage = make_storage(None, task.gpu, tmp_path)
    new = study_name(task, ["fake"])
    assert len(optuna.get_all_study_names(storage)) == 2 and new in optuna.get_all_study_names(storage)
    trials = optuna.load_study(study_name=new, storage=storage).get_trials()
    warm = [t for t in trials if t.user_attrs.get("source") == "warm-start"]
    assert warm and warm[0].params["fake.mode"] == "ok"


def test_warm_start_from_before_a_new_tunable_tries_it_both_ways():
    """An artifact's winner written before a tunable existed is completed once per choice of it (so the
    new knob is measured on the known-good config), capped; complete hints pass unchanged."""
    from autotune.tuning.artifact_io import completed_hints

    choices = {"block_m": (64, 128), "l2_group": (0, 8), "compact": (False, True)}
    old = {"block_m": 128, "l2_group": 8}
    assert completed_hints(old, choices) == [{**old, "compact": False}, {**old, "compact": True}]
    full = {**old, "compact": True}
    assert completed_hints(full, choices) == [full]
    assert len(completed_hints({}, choices, cap=3)) == 3


def test_warm_starts_read_winners_written_before_a_new_tunable(tmp_path):
    """The shipped backward artifact with one config field removed (as written before that tunable
    existed): dispatch must refuse it, but the tuner still warm-starts from its winners."""
    import json
    import shutil

    from autotune.tuning.artifact_io import artifact_winners, warm_starts_for

    shipped = art.artifact_path("h100", "hstu_attention_bwd")
    path = art.artifact_path("h100", "hstu_attention_bwd", tmp_path)
    path.parent.mkdir(parents=True)
    shutil.copy(shipped, path)
    data = json.loads(path.read_text())
    entry = next(e for e in data["entries"] if e["backend"] == "cute")
    entry["config"].pop("swap_sdp", None)
    entry["config"].pop("compact")
    path.write_text(json.dumps(data))
    with pytest.raises(art.ArtifactError, match="missing fields"):
        art.load_artifact(path, check_stale=False)
    fields = ("dtype", "dqk", "dv", "num_heads", "bucket", "distribution", "mask")
    task = Task("hstu_attention_bwd", "h100", **{k: entry[k] for k in fields})
    assert warm_starts_for(task, artifact_winners([task], tmp_path))[0] == ("cute", entry["config"])


def test_a_new_law_warm_starts_from_the_same_buckets_winners_on_the_other_laws(tmp_path):
    """A sparse study with no sparse entry yet measures the jagged and uniform winners of its bucket
    (after its own family's), each once; the other buckets' winners of other laws are not hints."""
    import shutil

    from autotune.tuning.artifact_io import artifact_winners, warm_starts_for

    path = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    path.parent.mkdir(parents=True)
    shutil.copy(art.artifact_path("h100", "hstu_attention_fwd"), path)
    entries = art.load_artifact(path, check_stale=False).entries
    by_law = {
        e["distribution"]: (e["backend"], e["config"])
        for e in entries
        if (e["dqk"], e["num_heads"], e["bucket"], e["mask"]) == (256, 4, 4096, "causal")
    }
    assert {"uniform", "jagged"} <= by_law.keys()
    sparse = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "sparse")
    winners = artifact_winners([sparse], tmp_path)
    winners.pop(sparse.family, None)  # as before any sparse entry was tuned
    starts = warm_starts_for(sparse, winners)
    assert starts == [by_law["uniform"], by_law["jagged"]] or starts == [by_law["uniform"]] == [by_law["jagged"]]
    jagged = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "jagged")
    own = warm_starts_for(jagged, artifact_winners([jagged], tmp_path))
    assert own[0] == by_law["jagged"] and by_law["uniform"] in own and len(own) == len({str(s) for s in own})


def test_own_warm_starts_are_the_buckets_last_winner_alone(tmp_path):
    """``scope="own"`` (``--warm-starts own``, a re-measure): the bucket's own last winner and nothing of its
    neighbours, other laws or head counts; none where the bucket has no entry; an unknown scope is refused."""
    import shutil

    from autotune.tuning.artifact_io import artifact_winners, warm_starts_for

    path = art.artifact_path("h100", "hstu_attention_fwd", tmp_path)
    path.parent.mkdir(parents=True)
    shutil.copy(art.artifact_path("h100", "hstu_attention_fwd"), path)
    entries = art.load_artifact(path, check_stale=False).entries
    own_entry = next(
        e for e in entries if (e["dqk"], e["num_heads"], e["bucket"], e["distribution"]) == (256, 4, 4096, "jagged")
    )
    jagged = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "jagged")
    winners = artifact_winners([jagged], tmp_path)
    every = warm_starts_for(jagged, winners)
    assert len(every) > 1  # the artifact holds neighbours and other laws, so "all" measures more
    assert warm_starts_for(jagged, winners, "own") == [(own_entry["backend"], own_entry["config"])]
    fresh = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "sparse")
    winners_fresh = artifact_winners([fresh], tmp_path)
    winners_fresh.pop(fresh.family, None)
    assert warm_starts_for(fresh, winners_fresh, "own") == [] and warm_starts_for(fresh, winners_fresh)
    with pytest.raises(ValueError, match="scope must be one of"):
        warm_starts_for(jagged, winners, "nearest")


def test_a_remeasure_with_own_warm_starts_times_the_default_and_the_last_winner(tmp_path, monkeypatch):
    """End to end: after a template edit, ``--trials 1 --warm-starts own`` measures the default and the
    bucket's last winner (one warm start), keeps the winner, and the choice is one of the farm's knobs."""
    from autotune.tuning.farm import FARM_KNOBS
    from autotune.tuning.tuner import study_name

    task = _fake_task()
    (first,) = run_tasks([task], _opts(tmp_path))
    monkeypatch.setattr(art, "current_template_hash", lambda kernel, backend="triton": "edited")
    (again,) = run_tasks([task], _opts(tmp_path, n_trials=1, sampler="random", warm_starts="own"))
    assert again.config == first.config and again.trials == 2
    storage = make_storage(None, task.gpu, tmp_path)
    trials = optuna.load_study(study_name=study_name(task, ["fake"]), storage=storage).get_trials()
    assert [t.user_attrs.get("source") for t in trials] == ["default", "warm-start"]
    assert trials[1].params["fake.mode"] == first.config["mode"]
    assert "warm_starts" in FARM_KNOBS


def test_a_new_head_count_starts_from_the_nearest_head_counts_winner(tmp_path):
    """A study at a head count with no entry measures the same bucket's winners at other head counts,
    nearest first (what dispatch served such calls before), after its own family's and other laws'."""
    from autotune.tuning.artifact_io import warm_starts_for

    def fam(heads):
        return Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, heads, 4096, "uniform").family

    winners = {
        fam(4): {4096: ("cute", {"block_m": 128}), 8192: ("cute", {"block_m": 192})},
        fam(16): {4096: ("cute", {"block_m": 64})},
        fam(1): {4096: ("cute", {"block_m": 192, "l2_group": 8})},
        Task("hstu_attention_fwd", "h100", "bfloat16", 128, 128, 4, 4096, "uniform").family: {4096: ("cute", {})},
    }
    h8 = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 8, 4096, "uniform")
    assert warm_starts_for(h8, winners) == [
        ("cute", {"block_m": 128}), ("cute", {"block_m": 64}), ("cute", {"block_m": 192, "l2_group": 8}),
    ]  # fmt: skip
    h4 = Task("hstu_attention_fwd", "h100", "bfloat16", 256, 256, 4, 4096, "uniform")
    assert warm_starts_for(h4, winners)[0] == ("cute", {"block_m": 128})  # its own winner first


def test_bench_launches_pair_the_baseline_with_the_artifacts_winner(tmp_path):
    """What ``autotune bench`` and the perf regression checks time: the default, and the bucket's entry."""
    from autotune.tuning.tuner import bench_launches

    task = _fake_task()
    flops, default, tuned = bench_launches(task, None, device="cpu")
    assert flops > 0 and tuned is None
    assert (default.backend, default.config) == ("fake", FakeConfig())
    run_tasks([task], _opts(tmp_path))
    artifact = art.load_artifact(art.artifact_path("h100", "fake_op", tmp_path))
    _, default, tuned = bench_launches(task, artifact, device="cpu")
    assert (tuned.backend, tuned.config) == ("fake", FakeConfig(mode="ok", size=1))
    (out,) = tuned.run()
    assert out.shape[0] == sum(task.lengths()) + 1  # launched on the task's own batch


def test_bench_launches_time_the_entry_of_the_tasks_own_heads_mask_and_bucket(tmp_path):
    """``autotune bench --heads 2`` (or ``--masks targets``) timed the bucket's heads-1 causal entry as the tuned
    config: the lookup ignored the task's heads and mask, and read the bucket from the capped length."""
    from autotune.tuning.tuner import bench_launches

    task = _fake_task()
    run_tasks([task], _opts(tmp_path))
    artifact = art.load_artifact(art.artifact_path("h100", "fake_op", tmp_path))
    (entry,) = artifact.entries
    artifact.upsert({**entry, "num_heads": 2, "config": {"mode": "ok2", "size": 2}})
    artifact.upsert({**entry, "mask": "targets", "config": {"mode": "ok2", "size": 1}})
    artifact.upsert({**entry, "bucket": 1024, "config": {"mode": "slow", "size": 2}})
    tuned = lambda **kw: bench_launches(dataclasses.replace(task, **kw), artifact, device="cpu")[2]  # noqa: E731
    assert tuned(num_heads=2).config == FakeConfig(mode="ok2", size=2)
    assert tuned(mask="targets").config == FakeConfig(mode="ok2", size=1)
    assert tuned(mask="window") is None  # no entry of its own
    assert tuned(bucket=1024).config == FakeConfig(mode="slow", size=2)  # capped to 16 tokens, still the 1K entry


def test_a_resume_with_no_prune_fully_times_the_configs_an_earlier_run_pruned(tmp_path):
    """``--no-prune`` promises every correct config fully timed, but a resumed study kept the configs a pruning run
    had cut after their quick timing as seen: the fastest config, pruned once, could never win the re-run."""
    task = _fake_task()
    run_tasks([task], _opts(tmp_path))
    storage = make_storage(None, task.gpu, tmp_path)
    name = next(n for n in optuna.get_all_study_names(storage) if n.startswith(task.study_name + "|src"))
    study = optuna.load_study(study_name=name, storage=storage)
    ok = next(t for t in study.get_trials() if t.params.get("fake.mode") == "ok" and t.params["fake.size"] == 1)
    attrs = {**ok.user_attrs, "status": "pruned"}  # as a pruning run leaves the fastest config, quick-timed only
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.PRUNED, params=ok.params,
                                              distributions=ok.distributions, user_attrs=attrs))  # fmt: skip
    (pruned,) = run_tasks([task], _opts(tmp_path))
    assert pruned.config != {"mode": "ok", "size": 1}  # a pruning resume keeps the verdict
    (full,) = run_tasks([task], _opts(tmp_path, prune=False))
    last = [t for t in _trials(tmp_path, task) if t.user_attrs.get("config_key") == ok.user_attrs["config_key"]]
    assert last[-1].user_attrs["status"] == "ok" and last[-1].state == optuna.trial.TrialState.COMPLETE
    assert full.config == {"mode": "ok", "size": 1}


def test_the_baseline_is_the_backend_dispatch_runs_without_artifacts(monkeypatch):
    """The study's baseline was Triton's default, else the alphabetically first backend's, while dispatch runs the
    first backend of the spec's defaults (gemm_silu in float32 on a GPU: torch, not cute): winners were compared
    with, and their speedups measured against, a default that never runs."""
    import dataclasses

    from autotune import spec
    from autotune.tuning.fake import FAKE_SPEC
    from autotune.tuning.tuner import _Study

    (kernel,) = FAKE_SPEC.kernels
    (fake,) = kernel.backends
    two = dataclasses.replace(kernel, name="fake_two", backends=(dataclasses.replace(fake, name="afake"), fake))
    spec.register(dataclasses.replace(FAKE_SPEC, name="fake_two", kernels=(two,)))
    try:
        task = Task("fake_two", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=16)
        study = _Study(task, _opts(None), None, optuna.storages.InMemoryStorage(), Reporter())
        assert study.default_backend.name == "fake"  # the spec's defaults name "fake" only
    finally:
        spec.unregister("fake_two")


def test_a_run_told_to_interpret_runs_its_workers_under_the_interpreter(monkeypatch):
    """``run_tasks`` with ``interpret=True``, called as a library, left TRITON_INTERPRET as it was: on a GPU host its
    workers ran the kernels on the GPU while the search space was pruned for the interpreter. The workers are spawned
    inside the run, so the variable set for the run reaches them; the caller's value is restored after."""
    import os

    from autotune.tuning import tuner

    seen = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tuner, "_run_tasks", lambda *a: seen.append(os.environ.get("TRITON_INTERPRET")) or [])
    assert tuner.run_tasks([], TuneOptions(interpret=True)) == [] and "TRITON_INTERPRET" not in os.environ
    tuner.run_tasks([], TuneOptions(interpret=False))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    tuner.run_tasks([], TuneOptions(interpret=True))
    assert seen == ["1", None, "1"] and os.environ["TRITON_INTERPRET"] == "0"
