"""Stopping the storage broker by its recorded pid (gateway.storage.launch.stop_recorded), which
scripts/test.sh does instead of ``pkill -f gateway.storage.broker``: the recorded broker of this
socket stops; any other process with that name in its command line (another instance's broker,
another user's, a shell that mentions it) is left running.

The brokers here are stand-ins: sleeping processes whose command lines have the broker's shape
(the name, ``--socket PATH``); tests/service/test_broker_pidfile.py runs the real daemon."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.storage.launch import is_broker, main, pidfile, record_pid, stop_recorded

pytestmark = pytest.mark.unit
Spawn = Callable[..., subprocess.Popen[bytes]]
STAND_IN = "import time; time.sleep(120)  # gateway.storage.broker stand-in"


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start processes for a test; each is killed and reaped after it."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*argv: str, **kw: object) -> subprocess.Popen[bytes]:
        p = subprocess.Popen([sys.executable, *argv], cwd="/", **kw)  # type: ignore[call-overload]
        started.append(p)
        return p

    yield start
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def _broker(spawn: Spawn, sock: Path, **kw: object) -> subprocess.Popen[bytes]:
    return spawn("-c", STAND_IN, "--socket", str(sock), **kw)


def _wait_exec(p: subprocess.Popen[bytes]) -> None:
    """Until the child has exec'd python (before that its cmdline is still the test's)."""
    for _ in range(500):
        if STAND_IN.encode() in Path(f"/proc/{p.pid}/cmdline").read_bytes():
            return
        time.sleep(0.01)
    raise AssertionError("the stand-in did not start")


def test_the_recorded_broker_stops_and_look_alikes_keep_running(tmp_path: Path, spawn: Spawn) -> None:
    mine, other_sock = tmp_path / "broker.sock", tmp_path / "other" / "broker.sock"
    recorded = _broker(spawn, mine)
    other_instance = _broker(spawn, other_sock)
    mentions = spawn("-c", STAND_IN)                      # the name in its command line, no socket
    for p in (recorded, other_instance, mentions):
        _wait_exec(p)
    record_pid(mine, recorded.pid)
    assert pidfile(mine).read_text() == f"{recorded.pid}\n"
    assert is_broker(recorded.pid, mine) and not is_broker(other_instance.pid, mine)
    assert not is_broker(mentions.pid, mine)

    assert stop_recorded(mine) == recorded.pid
    assert recorded.wait(timeout=5) == -signal.SIGTERM
    assert other_instance.poll() is None and mentions.poll() is None
    assert not pidfile(mine).exists()
    assert stop_recorded(mine) is None                   # nothing recorded any more


def test_a_pidfile_naming_another_instances_broker_signals_nothing(tmp_path: Path, spawn: Spawn) -> None:
    mine, theirs = tmp_path / "broker.sock", tmp_path / "theirs.sock"
    other_instance = _broker(spawn, theirs)
    _wait_exec(other_instance)
    record_pid(mine, other_instance.pid)
    assert stop_recorded(mine) is None
    assert other_instance.poll() is None
    assert not pidfile(mine).exists()                    # a stale record is dropped


def test_a_pidfile_of_an_exited_broker_signals_nothing(tmp_path: Path, spawn: Spawn) -> None:
    sock = tmp_path / "broker.sock"
    gone = _broker(spawn, sock)
    gone.kill()
    gone.wait()
    record_pid(sock, gone.pid)
    assert stop_recorded(sock) is None
    assert not pidfile(sock).exists()


def test_a_pidfile_in_a_directory_others_can_write_is_not_trusted(tmp_path: Path, spawn: Spawn) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    sock = shared / "broker.sock"
    broker = _broker(spawn, sock)
    _wait_exec(broker)
    record_pid(sock, broker.pid)
    assert not pidfile(sock).exists()                    # not recorded there either
    pidfile(sock).write_text(f"{broker.pid}\n")          # as anyone could have
    assert stop_recorded(sock) is None
    assert broker.poll() is None


def test_another_users_broker_is_left_alone(tmp_path: Path, spawn: Spawn) -> None:
    if os.geteuid() != 0:
        pytest.skip("starting a process as another user needs root")
    sock = tmp_path / "broker.sock"
    theirs = _broker(spawn, sock, user="nobody")
    _wait_exec(theirs)
    record_pid(sock, theirs.pid)
    assert stop_recorded(sock) is None
    assert theirs.poll() is None


def test_the_command_line_scripts_test_sh_runs(tmp_path: Path, spawn: Spawn,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    sock = tmp_path / "broker.sock"
    broker = _broker(spawn, sock)
    _wait_exec(broker)
    record_pid(sock, broker.pid)
    main(["--stop", "--socket", str(sock)])
    assert broker.wait(timeout=5) == -signal.SIGTERM
    assert f"stopped pid {broker.pid}" in capsys.readouterr().out
    main(["--stop", "--socket", str(sock)])
    assert "none recorded running" in capsys.readouterr().out
