"""/v1/files on a real database: upload, list, retrieve, content, delete, isolation, bad input."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat

import pytest
from sqlmodel import Session, select

from gateway.models import DataFile, FineTuningJob, Tenant
from gateway.storage.layout import tenant_root
from tests.service.conftest import TENANT_A, TENANT_B, Gateway, chat_lines

pytestmark = pytest.mark.service


def stored_path(gw: Gateway, tenant: str, sha: str):  # type: ignore[no-untyped-def]
    return tenant_root(gw.settings.storage_root, tenant) / "datasets" / f"{sha}.jsonl"


def test_upload_processed_with_report_and_private_storage(gw: Gateway) -> None:
    data = chat_lines(20)
    r = gw.upload(TENANT_A, data)
    assert r.status_code == 200, r.text
    obj = r.json()
    assert obj["object"] == "file" and obj["id"].startswith("file-")
    assert obj["status"] == "processed" and obj["bytes"] == len(data) and obj["purpose"] == "fine-tune"
    assert obj["validation"]["ok"] and obj["validation"]["stats"]["examples"] == 20
    path = stored_path(gw, TENANT_A, hashlib.sha256(data).hexdigest())
    st = path.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    if os.geteuid() == 0:
        assert st.st_uid == pwd.getpwnam(f"sft-{TENANT_A}").pw_uid
    assert list(path.parent.glob(".upload-*")) == [], "no temp file left behind"


def test_list_retrieve_content_and_dedup(gw: Gateway) -> None:
    data = chat_lines(12)
    first = gw.upload(TENANT_A, data).json()
    again = gw.upload(TENANT_A, data, filename="copy.jsonl").json()
    assert again["id"] == first["id"], "an identical re-upload deduplicates"
    listing = gw.client.get("/v1/files", headers=gw.auth(TENANT_A)).json()
    assert listing["object"] == "list" and [o["id"] for o in listing["data"]] == [first["id"]]
    got = gw.client.get(f"/v1/files/{first['id']}", headers=gw.auth(TENANT_A)).json()
    assert got == first
    content = gw.client.get(f"/v1/files/{first['id']}/content", headers=gw.auth(TENANT_A))
    assert content.status_code == 200 and content.content == data


def test_delete_removes_bytes(gw: Gateway) -> None:
    data = chat_lines(11)
    fid = gw.upload(TENANT_A, data).json()["id"]
    path = stored_path(gw, TENANT_A, hashlib.sha256(data).hexdigest())
    assert path.exists()
    r = gw.client.delete(f"/v1/files/{fid}", headers=gw.auth(TENANT_A))
    assert r.status_code == 200 and r.json() == {"id": fid, "object": "file", "deleted": True}
    assert not path.exists()
    assert gw.client.get(f"/v1/files/{fid}", headers=gw.auth(TENANT_A)).status_code == 404


def test_file_of_an_active_job_cannot_be_deleted(gw: Gateway) -> None:
    fid = gw.upload(TENANT_A, chat_lines(10)).json()["id"]
    with Session(gw.app.state.engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == TENANT_A)).one()
        job = FineTuningJob(tenant_id=tenant.id, status="running", training_file=fid, model="m")
        s.add(job)
        s.commit()
        job_id = job.id
    r = gw.client.delete(f"/v1/files/{fid}", headers=gw.auth(TENANT_A))
    assert r.status_code == 409 and job_id in r.json()["error"]["message"]
    with Session(gw.app.state.engine) as s:
        j = s.get(FineTuningJob, job_id)
        assert j is not None
        j.status = "succeeded"
        s.add(j)
        s.commit()
    assert gw.client.delete(f"/v1/files/{fid}", headers=gw.auth(TENANT_A)).status_code == 200


def test_tenant_b_sees_nothing_of_tenant_a(gw: Gateway) -> None:
    fid = gw.upload(TENANT_A, chat_lines(10)).json()["id"]
    b = gw.auth(TENANT_B)
    assert gw.client.get("/v1/files", headers=b).json()["data"] == []
    for method, path in (("GET", f"/v1/files/{fid}"), ("GET", f"/v1/files/{fid}/content"),
                         ("DELETE", f"/v1/files/{fid}")):
        foreign = gw.client.request(method, path, headers=b)
        missing = gw.client.request(method, path.replace(fid, "file-000000000000000000000000"),
                                    headers=b)
        assert foreign.status_code == missing.status_code == 404
        assert foreign.json()["error"]["message"].replace(fid, "X") == \
            missing.json()["error"]["message"].replace("file-000000000000000000000000", "X")
    assert gw.client.get(f"/v1/files/{fid}", headers=gw.auth(TENANT_A)).status_code == 200


def test_auth_required(gw: Gateway) -> None:
    assert gw.client.get("/v1/files").status_code == 401
    assert gw.client.get("/v1/files", headers={"Authorization": "Bearer sft_nope"}).status_code == 401
    r = gw.client.get("/v1/files", headers=gw.auth("sysadmin"))
    assert r.status_code == 403 and "tenant token" in r.json()["error"]["message"]


def test_bad_dataset_is_error_and_not_usable(gw: Gateway) -> None:
    data = chat_lines(12) + b'{"messages": [{"role": "robot", "content": "x"}]}\n'
    obj = gw.upload(TENANT_A, data).json()
    assert obj["status"] == "error"
    assert obj["validation"]["errors"][0] == {
        "line": 13, "kind": "bad_role", "message": "messages[0].role is not one of: system, user, assistant, tool"}
    assert "line 13" in obj["status_details"]
    with Session(gw.app.state.engine) as s:
        assert s.get(DataFile, obj["id"]).status == "error"  # type: ignore[union-attr]


@pytest.mark.parametrize(("name", "body", "headers", "status", "needle"), [
    ("truncated multipart", b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a\"\r\n\r\n"
     b"{\"messages\": []}\n", {"content-type": "multipart/form-data; boundary=XyZ"}, 400, "truncated"),
    ("wrong content type", b"{}", {"content-type": "application/json"}, 400, "multipart/form-data"),
    ("no boundary", b"x", {"content-type": "multipart/form-data"}, 400, "multipart/form-data"),
    ("no file part", b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n--B--\r\n",
     {"content-type": "multipart/form-data; boundary=B"}, 400, "no `file` part"),
    ("garbage", b"\x00\x01\x02" * 100, {"content-type": "multipart/form-data; boundary=B"}, 400, "multipart"),
])
def test_malformed_requests_get_a_clear_4xx(gw: Gateway, name: str, body: bytes,
                                            headers: dict[str, str], status: int, needle: str) -> None:
    r = gw.client.post("/v1/files", headers={**gw.auth(TENANT_A), **headers}, content=body)
    assert r.status_code == status, (name, r.text)
    assert needle in r.json()["error"]["message"], (name, r.text)
    assert list((tenant_root(gw.settings.storage_root, TENANT_A) / "datasets").glob(".upload-*")) == []
    assert gw.client.get("/healthz").status_code == 200


def test_wrong_purpose_refused(gw: Gateway) -> None:
    r = gw.upload(TENANT_A, chat_lines(10), purpose="assistants")
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    assert gw.client.get("/v1/files", headers=gw.auth(TENANT_A)).json()["data"] == []


@pytest.mark.parametrize(("label", "line", "kind"), [
    ("10 MB single line", b'{"messages": "' + b"a" * (10 * 1024 * 1024) + b'"}\n', "line_too_long"),
    ("NUL bytes", b'{"messages": [{"role": "user", "content": "a\x00b"}]}\n', "not_json"),
    ("deeply nested", b"[" * 100000 + b"]" * 100000 + b"\n", "not_json"),
])
def test_hostile_content_is_reported_by_line(gw: Gateway, label: str, line: bytes, kind: str) -> None:
    gw.settings.max_upload_bytes = 32 * 1024 * 1024
    obj = gw.upload(TENANT_A, chat_lines(10) + line).json()
    assert obj["status"] == "error", label
    assert obj["validation"]["errors"][0]["line"] == 11 and obj["validation"]["errors"][0]["kind"] == kind


@pytest.mark.parametrize(("filename", "shown"), [
    ("../../../etc/passwd", "passwd"), ("..\\..\\boot.ini", "boot.ini"),
    ("r\u00e9sum\u00e9 \u2603.jsonl", "r\u00e9sum\u00e9 \u2603.jsonl"),
    ("a\nb\r.jsonl", "a%0Ab%0D.jsonl"),  # the client percent-encodes CR/LF
])
def test_filenames_are_display_names_only(gw: Gateway, filename: str, shown: str) -> None:
    obj = gw.upload(TENANT_A, chat_lines(10, start=len(filename)), filename=filename).json()
    assert obj["filename"] == shown
    assert not (gw.settings.storage_root / "etc").exists()
    names = {p.name for p in (tenant_root(gw.settings.storage_root, TENANT_A) / "datasets").iterdir()}
    assert all(n.endswith(".jsonl") and len(n) == 64 + 6 for n in names)


@pytest.mark.parametrize(("raw", "shown"), [
    (b"\xff\xfe.jsonl", "\ufffd\ufffd.jsonl"), (b"a\x07\x1bb.jsonl", "ab.jsonl"), (b"", "upload.jsonl")])
def test_raw_filename_headers(gw: Gateway, raw: bytes, shown: str) -> None:
    body = (b"--B\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nfine-tune\r\n"
            b"--B\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + raw + b"\"\r\n\r\n"
            + chat_lines(10) + b"\r\n--B--\r\n")
    r = gw.client.post("/v1/files", headers={**gw.auth(TENANT_A),
                                             "content-type": "multipart/form-data; boundary=B"}, content=body)
    assert r.status_code == 200, r.text
    assert r.json()["filename"] == shown


def test_over_limit_by_content_length_refused_before_reading(gw: Gateway) -> None:
    big = b"x" * (gw.settings.max_upload_bytes + 100_000)
    r = gw.upload(TENANT_A, big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    d = tenant_root(gw.settings.storage_root, TENANT_A) / "datasets"
    assert not d.exists() or list(d.iterdir()) == []


def test_json_report_is_serializable_and_capped(gw: Gateway) -> None:
    gw.settings.max_reported_errors = 5
    bad = b"not json\n" * 50
    obj = gw.upload(TENANT_A, bad).json()
    v = obj["validation"]
    assert len(v["errors"]) == 5 and v["error_counts"]["not_json"] == 50
    json.dumps(v)
