"""Scratch directories and a job user's files: create, measure, remove, find leftovers.

Removal works on directory file descriptors with ``O_NOFOLLOW`` and ``dir_fd``
(as ``shutil.rmtree`` does on Linux), so a symlink planted by a tenant can
never redirect root's deletions outside the tree. Nothing here reads file
contents; only names' metadata (lstat) is used, and names are never reported.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class Removed:
    files: int = 0  # non-directories unlinked
    dirs: int = 0
    bytes: int = 0  # st_size of the regular files unlinked
    errors: int = 0
    first_error: str = ""

    def add(self, other: Removed) -> None:
        self.files += other.files
        self.dirs += other.dirs
        self.bytes += other.bytes
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error

    def error(self, where: str, e: OSError) -> None:
        """Count an error; keep the first one's reason (never the file name: names are tenant data)."""
        del where  # kept at call sites for debugging with a breakpoint, never reported
        self.errors += 1
        if not self.first_error:
            self.first_error = e.strerror or type(e).__name__


@dataclass(frozen=True)
class DirState:
    exists: bool
    is_dir: bool = False
    uid: int = -1
    gid: int = -1
    mode: int = 0


def dir_state(path: Path) -> DirState:
    """lstat of ``path`` (a symlink is not a directory)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return DirState(False)
    return DirState(True, stat.S_ISDIR(st.st_mode), st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode))


def make_scratch(root: Path, job_id: int, uid: int, gid: int) -> Path:
    """Create ``root/job-<id>`` 0700 owned by uid:gid (root itself root-owned 0711).

    An existing directory (a requeued job's previous run) is kept and re-owned
    only when it is a real directory; a symlink or file there raises OSError.
    """
    root.mkdir(parents=True, exist_ok=True)
    rst = os.lstat(root)
    if rst.st_uid != 0 or not stat.S_ISDIR(rst.st_mode):
        raise OSError(f"scratch root {root} is not a root-owned directory")
    os.chmod(root, 0o711)
    path = root / f"job-{job_id}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    fd = os.open(path, _DIR_FLAGS)
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, 0o700)
    finally:
        os.close(fd)
    return path


def remove_path(path: Path) -> Removed:
    """Remove a file or a whole tree (no symlink followed); count what went."""
    out = Removed()
    try:
        parent = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return out
    except OSError as e:
        out.error(str(path.parent), e)
        return out
    try:
        _remove_entry(parent, path.name, out)
    finally:
        os.close(parent)
    return out


def _remove_entry(dir_fd: int, name: str, out: Removed) -> None:
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        out.error(name, e)
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_dir(dir_fd, name, st, out)
        return
    try:
        os.unlink(name, dir_fd=dir_fd)
        out.files += 1
        out.bytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
    except FileNotFoundError:
        pass
    except OSError as e:
        out.error(name, e)


def _remove_dir(dir_fd: int, name: str, st: os.stat_result, out: Removed) -> None:
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        out.error(name, e)
        return
    try:
        if os.fstat(fd).st_ino != st.st_ino:  # swapped between lstat and open
            out.error(name, OSError(0, "directory changed while being removed"))
            return
        os.fchmod(fd, 0o700)  # a tenant may have made its own dirs unwritable
        for entry in os.listdir(fd):
            _remove_entry(fd, entry, out)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
        out.dirs += 1
    except FileNotFoundError:
        pass
    except OSError as e:
        out.error(name, e)


def owned_entries(top: Path, uid: int) -> Iterator[Path]:
    """Top-most paths under ``top`` owned by ``uid`` (not descending into them), same filesystem.

    ``top`` itself is never yielded. Directories owned by others (e.g. a sticky
    shared dir) are searched too: a user may leave files anywhere it can write.
    """
    try:
        dev = os.lstat(top).st_dev
    except FileNotFoundError:
        return
    stack = [top]
    while stack:
        d = stack.pop()
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        for e in entries:
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid == uid:
                yield Path(e.path)
            elif stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                stack.append(Path(e.path))
