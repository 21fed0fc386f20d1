"""`finetune admin report|qos apply|tenant modify` against a runner that replays recorded output."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest
from click.testing import CliRunner

import gateway.cli
import gateway.cli.sysadmin
import gateway.slurm
from gateway.slurm.runner import CommandResult
from tests.accounting.conftest import ACCT_DATA


class Replay:
    """A Runner answering sacct/sshare/sacctmgr show from tests/data/accounting; records argv."""

    def __init__(self, sacct_file: str = "sacct_final.txt"):
        self.calls: list[tuple[str, ...]] = []
        self.sacct_file = sacct_file

    def run(self, argv: Sequence[str], *, timeout: float = 60, input: str | None = None,
            **_: object) -> CommandResult:
        args = tuple(argv)
        self.calls.append(args)
        out = ""
        if args[0] == "sacct":
            out = (ACCT_DATA / self.sacct_file).read_text()
        elif args[0] == "sshare":
            out = (ACCT_DATA / "sshare_tenants.txt").read_text()
        elif args[:5] == ("sacctmgr", "--noheader", "--parsable2", "show", "qos"):
            out = (ACCT_DATA / "sacctmgr_show_qos.txt").read_text()
        elif args[:4] == ("sacctmgr", "--noheader", "--parsable2", "show") and "association" in args:
            out = ("t-acct-b||finetune|10|ft-small,ft-standard|ft-standard\n" if "format=User,GrpTRES"
                   not in args else "|gres/gpu=3\nsft-t-acct-b|\n")
        return CommandResult(args, 0, out, "", 0.0)


@pytest.fixture
def replay(monkeypatch: pytest.MonkeyPatch) -> Replay:
    r = Replay()
    monkeypatch.setattr(gateway.slurm, "make_runner", lambda *a, **k: r)
    monkeypatch.setattr(gateway.cli.sysadmin, "make_runner", lambda *a, **k: r)
    monkeypatch.setattr("accounting.cli.make_runner", lambda *a, **k: r)
    return r


def _run(*args: str) -> tuple[int, str]:
    res = CliRunner().invoke(gateway.cli.main, ["admin", *args])
    return res.exit_code, res.output


def test_usage_table_csv_json(replay: Replay, tmp_path: Path) -> None:
    window = ["--start", "2026-11-30T06:00", "--end", "2026-11-30T07:00"]
    code, out = _run("report", "usage", *window)
    assert code == 0 and "t-acct-a" in out and "106.0" in out
    code, out = _run("report", "usage", *window, "--format", "json", "--by", "qos")
    assert code == 0 and {r["key"] for r in json.loads(out)["rows"]} == {"ft-small", "ft-standard"}
    png = tmp_path / "u.png"
    code, out = _run("report", "usage", *window, "--format", "csv", "--plot", str(png))
    assert code == 0 and out.startswith("key,gpu_seconds") and png.read_bytes().startswith(b"\x89PNG")
    sacct_call = [c for c in replay.calls if c[0] == "sacct"][-1]
    assert "--starttime=2026-11-30T06:00:00" in sacct_call and "--duplicates" in sacct_call


def test_accounts_reach_sacct(replay: Replay) -> None:
    code, _ = _run("report", "usage", "--account", "t-acct-a", "--account", "t-acct-b")
    assert code == 0
    assert "--accounts=t-acct-a,t-acct-b" in next(c for c in replay.calls if c[0] == "sacct")


def test_fairshare(replay: Replay) -> None:
    code, out = _run("report", "fairshare", "--start", "2026-11-30T06:00", "--end", "2026-11-30T07:00",
                     "--account", "t-acct-a", "--account", "t-acct-b")
    assert code == 0 and "Jain's fairness index" in out and "t-acct-b" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--by", "project"], "--by 'project' is not a grouping; valid: tenant, user, person, qos, day"),
    (["--start", "2026-02-30"], "--start '2026-02-30' is not a date: use YYYY-MM-DD"),
    (["--start", "now", "--end", "-1d"], "must be after --start"),
    (["--format", "xml"], "valid: table, csv, json"),
    (["--account", "Bad Name"], "invalid user, group or account name"),
])
def test_errors_are_one_line_without_traceback(replay: Replay, args: list[str], message: str) -> None:
    code, out = _run("report", "usage", *args)
    assert code == 1 and message in out and "Traceback" not in out


def test_qos_dry_run_changes_nothing(replay: Replay, tmp_path: Path) -> None:
    policy = tmp_path / "p.toml"
    policy.write_text('[qos.ft-small]\ndescription = "small"\npriority = 30\nmax_gpus_per_user = 1\n'
                      'max_wall = "0-05:00:00"\nmax_jobs_per_user = 2\nmax_submit_jobs_per_user = 50\n')
    code, out = _run("qos", "apply", str(policy), "--dry-run")
    assert code == 0 and "would ft-small: modify" in out and "MaxWall 240 -> 300" in out
    assert not [c for c in replay.calls if "modify" in c]
    code, out = _run("qos", "apply", str(policy))
    (mod,) = [c for c in replay.calls if "modify" in c]
    assert mod[-3:] == ("set", "Description=small", "MaxWall=300")


def test_qos_apply_shipped_policy_is_a_no_op(replay: Replay) -> None:
    code, out = _run("qos", "apply")
    assert code == 0 and "0 changed" in out
    assert not [c for c in replay.calls if "modify" in c or "add" in c]


def test_tenant_modify_sends_one_sacctmgr_modify(replay: Replay) -> None:
    code, out = _run("tenant", "modify", "t-acct-b", "--gpu-limit", "3", "--shares", "20")
    assert code == 0, out
    (mod,) = [c for c in replay.calls if "modify" in c]
    assert mod[-5:] == ("where", "name=t-acct-b", "set", "Fairshare=20", "GrpTRES=gres/gpu=3")
    assert "gpu limit 3" in out


@pytest.mark.parametrize(("args", "message"), [
    (["--gpu-limit", "lots"], "give a number of GPUs (0 or more) or 'none'"),
    ([], "nothing to modify"),
    (["--qos", "ft-nope"], "unknown QOS ['ft-nope']"),
])
def test_tenant_modify_errors(replay: Replay, args: list[str], message: str) -> None:
    code, out = _run("tenant", "modify", "t-acct-b", *args)
    assert code != 0 and message in out and "Traceback" not in out
