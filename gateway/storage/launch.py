"""Start the storage broker daemon when a root process needs one and none answers, and stop the one
that was started (its pid recorded beside its socket), never another instance's or another user's."""

from __future__ import annotations

import argparse
import os
import pwd
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from gateway.config import Settings
from gateway.storage.broker import CODE_ID, recv_msg, send_msg

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


def _proc_state(pid: int) -> str:
    """What a process that ignored SIGTERM was doing: its state, threads, blocked and caught signals
    and where the kernel holds it, from /proc (for the log line before the SIGKILL)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError as e:
        return f"/proc unreadable: {e.strerror}"
    keep = ("State", "Threads", "SigPnd", "ShdPnd", "SigBlk", "SigIgn", "SigCgt")
    fields = [line.replace("\t", " ") for line in lines if line.split(":")[0] in keep]
    return ", ".join(fields + [f"wchan {wchan}"])


def _retire(path: Path, wait_s: float = 10.0) -> None:
    """Stop the broker listening at ``path``: SIGTERM to its pid (its in-flight children finish),
    SIGKILL when it has not exited within ``wait_s``. It waits for the process to end, not only for
    the socket to go quiet, so a replaced broker never lingers beside its successor; the process is
    held by a pidfd from before the signal, so a reused pid is never signalled."""
    pid = _peer_pid(path)
    if pid is None or pid <= 1:
        print(f"storage broker at {path}: no pid to stop (SO_PEERCRED gave {pid})", file=sys.stderr, flush=True)
        return
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    try:
        signal.pidfd_send_signal(pidfd, signal.SIGTERM)
        if not select.select([pidfd], [], [], wait_s)[0]:       # readable once the process has exited
            print(f"storage broker {pid} did not exit {wait_s:g} s after SIGTERM ({_proc_state(pid)}): "
                  "SIGKILL", file=sys.stderr, flush=True)
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            select.select([pidfd], [], [], wait_s)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def ensure_broker(socket_path: Path, service_user: str | None, wait_s: float = 15.0) -> None:
    """Start ``python -m gateway.storage.broker`` (root only) unless one running this code listens
    already; one running other code (the package was upgraded since it started) is replaced."""
    if answers(socket_path):
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
    socket_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)   # the runtime dir, for the pidfile
    # a clean environment: nothing of the caller's (database URL, tokens) reaches the broker
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
           **{k: v for k, v in os.environ.items() if k in ("SLURM_CONF", "PYTHONPATH")}}
    with open(LOG, "ab") as log:
        broker = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,  # noqa: S603
                                  cwd="/", start_new_session=True, close_fds=True)
    record_pid(socket_path, broker.pid)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if answers(socket_path):
            return
        time.sleep(0.05)
    raise RuntimeError(f"the storage broker did not start; see {LOG}")


# ------------------------------------------------------------------ stopping the one that was started
BROKER_MARK = b"gateway.storage.broker"   # in the daemon's command line (argv above)


def pidfile(socket_path: Path) -> Path:
    """Where the pid of the broker started for ``socket_path`` is recorded: beside the socket, in its
    runtime directory (root's, 0755, under /run), so a stop finds that broker and no other."""
    return socket_path.with_suffix(".pid")


def _private_dir(path: Path) -> bool:
    """Whether only this user can write ``path`` (a directory of its own, not group- or world-writable):
    a pidfile anyone else could have written names a pid nobody vouches for."""
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def record_pid(socket_path: Path, pid: int) -> None:
    """Write ``pid`` to the socket's pidfile atomically (temp name, fsync, rename); nothing when the
    directory is not this user's alone (then nothing is recorded, and a stop stops nothing)."""
    path = pidfile(socket_path)
    if not _private_dir(path.parent):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, f"{pid}\n".encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _recorded_pid(path: Path) -> int | None:
    """The pid in the pidfile ``path``, when this user wrote it in a directory only this user can write."""
    if not _private_dir(path.parent):
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        text = os.read(fd, 64).decode("ascii", "replace") if st.st_uid == os.geteuid() else ""
    finally:
        os.close(fd)
    pid = int(text.strip()) if text.strip().isdigit() else 0
    return pid if pid > 1 else None


def is_broker(pid: int, socket_path: Path) -> bool:
    """Whether process ``pid`` is this user's storage broker serving ``socket_path``: its owner is this
    user and its command line holds ``gateway.storage.broker`` and ``--socket <socket_path>`` (another
    instance's broker names another socket; a process that merely mentions the name is not one)."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    sock = os.fsencode(socket_path)
    serves = any(a == b"--socket" and b == sock for a, b in zip(argv, argv[1:], strict=False))
    return owner == os.geteuid() and any(BROKER_MARK in a for a in argv) and serves


def stop_recorded(socket_path: Path, wait_s: float = 10.0) -> int | None:
    """Stop the broker recorded for ``socket_path``: SIGTERM (its in-flight request children finish),
    SIGKILL when it has not exited within ``wait_s``; its pid, or None when no recorded broker runs.
    The process is held by a pidfd before it is checked (``is_broker``), so a pid reused meanwhile is
    never signalled; a pidfile naming anything else is removed and nothing is signalled."""
    path = pidfile(socket_path)
    pid = _recorded_pid(path)
    if pid is None:
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        path.unlink(missing_ok=True)
        return None
    try:
        if not is_broker(pid, socket_path):
            path.unlink(missing_ok=True)
            return None
        for sig, wait in ((signal.SIGTERM, wait_s), (signal.SIGKILL, 5.0)):
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                break
            if select.select([pidfd], [], [], wait)[0]:   # a pidfd reads ready once its process has exited
                break
        path.unlink(missing_ok=True)
        return pid
    finally:
        os.close(pidfd)


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.storage.launch --stop [--socket PATH]``: stop the broker recorded for the
    socket (default: the settings' ``broker_socket``); scripts/test.sh runs it before the tests."""
    p = argparse.ArgumentParser(prog="python -m gateway.storage.launch", description=main.__doc__)
    p.add_argument("--stop", action="store_true", required=True, help="stop the recorded broker")
    p.add_argument("--socket", type=Path, default=None)
    a = p.parse_args(argv)
    sock = a.socket or Settings().broker_socket
    pid = stop_recorded(sock)
    print(f"storage broker at {sock}: " + (f"stopped pid {pid}" if pid else "none recorded running"))


if __name__ == "__main__":
    main()
