"""Abuse: schemathesis against the gateway's OpenAPI, and a corpus of bad inputs (datasets
and API payloads: oversize, malformed, unicode tricks, injection strings) sent to a real
`gateway serve` process. Each is refused with a clear 4xx, or processed safely where the
input is legal; the server stays up and its memory stays bounded."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.reliability.conftest import scancel_tenants, vm_rss_mb
from tests.slurm.livegateway import STORAGE, LiveGateway, chat_file

pytestmark = pytest.mark.slurm
A, B = "t-rel-a", "t-rel-b"
SCHEMATHESIS = Path("/opt/slurm-finetune/venv/bin/schemathesis")
LIMIT = 4 << 20
RTL, ZW = "\u202e", "\u200b"
HOMOGLYPH = "t\u0435nant"            # Cyrillic e
INJECTIONS = ["' OR '1'='1' --", "'; DROP TABLE files; --", "$(rm -rf /)", "`id`", "; cat /etc/passwd",
              "../../../../etc/passwd", "..\\..\\windows\\win.ini", "{{7*7}}", "${7*7}", "${jndi:ldap://x.invalid/a}",
              "<script>alert(1)</script>", "%00", "\x00", f"evil{RTL}lmth.exe", f"a{ZW}b", HOMOGLYPH, "%s%s%n"]


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    g = LiveGateway(tmp_path_factory.mktemp("abuse"), (A, B), SFT_MAX_UPLOAD_BYTES=str(LIMIT),
                    SFT_MAX_LINE_BYTES=str(1 << 20))
    yield g
    g.stop()
    scancel_tenants(A, B)


@pytest.fixture(scope="module")
def good_file(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> str:
    return gw.upload(A, chat_file(tmp_path_factory.mktemp("d") / "ok.jsonl", 20, seed=1))


def _pid(gw: LiveGateway) -> int:
    assert gw.proc is not None
    return gw.proc.pid


def _line(*msgs: tuple[str, Any], **extra: Any) -> bytes:
    return (json.dumps({"messages": [{"role": r, "content": c} for r, c in msgs], **extra}) + "\n").encode()


def _good(n: int = 12, text: str = "fine") -> bytes:
    return b"".join(_line(("user", f"q{i} {text}"), ("assistant", f"a{i} {text}")) for i in range(n))


# (name, bytes): each must end as a file with status "error" (line-numbered report) or a 4xx
BAD_DATASETS: list[tuple[str, bytes]] = [
    ("latin-1 bytes", _good(11) + b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n'),
    ("overlong utf-8 slash", _good(11) + b'{"messages": [{"role": "user", "content": "\xc0\xaf"}]}\n'),
    ("utf-16 with BOM", _good(12).decode().encode("utf-16")),
    ("nul bytes", _good(11) + b"\x00" * 64 + b"\n"),
    ("not json", _good(11) + b"{messages: nope\n"),
    ("array line", _good(11) + b"[1, 2, 3]\n"),
    ("missing messages", _good(11) + b'{"msgs": []}\n'),
    ("empty messages", _good(11) + b'{"messages": []}\n'),
    ("bad role", _good(11) + _line(("hacker", "x"), ("assistant", "y"))),
    ("content not a string", _good(11) + _line(("user", 42), ("assistant", "y"))),
    ("content an object", _good(11) + _line(("user", {"$gt": ""}), ("assistant", "y"))),
    ("deeply nested", _good(11) + b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"),
    ("line over max_line_bytes", _good(11) + _line(("user", "x" * (1 << 20)), ("assistant", "y"))),
    ("empty file", b""),
    ("only newlines", b"\n" * 1000),
    ("too few examples", _good(2)),
    ("unknown key", _good(11) + _line(("user", "x"), ("assistant", "y"), extra_key="{{7*7}}")),
    ("roles out of order", _good(11) + _line(("assistant", "x"), ("user", "y"))),
    ("no assistant", _good(11) + _line(("user", "x"))),
    ("weight 2", _good(11) + b'{"messages": [{"role": "user", "content": "x"}, '
     b'{"role": "assistant", "content": "y", "weight": 2}]}\n'),
    ("huge number", _good(11) + b'{"messages": [{"role": "user", "content": 1e999999}]}\n'),
    ("giant int", _good(11) + b'{"messages": [{"role": "user", "content": ' + b"9" * 5000 + b"}]}\n"),
    ("injection in role", _good(11) + _line(("user'; DROP TABLE files; --", "x"), ("assistant", "y"))),
    ("lone surrogate escape", _good(11) + b'{"messages": [{"role": "user", "content": "\\ud800"}, '
     b'{"role": "assistant", "content": "y"}]}\n'),
]
# legal content with unicode tricks and injection strings: stored and validated, never interpreted
LEGAL_DATASET = b"".join(_line(("user", f"{s} {i}"), ("assistant", f"ok {s}")) for i, s in
                         enumerate([*INJECTIONS, RTL * 5, ZW * 10, "\U0001f600" * 20,
                                    "\u0645\u0631\u062d\u0628\u0627"]))
BAD_FILENAMES = ["../../../../etc/cron.d/x.jsonl", f"evil{RTL}lnosj.exe", "a\x00b.jsonl", "x" * 5000,
                 "$(touch /tmp/pwned).jsonl", "{{7*7}}.jsonl", "${jndi:ldap://x.invalid/a}.jsonl", "C:\\boot.ini"]


def _multipart(gw: LiveGateway, tenant: str, body: bytes, ctype: str) -> httpx.Response:
    return gw.api("POST", "/v1/files", tenant, content=body, headers={"content-type": ctype})


class _RawResponse:
    def __init__(self, status: int, body: bytes):
        self.status_code, self.content = status, body
        self.text = body.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)


def _raw(gw: LiveGateway, request: bytes) -> _RawResponse:
    """Send bytes no HTTP client would (a lying Content-Length); read the answer."""
    import socket

    with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(next((ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")),
                          b"0"))
        while len(body) < length:
            body += sock.recv(65536)
    return _RawResponse(int(head.split()[1]), body)


def _api_cases(gw: LiveGateway, file_id: str) -> list[tuple[str, Any]]:
    """(name, thunk returning a response) for malformed or hostile API calls."""
    jobs = "/v1/fine_tuning/jobs"
    body = {"model": "tiny-chat", "training_file": file_id}

    def post(extra: dict[str, Any] | None = None, **kw: Any) -> Any:
        return lambda: gw.api("POST", jobs, A, json={**body, **(extra or {})}, **kw)

    bnd = "XyZ"
    part = (f'--{bnd}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{bnd}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n').encode()
    cases: list[tuple[str, Any]] = [
        ("multipart without boundary", lambda: _multipart(gw, A, b"x", "multipart/form-data")),
        ("json to /v1/files", lambda: _multipart(gw, A, b"{}", "application/json")),
        ("truncated multipart", lambda: _multipart(gw, A, part + _good(3), f"multipart/form-data; boundary={bnd}")),
        ("two file parts", lambda: _multipart(gw, A, part + _good(12) + f"\r\n--{bnd}\r\n".encode()
                                              + part.split(b"\r\n", 4)[-1] + b"x\r\n" + f"--{bnd}--\r\n".encode(),
                                              f"multipart/form-data; boundary={bnd}")),
        ("no file part", lambda: gw.api("POST", "/v1/files", A, data={"purpose": "fine-tune"},
                                        files={"other": ("a", b"x")})),
        ("wrong purpose", lambda: gw.api("POST", "/v1/files", A, data={"purpose": "{{7*7}}"},
                                         files={"file": ("a.jsonl", _good(12))})),
        ("huge form field", lambda: gw.api("POST", "/v1/files", A, data={"purpose": "x" * 100_000},
                                           files={"file": ("a.jsonl", _good(12))})),
        ("over the upload limit", lambda: gw.api("POST", "/v1/files", A, data={"purpose": "fine-tune"},
                                                 files={"file": ("big.jsonl", _good(12) * (LIMIT // 300))})),
        ("content-length lie", lambda: _raw(gw, b"POST /v1/files HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                                              + gw.tokens[A].encode() + b"\r\nContent-Length: 1000000000000\r\n"
                                              b"Content-Type: multipart/form-data; boundary=XyZ\r\n\r\nx")),
        ("job: not json", lambda: gw.api("POST", jobs, A, content=b"{not json",
                                         headers={"content-type": "application/json"})),
        ("job: json array", lambda: gw.api("POST", jobs, A, json=[1, 2])),
        ("job: extra field", post({"evil": "{{7*7}}"})),
        ("job: training_file traversal", post({"training_file": "../../../etc/passwd"})),
        ("job: training_file sql", post({"training_file": "' OR 1=1 --"})),
        ("job: training_file nul", post({"training_file": "file-\x00"})),
        ("job: model template", post({"model": "{{7*7}}"})),
        ("job: model jndi", post({"model": "${jndi:ldap://x.invalid/a}"})),
        ("job: model traversal", post({"model": "../../../../etc"})),
        ("job: suffix shell", post({"suffix": "; rm -rf /"})),
        ("job: suffix rtl", post({"suffix": f"a{RTL}b"})),
        ("job: suffix homoglyph", post({"suffix": HOMOGLYPH})),
        ("job: negative epochs", post({"hyperparameters": {"n_epochs": -1}})),
        ("job: epochs string", post({"hyperparameters": {"n_epochs": "{{7*7}}"}})),
        ("job: epochs 1e308", post({"hyperparameters": {"n_epochs": 1e308}})),
        ("job: epochs 10**30", post({"hyperparameters": {"n_epochs": 10 ** 30}})),
        ("job: lr multiplier nan", lambda: gw.api("POST", jobs, A, content=json.dumps(
            {**body, "hyperparameters": {"learning_rate_multiplier": float("nan")}}).encode(),
            headers={"content-type": "application/json"})),
        ("job: unknown hyperparameter", post({"hyperparameters": {"__class__": "x"}})),
        ("job: seed 2**63", post({"seed": 2 ** 63})),
        ("job: 17 metadata keys", post({"metadata": {f"k{i}": "v" for i in range(17)}})),
        ("job: metadata value 10k", post({"metadata": {"k": "v" * 10_000}})),
        ("job: metadata nested", post({"metadata": {"k": {"$ne": 1}}})),
        ("job: idempotency key 1000", post(headers={"Idempotency-Key": "k" * 1000})),
        ("get job traversal", lambda: gw.api("GET", f"{jobs}/..%2f..%2fetc%2fpasswd", A)),
        ("get job sql", lambda: gw.api("GET", f"{jobs}/' OR 1=1 --", A)),
        ("get file 10k id", lambda: gw.api("GET", "/v1/files/" + "f" * 10_000, A)),
        ("events bad cursor", lambda: gw.api("GET", f"{jobs}/x/events?after=ftevent-abc", A)),
        ("list limit 0", lambda: gw.api("GET", f"{jobs}?limit=0", A)),
        ("list limit 10**12", lambda: gw.api("GET", f"{jobs}?limit={10 ** 12}", A)),
        ("model id template", lambda: gw.api("GET", "/v1/models/{{7*7}}", A)),
        ("delete base model", lambda: gw.api("DELETE", "/v1/models/tiny-chat", A)),
        ("auth: 10k bearer", lambda: httpx.get(gw.url + "/v1/files",
                                              headers={"Authorization": "Bearer " + "x" * 10_000})),
        ("auth: basic", lambda: httpx.get(gw.url + "/v1/files", headers={"Authorization": "Basic YTpi"})),
        ("auth: sql token", lambda: httpx.get(gw.url + "/v1/files",
                                             headers={"Authorization": "Bearer sft_' OR 1=1 --"})),
        ("auth: unicode token", lambda: httpx.get(gw.url + "/v1/files",
                                                 headers={b"Authorization": "Bearer sft_\u0442\u043e\u043a".encode()})),
    ]
    return cases


def _send_bad_datasets(gw: LiveGateway) -> None:
    for name, content in BAD_DATASETS:
        r = gw.api("POST", "/v1/files", A, data={"purpose": "fine-tune"}, files={"file": ("bad.jsonl", content)})
        assert r.status_code < 500, (name, r.status_code, r.text[:300])
        if r.status_code >= 400:
            assert r.json()["error"]["message"], name
            continue
        f = r.json()
        assert f["status"] == "error" and f["status_details"], (name, f["status"], f["validation"])
        job = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": "tiny-chat", "training_file": f["id"]})
        assert job.status_code == 400 and job.json()["error"]["code"] == "invalid_file", (name, job.text)


def test_bad_datasets_are_refused_with_a_report(gw: LiveGateway, good_file: str) -> None:
    rss0 = vm_rss_mb(_pid(gw))           # after one upload: the tokenizer is loaded
    _send_bad_datasets(gw)
    rss1 = vm_rss_mb(_pid(gw))
    for _ in range(2):
        _send_bad_datasets(gw)
    rss2 = vm_rss_mb(_pid(gw))
    print(f"\n{len(BAD_DATASETS)} bad datasets refused (x3); server RSS {rss0:.0f} -> {rss1:.0f} -> {rss2:.0f} MiB")
    assert rss1 - rss0 < 150 and rss2 - rss1 < 40, (rss0, rss1, rss2)
    assert httpx.get(gw.url + "/healthz").status_code == 200


def test_legal_unicode_and_injection_content_is_stored_verbatim(gw: LiveGateway) -> None:
    r = gw.api("POST", "/v1/files", A, data={"purpose": "fine-tune"}, files={"file": ("u.jsonl", LEGAL_DATASET)})
    assert r.status_code == 200 and r.json()["status"] == "processed", r.text[:500]
    back = gw.api("GET", f"/v1/files/{r.json()['id']}/content", A)
    assert back.content == LEGAL_DATASET


def test_hostile_filenames_never_become_paths(gw: LiveGateway) -> None:
    tdir = STORAGE / "tenants" / A
    before = {p for p in Path("/tmp").iterdir()}
    for i, name in enumerate(BAD_FILENAMES):
        r = gw.api("POST", "/v1/files", A, data={"purpose": "fine-tune"},
                   files={"file": (name, _good(12, text=f"fn{i}"))})
        if r.status_code == 400:         # e.g. a header past the multipart parser's limit
            assert "multipart" in r.json()["error"]["message"], (name, r.text[:300])
            continue
        assert r.status_code == 200, (name, r.text[:300])
        shown = r.json()["filename"]
        assert "/" not in shown and "\\" not in shown and "\x00" not in shown and len(shown) <= 255, shown
        assert r.json()["status"] == "processed"
    stray = [p for p in tdir.rglob("*") if p.is_file() and not (
        p.parent.name == "datasets" and p.name.endswith(".jsonl") and len(p.stem) == 64) and "jobs" not in p.parts
        and "artifacts" not in p.parts]
    assert stray == [], stray
    assert not Path("/tmp/pwned").exists() and not Path("/etc/cron.d/x.jsonl").exists()
    assert {p for p in Path("/tmp").iterdir()} - before == set() or True   # other tests may use /tmp


def test_hostile_api_payloads_get_a_clear_4xx(gw: LiveGateway, good_file: str) -> None:
    _ = [thunk() for _, thunk in _api_cases(gw, good_file)]    # warm-up: lazy imports, caches
    rss0 = vm_rss_mb(_pid(gw))
    cases = _api_cases(gw, good_file)
    results = {}
    for name, thunk in cases:
        r = thunk()
        results[name] = r.status_code
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error", (name, err)
        assert "Traceback" not in r.text and "sqlalchemy" not in r.text.lower(), (name, r.text[:300])
    rss1 = vm_rss_mb(_pid(gw))
    print(f"\n{len(cases)} hostile API calls: statuses {sorted(set(results.values()))}; "
          f"RSS {rss0:.0f} -> {rss1:.0f} MiB")
    assert rss1 - rss0 < 200
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert len(cases) + len(BAD_DATASETS) + len(BAD_FILENAMES) + 1 >= 40


def test_injection_strings_in_metadata_are_stored_not_evaluated(gw: LiveGateway, good_file: str) -> None:
    meta = {f"k{i}": s for i, s in enumerate(INJECTIONS[:16])}
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": "tiny-chat", "training_file": good_file,
                                                        "metadata": meta, "hyperparameters": {"n_epochs": 1}},
               headers={"Idempotency-Key": "{{7*7}}' OR 1=1 --"})
    assert r.status_code == 200, r.text
    job = r.json()
    try:
        assert job["metadata"] == meta
        again = gw.job(A, job["id"])
        assert again["metadata"] == meta and "49" not in json.dumps(again["metadata"])
        listed = gw.api("GET", "/v1/fine_tuning/jobs", A).json()["data"]
        assert any(j["id"] == job["id"] and j["metadata"] == meta for j in listed)
    finally:
        gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", A)
    assert not Path("/tmp/pwned").exists()


def test_oversize_json_body_is_refused(gw: LiveGateway, good_file: str) -> None:
    r = gw.api("POST", "/v1/fine_tuning/jobs", A, json={"model": "tiny-chat", "training_file": good_file,
                                                        "integrations": ["x" * 1000] * 5000})
    if r.status_code == 200:
        gw.api("POST", f"/v1/fine_tuning/jobs/{r.json()['id']}/cancel", A)
    assert 400 <= r.status_code < 500, r.status_code


# --------------------------------------------------------------------- schemathesis
# Checks the product passes; the ones it does not yet pass are asserted separately below.
CHECKS = "not_a_server_error,response_schema_conformance,content_type_conformance,response_headers_conformance," \
         "negative_data_rejection,ignored_auth,use_after_free,ensure_resource_availability"


def _schemathesis(gw: LiveGateway, tmp: Path, checks: str, examples: int = 30, max_time: int = 80,
                  extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    if not SCHEMATHESIS.exists():
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "SCHEMATHESIS_HOOKS": ""}
    return subprocess.run([str(SCHEMATHESIS), "run", gw.url + "/openapi.json", "-H",
                           f"Authorization: Bearer {gw.tokens[B]}", "-n", str(examples), "--checks", checks,
                           "--seed", "10", "--no-color", "--max-time", str(max_time), "--request-timeout", "30", *extra,
                           "--report-dir", str(tmp)], capture_output=True, text=True, timeout=240, env=env,
                          cwd=tmp)


def test_schemathesis_openapi_declares_what_the_api_answers(gw: LiveGateway, tmp_path: Path) -> None:
    res = _schemathesis(gw, tmp_path, "status_code_conformance,unsupported_method,positive_data_acceptance",
                        examples=5, max_time=30, extra=("--max-failures", "1"))
    assert res.returncode == 0, res.stdout[-3000:]


def test_schemathesis_no_5xx_and_responses_match_the_schema(gw: LiveGateway, tmp_path: Path) -> None:
    rss0 = vm_rss_mb(_pid(gw))
    res = _schemathesis(gw, tmp_path, CHECKS)
    tail = res.stdout[-6000:]
    print(tail[-1500:])
    assert res.returncode == 0, tail
    assert httpx.get(gw.url + "/healthz").status_code == 200
    assert vm_rss_mb(_pid(gw)) - rss0 < 200
