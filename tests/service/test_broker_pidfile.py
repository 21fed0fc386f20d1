"""The real storage broker records its pid where ensure_broker started it, and stop_recorded (what
scripts/test.sh runs instead of ``pkill -f``) stops exactly it (root only): a process that has
"gateway.storage.broker" in its command line but is not that broker keeps running."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.storage.launch import answers, ensure_broker, is_broker, pidfile, running_code, stop_recorded

pytestmark = pytest.mark.service
ROOT = Path(__file__).resolve().parents[2]


def test_ensure_broker_records_the_daemon_and_stop_recorded_stops_only_it(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("the broker runs as root")
    sock = tmp_path / "run" / "broker.sock"
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # gateway.storage.broker",
                                  "--socket", str(tmp_path / "elsewhere.sock")], cwd="/")
    pid: int | None = None
    try:
        monkeypatch.setenv("PYTHONPATH", str(ROOT))      # the broker runs this checkout's code
        ensure_broker(sock, None)
        _code, pid = running_code(sock)
        assert pid is not None and pidfile(sock).read_text() == f"{pid}\n"
        assert is_broker(pid, sock)                      # the daemon's real command line passes the check

        assert stop_recorded(sock) == pid
        assert os.waitpid(pid, os.WNOHANG) == (pid, 0)  # it had exited, cleanly (SIGTERM, not SIGKILL)
        assert not answers(sock)
        assert bystander.poll() is None
        pid = None
    finally:
        if pid is not None:
            os.kill(pid, 15)
        bystander.kill()
        bystander.wait()
