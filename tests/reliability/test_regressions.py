"""Fast regression tests for defects the reliability suite found (unit tier)."""

from __future__ import annotations

import json

from gateway.datasets.validation import validate_lines


def _ok_lines(n: int = 12) -> list[bytes]:
    return [json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                     {"role": "assistant", "content": "answer"}]}).encode() for i in range(n)]


def test_lone_surrogate_escape_is_a_line_error_not_a_crash() -> None:
    # found by tests/reliability/test_abuse.py: "\ud800" passed validation, then the tokenizer raised (HTTP 500)
    bad = b'{"messages": [{"role": "user", "content": "x\\ud800"}, {"role": "assistant", "content": "y"}]}'
    report = validate_lines([*_ok_lines(), bad], max_seq_len=2048, min_examples=10)
    assert not report["ok"]
    assert [(e["line"], e["kind"]) for e in report["errors"]] == [(13, "not_utf8")]


def test_escaped_surrogate_pairs_stay_legal() -> None:
    pair = json.dumps({"messages": [{"role": "user", "content": "smile \U0001f600"},
                                    {"role": "assistant", "content": "ok"}]}).encode()
    assert b"\\ud83d" in pair
    assert validate_lines([*_ok_lines(), pair], max_seq_len=2048, min_examples=10)["ok"]


def test_epochs_that_are_not_whole_numbers_are_a_400_not_a_500() -> None:
    # found by test_abuse.py: {"n_epochs": "{{7*7}}"} raised ValueError in int() (HTTP 500)
    import pytest

    from gateway.api.openai import to_ours
    from gateway.errors import ServiceError
    from gateway.services.jobspec import _epochs

    for bad in ("{{7*7}}", None, True, 0, -1, 2.5, 1e308, float("inf"), float("nan"), [3], 10 ** 30):
        with pytest.raises(ServiceError) as e:
            _epochs({"epochs": bad})
        assert e.value.status == 400 and e.value.param == "hyperparameters.epochs"
        with pytest.raises(ServiceError) as e:
            to_ours({"n_epochs": bad})             # OpenAI's name: the error names it
        assert e.value.status == 400 and e.value.param == "hyperparameters.n_epochs"
    assert _epochs({}) == 3 and _epochs({"epochs": 2.0}) == 2


def test_a_validator_crash_at_finish_leaves_no_temp_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # found by test_abuse.py: an exception in token counting (finish) left .upload-*.tmp behind

    import pytest

    from gateway.datasets.uploads import receive
    from gateway.datasets.validation import Validator

    class Boom:
        name = "boom"

        def count(self, conversations):  # type: ignore[no-untyped-def]
            raise TypeError("tokenizer failed")

        def bound(self, messages):  # type: ignore[no-untyped-def]
            return None

    body = b"\n".join(_ok_lines()) + b"\n"
    bnd = "b0undary"
    data = (f'--{bnd}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n').encode() \
        + body + f"\r\n--{bnd}--\r\n".encode()

    async def stream():  # type: ignore[no-untyped-def]
        yield data

    store = _store(tmp_path)
    with pytest.raises(TypeError):
        _run(receive(stream(), f"multipart/form-data; boundary={bnd}", store=store, limit=1 << 20,
                            make_validator=lambda f: Validator(max_seq_len=64, min_examples=1, counter=Boom())))
    assert list((tmp_path / "tenants" / "regr-nouser" / "datasets").iterdir()) == []


def test_gateway_killed_before_spec_json_resubmits_from_the_row(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # found by test_faults_gateway.py: SIGKILL between the job row's commit and spec.json failed the job
    # ("submission was interrupted; create the job again"), and a retry with the same Idempotency-Key
    # returned that failed job: the promise "a crash loses nothing" was broken.
    from datetime import timedelta
    from types import SimpleNamespace

    from sqlmodel import Session

    from gateway.config import Settings
    from gateway.db import make_engine, migrate
    from gateway.jobs.reconciler import Reconciler
    from gateway.models import DataFile, FineTuningJob, Tenant, utcnow
    from gateway.slurm import JobScript, SlurmClient
    from tests.slurmfake import FakeSlurm
    from trainer.contract.spec import JobSpec

    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        submission_grace_s=0)
    engine = make_engine(settings.database_url)
    migrate(engine)
    fake = FakeSlurm(accounts=("acme",))
    client = SlurmClient(fake)
    digest = "sha256:" + "a" * 64
    monkeypatch.setattr("gateway.services.jobcreate._catalog_entry",
                        lambda _s, name: SimpleNamespace(name=name, digest=digest))
    with Session(engine) as s:
        s.add(Tenant(id=1, name="acme", unix_user="sft-acme"))
        s.commit()
        s.add(DataFile(id="file-1", tenant_id=1, filename="t", bytes=1, sha256="0" * 64, status="processed"))
        s.commit()
        job = FineTuningJob(tenant_id=1, training_file="file-1", model="tiny", model_digest=digest,
                            hyperparameters={"epochs": 1, "checkpoint_every_steps": 3},
                            created_at=utcnow() - timedelta(minutes=5))
        s.add(job)
        s.commit()
        jid = job.id
    specs: list[JobSpec] = []

    def submit(job: FineTuningJob, spec: JobSpec, tenant: str) -> tuple[int, str]:
        specs.append(spec)
        return client.submit(JobScript(job.id, tenant, "ft-small", spec.job_dir, ("true",))), "ft-small"

    Reconciler(engine, settings, client, submit).cycle()
    with Session(engine) as s:
        row = s.get(FineTuningJob, jid)
        assert row is not None and row.status == "queued", (row.status if row else None, row.error if row else None)
    assert len(specs) == 1 and specs[0].job_id == jid and specs[0].checkpoint_every_steps == 3
    assert specs[0].train.sha256 == "0" * 64 and specs[0].base_model.digest == digest


def test_short_writes_never_truncate_an_upload(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # found by test_faults_disk.py: os.write's return value was ignored; on a filling disk a short
    # write kept a truncated file recorded with the full size and sha256, status "processed"
    import hashlib
    import os

    from gateway.datasets import uploads
    from gateway.datasets.validation import Validator

    real_write = os.write
    monkeypatch.setattr(uploads.os, "write", lambda fd, data: real_write(fd, bytes(data[:1000])))
    body = b"\n".join(_ok_lines(200)) + b"\n"
    bnd = "b0undary"
    data = (f'--{bnd}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n').encode() \
        + body + f"\r\n--{bnd}--\r\n".encode()

    async def stream():  # type: ignore[no-untyped-def]
        yield data

    up = _run(uploads.receive(stream(), f"multipart/form-data; boundary={bnd}", store=_store(tmp_path),
                                     limit=1 << 20, make_validator=lambda f: Validator(max_seq_len=64,
                                                                                       min_examples=1)))
    assert up.stored is not None
    stored = (tmp_path / "tenants" / "regr-nouser" / "datasets" / up.stored.name).read_bytes()
    up.discard()
    assert len(stored) == up.size == len(body) and hashlib.sha256(stored).hexdigest() == up.sha256


def test_interrupted_publication_leftovers_are_swept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # found by test_faults_gateway.py: a gateway SIGKILLed mid-publication left .pub-<job>-* build dirs
    # in the tenant's storage forever
    import os
    import time

    store = _store(tmp_path)
    store.sweep(60)                                           # creates nothing, fails on nothing
    root = tmp_path / "tenants" / "regr-nouser" / "artifacts"
    old_pub, young_pub = f".pub-ftjob-{'1' * 24}-abcdef01", f".pub-ftjob-{'2' * 24}-abcdef02"
    for name in (old_pub, "art-" + "0" * 24, young_pub, "unrelated"):
        (root / name).mkdir(parents=True)
    old = time.time() - 3600
    for name in (old_pub, "art-" + "0" * 24, "unrelated"):
        os.utime(root / name, (old, old))
    assert store.sweep(60) == 1
    # a young one may be in flight; published dirs are never touched
    assert sorted(p.name for p in root.iterdir()) == sorted(["art-" + "0" * 24, young_pub, "unrelated"])


def _store(tmp_path):  # type: ignore[no-untyped-def]
    """Direct-mode tenant storage (the tenant has no unix user: verbs run in-process)."""
    from gateway.storage import Storage

    return Storage(tmp_path, tmp_path / "no-broker.sock").tenant("regr-nouser")


def test_recovery_never_races_a_submission_still_in_flight(tmp_path) -> None:  # type: ignore[no-untyped-def]
    # found while reading the kill test's recovery path: with the defaults (grace 30 s, Slurm timeout 60 s)
    # the reconciler could resubmit a job whose sbatch was still running in a request: two Slurm jobs
    from datetime import timedelta

    from sqlmodel import Session

    from gateway.config import Settings
    from gateway.db import make_engine, migrate
    from gateway.jobs.reconciler import Reconciler
    from gateway.models import DataFile, FineTuningJob, Tenant, utcnow
    from gateway.slurm import SlurmClient
    from tests.slurmfake import FakeSlurm

    settings = Settings(storage_root=tmp_path / "s", database_url=f"sqlite:///{tmp_path / 'g.db'}",
                        submission_grace_s=30, slurm_timeout_s=60)
    engine = make_engine(settings.database_url)
    migrate(engine)
    with Session(engine) as s:
        s.add(Tenant(id=1, name="acme", unix_user="sft-acme"))
        s.commit()
        s.add(DataFile(id="file-1", tenant_id=1, filename="t", bytes=1, sha256="0" * 64, status="processed"))
        s.commit()
        job = FineTuningJob(tenant_id=1, training_file="file-1", model="m", created_at=utcnow() - timedelta(seconds=45))
        s.add(job)
        s.commit()
        jid = job.id
    calls: list[str] = []

    def submit(job: FineTuningJob, spec: object, tenant: str) -> tuple[int, str]:
        calls.append(job.id)
        return 1, "q"

    Reconciler(engine, settings, SlurmClient(FakeSlurm(accounts=("acme",))), submit).cycle()
    with Session(engine) as s:
        row = s.get(FineTuningJob, jid)
        assert row is not None and row.status == "validating_files" and calls == []


def _run(coro):  # type: ignore[no-untyped-def]
    """asyncio.run in a fresh thread: an earlier test (playwright's sync API) may leave an
    event loop running in this one."""
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()
