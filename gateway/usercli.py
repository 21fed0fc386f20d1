"""Tenant-facing CLI commands: they talk to the gateway over HTTP, never to the DB."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

import click
import httpx

from gateway.config import get_settings
from gateway.jobstate import TERMINAL as TERMINAL_STATES
from gateway.jobstate import JobState


def _credentials_path() -> Path:
    return get_settings().credentials_file.expanduser()


def connection() -> tuple[str, str]:
    """(base URL, token) from SFT_API_URL/SFT_API_TOKEN or `finetune login`."""
    s = get_settings()
    url, token = s.api_url, s.api_token
    if not (url and token):
        try:
            saved = json.loads(_credentials_path().read_text())
            url, token = url or saved["url"], token or saved["token"]
        except (OSError, ValueError, KeyError) as e:
            raise click.ClickException("not logged in: run `finetune login --url URL --token TOKEN` "
                                       "or set SFT_API_URL and SFT_API_TOKEN") from e
    return url.rstrip("/"), token


class Unreachable(click.ClickException):
    """The gateway did not answer (connection refused, timeout): worth a retry."""


def _raise_for_status(r: httpx.Response) -> None:
    if r.status_code >= 400:
        try:
            msg = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            msg = r.text[:500]
        raise click.ClickException(f"{r.status_code}: {msg}")


def call(method: str, path: str, *, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
    """One request to the gateway. Raises ClickException with the server's message on
    an error status, Unreachable when the gateway does not answer."""
    url, token = connection()
    try:
        r = httpx.request(method, url + path, headers={"Authorization": f"Bearer {token}", **(headers or {})},
                          timeout=httpx.Timeout(600, connect=10), **kwargs)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach the gateway at {url}: {e}") from e
    _raise_for_status(r)
    return r


@click.command("login")
@click.option("--url", required=True, help="Gateway base URL, e.g. http://127.0.0.1:8000")
@click.option("--token", prompt=True, hide_input=True, help="Your API token.")
def login(url: str, token: str) -> None:
    """Save the gateway URL and your token (file mode 0600)."""
    click.echo(f"saved credentials for {url} in {save_credentials(url, token)}")


def saved_url() -> str | None:
    """The gateway URL `finetune login` saved, if any."""
    try:
        url = json.loads(_credentials_path().read_text()).get("url")
    except (OSError, ValueError, AttributeError):
        return None
    return url if isinstance(url, str) else None


def save_credentials(url: str, token: str) -> Path:
    """Write what `finetune login` saves (0600, replaced atomically); return the file's path."""
    path = _credentials_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"url": url, "token": token}, f)
    os.replace(tmp, path)
    return path


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
    v = obj.get("validation") or {}
    stats = v.get("stats") or {}
    click.echo(f"{obj['id']}  {obj['filename']}  {obj['bytes']} bytes  status: {obj['status']}")
    tok = stats.get("tokens")
    if tok:
        click.echo(f"  {stats.get('examples')} examples, {tok['total']} tokens "
                   f"(p50 {tok['p50']}, p95 {tok['p95']}, max {tok['max']}; assistant {tok['assistant']}), "
                   f"~{stats.get('estimated_training_tokens')} tokens for {stats.get('estimated_epochs')} epochs")
    else:
        click.echo(f"  {stats.get('examples', 0)} examples")
    for kind, n in sorted((v.get("error_counts") or {}).items()):
        click.echo(f"  ERROR {kind}: {n}")
    for e in v.get("errors") or []:
        where = f"line {e['line']}" if e.get("line") else "file"
        click.echo(f"    {where}: [{e['kind']}] {e['message']}")
    for kind, n in sorted((v.get("warning_counts") or {}).items()):
        click.echo(f"  warning {kind}: {n}")


@files.command("upload")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--model", help="Base model whose tokenizer checks the lengths (default: the gateway's).")
@click.option("--json", "as_json", is_flag=True)
def upload(path: Path, model: str | None, as_json: bool) -> None:
    """Upload a chat JSONL dataset; print its validation report. Exit 1 if it has errors."""
    size = path.stat().st_size
    with open(path, "rb") as f, click.progressbar(length=size, label=f"uploading {path.name}",
                                                  file=None if not as_json else open(os.devnull, "w")) as bar:
        r = call("POST", "/v1/files", params={"model": model} if model else None,
                 data={"purpose": "fine-tune"}, files={"file": (path.name, _Progress(f, bar))})
    obj = r.json()
    click.echo(json.dumps(obj, indent=2)) if as_json else print_report(obj)
    if obj["status"] != "processed":
        raise SystemExit(1)


@files.command("list")
@click.option("--json", "as_json", is_flag=True)
def list_files(as_json: bool) -> None:
    """Your files, newest first."""
    data = call("GET", "/v1/files").json()["data"]
    if as_json:
        click.echo(json.dumps(data, indent=2))
        return
    for o in data:
        click.echo(f"{o['id']}  {o['status']:<10} {o['bytes']:>12}  {o['filename']}")


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


# ------------------------------------------------------------------------- jobs
TERMINAL = tuple(s.value for s in JobState if s in TERMINAL_STATES)


def _echo_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2))


def _when(ts: int | None) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%d %H:%M:%SZ") if ts else "-"


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


@jobs.command("create")
@click.option("--training-file", required=True, help="File id of a processed training dataset.")
@click.option("--validation-file", help="File id of a processed validation dataset.")
@click.option("--model", required=True, help="Base model from the catalog (`finetune models list`).")
@click.option("--epochs", type=click.IntRange(1, 100))
@click.option("--learning-rate-multiplier", type=click.FloatRange(min=0, min_open=True))
@click.option("--lora-r", type=click.IntRange(1, 1024))
@click.option("--batch-size-tokens", type=click.IntRange(16))
@click.option("--max-seq-len", type=click.IntRange(8))
@click.option("--suffix", help="Up to 64 characters of [A-Za-z0-9_.-] in the fine-tuned model's name.")
@click.option("--seed", type=click.IntRange(0, 2**31 - 1))
@click.option("--idempotency-key", help="Sending the same key again returns the same job.")
@click.option("--hp", "extra", multiple=True, metavar="KEY=VALUE", help="Any other hyperparameter (repeatable).")
@click.option("--json", "as_json", is_flag=True)
def create_job(training_file: str, validation_file: str | None, model: str, epochs: int | None,
               learning_rate_multiplier: float | None, lora_r: int | None, batch_size_tokens: int | None,
               max_seq_len: int | None, suffix: str | None, seed: int | None, idempotency_key: str | None,
               extra: tuple[str, ...], as_json: bool) -> None:
    """Create a fine-tuning job; it is queued on Slurm at once."""
    named = {"n_epochs": epochs, "learning_rate_multiplier": learning_rate_multiplier, "lora_r": lora_r,
             "batch_size_tokens": batch_size_tokens, "max_seq_len": max_seq_len}
    hp = {**{k: v for k, v in named.items() if v is not None}, **_parse_hp(extra)}
    body = {"model": model, "training_file": training_file, "validation_file": validation_file,
            "hyperparameters": hp or None, "suffix": suffix, "seed": seed}
    obj = call("POST", "/v1/fine_tuning/jobs", json={k: v for k, v in body.items() if v is not None},
               headers={"Idempotency-Key": idempotency_key} if idempotency_key else None).json()
    if as_json:
        _echo_json(obj)
        return
    where = f"Slurm job {obj['slurm_job_id']}, QOS {obj['qos']}" if obj.get("slurm_job_id") else "not on Slurm"
    click.echo(f"{obj['id']}  {obj['status']}  ({where})")
    if obj.get("error"):
        click.echo(f"  error: {obj['error'].get('message')}")
        raise SystemExit(1)
    click.echo(f"  follow it: finetune jobs follow {obj['id']}")


@jobs.command("list")
@click.option("--limit", type=click.IntRange(1, 100), default=20, show_default=True)
@click.option("--after", metavar="JOB_ID", help="Continue after this job (the last one of the previous page).")
@click.option("--json", "as_json", is_flag=True, help="Print the API's list object (data, has_more).")
def list_jobs(limit: int, after: str | None, as_json: bool) -> None:
    """Your jobs, newest first, one page at a time."""
    params: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
    page = call("GET", "/v1/fine_tuning/jobs", params=params).json()
    if as_json:
        _echo_json(page)
        return
    if not page["data"]:
        click.echo("no jobs yet: `finetune jobs create --training-file FILE_ID --model MODEL`")
    for j in page["data"]:
        phase = f"/{j['phase']}" if j.get("phase") and j["status"] == JobState.RUNNING else ""
        click.echo(f"{j['id']}  {_when(j['created_at'])}  {j['status'] + phase:<20} {j['model']:<14} "
                   f"{j.get('fine_tuned_model') or ''}")
    if page.get("has_more") and page["data"]:
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


def _show_text(j: dict[str, Any]) -> None:
    rows = [("status", progress_line(j)), ("model", j["model"]),
            ("fine-tuned model", j.get("fine_tuned_model")), ("training file", j["training_file"]),
            ("validation file", j.get("validation_file")), ("slurm job", j.get("slurm_job_id")),
            ("attempt", j.get("attempt")), ("qos", j.get("qos")), ("created", _when(j.get("created_at"))),
            ("finished", _when(j.get("finished_at"))), ("trained tokens", j.get("trained_tokens")),
            ("cleanup", j.get("cleanup")), ("result files", ", ".join(j.get("result_files") or []) or None),
            ("hyperparameters", json.dumps((j.get("method") or {}).get("supervised", {}).get("hyperparameters")))]
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
    try:
        while True:
            job, events = _poll(job_id, last, retry_s=60)
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


@jobs.command("cancel")
@click.argument("job_id")
@click.option("--wait", is_flag=True, help="Wait until Slurm confirms the job stopped.")
@click.option("--json", "as_json", is_flag=True)
def cancel(job_id: str, wait: bool, as_json: bool) -> None:
    """Cancel a job: `cancelling` at once, `cancelled` once Slurm confirms. A finished job is an error."""
    obj = call("POST", f"/v1/fine_tuning/jobs/{job_id}/cancel").json()
    while wait and obj["status"] not in TERMINAL:
        time.sleep(0.5)
        obj = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
    if as_json:
        _echo_json(obj)
    elif obj["status"] == JobState.CANCELLED:
        click.echo(f"{job_id}: cancelled")
    else:
        click.echo(f"{job_id}: {obj['status']} (Slurm is stopping it; `finetune jobs show {job_id}`)")


# -------------------------------------------------------------------- artifacts
@click.group("artifacts")
def artifacts() -> None:
    """Results of your finished jobs: adapter, eval.json, metrics.csv."""


def _stream_to(path: str, dest: Path, expected: int | None) -> int:
    """Download ``path`` into ``dest`` atomically (temp file, fsync, rename); returns bytes."""
    url, token = connection()
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    size = 0
    try:
        with httpx.stream("GET", url + path, headers={"Authorization": f"Bearer {token}"},
                          timeout=httpx.Timeout(600, connect=10)) as r:
            if r.status_code >= 400:
                r.read()
                _raise_for_status(r)
            with open(tmp, "wb") as f:
                for block in r.iter_bytes(1 << 20):
                    f.write(block)
                    size += len(block)
                f.flush()
                os.fsync(f.fileno())
        if expected is not None and size != expected:
            raise click.ClickException(f"{dest.name}: got {size} bytes, expected {expected}: retry the download")
        os.replace(tmp, dest)
    except httpx.HTTPError as e:
        raise Unreachable(f"download of {dest.name} from {url} failed: {e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return size


def extract_adapter(tar_path: Path, dest: Path) -> Path:
    """Unpack the adapter tar (members ``<job id>/<file>``) into ``dest``, atomically.
    Only plain files with plain names are accepted; raises ClickException otherwise."""
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        with tarfile.open(tar_path) as tar:
            for m in tar.getmembers():
                name = PurePosixPath(m.name).name
                if not m.isfile() or name in ("", ".", "..") or ".." in PurePosixPath(m.name).parts:
                    raise click.ClickException(f"{tar_path}: unexpected member {m.name!r}; not extracted")
                src = tar.extractfile(m)
                assert src is not None
                with src, open(tmp / name, "wb") as out:
                    shutil.copyfileobj(src, out)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


@artifacts.command("download")
@click.argument("job_id")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the files (default: ./JOB_ID/).")
@click.option("--extract", is_flag=True, help="Also unpack adapter.tar into DIR/adapter/ (loadable with PEFT).")
@click.option("--json", "as_json", is_flag=True)
def download(job_id: str, out_dir: Path | None, extract: bool, as_json: bool) -> None:
    """Download a job's result files; print where they are."""
    job = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
    if not job.get("result_files"):
        raise click.ClickException(f"job {job_id} has no result files (status: {job['status']}); "
                                   "results appear once a job has succeeded")
    out = out_dir or Path(job_id)
    out.mkdir(parents=True, exist_ok=True)
    got = []
    for fid in job["result_files"]:
        meta = call("GET", f"/v1/files/{fid}").json()
        name = Path(str(meta["filename"]).removeprefix(f"{job_id}-")).name or fid
        dest = out / name
        size = _stream_to(f"/v1/files/{fid}/content", dest, meta.get("bytes"))
        got.append({"id": fid, "name": name, "path": str(dest.resolve()), "bytes": size})
    adapter = None
    if extract:
        tar = next((out / g["name"] for g in got if g["name"] == "adapter.tar"), None)
        if tar is None:
            raise click.ClickException(f"job {job_id} has no adapter.tar among its result files")
        adapter = str(extract_adapter(tar, out / "adapter").resolve())
    if as_json:
        _echo_json({"job": job_id, "fine_tuned_model": job.get("fine_tuned_model"), "dir": str(out.resolve()),
                    "files": got, "adapter_dir": adapter})
        return
    for g in got:
        click.echo(f"{g['path']}  ({g['bytes']} bytes)")
    if adapter:
        click.echo(f"{adapter}/  (PeftModel.from_pretrained(base, {adapter!r}))")


# ----------------------------------------------------------------- staff access
def _request_line(r: dict[str, Any]) -> str:
    expires = f"  until {_when(r['expires_at'])}" if r.get("expires_at") else ""
    return (f"{r['id']}  {r['state']:<8} {r.get('tenant') or '-':<12} {r['resource']:<40} "
            f"{r['duration_s'] // 60} min{expires}  {r['reason'][:60]}")


@click.group("staff")
def staff() -> None:
    """Support staff: ask a tenant for time-bounded access to one resource (staff/sysadmin tokens)."""


@staff.command("request")
@click.option("--tenant", required=True, help="The tenant that owns the resource.")
@click.option("--resource", required=True, metavar="job:ID|file:ID", help="Exactly one job or file.")
@click.option("--reason", required=True, help="Why you need it; the tenant's admin reads this.")
@click.option("--duration", default="2h", show_default=True,
              help="How long the grant lasts once approved (30m, 2h, 1d).")
@click.option("--json", "as_json", is_flag=True)
def staff_request(tenant: str, resource: str, reason: str, duration: str, as_json: bool) -> None:
    """Ask for access; it stays pending until the tenant's admin approves or denies it."""
    obj = call("POST", "/v1/staff/access-requests",
               json={"tenant": tenant, "resource": resource, "reason": reason, "duration": duration}).json()
    if as_json:
        _echo_json(obj)
        return
    click.echo(f"{obj['id']}: {obj['state']}; the admin of {tenant} approves it with "
               f"`finetune access approve {obj['id']}`")


def _print_requests(path: str, as_json: bool) -> None:
    data = call("GET", path).json()["data"]
    if as_json:
        _echo_json(data)
        return
    for r in data:
        click.echo(_request_line(r))


@staff.command("list")
@click.option("--json", "as_json", is_flag=True)
def staff_list(as_json: bool) -> None:
    """Your access requests and their state now (pending, active, expired, denied, revoked)."""
    _print_requests("/v1/staff/access-requests", as_json)


@click.group("access")
def access() -> None:
    """Staff access requests for your tenant's resources (approve/deny/revoke: tenant admins)."""


@access.command("list")
@click.option("--json", "as_json", is_flag=True)
def access_list(as_json: bool) -> None:
    """Every access request for your resources, newest first."""
    _print_requests("/v1/access-requests", as_json)


def _decide(request_id: str, action: str, as_json: bool) -> None:
    obj = call("POST", f"/v1/access-requests/{request_id}/{action}").json()
    if as_json:
        _echo_json(obj)
    else:
        click.echo(_request_line(obj))


@access.command("approve")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_approve(request_id: str, as_json: bool) -> None:
    """Approve: the requester may read exactly that resource for the requested duration."""
    _decide(request_id, "approve", as_json)


@access.command("deny")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_deny(request_id: str, as_json: bool) -> None:
    """Deny a pending request."""
    _decide(request_id, "deny", as_json)


@access.command("revoke")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_revoke(request_id: str, as_json: bool) -> None:
    """End an active grant now."""
    _decide(request_id, "revoke", as_json)


@click.group("audit")
def audit() -> None:
    """The audit trail of your tenant's resources."""


@audit.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--before", type=click.IntRange(1, 2**31 - 1), help="Entries older than this sequence number.")
@click.option("--json", "as_json", is_flag=True)
def audit_list(limit: int, before: int | None, as_json: bool) -> None:
    """Requests, decisions and reads by staff on your resources, newest first."""
    params: dict[str, Any] = {"limit": limit, **({"after": before} if before else {})}
    data = call("GET", "/v1/audit", params=params).json()["data"]
    if as_json:
        _echo_json(data)
        return
    for e in data:
        actor = e["actor_token_id"] or "-"     # none: the local admin CLI
        click.echo(f"{e['seq']:>6}  {e['at'][:19]}Z  {e['actor_role']}#{actor:<4} {e['action']:<18} "
                   f"{e['resource'] or '-':<40} {e['outcome']:<7} {e['reason']}")


# ----------------------------------------------------------------------- tokens
def _token_line(t: dict[str, Any]) -> str:
    state = f"revoked {_when(t['revoked_at'])} by {t.get('revoked_by') or '?'}" if t.get("revoked_at") else "active"
    decides = "  decides access" if t.get("decides_access") else ""
    return (f"#{t['id']:<5} {t['role']:<13} {t['name'] or '-':<20} {t['prefix']}…  created {_when(t['created_at'])}  "
            f"minted by {t['minted_by']}{' (operator)' if t.get('minted_by_operator') else ''}  {state}{decides}")


@click.group("tokens")
def tokens() -> None:
    """Your tenant's API tokens: who minted each, rotate yours (admins: create, revoke)."""


@tokens.command("list")
@click.option("--json", "as_json", is_flag=True)
def tokens_list(as_json: bool) -> None:
    """Every token of your tenant (revoked ones too) and who minted or revoked it; use is not tracked."""
    data = call("GET", "/v1/tokens").json()["data"]
    if as_json:
        _echo_json(data)
        return
    for t in data:
        click.echo(_token_line(t))


def _show_new(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _echo_json(obj)
        return
    click.echo(f"token #{obj['id']} ({obj['role']}), shown once: {obj['token']}")
    if obj["role"] == "tenant_admin" and not obj.get("decides_access"):
        click.echo("  it cannot decide staff access requests (operator-minted): ask one of your tenant's own "
                   "admins (`finetune tokens list`) to mint you one")


@tokens.command("create")
@click.option("--role", type=click.Choice(["member", "tenant_admin"]), default="member", show_default=True)
@click.option("--name", default="", help="A label shown in listings.")
@click.option("--json", "as_json", is_flag=True)
def tokens_create(role: str, name: str, as_json: bool) -> None:
    """Mint a token for your tenant (tenant admins); it is shown once."""
    _show_new(call("POST", "/v1/tokens", json={"role": role, "name": name}).json(), as_json)


@tokens.command("revoke")
@click.argument("token_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True)
def tokens_revoke(token_id: int, as_json: bool) -> None:
    """Revoke one of your tenant's tokens (tenant admins)."""
    obj = call("POST", f"/v1/tokens/{token_id}/revoke").json()
    _echo_json(obj) if as_json else click.echo(_token_line(obj))


@tokens.command("rotate")
@click.option("--json", "as_json", is_flag=True)
def tokens_rotate(as_json: bool) -> None:
    """Replace your token with a new secret and revoke the old one (a copy anyone kept stops working).

    Rotating the tenant_admin token your sysadmin gave you claims it: the new one decides staff
    access requests (while your tenant has no admin token of its own yet). The saved
    credentials of `finetune login` are updated; a token in SFT_API_TOKEN is not.
    """
    url, old = connection()
    obj = call("POST", "/v1/tokens/rotate").json()
    path, saved = _credentials_path(), False
    if not get_settings().api_token:
        try:
            if json.loads(path.read_text()).get("token") == old:
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump({"url": url, "token": obj["token"]}, f)
                os.replace(tmp, path)
                saved = True
        except (OSError, ValueError, AttributeError) as e:
            click.echo(f"could not update {path} ({e}): keep the new token printed below", err=True)
    if as_json:
        _echo_json({**obj, "saved_to": str(path) if saved else None})
        return
    _show_new(obj, as_json=False)
    click.echo(f"  token #{obj['minted_by_token_id']} is revoked; "
               + (f"saved the new one in {path}" if saved else "put the new one where you keep your token"))
