"""Issue 32: a tenant's database rows deleted on both backends (SQLite and a real PostgreSQL).

PostgreSQL enforces every foreign key at once, so this is where the order of ``tenant_tables``
(children before parents) and the join tables (webhook deliveries, access requests by token) are
really checked; the other tenant keeps every row, the deleted tenant's tokens stop working, an
active job refuses the deletion with nothing changed, and ``erase_freed`` says what each backend
did with the freed space (SQLite: nothing of the rows left in the files; PostgreSQL: VACUUM, space
marked free, which the receipt's database line reports as such).
"""

from __future__ import annotations

import secrets

import pytest
import sqlalchemy as sa
from sqlmodel import Session, select

from gateway.access import audit
from gateway.access.tokens import authenticate
from gateway.db import erase_freed, make_engine, migrate
from gateway.errors import Conflict
from gateway.models import FineTuningJob, Tenant
from gateway.services import tenantdelete as td
from gateway.state import JobState
from tests.unit.test_tenant_deletion_parts import _populate

pytestmark = pytest.mark.service


@pytest.fixture
def engine(db_url: str, tmp_path_factory: pytest.TempPathFactory) -> sa.engine.Engine:
    e = make_engine(db_url)
    migrate(e)
    audit.use_key_file(e, tmp_path_factory.mktemp("key") / "audit.key")
    return e


def test_a_tenants_rows_go_in_one_transaction_and_the_other_tenant_keeps_all_of_its(engine: sa.engine.Engine) -> None:
    gone, kept = secrets.token_hex(12), secrets.token_hex(12)
    with Session(engine) as s:
        a, old_token = _populate(s, "t-gone", gone)
        b, kept_token = _populate(s, "t-kept", kept)
        s.commit()
        assert a.id is not None and b.id is not None
        tid, other = a.id, b.id
    with Session(engine) as s:
        before_other = {m.__tablename__: td._count(s, m, w) for m, w in td.tenant_tables(other)}
    removed = td.delete_rows(engine, tid)
    assert all(removed[t].rows >= 1 and len(removed[t].sha256) == 64 for t in td.TENANT_TABLES), removed
    with Session(engine) as s:
        assert s.get(Tenant, tid) is None
        assert all(td._count(s, m, w) == 0 for m, w in td.tenant_tables(tid))
        assert {m.__tablename__: td._count(s, m, w) for m, w in td.tenant_tables(other)} == before_other
        assert authenticate(session=s, token=old_token) is None
        assert authenticate(session=s, token=kept_token) is not None
    said = erase_freed(engine, td.TENANT_TABLES)
    if engine.dialect.name == "sqlite":
        assert "no freed page or WAL frame kept" in said, said
    else:
        assert said.startswith(f"VACUUM of {len(td.TENANT_TABLES)} tables") and "not overwritten" in said, said
    engine.dispose()


def test_an_active_job_refuses_the_deletion_and_nothing_goes(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        a, token = _populate(s, "t-busy", secrets.token_hex(6))
        job = s.exec(select(FineTuningJob).where(FineTuningJob.tenant_id == a.id)).one()
        job.status = JobState.QUEUED.value
        s.add(job)
        s.commit()
        assert a.id is not None
        tid = a.id
        counts = {m.__tablename__: td._count(s, m, w) for m, w in td.tenant_tables(tid)}
    with pytest.raises(Conflict, match="not final yet: nothing was deleted"):
        td.delete_rows(engine, tid)
    with Session(engine) as s:
        assert {m.__tablename__: td._count(s, m, w) for m, w in td.tenant_tables(tid)} == counts
        assert authenticate(session=s, token=token) is not None
    engine.dispose()
