"""The hash-chained audit log: append (serialized, so the chain never forks) and verify.

Each entry's ``hash`` is sha256 over the canonical JSON of its fields, ``prev_hash``
included; ``prev_hash`` is the hash of the entry before (``GENESIS`` for the first).
The single ``audit_head`` row names the newest entry: an append first UPDATEs it,
which takes PostgreSQL's row lock (SELECT ... FOR UPDATE semantics) or SQLite's
database write lock, so two appends can never both extend the same entry. The head
also lets ``verify`` notice that the newest entries were deleted.

Editing, deleting or reordering rows breaks the chain and ``verify`` names the first
broken entry. Someone able to rewrite the whole table *and* the head consistently is
not detected by the chain alone: see SECURITY.md (anchor the head hash elsewhere).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from gateway.models import AuditEntry, AuditHead

GENESIS = "0" * 64
ALLOWED, DENIED = "allowed", "denied"
HASHED_FIELDS = ("seq", "at", "actor_token_id", "actor_role", "tenant", "resource", "action",
                 "grant_id", "outcome", "reason", "prev_hash")


@dataclass(frozen=True)
class Actor:
    token_id: int | None
    role: str


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes an entry's hash covers: sorted-key compact JSON, times as UTC ISO with µs."""
    out = {}
    for k in HASHED_FIELDS:
        v = fields.get(k)
        out[k] = v.astimezone(UTC).isoformat(timespec="microseconds") if isinstance(v, datetime) else v
    return json.dumps(out, sort_keys=True, separators=(",", ":")).encode()


def entry_hash(fields: dict[str, Any]) -> str:
    return hashlib.sha256(canonical(fields)).hexdigest()


def _fields(e: AuditEntry) -> dict[str, Any]:
    return {k: getattr(e, k) for k in HASHED_FIELDS}


def append(db: Session | Connection, *, at: datetime, actor: Actor, action: str, outcome: str,
           tenant: str | None = None, resource: str | None = None, grant_id: str | None = None,
           reason: str = "") -> int:
    """Append one entry inside the caller's transaction; returns its sequence number.

    The head row stays locked until that transaction ends, so appends are serial.
    """
    head_t = AuditHead.__table__  # type: ignore[attr-defined]
    db.execute(sa.update(head_t).where(head_t.c.id == 1).values(seq=head_t.c.seq + 1))
    seq, prev = db.execute(sa.select(head_t.c.seq, head_t.c.hash).where(head_t.c.id == 1)).one()
    # Round to µs so the hashed value is exactly what both databases store and return.
    fields = {"seq": seq, "at": at.astimezone(UTC), "actor_token_id": actor.token_id, "actor_role": actor.role,
              "tenant": tenant, "resource": resource, "action": action, "grant_id": grant_id,
              "outcome": outcome, "reason": reason[:500], "prev_hash": prev}
    digest = entry_hash(fields)
    db.execute(sa.insert(AuditEntry.__table__).values(**fields, hash=digest))  # type: ignore[attr-defined]
    db.execute(sa.update(head_t).where(head_t.c.id == 1).values(hash=digest))
    return int(seq)


def append_now(engine: Engine, **kwargs: Any) -> int:
    """Append in a transaction of its own, committed before this returns (so a read is
    logged before its bytes leave, and a refusal is logged although the request fails)."""
    with engine.begin() as conn:
        return append(conn, **kwargs)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    entries: int
    head_hash: str
    broken_seq: int | None = None
    problem: str = ""

    def message(self) -> str:
        if self.ok:
            return f"audit log intact: {self.entries} entries, head {self.head_hash}"
        where = f"entry {self.broken_seq}" if self.broken_seq is not None else "the head"
        return f"audit log BROKEN at {where}: {self.problem}"


def check_chain(entries: Iterable[AuditEntry], head_seq: int, head_hash: str) -> Verdict:
    """Pure: walk ``entries`` (ordered by seq) and report the first one that breaks the chain."""
    prev, expected, n = GENESIS, 1, 0
    for e in entries:
        n += 1
        if e.seq != expected:
            missing = "missing" if e.seq > expected else "duplicated or out of order"
            return Verdict(False, n, head_hash, expected, f"entry {expected} is {missing} (found {e.seq})")
        if e.prev_hash != prev:
            return Verdict(False, n, head_hash, e.seq, "prev_hash does not match the entry before it "
                                                       "(an entry was deleted, inserted or reordered)")
        if entry_hash(_fields(e)) != e.hash:
            return Verdict(False, n, head_hash, e.seq, "its content does not match its hash (edited)")
        prev, expected = e.hash, expected + 1
    if head_seq != expected - 1 or head_hash != prev:
        return Verdict(False, n, head_hash, expected if head_seq >= expected else None,
                       f"the head names entry {head_seq} ({head_hash[:12]}…) but the chain ends at "
                       f"entry {expected - 1} ({prev[:12]}…): newest entries deleted or head altered")
    return Verdict(True, n, head_hash)


def verify(engine: Engine, batch: int = 5000) -> Verdict:
    """Check the whole chain against the head; returns the Verdict (never raises on tampering).

    Entries appended while this runs (past the head read first) are not judged.
    """
    with Session(engine) as session:
        head = session.get(AuditHead, 1)
        if head is None:
            return Verdict(False, 0, "", None, "the audit_head row is missing")
        head_seq, head_hash = head.seq, head.hash

        def rows() -> Iterable[AuditEntry]:
            last = 0
            while True:
                page = list(session.exec(select(AuditEntry).where(
                    col(AuditEntry.seq) > last, col(AuditEntry.seq) <= head_seq)
                    .order_by(col(AuditEntry.seq)).limit(batch)))
                yield from page
                if len(page) < batch:
                    return
                last = page[-1].seq

        verdict = check_chain(rows(), head_seq, head_hash)
        if not verdict.ok:
            return verdict
        top = session.exec(select(sa.func.max(AuditEntry.seq))).one() or 0
        session.expire_all()
        now_head = session.get(AuditHead, 1)
        if top > head_seq and (now_head is None or top > now_head.seq):
            return Verdict(False, verdict.entries, head_hash, head_seq + 1,
                           "entries exist past the head (inserted behind the log's back)")
        return verdict
