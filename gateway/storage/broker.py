"""The storage broker: the one privileged piece of the control plane, and a narrow one.

It runs as root (a systemd unit on a real site, or started by a root
``finetune serve`` before that drops to the service user), listens on a unix
socket that only root and the gateway's service user may use (checked with
SO_PEERCRED on every connection), and for each request forks a child that

1. derives the tenant's unix user itself (``sft-<tenant>``) and acts as it only when it is an
   account ``finetune admin tenant add`` made (recorded in ``identities.TENANT_USERS``, or one
   an earlier version made: home the tenant root, its own group), never root, the static system
   range or a user this broker serves (the gateway's service user),
2. drops to it for good (supplementary groups cleared, real/effective/saved
   gid and uid set, not dumpable) BEFORE it opens anything in tenant storage,
3. opens the tenant root no-follow and runs ONE verb of ``gateway.storage.verbs``
   (or ``submit``: sbatch as the tenant, ``--export=NONE``),
4. sends back a JSON result, file descriptors (SCM_RIGHTS) and blobs, and exits.

So a tenant who plants links, FIFOs or hardlinks in its storage can at most
make the broker act on what the tenant itself could already reach. Framing:
every message is a 4-byte big-endian length and a JSON header; a reply's blobs
follow it raw, their lengths in the header.
"""

from __future__ import annotations

import argparse
import errno
import grp
import json
import os
import pwd
import select
import signal
import socket
import struct
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.slurm.runner import TENANT_SBATCH, LocalRunner  # loaded as root: a child may not read code
from gateway.storage import identities, layout, safefs
from gateway.storage.verbs import VERBS, Ctx, Reply, VerbError
from trainer.contract import jobdir


def code_id() -> str:
    """A digest of the code this broker runs (its package's storage modules and the contract's
    job-directory names): a gateway started after an upgrade compares it with its own and replaces
    a broker still running the old code (``launch.ensure_broker``), so a fix to a verb never waits
    for a reboot."""
    import hashlib

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("broker.py", "verbs.py", "safefs.py", "layout.py", "identities.py", "__init__.py"):
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    # the job directory's names the verbs open come from the contract: a rename there is a new broker too
    digest.update(b"jobdir.py\0" + Path(jobdir.__file__).read_bytes())
    return digest.hexdigest()[:16]


CODE_ID = code_id()

MAX_HEADER = 4 << 20
MAX_FDS = 4
REQUEST_TIMEOUT_S = 120.0
# A child lives only as long as the gateway waits for it (the request's ``deadline_s``, at most
# MAX_DEADLINE_S; DEFAULT_DEADLINE_S when it names none) plus REPLY_GRACE_S, and never stopped:
# the parent (root, out of the tenant's reach) kills it then (``Children``).
DEFAULT_DEADLINE_S = 300.0
MAX_DEADLINE_S = 3600.0
REPLY_GRACE_S = 5.0
REPORT = struct.Struct(">id")   # child -> parent: (pid, seconds its request may take)


class BrokerError(Exception):
    def __init__(self, message: str, code: str = "storage_error"):
        super().__init__(message)
        self.message, self.code = message, code


# ------------------------------------------------------------------ framing
def send_msg(sock: socket.socket, header: dict[str, Any], fds: Sequence[int] = (),
             blobs: Sequence[bytes] = ()) -> None:
    """Write one message: its length (4 bytes, big-endian), the JSON header with the blobs' lengths, the blobs.
    ``fds`` travel with the first 4 bytes (SCM_RIGHTS)."""
    body = json.dumps({**header, "blobs": [len(b) for b in blobs]}).encode()
    head = struct.pack(">I", len(body)) + body
    if fds:
        socket.send_fds(sock, [head[:4]], list(fds))
        sock.sendall(head[4:])
    else:
        sock.sendall(head)
    for b in blobs:
        sock.sendall(b)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise BrokerError("the storage broker closed the connection")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket) -> tuple[dict[str, Any], list[int], list[bytes]]:
    """Read one message: (header, fds received, blobs). BrokerError when the peer closed the connection
    or the header is over MAX_HEADER."""
    data, fds, _flags, _addr = socket.recv_fds(sock, 4, MAX_FDS)
    if not data:
        for fd in fds:
            os.close(fd)
        raise BrokerError("the storage broker closed the connection")
    data += _recv_exact(sock, 4 - len(data)) if len(data) < 4 else b""
    (n,) = struct.unpack(">I", data)
    if n > MAX_HEADER:
        raise BrokerError("oversized storage message")
    header = json.loads(_recv_exact(sock, n))
    blobs = [_recv_exact(sock, int(size)) for size in header.pop("blobs", [])]
    return header, fds, blobs


# ------------------------------------------------------------- identity
# ids no tenant may have: root's and those of the users allowed to connect (``main``: --allow-user)
RESERVED_UIDS: set[int] = {0}
RESERVED_GIDS: set[int] = {0}


def tenant_identity(tenant: str, storage_root: Path) -> pwd.struct_passwd:
    """The tenant's unix user, derived here (``sft-<tenant>``), checked before the switch: BrokerError
    ``forbidden`` for root's, a reserved id (the users allowed to connect) or a static system uid, and
    unless ``tenant add`` recorded it (same uid and gid) or it looks exactly like an account an earlier
    version made, home the tenant root under ``storage_root`` (``identities.refusal``); ``no_unix_user``
    when there is none. Which directory it may act on is settled after the switch: the tenant root
    must be owned by that uid."""
    try:
        pw = pwd.getpwnam(layout.unix_user_for(tenant))
    except KeyError:
        raise BrokerError(f"tenant {tenant} has no unix user on this host", code="no_unix_user") from None
    try:
        group: str | None = grp.getgrgid(pw.pw_gid).gr_name
    except KeyError:
        group = None
    try:
        why = identities.refusal(pw, identities.read(), home=layout.tenant_root(storage_root, tenant),
                                 group=group, reserved_uids=RESERVED_UIDS, reserved_gids=RESERVED_GIDS)
    except identities.RegistryError as e:
        why = str(e)
    if why:
        raise BrokerError(f"refusing tenant {tenant}: {why}", code="forbidden")
    return pw


def storage_root_arg(raw: object) -> Path:
    """The storage root named in a request: absolute and normalised. It grants nothing: the
    child opens it only after becoming the tenant, and acts only beneath a tenant root that
    this tenant owns."""
    if not isinstance(raw, str) or not raw.startswith("/") or len(raw) > 1024 or "\0" in raw:
        raise BrokerError("invalid storage root", code="invalid_request")
    path = Path(os.path.normpath(raw))
    if ".." in path.parts:
        raise BrokerError("invalid storage root", code="invalid_request")
    return path


def drop_to(pw: pwd.struct_passwd) -> None:
    """Become ``pw`` irrevocably (this process only)."""
    os.setgroups([])
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    if os.getresuid() != (pw.pw_uid,) * 3 or os.getresgid() != (pw.pw_gid,) * 3:
        raise BrokerError("could not switch to the tenant's identity")
    _not_dumpable()
    os.umask(0o077)


def _libc() -> object | None:
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()          # loaded once, before any fork


def _not_dumpable() -> None:
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE, 0


def open_tenant_root(storage_root: Path, tenant: str, *, create: bool = False) -> int:
    """The tenant root as a no-follow fd. ``<storage_root>/tenants`` is the administrators'
    (root-owned, 0711); the tenant root itself must be owned by the effective uid. ``create``
    (direct mode only: a tenant with no unix user) makes the missing levels."""
    walk = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC   # search permission is enough
    top = os.open(str(storage_root), walk)
    try:
        if create:
            os.makedirs(storage_root / layout.TENANTS, mode=0o711, exist_ok=True)
        tenants = os.open(layout.TENANTS, walk, dir_fd=top)
    finally:
        os.close(top)
    try:
        return safefs.open_dir(tenants, (layout.tenant_name(tenant),), create=create)
    finally:
        os.close(tenants)


# -------------------------------------------------------------- one request
def run_verb(storage_root: Path, tenant: str, unix_user: str | None, verb: str, args: dict[str, Any],
             fds: list[int]) -> Reply:
    """Run ``verb`` as the current process identity (the caller has already switched);
    ``unix_user`` None is direct mode: a tenant with no unix user, storage owned by the caller."""
    if verb == "submit":
        if unix_user is None:
            raise BrokerError("a tenant without a unix user cannot submit jobs", code="no_unix_user")
        return _submit(storage_root, tenant, args)
    fn = VERBS.get(verb)
    if fn is None:
        raise VerbError(f"unknown storage verb {verb!r}")
    root_fd = open_tenant_root(storage_root, tenant, create=unix_user is None)
    try:
        return fn(Ctx(tenant, root_fd, str(storage_root), unix_user), args, fds)
    finally:
        os.close(root_fd)


def _submit(storage_root: Path, tenant: str, args: dict[str, Any]) -> Reply:
    """sbatch as the tenant (already switched), from a clean environment, ``--export=NONE``:
    the job gets only what its script sets, never the gateway's variables or secrets."""
    script = args.get("script")
    if not isinstance(script, str) or len(script) > 1 << 20:
        raise VerbError("invalid batch script")
    root = layout.tenant_root(storage_root, tenant)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
           "USER": pwd.getpwuid(os.getuid()).pw_name}
    if os.environ.get("SLURM_CONF"):
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    os.chdir(root)
    res = LocalRunner().run(list(TENANT_SBATCH), input=script, env=env,
                            timeout=float(args.get("timeout", 60)))
    return Reply({"returncode": res.returncode, "stdout": res.stdout[-65536:], "stderr": res.stderr[-65536:]})


def reply_error(e: BaseException) -> dict[str, Any]:
    """The ``ok: false`` reply for ``e``: an OSError's code follows its errno (its message is strerror,
    no path); an unexpected exception gives only its type name."""
    if isinstance(e, VerbError | BrokerError):
        return {"ok": False, "code": e.code, "message": e.message}
    if isinstance(e, layout.LayoutError):
        return {"ok": False, "code": "invalid_request", "message": str(e)}
    if isinstance(e, safefs.UnsafeStorage):
        return {"ok": False, "code": "unsafe_storage", "message": e.strerror or "unsafe storage"}
    if isinstance(e, OSError):
        code = {errno.ENOSPC: "storage_full", errno.EDQUOT: "quota_exceeded",
                errno.ENOENT: "not_found"}.get(e.errno or 0, "storage_error")
        return {"ok": False, "code": code, "message": e.strerror or type(e).__name__}
    return {"ok": False, "code": "storage_error", "message": f"storage verb failed ({type(e).__name__})"}


def serve_one(conn: socket.socket, report_fd: int | None = None) -> None:
    """In the forked child: read one request, drop to the tenant, run it, reply. ``report_fd``: the
    parent's pipe, told how long this request may take (``report_deadline``)."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        req, fds, _ = recv_msg(conn)
        if req.get("hello"):      # which code is this? (no tenant, nothing run)
            send_msg(conn, {"ok": True, "result": {"code_id": CODE_ID, "pid": os.getppid()}})
            return
        report_deadline(report_fd, req.get("deadline_s"))
        tenant, verb = str(req.get("tenant", "")), str(req.get("verb", ""))
        storage_root = storage_root_arg(req.get("storage_root"))
        pw = tenant_identity(tenant, storage_root)
        drop_to(pw)
        reply = run_verb(storage_root, tenant, pw.pw_name, verb, req.get("args") or {}, fds)
        send_msg(conn, {"ok": True, "result": reply.result}, reply.fds, reply.blobs)
    except BaseException as e:    # noqa: BLE001 - every failure becomes a reply, never a trace
        try:
            send_msg(conn, reply_error(e))
        except OSError:
            pass
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


def report_deadline(fd: int | None, raw: object) -> None:
    """Tell the parent how long this request may take (the gateway's wait, ``raw``, else
    DEFAULT_DEADLINE_S), then close the pipe: done while still root, so no tenant process holds it."""
    if fd is None:
        return
    seconds = float(raw) if isinstance(raw, int | float) and not isinstance(raw, bool) and raw > 0 \
        else DEFAULT_DEADLINE_S
    try:
        os.write(fd, REPORT.pack(os.getpid(), seconds))
    finally:
        os.close(fd)


# ------------------------------------------------------------------ children
class Children:
    """The parent's live children, each with the monotonic time it must be gone by.

    A child becomes the tenant, so the tenant can SIGSTOP it: it then neither answers nor ends,
    and cannot act on an alarm of its own. The parent, root and out of the tenant's reach, kills
    it (SIGKILL ends a stopped process too) as soon as the kernel reports it stopped (SIGCHLD,
    ``waitpid(WUNTRACED)``: no verb ever stops itself) or when it overruns its deadline. Children
    are reaped here, not by the kernel: a pid this may still kill stays our zombie until waited
    for, never another process's reused pid."""

    def __init__(self) -> None:
        self.deadline: dict[int, float] = {}
        self.killed: set[int] = set()

    def add(self, pid: int) -> None:
        """Track a new child: it may take REQUEST_TIMEOUT_S to read its request, then reports its verb's time."""
        self.deadline[pid] = time.monotonic() + REQUEST_TIMEOUT_S + REPLY_GRACE_S

    def read_reports(self, fd: int) -> None:
        """Apply the children's reports waiting on the pipe (``report_deadline``); every write is one whole record."""
        try:
            data = os.read(fd, 512 * REPORT.size)
        except BlockingIOError:
            return
        for pid, seconds in REPORT.iter_unpack(data[:len(data) - len(data) % REPORT.size]):
            if pid in self.deadline and pid not in self.killed:
                self.deadline[pid] = time.monotonic() + min(max(seconds, 1.0), MAX_DEADLINE_S) + REPLY_GRACE_S

    def police(self) -> None:
        """Reap the children that ended; SIGKILL (once, logged) each one stopped or past its deadline."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if os.WIFSTOPPED(status):
                self._kill(pid, "was stopped")
            else:
                self.deadline.pop(pid, None)
                self.killed.discard(pid)
        now = time.monotonic()
        for pid in [p for p, deadline in self.deadline.items() if now > deadline]:
            self._kill(pid, "overran its deadline")

    def wait_s(self) -> float | None:
        """How long the loop may wait for a connection: until the nearest deadline; None with no child."""
        live = [d for p, d in self.deadline.items() if p not in self.killed]
        return max(0.0, min(live) - time.monotonic()) if live else None

    def _kill(self, pid: int, why: str) -> None:
        if pid in self.killed:
            return
        os.kill(pid, signal.SIGKILL)
        self.killed.add(pid)
        print(f"storage broker: killed request child {pid}: it {why}", flush=True)


# ------------------------------------------------------------------ daemon
def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of the unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def serve(socket_path: Path, allowed_uids: set[int]) -> None:
    """Accept until SIGTERM; one forked child per connection (this loop stays single-threaded), each killed
    when it overruns its request's deadline or is stopped (``Children``)."""
    if os.geteuid() != 0:
        sys.exit("storage broker: must run as root (it switches to each tenant's uid per request)")
    socket_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        socket_path.unlink()
    except FileNotFoundError:
        pass
    # SIGTERM stops it cleanly, whatever the starting process had blocked or set (both are inherited).
    # The handler only records it (the wakeup fd below wakes the loop, which then returns): an
    # exception raised from a handler is swallowed where it lands in a callback, such as logging's
    # at-fork lock release around os.fork(), and the broker would run on until SIGKILLed
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGCHLD, signal.SIGINT})
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    srv.bind(str(socket_path))
    os.umask(old)
    os.chmod(socket_path, 0o600)
    service_uid = max(allowed_uids - {0}, default=0)
    os.chown(socket_path, service_uid, -1)
    srv.listen(128)
    wake_r, wake_w = os.pipe()                        # SIGCHLD (a child ended or stopped) wakes the loop
    for fd in (wake_r, wake_w):
        os.set_blocking(fd, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)    # reaped by Children.police, never by the kernel
    print(f"storage broker: listening on {socket_path} for uids {sorted(allowed_uids)}", flush=True)
    import gc

    gc.freeze()          # children share these pages instead of copying them on first GC
    children = Children()
    report_r, report_w = os.pipe()
    os.set_blocking(report_r, False)
    while not stop:
        children.police()
        ready, _, _ = select.select([srv.fileno(), report_r, wake_r], [], [], children.wait_s())
        if wake_r in ready:
            os.read(wake_r, 4096)
        if stop:
            break
        if report_r in ready:
            children.read_reports(report_r)
        if srv.fileno() not in ready:
            continue
        try:
            conn, _ = srv.accept()
        except InterruptedError:
            continue
        try:
            if peer_uid(conn) not in allowed_uids:
                send_msg(conn, {"ok": False, "code": "forbidden", "message": "not the gateway's service user"})
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                signal.set_wakeup_fd(-1)
                for fd in (report_r, wake_r, wake_w):
                    os.close(fd)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # sbatch's exit status must be seen
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                gc.disable()         # a child lives for one request
                try:
                    serve_one(conn, report_w)
                finally:
                    os._exit(0)
            children.add(pid)
        except OSError:
            pass
        finally:
            conn.close()
    print("storage broker: SIGTERM: stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.storage.broker --socket PATH [--allow-user USER ...]``: serve until SIGTERM;
    root may always connect. Exits when a named user does not exist."""
    p = argparse.ArgumentParser(prog="python -m gateway.storage.broker", description=__doc__.split("\n")[0])
    p.add_argument("--socket", type=Path, required=True)
    p.add_argument("--allow-user", action="append", default=[], help="service user allowed to connect")
    a = p.parse_args(argv)
    try:
        users = [pwd.getpwnam(u) for u in a.allow_user]
    except KeyError as e:
        sys.exit(f"storage broker: no such user {e} (scripts/bootstrap.sh creates the service user)")
    uids = {0} | {pw.pw_uid for pw in users}
    RESERVED_UIDS.update(uids)                      # a peer is never a tenant (tenant_identity)
    RESERVED_GIDS.update(pw.pw_gid for pw in users)
    serve(a.socket, uids)


if __name__ == "__main__":
    main()
