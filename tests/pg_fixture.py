"""A real PostgreSQL server for the farm tests: initdb into a temporary folder, ``pg_ctl start`` on a free
loopback port, one fresh database per test. Skipped, saying why, only where the server programs (or the
psycopg driver) are missing. As root the server runs as the ``postgres``/``nobody`` account
(``autotune.tuning.pg_local``), so its folder lives under /tmp where that account can reach it. A test module
imports ``pg_server_fixture, pg_url_fixture`` and its tests ask for ``pg_url``."""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from autotune.tuning import pg_local

_counter = itertools.count()


@pytest.fixture(scope="session", name="pg_server")
def pg_server_fixture() -> Iterator[dict]:
    missing = pg_local.missing_binaries()
    if missing:
        pytest.skip(f"no PostgreSQL server programs ({', '.join(missing)}): apt-get install postgresql to run these")
    pytest.importorskip("psycopg", reason="the PostgreSQL driver psycopg is missing (pip install 'psycopg[binary]')")
    folder = Path(tempfile.mkdtemp(prefix="hstu-farm-pg-"))
    os.chmod(folder, 0o755)  # as root, the account that runs the server must reach its files
    try:
        pg_local.start(folder / "pg")
        yield {"port": pg_local._state(folder / "pg")["port"], "folder": folder / "pg"}
    finally:
        try:
            pg_local.stop(folder / "pg")
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(name="pg_url")
def pg_url_fixture(pg_server: dict) -> str:
    """The storage URL of a database of its own (created for this test)."""
    name = f"farm_test_{os.getpid()}_{next(_counter)}"
    pg_local.create_database(pg_server["port"], name)
    return pg_local.storage_url("127.0.0.1", pg_server["port"], db=name)
