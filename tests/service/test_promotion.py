"""Gated promotion on a real database: an alias moves to a better model, never to a worse one or
one judged on other data; tenant admins only; every decision in the tenant's audit log."""

from __future__ import annotations

from typing import Any

import pytest
from sqlmodel import Session, select

from gateway.access.tokens import create_token
from gateway.models import AuditEntry, DataFile, FineTuningJob, Role
from gateway.services.tenants import get_tenant
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, cli_over
from tests.service.test_staff_access import audit_key  # noqa: F401 - autouse: a key file per test

pytestmark = pytest.mark.service
VAL, OTHER_VAL = "a" * 64, "b" * 64


def _model(gw: Gateway, tenant: str, n: int, after: float, val: str | None = VAL) -> str:
    """A published model of ``tenant`` whose lineage says its final eval loss was ``after`` on ``val``."""
    with Session(gw.app.state.engine) as s:
        t = get_tenant(session=s, name=tenant)
        assert t.id is not None
        if s.get(DataFile, f"file-{tenant}") is None:
            s.add(DataFile(id=f"file-{tenant}", tenant_id=t.id, filename="t.jsonl", bytes=1, sha256="c" * 64))
            s.flush()
        job = FineTuningJob(tenant_id=t.id, training_file=f"file-{tenant}", model="tiny-chat", status="succeeded",
                            fine_tuned_model=f"ft:tiny-chat:{tenant}:m{n}:ftjob-{n:024x}",
                            lineage={"eval": {"before": 5.0, "after": after},
                                     "checkpoints": [{"step": 3, "sha256": "sha256:" + "c" * 64}],
                                     "validation_file": {"id": "file-v", "sha256": val} if val else None})
        s.add(job)
        s.commit()
        assert job.fine_tuned_model is not None
        return job.fine_tuned_model


def _admin(gw: Gateway, tenant: str) -> dict[str, str]:
    with Session(gw.app.state.engine) as s:
        token, _ = create_token(session=s, role=Role.TENANT_ADMIN, tenant=get_tenant(session=s, name=tenant))
        s.commit()
    return {"Authorization": f"Bearer {token}"}


def _promote(gw: Gateway, h: dict[str, str], model: str, alias: str = "prod", **kw: Any) -> Any:
    return gw.client.post("/v1/model_aliases", headers=h, json={"model": model, "alias": alias, **kw})


def _audit(gw: Gateway) -> list[tuple[str, str]]:
    with Session(gw.app.state.engine) as s:
        rows = s.exec(select(AuditEntry).where(AuditEntry.action == "model.promote")
                      .order_by(AuditEntry.seq)).all()  # type: ignore[arg-type]
        return [(r.outcome, r.reason) for r in rows if r.tenant == TENANT_A]


def test_the_gate_refuses_a_worse_candidate_and_accepts_a_better_one(gw: Gateway) -> None:
    h = _admin(gw, TENANT_A)
    first, worse, better = _model(gw, TENANT_A, 1, 2.0), _model(gw, TENANT_A, 2, 2.5), _model(gw, TENANT_A, 3, 1.5)
    r = _promote(gw, h, first)
    assert r.status_code == 200 and r.json()["model"] == first and r.json()["gate"]["holder"] is None, r.text
    r = _promote(gw, h, worse)
    assert r.status_code == 409 and r.json()["error"]["code"] == "promotion_refused", r.text
    assert f"eval loss 2.5 is worse than 2, that of {first}, which holds 'prod'" in r.json()["error"]["message"]
    assert _promote(gw, h, worse, tolerance=0.6).status_code == 200          # an explicit allowance
    r = _promote(gw, h, better)
    assert r.status_code == 200 and r.json()["gate"]["holder"] == worse and r.json()["gate"]["holder_loss"] == 2.5
    listed = gw.client.get("/v1/model_aliases", headers=gw.auth(TENANT_A)).json()["data"]
    assert [(a["alias"], a["base_model"], a["model"]) for a in listed] == [("prod", "tiny-chat", better)]
    outcomes = [o for o, _ in _audit(gw)]
    assert outcomes == ["allowed", "denied", "allowed", "allowed"]            # the refusal is on record too
    assert any(f"-> {better}" in reason for _, reason in _audit(gw))


def test_models_judged_on_other_data_are_not_compared(gw: Gateway) -> None:
    h = _admin(gw, TENANT_A)
    assert _promote(gw, h, _model(gw, TENANT_A, 4, 2.0)).status_code == 200
    r = _promote(gw, h, _model(gw, TENANT_A, 5, 0.1, val=OTHER_VAL))         # far better, on other data
    assert r.status_code == 409 and "train the candidate with the holder's validation file" in r.text
    r = _promote(gw, h, _model(gw, TENANT_A, 6, 0.1, val=None))              # no validation file at all
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_gateable"


def test_only_tenant_admins_promote_and_only_their_own_models(gw: Gateway) -> None:
    mine, theirs = _model(gw, TENANT_A, 7, 2.0), _model(gw, TENANT_B, 8, 1.0)
    assert _promote(gw, gw.auth(TENANT_A), mine).status_code == 403           # a member token
    r = _promote(gw, _admin(gw, TENANT_A), theirs)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"     # foreign: as if absent
    assert _promote(gw, _admin(gw, TENANT_A), mine, alias="Bad Alias!").status_code in (400, 422)
    assert gw.client.get("/v1/model_aliases", headers=gw.auth(TENANT_B)).json()["data"] == []


def test_the_cli_promotes_and_lists(gw: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    run = cli_over(gw, monkeypatch)
    token = _admin(gw, TENANT_A)["Authorization"].removeprefix("Bearer ")
    model = _model(gw, TENANT_A, 9, 2.0)
    code, out = run(token, "models", "promote", model, "--alias", "prod")
    assert code == 0 and f"prod of tiny-chat -> {model}" in out, out
    code, out = run(token, "models", "aliases")
    assert code == 0 and "prod" in out and model in out, out
    code, out = run(token, "models", "promote", _model(gw, TENANT_A, 10, 3.0), "--alias", "prod")
    assert code != 0 and "promotion refused" in out, out


def test_the_portal_shows_a_models_lineage_and_aliases_to_its_tenant_only(gw: Gateway) -> None:
    from fastapi.testclient import TestClient

    from tests.service.test_portal_session import sign_in

    model = _model(gw, TENANT_A, 11, 2.0)
    assert _promote(gw, _admin(gw, TENANT_A), model, alias="prod").status_code == 200
    mine = TestClient(gw.app)
    sign_in(mine, gw.tokens[TENANT_A])
    page = mine.get(f"/portal/models/{model}")
    assert page.status_code == 200 and model in page.text and 'id="lineage"' in page.text
    assert "held out of the training file" not in page.text and "sha256:" + VAL in page.text
    assert f"{model}:ckpt-step-3" in page.text and "sha256:" + "c" * 64 in page.text
    assert "prod" in mine.get("/portal/models").text
    theirs = TestClient(gw.app)
    sign_in(theirs, gw.tokens[TENANT_B])
    assert theirs.get(f"/portal/models/{model}").status_code == 404
    assert model not in theirs.get("/portal/models").text
