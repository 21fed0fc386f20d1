"""Tenant-facing CLI commands: they talk to the gateway over HTTP, never to the DB.
`client` holds the connection (URL and token, saved credentials, one authenticated request);
`files`, `jobs`, `sweeps`, `artifacts` and `access` (login, tokens, staff, access, audit) hold the
command groups that `gateway.cli` mounts on `finetune`. The names other code uses are
re-exported here."""

from gateway.usercli.access import access, audit, login, staff, tokens
from gateway.usercli.artifacts import artifacts, extract_adapter
from gateway.usercli.client import Unreachable, call, connection, save_credentials, saved_url
from gateway.usercli.deletion import deletion
from gateway.usercli.files import files
from gateway.usercli.jobs import jobs, progress_line
from gateway.usercli.sweeps import sweeps
from gateway.usercli.webhooks import webhooks

__all__ = [
    "Unreachable", "access", "artifacts", "audit", "call", "connection", "extract_adapter", "files", "jobs",
    "deletion", "login", "progress_line", "save_credentials", "saved_url", "staff", "sweeps", "tokens", "webhooks",
]
