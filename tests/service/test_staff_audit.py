"""The audit log on a real database: tampering by direct SQL is caught by `finetune admin
audit verify`, naming the first broken entry; deleting the newest entries and rewriting the
head without the key is caught by the head's HMAC; without the key file verify never says
intact; concurrent appends never fork the chain."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from gateway.access import audit
from gateway.cli import main
from gateway.config import Settings, get_settings
from gateway.db import make_engine, migrate
from tests.service.test_staff_access import audit_key  # noqa: F401 - autouse: a key file per test

pytestmark = pytest.mark.service
T0 = datetime(2030, 1, 1, tzinfo=UTC)


@pytest.fixture
def engine(settings: Settings) -> Iterator[Engine]:
    eng = make_engine(settings.database_url)
    migrate(eng)
    for i in range(6):
        audit.append_now(eng, at=T0 + timedelta(seconds=i), actor=audit.Actor(7, "staff"),
                         action="read.file_content", outcome=audit.ALLOWED if i % 2 else audit.DENIED,
                         tenant="svc-a", resource=f"file:file-{i}", grant_id="acr-1", reason=f"attempt {i}")
    yield eng
    eng.dispose()


def cli_verify(settings: Settings, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["admin", "audit", "verify", *args],
                                 env={"SFT_DATABASE_URL": settings.database_url,
                                      "SFT_STORAGE_ROOT": str(settings.storage_root), **(env or {})})
    finally:
        get_settings.cache_clear()
    return res.exit_code, res.output


TAMPERING = {
    "edit a reason": ("UPDATE audit_log SET reason = 'nothing to see' WHERE seq = 3", 3),
    "turn a refusal into an allowed read": ("UPDATE audit_log SET outcome = 'allowed' WHERE seq = 1", 1),
    "edit the actor": ("UPDATE audit_log SET actor_token_id = 8 WHERE seq = 5", 5),
    "delete a middle entry": ("DELETE FROM audit_log WHERE seq = 4", 4),
    "delete the first entry": ("DELETE FROM audit_log WHERE seq = 1", 1),
    "delete the newest entry": ("DELETE FROM audit_log WHERE seq = 6", 6),
    "reorder two entries": ("UPDATE audit_log SET seq = -1 WHERE seq = 2; UPDATE audit_log SET seq = 2 "
                            "WHERE seq = 4; UPDATE audit_log SET seq = 4 WHERE seq = -1", 2),
    "re-hash an edited entry": ("UPDATE audit_log SET reason = 'x', hash = prev_hash WHERE seq = 3", 3),
}


def test_intact_chain_verifies(engine: Engine, settings: Settings, audit_key: Path) -> None:  # noqa: F811
    v = audit.verify(engine)
    assert v.ok and v.entries == 6 and v.anchor == audit.VERIFIED, v.message()
    code, out = cli_verify(settings)
    assert code == 0 and "intact: 6 entries" in out and f"key id {v.key_id}" in out, out
    # the key: made on first use, 32 random bytes, 0600 in a 0700 dir, never in the database
    st = audit_key.stat()
    assert st.st_mode & 0o777 == 0o600 and st.st_size == audit.KEY_BYTES
    assert audit_key.parent.stat().st_mode & 0o777 == 0o700
    key = audit_key.read_bytes()
    with engine.connect() as conn:
        for table in ("audit_head", "audit_log"):
            for row in conn.execute(sa.text(f"SELECT * FROM {table}")):
                assert key.hex() not in json.dumps([str(v) for v in row])


@pytest.mark.parametrize("how", list(TAMPERING))
def test_tampering_is_detected_and_named(engine: Engine, settings: Settings, how: str) -> None:
    sql, first_broken = TAMPERING[how]
    with engine.begin() as conn:
        for statement in sql.split("; "):
            conn.execute(sa.text(statement))
    v = audit.verify(engine)
    assert not v.ok and v.broken_seq == first_broken, v.message()
    code, out = cli_verify(settings)
    assert code == 1 and f"BROKEN at entry {first_broken}" in out, out


def test_concurrent_appends_never_fork(engine: Engine) -> None:
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for i in range(15):
                audit.append_now(engine, at=T0, actor=audit.Actor(n, "staff"), action="read.job_events",
                                 outcome=audit.ALLOWED, tenant="svc-a", resource=f"job:{n}-{i}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    v = audit.verify(engine)
    assert v.ok and v.entries == 6 + 60, v.message()
    with engine.connect() as conn:
        prevs = conn.execute(sa.text("SELECT prev_hash FROM audit_log")).scalars().all()
    assert len(set(prevs)) == len(prevs), "two entries extend the same predecessor: the chain forked"


# ------------------------------------------------------------------ the anchor
def _entry(engine: Engine, seq: int) -> dict[str, object]:
    with engine.connect() as conn:
        return dict(conn.execute(sa.text("SELECT * FROM audit_log WHERE seq = :s"), {"s": seq}).mappings().one())


def truncate_and_move_head(engine: Engine, keep: int) -> None:
    """Delete every entry after ``keep`` and point the head at it: consistent, but without the key."""
    tip = _entry(engine, keep)
    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM audit_log WHERE seq > :k"), {"k": keep})
        conn.execute(sa.text("UPDATE audit_head SET seq = :s, hash = :h WHERE id = 1"), {"s": keep, "h": tip["hash"]})


def rehash_newest(engine: Engine) -> None:
    """Edit the newest entry, recompute its hash and the head's (all that needs no key)."""
    row = _entry(engine, 6)
    fields = {**row, "reason": "nothing to see", "at": row["at"]}
    if isinstance(fields["at"], str):
        fields["at"] = datetime.fromisoformat(str(fields["at"])).replace(tzinfo=UTC)
    digest = audit.entry_hash(fields)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE audit_log SET reason = 'nothing to see', hash = :h WHERE seq = 6"), {"h": digest})
        conn.execute(sa.text("UPDATE audit_head SET hash = :h WHERE id = 1"), {"h": digest})


HEAD_TAMPERING = {
    "delete the newest entry, move the head back": lambda e: truncate_and_move_head(e, 5),
    "delete the last 3 entries, move the head back": lambda e: truncate_and_move_head(e, 3),
    "delete all but the first, move the head back": lambda e: truncate_and_move_head(e, 1),
    "edit the newest entry, re-hash it and the head": rehash_newest,
    "drop the head's MAC": lambda e: _sql(e, "UPDATE audit_head SET mac = NULL, key_id = NULL WHERE id = 1"),
    "delete everything, reset the head": lambda e: _sql(e, "DELETE FROM audit_log; UPDATE audit_head SET seq = 0, "
                                                           f"hash = '{audit.GENESIS}', mac = NULL WHERE id = 1"),
    "forge a MAC and key id": lambda e: _sql(e, f"UPDATE audit_head SET mac = '{'ab' * 32}', key_id = "
                                                "'0123456789abcdef' WHERE id = 1"),
}


def _sql(engine: Engine, sql: str) -> None:
    with engine.begin() as conn:
        for statement in sql.split("; "):
            conn.execute(sa.text(statement))


@pytest.mark.parametrize("how", list(HEAD_TAMPERING))
def test_truncation_and_rewritten_heads_are_detected(engine: Engine, settings: Settings, how: str) -> None:
    HEAD_TAMPERING[how](engine)
    v = audit.verify(engine)
    assert not v.ok and v.anchor == audit.BROKEN and v.broken_seq is None, v.message()
    code, out = cli_verify(settings)
    assert code == 1 and "BROKEN at the head" in out and "intact" not in out, out
    code, out = cli_verify(settings, "--json")
    assert code == 1 and json.loads(out)["anchor"] == "broken"


@pytest.mark.parametrize("how", list(HEAD_TAMPERING))
def test_appends_after_tampering_do_not_launder_it(engine: Engine, settings: Settings, how: str) -> None:
    """The gateway keeps appending after someone moved the head: the new heads stay unsigned."""
    HEAD_TAMPERING[how](engine)
    for i in range(3):
        audit.append_now(engine, at=T0, actor=audit.Actor(1, "staff"), action="read.job_events",
                         outcome=audit.ALLOWED, tenant="svc-a", reason=f"later {i}")
    v = audit.verify(engine)
    assert not v.ok and v.anchor == audit.BROKEN and "carries no MAC" in v.problem, v.message()
    # an admin who investigated re-anchors; that is an entry of its own, naming the verdict before
    code, out = cli_reanchor(settings, "--reason", "ticket 77: restored from backup")
    assert code == 0 and "re-anchored at entry" in out and "intact" in out, out
    v = audit.verify(engine)
    assert v.ok, v.message()
    newest = _entry(engine, v.entries)
    assert newest["action"] == "audit.reanchor" and "ticket 77" in str(newest["reason"])
    assert "carries no MAC" in str(newest["reason"]) and "local admin CLI" in str(newest["reason"])


def test_reanchor_hides_no_broken_entry(engine: Engine, settings: Settings) -> None:
    _sql(engine, "UPDATE audit_log SET reason = 'x' WHERE seq = 2")
    code, out = cli_reanchor(settings, "--reason", "try")
    assert code == 0, out
    v = audit.verify(engine)
    assert not v.ok and v.broken_seq == 2, v.message()


def cli_reanchor(settings: Settings, *args: str) -> tuple[int, str]:
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["admin", "audit", "reanchor", *args],
                                 env={"SFT_DATABASE_URL": settings.database_url,
                                      "SFT_STORAGE_ROOT": str(settings.storage_root)})
    finally:
        get_settings.cache_clear()
    return res.exit_code, res.output


def test_a_new_database_with_an_existing_key_stays_unsigned_until_reanchored(
        audit_key: Path, tmp_path: Path) -> None:  # noqa: F811
    """From outside, a new database looks like a wiped one: no append signs an unsigned head
    with a key made before (only the process that just made the key does, on first use)."""
    assert not audit_key.exists()
    first = make_engine(f"sqlite:///{tmp_path / 'first.db'}")
    migrate(first)
    audit.append_now(first, at=T0, actor=audit.Actor(1, "staff"), action="x", outcome=audit.ALLOWED)
    audit.append_now(first, at=T0, actor=audit.Actor(1, "staff"), action="x", outcome=audit.ALLOWED)
    assert audit_key.exists() and audit.verify(first).ok
    wiped = make_engine(f"sqlite:///{tmp_path / 'second.db'}")
    migrate(wiped)
    audit.append_now(wiped, at=T0, actor=audit.Actor(1, "staff"), action="x", outcome=audit.ALLOWED)
    v = audit.verify(wiped)
    assert not v.ok and v.anchor == audit.BROKEN, v.message()
    audit.reanchor(wiped, at=T0, actor=audit.Actor(None, "sysadmin"), reason="new database")
    assert audit.verify(wiped).ok and audit.verify(first).ok
    first.dispose()
    wiped.dispose()


@pytest.mark.parametrize("problem", ["missing", "unreadable by the verifier", "readable by others", "too short"])
def test_verify_without_a_usable_key_never_says_intact(engine: Engine, settings: Settings, audit_key: Path,  # noqa: F811
                                                       tmp_path: Path, problem: str) -> None:
    path = tmp_path / "elsewhere" / "audit.key"
    if problem == "missing":
        expect = "no audit key file"
    elif problem == "unreadable by the verifier":
        path = tmp_path                      # a directory: cannot be read as a key
        expect = "cannot read"
    elif problem == "readable by others":
        path.parent.mkdir()
        path.write_bytes(audit_key.read_bytes())
        path.chmod(0o644)
        expect = "readable by others"
    else:
        path.parent.mkdir()
        path.write_bytes(b"short")
        path.chmod(0o600)
        expect = "holds 5 bytes"
    for tampered in (False, True):
        if tampered:
            truncate_and_move_head(engine, 3)
        v = audit.verify(engine, key_file=path)
        assert not v.ok and v.anchor == audit.UNCHECKED, v.message()
        assert "could not be checked" in v.message() and expect in v.message() and "intact" not in v.message()
        code, out = cli_verify(settings, env={"SFT_AUDIT_KEY_FILE": str(path)})
        assert code == 2 and "NOT verified" in out and "intact" not in out, out
        if path.is_dir():
            continue                        # --key-file itself refuses a directory
        code, out = cli_verify(settings, "--key-file", str(path), "--json")
        assert code == 2 and json.loads(out)["anchor"] == "unchecked" and json.loads(out)["ok"] is False
    assert not (tmp_path / "elsewhere" / "audit.key").exists() or problem != "missing", "verify makes no key"


def test_verify_with_another_key_is_not_intact(engine: Engine, settings: Settings, tmp_path: Path) -> None:
    other = tmp_path / "other.key"
    other.write_bytes(os.urandom(32))
    other.chmod(0o600)
    v = audit.verify(engine, key_file=other)
    assert not v.ok and v.anchor == audit.BROKEN and "key id" in v.problem, v.message()
    code, out = cli_verify(settings, "--key-file", str(other))
    assert code == 1 and "not with this key file's" in out, out


def test_a_key_made_by_one_gateway_is_used_by_the_next(settings: Settings, audit_key: Path) -> None:  # noqa: F811
    """Two engines (two gateway processes' worth) on one database and key file agree."""
    first, second = make_engine(settings.database_url), make_engine(settings.database_url)
    try:
        migrate(first)
        for eng in (first, second, first):
            audit.append_now(eng, at=T0, actor=audit.Actor(1, "staff"), action="metadata.jobs",
                             outcome=audit.ALLOWED, tenant="svc-a")
        assert audit.verify(second).ok
    finally:
        first.dispose()
        second.dispose()
