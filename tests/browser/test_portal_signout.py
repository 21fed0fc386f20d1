"""Sign-out in a real Chromium ends the session on the server: the cookie, copied out before
signing out and planted in a fresh browser, lands on the sign-in page."""

from __future__ import annotations

from typing import Any

import pytest

from tests.browser.conftest import TENANT_A, Portal

pytestmark = pytest.mark.browser


def test_replayed_cookie_after_sign_out_is_refused(browser: Any, gateway: Any) -> None:
    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    stolen = [c for c in a.context.cookies() if c["name"] == "sft_portal"]
    assert len(stolen) == 1 and stolen[0]["httpOnly"] and stolen[0]["sameSite"] == "Strict"
    assert not stolen[0]["secure"]           # plain HTTP here, SFT_COOKIE_SECURE=auto

    thief = Portal(browser, gateway.url, None)
    thief.context.add_cookies(stolen)
    assert thief.goto("/portal/datasets").status == 200      # before sign-out the cookie is the session
    assert thief.page.url.endswith("/portal/datasets")

    a.goto("/portal/datasets")
    a.page.get_by_role("button", name="Sign out").click()
    assert "signed out" in a.page.get_by_role("status").inner_text()
    assert not [c for c in a.context.cookies() if c["name"] == "sft_portal"]

    thief.goto("/portal/datasets")
    assert thief.page.url.endswith("/portal/login?next=/portal/datasets")
    assert thief.page.get_by_label("API token").is_visible()
    a.close()
    thief.close()
