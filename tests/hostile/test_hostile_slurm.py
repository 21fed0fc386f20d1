"""The hostile tier, Slurm metadata: what a tenant's processes name or print never steers the gateway.

Each attack runs as the attacker's unix user against the real gateway and cluster while the
victim tenant's job runs; afterwards that job still runs and progresses, and the gateway keeps
reconciling everyone.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner
from sqlmodel import Session

from gateway.access.tokens import create_token
from gateway.models import FineTuningJob, Role
from gateway.slurm import LocalRunner, SlurmClient
from gateway.slurm.records import DELIM, Owner
from gateway.slurm.render import JobScript
from gateway.slurm.runner import CommandResult
from gateway.storage import TenantRunner, storage_for
from tests.hostile.conftest import ATTACKER, VICTIM, as_tenant
from tests.slurm.livegateway import LiveGateway, chat_file

pytestmark = pytest.mark.hostile

LONG_HP = {"n_epochs": 8, "batch_size_tokens": 256, "max_seq_len": 256, "checkpoint_every_steps": 50}


def _slurm_id(gw: LiveGateway, job_id: str) -> int:
    with Session(gw.engine) as s:
        job = s.get(FineTuningJob, job_id)
        assert job is not None and job.slurm_job_id is not None
        return job.slurm_job_id


def _running(gw: LiveGateway, tenant: str, tmp: Path, name: str) -> dict[str, Any]:
    fid = gw.upload(tenant, chat_file(tmp / f"{name}.jsonl", 60, seed=hash(name) % 100))
    job = gw.create(tenant, fid, LONG_HP)
    return gw.wait(tenant, job["id"], lambda j: j["status"] == "running" and (j.get("progress") or {}).get("step"),
                   timeout=300)


def _step(gw: LiveGateway, tenant: str, job_id: str) -> int:
    return int((gw.job(tenant, job_id).get("progress") or {}).get("step") or 0)


def _forged(victim_sid: int, state: str = "CANCELLED") -> str:
    """A job name that closes its own record and adds one for ``victim_sid`` in the formats the gateway
    once asked for (squeue's and sacct's), with other control characters around them."""
    squeue = DELIM.join([str(victim_sid), state, "None", f"sft-{VICTIM}", VICTIM, "ft-small",
                         "2026-12-03T07:00:00", "2026-12-03T07:00:00", "vm-n1", "x", "gres:gpu:1",
                         str(victim_sid), "N/A"])
    sacct = DELIM.join([str(victim_sid), str(victim_sid), "x", f"sft-{VICTIM}", VICTIM, "ft-small", state, "0:15",
                        "None", *["2026-12-03T07:00:00"] * 4, "1", "", "", "vm-n1", "01:00:00"])
    return f"a\n{squeue}\n{sacct}\r\t\x1b[2J\x07\x1e"


@pytest.fixture(scope="module")
def jobs(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("hostile-slurm")
    victim = _running(gw, VICTIM, tmp, "victim")
    attacker = _running(gw, ATTACKER, tmp, "attacker")
    yield {"victim": victim, "attacker": attacker, "victim_sid": _slurm_id(gw, victim["id"]),
           "attacker_sid": _slurm_id(gw, attacker["id"])}
    for tenant, job in ((VICTIM, victim), (ATTACKER, attacker)):
        gw.api("POST", f"/v1/fine_tuning/jobs/{job['id']}/cancel", tenant)


def test_a_job_renamed_to_forge_records_steers_nothing(gw: LiveGateway, jobs: dict[str, Any]) -> None:
    """The attacker renames its own running job (Slurm lets it) to a name holding line breaks, the
    unit separator and forged squeue/sacct records that say the victim's job was cancelled. The
    gateway's formats print no name: the victim's job keeps running and progressing, and both
    tenants' jobs keep being reconciled (no cycle fails on a parse error)."""
    vsid, asid = jobs["victim_sid"], jobs["attacker_sid"]
    name = _forged(vsid)
    res = subprocess.run(["runuser", "-u", f"sft-{ATTACKER}", "--", "scontrol", "update", f"jobid={asid}",
                          f"name={name}"], capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    shown = subprocess.run(["squeue", "-h", "-j", str(asid), "-o", "%j"], capture_output=True, text=True).stdout
    assert f"\n{vsid}{DELIM}CANCELLED" in shown, "Slurm should keep the hostile name as given"
    # an over-long name too: Slurm keeps or refuses it; either way nothing may change
    subprocess.run(["runuser", "-u", f"sft-{ATTACKER}", "--", "scontrol", "update", f"jobid={asid}",
                    "name=" + ("\n" + name) * 40], capture_output=True, text=True, timeout=30)
    v0, a0 = _step(gw, VICTIM, jobs["victim"]["id"]), _step(gw, ATTACKER, jobs["attacker"]["id"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (_step(gw, VICTIM, jobs["victim"]["id"]) > v0 + 1
                                               and _step(gw, ATTACKER, jobs["attacker"]["id"]) > a0):
        time.sleep(1)
    victim = gw.job(VICTIM, jobs["victim"]["id"])
    assert victim["status"] == "running" and _step(gw, VICTIM, victim["id"]) > v0 + 1, victim
    assert _step(gw, ATTACKER, jobs["attacker"]["id"]) > a0, "the attacker's own job is reconciled too"
    state = subprocess.run(["squeue", "-h", "-j", str(vsid), "-o", "%T"], capture_output=True, text=True).stdout
    assert state.strip() == "RUNNING"
    log = Path(gw.log.name).read_text(errors="replace")
    assert "expected 18 fields" not in log and "reconcile step failed" not in log


def test_reports_and_the_usage_page_answer_with_such_a_name_in_accounting(
        gw: LiveGateway, jobs: dict[str, Any]) -> None:
    """`finetune admin report usage|fairshare` and the portal's Usage page once exited on this name."""
    import gateway.cli

    env = {"SFT_DATABASE_URL": gw.db_url}
    for args in (["usage", "--start", "-1h", "--format", "json"], ["usage", "--by", "user"],
                 ["fairshare", "--format", "json"]):
        res = CliRunner().invoke(gateway.cli.main, ["admin", "report", *args], env=env)
        assert res.exit_code == 0, res.output
        assert "fields" not in res.output
    usage = CliRunner().invoke(gateway.cli.main, ["admin", "report", "usage", "--start", "-1h", "--format", "json",
                                                  "--account", ATTACKER], env=env)
    assert '"key": "' + ATTACKER + '"' in usage.output
    with Session(gw.engine) as s:
        token, _ = create_token(session=s, role=Role.SYSADMIN, tenant=None, name="hostile usage page")
        s.commit()
    with httpx.Client(base_url=gw.url, timeout=60, follow_redirects=True) as c:
        page = c.get("/portal/login")
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text)
        assert csrf is not None
        c.post("/portal/login", data={"token": token, "csrf": csrf.group(1)})
        r = c.get("/portal/admin/usage?start=-1h")
        assert r.status_code == 200 and ATTACKER in r.text and "expected" not in r.text, r.text[-2000:]


class _PrintsAnotherId:
    """sbatch as the tenant through the real broker, its answer rewritten to ``victim``: what a tenant
    that ptraces its own sbatch achieves (this host has no Yama: ptrace of one's own processes is
    allowed; the dev cluster sets kernel.yama.ptrace_scope=1 where the LSM exists)."""

    def __init__(self, inner: TenantRunner, victim: int):
        self.inner, self.victim = inner, victim

    def run(self, argv: Any, **kw: Any) -> CommandResult:
        res = self.inner.run(argv, **kw)
        return CommandResult(res.argv, res.returncode, re.sub(r"^\d+", str(self.victim), res.stdout),
                             res.stderr, res.seconds)


def test_an_id_rewritten_in_sbatchs_answer_reaches_no_other_tenants_job(
        gw: LiveGateway, jobs: dict[str, Any], tmp_path: Path) -> None:
    from gateway.config import Settings

    settings = Settings(storage_root=Path("/srv/slurm-finetune"))
    vsid = jobs["victim_sid"]
    client = SlurmClient(LocalRunner())
    job_dir = Path("/srv/slurm-finetune/tenants") / ATTACKER
    script = JobScript(job_name="ftjob-forged-answer", account=ATTACKER, qos="ft-small", job_dir=str(job_dir),
                       command=("/bin/sleep", "300"), gpus=1)
    runner = _PrintsAnotherId(TenantRunner(storage_for(settings).tenant(ATTACKER)), vsid)
    sid = client.submit(script, user=f"sft-{ATTACKER}", runner=runner)  # type: ignore[arg-type]
    try:
        assert sid != vsid
        rec = client.queue([sid])[0]
        assert (rec.user, rec.account) == (f"sft-{ATTACKER}", ATTACKER)
        # acting for the attacker on the victim's id is refused before any command
        from gateway.slurm.client import NotOurs

        with pytest.raises(NotOurs):
            client.cancel(vsid, owner=Owner(f"sft-{ATTACKER}", ATTACKER), deadline_s=1)
        with pytest.raises(NotOurs):
            client.pause(vsid, owner=Owner(f"sft-{ATTACKER}", ATTACKER))
    finally:
        client.cancel(sid, owner=Owner(f"sft-{ATTACKER}", ATTACKER), deadline_s=5)
    state = subprocess.run(["squeue", "-h", "-j", str(vsid), "-o", "%T"], capture_output=True, text=True).stdout
    assert state.strip() == "RUNNING"
    assert gw.job(VICTIM, jobs["victim"]["id"])["status"] == "running"


def test_a_tenant_can_see_only_its_own_jobs_in_squeue(gw: LiveGateway, jobs: dict[str, Any]) -> None:
    out = as_tenant(ATTACKER, "squeue -h -o %A").stdout.split()
    assert str(jobs["victim_sid"]) not in out and str(jobs["attacker_sid"]) in out


def test_proc_shows_a_tenant_none_of_another_tenants_processes(gw: LiveGateway, jobs: dict[str, Any]) -> None:
    """/proc is mounted hidepid=invisible (`finetune dev-cluster up` applies it): the victim's trainer,
    whose command line names its tenant and job, is not even listed for the attacker."""
    opts = next((line.split()[3] for line in Path("/proc/mounts").read_text().splitlines()
                 if line.split()[1:2] == ["/proc"]), "")
    if "hidepid=" not in opts:
        pytest.skip(f"/proc is mounted {opts!r}: this host refused the remount (see `dev-cluster up`'s output)")
    seen = as_tenant(ATTACKER, "for p in /proc/[0-9]*; do stat -c %u $p 2>/dev/null; done | sort -u").stdout.split()
    assert seen == [str(__import__("pwd").getpwnam(f"sft-{ATTACKER}").pw_uid)], seen
    cmdlines = as_tenant(ATTACKER, "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' || true").stdout
    assert jobs["victim"]["id"] not in cmdlines and VICTIM not in cmdlines
