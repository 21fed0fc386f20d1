"""Issue 31: portal sign-in through the site's OpenID Connect provider, in a real Chromium.

The provider is panva's oidc-provider (npm, installed by scripts/bootstrap.sh into
/opt/slurm-finetune/test-oidc), started here on a loopback port with one confidential client
for the portal and two users; its own login page is the one Chromium fills in. The username
claim (``alice@example.org``) maps to a unix user made here (``SFT_OIDC_USER_MAP``), who is in
the tenant's unix group; the other user maps to an account in no tenant's group.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser.conftest import DESKTOP, _problem
from tests.slurm.livegateway import LiveGateway, free_port

pytestmark = pytest.mark.browser
OIDC_DIR = Path("/opt/slurm-finetune/test-oidc")
PROVIDER = Path(__file__).with_name("oidc") / "provider.mjs"
TENANT = "t-web-sso"
TAG = secrets.token_hex(3)
GROUP, MEMBER, OUTSIDER = f"sftw{TAG}", f"sftwa{TAG}", f"sftwo{TAG}"
PASSWORDS = {MEMBER: secrets.token_urlsafe(12), OUTSIDER: secrets.token_urlsafe(12)}
FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"


def _node_problem() -> str | None:
    if shutil.which("node") is None:
        return "single sign-on tests skipped: no Node.js (scripts/bootstrap.sh installs the test provider with npm)"
    if not (OIDC_DIR / "node_modules" / "oidc-provider").is_dir():
        return f"single sign-on tests skipped: the test provider is not installed in {OIDC_DIR} (scripts/bootstrap.sh)"
    return None


@pytest.fixture(scope="module")
def accounts() -> Iterator[None]:
    subprocess.run(["groupadd", GROUP], check=True, capture_output=True)
    try:
        for user in (MEMBER, OUTSIDER):
            groups = ["-G", GROUP] if user == MEMBER else []
            subprocess.run(["useradd", "-M", "-d", "/nonexistent", "-s", "/usr/sbin/nologin", *groups, user],
                           check=True, capture_output=True)
        yield
    finally:
        for user in (MEMBER, OUTSIDER):
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", GROUP], capture_output=True)


@pytest.fixture(scope="module")
def sso(accounts: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LiveGateway, str]]:
    problem = _problem() or _node_problem()
    if problem:
        pytest.skip(problem)
    work = tmp_path_factory.mktemp("sso")
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    secret = secrets.token_urlsafe(32)
    from gateway.cli.privsep import service_owned_dir
    from gateway.config import Settings

    secret_dir = service_owned_dir(Settings(), f"test-sso-{TAG}")
    (secret_dir / "client-secret").write_text(secret)
    shutil.chown(secret_dir / "client-secret", Settings().service_user)
    os.chmod(secret_dir / "client-secret", 0o600)
    gw = LiveGateway(work, (TENANT,), SFT_OIDC_ISSUER=issuer, SFT_OIDC_CLIENT_ID="portal",
                     SFT_OIDC_CLIENT_SECRET_FILE=str(secret_dir / "client-secret"),
                     SFT_OIDC_USER_MAP=r"^([a-z0-9]+)@example\.org$", SFT_OIDC_NAME="Example SSO")
    people = subprocess.run([FINETUNE, "admin", "tenant", "people", TENANT, "--group", GROUP], env=gw.env,
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert people.returncode == 0, people.stderr
    config = {"client_id": "portal", "client_secret": secret, "redirect_uri": gw.url + "/portal/oidc/callback",
              "cookie_key": secrets.token_urlsafe(16),
              "users": {u: {"password": PASSWORDS[u], "claims": {"preferred_username": f"{u}@example.org",
                                                                  "name": u}} for u in (MEMBER, OUTSIDER)}}
    (work / "provider.json").write_text(json.dumps(config))
    shutil.copy(PROVIDER, OIDC_DIR / f"provider-{TAG}.mjs")    # beside its node_modules
    log = open(work / "provider.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(["node", str(OIDC_DIR / f"provider-{TAG}.mjs"), str(port), str(work / "provider.json")],
                            stdout=log, stderr=subprocess.STDOUT, cwd=OIDC_DIR)
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(issuer + "/.well-known/openid-configuration", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, (work / "provider.log").read_text()[-2000:]
        time.sleep(0.2)
    try:
        yield gw, issuer
    finally:
        proc.terminate()
        proc.wait(10)
        (OIDC_DIR / f"provider-{TAG}.mjs").unlink(missing_ok=True)
        gw.stop()
        shutil.rmtree(secret_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def chromium(sso: Any, browser: Any) -> Any:
    """The tier's Chromium (conftest's ``browser``), once the provider and this gateway are up."""
    return browser


def _sign_on(chromium: Any, gw: LiveGateway, user: str, password: str) -> Any:
    context = chromium.new_context(viewport=DESKTOP)
    context.set_default_timeout(15_000)
    page = context.new_page()
    page.goto(gw.url + "/portal/login")
    page.get_by_role("link", name="Sign in with Example SSO").click()
    page.wait_for_url(re.compile(r"http://127\.0\.0\.1:\d+/interaction/.*"))   # the provider's own page
    page.fill("input[name=login]", user)
    page.fill("input[name=password]", password)
    page.locator("button[type=submit]").first.click()
    return context, page


def test_a_member_signs_on_through_the_provider_and_signing_out_ends_the_session(chromium: Any, sso: Any) -> None:
    gw, issuer = sso
    context, page = _sign_on(chromium, gw, MEMBER, PASSWORDS[MEMBER])
    try:
        page.wait_for_url(re.compile(r".*/portal/jobs$"))
    except Exception as e:
        raise AssertionError(f"stopped at {page.url}: {page.inner_text('body')[:1500]}") from e
    assert MEMBER in page.locator("header").inner_text()
    cookie = [c for c in context.cookies() if c["name"] == "sft_portal"]
    assert len(cookie) == 1 and cookie[0]["sameSite"] == "Strict"

    entries = subprocess.run([FINETUNE, "admin", "audit", "verify"], env=gw.env, capture_output=True, text=True,
                             timeout=60, cwd="/")
    assert entries.returncode == 0, entries.stderr
    with gw.engine.connect() as conn:
        import sqlalchemy as sa

        actors = [r[0] for r in conn.execute(sa.text("SELECT actor FROM audit_log WHERE action = 'token.create'"))]
    assert f"{MEMBER} via oidc" in actors, actors

    page.get_by_role("button", name="Sign out").click()
    assert "signed out" in page.get_by_role("status").inner_text()
    thief = chromium.new_context(viewport=DESKTOP)
    thief.add_cookies(cookie)
    stolen = thief.new_page()
    stolen.goto(gw.url + "/portal/jobs")
    assert "/portal/login" in stolen.url           # the old cookie is refused: the session is over
    thief.close()
    context.close()


def test_a_user_in_no_tenant_group_is_refused_with_the_reason(chromium: Any, sso: Any) -> None:
    gw, _ = sso
    context, page = _sign_on(chromium, gw, OUTSIDER, PASSWORDS[OUTSIDER])
    page.wait_for_url(re.compile(r".*/portal/oidc/callback.*"))
    assert f"{OUTSIDER} is in no tenant's group" in page.get_by_role("alert").inner_text()
    assert not [c for c in context.cookies() if c["name"] == "sft_portal"]
    context.close()


def test_a_wrong_password_stops_at_the_provider(chromium: Any, sso: Any) -> None:
    gw, _ = sso
    context, page = _sign_on(chromium, gw, MEMBER, "not-the-password")
    page.wait_for_timeout(500)
    assert "/portal/" not in page.url and "wrong username or password" in page.content()
    context.close()
