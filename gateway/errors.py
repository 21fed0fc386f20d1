"""The errors that cross layers: one module every part of the gateway may import.

It imports nothing from the project, so the storage client, the Slurm adapter,
the services and both front ends can raise and catch the same classes without
importing each other. Two families:

- :class:`ServiceError` and its subclasses: a request cannot be served. Each
  carries the HTTP ``status`` and OpenAI-style ``code`` it maps to; the API's
  and the portal's exception handlers turn them into answers, the CLIs into
  one line. Raise these for anything a tenant or operator can act on.
- :class:`SlurmError`: the base of everything ``gateway.slurm`` raises (command
  failures, unparsable output, policy and name refusals); the subclasses that
  carry Slurm's own text live beside the code that produces it.

Errors that never leave their module (a validation line, a broker verb, a
layout refusal, a version race) stay in that module. :func:`friendly_errors` is the one
mapping of both families to a command line's one-line error, shared by every command group
(``gateway.cli``, ``accounting.cli``) so none imports another for it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

import click


class ServiceError(Exception):
    """A request cannot be served; ``status`` is the HTTP status it maps to."""

    status = 400
    code = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        if code:
            self.code = code


class Unauthorized(ServiceError):
    """No token, or one that is unknown, revoked or expired."""

    status = 401
    code = "invalid_api_key"


class Forbidden(ServiceError):
    """The caller is known but its role or tenant may not do this."""

    status = 403
    code = "forbidden"


class CsrfRefused(Forbidden):
    """A portal form came without a valid CSRF token."""

    code = "csrf_failed"


class NotFound(ServiceError):
    """No such resource for this caller (a foreign tenant's id answers the same)."""

    status = 404
    code = "not_found"


class Conflict(ServiceError):
    """The resource's state does not allow the request (e.g. cancelling a finished job)."""

    status = 409
    code = "conflict"


class TooLarge(ServiceError):
    """The body is over a size limit."""

    status = 413
    code = "file_too_large"


class TooManyJobs(ServiceError):
    """A per-tenant limit on active jobs is reached."""

    status = 429
    code = "rate_limit_exceeded"


class BadSetting(ServiceError):
    """The site's configuration is wrong (an operator must fix it, not the caller)."""

    status = 500
    code = "bad_setting"


class ClusterError(ServiceError):
    """A Slurm command behind a cluster page failed; the message is the command's own error."""

    status = 502
    code = "slurm_error"


class StorageFull(ServiceError):
    """The tenant's storage has no room (ENOSPC / EDQUOT): nothing was kept; retry later."""

    status = 507
    code = "storage_full"


class QuotaExceeded(StorageFull):
    """The write would pass the tenant's storage quota (EDQUOT): nothing was kept."""

    code = "storage_quota_exceeded"


class StorageUnavailable(ServiceError):
    """The storage broker does not answer."""

    status = 503
    code = "storage_unavailable"


class StorageTampered(ServiceError):
    """Stored data was changed outside the gateway (a symlink, a foreign owner, a swapped file)."""

    status = 409
    code = "storage_tampered"


class StorageFailed(ServiceError):
    """The broker failed in a way the caller cannot fix."""

    status = 500
    code = "storage_error"


class SlurmError(Exception):
    """Base class of every error raised by ``gateway.slurm``."""


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our errors into one clear line and exit 1; never a stack trace."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (SlurmError, ServiceError, ValueError, KeyError) as e:
            raise click.ClickException(str(e).strip("'\"")) from e
    return wrapper
