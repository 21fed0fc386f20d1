"""Every ``finetune`` command ends in a message, never a stack trace (issue 35).

Each leaf command of the real click tree runs three ways: with no gateway to talk to (a closed port),
with bad input (``../no-such`` for every argument and required option, an unopenable database), and,
for the commands the issue found tracebacks in, as an ordinary unix user (``nobody``) in a directory
it cannot write. A command passes when it exits with a message: no ``Traceback`` in its output and no
exception escaping click. Commands that start services or change the host (``serve``, ``dev-cluster``,
``demo`` in-process, ``admin qos apply``, ...) are run only as ``nobody`` or not at all (listed)."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.service

# started services, host changes or whole walk-throughs: not run in-process as root
NOT_IN_PROCESS = {"serve", "reconcile", "broker", "demo", "dev-cluster", "models make-tiny",
                  "models import-smollm2", "admin qos apply", "admin nodes", "admin tenant add",
                  "admin tenant delete", "admin tenant quota", "login"}
BAD = "../no-such"


def _leaves(cmd: click.Command, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    if isinstance(cmd, click.Group):
        for name, sub in sorted(cmd.commands.items()):
            yield from _leaves(sub, (*path, name))
    else:
        yield path, cmd


def _argv(path: tuple[str, ...], cmd: click.Command) -> list[str]:
    """The command with every argument and required option given a bad value (a choice: its first)."""
    argv = list(path)
    for p in cmd.params:
        if isinstance(p, click.Argument) and p.required:
            argv += [BAD] * (1 if p.nargs == 1 else 2)
        elif isinstance(p, click.Option) and p.required and not p.is_flag:
            value = p.type.choices[0] if isinstance(p.type, click.Choice) else BAD
            argv += [p.opts[0], str(value)]
    return argv


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])          # nothing listens once the socket is closed


def _all() -> list[tuple[tuple[str, ...], click.Command]]:
    from gateway.cli import main

    return [(p, c) for p, c in _leaves(main) if not any(" ".join(p).startswith(x) for x in NOT_IN_PROCESS)]


LEAVES = _all()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    return {"SFT_API_URL": f"http://127.0.0.1:{_closed_port()}", "SFT_API_TOKEN": "sft_not-a-token",
            "SFT_DATABASE_URL": f"sqlite:///{tmp_path}/no/such/dir/gw.db", "HOME": str(tmp_path),
            "SFT_CREDENTIALS_FILE": str(tmp_path / "cred.json"), "SFT_DEBUG": ""}


def test_the_walk_covers_every_command_group() -> None:
    from gateway.cli import main

    groups = {p[0] for p, _ in _leaves(main)}
    assert {"admin", "files", "jobs", "sweeps", "artifacts", "tokens", "staff", "access", "audit", "webhooks",
            "deletion", "models"} <= groups
    assert len(LEAVES) >= 55


@pytest.mark.parametrize(("path", "cmd"), LEAVES, ids=[" ".join(p) for p, _ in LEAVES])
def test_no_gateway_and_bad_input_end_in_a_message(path: tuple[str, ...], cmd: click.Command,
                                                    env: dict[str, str], tmp_path: Path) -> None:
    from gateway.cli import main
    from gateway.config import get_settings

    get_settings.cache_clear()
    try:
        os.chdir(tmp_path)
        res = CliRunner().invoke(main, _argv(path, cmd), env=env)
    finally:
        get_settings.cache_clear()
    out = res.output
    assert "Traceback" not in out, out
    assert res.exception is None or isinstance(res.exception, SystemExit), \
        f"{' '.join(path)} raised {type(res.exception).__name__}: {res.exception}"
    if res.exit_code != 0:
        assert out.strip(), "a failure says why"


def _as_nobody(argv: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    finetune = "/opt/slurm-finetune/venv/bin/finetune"
    return subprocess.run(["runuser", "-u", "nobody", "--", "env", *(f"{k}={v}" for k, v in env.items()), finetune,
                           *argv], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(os.geteuid() != 0 or not Path("/opt/slurm-finetune/venv/bin/finetune").exists(),
                    reason="needs root (to run as nobody) and the installed runtime")
@pytest.mark.parametrize("argv", [
    ["admin", "token", "create", "--tenant", "demo", "--name", "x"],     # the traceback: the DB
    ["admin", "report", "usage"],
    ["demo", "--local", "--tiny"],                                       # the other: demo-output
    ["files", "list"],
    ["jobs", "show", "ftjob-000000000000000000000000"],
], ids=lambda a: " ".join(a[:3]))
def test_as_an_ordinary_user_in_a_directory_it_cannot_write(argv: list[str], tmp_path: Path) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    tmp_path.chmod(0o755)
    ro.chmod(0o555)
    env = {"HOME": str(ro), "SFT_API_URL": f"http://127.0.0.1:{_closed_port()}", "SFT_API_TOKEN": "sft_x"}
    res = _as_nobody(argv, ro, env)
    text = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in text, text[-3000:]
    assert text.strip().splitlines()[-1].startswith("Error: "), text[-1000:]
