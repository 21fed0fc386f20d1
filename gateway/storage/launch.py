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


def ensure_broker(socket_path: Path, service_user: str | None, wait_s: float = 15.0) -> None:
    """Start ``python -m gateway.storage.broker`` (root only) unless one listens already."""
    if answers(socket_path):
        return
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
