"""The gateway's one settings object (environment variables prefixed ``SFT_``)."""

from __future__ import annotations

import os
import re
import sys
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer.contract.spec import HYPERPARAMETER_DEFAULTS

STATE_DIR = Path("/var/lib/slurm-finetune/gateway")      # 0700, owned by the service user
DEFAULT_DB = f"sqlite:///{STATE_DIR}/gateway.db"


class Settings(BaseSettings):
    """Every knob of a gateway process; unknown ``SFT_*`` keys are rejected."""

    model_config = SettingsConfigDict(env_prefix="SFT_", extra="forbid")

    # Where jobs run: "slurm" (the cluster), or "local": no root, no Slurm, jobs run as the
    # invoking user (submitit's LocalExecutor), state under data_dir; no tenant isolation.
    backend: Literal["slurm", "local"] = "slurm"
    data_dir: Path | None = None              # local mode; default ~/.local/share/slurm-finetune
    storage_root: Path = Path("/srv/slurm-finetune")
    # Privilege separation: the API and reconciler run as this user (started as root they drop
    # to it); tenant storage is reached only through the storage broker, as the tenant's uid.
    service_user: str = "sft-gateway"
    state_dir: Path = STATE_DIR
    broker_socket: Path = Path("/run/slurm-finetune/broker-v1.sock")
    runtime_prefix: Path = Path("/opt/slurm-finetune")
    parent_account: str = "finetune"
    database_url: str = DEFAULT_DB
    catalog_root: Path | None = None          # base-model catalog; default <storage_root>/models
    # Uploads: the limit is enforced while streaming, before the bytes are all in.
    max_upload_bytes: int = 256 * 1024 * 1024
    max_line_bytes: int = 4 * 1024 * 1024
    min_examples: int = 10
    max_seq_len: int = HYPERPARAMETER_DEFAULTS["max_seq_len"]   # an upload's longest example: the trainer's default
    default_model: str | None = "tiny-chat"   # tokenizer for upload checks when none is named
    max_reported_errors: int = 100
    # A file's ``expires_after`` (OpenAI's: {"anchor": "created_at", "seconds": N}): the shortest and longest
    # N accepted (OpenAI's bounds, 1 hour to 30 days). The sweeper deletes a file once it has expired.
    file_expiry_min_s: int = Field(default=3600, ge=1)
    file_expiry_max_s: int = Field(default=30 * 24 * 3600, ge=1)
    # The retention sweeper (gateway.jobs.sweeper, run by the reconciler's leader in a thread of its own,
    # never inside a cycle): every sweep_interval_s (0: never) one pass deletes what expired (files past
    # expires_at, what is older than a tenant's retention policy, the training state of succeeded jobs
    # beyond the checkpoints they keep), at most sweep_max_items deletions and sweep_budget_s seconds a pass.
    sweep_interval_s: float = Field(default=60.0, ge=0)
    sweep_max_items: int = Field(default=200, ge=1)
    sweep_budget_s: float = Field(default=20.0, gt=0)
    # Any other request body (JSON, forms) is capped here; over it: 413 (gateway/api/limits.py).
    max_json_bytes: int = 1024 * 1024
    # The portal cookie's Secure flag: "auto" (under TLS only), "always" (behind a TLS proxy), "never".
    cookie_secure: str = "auto"
    token_cache_s: float = 2.0                # a revoked token stops working within this time
    # HMAC key anchoring the audit chain's head outside the database (0600, made on first use);
    # every gateway sharing a database needs the same file, and `finetune admin audit verify` too.
    audit_key_file: Path = Path("/var/lib/slurm-finetune/gateway/audit.key")
    # Jobs: admission control, estimates, cancellation, publication.
    max_active_jobs_per_tenant: int = 20
    max_sweep_runs: int = 16             # grid points per sweep (each a job; at most 64, one array)
    max_tokens_per_job: int = 200_000_000
    max_wall_min: int = 3 * 24 * 60
    throughput_tokens_per_s: float = 1500.0      # conservative; sets --time for backfill
    job_overhead_s: int = 300                    # model load, eval, save
    job_cpus: int = 2                            # per rank (one rank per GPU)
    # Gangs (resources.gpus over resources.nodes): the most a job may ask for; QOS tiers limit GPUs further.
    max_gpus_per_node: int = 8
    max_nodes_per_job: int = 16
    parallel_efficiency: float = 0.8             # the estimate's speed-up per extra rank
    job_mem_mb: int = 8192                       # per rank (--mem is this x the ranks of a node)
    # Memory of one GPU, in GiB, by partition name ("default": the partition jobs go to when
    # slurm_partition is unset), e.g. SFT_GPU_MEMORY_GIB='{"a100": 80, "default": 24}'. Admission
    # refuses a job whose estimated per-GPU peak (trainer.memory) is over it. A partition not
    # listed is taken to train on the CPU (the dev cluster: its GPUs are gres entries, not devices)
    # unless job_device is "cuda", and the estimate is held against job_mem_mb instead.
    gpu_memory_gib: dict[str, float] = {}
    signal_grace_s: int = 90
    # detectors (gateway.jobs.detectors): a job silent for stall_factor x its median step time, at least
    # stall_min_s, is warned about; stall_requeue_s later still silent, it is requeued from its checkpoint
    stall_factor: float = 20.0
    stall_min_s: float = 300.0
    stall_requeue_s: float = 300.0
    # One reconciler at a time across the gateways sharing the database (gateway.jobs.leader): the
    # leader renews its lease every cycle; a standby takes over at most ~4/3 x this after the leader dies
    reconciler_lease_s: float = 15.0
    # For the test suite only, never on a site: variables added to every job's environment, each named
    # SFT_TEST_* (the trainer's test-only fault injection reads them: trainer.jobenv.test_fault_step). The
    # job spec carries no such thing, so no tenant's request can set one.
    test_job_env: dict[str, str] = {}
    # For capacity simulations only (bench/capacity.py, the dev cluster's simulated nodes), never on a
    # site that trains: when set, every job runs ``trainer.simulate`` instead of the trainer. It does no
    # ML: it sleeps for the time the job's tokens would take at its simulated speed divided by this
    # speed-up, and writes events, checkpoints and results as the trainer does. A site setting, so no
    # tenant's request can choose it.
    simulate_trainer_speedup: float | None = Field(default=None, gt=0)
    # webhooks: receivers on loopback, link-local or private addresses only when their host is listed here
    webhook_allowed_hosts: list[str] = []
    webhook_timeout_s: float = 5.0
    webhook_max_attempts: int = 8
    webhook_retry_base_s: float = 10.0    # the wait after the n-th failure: base x 2^(n-1)
    # MLflow integrations (a job's ``integrations: [{"type": "mlflow", ...}]``, gateway.services.tracking): the
    # gateway logs to the tenant's tracking server, public addresses only unless the host is listed here (the
    # webhooks' rules); the back-off after the n-th failure is base x 2^(n-1), at most max; a run still not
    # logged after max_attempts failures in a row is given up. Credentials are kept encrypted with the key in
    # integration_key_file (0600, made on first use; every gateway sharing the database needs the same file).
    mlflow_allowed_hosts: list[str] = []
    mlflow_timeout_s: float = Field(default=10.0, gt=0)
    mlflow_retry_base_s: float = Field(default=5.0, gt=0)
    mlflow_max_backoff_s: float = Field(default=600.0, gt=0)
    mlflow_max_attempts: int = Field(default=60, ge=1)
    integration_key_file: Path = STATE_DIR / "integrations.key"
    # The trainer's device: "auto" trains on CUDA when torch sees it, and refuses the CPU when Slurm
    # gave the job a GPU on a node with the NVIDIA driver loaded (exit GPU_UNAVAILABLE, failed as node_fail);
    # "cuda" refuses the CPU always (a GPU site that wants no doubt); "cpu" never uses a GPU.
    job_device: Literal["auto", "cuda", "cpu"] = "auto"
    cancel_deadline_s: float = 20.0
    checkpoint_every_steps: int = 50
    submission_grace_s: float = 30.0          # a job with no Slurm id after this is recovered
    eval_gate: str = "not_worse"                 # not_worse | off
    eval_gate_tolerance: float = 0.0
    reconcile_interval_s: float = 2.0
    # How long a reconcile cycle waits, all tenants together, for the tenants' storage calls (events
    # reads, the temp sweep; they run side by side): a tenant that has not answered by then (its broker
    # child stopped, its storage wedged) is left for a later cycle and never stalls the others' jobs.
    broker_cycle_timeout_s: float = 3.0
    reconcile_max_backoff_s: float = 60.0
    scrub_report_dir: Path = Path("/var/lib/slurm-finetune/scrub")
    # Where a tenant's jobs leave files outside its storage root on a node (`admin tenant delete` removes
    # the tenant's on this host): the scrubber's scratch root (its scratch_root), the temp dirs its epilog
    # clears, and Slurm's job_container.conf (the BasePath of each job's private /tmp).
    scratch_root: Path = Path("/var/lib/slurm-finetune/scratch")
    node_tmp_dirs: list[Path] = [Path("/tmp"), Path("/dev/shm"), Path("/var/tmp")]
    job_container_conf: Path = Path("/etc/slurm/job_container.conf")
    # Deletion receipts (`admin tenant delete`): JSON, 0600 root, in a 0700 directory.
    receipt_dir: Path = Path("/var/lib/slurm-finetune/receipts")
    slurm_partition: str | None = None
    # SSH access to a Slurm login node when the gateway runs off-cluster.
    ssh_host: str | None = None
    ssh_user: str = "root"
    ssh_port: int = 22
    ssh_key: Path | None = None
    ssh_known_hosts: Path | None = None
    slurm_timeout_s: float = 60.0
    # Signing in (gateway.access.signin): how long a personal token lives, and the URLs a MUNGE
    # sign-in credential may be bound to (default: the URL the request came in on).
    personal_token_hours: float = Field(default=12.0, gt=0, le=24 * 30)
    # How old a person's groups may be when their personal token is used: someone removed from a
    # tenant's group loses access within this plus token_cache_s (gateway.access.members).
    membership_ttl_s: float = Field(default=30.0, gt=0, le=3600)
    public_urls: list[str] = []
    # The portal's single sign-on (gateway.portal.oidc): the site's OpenID Connect provider. The
    # username claim is mapped to a unix user by ``oidc_user_map`` (a regex; its first group is the
    # user, like Open OnDemand's user_map_match), then to tenants through their groups.
    oidc_issuer: str | None = None
    oidc_client_id: str | None = None
    oidc_client_secret_file: Path | None = None    # read when needed; never in the environment
    oidc_username_claim: str = "preferred_username"
    oidc_user_map: str = r"^([a-z_][a-z0-9_-]{0,31})$"
    oidc_scopes: str = "openid profile"
    oidc_name: str = "single sign-on"               # what the sign-in button says ("Sign in with ...")
    # The CLI's connection to a gateway (else from `finetune login`'s credentials file).
    api_url: str | None = None
    api_token: str | None = None
    credentials_file: Path = Path("~/.config/slurm-finetune/credentials.json")

    @model_validator(mode="after")
    def _test_variables_only(self) -> Settings:
        """``test_job_env`` may name only ``SFT_TEST_*`` variables: it cannot reach into a job's real settings."""
        wrong = sorted(k for k in self.test_job_env if not re.fullmatch(r"SFT_TEST_[A-Z0-9_]+", k))
        if wrong:
            raise ValueError(f"test_job_env may set only SFT_TEST_* variables, not {', '.join(wrong)}")
        return self

    @model_validator(mode="after")
    def _local_paths(self) -> Settings:
        """Local mode keeps everything under ``data_dir`` unless a path was set explicitly."""
        if self.backend != "local":
            return self
        data = (self.data_dir or default_data_dir()).expanduser().absolute()
        self.data_dir = data
        defaults = {"storage_root": data / "storage", "state_dir": data / "state",
                    "database_url": f"sqlite:///{data / 'state' / 'gateway.db'}",
                    "audit_key_file": data / "state" / "audit.key", "catalog_root": data / "models",
                    "integration_key_file": data / "state" / "integrations.key",
                    "scrub_report_dir": data / "scrub"}
        for name, value in defaults.items():
            if name not in self.model_fields_set:
                setattr(self, name, value)
        return self

    @property
    def local(self) -> bool:
        """Whether this is local mode (``backend = "local"``): no Slurm, every job as this process's user."""
        return self.backend == "local"

    @property
    def runtime_python(self) -> Path:
        """The interpreter jobs run: the runtime venv's; in local mode this process's own."""
        if self.local:
            return Path(sys.executable)
        return self.runtime_prefix / "venv" / "bin" / "python"

    @property
    def models_root(self) -> Path:
        """The base-model catalog: ``catalog_root`` when set, else ``<storage_root>/models``."""
        return self.catalog_root or self.storage_root / "models"


def default_data_dir() -> Path:
    """Local mode's home: ``$XDG_DATA_HOME/slurm-finetune`` (``~/.local/share/slurm-finetune``)."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "slurm-finetune"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's Settings, read once from the ``SFT_*`` environment (cached)."""
    return Settings()
