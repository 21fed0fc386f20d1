"""Processes on this host: who owns them, which Slurm job (and node) their cgroup says, killing.

Slurm puts a job's processes in a per-job cgroup, and /proc/<pid>/cgroup says which:

- cgroup v1 (``N:<controllers>:<path>`` lines, any controller Slurm uses: freezer,
  memory, cpuset, devices, ...): ``/slurm_<node>/uid_<uid>/job_<id>/step_<step>/...``
  with multiple-slurmd, ``/slurm/uid_<uid>/job_<id>/...`` with one slurmd per host;
- cgroup v2 (the ``0::<path>`` line): ``.../slurmstepd.scope/job_<id>/step_<step>/...``
  (``.../<node>_slurmstepd.scope/...`` with multiple-slurmd); slurmstepd's own
  processes sit in ``.../slurmstepd.scope/system``.

A path that looks like Slurm's (a ``slurm*``, ``job_*``, ``uid_*`` or ``step_*``
component) but fits neither layout, lines that name different jobs, or a file
without a cgroup line make an *unknown* layout: such a process is neither
killed nor spared, the check fails and says why (the node drains). A job is live
while one of its ``slurmstepd`` processes exists. Processes a job started and
that left its process group (setsid, double fork) are still processes of the
user: they are found by uid from /proc, whatever their cgroup.

The control plane's storage broker (a root daemon, ``gateway.storage.broker``) does each
tenant-storage request in a short-lived child that has become the tenant's uid (and that
may run ``sbatch`` as the tenant): on a host that is both gateway and compute node those
are the tenant's processes with no job. A process whose parent chain reaches a root
broker process is such a helper, not a leftover; a tenant cannot put its own process
under a root parent (an orphan is re-parented to PID 1, never to the broker).

Signals go through a pidfd opened for the process the scan saw, after checking
(uid, start time, cgroup) that the pid still is that process: a pid recycled
meanwhile is never signalled.
"""

from __future__ import annotations

import os
import re
import select
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Protocol

_V1_JOB = re.compile(r"^/slurm(?:_(?P<node>[^/]+))?/uid_(?P<uid>\d+)/job_(?P<job>\d+)(?:/|$)")
_V1_NODE = re.compile(r"^/slurm(?:_(?P<node>[^/]+))?(?:/system|/uid_\d+)?/?$")
_V2_SCOPE = r"(?:/[^/]+)*?/(?:(?P<node>[^/]+)_)?slurmstepd\.scope"
_V2_JOB = re.compile(rf"^{_V2_SCOPE}/job_(?P<job>\d+)(?:/|$)")
_V2_NODE = re.compile(rf"^{_V2_SCOPE}(?:/system)?/?$")
# A path component that only Slurm makes: seen outside the layouts above, the layout is unknown.
_SLURMISH = re.compile(r"^(?:slurm(?:_.*)?|.*slurmstepd.*|job_.*|uid_\d+|step_.*)$")
_DAEMON_UNIT = re.compile(r"^slurm\w*(?:@[^/]*)?\.service$")  # slurmd.service & co: no job
_STEPD = re.compile(r"^slurmstepd: \[(?P<job>\d+)\.")
BROKER_MARK = b"gateway.storage.broker"   # in the root broker daemon's command line


@dataclass(frozen=True)
class Where:
    """Where a cgroup puts a process: Slurm node (None: the host's only/any), job, uid (v1 only).

    ``unknown`` non-empty: the layout is not understood (the reason); nothing else is meaningful.
    """
    slurm: bool
    node: str | None
    job: int | None
    uid: int | None = None
    unknown: str = ""


NOT_SLURM = Where(False, None, None)


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    state: str  # R, S, D, Z, ... from /proc/<pid>/stat
    comm: str
    cgroup: str  # the text of /proc/<pid>/cgroup
    stepd_job: int | None = None  # set for "slurmstepd: [<job>.<step>]" processes
    start: int = 0  # start time (clock ticks after boot, /proc/<pid>/stat field 22)
    broker: bool = False  # a root process running the gateway's storage broker

    @property
    def where(self) -> Where:
        """Where the process's cgroup places it (Slurm job, node, uid), parsed from ``cgroup``."""
        return cgroup_where(self.cgroup)


class Owner(Enum):
    OWN_JOB = "own job"
    OTHER_LIVE_JOB = "another live job"
    OTHER_NODE = "another node on this host"
    STALE_JOB = "a job that has ended"
    NO_JOB = "no job"
    UNKNOWN = "an unknown cgroup layout"


# ---------------------------------------------------------------- pure parsing
def parse_stat(text: str) -> tuple[str, int]:
    """(state, ppid) from /proc/<pid>/stat; comm may hold spaces and parentheses."""
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def parse_start(text: str) -> int:
    """The start time (field 22, clock ticks after boot) from /proc/<pid>/stat."""
    return int(text[text.rindex(")") + 2:].split()[19])


def parse_uid(status: str) -> int:
    """The real uid from /proc/<pid>/status."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise ValueError("no Uid line")


def where(path: str) -> Where:
    """Which Slurm node and job one cgroup path belongs to, v1 or v2 layout (pure)."""
    if m := _V1_JOB.match(path):
        return Where(True, m["node"], int(m["job"]), int(m["uid"]))
    if m := _V2_JOB.match(path):
        return Where(True, m["node"], int(m["job"]))
    if m := _V1_NODE.match(path) or _V2_NODE.match(path):
        return Where(True, m["node"], None)
    parts = [p for p in path.split("/") if p]
    if any(_SLURMISH.match(p) and not _DAEMON_UNIT.match(p) for p in parts):
        return Where(True, None, None, unknown=f"unknown Slurm cgroup layout {path[:200]!r}")
    return NOT_SLURM


def cgroup_where(text: str) -> Where:
    """Where the whole of /proc/<pid>/cgroup puts a process (pure).

    Every line counts (v1: any controller, v2: the ``0::`` line). A job on one line
    and nothing Slurm's on the others is that job; two different jobs or nodes, an
    unknown path on any line, or no line at all is an unknown layout.
    """
    seen = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0].isdigit() and parts[2].startswith("/"):
            seen.append(where(parts[2]))
    if not seen:
        return Where(True, None, None, unknown="no cgroup line in /proc/<pid>/cgroup")
    unknown = next((w for w in seen if w.unknown), None)
    if unknown:
        return unknown
    slurm = [w for w in seen if w.slurm]
    nodes = {w.node for w in slurm}
    job_ids = {w.job for w in slurm if w.job is not None}
    uids = {w.uid for w in slurm if w.uid is not None}
    if len(nodes) > 1 or len(job_ids) > 1 or len(uids) > 1:
        return Where(True, None, None, unknown=f"cgroup lines disagree: nodes {sorted(map(str, nodes))}, "
                                               f"jobs {sorted(job_ids)}, uids {sorted(uids)}")
    if not slurm:
        return NOT_SLURM
    return Where(True, next(iter(nodes)), next(iter(job_ids), None), next(iter(uids), None))


def stepd_job(cmdline: bytes) -> int | None:
    """The job id of a ``slurmstepd: [<job>.<step>]`` command line (NUL-separated argv); None otherwise."""
    m = _STEPD.match(cmdline.split(b"\0")[0].decode(errors="replace"))
    return int(m["job"]) if m else None


def live_jobs(procs: Iterable[Proc]) -> dict[int, Where]:
    """Job id → where (node, job user's uid) of every job that still has a slurmstepd.

    The uid is in the v1 path; for v2 it is the one non-root uid of the job's processes,
    None when that is not known (no process of the user yet, or more than one uid).
    """
    ps = list(procs)
    members: dict[int, set[int]] = {}
    for p in ps:
        w = p.where
        if w.job is not None and p.uid != 0:
            members.setdefault(w.job, set()).add(p.uid)
    out: dict[int, Where] = {}
    for p in ps:
        if p.stepd_job is None:
            continue
        w = p.where
        uids = members.get(p.stepd_job, set())
        if w.uid is None and len(uids) == 1:
            w = replace(w, uid=next(iter(uids)))
        out[p.stepd_job] = w
    return out


def owner(p: Proc, *, node: str, job_id: int, live: dict[int, Where]) -> Owner:
    """Whose a process is, seen from ``job_id``'s prolog/epilog on ``node`` (pure).

    ``node`` None in the path means a one-slurmd host: that is this node.
    """
    w = p.where
    if w.unknown:
        return Owner.UNKNOWN
    if w.job == job_id:
        return Owner.OWN_JOB
    if w.job is not None and w.job in live:
        return Owner.OTHER_LIVE_JOB
    if w.slurm and w.node not in (None, node):
        return Owner.OTHER_NODE
    if w.job is not None:
        return Owner.STALE_JOB
    return Owner.NO_JOB


def broker_helpers(procs: Iterable[Proc]) -> set[int]:
    """Pids whose parent chain reaches a root storage-broker process (pure; see the module doc)."""
    by_pid = {p.pid: p for p in procs}
    roots = {p.pid for p in by_pid.values() if p.broker and p.uid == 0}
    out: set[int] = set()
    for p in by_pid.values():
        seen, cur = set(), by_pid.get(p.ppid)
        while cur is not None and cur.pid not in seen:
            if cur.pid in roots:
                out.add(p.pid)
                break
            seen.add(cur.pid)
            cur = by_pid.get(cur.ppid)
    return out


def kill_targets(procs: Iterable[Proc], *, uid: int, node: str, job_id: int,
                 live: dict[int, Where]) -> list[Proc]:
    """Epilog: every process of ``uid`` that no other live job owns (zombies are already dead).
    A process whose cgroup layout is unknown is not a target (see ``undecided``); nor is the
    storage broker's work for the tenant."""
    procs = list(procs)
    helpers = broker_helpers(procs)
    return [p for p in procs if p.uid == uid and p.state != "Z" and p.pid not in helpers
            and owner(p, node=node, job_id=job_id, live=live) not in (Owner.OTHER_LIVE_JOB, Owner.UNKNOWN)]


def undecided(procs: Iterable[Proc], uids: set[int]) -> list[Proc]:
    """Processes of ``uids`` whose job cannot be told (unknown cgroup layout): the check fails."""
    procs = list(procs)
    helpers = broker_helpers(procs)
    return [p for p in procs if p.uid in uids and p.state != "Z" and p.where.unknown and p.pid not in helpers]


def leftovers(procs: Iterable[Proc], *, tenant_uids: set[int], node: str, job_id: int,
              live: dict[int, Where]) -> list[Proc]:
    """Prolog: tenant processes on this node that belong to no live job (the storage broker's
    short-lived children working for the tenant are not leftovers)."""
    procs = list(procs)
    helpers = broker_helpers(procs)
    return [p for p in procs if p.uid in tenant_uids and p.state != "Z" and p.pid not in helpers
            and owner(p, node=node, job_id=job_id, live=live) in (Owner.STALE_JOB, Owner.NO_JOB)]


def same_process(seen: Proc, now: Proc | None) -> bool:
    """Whether ``now`` (read after opening a pidfd) is the process the scan saw (pure)."""
    return (now is not None and now.state != "Z"
            and (now.pid, now.uid, now.start, now.cgroup) == (seen.pid, seen.uid, seen.start, seen.cgroup))


# ------------------------------------------------------------------------- I/O
def read_proc(proc_root: Path, pid: int) -> Proc | None:
    """One process, or None when it vanished meanwhile. Reads no command line but those of root's
    slurmstepd and python processes (job ids; the storage broker's mark)."""
    base = proc_root / str(pid)
    try:
        stat_text = (base / "stat").read_text()
        state, ppid = parse_stat(stat_text)
        start = parse_start(stat_text)
        uid = parse_uid((base / "status").read_text())
        comm = (base / "comm").read_text().strip()
        cgroup = (base / "cgroup").read_text()
        cmdline = (base / "cmdline").read_bytes() if uid == 0 and (comm == "slurmstepd"
                                                                   or comm.startswith("python")) else b""
        job = stepd_job(cmdline) if comm == "slurmstepd" else None
    except (OSError, ValueError, IndexError):
        return None
    return Proc(pid, ppid, uid, state, comm, cgroup, job, start, broker=BROKER_MARK in cmdline)


def list_procs(proc_root: Path = Path("/proc")) -> list[Proc]:
    """Every process on the host except this one."""
    me = os.getpid()
    out = []
    for name in os.listdir(proc_root):
        if name.isdigit() and int(name) != me:
            p = read_proc(proc_root, int(name))
            if p is not None:
                out.append(p)
    return out


class Handle(Protocol):
    """A process that can be signalled without naming its pid again."""
    proc: Proc

    def send(self, sig: int) -> bool:
        """Send ``sig``; False when the process is gone."""
        ...

    def gone(self) -> bool:
        """Whether the process has exited."""
        ...

    def close(self) -> None:
        """Release the handle."""
        ...


class Pidfd:
    """A process pinned by a pidfd: a signal reaches it or nothing (never a recycled pid)."""

    def __init__(self, proc: Proc, fd: int) -> None:
        self.proc, self.fd = proc, fd

    def send(self, sig: int) -> bool:
        """Send ``sig`` through the pidfd; False when the process has already exited."""
        try:
            signal.pidfd_send_signal(self.fd, sig)
        except ProcessLookupError:
            return False
        return True

    def gone(self) -> bool:
        """A pidfd polls readable once its process has exited (a zombie holds nothing)."""
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        return bool(poller.poll(0))

    def close(self) -> None:
        """Close the pidfd."""
        os.close(self.fd)


def open_pidfd(seen: Proc, proc_root: Path = Path("/proc")) -> Pidfd | None:
    """A pidfd for the process the scan saw, or None when its pid is gone or now another process.

    The pidfd refers to whatever process has the pid when it is opened; re-reading
    /proc *after* opening tells whether that is still the scanned one. Should that
    process die and its pid be reused during the re-read, the pidfd's process is
    dead: signals through it fail (ESRCH), they never reach the newcomer. Without pidfd
    support (Linux < 5.3) this raises OSError: the kill step fails rather than guess.
    """
    try:
        fd = os.pidfd_open(seen.pid)
    except ProcessLookupError:
        return None
    if not same_process(seen, read_proc(proc_root, seen.pid)):
        os.close(fd)
        return None
    return Pidfd(seen, fd)


@dataclass(frozen=True)
class KillResult:
    killed: tuple[Proc, ...]  # gone after TERM or KILL
    needed_kill: tuple[int, ...]  # pids that ignored SIGTERM
    survivors: tuple[Proc, ...]  # still there after KILL and the wait
    seconds: float
    not_signalled: tuple[Proc, ...] = ()  # exited, or its pid recycled, before a verified pidfd


def terminate(targets: list[Proc], *, grace_s: float, wait_s: float, proc_root: Path = Path("/proc"),
              open_fn: Callable[[Proc], Handle | None] | None = None, poll_s: float = 0.05) -> KillResult:
    """SIGTERM every target, SIGKILL what is left after ``grace_s``, wait ``wait_s`` more.

    Every signal goes through the target's verified pidfd (``open_fn``, default
    ``open_pidfd``), opened once before SIGTERM and kept until the end.
    """
    opener: Callable[[Proc], Handle | None] = open_fn or (lambda p: open_pidfd(p, proc_root))
    t0 = time.monotonic()
    handles: list[Handle] = []  # every one opened: closed at the end
    sent: list[Handle] = []  # SIGTERM delivered
    not_signalled: list[Proc] = []
    try:
        for p in targets:
            h = opener(p)
            if h is not None:
                handles.append(h)
            if h is not None and h.send(signal.SIGTERM):
                sent.append(h)
            else:
                not_signalled.append(p)
        left = _wait_gone(sent, grace_s, poll_s)
        for h in left:
            h.send(signal.SIGKILL)
        survivors = _wait_gone(left, wait_s, poll_s) if left else []
    finally:
        for h in handles:
            h.close()
    return KillResult(killed=tuple(h.proc for h in sent if h not in survivors),
                      needed_kill=tuple(h.proc.pid for h in left),
                      survivors=tuple(h.proc for h in survivors), seconds=time.monotonic() - t0,
                      not_signalled=tuple(not_signalled))


def _wait_gone(handles: list[Handle], timeout: float, poll_s: float) -> list[Handle]:
    deadline = time.monotonic() + timeout
    left = [h for h in handles if not h.gone()]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [h for h in left if not h.gone()]
    return left


def device_holders(proc_root: Path, devices: Iterable[str]) -> dict[str, list[tuple[int, int]]]:
    """Device path → [(pid, uid)] of processes with it open (from /proc/<pid>/fd links)."""
    wanted = set(devices)
    out: dict[str, list[tuple[int, int]]] = {d: [] for d in wanted}
    if not wanted:
        return out
    for name in os.listdir(proc_root):
        if not name.isdigit():
            continue
        fd_dir = proc_root / name / "fd"
        try:
            links = {os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}
            uid = parse_uid((proc_root / name / "status").read_text())
        except (OSError, ValueError):
            continue
        for dev in wanted & links:
            out[dev].append((int(name), uid))
    return out
