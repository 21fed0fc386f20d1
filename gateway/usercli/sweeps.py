"""``finetune sweeps``: a hyperparameter grid as one Slurm job array, and its runs side by side."""

from __future__ import annotations

from typing import Any

import click

from gateway.state import JobState
from gateway.usercli.client import _echo_json, call
from gateway.usercli.jobs import _parse_hp


def _parse_grid(pairs: tuple[str, ...]) -> dict[str, list[Any]]:
    """``KEY=V1,V2,...`` (repeatable) → {KEY: [numbers]}; UsageError on anything else."""
    grid: dict[str, list[Any]] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise click.UsageError(f"--grid {pair!r}: expected KEY=V1,V2,...")
        try:
            grid[key.strip()] = [float(v) if any(c in v for c in ".eE") else int(v) for v in raw.split(",")]
        except ValueError:
            raise click.UsageError(f"--grid {pair!r}: the values must be numbers") from None
    return grid


def _table(sweep: dict[str, Any]) -> list[str]:
    keys = list(sweep["grid"])
    best = (sweep.get("best") or {}).get("job_id")
    lines = [f"{sweep['id']}  {sweep['status']}  Slurm job array {sweep.get('slurm_array_id') or '-'}  "
             f"({len(sweep['runs'])} runs of {sweep['model']})",
             "  task  " + "  ".join(f"{k:>14}" for k in keys) + "  status      valid loss  job"]
    for r in sweep["runs"]:
        loss = f"{r['valid_loss']:.5f}" if r["valid_loss"] is not None else "-"
        mark = "  <- best" if r["job_id"] == best else ""
        lines.append(f"  {r['task']:>4}  " + "  ".join(f"{r['hyperparameters'].get(k)!s:>14}" for k in keys)
                     + f"  {r['status']:<10}  {loss:>10}  {r['job_id']}{mark}")
    if sweep.get("best"):
        lines.append(f"  best: {sweep['best']['fine_tuned_model']} (valid loss {sweep['best']['valid_loss']:.5f}); "
                     f"promote it: finetune models promote {sweep['best']['fine_tuned_model']} --alias prod")
    return lines


@click.group("sweeps")
def sweeps() -> None:
    """Hyperparameter sweeps: a grid of jobs run as one Slurm job array, compared by validation loss."""


@sweeps.command("create")
@click.option("--training-file", required=True, help="File id of a processed training dataset.")
@click.option("--validation-file", required=True, help="File id of the validation dataset the runs are compared on.")
@click.option("--model", required=True, help="Base model from the catalog, or your ft:... model to train further.")
@click.option("--grid", "grid", multiple=True, required=True, metavar="KEY=V1,V2,...",
              help="A hyperparameter and its values (repeatable): e.g. --grid learning_rate_multiplier=1,10 "
                   "--grid lora_r=8,16 runs 4 jobs.")
@click.option("--hp", "extra", multiple=True, metavar="KEY=VALUE", help="A hyperparameter every run shares.")
@click.option("--suffix", help="Up to 64 characters of [A-Za-z0-9_.-] in the runs' model names.")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True)
def create(training_file: str, validation_file: str, model: str, grid: tuple[str, ...], extra: tuple[str, ...],
           suffix: str | None, seed: int | None, as_json: bool) -> None:
    """Create a sweep: one job per point of the grid, submitted as ONE Slurm job array."""
    body = {"model": model, "training_file": training_file, "validation_file": validation_file,
            "grid": _parse_grid(grid), "hyperparameters": _parse_hp(extra) or None, "suffix": suffix, "seed": seed}
    obj = call("POST", "/v1/fine_tuning/sweeps", json={k: v for k, v in body.items() if v is not None}).json()
    if as_json:
        _echo_json(obj)
        return
    for line in _table(obj):
        click.echo(line)
    click.echo(f"  follow it: finetune sweeps show {obj['id']}")


@sweeps.command("show")
@click.argument("sweep_id")
@click.option("--json", "as_json", is_flag=True, help="Print the API's sweep object (runs, eval curves, best).")
def show(sweep_id: str, as_json: bool) -> None:
    """A sweep's runs side by side, the best by validation loss marked."""
    obj = call("GET", f"/v1/fine_tuning/sweeps/{sweep_id}").json()
    if as_json:
        _echo_json(obj)
        return
    for line in _table(obj):
        click.echo(line)


@sweeps.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_sweeps(as_json: bool) -> None:
    """Your sweeps, newest first."""
    page = call("GET", "/v1/fine_tuning/sweeps").json()
    rows = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    if not rows:
        click.echo("no sweeps yet: finetune sweeps create --grid ...")
    for s in rows:
        best = (s.get("best") or {}).get("valid_loss")
        click.echo(f"{s['id']}  {s['status']:<10} {len(s['runs'])} runs  array {s.get('slurm_array_id') or '-'}  "
                   f"best valid loss {best if best is None else f'{best:.5f}'}")


@sweeps.command("cancel")
@click.argument("sweep_id")
def cancel(sweep_id: str) -> None:
    """Cancel every unfinished run of the sweep."""
    obj = call("POST", f"/v1/fine_tuning/sweeps/{sweep_id}/cancel").json()
    click.echo(f"{obj['id']}: cancelling {sum(r['status'] == JobState.CANCELLING for r in obj['runs'])} run(s)")
