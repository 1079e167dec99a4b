"""The farm's claim on a task against a stalled holder (a real PostgreSQL, ``tests/pg_fixture.py``): whatever a
holder does after another worker took its task over (writes to the task study, trials it finishes, asks or
hands back), the new holder's trials and records stay as the new holder left them."""

from __future__ import annotations

import optuna
import pytest
from farm_fixture import one_task_farm, rdb_storage, run_one
from optuna.trial import TrialState
from pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures pg_server, pg_url

from autotune.runtime import artifacts as art
from autotune.tuning.registry import load_plugins
from autotune.tuning.study_storage import rdb_url

load_plugins(["autotune.tuning.fake"])


def test_stalled_holder_writes_nothing_after_its_claim_was_taken_over(pg_url, tmp_path, monkeypatch):
    """A holder whose heartbeat stalled while it re-checked its winner: meanwhile another worker failed its
    claim, re-claimed the task and recorded its own result. The stalled one then drops the task: it does
    not overwrite the task study's result, writes no artifact entry and completes no farm trial."""
    import copy

    from autotune.tuning import farm, tuner

    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    trial = farm.claim(study, fopts)
    real_decide = tuner._decide

    def decide_after_takeover(s, result):
        storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # another worker's fail_stale_trials
        farm._retry_callback(storage)(study, copy.deepcopy(storage.get_trial(trial._trial_id)))
        new_holder = optuna.load_study(study_name=s.study.study_name, storage=rdb_storage(pg_url))
        new_holder.set_user_attr("result", {"by": "the new holder"})
        return real_decide(s, result)

    monkeypatch.setattr(tuner, "_decide", decide_after_takeover)
    assert run_one(study, trial, opts, fopts, "stalled") is False
    (name,) = [n for n in optuna.get_all_study_names(storage) if not n.startswith("farm|")]
    assert optuna.load_study(study_name=name, storage=storage).user_attrs["result"] == {"by": "the new holder"}
    assert not art.artifact_path("h100", "fake_faults", tmp_path).exists()
    assert [t.state for t in study.get_trials(deepcopy=False)] == [TrialState.FAIL, TrialState.WAITING]


@pytest.mark.parametrize(("key", "modes"), [("result", "ok,ok2"), ("rejected", "narrow")])
def test_holder_stalled_between_claim_check_and_study_write_keeps_the_new_holders_value(
    pg_url, tmp_path, monkeypatch, key, modes
):
    """The task study's ``result`` and ``rejected`` are study attributes, which Optuna does not guard. A holder
    passes its claim check, then stalls right before writing one; meanwhile another worker fails its claim, takes
    the task over and writes its own value. The stalled one wakes and drops the task instead of overwriting it."""
    import copy

    from autotune.tuning import farm

    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", modes)  # 'narrow': fastest, and rejected by the final re-check
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    trial = farm.claim(study, fopts)
    theirs = {"by": "the new holder"} if key == "result" else {"fake:mode=ok": "the new holder's"}
    real_set, taken = optuna.Study.set_user_attr, []

    def set_user_attr(self: optuna.Study, k: str, value: object) -> None:
        if k == key and not self.study_name.startswith("farm|") and not taken:
            taken.append(self.study_name)  # the holder stalls here, after its last claim check
            storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)  # another worker's fail_stale_trials
            farm._retry_callback(storage)(study, copy.deepcopy(storage.get_trial(trial._trial_id)))
            real_set(optuna.load_study(study_name=self.study_name, storage=rdb_storage(pg_url)), k, theirs)
        real_set(self, k, value)

    monkeypatch.setattr(optuna.Study, "set_user_attr", set_user_attr)
    assert run_one(study, trial, opts, fopts, "stalled") is False
    assert taken, f"the holder never wrote {key!r}"
    assert optuna.load_study(study_name=taken[0], storage=rdb_storage(pg_url)).user_attrs[key] == theirs
    assert not art.artifact_path("h100", "fake_faults", tmp_path).exists()


@pytest.mark.parametrize("modes", ["ok,ok2", "wrong"])
def test_trial_finished_while_the_new_holder_interrupts_it_is_not_marked_interrupted(
    pg_url, tmp_path, monkeypatch, modes
):
    """A stalled holder wakes inside a config trial and ``tell``s it between the two writes of the new holder's
    ``_interrupt`` (the "interrupted" mark, then the FAIL). The trial used to end COMPLETE (or, for a config
    that failed, 'wrong': FAIL) yet marked "interrupted" (its config neither counted nor queued again). Now the
    stalled holder's ``tell`` is refused: the trial ends failed, marked "interrupted", and its config is queued
    again once."""
    import copy
    import dataclasses
    import threading

    from autotune.runtime import gpus
    from autotune.tuning import farm, tuner
    from autotune.tuning.registry import plugin_modules
    from autotune.tuning.worker import Worker

    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", modes)  # 'wrong': its trial is told FAIL (incorrect)
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    held = farm.claim(study, fopts)
    stalled, marked, told, out = threading.current_thread(), threading.Event(), threading.Event(), {}
    failed = modes == "wrong"  # the tell to stall at: the first one (the default's), or the first FAIL
    real_tell, real_state = optuna.Study.tell, optuna.storages.RDBStorage.set_trial_state_values

    def new_holder(name: str) -> None:  # opens the task study: fails and re-queues the trial still RUNNING
        ns = dataclasses.replace(opts, study_namespace=study.study_name)
        out["new"] = tuner._Study(task, ns, None, farm.farm_storage(pg_url, fopts), tuner.Reporter())

    def tell(self: optuna.Study, trial, *args, **kwargs):
        first = not self.study_name.startswith("farm|") and not out
        if threading.current_thread() is stalled and first and failed == (kwargs.get("state") == TrialState.FAIL):
            out["trial"] = trial._trial_id
            storage.set_trial_state_values(held._trial_id, TrialState.FAIL)  # another worker's fail_stale_trials
            farm._retry_callback(storage)(study, copy.deepcopy(storage.get_trial(held._trial_id)))
            out["thread"] = threading.Thread(target=new_holder, args=(self.study_name,))
            out["thread"].start()
            assert marked.wait(120), "the new holder did not interrupt the trial"
            try:
                return real_tell(self, trial, *args, **kwargs)
            finally:
                told.set()
        return real_tell(self, trial, *args, **kwargs)

    def set_state(self, trial_id: int, state: TrialState, values=None) -> bool:
        if threading.current_thread() is not stalled and trial_id == out.get("trial") and state == TrialState.FAIL:
            marked.set()  # the "interrupted" mark is written; the FAIL waits for the holder's tell
            assert told.wait(120)
        return real_state(self, trial_id, state, values)

    monkeypatch.setattr(optuna.Study, "tell", tell)
    monkeypatch.setattr(optuna.storages.RDBStorage, "set_trial_state_values", set_state)
    worker = Worker(plugin_modules(opts.plugins))
    ctx = {"opts": opts, "fopts": fopts, "id": "stalled", "deadline": None, "env": gpus.environment(), "worker": worker}
    try:
        assert farm._run_one(study, held, ctx) is False
    finally:
        marked.set()
        told.set()
        worker.close()
        if "thread" in out:
            out["thread"].join(120)
    t = storage.get_trial(out["trial"])
    assert (t.state, t.user_attrs["status"]) == (TrialState.FAIL, "interrupted"), (t.state, t.user_attrs["status"])
    waiting = out["new"].study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
    assert [w.system_attrs["fixed_params"] for w in waiting].count(t.params) == 1, (t.params, waiting)


def _take_over(storage, study, held) -> None:
    """Another worker's ``fail_stale_trials`` fails the claim ``held``; the retry callback queues the task again."""
    import copy

    from autotune.tuning import farm

    storage.set_trial_state_values(held._trial_id, TrialState.FAIL)
    farm._retry_callback(storage)(study, copy.deepcopy(storage.get_trial(held._trial_id)))


def test_holder_stalled_while_opening_its_study_fails_no_trial_of_the_new_holder(pg_url, tmp_path, monkeypatch):
    """A holder stalls while opening its task study, after its first (checked) write and before it fails the
    trials it finds RUNNING (``_requeue_interrupted``, meant for a dead run's). Meanwhile another worker takes the
    task over and asks a trial. The stalled one used to fail that live trial as "interrupted" (the hand-back
    writes needed no claim, whoever's trial it was), so the new holder's result became an error. Now only a
    trial this holder asked is handed back without its claim: it drops the task and leaves the trial alone."""
    from autotune.tuning import farm, tuner

    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    held = farm.claim(study, fopts)
    real_requeue, live = tuner._Study._requeue_interrupted, []

    def requeue(self: tuner._Study) -> None:
        if not live:
            _take_over(storage, study, held)
            live.append(optuna.load_study(study_name=self.study.study_name, storage=rdb_storage(pg_url)).ask())
        real_requeue(self)

    monkeypatch.setattr(tuner._Study, "_requeue_interrupted", requeue)
    assert run_one(study, held, opts, fopts, "stalled") is False
    t = storage.get_trial(live[0]._trial_id)
    assert (t.state, t.user_attrs) == (TrialState.RUNNING, {}), (t.state, t.user_attrs)


def test_holder_telling_a_trial_the_new_holder_already_failed_drops_the_task(pg_url, tmp_path, monkeypatch):
    """A holder stalls right before it ``tell``s a config trial; meanwhile another worker takes the task over
    and, opening the task study, fails and re-queues that trial. Optuna refuses the late ``tell`` with a
    ``ValueError`` (no lease error), which used to escape ``_run_one`` and kill the worker process. Now a lost
    claim behind any error of the task is a lost lease: the worker drops the task and goes on."""
    import dataclasses

    from autotune.tuning import farm, tuner

    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    held = farm.claim(study, fopts)
    real_tell, out = optuna.Study.tell, {}

    def tell(self: optuna.Study, trial, *args, **kwargs):
        if not self.study_name.startswith("farm|") and not out:
            out["trial"] = trial._trial_id
            _take_over(storage, study, held)
            ns = dataclasses.replace(opts, study_namespace=study.study_name)
            tuner._Study(task, ns, None, farm.farm_storage(pg_url, fopts), tuner.Reporter())  # the new holder
        return real_tell(self, trial, *args, **kwargs)

    monkeypatch.setattr(optuna.Study, "tell", tell)
    assert run_one(study, held, opts, fopts, "stalled") is False
    t = storage.get_trial(out["trial"])
    assert (t.state, t.user_attrs["status"]) == (TrialState.FAIL, "interrupted")


def test_farm_lock_is_free_after_an_interrupt_while_releasing_it(pg_url, monkeypatch):
    """Ctrl-C or SIGTERM (both ``KeyboardInterrupt`` in a worker) may land while the farm's lock is released,
    which a holder now does around every write to its task study. The lock used to be the connection's: an
    interrupted unlock left it held by a pooled connection, so the worker's own hand-back (another connection)
    and every other worker's claim waited on it for as long as the process lived. Now it is the transaction's."""
    import sqlalchemy

    from autotune.tuning.farm_storage import _advisory_lock, plain_storage

    storage = plain_storage(pg_url)
    conn_cls, hits = sqlalchemy.engine.Connection, []
    real_execute, real_commit = conn_cls.execute, conn_cls._commit_impl  # the commit of either kind of lock

    def execute(self, statement, *args, **kwargs):
        if not hits and "unlock" in str(statement):
            hits.append("unlock")
            raise KeyboardInterrupt
        return real_execute(self, statement, *args, **kwargs)

    def commit(self):
        if not hits:
            hits.append("commit")
            raise KeyboardInterrupt
        return real_commit(self)

    monkeypatch.setattr(conn_cls, "execute", execute)
    monkeypatch.setattr(conn_cls, "_commit_impl", commit)
    with pytest.raises(KeyboardInterrupt), _advisory_lock(storage, "farm|h100|lock"):
        pass
    monkeypatch.undo()
    assert hits
    query = (
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
        " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    )
    with sqlalchemy.create_engine(rdb_url(pg_url), poolclass=sqlalchemy.pool.NullPool).connect() as conn:
        assert conn.execute(sqlalchemy.text(query)).scalar() == 0


@pytest.mark.parametrize("stall", ["before ask", "between ask and check"])
def test_holder_stalled_at_ask_takes_no_trial_of_the_new_holder(pg_url, tmp_path, monkeypatch, stall):
    """A holder stalls at its first config ``ask`` while another worker takes the task over and opens its study,
    counting on the queued default. The stalled one used to pop and time that default when it woke: the new
    holder then timed it again and ran past ``n_trials``. Now it hands the trial back and drops the task, and
    ``n_trials`` configs are timed once each, all by the new holder. Stalled between ``ask`` and its claim check,
    the new holder fails and re-queues the asked trial itself."""
    import copy
    import threading

    from autotune.runtime import gpus
    from autotune.tuning import farm, tuner
    from autotune.tuning.registry import plugin_modules
    from autotune.tuning.worker import Worker

    monkeypatch.setenv("AUTOTUNE_FAKE_MODES", "ok,ok2")  # 3 configs: room to run past n_trials=2
    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    held = farm.claim(study, fopts)
    other = optuna.load_study(study_name=study.study_name, storage=farm.farm_storage(pg_url, fopts))
    stalled, opened, woke, out = threading.current_thread(), threading.Event(), threading.Event(), {}

    def ctx(wid: str, worker: Worker) -> dict:
        return {"opts": opts, "fopts": fopts, "id": wid, "deadline": None, "env": gpus.environment(), "worker": worker}

    def new_holder() -> None:
        worker = Worker(plugin_modules(opts.plugins))
        try:
            out["new"] = farm._run_one(other, farm.claim(other, fopts), ctx("new", worker))
        finally:
            opened.set()
            worker.close()

    def take_over() -> None:  # while the holder stalls: its claim is failed as stale and re-queued, then taken
        storage.set_trial_state_values(held._trial_id, TrialState.FAIL)
        farm._retry_callback(storage)(study, copy.deepcopy(storage.get_trial(held._trial_id)))
        out["thread"] = threading.Thread(target=new_holder)
        out["thread"].start()
        assert opened.wait(120)

    real_ask, real_check = optuna.Study.ask, tuner._check_claim

    def ask(self: optuna.Study, *args, **kwargs):
        if not self.study_name.startswith("farm|"):
            if threading.current_thread() is not stalled and not opened.is_set():
                opened.set()  # the new holder opened the task study and queued its first trials
                assert woke.wait(120)  # it asks once the stalled holder is done
            elif threading.current_thread() is stalled and stall == "before ask" and "thread" not in out:
                take_over()
        return real_ask(self, *args, **kwargs)

    def check_claim(reporter: tuner.Reporter, task: object) -> None:
        if threading.current_thread() is stalled and stall != "before ask" and "thread" not in out:
            take_over()
        real_check(reporter, task)

    monkeypatch.setattr(optuna.Study, "ask", ask)
    monkeypatch.setattr(tuner, "_check_claim", check_claim)
    worker = Worker(plugin_modules(opts.plugins))
    try:
        assert farm._run_one(study, held, ctx("stalled", worker)) is False
    finally:
        woke.set()
        worker.close()
        if "thread" in out:
            out["thread"].join(300)
    assert out["new"] is True
    (name,) = [n for n in optuna.get_all_study_names(storage) if not n.startswith("farm|")]
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    measured = [t.user_attrs["config_key"] for t in trials if t.user_attrs.get("measured")]
    assert len(measured) == opts.n_trials == len(set(measured)) and "fake:mode=slow" in measured, measured
    claims = study.get_trials(deepcopy=False)
    assert [t.state for t in claims] == [TrialState.FAIL, TrialState.COMPLETE], claims
    new = claims[1].user_attrs
    assert new["worker"] == "new" and new["result"]["entry"]["trials"] == opts.n_trials
