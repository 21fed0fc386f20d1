"""The `artifacts` group: download a finished job's result files (streamed, written
atomically) and unpack its adapter tar (`extract_adapter`)."""

from __future__ import annotations

import os
import shutil
import tarfile
from pathlib import Path, PurePosixPath

import click
import httpx

from gateway.usercli.client import Unreachable, _echo_json, _raise_for_status, call, connection


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
