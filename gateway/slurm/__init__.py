"""The scheduler adapters: what runs a job, behind one protocol (``scheduler.Scheduler``).

``client.SlurmClient`` is the cluster, ``local.LocalScheduler`` local mode (no Slurm); the
only package that builds Slurm command lines (``runner`` runs them; ``records`` parses what
they print; ``render`` writes the batch script; ``admin`` and ``policy`` are sacctmgr's side).
"""

from gateway.config import Settings, get_settings
from gateway.errors import SlurmError
from gateway.slurm.client import CancelResult, JobStatus, SlurmClient
from gateway.slurm.render import JobScript, RenderError, render_sbatch
from gateway.slurm.runner import LocalRunner, Runner, SlurmCommandError, SSHRunner, SSHTarget
from gateway.slurm.validate import InvalidNameError, validate_tenant_name

__all__ = [
    "CancelResult", "InvalidNameError", "JobScript", "JobStatus", "LocalRunner", "RenderError",
    "Runner", "SSHRunner", "SSHTarget", "SlurmClient", "SlurmCommandError", "SlurmError",
    "render_sbatch", "validate_tenant_name",
]


def make_runner(settings: object | None = None) -> Runner:
    """A runner from settings: SSH when ``ssh_host`` is set, else local."""
    s = settings if isinstance(settings, Settings) else get_settings()
    if s.ssh_host:
        if s.ssh_key is None:
            raise SlurmError("SFT_SSH_HOST is set but SFT_SSH_KEY is not: key auth is required")
        return SSHRunner(SSHTarget(s.ssh_host, s.ssh_user, s.ssh_key, s.ssh_port,
                                   s.ssh_known_hosts))
    return LocalRunner()
