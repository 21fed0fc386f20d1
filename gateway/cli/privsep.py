"""The control plane never runs as root.

``finetune serve`` and ``finetune reconcile`` call ``become_service_user`` first.
Started as root, they do the only things that need root, then drop for good to
the service user (``SFT_SERVICE_USER``, default ``sft-gateway``) before opening
the database or a socket:

1. make the gateway's state dir (``SFT_STATE_DIR``: database, portal secret,
   audit key) 0700 and owned by the service user,
2. start the storage broker (``gateway.storage.broker``) unless one answers:
   the narrow root helper that performs tenant-storage verbs as the tenant.

Without a service user they refuse to run as root. Started as any other user
they run as that user (a site that starts them from a systemd unit with
``User=sft-gateway`` never gives them root at all).
"""

from __future__ import annotations

import os
import pwd
from pathlib import Path
from typing import Any

from gateway.storage import storage_for
from gateway.storage.safefs import UnsafeStorage, own_dir


class PrivilegeError(SystemExit):
    pass


def _own_dir(path: Path, uid: int, gid: int) -> None:
    """``path`` as a 0700 directory of ``uid`` (created if missing; never through a link)."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    try:
        own_dir(path, uid, gid, 0o700)
    except UnsafeStorage:
        raise PrivilegeError(f"{path} is not a directory: refusing to use it as the gateway's state dir") from None


def become_service_user(settings: Any, *, start_broker: bool = True) -> None:
    """Drop from root to the service user (see the module doc); no-op when not root."""
    if os.geteuid() != 0:
        return
    try:
        pw = pwd.getpwnam(settings.service_user)
    except KeyError:
        raise PrivilegeError(f"refusing to run the gateway as root: its service user "
                             f"{settings.service_user!r} does not exist (scripts/bootstrap.sh creates it, "
                             "or set SFT_SERVICE_USER)") from None
    if pw.pw_uid == 0:
        raise PrivilegeError("refusing to run the gateway as root: SFT_SERVICE_USER must not be root")
    _own_dir(settings.state_dir, pw.pw_uid, pw.pw_gid)
    if start_broker:
        storage_for(settings).ensure_broker()
    os.setgroups([])
    os.setresgid(pw.pw_gid, pw.pw_gid, pw.pw_gid)
    os.setresuid(pw.pw_uid, pw.pw_uid, pw.pw_uid)
    if os.geteuid() == 0 or os.getuid() == 0:
        raise PrivilegeError("could not drop root privileges")
    os.umask(0o077)
    os.environ["HOME"] = str(settings.state_dir)
    os.environ["USER"] = os.environ["LOGNAME"] = pw.pw_name
    _check_database(settings.database_url)


def _check_database(url: str) -> None:
    if not url.startswith("sqlite:///"):
        return
    parent = Path(url.split("///", 1)[-1]).parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PrivilegeError(f"the service user cannot write the database directory {parent}: "
                             "put the SQLite file in the state dir (SFT_STATE_DIR) or a dir it owns")


def service_owned_dir(settings: Any, name: str) -> Path:
    """A fresh 0700 dir of the service user under its state dir (root only): for a database
    that a root process prepares and a dropped gateway then serves (tests, demo)."""
    pw = pwd.getpwnam(settings.service_user)
    _own_dir(settings.state_dir, pw.pw_uid, pw.pw_gid)
    path = settings.state_dir / name
    _own_dir(path, pw.pw_uid, pw.pw_gid)
    return path
