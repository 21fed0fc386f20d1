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

import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from gateway.errors import SlurmError
from gateway.slurm import records as rec
from gateway.slurm.render import JobScript, render_array, render_sbatch
from gateway.slurm.runner import DEFAULT_TIMEOUT_S, CommandResult, Runner, SlurmCommandError
from gateway.slurm.validate import validate_job_name, validate_unix_name
from gateway.state import SLURM_ACTIVE, state_word
from gateway.state import SlurmState as S

log = logging.getLogger(__name__)

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
    problem: str | None = None      # ``invalid``: why this job's records cannot be trusted this time

    @property
    def active(self) -> bool:
        """Whether the job may still own processes: an active Slurm state, or not visible yet (``missing``)
        or its records not readable (``invalid``): neither is ever taken for an ending."""
        return self.source in ("missing", "invalid") or (self.state in ACTIVE_STATES)

    def owner_problem(self, owner: rec.Owner) -> str | None:
        """Why this job cannot be acted on for ``owner``: its records are invalid, or they are another
        user's or account's (a recorded id that is not the tenant's job). None: act on it."""
        if self.problem is not None:
            return self.problem
        record: rec.QueueRecord | rec.AcctRecord | None = self.queue or self.acct
        if record is None:
            return None
        return owner.problem(record.user, record.account)


class NotOurs(SlurmError):
    """A Slurm job id that is not the owner's job (another tenant's, or records that cannot be trusted):
    nothing was done to it."""


def _only(records: Iterable[rec.QueueRecord | rec.AcctRecord], key: Callable[[Any], int]) -> tuple[
        dict[int, Any], set[int]]:
    """Records by ``key``, and the keys seen more than once (a forged or broken record: trust neither)."""
    out: dict[int, Any] = {}
    dup: set[int] = set()
    for r in records:
        k = key(r)
        if k in out:
            dup.add(k)
        out[k] = r
    return out, dup


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


SUBMIT_SLACK_S = 30.0
"""How much earlier than the request a job's Submit time may read (clock skew, whole seconds)."""

_TEST_ONLY = re.compile(r"to start at (\S+) using \d+ processors on nodes (\S+)")


def _slurm_time(t: datetime) -> str:
    """Slurm takes local wall-clock time without a zone."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.astimezone().strftime("%Y-%m-%dT%H:%M:%S")


class SlurmClient:
    """Slurm operations over a Runner. Methods raise SlurmCommandError with Slurm's text.

    Every id the client acts on is checked against an ``Owner`` (the tenant's user and account)
    first; ``scancel`` also carries the owner as Slurm's own filters. An id that ``sbatch`` printed
    is a claim (sbatch runs as the tenant, who may rewrite what it prints) until the client's own
    query confirms it (``_confirm``)."""

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
        ``TenantRunner``; ``user`` then names that tenant's unix user); without one, a root runner
        (e.g. over SSH) submits with ``--uid``.

        Returns the Slurm job id, confirmed by the client's own squeue: the job of that id is
        ``user``'s, in the script's account, named as the script names it and submitted after this
        call began; otherwise the one job Slurm has under that name and owner, submitted since.
        Raises SlurmCommandError with sbatch's message (e.g. ``Invalid account or account/partition
        combination specified``), or when no job can be confirmed (any under the name are cancelled).
        """
        since = datetime.now(UTC)
        claimed = self._sbatch(render_sbatch(job), user=user, group=group, runner=runner)
        owner = rec.Owner(user, job.account)
        return self._confirm(claimed, job.job_name, owner, since, array=False)

    def submit_array(self, jobs: Sequence[JobScript], *, name: str, user: str | None = None,
                     group: str | None = None, runner: Runner | None = None) -> int:
        """Submit ``jobs`` as the tasks of ONE job array named ``name``, held (``render_array``), as
        ``submit`` does, and confirmed the same way; returns the array's job id. Name each task
        (``name_task``), then release it."""
        since = datetime.now(UTC)
        claimed = self._sbatch(render_array(jobs, name=name), user=user, group=group, runner=runner)
        return self._confirm(claimed, name, rec.Owner(user, jobs[0].account), since, array=True)

    def submit_named_array(self, jobs: Sequence[JobScript], *, name: str, task_names: Sequence[str],
                           user: str | None = None, runner: Runner | None = None) -> tuple[int, list[int]]:
        """Submit ``jobs`` as ONE held job array named ``name`` (``submit_array``), name task ``i``
        ``task_names[i]`` (which gives it a job id of its own), check that Slurm shows every task, then
        release them; returns (array id, each task's job id). On any failure after sbatch the whole
        array is cancelled before the error is raised: no task runs unrecorded. A caller that dies
        between sbatch and naming leaves a held array named ``name`` behind (nothing runs):
        ``cancel_unnamed_tasks`` finds it."""
        owner = rec.Owner(user, jobs[0].account)
        array_id = self.submit_array(jobs, name=name, user=user, runner=runner)   # confirmed ours
        try:
            for task, task_name in enumerate(task_names):
                self.name_task(array_id, task, task_name)
            tasks = self.array_tasks(array_id, owner=owner)
            if sorted(tasks) != list(range(len(jobs))):
                raise SlurmCommandError(["squeue", "--array", f"--jobs={array_id}"], 0,
                                        f"array {array_id} shows tasks {sorted(tasks)}, not 0-{len(jobs) - 1}")
            ids = [tasks[task].job_id for task in range(len(jobs))]
            for task in range(len(jobs)):
                self.release_task(array_id, task)
        except BaseException:
            self.cancel_array(array_id, owner=owner)
            raise
        return array_id, ids

    def _sbatch(self, script: str, *, user: str | None, group: str | None, runner: Runner | None) -> int:
        argv = ["sbatch", "--parsable", "--export=NONE"]
        if user is not None and runner is None:
            argv += ["--uid", validate_unix_name(user), "--gid", validate_unix_name(group or user)]
        out = (runner or self.runner).run(argv, input=script, timeout=self.timeout).check().stdout.strip()
        try:
            return int(out.splitlines()[-1].split(";")[0])
        except (ValueError, IndexError) as e:
            raise SlurmCommandError(argv, 0, f"unexpected sbatch output: {out[:200]!r}") from e

    def _confirm(self, claimed: int, name: str, owner: rec.Owner, since: datetime, *, array: bool) -> int:
        """The id of the job just submitted as ``name`` for ``owner``, from squeue, never from sbatch's
        answer alone. ``claimed`` is taken when Slurm shows that id under this name and owner,
        submitted since ``since``; else the single such job under the name (logged: sbatch's answer
        was not the truth); else every such job is cancelled and SlurmCommandError raised."""
        after = since - timedelta(seconds=SUBMIT_SLACK_S)
        mine = ["--name=" + validate_job_name(name), *owner.squeue_filters()] + (["--array"] if array else [])
        fresh = [q for q in self._queue_where(mine + [f"--jobs={int(claimed)}"])
                 if q.submit is not None and q.submit >= after and owner.problem(q.user, q.account) is None]
        ids = {q.array_job_id if array and q.array_job_id is not None else q.job_id for q in fresh}
        if ids == {claimed}:
            return claimed
        found = {q.array_job_id if array and q.array_job_id is not None else q.job_id
                 for q in self._queue_where(mine)
                 if q.submit is not None and q.submit >= after and owner.problem(q.user, q.account) is None}
        if len(found) == 1:
            real = found.pop()
            log.warning("sbatch answered job %d, but Slurm has %s's job %s as %d: recorded %d (the tenant's "
                        "sbatch printed something else)", claimed, owner.account, name, real, real)
            return real
        for jid in sorted(found):
            self._run(["scancel", *owner.squeue_filters(), str(jid)])
        raise SlurmCommandError(["sbatch"], 0, f"sbatch answered job {claimed}, which is not {owner.account}'s "
                                f"new job {name}, and Slurm shows {len(found)} such jobs (cancelled): "
                                "submission refused")

    def _address(self, job_id: int, owner: rec.Owner, status: JobStatus | None = None) -> str:
        """How scontrol/scancel name ``job_id`` (``<array id>_<task>`` for a job array's task), once its
        record shows it is ``owner``'s job. NotOurs (nothing done) otherwise."""
        status = status or self.states([job_id])[job_id]
        if (problem := status.owner_problem(owner)) is not None:
            raise NotOurs(f"Slurm job {int(job_id)} is not {owner.account}'s job ({problem}): not touched")
        return status.queue.control_id if status.queue is not None else str(int(job_id))

    def _scancel(self, owner: rec.Owner, jid: str, *options: str) -> CommandResult:
        """scancel with the owner as Slurm's own filter: a job that is not the owner's is left alone."""
        return self._run(["scancel", *options, *owner.squeue_filters(), jid])

    def requeue(self, job_id: int, *, owner: rec.Owner) -> None:
        """``scontrol requeue`` the job (``owner``'s, else NotOurs); SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "requeue", self._address(job_id, owner)]).check()

    def pause(self, job_id: int, *, owner: rec.Owner) -> str | None:
        """Hold ``job_id`` (an operator hold: its owner cannot release it) and, if it runs, send its
        batch script SIGUSR1, the "checkpoint and requeue" signal: the trainer checkpoints after the
        step it is in, exits REQUEUE, the script requeues the job and the hold keeps it pending. Returns
        the Slurm state it found; None when the job is already gone. Idempotent. NotOurs when the
        job is not ``owner``'s."""
        status = self.states([job_id])[job_id]
        if not status.active:
            return None
        jid = self._address(job_id, owner, status)
        self._run(["scontrol", "hold", jid]).check()
        if status.state in (S.RUNNING, S.CONFIGURING):
            self._scancel(owner, jid, "--signal=USR1", "--batch")   # ended meanwhile: nothing to signal
        return status.state

    def release(self, job_id: int, *, owner: rec.Owner) -> None:
        """Release the hold of ``job_id`` (``scontrol release``): it queues again and resumes from its
        newest checkpoint when it starts. NotOurs for another owner's job; SlurmCommandError when
        Slurm refuses."""
        self._run(["scontrol", "release", self._address(job_id, owner)]).check()

    def cancel(self, job_id: int, *, owner: rec.Owner, deadline_s: float = 30.0, poll_s: float = 0.25,
               kill_wait_s: float = 60.0) -> CancelResult:
        """Cancel ``job_id`` (``owner``'s job, else NotOurs) within ``deadline_s``: SIGTERM now, SIGKILL
        once it passes.

        A running job's batch script gets SIGUSR2 (the platform's "cancel"), which
        it turns into SIGTERM for the trainer while the job stays RUNNING: a plain
        ``scancel`` would leave escalation to Slurm's ``KillWait`` (a CANCELLED job
        takes no further signals), and a plain SIGTERM could not be told from
        Slurm's own (requeue, time limit). The batch script then records the job
        CANCELLED itself, killing a trainer still running ``cancel_grace_s`` after the first USR2 (a
        script that cannot, and needs this KILL to its batch step, ends FAILED, signal 9). A pending job is simply
        cancelled. Returns when Slurm reports no process of the job left, with
        how long that took. Raises SlurmCommandError if even SIGKILL does not
        end it within ``kill_wait_s``.
        """
        start = time.monotonic()
        status = self.states([job_id])[job_id]
        jid = self._address(job_id, owner, status)
        if status.state in (S.RUNNING, S.SUSPENDED, S.CONFIGURING):
            res = self._scancel(owner, jid, "--signal=USR2", "--batch")
            if res.returncode != 0:  # ended or not yet started meanwhile
                self._scancel(owner, jid)
        elif status.active:
            self._scancel(owner, jid).check()
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
                self._scancel(owner, jid, "--signal=USR2", "--batch")
                last_term = time.monotonic()
            elif status.state == S.PENDING:
                self._scancel(owner, jid)  # requeued meanwhile: nothing to signal
            if not escalated and elapsed >= deadline_s:
                # KILL to the batch step: its cgroup takes every process with it.
                # (``--full`` with KILL is a plain cancel in Slurm: KillWait again.)
                self._scancel(owner, jid, "--signal=KILL", "--batch")
                escalated = True
            if elapsed >= deadline_s + kill_wait_s:
                raise SlurmCommandError(["scancel", jid], 0,
                                        f"job {jid} still {status.state} {elapsed:.0f}s after cancel")
            time.sleep(poll_s)

    def cancel_array(self, array_id: int, *, owner: rec.Owner) -> None:
        """Cancel every task of ``owner``'s job array ``array_id`` (a submission that failed midway);
        Slurm's owner filter leaves another owner's array alone."""
        self._scancel(owner, str(int(array_id)))

    def cancel_task(self, task: rec.QueueRecord, *, owner: rec.Owner) -> None:
        """Cancel one task of a job array (a never-named task of an interrupted sweep), ``owner``'s only."""
        if owner.problem(task.user, task.account) is None:
            self._scancel(owner, task.control_id)

    def cancel_unnamed_tasks(self, arrays: Mapping[str, rec.Owner]) -> list[tuple[str, int, int]]:
        """Cancel the tasks of the arrays named as ``arrays``' keys (each among its owner's jobs) that
        still carry the array's name: never named after their job (``submit_named_array`` was cut
        short), they were held and never ran. Returns (array name, task, array id) of each."""
        cancelled: list[tuple[str, int, int]] = []
        for name, array_id in (self.find_by_name(arrays) if arrays else {}).items():
            for task, q in self.array_tasks(array_id, owner=arrays[name], name=name).items():
                log.warning("array %s: cancelling task %d of array %d (never named after its job)",
                            name, task, array_id)
                self.cancel_task(q, owner=arrays[name])
                cancelled.append((name, task, array_id))
        return cancelled

    # -------------------------------------------------------------- reads
    def ping(self, timeout: float = 10.0) -> bool:
        """Whether slurmctld answers (``scontrol ping``) through this client's runner."""
        try:
            return self.runner.run(["scontrol", "ping"], timeout=timeout).returncode == 0
        except SlurmError:
            return False

    def _queue_where(self, selection: Sequence[str]) -> rec.Rows[rec.QueueRecord]:
        """squeue records matching ``selection`` (squeue options) in ONE call; none when Slurm knows
        none of the ids asked for."""
        argv = ["squeue", "--noheader", "--states=all", "--format=" + rec.format_string(rec.SQUEUE_FIELDS),
                *selection]
        res = self._run(argv)
        if res.returncode != 0 and "Invalid job id" in res.stderr:
            return rec.Rows()  # every id already left slurmctld's memory
        rows = rec.parse_squeue(res.check().stdout)
        for bad in rows.skipped:
            log.warning("squeue: skipped a record that does not parse: %s", bad)
        return rows

    def queue(self, job_ids: Iterable[int] | None = None) -> rec.Rows[rec.QueueRecord]:
        """squeue records (all jobs, or these ids) in ONE call; ``skipped`` lists lines that did not parse."""
        if job_ids is None:
            return self._queue_where(())
        ids = sorted({int(j) for j in job_ids})
        if not ids:
            return rec.Rows()
        return self._queue_where(["--jobs=" + ",".join(map(str, ids))])

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

    def array_tasks(self, array_id: int, *, owner: rec.Owner, name: str | None = None) -> dict[int, rec.QueueRecord]:
        """The tasks of ``owner``'s job array ``array_id`` still in the queue (only those still named ``name``,
        when given), by task index, in ONE squeue call; another owner's array has none."""
        selection = ["--array", f"--jobs={int(array_id)}", *owner.squeue_filters()]
        if name is not None:
            selection.append("--name=" + validate_job_name(name))
        return {q.array_task: q for q in self._queue_where(selection)
                if q.array_job_id == array_id and q.array_task is not None
                and owner.problem(q.user, q.account) is None}

    def name_task(self, array_id: int, task: int, name: str) -> None:
        """Name task ``task`` of array ``array_id`` (``scontrol update``; the array was confirmed as
        the owner's at submission): the task gets a job record, and so a job id, of its own.
        SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "update", f"jobid={int(array_id)}_{int(task)}",
                   f"name={validate_job_name(name)}"]).check()

    def release_task(self, array_id: int, task: int) -> None:
        """Release the hold of one task of a held array (confirmed as the owner's at submission).
        SlurmCommandError when Slurm refuses."""
        self._run(["scontrol", "release", f"{int(array_id)}_{int(task)}"]).check()

    def find_by_name(self, wanted: Mapping[str, rec.Owner], *, since: datetime | None = None) -> dict[str, int]:
        """Slurm job ids by job name, each only among its owner's jobs submitted since ``since``: ONE
        squeue call per name (Slurm filters by name, so no name is ever printed or parsed), plus ONE
        sacct call per name squeue no longer knows. A name with several such jobs (its tenant may rename
        its own jobs) is left out, logged.

        Used to adopt a job whose sbatch succeeded but whose id was never recorded."""
        after = since - timedelta(seconds=SUBMIT_SLACK_S) if since is not None else None
        found: dict[str, int] = {}
        for name in sorted(wanted):
            owner = wanted[name]
            ids = {q.array_job_id if q.array_job_id is not None and q.array_task is None else q.job_id
                   for q in self._queue_where(["--name=" + validate_job_name(name), *owner.squeue_filters()])
                   if owner.problem(q.user, q.account) is None and (after is None or (q.submit or after) >= after)}
            if not ids:
                argv = self._sacct_argv(duplicates=False) + ["--name=" + name, *owner.sacct_filters(),
                                                             "--starttime=now-7days"]
                ids = {a.job_id_raw for a in self._sacct_rows(argv)
                       if owner.problem(a.user, a.account) is None and (after is None or (a.submit or after) >= after)}
            if len(ids) == 1:
                found[name] = ids.pop()
            elif ids:
                log.warning("job name %s: %s has %d jobs under it (renamed by the tenant?): none adopted",
                            name, owner.account, len(ids))
        return found

    def _sacct_rows(self, argv: list[str]) -> rec.Rows[rec.AcctRecord]:
        rows = rec.parse_sacct(self._run(argv).check().stdout)
        for bad in rows.skipped:
            log.warning("sacct: skipped a record that does not parse: %s", bad)
        return rows

    def accounting(self, job_ids: Iterable[int], *, duplicates: bool = False) -> rec.Rows[rec.AcctRecord]:
        """sacct job rows for these ids in ONE call (``duplicates``: every requeued run)."""
        ids = sorted({int(j) for j in job_ids})
        if not ids:
            return rec.Rows()
        return self._sacct_rows(self._sacct_argv(duplicates=duplicates) + ["--jobs=" + ",".join(map(str, ids))])

    def states(self, job_ids: Iterable[int]) -> dict[int, JobStatus]:
        """Current state of every id: ONE squeue call, plus ONE sacct call for the ids not in it and the
        ones squeue shows ended unsuccessfully (squeue keeps an ended job a while, without its exit code:
        the failure's cause, e.g. the trainer's user error 65, is in its accounting record).

        An id with two records, or named by a line that does not parse, is ``invalid`` this time: one
        job's bad record never fails the others, and never reads as that job's end."""
        ids = sorted({int(j) for j in job_ids})
        out: dict[int, JobStatus] = {}
        rows = self.queue(ids)
        queued, dup = _only(rows, lambda q: q.job_id)
        bad = dup | {b.job_id for b in rows.skipped if b.job_id is not None}
        for j, q in queued.items():
            if j in ids:
                out[j] = JobStatus(j, q.state, q.pending_reason, "squeue", queue=q)
        ask = [j for j in ids if j not in bad and (j not in out or _failed_state(out[j].state))]
        if ask:
            acct = self.accounting(ask)
            runs, adup = _only(acct, lambda a: a.job_id_raw)
            bad |= adup | {b.job_id for b in acct.skipped if b.job_id is not None}
            for j, a in runs.items():
                if j not in ask or j in bad:
                    continue
                known = out.get(j)
                if known is None:
                    out[j] = JobStatus(j, a.state, a.reason, "sacct", acct=a)
                elif a.exit:              # squeue's state stays; accounting adds the exit code
                    out[j] = JobStatus(known.job_id, known.state, known.reason, known.source,
                                       queue=known.queue, acct=a)
        for j in sorted(bad & set(ids)):
            out[j] = JobStatus(j, None, None, "invalid", problem="Slurm printed more than one record, or one "
                               "that does not parse, for this job")
        for j in ids:
            out.setdefault(j, JobStatus(j, None, None, "missing"))
        return out

    def history(self, job_id: int) -> list[rec.AcctRecord]:
        """Every run of one job (requeues included), oldest first."""
        return self.accounting([job_id], duplicates=True)

    def sacct(self, start: datetime, end: datetime, *,
              accounts: Sequence[str] | None = None) -> rec.Rows[rec.AcctRecord]:
        """All job runs (requeues included) overlapping [start, end); ``skipped``: records that did not parse."""
        argv = self._sacct_argv(duplicates=True) + [
            "--allusers", "--starttime=" + _slurm_time(start), "--endtime=" + _slurm_time(end)]
        if accounts:
            argv.append("--accounts=" + ",".join(validate_unix_name(a) for a in accounts))
        return self._sacct_rows(argv)

    def sshare(self) -> rec.Rows[rec.ShareRecord]:
        """Fairshare rows for every account and user (``sshare --all``)."""
        argv = ["sshare", "--all", "--noheader", "--parsable2",
                "--format=" + rec.field_names(rec.SSHARE_FIELDS)]
        return rec.parse_sshare(self._run(argv).check().stdout)

    def drained_nodes(self) -> rec.Rows[rec.DrainedNode]:
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
