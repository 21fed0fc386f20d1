"""The models CLI as scripts use it."""

from __future__ import annotations

from pathlib import Path


def test_models_list_json(tmp_path: Path) -> None:
    """`finetune models list --json` prints the catalog for scripts (empty catalog: [])."""
    import json

    from click.testing import CliRunner

    from gateway.cli import main

    res = CliRunner().invoke(main, ["models", "list", "--json", "--root", str(tmp_path)])
    assert res.exit_code == 0 and json.loads(res.output) == []
