"""Local mode: the same gateway with no root, no Slurm and no tenant isolation.

``finetune serve --local`` / ``finetune demo --local`` / ``SFT_BACKEND=local`` run the
gateway, API, portal, validation, trainer, checkpoints, cancel and publication as the
invoking user, with storage and SQLite under ``SFT_DATA_DIR`` (default
``~/.local/share/slurm-finetune``). Only the scheduler differs: ``LocalScheduler``
answers the job methods of ``SlurmClient`` (submit, states, cancel, find_by_name),
and runs each job with submitit's ``LocalExecutor`` on this machine. The state
machine, the reconciler and publication are the cluster's own code: a job's
``RUNNING``/``COMPLETED``/``FAILED``/``CANCELLED``/``TIMEOUT`` here are the words
Slurm would use.

What is off, and said at start (``BANNER``): tenant isolation (every tenant's files
belong to the invoking user), fairshare and QOS, node scrubbing, requeue. It is for
one person trying the software on a laptop or workstation, never for shared use.

Layout under ``<state_dir>/local-jobs/<id>/``: ``meta.json`` (name, account, times),
``submitit/`` (the executor's folder and logs), ``pid`` (the controller), ``cancel``
(set by a cancel), ``exit.json`` (the trainer's exit status, written by ``run_job``).
The trainer's own output goes to ``local-<id>.out`` in the job dir, as
``slurm-<id>.out`` does on the cluster.
"""

from __future__ import annotations

import fcntl
import json
import os
import pwd
import signal
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from gateway.config import Settings
from gateway.errors import ServiceError, SlurmError
from gateway.slurm import records as rec
from gateway.slurm.client import CancelResult, JobStatus
from gateway.slurm.render import JobScript
from gateway.state import LOCAL_QOS
from gateway.state import SlurmState as S
from trainer.contract import exitcodes

BANNER = ("LOCAL MODE: jobs run as {user} on this machine, without Slurm. Tenant isolation, fairshare/QOS "
          "and node scrubbing are OFF: every tenant's data belongs to {user}. For trying slurm-finetune "
          "alone, never for shared use. Data: {data_dir}")
NODE = "local"
QOS = LOCAL_QOS


class LocalModeError(SystemExit):
    pass


def banner(settings: Settings) -> str:
    """The warning local mode prints at start: who owns every tenant's data, and where it lives."""
    return BANNER.format(user=pwd.getpwuid(os.getuid()).pw_name, data_dir=settings.data_dir)


def check_not_root() -> None:
    """Local mode runs every tenant's job as the invoking user: as root that would be root."""
    if os.geteuid() == 0:
        raise LocalModeError("local mode runs jobs as the invoking user and isolates nothing: refusing to run "
                             "it as root. Run it as an ordinary user, or use the cluster mode (no --local).")


def _now() -> datetime:
    return datetime.now(UTC)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def run_job(command: list[str], cwd: str, env: dict[str, str], log_path: str, folder: str) -> int:
    """The job, inside submitit's task process: the trainer as a child with exactly ``env``
    (as ``sbatch --export=NONE`` gives it), its output appended to ``log_path``.

    Signals mirror the cluster's batch script: TERM/INT (a cancel, or the controller
    stopping) reach the trainer as TERM; submitit's time-limit warning (USR2) reaches it as
    USR1 (checkpoint, exit ``REQUEUE``). A signal that arrives before the trainer exists is replayed
    to it. Returns the trainer's exit status (negative: killed by that signal) after recording
    it in ``exit.json``."""
    import subprocess

    child: list[subprocess.Popen[bytes]] = []
    pending: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        target = signal.SIGUSR1 if signum == signal.SIGUSR2 else signal.SIGTERM
        if child:
            child[0].send_signal(target)
        else:
            pending.append(target)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
        signal.signal(sig, forward)
    os.umask(0o077)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        child.append(subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    finally:
        os.close(fd)
    _write_atomic(Path(folder) / "trainer.pid", str(child[0].pid))
    for target in pending:
        child[0].send_signal(target)
    rc = child[0].wait()
    _write_atomic(Path(folder) / "exit.json", json.dumps({"rc": rc, "end": _now().isoformat()}))
    return rc


class LocalScheduler:
    """``SlurmClient``'s job methods for local mode (see the module doc)."""

    runner = None     # no Slurm commands: nothing may ask for a runner in local mode

    def __init__(self, settings: Settings):
        self.settings = settings
        self.root = settings.state_dir / "local-jobs"
        self._jobs: dict[int, Any] = {}      # submitit LocalJob of jobs this process started (reaps them)

    # ------------------------------------------------------------- writes
    def submit(self, job: JobScript, *, user: str | None = None, group: str | None = None,
               runner: Any = None) -> int:
        """Start ``job`` now (no queue: local jobs run at once). Returns its id."""
        import shlex

        import submitit  # lazy: only local mode starts jobs with it; a cluster gateway never loads it

        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        jid = self._next_id()
        folder = self.root / str(jid)
        folder.mkdir(mode=0o700)
        _write_atomic(folder / "meta.json", json.dumps({
            "name": job.job_name, "account": job.account, "qos": job.qos, "submit": _now().isoformat(),
            "time_limit_min": job.time_limit_min}))
        python = str(self.settings.runtime_python)
        env = {"PATH": f"{Path(python).parent}:/usr/local/bin:/usr/bin:/bin", "HOME": job.job_dir,
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": str(job.cpus), **job.env}
        executor = submitit.LocalExecutor(folder=folder / "submitit", python=shlex.quote(python))
        executor.update_parameters(timeout_min=job.time_limit_min, signal_delay_s=job.grace_s)
        try:
            started = executor.submit(run_job, list(job.command), job.job_dir, env,
                                      str(Path(job.job_dir) / f"local-{jid}.out"), str(folder))
        except Exception as e:   # noqa: BLE001 - reported like sbatch's refusal
            raise SlurmError(f"local job {jid} could not start: {e}") from None
        _write_atomic(folder / "pid", str(started.job_id))
        self._jobs[jid] = started
        return jid

    def submit_named_array(self, jobs: Sequence[JobScript], *, name: str, task_names: Sequence[str],
                           user: str | None = None, runner: Any = None) -> tuple[int, list[int]]:
        """Always raises ServiceError (``no_backend``): local mode has no job arrays (a sweep's runs are
        submitted one by one)."""
        raise ServiceError("job arrays need Slurm: submit the jobs one by one", code="no_backend")

    def _next_id(self) -> int:
        with open(self.root / "next_id", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.seek(0)
            raw = f.read().strip()
            jid = int(raw) if raw.isdigit() else 1
            f.seek(0)
            f.truncate()
            f.write(str(jid + 1))
            return jid

    def requeue(self, job_id: int, *, owner: rec.Owner) -> None:
        """Always raises SlurmError: local mode cannot requeue a job."""
        raise SlurmError("local mode has no requeue")

    def cancel(self, job_id: int, *, owner: rec.Owner, deadline_s: float = 30.0, poll_s: float = 0.25,
               kill_wait_s: float = 60.0) -> CancelResult:
        """SIGTERM to the trainer (through submitit's controller and ``run_job``); SIGKILL to its
        process group once ``deadline_s`` passes. Returns when no process of the job is left. Every
        local job is this user's own: ``owner`` is not checked."""
        start = time.monotonic()
        folder = self.root / str(int(job_id))
        if not folder.is_dir():
            raise SlurmError(f"no local job {job_id}")
        (folder / "cancel").touch()
        self._signal(folder / "pid", signal.SIGTERM)
        escalated = False
        while True:
            status = self.states([job_id])[job_id]
            trainer_gone = not self._alive(folder / "trainer.pid", session=True)
            if not status.active and trainer_gone:
                return CancelResult(job_id, time.monotonic() - start, escalated, status.state)
            elapsed = time.monotonic() - start
            if not escalated and elapsed >= deadline_s:
                self._signal(folder / "trainer.pid", signal.SIGKILL, group=True)
                self._signal(folder / "pid", signal.SIGKILL)
                escalated = True
            if elapsed >= deadline_s + kill_wait_s:
                raise SlurmError(f"local job {job_id} still running {elapsed:.0f}s after cancel")
            time.sleep(poll_s)

    # -------------------------------------------------------------- reads
    def states(self, job_ids: Iterable[int]) -> dict[int, JobStatus]:
        """The status of each local job, from its folder (``missing`` when it has none)."""
        return {int(j): self._state(int(j)) for j in job_ids}

    def pause(self, job_id: int, *, owner: rec.Owner) -> str | None:
        """Local mode has no queue to hold a job in: refused (the API answers 409 before this)."""
        raise SlurmError("local mode cannot pause a job: it has no scheduler queue")

    def release(self, job_id: int, *, owner: rec.Owner) -> None:
        """See :meth:`pause`."""
        raise SlurmError("local mode cannot pause or resume a job: it has no scheduler queue")

    def find_by_name(self, names: Iterable[str], *, since: datetime | None = None) -> dict[str, int]:
        """Local job ids by job name (from each job folder's meta.json, written by this scheduler, not by
        a job); names not found are left out. Every local job is this user's: owners are not checked."""
        wanted, found = set(names), {}
        for folder in self.root.glob("[0-9]*"):
            meta = _read_json(folder / "meta.json") or {}
            if meta.get("name") in wanted and folder.name.isdigit():
                found[str(meta["name"])] = int(folder.name)
        return found

    def cancel_unnamed_tasks(self, arrays: Mapping[str, rec.Owner]) -> list[tuple[str, int, int]]:
        """Always []: local mode has no job arrays."""
        return []

    def pending_starts(self, job_ids: Iterable[int]) -> dict[int, datetime | None]:
        """Always {}: local jobs start at once, none is pending."""
        return {}

    def test_only(self, job: JobScript, *, runner: Any = None) -> tuple[datetime | None, str | None]:
        """Now, on this machine: local jobs start at once."""
        return _now(), NODE

    def running_gpus(self, account: str) -> list[tuple[int, str, int, datetime | None]]:
        """Always []: local mode has no QOS limits to count GPUs against."""
        return []

    def drained_nodes(self) -> list[rec.DrainedNode]:
        """Always []: local mode has no nodes to drain."""
        return []

    def sshare(self) -> list[rec.ShareRecord]:
        """Always []: local mode has no fairshare."""
        return []

    def sacct(self, start: datetime, end: datetime, *, accounts: Any = None) -> list[rec.AcctRecord]:
        """Always []: local mode has no accounting."""
        return []

    # ------------------------------------------------------------ helpers
    def _state(self, jid: int) -> JobStatus:
        folder = self.root / str(jid)
        meta = _read_json(folder / "meta.json")
        if meta is None:
            return JobStatus(jid, None, None, "missing")
        job = self._jobs.get(jid)
        if job is not None and job.state != "RUNNING":   # submitit's own word for a live LocalJob
            self._jobs.pop(jid, None)         # reaped by submitit's poll
        done = _read_json(folder / "exit.json")
        cancelled = (folder / "cancel").exists()
        submitted, account = _iso(meta.get("submit")), str(meta.get("account"))
        if done is None and self._alive(folder / "pid"):
            q = rec.QueueRecord(jid, S.RUNNING, None, self._user(), account, QOS, submitted, submitted, NODE, 0)
            return JobStatus(jid, S.RUNNING, None, "squeue", queue=q)
        rc = done.get("rc") if done else None
        if cancelled:
            state = S.CANCELLED
        elif rc == exitcodes.OK:
            state = S.COMPLETED
        elif rc == exitcodes.REQUEUE:   # checkpointed on the time-limit warning (requeued on the cluster)
            state = S.TIMEOUT
        else:
            state = S.FAILED
        code = (rc, 0) if isinstance(rc, int) and rc >= 0 else (0, -rc if isinstance(rc, int) else 9)
        reason = None if done else "the job's processes ended without an exit status"
        a = rec.AcctRecord(str(jid), jid, self._user(), account, QOS, state, code, reason, submitted,
                           submitted, submitted, _iso(done.get("end")) if done else None, None, "", "", NODE, None)
        return JobStatus(jid, state, reason, "sacct", acct=a)

    @staticmethod
    def _user() -> str:
        return pwd.getpwuid(os.getuid()).pw_name

    @staticmethod
    def _pid(path: Path) -> int | None:
        try:
            raw = path.read_text().strip()
        except OSError:
            return None
        return int(raw) if raw.isdigit() and int(raw) > 1 else None

    def _alive(self, pid_file: Path, *, session: bool = False) -> bool:
        """Whether the process in ``pid_file`` still runs (its command line naming this job's
        folder, so a reused pid does not count), or with ``session`` any process of the session
        it leads (the trainer's); a zombie counts as ended."""
        pid = self._pid(pid_file)
        if pid is None:
            return False
        if not session:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                return False
            return str(pid_file.parent).encode() in cmdline and _stat(Path(f"/proc/{pid}"))[0] != "Z"
        for proc in Path("/proc").glob("[0-9]*"):
            fields = _stat(proc)
            if fields[0] != "Z" and int(fields[3]) == pid:     # fields[3]: the session id
                return True
        return False

    def _signal(self, pid_file: Path, sig: int, *, group: bool = False) -> None:
        pid = self._pid(pid_file)
        if pid is None:
            return
        try:
            os.killpg(pid, sig) if group else os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _stat(proc: Path) -> list[str]:
    """``/proc/<pid>/stat`` after the command name: [state, ppid, pgrp, session, ...]."""
    try:
        fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ["Z", "0", "0", "0"]
    return fields if len(fields) > 3 else ["Z", "0", "0", "0"]


def _iso(raw: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(raw) if isinstance(raw, str) else None
    except ValueError:
        return None


def prepare(settings: Settings) -> None:
    """Refuse root, then make the data dir's folders (0700, the invoking user's)."""
    check_not_root()
    for d in (settings.state_dir, settings.storage_root, settings.models_root):
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
