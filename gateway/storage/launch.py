"""Start the storage broker daemon when a root process needs one and none answers."""

from __future__ import annotations

import os
import pwd
import socket
import subprocess
import sys
import time
from pathlib import Path

LOG = Path("/var/log/slurm-finetune/broker.log")


def answers(path: Path) -> bool:
    """Whether something accepts a connection on the unix socket ``path`` within 2 s."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def running_code(path: Path) -> tuple[str | None, int | None]:
    """(code id, pid) of the broker answering at ``path`` (``broker.code_id``); (None, None) when
    it does not say (one from before the handshake existed, or no answer)."""
    from gateway.storage.broker import recv_msg, send_msg

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(5)
        s.connect(str(path))
        send_msg(s, {"hello": True})
        header, fds, _ = recv_msg(s)
        for fd in fds:
            os.close(fd)
        result = header.get("result") or {}
        code, pid = result.get("code_id"), result.get("pid")
        return (code if isinstance(code, str) else None), (pid if isinstance(pid, int) else None)
    except (OSError, ValueError):
        return None, None
    finally:
        s.close()


def _peer_pid(path: Path) -> int | None:
    """The pid of the process listening at ``path`` (SO_PEERCRED of a connection to it)."""
    import struct

    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(2)
        s.connect(str(path))
        pid, _uid, _gid = struct.unpack("3i", s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        return int(pid)
    except OSError:
        return None
    finally:
        s.close()


def _retire(path: Path, wait_s: float = 10.0) -> None:
    """Stop the broker listening at ``path`` (SIGTERM to its pid; its in-flight children finish)."""
    import signal

    pid = _peer_pid(path)
    if pid is None or pid <= 1:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and answers(path):
        time.sleep(0.05)


def ensure_broker(socket_path: Path, service_user: str | None, wait_s: float = 15.0) -> None:
    """Start ``python -m gateway.storage.broker`` (root only) unless one running this code listens
    already; one running other code (the package was upgraded since it started) is replaced."""
    if answers(socket_path):
        from gateway.storage.broker import CODE_ID

        if os.geteuid() != 0 or running_code(socket_path)[0] == CODE_ID:
            return
        print(f"storage broker at {socket_path} runs other code than this gateway (upgraded since it "
              "started): replacing it", file=sys.stderr, flush=True)
        _retire(socket_path)
    if os.geteuid() != 0:
        raise RuntimeError(f"the storage broker is not running ({socket_path}); start it as root: "
                           "finetune broker")
    # (-c, not -m: the package imports the module, and runpy would warn about running it twice;
    # the scrubber recognises the daemon by "gateway.storage.broker" in its command line)
    argv = [sys.executable, "-c", "from gateway.storage.broker import main; main()", "--socket", str(socket_path)]
    if service_user:
        try:
            pwd.getpwnam(service_user)
            argv += ["--allow-user", service_user]
        except KeyError:
            pass
    LOG.parent.mkdir(parents=True, exist_ok=True)
    # a clean environment: nothing of the caller's (database URL, tokens) reaches the broker
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k in ("SLURM_CONF", "PYTHONPATH")}}
    with open(LOG, "ab") as log:
        subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,  # noqa: S603
                         cwd="/", start_new_session=True, close_fds=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if answers(socket_path):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the storage broker did not start; see {LOG}")
