"""The storage broker: the one privileged piece of the control plane, and a narrow one.

It runs as root (a systemd unit on a real site, or started by a root
``finetune serve`` before that drops to the service user), listens on a unix
socket that only root and the gateway's service user may use (checked with
SO_PEERCRED on every connection), and for each request forks a child that

1. derives the tenant's unix user itself (``sft-<tenant>``; its home must be the
   tenant root, so no other account can be named),
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
import json
import os
import pwd
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gateway.storage import layout, safefs
from gateway.storage.verbs import VERBS, Ctx, Reply, VerbError


def code_id() -> str:
    """A digest of the code this broker runs (its package's storage modules): a gateway started
    after an upgrade compares it with its own and replaces a broker still running the old code
    (``launch.ensure_broker``), so a fix to a verb never waits for a reboot."""
    import hashlib

    here = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for name in ("broker.py", "verbs.py", "safefs.py", "layout.py", "__init__.py"):
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    return digest.hexdigest()[:16]


CODE_ID = code_id()

MAX_HEADER = 4 << 20
MAX_FDS = 4
REQUEST_TIMEOUT_S = 120.0
SBATCH = "sbatch"


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
def tenant_identity(tenant: str) -> pwd.struct_passwd:
    """The tenant's unix user, derived here (``sft-<tenant>``), never root. Which directory it may
    act on is settled after the switch: the tenant root must be owned by that uid."""
    try:
        pw = pwd.getpwnam(layout.unix_user_for(tenant))
    except KeyError:
        raise BrokerError(f"tenant {tenant} has no unix user on this host", code="no_unix_user") from None
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        raise BrokerError(f"refusing unix user {pw.pw_name}: not a tenant account", code="forbidden")
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
            os.makedirs(storage_root / "tenants", mode=0o711, exist_ok=True)
        tenants = os.open("tenants", walk, dir_fd=top)
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
    from gateway.slurm.runner import LocalRunner

    script = args.get("script")
    if not isinstance(script, str) or len(script) > 1 << 20:
        raise VerbError("invalid batch script")
    root = layout.tenant_root(storage_root, tenant)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(root), "LANG": "C.UTF-8",
           "USER": pwd.getpwuid(os.getuid()).pw_name}
    if os.environ.get("SLURM_CONF"):
        env["SLURM_CONF"] = os.environ["SLURM_CONF"]
    os.chdir(root)
    res = LocalRunner().run([SBATCH, "--parsable", "--export=NONE"], input=script, env=env,
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
        code = {errno.ENOSPC: "storage_full", errno.EDQUOT: "storage_full",
                errno.ENOENT: "not_found"}.get(e.errno or 0, "storage_error")
        return {"ok": False, "code": code, "message": e.strerror or type(e).__name__}
    return {"ok": False, "code": "storage_error", "message": f"storage verb failed ({type(e).__name__})"}


def serve_one(conn: socket.socket) -> None:
    """In the forked child: read one request, drop to the tenant, run it, reply."""
    fds: list[int] = []
    try:
        conn.settimeout(REQUEST_TIMEOUT_S)
        req, fds, _ = recv_msg(conn)
        if req.get("hello"):      # which code is this? (no tenant, nothing run)
            send_msg(conn, {"ok": True, "result": {"code_id": CODE_ID, "pid": os.getppid()}})
            return
        tenant, verb = str(req.get("tenant", "")), str(req.get("verb", ""))
        storage_root = storage_root_arg(req.get("storage_root"))
        pw = tenant_identity(tenant)
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


# ------------------------------------------------------------------ daemon
def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of the unix socket (SO_PEERCRED)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def serve(socket_path: Path, allowed_uids: set[int]) -> None:
    """Accept forever; one forked child per connection (this loop stays single-threaded)."""
    if os.geteuid() != 0:
        sys.exit("storage broker: must run as root (it switches to each tenant's uid per request)")
    socket_path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        socket_path.unlink()
    except FileNotFoundError:
        pass
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    srv.bind(str(socket_path))
    os.umask(old)
    os.chmod(socket_path, 0o600)
    service_uid = max(allowed_uids - {0}, default=0)
    os.chown(socket_path, service_uid, -1)
    srv.listen(128)
    import gateway.slurm.runner  # noqa: F401 - imported while root: children may not read the code after the drop
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)    # children are reaped by the kernel
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"storage broker: listening on {socket_path} for uids {sorted(allowed_uids)}", flush=True)
    import gc

    gc.freeze()          # children share these pages instead of copying them on first GC
    while True:
        try:
            conn, _ = srv.accept()
        except InterruptedError:
            continue
        try:
            if peer_uid(conn) not in allowed_uids:
                send_msg(conn, {"ok": False, "code": "forbidden", "message": "not the gateway's service user"})
                continue
            if os.fork() == 0:
                srv.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)   # sbatch's exit status must be seen
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                gc.disable()         # a child lives for one request
                try:
                    serve_one(conn)
                finally:
                    os._exit(0)
        except OSError:
            pass
        finally:
            conn.close()


def main(argv: list[str] | None = None) -> None:
    """``python -m gateway.storage.broker --socket PATH [--allow-user USER ...]``: serve until SIGTERM;
    root may always connect. Exits when a named user does not exist."""
    p = argparse.ArgumentParser(prog="python -m gateway.storage.broker", description=__doc__.split("\n")[0])
    p.add_argument("--socket", type=Path, required=True)
    p.add_argument("--allow-user", action="append", default=[], help="service user allowed to connect")
    a = p.parse_args(argv)
    try:
        uids = {0} | {pwd.getpwnam(u).pw_uid for u in a.allow_user}
    except KeyError as e:
        sys.exit(f"storage broker: no such user {e} (scripts/bootstrap.sh creates the service user)")
    serve(a.socket, uids)


if __name__ == "__main__":
    main()
