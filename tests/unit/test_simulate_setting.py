"""The simulated trainer is a site's choice (``simulate_trainer_speedup``), never a tenant's: what the
batch script runs follows the setting alone."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.config import Settings
from gateway.jobs.submission import trainer_command


def test_the_trainer_runs_unless_the_site_simulates() -> None:
    spec = Path("/srv/slurm-finetune/tenants/acme/jobs/ftjob-1/spec.json")
    py = "/opt/slurm-finetune/venv/bin/python"
    assert trainer_command(Settings(), spec) == (py, "-m", "trainer", "run", str(spec))
    assert trainer_command(Settings(simulate_trainer_speedup=24), spec) == (
        py, "-m", "trainer.simulate", str(spec), "--speedup", "24")
    assert trainer_command(Settings(simulate_trainer_speedup=0.0937), spec)[-1] == "0.0937"
    for bad in (0, -1):
        with pytest.raises(ValidationError):
            Settings(simulate_trainer_speedup=bad)
