"""The `artifacts` group: download a finished job's result files (streamed, written
atomically), unpack its adapter tar (`extract_adapter`), and export it for serving
(`export`: a vLLM/LoRAX adapter directory or a merged model, by `trainer.export`)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import quote

import click
import httpx

from gateway.config import get_settings
from gateway.usercli.client import Unreachable, _echo_json, _raise_for_status, call, connection
from trainer.contract.errors import TrainerError

FORMATS = ("vllm", "merged")
DTYPES = ("bfloat16", "float16", "float32")
"""trainer.export.DTYPES, spelled here so `finetune --help` imports no trainer module (a unit test keeps them equal)."""


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


def _download_results(job: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    """Stream every result file of ``job`` into ``out``; return each one's id, name, path and bytes.
    Raises ClickException when the job has none (yet)."""
    job_id = job["id"]
    if not job.get("result_files"):
        raise click.ClickException(f"job {job_id} has no result files (status: {job['status']}); "
                                   "results appear once a job has succeeded")
    out.mkdir(parents=True, exist_ok=True)
    got = []
    for fid in job["result_files"]:
        meta = call("GET", f"/v1/files/{fid}").json()
        name = Path(str(meta["filename"]).removeprefix(f"{job_id}-")).name or fid
        dest = out / name
        size = _stream_to(f"/v1/files/{fid}/content", dest, meta.get("bytes"))
        got.append({"id": fid, "name": name, "path": str(dest.resolve()), "bytes": size})
    return got


@artifacts.command("download")
@click.argument("job_id")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory for the files (default: ./JOB_ID/).")
@click.option("--extract", is_flag=True, help="Also unpack adapter.tar into DIR/adapter/ (loadable with PEFT).")
@click.option("--json", "as_json", is_flag=True)
def download(job_id: str, out_dir: Path | None, extract: bool, as_json: bool) -> None:
    """Download a job's result files; print where they are."""
    job = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
    out = out_dir or Path(job_id)
    got = _download_results(job, out)
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


# ----------------------------------------------------------------- export for serving


@artifacts.command("export")
@click.argument("job_id")
@click.option("--format", "fmt", type=click.Choice(FORMATS), required=True,
              help="vllm: the LoRA adapter as vLLM --lora-modules and LoRAX load it; "
                   "merged: the base model with the adapter merged in (plain transformers, vLLM).")
@click.option("-o", "--output", "out_dir", type=click.Path(file_okay=False, path_type=Path),
              help="Directory to write (default: ./JOB_ID-vllm or ./JOB_ID-merged).")
@click.option("--max-lora-rank", type=int, default=None,
              help="vllm: the --max-lora-rank of the vLLM server to check against (1, 8, 16, 32, 64, 128, "
                   "256, 320 or 512; default: the smallest of them that fits the adapter).")
@click.option("--models-root", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The base-model catalog (default: the gateway's, SFT_STORAGE_ROOT/models): merged "
                   "merges into the base found there; vllm only names its path in the serving command.")
@click.option("--dtype", type=click.Choice(DTYPES), default=None, help="merged: the saved dtype (default bfloat16).")
@click.option("--force", is_flag=True, help="Replace a non-empty output directory.")
@click.option("--checkpoint", "step", type=click.IntRange(1), default=None,
              help="Export the job's checkpoint of this step (`finetune jobs checkpoints JOB_ID`) instead.")
def export_cmd(job_id: str, fmt: str, out_dir: Path | None, max_lora_rank: int | None,
               models_root: Path | None, dtype: str | None, force: bool, step: int | None) -> None:
    """Export a finished job's adapter (or one of its checkpoints') for serving; print how to serve it."""
    _check_export_options(fmt, max_lora_rank, dtype)
    out = out_dir or Path(f"{job_id}-{fmt}" if step is None else f"{job_id}-step-{step}-{fmt}")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise click.ClickException(f"{out} exists and is not empty: choose another --output or pass --force")
    root = models_root or get_settings().models_root
    job = call("GET", f"/v1/fine_tuning/jobs/{job_id}").json()
    model_id, base, digest = _base_model(job)
    base_dir = _catalog_base(root, base, digest) if fmt == "merged" else None   # before any download
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.download-", dir=out.parent) as work:
            if step is None:
                got = _download_results(job, Path(work))
                tar = next((Path(g["path"]) for g in got if g["name"] == "adapter.tar"), None)
                if tar is None:
                    raise click.ClickException(f"job {job_id} has no adapter.tar among its result files")
            else:
                model_id, tar = _download_checkpoint(job_id, step, Path(work))
            adapter = extract_adapter(tar, Path(work) / "adapter")
            if base_dir is None:
                _export_vllm(adapter, model_id, base, digest, out, root, max_lora_rank, force)
            else:
                _export_merged(adapter, base, base_dir, out, dtype or "bfloat16", force)
    except OSError as e:
        raise click.ClickException(f"cannot write next to {out}: {e.strerror or e}") from e


def _download_checkpoint(job_id: str, step: int, work: Path) -> tuple[str, Path]:
    """(model name, downloaded adapter tar) of ``job_id``'s published checkpoint ``step``."""
    cks = call("GET", f"/v1/fine_tuning/jobs/{job_id}/checkpoints", params={"limit": 100}).json()["data"]
    ck = next((c for c in cks if c["step_number"] == step and c.get("adapter_file")), None)
    if ck is None:
        have = sorted(c["step_number"] for c in cks if c.get("adapter_file"))
        raise click.ClickException(f"job {job_id} has no published checkpoint at step {step} "
                                   f"(published: {', '.join(map(str, have)) or 'none'})")
    meta = call("GET", f"/v1/files/{ck['adapter_file']}").json()
    tar = work / f"checkpoint-step-{step}.tar"
    _stream_to(f"/v1/files/{ck['adapter_file']}/content", tar, meta.get("bytes"))
    return str(ck["fine_tuned_model_checkpoint"]), tar


def _check_export_options(fmt: str, max_lora_rank: int | None, dtype: str | None) -> None:
    """Refuse options of the other format, and a --max-lora-rank vLLM would refuse (before any download)."""
    from trainer.export import VLLM_MAX_LORA_RANKS  # lazy: the trainer side (export), only for this command

    if fmt == "merged" and max_lora_rank is not None:
        raise click.UsageError("--max-lora-rank applies to --format vllm only")
    if fmt == "vllm" and dtype is not None:
        raise click.UsageError("--dtype applies to --format merged only (an adapter keeps its own dtype)")
    if max_lora_rank is not None and max_lora_rank not in VLLM_MAX_LORA_RANKS:
        raise click.BadParameter(f"{max_lora_rank}: vLLM accepts only {', '.join(map(str, VLLM_MAX_LORA_RANKS))}",
                                 param_hint="--max-lora-rank")


def _base_model(job: dict[str, Any]) -> tuple[str, str, str | None]:
    """(fine-tuned model id, base model name, base digest or None) of a succeeded job.

    The job object names the parent for continued training, so the base comes from the
    model's lineage record (``GET /v1/models/{id}``); a model published before lineage
    records existed has only the job's ``model`` and no digest."""
    model_id = job.get("fine_tuned_model")
    if not model_id:
        raise click.ClickException(f"job {job['id']} has no published model (status: {job['status']}); "
                                   "results appear once a job has succeeded")
    record = call("GET", f"/v1/models/{quote(model_id, safe=':')}").json()
    base = (record.get("lineage") or {}).get("base_model") or {}
    name = base.get("name") or (job["model"] if not str(job.get("model", "")).startswith("ft:") else None)
    if not name:
        raise click.ClickException(f"{model_id} has no record of its base model (published before lineage "
                                   "records): it cannot be exported")
    return str(model_id), str(name), base.get("digest")


def _export_vllm(adapter: Path, model_id: str, base: str, digest: str | None, out: Path, root: Path,
                 max_lora_rank: int | None, force: bool) -> None:
    """Write the vLLM adapter, print vLLM's loader problems (exit 1 if any), else the serving command."""
    from trainer import catalog  # lazy: the trainer side (catalog), only for this command
    from trainer import export as ex  # lazy: the trainer side (export), only for this command

    try:
        ex.vllm_adapter(adapter, base, out, force=force)
    except TrainerError as e:       # ExportError: an existing output, a template that would change
        raise click.ClickException(str(e)) from e
    rank = max_lora_rank or _fitting_rank(out)
    problems = ex.vllm_problems(out, rank)
    for problem in problems:
        click.echo(f"problem: {problem}", err=True)
    if problems:
        raise click.ClickException(f"{out}: vLLM would refuse this adapter ({len(problems)} problem(s) above); "
                                   "the export is left there to inspect")
    local = catalog.model_dir(root, base, digest) if digest else None
    base_arg = str(local) if local is not None and local.is_dir() else base
    argv = ["vllm", "serve", base_arg, "--enable-lora", "--max-lora-rank", str(rank),
            "--lora-modules", f"{model_id}={out.resolve()}"]
    if (out / ex.CHAT_TEMPLATE).is_file():
        argv += ["--chat-template", str((out / ex.CHAT_TEMPLATE).resolve())]
    click.echo(f"{out.resolve()}/  (LoRA adapter of {model_id} for base {base}; passes vLLM's loader checks)")
    click.echo(f"serve it:  {shlex.join(argv)}")
    if base_arg == base:
        click.echo(f"           ({base} is not in the catalog at {root}: put the directory of base model {base} "
                   f"{digest or '(digest not recorded)'} in its place; `finetune models list` shows a catalog)")
    click.echo(f"then ask for model {model_id!r}; vLLM itself was not run here, only its loader's checks")


def _fitting_rank(out: Path) -> int:
    """The smallest --max-lora-rank vLLM accepts for the exported adapter's r (512 past that)."""
    from trainer.export import (  # lazy: the trainer side (export), only for this command
        ADAPTER_CONFIG,
        DEFAULT_MAX_LORA_RANK,
        VLLM_MAX_LORA_RANKS,
        vllm_rank,
    )

    try:
        r = json.loads((out / ADAPTER_CONFIG).read_text()).get("r")
    except (OSError, ValueError):
        return DEFAULT_MAX_LORA_RANK
    if not isinstance(r, int) or r < 1:
        return DEFAULT_MAX_LORA_RANK
    return vllm_rank(r) or VLLM_MAX_LORA_RANKS[-1]


def _export_merged(adapter: Path, base: str, base_dir: Path, out: Path, dtype: str, force: bool) -> None:
    """Merge into ``base_dir`` (the catalog's copy of the exact base it was trained on); print how to load it."""
    from trainer.quiet import quiet_libraries  # lazy: the trainer side, only for this command

    quiet_libraries()
    try:
        from trainer.export import merged_model  # lazy: the trainer side (export), only for this command

        merged_model(base_dir, adapter, out, dtype=dtype, force=force)
    except ImportError as e:
        raise click.ClickException(f"--format merged needs the ML stack here ({e.name} is missing): "
                                   "pip install 'slurm-finetune[ml]'") from e
    except (TrainerError, ValueError) as e:    # ValueError: transformers/peft refusing the files
        raise click.ClickException(str(e)) from e
    where = out.resolve()
    click.echo(f"{where}/  (base {base} with the adapter merged in, {dtype}; no quantization)")
    click.echo(f"serve it:  {shlex.join(['vllm', 'serve', str(where)])}")
    click.echo(f"load it:   AutoModelForCausalLM.from_pretrained({str(where)!r})")


def _catalog_base(root: Path, name: str, digest: str | None) -> Path:
    """The catalog directory of base ``name`` pinned by ``digest`` (its files re-hashed), or ClickException."""
    from trainer import catalog  # lazy: the trainer side (catalog), only for this command

    if not digest:
        raise click.ClickException(f"the model record names base {name} without a digest (published before "
                                   "lineage records): a merge needs the exact base it was trained on; "
                                   "export --format vllm instead")
    if not catalog.model_dir(root, name, digest).is_dir():
        try:
            others = [entry.digest for entry in catalog.list_models(root) if entry.name == name]
        except TrainerError as e:
            raise click.ClickException(str(e)) from e
        if others:
            raise click.ClickException(
                f"base model {name}: the catalog at {root} has {', '.join(others)}, but this adapter was trained "
                f"on {digest}: refusing to merge it into a different base")
        raise click.ClickException(f"base model {name} ({digest}) is not in the catalog at {root}: pass "
                                   "--models-root with the catalog the job trained from")
    try:
        return catalog.resolve(root, name, digest)      # re-hashes the files: a changed copy is refused
    except TrainerError as e:
        raise click.ClickException(str(e)) from e
