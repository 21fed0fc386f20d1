"""Runners: the only way slurm-finetune executes a command.

A runner takes an argv list (never a shell string), runs it locally or over
SSH, and returns ``CommandResult``. ``check`` raises ``SlurmCommandError``
carrying the command's own error text. Tenant names reach these commands, so
nothing here ever goes through a shell on the local side, and the SSH side
quotes every argument with ``shlex.join``.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from gateway.errors import SlurmError

DEFAULT_TIMEOUT_S = 60.0
# The one command the storage broker runs as a tenant (gateway.storage.TenantRunner, broker
# ``submit``): the batch script on stdin, no environment of the gateway's in the job.
TENANT_SBATCH = ("sbatch", "--parsable", "--export=NONE")


# Slurm's own words → what the user can do about them.
_HINTS: tuple[tuple[str, str], ...] = (
    ("QOSMaxWallDurationPerJobLimit",
     "the time limit exceeds the QOS tier's MaxWall: ask for less time or a larger tier"),
    ("QOSMaxGRESPerUser", "the tier's MaxTRESPerUser GPU limit is reached: ask for fewer GPUs"),
    ("QOSMaxSubmitJobPerUserLimit",
     "the tier's MaxSubmitJobsPerUser is reached: wait for queued jobs to finish"),
    ("Job violates accounting/QOS policy",
     "the job exceeds a limit of its QOS tier (MaxWall, GPUs per user or jobs per user)"),
    ("Invalid account or account/partition",
     "the submitting user does not belong to that account: submit under your own tenant"),
    ("Invalid qos specification", "the tenant's account is not allowed that QOS tier"),
    ("Invalid --uid specification", "the tenant's unix user does not exist on this host"),
    ("Unable to contact slurm controller", "slurmctld is not answering: retry later"),
)


def explain(message: str) -> str:
    """An actionable hint for a known Slurm error message, or ``""``."""
    return next((hint for key, hint in _HINTS if key in message), "")


class SlurmCommandError(SlurmError):
    """A command failed; ``message`` is the command's own error text, ``hint`` what to do."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, stdout: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.stdout = stdout.strip()
        self.message = self.stderr or self.stdout or f"exit status {returncode}"
        self.hint = explain(self.message)
        text = f"{argv[0]} failed (exit {returncode}): {self.message}"
        super().__init__(f"{text} ({self.hint})" if self.hint else text)


class SlurmTimeoutError(SlurmCommandError):
    """A command ran past its timeout and was killed."""


@dataclass(frozen=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    def check(self) -> CommandResult:
        """Return self when the command succeeded; raise SlurmCommandError otherwise."""
        if self.returncode != 0:
            raise SlurmCommandError(self.argv, self.returncode, self.stderr, self.stdout)
        return self


class Runner(Protocol):
    """Anything that runs an argv list and returns a CommandResult."""

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``argv`` (never through a shell) and return its result; a non-zero exit is not raised (``check()``)."""
        ...


def _validate_argv(argv: Sequence[str]) -> tuple[str, ...]:
    if isinstance(argv, str) or not argv:
        raise TypeError("argv must be a non-empty list of strings, never a shell string")
    if not all(isinstance(a, str) for a in argv):
        raise TypeError(f"every argv element must be a str: {argv!r}")
    return tuple(argv)


class LocalRunner:
    """Runs commands on this host with subprocess (no shell)."""

    def __init__(self, log: list[tuple[str, ...]] | None = None):
        # Every argv run is appended here when given: tests count calls with it.
        self.log = log

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``argv`` here; SlurmTimeoutError past ``timeout``, SlurmCommandError (127) when it is not found."""
        args = _validate_argv(argv)
        if self.log is not None:
            self.log.append(args)
        start = time.monotonic()
        try:
            proc = subprocess.run(  # noqa: S603 - argv list, no shell
                args,
                input=input,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=dict(env) if env is not None else None,
                check=False,
            )
        except subprocess.TimeoutExpired as e:
            raise SlurmTimeoutError(args, -9, f"timed out after {timeout:g}s") from e
        except FileNotFoundError as e:
            raise SlurmCommandError(args, 127, f"command not found: {args[0]}") from e
        return CommandResult(args, proc.returncode, proc.stdout, proc.stderr,
                             time.monotonic() - start)


@dataclass(frozen=True)
class SSHTarget:
    host: str
    user: str
    key_file: Path
    port: int = 22
    known_hosts: Path | None = None  # None: ~/.ssh/known_hosts of the gateway user


class SSHRunner:
    """Runs commands on a Slurm login node over SSH (paramiko).

    Key authentication only; the host key must already be known (RejectPolicy):
    a gateway that silently trusts a new host key would hand tenant job
    submissions to whoever answers on that address.
    """

    def __init__(self, target: SSHTarget, log: list[tuple[str, ...]] | None = None):
        self.target = target
        self.log = log
        self._client = None

    def _connect(self):  # type: ignore[no-untyped-def]
        import paramiko

        if self._client is not None and self._client.get_transport() is not None \
                and self._client.get_transport().is_active():
            return self._client
        client = paramiko.SSHClient()
        if self.target.known_hosts is not None:
            client.load_host_keys(str(self.target.known_hosts))
        else:
            client.load_system_host_keys()
        client.set_missing_host_key_policy(paramiko.RejectPolicy())
        try:
            client.connect(
                self.target.host,
                port=self.target.port,
                username=self.target.user,
                key_filename=str(self.target.key_file),
                allow_agent=False,
                look_for_keys=False,
                timeout=15,
            )
        except (paramiko.SSHException, OSError) as e:
            raise SlurmCommandError(("ssh", self.target.host), 255, f"ssh connection failed: {e}") from e
        self._client = client
        return client

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        input: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> CommandResult:
        """Run ``argv`` on the login node (``env`` as an ``env K=V`` prefix); SlurmTimeoutError past ``timeout``."""
        args = _validate_argv(argv)
        if self.log is not None:
            self.log.append(args)
        command = shlex.join(args)
        if env:
            command = shlex.join(["env", *(f"{k}={v}" for k, v in env.items()), *args])
        client = self._connect()
        start = time.monotonic()
        try:
            stdin, stdout, stderr = client.exec_command(command, timeout=timeout)
            if input is not None:
                stdin.write(input)
            stdin.channel.shutdown_write()
            out = stdout.read().decode()
            err = stderr.read().decode()
            rc = stdout.channel.recv_exit_status()
        except TimeoutError as e:  # socket.timeout is TimeoutError on 3.10+
            raise SlurmTimeoutError(args, -9, f"timed out after {timeout:g}s over ssh") from e
        return CommandResult(args, rc, out, err, time.monotonic() - start)

    def close(self) -> None:
        """Close the SSH connection; the next ``run`` opens a new one."""
        if self._client is not None:
            self._client.close()
            self._client = None
