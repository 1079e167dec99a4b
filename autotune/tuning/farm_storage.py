"""Where a tuning farm keeps its state: the PostgreSQL (Optuna RDB) storage, opened with heartbeats, a
retry callback, a connect timeout and a schema lock; the farm's advisory lock; and its knobs from
``AUTOTUNE_FARM_*``.

Apart from ``farm.py`` (claims, workers, the host's run) so that readers of the storage (``autotune status``)
and the farm share one way to open it, and one error for what cannot be opened.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import optuna

from autotune.tuning.study_storage import rdb_url


class FarmError(RuntimeError):
    """The farm cannot be joined or run (other timing key, storage unreachable, workers refused)."""


@dataclass
class FarmOptions:
    """Heartbeat and polling knobs (``AUTOTUNE_FARM_*`` environment variables; short ones in tests)."""

    heartbeat_s: int = 10
    grace_s: int = 60
    retries: int = 3
    poll_s: float = 2.0

    @classmethod
    def from_env(cls) -> FarmOptions:
        """The knobs of the environment; a grace period no longer than the heartbeat interval is refused: every
        live worker would count as dead between two of its beats, and its task be taken over again and again."""
        fopts = cls(
            heartbeat_s=int(env_number("AUTOTUNE_FARM_HEARTBEAT", 10, 1, integer=True)),
            grace_s=int(env_number("AUTOTUNE_FARM_GRACE", 60, 1, integer=True)),
            retries=int(env_number("AUTOTUNE_FARM_RETRIES", 3, 0, integer=True)),
            poll_s=env_number("AUTOTUNE_FARM_POLL", 2.0, 0.01),
        )
        if fopts.grace_s <= fopts.heartbeat_s:
            raise FarmError(
                f"AUTOTUNE_FARM_GRACE={fopts.grace_s} must exceed AUTOTUNE_FARM_HEARTBEAT={fopts.heartbeat_s} "
                "(seconds; a few heartbeats, e.g. 6x): a live worker would count as dead between two of its beats"
            )
        return fopts


def env_number(name: str, default: float, minimum: float, integer: bool = False) -> float:
    """The number in environment variable ``name`` (``default`` when unset), at least ``minimum``; a
    ``FarmError`` naming the variable otherwise (a typo there is one line, not a worker's traceback)."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw) if integer else float(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        kind = "an integer" if integer else "a number"
        raise FarmError(f"{name}={raw!r}: must be {kind} >= {minimum:g}")
    return value


# Worker processes one host may start: each holds a Python process with its own storage connections (a stock
# PostgreSQL server takes 100), so a typo such as --workers 1000 would start a fork storm, not a farm.
MAX_WORKERS = 64


def check_farm_call(url: str, workers: int | None) -> None:
    """FarmError for a farm this host cannot run: a worker count outside [1, MAX_WORKERS] (None: one per GPU), or
    a storage other than PostgreSQL, whose row and advisory locks the claims rely on (sqlite would lose them)."""
    if workers is not None and (type(workers) is not int or not 1 <= workers <= MAX_WORKERS):  # bool is no count
        raise FarmError(f"workers must be an integer in [1, {MAX_WORKERS}] (None: one per GPU), got {workers!r}")
    if not is_farm_url(url):
        raise FarmError(f"--storage {_safe(url)}: a farm runs on PostgreSQL (postgresql://...)")


# ------------------------------------------------------------------------------------------ storage
def is_farm_url(url: str | None) -> bool:
    """A PostgreSQL storage URL: the farm's engine (row locks, heartbeats, many hosts)."""
    return bool(url) and url.split("://", 1)[0].split("+", 1)[0] in ("postgresql", "postgres")


def farm_storage(url: str, fopts: FarmOptions | None = None) -> optuna.storages.RDBStorage:
    """RDBStorage with heartbeats and a retry callback: a dead worker's task goes back to the queue."""
    fopts = fopts or FarmOptions.from_env()
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")
    warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
    kw: dict[str, Any] = {"heartbeat_interval": fopts.heartbeat_s, "grace_period": fopts.grace_s}
    if hasattr(optuna.storages, "RetryHeartbeatStaleTrialCallback"):  # optuna >= 5
        kw["heartbeat_stale_trial_callback"] = optuna.storages.RetryHeartbeatStaleTrialCallback(fopts.retries)
    else:
        kw["failed_trial_callback"] = optuna.storages.RetryFailedTrialCallback(fopts.retries)
    return _open_storage(url, **kw)


class NoOptunaTables(FarmError):
    """The database holds no Optuna storage (a reader opened it with ``create=False``)."""


def plain_storage(url: str, create: bool = True) -> optuna.storages.RDBStorage:
    """An RDBStorage without heartbeats (readers: status, the run's progress table). ``create=False``: a database
    without Optuna's tables is ``NoOptunaTables``, not given them (``autotune status`` only reads)."""
    return _open_storage(url, create=create)


def _open_storage(url: str, create: bool = True, **kw: Any) -> optuna.storages.RDBStorage:
    """Open (and on first use create, unless ``create`` is off) Optuna's tables; FarmError naming ``--storage``
    when that fails, so a wrong or unreachable URL is one line, not a driver traceback."""
    engine_kwargs = {"pool_pre_ping": True, "connect_args": _connect_args(rdb_url(url))}
    try:
        with _schema_lock(rdb_url(url)):
            if not create and not _has_optuna_tables(rdb_url(url)):
                raise NoOptunaTables(f"--storage {_safe(url)}: the database holds no Optuna storage")
            return optuna.storages.RDBStorage(
                rdb_url(url), engine_kwargs=engine_kwargs, skip_table_creation=not create, **kw
            )
    except FarmError:
        raise
    except ImportError as e:
        need = (
            "the PostgreSQL driver is missing (pip install 'psycopg[binary]')"
            if is_farm_url(url)
            else ("its database driver is missing; the farm runs on postgresql:// URLs")
        )
        raise FarmError(f"--storage {_safe(url)}: {e}: {need}") from e
    except Exception as e:  # noqa: BLE001 - sqlalchemy's URL and connection errors: say where and why
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        hint = "check the URL"
        if is_farm_url(url):
            hint += " and that the server runs (python -m autotune.tuning.pg_local start DIR prints a local one's URL)"
        raise FarmError(f"--storage {_safe(url)}: cannot open it ({why}); {hint}") from e


def _has_optuna_tables(url: str) -> bool:
    """Whether the database at ``url`` holds Optuna's tables (its ``studies`` and ``version_info``)."""
    import sqlalchemy

    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=_connect_args(url))
    try:
        inspector = sqlalchemy.inspect(engine)
        return all(inspector.has_table(t) for t in ("studies", "version_info"))
    finally:
        engine.dispose()


def _connect_args(url: str) -> dict[str, Any]:
    """A connect timeout for PostgreSQL (``AUTOTUNE_FARM_CONNECT_TIMEOUT`` s, default 30): a firewalled or
    silent host is an error after that, not a hang of minutes (the OS's TCP timeout)."""
    if not url.startswith("postgresql"):
        return {}
    return {"connect_timeout": int(env_number("AUTOTUNE_FARM_CONNECT_TIMEOUT", 30, 2, integer=True))}


@contextlib.contextmanager
def _schema_lock(url: str) -> Iterator[None]:
    """Optuna creates its tables on first use, which races when two hosts start on a fresh database
    (CREATE TYPE twice): an advisory lock serialises that first connection."""
    import sqlalchemy

    if not url.startswith("postgresql"):
        yield
        return
    engine = sqlalchemy.create_engine(url, poolclass=sqlalchemy.pool.NullPool, connect_args=_connect_args(url))
    try:
        with engine.connect() as conn:
            conn.execute(sqlalchemy.text("SELECT pg_advisory_lock(:k)"), {"k": _SCHEMA_LOCK})
            try:
                yield
            finally:
                conn.execute(sqlalchemy.text("SELECT pg_advisory_unlock(:k)"), {"k": _SCHEMA_LOCK})
    finally:
        engine.dispose()


_SCHEMA_LOCK = 0x68737475  # 'hstu': the advisory lock id around Optuna's table creation


@contextlib.contextmanager
def _advisory_lock(storage: optuna.storages.RDBStorage, name: str) -> Iterator[None]:
    """PostgreSQL's advisory lock ``name`` (a farm's: around joining, re-queueing, and a holder's writes to its
    task study), so each task is queued once and a stale holder writes nothing after a takeover."""
    from sqlalchemy import text

    lock_id = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    # A loaded study's storage is Optuna's cache around the RDBStorage, which holds the engine.
    engine = getattr(storage, "engine", None) or getattr(getattr(storage, "_backend", None), "engine", None)
    if engine is None or engine.dialect.name != "postgresql":
        yield
        return
    # The transaction's lock, not the connection's: it ends with the transaction however that ends, so an
    # interrupt (Ctrl-C, SIGTERM) during its release leaves no pooled connection holding it, which would block
    # this process's own hand-back (on another connection) and every other worker for as long as it lives.
    with engine.connect() as conn, conn.begin():
        conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": lock_id})
        yield


def _safe(url: str) -> str:
    """The URL without its password (for messages and status titles): the one before '@', and a ``password=``
    query parameter (libpq's other spelling, ``postgresql://u@h/db?password=...``)."""
    head, sep, tail = url.partition("://")
    tail = re.sub(r"([?&]password=)[^&]*", r"\1***", tail, flags=re.IGNORECASE)
    if "@" in tail:
        auth, host = tail.rsplit("@", 1)
        tail = auth.split(":", 1)[0] + ("" if ":" not in auth else ":***") + "@" + host
    return head + sep + tail


def _retry_callback(storage: Any) -> Callable | None:
    getter = getattr(storage, "get_heartbeat_stale_trial_callback", None) or storage.get_failed_trial_callback
    return getter()


# --------------------------------------------------------------------------------------------- keys
