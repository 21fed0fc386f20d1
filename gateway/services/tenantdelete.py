"""Deleting a tenant, with a receipt (``finetune admin tenant delete NAME``, as root).

``plan_deletion`` says what would go and what stands in the way (a job not yet final, a Slurm job
still held under the account, a process of the tenant's user, a mount beneath what would be
erased), changing nothing: the dry run. ``delete_tenant`` carries the plan out, in this order:

1. the database rows (``TENANT_TABLES``), in one transaction that takes the write lock first and
   checks again that no job is active; with the rows go the tokens, so nothing reaches the
   tenant's data through the API from here on (foreign keys refuse a late write for it);
2. the tenant root, erased as root with an fd walk that never follows a link, each file hashed
   as it goes (``gateway.storage.erase``); then what its jobs left on this host outside it
   (``TenantAdmin.node_leftovers``: scratch, a job's private /tmp, the tenant uid's temp files);
3. the Slurm account and its associations, then the unix user and its group, only when this
   project made it (its ids retired: never given to another tenant);
4. the receipt (``build_receipt``: per kind counts, bytes and a sha256 over what went; rows per
   table), written 0600 as root; its sha256 goes into the audit tombstones (kinds and counts,
   when, by whom: never content) and into the tenant's pending deletion requests, marked done;
5. the database's freed pages and WAL frames erased (``gateway.db.erase_freed``).

A deletion interrupted part-way is finished by running it again: each step skips what is gone.
The audit chain keeps every entry it had: it is append-only and ``admin audit verify`` still holds.
"""

from __future__ import annotations

import hashlib
import json
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.db import erase_freed, secure_deletes, session_scope
from gateway.errors import Conflict
from gateway.models import (
    AccessRequest,
    ApiToken,
    DataFile,
    FineTuningJob,
    JobCheckpoint,
    JobEvent,
    MlflowParentRun,
    MlflowRun,
    ModelAlias,
    PortalSession,
    Role,
    Sweep,
    Tenant,
    TenantDeletionRequest,
    TenantMember,
    WebhookDelivery,
    WebhookEndpoint,
    utcnow,
)
from gateway.services.deletionrequests import DONE, PENDING
from gateway.slurm import jobcontainer
from gateway.state import ACTIVE
from gateway.storage import erase, layout
from gateway.storage.onboarding import NodePlaces, TenantAdmin, UnixUser

RECEIPT_VERSION = 1
# Tables that hold nothing of one tenant (persons are site accounts, possibly in other tenants) or
# that outlive it on purpose (the audit chain; the deletion requests, which name it as text).
KEPT_TABLES = frozenset({"audit_log", "audit_head", "persons", "sign_in_nonces", "leader_leases",
                         "tenant_deletion_requests", "alembic_version"})


def _in(column: Any, sub: Any) -> Any:
    return col(column).in_(sub)


def tenant_tables(tid: int) -> list[tuple[type[Any], Any]]:
    """Every table holding rows of tenant ``tid``, children before parents, each with the WHERE
    clause that selects them: the order deletion goes in (foreign keys are enforced)."""
    jobs = select(FineTuningJob.id).where(FineTuningJob.tenant_id == tid)
    tokens = select(ApiToken.id).where(ApiToken.tenant_id == tid)
    endpoints = select(WebhookEndpoint.id).where(WebhookEndpoint.tenant_id == tid)
    return [
        (PortalSession, _in(PortalSession.token_id, tokens)),
        (WebhookDelivery, sa.or_(col(WebhookDelivery.tenant_id) == tid, _in(WebhookDelivery.endpoint_id, endpoints))),
        (WebhookEndpoint, WebhookEndpoint.tenant_id == tid),
        (MlflowRun, sa.or_(col(MlflowRun.tenant_id) == tid, _in(MlflowRun.job_id, jobs))),
        (JobEvent, _in(JobEvent.job_id, jobs)),
        (JobCheckpoint, _in(JobCheckpoint.job_id, jobs)),
        (ModelAlias, ModelAlias.tenant_id == tid),
        (MlflowParentRun, MlflowParentRun.tenant_id == tid),
        (Sweep, Sweep.tenant_id == tid),
        (AccessRequest, sa.or_(col(AccessRequest.tenant_id) == tid, _in(AccessRequest.requester_token_id, tokens),
                               _in(AccessRequest.decided_by_token_id, tokens),
                               _in(AccessRequest.revoked_by_token_id, tokens))),
        (FineTuningJob, FineTuningJob.tenant_id == tid),
        (DataFile, DataFile.tenant_id == tid),
        (TenantMember, TenantMember.tenant_id == tid),
        (ApiToken, ApiToken.tenant_id == tid),
        (Tenant, Tenant.id == tid),
    ]


TENANT_TABLES = tuple(m.__tablename__ for m, _ in tenant_tables(0))


# ------------------------------------------------------------------ pure parts
def digest(lines: Iterable[str]) -> str:
    """sha256 (hex) over ``lines`` sorted, each ended by a newline: a listing's fingerprint."""
    h = hashlib.sha256()
    for line in sorted(lines):
        h.update(line.encode("utf-8", "surrogateescape") + b"\n")
    return h.hexdigest()


def entry_line(entry: erase.Entry, prefix: str = "") -> str:
    """One removed entry as a digest line: ``path<TAB>kind<TAB>size<TAB>sha256`` (``-``: none)."""
    path = prefix if entry.path == "." else f"{prefix}/{entry.path}" if prefix else entry.path
    return f"{path}\t{entry.kind}\t{entry.size}\t{entry.sha256 or '-'}"


def tally(entries: Sequence[erase.Entry], prefix: str = "", *, hashes: bool = True) -> dict[str, Any]:
    """Counts of a removed tree: files (every non-directory), dirs, bytes, and (``hashes``) the sha256
    over its ``entry_line``s."""
    leaves = [e for e in entries if e.kind != "dir"]
    out: dict[str, Any] = {"files": len(leaves), "dirs": len(entries) - len(leaves),
                           "bytes": sum(e.size for e in leaves if e.kind == "file")}
    if hashes:
        out["sha256"] = digest(entry_line(e, prefix) for e in entries)
    return out


def by_kind(entries: Sequence[erase.Entry], kind_of: Callable[[str], str] = layout.deletion_kind, *,
            hashes: bool = True) -> dict[str, dict[str, Any]]:
    """``tally`` per kind of a tenant root's entries (directories are left out of the kinds)."""
    kinds: dict[str, list[erase.Entry]] = {}
    for e in entries:
        if e.kind != "dir":
            kinds.setdefault(kind_of(e.path), []).append(e)
    return {k: {key: v for key, v in tally(es, hashes=hashes).items() if key != "dirs"}
            for k, es in sorted(kinds.items())}


@dataclass(frozen=True)
class RowsRemoved:
    """One table's removed rows: how many, and the sha256 over their primary keys."""
    rows: int
    sha256: str


@dataclass(frozen=True)
class Removed:
    """What one deletion removed, as the receipt reports it."""
    tenant: str
    at: datetime
    by: str
    host: str
    storage_root: str
    storage: list[erase.Entry]
    leftovers: dict[str, list[erase.Entry]]
    rows: dict[str, RowsRemoved]
    account: str
    account_removed: bool
    user: UnixUser
    user_removed: bool
    requests: list[str] = field(default_factory=list)


def build_receipt(r: Removed) -> dict[str, Any]:
    """The deletion receipt (JSON-ready): tenant, time, who; per kind of storage the files, bytes and
    sha256 over (path, kind, size, sha256) of each removed entry; the same for each place outside the
    storage; rows removed per table with a sha256 over their keys; the Slurm account; the unix user.
    Pure: names and figures only, never content."""
    datasets = sorted(e.sha256 for e in r.storage if e.sha256 and layout.deletion_kind(e.path) == "datasets")
    places = [{"path": p, **tally(es, p)} for p, es in sorted(r.leftovers.items())]
    return {
        "object": "tenant.deletion_receipt", "version": RECEIPT_VERSION,
        "tenant": r.tenant, "deleted_at": r.at.isoformat(timespec="microseconds"), "deleted_by": r.by,
        "host": r.host, "requests": r.requests,
        "storage": {"root": r.storage_root, **tally(r.storage), "kinds": by_kind(r.storage),
                    "dataset_sha256s": datasets},
        "node_leftovers": {"files": sum(p["files"] for p in places), "bytes": sum(p["bytes"] for p in places),
                           "places": places},
        "database": {"rows": sum(t.rows for t in r.rows.values()),
                     "tables": {t: {"rows": v.rows, "sha256": v.sha256} for t, v in sorted(r.rows.items())}},
        "slurm": {"account": r.account, "removed": r.account_removed},
        "unix_user": {"name": r.user.name, "uid": r.user.uid, "gid": r.user.gid, "removed": r.user_removed,
                      **({"note": r.user.note} if r.user.note else {})},
    }


def receipt_bytes(receipt: dict[str, Any]) -> bytes:
    """The receipt as it is written (sorted keys, indented, newline-ended): what its sha256 covers."""
    return (json.dumps(receipt, sort_keys=True, indent=2) + "\n").encode()


def tombstones(receipt: dict[str, Any], sha256: str) -> list[tuple[str, str]]:
    """The audit entries (action, reason) a deletion appends, kinds and counts only, each naming the
    receipt's sha256; ``tenant.delete`` last."""
    st, left, db = receipt["storage"], receipt["node_leftovers"], receipt["database"]
    kinds = ", ".join(f"{k} {v['files']}" for k, v in st["kinds"].items()) or "none"
    tables = ", ".join(f"{t} {v['rows']}" for t, v in db["tables"].items() if v["rows"]) or "none"
    user, slurm = receipt["unix_user"], receipt["slurm"]
    tail = f"; receipt sha256 {sha256}"

    def fit(text: str) -> str:      # the audit keeps 500 characters: the receipt's sha256 always
        return text[:500 - len(tail)] + tail

    return [
        ("tenant.delete.storage", fit(f"storage erased as root: {st['files']} files, {st['bytes']} bytes ({kinds}); "
                                      f"outside it on {receipt['host']}: {left['files']} files, {left['bytes']} "
                                      f"bytes in {len(left['places'])} places")),
        ("tenant.delete.database", fit(f"{db['rows']} rows deleted ({tables})")),
        ("tenant.delete.identity", fit(f"Slurm account {slurm['account']} "
                                       f"{'removed' if slurm['removed'] else 'absent'}; unix user {user['name']} "
                                       f"(uid {user['uid']}) "
                                       + ("removed, its ids retired" if user["removed"] else
                                          "left: " + user.get("note", "")))),
        (audit.TENANT_DELETED, fit(f"tenant {receipt['tenant']} deleted by {receipt['deleted_by']}"
                              + (f" (requests {', '.join(receipt['requests'])})" if receipt["requests"] else ""))),
    ]


# ------------------------------------------------------------------ the plan
@dataclass
class Plan:
    """What deleting tenant ``tenant`` would remove, and what refuses it now (``refusals``)."""
    tenant: str
    tenant_id: int | None
    rows: dict[str, int]
    storage_root: Path
    storage: list[erase.Entry]
    leftovers: dict[str, list[erase.Entry]]
    account: bool
    user: UnixUser
    slurm_job_ids: list[int]
    active_jobs: list[str]
    slurm_jobs: list[str]
    processes: list[int]
    requests: list[str]
    refusals: list[str] = field(default_factory=list)

    @property
    def nothing_left(self) -> bool:
        """Whether nothing of the tenant is left anywhere (rows, storage, account, its own user)."""
        return (self.tenant_id is None and not self.storage and not self.leftovers and not self.account
                and not (self.user.exists and self.user.ours))


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The dry run as JSON-ready data: what would go (counts and bytes, no hashes) and the refusals."""
    return {"tenant": plan.tenant, "refusals": plan.refusals,
            "database": {"rows": sum(plan.rows.values()), "tables": {t: n for t, n in plan.rows.items() if n}},
            "storage": {"root": str(plan.storage_root), **tally(plan.storage, hashes=False),
                        "kinds": by_kind(plan.storage, hashes=False)},
            "node_leftovers": [{"path": p, **tally(es, hashes=False)} for p, es in sorted(plan.leftovers.items())],
            "slurm": {"account": plan.tenant if plan.account else None, "jobs": plan.slurm_jobs},
            "unix_user": {"name": plan.user.name, "uid": plan.user.uid, "exists": plan.user.exists,
                          "removed": plan.user.exists and plan.user.ours, "note": plan.user.note},
            "active_jobs": plan.active_jobs, "requests": plan.requests}


def node_places(settings: Any) -> NodePlaces:
    """Where jobs leave files on this host outside tenant storage (the settings' scratch root and temp
    dirs, job_container.conf's BasePaths)."""
    return NodePlaces(scratch_root=settings.scratch_root,
                      job_tmp_bases=tuple(jobcontainer.read_base_paths(settings.job_container_conf)),
                      tmp_dirs=tuple(settings.node_tmp_dirs))


def _count(conn: Connection | Session, model: type[Any], where: Any) -> int:
    return int(conn.execute(sa.select(sa.func.count()).select_from(model.__table__).where(where)).scalar_one())


def plan_deletion(*, engine: Engine, admin: TenantAdmin, settings: Any, name: str) -> Plan:
    """What deleting tenant ``name`` would remove, and why it may not go now (``Plan.refusals``:
    active jobs, Slurm jobs still under its account, processes of its user, a mount beneath its
    storage). Changes nothing and opens no tenant file. RegistryError when the user registry is unsafe."""
    layout.tenant_name(name)
    with Session(engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == name)).first()
        tid = tenant.id if tenant else None
        rows = {m.__tablename__: _count(s, m, w) for m, w in tenant_tables(tid)} if tid is not None else {}
        jobs = list(s.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == tid))) if tid is not None else []
        arrays = list(s.exec(select(Sweep.slurm_array_id).where(Sweep.tenant_id == tid))) if tid is not None else []
        requests = [r.id for r in s.exec(select(TenantDeletionRequest).where(
            TenantDeletionRequest.tenant == name, TenantDeletionRequest.status == PENDING))]
    active_states = {str(a.value) for a in ACTIVE}
    active = sorted(j.id for j in jobs if j.status in active_states)
    slurm_ids = sorted({j.slurm_job_id for j in jobs if j.slurm_job_id} | {a for a in arrays if a})
    user = admin.unix_user(name)
    root = layout.tenant_root(admin.storage_root, name)
    refusals: list[str] = []
    try:
        storage = erase.survey(root)
        leftovers = {str(p): erase.survey(p) for p in admin.node_leftovers(user, slurm_ids, node_places(settings))}
    except erase.EraseRefused as e:
        storage, leftovers = [], {}
        refusals.append(str(e.strerror))
    account = admin.account_exists(name)
    slurm_jobs = admin.account_jobs(name) if account else []
    processes = erase.processes_of(user.uid) if user.exists and user.uid else []
    if active:
        refusals.append(f"{len(active)} job(s) not final yet ({', '.join(active[:5])}): cancel them "
                        f"(the tenant: `finetune jobs cancel ID`) and wait until they end")
    if slurm_jobs:
        refusals.append(f"Slurm still holds job(s) {', '.join(slurm_jobs[:10])} under account {name}: "
                        f"wait for them or `scancel --account={name}`")
    if processes:
        refusals.append(f"unix user {user.name} still runs processes (pids {', '.join(map(str, processes[:10]))}): "
                        f"end them (`pkill -u {user.name}`) and run this again")
    return Plan(tenant=name, tenant_id=tid, rows=rows, storage_root=root, storage=storage, leftovers=leftovers,
                account=account, user=user, slurm_job_ids=slurm_ids, active_jobs=active, slurm_jobs=slurm_jobs,
                processes=processes, requests=requests, refusals=refusals)


# ------------------------------------------------------------------ carrying it out
def _primary_key_lines(conn: Connection, model: type[Any], where: Any) -> list[str]:
    table = model.__table__
    cols = list(table.primary_key.columns)
    return ["\t".join(str(v) for v in row) for row in conn.execute(sa.select(*cols).where(where))]


def delete_rows(engine: Engine, tid: int) -> dict[str, RowsRemoved]:
    """Delete every row of tenant ``tid`` (``tenant_tables``) in ONE transaction, SQLite zeroing what it
    frees (``secure_deletes``); returns the rows removed per table with a sha256 over their keys. The
    transaction writes first (the tenant row: SQLite's write lock, PostgreSQL's row lock), then checks
    that no job became active meanwhile: Conflict (nothing deleted) if one did."""
    out: dict[str, RowsRemoved] = {}
    with engine.begin() as conn:
        secure_deletes(conn)
        tenants = Tenant.__table__  # type: ignore[attr-defined]
        conn.execute(sa.update(tenants).where(tenants.c.id == tid).values(name=tenants.c.name))
        jobs = FineTuningJob.__table__  # type: ignore[attr-defined]
        active = conn.execute(sa.select(sa.func.count()).select_from(jobs).where(
            jobs.c.tenant_id == tid, jobs.c.status.in_([str(a.value) for a in ACTIVE]))).scalar_one()
        if active:
            raise Conflict(f"the tenant has {active} job(s) not final yet: nothing was deleted; run this again once "
                           "they have ended")
        for model, where in tenant_tables(tid):
            keys = _primary_key_lines(conn, model, where)
            conn.execute(sa.delete(model.__table__).where(where))
            out[model.__tablename__] = RowsRemoved(len(keys), digest(keys))
    return out


@dataclass(frozen=True)
class Deleted:
    """A finished deletion: the receipt (None when nothing was left to delete), where it was written,
    its sha256, and what was done to the database's freed pages."""
    receipt: dict[str, Any] | None
    path: Path | None
    sha256: str | None
    scrub: str


def receipt_path_for(settings: Any, name: str, at: datetime) -> Path:
    """The default receipt file: ``<receipt_dir>/<tenant>-<UTC time>.json``."""
    return Path(settings.receipt_dir) / f"{name}-{at.strftime('%Y%m%dT%H%M%S%fZ')}.json"


def delete_tenant(*, engine: Engine, admin: TenantAdmin, settings: Any, name: str, by: str,
                  receipt: Path | None = None, now: datetime | None = None) -> Deleted:
    """Delete tenant ``name`` (see the module doc for the order) and return the receipt, written
    0600 to ``receipt`` (default ``receipt_path_for``). Raises Conflict, before anything changes, with
    every refusal of ``plan_deletion``; a tenant with nothing left only gets its database scrubbed.
    SlurmCommandError (sacctmgr's, userdel's text) or OSError stop it part-way: run it again."""
    plan = plan_deletion(engine=engine, admin=admin, settings=settings, name=name)
    if plan.refusals:
        raise Conflict(f"tenant {name} cannot be deleted now: " + "; ".join(plan.refusals))
    if plan.nothing_left:
        return Deleted(None, None, None, erase_freed(engine, TENANT_TABLES))
    at = now or utcnow()
    rows = delete_rows(engine, plan.tenant_id) if plan.tenant_id is not None else {}
    storage = erase.erase(plan.storage_root)
    leftovers = {str(p): erase.erase(p) for p in admin.node_leftovers(plan.user, plan.slurm_job_ids,
                                                                       node_places(settings))}
    account_removed = admin.remove_account(name, user=plan.user.name)
    user = admin.remove_unix_user(name)
    removed = Removed(tenant=name, at=at, by=by, host=socket.gethostname(), storage_root=str(plan.storage_root),
                      storage=storage, leftovers={p: es for p, es in leftovers.items() if es}, rows=rows,
                      account=name, account_removed=account_removed, user=user,
                      user_removed=user.exists and user.ours, requests=plan.requests)
    doc = build_receipt(removed)
    data = receipt_bytes(doc)
    sha = hashlib.sha256(data).hexdigest()
    path = receipt or receipt_path_for(settings, name, at)
    erase.write_private(path, data)
    with session_scope(engine) as s:
        for action, reason in tombstones(doc, sha):
            audit.append(s, at=at, actor=audit.Actor(None, Role.SYSADMIN.value, by), action=action,
                         outcome=audit.ALLOWED, tenant=name, reason=reason)
        for req in s.exec(select(TenantDeletionRequest).where(TenantDeletionRequest.tenant == name,
                                                              TenantDeletionRequest.status == PENDING)):
            req.status, req.decided_at, req.decided_by, req.receipt_sha256 = DONE, at, by[:100], sha
            s.add(req)
    return Deleted(doc, path, sha, erase_freed(engine, TENANT_TABLES))
