"""Storage quotas, enforced by the filesystem: each tenant root is a btrfs subvolume with a qgroup limit.

HPC centers limit space on the filesystem itself (Lustre's ``lfs setquota``, GPFS filesets, XFS
project quotas), so that every writer meets the limit: an upload the gateway streams, a
checkpoint the trainer writes in a job, anything a tenant's process writes. This module does it
on btrfs: the tenant root is a subvolume (made at onboarding when the tenants directory is on
btrfs with quotas on), and its qgroup's *referenced* limit is the tenant's space quota; a write
past it fails with EDQUOT in whatever process makes it. btrfs qgroups limit bytes only, never a
count of files.

Everything here is an ioctl on an open directory, or a read of the qgroup's figures in sysfs:
no process is started. Setting a limit or making a subvolume needs root (CAP_SYS_ADMIN); reading
the figures needs only an fd of the tenant root, so the broker reads them as the tenant.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

_WRITE, _READ = 1, 2


def _ioc(direction: int, nr: int, size: int) -> int:
    return (direction << 30) | (size << 16) | (0x94 << 8) | nr     # 0x94: BTRFS_IOCTL_MAGIC


SUBVOL_CREATE = _ioc(_WRITE, 14, 4096)            # struct btrfs_ioctl_vol_args {s64 fd; char name[4088]}
INO_LOOKUP = _ioc(_READ | _WRITE, 18, 4096)       # {u64 treeid; u64 objectid; char name[4080]}
FS_INFO = _ioc(_READ, 31, 1024)                   # {u64 max_id; u64 num_devices; u8 fsid[16]; ...}
QUOTA_CTL = _ioc(_READ | _WRITE, 40, 16)          # {u64 cmd; u64 status}
QGROUP_LIMIT = _ioc(_READ, 43, 48)                # {u64 qgroupid; {u64 flags, max_rfer, max_excl, rsv_rfer, rsv_excl}}
QUOTA_CTL_ENABLE = 1
LIMIT_MAX_RFER = 1
CLEAR = (1 << 64) - 1                             # "no limit" for max_rfer
FIRST_FREE_OBJECTID = 256                         # the inode number of every subvolume's root directory
SYSFS = Path("/sys/fs/btrfs")
ENFORCED_BY = "btrfs qgroup"


class QuotaError(Exception):
    """A quota that cannot be set or read here (not btrfs, quotas off, not a subvolume, no right)."""


@dataclass(frozen=True)
class Usage:
    """A tenant root's space: ``used_bytes`` (the qgroup's referenced bytes) against ``limit_bytes``
    (None: no limit), and what enforces the limit (None when nothing does here)."""

    used_bytes: int | None
    limit_bytes: int | None
    enforced_by: str | None

    def as_dict(self) -> dict[str, int | str | None]:
        """The figures as JSON: used_bytes, limit_bytes, enforced_by."""
        return {"used_bytes": self.used_bytes, "limit_bytes": self.limit_bytes, "enforced_by": self.enforced_by}


NONE = Usage(None, None, None)


def fsid(fd: int) -> str | None:
    """The btrfs filesystem id of the directory ``fd`` (as sysfs names it), or None when it is not btrfs."""
    buf = bytearray(1024)
    try:
        fcntl.ioctl(fd, FS_INFO, buf)
    except OSError as e:
        if e.errno in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise
    raw = bytes(buf[16:32]).hex()
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


def subvolume_id(fd: int) -> int:
    """The id of the btrfs subvolume that holds the directory ``fd`` (no privilege needed)."""
    buf = bytearray(4096)
    struct.pack_into("=QQ", buf, 0, 0, FIRST_FREE_OBJECTID)
    fcntl.ioctl(fd, INO_LOOKUP, buf)
    return int(struct.unpack_from("=Q", buf, 0)[0])


def is_subvolume(fd: int) -> bool:
    """Whether the directory ``fd`` is the root of a btrfs subvolume."""
    return fsid(fd) is not None and os.fstat(fd).st_ino == FIRST_FREE_OBJECTID


def _qgroup_dir(fd: int) -> Path | None:
    fs = fsid(fd)
    if fs is None:
        return None
    d = SYSFS / fs / "qgroups"
    return d if d.is_dir() else None


def enabled(fd: int) -> bool:
    """Whether the filesystem of the directory ``fd`` is btrfs with quotas (qgroups) on."""
    return _qgroup_dir(fd) is not None


def enable(fd: int) -> None:
    """Turn quotas on for the btrfs filesystem of the directory ``fd`` (root); QuotaError if not btrfs."""
    if fsid(fd) is None:
        raise QuotaError("not a btrfs filesystem")
    buf = bytearray(struct.pack("=QQ", QUOTA_CTL_ENABLE, 0))
    fcntl.ioctl(fd, QUOTA_CTL, buf)


def create_subvolume(parent_fd: int, name: str) -> None:
    """Make ``name`` in the directory ``parent_fd`` as a new btrfs subvolume (root); FileExistsError
    when the name exists, QuotaError when ``parent_fd`` is not on btrfs."""
    if fsid(parent_fd) is None:
        raise QuotaError("not a btrfs filesystem")
    raw = name.encode()
    if not raw or b"/" in raw or len(raw) >= 4088:
        raise ValueError(f"invalid subvolume name: {name!r}")
    buf = bytearray(4096)
    struct.pack_into("=q", buf, 0, 0)
    buf[8:8 + len(raw)] = raw
    fcntl.ioctl(parent_fd, SUBVOL_CREATE, buf)


def set_limit(fd: int, limit_bytes: int | None) -> None:
    """Limit the subvolume whose root is the directory ``fd`` to ``limit_bytes`` referenced (None: no
    limit). Root only. QuotaError when ``fd`` is not a subvolume root on btrfs with quotas on."""
    if not is_subvolume(fd):
        raise QuotaError("the tenant's storage is not a btrfs subvolume, so no quota can be set on it "
                         "(tenants made before the tenants directory was on btrfs: see README, Storage quotas)")
    if not enabled(fd):
        raise QuotaError("quotas are off on this btrfs filesystem (btrfs quota enable <mountpoint>)")
    value = CLEAR if limit_bytes is None else int(limit_bytes)
    if value != CLEAR and value <= 0:
        raise ValueError("a limit is a positive number of bytes")
    # through the parent directory (another subvolume), naming the qgroup: the ioctl's transaction is then
    # charged to the parent, so a limit can be raised or lifted while the tenant is over it
    buf = bytearray(struct.pack("=QQQQQQ", subvolume_id(fd), LIMIT_MAX_RFER, value, 0, 0, 0))
    parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=fd)
    try:
        fcntl.ioctl(parent, QGROUP_LIMIT, buf)
    finally:
        os.close(parent)


def _syncfs(fd: int) -> None:
    # btrfs updates a qgroup's figures when a transaction commits (every 30 s by default): commit now,
    # so a file just written or deleted is counted. syncfs needs no privilege.
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syncfs(fd) != 0:
        raise OSError(ctypes.get_errno(), "syncfs")


def usage(fd: int, *, sync: bool = True) -> Usage:
    """The space of the subvolume whose root is the directory ``fd``: NONE when it is not a subvolume
    root on btrfs with quotas on (nothing enforces a limit there)."""
    qgroups = _qgroup_dir(fd)
    if qgroups is None or os.fstat(fd).st_ino != FIRST_FREE_OBJECTID:
        return NONE
    if sync:
        _syncfs(fd)
    d = qgroups / f"0_{subvolume_id(fd)}"
    try:
        used = int((d / "referenced").read_text().strip())
        limit = int((d / "max_referenced").read_text().strip())
        flags = int((d / "limit_flags").read_text().strip())
    except (OSError, ValueError):
        return NONE
    return Usage(used, limit if flags & LIMIT_MAX_RFER and limit else None, ENFORCED_BY)


UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int | None:
    """``20G``, ``500M``, ``1.5T``, ``123456`` (bytes) as bytes; ``none``/``0`` as None (no limit).
    ValueError for anything else."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    if t in ("NONE", "0", "OFF"):
        return None
    unit = t[-1:] if t[-1:] in UNITS and not t[-1:].isdigit() else ""
    number = t[:-1] if unit else t
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"not a size: {text!r} (e.g. 20G, 500M, none)") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"not a size: {text!r} (e.g. 20G, 500M, none)")
    return int(value * UNITS[unit])


def human(n: int | None) -> str:
    """``n`` bytes for people (``1.5 GiB``); ``-`` for None."""
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
