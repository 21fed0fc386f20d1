"""Database engine and schema: SQLite (WAL) by default, PostgreSQL by URL.

The schema is created and upgraded only by Alembic migrations
(gateway/migrations); ``migrate`` runs them to head.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session

MIGRATIONS = Path(__file__).parent / "migrations"
_decode = msgspec.json.decode
SQLITE_POOL = 40


def json_loads(text: str | bytes) -> Any:
    """JSON columns' decoder: msgspec (several times json.loads' speed on the API's hot reads), and
    json.loads for what msgspec refuses but json.loads reads (NaN, lone surrogates, huge integers)."""
    try:
        return _decode(text)
    except msgspec.DecodeError:
        return json.loads(text)


def make_engine(url: str) -> Engine:
    """An engine for ``url``; SQLite gets WAL, foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        path = url.split("///", 1)[-1]
        if path and path != ":memory:":
            _private_db_file(Path(path))
        # A pool as large as the requests one process serves at once (anyio's 40 worker threads): a
        # connection opened past the pool is closed on return, and opening one costs its PRAGMAs.
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                                  pool_size=SQLITE_POOL, max_overflow=8, json_deserializer=json_loads)

        @sa.event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url.removeprefix("postgresql://")
    return sa.create_engine(url, pool_pre_ping=True, pool_size=20, max_overflow=10, json_deserializer=json_loads)


SIDE_FILES = ("-wal", "-shm", "-journal")      # SQLite opens these by name beside the database


class UnsafeDatabaseFile(ValueError):
    """The database path or one of its side files is a link or not a regular file."""


def _refuse_unsafe(path: Path, p: Path, what: str) -> UnsafeDatabaseFile:
    return UnsafeDatabaseFile(
        f"refusing to open the database {path}: {p} is {what}, not a file of the database. Whoever may "
        f"write {path.parent} could have planted it to point this process at another file: remove it "
        "and find out who made it (a database elsewhere is named by its real path in SFT_DATABASE_URL)")


def _private_db_file(path: Path) -> None:
    """All tenants' metadata and the audit log live here: the database file is created 0600 in a
    0700 directory; a file of ours (database, WAL, SHM, journal) that others can read is tightened;
    and root (the admin CLI, the demo, the tests) working on a database in the service user's state
    dir leaves its files to that dir's owner (SQLite, as root, gives WAL/SHM files it creates the
    database file's owner). Everything goes through ``O_NOFOLLOW`` fds, and a link or anything but a
    regular file at the database's path or a side file's raises UnsafeDatabaseFile before SQLite
    opens any of them (it would follow a link at the database's path, as root too): the state dir's
    owner cannot point root at another file."""
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    parent = os.stat(path.parent)
    for p in (path, *(path.with_name(path.name + s) for s in SIDE_FILES)):
        create = p == path
        try:
            fd = os.open(p, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                         | (os.O_CREAT if create else 0), 0o600)
        except FileNotFoundError:
            continue        # a side file SQLite has not made (or a missing directory: SQLite says so)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise _refuse_unsafe(path, p, "a symbolic link") from None
            try:
                regular = stat.S_ISREG(os.lstat(p).st_mode)
            except OSError:
                continue
            if not regular:
                raise _refuse_unsafe(path, p, "not a regular file") from None
            continue        # not ours to open (EACCES): SQLite reports it with the path
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _refuse_unsafe(path, p, "not a regular file")
            if st.st_nlink != 1:
                raise _refuse_unsafe(path, p, f"a file with {st.st_nlink} hard links")
            if st.st_uid == os.geteuid() and st.st_mode & 0o077:
                os.fchmod(fd, 0o600)
            if os.geteuid() == 0 and st.st_uid == 0 and parent.st_uid != 0:
                os.fchown(fd, parent.st_uid, parent.st_gid)
        finally:
            os.close(fd)


def migrate(engine: Engine) -> None:
    """Upgrade the schema to the newest migration (idempotent)."""
    from alembic import command
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "head")


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """A session that commits on success and rolls back on error."""
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def secure_deletes(conn: sa.Connection) -> None:
    """On SQLite, make this connection zero what it deletes (``PRAGMA secure_delete``) instead of only
    unlinking it from the b-tree; on other databases nothing (see ``erase_freed``)."""
    if conn.dialect.name == "sqlite":
        conn.exec_driver_sql("PRAGMA secure_delete=ON")


def erase_freed(engine: Engine, tables: Iterable[str] = (), *, tries: int = 50, pause_s: float = 0.2) -> str:
    """After rows were deleted, leave none of their bytes in the database's files where the database lets
    us, and return one line saying what was done. SQLite: VACUUM (the file rebuilt from the live rows, its
    free pages gone), then ``wal_checkpoint(TRUNCATE)`` (the WAL, which still held the old pages, copied
    back and cut to 0 bytes), retried while another connection reads (``tries`` x ``pause_s``); the line
    says so when a reader kept it busy. PostgreSQL: VACUUM of ``tables`` (dead rows' space marked reusable:
    not overwritten, and the server's WAL, replicas and backups keep what they hold)."""
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if conn.dialect.name != "sqlite":
            names = sorted(set(tables))
            for name in names:
                conn.exec_driver_sql(f'VACUUM "{name}"')
            return f"VACUUM of {len(names)} tables ({', '.join(names)}): space marked free, not overwritten"
        conn.exec_driver_sql("PRAGMA secure_delete=ON")
        conn.exec_driver_sql("VACUUM")
        busy = 1
        for _ in range(max(1, tries)):
            busy = conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)").one()[0]
            if not busy:
                break
            time.sleep(pause_s)
        if busy:
            return ("secure_delete, VACUUM; the WAL could NOT be truncated (another connection kept reading): "
                    "stop the gateways and run the deletion's last step again (`finetune admin tenant delete "
                    "NAME --yes` on a deleted tenant only scrubs)")
        return "secure_delete, VACUUM, wal_checkpoint(TRUNCATE): no freed page or WAL frame kept"
