"""`finetune artifacts export`: what it refuses before it talks to the gateway (no gateway here;
the whole command runs against the real cluster in tests/slurm/test_export_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner, Result


def _export(*args: str) -> Result:
    from gateway.cli import main

    return CliRunner().invoke(main, ["artifacts", "export", *args])


@pytest.mark.parametrize(("args", "message"), [
    (["ftjob-1"], "Missing option '--format'"),
    (["ftjob-1", "--format", "onnx"], "'onnx' is not one of 'vllm', 'merged'"),
    (["ftjob-1", "--format", "vllm", "--max-lora-rank", "48"],
     "vLLM accepts only 1, 8, 16, 32, 64, 128, 256, 320, 512"),
    (["ftjob-1", "--format", "merged", "--max-lora-rank", "64"], "--max-lora-rank applies to --format vllm only"),
    (["ftjob-1", "--format", "vllm", "--dtype", "float32"], "--dtype applies to --format merged only"),
    (["ftjob-1", "--format", "merged", "--dtype", "int4"], "'int4' is not one of"),
])
def test_export_refuses_bad_options_as_usage_errors(args: list[str], message: str) -> None:
    res = _export(*args)
    assert res.exit_code == 2, res.output
    assert message in res.output and "Traceback" not in res.output


def test_export_refuses_a_non_empty_output_before_downloading(tmp_path: Path) -> None:
    out = tmp_path / "taken"
    out.mkdir()
    (out / "model.safetensors").write_text("someone else's")
    res = _export("ftjob-1", "--format", "merged", "-o", str(out))
    assert res.exit_code == 1 and f"{out} exists and is not empty" in res.output and "--force" in res.output
    assert (out / "model.safetensors").read_text() == "someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_the_cli_offers_the_trainers_dtypes() -> None:
    """The CLI spells the choices so `finetune --help` need not import the trainer; they must agree."""
    import importlib

    from trainer import export

    cli = importlib.import_module("gateway.usercli.artifacts")   # the module; the package exports the group
    assert cli.DTYPES == export.DTYPES
    shown = _export("--help").output
    assert "vllm: the LoRA adapter" in shown and "merged: the base model" in shown


def _catalog(root: Path, name: str, weights: bytes) -> str:
    from trainer import catalog

    source = root.parent / f"src-{name}-{len(weights)}"
    source.mkdir()
    (source / "model.safetensors").write_bytes(weights)
    return catalog.add(source, name, root, check=None).digest


def test_a_merge_uses_only_the_exact_base_it_was_trained_on(tmp_path: Path) -> None:
    import importlib

    import click

    from trainer import catalog

    cli = importlib.import_module("gateway.usercli.artifacts")
    root = tmp_path / "models"
    trained_on = _catalog(root, "base", b"the weights it trained on")
    assert cli._catalog_base(root, "base", trained_on) == catalog.model_dir(root, "base", trained_on)

    with pytest.raises(click.ClickException, match="without a digest"):
        cli._catalog_base(root, "base", None)
    with pytest.raises(click.ClickException, match=r"not in the catalog at .*: pass --models-root"):
        cli._catalog_base(root, "other", trained_on)
    other_root = tmp_path / "elsewhere"
    newer = _catalog(other_root, "base", b"an upgraded base")
    with pytest.raises(click.ClickException, match=f"has {newer}, but this adapter was trained on {trained_on}"):
        cli._catalog_base(other_root, "base", trained_on)
    weights = catalog.model_dir(root, "base", trained_on) / "model.safetensors"
    weights.chmod(0o644)
    weights.write_bytes(b"the weights, changed")
    with pytest.raises(click.ClickException, match="files on disk hash to"):
        cli._catalog_base(root, "base", trained_on)
