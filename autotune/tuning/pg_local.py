"""A local PostgreSQL server in a folder, for the tuning farm's Optuna storage (and its tests).

    python -m autotune.tuning.pg_local start pgdata              # initdb on first use, start, print the URL
    python -m autotune.tuning.pg_local start pgdata --listen '*' --password S3cret   # reachable from other hosts
    python -m autotune.tuning.pg_local url pgdata | stop pgdata | status pgdata

Needs the server binaries (``initdb``, ``pg_ctl``, ``postgres``: Debian/Ubuntu ``apt-get install
postgresql``, macOS ``brew install postgresql``, conda ``conda install -c conda-forge postgresql``, or
``pip install pgserver``, whose wheel carries them); ``server_bin`` says where they are looked up.
PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` (else ``nobody``)
account, which then owns the folder.
Stdlib only (psycopg is needed only to create the database).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import importlib.util
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

DB = "autotune"
USER = "autotune"
STATE = "autotune-pg.json"  # beside the data directory: port, listen address, password, URL


class PgError(RuntimeError):
    """The local server could not be created, started or reached; the message says what to do."""


def server_bin(name: str) -> str | None:
    """Path of a PostgreSQL server program (``initdb``, ``pg_ctl``); None if absent. Looked up in
    ``AUTOTUNE_PG_BIN``, on PATH, in Debian's /usr/lib/postgresql/*/bin (newest first), then in the
    ``pgserver`` wheel (``pip install pgserver`` carries the server programs: no root, no apt)."""
    dirs = [os.environ["AUTOTUNE_PG_BIN"]] if os.environ.get("AUTOTUNE_PG_BIN") else []
    found = shutil.which(name, path=dirs[0]) if dirs else None
    found = found or shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=_version_key, reverse=True)
    spec = importlib.util.find_spec("pgserver")
    if spec is not None and spec.origin:
        candidates.append(str(Path(spec.origin).parent / "pginstall" / "bin" / name))
    for path in candidates:
        if os.access(path, os.X_OK):
            return path
    return None


def _version_key(path: str) -> tuple:
    part = Path(path).parents[1].name
    return tuple(int(p) for p in part.split(".") if p.isdigit())


def missing_binaries() -> list[str]:
    """The server programs that are not installed (empty when a local server can be started)."""
    return [n for n in ("initdb", "pg_ctl", "postgres") if server_bin(n) is None]


def free_port() -> int:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_as() -> str | None:
    """The account the server runs under: None (this one) unless we are root, which PostgreSQL refuses."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        with contextlib.suppress(KeyError):
            pwd.getpwnam(name)
            return name
    raise PgError("running as root and no 'postgres' or 'nobody' account exists to run the server")


def _cmd(args: list[str], user: str | None) -> list[str]:
    """``args`` run as ``user`` (runuser, else setpriv: both in util-linux, one may be missing)."""
    if not user:
        return args
    if shutil.which("runuser"):
        return ["runuser", "-u", user, "--", *args]
    entry = pwd.getpwnam(user)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--clear-groups", *args]


def _check(args: list[str], user: str | None, what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(_cmd(args, user), capture_output=True, text=True)
    if proc.returncode != 0:
        raise PgError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout).strip()[-1500:]}")
    return proc


def _state(folder: Path) -> dict:
    path = folder / STATE
    return json.loads(path.read_text()) if path.exists() else {}


def storage_url(host: str, port: int, password: str | None = None, db: str = DB) -> str:
    """The Optuna storage URL of the server (``autotune run --storage URL``); the password percent-encoded, so one
    holding '@', '%' or '/' names the same password in the URL."""
    from urllib.parse import quote

    auth = f"{USER}:{quote(password, safe='')}" if password else USER
    return f"postgresql://{auth}@{host}:{port}/{db}"


def is_running(folder: str | Path) -> bool:
    folder = Path(folder).resolve()
    pg_ctl = server_bin("pg_ctl")
    if pg_ctl is None or not (folder / "data" / "PG_VERSION").exists():
        return False
    proc = subprocess.run(_cmd([pg_ctl, "-D", str(folder / "data"), "status"], _run_as()), capture_output=True)
    return proc.returncode == 0


def start(
    folder: str | Path,
    port: int | None = None,
    listen: str = "127.0.0.1",
    password: str | None = None,
    host: str | None = None,
) -> str:
    """Create (first time) and start the server whose files live in ``folder``; returns its storage URL.

    Idempotent: a running server's URL is returned as it is. ``listen`` other than loopback opens it to
    other hosts (password authentication then, scram-sha-256; trust on loopback only).
    """
    if password is not None and not password:  # `--password "$PW"` with PW unset: no password, no remote login
        raise PgError("--password is empty; give the password remote hosts log in with")
    if Path(folder).exists() and not Path(folder).is_dir():  # it was a FileExistsError traceback from mkdir
        raise PgError(f"{folder} exists and is not a folder; name a folder for the server's files")
    missing = missing_binaries()
    if missing:
        raise PgError(
            f"PostgreSQL server programs not found: {', '.join(missing)} (install e.g. 'apt-get install postgresql'; "
            "they are looked up on PATH and in /usr/lib/postgresql/*/bin)"
        )
    folder = Path(folder).resolve()
    user = _run_as()
    data = folder / "data"
    state = _state(folder)
    if is_running(folder) and state.get("url"):
        return state["url"]
    folder.mkdir(parents=True, exist_ok=True)
    if user:
        shutil.chown(folder, user)
        if subprocess.run(_cmd(["test", "-w", str(folder)], user)).returncode != 0:
            raise PgError(
                f"the '{user}' account that runs the server (root may not) cannot reach {folder}: a parent folder "
                "is private; pick a folder it can reach (e.g. under /tmp) or chmod o+x its parents"
            )
    if not (data / "PG_VERSION").exists():
        _init(folder, data, user, password)
    port = port or state.get("port") or free_port()
    if listen != "127.0.0.1" and password is None:
        password = state.get("password")
        if password is None:
            raise PgError("--listen beyond loopback needs --password on the first start (remote logins use it)")
    opts = f"-p {port} -c listen_addresses='{listen}' -c unix_socket_directories='' -c max_connections=200"
    log = folder / "server.log"
    pg_ctl = server_bin("pg_ctl")
    _check([pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "60", "-o", opts, "start"], user, "pg_ctl start")
    url_host = host or ("127.0.0.1" if listen in ("127.0.0.1", "localhost") else socket.gethostname())
    url = storage_url(url_host, port, password)
    create_database(port, DB, password)
    (folder / STATE).write_text(json.dumps({"port": port, "listen": listen, "password": password, "url": url}))
    return url


def _init(folder: Path, data: Path, user: str | None, password: str | None) -> None:
    args = [server_bin("initdb"), "-D", str(data), "-U", USER, "-E", "UTF8", "--no-instructions", "--auth-local=trust"]
    if password:
        pwfile = folder / ".pwfile"
        pwfile.write_text(password + "\n")
        if user:
            shutil.chown(pwfile, user)
        args += ["--pwfile", str(pwfile), "--auth-host=scram-sha-256"]
    else:
        args += ["--auth-host=trust"]
    try:
        _check(args, user, "initdb")
    finally:
        (folder / ".pwfile").unlink(missing_ok=True)
    if password:
        with open(data / "pg_hba.conf", "a") as f:
            f.write("host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
        if user:
            shutil.chown(data / "pg_hba.conf", user)


def create_database(port: int, name: str = DB, password: str | None = None) -> None:
    """CREATE DATABASE ``name`` unless it exists (through psycopg, so no client programs are needed)."""
    try:
        import psycopg
    except ImportError as e:
        raise PgError("psycopg is not installed: pip install 'psycopg[binary]' (part of the dev extras)") from e
    deadline = time.time() + 30
    while True:
        try:
            conn = psycopg.connect(
                host="127.0.0.1", port=port, user=USER, password=password, dbname="postgres", autocommit=True
            )
            break
        except psycopg.OperationalError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    with conn:
        if conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is None:
            conn.execute(f'CREATE DATABASE "{name}"')


def stop(folder: str | Path) -> None:
    folder = Path(folder).resolve()
    if is_running(folder):
        _check([server_bin("pg_ctl"), "-D", str(folder / "data"), "-m", "fast", "-w", "stop"], _run_as(), "pg_ctl stop")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pg_local", description="A local PostgreSQL for the tuning farm's storage.")
    p.add_argument("action", choices=("start", "stop", "url", "status"))
    p.add_argument("folder", help="where the server's files live (created on first start)")
    p.add_argument("--port", type=int, default=None, help="TCP port (default: a free one, then kept)")
    p.add_argument("--listen", default="127.0.0.1", help="listen address; '*' lets other hosts join (needs --password)")
    p.add_argument("--password", default=None, help="password of the 'autotune' role for remote logins")
    p.add_argument("--host", default=None, help="host name to print in the URL (default: this host's name)")
    args = p.parse_args(argv)
    try:
        if args.action == "start":
            print(start(args.folder, args.port, args.listen, args.password, args.host))
        elif args.action == "stop":
            stop(args.folder)
        elif args.action == "url":
            url = _state(Path(args.folder).resolve()).get("url")
            if not url:
                raise PgError(f"no server was started in {args.folder}")
            print(url)
        else:
            running = is_running(args.folder)
            print("running" if running else "stopped")
            return 0 if running else 1
    except PgError as e:
        print(f"pg_local: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
