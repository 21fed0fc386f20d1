"""The reconciler's lease (gateway.jobs.leader) on a real SQLite file and a real PostgreSQL server: one
holder at a time, however many race for it; a takeover only after expiry, with a new epoch; a deposed
holder's writes are refused in their own transaction; a clean release hands over at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlmodel import Session, select

from gateway.db import make_engine, migrate
from gateway.jobs.leader import Lease, LeaseLost
from gateway.models import Tenant

pytestmark = pytest.mark.service


@pytest.fixture
def engines(db_url: str) -> Iterator[list[Engine]]:
    """Four engines on one database: as four gateway processes have."""
    first = make_engine(db_url)
    migrate(first)
    out = [first] + [make_engine(db_url) for _ in range(3)]
    yield out
    for e in out:
        e.dispose()


def _row(engine: Engine) -> tuple[str, int, float]:
    with engine.connect() as c:
        holder, epoch, expires = c.execute(sa.text(
            "SELECT holder, epoch, expires_at FROM leader_leases WHERE name = 'reconciler'")).one()
    return str(holder), int(epoch), float(expires)


def test_one_holder_until_it_expires_then_a_new_epoch(engines: list[Engine]) -> None:
    a, b = Lease(engines[0], ttl_s=0.6, holder="a"), Lease(engines[1], ttl_s=0.6, holder="b")
    assert a.hold() and not b.hold()
    first = a.epoch
    for _ in range(4):                    # renewing keeps it past its ttl
        time.sleep(0.3)
        assert a.hold() and not b.hold() and a.epoch == first
    time.sleep(0.8)                       # a stopped renewing (dead): b takes it
    assert b.hold() and b.epoch == (first or 0) + 1 and _row(engines[0])[:2] == ("b", b.epoch)
    assert not a.hold() and not a.held    # a's renewal names its old epoch: refused


def test_racing_processes_elect_exactly_one(engines: list[Engine]) -> None:
    leases = [Lease(e, ttl_s=30, holder=f"p{i}") for i, e in enumerate(engines)]
    results: dict[str, bool] = {}
    barrier = threading.Barrier(len(leases))

    def race(lease: Lease) -> None:
        barrier.wait()
        results[lease.holder] = lease.hold()

    threads = [threading.Thread(target=race, args=(le,)) for le in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [h for h, won in results.items() if won]
    assert len(winners) == 1 and _row(engines[0])[0] == winners[0] and _row(engines[0])[1] == 1


def test_a_deposed_leader_commits_nothing(engines: list[Engine]) -> None:
    a, b = Lease(engines[0], ttl_s=0.5, holder="a"), Lease(engines[1], ttl_s=0.5, holder="b")
    assert a.hold()
    with Session(engines[0]) as s:
        a.guard(s)
        s.add(Tenant(name="written-by-a", unix_user="sft-a"))
        s.commit()                        # a still leads: committed, and the commit renewed the lease
        s.exec(select(Tenant)).all()      # a cycle reads, then stalls past its lease (a hung Slurm call)
        time.sleep(0.7)
        assert b.hold()
        s.add(Tenant(name="written-after-takeover", unix_user="sft-b"))
        with pytest.raises(LeaseLost):
            s.commit()
        s.rollback()
    with Session(engines[2]) as s:
        names = {t.name for t in s.exec(select(Tenant))}
    assert "written-by-a" in names and "written-after-takeover" not in names
    assert not a.held


def test_a_guarded_session_that_only_reads_writes_nothing(engines: list[Engine]) -> None:
    a = Lease(engines[0], ttl_s=30, holder="a")
    assert a.hold()
    before = _row(engines[0])
    with Session(engines[0]) as s:
        a.guard(s)
        s.exec(select(Tenant)).all()
        s.commit()
    assert _row(engines[0]) == before     # no renewal: a read-only transaction took no write lock


def test_release_hands_over_at_once_and_check_raises_for_a_standby(engines: list[Engine]) -> None:
    a, b = Lease(engines[0], ttl_s=300, holder="a"), Lease(engines[1], ttl_s=300, holder="b")
    assert a.hold()
    with pytest.raises(LeaseLost):
        b.check()
    a.release()
    assert b.hold() and not a.hold()


def test_a_check_inside_a_writing_transaction_does_not_wait_on_itself(engines: list[Engine]) -> None:
    """The reconciler checks the lease before a publication, inside the cycle's transaction that may hold
    SQLite's write lock already: the renewal runs in that transaction (a connection of its own would wait
    30 s for the lock and fail: the stall test caught it)."""
    a, b = Lease(engines[0], ttl_s=30, holder="a"), Lease(engines[1], ttl_s=30, holder="b")
    assert a.hold()
    with Session(engines[0]) as s:
        a.guard(s)
        s.add(Tenant(name="before-publication", unix_user="sft-a"))
        s.flush()                              # this transaction now holds the write lock (SQLite)
        t0 = time.monotonic()
        a.check(s)
        assert time.monotonic() - t0 < 2
        s.commit()
    a.epoch = (a.epoch or 0) + 5               # as if another process had taken it meanwhile
    with Session(engines[0]) as s, pytest.raises(LeaseLost):
        a.check(s)
    assert not a.held and not b.hold()         # b still sees a live lease: a's row was renewed, not released
