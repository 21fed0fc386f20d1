"""The gateway connection shared by every command group: the URL and token (environment or
`finetune login`'s saved credentials), one authenticated request (`call`), the error it
raises when the gateway does not answer, and the small output helpers the groups share."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import click
import httpx

from gateway.config import get_settings


def _credentials_path() -> Path:
    return get_settings().credentials_file.expanduser()


def connection() -> tuple[str, str]:
    """(base URL, token) from SFT_API_URL/SFT_API_TOKEN or `finetune login`."""
    s = get_settings()
    url, token = s.api_url, s.api_token
    if not (url and token):
        try:
            saved = json.loads(_credentials_path().read_text())
            url, token = url or saved["url"], token or saved["token"]
        except (OSError, ValueError, KeyError) as e:
            raise click.ClickException("not logged in: run `finetune login --url URL` (on a cluster host; "
                                       "elsewhere add --token to be asked for a token) or set SFT_API_URL "
                                       "and SFT_API_TOKEN") from e
    return url.rstrip("/"), token


class Unreachable(click.ClickException):
    """The gateway did not answer (connection refused, timeout): worth a retry."""


class ApiError(click.ClickException):
    """The gateway answered an error: its status and OpenAI's error object (``--json`` prints them)."""

    def __init__(self, status: int, error: dict[str, Any]):
        super().__init__(f"{status}: {error.get('message')}")
        self.status = status
        self.error = error


def _raise_for_status(r: httpx.Response) -> None:
    if r.status_code >= 400:
        try:
            error = dict(r.json()["error"])
        except (ValueError, KeyError, TypeError):
            error = {"message": r.text[:500], "type": None, "code": None, "param": None}
        raise ApiError(r.status_code, error)


def call(method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    """One request to the gateway. Raises ClickException with the server's message on
    an error status, Unreachable when the gateway does not answer."""
    url, token = connection()
    try:
        r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                          timeout=httpx.Timeout(600, connect=10), **kwargs)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach the gateway at {url}: {e}") from e
    _raise_for_status(r)
    return r


def saved_url() -> str | None:
    """The gateway URL `finetune login` saved, if any."""
    try:
        url = json.loads(_credentials_path().read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) else None


def save_credentials(url: str, token: str) -> Path:
    """Write what `finetune login` saves (0600, replaced atomically); return the file's path."""
    path = _credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
    os.replace(tmp, path)
    return path


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def _when(ts: int | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ") if ts else "-"
