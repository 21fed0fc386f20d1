"""The gateway's one settings object (environment variables prefixed ``SFT_``)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SFT_", extra="forbid")

    storage_root: Path = Path("/srv/slurm-finetune")
    runtime_prefix: Path = Path("/opt/slurm-finetune")
    parent_account: str = "finetune"
    # SSH access to a Slurm login node when the gateway runs off-cluster.
    ssh_host: str | None = None
    ssh_user: str = "root"
    ssh_port: int = 22
    ssh_key: Path | None = None
    ssh_known_hosts: Path | None = None
    slurm_timeout_s: float = 60.0

    @property
    def runtime_python(self) -> Path:
        return self.runtime_prefix / "venv" / "bin" / "python"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
