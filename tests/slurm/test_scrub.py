"""The scrubber on the real cluster: what a job leaves behind is gone before the next tenant
runs there; a failing scrub drains the node; a dirty node refuses jobs.

Uses its own tenants (t-scrub-a, t-scrub-b) and node 2 only; a node drained on purpose is
resumed in a ``finally``. The jobs run with job_container/tmpfs (private /tmp, /dev/shm),
so the canaries the test wants the *scrubber* to remove are written on the host by a
process of the tenant outside the job's step cgroups (as an ssh session without
pam_slurm_adopt would be).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.cli import main as cli
from gateway.devcluster.cluster import DevClusterConfig, short_hostname
from gateway.slurm import SlurmClient
from gateway.storage.layout import unix_user_for
from gateway.storage.onboarding import TenantAdmin
from tests.slurm.conftest import finished, job_dir, wait_for, wait_output

pytestmark = pytest.mark.slurm

TENANT_A, TENANT_B = "t-scrub-a", "t-scrub-b"
NODE = f"{short_hostname()}-n2"
DEV = DevClusterConfig(host=short_hostname())
CONFIG = Path("/etc/slurm-finetune/scrubber.toml")
FREEZER = Path("/sys/fs/cgroup/freezer")
TRACE_DIRS = (Path("/tmp"), Path("/dev/shm"), DEV.scratch_root, DEV.job_tmp_root)


# ----------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def scrub_tenants(admin: TenantAdmin) -> tuple[str, str]:
    for t in (TENANT_A, TENANT_B):
        admin.add_tenant(t, shares=5, qos=["ft-standard", "ft-small"])
    return TENANT_A, TENANT_B


def uid_of(tenant: str) -> int:
    return pwd.getpwnam(unix_user_for(tenant)).pw_uid


def sbatch(client: SlurmClient, tenant: str, script: str, *extra: str,
           mem_mb: int = 256) -> tuple[int, Path]:
    """Submit ``script`` as the tenant, pinned to NODE (the JobScript has no nodelist)."""
    d = job_dir(tenant)
    user = unix_user_for(tenant)
    argv = ["sbatch", "--parsable", "--uid", user, "--gid", user, f"--account={tenant}",
            "--qos=ft-standard", "--gres=gpu:1", f"--nodelist={NODE}", f"--mem={mem_mb}",
            "--time=3", "--job-name=sft-scrub-test", f"--chdir={d}", f"--output={d}/slurm-%j.out",
            *extra]
    out = client.runner.run(argv, input=script, timeout=30).check().stdout
    return int(out.strip().split(";")[0]), d


def wait_report(jid: int, kind: str, timeout: float = 30) -> dict:
    path = DEV.report_dir / NODE / f"{jid}-{kind}.json"
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {kind} report {path} after {timeout}s")
        time.sleep(0.2)
    return json.loads(path.read_text())


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def live_pids(uid: int) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        try:
            status = (p / "status").read_text()
        except (OSError, ValueError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid and not fields["State"].strip().startswith("Z"):
            out.append(int(p.name))
    return out


def files_of(uid: int) -> list[str]:
    found = []
    for top in TRACE_DIRS:
        for root, dirs, names in os.walk(top):
            for n in dirs + names:
                try:
                    if os.lstat(os.path.join(root, n)).st_uid == uid:
                        found.append(os.path.join(root, n))
                except OSError:
                    continue
    return found


def assert_no_trace(uid: int) -> None:
    assert live_pids(uid) == [], "a process of the tenant survived the epilog"
    assert files_of(uid) == [], "a file of the tenant survived the epilog"


def spawn_as(tenant: str, command: str) -> subprocess.Popen[bytes]:
    """A TERM-ignoring process of the tenant started outside Slurm (as root drops to it)."""
    user = unix_user_for(tenant)
    pw = pwd.getpwnam(user)
    return subprocess.Popen(  # noqa: S603 - argv list
        ["setpriv", f"--reuid={pw.pw_uid}", f"--regid={pw.pw_gid}", "--clear-groups", "--",
         "/bin/bash", "-c", f"trap '' TERM; {command}; exec sleep 300"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True, cwd="/")


def into_cgroup(pid: int, cgroup: Path) -> None:
    (cgroup / "cgroup.procs").write_text(str(pid))


def job_cgroup(tenant: str, jid: int) -> Path:
    return FREEZER / f"slurm_{NODE}" / f"uid_{uid_of(tenant)}" / f"job_{jid}"


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


def resume(client: SlurmClient) -> None:
    client.runner.run(["scontrol", "update", f"nodename={NODE}", "state=resume"], timeout=10)


def drained(client: SlurmClient) -> str | None:
    return next((n.reason for n in client.drained_nodes() if n.node == NODE), None)


def wait_drained(client: SlurmClient, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    while (reason := drained(client)) is None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{NODE} not drained after {timeout}s")
        time.sleep(0.3)
    return reason


@pytest.fixture
def fail_config() -> Iterator[Path]:
    """Remove the fault-injection file whatever happens (before any node is resumed)."""
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    try:
        yield CONFIG
    finally:
        CONFIG.unlink(missing_ok=True)


def canary() -> tuple[str, str]:
    """A random canary, and shell text that builds it without spelling it out
    (so the probing job's own script never matches)."""
    tail = uuid.uuid4().hex
    return f"SFT-CANARY-{tail}", f'"SFT-CAN""ARY-{tail}"'


def probe_script(tenant_user: str, canary_sh: str) -> str:
    """Tenant B's job: look for the canary everywhere it can read, and for A's processes."""
    return f"""#!/bin/bash
c={canary_sh}
hits=$(grep -rIl -s -F -- "$c" /tmp /dev/shm /var/tmp /var/lib/slurm-finetune /srv/slurm-finetune \
       "$SFT_SCRATCH" 2>/dev/null | wc -l)
# zombies hold no memory and no files: an orphan of the killed job waits there for this
# container's PID 1 to reap it (seen: "[sleep] <defunct>", PPID 1), which is not a leftover
echo "GPUS=$SLURM_JOB_GPUS HITS=$hits PROCS=$(ps -u {tenant_user} -o stat= | grep -vc '^Z') DONE"
"""


def probe_as(client: SlurmClient, prober: str, owner: str, canary_sh: str) -> str:
    """Run the probe as ``prober`` on NODE; assert it saw no canary and no process of ``owner``."""
    jid, d = sbatch(client, prober, probe_script(unix_user_for(owner), canary_sh))
    wait_for(client, jid, finished, 60)
    out = (d / f"slurm-{jid}.out").read_text()
    assert "HITS=0 PROCS=0 DONE" in out, out
    return out


# ------------------------------------------------------------------------- tests
def test_canary_job_leaves_nothing_for_the_next_tenant(client: SlurmClient,
                                                       scrub_tenants: tuple[str, str]) -> None:
    a, b = scrub_tenants
    secret, secret_sh = canary()
    script = f"""#!/bin/bash
set -e
c={secret_sh}
echo "$c" > "$SFT_SCRATCH/canary.txt"
head -c 4194304 /dev/urandom > "$SFT_SCRATCH/blob"
echo "$c" > /tmp/canary.txt
echo "$c" > /dev/shm/canary.txt
# detached, double-forked, ignoring TERM
( setsid bash -c 'trap "" TERM; exec sleep 300' & )
echo "READY scratch=$SFT_SCRATCH"
sleep 3
"""
    jid, d = sbatch(client, a, script)
    wait_output(d / f"slurm-{jid}.out", "READY")
    # A process of A on the node outside the job's steps (ssh without pam_slurm_adopt):
    # it writes host-side canaries, Slurm's step cleanup does not see it; the epilog must.
    escaped = spawn_as(a, f"echo {secret_sh} > /dev/shm/host-canary; mkdir -p /tmp/a-dir; "
                          f"echo {secret_sh} > /tmp/a-dir/c")
    try:
        into_cgroup(escaped.pid, job_cgroup(a, jid))
        st = wait_for(client, jid, finished, 60)
        assert st.state == "COMPLETED", (d / f"slurm-{jid}.out").read_text()
        assert "scratch=/var/lib/slurm-finetune/scratch/job-" in (d / f"slurm-{jid}.out").read_text()
        report = wait_report(jid, "epilog")
    finally:
        stop(escaped)
    assert report["outcome"] == "ok", report
    kill = step(report, "kill_processes")["figures"]
    assert kill["processes_killed"] >= 1 and kill["needed_sigkill"] >= 1, kill
    assert step(report, "scratch")["figures"]["bytes_removed"] >= 4194304
    assert step(report, "tmp_files")["figures"]["files_removed"] >= 2
    assert step(report, "gpu_wipe") == {**step(report, "gpu_wipe"), "status": "skipped",
                                        "message": "no driver"}
    assert_no_trace(uid_of(a))
    assert secret not in json.dumps(report) and secret not in (DEV.log_dir / "scrubber.log").read_text()

    out = probe_as(client, b, a, secret_sh)
    same_gpu = out.split("GPUS=")[1].split()[0] == ",".join(map(str, report["gpus"]))
    print(f"tenant B ran on {NODE}, same GPU as A: {same_gpu}; epilog {report['seconds']:.2f}s")


@pytest.mark.parametrize("how", ["scancel", "oom"])
def test_nothing_left_after_cancel_or_oom(client: SlurmClient, scrub_tenants: tuple[str, str],
                                         how: str) -> None:
    a, b = scrub_tenants
    secret, secret_sh = canary()
    tail = ("python3 -c 'b = bytearray(600 << 20); import time; time.sleep(30)'" if how == "oom"
            else 'while :; do echo "$c" >> "$SFT_SCRATCH/log.txt"; echo "$c" >> /dev/shm/w; sleep 0.02; done')
    script = f"""#!/bin/bash
c={secret_sh}
head -c 2097152 /dev/urandom > "$SFT_SCRATCH/blob"
echo "$c" > /tmp/canary.txt
echo READY
{tail}
"""
    jid, d = sbatch(client, a, script, mem_mb=128)
    wait_output(d / f"slurm-{jid}.out", "READY")
    if how == "scancel":
        time.sleep(0.5)  # mid-write
        client.runner.run(["scancel", str(jid)], timeout=10).check()
    st = wait_for(client, jid, finished, 60)
    assert st.state == ("OUT_OF_MEMORY" if how == "oom" else "CANCELLED"), st
    report = wait_report(jid, "epilog")
    assert report["outcome"] == "ok", report
    assert step(report, "scratch")["figures"]["bytes_removed"] >= 2097152
    assert_no_trace(uid_of(a))
    probe_as(client, b, a, secret_sh)


def test_failing_scrub_step_drains_node_until_admin_resumes(
        client: SlurmClient, scrub_tenants: tuple[str, str], fail_config: Path) -> None:
    a, b = scrub_tenants
    fail_config.write_text(f'fail_step = "tmp_files"\nfail_node = "{NODE}"\n'
                           f'fail_user = "{unix_user_for(a)}"\n')
    waiting = None
    try:
        jid, _ = sbatch(client, a, "#!/bin/bash\ntrue\n")
        wait_for(client, jid, finished, 60)
        reason = wait_drained(client)
        fail_config.unlink()
        report = wait_report(jid, "epilog")
        assert report["failed_steps"] == ["tmp_files"], report
        assert "failed on purpose" in step(report, "tmp_files")["message"]
        sinfo = client.runner.run(["sinfo", "-R", "-h", "-n", NODE, "-o", "%N|%E"], timeout=10).stdout
        assert sinfo.strip() == f"{NODE}|{reason}" and "pilog" in reason, sinfo

        res = CliRunner().invoke(cli, ["admin", "nodes", "--json"])
        assert res.exit_code == 0, res.output
        nodes = json.loads(res.output)
        assert any(n["node"] == NODE and n["reason"] == reason for n in nodes["drained"]), nodes
        last = next(r for r in nodes["scrub"][NODE] if r["job_id"] == jid)
        assert last["outcome"] == "fail" and last["failed_steps"] == ["tmp_files"], last
        text = CliRunner().invoke(cli, ["admin", "nodes"]).output
        assert NODE in text and reason in text and f"job {jid} FAILED" in text, text

        waiting, _ = sbatch(client, b, "#!/bin/bash\ntrue\n")
        time.sleep(3)
        assert client.states([waiting])[waiting].state == "PENDING", "a job started on a drained node"
    finally:
        fail_config.unlink(missing_ok=True)
        resume(client)
    assert drained(client) is None
    if waiting is not None:
        assert wait_for(client, waiting, finished, 60).state == "COMPLETED"


def test_prolog_refuses_node_with_foreign_leftover_and_requeues(
        client: SlurmClient, scrub_tenants: tuple[str, str]) -> None:
    a, b = scrub_tenants
    # B has no job on the node; its process sits in the node's Slurm cgroup outside any job.
    leftover = spawn_as(b, "true")
    jid = None
    try:
        into_cgroup(leftover.pid, FREEZER / f"slurm_{NODE}")
        jid, _ = sbatch(client, a, "#!/bin/bash\ntrue\n")
        report = wait_report(jid, "prolog")
        stop(leftover)
        reason = wait_drained(client)
        assert "rolog" in reason, reason
        assert report["failed_steps"] == ["leftover_processes"], report
        assert f"[{uid_of(b)}]" in step(report, "leftover_processes")["message"]
        st = wait_for(client, jid, lambda s: s.state == "PENDING", 30)
        assert client.history(jid) == [] or st.state == "PENDING"  # requeued, not failed
        assert "held" in (st.reason or "").lower() or "requeue" in (st.reason or "").lower(), st
    finally:
        stop(leftover)
        if jid is not None:
            client.runner.run(["scancel", str(jid)], timeout=10)
        resume(client)
    assert drained(client) is None


def test_epilog_spares_the_same_users_other_job_on_the_node(
        client: SlurmClient, scrub_tenants: tuple[str, str]) -> None:
    """Job Y ends while job X of the same tenant runs on the same node: Y's epilog must
    leave X's processes (and the tenant's files) alone; X's own epilog then cleans up."""
    a, _ = scrub_tenants
    x, dx = sbatch(client, a, "#!/bin/bash\necho READY\nexec sleep 60\n")
    try:
        wait_output(dx / f"slurm-{x}.out", "READY")
        y, _ = sbatch(client, a, "#!/bin/bash\ntrue\n")
        wait_for(client, y, finished, 60)
        report = wait_report(y, "epilog")
        assert report["outcome"] == "ok", report
        assert step(report, "kill_processes")["figures"]["processes_killed"] == 0, report
        tmp = step(report, "tmp_files")
        assert tmp["status"] == "skipped" and f"[{x}]" in tmp["message"], tmp
        assert client.states([x])[x].state == "RUNNING"
        assert live_pids(uid_of(a)), "job X's processes were killed by job Y's epilog"
    finally:
        client.runner.run(["scancel", str(x)], timeout=10)
    wait_for(client, x, finished, 60)
    assert wait_report(x, "epilog")["outcome"] == "ok"
    assert_no_trace(uid_of(a))


def test_unknown_cgroup_layout_fails_closed_and_drains(
        client: SlurmClient, scrub_tenants: tuple[str, str]) -> None:
    """A process of the job user in a Slurm-looking cgroup the scrubber does not know is
    neither killed nor spared: the epilog fails, says why, and the node drains."""
    a, _ = scrub_tenants
    odd = FREEZER / f"slurm_{NODE}" / f"uid_{uid_of(a)}" / "not_a_job"
    escaped, made_uid_dir = None, False
    try:
        jid, d = sbatch(client, a, "#!/bin/bash\necho READY\nsleep 3\n")
        wait_output(d / f"slurm-{jid}.out", "READY")  # after the prolog: it would refuse the node
        escaped = spawn_as(a, "true")
        made_uid_dir = not odd.parent.exists()
        odd.mkdir(parents=True, exist_ok=True)
        into_cgroup(escaped.pid, odd)
        wait_for(client, jid, finished, 60)
        reason = wait_drained(client)
        report = wait_report(jid, "epilog")
        assert "pilog" in reason and report["failed_steps"] == ["kill_processes"], report
        kill = step(report, "kill_processes")
        assert "cannot place" in kill["message"] and "not_a_job" in kill["message"], kill
        assert kill["figures"]["undecided"] == [f"{escaped.pid}:sleep:uid={uid_of(a)}"], kill
        assert escaped.poll() is None, "the undecided process was killed anyway"
    finally:
        if escaped is not None:
            stop(escaped)
        if odd.exists():
            odd.rmdir()
        if made_uid_dir:
            with contextlib.suppress(OSError):  # Slurm may be using it again
                odd.parent.rmdir()
        resume(client)
    assert drained(client) is None
