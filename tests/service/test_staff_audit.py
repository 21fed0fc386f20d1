"""The audit log on a real database: tampering by direct SQL is caught by `finetune admin
audit verify`, naming the first broken entry; concurrent appends never fork the chain."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from click.testing import CliRunner
from sqlalchemy.engine import Engine

from gateway import audit
from gateway.cli import main
from gateway.config import Settings, get_settings
from gateway.db import make_engine, migrate

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


def cli_verify(settings: Settings) -> tuple[int, str]:
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(main, ["admin", "audit", "verify"],
                                 env={"SFT_DATABASE_URL": settings.database_url,
                                      "SFT_STORAGE_ROOT": str(settings.storage_root)})
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


def test_intact_chain_verifies(engine: Engine, settings: Settings) -> None:
    v = audit.verify(engine)
    assert v.ok and v.entries == 6, v.message()
    code, out = cli_verify(settings)
    assert code == 0 and "intact: 6 entries" in out, out


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
