"""Accounting on the real cluster: reports match the GPU jobs two tenants really ran.

Tenants t-acct-a / t-acct-b belong to this module only (other slurm tests run
concurrently on the same cluster with their own tenants).
"""

from __future__ import annotations

import csv
import io
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner

import gateway.cli
from accounting.usage import usage_report
from accounting.window import Window
from gateway.slurm import LocalRunner, SlurmClient, SlurmCommandError
from gateway.slurm.policy import parse_policy
from gateway.storage.onboarding import TenantAdmin
from tests.slurm.conftest import accounting, finished, submit, wait_for

pytestmark = pytest.mark.slurm
A, B = "t-acct-a", "t-acct-b"
PNG_COPY = Path("/tmp/slurm-finetune-accounting-usage.png")  # kept for a human to look at


@pytest.fixture(scope="module")
def acct_tenants(admin: TenantAdmin) -> tuple[str, str]:
    for t in (A, B):
        admin.add_tenant(t, shares=10, qos=["ft-standard", "ft-small"])
    return A, B


@pytest.fixture(scope="module")
def ran(acct_tenants: tuple[str, str]) -> dict:  # type: ignore[type-arg]
    """A: 2 jobs x 1 GPU x 6 s; B: 1 job x 2 GPUs x 4 s. Returns the window and sacct's rows."""
    client = SlurmClient(LocalRunner())
    start = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1)
    jobs = [(A, submit(client, A, "sleep 6", gpus=1)[0], 1, 6) for _ in range(2)]
    jobs.append((B, submit(client, B, "sleep 4", gpus=2)[0], 2, 4))
    for _, j, _, _ in jobs:
        wait_for(client, j, finished, 120)
    rows = {j: accounting(client, j) for _, j, _, _ in jobs}
    end = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=2)
    return {"window": Window(start, end), "jobs": jobs, "rows": rows, "client": client}


def _expected(ran: dict, tenant: str) -> float:  # type: ignore[type-arg]
    return sum(ran["rows"][j].gpus * ran["rows"][j].elapsed_s for t, j, _, _ in ran["jobs"] if t == tenant)


def test_usage_gpu_seconds_match_what_ran(ran: dict) -> None:  # type: ignore[type-arg]
    for _, j, gpus, secs in ran["jobs"]:
        row = ran["rows"][j]
        assert row.gpus == gpus and secs <= row.elapsed_s <= secs + 3, row
    rows = ran["client"].sacct(ran["window"].start, ran["window"].end, accounts=[A, B])
    report = {r.key: r for r in usage_report(rows, ran["window"]).rows}
    for t in (A, B):
        assert report[t].gpu_seconds == _expected(ran, t)
    assert 2 * 6 <= report[A].gpu_seconds <= 2 * 9 and 2 * 4 <= report[B].gpu_seconds <= 2 * 7
    assert report[A].states == {"COMPLETED": 2} and report[B].states == {"COMPLETED": 1}
    assert report[A].waits == 2 and report[A].run_p50_s is not None
    print(f"\nGPU-seconds: {A} {report[A].gpu_seconds} (2 x 1 GPU x 6 s), "
          f"{B} {report[B].gpu_seconds} (1 x 2 GPUs x 4 s)")


def _cli(*args: str) -> str:
    res = CliRunner().invoke(gateway.cli.main, ["admin", "report", *args])
    assert res.exit_code == 0, res.output
    return res.output


def test_cli_table_csv_json_and_png(ran: dict, tmp_path: Path) -> None:  # type: ignore[type-arg]
    w = ran["window"]
    common = ["--start", w.start.isoformat(), "--end", w.end.isoformat(), "--account", A, "--account", B]
    png = tmp_path / "usage.png"
    table = _cli("usage", *common, "--plot", str(png))
    for t in (A, B):
        line = next(ln for ln in table.splitlines() if ln.startswith(t))
        assert f" {_expected(ran, t):.1f} " in line, table
    rows = {r["key"]: r for r in csv.DictReader(io.StringIO(_cli("usage", *common, "--format", "csv")))}
    data = {r["key"]: r for r in json.loads(_cli("usage", *common, "--format", "json"))["rows"]}
    for t in (A, B):
        assert float(rows[t]["gpu_seconds"]) == data[t]["gpu_seconds"] == _expected(ran, t)
    assert png.read_bytes().startswith(b"\x89PNG")
    PNG_COPY.write_bytes(png.read_bytes())
    fs = json.loads(_cli("fairshare", *common, "--format", "json"))
    shares = {r["tenant"]: r for r in fs["rows"]}
    total = _expected(ran, A) + _expected(ran, B)
    assert shares[A]["usage_share"] == pytest.approx(_expected(ran, A) / total, abs=1e-6)
    assert shares[A]["entitled_share"] == 0.5 and 0 < fs["jain_index"] <= 1


def test_tenant_gpu_limit_refuses_a_job_over_it(acct_tenants: tuple[str, str], admin: TenantAdmin) -> None:
    client = SlurmClient(LocalRunner())
    admin.modify_tenant(B, gpu_limit=1)
    try:
        assert admin.tenant_gpu_limit(B) == 1
        with pytest.raises(SlurmCommandError):
            submit(client, B, "true", gpus=2)
    finally:
        admin.modify_tenant(B, gpu_limit=-1)
    assert admin.tenant_gpu_limit(B) is None


QOS = "t-acct-qos"  # a QOS used by nobody, removed at the end


def test_qos_apply_changes_only_the_difference(admin: TenantAdmin) -> None:
    toml = (f'[qos.{QOS}]\ndescription = "accounting test"\npriority = 1\nmax_gpus_per_user = 1\n'
            'max_wall = 60\nmax_jobs_per_user = 1\nmax_submit_jobs_per_user = 2\n')
    runner = LocalRunner()
    try:
        assert admin.apply_qos(parse_policy(toml)) == [QOS]
        assert admin.plan_qos(parse_policy(toml)) == []
        (change,) = admin.plan_qos(parse_policy(toml.replace("max_wall = 60", "max_wall = 90")))
        assert change.settings == ("MaxWall=90",)
        admin.apply_qos_changes([change])
        assert admin.plan_qos(parse_policy(toml.replace("max_wall = 60", "max_wall = 90"))) == []
    finally:
        runner.run(["sacctmgr", "--immediate", "delete", "qos", QOS], timeout=60)
