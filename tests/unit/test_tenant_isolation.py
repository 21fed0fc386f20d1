"""One tenant cannot stall the others (issue 28), without Slurm: the reconciler's per-tenant storage
calls run side by side under one bounded wait (``jobs.tenantcalls``), and the broker's parent kills a
request child that is stopped or overruns its deadline (``storage.broker.Children``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gateway.config import Settings
from gateway.db import make_engine, migrate
from gateway.errors import StorageFailed
from gateway.jobs import tenantcalls
from gateway.jobs.reconciler import Reconciler
from gateway.jobs.tenantcalls import TenantCalls
from gateway.models import FineTuningJob, Tenant
from gateway.slurm import SlurmClient
from gateway.storage import SUBMIT_MARGIN_S, VERB_TIMEOUT_S
from gateway.storage import Storage as GatewayStorage
from gateway.storage.broker import REPLY_GRACE_S, REPORT, Children, recv_msg, send_msg
from tests.slurmfake import FakeSlurm

WAIT_S = 2.0      # generous: the suite runs on 2 busy cores; a healthy call answers in ms


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ TenantCalls
def test_a_hanging_tenant_costs_one_bounded_wait_then_nothing() -> None:
    release = threading.Event()
    calls: Counter[str] = Counter()

    def call(tenant: str) -> Any:
        def run() -> str:
            calls[tenant] += 1
            if tenant == "a":
                release.wait(10)
            return f"{tenant}-answer"
        return run

    tc = TenantCalls()
    t0 = time.monotonic()
    first = tc.run({"a": call("a"), "b": call("b")}, WAIT_S)
    assert time.monotonic() - t0 < WAIT_S + 1.5
    assert first.results == {"b": "b-answer"} and first.late == ["a"] and tc.busy("a")
    for _ in range(5):                     # a's call still runs: a is not called again, nobody waits for it
        t0 = time.monotonic()
        again = tc.run({"a": call("a"), "b": call("b")}, WAIT_S)
        assert time.monotonic() - t0 < WAIT_S / 2     # no wait for the stalled tenant
        assert again.results == {"b": "b-answer"} and again.skipped == ["a"]
    assert calls == {"a": 1, "b": 6}
    release.set()
    _until(lambda: not tc.busy("a"))
    later = tc.run({"a": call("a"), "b": call("b")}, WAIT_S)    # answered late, not failed: no pause left
    assert later.results == {"a": "a-answer", "b": "b-answer"}


def test_a_failing_tenant_pauses_doubling_and_a_success_halves_the_pause() -> None:
    clock, fail = Clock(), [True]

    def flaky() -> int:
        if fail[0]:
            raise StorageFailed("storage broker: the storage broker closed the connection")
        return 1

    tc = TenantCalls(clock=clock)
    pauses = []
    for k in range(4):
        rnd = tc.run({"a": flaky}, WAIT_S)
        assert list(rnd.failed) == ["a"] and rnd.repeated == ({"a"} if k else set())   # logged once
        assert tc.run({"a": flaky}, WAIT_S).skipped == ["a"]      # pausing: not called
        pauses.append(tc._pause["a"][1])
        clock.now += pauses[-1] + 0.01
    assert pauses == [1.0, 2.0, 4.0, 8.0]
    fail[0] = False
    assert tc.run({"a": flaky}, WAIT_S).results == {"a": 1}
    assert tc._pause["a"][1] == 4.0                                # halved, not forgotten
    for _ in range(3):
        tc.run({"a": flaky}, WAIT_S)
    assert "a" not in tc._pause
    assert tenantcalls.PAUSE_MAX_S >= 8.0


def test_calls_queued_behind_a_full_pool_are_skipped_not_blamed() -> None:
    release = threading.Event()
    tc = TenantCalls(workers=1)
    rnd = tc.run({"a": lambda: release.wait(10), "b": lambda: 2}, WAIT_S)
    assert rnd.late == ["a"] and rnd.skipped == ["b"] and not tc.busy("b") and "b" not in tc._pause
    release.set()
    _until(lambda: not tc.busy("a"))
    assert tc.run({"b": lambda: 2}, WAIT_S).results == {"b": 2}


# -------------------------------------------------------------- the reconciler
class Storage:
    """A storage double at the ``Storage.tenant`` level: tenant "a"'s calls hang until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: Counter[tuple[str, str]] = Counter()

    def tenant(self, name: str) -> Any:
        outer = self

        class TenantDouble:
            def read_events(self, offsets: dict[str, int]) -> dict[str, bytes]:
                outer._enter(name, "read_events")
                return {job: f"{name}@{off}".encode() for job, off in offsets.items()}

            def sweep(self, min_age_s: float) -> int:
                outer._enter(name, "sweep")
                return 0

        return TenantDouble()

    def _enter(self, tenant: str, verb: str) -> None:
        self.calls[tenant, verb] += 1
        if tenant == "a":
            self.release.wait(10)


@pytest.fixture
def rec(tmp_path: Path) -> Iterator[tuple[Reconciler, Storage]]:
    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        broker_cycle_timeout_s=WAIT_S)
    engine = make_engine(settings.database_url)
    migrate(engine)
    r = Reconciler(engine, settings, SlurmClient(FakeSlurm()))
    store = Storage()
    r.storage = store  # type: ignore[assignment]
    yield r, store
    store.release.set()


def test_a_stalled_tenant_never_stalls_another_tenants_events(rec: tuple[Reconciler, Storage]) -> None:
    r, store = rec
    tenants: dict[int | None, Tenant] = {1: Tenant(id=1, name="a", unix_user="sft-a"),
                                          2: Tenant(id=2, name="b", unix_user="sft-b")}
    jobs = [FineTuningJob(id="ftjob-a", tenant_id=1, training_file="f", model="m", events_offset=7),
            FineTuningJob(id="ftjob-b", tenant_id=2, training_file="f", model="m", events_offset=3)]
    t0 = time.monotonic()
    assert r._read_events(jobs, tenants) == {"ftjob-b": b"b@3"}    # a's jobs wait for a later cycle
    assert time.monotonic() - t0 < WAIT_S + 1.5
    assert r.stats.storage_missed == {("read_events", "late"): 1}
    for _ in range(10):                                            # later cycles: no wait, no new call to a
        t0 = time.monotonic()
        assert r._read_events(jobs, tenants) == {"ftjob-b": b"b@3"}
        assert time.monotonic() - t0 < WAIT_S / 2     # no wait for the stalled tenant
    assert store.calls["a", "read_events"] == 1 and store.calls["b", "read_events"] == 11
    assert r.stats.storage_missed == {("read_events", "late"): 1, ("read_events", "skipped"): 10}
    store.release.set()
    _until(lambda: not r._tenant_calls.busy("a"))
    # nothing lost: a is read again from the offset its jobs still have
    assert r._read_events(jobs, tenants) == {"ftjob-a": b"a@7", "ftjob-b": b"b@3"}


def test_the_sweep_is_bounded_the_same_way(rec: tuple[Reconciler, Storage], tmp_path: Path) -> None:
    from sqlmodel import Session

    r, store = rec
    with Session(r.engine) as s:
        s.add(Tenant(id=1, name="a", unix_user="sft-a"))
        s.add(Tenant(id=2, name="b", unix_user="sft-b"))
        s.commit()
        t0 = time.monotonic()
        r._sweep_artifacts(s)
        assert time.monotonic() - t0 < WAIT_S + 1.5
    assert store.calls["b", "sweep"] == 1 and r.stats.storage_missed == {("sweep", "late"): 1}


# ------------------------------------------------------------- the gateway's side of a broker call
@pytest.fixture
def broker(tmp_path: Path) -> Iterator[tuple[GatewayStorage, list[dict[str, Any]]]]:
    """A Storage whose broker (a fake on a unix socket) records each request; it answers ``submit``
    at once and never answers anything else."""
    path, seen = tmp_path / "broker.sock", []
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(8)
    done = threading.Event()

    def one(conn: socket.socket) -> None:
        req, _fds, _ = recv_msg(conn)
        seen.append(req)
        if req.get("verb") == "submit":
            send_msg(conn, {"ok": True, "result": {"returncode": 0, "stdout": "7", "stderr": ""}})
        else:
            done.wait(5)
        conn.close()

    def serve() -> None:
        while not done.is_set():
            threading.Thread(target=one, args=(srv.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    store = GatewayStorage(tmp_path, path)
    store._users["acme"] = (time.monotonic(), True)     # as if sft-acme existed: through the broker
    yield store, seen
    done.set()
    srv.close()


def test_a_broker_call_gives_up_at_its_timeout_which_the_broker_enforces(broker: Any) -> None:
    store, seen = broker
    t0 = time.monotonic()
    with pytest.raises(StorageFailed, match="no answer to read_events within"):
        store.tenant("acme").read_events({"ftjob-0123456789abcdef01234567": 0}, timeout=0.3)
    assert time.monotonic() - t0 < 1.5
    assert seen[-1]["verb"] == "read_events" and seen[-1]["deadline_s"] == 0.3   # the child's deadline
    assert store.tenant("acme").submit("#!/bin/sh\n", timeout=61) == (0, "7", "")
    assert seen[-1]["deadline_s"] == 61 + SUBMIT_MARGIN_S          # sbatch's own timeout, and a margin
    assert VERB_TIMEOUT_S["publish_build"] >= 10 * VERB_TIMEOUT_S["read_events"]   # a big adapter's copy


# ------------------------------------------------------------- broker children
def test_the_broker_kills_a_stopped_child_and_one_past_its_deadline(capsys: pytest.CaptureFixture[str]) -> None:
    stopped = subprocess.Popen(["sleep", "60"])
    overdue = subprocess.Popen(["sleep", "60"])
    healthy = subprocess.Popen(["sleep", "60"])
    kids = Children()
    try:
        for p in (stopped, overdue, healthy):
            kids.add(p.pid)
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.write(w, REPORT.pack(overdue.pid, 1.0) + REPORT.pack(healthy.pid, 30.0))
        kids.read_reports(r)
        assert 30 < kids.deadline[healthy.pid] - time.monotonic() <= 30 + REPLY_GRACE_S
        kids.deadline[overdue.pid] = time.monotonic() - 1      # as if its 1 s (+ grace) had passed
        os.kill(stopped.pid, signal.SIGSTOP)                   # the kernel tells the parent (waitpid WUNTRACED)
        def only_healthy_left() -> bool:
            kids.police()                                      # kills, then reaps (never the kernel)
            return set(kids.deadline) == {healthy.pid}

        _until(only_healthy_left)
        said = capsys.readouterr().out
        assert f"killed request child {stopped.pid}: it was stopped" in said
        assert f"killed request child {overdue.pid}: it overran its deadline" in said
        assert healthy.pid not in kids.killed and kids.wait_s() is not None
        assert not Path(f"/proc/{stopped.pid}").exists() and not Path(f"/proc/{overdue.pid}").exists()
        assert Path(f"/proc/{healthy.pid}").exists()
        os.close(r)
        os.close(w)
    finally:
        for p in (stopped, overdue, healthy):
            if Path(f"/proc/{p.pid}").exists():
                p.kill()
                p.wait()


def _until(ok: Any, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_a_healthy_tenants_call_never_waits_behind_a_stalled_one() -> None:
    """Regression: calls once shared a queue whose idle-thread count could be stale, so on a busy
    machine a healthy tenant's call could sit behind a stalled tenant's until that one ended."""
    release = threading.Event()
    try:
        for _ in range(200):
            tc = TenantCalls()
            hung = tc._submit("a", lambda: release.wait(30))
            assert tc._submit("b", lambda: "b").result(timeout=5) == "b" and not hung.done()
    finally:
        release.set()
