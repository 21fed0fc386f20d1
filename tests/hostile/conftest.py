"""The hostile-tenant tier: a tenant runs arbitrary code as its own unix user.

Each test runs the attacker's steps as the tenant (``runuser -u sft-<tenant>``)
against the real gateway (``finetune serve``, dropped to ``sft-gateway``), the
real storage broker and the real dev cluster, then checks that the victim's
bytes, owner and mode are unchanged and that the request failed clearly.
"""

from __future__ import annotations

import hashlib
import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.slurm.conftest import cluster  # noqa: F401 - the session fixture
from tests.slurm.livegateway import LiveGateway, chat_file

ATTACKER, VICTIM = "hst-mallory", "hst-victim"
STORAGE = Path("/srv/slurm-finetune")


def as_tenant(tenant: str, script: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (sh) as the tenant's unix user, in its storage root."""
    res = subprocess.run(["runuser", "-u", f"sft-{tenant}", "--", "sh", "-ec", script],
                         cwd=STORAGE / "tenants" / tenant, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, f"attacker step failed: {res.stderr}"
    return res


@dataclass(frozen=True)
class Snap:
    """What must not change about a victim path: bytes, owner, mode (recursively)."""

    entries: tuple[tuple[str, int, int, int, str], ...]

    @classmethod
    def of(cls, root: Path) -> Snap:
        out = []
        for p in sorted([root, *root.rglob("*")]):
            st = os.lstat(p)
            digest = hashlib.sha256(p.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            out.append((str(p.relative_to(root)), st.st_uid, st.st_gid, st.st_mode, digest))
        return cls(tuple(out))


@pytest.fixture(scope="session")
def victim_root_dir() -> Iterator[Path]:
    """A root-owned directory a tenant can read but not write (like /etc or the catalog)."""
    d = Path("/var/lib/sft-hostile-victim")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(mode=0o755)
    (d / "root-secret.txt").write_text("root's bytes\n")
    os.chmod(d / "root-secret.txt", 0o644)
    (d / "sub").mkdir(mode=0o755)
    (d / "sub" / "keep").write_text("keep\n")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:  # noqa: F811
    # secrets in the gateway's environment: none may reach a tenant job or tenant storage
    g = LiveGateway(tmp_path_factory.mktemp("hostile"), (ATTACKER, VICTIM),
                    SFT_API_TOKEN="sft_gateway-env-secret-canary", SFT_SLURM_TIMEOUT_S="61")
    yield g
    g.stop()


@pytest.fixture(scope="session")
def victim_file(gw: LiveGateway, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """The victim tenant's uploaded dataset: (file id, its path in the victim's storage)."""
    path = chat_file(tmp_path_factory.mktemp("victim") / "victim.jsonl", 30, seed=7)
    fid = gw.upload(VICTIM, path)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return fid, STORAGE / "tenants" / VICTIM / "datasets" / f"{sha}.jsonl"


def uid_of(user: str) -> int:
    return pwd.getpwnam(user).pw_uid
