"""The `jobs` group: create, list, show, follow (events and a progress line, polled until the
job ends) and cancel fine-tuning jobs."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import click

from gateway.state import LOCAL_QOS, JobState
from gateway.state import TERMINAL as TERMINAL_STATES
from gateway.usercli.client import Unreachable, _echo_json, _when, call
from trainer.contract.spec import HYPERPARAMETER_BOUNDS, HYPERPARAMETER_DEFAULTS, JOB_BOUNDS, Bounds

TERMINAL = tuple(s.value for s in JobState if s in TERMINAL_STATES)


def _range(bounds: Bounds, whole: bool) -> click.ParamType:
    """A click range from the contract's bounds of a field (the CLI spells none of its own)."""
    if whole:
        return click.IntRange(None if bounds.low is None else int(bounds.low),
                              None if bounds.high is None else int(bounds.high),
                              min_open=bounds.low_open, max_open=bounds.high_open)
    return click.FloatRange(bounds.low, bounds.high, min_open=bounds.low_open, max_open=bounds.high_open)


def _hp_range(name: str) -> click.ParamType:
    """The click range of hyperparameter ``name`` (whole numbers when its default is one)."""
    default = HYPERPARAMETER_DEFAULTS[name]
    return _range(HYPERPARAMETER_BOUNDS[name], isinstance(default, int) and not isinstance(default, bool))


def _parse_hp(pairs: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` pairs; values are JSON when they parse (numbers, true, null), else strings."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{pair!r}: expected KEY=VALUE, e.g. lora_alpha=32", param_hint="--hp")
        try:
            out[key.strip()] = json.loads(raw)
        except ValueError:
            out[key.strip()] = raw
    return out


@click.group("jobs")
def jobs() -> None:
    """Your fine-tuning jobs: create, list, show, follow, cancel."""


_JOB_OPTIONS = [
    click.option("--training-file", required=True, help="File id of a processed training dataset."),
    click.option("--validation-file", help="File id of a processed validation dataset."),
    click.option("--model", required=True,
                 help="Base model from the catalog (`finetune models list`), or your ft:... model to train further."),
    click.option("--method", type=click.Choice(["supervised", "dpo"]), default="supervised", show_default=True,
                 help="supervised: chat data (SFT); dpo: preference pairs (input, preferred_output, "
                      "non_preferred_output)."),
    click.option("--beta", type=_hp_range("beta"),
                 help="DPO only: how strongly the policy is held to the reference "
                      f"(default {HYPERPARAMETER_DEFAULTS['beta']})."),
    click.option("--epochs", type=_hp_range("epochs"),
                 help="Passes over the file (default: chosen from its size, as OpenAI's \"auto\")."),
    click.option("--learning-rate-multiplier", type=click.FloatRange(min=0, min_open=True),
                 help="Times our base LoRA learning rate (default: chosen from the step size and the model)."),
    click.option("--lora-r", type=_hp_range("lora_r")),
    click.option("--batch-size-tokens", type=_hp_range("batch_size_tokens"),
                 help="Tokens per optimizer step (default: chosen from the file's size and example length)."),
    click.option("--max-seq-len", type=_hp_range("max_seq_len")),
    click.option("--suffix", help="Up to 64 characters of [A-Za-z0-9_.-] in the fine-tuned model's name."),
    click.option("--seed", type=click.IntRange(0, 2**31 - 1)),
    click.option("--gpus", type=_range(JOB_BOUNDS["world_size"], whole=True),
                 help="GPUs in all, one trainer rank each (default 1)."),
    click.option("--nodes", type=click.IntRange(1, 1024), help="Nodes to spread the GPUs over (default 1)."),
    click.option("--fsdp", is_flag=True,
                 help="Shard the model over the GPUs (FSDP): for a base too large for one GPU."),
    click.option("--time", "time_limit", type=click.IntRange(1, 365 * 24 * 60), metavar="MINUTES",
                 help="The job's time limit, instead of the estimate's (a slow machine, a job that timed out)."),
    click.option("--from-checkpoint", metavar="JOB_ID[:STEP]",
                 help="Continue from that job's checkpoint (its newest without STEP; `finetune jobs checkpoints`)."),
    click.option("--hp", "extra", multiple=True, metavar="KEY=VALUE", help="Any other hyperparameter (repeatable)."),
    click.option("--json", "as_json", is_flag=True),
]


def _job_options(f: Any) -> Any:
    """The options `create` and `estimate` share (one job's request)."""
    for option in reversed(_JOB_OPTIONS):
        f = option(f)
    return f


def _job_body(training_file: str, validation_file: str | None, model: str, method: str, beta: float | None,
              epochs: int | None,
              learning_rate_multiplier: float | None, lora_r: int | None, batch_size_tokens: int | None,
              max_seq_len: int | None, suffix: str | None, seed: int | None, gpus: int | None, nodes: int | None,
              fsdp: bool, from_checkpoint: str | None, extra: tuple[str, ...],
              time_limit: int | None = None) -> dict[str, Any]:
    named = {"n_epochs": epochs, "learning_rate_multiplier": learning_rate_multiplier, "lora_r": lora_r,
             "batch_size_tokens": batch_size_tokens, "max_seq_len": max_seq_len}
    hp = {**{k: v for k, v in named.items() if v is not None}, **_parse_hp(extra)}
    if beta is not None and method != "dpo":
        raise click.UsageError("--beta is a DPO hyperparameter: add --method dpo")
    if beta is not None:
        hp["beta"] = beta
    for option, value in (("--training-file", training_file), ("--validation-file", validation_file)):
        if value is not None and not value.startswith("file-") and os.path.exists(value):
            raise click.UsageError(f"{option} {value} is a path on this machine, not a file id: did you mean "
                                   f"`finetune files upload {value}`? Then give the file id it prints (file-...)")
    body = {"model": model, "training_file": training_file, "validation_file": validation_file,
            "hyperparameters": (hp or None) if method == "supervised" else None,
            "method": {"type": "dpo", "dpo": {"hyperparameters": hp}} if method == "dpo" else None,
            "suffix": suffix, "seed": seed,
            "resources": ({"gpus": gpus or 1, "nodes": nodes or 1, "fsdp": fsdp,
                           **({"time_limit_minutes": time_limit} if time_limit else {})}
                          if gpus or nodes or fsdp or time_limit else None),
            "from_checkpoint": from_checkpoint}
    return {k: v for k, v in body.items() if v is not None}


@jobs.command("create")
@_job_options
@click.option("--idempotency-key", help="Sending the same key again returns the same job.")
def create_job(idempotency_key: str | None, as_json: bool, **request: Any) -> None:
    """Create a fine-tuning job; it is submitted at once (to Slurm; in local mode it starts on this machine)."""
    body = _job_body(**request)
    obj = call("POST", "/v1/fine_tuning/jobs", json=body,
               headers={"Idempotency-Key": idempotency_key} if idempotency_key else None).json()
    if as_json:
        _echo_json(obj)
        return
    if obj.get("qos") == LOCAL_QOS:            # local mode: no Slurm words (issue 35)
        where = f"local job {obj['slurm_job_id']} on this machine"
    else:
        where = f"Slurm job {obj['slurm_job_id']}, QOS {obj['qos']}" if obj.get("slurm_job_id") else "not on Slurm"
    click.echo(f"{obj['id']}  {obj['status']}  ({where})")
    if obj.get("error"):
        click.echo(f"  error: {obj['error'].get('message')}")
        raise SystemExit(1)
    click.echo(f"  follow it: finetune jobs follow {obj['id']}")


@jobs.command("estimate")
@_job_options
def estimate_job(as_json: bool, **request: Any) -> None:
    """What a job would take and when it would start, without creating it (a dry run of `create`)."""
    est = call("POST", "/v1/fine_tuning/jobs/estimate", json=_job_body(**request)).json()
    if as_json:
        _echo_json(est)
        return
    secs = int(est.get("expected_seconds") or est["expected_minutes"] * 60)
    took = f"{secs // 60} min {secs % 60:02d} s" if secs >= 60 else f"{secs} s"
    speed = est.get("speed") or {}
    basis = (f"measured on {speed.get('jobs')} earlier jobs of this model: {speed.get('overhead_s')} s to start "
             f"and finish, {speed.get('tokens_per_s'):,} tokens/s" if speed.get("source") == "measured"
             else "the site's guess: no jobs of this model measured yet")
    click.echo(f"~{est['estimated_tokens']:,} training tokens on {est['gpus']} GPU(s): about "
               f"{took} ({est['gpu_hours']} GPU-hours; {basis}), time limit {est['time_limit_minutes']} min")
    if hp := est.get("hyperparameters"):     # what "auto" chose, as the job would show it
        click.echo(f"hyperparameters: n_epochs {hp.get('n_epochs')}, batch_size {hp.get('batch_size')} "
                   f"(batch_size_tokens {hp.get('batch_size_tokens')}), learning_rate_multiplier "
                   f"{hp.get('learning_rate_multiplier')} (learning_rate {hp.get('learning_rate')})")
    memory = est.get("memory")
    if memory:
        limit = f" of {memory['limit_gib']} GiB" if memory.get("limit_gib") else ""
        fits = {True: "fits", False: "does NOT fit", None: "not checked"}[memory.get("fits")]
        click.echo(f"memory: ~{memory['per_gpu_gib']} GiB per {'GPU' if memory['device'] == 'cuda' else 'rank'}"
                   f"{limit} ({fits})")
    for warning in est.get("warnings") or []:
        click.echo(f"warning: {warning}")
    if "qos" in est:
        start = est.get("expected_start")
        when = "now" if start is not None and start <= time.time() + 5 else _when(start) if start else "unknown"
        click.echo(f"QOS {est['qos']}; expected start: {when}")
        if est.get("start_reason"):
            click.echo(f"  why later: {est['start_reason']}: {est['start_detail']}")


def _metadata_pair(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    pairs = {}
    for v in values:
        key, eq, value = v.partition("=")
        if not eq or not key:
            raise click.BadParameter(f"{v!r}: give KEY=VALUE", ctx=ctx, param=param)
        pairs[key] = value
    return pairs


def _fit(text: str, width: int) -> str:
    """``text`` in ``width`` columns: cut with an ellipsis when longer (a long model name keeps the table)."""
    return text if len(text) <= width else text[:width - 1] + "…"


@jobs.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
@click.option("--after", metavar="JOB_ID", help="Continue after this job (the last one of the previous page).")
@click.option("--metadata", "metadata", multiple=True, metavar="KEY=VALUE", callback=_metadata_pair,
              help="Only jobs whose metadata has this value (repeat for several; OpenAI's metadata filter).")
@click.option("--json", "as_json", is_flag=True, help="Print the API's list object (data, has_more).")
def list_jobs(limit: int, after: str | None, metadata: dict[str, str], as_json: bool) -> None:
    """Your jobs, newest first, one page at a time."""
    params: dict[str, Any] = {"limit": limit, **({"after": after} if after else {}),
                              **{f"metadata[{k}]": v for k, v in metadata.items()}}
    page = call("GET", "/v1/fine_tuning/jobs", params=params).json()
    if as_json:
        _echo_json(page)
        return
    if not page["data"]:
        click.echo("no jobs match those metadata values" if metadata else
                   "no jobs yet: `finetune jobs create --training-file FILE_ID --model MODEL`")
        return
    click.echo(f"{'ID':<30}  {'CREATED':<16}  {'STATUS':<20}  {'MODEL':<14}  FINE-TUNED MODEL")
    for j in page["data"]:
        phase = f"/{j['phase']}" if j.get("phase") and j["status"] == JobState.RUNNING else ""
        click.echo(f"{j['id']:<30}  {_when(j['created_at']):<16}  {j['status'] + phase:<20}  "
                   f"{_fit(j['model'], 14):<14}  {j.get('fine_tuned_model') or ''}")
    if page.get("has_more"):
        click.echo(f"more: finetune jobs list --after {page['data'][-1]['id']}")


def progress_line(job: dict[str, Any], now: float | None = None) -> str:
    """One line: status/phase, step/total, loss, tokens/s, ETA (from estimated_finish)."""
    p = job.get("progress") or {}
    parts = [job["status"] + (f"/{job['phase']}" if job.get("phase") and job["status"] == JobState.RUNNING else "")]
    if p.get("step") is not None and p.get("total_steps"):
        parts.append(f"step {p['step']}/{p['total_steps']} ({100 * p['step'] // max(1, p['total_steps'])}%)")
    if isinstance(p.get("loss"), int | float):
        parts.append(f"loss {p['loss']:.4f}")
    if isinstance(p.get("tokens_per_s"), int | float):
        parts.append(f"{p['tokens_per_s']:,.0f} tok/s")
    if job.get("estimated_finish"):
        left = max(0, int(job["estimated_finish"] - (time.time() if now is None else now)))
        parts.append(f"ETA {left // 60}m{left % 60:02d}s")
    return "  ".join(parts)


def _method_settings(j: dict[str, Any]) -> dict[str, Any]:
    """The job's ``method.<type>`` object (its hyperparameters)."""
    method = j.get("method") or {}
    settings = method.get(method.get("type") or "supervised")
    return settings if isinstance(settings, dict) else {}


def _freed(j: dict[str, Any]) -> str | None:
    """What the gateway removed of the job's storage (``progress.storage``): bytes, and the checkpoints kept."""
    rec = (j.get("progress") or {}).get("storage") or {}
    if not isinstance(rec, dict) or not isinstance(rec.get("freed_bytes"), int):
        return None
    kept = rec.get("kept_steps")
    return f"{rec['freed_bytes']} bytes" + (f" (checkpoints kept: steps {', '.join(map(str, kept)) or 'none'})"
                                            if isinstance(kept, list) else "")


OPENAI_NAMES = {"n_epochs": "epochs", "learning_rate_multiplier": "learning_rate", "batch_size": "batch_size_tokens"}
"""OpenAI's hyperparameter names and ours, which `jobs show` prints instead (one name per value)."""


def _hyperparameters(j: dict[str, Any]) -> str | None:
    """The job's hyperparameters once each, by our names (OpenAI's only where ours are absent)."""
    hp = dict(_method_settings(j).get("hyperparameters") or {})
    for theirs, ours in OPENAI_NAMES.items():
        if ours in hp:
            hp.pop(theirs, None)
    return ", ".join(f"{k}={v}" for k, v in sorted(hp.items())) or None


def _evals(j: dict[str, Any]) -> str | None:
    """Validation loss before training -> after it (and at its best step when that differs)."""
    evals = [e for e in ((j.get("progress") or {}).get("evals") or []) if isinstance(e.get("loss"), int | float)]
    if not evals:
        return None
    before = next((e for e in evals if e.get("when") == "before"), None)
    after = next((e for e in reversed(evals) if e.get("when") == "after"), evals[-1])
    text = f"{before['loss']:.4f} -> " if before is not None else ""
    return f"{text}{after['loss']:.4f} (step {after.get('step')})"


def _duration(j: dict[str, Any]) -> str | None:
    """How long it took from creation to its end."""
    start, end = j.get("created_at"), j.get("finished_at")
    if not start or not end:
        return None
    secs = int(end - start)
    hours = f"{secs // 3600}h" if secs >= 3600 else ""
    return f"{hours}{secs % 3600 // 60}m{secs % 60:02d}s"


def _result_names(j: dict[str, Any]) -> str | None:
    """The job's result files as ``file-id (name)``."""
    names = []
    for fid in j.get("result_files") or []:
        try:
            name = call("GET", f"/v1/files/{fid}").json().get("filename", "?")
        except click.ClickException:
            name = "?"
        names.append(f"{fid} ({str(name).removeprefix(j['id'] + '-')})")
    return ", ".join(names) or None


def _continuable(j: dict[str, Any]) -> str | None:
    """For a job that ended without a model: the checkpoints it kept as adapters, and how to go on."""
    if j["status"] not in (JobState.FAILED, JobState.CANCELLED):
        return None
    try:
        cks = call("GET", f"/v1/fine_tuning/jobs/{j['id']}/checkpoints", params={"limit": 100}).json()["data"]
    except click.ClickException:
        return None
    steps = sorted(c["step_number"] for c in cks if c.get("adapter_file"))
    if not steps:
        return None
    return (f"step {', '.join(map(str, steps))}: `finetune jobs create --from-checkpoint {j['id']} ...` "
            f"goes on from step {steps[-1]}")


def _show_text(j: dict[str, Any]) -> None:
    rows = [("status", progress_line(j)), ("model", j["model"]),
            ("fine-tuned model", j.get("fine_tuned_model")), ("training file", j["training_file"]),
            ("validation file", j.get("validation_file")), ("slurm job", j.get("slurm_job_id")),
            ("attempt", j.get("attempt")), ("qos", j.get("qos")), ("created", _when(j.get("created_at"))),
            ("finished", _when(j.get("finished_at"))), ("took", _duration(j)),
            ("trained tokens", j.get("trained_tokens")), ("eval loss", _evals(j)),
            ("cleanup", j.get("cleanup")), ("result files", _result_names(j)),
            ("continue from", _continuable(j)),
            ("storage freed", _freed(j)),
            ("method", (j.get("method") or {}).get("type")),
            ("hyperparameters", _hyperparameters(j))]
    click.echo(j["id"])
    for name, value in rows:
        if value not in (None, ""):
            click.echo(f"  {name + ':':<17} {value}")
    if j.get("error"):
        click.echo(f"  error:            [{j['error'].get('code')}] {j['error'].get('message')}")


@jobs.command("show")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
def show_job(job_id: str, as_json: bool) -> None:
    """One job: status, phase, progress, Slurm id, results, error."""
    obj = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
    _echo_json(obj) if as_json else _show_text(obj)


def _event_num(ev: dict[str, Any]) -> int:
    return int(str(ev["id"]).removeprefix("ftevent-"))


def new_events(job_id: str, last: int) -> list[dict[str, Any]]:
    """Events with an id above ``last``, oldest first. The API lists newest first and pages
    towards older ones with ``after``, so page back until ``last`` is reached."""
    out: list[dict[str, Any]] = []
    params: dict[str, Any] = {"limit": 100}
    while True:
        page = call("GET", f"/v1/fine_tuning/jobs/{job_id}/events", params=params).json()
        fresh = [e for e in page["data"] if _event_num(e) > last]
        out.extend(fresh)
        if len(fresh) < len(page["data"]) or not page.get("has_more") or not fresh:
            return sorted(out, key=_event_num)
        params["after"] = fresh[-1]["id"]


class _Display:
    """Events as lines; on a terminal the progress line is redrawn below them, elsewhere
    it is printed (prefixed ``>``) whenever it changes."""

    def __init__(self, as_json: bool):
        self.as_json, self.tty, self.line = as_json, sys.stdout.isatty(), ""

    def event(self, ev: dict[str, Any]) -> None:
        if self.as_json:
            click.echo(json.dumps(ev))
            return
        level = "" if ev.get("level") == "info" else f"[{str(ev.get('level')).upper()}] "
        click.echo(f"{self._erase()}{_when(ev.get('created_at'))}  {level}{ev['message']}")
        if self.tty:
            click.echo(self.line, nl=False)

    def progress(self, text: str) -> None:
        if not self.as_json and text != self.line:
            click.echo(self._erase() + (text if self.tty else f"  > {text}"), nl=not self.tty)
            self.line = text

    def _erase(self) -> str:
        return "\r\033[K" if self.tty and self.line else ""

    def close(self) -> None:
        if self.tty and self.line and not self.as_json:
            click.echo("")


def _poll(job_id: str, last: int, retry_s: float) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(job, new events); a gateway that stops answering is retried for ``retry_s``."""
    deadline = time.monotonic() + retry_s
    while True:
        try:
            job = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
            return job, new_events(job_id, last)   # after the job: a final state's events are in
        except Unreachable:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


@jobs.command("follow")
@click.argument("job_id")
@click.option("--interval", type=click.FloatRange(0.2, 60), default=1.0, show_default=True,
              help="Seconds between polls.")
@click.option("--json", "as_json", is_flag=True, help="Print events as JSON lines, then the final job.")
def follow(job_id: str, interval: float, as_json: bool) -> None:
    """Stream a job's events and progress until it ends. Exit 0 if it succeeded, 1 otherwise."""
    display, last = _Display(as_json), -1
    retry_s = 0.0        # a gateway that never answered: say so now; one that stops answering later: retried
    try:
        while True:
            job, events = _poll(job_id, last, retry_s=retry_s)
            retry_s = 60.0
            for ev in events:
                display.event(ev)
                last = _event_num(ev)
            display.progress(progress_line(job))
            if job["status"] in TERMINAL:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        display.close()
        click.echo(f"stopped following; the job goes on (finetune jobs cancel {job_id})", err=True)
        raise SystemExit(130) from None
    display.close()
    _finish(job, as_json)


def _finish(job: dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(job))
    elif job["status"] == JobState.SUCCEEDED:
        click.echo(f"succeeded: {job['fine_tuned_model']}\n"
                   f"  download: finetune artifacts download {job['id']} --extract")
    elif job.get("error"):
        click.echo(f"{job['status']}: [{job['error'].get('code')}] {job['error'].get('message')}", err=True)
    else:
        click.echo(job["status"], err=True)
    if job["status"] != JobState.SUCCEEDED:
        raise SystemExit(1)


@jobs.command("checkpoints")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True, help="Print the API's list object.")
def checkpoints(job_id: str, as_json: bool) -> None:
    """A job's checkpoints, newest first. Once the job ends (succeeded, failed, timed out or
    cancelled), each complete one it kept is a model of its own: download its adapter file, or
    train further from it (`--model` or `--from-checkpoint`)."""
    page = call("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 100}).json()
    if as_json:
        _echo_json(page)
        return
    if not page["data"]:
        click.echo("no checkpoints")
    for c in page["data"]:
        loss = c["metrics"].get("train_loss")
        click.echo(f"step {c['step_number']:>6}  train loss {loss if loss is None else f'{loss:.4f}'}  "
                   f"{c['fine_tuned_model_checkpoint'] if c.get('adapter_file') else '(not published)'}"
                   f"{'  adapter ' + c['adapter_file'] if c.get('adapter_file') else ''}")


@jobs.command("pause")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
def pause(job_id: str, as_json: bool) -> None:
    """Pause a queued or running job: it checkpoints, leaves its GPU and waits, held, for `resume`."""
    obj = call("POST", f"/v1/fine_tuning/jobs/{job_id}/pause").json()
    if as_json:
        _echo_json(obj)
    else:
        click.echo(f"{job_id}: paused (resume with `finetune jobs resume {job_id}`)")


@jobs.command("resume")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
def resume(job_id: str, as_json: bool) -> None:
    """Resume a paused job: queued again, it continues from its last checkpoint."""
    obj = call("POST", f"/v1/fine_tuning/jobs/{job_id}/resume").json()
    if as_json:
        _echo_json(obj)
    else:
        click.echo(f"{job_id}: {obj['status']}; it continues from its last checkpoint when Slurm starts it")


@jobs.command("cancel")
@click.argument("job_id")
@click.option("--wait", is_flag=True, help="Wait until Slurm confirms the job stopped.")
@click.option("--json", "as_json", is_flag=True)
def cancel(job_id: str, wait: bool, as_json: bool) -> None:
    """Cancel a job: `cancelling` at once, `cancelled` once Slurm confirms. A finished job is an error."""
    obj = call("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    started = time.monotonic()
    if wait and obj["status"] not in TERMINAL and not as_json:
        click.echo(f"{job_id}: {obj['status']}; waiting until nothing of it runs...", err=True)
    said = 0.0
    while wait and obj["status"] not in TERMINAL:
        time.sleep(0.5)
        obj = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
        waited = time.monotonic() - started
        if not as_json and waited - said >= 5:       # a line every 5 s: the wait is alive (issue 35)
            said = waited
            why = " (its trainer is checkpointing and stopping)" if obj["status"] == JobState.CANCELLING else ""
            click.echo(f"  {waited:.0f}s: {obj['status']}{why}", err=True)
    if as_json:
        _echo_json(obj)
    elif obj["status"] == JobState.CANCELLED:
        click.echo(f"{job_id}: cancelled")
    else:
        click.echo(f"{job_id}: {obj['status']} (Slurm is stopping it; `finetune jobs show {job_id}`)")
