"""File-descriptor primitives that never follow a link and never leave a root.

Every open walks from a directory fd one component at a time with
``O_NOFOLLOW`` (directories also ``O_DIRECTORY``), so a symlink anywhere on the
way is refused (``ELOOP``/``ENOTDIR``) instead of followed, and each directory is
``fstat``-checked to be owned by the effective uid (the tenant, once the broker
has switched to it). Files are opened ``O_NONBLOCK`` (a planted FIFO cannot hang
the caller) and then checked: a regular file, owned by the effective uid, of the
expected size. These run inside the storage broker's per-request process.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeStorage(OSError):
    """Something in tenant storage is not what the layout says (a link, a FIFO, a foreign
    owner, a wrong size). The message never names more than the layout's own parts."""


def _refuse(what: str, why: str) -> UnsafeStorage:
    return UnsafeStorage(errno.EPERM, f"{what}: {why}")


def check_dir_fd(fd: int, what: str) -> os.stat_result:
    """fstat of ``fd``; UnsafeStorage unless it is a directory owned by the effective uid."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(what, "not a directory")
    if st.st_uid != os.geteuid():
        raise _refuse(what, "not owned by the tenant")
    return st


def open_dir(base_fd: int, parts: tuple[str, ...], *, create: bool = False, mode: int = 0o700) -> int:
    """A new fd for the directory ``parts`` beneath ``base_fd``; ``create`` makes missing ones."""
    fd = os.dup(base_fd)
    try:
        for i, name in enumerate(parts):
            what = "/".join(parts[:i + 1])
            try:
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                except FileExistsError:
                    pass
                nfd = os.open(name, DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _refuse(what, "a link or not a directory") from None
                raise
            os.close(fd)
            fd = nfd
            check_dir_fd(fd, what)
        return fd
    except BaseException:
        os.close(fd)
        raise


def check_file_fd(fd: int, what: str, *, size: int | None = None, max_size: int | None = None) -> os.stat_result:
    """fstat of ``fd``; UnsafeStorage unless it is a regular file of the effective uid with exactly
    ``size`` (when given) and at most ``max_size`` bytes."""
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse(what, "not a regular file")
    if st.st_uid != os.geteuid():
        raise _refuse(what, "not owned by the tenant")
    if size is not None and st.st_size != size:
        raise _refuse(what, f"has {st.st_size} bytes, {size} were recorded")
    if max_size is not None and st.st_size > max_size:
        raise _refuse(what, f"is larger than {max_size} bytes")
    return st


def open_file(dir_fd: int, name: str, what: str, *, size: int | None = None,
              max_size: int | None = None) -> int:
    """Open ``name`` in ``dir_fd`` for reading, no-follow, checked (see module doc)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY,
                     dir_fd=dir_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO):
            raise _refuse(what, "a link or not a regular file") from None
        raise
    try:
        check_file_fd(fd, what, size=size, max_size=max_size)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_path(base_fd: int, parts: tuple[str, ...], *, size: int | None = None,
              max_size: int | None = None) -> int:
    """``open_dir`` for all but the last component, then ``open_file``."""
    dfd = open_dir(base_fd, parts[:-1])
    try:
        return open_file(dfd, parts[-1], "/".join(parts), size=size, max_size=max_size)
    finally:
        os.close(dfd)


def read_fd(fd: int, limit: int) -> bytes:
    """Up to ``limit`` bytes from ``fd``'s current offset."""
    chunks, left = [], limit
    while left > 0:
        b = os.read(fd, min(left, 1 << 20))
        if not b:
            break
        chunks.append(b)
        left -= len(b)
    return b"".join(chunks)


def write_all(fd: int, data: bytes) -> None:
    """os.write may write less than asked (a filling disk): loop until all is written."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(dir_fd: int, name: str, data: bytes, *, mode: int = 0o600) -> None:
    """temp name, fsync, rename over ``name``, fsync the directory: readers see old or new."""
    tmp = f".{name}.{os.getpid()}.tmp"
    try:
        os.unlink(tmp, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode,
                 dir_fd=dir_fd)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    os.fsync(dir_fd)


def own_dir(path: str | os.PathLike[str], uid: int, gid: int, mode: int) -> None:
    """Root's way to make ``path`` a directory of ``uid`` with ``mode``: created if missing, then
    opened ``O_NOFOLLOW|O_DIRECTORY`` and changed through that fd, so a link swapped in by
    whoever owns the parent is refused instead of followed (``chmod``/``chown`` by path would)."""
    try:
        os.mkdir(path, mode)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refuse(str(path), "a link or not a directory") from None
        raise
    try:
        os.fchown(fd, uid, gid)
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def remove(dir_fd: int, name: str) -> bool:
    """Remove ``name`` (a file, a link, or a whole tree: fd-based, never following links)."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, dir_fd=dir_fd)   # the fd-based, symlink-safe variant on Linux
    else:
        os.unlink(name, dir_fd=dir_fd)
    return True


def tree_bytes(dir_fd: int, name: str) -> int:
    """The bytes of the regular files at ``name`` (a file, or a whole tree walked by fd, never following a
    link; a file linked twice counted once): what removing it frees. 0 for a link or a missing name."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return 0
    if stat.S_ISREG(st.st_mode):
        return st.st_size
    if not stat.S_ISDIR(st.st_mode):
        return 0
    seen: set[tuple[int, int]] = set()
    total = 0
    for _, _, files, fd in os.fwalk(name, dir_fd=dir_fd, follow_symlinks=False):
        for f in files:
            try:
                fst = os.stat(f, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(fst.st_mode) and (fst.st_dev, fst.st_ino) not in seen:
                seen.add((fst.st_dev, fst.st_ino))
                total += fst.st_size
    return total


def remove_measured(dir_fd: int, name: str) -> int | None:
    """``remove``, and the bytes that freed (``tree_bytes`` just before); None when ``name`` did not exist."""
    size = tree_bytes(dir_fd, name)
    return size if remove(dir_fd, name) else None
