"""The reserved identities: which unix accounts may act as a tenant, and the registry that says so.

``finetune admin tenant add`` makes each tenant's unix user (``sft-<tenant>``) and records it, as
``name uid gid`` lines, in ``TENANT_USERS``: a root-owned file (0644, in a root-owned directory,
written atomically) that the storage broker reads before it becomes anyone. An account is a tenant's
when the registry holds it with the same uid and gid; root (uid or gid 0), the users the broker
serves (the gateway's service user) and the static system range (uids 0-99, Debian's base-passwd
accounts) never are, whatever the registry says. So a tenant named after an existing account (say
``gateway``, whose ``sft-gateway`` owns the database and the audit key) can never run as it.

An account an earlier version made (before the registry existed) is accepted, by the broker and by
``tenant add`` (which records it, with a notice), only when it looks exactly like one ``tenant add``
makes (``legacy_mismatch``: home the tenant root, shell, own group, system uid): an upgrade needs no
step, and an account someone else made never passes. Stdlib only: the broker imports it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import re
import secrets
import stat
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

TENANT_USERS = Path("/var/lib/slurm-finetune/tenant-users")
STATIC_UID_MAX = 99              # Debian's static allocation (base-passwd): never a tenant
SYSTEM_UID_MAX = 999             # useradd --system allocates below this (login.defs SYS_UID_MAX)
TENANT_SHELL = "/bin/bash"       # what tenant add gives a tenant's user
MAX_REGISTRY_BYTES = 4 << 20
_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
_HEADER = ("# unix users made by `finetune admin tenant add`: name uid gid (root-owned; the storage\n"
           "# broker acts only as these; edit with care)\n")


class RegistryError(ValueError):
    """The registry file is unsafe to trust (a link, not root's, writable by others) or unreadable."""


@dataclass(frozen=True)
class Entry:
    """One account ``tenant add`` made: its name, uid and primary gid."""

    name: str
    uid: int
    gid: int


# ------------------------------------------------------------------ the file
def parse(text: str) -> dict[str, Entry]:
    """The entries of a registry's text by name; comments, blank and malformed lines are skipped
    (a line that does not parse grants nothing), a later line for a name replaces an earlier one."""
    out: dict[str, Entry] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 3 or not _USER.fullmatch(fields[0]) \
                or not all(f.isascii() and f.isdigit() and len(f) <= 10 for f in fields[1:]):
            continue
        out[fields[0]] = Entry(fields[0], int(fields[1]), int(fields[2]))
    return out


def render(entries: Collection[Entry], header: str = _HEADER) -> str:
    """The registry text of ``entries`` (a header comment, then one ``name uid gid`` line each)."""
    return header + "".join(f"{e.name} {e.uid} {e.gid}\n" for e in entries)


def _check_dir(fd: int, path: Path, owner: int) -> None:
    st = os.fstat(fd)
    if st.st_uid != owner or st.st_mode & 0o022:
        raise RegistryError(f"{path} must be a directory owned by uid {owner} that no one else may "
                            f"write (it is uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}): fix it "
                            "(scripts/bootstrap.sh makes it root's, 0755)")


def _open_dir(path: Path, owner: int) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise RegistryError(f"cannot open {path} ({e.strerror}): it must be a real directory, "
                            "not a link") from None
    try:
        _check_dir(fd, path, owner)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_at(dir_fd: int, path: Path, owner: int) -> dict[str, Entry]:
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return {}
    except OSError as e:
        what = "a link" if e.errno == errno.ELOOP else e.strerror
        raise RegistryError(f"refusing the tenant user registry {path}: {what}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_mode & 0o022 or st.st_nlink != 1:
            raise RegistryError(f"refusing the tenant user registry {path}: it must be a regular file "
                                f"owned by uid {owner}, writable only by its owner, with no other link")
        data = b""
        while len(data) <= MAX_REGISTRY_BYTES and (chunk := os.read(fd, 1 << 16)):
            data += chunk
        if len(data) > MAX_REGISTRY_BYTES:
            raise RegistryError(f"refusing the tenant user registry {path}: over {MAX_REGISTRY_BYTES} bytes")
        return parse(data.decode("utf-8", errors="replace"))
    finally:
        os.close(fd)


def read(path: Path = TENANT_USERS, *, owner: int = 0) -> dict[str, Entry]:
    """The registry's entries by name; {} when the file (or its directory) does not exist yet.
    Raises RegistryError when the file or its directory is not ``owner``'s alone or is a link."""
    try:
        dfd = _open_dir(path.parent, owner)
    except RegistryError:
        if not os.path.lexists(path.parent):
            return {}
        raise
    try:
        return _read_at(dfd, path, owner)
    finally:
        os.close(dfd)


def record(entry: Entry, path: Path = TENANT_USERS, *, owner: int = 0) -> None:
    """Add ``entry`` to the registry (replacing a line of the same name), atomically: a temp file in
    the same directory, fsync, rename, fsync the directory; concurrent callers take turns (flock on
    the directory). The file is 0644, owned by the caller (root). RegistryError as ``read``."""
    if not _USER.fullmatch(entry.name) or min(entry.uid, entry.gid) < 0:
        raise ValueError(f"not a registry entry: {entry!r}")

    def add(entries: dict[str, Entry]) -> None:
        entries.pop(entry.name, None)
        entries[entry.name] = entry

    _rewrite(path, owner, add, _RETIRED_HEADER if path.name.endswith(RETIRED_SUFFIX) else _HEADER)


def forget(name: str, path: Path = TENANT_USERS, *, owner: int = 0) -> Entry | None:
    """Remove ``name``'s line from the registry (a deleted tenant's user: the broker never acts as
    it again), atomically as ``record``; returns the entry it held, None when it held none (the file
    is then left as it is). RegistryError as ``read``."""
    if not _USER.fullmatch(name):
        raise ValueError(f"not a unix user name: {name!r}")
    if name not in read(path, owner=owner):
        return None
    gone: dict[str, Entry] = {}

    def drop(entries: dict[str, Entry]) -> None:
        if name in entries:
            gone[name] = entries.pop(name)

    _rewrite(path, owner, drop, _HEADER)
    return gone.get(name)


RETIRED_SUFFIX = ".retired"
_RETIRED_HEADER = ("# unix users of deleted tenants: name uid gid (root-owned). These ids are never given to\n"
                   "# a new tenant (files and Slurm job records of the old one may still carry them); this\n"
                   "# file grants nothing\n")


def retired_path(registry: Path = TENANT_USERS) -> Path:
    """The file beside ``registry`` that lists deleted tenants' users (``tenant-users.retired``)."""
    return registry.with_name(registry.name + RETIRED_SUFFIX)


def retire(entry: Entry, registry: Path = TENANT_USERS, *, owner: int = 0) -> None:
    """Add a deleted tenant's user to the retired list beside ``registry``, one line per (user, uid):
    named ``<user>_<uid>`` there, so a name deleted twice keeps both ids. RegistryError as ``read``."""
    record(Entry(f"{entry.name[:21]}_{entry.uid}", entry.uid, entry.gid), retired_path(registry), owner=owner)


def free_system_id(taken: Collection[int]) -> int:
    """The highest id in the system range (``STATIC_UID_MAX`` < id <= ``SYSTEM_UID_MAX``, where
    ``useradd --system`` allocates) not in ``taken``; ValueError when every one is."""
    for n in range(SYSTEM_UID_MAX, STATIC_UID_MAX, -1):
        if n not in taken:
            return n
    raise ValueError(f"no free system uid/gid left in {STATIC_UID_MAX + 1}-{SYSTEM_UID_MAX}")


def _rewrite(path: Path, owner: int, change: Callable[[dict[str, Entry]], None], header: str) -> None:
    """Apply ``change`` to the entries of ``path`` and write them back atomically, under the flock."""
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    dfd = _open_dir(path.parent, owner)
    try:
        fcntl.flock(dfd, fcntl.LOCK_EX)
        entries = _read_at(dfd, path, owner)
        change(entries)
        tmp = f".{path.name}.{secrets.token_hex(6)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                     dir_fd=dfd)
        try:
            try:
                os.fchmod(fd, 0o644)
                data = render(entries.values(), header).encode()
                while data:
                    data = data[os.write(fd, data):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path.name, src_dir_fd=dfd, dst_dir_fd=dfd)
        except BaseException:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except FileNotFoundError:
                pass
            raise
        os.fsync(dfd)
    finally:
        os.close(dfd)


# ----------------------------------------------------------------- the rules
def forbidden(pw: pwd.struct_passwd, *, reserved_uids: Collection[int] = (),
              reserved_gids: Collection[int] = ()) -> str | None:
    """Why ``pw`` can never be a tenant's account, whatever the registry says (None when it may be):
    root's uid or gid, a reserved id (the gateway's service user: the broker's allowed peers), or a
    uid in the static system range."""
    if pw.pw_uid == 0 or pw.pw_gid == 0:
        return f"unix user {pw.pw_name} has uid {pw.pw_uid} / gid {pw.pw_gid}: root's, never a tenant's"
    if pw.pw_uid in reserved_uids or pw.pw_gid in reserved_gids:
        return (f"unix user {pw.pw_name} (uid {pw.pw_uid}, gid {pw.pw_gid}) is the gateway's service "
                "identity: it owns the database and the audit key, and no tenant may act as it")
    if pw.pw_uid <= STATIC_UID_MAX:
        return (f"unix user {pw.pw_name} has uid {pw.pw_uid}, in the static system range "
                f"0-{STATIC_UID_MAX} (the distribution's own accounts), never a tenant's")
    return None


def refusal(pw: pwd.struct_passwd, registry: Mapping[str, Entry], *, home: Path, group: str | None,
            reserved_uids: Collection[int] = (), reserved_gids: Collection[int] = (),
            where: Path = TENANT_USERS) -> str | None:
    """The one rule, the broker's and ``tenant add``'s: why ``pw`` must not be the account of the
    tenant whose root is ``home`` (``group``: the name of ``pw``'s primary group), or None when it
    is: never ``forbidden``; else the registry's entry when it holds the name (same uid and gid),
    or, for an account made before the registry existed, one that looks exactly like those
    ``tenant add`` makes (``legacy_mismatch``)."""
    why = forbidden(pw, reserved_uids=reserved_uids, reserved_gids=reserved_gids)
    if why:
        return why
    entry = registry.get(pw.pw_name)
    if entry is not None:
        if (entry.uid, entry.gid) == (pw.pw_uid, pw.pw_gid):
            return None
        return (f"unix user {pw.pw_name} is now uid {pw.pw_uid} / gid {pw.pw_gid} but {where} recorded "
                f"uid {entry.uid} / gid {entry.gid}: the account was replaced, and the new one is not "
                "the one `finetune admin tenant add` made")
    mismatch = legacy_mismatch(pw, home=home, group=group)
    if mismatch:
        return (f"unix user {pw.pw_name} (uid {pw.pw_uid}) exists but slurm-finetune did not make it: "
                f"it is not in {where}, the registry of the users `finetune admin tenant add` made, "
                f"and {mismatch}")
    return None


def legacy_mismatch(pw: pwd.struct_passwd, *, home: Path, group: str | None) -> str | None:
    """Why ``pw`` (an existing account the registry does not hold) does not look like one an earlier
    ``tenant add`` made, or None when it does: home the tenant root ``home``, shell ``TENANT_SHELL``,
    primary group of its own name (``group``: that group's name), a system uid (``useradd --system``)."""
    if pw.pw_dir != str(home):
        return f"its home is {pw.pw_dir or '(none)'}, not the tenant root {home}"
    if pw.pw_shell != TENANT_SHELL:
        return f"its shell is {pw.pw_shell or '(none)'}, not {TENANT_SHELL}"
    if group != pw.pw_name:
        return f"its primary group is {group or pw.pw_gid}, not {pw.pw_name}"
    if not STATIC_UID_MAX < pw.pw_uid <= SYSTEM_UID_MAX:
        return f"its uid {pw.pw_uid} is not a system uid ({STATIC_UID_MAX + 1}-{SYSTEM_UID_MAX})"
    return None
