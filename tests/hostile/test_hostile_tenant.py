"""Every attack of the security review (issue 13), run as the tenant's unix user against the real
gateway, broker and cluster. See SECURITY.md "A tenant runs arbitrary code" for the defences."""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlmodel import Session, select

from gateway.config import Settings
from gateway.models import DataFile, FineTuningJob, Tenant, new_id, utcnow
from gateway.slurm import JobScript, SlurmClient
from gateway.slurm.runner import LocalRunner
from gateway.storage import Storage, TenantRunner, layout
from tests.hostile.conftest import ATTACKER, STORAGE, VICTIM, Snap, as_tenant, uid_of
from tests.slurm.livegateway import LiveGateway, chat_file
from trainer.contract.spec import JobSpec, parse_spec, spec_data, spec_file_text

pytestmark = pytest.mark.hostile
ROOT_A = STORAGE / "tenants" / ATTACKER


def _store(tenant: str = ATTACKER) -> Storage:
    return Storage(STORAGE, Settings().broker_socket, "sft-gateway")


def _upload(gw: LiveGateway, tmp: Path, seed: int = 1) -> httpx.Response:
    path = chat_file(tmp / f"a{seed}.jsonl", 20, seed=seed)
    with open(path, "rb") as f:
        return gw.api("POST", "/v1/files", ATTACKER, data={"purpose": "fine-tune"}, files={"file": (path.name, f)})


def _clear_error(r: httpx.Response, status: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert "Traceback" not in r.text and body["message"]
    return str(body["message"])


@pytest.fixture
def reset_attacker(gw: LiveGateway) -> Iterator[None]:
    """Undo what an attack planted in the attacker's own storage (as the attacker)."""
    yield
    as_tenant(ATTACKER, "for d in datasets artifacts jobs; do [ -L $d ] && rm -f $d; done; true")


# ------------------------------------------------------------------ processes
def test_api_and_reconciler_run_as_the_service_user(gw: LiveGateway) -> None:
    assert gw.proc is not None
    uids = Path(f"/proc/{gw.proc.pid}/status").read_text().split("Uid:")[1].split("\n")[0].split()
    assert {int(u) for u in uids} == {uid_of("sft-gateway")}       # real, effective, saved, fs
    ps = subprocess.run(["ps", "-o", "uid=,args=", "-p", str(gw.proc.pid)], capture_output=True, text=True)
    uid, args = ps.stdout.split(None, 1)
    assert int(uid) == uid_of("sft-gateway") and "serve" in args


def test_standalone_reconciler_drops_to_the_service_user(gw: LiveGateway) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "reconcile"], cwd="/",
                            env={**gw.env}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            uids = Path(f"/proc/{proc.pid}/status").read_text().split("Uid:")[1].split("\n")[0].split()
            if {int(u) for u in uids} == {uid_of("sft-gateway")}:
                break
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        else:
            raise AssertionError("the reconciler still runs as root")
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_refuses_root_without_a_service_user(gw: LiveGateway) -> None:
    res = subprocess.run([sys.executable, "-m", "gateway", "serve", "--port", "1"], cwd="/",
                         env={**gw.env, "SFT_SERVICE_USER": "no-such-user-here"}, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode != 0 and "refusing to run the gateway as root" in res.stderr


def test_database_is_private_to_the_service_user(gw: LiveGateway) -> None:
    db = Path(gw.db_url.split("///", 1)[1])
    for p in (db, db.with_name(db.name + "-wal")):
        if p.exists():
            st = p.stat()
            assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == uid_of("sft-gateway"), p
    assert stat.S_IMODE(db.parent.stat().st_mode) == 0o700


# ------------------------------------------------------------------- uploads
def test_datasets_link_to_a_root_dir_then_upload(gw: LiveGateway, victim_root_dir: Path, tmp_path: Path,
                                                 reset_attacker: None) -> None:
    before = Snap.of(victim_root_dir)
    as_tenant(ATTACKER, f"rm -rf datasets; ln -s {victim_root_dir} datasets")
    msg = _clear_error(_upload(gw, tmp_path), 409)
    assert "changed outside the gateway" in msg
    assert Snap.of(victim_root_dir) == before


def test_upload_temp_file_swapped_for_a_link_before_the_last_chunk(gw: LiveGateway, victim_root_dir: Path,
                                                                   tmp_path: Path) -> None:
    before = Snap.of(victim_root_dir)
    body = chat_file(tmp_path / "slow.jsonl", 40, seed=3).read_bytes()
    bnd = "hostileboundary"
    head = (f'--{bnd}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
            f'--{bnd}\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n\r\n').encode()

    def slow() -> Iterator[bytes]:
        yield head + body[:1000]
        deadline = time.monotonic() + 20
        while not list((ROOT_A / "datasets").glob(".upload-*.tmp")):
            assert time.monotonic() < deadline, "the upload's temp file never appeared"
            time.sleep(0.05)
        # the attacker swaps its temp file for a link to root's file while the client pauses
        as_tenant(ATTACKER, f"cd datasets; for t in .upload-*.tmp; do mv $t $t.moved; "
                            f"ln -s {victim_root_dir}/root-secret.txt $t; done")
        yield body[1000:] + f"\r\n--{bnd}--\r\n".encode()

    headers = {**gw.h(ATTACKER), "content-type": f"multipart/form-data; boundary={bnd}"}
    r = httpx.post(gw.url + "/v1/files", headers=headers, content=slow(), timeout=60)
    assert "replaced while it streamed" in _clear_error(r, 409)
    assert Snap.of(victim_root_dir) == before
    as_tenant(ATTACKER, "rm -f datasets/.upload-*")


@pytest.mark.parametrize("plant", ["symlink-victim", "symlink-root", "hardlink-root", "fifo", "directory",
                                   "longer", "root-owned"])
def test_stored_dataset_replaced_then_downloaded(gw: LiveGateway, victim_file: tuple[str, Path],
                                                 tmp_path: Path, plant: str) -> None:
    r = _upload(gw, tmp_path, seed=11)
    assert r.status_code == 200, r.text
    fid, name = r.json()["id"], None
    with Session(gw.engine) as s:
        name = f"{s.get(DataFile, fid).sha256}.jsonl"  # type: ignore[union-attr]
    # root's file inside the tenant's own root: a hard link cannot cross filesystems, nor btrfs subvolumes
    # (each tenant root is one where the dev cluster has quotas), so from anywhere else it fails with EXDEV
    shared = ROOT_A / "sft-hostile-writable"
    shared.write_text("root-owned, world-writable: hardlinkable by a tenant\n")
    os.chmod(shared, 0o666)
    steps = {
        "symlink-victim": f"ln -sf {victim_file[1]} {name}",
        "symlink-root": f"ln -sf /etc/passwd {name}",
        "hardlink-root": f"rm -f {name}; ln {shared} {name}",
        "fifo": f"rm -f {name}; mkfifo {name}",
        "directory": f"rm -f {name}; mkdir {name}",
        "longer": f"cat /etc/hostname >> {name}",
    }
    if plant == "root-owned":       # a file of someone else's (here root's) under the tenant's name
        p = ROOT_A / "datasets" / name
        p.unlink()
        p.write_bytes(b"x" * r.json()["bytes"])
    else:
        as_tenant(ATTACKER, f"cd datasets; {steps[plant]}")
    t0 = time.monotonic()
    resp = gw.api("GET", f"/v1/files/{fid}/content", ATTACKER)
    assert time.monotonic() - t0 < 10                       # a FIFO never hangs the gateway
    assert "changed outside the gateway" in _clear_error(resp, 409)
    assert b"root" not in resp.content and b"It is" not in resp.content
    p = ROOT_A / "datasets" / name
    if p.is_dir() and not p.is_symlink():
        p.rmdir()
    else:
        p.unlink()
    shared.unlink()


# ---------------------------------------------------------- jobs and models
def _fake_succeeded_job(gw: LiveGateway) -> tuple[str, str]:
    """A succeeded job with published results, as the reconciler leaves it (files made as the tenant)."""
    jid, aid = new_id("ftjob"), new_id("art")
    as_tenant(ATTACKER, f"mkdir -p jobs/{jid}/checkpoints/step-1 jobs/{jid}/attempts/0/staging artifacts/{aid}; "
                        f"echo ckpt > jobs/{jid}/checkpoints/step-1/w; echo tar > artifacts/{aid}/adapter.tar")
    with Session(gw.engine) as s:
        tenant = s.exec(select(Tenant).where(Tenant.name == ATTACKER)).one()
        f = DataFile(tenant_id=tenant.id, filename="t", bytes=1, sha256="0" * 64, status="processed")  # type: ignore[arg-type]
        s.add(f)
        s.flush()
        model = f"ft:tiny-chat:{ATTACKER}::{jid}"
        s.add(FineTuningJob(id=jid, tenant_id=tenant.id, status="succeeded", training_file=f.id,  # type: ignore[arg-type]
                            model="tiny-chat", fine_tuned_model=model, finished_at=utcnow()))
        s.flush()
        s.add(DataFile(tenant_id=tenant.id, filename=f"{jid}-adapter.tar", bytes=4, sha256="1" * 64,  # type: ignore[arg-type]
                       status="processed", purpose="fine-tune-results", job_id=jid,
                       path=layout.result_path(aid, "adapter.tar")))
        s.commit()
    return jid, model


@pytest.mark.parametrize("where", ["job-dir", "checkpoints", "artifacts"])
def test_job_dir_linked_to_a_victim_then_model_deleted(gw: LiveGateway, victim_root_dir: Path, where: str,
                                                       reset_attacker: None) -> None:
    jid, model = _fake_succeeded_job(gw)
    before = Snap.of(victim_root_dir)
    step = {"job-dir": f"rm -rf jobs/{jid}; ln -s {victim_root_dir} jobs/{jid}",
            "checkpoints": f"rm -rf jobs/{jid}/checkpoints; ln -s {victim_root_dir} jobs/{jid}/checkpoints",
            "artifacts": f"rm -rf artifacts; ln -s {victim_root_dir} artifacts"}[where]
    as_tenant(ATTACKER, step)
    r = gw.api("DELETE", f"/v1/models/{model}", ATTACKER)
    assert r.status_code == 200, r.text
    assert Snap.of(victim_root_dir) == before


def test_other_tenants_job_dir_cannot_be_reached_through_a_link(gw: LiveGateway) -> None:
    jid, model = _fake_succeeded_job(gw)
    vj = STORAGE / "tenants" / VICTIM / "jobs" / new_id("ftjob")
    (vj / "checkpoints").mkdir(parents=True)
    (vj / "checkpoints" / "w").write_text("victim's weights\n")
    vuid = uid_of(f"sft-{VICTIM}")
    for p in (vj.parent, vj, vj / "checkpoints", vj / "checkpoints" / "w"):
        os.chown(p, vuid, vuid)
    before = Snap.of(vj)
    as_tenant(ATTACKER, f"rm -rf jobs/{jid}; ln -s {vj} jobs/{jid}")
    assert gw.api("DELETE", f"/v1/models/{model}", ATTACKER).status_code == 200
    assert Snap.of(vj) == before


def test_events_and_staging_links_return_nothing_foreign(gw: LiveGateway, victim_root_dir: Path,
                                                         reset_attacker: None) -> None:
    jid = new_id("ftjob")
    fake_event = json.dumps({"type": "metrics", "step": 1, "loss": 1.0}) + "\n"
    (victim_root_dir / "events.jsonl").write_text(fake_event)
    as_tenant(ATTACKER, f"mkdir -p jobs/{jid}/attempts/0; "
                        f"ln -s {victim_root_dir}/events.jsonl jobs/{jid}/events.jsonl; "
                        f"ln -s {victim_root_dir} jobs/{jid}/attempts/0/staging")
    store = _store().tenant(ATTACKER)
    assert store.read_events({jid: 0}) == {jid: b""}
    before = Snap.of(victim_root_dir)
    with pytest.raises(Exception, match="no staging directory"):
        store.publish_build(jid, 0, None)
    assert Snap.of(victim_root_dir) == before
    as_tenant(ATTACKER, f"rm -rf jobs/{jid}")


def test_publication_build_dir_swapped_for_a_link(gw: LiveGateway, victim_root_dir: Path) -> None:
    store = _store().tenant(ATTACKER)
    name = f".pub-{new_id('ftjob')}-abcdef01"
    as_tenant(ATTACKER, f"mkdir -p artifacts; ln -s {victim_root_dir} artifacts/{name}")
    before = Snap.of(victim_root_dir)
    with pytest.raises(Exception, match="replaced"):
        store.publish_commit(name, new_id("art"))
    store.remove([(layout.ARTIFACTS, name)])
    assert Snap.of(victim_root_dir) == before and not (ROOT_A / "artifacts" / name).exists()


def _any_spec(job_id: str, job_dir: str) -> JobSpec:
    return parse_spec({"job_id": job_id, "job_dir": job_dir,
                       "base_model": {"name": "m", "digest": "sha256:" + "0" * 64},
                       "train": {"path": "/t.jsonl", "sha256": "0" * 64}})


def test_tampered_spec_is_never_submitted(gw: LiveGateway) -> None:
    from gateway.services.jobspec import saved_spec_matches

    spec = _any_spec("x", str(ROOT_A / "jobs" / "x"))
    planted = dict(spec_data(spec), job_dir=str(STORAGE / "tenants" / VICTIM / "jobs" / "x"))
    assert not saved_spec_matches(json.dumps(planted).encode(), spec)
    assert saved_spec_matches(spec_file_text(spec).encode(), spec)      # the gateway's own file matches
    assert not saved_spec_matches(b"\x00" * 100, spec)


def test_broker_refuses_everyone_but_root_and_the_service_user(gw: LiveGateway) -> None:
    sock = Settings().broker_socket
    st = sock.stat()
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == uid_of("sft-gateway")
    code = ("import socket,sys; s=socket.socket(socket.AF_UNIX); "
            f"s.connect({str(sock)!r}); print('connected')")
    res = subprocess.run(["runuser", "-u", f"sft-{ATTACKER}", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, cwd="/")
    assert "connected" not in res.stdout and "Permission denied" in res.stderr


# --------------------------------------------------------------- job environment
def test_job_environment_has_no_gateway_secret(gw: LiveGateway, monkeypatch: pytest.MonkeyPatch) -> None:
    """Submitted exactly as the gateway submits (render, TenantRunner through the broker, sbatch
    --export=NONE as the tenant) from a process whose environment holds secrets."""
    monkeypatch.setenv("SFT_DATABASE_URL", "postgresql://gw:db-password-canary@127.0.0.1/gw")
    monkeypatch.setenv("SFT_API_TOKEN", "sft_gateway-env-secret-canary")
    jid = new_id("ftjob")
    store = _store().tenant(ATTACKER)
    store.write_spec(jid, _any_spec(jid, str(ROOT_A / "jobs" / jid)))
    job_dir = str(ROOT_A / "jobs" / jid)
    script = JobScript(job_name=jid, account=ATTACKER, qos="ft-small", job_dir=job_dir,
                       command=("/usr/bin/env",), gpus=1, cpus=1, mem_mb=256, time_limit_min=5,
                       env={"HF_HUB_OFFLINE": "1"})
    client = SlurmClient(LocalRunner())
    sid = client.submit(script, runner=TenantRunner(store))
    out = Path(job_dir) / f"slurm-{sid}.out"
    deadline = time.monotonic() + 60
    while not (out.exists() and "HF_HUB_OFFLINE" in out.read_text()):
        assert time.monotonic() < deadline, "the env job did not run"
        time.sleep(0.5)
    env = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    assert [k for k in env if k.startswith("SFT_")] == ["SFT_SCRATCH"]     # set by the TaskProlog
    text = out.read_text()
    assert "canary" not in text and "/root" not in env.get("HOME", "")
    assert env["USER" if "USER" in env else "SLURM_JOB_USER"] == f"sft-{ATTACKER}"
    assert env["HOME"] == job_dir and env["HF_HUB_OFFLINE"] == "1"
    as_tenant(ATTACKER, f"rm -rf jobs/{jid}")


def test_tenant_storage_stays_tenant_owned(gw: LiveGateway, tmp_path: Path) -> None:
    r = _upload(gw, tmp_path, seed=21)
    assert r.status_code == 200, r.text
    with Session(gw.engine) as s:
        sha = s.get(DataFile, r.json()["id"]).sha256  # type: ignore[union-attr]
    p = ROOT_A / "datasets" / f"{sha}.jsonl"
    st = p.stat()
    assert st.st_uid == pwd.getpwnam(f"sft-{ATTACKER}").pw_uid and stat.S_IMODE(st.st_mode) == 0o600
    assert hashlib.sha256(p.read_bytes()).hexdigest() == sha


def test_sbatch_errors_come_back_through_the_broker(gw: LiveGateway) -> None:
    """Submitting as the tenant keeps Slurm's own refusal (exit status and message)."""
    from gateway.slurm.runner import SlurmCommandError

    jid = new_id("ftjob")
    store = _store().tenant(ATTACKER)
    store.write_spec(jid, _any_spec(jid, str(ROOT_A / "jobs" / jid)))
    script = JobScript(job_name=jid, account=VICTIM, qos="ft-small", job_dir=str(ROOT_A / "jobs" / jid),
                       command=("/bin/true",), mem_mb=256, time_limit_min=5)
    with pytest.raises(SlurmCommandError, match="Invalid account") as e:
        SlurmClient(LocalRunner()).submit(script, runner=TenantRunner(store))   # another tenant's account
    assert e.value.returncode != 0
    as_tenant(ATTACKER, f"rm -rf jobs/{jid}")


@pytest.mark.parametrize("suffix", ["", "-wal", "-shm", "-journal"])
@pytest.mark.parametrize("target", ["root-secret.txt", "created-by-root"])
def test_root_never_follows_a_link_planted_beside_the_database(gw: LiveGateway, victim_root_dir: Path,
                                                               suffix: str, target: str) -> None:
    """The state dir belongs to the service user: a link it plants where the database or one of its
    side files goes (to a root file, or to a name root would create) must not make root (the admin CLI
    opening the database) create, chmod, chown or write the link's target: the open is refused,
    naming the link, before SQLite opens anything; without the link the database opens as before."""
    from gateway.cli.privsep import service_owned_dir
    from gateway.db import UnsafeDatabaseFile, make_engine, migrate

    d = service_owned_dir(Settings(), f"test-planted-{os.getpid()}-{target}{suffix}")
    link = d / f"gw.db{suffix}"
    before = Snap.of(victim_root_dir)
    subprocess.run(["runuser", "-u", "sft-gateway", "--", "ln", "-s", str(victim_root_dir / target), str(link)],
                   check=True)
    with pytest.raises(UnsafeDatabaseFile, match=f"{link} is a symbolic link"):
        engine = make_engine(f"sqlite:///{d / 'gw.db'}")
        migrate(engine)              # (were it not refused: SQLite writes the database and its journal)
    assert Snap.of(victim_root_dir) == before and not (victim_root_dir / "created-by-root").exists()
    link.unlink()
    engine = make_engine(f"sqlite:///{d / 'gw.db'}")
    migrate(engine)
    engine.dispose()
    for f in d.iterdir():
        st = f.lstat()
        assert stat.S_ISREG(st.st_mode) and st.st_uid == uid_of("sft-gateway") and stat.S_IMODE(st.st_mode) == 0o600


def _plant(rel: str, data: bytes) -> None:
    """Write ``rel`` (parents made) in the attacker's root, owned by the attacker, as its job would."""
    uid = uid_of(f"sft-{ATTACKER}")
    path = ROOT_A / rel
    for d in reversed(path.parents[:len(Path(rel).parts) - 1]):
        if not d.exists():
            d.mkdir(mode=0o700)
            os.chown(d, uid, uid)
    path.write_bytes(data)
    os.chown(path, uid, uid)


def _forged_staging(jid: str) -> None:
    """A complete, self-consistent staging dir for attempt 0, as a trainer (or the tenant) can write one."""
    import torch
    from safetensors.torch import save

    files = {"adapter_model.safetensors": save({"x.lora_A.weight": torch.ones(2, 2)}),
             "adapter_config.json": b'{"peft_type": "LORA"}',
             "eval.json": b'{"before": {"loss": 2.0}, "after": {"loss": 1.0}}'}
    manifest = json.dumps({"attempt": 0, "files": {n: f"sha256:{hashlib.sha256(b).hexdigest()}"
                                                   for n, b in files.items()}}).encode()
    for name, data in {**files, "manifest.json": manifest}.items():
        _plant(f"jobs/{jid}/attempts/0/staging/{name}", data)
    marker = f"manifest sha256:{hashlib.sha256(manifest).hexdigest()}\n"
    _plant(f"jobs/{jid}/attempts/0/staging/COMPLETE", marker.encode())


def test_planted_checkpoints_publish_only_the_tenants_own_adapter(gw: LiveGateway, victim_root_dir: Path,
                                                                  victim_file: tuple[str, Path],
                                                                  reset_attacker: None) -> None:
    """Checkpoints linked to a root dir or to another tenant's dataset, a hostile safetensors header and
    an incomplete one are skipped; the one real checkpoint becomes a result, renamed as peft names it."""
    import tarfile

    import torch
    from safetensors.torch import load, save

    jid = new_id("ftjob")
    _forged_staging(jid)
    ck = f"jobs/{jid}/checkpoints"
    _plant(f"{ck}/step-6/COMPLETE", b"")
    _plant(f"{ck}/step-9/COMPLETE", b"")
    _plant(f"{ck}/step-9/adapter.safetensors", (1 << 40).to_bytes(8, "little") + b"{}")
    _plant(f"{ck}/step-12/COMPLETE", b"")
    _plant(f"{ck}/step-12/adapter.safetensors", save({"x.lora_A.default.weight": torch.full((2, 2), 3.0)}))
    _plant(f"{ck}/step-15/adapter.safetensors", save({"x.lora_A.default.weight": torch.zeros(2, 2)}))
    as_tenant(ATTACKER, f"ln -s {victim_root_dir} {ck}/step-3; ln -s {victim_file[1]} {ck}/step-6/adapter.safetensors")
    before, victim = Snap.of(victim_root_dir), victim_file[1].read_bytes()
    store = _store().tenant(ATTACKER)
    built = store.publish_build(jid, 0, None, [3, 6, 9, 12, 15])
    try:
        assert built["checkpoints"] == [12], built
        assert set(built["skipped_checkpoints"]) == {"3", "6", "9", "15"}, built["skipped_checkpoints"]
        assert "safetensors" in built["skipped_checkpoints"]["9"]
        with tarfile.open(ROOT_A / "artifacts" / built["name"] / "checkpoint-step-12.tar") as tar:
            names = tar.getnames()
            member = tar.extractfile(f"{jid}-step-12/adapter_model.safetensors")
            assert member is not None
            tensors = load(member.read())
        assert names == [f"{jid}-step-12/adapter_model.safetensors", f"{jid}-step-12/adapter_config.json"]
        assert list(tensors) == ["x.lora_A.weight"] and bool((tensors["x.lora_A.weight"] == 3.0).all())
        sha = hashlib.sha256((ROOT_A / "artifacts" / built["name"] / "checkpoint-step-12.tar").read_bytes()).hexdigest()
        assert built["results"]["checkpoint-step-12.tar"][1] == sha
    finally:
        store.remove([(layout.ARTIFACTS, built["name"])])
    assert Snap.of(victim_root_dir) == before and victim_file[1].read_bytes() == victim
    with pytest.raises(Exception, match="invalid checkpoint step"):
        store.publish_build(jid, 0, None, [0])
