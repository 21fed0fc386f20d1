"""One tenant cannot stall the others (issue 28), against the real gateway, broker and cluster.

The attacker, as its own unix user, SIGSTOPs every storage broker child that runs as it (each
request of its tenant: its jobs' events reads, its sweep). Before the fix the reconciler waited
up to 300 s on such a child, and every tenant's jobs with it. Now the broker kills a stopped
child at once, the cycle waits a bounded time for a tenant that does not answer, and a tenant
that failed pauses: the victim's job keeps progressing and the cycle time stays within 2x of
the cycle time without the attack (``storage.broker.Children``, ``jobs.tenantcalls``)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session

from gateway.access.tokens import create_token
from gateway.config import Settings
from gateway.models import Role
from gateway.storage import VERB_TIMEOUT_S
from gateway.storage.broker import MAX_DEADLINE_S, REPLY_GRACE_S
from gateway.storage.launch import running_code
from tests.hostile.conftest import ATTACKER, VICTIM
from tests.slurm.livegateway import LiveGateway, chat_file, terminal

pytestmark = pytest.mark.hostile
HP = {"n_epochs": 3, "batch_size_tokens": 256, "max_seq_len": 256, "checkpoint_every_steps": 1000,
      "learning_rate_multiplier": 5}
WINDOW_S = 25.0
BROKER_LOG = Path("/var/log/slurm-finetune/broker.log")

# The attacker's loop, run as the attacker. /proc hides the broker's children from it (hidepid, and
# they are not dumpable), but a signal reaches any process of its uid: each new pid is probed with
# signal 0 (a broker child is root until it drops to the tenant); one that answers and that it
# cannot see in /proc (not an ordinary process of its own) is a broker child: stop it, print it.
ATTACK = r"""
import os, signal, sys, time
end, stop = time.monotonic() + float(sys.argv[1]), sys.argv[2] == "stop"
def newest():
    with open("/proc/loadavg") as f:
        return int(f.read().split()[4])
last, watch = newest(), {}
while time.monotonic() < end:
    top, now = newest(), time.monotonic()
    for pid in range(last + 1, top + 1) if top >= last else ():
        watch[pid] = now + 2
    last = top
    for pid, until in list(watch.items()):
        try:
            os.kill(pid, 0)
        except PermissionError:          # not ours, or not yet
            if now > until:
                del watch[pid]
            continue
        except ProcessLookupError:
            del watch[pid]
            continue
        del watch[pid]
        if os.path.exists(f"/proc/{pid}"):
            continue
        try:
            stop and os.kill(pid, signal.SIGSTOP)
            print(pid, time.monotonic(), flush=True)
        except OSError:
            pass
    time.sleep(0.001)
"""


def _attacker(mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(["runuser", "-u", f"sft-{ATTACKER}", "--", sys.executable, "-c", ATTACK,
                             str(WINDOW_S + 2), mode], cwd="/", stdout=subprocess.PIPE, text=True)


def _metrics(gw: LiveGateway, token: str) -> dict[str, float]:
    """The reconciler's counters from /metrics: cycles (every outcome), seconds, and the storage counts."""
    r = httpx.get(gw.url + "/metrics", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert r.status_code == 200, r.text
    out: dict[str, float] = {"cycles": 0.0}
    for line in r.text.splitlines():
        if line.startswith("sft_reconcile_cycles_total"):
            out["cycles"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith(("sft_reconcile_seconds_total", "sft_reconcile_storage_")):
            out[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _count(m: dict[str, float], outcome: str) -> float:
    return sum(v for k, v in m.items() if k.startswith("sft_reconcile_storage_missed") and f'"{outcome}"' in k)


def _mean_cycle(before: dict[str, float], after: dict[str, float]) -> float:
    n = after["cycles"] - before["cycles"]
    assert n >= 5, f"only {n} reconcile cycles in the window"
    return (after["sft_reconcile_seconds_total"] - before["sft_reconcile_seconds_total"]) / n


def _step(gw: LiveGateway, tenant: str, job_id: str) -> int:
    j = gw.job(tenant, job_id)
    assert j["status"] == "running", j
    return int((j.get("progress") or {}).get("step") or 0)


class ChildWatch(threading.Thread):
    """Root's view of the children the attacker stopped (its printed pid and time): when each was gone."""

    def __init__(self, attack: subprocess.Popen[str]):
        super().__init__(daemon=True)
        self.attack = attack
        self.stopped: dict[int, float] = {}
        self.gone: dict[int, float] = {}
        self._lock = threading.Lock()

    def run(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        while self.attack.poll() is None or self._pending():
            for pid in self._pending():
                if _state(pid) in (None, "Z"):
                    self.gone[pid] = time.monotonic()
            time.sleep(0.002)

    def _read(self) -> None:
        assert self.attack.stdout is not None
        for line in self.attack.stdout:
            pid, at = line.split()
            with self._lock:
                self.stopped[int(pid)] = float(at)

    def _pending(self) -> list[int]:
        with self._lock:
            return [p for p in self.stopped if p not in self.gone]


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


@pytest.fixture
def jobs(gw: LiveGateway, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A long job of each tenant, both running (the attacker's, then the victim's); cancelled after."""
    ids: dict[str, str] = {}
    for tenant, seed in ((ATTACKER, 281), (VICTIM, 282)):
        fid = gw.upload(tenant, chat_file(tmp_path / f"{tenant}.jsonl", 1500, seed=seed))
        ids[tenant] = gw.create(tenant, fid, HP)["id"]
    try:
        for tenant, jid in ids.items():
            j = gw.wait(tenant, jid, lambda j: terminal(j) or (j.get("progress") or {}).get("step", 0) >= 2, 300)
            assert j["status"] == "running", j
        yield ids[ATTACKER], ids[VICTIM]
    finally:
        for tenant, jid in ids.items():
            gw.api("POST", f"/v1/fine_tuning/jobs/{jid}/cancel", tenant)


def test_a_tenant_stopping_its_broker_children_stalls_no_other_tenant(gw: LiveGateway,
                                                                      jobs: tuple[str, str]) -> None:
    attacker_job, victim_job = jobs
    with Session(gw.engine) as s:
        admin, _ = create_token(session=s, role=Role.SYSADMIN, tenant=None)
        s.commit()
    log_from = BROKER_LOG.stat().st_size if BROKER_LOG.exists() else 0

    # without the attack: the attacker runs the same loop (the same load on the host) but stops nothing
    control = _attacker("scan")
    try:
        time.sleep(1.0)
        m0, v0, a0 = _metrics(gw, admin), _step(gw, VICTIM, victim_job), _step(gw, ATTACKER, attacker_job)
        time.sleep(WINDOW_S)
        m1, v1, a1 = _metrics(gw, admin), _step(gw, VICTIM, victim_job), _step(gw, ATTACKER, attacker_job)
    finally:
        seen, _ = control.communicate(timeout=60)
    base = _mean_cycle(m0, m1)
    assert v1 > v0 and a1 > a0 and seen.split(), "the control saw no broker child of the attacker"

    # the attack: as the attacker's own unix user
    attack = _attacker("stop")
    watch = ChildWatch(attack)
    watch.start()
    try:
        time.sleep(1.0)
        m2, v2 = _metrics(gw, admin), _step(gw, VICTIM, victim_job)
        a2 = _step(gw, ATTACKER, attacker_job)
        time.sleep(WINDOW_S)
        m3, v3 = _metrics(gw, admin), _step(gw, VICTIM, victim_job)
        a3 = _step(gw, ATTACKER, attacker_job)
    finally:
        attack.wait(60)
        watch.join(30)
    hit = set(watch.stopped)
    attacked = _mean_cycle(m2, m3)
    failed, late, skipped = (_count(m3, o) - _count(m2, o) for o in ("error", "late", "skipped"))
    kills = [pid for pid in hit if pid in watch.gone]
    took = [watch.gone[p] - watch.stopped[p] for p in kills]
    print(f"\nmean reconcile cycle: {base * 1000:.1f} ms without the attack, {attacked * 1000:.1f} ms under it; "
          f"victim steps {v0}->{v1} (before), {v2}->{v3} (under attack); attacker steps {a2}->{a3}; "
          f"{len(hit)} broker children stopped by the attacker, killed after "
          f"{max(took, default=0):.2f}s at most; this gateway's calls for the attacker "
          f"error/late/skipped: {failed:.0f}/{late:.0f}/{skipped:.0f}")

    assert hit, "the attacker stopped no broker child: the attack did not happen"
    assert failed > 0 and skipped > 0, "the attack never reached this gateway's reads"
    assert v3 > v2, "the victim's job made no progress while the attacker stalled its broker children"
    assert attacked <= 2 * base, f"cycle {attacked:.3f}s under the attack vs {base:.3f}s without"
    # every stopped child is killed by the broker within its deadline (the events read's), not left stopped
    assert hit <= set(watch.gone), f"still stopped: {hit - set(watch.gone)}"
    assert max(took) <= min(VERB_TIMEOUT_S["read_events"], MAX_DEADLINE_S) + REPLY_GRACE_S
    if BROKER_LOG.exists():
        with open(BROKER_LOG, "rb") as f:
            f.seek(log_from if BROKER_LOG.stat().st_size >= log_from else 0)   # a reinstall starts a new log
            logged = f.read().decode(errors="replace")
        assert any(f"killed request child {pid}: it was stopped" in logged for pid in kills), logged[-2000:]

    # nothing lost: the attacker's events are read again once it stops attacking
    deadline = time.monotonic() + 90
    while _step(gw, ATTACKER, attacker_job) <= a3:
        assert time.monotonic() < deadline, "the attacker's job never progressed again after the attack"
        time.sleep(1.0)


def test_the_tenant_cannot_stop_or_kill_the_broker_that_kills_its_children(gw: LiveGateway) -> None:
    _code, parent = running_code(Settings().broker_socket)
    assert parent and Path(f"/proc/{parent}/status").read_text().split("Uid:")[1].split()[:1] == ["0"]
    for sig in ("STOP", "KILL"):
        res = subprocess.run(["runuser", "-u", f"sft-{ATTACKER}", "--", "kill", f"-{sig}", str(parent)],
                             capture_output=True, text=True, timeout=30)
        assert res.returncode != 0 and "not permitted" in res.stderr, res
    assert _state(parent) not in ("T", None, "Z")
