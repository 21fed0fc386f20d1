"""Test tiers: every test module is marked with its tier (see pyproject markers).

Unmarked tests in tests/unit are marked ``unit`` automatically.
"""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = {"unit", "train", "slurm", "ssh", "gpu", "service", "browser"}
    for item in items:
        if not any(m.name in tiers for m in item.iter_markers()):
            item.add_marker(pytest.mark.unit)


@pytest.fixture
def data_dir() -> Path:
    return DATA
