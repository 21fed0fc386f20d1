"""Browser tier: Debian's Chromium, driven by playwright, against `gateway serve` on the dev cluster.

Never `playwright install`: the tests launch /usr/bin/chromium through ``executable_path``.
Screenshots (desktop 1280 px and phone 390 px) go to artifacts/screenshots/.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SHOTS = ROOT / "artifacts" / "screenshots"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", "--no-first-run"]
TENANT_A, TENANT_B = "t-web-a", "t-web-b"
DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}


def _problem() -> str | None:
    if not CHROMIUM.exists():
        return "browser tier skipped: /usr/bin/chromium is missing (apt-get install chromium)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "browser tier skipped: the playwright package is missing (pip install playwright)"
    if os.geteuid() != 0:
        return "browser tier skipped: the dev cluster and tenant onboarding need root"
    if not shutil.which("sbatch"):
        return "browser tier skipped: Slurm is not installed (finetune dev-cluster up)"
    from gateway.slurm import LocalRunner

    if LocalRunner().run(["scontrol", "ping"], timeout=10).returncode != 0:
        return "browser tier skipped: slurmctld does not answer (finetune dev-cluster up)"
    return None


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    problem = _problem()
    if problem:
        pytest.skip(problem)
    from sqlmodel import Session

    from gateway.access.tokens import create_token
    from gateway.models import Role
    from tests.slurm.livegateway import LiveGateway

    gw = LiveGateway(tmp_path_factory.mktemp("portal"), (TENANT_A, TENANT_B))
    with Session(gw.engine) as s:
        gw.tokens["sysadmin"], _ = create_token(session=s, role=Role.SYSADMIN, tenant=None, name="portal tests")
        s.commit()
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def browser(gateway: Any) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=FLAGS)
        yield b
        b.close()


class Portal:
    """One signed-in browser context (one user), with screenshot helpers."""

    def __init__(self, browser: Any, base: str, token: str | None, tz: str = "Europe/Paris"):
        self.base = base
        self.context = browser.new_context(viewport=DESKTOP, timezone_id=tz, accept_downloads=True)
        self.context.set_default_timeout(15_000)
        self.page = self.context.new_page()
        self.console_errors: list[str] = []
        self.page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        if token:
            self.sign_in(token)

    def goto(self, path: str) -> Any:
        return self.page.goto(self.base + path)

    def sign_in(self, token: str) -> None:
        self.goto("/portal/login")
        self.page.get_by_label("API token").fill(token)
        self.page.get_by_role("button", name="Sign in").click()
        self.page.wait_for_url(re.compile(r".*/portal/(jobs|admin)$"))

    def shot(self, name: str) -> None:
        """Full-page screenshots of the current page at desktop and phone width."""
        SHOTS.mkdir(parents=True, exist_ok=True)
        for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
            self.page.set_viewport_size(size)
            self.page.wait_for_timeout(300)     # the chart redraws for the new width
            self.page.screenshot(path=str(SHOTS / f"{name}-{label}.png"), full_page=True)
        self.page.set_viewport_size(DESKTOP)

    def close(self) -> None:
        self.context.close()


@pytest.fixture(scope="module")
def state() -> dict[str, Any]:
    """What one test leaves for the next in the module (ids of A's job and file)."""
    return {}
