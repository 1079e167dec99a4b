"""The tuning farm on a real PostgreSQL (``tests/pg_fixture.py``): worker processes on the fake op under
the Triton interpreter share one farm; nothing is timed twice, nothing is lost, a killed worker's task is
finished by another, a worker of another timing environment refuses to join. Short heartbeats (1 s,
3 s grace) keep the whole file near a minute."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import optuna
import pytest
from farm_fixture import FARM_ENV, one_task_farm, rdb_storage, run_one
from optuna.trial import TrialState
from pg_fixture import pg_server_fixture, pg_url_fixture  # noqa: F401 - fixtures pg_server, pg_url
from plugin_specs import decide_raises_for_bucket
from proc_env import REPO, child_env

from autotune.runtime import artifacts as art
from autotune.tuning.farm_status import farm_names
from autotune.tuning.registry import load_plugins
from autotune.tuning.study_storage import rdb_url

load_plugins(["autotune.tuning.fake"])
BUCKETS = "256,512,1K,2K"
N_TASKS = 16  # 4 buckets x 2 distributions x 2 head dims


def _argv(url: str, root: Path, workers: int, buckets: str = BUCKETS, dims: str = "32,64") -> list[str]:
    return [
        "run",
        "--interpret",
        "--kernel",
        "fake_faults",
        "--plugin",
        "autotune.tuning.fake",
        "--trials",
        "3",
        "--sampler",
        "bruteforce",
        "--buckets",
        buckets,
        "--dims",
        dims,
        "--artifacts",
        str(root),
        "--storage",
        url,
        "--workers",
        str(workers),
    ]


def _start(
    url: str, root: Path, workers: int, host: str, small: bool = False, one: bool = False, **env: str
) -> subprocess.Popen:
    """One ``autotune run`` command, as a host would start it (``small``: 4 tasks instead of 16; ``one``: 1)."""
    full = child_env(**FARM_ENV, AUTOTUNE_FARM_HOST=host, **env)
    log = open(root.parent / f"{host}.out", "w")  # noqa: SIM115 - closed with the process
    argv = _argv(url, root, workers, "256,512", "32") if small or one else _argv(url, root, workers)
    argv += ["--buckets", "256", "--distributions", "uniform"] if one else []
    cmd = [sys.executable, "-m", "autotune.tuning.cli", *argv]
    return subprocess.Popen(cmd, env=full, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


def _wait(proc: subprocess.Popen, root: Path, host: str, timeout: float = 150) -> None:
    try:
        rc = proc.wait(timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (root.parent / f"{host}.out").read_text()
    assert rc == 0, out[-3000:]


def _check_farm(url: str, roots: list[Path], n_tasks: int = N_TASKS) -> dict:
    """Every task finished once, no config measured twice in any task study, every entry in each artifact."""
    storage = rdb_storage(url)
    (name,) = farm_names(storage)
    farm = optuna.load_study(study_name=name, storage=storage)
    trials = [t for t in farm.get_trials(deepcopy=False) if "task_key" in t.user_attrs]
    done = [t for t in trials if t.state == TrialState.COMPLETE]
    assert len({t.user_attrs["task_key"] for t in trials}) == n_tasks
    assert sorted(t.user_attrs["task_key"] for t in done) == sorted({t.user_attrs["task_key"] for t in trials})
    assert not [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]
    duplicates, measured = 0, 0
    task_studies = [n for n in optuna.get_all_study_names(storage) if not n.startswith("farm|")]
    assert len(task_studies) == n_tasks
    for study in task_studies:
        keys = [
            t.user_attrs["config_key"]
            for t in optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
            if t.user_attrs.get("measured") and t.user_attrs.get("status") != "interrupted"  # killed: measured again
        ]
        measured += len(keys)
        duplicates += len(keys) - len(set(keys))
    assert duplicates == 0 and measured >= 3 * n_tasks
    for root in roots:
        a = art.load_artifact(art.artifact_path("h100", "fake_faults", root))
        assert len(a.entries) == n_tasks
        for t in done:
            task, result = t.user_attrs["task"], t.user_attrs["result"]
            entry = a.lookup("float32", task["dqk"], task["dv"], task["bucket"], task["distribution"])
            # 'ok' or 'ok2' (4 and 6 ms): under this load either may time faster, and on a busy host the
            # interleaved comparison may not separate them from the default ('slow'); never a planted fault
            assert entry == result["entry"] and entry["config"]["mode"] in ("ok", "ok2", "slow")
    return {"farm": farm, "trials": trials, "done": done, "workers": Counter(t.user_attrs["worker"] for t in done)}


def test_four_workers_share_one_farm(pg_url, tmp_path, monkeypatch, capsys):
    from autotune.tuning.cli import main

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    root = tmp_path / "artifacts"
    assert main(_argv(pg_url, root, 4)) == 0
    got = _check_farm(pg_url, [root])
    assert len(got["workers"]) >= 2, got["workers"]  # the tasks were spread over the workers
    assert all(t.user_attrs["attempt"] == 1 for t in got["done"])
    capsys.readouterr()
    assert main(["status", "--storage", pg_url]) == 0
    out = capsys.readouterr().out
    assert f"{N_TASKS} done" in out and "0 running" in out and "0 left" in out
    assert main(["status", "--storage", pg_url, "--audit", str(root)]) == 0
    out = capsys.readouterr().out
    assert f"tasks {N_TASKS}, finished {N_TASKS}" in out and "duplicates 0, entries_lost 0" in out
    # The same command again finds the farm done: nothing is re-run, the artifact is rewritten from the storage.
    art.artifact_path("h100", "fake_faults", root).unlink()
    assert main(["status", "--storage", pg_url, "--audit", str(root)]) == 0
    assert f"entries_lost {N_TASKS}" in capsys.readouterr().out  # the audit sees a missing artifact
    assert main(_argv(pg_url, root, 4)) == 0
    again = _check_farm(pg_url, [root])
    assert len(again["trials"]) == len(got["trials"])


def _caught_inside_a_trial(proc: subprocess.Popen, url: str, timeout_s: float = 90.0) -> tuple:
    """``_running_task`` once a worker of ``proc`` is inside a config trial (polled; fails after ``timeout_s``)."""
    deadline, found = time.time() + timeout_s, None
    while found is None and time.time() < deadline and proc.poll() is None:
        found = _running_task(url)
        time.sleep(0.1)
    assert found is not None, "no worker was caught inside a trial"
    return found


def _running_task(url: str) -> tuple[optuna.trial.FrozenTrial, str] | None:
    """A farm trial whose worker is inside a config trial right now (the default, slowed down)."""
    storage = rdb_storage(url)
    names = farm_names(storage)
    if not names:
        return None
    farm = optuna.load_study(study_name=names[0], storage=storage)
    for t in farm.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if "pid" not in t.user_attrs:
            continue
        for study in optuna.get_all_study_names(storage):
            if not study.startswith(t.user_attrs["task_key"] + "|src"):
                continue
            s = optuna.load_study(study_name=study, storage=storage)
            running = s.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
            if running and running[0].user_attrs.get("config_key") == "fake:mode=slow":
                return t, study
    return None


def test_killed_worker_task_is_requeued_and_finished_by_another(pg_url, tmp_path):
    root = tmp_path / "artifacts"
    # The default sleeps 0.4 s per launch: its trial (5 launches on the CPU) is the window for the kill.
    proc = _start(pg_url, root, 2, "hostK", small=True, AUTOTUNE_FAKE_DEFAULT_SLEEP="0.4")
    try:
        found = _caught_inside_a_trial(proc, pg_url)
        victim, study = found
        os.kill(victim.user_attrs["pid"], signal.SIGKILL)
    finally:
        _wait(proc, root, "hostK")
    got = _check_farm(pg_url, [root], n_tasks=4)
    farm = got["farm"]
    killed = farm.trials[victim.number]
    assert killed.state == TrialState.FAIL  # failed as stale by a surviving worker's fail_stale_trials
    retries = [t for t in got["done"] if t.system_attrs.get("failed_trial") == victim.number]
    assert len(retries) == 1 and retries[0].user_attrs["worker"] != victim.user_attrs["worker"]
    assert retries[0].user_attrs["task_key"] == victim.user_attrs["task_key"] and retries[0].user_attrs["attempt"] == 2
    trials = optuna.load_study(study_name=study, storage=rdb_storage(pg_url)).get_trials(deepcopy=False)
    interrupted = [t for t in trials if t.user_attrs.get("status") == "interrupted"]
    assert [t.user_attrs.get("config_key") for t in interrupted] == ["fake:mode=slow"], [
        (t.number, t.state, t.params, t.user_attrs, t.system_attrs) for t in trials
    ]
    remeasured = [t for t in trials if t.user_attrs.get("measured") and t.user_attrs["config_key"] == "fake:mode=slow"]
    assert len(remeasured) == 1 and remeasured[0].user_attrs["status"] == "ok"


def test_two_hosts_side_by_side(pg_url, tmp_path):
    roots = [tmp_path / "hostA" / "artifacts", tmp_path / "hostB" / "artifacts"]
    for r in roots:
        r.parent.mkdir()
    procs = [_start(pg_url, r, 2, h) for r, h in zip(roots, ("hostA", "hostB"), strict=True)]
    for p, r, h in zip(procs, roots, ("hostA", "hostB"), strict=True):
        _wait(p, r, h)
    got = _check_farm(pg_url, roots)  # each host's artifact holds every entry, tuned here or there
    hosts = {t.user_attrs["host"] for t in got["done"]}
    assert hosts == {"hostA", "hostB"}, got["workers"]


def test_worker_with_another_gpu_key_refuses_to_join(pg_url, tmp_path, monkeypatch, capsys):
    from autotune.runtime import gpus
    from autotune.tuning import farm
    from autotune.tuning.cli import main
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    # The knobs of the command below (same tasks and knobs: the same farm).
    opts = TuneOptions(n_trials=3, sampler="bruteforce", interpret=True, plugins=["autotune.tuning.fake"])
    storage = farm.farm_storage(pg_url)
    name = farm.join_farm(storage, [task], opts)
    real = gpus.environment()
    monkeypatch.setattr(gpus, "environment", lambda: {**real, "sm_count": 114, "driver": "999.1"})
    with pytest.raises(farm.FarmError, match="refusing to join") as err:
        farm.join_farm(storage, [task], opts)
    assert "sm_count: farm None, this worker 114" in str(err.value) and "driver" in str(err.value)
    with pytest.raises(farm.FarmError, match="refusing to join"):
        farm.check_key(optuna.load_study(study_name=name, storage=storage), True)  # a worker's own check
    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    argv = _argv(pg_url, tmp_path, 1)
    argv[argv.index(BUCKETS)], argv[argv.index("32,64")] = "256", "32"
    assert main([*argv, "--distributions", "uniform"]) == 2  # the command refuses too (exit 2), starts no worker
    assert "refusing to join" in capsys.readouterr().err
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.WAITING]  # nothing was claimed


def test_claim_left_without_a_heartbeat_is_requeued(pg_url, tmp_path):
    """A worker killed between ``ask`` and its first heartbeat: Optuna never sees that trial as stale,
    the farm fails and re-queues it after two grace periods."""
    from autotune.tuning import farm
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    fopts = farm.FarmOptions(heartbeat_s=1, grace_s=1, retries=3, poll_s=0.2)
    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    storage = farm.farm_storage(pg_url, fopts)
    name = farm.join_farm(storage, [task], TuneOptions(interpret=True, plugins=["autotune.tuning.fake"]))
    study = optuna.load_study(study_name=name, storage=storage)
    orphan = study.ask()  # ... and the worker died here
    assert farm.claim(study, fopts) is None and not farm._drained(study)  # nothing waiting, one held
    time.sleep(2.5)
    again = farm.claim(study, fopts)
    assert again is not None and again.user_attrs["task_key"] == task.study_name
    assert study.trials[orphan.number].state == TrialState.FAIL


def test_a_task_cut_by_a_time_budget_is_queued_again_at_the_next_join(pg_url):
    """A task whose result says it was cut by the run's time budget (``cut``) is queued again when the farm is
    joined next, as a re-run on one host resumes its study; a task finished in full is not."""
    from autotune.tuning import farm
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TaskResult, TuneOptions

    fopts = farm.FarmOptions(heartbeat_s=1, grace_s=2, retries=3, poll_s=0.2)
    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    opts = TuneOptions(interpret=True, plugins=["autotune.tuning.fake"])
    storage = farm.farm_storage(pg_url, fopts)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    result = TaskResult(task, backend="fake", config={"mode": "ok", "size": 1}, median_ms=1.0, tflops=1.0)

    def finish(cut: bool) -> None:
        trial = farm.claim(study, fopts)
        assert trial is not None
        result.cut = cut
        trial.set_user_attr("result", farm._summary(result))
        study.tell(trial, 1.0)

    def waiting() -> int:
        return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    finish(cut=True)
    farm.join_farm(storage, [task], opts)
    assert waiting() == 1
    finish(cut=False)
    farm.join_farm(storage, [task], opts)
    assert waiting() == 0


def test_orphan_of_a_host_in_another_time_zone_is_requeued(pg_url, tmp_path):
    """Optuna stamps a trial's start with the claiming host's local wall clock: an orphan claimed on a host
    5 hours ahead (another time zone) is re-queued after two grace periods all the same."""
    import sqlalchemy

    from autotune.tuning import farm
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    fopts = farm.FarmOptions(heartbeat_s=1, grace_s=1, retries=3, poll_s=0.2)
    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    storage = farm.farm_storage(pg_url, fopts)
    name = farm.join_farm(storage, [task], TuneOptions(interpret=True, plugins=["autotune.tuning.fake"]))
    study = optuna.load_study(study_name=name, storage=storage)
    orphan = study.ask()  # claimed on the other host, whose worker died before its first heartbeat
    engine = sqlalchemy.create_engine(rdb_url(pg_url))
    with engine.begin() as conn:
        ahead = "UPDATE trials SET datetime_start = datetime_start + interval '5 hours' WHERE trial_id = :i"
        conn.execute(sqlalchemy.text(ahead), {"i": orphan._trial_id})
    engine.dispose()
    assert farm.claim(study, fopts) is None
    time.sleep(2.5)
    again = farm.claim(study, fopts)
    assert again is not None and again.user_attrs["task_key"] == task.study_name
    assert study.trials[orphan.number].state == TrialState.FAIL


_MERGER = """
import sys
from pathlib import Path
from autotune.tuning.registry import load_plugins
from autotune.tuning.tasks import Task
from autotune.tuning.tuner import TaskResult, TuneOptions, update_artifact
from autotune.runtime.gpus import environment
load_plugins(["autotune.tuning.fake"])
root, first = Path(sys.argv[1]), int(sys.argv[2])
env = environment()
for i in range(first, first + 6):
    task = Task("fake_faults", "h100", "float32", 32, 32, 1 + i, 256, "uniform", batch=2, seq_cap=16)
    r = TaskResult(task, backend="fake", config={"mode": "ok", "size": 1}, median_ms=1.0, spread_ms=0.0, tflops=1.0)
    update_artifact(r, TuneOptions(artifacts_root=root), env)
"""


def test_concurrent_artifact_writers_lose_no_entry(tmp_path):
    """Four processes upsert 6 entries each into one artifact at once: the lock and re-read keep all 24."""
    env = child_env()
    code = textwrap.dedent(_MERGER)
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path), str(6 * k)], env=env) for k in range(4)]
    assert [p.wait(120) for p in procs] == [0, 0, 0, 0]
    a = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path))
    assert sorted(e["num_heads"] for e in a.entries) == list(range(1, 25))
    json.loads(art.artifact_path("h100", "fake_faults", tmp_path).read_text())  # one valid document


def _closed_port_url() -> str:
    from autotune.tuning import pg_local

    return pg_local.storage_url("127.0.0.1", pg_local.free_port(), db="nowhere")


def test_unreachable_storage_is_one_line_naming_the_option(pg_url, tmp_path, monkeypatch, capsys):
    """A wrong or dead --storage is a usage error (exit 2) naming the option, never a driver traceback;
    ``postgres://`` spellings reach the same server; an unknown --farm is named too."""
    from autotune.tuning import farm
    from autotune.tuning.cli import main

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    bad = _closed_port_url()
    assert main(_argv(bad, tmp_path / "artifacts", 1, "256", "32")) == 2
    err = capsys.readouterr().err
    assert "--storage postgresql://autotune@127.0.0.1:" in err and "cannot open it" in err, err
    assert main(["status", "--storage", bad]) == 2
    assert "--storage" in capsys.readouterr().err
    assert main(["status", "--storage", pg_url, "--farm", "farm|h100|nope"]) == 2
    assert "no such farm" in capsys.readouterr().err
    for spelling in ("postgres://", "postgres+psycopg://"):
        storage = farm.plain_storage(pg_url.replace("postgresql://", spelling, 1))
        assert optuna.get_all_study_names(storage) == []


def test_silent_storage_host_times_out_without_traceback(tmp_path):
    """``python -m autotune.tuning.cli`` (as the tests and scripts run it) prints CLIError of other modules as
    one line too; a host that accepts TCP but never answers is an error after the connect timeout."""
    import socket

    pytest.importorskip("psycopg", reason="the PostgreSQL driver (the dev extra) is what times out here")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel completes the handshake; nothing ever speaks PostgreSQL
        url = f"postgresql://autotune@127.0.0.1:{silent.getsockname()[1]}/autotune"
        env = child_env(AUTOTUNE_FARM_CONNECT_TIMEOUT="2")
        cmd = [sys.executable, "-m", "autotune.tuning.cli", "status", "--storage", url]
        t0 = time.time()
        res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert f"--storage {url}: cannot open it" in res.stderr and time.time() - t0 < 60


def _children(pid: int) -> list[int]:
    """Process ids whose parent is ``pid`` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_of_the_run_stops_its_workers_and_hands_the_task_back(pg_url, tmp_path):
    """``kill <autotune run>`` (a scheduler's SIGTERM) stops the workers as Ctrl-C does: none keeps running
    unsupervised, and the task it held is failed and queued again at once, not left RUNNING. The workers'
    command lines (visible to every user of the host) do not carry the storage password."""
    root = tmp_path / "artifacts"
    # trust authentication ignores the password: it only shows whether the workers' command lines leak it
    url = pg_url.replace("postgresql://autotune@", "postgresql://autotune:S3cretPw@", 1)
    proc = _start(url, root, 2, "hostT", one=True, AUTOTUNE_FAKE_DEFAULT_SLEEP="0.4")
    try:
        found = _caught_inside_a_trial(proc, pg_url)
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in workers]
        assert all(b"autotune.tuning.farm" in c and b"S3cretPw" not in c for c in cmdlines), cmdlines
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 130, (root.parent / "hostT.out").read_text()[-3000:]
    assert all(_gone(pid, 15) for pid in workers), workers
    storage = rdb_storage(pg_url)
    (name,) = farm_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    trials = [t for t in trials if "task_key" in t.user_attrs]  # not the other worker's empty ask, if it raced
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING], trials
    assert trials[0].number == found[0].number and "interrupted" in trials[0].user_attrs["failed_reason"]
    assert trials[1].user_attrs["task_key"] == found[0].user_attrs["task_key"]


def test_sigkill_of_the_run_stops_its_workers_and_hands_the_task_back(pg_url, tmp_path):
    """``kill -9 <autotune run>`` (or the OOM killer) cannot run the run's own clean-up: its workers stop all
    the same (the kernel's parent-death signal), each handing its task back to the farm at once."""
    root = tmp_path / "artifacts"
    proc = _start(pg_url, root, 1, "hostK", one=True, AUTOTUNE_FAKE_DEFAULT_SLEEP="0.4")
    try:
        _caught_inside_a_trial(proc, pg_url)
        workers = _children(proc.pid)
        assert len(workers) == 1, workers
    finally:
        proc.kill()
        proc.wait(60)
    assert all(_gone(pid, 30) for pid in workers), workers
    storage = rdb_storage(pg_url)
    (name,) = farm_names(storage)
    trials = optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)
    logs = "".join(p.read_text() for p in root.glob("h100/studies/farm-logs/*.log"))
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING], (trials, logs[-3000:])
    assert "its run died" in trials[0].user_attrs["failed_reason"]


def test_a_worker_finishes_its_hand_back_through_further_signals():
    """The first SIGTERM/SIGINT interrupts a worker; the ones after it (the run's SIGTERM after a Ctrl-C, the
    parent-death signal re-sent by each thread of a killed run) do not cut its hand-back short."""
    code = (
        "import os, signal, time\n"
        "from autotune.tuning import farm\n"
        "farm._worker_signals()\n"
        "try:\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(10)\n"
        "except KeyboardInterrupt:\n"
        "    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):\n"
        "        os.kill(os.getpid(), s)\n"
        "    time.sleep(0.3)\n"
        "    print('handed back')\n"
    )
    cmd = [sys.executable, "-c", code]
    r = subprocess.run(cmd, env=child_env(), cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "handed back", (r.returncode, r.stdout, r.stderr[-2000:])


def test_merge_takes_the_last_finished_of_tasks_sharing_an_entry_by_epoch_not_local_time(tmp_path):
    """Two tasks of one artifact entry (one bucket, other batches) finished on hosts in other time zones: Optuna's
    ``datetime_complete`` is each host's naive local time, so the later result looked earlier and the earlier
    one was merged last. The merge orders by the workers' epoch ``finished_at``."""
    import datetime as dt

    from autotune.tuning import farm
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TaskResult, TuneOptions

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="farm|h100|tz", storage=storage)
    early, late = (Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=b) for b in (2, 4))
    base = {"backend": "fake", "median_ms": 1.0, "spread_ms": 0.0, "tflops": 1.0}
    now = dt.datetime(2026, 1, 1, 12)
    # early finished at epoch 1000 on a host 9 h ahead (local clock 21:00), late at epoch 2000 on one 5 h behind
    for task, size, epoch, local in ((late, 2, 2000.0, now - dt.timedelta(hours=5)),
                                     (early, 1, 1000.0, now + dt.timedelta(hours=9))):  # fmt: skip
        entry = TaskResult(task, config={"mode": "ok", "size": size}, **base).entry()
        attrs = {"task": task.to_dict(), "task_key": task.study_name, "label": task.label(),
                 "result": {"entry": entry, "error": None}, "finished_at": epoch}  # fmt: skip
        trial = optuna.trial.create_trial(state=TrialState.COMPLETE, value=1.0, user_attrs=attrs)
        trial.datetime_start, trial.datetime_complete = local - dt.timedelta(seconds=1), local
        study.add_trial(trial)
    assert farm.merge_farm(storage, study.study_name, TuneOptions(artifacts_root=tmp_path)) == 2
    entries = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries
    assert [e["config"]["size"] for e in entries] == [2]


def test_exhausted_retries_fail_the_task_with_its_reason(pg_url, tmp_path, capsys):
    """No retries left (AUTOTUNE_FARM_RETRIES=0) and the worker holding the task is killed: the farm drains,
    the run exits 1 and names the task, its lost holder and why; status counts it and keeps the reason."""
    from autotune.tuning.cli import main

    root = tmp_path / "artifacts"
    proc = _start(pg_url, root, 1, "hostR", one=True, AUTOTUNE_FAKE_DEFAULT_SLEEP="0.4", AUTOTUNE_FARM_RETRIES="0")
    try:
        found = _caught_inside_a_trial(proc, pg_url)
        os.kill(found[0].user_attrs["pid"], signal.SIGKILL)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (root.parent / "hostR.out").read_text()
    assert rc == 1, out[-3000:]
    holder = found[0].user_attrs["worker"]
    assert "1 of 1 tasks failed" in out and "retries exhausted" in out and holder in out, out[-3000:]
    assert main(["status", "--storage", pg_url]) == 0
    status = capsys.readouterr().out
    assert "1 lost" in status and "stopped heartbeating" in status, status


def test_a_task_that_raises_an_unexpected_error_ends_alone_and_the_worker_goes_on(pg_url, tmp_path, monkeypatch):
    """A farm task whose tuning raised anything but a RuntimeError (a KeyError of a bug) killed its worker with a
    traceback: the task was handed back as "interrupted (Ctrl-C, SIGTERM, or its run died)", every retry killed one
    more worker, and once the host's respawns were spent the tasks after it were never claimed. As on one host
    (``run_tasks``), the task now ends alone with the error's type and message, and the worker tunes the next."""
    import dataclasses

    from autotune.tuning import farm

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    fopts, first, opts, storage = one_task_farm(pg_url, tmp_path, grace_s=3)
    second = dataclasses.replace(first, bucket=512)
    name = farm.join_farm(storage, [first, second], opts)
    decide_raises_for_bucket(monkeypatch, first.bucket)
    plain = {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(opts).items()}
    spec = {"url": pg_url, "farm": name, "opts": plain, "farm_options": dataclasses.asdict(fopts), "deadline": None,
            "slot": 0}  # fmt: skip
    assert farm.work(spec) == 0
    study = optuna.load_study(study_name=name, storage=storage)
    bad, good = farm.farm_results(study, [first, second])
    assert bad.config is None and bad.error == "KeyError: 'planted'", bad.error
    assert good.error is None and good.config is not None
    assert [t.state for t in study.get_trials(deepcopy=False)] == [TrialState.COMPLETE] * 2
    entries = art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries
    assert [e["bucket"] for e in entries] == [512]


def test_results_artifacts_and_status_take_one_result_per_task(tmp_path):
    """The run's results, the artifact entries it merges and ``autotune status`` pick a task's result by one
    rule (``farm.result_trial``): its latest run that finished without error, so neither a lost claim nor an
    errored run hides it; else its latest error; else its lost claim."""
    from autotune.tuning import farm, farm_status
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TaskResult, TuneOptions

    storage = optuna.storages.InMemoryStorage()
    study = optuna.create_study(study_name="farm|h100|x", storage=storage)
    tasks = [
        Task("fake_faults", "h100", "float32", 32, 32, 1, b, "uniform", batch=2, seq_cap=64) for b in (256, 512, 1024)
    ]
    ok = {"backend": "fake", "config": {"mode": "ok", "size": 1}, "median_ms": 1.0, "spread_ms": 0.0, "tflops": 1.0}
    good = TaskResult(tasks[0], **ok)

    def run(task: Task, state: TrialState, result: dict | None = None) -> None:
        attrs = {"task": task.to_dict(), "task_key": task.study_name, "label": task.label(), "result": result}
        value = 1.0 if state == TrialState.COMPLETE else None
        study.add_trial(optuna.trial.create_trial(state=state, value=value, user_attrs=attrs))

    run(tasks[0], TrialState.FAIL)
    run(tasks[0], TrialState.COMPLETE, {"entry": good.entry(), "error": None})
    run(tasks[0], TrialState.COMPLETE, {"entry": TaskResult(tasks[0]).entry(), "error": "an errored run"})
    run(tasks[1], TrialState.COMPLETE, {"entry": TaskResult(tasks[1]).entry(), "error": "no config was correct"})
    run(tasks[2], TrialState.FAIL)
    results = farm.farm_results(study, tasks)
    assert results[0].config == good.config and results[0].error is None
    assert results[1].error == "no config was correct" and "lost after 1 attempt" in results[2].error
    assert farm.merge_farm(storage, study.study_name, TuneOptions(artifacts_root=tmp_path)) == 1
    assert art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path)).entries == [good.entry()]
    rows = farm_status.snapshot(storage, study.study_name)["tasks"]
    assert [(r["state"], r["claims"]) for r in rows] == [("done", 3), ("failed", 1), ("lost", 1)]


def test_two_farms_naming_one_task_keep_to_their_own_task_studies(pg_url, tmp_path, monkeypatch):
    """Two commands of other knobs (``--trials 2`` and ``3``) on one storage are two farms naming the same task.
    When farm B's worker opens the task while A's worker is inside a config trial, A's trial is not failed as
    interrupted (it used to be, and A recorded the task as failed): each farm has its own task study."""
    import dataclasses

    from autotune.tuning import farm, tuner

    fopts, task, opts_a, storage = one_task_farm(pg_url, tmp_path, grace_s=2)
    opts_b = dataclasses.replace(opts_a, n_trials=3)
    farm_a = optuna.load_study(study_name=farm.join_farm(storage, [task], opts_a), storage=storage)
    farm_b_name = farm.join_farm(storage, [task], opts_b)
    assert farm_b_name != farm_a.study_name
    trial = farm.claim(farm_a, fopts)
    real_evaluate, opened = tuner._Study._evaluate, []

    def evaluate(self, *args, **kwargs):
        if not opened:  # farm B's worker opens its study of the same task now
            opened.append(tuner._Study(task, dataclasses.replace(opts_b, study_namespace=farm_b_name),
                                       self.worker, storage, tuner.Reporter()))  # fmt: skip
        return real_evaluate(self, *args, **kwargs)

    monkeypatch.setattr(tuner._Study, "_evaluate", evaluate)
    assert run_one(farm_a, trial, opts_a, fopts, "A-w0") is True
    done = farm_a.get_trials(deepcopy=False)
    assert [t.state for t in done] == [TrialState.COMPLETE] and not done[0].user_attrs["result"]["error"]
    task_studies = [n for n in optuna.get_all_study_names(storage) if not n.startswith("farm|")]
    (mine,) = [n for n in task_studies if n.endswith(farm_a.study_name)]
    assert len(task_studies) == 2 and opened[0].study.study_name.endswith(farm_b_name)
    statuses = [t.user_attrs.get("status") for t in optuna.load_study(study_name=mine, storage=storage).trials]
    assert "interrupted" not in statuses and "ok" in statuses, statuses


def test_a_host_joining_while_a_stale_claim_is_failed_queues_nothing_twice(pg_url, tmp_path, monkeypatch):
    """Failing a stale claim and queueing its copy happen under the farm's lock: a host that joins in between
    (it queues every task with no waiting or running copy) waits for the copy, so the task is queued once."""
    import copy
    import threading

    from autotune.tuning import farm

    fopts, task, opts, storage = one_task_farm(pg_url, tmp_path)
    study = optuna.load_study(study_name=farm.join_farm(storage, [task], opts), storage=storage)
    held = farm.claim(study, fopts)
    joined = threading.Event()

    def fail_stale(s):  # what Optuna's fail_stale_trials does with a stale claim: fail it, then re-queue it
        storage.set_trial_state_values(held._trial_id, TrialState.FAIL)
        other = threading.Thread(target=lambda: (farm.join_farm(storage, [task], opts), joined.set()))
        other.start()
        assert not joined.wait(1.5), "a host joined between the fail and the re-queue"
        farm._retry_callback(storage)(s, copy.deepcopy(storage.get_trial(held._trial_id)))
        fail_stale.thread = other

    monkeypatch.setattr(optuna.storages, "fail_stale_trials", fail_stale)
    farm.claim(study, fopts)
    fail_stale.thread.join(30)
    assert joined.is_set()
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert states.count(TrialState.WAITING) + states.count(TrialState.RUNNING) == 1, states


def test_status_of_a_sqlite_storage(tmp_path, capsys):
    """sqlite storages hold single-process studies, never a farm: status of a missing file is an error that
    creates nothing there, and of an existing one says that farms need PostgreSQL."""
    from autotune.tuning.cli import main

    missing = tmp_path / "missing.db"
    assert main(["status", "--storage", f"sqlite:///{missing}"]) == 2
    assert "no such database file" in capsys.readouterr().err and not missing.exists()
    db = tmp_path / "runs.db"
    optuna.create_study(study_name="a single-process study", storage=f"sqlite:///{db}")
    assert main(["status", "--storage", f"sqlite:///{db}"]) == 1
    assert "farms live in PostgreSQL storage" in capsys.readouterr().out


def test_progress_display_failure_does_not_stop_the_farm(pg_url, tmp_path, monkeypatch):
    """The run's progress table reads the storage too: when that read fails (a storage restart, a network
    blip) the workers go on and the task finishes, instead of the whole host stopping with a traceback."""
    from sqlalchemy.exc import OperationalError

    from autotune.tuning import farm
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    calls = []

    def broken_display(name: str) -> None:
        calls.append(name)
        raise OperationalError("SELECT ...", {}, Exception("server closed the connection unexpectedly"))

    task = Task("fake_faults", "h100", "float32", 32, 32, 1, 256, "uniform", batch=2, seq_cap=64)
    opts = TuneOptions(
        n_trials=2, sampler="bruteforce", interpret=True, plugins=["autotune.tuning.fake"], artifacts_root=tmp_path
    )
    fopts = farm.FarmOptions(heartbeat_s=1, grace_s=3, retries=3, poll_s=0.3)
    (result,) = farm.run_farm([task], opts, pg_url, workers=1, fopts=fopts, tick=broken_display)
    assert calls and result.error is None and result.config is not None


def test_stopped_worker_resumed_after_takeover_drops_its_task(pg_url, tmp_path):
    """SIGSTOP the holder inside a trial (its heartbeat stalls), let another worker take the task over, then
    SIGCONT it: the task is finished once, by the new holder, nothing is measured twice, the artifact holds
    the new holder's entry, and the resumed worker says it lost the claim."""
    root = tmp_path / "artifacts"
    proc = _start(pg_url, root, 2, "hostS", one=True, AUTOTUNE_FAKE_DEFAULT_SLEEP="0.4")
    try:
        found = _caught_inside_a_trial(proc, pg_url)
        victim = found[0]
        os.kill(victim.user_attrs["pid"], signal.SIGSTOP)
        try:
            storage, taken, deadline = rdb_storage(pg_url), None, time.time() + 120
            farm_study = optuna.load_study(study_name=farm_names(storage)[0], storage=storage)
            while taken is None and time.time() < deadline:
                claims = [t for t in farm_study.get_trials(deepcopy=False) if t.user_attrs.get("pid")]
                taken = next((t for t in claims if t.number != victim.number and t.state.is_finished()), None)
                time.sleep(0.3)
        finally:
            os.kill(victim.user_attrs["pid"], signal.SIGCONT)
        assert taken is not None and taken.state == TrialState.COMPLETE, "no other worker finished the task"
    finally:
        _wait(proc, root, "hostS")
    got = _check_farm(pg_url, [root], n_tasks=1)
    assert [t.number for t in got["done"]] == [taken.number]
    assert got["farm"].trials[victim.number].state == TrialState.FAIL
    logs = "".join(p.read_text() for p in (root / "h100" / "studies" / "farm-logs").glob("hostS-w*.log"))
    assert f"{victim.user_attrs['worker']}: lost the claim" in logs, logs[-3000:]


def test_single_process_sqlite_storage_runs_and_a_bad_one_is_named(tmp_path, monkeypatch, capsys):
    """sqlite storages keep the single-process run (its progress bars are no farm reporter); a sqlite file
    that cannot be opened is a usage error naming --storage, not a traceback from inside the first task."""
    from autotune.tuning.cli import main

    for k, v in FARM_ENV.items():
        monkeypatch.setenv(k, v)
    argv = _argv("sqlite:///" + str(tmp_path / "runs.db"), tmp_path / "artifacts", 1, "256", "32")
    argv = [*argv[: argv.index("--workers")], "--distributions", "uniform"]
    assert main(argv) == 0, capsys.readouterr()
    assert len(art.load_artifact(art.artifact_path("h100", "fake_faults", tmp_path / "artifacts")).entries) == 1
    capsys.readouterr()
    bad = "sqlite:///" + str(tmp_path / "no-such-dir" / "runs.db")
    argv[argv.index("--storage") + 1] = bad
    assert main(argv) == 2
    assert f"--storage {bad}: cannot open it" in capsys.readouterr().err


def test_farm_name_follows_tasks_and_knobs_only():
    """Another task set or tuning knob is another farm; where artifacts or studies of one run go is not."""
    import dataclasses

    from autotune.tuning.farm import farm_name
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    tasks = [Task("fake_faults", "h100", "float32", 32, 32, 1, b, "uniform", batch=2, seq_cap=64) for b in (256, 512)]
    opts = TuneOptions(n_trials=3, sampler="bruteforce", interpret=True, plugins=["autotune.tuning.fake"])
    name = farm_name(tasks, opts)
    assert name.startswith("farm|h100|") and farm_name(tasks[::-1], opts) == name
    assert farm_name(tasks, dataclasses.replace(opts, artifacts_root=Path("elsewhere"), storage="x")) == name
    assert farm_name(tasks[:1], opts) != name
    for knob in (
        {"n_trials": 4},
        {"sampler": "random"},
        {"seed": 1},
        {"prune": False},
        {"verify": "quick"},
        {"eval_timeout_s": 5.0},
    ):
        assert farm_name(tasks, dataclasses.replace(opts, **knob)) != name, knob


def test_farm_name_takes_the_backends_as_a_set():
    """``--backends cute,triton`` on one host and ``triton,cute`` on another named two farms, each tuning every
    task again; the same backends in any order are one farm, other backends another."""
    import dataclasses

    from autotune.tuning.farm import farm_name
    from autotune.tuning.tasks import Task
    from autotune.tuning.tuner import TuneOptions

    tasks = [Task("hstu_attention_fwd", "h100", "bfloat16", 64, 64, 4, 1024, "uniform")]
    opts = TuneOptions(n_trials=3, backends=["cute", "triton"])
    name = farm_name(tasks, opts)
    assert farm_name(tasks, dataclasses.replace(opts, backends=["triton", "cute"])) == name
    assert farm_name(tasks, dataclasses.replace(opts, backends=["triton"])) != name


@pytest.mark.parametrize(
    ("name", "value"),
    [("AUTOTUNE_FARM_GRACE", "abc"), ("AUTOTUNE_FARM_HEARTBEAT", "0"), ("AUTOTUNE_FARM_RETRIES", "1.5"),
     ("AUTOTUNE_FARM_POLL", "nan"), ("AUTOTUNE_FARM_CONNECT_TIMEOUT", "-1")],
)  # fmt: skip
def test_bad_farm_environment_values_are_one_line_naming_the_variable(monkeypatch, capsys, name, value):
    from autotune.tuning.cli import main

    monkeypatch.setenv(name, value)
    argv = ["run", "--interpret", "--kernel", "fake_faults", "--plugin", "autotune.tuning.fake", "--trials", "2"]
    assert main([*argv, "--workers", "1", "--storage", "postgresql://nobody@127.0.0.1:1/none"]) == 2
    err = capsys.readouterr().err
    assert f"{name}={value!r}" in err and "Traceback" not in err, err


@pytest.mark.parametrize(
    ("url", "hint"),
    [("postgresql://u@h/db", "the PostgreSQL driver is missing"), ("mysql://u@h/db", "its database driver is missing")],
)
def test_a_missing_driver_is_named_for_the_url_given(monkeypatch, url, hint):
    """A missing driver said 'the PostgreSQL driver is missing' for any URL (a mysql:// one too)."""
    from autotune.tuning import farm_storage

    def no_driver(*a, **k):
        raise ImportError("No module named 'driver'")

    monkeypatch.setattr(farm_storage, "_schema_lock", lambda url: __import__("contextlib").nullcontext())
    monkeypatch.setattr(optuna.storages, "RDBStorage", no_driver)
    with pytest.raises(farm_storage.FarmError, match=hint):
        farm_storage._open_storage(url)


def test_a_farm_told_to_interpret_joins_and_spawns_under_the_interpreter(monkeypatch):
    """As ``run_tasks``: ``run_farm(interpret=True)`` called as a library left TRITON_INTERPRET as it was, so on a
    GPU host its workers (which inherit this environment) timed the GPU. Set for the farm's run, restored after."""
    import os

    from autotune.tuning import farm
    from autotune.tuning.tuner import TuneOptions

    seen = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(farm, "_run_farm", lambda *a: seen.append(os.environ.get("TRITON_INTERPRET")) or [])
    assert farm.run_farm([], TuneOptions(interpret=True), "postgresql://u@h/db") == []
    farm.run_farm([], TuneOptions(interpret=False), "postgresql://u@h/db")
    assert seen == ["1", None] and "TRITON_INTERPRET" not in os.environ
