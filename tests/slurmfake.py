"""FakeSlurm: an argv-level stand-in for Slurm's CLI, for fast unit tests only.

It answers sbatch / squeue / sacct / scancel / scontrol / sshare / sinfo in
exactly the formats the client asks for (it reads the client's ``--format``),
so the real parsers run in every unit test. It keeps jobs in memory and moves
them only when a test says so (``start``, ``finish``); ``ignores_term`` jobs
need SIGKILL. Job arrays (``--array=0-N``, ``--hold``) are tasks of their own job ids; as in
Slurm, the tasks no ``scontrol`` touched yet stay one record (``%K`` a range) unless squeue is
asked ``--array``, and an array's id names all its tasks. The slurm test tier runs the same
client against the real cluster.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

from gateway.slurm.records import DELIM
from gateway.slurm.runner import CommandResult


@dataclass
class FakeJob:
    job_id: int
    name: str
    user: str
    account: str
    qos: str
    gpus: int = 1
    state: str = "PENDING"
    reason: str = "Priority"
    submit: datetime = field(default_factory=lambda: datetime.now(UTC))
    start: datetime | None = None
    end: datetime | None = None
    exit: str = "0:0"
    ignores_term: bool = False
    in_queue: bool = True   # False: aged out of slurmctld; only sacct knows it
    script: str = ""
    array_id: int | None = None     # a job array's task: the array's id, the task's index
    task: int | None = None
    held: bool = False
    split: bool = False             # touched by scontrol (named, released): a record of its own


def _t(d: datetime | None) -> str:
    return d.astimezone().strftime("%Y-%m-%dT%H:%M:%S") if d else "Unknown"


class FakeSlurm:
    """A Runner. ``calls`` records every argv; ``accounts`` are the valid ones."""

    def __init__(self, accounts: Sequence[str] = ("acme", "beta")):
        self.jobs: dict[int, FakeJob] = {}
        self.calls: list[tuple[str, ...]] = []
        self.accounts = set(accounts)
        self.next_id = 1000
        self.fail_next: dict[str, tuple[int, str]] = {}  # command → (rc, stderr) once
        self.sbatch_prints: int | None = None   # a tampered sbatch: prints this id instead of its job's
        self.on_sbatch: Callable[[FakeJob], None] | None = None   # the tenant acts right after sbatch

    # -- test controls
    def start(self, job_id: int) -> None:
        """Move the job to RUNNING now."""
        j = self.jobs[job_id]
        j.state, j.reason, j.start = "RUNNING", "None", datetime.now(UTC)

    def finish(self, job_id: int, state: str = "COMPLETED", exit: str = "0:0") -> None:
        """End the job now in ``state`` with ``exit`` (sacct's ``code:signal``)."""
        j = self.jobs[job_id]
        j.state, j.exit, j.end = state, exit, datetime.now(UTC)

    def age_out(self, job_id: int) -> None:
        """Drop the job from squeue's view; sacct still reports it."""
        self.jobs[job_id].in_queue = False

    def count(self, command: str) -> int:
        """How many calls ran ``command`` (argv[0])."""
        return sum(1 for c in self.calls if c[0] == command)

    # -- the Runner interface
    def run(self, argv: Sequence[str], *, timeout: float = 60.0, input: str | None = None,
            env: Mapping[str, str] | None = None) -> CommandResult:
        """Answer ``argv`` as the Slurm command would; ``fail_next`` failures first; 127 for a command it lacks."""
        args = tuple(argv)
        self.calls.append(args)
        if args[0] in self.fail_next:
            rc, err = self.fail_next.pop(args[0])
            return CommandResult(args, rc, "", err, 0.0)
        handler = getattr(self, "_" + args[0], None)
        if handler is None:
            return CommandResult(args, 127, "", f"{args[0]}: command not found", 0.0)
        rc, out, err = handler(list(args[1:]), input or "")
        return CommandResult(args, rc, out, err, 0.0)

    # -- commands
    @staticmethod
    def _opt(args: list[str], name: str) -> str | None:
        for i, a in enumerate(args):
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
            if a == name and i + 1 < len(args):
                return args[i + 1]
        return None

    def _sbatch(self, args: list[str], script: str) -> tuple[int, str, str]:
        header = script.split("\n# Rendered by", 1)[0]      # an array's tasks carry their own scripts below
        directives = dict(re.findall(r"^#SBATCH --([a-z-]+)=?(.*)$", header, re.M))
        account = directives.get("account", "")
        if account not in self.accounts:
            return 1, "", ("sbatch: error: Batch job submission failed: Invalid account or "
                           "account/partition combination specified\n")
        jid = self.next_id
        gres = directives.get("gres", "gpu:1")
        tasks = [None] if "array" not in directives else list(range(int(directives["array"].split("-")[1]) + 1))
        self.next_id += len(tasks)
        for i, task in enumerate(tasks):
            self.jobs[jid + i] = FakeJob(
                jid + i, directives.get("job-name", "sbatch"), self._opt(args, "--uid") or "root",
                account, directives.get("qos", "normal"), int(gres.rsplit(":", 1)[-1]),
                script=script, array_id=None if task is None else jid, task=task, held="hold" in directives,
                reason="JobHeldUser" if "hold" in directives else "Priority")
        if self.on_sbatch is not None:
            self.on_sbatch(self.jobs[jid])
        return 0, f"{self.sbatch_prints if self.sbatch_prints is not None else jid}\n", ""

    def _ids(self, args: list[str]) -> list[int] | None:
        v = self._opt(args, "--jobs")
        return None if v is None else [int(x) for x in v.split(",")]

    def _records(self, jobs: list[FakeJob], one_per_task: bool) -> list[tuple[FakeJob, str]]:
        """(job, its %K) per squeue record: without ``--array`` an array's untouched pending tasks are one."""
        out: list[tuple[FakeJob, str]] = []
        together: dict[int, list[FakeJob]] = {}
        for j in jobs:
            if j.array_id is None:
                out.append((j, "N/A"))
            elif one_per_task or j.split or j.state != "PENDING":
                out.append((j, str(j.task)))
            else:
                together.setdefault(j.array_id, []).append(j)
        for tasks in together.values():
            first, last = min(j.task or 0 for j in tasks), max(j.task or 0 for j in tasks)
            # the array's own record: its id, whatever task ids split off it
            out.append((replace(tasks[0], job_id=tasks[0].array_id or 0),
                        f"{first}-{last}" if len(tasks) > 1 else str(first)))
        return out

    def _squeue(self, args: list[str], _: str) -> tuple[int, str, str]:
        fmt = (self._opt(args, "--format") or "").split(DELIM)
        ids = self._ids(args)
        names = self._opt(args, "--name")
        jobs = [j for j in self.jobs.values() if j.in_queue and (ids is None or j.job_id in ids or j.array_id in ids)
                and (names is None or j.name in names.split(",")) and self._owned(j, args, "--account")]
        if ids is not None and len(ids) == 1 and not jobs:
            return 1, "", "slurm_load_jobs error: Invalid job id specified\n"
        records = self._records(jobs, one_per_task="--array" in args)
        codes = {
            "%A": lambda j: str(j.job_id), "%T": lambda j: j.state,
            "%r": lambda j: j.reason if j.state == "PENDING" else "None",
            "%u": lambda j: j.user, "%a": lambda j: j.account, "%q": lambda j: j.qos,
            "%V": lambda j: _t(j.submit), "%S": lambda j: _t(j.start) if j.start else "N/A",
            "%N": lambda j: "node1" if j.start else "", "%j": lambda j: j.name,
            "%b": lambda j: f"gres:gpu:{j.gpus}", "%F": lambda j: str(j.array_id or j.job_id),
        }
        lines = [DELIM.join(task if c == "%K" else codes[c](j) for c in fmt) for j, task in records]
        return 0, "".join(line + "\n" for line in lines), ""

    def _sacct(self, args: list[str], _: str) -> tuple[int, str, str]:
        fields = (self._opt(args, "--format") or "").split(",")
        delim = self._opt(args, "--delimiter") or "|"
        ids = self._ids(args)
        names = self._opt(args, "--name")
        jobs = [j for j in self.jobs.values() if (ids is None or j.job_id in ids)
                and (names is None or j.name in names.split(",")) and self._owned(j, args, "--accounts")]
        values = {
            "JobID": lambda j: str(j.job_id) if j.array_id is None else f"{j.array_id}_{j.task}",
            "JobIDRaw": lambda j: str(j.job_id),
            "JobName": lambda j: j.name, "User": lambda j: j.user, "Account": lambda j: j.account,
            "QOS": lambda j: j.qos, "State": lambda j: j.state, "ExitCode": lambda j: j.exit,
            "Reason": lambda j: "None", "Submit": lambda j: _t(j.submit),
            "Eligible": lambda j: _t(j.submit), "Start": lambda j: _t(j.start),
            "End": lambda j: _t(j.end),
            "ElapsedRaw": lambda j: str(int(((j.end or datetime.now(UTC)) - j.start)
                                            .total_seconds()) if j.start else 0),
            "AllocTRES": lambda j: f"cpu=1,gres/gpu={j.gpus},node=1" if j.start else "",
            "ReqTRES": lambda j: f"cpu=1,gres/gpu={j.gpus},node=1",
            "NodeList": lambda j: "node1" if j.start else "None assigned",
            "Timelimit": lambda j: "01:00:00",
        }
        lines = [delim.join(values[f](j) for f in fields) for j in jobs]
        return 0, "".join(line + "\n" for line in lines), ""

    def _owned(self, j: FakeJob, args: list[str], account_option: str) -> bool:
        """Slurm's ``--user`` / ``--account`` filters."""
        user, account = self._opt(args, "--user"), self._opt(args, account_option)
        return (user is None or j.user == user) and (account is None or j.account in account.split(","))

    def _task(self, control_id: str) -> FakeJob | None:
        """The job ``control_id`` names: ``<array id>_<task>`` a task, else a job id."""
        array, _, task = control_id.partition("_")
        if not task:
            return self.jobs.get(int(array))
        return next((j for j in self.jobs.values() if j.array_id == int(array) and j.task == int(task)), None)

    def _scancel(self, args: list[str], _: str) -> tuple[int, str, str]:
        if "_" not in args[-1] and self.jobs.get(int(args[-1])) is not None \
                and self.jobs[int(args[-1])].array_id == int(args[-1]):          # an array's id: every task
            tasks = [j for j in self.jobs.values() if j.array_id == int(args[-1])]
            for j in tasks:
                if self._owned(j, args, "--account") and j.state in ("PENDING", "RUNNING"):
                    self.finish(j.job_id, "CANCELLED")
            return 0, "", ""
        found = self._task(args[-1])
        jid = found.job_id if found is not None else int(args[-1].split("_")[0])
        j = self.jobs.get(jid)
        if j is not None and not self._owned(j, args, "--account"):
            return 0, "", ""        # scancel's filters leave another owner's job alone, silently
        if j is None or j.state not in ("PENDING", "RUNNING"):
            return 1, "", f"scancel: error: Kill job error on job id {jid}: Invalid job id specified\n"
        signal = self._opt(args, "--signal")
        if j.state == "PENDING":
            self.finish(jid, "CANCELLED")
        elif signal in ("TERM", "USR2") and j.ignores_term:
            pass
        elif signal == "KILL":
            self.finish(jid, "FAILED", "0:9")
        else:
            self.finish(jid, "CANCELLED", "0:15")
        return 0, "", ""

    def _scontrol(self, args: list[str], _: str) -> tuple[int, str, str]:
        if args[:1] == ["ping"]:
            return 0, "Slurmctld(primary) at fake is UP\n", ""
        if args[:1] == ["requeue"]:
            j = self.jobs[int(args[1])]
            j.state, j.reason, j.start = "PENDING", "BeginTime", None
            return 0, "", ""
        if args[:1] == ["update"] and len(args) == 3:
            target = self._task(args[1].removeprefix("jobid="))
            if target is None:
                return 1, "", "slurm_update error: Invalid job id specified\n"
            target.name, target.split = args[2].removeprefix("name="), True
            return 0, "", ""
        if args[:1] in (["hold"], ["release"]) and len(args) == 2:
            target = self._task(args[1])
            if target is None or target.state != "PENDING" and args[0] == "release":
                return 1, "", f"slurm_{args[0]} error: Invalid job id specified\n"
            target.held, target.split = args[0] == "hold", True
            target.reason = "JobHeldAdmin" if target.held else "Priority"
            return 0, "", ""
        return 1, "", f"invalid keyword: {args[0] if args else ''}\n"

    def _sshare(self, args: list[str], _: str) -> tuple[int, str, str]:
        rows = ["root||||100|1.000000||", "root|root|1|0.500000|0|0.000000|1.000000|inf"]
        for a in sorted(self.accounts):
            rows.append(f"{a}||1|0.500000|0|0.000000||1.000000")
            rows.append(f"{a}|sft-{a}|1|1.000000|0|0.000000|0.500000|1.000000")
        return 0, "\n".join(rows) + "\n", ""

    def _sinfo(self, args: list[str], _: str) -> tuple[int, str, str]:
        return 0, "", ""
