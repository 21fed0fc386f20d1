"""Secrets a tenant hands the gateway for a third party (an MLflow server's token or password), kept
encrypted at rest: Fernet (AES-128-CBC + HMAC-SHA256, from ``cryptography``) with a key file in the
gateway's state dir (``integration_key_file``: 0600, made on first use and linked into place
atomically, so gateways sharing a database and a state dir agree). The database alone never holds
a usable credential; losing the key file makes the stored ones unreadable (``Unavailable``), never
readable by someone else.
"""

from __future__ import annotations

import os
import secrets
import threading
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

_lock = threading.Lock()
_keys: dict[Path, bytes] = {}


class Unavailable(Exception):
    """The key file is missing, unreadable, readable by others, or not the key a secret was sealed with."""


def _read(path: Path) -> bytes:
    st = path.stat()
    if st.st_mode & 0o077:
        raise Unavailable(f"integration key file {path} is readable by others (mode {st.st_mode & 0o777:o}): "
                          "chmod 600 it")
    key = path.read_bytes().strip()
    try:
        Fernet(key)
    except ValueError as e:
        raise Unavailable(f"integration key file {path} does not hold a Fernet key") from e
    return key


def _create(path: Path) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(Fernet.generate_key())
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)       # another process won the race: its key is the one
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def key(path: Path, *, create: bool = False) -> bytes:
    """The Fernet key in ``path`` (cached per process); with ``create``, made when there is none.
    Raises Unavailable saying what is wrong with the file."""
    with _lock:
        if path in _keys:
            return _keys[path]
        try:
            if create and not path.exists():
                _create(path)
            _keys[path] = _read(path)
        except OSError as e:
            raise Unavailable(f"cannot use the integration key file {path}: {e.strerror or e}") from e
        return _keys[path]


def seal(path: Path, plaintext: str) -> str:
    """``plaintext`` encrypted with the key in ``path`` (made on first use); Unavailable as ``key``."""
    return Fernet(key(path, create=True)).encrypt(plaintext.encode()).decode()


def unseal(path: Path, token: str) -> str:
    """What ``seal`` sealed; Unavailable when the key file is gone or is not the one it was sealed with."""
    try:
        return Fernet(key(path)).decrypt(token.encode()).decode()
    except InvalidToken as e:
        raise Unavailable(f"a stored credential does not decrypt with {path}: was the key file replaced?") from e
