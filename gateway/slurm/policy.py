"""The declarative QOS tier policy (TOML) and its sacctmgr form. Pure functions."""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from gateway.errors import SlurmError
from gateway.slurm.records import gpu_count
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


# ------------------------------------------------------------------ QOS diff
# What ``sacctmgr show qos`` prints for the fields the policy manages, in this order.
QOS_SHOW_FORMAT = "Name,Priority,MaxTRESPerUser,MaxWall,MaxJobsPerUser,MaxSubmitJobsPerUser,Flags,Description"


@dataclass(frozen=True)
class QosRow:
    """One QOS as the cluster has it (``sacctmgr --parsable2 show qos``)."""

    name: str
    priority: int | None
    max_tres_per_user: str
    max_wall_min: int | None
    max_jobs_per_user: int | None
    max_submit_jobs_per_user: int | None
    flags: frozenset[str]
    description: str

    @property
    def max_gpus_per_user(self) -> int | None:
        """The per-user GPU limit in MaxTRESPerUser; None when it sets none."""
        return gpu_count(self.max_tres_per_user) if "gres/gpu" in self.max_tres_per_user else None


def _opt_int(v: str) -> int | None:
    return int(v) if v.strip() else None


def parse_slurm_duration(v: str) -> int | None:
    """sacctmgr's MaxWall (``1-00:00:00``, ``04:00:00``, ``30:00``) → minutes; "" → None."""
    v = v.strip()
    if not v:
        return None
    days, _, rest = v.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    while len(parts) < 3:
        parts.insert(0, 0)
    h, m, s = parts
    return int(days or 0) * 1440 + h * 60 + m + (1 if s else 0)


def parse_qos_show(text: str) -> list[QosRow]:
    """Rows of ``sacctmgr --noheader --parsable2 show qos format=<QOS_SHOW_FORMAT>``.

    Description is last: it is the one free-text field, so a ``|`` inside it is kept.
    Raises PolicyError on a line with too few fields.
    """
    rows = []
    n = QOS_SHOW_FORMAT.count(",") + 1
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        f = line.split("|", n - 1)
        if len(f) != n:
            raise PolicyError(f"sacctmgr show qos line {lineno}: expected {n} fields: {line!r}")
        try:
            rows.append(QosRow(
                name=f[0], priority=_opt_int(f[1]), max_tres_per_user=f[2],
                max_wall_min=parse_slurm_duration(f[3]), max_jobs_per_user=_opt_int(f[4]),
                max_submit_jobs_per_user=_opt_int(f[5]),
                flags=frozenset(x for x in f[6].split(",") if x), description=f[7],
            ))
        except ValueError as e:
            raise PolicyError(f"sacctmgr show qos line {lineno}: {e}: {line!r}") from e
    return rows


@dataclass(frozen=True)
class QosChange:
    """What ``apply`` would do to one tier: ``add`` it, or ``modify`` only the fields that differ."""

    name: str
    action: str                                   # "add" | "modify"
    fields: tuple[tuple[str, str, str], ...]      # (sacctmgr field, cluster has, policy wants)
    settings: tuple[str, ...]                     # the ``key=value`` arguments to send

    def describe(self) -> str:
        """One line for a dry run: the settings an add sends, or each field's cluster -> policy value."""
        if self.action == "add":
            return f"{self.name}: add ({' '.join(self.settings)})"
        return f"{self.name}: modify " + "; ".join(f"{k} {h or '(unset)'} -> {w}" for k, h, w in self.fields)


def _wanted(tier: QosTier) -> dict[str, str]:
    return dict(s.split("=", 1) for s in tier.sacctmgr_settings())


def _have(row: QosRow) -> dict[str, str]:
    gpus = row.max_gpus_per_user
    return {
        "Description": row.description, "Priority": "" if row.priority is None else str(row.priority),
        "MaxTRESPerUser": "" if gpus is None else f"gres/gpu={gpus}",
        "MaxWall": "" if row.max_wall_min is None else str(row.max_wall_min),
        "MaxJobsPerUser": "" if row.max_jobs_per_user is None else str(row.max_jobs_per_user),
        "MaxSubmitJobsPerUser": "" if row.max_submit_jobs_per_user is None
        else str(row.max_submit_jobs_per_user),
        "Flags": ",".join(sorted(row.flags)) or "-1",
    }


def diff_qos(tiers: dict[str, QosTier], cluster: list[QosRow]) -> list[QosChange]:
    """The changes that make ``cluster`` match ``tiers``; [] when it already does.

    Only managed fields are compared (sacctmgr lowercases descriptions, so they
    compare case-insensitively); QOS the policy does not name are left alone.
    """
    have = {r.name: r for r in cluster}
    changes = []
    for tier in tiers.values():
        want = _wanted(tier)
        if tier.name not in have:
            changes.append(QosChange(tier.name, "add", (), tuple(tier.sacctmgr_settings())))
            continue
        got = _have(have[tier.name])
        diff = tuple((k, got[k], v) for k, v in want.items()
                     if (got[k].casefold() if k == "Description" else got[k])
                     != (v.casefold() if k == "Description" else v))
        if diff:
            changes.append(QosChange(tier.name, "modify", diff, tuple(f"{k}={w}" for k, _, w in diff)))
    return changes


def unmanaged_qos(tiers: dict[str, QosTier], cluster: list[QosRow]) -> list[str]:
    """QOS on the cluster that the policy does not name (never touched by apply)."""
    return sorted(r.name for r in cluster if r.name not in tiers)
