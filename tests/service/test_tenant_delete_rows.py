"""Issue 32: a tenant's database rows deleted on both backends (SQLite and a real PostgreSQL).

PostgreSQL enforces every foreign key at once, so this is where the order of ``tenant_tables``
(children before parents) and the join tables (webhook deliveries, access requests by token) are
really checked; the other tenant keeps every row, the deleted tenant's tokens stop working, an
active job refuses the deletion with nothing changed, and ``erase_freed`` says what each backend
did with the freed space (SQLite: nothing of the rows left in the files; PostgreSQL: VACUUM, space
marked free, which the receipt's database line reports as such). And the tenant admin's side:
``finetune deletion`` asks, follows and withdraws the request.
"""

from __future__ import annotations

import json
import secrets

import pytest
import sqlalchemy as sa
from sqlmodel import Session, select

from gateway.access import audit
from gateway.access.tokens import authenticate, create_token
from gateway.db import erase_freed, make_engine, migrate
from gateway.errors import Conflict
from gateway.models import FineTuningJob, Role, Tenant
from gateway.services import tenantdelete as td
from gateway.services.deletionrequests import pending_requests
from gateway.state import JobState
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, cli_over
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


def test_a_tenant_admin_asks_for_the_deletion_from_the_cli_and_a_member_cannot(gw: Gateway,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`finetune deletion request/status/withdraw` over the real API: the admin's request is pending
    (and listed for the sysadmin), a member is refused with the API's message and no traceback, and
    the other tenant sees nothing of it."""
    with Session(gw.app.state.engine) as s:
        admin, _ = create_token(session=s, role=Role.TENANT_ADMIN,
                                tenant=s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one())
        s.commit()
    run = cli_over(gw, monkeypatch)
    code, out = run(admin, "deletion", "status")
    assert code == 0 and "no deletion request" in out, out
    code, out = run(admin, "deletion", "request", "--reason", "project over")
    assert code == 0 and "pending" in out and "reason: project over" in out and "withdraw" in out, out
    code, out = run(admin, "deletion", "status", "--json")
    assert code == 0 and json.loads(out)["status"] == "pending", out
    with Session(gw.app.state.engine) as s:
        assert [r.tenant for r in pending_requests(session=s)] == [TENANT_A]
    code, out = run(gw.tokens[TENANT_A], "deletion", "request")
    assert code != 0 and "tenant_admin" in out and "Traceback" not in out, out
    code, out = run(gw.tokens[TENANT_B], "deletion", "status")      # a member of B: not its admin
    assert code != 0 and "Traceback" not in out, out
    code, out = run(admin, "deletion", "withdraw")
    assert code == 0 and "withdrawn" in out, out
    code, out = run(admin, "deletion", "withdraw")
    assert code != 0 and "no pending deletion request" in out, out
