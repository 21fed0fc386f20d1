"""The layout of tenant storage: the ONLY place that spells a tenant path.

Everything is relative to a tenant root, ``<storage_root>/tenants/<tenant>/``
(0700, owned by the tenant's unix user), as a tuple of path components that are
each checked here: no ``/``, no ``..``, no leading dot except the two hidden
temp-name patterns the storage verbs create themselves. The verbs open these
components one at a time with ``O_NOFOLLOW`` beneath the root (see ``safefs``),
so a name can never climb out or follow a link.

    datasets/<sha256>.jsonl              validated uploads (0600)
    datasets/.upload-<hex>.tmp           an upload while it streams
    jobs/<job id>/spec.json              the trainer's spec (written by the gateway)
    jobs/<job id>/events.jsonl           the trainer's progress (read by the reconciler)
    jobs/<job id>/attempts/<n>/staging/  the trainer's finished attempt
    jobs/<job id>/checkpoints/           the trainer's checkpoints
    artifacts/<art id>/<result>          published results (adapter.tar, eval.json, metrics.csv)
    artifacts/.pub-<job id>-<hex>/       a publication being built
    CLAIM-CODE-<token id>                an operator-minted admin token's one-time claim code (0600)

Inside ``jobs/<job id>/`` the names are the trainer's (``trainer.contract.jobdir``); this
module builds the tenant-root paths around them.
"""

from __future__ import annotations

import re
from pathlib import Path

from trainer.contract import jobdir

Parts = tuple[str, ...]

TENANT_NAME = re.compile(r"^[a-z][a-z0-9_-]{1,23}$")
JOB_ID = re.compile(r"^ftjob-[0-9a-f]{24}$")
ART_ID = re.compile(r"^art-[0-9a-f]{24}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")
UPLOAD_TMP = re.compile(r"^\.upload-[0-9a-f]{16}\.tmp$")
PUB_TMP = re.compile(r"^\.pub-ftjob-[0-9a-f]{24}-[0-9a-f]{8}$")
TENANTS = "tenants"
RESULT_NAMES = ("adapter.tar", "eval.json", "metrics.csv")
CHECKPOINT_RESULT = re.compile(r"^checkpoint-step-([1-9][0-9]{0,8})\.tar$")   # a checkpoint's adapter, as a model
MAX_STEP = 999_999_999
MAX_CHECKPOINTS = 64              # checkpoint adapters packed per publication
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,127}$")

DATASETS, JOBS, ARTIFACTS = "datasets", "jobs", "artifacts"


class LayoutError(ValueError):
    """A name that is not part of the layout (never reaches the filesystem)."""


def _match(pattern: re.Pattern[str], value: object, what: str) -> str:
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise LayoutError(f"invalid {what}: {value!r}")
    return value


def tenant_name(name: object) -> str:
    """``name`` when it is a valid tenant name; LayoutError otherwise."""
    return _match(TENANT_NAME, name, "tenant name")


def unix_user_for(tenant: str) -> str:
    """The unix user (and group) that owns a tenant's files and runs its jobs."""
    return f"sft-{tenant_name(tenant)}"


def tenants_dir(storage_root: Path) -> Path:
    """``<storage_root>/tenants``: root's, 0711; on a site with quotas, the filesystem that holds them."""
    return storage_root / TENANTS


def tenant_root(storage_root: Path, tenant: str) -> Path:
    """Absolute tenant root: for the trainer's spec and the onboarding code only."""
    return storage_root / TENANTS / tenant_name(tenant)


def absolute(storage_root: Path, tenant: str, parts: Parts) -> str:
    """An absolute path the trainer (running as the tenant) opens."""
    return str(tenant_root(storage_root, tenant).joinpath(*check(parts)))


def check(parts: object) -> Parts:
    """Validate a tuple of components (each a plain name, no dot-dot, no slash)."""
    if not isinstance(parts, list | tuple) or not parts or len(parts) > 8:
        raise LayoutError(f"invalid storage path: {parts!r}")
    for p in parts:
        if not isinstance(p, str) or not (_NAME.fullmatch(p) or UPLOAD_TMP.fullmatch(p)
                                          or PUB_TMP.fullmatch(p)):
            raise LayoutError(f"invalid storage path component: {p!r}")
    return tuple(parts)


def dataset(sha256: str) -> Parts:
    """A validated upload: ``datasets/<sha256>.jsonl`` (LayoutError for a bad digest)."""
    return (DATASETS, f"{_match(SHA256, sha256, 'sha256')}.jsonl")


def job(job_id: str) -> Parts:
    """The job's directory: ``jobs/<job id>`` (LayoutError for a bad id)."""
    return (JOBS, _match(JOB_ID, job_id, "job id"))


def job_file(job_id: str, name: str) -> Parts:
    """``jobs/<job id>/<name>``; only the job id is checked here."""
    return (*job(job_id), name)


def staging(job_id: str, attempt: int) -> Parts:
    """An attempt's staging dir: ``jobs/<job id>/attempts/<n>/staging`` (LayoutError unless 0 <= n <= 10000)."""
    if not isinstance(attempt, int) or attempt < 0 or attempt > 10_000:
        raise LayoutError(f"invalid attempt: {attempt!r}")
    return (*job(job_id), *jobdir.staging_parts(attempt))


def _step(step: object) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or not 1 <= step <= MAX_STEP:
        raise LayoutError(f"invalid checkpoint step: {step!r}")
    return step


def checkpoint(job_id: str, step: int) -> Parts:
    """A trainer checkpoint: ``jobs/<job id>/checkpoints/step-<n>`` (LayoutError unless 1 <= n <= MAX_STEP)."""
    return (*job(job_id), jobdir.CHECKPOINTS, jobdir.step_dir_name(_step(step)))


def checkpoint_result(step: int) -> str:
    """The result name of the adapter of checkpoint ``step`` (``checkpoint-step-<n>.tar``)."""
    return f"checkpoint-step-{_step(step)}.tar"


def checkpoint_step_of(name: object) -> int | None:
    """The step of a checkpoint adapter's result name (``checkpoint-step-<n>.tar``), else None."""
    m = CHECKPOINT_RESULT.fullmatch(name) if isinstance(name, str) else None
    return int(m.group(1)) if m else None


def is_main_result(name: object) -> bool:
    """Whether ``name`` is one of a job's own results (RESULT_NAMES), not a checkpoint's adapter."""
    return name in RESULT_NAMES


def is_result_name(name: object) -> bool:
    """Whether ``name`` is a result file's name: one of RESULT_NAMES or a checkpoint's adapter."""
    return isinstance(name, str) and (name in RESULT_NAMES or CHECKPOINT_RESULT.fullmatch(name) is not None)


def training_state(job_id: str) -> list[Parts]:
    """What a job's training left behind besides its published results: checkpoints, attempts."""
    return [(*job(job_id), jobdir.CHECKPOINTS), (*job(job_id), jobdir.ATTEMPTS)]


def slurm_output(slurm_job_id: int) -> str:
    """The name of a job's Slurm output file in its directory (``slurm-<id>.out``: the batch script's
    ``--output``, ``gateway.slurm.render``); LayoutError for an id that is not a positive integer."""
    if not isinstance(slurm_job_id, int) or isinstance(slurm_job_id, bool) or not 1 <= slurm_job_id <= 2**32:
        raise LayoutError(f"invalid Slurm job id: {slurm_job_id!r}")
    return f"slurm-{slurm_job_id}.out"


def job_logs(job_id: str, slurm_job_id: int | None) -> list[Parts]:
    """A job's logs: the trainer's ``events.jsonl`` and, once it had a Slurm id, its Slurm output file."""
    return [job_file(job_id, jobdir.EVENTS)] + ([job_file(job_id, slurm_output(slurm_job_id))]
                                                if slurm_job_id is not None else [])


def artifact(art_id: str) -> Parts:
    """A publication's directory: ``artifacts/<art id>`` (LayoutError for a bad id)."""
    return (ARTIFACTS, _match(ART_ID, art_id, "artifact id"))


def result_file(rel: str) -> Parts:
    """A result file row's ``path`` (``artifacts/<art id>/<name>``), checked."""
    parts = tuple(rel.split("/")) if isinstance(rel, str) else ()
    if len(parts) != 3 or parts[0] != ARTIFACTS or not ART_ID.fullmatch(parts[1]) \
            or not is_result_name(parts[2]):
        raise LayoutError(f"invalid result path: {rel!r}")
    return parts


def result_path(art_id: str, name: str) -> str:
    """What a result file row stores as its ``path``."""
    if not is_result_name(name):
        raise LayoutError(f"invalid result name: {name!r}")
    return "/".join((*artifact(art_id), name))


CLAIM_CODE_PREFIX = "CLAIM-CODE-"
MAX_TOKEN_ID = 2**31 - 1


def claim_code_file(token_id: object) -> str:
    """The name, at the tenant root, of the claim code file for token ``token_id``
    (``CLAIM-CODE-<id>``); LayoutError unless 1 <= id < 2**31."""
    if not isinstance(token_id, int) or isinstance(token_id, bool) or not 1 <= token_id <= MAX_TOKEN_ID:
        raise LayoutError(f"invalid token id: {token_id!r}")
    return f"{CLAIM_CODE_PREFIX}{token_id}"


DELETION_KINDS = ("datasets", "checkpoints", "logs", "job_files", "results", "claim_codes", "other")
_SLURM_OUTPUT = re.compile(r"^slurm-[0-9]+\.out$")


def deletion_kind(rel: str) -> str:
    """What a path relative to a tenant root holds, as a deletion receipt counts it (one of
    DELETION_KINDS): datasets, checkpoints, logs (Slurm output, the trainer's events), job_files
    (spec, attempts' staging), results (published artifacts), claim_codes, or other."""
    parts = rel.split("/")
    top = parts[0]
    if top == DATASETS:
        return "datasets"
    if top == ARTIFACTS:
        return "results"
    if top == JOBS and len(parts) >= 3:
        if parts[2] == jobdir.CHECKPOINTS:
            return "checkpoints"
        if len(parts) == 3 and (parts[2] == jobdir.EVENTS or _SLURM_OUTPUT.fullmatch(parts[2])):
            return "logs"
        return "job_files"
    if len(parts) == 1 and top.startswith(CLAIM_CODE_PREFIX):
        return "claim_codes"
    return "other"
