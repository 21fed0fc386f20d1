"""Typed records parsed from Slurm's parsable output.

Each record names its Slurm fields once (``FIELDS``: Slurm name, attribute,
parser). The client asks for exactly those fields with a delimiter that cannot
occur in them, and ``parse_rows`` turns the output into frozen dataclasses,
raising ``SlurmParseError`` on a field-count mismatch instead of guessing.
Step rows (``123.batch``, ``123.extern``, ``123.0``) are dropped from sacct.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar

from gateway.errors import SlurmError
from gateway.slurm.validate import validate_unix_name
from gateway.state import SlurmState

# ASCII unit separator: cannot occur in account, user, QOS or job names.
DELIM = "\x1f"


class SlurmParseError(SlurmError):
    """Slurm printed something we cannot parse into a record."""


_NONE_WORDS = {"", "N/A", "NONE", "None", "Unknown", "(null)", "n/a", "INVALID", "None assigned"}


def opt_str(v: str) -> str | None:
    """None for Slurm's "no value" words ("", N/A, None, Unknown, (null), ...), else ``v``."""
    return None if v in _NONE_WORDS else v


def opt_int(v: str) -> int | None:
    """An integer, or None for Slurm's "no value" words; SlurmParseError otherwise."""
    v = v.strip()
    if v in _NONE_WORDS:
        return None
    try:
        return int(v)
    except ValueError as e:
        raise SlurmParseError(f"not an integer: {v!r}") from e


def opt_float(v: str) -> float | None:
    """A number, or None for Slurm's "no value" words; SlurmParseError otherwise."""
    v = v.strip()
    if v in _NONE_WORDS:
        return None
    try:
        return float(v)
    except ValueError as e:
        raise SlurmParseError(f"not a number: {v!r}") from e


def opt_time(v: str) -> datetime | None:
    """Slurm prints local wall-clock time without a zone; return it UTC-aware."""
    v = v.strip()
    if v in _NONE_WORDS:
        return None
    try:
        return datetime.fromisoformat(v).astimezone(UTC)
    except ValueError as e:
        raise SlurmParseError(f"not a Slurm timestamp: {v!r}") from e


def state_word(v: str) -> str:
    """``CANCELLED by 0`` → ``CANCELLED``; ``RUNNING`` stays."""
    return v.split(" ", 1)[0].strip()


def exit_code(v: str) -> tuple[int, int] | None:
    """``0:15`` → (0, 15): the exit status and the terminating signal."""
    if v in _NONE_WORDS:
        return None
    code, _, sig = v.partition(":")
    return int(code), int(sig or 0)


_GPU_RE = re.compile(r"gres/gpu(?::[^=,]+)?=(\d+)")


def gpu_count(tres: str) -> int:
    """GPUs in a TRES string (``cpu=1,gres/gpu=2,mem=1G`` → 2).

    A typed count (``gres/gpu:h100=2``) is reported alongside the untyped
    total by Slurm; take the untyped one when present, else sum the typed.
    """
    if not tres:
        return 0
    untyped = re.search(r"(?:^|,)gres/gpu=(\d+)", tres)
    if untyped:
        return int(untyped.group(1))
    return sum(int(m) for m in _GPU_RE.findall(tres))


def gres_gpu_count(gres: str) -> int:
    """GPUs in squeue's ``%b`` (``gres:gpu:1``, ``gres/gpu:2``, ``gpu:a100:1``)."""
    total = 0
    for part in gres.split(","):
        bits = part.replace("gres/", "").replace("gres:", "").split(":")
        if bits and bits[0] == "gpu":
            try:
                total += int(bits[-1]) if len(bits) > 1 else 1
            except ValueError:
                total += 1
    return total


Field = tuple[str, str, Callable[[str], Any]]
R = TypeVar("R")


_HOST_RANGE = re.compile(r"([^,\[\]]*)\[([^\]]+)\]([^,\[\]]*)")


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's hostlist notation → node names: ``"gpu[01-03,07],login"`` → gpu01 gpu02 gpu03 gpu07
    login (zero padding kept, order kept, one bracket group per name). Raises SlurmParseError on a
    malformed list or a range over 4096 names."""
    names: list[str] = []
    for part in _split_top(nodelist.strip()):
        m = _HOST_RANGE.fullmatch(part)
        if m is None:
            if "[" in part or "]" in part or not part:
                raise SlurmParseError(f"malformed node list {nodelist!r}")
            names.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
                raise SlurmParseError(f"malformed node range {r!r} in {nodelist!r}")
            end = int(hi) if hi else int(lo)
            if end - int(lo) > 4096 or len(names) > 65536:
                raise SlurmParseError(f"node list {nodelist!r} is too long")
            names += [f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), end + 1)]
    return names


def _split_top(text: str) -> list[str]:
    """Split ``text`` at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p] if text else []


@dataclass(frozen=True)
class Skipped:
    """One line of Slurm's output that did not parse into a record: where, which job it names
    (when its first field is a job id) and why. It fails that one record, never the call."""

    lineno: int
    job_id: int | None
    message: str

    def __str__(self) -> str:
        return f"line {self.lineno}" + (f" (job {self.job_id})" if self.job_id is not None else "") \
            + f": {self.message}"


class Rows(list[R]):
    """Parsed records (a list), with ``skipped``: the lines that did not parse, each a ``Skipped``."""

    skipped: list[Skipped]

    def __init__(self, records: Iterable[R] = (), skipped: Iterable[Skipped] = ()):
        super().__init__(records)
        self.skipped = list(skipped)


def _leading_id(line: str, delim: str) -> int | None:
    head = line.split(delim, 1)[0].split(".")[0].split("_")[0].split("+")[0].strip()
    return int(head) if head.isdigit() and len(head) < 19 else None


def parse_rows(text: str, fields: tuple[Field, ...], make: Callable[..., R], delim: str = DELIM,
               rest_last: bool = False) -> Rows[R]:
    """One record per non-empty line; a line with the wrong field count or a field that does not
    parse is skipped and reported in ``Rows.skipped`` (with the job id it starts with, if any), so
    one bad record fails that record only.

    The formats we ask for hold no free-text field (job names, comments: a tenant writes those,
    and a name may hold the delimiter and a line break), so a well-formed line is machine-made.
    ``rest_last``: the last field keeps any delimiter it holds (an administrator's text)."""
    records: list[R] = []
    skipped: list[Skipped] = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        values = line.split(delim, len(fields) - 1) if rest_last else line.split(delim)
        if len(values) != len(fields):
            skipped.append(Skipped(lineno, _leading_id(line, delim),
                                   f"expected {len(fields)} fields, got {len(values)}"))
            continue
        kwargs = {}
        try:
            for (slurm_name, attr, parse), raw in zip(fields, values, strict=True):
                try:
                    kwargs[attr] = parse(raw)
                except (SlurmParseError, ValueError) as e:
                    raise SlurmParseError(f"field {slurm_name}: {e}") from e
        except SlurmParseError as e:
            skipped.append(Skipped(lineno, _leading_id(line, delim), str(e)))
            continue
        records.append(make(**kwargs))
    return Rows(records, skipped)


def format_string(fields: tuple[Field, ...], delim: str = DELIM) -> str:
    """The format argument (``%A<delim>%T…``) for squeue/sinfo ``-o``."""
    return delim.join(f[0] for f in fields)


def field_names(fields: tuple[Field, ...]) -> str:
    """The ``--format`` argument (``JobID,State,…``) for sacct/sshare."""
    return ",".join(f[0] for f in fields)


def array_index(v: str) -> int | None:
    """A job array task's index, or None: not an array task, or a record of several tasks still
    pending together, which squeue prints as a range ("1-3", "1,4-7%2") unless asked for ``--array``."""
    v = v.strip()
    return int(v) if v.isdigit() else None


# ---------------------------------------------------------------------- owner
@dataclass(frozen=True)
class Owner:
    """Whose a Slurm job must be for the gateway to act on it: the tenant's unix user (None: any, for
    a submission by the gateway's own identity) and its Slurm account. A job's user never changes and
    its account only among the user's own accounts, so a record that matches stays the tenant's."""

    user: str | None
    account: str

    def __post_init__(self) -> None:
        validate_unix_name(self.account)
        if self.user is not None:
            validate_unix_name(self.user)

    def problem(self, user: str | None, account: str | None) -> str | None:
        """Why a record of ``user`` / ``account`` is not this owner's job, or None."""
        if account != self.account:
            return f"its account is not {self.account}"
        if self.user is not None and user != self.user:
            return f"its user is not {self.user}"
        return None

    def squeue_filters(self) -> list[str]:
        """squeue/scancel options that keep only this owner's jobs (Slurm applies them itself)."""
        return ([f"--user={self.user}"] if self.user else []) + [f"--account={self.account}"]

    def sacct_filters(self) -> list[str]:
        """The same filters in sacct's spelling."""
        return ([f"--user={self.user}"] if self.user else []) + [f"--accounts={self.account}"]


# --------------------------------------------------------------------- squeue
@dataclass(frozen=True)
class QueueRecord:
    job_id: int
    state: str
    reason: str | None
    user: str
    account: str
    qos: str
    submit: datetime | None
    start: datetime | None
    nodes: str | None
    gpus: int
    array_job_id: int | None = None    # a job array's task: the array's id and the task's index
    array_task: int | None = None

    @property
    def control_id(self) -> str:
        """How scancel/scontrol address this job: ``<array id>_<task>`` for an array's task (its own
        job id is refused there once the task has a record of its own), else the job id."""
        if self.array_job_id is not None and self.array_task is not None:
            return f"{self.array_job_id}_{self.array_task}"
        return str(self.job_id)

    @property
    def pending_reason(self) -> str | None:
        """Slurm's reason while the job is PENDING (Priority, Resources, ...); None in any other state."""
        return self.reason if self.state == SlurmState.PENDING else None


SQUEUE_FIELDS: tuple[Field, ...] = (
    ("%A", "job_id", int),
    ("%T", "state", state_word),
    ("%r", "reason", opt_str),
    ("%u", "user", str),
    ("%a", "account", str),
    ("%q", "qos", str),
    ("%V", "submit", opt_time),
    ("%S", "start", opt_time),
    ("%N", "nodes", opt_str),
    ("%b", "gpus", gres_gpu_count),
    ("%F", "array_job_id", opt_int),
    ("%K", "array_task", array_index),
)


def parse_squeue(text: str) -> Rows[QueueRecord]:
    """Records from squeue output in SQUEUE_FIELDS' format (no job name: see ``parse_rows``)."""
    return parse_rows(text, SQUEUE_FIELDS, QueueRecord)


# ---------------------------------------------------------------------- sacct
@dataclass(frozen=True)
class AcctRecord:
    job_id: str          # as printed: "123", "123_4" (array task), "123+0" (het)
    job_id_raw: int
    user: str | None
    account: str | None
    qos: str | None
    state: str
    exit: tuple[int, int] | None
    reason: str | None
    submit: datetime | None
    eligible: datetime | None
    start: datetime | None
    end: datetime | None
    elapsed_s: int | None
    alloc_tres: str
    req_tres: str
    nodes: str | None
    timelimit: str | None

    @property
    def gpus(self) -> int:
        """GPUs allocated, or requested while the job has no allocation yet."""
        return gpu_count(self.alloc_tres) or gpu_count(self.req_tres)

    @property
    def ran(self) -> bool:
        """Whether the job ever got an allocation (Slurm sets Start=End=Submit
        for a job cancelled before it started, so Start alone does not tell)."""
        return bool(self.alloc_tres)

    @property
    def wait_s(self) -> float | None:
        """Queue wait (Start - Submit); None for a job that never ran."""
        if not self.ran or self.submit is None or self.start is None:
            return None
        return (self.start - self.submit).total_seconds()


SACCT_FIELDS: tuple[Field, ...] = (
    ("JobID", "job_id", str),
    ("JobIDRaw", "job_id_raw", lambda v: int(v.split(".")[0].split("+")[0])),
    ("User", "user", opt_str),
    ("Account", "account", opt_str),
    ("QOS", "qos", opt_str),
    ("State", "state", state_word),
    ("ExitCode", "exit", exit_code),
    ("Reason", "reason", opt_str),
    ("Submit", "submit", opt_time),
    ("Eligible", "eligible", opt_time),
    ("Start", "start", opt_time),
    ("End", "end", opt_time),
    ("ElapsedRaw", "elapsed_s", opt_int),
    ("AllocTRES", "alloc_tres", str),
    ("ReqTRES", "req_tres", str),
    ("NodeList", "nodes", opt_str),
    ("Timelimit", "timelimit", opt_str),
)

_STEP_RE = re.compile(r"\.(batch|extern|interactive|\d+)$")


def parse_sacct(text: str) -> Rows[AcctRecord]:
    """Job (allocation) rows only (step rows are dropped before parsing); no job name."""
    keep = []
    for line in text.splitlines():
        if not line.strip():
            continue
        job_id = line.split(DELIM, 1)[0]
        if _STEP_RE.search(job_id):
            continue
        keep.append(line)
    return parse_rows("\n".join(keep), SACCT_FIELDS, AcctRecord)


# --------------------------------------------------------------------- sshare
@dataclass(frozen=True)
class ShareRecord:
    account: str
    user: str | None     # None: the account's own row
    raw_shares: int | None
    norm_shares: float | None
    raw_usage: int | None
    effective_usage: float | None
    fairshare: float | None
    level_fs: float | None

    @property
    def is_account_row(self) -> bool:
        """Whether this is the account's own row rather than one of its users'."""
        return self.user is None


SSHARE_FIELDS: tuple[Field, ...] = (
    ("Account", "account", lambda v: v.strip()),
    ("User", "user", opt_str),
    ("RawShares", "raw_shares", lambda v: None if v.strip() == "parent" else opt_int(v)),
    ("NormShares", "norm_shares", opt_float),
    ("RawUsage", "raw_usage", opt_int),
    ("EffectvUsage", "effective_usage", opt_float),
    ("FairShare", "fairshare", opt_float),
    ("LevelFS", "level_fs", lambda v: None if v.strip() == "inf" else opt_float(v)),
)


def parse_sshare(text: str) -> Rows[ShareRecord]:
    """``sshare -a -n -P`` output (``|``-delimited; account and user names cannot hold ``|``)."""
    return parse_rows(text, SSHARE_FIELDS, ShareRecord, delim="|")


# ---------------------------------------------------------------------- sinfo
@dataclass(frozen=True)
class DrainedNode:
    node: str
    state: str
    since: datetime | None
    by_user: str | None
    reason: str


SINFO_R_FIELDS: tuple[Field, ...] = (
    ("%N", "node", str),
    ("%T", "state", str),
    ("%H", "since", opt_time),
    ("%u", "by_user", opt_str),
    ("%E", "reason", str),
)


def parse_sinfo_r(text: str) -> Rows[DrainedNode]:
    """Records from ``sinfo --list-reasons`` output in SINFO_R_FIELDS' format. The reason is free text,
    but only administrators (and our own epilog) set it: it goes last and keeps any delimiter it holds."""
    return parse_rows(text, SINFO_R_FIELDS, DrainedNode, rest_last=True)
