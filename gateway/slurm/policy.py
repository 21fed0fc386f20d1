"""The declarative QOS tier policy (TOML) and its sacctmgr form. Pure functions."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gateway.slurm.runner import SlurmError
from gateway.slurm.validate import validate_qos_name

_WALL_RE = re.compile(r"^(?:(\d+)-)?(\d{1,2}):(\d{2}):(\d{2})$")
_KEYS = {"description", "priority", "max_gpus_per_user", "max_wall", "max_jobs_per_user",
         "max_submit_jobs_per_user", "deny_on_limit"}


class PolicyError(SlurmError, ValueError):
    """The QOS policy file is invalid; the message names the tier and key."""


@dataclass(frozen=True)
class QosTier:
    name: str
    description: str
    priority: int
    max_gpus_per_user: int
    max_wall_min: int
    max_jobs_per_user: int
    max_submit_jobs_per_user: int
    deny_on_limit: bool

    def sacctmgr_settings(self) -> list[str]:
        """``key=value`` arguments for ``sacctmgr add/modify qos``, in a fixed order."""
        return [
            f"Description={self.description}",
            f"Priority={self.priority}",
            f"MaxTRESPerUser=gres/gpu={self.max_gpus_per_user}",
            f"MaxWall={self.max_wall_min}",
            f"MaxJobsPerUser={self.max_jobs_per_user}",
            f"MaxSubmitJobsPerUser={self.max_submit_jobs_per_user}",
            "Flags=" + ("DenyOnLimit" if self.deny_on_limit else "-1"),
        ]


def parse_wall(value: str | int, where: str) -> int:
    """``"1-02:30:00"`` or minutes → minutes; raise PolicyError naming ``where``."""
    if isinstance(value, int) and value > 0:
        return value
    m = _WALL_RE.match(str(value))
    if not m:
        raise PolicyError(f"{where}: max_wall {value!r} is not minutes or D-HH:MM:SS")
    days, h, mi, s = (int(x or 0) for x in m.groups())
    return days * 1440 + h * 60 + mi + (1 if s else 0)


def _int(tier: dict, key: str, where: str, minimum: int = 0) -> int:
    v = tier.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise PolicyError(f"{where}: {key} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_policy(text: str, source: str = "policy") -> dict[str, QosTier]:
    """Parse the TOML policy into tiers by name; raise PolicyError on any bad key or value."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise PolicyError(f"{source}: not valid TOML: {e}") from e
    if set(data) != {"qos"} or not isinstance(data["qos"], dict) or not data["qos"]:
        raise PolicyError(f"{source}: expected only [qos.<name>] tables")
    tiers = {}
    for name, tier in data["qos"].items():
        where = f"{source}: [qos.{name}]"
        validate_qos_name(name)
        unknown = set(tier) - _KEYS
        if unknown:
            raise PolicyError(f"{where}: unknown keys {sorted(unknown)}; valid: {sorted(_KEYS)}")
        tiers[name] = QosTier(
            name=name,
            description=str(tier.get("description", name)),
            priority=_int(tier, "priority", where),
            max_gpus_per_user=_int(tier, "max_gpus_per_user", where, 1),
            max_wall_min=parse_wall(tier.get("max_wall", ""), where),
            max_jobs_per_user=_int(tier, "max_jobs_per_user", where, 1),
            max_submit_jobs_per_user=_int(tier, "max_submit_jobs_per_user", where, 1),
            deny_on_limit=bool(tier.get("deny_on_limit", True)),
        )
    return tiers


def load_policy(path: Path | None = None) -> dict[str, QosTier]:
    """The policy at ``path``, or the one shipped in slurm_templates/."""
    if path is None:
        text = resources.files("slurm_templates").joinpath("qos_policy.toml").read_text()
        return parse_policy(text, "slurm_templates/qos_policy.toml")
    return parse_policy(path.read_text(), str(path))
