"""Where a study's trials live: a journal file (one ``autotune run`` at a time) or an RDB URL (SQLite, or the
farm's PostgreSQL), opened the one way the tuner, the farm and the tests share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna


def rdb_url(url: str) -> str:
    """SQLAlchemy URL of an RDB storage: ``postgresql://`` goes through psycopg (3) unless psycopg2 is there.

    ``postgres://`` (libpq's and many hosting providers' spelling) is PostgreSQL too: SQLAlchemy knows no
    ``postgres`` dialect, so it is spelled ``postgresql`` whichever driver is installed."""
    import importlib.util

    if url.startswith(("postgres://", "postgres+")):
        url = "postgresql" + url[len("postgres") :]
    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg2") is None:
        return "postgresql+psycopg://" + url.split("://", 1)[1]
    return url


def make_storage(url: str | None, gpu: str, root: Path) -> Any:
    """Optuna storage: an RDB URL as is; otherwise a journal file (default artifacts/<gpu>/studies/)."""
    if url and "://" in url:
        return rdb_url(url)
    path = Path(url) if url else Path(root) / gpu / "studies" / "tuning.journal"
    problem = journal_problem(path)
    if problem:
        raise ValueError(f"storage {path}: {problem}")
    path.parent.mkdir(parents=True, exist_ok=True)
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(str(path)))


def journal_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a journal storage (None: it is one, is empty or does not exist yet). Optuna appends
    its log lines to whatever file it is given, so a notes file or a SQLite database named as a journal path
    would be written into before the run failed on it; and a record garbled past the first line (a disk error, a
    hand edit) ended the run in Optuna's JSONDecodeError. A last line cut short (a killed write) is what Optuna
    skips, so it passes."""
    try:
        with open(path, "rb") as f:
            return _records_problem(f)  # an empty file has no line: a journal not written yet
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot read it ({e.strerror or e})"


def _records_problem(f: Any) -> str | None:
    """Why the lines of an open journal are not Optuna's records (each a JSON object with an ``op_code``), or None."""
    for number, raw in enumerate(f, 1):
        if not raw.endswith(b"\n"):  # the last line, cut short: Optuna skips it
            return None if raw.startswith(b'{"op_code"') or number > 1 else _NOT_JOURNAL
        try:
            record = json.loads(raw)
        except ValueError:
            record = None
        if not (isinstance(record, dict) and "op_code" in record):
            return _NOT_JOURNAL if number == 1 else f"line {number} is no Optuna journal record (a damaged journal)"
    return None


_NOT_JOURNAL = "it exists and is not an Optuna journal file (an RDB storage is a URL, e.g. sqlite:///PATH)"
