"""Service functions: every database write goes through here (keyword-only ``session``)."""


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


class NotFound(ServiceError):
    status = 404
    code = "not_found"


class Conflict(ServiceError):
    status = 409
    code = "conflict"


class Forbidden(ServiceError):
    status = 403
    code = "forbidden"


class TooLarge(ServiceError):
    status = 413
    code = "file_too_large"


class StorageFull(ServiceError):
    """The tenant's storage has no room (ENOSPC / EDQUOT): nothing was kept; retry later."""

    status = 507
    code = "storage_full"
