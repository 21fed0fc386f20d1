"""Fixtures for accounting unit tests: recorded real sacct/sshare/sacctmgr outputs."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.slurm import records as rec

ACCT_DATA = Path(__file__).resolve().parents[1] / "data" / "accounting"
# When sacct_final.txt / sacct_live.txt were recorded (see tests/data/accounting/README.md).
RECORDED_AT = datetime(2026, 11, 30, 6, 21, 0, tzinfo=UTC)
LIVE_AT = datetime(2026, 11, 30, 6, 20, 18, tzinfo=UTC)


def sacct(name: str) -> list[rec.AcctRecord]:
    return rec.parse_sacct((ACCT_DATA / name).read_text())


@pytest.fixture
def acct_data() -> Path:
    return ACCT_DATA
