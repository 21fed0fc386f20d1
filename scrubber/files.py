"""Scratch directories and a job user's files: create, measure, remove, find leftovers.

Everything below a top directory (``/tmp``, ``/dev/shm``, the scratch root) is
reached from that top's file descriptor, one name at a time (``dir_fd=``, each
directory opened ``O_NOFOLLOW|O_DIRECTORY``): no path string below the top is
ever resolved, so a symlink or a directory swapped in by a tenant (or by a
second uid working with it) between the scan and the removal cannot redirect
root's deletions outside the tree. The scan records each directory's identity
(device, inode) on the way to an entry; removal walks the same names again
and refuses to go on where one changed (counted as an error: the step fails,
the node drains). Before each unlink or rmdir the entry's owner is checked
(``stat(name, dir_fd=fd, follow_symlinks=False)``): only the job user's
entries go; foreign ones are counted and left alone.

What is left racy is harmless: between that owner check and the unlink, only
someone who can write the parent directory can swap the name, and unlinking a
name there is what they could do themselves.

Nothing here reads file contents; only names' metadata is used, and names are
never reported.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# The top itself (/tmp, /dev/shm: root's configured paths) is resolved as given: on some
# systems /dev/shm is a symlink to /run/shm. Nothing below it is resolved by path.
_TOP_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC

Ident = tuple[int, int]  # (st_dev, st_ino)


@dataclass
class Removed:
    files: int = 0  # non-directories unlinked
    dirs: int = 0
    bytes: int = 0  # st_size of the regular files unlinked
    foreign: int = 0  # entries not owned by the job user, found where its were: left alone
    errors: int = 0
    first_error: str = ""

    def add(self, other: Removed) -> None:
        """Add ``other``'s counts to these; the first error reason seen is kept."""
        self.files += other.files
        self.dirs += other.dirs
        self.bytes += other.bytes
        self.foreign += other.foreign
        self.errors += other.errors
        self.first_error = self.first_error or other.first_error

    def error(self, where: str, e: OSError) -> None:
        """Count an error; keep the first one's reason (never the file name: names are tenant data)."""
        del where  # kept at call sites for debugging with a breakpoint, never reported
        self.errors += 1
        if not self.first_error:
            self.first_error = e.strerror or type(e).__name__


def _changed() -> OSError:
    return OSError(errno.ESTALE, "a directory on the way changed since the scan (swapped?): "
                                 "not followed")


@dataclass(frozen=True)
class Found:
    """A top-most entry of the user, as the scan saw it: the names leading to it from the top
    directory (never joined into a path) and the identity each one had then."""
    names: tuple[str, ...]
    idents: tuple[Ident, ...]


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


# ------------------------------------------------------------------ removal
def remove_path(path: Path, uid: int) -> Removed:
    """Remove ``path`` (a file or a whole tree, no symlink followed) where ``uid`` owns it.

    ``path.parent`` must be root's (the scratch root): it is the top fd. Entries
    inside that ``uid`` does not own are left (counted in ``foreign``).
    """
    out = Removed()
    try:
        parent = os.open(path.parent, _DIR_FLAGS)
    except FileNotFoundError:
        return out
    except OSError as e:
        out.error(str(path.parent), e)
        return out
    try:
        _remove_entry(parent, os.fstat(parent).st_dev, path.name, uid, out)
    finally:
        os.close(parent)
    return out


def _no_pause(top: Path, found: list[Found]) -> None:
    del top, found


# Test hook: called by remove_owned between its scan and its removal (the race window).
_between_scan_and_remove: Callable[[Path, list[Found]], None] = _no_pause


def remove_owned(top: Path, uid: int) -> Removed:
    """Remove every top-most entry of ``uid`` below ``top`` (same filesystem), ``top`` kept.

    Scan and removal both work from one fd of ``top``; see the module docstring.
    """
    out = Removed()
    try:
        top_fd = os.open(top, _TOP_FLAGS)
    except FileNotFoundError:
        return out
    except OSError as e:
        out.error(str(top), e)
        return out
    try:
        found = _scan(top_fd, uid)
        _between_scan_and_remove(top, found)
        for f in found:
            _remove_found(top_fd, f, uid, out)
    finally:
        os.close(top_fd)
    return out


def _remove_found(top_fd: int, f: Found, uid: int, out: Removed) -> None:
    try:
        parent = _open_chain(top_fd, f.names[:-1], f.idents[:-1])
    except FileNotFoundError:
        return  # gone meanwhile; the verification scan finds it if it only moved
    except OSError as e:
        out.error(f.names[-1], e)
        return
    try:
        _remove_entry(parent, os.fstat(parent).st_dev, f.names[-1], uid, out, expect=f.idents[-1])
    finally:
        os.close(parent)


def _open_chain(top_fd: int, names: tuple[str, ...], idents: tuple[Ident, ...]) -> int:
    """A new fd of the directory ``names`` leads to from ``top_fd``, each step ``O_NOFOLLOW``
    and checked against the identity the scan saw. Raises FileNotFoundError when a name is
    gone, OSError(ESTALE) when one is now a symlink, a non-directory or another directory."""
    fd = os.dup(top_fd)
    try:
        for name, ident in zip(names, idents, strict=True):
            try:
                nfd = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise _changed() from e
                raise
            os.close(fd)
            fd = nfd
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ident:
                raise _changed()
    except BaseException:
        os.close(fd)
        raise
    return fd


def _remove_entry(dir_fd: int, dev: int, name: str, uid: int, out: Removed,
                  expect: Ident | None = None) -> None:
    """Remove ``name`` in ``dir_fd`` (a directory on device ``dev``) if ``uid`` owns it."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    except OSError as e:
        out.error(name, e)
        return
    if expect is not None and (st.st_dev, st.st_ino) != expect:
        out.error(name, _changed())
        return
    if st.st_uid != uid:
        out.foreign += 1
        return
    if stat.S_ISDIR(st.st_mode):
        _remove_dir(dir_fd, dev, name, st, uid, out)
        return
    try:
        os.unlink(name, dir_fd=dir_fd)
        out.files += 1
        out.bytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
    except FileNotFoundError:
        pass
    except OSError as e:
        out.error(name, e)


def _remove_dir(dir_fd: int, dev: int, name: str, st: os.stat_result, uid: int, out: Removed) -> None:
    if st.st_dev != dev:
        out.error(name, OSError(errno.EXDEV, "a mount point: not descended"))
        return
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as e:
        out.error(name, e)
        return
    kept = out.foreign + out.errors
    try:
        fst = os.fstat(fd)
        if (fst.st_dev, fst.st_ino) != (st.st_dev, st.st_ino) or fst.st_uid != uid:
            out.error(name, OSError(0, "directory changed while being removed"))
            return
        os.fchmod(fd, 0o700)  # the job user's own dir: it may have made it unwritable
        for entry in os.listdir(fd):
            _remove_entry(fd, dev, entry, uid, out)
    finally:
        os.close(fd)
    if out.foreign + out.errors > kept:
        return  # something inside stays, so does the directory (the verification counts it)
    try:
        os.rmdir(name, dir_fd=dir_fd)
        out.dirs += 1
    except FileNotFoundError:
        pass
    except OSError as e:
        out.error(name, e)


# --------------------------------------------------------------------- scan
def owned_entries(top: Path, uid: int) -> list[Found]:
    """Top-most entries below ``top`` owned by ``uid`` (not descending into them), same filesystem.

    ``top`` itself is never found. Directories owned by others (e.g. a sticky
    shared dir) are searched too: a user may leave files anywhere it can write.
    """
    try:
        top_fd = os.open(top, _TOP_FLAGS)
    except FileNotFoundError:
        return []
    try:
        return _scan(top_fd, uid)
    finally:
        os.close(top_fd)


def _scan(top_fd: int, uid: int) -> list[Found]:
    dev = os.fstat(top_fd).st_dev
    found: list[Found] = []
    stack: list[tuple[tuple[str, ...], tuple[Ident, ...]]] = [((), ())]
    while stack:  # iterative, one fd open at a time: a deep foreign tree exhausts neither
        names, idents = stack.pop()
        try:
            fd = _open_chain(top_fd, names, idents)
        except OSError:
            continue  # gone or changed since its parent was listed: not a place of the user's now
        try:
            entries = os.listdir(fd)
            for name in entries:
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except OSError:
                    continue
                ident = (st.st_dev, st.st_ino)
                if st.st_uid == uid:
                    found.append(Found(names + (name,), idents + (ident,)))
                elif stat.S_ISDIR(st.st_mode) and st.st_dev == dev:
                    stack.append((names + (name,), idents + (ident,)))
        except OSError:
            pass
        finally:
            os.close(fd)
    return found
