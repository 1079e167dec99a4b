"""``autotune.tuning.pg_local``: the URL it prints opens the server it started, whatever the password holds."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import sqlalchemy

from autotune.tuning import pg_local
from autotune.tuning.study_storage import rdb_url


@pytest.mark.parametrize("password", ["p@ss", "a%41b"])
def test_the_url_names_the_password_as_given(password):
    """A password holding '@' cut the URL at it (host 'ss@hostA'), and '%41' was read back as 'A'."""
    url = pg_local.storage_url("hostA", 5432, password)
    parsed = sqlalchemy.engine.make_url(url)
    assert (parsed.password, parsed.host, parsed.port, parsed.database) == (password, "hostA", 5432, "autotune")


def test_an_empty_password_is_refused(tmp_path):
    """``--password "$PW"`` with PW unset started a server no remote host could log in to, saying nothing."""
    with pytest.raises(pg_local.PgError, match="--password is empty"):
        pg_local.start(tmp_path / "pg", listen="*", password="")
    assert not (tmp_path / "pg").exists()


def test_a_file_named_as_the_server_folder_is_refused(tmp_path, capsys):
    (tmp_path / "pgdata").write_text("notes")
    assert pg_local.main(["start", str(tmp_path / "pgdata")]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert (tmp_path / "pgdata").read_text() == "notes"


def test_a_server_with_a_password_of_url_characters_is_reachable_by_its_url():
    if pg_local.missing_binaries():
        pytest.skip("no PostgreSQL server programs: apt-get install postgresql to run this")
    pytest.importorskip("psycopg", reason="the PostgreSQL driver psycopg is missing")
    folder = Path(tempfile.mkdtemp(prefix="hstu-pg-pw-"))
    os.chmod(folder, 0o755)  # as root, the account that runs the server must reach its files
    try:
        url = pg_local.start(folder / "pg", password="p@ss/w%rd")
        engine = sqlalchemy.create_engine(rdb_url(url))
        try:
            with engine.connect() as conn:
                assert conn.execute(sqlalchemy.text("SELECT 1")).scalar() == 1
        finally:
            engine.dispose()
    finally:
        try:
            pg_local.stop(folder / "pg")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
