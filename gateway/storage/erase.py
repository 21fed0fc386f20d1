"""Root's erasure of what a tenant left: a whole tree, walked with fds, never following a link.

``erase`` removes one entry beneath a directory fd (a tenant root, a job's scratch dir, a file in
``/tmp``) and returns what went: every entry's path relative to it, its type, its size and, for a
regular file, the sha256 of the bytes it held (read through the very fd that was checked), so a
deletion receipt can say exactly what was removed. ``survey`` walks the same way and changes
nothing (a dry run: no file is opened). The walk:

- opens each directory ``O_DIRECTORY|O_NOFOLLOW`` beneath its parent's fd, and lstat-checks every
  entry before acting on it: a symlink is unlinked as a link (its target is never opened), a
  FIFO, socket or device node is unlinked without being opened;
- opens a regular file ``O_NOFOLLOW|O_NONBLOCK`` and acts only when the fd is that same inode;
- never crosses into another mount: the mount points beneath the top (``/proc/self/mountinfo``)
  are refused before anything is removed (tenants cannot mount; a mount there is an admin's);
- keeps going when an entry vanishes under it (the epilog may be clearing the same place).

It runs as root, in the admin CLI, after the tenant's jobs and processes are gone.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.storage import safefs

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
CHUNK = 1 << 20
MOUNTINFO = Path("/proc/self/mountinfo")


class EraseRefused(OSError):
    """Something beneath the tree makes erasing it unsafe (a mount point); nothing was removed."""


@dataclass(frozen=True)
class Entry:
    """One removed (or, surveyed, removable) entry: ``path`` relative to the erased path ('/'-joined;
    ``.`` is the erased path itself), ``kind`` (file, dir, link, other), ``size``
    (bytes of a file; a link's target length) and a file's ``sha256`` (None when not read: a survey,
    a directory, a special file; a link's is its target text's)."""

    path: str
    kind: str
    size: int
    sha256: str | None = None


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"


def mounts_beneath(top: Path, mountinfo: str | None = None) -> list[str]:
    """The mount points at or beneath ``top`` (from ``/proc/self/mountinfo``, or the text given)."""
    if mountinfo is None:
        try:
            mountinfo = MOUNTINFO.read_text()
        except OSError:
            return []
    prefix = str(top).rstrip("/") + "/"
    out = []
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = fields[4].replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n") \
                .replace("\\134", "\\")
            if point == str(top) or point.startswith(prefix):
                out.append(point)
    return out


def _hash_file(dir_fd: int, name: str, st: os.stat_result) -> str | None:
    """The sha256 of regular file ``name``, read through an fd that is the inode lstat saw; None
    when it vanished or was swapped for something else in between."""
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
            return None
        raise
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return None
        h = hashlib.sha256()
        while chunk := os.read(fd, CHUNK):
            h.update(chunk)
        return h.hexdigest()
    finally:
        os.close(fd)


def _lstat(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _link_entry(dir_fd: int, name: str, rel: str) -> Entry:
    try:
        target = os.readlink(name, dir_fd=dir_fd).encode("utf-8", "surrogateescape")
    except OSError:
        target = b""
    return Entry(rel, "link", len(target), hashlib.sha256(target).hexdigest())


def _walk(dir_fd: int, name: str, rel: str, *, remove: bool) -> Iterator[Entry]:
    """Entries of ``name`` beneath ``dir_fd``, children before their directory, removed as they
    are yielded when ``remove``. Iterative: a tenant's deep tree cannot exhaust the stack."""
    st = _lstat(dir_fd, name)
    if st is None:
        return
    if not stat.S_ISDIR(st.st_mode):
        yield _leaf(dir_fd, name, rel, st, remove=remove)
        return
    try:
        top = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ENOENT,):
            return
        if e.errno in (errno.ELOOP, errno.ENOTDIR):     # swapped for a link or a file since lstat
            yield from _walk(dir_fd, name, rel, remove=remove)
            return
        raise
    # a stack of (dir fd, its parent's fd, its name, its relative path, names left to visit)
    stack: list[tuple[int, int, str, str, list[str]]] = [(top, dir_fd, name, rel, sorted(os.listdir(top)))]
    try:
        while stack:
            fd, parent, dname, drel, left = stack[-1]
            if not left:
                stack.pop()
                os.close(fd)
                if remove:
                    try:
                        os.rmdir(dname, dir_fd=parent)
                    except FileNotFoundError:
                        pass
                yield Entry(drel, "dir", 0)
                continue
            child = left.pop()
            crel = child if drel == "." else f"{drel}/{child}"
            cst = _lstat(fd, child)
            if cst is None:
                continue
            if stat.S_ISDIR(cst.st_mode):
                try:
                    cfd = os.open(child, DIR_FLAGS, dir_fd=fd)
                except OSError as e:
                    if e.errno == errno.ENOENT:
                        continue
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        left.append(child)      # swapped since lstat: look at it again
                        continue
                    raise
                stack.append((cfd, fd, child, crel, sorted(os.listdir(cfd))))
                continue
            yield _leaf(fd, child, crel, cst, remove=remove)
    finally:
        for fd, *_ in stack:
            os.close(fd)


def _leaf(dir_fd: int, name: str, rel: str, st: os.stat_result, *, remove: bool) -> Entry:
    kind = _kind(st.st_mode)
    if kind == "link":
        entry = _link_entry(dir_fd, name, rel)
    elif kind == "file":
        entry = Entry(rel, kind, st.st_size, _hash_file(dir_fd, name, st) if remove else None)
    else:
        entry = Entry(rel, kind, 0)
    if remove:
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        except IsADirectoryError:       # swapped for a directory since lstat (by root): erase that too
            for _ in _walk(dir_fd, name, rel, remove=True):
                pass
            return Entry(rel, "dir", 0)
    return entry


def _open_dir(path: Path) -> int:
    """An fd of directory ``path``, every component opened no-follow from ``/``."""
    fd = os.open("/", DIR_FLAGS)
    try:
        for part in path.parts[1:]:
            nfd = os.open(part, DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def _checked(path: Path) -> Path:
    if not path.is_absolute() or ".." in path.parts or path == Path("/"):
        raise ValueError(f"not an absolute path below /: {path}")
    mounts = mounts_beneath(path)
    if mounts:
        raise EraseRefused(errno.EBUSY, f"refusing to erase {path}: {', '.join(mounts)} is mounted there; "
                                        "unmount it first (nothing was removed)")
    return path


def erase(path: Path) -> list[Entry]:
    """Remove ``path`` (a file, a link or a whole tree; missing is fine) and return what went, each
    file read and hashed through its checked fd before it is unlinked. The path's own components
    are opened no-follow too (a link on the way raises OSError ELOOP/ENOTDIR); EraseRefused, before
    anything is removed, when a mount point lies at or beneath it."""
    return _tree(path, remove=True)


def survey(path: Path) -> list[Entry]:
    """What ``erase(path)`` would remove (no file opened, nothing changed; no sha256s); [] when
    ``path`` does not exist. EraseRefused as ``erase``."""
    return _tree(path, remove=False)


def _tree(path: Path, *, remove: bool) -> list[Entry]:
    _checked(path)
    try:
        parent = _open_dir(path.parent)
    except FileNotFoundError:
        return []
    try:
        return list(_walk(parent, path.name, ".", remove=remove))
    finally:
        os.close(parent)


def owned_entries(top: Path, uid: int) -> list[Path]:
    """The entries directly in directory ``top`` (``/tmp``, a scratch root) owned by ``uid``, by
    lstat through ``top``'s no-follow fd; [] when ``top`` does not exist."""
    try:
        parent = _open_dir(top)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        out = []
        for name in sorted(os.listdir(parent)):
            st = _lstat(parent, name)
            if st is not None and st.st_uid == uid:
                out.append(top / name)
        return out
    finally:
        os.close(parent)


def processes_of(uid: int, proc: Path = Path("/proc")) -> list[int]:
    """The pids of processes whose real, effective or saved uid is ``uid`` (``/proc/<pid>/status``)."""
    out = []
    for entry in proc.iterdir() if proc.is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "status").read_text()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("Uid:"):
                if str(uid) in line.split()[1:4]:
                    out.append(int(entry.name))
                break
    return sorted(out)


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``safefs.write_atomic``: temp name beside it, fsync,
    rename, fsync the dir), mode 0600; its directory is made 0700 when missing. A link at the final
    name is replaced, never followed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    dfd = os.open(path.parent, DIR_FLAGS)
    try:
        safefs.write_atomic(dfd, path.name, data, mode=0o600)
    finally:
        os.close(dfd)
