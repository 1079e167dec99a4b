"""``autotune`` option values a user gets wrong: one-line errors naming the option, before any work runs."""

from __future__ import annotations

import pytest

from autotune.runtime import artifacts as art
from autotune.tuning import cli
from autotune.tuning.tasks import build_tasks


def _run(capsys, *argv: str) -> tuple[int, str]:
    rc = cli.main(list(argv))
    out = capsys.readouterr()
    return rc, out.out + out.err


@pytest.fixture
def no_tuning(monkeypatch) -> list:
    """``run_tasks`` replaced by a recorder: a run that gets past its checks tunes nothing here."""
    import autotune.tuning.tuner

    calls: list = []
    monkeypatch.setattr(autotune.tuning.tuner, "run_tasks", lambda tasks, *a, **k: calls.append(tasks) or [])
    return calls


RUN = ("run", "--gpu", "h100", "--interpret", "--kernel", "fwd", "--distributions", "uniform")


def test_run_refuses_an_artifacts_root_that_is_a_file(capsys, tmp_path, no_tuning):
    """It was a NotADirectoryError traceback (or, with --storage elsewhere, one after the first task)."""
    root = tmp_path / "artifacts"
    root.write_text("")
    rc, text = _run(capsys, *RUN, "--artifacts", str(root))
    assert rc == 2 and "--artifacts" in text and "Traceback" not in text and not no_tuning


def test_run_refuses_a_journal_storage_that_is_a_folder(capsys, tmp_path, no_tuning):
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", str(tmp_path))
    assert rc == 2 and "--storage" in text and "is a folder" in text and not no_tuning
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", str(tmp_path / "j.journal"))
    assert rc == 0 and len(no_tuning) == 1  # a new journal file in an existing folder is fine


@pytest.mark.parametrize("url", ["postgres:/db", "postgresql:host/db", "sqlite:tuning.db"])
def test_run_refuses_a_storage_url_without_its_slashes(capsys, tmp_path, monkeypatch, no_tuning, url):
    """A URL missing '//' was taken as a journal path: a folder 'postgres:' made here and a run without the farm."""
    monkeypatch.chdir(tmp_path)
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", url)
    assert rc == 2 and f"--storage {url}: a URL needs 'scheme://'" in text and not no_tuning
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]  # no 'postgres:' folder, no journal
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", f"./{url.replace('/', '_')}")
    assert rc == 0 and len(no_tuning) == 1  # such a name, written as a path, is a journal file


@pytest.mark.parametrize("url", ["", "  "])
def test_run_refuses_a_storage_that_names_nothing(capsys, tmp_path, monkeypatch, no_tuning, url):
    """``--storage "$URL"`` with the variable unset ran without the farm, on the default journal file."""
    monkeypatch.chdir(tmp_path)
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", url)
    assert rc == 2 and "--storage names nothing" in text and not no_tuning
    assert list(tmp_path.iterdir()) == []  # nothing was made: no artifacts folder, no journal


def test_merge_refuses_an_artifacts_root_that_is_a_file(capsys, tmp_path):
    root = tmp_path / "artifacts"
    root.write_text("")
    src = sorted((art.DEFAULT_ROOT / "h100").glob("*.json"))[0]
    rc, text = _run(capsys, "merge", str(src), "--artifacts", str(root))
    assert rc == 2 and "--artifacts" in text and "Traceback" not in text


@pytest.mark.parametrize("watch", ["0", "-1", "nan"])
def test_status_watch_must_be_a_positive_interval(capsys, tmp_path, watch):
    """-1 and nan crashed in time.sleep once a task was waiting; 0 silently printed once and did not watch."""
    import optuna

    from autotune.tuning.farm_status import FARM_PREFIX

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    farm = optuna.create_study(study_name=f"{FARM_PREFIX}h100|x", storage=url)
    farm.enqueue_trial({}, user_attrs={"task_key": "t", "label": "a task"})
    rc, text = _run(capsys, "status", "--storage", url, "--watch", watch)
    assert rc == 2 and "--watch must be a positive number" in text


def test_status_audit_of_a_missing_artifacts_folder_is_refused(capsys, tmp_path):
    """``--audit`` with a misspelt folder reported every finished task's entry as lost from the artifacts."""
    import optuna

    from autotune.tuning.farm_status import FARM_PREFIX

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name=f"{FARM_PREFIX}h100|x", storage=url)
    rc, text = _run(capsys, "status", "--storage", url, "--audit", str(tmp_path / "artifcts"))
    assert rc == 2 and "--audit" in text and "no such artifacts folder" in text, text
    rc, text = _run(capsys, "status", "--storage", url, "--audit", str(tmp_path))
    assert rc == 0 and "entries_lost 0" in text, text


def test_an_empty_farm_or_plugin_name_is_a_usage_error(capsys, tmp_path, no_tuning):
    """``--farm "$FARM"`` with the variable unset showed every farm, and ``--plugin ""`` loaded nothing: each was
    taken as if left out. Both are refused, naming the option, before anything runs."""
    import optuna

    from autotune.tuning.farm_status import FARM_PREFIX

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name=f"{FARM_PREFIX}h100|x", storage=url)
    rc, text = _run(capsys, "status", "--storage", url, "--farm", " ")
    assert rc == 2 and "--farm names nothing" in text, text
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--plugin", "")
    assert rc == 2 and "--plugin names nothing" in text and not no_tuning, text


def test_status_audit_with_watch_is_a_usage_error(capsys, tmp_path):
    """``--audit`` printed the evidence once and returned: a ``--watch`` beside it was accepted and ignored."""
    import optuna

    from autotune.tuning.farm_status import FARM_PREFIX

    url = f"sqlite:///{tmp_path / 'farm.db'}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    optuna.create_study(study_name=f"{FARM_PREFIX}h100|x", storage=url)
    rc, text = _run(capsys, "status", "--storage", url, "--audit", str(tmp_path), "--watch")
    assert rc == 2 and "--audit" in text and "--watch" in text, text


def test_a_value_named_twice_is_one_task(capsys):
    """``--buckets 1K,1024`` or ``--dims 128,128`` tuned the same study twice (twice the budget)."""
    rc, text = _run(
        capsys, "run", "--gpu", "h100", "--dry-run", "--kernel", "fwd", "--dims", "128,128x128",
        "--buckets", "1K,1024", "--distributions", "jagged,jagged", "--masks", "causal,causal",
    )  # fmt: skip
    assert rc == 0 and "dry run: 1 tasks" in text
    tasks = build_tasks(["hstu_attention_fwd"], "h100", "bfloat16", [(64, 64)] * 2, 4, [512, 256, 512], ["uniform"],
                        ["causal"], 32)  # fmt: skip
    assert [t.bucket for t in tasks] == [256, 512]


def test_merge_refuses_a_folder(capsys, tmp_path):
    """A folder given as a file was an IsADirectoryError traceback from ``os.fdopen``."""
    rc, text = _run(capsys, "merge", str(tmp_path), "--artifacts", str(tmp_path / "out"))
    assert rc == 2 and "not a regular file" in text and "Traceback" not in text
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        # ',' showed or re-checked every kernel; 'fwd,nope' showed fwd and ignored nope.
        (("show", "--gpu", "h100", "--kernel", ","), "--kernel ',' names nothing"),
        (("show", "--gpu", "h100", "--kernel", "fwd,nope"), "--kernel: unknown kernel(s) nope"),
        (("verify", "--interpret", "--kernel", ","), "--kernel ',' names nothing"),
        (("verify", "--interpret", "--kernel", ""), "--kernel '' names nothing"),
        (("verify", "--interpret", "--kernel", "fwd,nope"), "--kernel: unknown kernel(s) nope"),
        # It named no option: "unknown kernel 'nope'".
        (("run", "--gpu", "h100", "--dry-run", "--kernel", "fwd,nope"), "--kernel: unknown kernel(s) nope"),
    ],
)
def test_a_kernel_list_naming_nothing_or_an_unknown_kernel(capsys, argv, message):
    rc, text = _run(capsys, *argv)
    assert rc == 2 and message in text and len(text.strip().splitlines()) == 1, text


def test_a_farm_run_opens_its_storage_once_at_start_up(capsys, tmp_path, monkeypatch):
    """The CLI opens ``--storage postgresql://...`` before its banner (to name a bad URL first); the farm then read
    its progress through a second connection of its own. It now takes the one the CLI opened."""
    from autotune.tuning import farm, farm_storage

    opened: list[str] = []
    storage = object()

    def plain(url, create=False):
        opened.append(url)
        return storage

    seen: dict = {}

    def fake_farm(tasks, opts, url, workers, budget_s, fopts, tick):
        seen["reader"] = farm.plain_storage  # the module's name, to prove it was not called again
        return []

    monkeypatch.setattr(farm_storage, "plain_storage", plain)
    monkeypatch.setattr(farm, "plain_storage", plain)
    monkeypatch.setattr(farm, "run_farm", fake_farm)
    url = "postgresql://tuner@localhost:1/farm"
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"), "--storage", url, "--workers", "1")
    assert rc == 0 and seen, text
    assert opened == [url]


def test_run_refuses_a_journal_corrupt_past_its_first_line(capsys, tmp_path, no_tuning):
    """A journal damaged after its first line (a garbled record: a disk error, a hand edit) passed the check of its
    first line and ended ``autotune run`` in a JSONDecodeError traceback from Optuna; the default journal under
    ``--artifacts`` was not checked at all. Its last line cut short (a killed write) is what Optuna skips: fine."""
    import optuna

    from autotune.tuning.study_storage import journal_problem, make_storage

    journal = tmp_path / "a" / "h100" / "studies" / "tuning.journal"
    journal.parent.mkdir(parents=True)
    study = optuna.create_study(study_name="s", storage=make_storage(str(journal), "h100", tmp_path))
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    good = journal.read_bytes()
    journal.write_bytes(good[:-7])  # the last record cut short
    assert journal_problem(journal) is None
    lines = good.splitlines(keepends=True)
    journal.write_bytes(b"".join([*lines[:2], b'{"op_code": 5, "trial_id": garb\n', *lines[2:]]))
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "a"))
    assert rc == 2 and str(journal) in text and "line 3" in text and not no_tuning, text
    rc, text = _run(capsys, *RUN, "--artifacts", str(tmp_path / "b"), "--storage", str(journal))
    assert rc == 2 and f"--storage {journal}" in text and "line 3" in text and not no_tuning, text
