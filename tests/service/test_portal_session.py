"""Portal sessions are server-side: sign-out ends them for every gateway process, so the old
cookie replayed afterwards is refused; the cookie's Secure flag follows ``SFT_COOKIE_SECURE``."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlmodel import Session, func, select

from gateway.access.tokens import create_token, revoke_token
from gateway.app import create_app
from gateway.config import Settings
from gateway.models import ApiToken, PortalSession, Role
from gateway.portal.session import COOKIE, LOGIN_COOKIE, load_secret, sign
from gateway.services.tenants import ensure_tenant
from tests.service.conftest import TENANT_A, Gateway, _free_port, wait_port

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]
CSRF = re.compile(r'name="csrf" value="([^"]+)"')


def make_settings(tmp: Path, storage_root: Path, **kw: object) -> Settings:
    return Settings(storage_root=storage_root, database_url=f"sqlite:///{tmp / 'gw.db'}", default_model=None,
                    **kw)  # type: ignore[arg-type]


@pytest.fixture
def gw(tmp_path: Path, storage_root: Path) -> Iterator[Gateway]:
    g = Gateway(make_settings(tmp_path, storage_root))
    yield g
    g.app.state.engine.dispose()


def sign_in(client: TestClient | httpx.Client, token: str) -> httpx.Response:
    m = CSRF.search(client.get("/portal/login").text)
    assert m
    r = client.post("/portal/login", data={"token": token, "csrf": m.group(1)}, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    return r


def page_csrf(client: TestClient | httpx.Client) -> str:
    r = client.get("/portal/datasets", follow_redirects=False)
    m = CSRF.search(r.text)
    assert r.status_code == 200 and m, (r.status_code, r.headers.get("location"))
    return m.group(1)


def refused(r: httpx.Response) -> bool:
    return r.status_code == 303 and r.headers["location"].startswith("/portal/login")


def replay(app_or_url: object, cookie: str, path: str = "/portal/datasets") -> httpx.Response:
    """GET ``path`` with nothing but ``cookie``, from a fresh client (a replaying attacker)."""
    if isinstance(app_or_url, str):
        return httpx.get(app_or_url + path, headers={"cookie": f"{COOKIE}={cookie}"}, timeout=30)
    c = TestClient(app_or_url, raise_server_exceptions=False)  # type: ignore[arg-type]
    return c.get(path, headers={"cookie": f"{COOKIE}={cookie}"}, follow_redirects=False)


def live_rows(gw: Gateway) -> int:
    with Session(gw.app.state.engine) as s:
        return int(s.exec(select(func.count()).select_from(PortalSession)).one())


def test_sign_out_refuses_a_replay_of_the_old_cookie(gw: Gateway) -> None:
    c = TestClient(gw.app, raise_server_exceptions=False)
    sign_in(c, gw.tokens[TENANT_A])
    cookie = c.cookies[COOKIE]
    csrf = page_csrf(c)
    assert replay(gw.app, cookie).status_code == 200          # the cookie alone is the session
    assert live_rows(gw) == 1
    r = c.post("/portal/logout", data={"csrf": csrf}, follow_redirects=False)
    assert r.status_code == 303 and r.headers["location"] == "/portal/login?signed_out=1"
    assert live_rows(gw) == 0
    # the attacker kept the cookie (and the form's CSRF token): every use is refused
    assert refused(replay(gw.app, cookie))
    assert refused(replay(gw.app, cookie, "/portal/jobs"))
    attacker = TestClient(gw.app, raise_server_exceptions=False)
    r = attacker.post("/portal/logout", data={"csrf": csrf}, headers={"cookie": f"{COOKIE}={cookie}"},
                      follow_redirects=False)
    assert refused(r)
    # the token itself still works: signing in again opens a new, different session
    c2 = TestClient(gw.app, raise_server_exceptions=False)
    sign_in(c2, gw.tokens[TENANT_A])
    assert c2.cookies[COOKIE] != cookie and page_csrf(c2) != csrf
    assert refused(replay(gw.app, cookie))


def test_sign_out_on_one_gateway_process_ends_the_session_on_another(tmp_path: Path, storage_root: Path) -> None:
    """Two apps on one database and storage stand for two `--workers` processes."""
    one = Gateway(make_settings(tmp_path, storage_root))
    two_app = create_app(one.settings)
    two = TestClient(two_app, raise_server_exceptions=False)
    c = TestClient(one.app, raise_server_exceptions=False)
    sign_in(c, one.tokens[TENANT_A])
    cookie = c.cookies[COOKIE]
    assert two.get("/portal/datasets", headers={"cookie": f"{COOKIE}={cookie}"},
                   follow_redirects=False).status_code == 200
    csrf = page_csrf(c)
    r = two.post("/portal/logout", data={"csrf": csrf}, headers={"cookie": f"{COOKIE}={cookie}"},
                 follow_redirects=False)
    assert r.status_code == 303 and "signed_out" in r.headers["location"]
    assert refused(c.get("/portal/datasets", follow_redirects=False))     # process one, same cookie
    assert refused(replay(one.app, cookie))
    one.app.state.engine.dispose()
    two_app.state.engine.dispose()


def test_a_cookie_without_a_live_session_row_is_refused(gw: Gateway) -> None:
    """A validly signed cookie is not enough: the server must know the session (old-format
    cookies from before server-side sessions, or a session id never issued)."""
    c = TestClient(gw.app, raise_server_exceptions=False)
    sign_in(c, gw.tokens[TENANT_A])
    assert page_csrf(c)
    key = load_secret(gw.settings)
    with Session(gw.app.state.engine) as s:
        tid = s.exec(select(PortalSession)).one().token_id
        tok = s.get(ApiToken, tid)
        assert tok is not None
        th = tok.token_hash[:16]
    exp = int(time.time()) + 3600
    old_style = sign(key, {"tid": tid, "th": th, "csrf": "c", "exp": exp})
    forged_sid = sign(key, {"sid": "never-issued", "tid": tid, "th": th, "csrf": "c", "exp": exp})
    for cookie in (old_style, forged_sid):
        assert refused(replay(gw.app, cookie))


def test_expired_sessions_are_refused_and_pruned_at_sign_in(gw: Gateway) -> None:
    c = TestClient(gw.app, raise_server_exceptions=False)
    sign_in(c, gw.tokens[TENANT_A])
    cookie = c.cookies[COOKIE]
    with Session(gw.app.state.engine) as s:
        row = s.exec(select(PortalSession)).one()
        row.expires_at = datetime.now(UTC) - timedelta(seconds=1)    # the server says: over
        s.add(row)
        s.commit()
    assert refused(replay(gw.app, cookie))
    sign_in(TestClient(gw.app, raise_server_exceptions=False), gw.tokens[TENANT_A])
    assert live_rows(gw) == 1          # the expired row is gone, the new one is there


def test_revoking_the_token_still_ends_its_sessions(gw: Gateway) -> None:
    c = TestClient(gw.app, raise_server_exceptions=False)
    sign_in(c, gw.tokens[TENANT_A])
    cookie = c.cookies[COOKIE]
    with Session(gw.app.state.engine) as s:
        tid = s.exec(select(PortalSession)).one().token_id
        revoke_token(session=s, token_id=tid)
        s.commit()
    assert refused(replay(gw.app, cookie))


def _set_cookies(r: httpx.Response) -> dict[str, SimpleCookie]:
    out = {}
    for header in r.headers.get_list("set-cookie"):
        jar: SimpleCookie = SimpleCookie()
        jar.load(header)
        out.update({name: jar for name in jar})
    return out


@pytest.mark.parametrize(("mode", "scheme", "secure"), [
    ("auto", "http", False), ("auto", "https", True),
    ("always", "http", True), ("always", "https", True),
    ("never", "http", False), ("never", "https", False)])
def test_cookie_secure_setting(tmp_path: Path, storage_root: Path, mode: str, scheme: str, secure: bool) -> None:
    """(A client keeps a Secure cookie out of plain-HTTP requests, as a browser does: cookies go
    back by hand here, as a TLS proxy in front would pass them.)"""
    g = Gateway(make_settings(tmp_path, storage_root, cookie_secure=mode))
    c = TestClient(g.app, base_url=f"{scheme}://testserver", raise_server_exceptions=False)
    login_page = c.get("/portal/login")
    m = CSRF.search(login_page.text)
    assert login_page.status_code == 200 and m
    pre = _set_cookies(login_page)[LOGIN_COOKIE][LOGIN_COOKIE].value
    c.cookies.clear()
    r = c.post("/portal/login", data={"token": g.tokens[TENANT_A], "csrf": m.group(1)},
               headers={"cookie": f"{LOGIN_COOKIE}={pre}"}, follow_redirects=False)
    assert r.status_code == 303, r.text[:300]
    for page in (login_page, r):
        for name, jar in _set_cookies(page).items():
            morsel = jar[name]
            assert bool(morsel["secure"]) is secure, (name, page.headers.get_list("set-cookie"))
            assert morsel["httponly"] and morsel["samesite"].lower() == "strict" and morsel["path"] == "/portal"
    session_cookie = {"cookie": f"{COOKIE}={_set_cookies(r)[COOKIE][COOKIE].value}"}
    c.cookies.clear()
    page = c.get("/portal/datasets", headers=session_cookie)
    csrf = CSRF.search(page.text)
    assert page.status_code == 200 and csrf
    # the sign-out's expiring cookie carries the same attributes
    sign_out = c.post("/portal/logout", data={"csrf": csrf.group(1)}, headers=session_cookie, follow_redirects=False)
    assert sign_out.status_code == 303
    assert bool(_set_cookies(sign_out)[COOKIE][COOKIE]["secure"]) is secure
    g.app.state.engine.dispose()


def test_an_unknown_cookie_secure_value_is_a_clear_error(tmp_path: Path, storage_root: Path) -> None:
    g = Gateway(make_settings(tmp_path, storage_root, cookie_secure="sometimes"))
    r = g.client.get("/portal/login")
    assert r.status_code == 500 and "SFT_COOKIE_SECURE" in r.text and "always" in r.text
    assert g.client.get("/v1/files", headers=g.auth(TENANT_A)).status_code == 200    # the API is unaffected
    g.app.state.engine.dispose()


def test_live_workers_share_sessions_and_sign_out_reaches_every_worker(tmp_path: Path, storage_root: Path) -> None:
    """`uvicorn --workers 2`: the old cookie, replayed over many fresh connections (so both
    workers serve it), is accepted before sign-out and refused by every worker after it."""
    settings = make_settings(tmp_path, storage_root)
    env = {**os.environ, "SFT_DATABASE_URL": settings.database_url, "SFT_STORAGE_ROOT": str(settings.storage_root),
           "SFT_DEFAULT_MODEL": ""}
    from gateway.db import make_engine, migrate

    engine = make_engine(settings.database_url)
    migrate(engine)
    with Session(engine) as s:
        token, _ = create_token(session=s, role=Role.MEMBER, tenant=ensure_tenant(session=s, name=TENANT_A))
        s.commit()
    engine.dispose()
    port = _free_port()
    log = open(tmp_path / "uvicorn.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "gateway.app:worker_app", "--factory",
                             "--workers", "2", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_port(port, 60)
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=30) as c:
            deadline = time.monotonic() + 60
            while True:      # both workers up: each migrates and creates the portal key on start
                try:
                    sign_in(c, token)
                    break
                except (httpx.HTTPError, AssertionError):
                    assert time.monotonic() < deadline
                    time.sleep(0.5)
            cookie = c.cookies[COOKIE]
            assert all(replay(url, cookie).status_code == 200 for _ in range(12))
            r = c.post("/portal/logout", data={"csrf": page_csrf(c)})
            assert r.status_code == 303
        answers = [replay(url, cookie) for _ in range(12)]
        assert all(refused(a) for a in answers), [a.status_code for a in answers]
    finally:
        proc.terminate()
        proc.wait(20)
        log.close()
    assert "Traceback" not in (tmp_path / "uvicorn.log").read_text()
