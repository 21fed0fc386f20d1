"""The hash-chained audit log: append (serialized, so the chain never forks) and verify.

Each entry's ``hash`` is sha256 over the canonical JSON of its fields, ``prev_hash``
included; ``prev_hash`` is the hash of the entry before (``GENESIS`` for the first).
The single ``audit_head`` row names the newest entry: an append first UPDATEs it,
which takes PostgreSQL's row lock (SELECT ... FOR UPDATE semantics) or SQLite's
database write lock, so two appends can never both extend the same entry. The head
also lets ``verify`` notice that the newest entries were deleted.

Editing, deleting or reordering rows breaks the chain and ``verify`` names the first
broken entry. The chain alone cannot catch someone who deletes the newest entries and
moves the head back, or rewrites entries and the head consistently: so the head is also
*anchored outside the database*. Every append stores in the head row an HMAC-SHA256 of
(seq, hash) under a key the database never holds (a file on the gateway host,
``SFT_AUDIT_KEY_FILE``, 32 random bytes, 0600, created on first use). ``verify`` recomputes
it: a head moved back or recomputed without the key fails, and where the key file is not
at hand it says the anchor could not be checked, never "intact".

An append signs only over a head that itself verifies, so the gateway appending on
top of a moved-back head never launders it (the head stays unsigned until an admin runs
``finetune admin audit reanchor``, itself an entry). The MAC covers the newest state only:
someone who saved an old head row (a database backup) and deletes every entry after it
restores a validly signed older head. That rollback is not detected here; comparing the
head hash ``verify`` prints with one kept where the DB admins cannot write still does.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import pwd
import secrets
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlmodel import Session, col, select

from gateway.config import get_settings
from gateway.db import make_engine, migrate
from gateway.models import AuditEntry, AuditHead

log = logging.getLogger("gateway.access.audit")
GENESIS = "0" * 64
ALLOWED, DENIED = "allowed", "denied"
ALERT = "alert"          # allowed, and the tenant should look: an operator minted a token for it
TENANT_DELETED = "tenant.delete"   # the last tombstone of a tenant's deletion: its namesake sees what follows
HASHED_FIELDS = ("seq", "at", "actor_token_id", "actor_role", "tenant", "resource", "action",
                 "grant_id", "outcome", "reason", "prev_hash")


@dataclass(frozen=True)
class Actor:
    token_id: int | None
    role: str
    label: str | None = None      # the person or service token: "alice via munge", "service token 'ci'"


def canonical(fields: dict[str, Any]) -> bytes:
    """The bytes an entry's hash covers: sorted-key compact JSON, times as UTC ISO with µs."""
    out = {}
    for k in HASHED_FIELDS:
        v = fields.get(k)
        out[k] = v.astimezone(UTC).isoformat(timespec="microseconds") if isinstance(v, datetime) else v
    if fields.get("actor") is not None:      # entries from before persons (migration 0017) keep their hashes
        out["actor"] = fields["actor"]
    return json.dumps(out, sort_keys=True, separators=(",", ":")).encode()


def entry_hash(fields: dict[str, Any]) -> str:
    """The sha256 (hex) of an entry's canonical bytes: what the next entry's ``prev_hash`` names."""
    return hashlib.sha256(canonical(fields)).hexdigest()


def _fields(e: AuditEntry) -> dict[str, Any]:
    return {k: getattr(e, k) for k in (*HASHED_FIELDS, "actor")}


# ------------------------------------------------------------------ the anchor key
KEY_BYTES = 32
_HEAD_DOMAIN = b"slurm-finetune audit head v1\0"
_KEY_ID_DOMAIN = b"slurm-finetune audit key id v1"
_key_files: weakref.WeakKeyDictionary[Engine, Path] = weakref.WeakKeyDictionary()
_keys: dict[Path, bytes] = {}
_fresh: set[Path] = set()       # keys this process created and has not yet seen a head signed with
_keys_lock = threading.Lock()


class KeyUnavailable(Exception):
    """The anchor key file is missing, unreadable, too short or readable by others."""


def use_key_file(engine: Engine, path: Path | str) -> None:
    """Sign and verify ``engine``'s audit head with the key in ``path`` (default: the
    ``audit_key_file`` setting)."""
    _key_files[engine] = Path(path)


def open_database(settings: Any, *, run_migrations: bool = True) -> Engine:
    """The engine of ``settings.database_url``, migrated to head, its audit chain anchored in
    ``settings.audit_key_file``: what every process that writes the gateway's DB starts with.
    It lives here, above gateway.db, because it composes the engine with the audit key."""
    engine = make_engine(settings.database_url)
    use_key_file(engine, settings.audit_key_file)
    if run_migrations:
        migrate(engine)
    return engine


def key_file_for(engine: Engine | None) -> Path:
    """The anchor key file for ``engine``: the one ``use_key_file`` set, else the ``audit_key_file`` setting."""
    path = _key_files.get(engine) if engine is not None else None
    return path if path is not None else get_settings().audit_key_file


def read_key(path: Path) -> bytes:
    """The key in ``path``; raises KeyUnavailable saying what is wrong with it."""
    try:
        st = path.stat()
        if st.st_mode & 0o077:
            raise KeyUnavailable(f"audit key file {path} is readable by others (mode {st.st_mode & 0o777:o}): "
                                 "it cannot be trusted; chmod 600 it, or restore the gateway's own copy")
        key = path.read_bytes()
    except FileNotFoundError as e:
        raise KeyUnavailable(f"no audit key file at {path}") from e
    except OSError as e:
        raise KeyUnavailable(f"cannot read the audit key file {path}: {e.strerror or e}") from e
    if len(key) < KEY_BYTES:
        raise KeyUnavailable(f"audit key file {path} holds {len(key)} bytes, not {KEY_BYTES}")
    return key


def load_key(path: Path, *, create: bool = False) -> bytes:
    """The key in ``path`` (cached per process); with ``create``, made on first use: 32
    random bytes, mode 0600, linked into place atomically so concurrent gateways agree."""
    with _keys_lock:
        if path in _keys:
            return _keys[path]
        try:
            key = read_key(path)
        except KeyUnavailable:
            try:
                present = path.exists()
            except OSError as e:      # e.g. a parent dir this user cannot search
                raise KeyUnavailable(f"cannot reach the audit key file {path}: {e.strerror or e}") from e
            if not create or present:
                raise
            key, created = _create_key(path)
            if created:
                _fresh.add(path)
        _keys[path] = key
        return key


def _create_key(path: Path) -> tuple[bytes, bool]:
    """(the key now in ``path``, whether this call made it)."""
    created = False
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            owner = _service_owner(path)
            if owner is not None:
                os.fchown(fd, *owner)
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)      # fails if another process won the race: its key is used
                created = True
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    except OSError as e:
        raise KeyUnavailable(f"cannot create the audit key file {path}: {e.strerror or e}") from e
    return read_key(path), created


def _service_owner(path: Path) -> tuple[int, int] | None:
    """Root (the admin CLI) making the key hands it to the gateway, which runs as the service
    user: the owner of the state dir when that is not root, else ``service_user``."""
    if os.geteuid() != 0:
        return None
    parent = os.stat(path.parent)
    if parent.st_uid != 0:
        return parent.st_uid, parent.st_gid
    try:
        pw = pwd.getpwnam(get_settings().service_user)
    except (KeyError, AttributeError):
        return None
    return (pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None


def key_id(key: bytes) -> str:
    """A public fingerprint of the key (names which key signed a head; reveals nothing of it)."""
    return hmac.new(key, _KEY_ID_DOMAIN, hashlib.sha256).hexdigest()[:16]


def head_mac(key: bytes, seq: int, digest: str) -> str:
    """HMAC-SHA256 of the head (newest seq and its hash): what only the key holder can make."""
    msg = _HEAD_DOMAIN + json.dumps({"seq": int(seq), "hash": digest}, sort_keys=True).encode()
    return hmac.new(key, msg, hashlib.sha256).hexdigest()


def _engine_of(db: Session | Connection) -> Engine | None:
    bind = db.get_bind() if isinstance(db, Session) else db
    return getattr(bind, "engine", None)


_warned: set[tuple[Path, str]] = set()


def _complain(path: Path, what: str, message: str) -> None:
    """Log once per key file and kind of problem (appends are frequent)."""
    if (path, what) not in _warned:
        _warned.add((path, what))
        log.error("%s", message)


def _signing_key(db: Session | Connection) -> tuple[bytes | None, Path]:
    path = key_file_for(_engine_of(db))
    try:
        return load_key(path, create=True), path
    except KeyUnavailable as e:      # the append still happens; `verify` reports the head unanchored
        _complain(path, "key", f"audit head left unsigned: {e}")
        return None, path


def _may_sign(key: bytes, path: Path, old_seq: int, old_hash: str, old_mac: str | None,
              old_key_id: str | None) -> bool:
    """Whether extending this head may carry a MAC: only when the head being extended is
    itself validly signed under ``key``, so an append never launders a head someone moved
    back or re-hashed. An unsigned head is signed only by the process that just made the
    key (first use: a new install, or the upgrade that introduced the anchor)."""
    if old_mac is None:
        return path in _fresh
    ok = old_key_id in (None, key_id(key)) and hmac.compare_digest(old_mac, head_mac(key, old_seq, old_hash))
    if ok:
        _fresh.discard(path)
    return ok


# ------------------------------------------------------------------------ append
def append(db: Session | Connection, *, at: datetime, actor: Actor, action: str, outcome: str,
           tenant: str | None = None, resource: str | None = None, grant_id: str | None = None,
           reason: str = "", reanchor: bool = False) -> int:
    """Append one entry inside the caller's transaction; returns its sequence number.

    The head row stays locked until that transaction ends, so appends are serial. The new
    head is signed when the key file is at hand and the head it extends verifies (see
    ``_may_sign``); otherwise it is left unsigned, so ``verify`` keeps reporting it until an
    admin re-anchors (``reanchor``: sign whatever the head was, recorded as this entry).
    """
    key, path = _signing_key(db)
    head_t = AuditHead.__table__  # type: ignore[attr-defined]
    db.execute(sa.update(head_t).where(head_t.c.id == 1).values(seq=head_t.c.seq + 1))
    seq, prev, old_mac, old_key_id = db.execute(sa.select(
        head_t.c.seq, head_t.c.hash, head_t.c.mac, head_t.c.key_id).where(head_t.c.id == 1)).one()
    # Round to µs so the hashed value is exactly what both databases store and return.
    fields = {"seq": seq, "at": at.astimezone(UTC), "actor_token_id": actor.token_id, "actor_role": actor.role,
              "actor": actor.label[:100] if actor.label else None, "tenant": tenant, "resource": resource,
              "action": action, "grant_id": grant_id,
              "outcome": outcome, "reason": reason[:500], "prev_hash": prev}
    digest = entry_hash(fields)
    db.execute(sa.insert(AuditEntry.__table__).values(**fields, hash=digest))  # type: ignore[attr-defined]
    sign = key is not None and (reanchor or _may_sign(key, path, seq - 1, prev, old_mac, old_key_id))
    if key is not None and not sign:
        _complain(path, "head", f"audit head (entry {seq - 1}) does not verify under {path}: the log was altered "
                                "behind the gateway's back, or signed with another key; appending unsigned until "
                                "an admin runs `finetune admin audit verify` and `finetune admin audit reanchor`")
    db.execute(sa.update(head_t).where(head_t.c.id == 1).values(
        hash=digest, mac=head_mac(key, seq, digest) if sign and key is not None else None,
        key_id=key_id(key) if sign and key is not None else None))
    return int(seq)


def append_now(engine: Engine, **kwargs: Any) -> int:
    """Append in a transaction of its own, committed before this returns (so a read is
    logged before its bytes leave, and a refusal is logged although the request fails)."""
    with engine.begin() as conn:
        return append(conn, **kwargs)


def reanchor(engine: Engine, *, at: datetime, actor: Actor, reason: str) -> int:
    """Sign the head as it is now, whatever it was, recorded as an ``audit.reanchor`` entry
    (its reason says why: the verdict before). For an admin with the key, after a verdict
    was investigated, or for a database created after its key file; makes the key if none."""
    path = key_file_for(engine)
    load_key(path, create=True)          # raises KeyUnavailable: nothing is signed without the key
    return append_now(engine, at=at, actor=actor, action="audit.reanchor", outcome=ALLOWED,
                      reason=reason, reanchor=True)


VERIFIED, UNCHECKED, BROKEN = "verified", "unchecked", "broken"


@dataclass(frozen=True)
class Verdict:
    """``ok`` only when the chain is whole *and* the head's MAC checks out under the key.

    ``anchor``: ``verified``; ``broken`` (no MAC, another key, or a MAC that does not
    match: the head was rewritten without the key); ``unchecked`` (the key file is not
    at hand: nothing said about truncation); empty when the chain itself is broken.
    """

    ok: bool
    entries: int
    head_hash: str
    broken_seq: int | None = None
    problem: str = ""
    anchor: str = ""
    key_id: str = ""

    def message(self) -> str:
        """One line for the operator: intact, not verified (the anchor could not be checked) or broken where."""
        if self.ok:
            return (f"audit log intact: {self.entries} entries, head {self.head_hash}, "
                    f"anchored by its HMAC (key id {self.key_id})")
        if self.anchor == UNCHECKED:
            return (f"audit log NOT verified: the chain of {self.entries} entries is consistent (head "
                    f"{self.head_hash}), but its anchor could not be checked: {self.problem}. Without the key, "
                    "deleted newest entries or a rewritten head go unnoticed: run this on the gateway host, "
                    "or give --key-file")
        where = f"entry {self.broken_seq}" if self.broken_seq is not None else "the head"
        return f"audit log BROKEN at {where}: {self.problem}"


def check_anchor(chain: Verdict, *, head_seq: int, mac: str | None, stored_key_id: str | None,
                 key: bytes | None, key_problem: str = "") -> Verdict:
    """Pure: judge the head's MAC for a chain that ``check_chain`` found whole up to ``head_seq``."""
    head_hash = chain.head_hash
    unsigned = "" if mac else "; the head carries no MAC either"
    if key is None:
        return Verdict(False, chain.entries, head_hash, None, key_problem + unsigned, UNCHECKED)
    mine = key_id(key)

    def broken(problem: str) -> Verdict:
        return Verdict(False, chain.entries, head_hash, None, problem, BROKEN, mine)

    if not mac:
        if head_seq == 0:
            return broken("the log is empty and its head was never signed: a database no entry was ever "
                          "appended to, or every entry was deleted and the head reset")
        return broken(f"the head (entry {head_seq}) carries no MAC: it was rewritten by someone without the key, "
                      "or the gateway appended without its key file (its log says 'audit head left unsigned')")
    if stored_key_id and stored_key_id != mine:
        return broken(f"the head was signed with key id {stored_key_id}, not with this key file's ({mine}): "
                      "this is not the gateway's key, or the head was rewritten")
    if not hmac.compare_digest(mac, head_mac(key, head_seq, head_hash)):
        return broken(f"the head's MAC does not match entry {head_seq} ({head_hash[:12]}…): the head was "
                      "rewritten without the key (newest entries deleted and the head moved back, or entries "
                      "re-hashed)")
    return Verdict(True, chain.entries, head_hash, anchor=VERIFIED, key_id=mine)


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


def verify(engine: Engine, batch: int = 5000, key_file: Path | None = None) -> Verdict:
    """Check the whole chain against the head, then the head's MAC under the key in
    ``key_file`` (default: the one appends use); returns the Verdict (never raises on
    tampering, never creates a key). Entries appended while this runs (past the head
    read first) are not judged.
    """
    path = key_file or key_file_for(engine)
    key, key_problem = None, ""
    try:
        key = read_key(path)
    except KeyUnavailable as e:
        key_problem = str(e)
    with Session(engine) as session:
        head = session.get(AuditHead, 1)
        if head is None:
            return Verdict(False, 0, "", None, "the audit_head row is missing")
        head_seq, head_hash, mac, stored_key_id = head.seq, head.hash, head.mac, head.key_id

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
        return check_anchor(verdict, head_seq=head_seq, mac=mac, stored_key_id=stored_key_id, key=key,
                            key_problem=key_problem)
