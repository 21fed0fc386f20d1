"""Issue 31's pure and database parts, on SQLite: the audit actor in the hash chain, tenant
membership from groups and explicit rows, personal tokens that expire and follow their
person's membership, and the MUNGE sign-in checks that are the gateway's own (the credential's
binding, lifetime and nonce; a decode function stands in for munged, which the slurm tier runs
for real in tests/slurm/test_signin.py)."""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlmodel import Session

from gateway.access import audit, members, munge, signin
from gateway.access.tokens import authenticate, create_token
from gateway.db import make_engine, migrate
from gateway.errors import Conflict, Forbidden, Unauthorized
from gateway.models import Role, TenantMember, utcnow
from gateway.services.tenants import ensure_tenant

URL = "http://gw.test:8000"
ME = pwd.getpwuid(os.getuid()).pw_name
MY_GROUP = grp.getgrgid(os.getgid()).gr_name


@pytest.fixture
def engine(tmp_path: Path) -> sa.engine.Engine:
    e = make_engine(f"sqlite:///{tmp_path / 'gw.db'}")
    migrate(e)
    audit.use_key_file(e, tmp_path / "audit.key")
    return e


def test_an_entry_with_an_actor_verifies_and_an_altered_actor_does_not(engine: sa.engine.Engine) -> None:
    audit.append_now(engine, at=utcnow(), actor=audit.Actor(None, "sysadmin"), action="x", outcome=audit.ALLOWED)
    audit.append_now(engine, at=utcnow(), actor=audit.Actor(3, "member", "alice via munge"), action="y",
                     outcome=audit.ALLOWED)
    assert audit.verify(engine).ok
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE audit_log SET actor = 'mallory via munge' WHERE actor IS NOT NULL"))
    assert not audit.verify(engine).ok


def test_an_entry_without_an_actor_hashes_as_before_persons() -> None:
    fields = {"seq": 1, "at": utcnow(), "actor_token_id": None, "actor_role": "sysadmin", "tenant": None,
              "resource": None, "action": "x", "grant_id": None, "outcome": "allowed", "reason": "",
              "prev_hash": audit.GENESIS}
    assert audit.canonical({**fields, "actor": None}) == audit.canonical(fields)
    assert b'"actor"' in audit.canonical({**fields, "actor": "alice via munge"})


def test_membership_comes_from_the_group_or_an_explicit_row(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        t = ensure_tenant(session=s, name="acme")
        assert members.role_in(s, t, ME, fresh=True) is None
        t.unix_group = MY_GROUP
        assert members.role_in(s, t, ME) is Role.MEMBER
        t.admin_group = MY_GROUP
        assert members.role_in(s, t, ME) is Role.TENANT_ADMIN
        t.unix_group = t.admin_group = None
        s.add(TenantMember(tenant_id=t.id or 0, username="someone-else"))
        s.flush()
        assert members.role_in(s, t, "someone-else") is Role.MEMBER
        assert members.tenants_of(s, "someone-else") == {"acme": Role.MEMBER}
        assert members.tenants_of(s, "nobody-at-all") == {}


def test_a_personal_token_expires_and_follows_its_person_out_of_the_tenant(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        t = ensure_tenant(session=s, name="acme")
        s.add(TenantMember(tenant_id=t.id or 0, username="alice", admin=True))
        s.flush()
        done = signin.person_sign_in(session=s, username="alice", uid=12345, via="munge", tenant=None, now=utcnow(),
                                     ttl=timedelta(hours=12), service_user="sft-gateway")
        assert (done.tenant, done.role, done.token.via) == ("acme", Role.TENANT_ADMIN, "munge")
        p = authenticate(session=s, token=done.secret)
        assert p is not None and (p.person, p.role) == ("alice", Role.TENANT_ADMIN)
        row = s.exec(sa.select(TenantMember).where(TenantMember.username == "alice")).scalar_one()  # type: ignore[call-overload]
        row.admin = False
        s.flush()
        demoted = authenticate(session=s, token=done.secret)
        assert demoted is not None and demoted.role is Role.MEMBER
        s.delete(row)
        s.flush()
        assert authenticate(session=s, token=done.secret) is None
        old, _ = create_token(session=s, role=Role.MEMBER, tenant=t, expires_at=utcnow() - timedelta(seconds=1))
        assert authenticate(session=s, token=old) is None


def test_the_platforms_own_accounts_never_sign_in(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        t = ensure_tenant(session=s, name="acme")
        for user in ("root", "sft-gateway", t.unix_user):
            s.add(TenantMember(tenant_id=t.id or 0, username=user))
        s.commit()
        for user, uid in (("root", 0), ("sft-gateway", 999), (t.unix_user, 2000)):
            with pytest.raises(Forbidden, match="the platform itself runs as"):
                signin.person_sign_in(session=s, username=user, uid=uid, via="munge", tenant=None, now=utcnow(),
                                      ttl=timedelta(hours=1), service_user="sft-gateway")


def test_several_tenants_need_a_choice_and_a_foreign_one_is_refused(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        for name in ("acme", "beta"):
            s.add(TenantMember(tenant_id=ensure_tenant(session=s, name=name).id or 0, username="alice"))
        ensure_tenant(session=s, name="gamma")
        s.commit()
        kw = {"session": s, "username": "alice", "uid": 12345, "via": "munge", "now": utcnow(),
              "ttl": timedelta(hours=1), "service_user": "sft-gateway"}
        with pytest.raises(Conflict, match="belongs to tenants acme, beta: pick one"):
            signin.person_sign_in(tenant=None, **kw)  # type: ignore[arg-type]
        with pytest.raises(Forbidden, match="not a member of tenant 'gamma'"):
            signin.person_sign_in(tenant="gamma", **kw)  # type: ignore[arg-type]
        assert signin.person_sign_in(tenant="beta", **kw).tenant == "beta"  # type: ignore[arg-type]


def _decoder(payload: dict[str, object] | bytes, *, uid: int | None = None, ttl: int = 60):  # type: ignore[no-untyped-def]
    raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()

    def decode(_credential: str) -> munge.Credential:
        return munge.Credential(os.getuid() if uid is None else uid, os.getgid(), raw, int(utcnow().timestamp()), ttl)

    return decode


@pytest.mark.parametrize(("payload", "ttl", "words"), [
    ({"aud": "something else", "url": URL, "nonce": "n" * 32}, 60, "not a sign-in credential"),
    (b"\xff not json", 60, "not a sign-in credential"),
    ({"aud": munge.AUDIENCE, "url": "http://elsewhere:8000", "nonce": "n" * 32}, 60,
     "bound to 'http://elsewhere:8000', not to this gateway"),
    ({"aud": munge.AUDIENCE, "url": URL, "nonce": "n" * 32}, 3600, "may live at most 300 s"),
    ({"aud": munge.AUDIENCE, "url": URL, "nonce": "short"}, 60, "already used"),
])
def test_a_credential_not_made_for_this_sign_in_is_refused(engine: sa.engine.Engine, payload: dict[str, object],
                                                           ttl: int, words: str) -> None:
    with Session(engine) as s, pytest.raises(Unauthorized, match=words):
        signin.munge_sign_in(session=s, credential="MUNGE:x", urls=[URL], tenant=None, now=utcnow(),
                             ttl=timedelta(hours=1), service_user="sft-gateway", decode=_decoder(payload, ttl=ttl))
    with engine.connect() as conn:     # the refusal is in the audit log, committed
        reasons = [r[0] for r in conn.execute(sa.text("SELECT reason FROM audit_log WHERE action = 'sign_in'"))]
    assert any(words.split("'")[0] in r for r in reasons), reasons


def test_a_nonce_is_accepted_once_across_gateways(engine: sa.engine.Engine) -> None:
    nobody = pwd.getpwnam("nobody")
    with Session(engine) as s:
        s.add(TenantMember(tenant_id=ensure_tenant(session=s, name="acme").id or 0, username=nobody.pw_name))
        s.commit()
    payload = json.loads(munge.login_payload(URL))
    for attempt in range(2):     # two gateways sharing the database: each with its own munged
        with Session(engine) as s:
            kw = {"session": s, "credential": "MUNGE:x", "urls": [URL + "/"], "tenant": None, "now": utcnow(),
                  "ttl": timedelta(hours=1), "service_user": "sft-gateway",
                  "decode": _decoder(payload, uid=nobody.pw_uid)}
            if attempt == 0:
                assert signin.munge_sign_in(**kw).person == nobody.pw_name  # type: ignore[arg-type]
                s.commit()
            else:
                with pytest.raises(Unauthorized, match="already used"):
                    signin.munge_sign_in(**kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("code", "audited"), [(14, False), (8, False), (17, True), (15, True)])
def test_only_refusals_of_this_clusters_credentials_are_audited(engine: sa.engine.Engine, code: int,
                                                               audited: bool) -> None:
    """Anyone can post bytes to the sign-in route: garbage or another key's credential is logged, not an
    audit entry each; an expired or replayed credential of this cluster's key is audited."""
    def decode(_credential: str) -> munge.Credential:
        raise munge.MungeError(code, munge.REASONS[code])

    with Session(engine) as s, pytest.raises(Unauthorized, match=re.escape(munge.REASONS[code])):
        signin.munge_sign_in(session=s, credential="MUNGE:x", urls=[URL], tenant=None, now=utcnow(),
                             ttl=timedelta(hours=1), service_user="sft-gateway", decode=decode)
    with engine.connect() as conn:
        count = conn.execute(sa.text("SELECT count(*) FROM audit_log WHERE action = 'sign_in'")).scalar_one()
    assert count == (1 if audited else 0)
