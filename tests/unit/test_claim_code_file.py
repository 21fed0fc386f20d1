"""The storage verb that delivers a claim code (``write_claim``), in direct mode: the file lands at the
tenant root as ``CLAIM-CODE-<token id>``, 0600, replacing (never following) whatever was planted there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gateway.storage import layout
from gateway.storage.broker import run_verb
from gateway.storage.verbs import VerbError


def test_write_claim_writes_a_private_file_at_the_tenant_root(tmp_path: Path) -> None:
    reply = run_verb(tmp_path, "acme", None, "write_claim", {"token_id": 12, "text": "sftclaim_x\n"}, [])
    path = tmp_path / "tenants" / "acme" / "CLAIM-CODE-12"
    assert reply.result == {"name": "CLAIM-CODE-12"} and path.read_text() == "sftclaim_x\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # a link planted under that name is replaced, its target untouched
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    path.unlink()
    os.symlink(victim, path)
    run_verb(tmp_path, "acme", None, "write_claim", {"token_id": 12, "text": "sftclaim_y\n"}, [])
    assert not path.is_symlink() and path.read_text() == "sftclaim_y\n" and victim.read_text() == "keep\n"


@pytest.mark.parametrize("args", [{"token_id": 0, "text": "x"}, {"token_id": "12", "text": "x"},
                                  {"token_id": True, "text": "x"}, {"token_id": 2**31, "text": "x"},
                                  {"token_id": 3, "text": ""}, {"token_id": 3, "text": "x" * 5000},
                                  {"token_id": 3}])
def test_write_claim_refuses_bad_arguments(tmp_path: Path, args: dict[str, object]) -> None:
    with pytest.raises((VerbError, layout.LayoutError)):
        run_verb(tmp_path, "acme", None, "write_claim", args, [])
    assert not list((tmp_path / "tenants" / "acme").glob("CLAIM-CODE-*"))
