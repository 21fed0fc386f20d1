"""Listing jobs by metadata (issue 35): OpenAI's ``metadata[key]=value`` filter through the official
openai client, answered by the database (a JSON path query on SQLite and PostgreSQL), not a scan of
the tenant's rows in Python; a filter never reaches another tenant's jobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from gateway.services.jobreads import metadata_filter
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, RecordingSubmitter, chat_lines

pytestmark = pytest.mark.service


@pytest.fixture
def gw_meta(settings: Settings, tiny_catalog: Path) -> Iterator[Gateway]:
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": tiny_catalog,
                                            "max_active_jobs_per_tenant": 100}))
    g.app.state.submitter = RecordingSubmitter()
    yield g
    g.app.state.engine.dispose()


def test_list_by_metadata_through_the_openai_client(gw_meta: Gateway) -> None:
    from openai import OpenAI

    gw = gw_meta
    made: dict[str, list[str]] = {TENANT_A: [], TENANT_B: []}
    for tenant in (TENANT_A, TENANT_B):
        file_id = gw.upload(tenant, chat_lines(12)).json()["id"]
        for i in range(6):
            meta = {"team": "search" if i % 2 else "ads", "run": str(i)}
            r = gw.client.post("/v1/fine_tuning/jobs", headers=gw.auth(tenant),
                               json={"model": "tiny-chat", "training_file": file_id, "metadata": meta,
                                     "hyperparameters": {"n_epochs": 1}})
            assert r.status_code == 200, r.text
            made[tenant].append(r.json()["id"])
    client = OpenAI(base_url=str(gw.client.base_url) + "/v1", api_key=gw.tokens[TENANT_A], http_client=gw.client,
                    max_retries=0)
    search = [j.id for j in client.fine_tuning.jobs.list(metadata={"team": "search"})]
    assert search == [made[TENANT_A][i] for i in (5, 3, 1)]       # newest first, the tenant's own only
    one = client.fine_tuning.jobs.list(metadata={"team": "search", "run": "3"})
    assert [j.id for j in one] == [made[TENANT_A][3]] and one.data[0].metadata == {"team": "search", "run": "3"}
    assert list(client.fine_tuning.jobs.list(metadata={"team": "nobody"})) == []
    page = client.fine_tuning.jobs.list(metadata={"team": "ads"}, limit=2)
    assert [j.id for j in page.data] == [made[TENANT_A][4], made[TENANT_A][2]] and page.has_more
    bad = gw.client.get("/v1/fine_tuning/jobs?metadata=x", headers=gw.auth(TENANT_A))
    assert bad.status_code == 400 and "metadata[key]=value" in bad.json()["error"]["message"]


def test_the_filter_is_sql_not_a_python_scan() -> None:
    """The condition is a JSON path expression the database evaluates (compiled for both dialects)."""
    from sqlalchemy.dialects import postgresql, sqlite

    [cond] = metadata_filter({"team": "search"})
    assert "JSON_EXTRACT" in str(cond.compile(dialect=sqlite.dialect())).upper()
    assert "->>" in str(cond.compile(dialect=postgresql.dialect()))


def test_cli_lists_by_metadata_under_a_header(gw_meta: Gateway, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.service.conftest import cli_over

    gw = gw_meta
    file_id = gw.upload(TENANT_A, chat_lines(12)).json()["id"]
    ids = [gw.client.post("/v1/fine_tuning/jobs", headers=gw.auth(TENANT_A),
                          json={"model": "tiny-chat", "training_file": file_id, "metadata": {"team": team},
                                "hyperparameters": {"n_epochs": 1}}).json()["id"] for team in ("ads", "search")]
    run = cli_over(gw, monkeypatch)
    rc, out = run(gw.tokens[TENANT_A], "jobs", "list", "--metadata", "team=search")
    lines = out.splitlines()
    assert rc == 0 and lines[0].split() == ["ID", "CREATED", "STATUS", "MODEL", "FINE-TUNED", "MODEL"]
    assert ids[1] in out and ids[0] not in out and len(lines) == 2
    rc, out = run(gw.tokens[TENANT_A], "jobs", "list", "--metadata", "team")
    assert rc == 2 and "KEY=VALUE" in out and "Traceback" not in out


def test_one_json_shape_for_lists_and_json_errors_on_stderr(gw_meta: Gateway,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 35: ``--json`` gave a bare array for files and an object for jobs, and errors stayed text:
    lists are the API's list object, an error is OpenAI's error object on stderr with exit 1."""
    import json

    from click.testing import CliRunner

    from gateway.cli import main
    from gateway.config import get_settings
    from tests.service.conftest import cli_over

    gw = gw_meta
    gw.upload(TENANT_A, chat_lines(12))
    run = cli_over(gw, monkeypatch)
    for argv in (["files", "list", "--json"], ["jobs", "list", "--json"]):
        rc, out = run(gw.tokens[TENANT_A], *argv)
        page = json.loads(out)
        assert rc == 0 and page["object"] == "list" and "has_more" in page and isinstance(page["data"], list)
    rc, out = run(gw.tokens[TENANT_A], "files", "list")
    assert rc == 0 and out.splitlines()[0].split() == ["ID", "PURPOSE", "STATUS", "SIZE", "FILENAME"]
    assert " dataset " in out.splitlines()[1]
    get_settings.cache_clear()
    res = CliRunner().invoke(main, ["jobs", "show", "ftjob-" + "0" * 24, "--json"],
                             env={"SFT_API_URL": "http://testserver", "SFT_API_TOKEN": gw.tokens[TENANT_A]})
    get_settings.cache_clear()
    assert res.exit_code == 1 and res.stdout == ""
    error = json.loads(res.stderr)["error"]
    assert error["status"] == 404 and "no such fine-tuning job" in error["message"]
