"""What every ``finetune`` command group shares (``gateway.cli``, ``accounting.cli``): one
place both import, so neither command module imports the other to get it."""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

import click

from gateway.errors import ServiceError, SlurmError


def friendly_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn our errors into one clear line and exit 1; never a stack trace."""
    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (SlurmError, ServiceError, ValueError, KeyError) as e:
            raise click.ClickException(str(e).strip("'\"")) from e
    return wrapper
