"""One reconciler at a time across every gateway sharing a database: a lease row with fencing.

The row ``leader_leases(name)`` names its holder, an epoch (the fencing token) and when the lease
expires, in unix seconds on the DATABASE's clock (one clock for every host; no host's skew counts).

- ``hold()`` renews the lease this process holds (holder and epoch unchanged prove nobody took it
  meanwhile), or takes an expired one, bumping the epoch. One UPDATE each: the database serialises
  two gateways racing for it (PostgreSQL re-checks the WHERE after the first commits; SQLite has one
  writer), so at most one wins.
- ``guard(session)`` fences a session: a transaction that wrote anything first renews the lease in
  the same transaction; when another process has taken it the commit fails with LeaseLost and
  nothing is written. A leader that stalled past its lease (a paused VM, a hung Slurm call, a network
  cut from the database) cannot commit after the takeover.
- ``check()`` renews now, before a side effect outside the database (sbatch of a lost submission,
  a publication), narrowing the window in which a deposed leader could act to one statement.
- ``release()`` on a clean stop expires the lease at once, so a peer takes over without waiting.

A standby polls ``hold()`` every ``ttl/3`` at most: a dead leader is replaced within about
``ttl + ttl/3`` seconds (settings.reconciler_lease_s).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlmodel import Session

log = logging.getLogger(__name__)


class LeaseLost(Exception):
    """Another process holds the lease now: this one must stop acting as the leader."""


def now_sql(dialect: str) -> str:
    """SQL for the database's current time in unix seconds (fractional)."""
    if dialect == "sqlite":
        return "((julianday('now') - 2440587.5) * 86400.0)"
    return "extract(epoch from clock_timestamp())"


class Lease:
    """This process's claim on the lease ``name`` (see the module docstring)."""

    def __init__(self, engine: Engine, name: str = "reconciler", ttl_s: float = 15.0, holder: str | None = None):
        self.engine, self.name, self.ttl_s = engine, name, float(ttl_s)
        self.holder = holder or f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self.epoch: int | None = None            # set while this process holds the lease
        self.takeovers = 0                       # leases taken (not renewed) since start
        now = now_sql(engine.dialect.name)
        self._renew = sa.text(f"UPDATE leader_leases SET expires_at = {now} + :ttl "
                              "WHERE name = :name AND holder = :holder AND epoch = :epoch")
        self._take = sa.text(f"UPDATE leader_leases SET holder = :holder, epoch = epoch + 1, "
                             f"expires_at = {now} + :ttl WHERE name = :name AND expires_at < {now}")
        self._read = sa.text("SELECT holder, epoch FROM leader_leases WHERE name = :name")
        self._seed = sa.text("INSERT INTO leader_leases (name, holder, epoch, expires_at) "
                             "SELECT :name, '', 0, 0 WHERE NOT EXISTS "
                             "(SELECT 1 FROM leader_leases WHERE name = :name)")
        self._lock = threading.Lock()

    @property
    def held(self) -> bool:
        """Whether this process held the lease at its last renewal."""
        return self.epoch is not None

    def _params(self) -> dict[str, Any]:
        return {"name": self.name, "holder": self.holder, "epoch": self.epoch, "ttl": self.ttl_s}

    def hold(self) -> bool:
        """Renew the lease, or take it when it expired; whether this process holds it now."""
        with self._lock, self.engine.begin() as conn:
            if self.epoch is not None:
                if conn.execute(self._renew, self._params()).rowcount == 1:
                    return True
                log.warning("lost the %s lease (epoch %d) to another gateway: standing by", self.name, self.epoch)
                self.epoch = None
            if conn.execute(self._take, self._params()).rowcount != 1:
                if conn.execute(self._read, {"name": self.name}).first() is None:
                    conn.execute(self._seed, {"name": self.name})    # a lease no migration seeded
                return False
            holder, epoch = conn.execute(self._read, {"name": self.name}).one()
            if holder != self.holder:        # cannot happen: the UPDATE named us; be safe
                return False
            self.epoch, self.takeovers = int(epoch), self.takeovers + 1
            log.warning("took the %s lease (epoch %d) as %s", self.name, self.epoch, self.holder)
            return True

    def check(self, session: Session | None = None) -> None:
        """Renew now; LeaseLost when another process holds the lease. With ``session``, the renewal is a
        statement of that session's transaction (it may already hold SQLite's one write lock: a
        connection of its own would wait on it), and commits or rolls back with it."""
        if session is None:
            if not self.hold() or self.epoch is None:
                raise LeaseLost(f"the {self.name} lease is held by another gateway")
            return
        if self.epoch is None or session.connection().execute(self._renew, self._params()).rowcount != 1:
            self.epoch = None
            raise LeaseLost(f"the {self.name} lease was taken by another gateway")

    def release(self) -> None:
        """Give the lease up at once (a clean stop); nothing when this process does not hold it."""
        with self._lock:
            if self.epoch is None:
                return
            with self.engine.begin() as conn:
                conn.execute(sa.text("UPDATE leader_leases SET expires_at = 0 "
                                     "WHERE name = :name AND holder = :holder AND epoch = :epoch"), self._params())
            self.epoch = None

    def guard(self, session: Session) -> None:
        """Fence ``session``: each of its transactions that wrote renews the lease in that transaction
        before committing, and fails with LeaseLost (nothing written) if another process took it."""
        wrote = [False]

        def mark(*_: Any) -> None:
            wrote[0] = True

        def on_execute(state: Any) -> None:
            if state.is_insert or state.is_update or state.is_delete:
                wrote[0] = True

        def before_commit(s: Session) -> None:
            if not (wrote[0] or s.new or s.dirty or s.deleted):
                return
            if self.epoch is None or s.connection().execute(self._renew, self._params()).rowcount != 1:
                self.epoch = None
                raise LeaseLost(f"the {self.name} lease was taken by another gateway: this transaction "
                                "is not committed")

        def reset(*_: Any) -> None:
            wrote[0] = False

        event.listen(session, "after_flush", mark)
        event.listen(session, "do_orm_execute", on_execute)
        event.listen(session, "before_commit", before_commit)
        event.listen(session, "after_commit", reset)
        event.listen(session, "after_rollback", reset)
