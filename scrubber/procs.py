"""Processes on this host: who owns them, which Slurm job (and node) their cgroup says, killing.

Slurm's cgroup v1 layout with multiple-slurmd is
``/sys/fs/cgroup/freezer/slurm_<node>/uid_<uid>/job_<id>/step_<step>/``
(``/slurm/uid_…`` with one slurmd per host). A job is live while one of its
``slurmstepd`` processes (which sit in the job-level cgroup) exists. Processes a
job started and that left its process group (setsid, double fork) are still
processes of the user: they are found by uid from /proc, whatever their cgroup.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

_SLURM_CG = re.compile(r"^/slurm(?:_(?P<node>[^/]+))?/uid_(?P<uid>\d+)/job_(?P<job>\d+)(?:/|$)")
_SLURM_NODE_CG = re.compile(r"^/slurm(?:_(?P<node>[^/]+))?(?:/|$)")
_STEPD = re.compile(r"^slurmstepd: \[(?P<job>\d+)\.")


@dataclass(frozen=True)
class Proc:
    pid: int
    ppid: int
    uid: int
    state: str  # R, S, D, Z, ... from /proc/<pid>/stat
    comm: str
    cgroup: str  # the freezer (v1) or unified (v2) path
    stepd_job: int | None = None  # set for "slurmstepd: [<job>.<step>]" processes


@dataclass(frozen=True)
class Where:
    """Where a cgroup path puts a process: Slurm node (None: the host's only/any), job."""
    slurm: bool
    node: str | None
    job: int | None
    uid: int | None = None


class Owner(Enum):
    OWN_JOB = "own job"
    OTHER_LIVE_JOB = "another live job"
    OTHER_NODE = "another node on this host"
    STALE_JOB = "a job that has ended"
    NO_JOB = "no job"


# ---------------------------------------------------------------- pure parsing
def parse_stat(text: str) -> tuple[str, int]:
    """(state, ppid) from /proc/<pid>/stat; comm may hold spaces and parentheses."""
    rest = text[text.rindex(")") + 2:].split()
    return rest[0], int(rest[1])


def parse_uid(status: str) -> int:
    """The real uid from /proc/<pid>/status."""
    for line in status.splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise ValueError("no Uid line")


def parse_cgroup(text: str) -> str:
    """The freezer path of /proc/<pid>/cgroup (cgroup v1), else the unified one (v2)."""
    unified = ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "freezer" in parts[1].split(","):
            return parts[2]
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
    return unified


def where(cgroup: str) -> Where:
    """Which Slurm node and job a cgroup path belongs to (pure)."""
    m = _SLURM_CG.match(cgroup)
    if m:
        return Where(True, m["node"], int(m["job"]), int(m["uid"]))
    n = _SLURM_NODE_CG.match(cgroup)
    if n:
        return Where(True, n["node"], None)
    return Where(False, None, None)


def stepd_job(cmdline: bytes) -> int | None:
    m = _STEPD.match(cmdline.split(b"\0")[0].decode(errors="replace"))
    return int(m["job"]) if m else None


def live_jobs(procs: Iterable[Proc]) -> dict[int, Where]:
    """Job id → where (node, uid from the cgroup) of every job that still has a slurmstepd."""
    return {p.stepd_job: where(p.cgroup) for p in procs if p.stepd_job is not None}


def owner(p: Proc, *, node: str, job_id: int, live: dict[int, Where]) -> Owner:
    """Whose a process is, seen from ``job_id``'s prolog/epilog on ``node`` (pure).

    ``node`` None in the path means a one-slurmd host: that is this node.
    """
    w = where(p.cgroup)
    if w.job == job_id:
        return Owner.OWN_JOB
    if w.job is not None and w.job in live:
        return Owner.OTHER_LIVE_JOB
    if w.slurm and w.node not in (None, node):
        return Owner.OTHER_NODE
    if w.job is not None:
        return Owner.STALE_JOB
    return Owner.NO_JOB


def kill_targets(procs: Iterable[Proc], *, uid: int, node: str, job_id: int,
                 live: dict[int, Where]) -> list[Proc]:
    """Epilog: every process of ``uid`` that no other live job owns (zombies are already dead)."""
    return [p for p in procs if p.uid == uid and p.state != "Z"
            and owner(p, node=node, job_id=job_id, live=live) is not Owner.OTHER_LIVE_JOB]


def leftovers(procs: Iterable[Proc], *, tenant_uids: set[int], node: str, job_id: int,
              live: dict[int, Where]) -> list[Proc]:
    """Prolog: tenant processes on this node that belong to no live job."""
    return [p for p in procs if p.uid in tenant_uids and p.state != "Z"
            and owner(p, node=node, job_id=job_id, live=live) in (Owner.STALE_JOB, Owner.NO_JOB)]


# ------------------------------------------------------------------------- I/O
def read_proc(proc_root: Path, pid: int) -> Proc | None:
    """One process, or None when it vanished meanwhile. Reads no command line except slurmstepd's."""
    base = proc_root / str(pid)
    try:
        state, ppid = parse_stat((base / "stat").read_text())
        uid = parse_uid((base / "status").read_text())
        comm = (base / "comm").read_text().strip()
        cgroup = parse_cgroup((base / "cgroup").read_text())
        job = stepd_job((base / "cmdline").read_bytes()) if comm == "slurmstepd" and uid == 0 else None
    except (OSError, ValueError):
        return None
    return Proc(pid, ppid, uid, state, comm, cgroup, job)


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


def gone(pid: int, proc_root: Path = Path("/proc")) -> bool:
    """True once ``pid`` no longer runs (a zombie holds nothing but its pid)."""
    try:
        state, _ = parse_stat((proc_root / str(pid) / "stat").read_text())
    except (OSError, ValueError):
        return True
    return state == "Z"


@dataclass(frozen=True)
class KillResult:
    killed: tuple[Proc, ...]  # gone after TERM or KILL
    needed_kill: tuple[int, ...]  # pids that ignored SIGTERM
    survivors: tuple[Proc, ...]  # still there after KILL and the wait
    seconds: float


def terminate(targets: list[Proc], *, grace_s: float, wait_s: float,
              signal_fn: Callable[[int, int], None] = os.kill,
              is_gone: Callable[[int], bool] = gone, poll_s: float = 0.05) -> KillResult:
    """SIGTERM every target, SIGKILL what is left after ``grace_s``, wait ``wait_s`` more."""
    t0 = time.monotonic()
    _signal_all(targets, signal.SIGTERM, signal_fn)
    left = _wait_gone(targets, grace_s, is_gone, poll_s)
    needed_kill = tuple(p.pid for p in left)
    _signal_all(left, signal.SIGKILL, signal_fn)
    survivors = _wait_gone(left, wait_s, is_gone, poll_s) if left else []
    killed = tuple(p for p in targets if p not in survivors)
    return KillResult(killed, needed_kill, tuple(survivors), time.monotonic() - t0)


def _signal_all(procs: list[Proc], sig: int, signal_fn: Callable[[int, int], None]) -> None:
    for p in procs:
        try:
            signal_fn(p.pid, sig)
        except ProcessLookupError:
            pass


def _wait_gone(procs: list[Proc], timeout: float, is_gone: Callable[[int], bool],
               poll_s: float) -> list[Proc]:
    deadline = time.monotonic() + timeout
    left = [p for p in procs if not is_gone(p.pid)]
    while left and time.monotonic() < deadline:
        time.sleep(poll_s)
        left = [p for p in left if not is_gone(p.pid)]
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
