"""The `files` group: upload a dataset (with a progress bar), list, show and remove files,
and the validation report they print."""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import click

from gateway.usercli.client import _echo_json, call


@click.group("files")
def files() -> None:
    """Your datasets on the gateway."""


class _Progress:
    """A file object that advances a click progress bar as httpx reads it."""

    def __init__(self, f: BinaryIO, bar: Any):
        self.f, self.bar = f, bar

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.bar.update(len(data))
        return data


def print_report(obj: dict[str, Any]) -> None:
    """Print a file object and its validation report (stats, error and warning counts, errors) for a person."""
    v = obj.get("validation") or {}
    stats = v.get("stats") or {}
    click.echo(f"{obj['id']}  {obj['filename']}  {obj['bytes']} bytes  status: {obj['status']}")
    if obj.get("expires_at"):
        click.echo(f"  expires {datetime.fromtimestamp(obj['expires_at'], UTC).isoformat(timespec='seconds')} "
                   "(then the gateway deletes it)")
    tok = stats.get("tokens")
    if tok:
        click.echo(f"  {stats.get('examples')} examples, {tok['total']} tokens in {stats.get('tokenizer')}'s "
                   f"tokenizer (p50 {tok['p50']}, p95 {tok['p95']}, max {tok['max']}; assistant {tok['assistant']}), "
                   f"~{stats.get('estimated_training_tokens')} tokens for {stats.get('estimated_epochs')} epochs")
    else:
        click.echo(f"  {stats.get('examples', 0)} examples (tokens not counted: no base model's tokenizer)")
    tools = stats.get("tools")
    if tools:
        click.echo(f"  tool calling: {tools['lines_with_tools']} lines declare tools, {tools['tool_calls']} calls "
                   f"({tools['calls_per_line']} per line, at most {tools['max_calls_per_line']})")
    for kind, n in sorted((v.get("error_counts") or {}).items()):
        click.echo(f"  ERROR {kind}: {n}")
    for e in v.get("errors") or []:
        where = f"line {e['line']}" if e.get("line") else "file"
        click.echo(f"    {where}: [{e['kind']}] {e['message']}")
    for kind, n in sorted((v.get("warning_counts") or {}).items()):
        click.echo(f"  warning {kind}: {n}")
        for w in [w for w in v.get("warnings") or [] if w.get("kind") == kind][:5]:
            where = f"line {w['line']}" if w.get("line") else "file"   # where, as the portal's page says
            click.echo(f"    {where}: {w.get('message')}")


@files.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Base model whose tokenizer checks the lengths (default: the gateway's).")
@click.option("--expires-after", type=click.IntRange(1), metavar="SECONDS",
              help="Delete the file this long after the upload (OpenAI's expires_after; the gateway's bounds apply).")
@click.option("--json", "as_json", is_flag=True)
def upload(path: Path, model: str | None, expires_after: int | None, as_json: bool) -> None:
    """Upload a chat JSONL dataset; print its validation report. Exit 1 if it has errors."""
    size = path.stat().st_size
    with open(path, "rb") as f, click.progressbar(length=size, label=f"uploading {path.name}",
                                                  file=None if not as_json else open(os.devnull, "w")) as bar:
        r = call("POST", "/v1/files", params={"model": model} if model else None,
                 data={"purpose": "fine-tune", **({"expires_after[anchor]": "created_at",
                                                   "expires_after[seconds]": str(expires_after)}
                                                  if expires_after is not None else {})},
                 files={"file": (path.name, _Progress(f, bar))})
    obj = r.json()
    click.echo(json.dumps(obj, indent=2)) if as_json else print_report(obj)
    if obj["status"] != "processed":
        raise SystemExit(1)


def _size(n: int) -> str:
    """Bytes as a person reads them (``1.2 MB``)."""
    size = float(n)
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{size:.1f} GB"


PURPOSES = {"datasets": "fine-tune", "results": "fine-tune-results"}


@files.command("list")
@click.option("--purpose", type=click.Choice(["all", *PURPOSES]), default="all", show_default=True,
              help="datasets: what you uploaded; results: the adapters, evaluations and checkpoints jobs published.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's list object (object, data, has_more).")
def list_files(purpose: str, as_json: bool) -> None:
    """Your files, newest first: datasets and the results jobs published (a PURPOSE column)."""
    page = call("GET", "/v1/files", params={"purpose": PURPOSES[purpose]} if purpose in PURPOSES else None).json()
    if as_json:
        _echo_json(page)
        return
    data = page["data"]
    if not data:
        click.echo("no files yet: `finetune files upload train.jsonl`" if purpose == "all" else f"no {purpose}")
        return
    click.echo(f"{'ID':<29}  {'PURPOSE':<8}  {'STATUS':<10}  {'SIZE':>9}  FILENAME")
    for o in data:
        kind = "result" if o.get("purpose") == PURPOSES["results"] else "dataset"
        click.echo(f"{o['id']:<29}  {kind:<8}  {o['status']:<10}  {_size(o['bytes']):>9}  {o['filename']}")


@files.command("show")
@click.argument("file_id")
@click.option("--json", "as_json", is_flag=True)
def show(file_id: str, as_json: bool) -> None:
    """One file with its validation report."""
    obj = call("GET", f"/v1/files/{file_id}").json()
    click.echo(json.dumps(obj, indent=2)) if as_json else print_report(obj)


@files.command("rm")
@click.argument("file_id")
@click.option("--json", "as_json", is_flag=True)
def rm(file_id: str, as_json: bool) -> None:
    """Delete a file and its bytes (refused while a running job uses it)."""
    obj = call("DELETE", f"/v1/files/{file_id}").json()
    click.echo(json.dumps(obj) if as_json else f"deleted {file_id}")
