"""Isolation: every route of the app and every tenant CLI command, called with another
tenant's token and with no token, answers 401/404 (403 for non-tenant routes) and shows
no content of the owner; "foreign" and "missing" ids are indistinguishable in timing."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from fastapi.routing import APIRoute
from sqlmodel import Session
from starlette.routing import Mount, Route

from gateway.config import Settings
from gateway.models import DataFile, FineTuningJob, JobCheckpoint, JobEvent, Sweep, WebhookEndpoint, new_id, utcnow
from gateway.storage.layout import tenant_root
from tests.reliability.conftest import Served
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines, tenant_storage_root

pytestmark = pytest.mark.service
CANARY = "CANARY-iso-7f3b"
# Routes anyone may call: everything else must refuse a caller without a token.
PUBLIC = {"/healthz", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc", "/", "/portal",
          "/portal/", "/portal/login",
          # signing in: no token yet (a MUNGE credential, the provider's answer); no tenant content
          "/v1/auth/munge", "/portal/oidc/login", "/portal/oidc/callback"}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A gateway on SQLite with tenant A owning one of everything, served over HTTP."""
    import os

    tmp = tmp_path_factory.mktemp("iso")
    os.chmod(tmp, 0o755)
    storage = next(roots := tenant_storage_root())
    settings = Settings(storage_root=storage, database_url=f"sqlite:///{tmp / 'gw.db'}",
                        default_model=None, max_upload_bytes=8 << 20)
    gw = Gateway(settings)
    r = gw.upload(TENANT_A, chat_lines(12) + f'{{"messages": [{{"role": "user", "content": "{CANARY}"}}, '
                  f'{{"role": "assistant", "content": "ok"}}]}}\n'.encode(), filename=f"{CANARY}.jsonl")
    assert r.status_code == 200, r.text
    fid = r.json()["id"]
    ids = _seed_job(gw, settings, fid)
    served = Served(gw.app)
    yield {"gw": gw, "served": served, "file": fid, **ids}
    served.close()
    gw.app.state.engine.dispose()
    next(roots, None)       # removes the storage root


def _as_tenant_files(top: Path, tenant: str) -> None:
    """Published results belong to the tenant's unix user (the broker makes them as it)."""
    import os
    import pwd

    pw = pwd.getpwnam(f"sft-{tenant}")
    for p in [top, *top.rglob("*")]:
        os.lchown(p, pw.pw_uid, pw.pw_gid)


def _seed_job(gw: Gateway, settings: Settings, fid: str) -> dict[str, str]:
    """A finished job of tenant A with an event, a checkpoint and a published result file."""
    with Session(gw.app.state.engine) as s:
        train = s.get(DataFile, fid)
        assert train is not None
        job = FineTuningJob(tenant_id=train.tenant_id, training_file=fid, model="tiny-chat", status="succeeded",
                            suffix="iso", meta={"note": CANARY}, finished_at=utcnow(), slurm_job_id=999999)
        s.add(job)
        s.flush()
        job.fine_tuned_model = f"ft:tiny-chat:{TENANT_A}:iso:{job.id}"
        aid = new_id("art")
        art = tenant_root(settings.storage_root, TENANT_A) / "artifacts" / aid
        art.mkdir(parents=True)
        (art / "eval.json").write_text(f'{{"note": "{CANARY}"}}')
        _as_tenant_files(art.parent, TENANT_A)
        result = DataFile(tenant_id=train.tenant_id, filename=f"{job.id}-eval.json", purpose="fine-tune-results",
                          bytes=(art / "eval.json").stat().st_size, sha256="0" * 64, status="processed",
                          path=f"artifacts/{aid}/eval.json", job_id=job.id)
        s.add(result)
        s.flush()
        job.result_files = [result.id]
        s.add(job)
        s.add(JobEvent(job_id=job.id, message=f"Step 1/1: {CANARY}"))
        ck = JobCheckpoint(job_id=job.id, step=1, path="checkpoints/step-1", metrics={"note": CANARY})
        s.add(ck)
        sweep = Sweep(tenant_id=train.tenant_id, model="tiny-chat", grid={"lora_r": [8]}, job_ids=[job.id],
                      suffix="iso")
        job.sweep_id = sweep.id
        hook = WebhookEndpoint(tenant_id=train.tenant_id, url=f"https://example.org/{CANARY}", secret="whsec_AAAA")
        s.add_all([sweep, job, hook])
        s.commit()
        return {"job": job.id, "model": str(job.fine_tuned_model), "result": result.id, "checkpoint": ck.id,
                "event": "ftevent-1", "sweep": sweep.id, "webhook": hook.id}


def _fill(path: str, world: dict[str, Any]) -> str:
    """Put tenant A's ids into a route's path parameters (unknown parameters get A's job id)."""
    by_name = {"file_id": world["file"], "job_id": world["job"], "model_id": world["model"],
               "checkpoint_id": world["checkpoint"], "sweep_id": world["sweep"], "webhook_id": world["webhook"]}
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: by_name.get(m.group(1), world["job"]), path)


def _flat(routes: list[Any], prefix: str = "") -> list[tuple[str, str]]:
    out = []
    for r in routes:
        if isinstance(r, Mount):
            continue          # static files: no tenant data
        if hasattr(r, "original_router"):     # FastAPI >= 0.16x keeps included routers whole
            out += _flat(r.original_router.routes, prefix + r.include_context.prefix)
        elif isinstance(r, APIRoute | Route):
            out += [(m, prefix + r.path) for m in sorted(r.methods or ()) if m not in ("HEAD", "OPTIONS")]
    return out


def _routes(app: Any) -> list[tuple[str, str]]:
    """Every (method, path) the app serves, whatever router declared it."""
    out = sorted(set(_flat(app.routes)))
    assert len(out) >= 25 and ("POST", "/v1/files") in out, out
    return out


def _no_leak(resp: httpx.Response, world: dict[str, Any]) -> None:
    body = resp.text
    assert CANARY not in body, (resp.request.method, resp.request.url, body[:300])
    assert world["model"] not in body or resp.status_code == 404, body[:300]
    assert "tiny-chat:" + TENANT_A not in body.replace(f"no such model: {world['model']}", "")


def _portal_login(served: Served, token: str) -> tuple[httpx.Client, str]:
    c = httpx.Client(base_url=served.url, timeout=30)
    page = c.get("/portal/login")
    csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
    assert csrf, page.text[:500]
    r = c.post("/portal/login", data={"token": token, "csrf": csrf.group(1)})
    assert r.status_code == 303, r.text[:300]
    home = c.get("/portal/datasets")
    mine = re.search(r'name="csrf" value="([^"]+)"', home.text)
    return c, mine.group(1) if mine else ""


def test_every_route_refuses_a_caller_without_a_token(world: dict[str, Any]) -> None:
    served: Served = world["served"]
    checked = []
    for method, path in _routes(world["gw"].app):
        if path in PUBLIC:
            continue
        r = served.http.request(method, _fill(path, world), follow_redirects=False)
        if path.startswith("/portal"):
            ok = r.status_code in (401, 403) or (r.status_code == 303 and "/portal/login" in r.headers["location"])
        else:
            ok = r.status_code == 401
        assert ok, (method, path, r.status_code, r.text[:200])
        _no_leak(r, world)
        checked.append(path)
    print(f"\nno token: {len(checked)} route+method pairs refused")


def test_every_route_with_another_tenants_token_shows_nothing(world: dict[str, Any]) -> None:
    served: Served = world["served"]
    gw: Gateway = world["gw"]
    headers = gw.auth(TENANT_B)
    portal, csrf = _portal_login(served, gw.tokens[TENANT_B])
    statuses: dict[str, int] = {}
    for method, path in _routes(gw.app):
        if path in PUBLIC or path in ("/portal/login", "/portal/logout"):
            continue
        url = _fill(path, world)
        kw: dict[str, Any] = {}
        if path in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate") and method == "POST":
            kw["json"] = {"model": "tiny-chat", "training_file": world["file"]}
        elif path == "/v1/webhooks" and method == "POST":
            kw["json"] = {"url": "https://example.org/hook"}      # a member: 403 (tenant admins register)
        elif path == "/v1/fine_tuning/sweeps" and method == "POST":
            kw["json"] = {"model": "tiny-chat", "training_file": world["file"], "validation_file": world["file"],
                          "grid": {"lora_r": [4, 8]}}
        elif path in ("/v1/files", "/portal/datasets") and method == "POST":
            continue          # B uploading its own file: covered by the dedup test below
        elif path in ("/v1/tokens", "/v1/tokens/rotate", "/v1/tokens/claim") and method == "POST":
            continue          # B minting, rotating, claiming its own tokens: tests/service/test_token_claim.py
        if path.startswith("/portal"):
            data = {"csrf": csrf, "training_file": world["file"], "model": "tiny-chat"} if method == "POST" else None
            r = portal.request(method, url, data=data, follow_redirects=False)
        else:
            r = served.http.request(method, url, headers=headers, **kw)
        statuses[f"{method} {path}"] = r.status_code
        _no_leak(r, world)
        if "{" in path or (method == "POST" and path in ("/v1/fine_tuning/jobs", "/v1/fine_tuning/jobs/estimate",
                                                          "/v1/fine_tuning/sweeps", "/portal/jobs")):
            assert r.status_code in (403, 404) or (path == "/portal/jobs" and r.status_code in (200, 400, 422)), \
                (method, path, r.status_code, r.text[:200])
        else:
            assert r.status_code in (200, 303, 403), (method, path, r.status_code, r.text[:200])
    portal.close()
    # A's objects are untouched by B's attempts (cancel, delete)
    a = gw.auth(TENANT_A)
    assert served.http.get(f"/v1/files/{world['file']}", headers=a).status_code == 200
    assert served.http.get(f"/v1/models/{world['model']}", headers=a).status_code == 200
    assert served.http.get(f"/v1/files/{world['result']}/content", headers=a).status_code == 200
    print(f"\nforeign token: {len(statuses)} route+method pairs: {sorted(set(statuses.values()))}")


def test_same_content_uploaded_by_another_tenant_is_a_new_file(world: dict[str, Any]) -> None:
    gw: Gateway = world["gw"]
    content = world["served"].http.get(f"/v1/files/{world['file']}/content", headers=gw.auth(TENANT_A)).content
    r = gw.upload(TENANT_B, content)
    assert r.status_code == 200 and r.json()["id"] != world["file"]


def test_every_tenant_cli_command_with_a_foreign_or_no_token(world: dict[str, Any], tmp_path: Path) -> None:
    from gateway.cli import main
    from gateway.config import get_settings

    served: Served = world["served"]
    commands = [["files", "list", "--json"], ["files", "show", world["file"]], ["files", "rm", world["file"]],
                ["jobs", "list", "--json"], ["jobs", "show", world["job"]], ["jobs", "cancel", world["job"]],
                ["jobs", "follow", world["job"]], ["jobs", "pause", world["job"]], ["jobs", "resume", world["job"]],
                ["jobs", "create", "--training-file", world["file"], "--model", "tiny-chat"],
                ["jobs", "create", "--training-file", world["file"], "--model", world["model"]],   # continue it
                ["artifacts", "download", world["job"], "--output", str(tmp_path / "dl")],
                ["jobs", "create", "--training-file", world["file"], "--model", "tiny-chat",
                 "--from-checkpoint", world["job"]],                                            # its checkpoint
                ["jobs", "checkpoints", world["job"]],
                ["artifacts", "export", world["job"], "--format", "vllm", "--output", str(tmp_path / "ex")],
                ["artifacts", "export", world["job"], "--format", "vllm", "--checkpoint", "3",
                 "--output", str(tmp_path / "ex")],
                ["models", "show", world["model"]], ["models", "bundle", world["model"], "-o", str(tmp_path / "b")],
                ["models", "aliases"],
                ["sweeps", "show", world["sweep"]], ["sweeps", "cancel", world["sweep"]], ["sweeps", "list", "--json"],
                ["sweeps", "create", "--training-file", world["file"], "--validation-file", world["file"],
                 "--model", "tiny-chat", "--grid", "lora_r=4,8"],
                ["jobs", "estimate", "--training-file", world["file"], "--model", "tiny-chat"],
                ["webhooks", "list", "--json"], ["webhooks", "deliveries", world["webhook"]],
                ["webhooks", "rm", world["webhook"]], ["webhooks", "add", "https://example.org/x"]]
    tenant_groups = {g: sorted(main.commands[g].commands) for g in ("files", "jobs", "artifacts", "sweeps",
                                                                    "webhooks")}  # type: ignore[attr-defined]
    covered = {g: sorted({c[1] for c in commands if c[0] == g} | ({"upload"} if g == "files" else set()))
               for g in tenant_groups}
    assert tenant_groups == covered, f"a tenant CLI command is not covered here: {tenant_groups}"
    for label, token in (("foreign", world["gw"].tokens[TENANT_B]), ("none", "")):
        env = {"SFT_API_URL": served.url, "SFT_API_TOKEN": token or "",
               "SFT_CREDENTIALS_FILE": str(tmp_path / "nocred.json")}
        for argv in commands:
            get_settings.cache_clear()
            res = CliRunner().invoke(main, argv, env=env)
            out = res.output
            said = out.replace(world["job"], "").replace(world["sweep"], "")   # ids the command names may be echoed
            said = said.replace(world["model"], "") if world["model"] in argv else said
            assert CANARY not in out and world["model"] not in said, (label, argv, out)
            if argv[1] in ("list", "aliases"):
                if label == "foreign":
                    assert res.exit_code == 0 and world["file"] not in out and world["job"] not in out, out
                else:
                    assert res.exit_code != 0, (argv, out)
            else:
                assert res.exit_code != 0, (label, argv, out)
                admin_only = argv[0] == "webhooks" and argv[1] in ("add", "rm")     # a member: 403 before any lookup
                want = ("403" if admin_only else "404") if label == "foreign" else ("401", "not logged in")
                assert any(w in out for w in ((want,) if isinstance(want, str) else want)), (label, argv, out)
    get_settings.cache_clear()
    assert not (tmp_path / "dl").exists() or not any((tmp_path / "dl").iterdir())
    assert not (tmp_path / "ex").exists() and not (tmp_path / "b").exists()


def _median_ms(served: Served, headers: dict[str, str], paths: list[str], n: int) -> tuple[float, float]:
    times: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(n):
        for p in paths:      # interleaved, so drift hits both alike
            t0 = time.perf_counter()
            r = served.http.get(p, headers=headers)
            times[p].append((time.perf_counter() - t0) * 1000)
            assert r.status_code == 404
    a, b = (statistics.median(times[p]) for p in paths)
    return a, b


@pytest.mark.parametrize("kind", ["file", "job", "content"])
def test_foreign_and_missing_ids_take_the_same_time(world: dict[str, Any], kind: str) -> None:
    served: Served = world["served"]
    foreign = world["file"] if kind != "job" else world["job"]
    missing = foreign[:-6] + "zzzzzz"          # same length and prefix, no such row
    base = {"file": "/v1/files/{}", "job": "/v1/fine_tuning/jobs/{}", "content": "/v1/files/{}/content"}[kind]
    headers = world["gw"].auth(TENANT_B)
    for _ in range(20):                        # warm up
        served.http.get(base.format(foreign), headers=headers)
    m_foreign, m_missing = _median_ms(served, headers, [base.format(foreign), base.format(missing)], 200)
    print(f"\n{kind}: median foreign {m_foreign:.3f} ms, missing {m_missing:.3f} ms")
    assert abs(m_foreign - m_missing) <= max(0.5, 0.15 * min(m_foreign, m_missing)), (m_foreign, m_missing)
    r1 = served.http.get(base.format(foreign), headers=headers)
    r2 = served.http.get(base.format(missing), headers=headers)
    assert r1.status_code == r2.status_code == 404
    assert r1.json()["error"]["message"].replace(foreign, "X") == r2.json()["error"]["message"].replace(missing, "X")


def test_a_foreign_id_is_never_loaded(world: dict[str, Any]) -> None:
    # found by the timing test: a foreign row was loaded (JSON columns parsed) before the tenant check,
    # ~0.5-1 ms slower than a missing one; now the tenant is part of the query
    from sqlalchemy import event

    from gateway.models import FineTuningJob as Job

    loaded: list[str] = []

    def on_load(target: Any, _ctx: Any) -> None:
        loaded.append(target.id)

    gw: Gateway = world["gw"]
    for model in (DataFile, Job):
        event.listen(model, "load", on_load)
    try:
        for path in (f"/v1/files/{world['file']}", f"/v1/files/{world['file']}/content",
                     f"/v1/fine_tuning/jobs/{world['job']}", f"/v1/fine_tuning/jobs/{world['job']}/events"):
            assert world["served"].http.get(path, headers=gw.auth(TENANT_B)).status_code == 404
    finally:
        for model in (DataFile, Job):
            event.remove(model, "load", on_load)
    assert world["file"] not in loaded and world["job"] not in loaded, loaded
