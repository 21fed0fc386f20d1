"""Tenant storage, as the gateway sees it: one object, a fixed set of verbs.

The gateway (an unprivileged service user) never opens a path in a tenant's
storage. It asks ``Storage.tenant(name)`` for a ``TenantStorage`` and calls its
methods; each is one request to the storage broker (``broker``), which runs it
in a child process that has become the tenant's unix user and opens names
no-follow beneath the tenant root (``safefs``). What comes back (file
descriptors, bytes) is then treated as untrusted input by the caller.

A tenant with no unix user on this host (a storage-only tenant of the service
tests, or the no-root local mode) runs the same verbs in-process ("direct"):
its files belong to whoever runs the gateway, and there is no tenant uid that
could attack them.
"""

from __future__ import annotations

import os
import pwd
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.errors import (
    Conflict,
    NotFound,
    QuotaExceeded,
    ServiceError,
    StorageFailed,
    StorageFull,
    StorageTampered,
    StorageUnavailable,
)
from gateway.slurm.runner import TENANT_SBATCH, CommandResult
from gateway.storage import launch, layout, quota, safefs
from gateway.storage.broker import BrokerError, recv_msg, reply_error, run_verb, send_msg
from gateway.storage.verbs import Reply
from trainer.contract import jobdir
from trainer.contract.spec import JobSpec, spec_file_text

__all__ = ["QUOTA_EXCEEDED", "STORAGE_FULL", "Freed", "Storage", "TenantRunner", "TenantStorage", "Upload",
           "create_tenant_root", "layout", "storage_for"]


def _error(code: str, message: str) -> ServiceError:
    if code == "not_found":
        return NotFound(message)
    if code == "storage_full":
        return StorageFull(STORAGE_FULL)
    if code == "quota_exceeded":
        return QuotaExceeded(QUOTA_EXCEEDED)
    if code == "unsafe_storage":
        return StorageTampered(f"the stored data was changed outside the gateway ({message}); "
                               "it is not used")
    if code in ("conflict", "publication_refused"):
        return Conflict(message, code=code)
    if code == "invalid_request":
        return ServiceError(message)
    return StorageFailed(f"storage operation failed: {message}", code=code)


QUOTA_EXCEEDED = ("storage quota exceeded: nothing was kept; delete files or models you no longer need "
                  "(finetune files delete, finetune models delete), or ask your administrator for more space")
STORAGE_FULL = ("the shared storage is full: nothing was kept; ask your administrator, then retry")

# How long the gateway waits for a verb's reply; the broker kills the child once that has passed
# (``broker.serve``), so a request the gateway gave up on never lives on as a tenant's process.
TIMEOUT_S = 120.0
VERB_TIMEOUT_S = {"read_events": 30.0, "read_spec": 30.0, "open_file": 30.0, "upload_begin": 30.0,
                  "upload_abort": 30.0, "storage_usage": 30.0, "publish_commit": 60.0, "sweep": 120.0, "remove": 300.0,
                  "publish_build": 900.0, "checkpoints_build": 900.0}   # adapter and checkpoint tars are copied
                                                                         # and hashed
SUBMIT_MARGIN_S = 30.0      # ``submit``: sbatch's own timeout plus this


@dataclass(frozen=True)
class Freed:
    """What a ``remove`` freed: the paths that existed, and their regular files' bytes."""

    removed: int
    bytes: int | None


@dataclass
class Upload:
    """A temp file in the tenant's datasets/ that the gateway streams into."""

    name: str
    fd: int


class Storage:
    """Per-process entry point; thread-safe."""

    def __init__(self, storage_root: Path, socket_path: Path, service_user: str | None = None,
                 direct: bool = False):
        self.root = storage_root
        self.direct = direct            # local mode: every tenant in-process, as this process's user
        self.socket_path = socket_path
        self.service_user = service_user
        self._users: dict[str, tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def tenant(self, name: str) -> TenantStorage:
        """The verbs for tenant ``name``; LayoutError when it is not a valid tenant name."""
        return TenantStorage(self, layout.tenant_name(name))

    def has_unix_user(self, tenant: str) -> bool:
        """Whether the tenant's unix user (``sft-<tenant>``) exists here; a yes is cached 30 s, a no never."""
        now = time.monotonic()
        with self._lock:
            hit = self._users.get(tenant)
            if hit and now - hit[0] < 30:
                return hit[1]
        try:
            pwd.getpwnam(layout.unix_user_for(tenant))
        except KeyError:
            return False        # not cached: a tenant onboarded a moment later goes through the broker
        with self._lock:
            self._users[tenant] = (now, True)
        return True

    def ensure_broker(self) -> None:
        """Start the broker unless one answers (root only); StorageUnavailable when it cannot be started."""
        try:
            launch.ensure_broker(self.socket_path, self.service_user)
        except RuntimeError as e:
            raise StorageUnavailable(str(e)) from None

    def call(self, tenant: str, verb: str, args: dict[str, Any] | None = None,
             fds: list[int] | None = None, timeout: float | None = None) -> Reply:
        """Run ``verb`` for ``tenant``: in-process when direct or it has no unix user, else through the broker,
        waiting at most ``timeout`` seconds (default: the verb's ``VERB_TIMEOUT_S``) for the reply, after
        which the broker kills the request's child. A refusal or failure raises the ServiceError its code maps
        to (NotFound, StorageFull, Conflict, ...); no reply in time raises StorageFailed."""
        args, fds = args or {}, fds or []
        if self.direct or not self.has_unix_user(tenant):
            try:
                return run_verb(self.root, tenant, None, verb, args, fds)
            except Exception as e:   # noqa: BLE001 - mapped exactly as the broker maps them
                err = reply_error(e)
                raise _error(err["code"], err["message"]) from None
        return self._via_broker(tenant, verb, args, fds, VERB_TIMEOUT_S.get(verb, TIMEOUT_S) if timeout is None
                                else timeout)

    def _connect(self) -> socket.socket:
        for attempt in (0, 1):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.connect(str(self.socket_path))
                return s
            except OSError:
                s.close()
                if attempt == 0 and os.geteuid() == 0:
                    self.ensure_broker()
                    continue
                raise StorageUnavailable(
                    f"the storage broker does not answer at {self.socket_path}: start it as root "
                    "(finetune broker), or start finetune serve as root") from None
        raise AssertionError("unreachable")

    def _via_broker(self, tenant: str, verb: str, args: dict[str, Any], fds: list[int], timeout: float) -> Reply:
        s = self._connect()
        try:
            s.settimeout(timeout)
            send_msg(s, {"tenant": tenant, "storage_root": str(self.root), "verb": verb, "args": args,
                         "deadline_s": timeout}, fds)
            header, rfds, blobs = recv_msg(s)
        except TimeoutError:
            raise StorageFailed(f"storage broker: no answer to {verb} within {timeout:.0f}s") from None
        except (OSError, BrokerError, ValueError) as e:
            raise StorageFailed(f"storage broker: {e}") from None
        finally:
            s.close()
        if not header.get("ok"):
            for fd in rfds:
                os.close(fd)
            raise _error(str(header.get("code", "storage_error")), str(header.get("message", "failed")))
        return Reply(header.get("result") or {}, rfds, blobs)


def create_tenant_root(storage_root: Path, tenant: str, uid: int, gid: int) -> Path:
    """Onboarding (root): ``<root>/tenants`` 0711 root's (traversable, not listable) and the tenant
    root 0700 owned by the tenant's unix user; never through a link (``safefs.own_dir``)."""
    root = layout.tenant_root(storage_root, tenant)
    storage_root.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.chmod(storage_root, 0o755)
    if root.parent.exists() and os.lstat(root.parent).st_uid != 0:
        raise RuntimeError(f"{root.parent} must be a root-owned directory")
    safefs.own_dir(root.parent, 0, 0, 0o711)
    _make_subvolume(root)
    safefs.own_dir(root, uid, gid, 0o700)
    return root


def _make_subvolume(root: Path) -> None:
    """Where the tenants directory is on btrfs with quotas on, a new tenant root is a subvolume of its
    own, so that its space can be limited (``quota.set_limit``); elsewhere ``own_dir`` makes a plain dir."""
    parent = os.open(root.parent, safefs.DIR_FLAGS)
    try:
        if quota.enabled(parent):
            quota.create_subvolume(parent, root.name)
    except FileExistsError:
        pass
    finally:
        os.close(parent)


_shared: dict[tuple[Path, Path, str | None, bool], Storage] = {}


def storage_for(settings: Any) -> Storage:
    """The process's Storage for these settings (one per storage root and broker socket)."""
    key = (settings.storage_root, settings.broker_socket, settings.service_user, settings.backend == "local")
    if key not in _shared:
        _shared[key] = Storage(*key)
    return _shared[key]


class TenantStorage:
    """The verbs for one tenant (see ``gateway.storage.verbs`` for what each does)."""

    def __init__(self, storage: Storage, tenant: str):
        self.storage, self.tenant = storage, tenant

    def _call(self, verb: str, args: dict[str, Any] | None = None, fds: list[int] | None = None,
              timeout: float | None = None) -> Reply:
        return self.storage.call(self.tenant, verb, args, fds, timeout)

    def absolute(self, parts: layout.Parts) -> str:
        """The absolute path of ``parts`` under this tenant's root (for the trainer, which runs as the tenant)."""
        return layout.absolute(self.storage.root, self.tenant, parts)

    # uploads
    def upload_begin(self) -> Upload:
        """A fresh temp file in datasets/ to stream an upload into: its name and a write fd."""
        r = self._call("upload_begin")
        return Upload(str(r.result["name"]), r.fds[0])

    def upload_commit(self, up: Upload, sha256: str, size: int) -> None:
        """Name the streamed upload ``<sha256>.jsonl``: Conflict if its temp file was replaced meanwhile,
        StorageTampered if it does not hold exactly ``size`` bytes."""
        self._call("upload_commit", {"name": up.name, "sha256": sha256, "size": size}, [up.fd])

    def upload_abort(self, up: Upload) -> None:
        """Remove the upload's temp file (already gone: fine)."""
        self._call("upload_abort", {"name": up.name})

    # reads
    def open(self, parts: layout.Parts, size: int) -> int:
        """A read fd: regular file, the tenant's own, exactly ``size`` bytes."""
        return self._call("open_file", {"parts": list(layout.check(parts)), "size": size}).fds[0]

    def stream(self, parts: layout.Parts, size: int, chunk: int = 1 << 20) -> Iterator[bytes]:
        """The bytes of a stored file: opened (and checked) now, read as the response streams;
        never more than ``size`` bytes, whatever happens to the file meanwhile."""
        f = os.fdopen(self.open(parts, size), "rb", buffering=0)   # closed even if never iterated

        def chunks() -> Iterator[bytes]:
            left = size
            with f:
                while left > 0 and (block := f.read(min(chunk, left))):
                    left -= len(block)
                    yield block

        return chunks()

    def read_events(self, offsets: dict[str, int], timeout: float | None = None) -> dict[str, bytes]:
        """New bytes of each job's events.jsonl from its offset (job id → at most 4 MiB); a missing file gives b""."""
        if not offsets:
            return {}
        r = self._call("read_events", {"offsets": offsets}, timeout=timeout)
        return dict(zip(r.result.get("order") or [], r.blobs, strict=False))

    def read_spec(self, job_id: str) -> bytes | None:
        """The job's spec.json; None when it is missing, over 1 MiB, or not a plain file of the tenant's."""
        r = self._call("read_spec", {"job_id": job_id})
        return r.blobs[0] if r.result.get("found") and r.blobs else None

    # writes
    def write_spec(self, job_id: str, spec: JobSpec) -> str:
        """Write ``spec`` as the job's spec.json (atomically, creating its directory); returns the absolute path."""
        self._call("write_spec", {"job_id": job_id, "spec": spec_file_text(spec)})
        return self.absolute(layout.job_file(job_id, jobdir.SPEC))

    def remove(self, paths: list[layout.Parts]) -> int:
        """Remove these paths (files or trees, links never followed); returns how many existed."""
        return self.free(paths).removed

    def free(self, paths: list[layout.Parts]) -> Freed:
        """``remove``, saying what it freed: how many paths existed and the bytes of their regular files
        (as the broker measured them just before; None from a broker older than that figure)."""
        r = self._call("remove", {"paths": [list(layout.check(p)) for p in paths]}).result
        size = r.get("freed_bytes")
        return Freed(int(r["removed"]), size if isinstance(size, int) and not isinstance(size, bool) else None)

    def usage(self) -> quota.Usage:
        """The tenant root's space as the filesystem counts and limits it (``quota.NONE`` where nothing does)."""
        r = self._call("storage_usage").result

        def number(key: str) -> int | None:
            v = r.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None

        by = r.get("enforced_by")
        return quota.Usage(number("used_bytes"), number("limit_bytes"), by if isinstance(by, str) else None)

    def sweep(self, min_age_s: float) -> int:
        """Remove upload and publication temp names older than ``min_age_s``; returns how many."""
        return int(self._call("sweep", {"min_age_s": min_age_s}).result["removed"])

    def publish_build(self, job_id: str, attempt: int, model_digest: str | None,
                      checkpoint_steps: list[int] | None = None) -> dict[str, Any]:
        """Verify the attempt's staging and build its results in a hidden artifacts/.pub-* dir.
        Returns ``name`` (that dir), ``results`` (each one's bytes and sha256), ``evaluation`` (eval.json)
        and ``manifest`` (the checked subset of the trainer's manifest the lineage keeps: ``verbs.reported``);
        the adapters of the complete ones of ``checkpoint_steps`` are results too (``checkpoints``)."""
        return self._call("publish_build", {"job_id": job_id, "attempt": attempt, "model_digest": model_digest,
                                            "checkpoint_steps": checkpoint_steps or []}).result

    def checkpoints_build(self, job_id: str, checkpoint_steps: list[int]) -> dict[str, Any]:
        """Build the complete ones of ``checkpoint_steps`` of a job that ended unpublished in a hidden
        artifacts/.pub-* dir: ``name``, ``results`` (each tar's bytes and sha256), ``checkpoints`` (the
        steps packed), ``skipped_checkpoints``; Conflict when not one is complete."""
        return self._call("checkpoints_build", {"job_id": job_id, "checkpoint_steps": checkpoint_steps}).result

    def publish_commit(self, name: str, art_id: str) -> None:
        """Rename the built dir ``name`` to artifacts/<art_id>, where its results appear at once."""
        self._call("publish_commit", {"name": name, "art_id": art_id})

    def submit(self, script: str, timeout: float = 60.0) -> tuple[int, str, str]:
        """sbatch as the tenant (``--export=NONE``): (returncode, stdout, stderr)."""
        r = self._call("submit", {"script": script, "timeout": timeout}, timeout=timeout + SUBMIT_MARGIN_S).result
        return int(r["returncode"]), str(r["stdout"]), str(r["stderr"])


class TenantRunner:
    """A Runner (gateway.slurm.runner) that runs exactly one command, ``sbatch --parsable
    --export=NONE`` with the script on stdin, as the tenant through the broker."""

    ARGV = TENANT_SBATCH

    def __init__(self, store: TenantStorage):
        self.store = store

    def run(self, argv: Any, *, timeout: float = 60.0, input: str | None = None,
            env: Any = None) -> Any:
        """Submit the script ``input`` through the broker as the tenant; a CommandResult.
        Raises ValueError for any argv but ARGV, no script, or an ``env``."""
        if tuple(argv) != self.ARGV or input is None or env is not None:
            raise ValueError(f"the tenant runner only submits batch scripts, not {argv!r}")
        start = time.monotonic()
        rc, out, err = self.store.submit(input, timeout=timeout)
        return CommandResult(tuple(argv), rc, out, err, time.monotonic() - start)
