"""The Slurm client: every Slurm operation the platform performs.

All reads come from parsable CLI output parsed into ``records``; all commands go
through one ``Runner`` (local or SSH). ``states`` answers for any number of jobs
with ONE squeue call plus at most ONE sacct call: the gateway never polls per job.

pyslurm seam: the read methods (``states``, ``sacct``, ``sshare``,
``drained_nodes``) only need records; a pyslurm-backed reader can replace them
on clusters whose libslurm matches a PyPI pyslurm release. Debian 12 ships Slurm
22.05, for which PyPI has no pyslurm build, so none is provided here
(``pyslurm_status`` says so instead of pretending).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from gateway.jobs.state import SLURM_ACTIVE, state_word
from gateway.jobs.state import SlurmState as S
from gateway.slurm import records as rec
from gateway.slurm.render import JobScript, render_array, render_sbatch
from gateway.slurm.runner import DEFAULT_TIMEOUT_S, CommandResult, Runner, SlurmCommandError
from gateway.slurm.validate import validate_job_name, validate_unix_name

ACTIVE_STATES = SLURM_ACTIVE    # states in which a job may still own processes on a node


def _failed_state(state: str | None) -> bool:
    """Whether a squeue state word says the job ended, and not as COMPLETED."""
    word = state_word(state or "")
    return bool(word) and word not in ACTIVE_STATES and word != S.COMPLETED


@dataclass(frozen=True)
class JobStatus:
    """What Slurm says about one job right now.

    ``source`` is ``squeue`` (still known to slurmctld), ``sacct`` (left the
    queue; from the accounting DB) or ``missing`` (not yet visible anywhere:
    never treat that as a failure).
    """

    job_id: int
    state: str | None
    reason: str | None
    source: str
    queue: rec.QueueRecord | None = None
    acct: rec.AcctRecord | None = None

    @property
    def active(self) -> bool:
        """Whether the job may still own processes: an active Slurm state, or not visible yet (``missing``)."""
        return self.source == "missing" or (self.state in ACTIVE_STATES)


@dataclass(frozen=True)
class CancelResult:
    job_id: int
    seconds: float          # scancel → no process of the job left
    escalated: bool         # SIGKILL had to be sent after the deadline
    final_state: str | None


def pyslurm_status() -> str:
    """Why the pyslurm read path is not used on this installation."""
    try:
        import pyslurm  # type: ignore[import-not-found]  # noqa: F401
    except ImportError as e:
        return f"unavailable: {e} (PyPI has no pyslurm build for this Slurm; CLI reads are used)"
    return "importable, but not wired: CLI reads are used"


_TEST_ONLY = re.compile(r"to start at (\S+) using \d+ processors on nodes (\S+)")


def _slurm_time(t: datetime) -> str:
    """Slurm takes local wall-clock time without a zone."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


class SlurmClient:
    """Slurm operations over a Runner. Methods raise SlurmCommandError with Slurm's text."""

    def __init__(self, runner: Runner, *, timeout: float = DEFAULT_TIMEOUT_S):
        self.runner = runner
        self.timeout = timeout

    def _run(self, argv: Sequence[str], *, input: str | None = None) -> CommandResult:
        return self.runner.run(argv, timeout=self.timeout, input=input)

    # ------------------------------------------------------------- writes
    def submit(self, job: JobScript, *, user: str | None = None, group: str | None = None,
               runner: Runner | None = None) -> int:
        """Submit ``job`` with ``--export=NONE`` (the job gets only what its script sets, never the
        gateway's environment). ``runner`` runs sbatch as the tenant (the storage broker's
        ``TenantRunner``); without one, a root runner (e.g. over SSH) submits with ``--uid``.

        Returns the Slurm job id. Raises SlurmCommandError with sbatch's message
        (e.g. ``Invalid account or account/partition combination specified``).
        """
        return self._sbatch(render_sbatch(job), user=user, group=group, runner=runner)

    def submit_array(self, jobs: Sequence[JobScript], *, name: str, user: str | None = None,
                     group: str | None = None, runner: Runner | None = None) -> int:
        """Submit ``jobs`` as the tasks of ONE job array named ``name``, held (``render_array``), as
        ``submit`` does; returns the array's job id. Name each task (``name_task``), then release it."""
        return self._sbatch(render_array(jobs, name=name), user=user, group=group, runner=runner)

    def _sbatch(self, script: str, *, user: str | None, group: str | None, runner: Runner | None) -> int:
        argv = ["sbatch", "--parsable", "--export=NONE"]
        if user is not None and runner is None:
            argv += ["--uid", validate_unix_name(user), "--gid", validate_unix_name(group or user)]
        out = (runner or self.runner).run(argv, input=script, timeout=self.timeout).check().stdout.strip()
        try:
            return int(out.splitlines()[-1].split(";")[0])
        except (ValueError, IndexError) as e:
            raise SlurmCommandError(argv, 0, f"unexpected sbatch output: {out!r}") from e

    def _address(self, job_id: int, status: JobStatus | None = None) -> str:
        """How scontrol/scancel name ``job_id`` (``<array id>_<task>`` for a job array's task)."""
        status = status or self.states([job_id])[job_id]
        return status.queue.control_id if status.queue is not None else str(int(job_id))

    def requeue(self, job_id: int) -> None:
        """``scontrol requeue`` the job; SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "requeue", self._address(job_id)]).check()

    def pause(self, job_id: int) -> str | None:
        """Hold ``job_id`` (an operator hold: its owner cannot release it) and, if it runs, send its
        batch script SIGUSR1, the "checkpoint and requeue" signal: the trainer checkpoints after the
        step it is in, exits 75, the script requeues the job and the hold keeps it pending. Returns
        the Slurm state it found; None when the job is already gone. Idempotent."""
        status = self.states([job_id])[job_id]
        if not status.active:
            return None
        jid = self._address(job_id, status)
        self._run(["scontrol", "hold", jid]).check()
        if status.state in (S.RUNNING, S.CONFIGURING):
            self._run(["scancel", "--signal=USR1", "--batch", jid])   # ended meanwhile: nothing to signal
        return status.state

    def release(self, job_id: int) -> None:
        """Release the hold of ``job_id`` (``scontrol release``): it queues again and resumes from its
        newest checkpoint when it starts. SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "release", self._address(job_id)]).check()

    def cancel(self, job_id: int, *, deadline_s: float = 30.0, poll_s: float = 0.25,
               kill_wait_s: float = 60.0) -> CancelResult:
        """Cancel ``job_id`` within ``deadline_s``: SIGTERM now, SIGKILL once it passes.

        A running job's batch script gets SIGUSR2 (the platform's "cancel"), which
        it turns into SIGTERM for the trainer while the job stays RUNNING: a plain
        ``scancel`` would leave escalation to Slurm's ``KillWait`` (a CANCELLED job
        takes no further signals), and a plain SIGTERM could not be told from
        Slurm's own (requeue, time limit). The batch script then records the job
        CANCELLED itself; a job that needed SIGKILL ends FAILED (signal 9). A pending job is simply
        cancelled. Returns when Slurm reports no process of the job left, with
        how long that took. Raises SlurmCommandError if even SIGKILL does not
        end it within ``kill_wait_s``.
        """
        start = time.monotonic()
        status = self.states([job_id])[job_id]
        jid = self._address(job_id, status)
        if status.state in (S.RUNNING, S.SUSPENDED, S.CONFIGURING):
            res = self._run(["scancel", "--signal=USR2", "--batch", jid])
            if res.returncode != 0:  # ended or not yet started meanwhile
                self._run(["scancel", jid])
        elif status.active:
            self._run(["scancel", jid]).check()
        escalated = False
        last_term = time.monotonic()
        while True:
            status = self.states([job_id])[job_id]
            if not status.active:
                return CancelResult(job_id, time.monotonic() - start, escalated, status.state)
            elapsed = time.monotonic() - start
            if status.state in (S.RUNNING, S.CONFIGURING) and not escalated \
                    and time.monotonic() - last_term >= 1.0:
                # A job still in its prolog drops signals: repeat the cancel signal
                # (harmless: the trainer only sets a flag) until the deadline.
                self._run(["scancel", "--signal=USR2", "--batch", jid])
                last_term = time.monotonic()
            elif status.state == S.PENDING:
                self._run(["scancel", jid])  # requeued meanwhile: nothing to signal
            if not escalated and elapsed >= deadline_s:
                # KILL to the batch step: its cgroup takes every process with it.
                # (``--full`` with KILL is a plain cancel in Slurm: KillWait again.)
                self._run(["scancel", "--signal=KILL", "--batch", jid])
                escalated = True
            if elapsed >= deadline_s + kill_wait_s:
                raise SlurmCommandError(["scancel", jid], 0,
                                        f"job {jid} still {status.state} {elapsed:.0f}s after cancel")
            time.sleep(poll_s)

    # -------------------------------------------------------------- reads
    def queue(self, job_ids: Iterable[int] | None = None) -> list[rec.QueueRecord]:
        """squeue records (all jobs, or these ids) in ONE call."""
        argv = ["squeue", "--noheader", "--states=all",
                "--format=" + rec.format_string(rec.SQUEUE_FIELDS)]
        if job_ids is not None:
            ids = sorted({int(j) for j in job_ids})
            if not ids:
                return []
            argv.append("--jobs=" + ",".join(map(str, ids)))
        res = self._run(argv)
        if res.returncode != 0 and "Invalid job id" in res.stderr:
            return []  # every id already left slurmctld's memory
        return rec.parse_squeue(res.check().stdout)

    def test_only(self, job: JobScript, *, runner: Runner | None = None) -> tuple[datetime | None, str | None]:
        """When Slurm would start ``job`` now (``sbatch --test-only``: nothing is submitted) and on which
        nodes. Slurm's answer weighs resources and priority, not QOS limits. SlurmCommandError if refused."""
        script = render_sbatch(job).replace("#!/bin/bash\n", "#!/bin/bash\n#SBATCH --test-only\n", 1)
        res = (runner or self.runner).run(["sbatch", "--parsable", "--export=NONE"], input=script,
                                          timeout=self.timeout).check()
        m = _TEST_ONLY.search(res.stderr + res.stdout)
        if not m:
            raise SlurmCommandError(["sbatch", "--test-only"], 0, f"unexpected answer: {res.stderr[-300:]!r}")
        return rec.opt_time(m.group(1)), m.group(2)

    def running_gpus(self, account: str) -> list[tuple[int, str, int, datetime | None]]:
        """The account's running jobs as (job id, QOS, GPUs, expected end), in ONE squeue call."""
        res = self._run(["squeue", "--noheader", "--states=RUNNING,CONFIGURING",
                         f"--account={validate_unix_name(account)}",
                         f"--format=%A{rec.DELIM}%q{rec.DELIM}%b{rec.DELIM}%e"]).check()
        out = []
        for line in res.stdout.splitlines():
            parts = line.split(rec.DELIM)
            if len(parts) == 4 and parts[0].strip().isdigit():
                out.append((int(parts[0]), parts[1], rec.gres_gpu_count(parts[2]), rec.opt_time(parts[3])))
        return out

    def pending_starts(self, job_ids: Iterable[int]) -> dict[int, datetime | None]:
        """Slurm's expected start of each pending job among ``job_ids`` (``squeue --start``: None while the
        scheduler has not planned it), in ONE call."""
        ids = sorted({int(j) for j in job_ids})
        if not ids:
            return {}
        res = self._run(["squeue", "--noheader", "--start", "--jobs=" + ",".join(map(str, ids)),
                         f"--format=%A{rec.DELIM}%S"])
        if res.returncode != 0:
            return {}
        out: dict[int, datetime | None] = {}
        for line in res.stdout.splitlines():
            parts = line.split(rec.DELIM)
            if len(parts) == 2 and parts[0].strip().isdigit() and int(parts[0]) in ids:
                try:
                    out[int(parts[0])] = rec.opt_time(parts[1])
                except rec.SlurmParseError:
                    out[int(parts[0])] = None
        return out

    def array_tasks(self, array_id: int) -> dict[int, rec.QueueRecord]:
        """The tasks of job array ``array_id`` still in the queue, by task index (ONE squeue call)."""
        argv = ["squeue", "--noheader", "--states=all", "--array", f"--jobs={int(array_id)}",
                "--format=" + rec.format_string(rec.SQUEUE_FIELDS)]
        res = self._run(argv)
        if res.returncode != 0 and "Invalid job id" in res.stderr:
            return {}
        return {q.array_task: q for q in rec.parse_squeue(res.check().stdout)
                if q.array_job_id == array_id and q.array_task is not None}

    def name_task(self, array_id: int, task: int, name: str) -> None:
        """Name task ``task`` of array ``array_id`` (``scontrol update``): the task gets a job record,
        and so a job id, of its own. SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "update", f"jobid={int(array_id)}_{int(task)}",
                   f"name={validate_job_name(name)}"]).check()

    def release_task(self, array_id: int, task: int) -> None:
        """Release the hold of one task of a held array. SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "release", f"{int(array_id)}_{int(task)}"]).check()

    def find_by_name(self, names: Iterable[str]) -> dict[str, int]:
        """Slurm job ids by job name, in ONE squeue call (+ ONE sacct call for the rest).

        Used to adopt a job whose sbatch succeeded but whose id was never recorded."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        argv = ["squeue", "--noheader", "--states=all", "--name=" + ",".join(wanted),
                "--format=" + rec.format_string(rec.SQUEUE_FIELDS)]
        found = {q.name: q.job_id for q in rec.parse_squeue(self._run(argv).check().stdout)}
        rest = [n for n in wanted if n not in found]
        if rest:
            argv = self._sacct_argv(duplicates=False) + ["--name=" + ",".join(rest),
                                                         "--starttime=now-7days"]
            for a in rec.parse_sacct(self._run(argv).check().stdout):
                found.setdefault(a.name, a.job_id_raw)
        return found

    def accounting(self, job_ids: Iterable[int], *, duplicates: bool = False) -> list[rec.AcctRecord]:
        """sacct job rows for these ids in ONE call (``duplicates``: every requeued run)."""
        ids = sorted({int(j) for j in job_ids})
        if not ids:
            return []
        argv = self._sacct_argv(duplicates=duplicates) + ["--jobs=" + ",".join(map(str, ids))]
        return rec.parse_sacct(self._run(argv).check().stdout)

    def states(self, job_ids: Iterable[int]) -> dict[int, JobStatus]:
        """Current state of every id: ONE squeue call, plus ONE sacct call for the ids not in it and the
        ones squeue shows ended unsuccessfully (squeue keeps an ended job a while, without its exit code:
        the failure's cause, e.g. the trainer's user error 65, is in its accounting record)."""
        ids = sorted({int(j) for j in job_ids})
        out: dict[int, JobStatus] = {}
        for q in self.queue(ids):
            if q.job_id in ids:
                out[q.job_id] = JobStatus(q.job_id, q.state, q.pending_reason, "squeue", queue=q)
        ask = [j for j in ids if j not in out or _failed_state(out[j].state)]
        if ask:
            for a in self.accounting(ask):
                if a.job_id_raw not in ask:
                    continue
                known = out.get(a.job_id_raw)
                if known is None:
                    out[a.job_id_raw] = JobStatus(a.job_id_raw, a.state, a.reason, "sacct", acct=a)
                elif a.exit:              # squeue's state stays; accounting adds the exit code
                    out[a.job_id_raw] = JobStatus(known.job_id, known.state, known.reason, known.source,
                                                  queue=known.queue, acct=a)
        for j in ids:
            out.setdefault(j, JobStatus(j, None, None, "missing"))
        return out

    def history(self, job_id: int) -> list[rec.AcctRecord]:
        """Every run of one job (requeues included), oldest first."""
        return self.accounting([job_id], duplicates=True)

    def sacct(self, start: datetime, end: datetime, *,
              accounts: Sequence[str] | None = None) -> list[rec.AcctRecord]:
        """All job runs (requeues included) overlapping [start, end)."""
        argv = self._sacct_argv(duplicates=True) + [
            "--allusers", "--starttime=" + _slurm_time(start), "--endtime=" + _slurm_time(end)]
        if accounts:
            argv.append("--accounts=" + ",".join(validate_unix_name(a) for a in accounts))
        return rec.parse_sacct(self._run(argv).check().stdout)

    def sshare(self) -> list[rec.ShareRecord]:
        """Fairshare rows for every account and user (``sshare --all``)."""
        argv = ["sshare", "--all", "--noheader", "--parsable2",
                "--format=" + rec.field_names(rec.SSHARE_FIELDS)]
        return rec.parse_sshare(self._run(argv).check().stdout)

    def drained_nodes(self) -> list[rec.DrainedNode]:
        """Nodes that are down, drained or failing, with the reason and who set it (``sinfo --list-reasons``)."""
        argv = ["sinfo", "--list-reasons", "--Node", "--noheader",
                "--format=" + rec.format_string(rec.SINFO_R_FIELDS)]
        return rec.parse_sinfo_r(self._run(argv).check().stdout)

    @staticmethod
    def _sacct_argv(*, duplicates: bool) -> list[str]:
        argv = ["sacct", "--noheader", "--parsable2", f"--delimiter={rec.DELIM}",
                "--allocations", "--format=" + rec.field_names(rec.SACCT_FIELDS)]
        if duplicates:
            argv.append("--duplicates")
        return argv
