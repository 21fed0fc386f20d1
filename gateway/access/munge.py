"""MUNGE credentials through libmunge (ctypes): how a cluster host proves who a local user is.

MUNGE is what Slurm itself trusts on every host: ``munged`` encodes a credential naming the
calling process's uid and gid, sealed under the cluster's shared key, with a time to live; any
host with the same key decodes it, and its ``munged`` refuses one that has expired, has been
decoded before (its replay cache) or was made under another key. Nothing here runs a process:
the library talks to the local ``munged`` over its unix socket.

The CLI's ``finetune login`` encodes a payload binding the credential to one gateway URL and a
fresh nonce (``login_payload``); the gateway decodes it (``decode``) and checks the binding, the
lifetime and the nonce itself (``gateway.access.signin``): a second gateway host has its own
replay cache, the database's nonce table is shared.
"""

from __future__ import annotations

import ctypes
import json
import secrets
from dataclasses import dataclass
from typing import Any

LIBRARY = "libmunge.so.2"
DEFAULT_TTL_S = 60           # what the CLI asks for: enough to reach the gateway, not to be reused later
MAX_TTL_S = 300              # what the gateway accepts
AUDIENCE = "slurm-finetune login"

# munge.h: munge_opt_t and munge_err_t (the ABI is stable since MUNGE 0.5)
_OPT_TTL, _OPT_ENCODE_TIME, _OPT_SOCKET = 4, 6, 8
REASONS = {                  # munge_err_t -> what a user is told (the library's own text follows)
    6: "munged does not answer on this host",
    8: "the credential is malformed",
    11: "the credential was made under another MUNGE key (another cluster)",
    13: "the credential was made in another MUNGE realm",
    14: "the credential is invalid (made under another key, or altered)",
    15: "the credential has expired",
    16: "the credential was made in the future (clock skew)",
    17: "the credential was already used (replayed)",
    18: "the credential is restricted to another user",
}


# refusals of a credential munged could open (made under this cluster's key): worth an audit entry
SEALED = frozenset({15, 16, 17, 18})


class MungeError(Exception):
    """libmunge refused: ``code`` is munge_err_t, ``message`` what to tell the user."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Credential:
    """A decoded credential: who made it (uid, gid: as munged saw the process), when, for how long."""

    uid: int
    gid: int
    payload: bytes
    encode_time: int
    ttl: int


_lib: Any = None


def _library() -> Any:
    global _lib
    if _lib is None:
        try:
            lib = ctypes.CDLL(LIBRARY, use_errno=True)
        except OSError as e:
            raise MungeError(6, f"MUNGE is not installed on this host ({LIBRARY}: {e})") from e
        lib.munge_ctx_create.restype = ctypes.c_void_p
        lib.munge_ctx_destroy.argtypes = [ctypes.c_void_p]
        lib.munge_ctx_strerror.restype = ctypes.c_char_p
        lib.munge_ctx_strerror.argtypes = [ctypes.c_void_p]
        lib.munge_strerror.restype = ctypes.c_char_p
        lib.munge_strerror.argtypes = [ctypes.c_int]
        lib.munge_encode.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_char_p,
                                     ctypes.c_int]
        lib.munge_decode.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                                     ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint),
                                     ctypes.POINTER(ctypes.c_uint)]
        _lib = lib
    return _lib


def _context(lib: Any, socket: str | None) -> Any:
    ctx = lib.munge_ctx_create()
    if not ctx:
        raise MungeError(5, "libmunge could not allocate a context")
    if socket is not None:
        lib.munge_ctx_set(ctypes.c_void_p(ctx), _OPT_SOCKET, ctypes.c_char_p(socket.encode()))
    return ctx


def _error(lib: Any, ctx: Any, code: int) -> MungeError:
    detail = (lib.munge_ctx_strerror(ctypes.c_void_p(ctx)) or lib.munge_strerror(code) or b"").decode(errors="replace")
    reason = REASONS.get(code, "MUNGE refused the credential")
    return MungeError(code, f"{reason} ({detail})" if detail else reason)


def encode(payload: bytes, *, ttl: int = DEFAULT_TTL_S, socket: str | None = None) -> str:
    """A credential for this process's uid carrying ``payload``, valid ``ttl`` seconds."""
    lib = _library()
    ctx = _context(lib, socket)
    try:
        lib.munge_ctx_set(ctypes.c_void_p(ctx), _OPT_TTL, ctypes.c_int(ttl))
        out = ctypes.c_char_p()
        code = lib.munge_encode(ctypes.byref(out), ctypes.c_void_p(ctx), payload, len(payload))
        if code != 0:
            raise _error(lib, ctx, code)
        return (out.value or b"").decode()
    finally:
        lib.munge_ctx_destroy(ctypes.c_void_p(ctx))


def decode(credential: str, *, socket: str | None = None) -> Credential:
    """Decode ``credential`` with the local munged; MungeError when it refuses (expired,
    replayed, another key...). The payload is copied out and the library's buffer freed."""
    lib = _library()
    libc = ctypes.CDLL(None)
    ctx = _context(lib, socket)
    buf, length = ctypes.c_void_p(), ctypes.c_int()
    uid, gid = ctypes.c_uint(), ctypes.c_uint()
    try:
        code = lib.munge_decode(credential.encode("ascii", errors="replace"), ctypes.c_void_p(ctx),
                                ctypes.byref(buf), ctypes.byref(length), ctypes.byref(uid), ctypes.byref(gid))
        payload = ctypes.string_at(buf, length.value) if buf.value else b""
        if buf.value:
            libc.free(buf)
        if code != 0:
            raise _error(lib, ctx, code)
        encoded, ttl = ctypes.c_long(), ctypes.c_int()
        lib.munge_ctx_get(ctypes.c_void_p(ctx), _OPT_ENCODE_TIME, ctypes.byref(encoded))
        lib.munge_ctx_get(ctypes.c_void_p(ctx), _OPT_TTL, ctypes.byref(ttl))
        return Credential(uid.value, gid.value, payload, encoded.value, ttl.value)
    finally:
        lib.munge_ctx_destroy(ctypes.c_void_p(ctx))


def login_payload(url: str, tenant: str | None = None) -> bytes:
    """What ``finetune login`` seals: this credential is for signing in at ``url``, once."""
    return json.dumps({"aud": AUDIENCE, "url": url.rstrip("/"), "nonce": secrets.token_urlsafe(24),
                       "tenant": tenant}, separators=(",", ":")).encode()
