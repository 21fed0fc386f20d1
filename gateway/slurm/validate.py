"""Validation of names that reach Slurm and unix commands. Pure functions.

Tenant names become Slurm account names, unix user/group names and directory
names, so they are held to the intersection of what all three accept, checked
before any command runs.
"""

from __future__ import annotations

import re

from gateway.errors import SlurmError

TENANT_RE = re.compile(r"^[a-z][a-z0-9_-]{1,23}$")
_UNIX_RE = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")
_QOS_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")


class InvalidNameError(SlurmError, ValueError):
    """A name would be unsafe or invalid as a Slurm account, unix user or path."""


def validate_tenant_name(name: str) -> str:
    """Return ``name`` if it is a valid tenant name; raise InvalidNameError naming the rule."""
    if not isinstance(name, str) or not TENANT_RE.fullmatch(name):
        raise InvalidNameError(
            f"invalid tenant name {name!r}: use 2-24 characters, lowercase letters, digits, "
            "'-' or '_', starting with a letter (it becomes a Slurm account, a unix user "
            "and a directory name, so spaces, '..', '/' and shell characters are refused)"
        )
    return name


def validate_unix_name(name: str) -> str:
    """Return ``name`` if valid as a unix user/group or Slurm account; raise otherwise."""
    if not isinstance(name, str) or not _UNIX_RE.fullmatch(name):
        raise InvalidNameError(f"invalid user, group or account name {name!r}")
    return name


def validate_qos_name(name: str) -> str:
    """Return ``name`` if valid as a QOS name; raise InvalidNameError otherwise."""
    if not isinstance(name, str) or not _QOS_RE.fullmatch(name):
        raise InvalidNameError(
            f"invalid QOS name {name!r}: lowercase letters, digits, '-' or '_', "
            "starting with a letter, at most 32 characters"
        )
    return name


_JOB_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def validate_job_name(name: str) -> str:
    """A job name the gateway gives (a job or sweep id): letters, digits and ._- only; ValueError otherwise."""
    if not isinstance(name, str) or not _JOB_NAME_RE.fullmatch(name):
        raise ValueError(f"invalid job name: {name!r}")
    return name
