"""The prolog and epilog steps. Each is a check (STYLE #12): ``observe_*`` does the I/O,
``judge_*`` turns the observation into a Verdict (pure), and the step function joins them.

Steps never read file contents and never put file names in their messages: a
report says how many files and bytes went, and which processes (pid, comm) died.
"""

from __future__ import annotations

import math
import os
import pwd
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from scrubber import files, gpu, procs
from scrubber.config import ScrubConfig
from scrubber.jobenv import JobContext

Figures = dict[str, int | float | str | list[str]]


class Status(StrEnum):
    OK = "ok"
    FAIL = "fail"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Verdict:
    status: Status
    message: str
    figures: Figures = field(default_factory=dict)


def ok(message: str, **figures: int | float | str | list[str]) -> Verdict:
    """A passing Verdict; ``figures`` go into the report."""
    return Verdict(Status.OK, message, figures)


def fail(message: str, **figures: int | float | str | list[str]) -> Verdict:
    """A failing Verdict: any one makes the scrub exit 1 (Slurm drains the node)."""
    return Verdict(Status.FAIL, message, figures)


def skipped(message: str, **figures: int | float | str | list[str]) -> Verdict:
    """A Verdict for a step that did not act (no GPU, no driver, a root job...); it fails nothing."""
    return Verdict(Status.SKIPPED, message, figures)


@dataclass(frozen=True)
class Scrub:
    """What every step needs: settings, the job, and the job's GPU device files."""
    cfg: ScrubConfig
    job: JobContext
    gpu_files: tuple[str, ...]

    @classmethod
    def make(cls, cfg: ScrubConfig, job: JobContext) -> Scrub:
        """Read gres.conf (absent: empty) and resolve the job's GPU indices to device files."""
        gres = gpu.read_gres_conf(cfg.gres_conf)
        return cls(cfg, job, tuple(gpu.job_gpu_files(gres, job.node, job.gpus)))

    @property
    def scratch(self) -> Path:
        """The job's scratch directory, ``<scratch_root>/job-<id>``."""
        return self.cfg.scratch_root / f"job-{self.job.job_id}"

    def minors(self) -> list[int]:
        """Device minor numbers of the job's GPU files; a file that cannot be stat'ed is left out."""
        return [m for m in map(gpu.device_minor, self.gpu_files) if m is not None]


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Scrub], Verdict]


def _describe(ps: list[procs.Proc], limit: int = 10) -> list[str]:
    return [f"{p.pid}:{p.comm}:uid={p.uid}" for p in ps[:limit]]


# ------------------------------------------------------------------ scratch
def judge_scratch_created(st: files.DirState, uid: int, error: str = "") -> Verdict:
    """OK when the scratch dir is a real directory of ``uid`` with mode 700; ``error``: the creation's OSError text."""
    if error:
        return fail(f"could not create the scratch dir: {error}")
    if not (st.exists and st.is_dir):
        return fail("scratch dir missing or not a directory after creation")
    if st.uid != uid or st.mode != 0o700:
        return fail(f"scratch dir is uid {st.uid} mode {st.mode:o}, expected uid {uid} mode 700")
    return ok(f"scratch dir created, owner uid {uid}, mode 700")


def step_make_scratch(s: Scrub) -> Verdict:
    """Prolog: create the job's scratch dir (a requeued run's is kept and re-owned) and check it."""
    try:
        files.make_scratch(s.cfg.scratch_root, s.job.job_id, s.job.uid, s.job.gid)
        error = ""
    except OSError as e:
        error = str(e)
    v = judge_scratch_created(files.dir_state(s.scratch), s.job.uid, error)
    return Verdict(v.status, v.message, {**v.figures, "path": str(s.scratch)})


def judge_removed(removed: files.Removed, left: int, what: str) -> Verdict:
    """OK only when nothing is ``left``, no removal failed and no other user's entry was met (``what``: the place)."""
    figures: Figures = {"files_removed": removed.files, "dirs_removed": removed.dirs,
                        "bytes_removed": removed.bytes, "foreign_left": removed.foreign}
    if removed.errors or left or removed.foreign:
        return fail(f"{what}: {left} entries left, {removed.errors} errors "
                    f"(first: {removed.first_error or '-'}), {removed.foreign} entries of other "
                    "users inside the job user's tree left alone", **figures)
    return ok(f"{what}: removed {removed.files} files, {removed.dirs} dirs, "
              f"{removed.bytes} bytes; none left", **figures)


def step_remove_scratch(s: Scrub) -> Verdict:
    """Epilog: remove the job's scratch dir where the job user owns it; fails if anything of it is left."""
    removed = files.remove_path(s.scratch, s.job.uid)
    left = 1 if files.dir_state(s.scratch).exists else 0
    return judge_removed(removed, left, "scratch")


# ---------------------------------------------------------------- processes
def _tenant_uids(prefix: str, job_uid: int, service_users: tuple[str, ...] = ()) -> set[int]:
    uids = {p.pw_uid for p in pwd.getpwall()
            if prefix and p.pw_name.startswith(prefix) and p.pw_name not in service_users}
    return (uids | {job_uid}) - {0}  # root's daemons are not a tenant's leftovers


def _undecided_message(ps: list[procs.Proc]) -> str:
    return (f"{len(ps)} process(es) of uid(s) {sorted({p.uid for p in ps})} in a cgroup the "
            f"scrubber cannot place ({ps[0].where.unknown}): neither killed nor spared")


def judge_leftovers(found: list[procs.Proc], undecided: list[procs.Proc] | None = None) -> Verdict:
    """Fails on any leftover tenant process (``found``) and on any whose cgroup cannot be placed (``undecided``)."""
    undecided = undecided or []
    if undecided:
        return fail(_undecided_message(undecided), processes=_describe(found + undecided))
    if found:
        uids = sorted({p.uid for p in found})
        return fail(f"{len(found)} leftover tenant process(es) of uid(s) {uids} with no job on "
                    "this node", processes=_describe(found))
    return ok("no leftover tenant process on this node")


LEFTOVER_SETTLE_S = 1.0   # a job starting or ending beside this one: its processes finish moving


def step_leftover_processes(s: Scrub, settle_s: float = LEFTOVER_SETTLE_S) -> Verdict:
    """Tenant processes that no live job owns. A process seen so must still be one after
    ``settle_s`` (same pid and start time): one that slurmstepd of another job on this host is
    starting (not yet in its job's cgroup) or reaping is in transit, not a leftover."""
    tenants = _tenant_uids(s.cfg.tenant_user_prefix, s.job.uid, s.cfg.service_users)

    def scan() -> tuple[list[procs.Proc], list[procs.Proc]]:
        ps = procs.list_procs(s.cfg.proc_root)
        return (procs.leftovers(ps, tenant_uids=tenants, node=s.job.node, job_id=s.job.job_id,
                                live=procs.live_jobs(ps)), procs.undecided(ps, tenants))

    found, undecided = scan()
    if found and settle_s > 0:
        time.sleep(settle_s)
        again, undecided = scan()
        first = {(p.pid, p.start) for p in found}
        found = [p for p in again if (p.pid, p.start) in first]
    return judge_leftovers(found, undecided)


def judge_kill(rounds: list[procs.KillResult], left: list[procs.Proc],
               undecided: list[procs.Proc] | None = None) -> Verdict:
    """OK when no target is ``left`` and none ``undecided``; figures: killed, needed SIGKILL, never signalled."""
    undecided = undecided or []
    killed = [p for r in rounds for p in r.killed]
    forced = sum(len(r.needed_kill) for r in rounds)
    figures: Figures = {"processes_killed": len(killed), "needed_sigkill": forced,
                        "not_signalled": sum(len(r.not_signalled) for r in rounds),
                        "killed": _describe(killed, 50)}
    if undecided:
        return fail(_undecided_message(undecided), undecided=_describe(undecided),
                    survivors=_describe(left), **figures)
    if left:
        return fail(f"{len(left)} process(es) of the job user survive SIGKILL "
                    f"(unkillable, D state?)", survivors=_describe(left), **figures)
    return ok(f"killed {len(killed)} leftover process(es) ({forced} needed SIGKILL); none left",
              **figures)


def _targets(s: Scrub) -> tuple[list[procs.Proc], list[procs.Proc]]:
    """The job user's processes to kill, and those whose cgroup cannot be placed."""
    ps = procs.list_procs(s.cfg.proc_root)
    return (procs.kill_targets(ps, uid=s.job.uid, node=s.job.node, job_id=s.job.job_id,
                               live=procs.live_jobs(ps)),
            procs.undecided(ps, {s.job.uid}))


def step_kill_processes(s: Scrub, rounds: int = 3) -> Verdict:
    """TERM → KILL every process of the job user no other live job owns; repeat while the
    dying ones spawn new ones. Signals go through verified pidfds (procs.terminate)."""
    results = []
    targets, undecided = _targets(s)
    for _ in range(rounds):
        if not targets or s.job.uid == 0:
            break
        results.append(procs.terminate(targets, grace_s=s.cfg.kill_grace_s, wait_s=s.cfg.kill_wait_s,
                                       proc_root=s.cfg.proc_root))
        targets, undecided = _targets(s)
    if s.job.uid == 0:
        return skipped("job user is root: not killing root's processes")
    return judge_kill(results, targets, undecided)


# ------------------------------------------------------------------------ files
def judge_other_jobs(live: dict[int, procs.Where], uid: int, job_id: int, where: str) -> Verdict | None:
    """Whether the job user's files must stay (its other live jobs here), or cannot be judged
    (a live job whose user is not known, cgroup v2 before its first process); None: remove them."""
    others = sorted(j for j, w in live.items() if w.uid == uid and j != job_id)
    if others:
        return skipped(f"the job user has other job(s) {others} on this host: its files in "
                       f"{where} stay until its last job ends")
    unknown = sorted(j for j, w in live.items() if w.uid is None and j != job_id)
    if unknown:
        return fail(f"cannot tell whose live job(s) {unknown} on this host are (no uid in the "
                    f"cgroup, no process of a user yet): the job user's files in {where} were "
                    "not removed")
    return None


def _settled_live_jobs(s: Scrub, tries: int = 20, pause_s: float = 0.1) -> dict[int, procs.Where]:
    """Live jobs, re-observed for up to ~2 s while one's user is not known yet (a starting
    job's slurmstepd before its cgroup, or its first process, exists)."""
    live = procs.live_jobs(procs.list_procs(s.cfg.proc_root))
    for _ in range(tries - 1):
        if all(w.uid is not None for j, w in live.items() if j != s.job.job_id):
            break
        time.sleep(pause_s)
        live = procs.live_jobs(procs.list_procs(s.cfg.proc_root))
    return live


def step_remove_tmp_files(s: Scrub) -> Verdict:
    """Epilog: remove the job user's entries in the tmp dirs; skipped while it has another live
    job on this host, failed while a live job's user cannot be told (see judge_other_jobs)."""
    where = "+".join(map(str, s.cfg.tmp_dirs))
    v = judge_other_jobs(_settled_live_jobs(s), s.job.uid, s.job.job_id,
                         ", ".join(map(str, s.cfg.tmp_dirs)))
    if v is not None:
        return v
    if s.job.uid == 0:
        return skipped("job user is root: not removing root's files")
    removed = files.Removed()
    for top in s.cfg.tmp_dirs:
        removed.add(files.remove_owned(top, s.job.uid))
    left = sum(len(files.owned_entries(top, s.job.uid)) for top in s.cfg.tmp_dirs)
    return judge_removed(removed, left, where)


# -------------------------------------------------------------------------- GPUs
def judge_device_holders(holders: dict[str, list[tuple[int, int]]], allowed_uids: set[int]) -> Verdict:
    """Fails when a process of a uid not in ``allowed_uids`` holds a device file open; skipped without devices."""
    bad = {dev: [pid for pid, uid in hs if uid not in allowed_uids] for dev, hs in holders.items()}
    bad = {d: pids for d, pids in bad.items() if pids}
    if not holders:
        return skipped("the job has no GPU")
    if bad:
        return fail(f"device file(s) held open by other processes: {bad}")
    return ok(f"no foreign process holds {', '.join(sorted(holders))}")


def step_prolog_device_holders(s: Scrub) -> Verdict:
    """Prolog: only root and the job user may hold the job's GPU device files open."""
    return judge_device_holders(procs.device_holders(s.cfg.proc_root, s.gpu_files), {0, s.job.uid})


def step_epilog_device_holders(s: Scrub) -> Verdict:
    """Epilog: only root may still hold the job's GPU device files open."""
    return judge_device_holders(procs.device_holders(s.cfg.proc_root, s.gpu_files), {0})


def judge_gpu_processes(info: dict[int, gpu.GpuInfo] | None, minors: list[int],
                        pid_uid: dict[int, int | None], allowed_uids: set[int], me: int) -> Verdict:
    """Fails when NVML misses one of ``minors`` or shows a compute process (other than ``me``) of a uid
    not in ``allowed_uids``; a pid of unknown uid counts as foreign. Skipped without GPUs or driver."""
    if not minors:
        return skipped("the job has no GPU")
    if info is None:
        return skipped(gpu.NO_DRIVER)
    missing = sorted(set(minors) - set(info))
    if missing:
        return fail(f"NVML does not see the job's GPU(s) with minor number(s) {missing}")
    bad = sorted(pid for g in info.values() for pid in g.compute_pids
                 if pid != me and pid_uid.get(pid) not in allowed_uids)
    if bad:
        return fail(f"compute process(es) {bad} on the job's GPU(s)")
    return ok(f"no foreign compute process on {len(info)} GPU(s)")


def _pid_uids(info: dict[int, gpu.GpuInfo] | None, proc_root: Path) -> dict[int, int | None]:
    out: dict[int, int | None] = {}
    for g in (info or {}).values():
        for pid in g.compute_pids:
            p = procs.read_proc(proc_root, pid)
            out[pid] = p.uid if p else None  # unknown (other pid namespace): foreign
    return out


def step_prolog_gpu_processes(s: Scrub) -> Verdict:
    """Prolog: no compute process but the job user's (and the scrubber's) on the job's GPUs."""
    minors = s.minors()
    info = gpu.gpu_info(minors) if minors else None
    return judge_gpu_processes(info, minors, _pid_uids(info, s.cfg.proc_root), {s.job.uid},
                               os.getpid())


def step_epilog_gpu_processes(s: Scrub) -> Verdict:
    """Epilog: no compute process but the scrubber's own left on the job's GPUs."""
    minors = s.minors()
    info = gpu.gpu_info(minors) if minors else None
    return judge_gpu_processes(info, minors, _pid_uids(info, s.cfg.proc_root), set(), os.getpid())


def judge_gpu_memory(info: dict[int, gpu.GpuInfo] | None, minors: list[int],
                     tolerance_bytes: int) -> Verdict:
    """Fails when NVML misses a job GPU or one has more than ``tolerance_bytes`` in use (skipped: no GPU, no driver)."""
    if not minors:
        return skipped("the job has no GPU")
    if info is None:
        return skipped(gpu.NO_DRIVER)
    used = {m: g.used for m, g in sorted(info.items())}
    if len(info) < len(minors) or any(u > tolerance_bytes for u in used.values()):
        return fail(f"GPU memory in use before the job (bytes by minor): {used}")
    return ok(f"GPU memory free on {len(info)} GPU(s)", gpu_bytes_used=sum(used.values()))


def step_gpu_memory(s: Scrub) -> Verdict:
    """Prolog: the job's GPUs have no more memory in use than ``gpu_used_tolerance_mb``."""
    minors = s.minors()
    info = gpu.gpu_info(minors) if minors else None
    return judge_gpu_memory(info, minors, s.cfg.gpu_used_tolerance_mb << 20)


# The wipe must cover at least this share of the memory that was free on each GPU.
WIPE_MIN_PERCENT = 99


def wipe_covers(r: gpu.WipeResult, percent: int = WIPE_MIN_PERCENT) -> bool:
    """Whether ``r`` zeroed at least ``percent`` % of the memory free before it (integers: exact)."""
    return r.free_bytes > 0 and r.wiped_bytes * 100 >= r.free_bytes * percent


def _percent(fraction: float) -> str:
    """Rounded down: 98.999 % reads 98.99 %, never a passing-looking 99.00 %."""
    return f"{math.floor(fraction * 10000) / 100:.2f}%"


def judge_wipe(results: list[gpu.WipeResult], expected: int) -> Verdict:
    """OK when all ``expected`` GPUs were wiped, each over WIPE_MIN_PERCENT of its free memory, and read back zero."""
    wiped = sum(r.wiped_bytes for r in results)
    free = sum(r.free_bytes for r in results)
    seconds = sum(r.seconds for r in results)
    fraction = min((r.fraction for r in results), default=0.0)
    figures: Figures = {"gpu_bytes_wiped": wiped, "gpu_bytes_free": free,
                        "gpu_bytes_total": sum(r.total_bytes for r in results),
                        "gpu_wipe_fraction": round(fraction, 6),  # the worst GPU's wiped / free
                        "wipe_seconds": round(seconds, 3),
                        "wipe_gb_per_s": round(wiped / seconds / 1e9, 1) if seconds else 0.0}
    if len(results) != expected:
        return fail(f"wiped {len(results)} of {expected} GPU(s)", **figures)
    short = {r.device: _percent(r.fraction) for r in results if not wipe_covers(r)}
    if short:
        return fail(f"GPU wipe covered too little of the free memory on {short} "
                    f"(need {WIPE_MIN_PERCENT}%)", **figures)
    bad = [r.device for r in results if r.nonzero_chunks]
    if bad:
        return fail(f"GPU memory not verified zero on {bad}", **figures)
    return ok(f"zeroed and verified {wiped} bytes on {len(results)} GPU(s), at least "
              f"{_percent(fraction)} of the memory that was free", **figures)


def step_gpu_wipe(s: Scrub) -> Verdict:
    """Epilog: zero and verify the free memory of every job GPU with torch; fails without torch+CUDA."""
    minors = s.minors()
    if not minors:
        return skipped("the job has no GPU")
    info = gpu.gpu_info(minors)
    if info is None:
        return skipped(gpu.NO_DRIVER)
    torch = gpu.import_torch_cuda([info[m].uuid for m in minors if m in info])
    if torch is None:
        return fail("an NVIDIA driver is present but torch with CUDA is not in the scrubber's "
                    "runtime: GPU memory cannot be wiped")
    results = [gpu.wipe_gpu(torch, i, chunk_bytes=s.cfg.wipe_chunk_mb << 20,
                            min_chunk_bytes=s.cfg.wipe_min_chunk_mb << 20)
               for i in range(torch.cuda.device_count())]
    return judge_wipe(results, len(minors))


# ------------------------------------------------------------------------ plans
PROLOG: tuple[Step, ...] = (
    Step("scratch", step_make_scratch),
    Step("leftover_processes", step_leftover_processes),
    Step("gpu_device_holders", step_prolog_device_holders),
    Step("gpu_processes", step_prolog_gpu_processes),
    Step("gpu_memory", step_gpu_memory),
)

EPILOG: tuple[Step, ...] = (
    Step("kill_processes", step_kill_processes),
    Step("gpu_wipe", step_gpu_wipe),
    Step("gpu_processes", step_epilog_gpu_processes),
    Step("gpu_device_holders", step_epilog_device_holders),
    Step("scratch", step_remove_scratch),
    Step("tmp_files", step_remove_tmp_files),
)

PLANS = {"prolog": PROLOG, "epilog": EPILOG}
STEP_NAMES = sorted({st.name for plan in PLANS.values() for st in plan})
