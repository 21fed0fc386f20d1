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


def test_models_list_is_a_table_with_a_header_and_human_sizes(tmp_path: Path) -> None:
    """Issue 35: the plain listing was raw tab-separated bytes; now a header, a short digest, a size a
    person reads and whether the template renders tool calling."""
    from click.testing import CliRunner

    from gateway.cli import main
    from trainer import catalog

    model = tmp_path / "src"
    model.mkdir()
    (model / "weights.bin").write_bytes(b"\0" * 2_500_000)
    catalog.add(model, "a-model", tmp_path / "root", check=None)
    res = CliRunner().invoke(main, ["models", "list", "--root", str(tmp_path / "root")])
    lines = res.output.splitlines()
    assert res.exit_code == 0 and lines[0].split() == ["NAME", "DIGEST", "SIZE", "ADDED", "TOOL", "CALLING"]
    assert lines[1].startswith("a-model") and "2.5 MB" in lines[1] and lines[1].endswith("not checked")
    empty = CliRunner().invoke(main, ["models", "list", "--root", str(tmp_path / "none")])
    assert empty.exit_code == 0 and "no models in" in empty.output


def test_the_man_page_covers_every_command_and_completion_completes() -> None:
    """Issue 35: a man page generated from the click commands (the set-up installs it), and documented
    completion for bash and zsh that really completes."""
    from click.testing import CliRunner

    from gateway.cli import main
    from gateway.cli.manpage import _leaves

    page = CliRunner().invoke(main, ["man"])
    assert page.exit_code == 0 and page.output.startswith(".TH FINETUNE 1")
    names = [" ".join(("finetune", *p)).replace("-", "\\-") for p, _ in _leaves(main, ())]
    assert len(names) > 60 and all(f".B {n}\n" in page.output for n in names)
    assert ".SH SHELL COMPLETION" in page.output and "SFT_API_URL" in page.output
    for shell in ("bash", "zsh"):
        script = CliRunner().invoke(main, ["completion", shell])
        assert script.exit_code == 0 and "_FINETUNE_COMPLETE" in script.output
    done = CliRunner().invoke(main, [], env={"_FINETUNE_COMPLETE": "bash_complete", "COMP_WORDS": "finetune jo",
                                             "COMP_CWORD": "1"}, prog_name="finetune")
    assert "plain,jobs" in done.output.splitlines()
