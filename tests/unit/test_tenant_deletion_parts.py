"""Issue 32, a tenant deleted with a receipt: the pure parts (receipt, tombstones, the dry run's
summary, what a path is), the root-side erasure on a temp tree, the row deletion on SQLite (every
table that holds a tenant's rows, and no byte of them left in the file), the deletion requests and
the registry's retired ids. The whole deletion on the real cluster: tests/slurm/test_tenant_delete.py."""

from __future__ import annotations

import hashlib
import os
import secrets
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlmodel import Session, SQLModel, select

from gateway.access import audit
from gateway.access.staff import tenant_audit
from gateway.access.tokens import Principal, authenticate, create_token
from gateway.db import erase_freed, make_engine, migrate
from gateway.errors import Forbidden, NotFound
from gateway.models import (
    AccessRequest,
    ApiToken,
    DataFile,
    FineTuningJob,
    JobCheckpoint,
    JobEvent,
    MlflowParentRun,
    MlflowRun,
    ModelAlias,
    PortalSession,
    Role,
    Sweep,
    Tenant,
    TenantMember,
    WebhookDelivery,
    WebhookEndpoint,
    utcnow,
)
from gateway.services import deletionrequests as requests
from gateway.services import tenantdelete as td
from gateway.services.tenants import ensure_tenant
from gateway.slurm.jobcontainer import base_paths, job_tmp_dir
from gateway.state import JobState
from gateway.storage import erase, identities, layout
from gateway.storage.onboarding import UnixUser

JOB = "ftjob-" + "a" * 24


# ------------------------------------------------------------------ pure parts
@pytest.mark.parametrize("rel,kind", [
    (f"datasets/{'0' * 64}.jsonl", "datasets"), (f"jobs/{JOB}/checkpoints/step-3/state.pt", "checkpoints"),
    (f"jobs/{JOB}/slurm-812.out", "logs"), (f"jobs/{JOB}/events.jsonl", "logs"), (f"jobs/{JOB}/spec.json", "job_files"),
    (f"jobs/{JOB}/attempts/0/staging/eval.json", "job_files"), ("artifacts/art-1/adapter.tar", "results"),
    ("CLAIM-CODE-7", "claim_codes"), ("stray.txt", "other"), ("jobs", "other"),
])
def test_each_path_of_a_tenant_root_has_its_kind(rel: str, kind: str) -> None:
    assert layout.deletion_kind(rel) == kind
    assert kind in layout.DELETION_KINDS


AT = utcnow()


def _removed(**kw: object) -> td.Removed:
    storage = [erase.Entry(f"datasets/{'1' * 64}.jsonl", "file", 10, "1" * 64),
               erase.Entry(f"jobs/{JOB}/checkpoints/step-1/state.pt", "file", 100, "2" * 64),
               erase.Entry(f"jobs/{JOB}/checkpoints/step-1", "dir", 0),
               erase.Entry(f"jobs/{JOB}/slurm-9.out", "file", 5, "3" * 64),
               erase.Entry(f"jobs/{JOB}/evil", "link", 4, "4" * 64), erase.Entry(".", "dir", 0)]
    fields: dict[str, object] = dict(
        tenant="t-gone", at=AT, by="local admin CLI (uid 0)", host="vm", storage_root="/srv/x/tenants/t-gone",
        storage=storage, leftovers={"/var/lib/s/scratch/job-9": [erase.Entry("out", "file", 7, "5" * 64),
                                                               erase.Entry(".", "dir", 0)]},
        rows={"files": td.RowsRemoved(2, "a" * 64), "fine_tuning_jobs": td.RowsRemoved(1, "b" * 64),
              "sweeps": td.RowsRemoved(0, td.digest([]))},
        account="t-gone", account_removed=True, user=UnixUser("sft-t-gone", 990, 990, exists=True, ours=True),
        user_removed=True, requests=["tdr-1"])
    fields.update(kw)
    return td.Removed(**fields)  # type: ignore[arg-type]


def test_the_receipt_counts_sizes_and_hashes_what_went_per_kind() -> None:
    r = td.build_receipt(_removed())
    st = r["storage"]
    assert (st["files"], st["dirs"], st["bytes"]) == (4, 2, 115)
    assert st["kinds"]["datasets"] == {"files": 1, "bytes": 10, "sha256": st["kinds"]["datasets"]["sha256"]}
    assert st["kinds"]["checkpoints"]["files"] == 1 and st["kinds"]["logs"]["bytes"] == 5
    assert st["kinds"]["job_files"] == {"files": 1, "bytes": 0,   # the link: counted, its target's text hashed
                                        "sha256": td.digest([f"jobs/{JOB}/evil\tlink\t4\t" + "4" * 64])}
    assert st["dataset_sha256s"] == ["1" * 64]
    # the digest is over the sorted (path, kind, size, sha256) lines: anyone holding the listing can check it
    lines = [f"datasets/{'1' * 64}.jsonl\tfile\t10\t{'1' * 64}"]
    assert st["kinds"]["datasets"]["sha256"] == hashlib.sha256("".join(f"{x}\n" for x in lines).encode()).hexdigest()
    assert r["node_leftovers"] == {"files": 1, "bytes": 7, "places": [
        {"path": "/var/lib/s/scratch/job-9", "files": 1, "dirs": 1, "bytes": 7,
         "sha256": td.digest(["/var/lib/s/scratch/job-9/out\tfile\t7\t" + "5" * 64,
                              "/var/lib/s/scratch/job-9\tdir\t0\t-"])}]}
    assert r["database"]["rows"] == 3 and r["database"]["tables"]["files"] == {"rows": 2, "sha256": "a" * 64}
    assert r["slurm"] == {"account": "t-gone", "removed": True}
    assert r["unix_user"] == {"name": "sft-t-gone", "uid": 990, "gid": 990, "removed": True}
    assert (r["tenant"], r["deleted_by"], r["requests"]) == ("t-gone", "local admin CLI (uid 0)", ["tdr-1"])
    # the same deletion gives the same bytes: the sha256 in the audit log names exactly this file
    assert td.receipt_bytes(r) == td.receipt_bytes(td.build_receipt(_removed()))


def test_a_changed_file_changes_its_kinds_digest() -> None:
    a = td.build_receipt(_removed())
    changed = _removed().storage.copy()
    changed[0] = erase.Entry(changed[0].path, "file", 10, "9" * 64)
    b = td.build_receipt(_removed(storage=changed))
    assert a["storage"]["kinds"]["datasets"]["sha256"] != b["storage"]["kinds"]["datasets"]["sha256"]
    assert a["storage"]["kinds"]["checkpoints"] == b["storage"]["kinds"]["checkpoints"]
    assert a["storage"]["sha256"] != b["storage"]["sha256"]


def test_tombstones_say_kinds_and_counts_and_the_receipts_sha256_never_content() -> None:
    r = td.build_receipt(_removed())
    sha = "f" * 64
    stones = td.tombstones(r, sha)
    assert [a for a, _ in stones][-1] == audit.TENANT_DELETED
    for _, reason in stones:
        assert reason.endswith(f"receipt sha256 {sha}") and len(reason) <= 500
        assert "1" * 64 not in reason and "slurm-9.out" not in reason      # no names of the tenant's files
    assert "checkpoints 1, datasets 1, job_files 1, logs 1" in stones[0][1] and "4 files, 115 bytes" in stones[0][1]
    assert "files 2, fine_tuning_jobs 1" in stones[1][1] and "sweeps" not in stones[1][1]
    many = _removed(rows={f"table_{i:03d}": td.RowsRemoved(i + 1, "0" * 64) for i in range(80)})
    assert all(len(x) <= 500 and x.endswith(sha) for _, x in td.tombstones(td.build_receipt(many), sha))


def _plan(**kw: object) -> td.Plan:
    fields: dict[str, object] = dict(
        tenant="t-gone", tenant_id=4, rows={"files": 2, "sweeps": 0}, storage_root=Path("/srv/x/tenants/t-gone"),
        storage=[erase.Entry(f"datasets/{'1' * 64}.jsonl", "file", 10), erase.Entry(".", "dir", 0)],
        leftovers={"/tmp/x": [erase.Entry(".", "file", 3)]}, account=True,
        user=UnixUser("sft-t-gone", 990, 990, exists=True, ours=True), slurm_job_ids=[9], active_jobs=[],
        slurm_jobs=[], processes=[], requests=[])
    fields.update(kw)
    return td.Plan(**fields)  # type: ignore[arg-type]


def test_the_dry_run_lists_what_would_go_without_hashes() -> None:
    s = td.plan_summary(_plan(refusals=["1 job(s) not final yet"]))
    assert s["database"] == {"rows": 2, "tables": {"files": 2}}
    assert s["storage"]["files"] == 1 and s["storage"]["bytes"] == 10 and "sha256" not in s["storage"]
    assert s["storage"]["kinds"] == {"datasets": {"files": 1, "bytes": 10}}
    assert s["node_leftovers"] == [{"path": "/tmp/x", "files": 1, "dirs": 0, "bytes": 3}]
    assert s["unix_user"]["removed"] and s["slurm"]["account"] == "t-gone"
    assert s["refusals"] == ["1 job(s) not final yet"]
    assert not _plan().nothing_left
    gone = _plan(tenant_id=None, storage=[], leftovers={}, account=False,
                 user=UnixUser("sft-t-gone", None, None, exists=False, ours=False))
    assert gone.nothing_left
    assert not td.plan_summary(_plan(user=UnixUser("sft-t-gone", 5, 5, exists=True, ours=False,
                                                   note="not made by slurm-finetune")))["unix_user"]["removed"]


def test_job_container_base_paths_are_read_from_its_conf() -> None:
    text = ("# comment BasePath=/nope\nAutoBasePath=true\nNodeName=n1 BasePath=/var/jt/n1\n"
            "NodeName=n2 BasePath=/var/jt/n2 # x\nBasePath=relative\nBasePath=/var/jt/n1\n")
    assert base_paths(text) == [Path("/var/jt/n1"), Path("/var/jt/n2")]
    assert job_tmp_dir(Path("/var/jt/n1"), 77) == Path("/var/jt/n1/77")
    with pytest.raises(ValueError):
        job_tmp_dir(Path("/x"), 0)


# ------------------------------------------------------------------ erasure
def test_erase_hashes_every_file_removes_the_tree_and_never_follows_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("not the tenant's")
    top = tmp_path / "root"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "f").write_bytes(b"hello")
    (top / "a" / "to-file").symlink_to(outside / "keep")
    (top / "a" / "b" / "to-dir").symlink_to(outside)
    os.mkfifo(top / "a" / "fifo")
    before = sorted(str(p) for p in top.rglob("*"))
    surveyed = erase.survey(top)
    assert sorted(str(p) for p in top.rglob("*")) == before          # the dry run changed nothing
    assert {e.path for e in surveyed} == {".", "a", "a/b", "a/f", "a/to-file", "a/b/to-dir", "a/fifo"}
    assert all(e.sha256 is None for e in surveyed if e.kind == "file")
    gone = {e.path: e for e in erase.erase(top)}
    assert not top.exists()
    assert (outside / "keep").read_text() == "not the tenant's"    # links were unlinked, not followed
    assert gone["a/f"] == erase.Entry("a/f", "file", 5, hashlib.sha256(b"hello").hexdigest())
    assert gone["a/to-file"].kind == "link" and gone["a/fifo"].kind == "other"
    assert erase.erase(top) == [] and erase.survey(top) == []         # again: nothing, no error


def test_erase_refuses_a_tree_with_a_mount_beneath_it() -> None:
    info = ("27 1 254:0 / / rw - ext4 /dev/vda rw\n"
            "40 27 0:50 / /srv/t/tenants rw - btrfs /dev/loop0 rw\n"
            "41 40 0:51 / /srv/t/tenants/acme/mnt\\040x rw - tmpfs tmpfs rw\n")
    assert erase.mounts_beneath(Path("/srv/t/tenants/acme"), info) == ["/srv/t/tenants/acme/mnt x"]
    assert erase.mounts_beneath(Path("/srv/t/tenants/bravo"), info) == []
    assert erase.mounts_beneath(Path("/srv/t/tenants"), info) == ["/srv/t/tenants", "/srv/t/tenants/acme/mnt x"]


def test_owned_entries_and_private_receipts(tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("x")
    assert erase.owned_entries(tmp_path, os.getuid()) == [tmp_path / "mine"]
    assert erase.owned_entries(tmp_path, os.getuid() + 12345) == []
    path = tmp_path / "receipts" / "t.json"
    erase.write_private(path, b"{}\n")
    assert path.read_bytes() == b"{}\n" and path.stat().st_mode & 0o777 == 0o600
    assert path.parent.stat().st_mode & 0o777 == 0o700


# ------------------------------------------------------------------ the database
def test_every_table_is_either_deleted_with_its_tenant_or_kept_on_purpose() -> None:
    tables = set(SQLModel.metadata.tables)
    assert set(td.TENANT_TABLES) <= tables
    assert tables - set(td.TENANT_TABLES) <= td.KEPT_TABLES, "classify the new table: deleted with its tenant?"
    deleted = set(td.TENANT_TABLES)
    for name, table in SQLModel.metadata.tables.items():
        for fk in table.foreign_keys:
            if fk.column.table.name in deleted:       # a row pointing at a deleted row would block the delete
                assert name in deleted, f"{name}.{fk.parent.name} references {fk.column.table.name}"


@pytest.fixture
def engine(tmp_path: Path) -> sa.engine.Engine:
    e = make_engine(f"sqlite:///{tmp_path / 'gw.db'}")
    migrate(e)
    audit.use_key_file(e, tmp_path / "audit.key")
    return e


def _populate(s: Session, name: str, canary: str) -> tuple[Tenant, str]:
    t = ensure_tenant(session=s, name=name)
    assert t.id is not None
    # (a token's name goes into the audit log, which keeps its entries: the canary stays out of it)
    secret, tok = create_token(session=s, role=Role.TENANT_ADMIN, tenant=t, name="ci")
    staff_secret, staff = create_token(session=s, role=Role.STAFF, tenant=None)
    f = DataFile(tenant_id=t.id, filename=f"data-{canary}.jsonl", bytes=1, sha256="0" * 64)
    s.add(f)
    s.flush()
    job = FineTuningJob(tenant_id=t.id, training_file=f.id, model="tiny-chat", suffix=canary, slurm_job_id=4242,
                        status=JobState.SUCCEEDED.value)
    s.add(job)
    s.flush()
    ep = WebhookEndpoint(tenant_id=t.id, url=f"https://{canary}.example.org/h", secret="whsec_x")
    s.add(ep)
    s.flush()
    assert tok.id is not None and staff.id is not None
    s.add_all([
        TenantMember(tenant_id=t.id, username=f"u{canary[:8]}"),
        PortalSession(id_hash=hashlib.sha256(canary.encode() + name.encode()).hexdigest(), token_id=tok.id,
                      expires_at=utcnow() + timedelta(hours=1)),
        JobEvent(job_id=job.id, message=f"Step 1: {canary}"),
        JobCheckpoint(job_id=job.id, step=1, path=f"jobs/{job.id}/checkpoints/step-1"),
        AccessRequest(tenant_id=t.id, requester_token_id=staff.id, requester_role="staff", resource_kind="job",
                      resource_id=job.id, reason=canary, duration_s=60, created_at=utcnow()),
        Sweep(tenant_id=t.id, model="tiny-chat", grid={"seed": [1]}, job_ids=[job.id], slurm_array_id=4300),
        WebhookDelivery(endpoint_id=ep.id, tenant_id=t.id, event_type="fine_tuning.job.succeeded", job_id=job.id,
                        body=canary),
        ModelAlias(tenant_id=t.id, base_model="tiny-chat", alias="prod", fine_tuned_model=f"ft:x:{canary}"),
        MlflowRun(job_id=job.id, tenant_id=t.id, tracking_uri=f"https://{canary}.example.org", experiment=canary),
    ])
    s.flush()
    s.add(MlflowParentRun(sweep_id=s.exec(select(Sweep).where(Sweep.tenant_id == t.id)).one().id, tenant_id=t.id,
                          tracking_uri=f"https://{canary}.example.org", experiment=canary))
    s.flush()
    return t, secret


def _db_bytes(path: Path) -> bytes:
    return b"".join(p.read_bytes() for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def test_deleting_the_rows_leaves_the_other_tenant_whole_and_no_byte_in_the_file(engine: sa.engine.Engine,
                                                                                   tmp_path: Path) -> None:
    gone, kept = secrets.token_hex(12), secrets.token_hex(12)
    with Session(engine) as s:
        a, old_token = _populate(s, "t-gone", gone)
        _populate(s, "t-kept", kept)
        s.commit()
        assert a.id is not None
        tid = a.id
    db = tmp_path / "gw.db"
    assert gone.encode() in _db_bytes(db)
    with Session(engine) as s:
        counts = {m.__tablename__: td._count(s, m, w) for m, w in td.tenant_tables(tid)}
    removed = td.delete_rows(engine, tid)
    assert {t: r.rows for t, r in removed.items()} == counts
    assert all(removed[t].rows >= 1 for t in td.TENANT_TABLES), removed
    with Session(engine) as s:
        assert s.get(Tenant, tid) is None and authenticate(session=s, token=old_token) is None
        b = s.exec(select(Tenant).where(Tenant.name == "t-kept")).one()
        assert b.id is not None
        assert all(td._count(s, m, w) >= 1 for m, w in td.tenant_tables(b.id))
    assert "secure_delete" in erase_freed(engine)
    assert gone.encode() not in _db_bytes(db), "the deleted rows' bytes survive in the database file"
    assert kept.encode() in _db_bytes(db)


# ------------------------------------------------------------------ deletion requests
def _principal(s: Session, t: Tenant, role: Role) -> Principal:
    tok = s.exec(select(ApiToken).where(ApiToken.tenant_id == t.id)).first()
    assert tok is not None and tok.id is not None and t.id is not None
    return Principal(tok.id, role, t.id, t.name, t.unix_user)


def test_a_tenant_admin_asks_follows_and_withdraws_a_deletion_request(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        t, _ = _populate(s, "t-ask", "c0ffee")
        admin, member = _principal(s, t, Role.TENANT_ADMIN), _principal(s, t, Role.MEMBER)
        with pytest.raises(Forbidden):
            requests.request_deletion(session=s, principal=member, reason="", now=utcnow())
        assert requests.latest_request(session=s, principal=admin) is None
        row = requests.request_deletion(session=s, principal=admin, reason="project over", now=utcnow())
        again = requests.request_deletion(session=s, principal=admin, reason="twice", now=utcnow())
        assert again.id == row.id and row.status == "pending"
        assert [r.id for r in requests.pending_requests(session=s)] == [row.id]
        assert requests.withdraw_request(session=s, principal=admin, now=utcnow()).status == "withdrawn"
        with pytest.raises(NotFound):
            requests.withdraw_request(session=s, principal=admin, now=utcnow())
        assert requests.request_object(row)["status"] == "withdrawn"
        s.commit()
    assert audit.verify(engine).ok


def test_a_namesake_sees_neither_old_requests_nor_old_audit_entries(engine: sa.engine.Engine) -> None:
    with Session(engine) as s:
        t, _ = _populate(s, "t-again", "c0ffee")
        requests.request_deletion(session=s, principal=_principal(s, t, Role.TENANT_ADMIN), reason="", now=utcnow())
        s.commit()
        assert t.id is not None
        tid = t.id
    td.delete_rows(engine, tid)
    with Session(engine) as s:
        audit.append(s, at=utcnow(), actor=audit.Actor(None, "sysadmin"), action=audit.TENANT_DELETED,
                     outcome=audit.ALLOWED, tenant="t-again", reason="deleted")
        s.commit()
    with Session(engine) as s:
        new = ensure_tenant(session=s, name="t-again")
        create_token(session=s, role=Role.TENANT_ADMIN, tenant=new)
        s.commit()
        p = _principal(s, new, Role.TENANT_ADMIN)
        assert requests.latest_request(session=s, principal=p) is None
        seen = tenant_audit(session=s, principal=p, after=None, limit=100)
        assert seen and all(e.action == "token.create" for e in seen), [e.action for e in seen]
    assert audit.verify(engine).ok


# ------------------------------------------------------------------ the registry
def test_forget_drops_a_user_and_retired_ids_are_kept_beside_it(tmp_path: Path) -> None:
    reg = tmp_path / "tenant-users"
    owner = os.getuid()
    identities.record(identities.Entry("sft-a", 990, 990), reg, owner=owner)
    identities.record(identities.Entry("sft-b", 989, 989), reg, owner=owner)
    assert identities.forget("sft-a", reg, owner=owner) == identities.Entry("sft-a", 990, 990)
    assert identities.forget("sft-a", reg, owner=owner) is None
    assert set(identities.read(reg, owner=owner)) == {"sft-b"}
    retired = identities.retired_path(reg)
    identities.retire(identities.Entry("sft-a", 990, 990), reg, owner=owner)
    identities.retire(identities.Entry("sft-a", 970, 970), reg, owner=owner)    # the name deleted twice
    assert "grants nothing" in retired.read_text()
    assert {e.uid for e in identities.read(retired, owner=owner).values()} == {990, 970}
    assert not {"sft-a", "sft-b"} & set(identities.read(retired, owner=owner))
    assert identities.free_system_id({999, 998, 990}) == 997
    assert identities.free_system_id(set(range(100, 999))) == 999
    with pytest.raises(ValueError):
        identities.free_system_id(set(range(0, 1000)))
