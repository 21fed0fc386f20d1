"""``finetune models show|bundle|promote|aliases``: one model's record over HTTP (a fine-tuned
model's or checkpoint's lineage included), its reproducibility bundle, and the tenant's aliases."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

import click

from gateway.usercli.client import _echo_json, call


def _lines(record: dict[str, Any]) -> list[str]:
    lin = record.get("lineage") or {}
    if not lin:
        return [f"{record['id']}  (base model, digest {record.get('digest')})"] if "digest" in record else \
            [f"{record['id']}  (no lineage recorded: published before the registry existed)"]
    slurm, ev, trainer = lin.get("slurm") or {}, lin.get("eval") or {}, lin.get("trainer") or {}
    val = lin.get("validation_file")
    versions = ", ".join(f"{k} {v}" for k, v in (trainer.get("versions") or {}).items() if v)
    return [
        record["id"],
        f"  base        {lin['base_model']['name']} ({lin['base_model']['digest']})",
        f"  parent      {lin.get('parent') or '-'}",
        f"  training    {lin['training_file']['id']} sha256:{lin['training_file']['sha256']}",
        f"  validation  {val['id'] + ' sha256:' + val['sha256'] if val else 'held out of the training file'}",
        f"  spec        {lin.get('spec_hash')} (trainer agrees: {'yes' if lin.get('spec_verified') else 'NO'})",
        "  hyperparams " + ", ".join(f"{k}={v}" for k, v in sorted((lin.get("hyperparameters") or {}).items())),
        f"  slurm       job {slurm.get('job_id')}, account {slurm.get('account')}, QOS {slurm.get('qos')}, "
        f"{slurm.get('attempts')} attempt(s), {slurm.get('gpus')} GPU(s) on {slurm.get('nodes')} node(s), "
        f"{slurm.get('training_gpu_seconds')} training GPU-seconds",
        f"  eval loss   before {ev.get('before')}, after {ev.get('after')}",
        f"  trainer     {trainer.get('steps')} steps; {versions}",
        *_checkpoint_lines(record["id"], lin),
    ]


def _checkpoint_lines(model_id: str, lin: dict[str, Any]) -> list[str]:
    ck = lin.get("checkpoint")
    if ck:       # a checkpoint's own record
        return [f"  checkpoint  step {ck['step']}, adapter {ck['adapter_file']} {ck['sha256']}, "
                f"eval loss {ck.get('eval_loss')}"]
    steps = [c["step"] for c in lin.get("checkpoints") or []]
    if not steps:
        return []
    return [f"  checkpoints steps {', '.join(map(str, steps))}: each a model, {model_id}:ckpt-step-<n>"]


@click.command("show")
@click.argument("model_id")
@click.option("--json", "as_json", is_flag=True, help="The whole record: the reproducibility bundle.")
def show_model(model_id: str, as_json: bool) -> None:
    """A model's record: for a fine-tuned model, what it was made from (its lineage)."""
    record = call("GET", f"/v1/models/{quote(model_id, safe=':')}").json()
    if as_json:
        _echo_json(record)
        return
    for line in _lines(record):
        click.echo(line)


@click.command("bundle")
@click.argument("model_id")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), required=True,
              help="Where to write it (JSON).")
def bundle_model(model_id: str, output: str) -> None:
    """Write MODEL_ID's reproducibility bundle: its record (datasets and their sha256s, the spec the
    trainer was given and its hash, versions, Slurm job, evals) and the sha256 of every file it made."""
    import json
    import os

    record = call("GET", f"/v1/models/{quote(model_id, safe=':')}").json()
    lin = record.get("lineage") or {}
    if not lin.get("spec"):
        raise click.ClickException(f"{model_id} has no recorded spec (a base model, or published before "
                                   "the registry kept one)")
    bundle = {"model": record["id"], "record": lin, "spec": lin["spec"], "spec_hash": lin.get("spec_hash"),
              "results": lin.get("results"), "trainer_files": (lin.get("trainer") or {}).get("files")}
    tmp = f"{output}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(bundle, f, indent=2, sort_keys=True)
    os.replace(tmp, output)
    click.echo(f"{output}: {record['id']} (spec {lin.get('spec_hash')})")


@click.command("promote")
@click.argument("model_id")
@click.option("--alias", required=True, help="The alias to move, e.g. prod (one per base model).")
@click.option("--tolerance", type=click.FloatRange(0, 10), default=0.0, show_default=True,
              help="How much worse (eval loss) the candidate may be than the current holder.")
def promote_model(model_id: str, alias: str, tolerance: float) -> None:
    """Point ALIAS at MODEL_ID if its eval is not worse than the holder's (tenant admins; audited)."""
    r = call("POST", "/v1/model_aliases", json={"model": model_id, "alias": alias, "tolerance": tolerance}).json()
    gate = r["gate"]
    was = f"{gate['holder']} (eval loss {gate['holder_loss']})" if gate["holder"] else "nothing"
    click.echo(f"{r['alias']} of {r['base_model']} -> {r['model']} (eval loss {gate['candidate_loss']:.6g}); "
               f"it was {was}")


@click.command("aliases")
@click.option("--json", "as_json", is_flag=True)
def list_aliases(as_json: bool) -> None:
    """Your aliases: which model each name of each base points at."""
    page = call("GET", "/v1/model_aliases").json()
    rows = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    if not rows:
        click.echo("no aliases yet: `finetune models promote ft:... --alias prod`")
    for r in rows:
        click.echo(f"{r['base_model']:20s} {r['alias']:12s} {r['model']}")
