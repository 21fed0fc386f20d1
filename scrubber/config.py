"""The scrubber's one settings object: defaults < /etc/slurm-finetune/scrubber.toml < CLI options.

Unknown keys in the TOML file are rejected with the list of valid ones, so a
typo in ``fail_step`` cannot silently disable a drain test.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/slurm-finetune/scrubber.toml")


class ScrubConfigError(ValueError):
    """The scrubber configuration is invalid; the message names the file and key."""


@dataclass(frozen=True)
class ScrubConfig:
    scratch_root: Path = Path("/var/lib/slurm-finetune/scratch")
    report_dir: Path = Path("/var/lib/slurm-finetune/scrub")
    log_dir: Path = Path("/var/log/slurm-finetune")
    # Where the job user's files are removed after its last job on the node.
    tmp_dirs: tuple[Path, ...] = (Path("/tmp"), Path("/dev/shm"))
    # Unix users whose name starts with this are tenants (prolog: leftover check) ...
    tenant_user_prefix: str = "sft-"
    # ... except these service accounts (the gateway's user, which runs on a one-host cluster).
    service_users: tuple[str, ...] = ("sft-gateway",)
    proc_root: Path = Path("/proc")
    gres_conf: Path = Path("/etc/slurm/gres.conf")
    # SIGTERM → SIGKILL grace, then how long KILLed processes may take to vanish.
    kill_grace_s: float = 2.0
    kill_wait_s: float = 5.0
    # GPU wipe: chunk sizes tried from largest to smallest until memory is full.
    wipe_chunk_mb: int = 1024
    wipe_min_chunk_mb: int = 2
    # NVML memory.used (v2, reserved memory excluded) allowed on a clean GPU.
    gpu_used_tolerance_mb: int = 0
    # Fault injection for drain tests: this step fails on purpose (after doing its work),
    # only on fail_node / for fail_user when those are set.
    fail_step: str = ""
    fail_node: str = ""
    fail_user: str = ""
    source: str = field(default="defaults", compare=False)

    def fails_on_purpose(self, step: str, node: str, user: str) -> bool:
        """Whether ``step`` must fail by configuration on this node for this user."""
        return (self.fail_step == step and self.fail_node in ("", node)
                and self.fail_user in ("", user))


_PATHS = {"scratch_root", "report_dir", "log_dir", "proc_root", "gres_conf"}
_FLOATS = {"kill_grace_s", "kill_wait_s"}
_INTS = {"wipe_chunk_mb", "wipe_min_chunk_mb", "gpu_used_tolerance_mb"}
_STRS = {"tenant_user_prefix", "fail_step", "fail_node", "fail_user"}
KEYS = sorted(f.name for f in fields(ScrubConfig) if f.name != "source")


def coerce(values: dict[str, Any], where: str) -> dict[str, Any]:
    """Check and convert raw TOML/CLI values. Raises ScrubConfigError naming the key."""
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise ScrubConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(KEYS)}")
    out: dict[str, Any] = {}
    for key, v in values.items():
        try:
            out[key] = _coerce_one(key, v)
        except (TypeError, ValueError) as e:
            raise ScrubConfigError(f"{where}: {key} = {v!r}: {e}") from e
    return out


def _coerce_one(key: str, v: Any) -> Any:
    if key in _PATHS:
        return Path(_text(v))
    if key == "tmp_dirs":
        if not isinstance(v, list | tuple):
            raise TypeError("expected a list of paths")
        return tuple(Path(_text(p)) for p in v)
    if key == "service_users":
        if not isinstance(v, list | tuple):
            raise TypeError("expected a list of user names")
        return tuple(_text(u) for u in v)
    if key in _FLOATS:
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError("expected a number >= 0")
        return float(v)
    if key in _INTS:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError("expected an integer >= 0")
        return v
    assert key in _STRS
    return _text(v, allow_empty=True)


def _text(v: Any, *, allow_empty: bool = False) -> str:
    if not isinstance(v, str) or (not v and not allow_empty):
        raise TypeError("expected a non-empty string")
    return v


def load_config(path: Path | None = DEFAULT_CONFIG, overrides: dict[str, Any] | None = None) -> ScrubConfig:
    """Defaults, then the TOML file when it exists, then ``overrides`` (CLI).

    Raises ScrubConfigError for an unreadable file, bad TOML, unknown keys or bad values.
    """
    cfg = ScrubConfig()
    if path is not None and path.exists():
        try:
            raw = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ScrubConfigError(f"{path}: {e}") from e
        cfg = replace(cfg, **coerce(raw, str(path)), source=str(path))
    if overrides:
        cfg = replace(cfg, **coerce({k: v for k, v in overrides.items() if v is not None},
                                    "command line"))
    if cfg.wipe_min_chunk_mb < 1 or cfg.wipe_min_chunk_mb > cfg.wipe_chunk_mb:
        raise ScrubConfigError(f"{cfg.source}: need 1 <= wipe_min_chunk_mb <= wipe_chunk_mb")
    return cfg
