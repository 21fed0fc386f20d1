"""The storage verbs: the fixed set of operations the gateway may ask for inside a
tenant's storage. Each runs in a process that already IS the tenant (the broker
switched uid before opening anything; see ``broker``), starts from the tenant
root's directory fd, and touches names only through ``safefs`` (no-follow,
beneath the root, owner- and type-checked).

A verb takes ``(ctx, args, fds)`` and returns a ``Reply``: a JSON-able result,
file descriptors to hand to the gateway (SCM_RIGHTS), and byte blobs. Arguments
come from the gateway, which is less trusted than the broker: every name is
checked by ``layout`` before use.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import stat
import tarfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

from gateway.storage import layout, quota, safefs
from trainer.contract import jobdir

MAX_SPEC_BYTES = 1 << 20
MAX_EVENTS_READ = 4 << 20          # per job per call
MAX_EVAL_BYTES = 1 << 20
MAX_METRICS_BYTES = 64 << 20
MAX_MANIFEST_BYTES = 1 << 20
MAX_ADAPTER_BYTES = 16 << 30
MAX_SAFETENSORS_HEADER = 16 << 20
MAX_JSON_DEPTH = 64               # nesting of a tenant-written JSON document (ours nest 4 deep at most)
ADAPTER_FILES = ("adapter_model.safetensors", jobdir.ADAPTER_CONFIG)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


class VerbError(Exception):
    """A refusal the gateway shows as it is (``code`` picks the HTTP status)."""

    def __init__(self, message: str, code: str = "storage_error"):
        super().__init__(message)
        self.message, self.code = message, code


@dataclass
class Ctx:
    tenant: str
    root_fd: int          # the tenant root, opened no-follow, owned by the effective uid
    storage_root: str
    unix_user: str | None


@dataclass
class Reply:
    result: dict[str, Any] = field(default_factory=dict)
    fds: list[int] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)


Verb = Callable[[Ctx, dict[str, Any], list[int]], Reply]
VERBS: dict[str, Verb] = {}


def verb(fn: Verb) -> Verb:
    """Register ``fn`` in VERBS under its function name, the name the gateway asks for."""
    VERBS[fn.__name__] = fn
    return fn


def _missing(what: str) -> VerbError:
    return VerbError(f"{what} is no longer in storage", code="not_found")


# A JSON string (escapes included); brackets inside one are not structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NESTING = [0] * 256
_NESTING[ord("[")] = _NESTING[ord("{")] = 1
_NESTING[ord("]")] = _NESTING[ord("}")] = -1


def json_depth(raw: bytes) -> int:
    """How deep the arrays and objects of the JSON text ``raw`` nest (exact for valid JSON; for
    anything else at least what a parser would reach before failing). Runs at C speed: strings
    removed by one regex, then a running sum over the brackets."""
    return max(accumulate(map(_NESTING.__getitem__, _JSON_STRING.sub(b"", raw))), default=0)


def tenant_json(raw: bytes, what: str = "JSON") -> Any:
    """``raw`` (UTF-8 bytes a tenant's process wrote) parsed; ValueError when it is not JSON or
    nests deeper than MAX_JSON_DEPTH, checked before parsing: 200k ``[`` would otherwise raise
    RecursionError past every ``except ValueError`` (and deep values would reach the reply)."""
    text = raw.decode("utf-8-sig")        # UTF-8 only: its multi-byte characters hold no ASCII byte
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ValueError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} nests too deep") from None


# ------------------------------------------------------------------- uploads
@verb
def upload_begin(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """A fresh temp file in datasets/ (0600, O_EXCL): its fd goes to the gateway, which streams
    the upload into it; ``upload_commit`` then names it by its sha256."""
    d = safefs.open_dir(ctx.root_fd, (layout.DATASETS,), create=True)
    try:
        name = f".upload-{secrets.token_hex(8)}.tmp"
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=d)
        return Reply({"name": name}, fds=[fd])
    finally:
        os.close(d)


def _same_inode(dir_fd: int, name: str, fd: int) -> bool:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


@verb
def upload_commit(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Rename the temp file (still the very inode the gateway wrote: checked through the fd it
    sends back) to ``<sha256>.jsonl``, over whatever had that name (same content, or something
    the tenant planted: a link or FIFO is replaced, never followed)."""
    name = layout.check((args.get("name"),))[0]
    if not layout.UPLOAD_TMP.fullmatch(name) or len(fds) != 1:
        raise VerbError("invalid upload handle")
    final = layout.dataset(args.get("sha256", ""))[1]
    d = safefs.open_dir(ctx.root_fd, (layout.DATASETS,))
    try:
        if not _same_inode(d, name, fds[0]):
            raise VerbError("the upload's temp file was replaced while it streamed; nothing was kept",
                            code="conflict")
        safefs.check_file_fd(fds[0], "upload", size=int(args.get("size", -1)))
        os.fsync(fds[0])
        os.replace(name, final, src_dir_fd=d, dst_dir_fd=d)
        os.fsync(d)
        return Reply()
    finally:
        os.close(d)


@verb
def upload_abort(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Remove an upload's temp file; a missing file (or datasets/) is no error."""
    name = layout.check((args.get("name"),))[0]
    if not layout.UPLOAD_TMP.fullmatch(name):
        raise VerbError("invalid upload handle")
    try:
        d = safefs.open_dir(ctx.root_fd, (layout.DATASETS,))
    except (FileNotFoundError, safefs.UnsafeStorage):
        return Reply()
    try:
        safefs.remove(d, name)
    finally:
        os.close(d)
    return Reply()


# --------------------------------------------------------------------- reads
@verb
def open_file(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """An fd to read a dataset or result file: regular, tenant-owned, exactly the recorded size."""
    parts = layout.check(args.get("parts"))
    if parts[0] not in (layout.DATASETS, layout.ARTIFACTS):
        raise VerbError("only datasets and results are served")
    try:
        return Reply(fds=[safefs.open_path(ctx.root_fd, parts, size=int(args["size"]))])
    except FileNotFoundError:
        raise _missing("the file") from None


@verb
def read_events(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """New bytes of each job's events.jsonl from its offset: one call per tenant per cycle."""
    offsets = args.get("offsets") or {}
    sizes, blobs = {}, []
    for job_id, offset in offsets.items():
        data = b""
        try:
            fd = safefs.open_path(ctx.root_fd, layout.job_file(job_id, jobdir.EVENTS))
            try:
                os.lseek(fd, max(0, int(offset)), os.SEEK_SET)
                data = safefs.read_fd(fd, MAX_EVENTS_READ)
            finally:
                os.close(fd)
        except (FileNotFoundError, safefs.UnsafeStorage, NotADirectoryError):
            data = b""
        sizes[job_id] = len(data)
        blobs.append(data)
    return Reply({"order": list(offsets), "sizes": sizes}, blobs=blobs)


@verb
def read_spec(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """spec.json's bytes as a blob (``found``); not found when missing, unsafe or over MAX_SPEC_BYTES."""
    try:
        fd = safefs.open_path(ctx.root_fd, layout.job_file(args.get("job_id", ""), jobdir.SPEC),
                              max_size=MAX_SPEC_BYTES)
    except (FileNotFoundError, safefs.UnsafeStorage):
        return Reply({"found": False})
    try:
        return Reply({"found": True}, blobs=[safefs.read_fd(fd, MAX_SPEC_BYTES)])
    finally:
        os.close(fd)


# -------------------------------------------------------------------- writes
@verb
def write_spec(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Create jobs/<id>/ (0700) and write spec.json atomically."""
    data = args.get("spec")
    if not isinstance(data, str) or len(data) > MAX_SPEC_BYTES:
        raise VerbError("invalid spec")
    d = safefs.open_dir(ctx.root_fd, layout.job(args.get("job_id", "")), create=True)
    try:
        safefs.write_atomic(d, jobdir.SPEC, data.encode())
    finally:
        os.close(d)
    return Reply()


MAX_CLAIM_BYTES = 4096


@verb
def write_claim(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Write ``CLAIM-CODE-<token id>`` at the tenant root atomically, 0600: as the tenant, so only
    its unix user (and root) can read the one-time claim code in it; returns its ``name``."""
    name = layout.claim_code_file(args.get("token_id"))
    text = args.get("text")
    if not isinstance(text, str) or not text or len(text.encode()) > MAX_CLAIM_BYTES:
        raise VerbError("invalid claim code text")
    safefs.write_atomic(ctx.root_fd, name, text.encode(), mode=0o600)
    return Reply({"name": name})


@verb
def remove(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Remove each named path (file or tree), never following a link; missing ones are fine. Replies
    how many existed (``removed``) and the bytes of regular files that went with them (``freed_bytes``)."""
    removed = freed = 0
    for raw in args.get("paths") or []:
        parts = layout.check(raw)
        if parts[0] not in (layout.DATASETS, layout.JOBS, layout.ARTIFACTS) or len(parts) < 2:
            raise VerbError("refusing to remove a top-level directory")
        try:
            d = safefs.open_dir(ctx.root_fd, parts[:-1])
        except (FileNotFoundError, safefs.UnsafeStorage, NotADirectoryError):
            continue
        try:
            size = safefs.remove_measured(d, parts[-1])
        finally:
            os.close(d)
        if size is not None:
            removed, freed = removed + 1, freed + size
    return Reply({"removed": removed, "freed_bytes": freed})


@verb
def sweep(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Remove temp names older than ``min_age_s`` left by interrupted uploads and publications."""
    min_age, now, removed = float(args.get("min_age_s", 60)), time.time(), 0
    for top, pattern in ((layout.ARTIFACTS, layout.PUB_TMP), (layout.DATASETS, layout.UPLOAD_TMP)):
        try:
            d = safefs.open_dir(ctx.root_fd, (top,))
        except (FileNotFoundError, safefs.UnsafeStorage, NotADirectoryError):
            continue
        try:
            for name in os.listdir(d):
                if not pattern.fullmatch(name):
                    continue
                try:
                    age = now - os.stat(name, dir_fd=d, follow_symlinks=False).st_mtime
                except FileNotFoundError:
                    continue
                if age >= min_age:
                    removed += safefs.remove(d, name)
        finally:
            os.close(d)
    return Reply({"removed": removed})


@verb
def storage_usage(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """The tenant root's space as the filesystem counts and limits it (``quota.Usage``: used and limit
    bytes, what enforces it; all None where nothing does), read as the tenant through its root's fd."""
    return Reply(quota.usage(ctx.root_fd).as_dict())


# --------------------------------------------------------------- publication
def _sha256_fd(fd: int) -> tuple[int, str]:
    os.lseek(fd, 0, os.SEEK_SET)
    h, n = hashlib.sha256(), 0
    while block := os.read(fd, 1 << 20):
        h.update(block)
        n += len(block)
    os.lseek(fd, 0, os.SEEK_SET)
    return n, h.hexdigest()


def _refused(message: str) -> VerbError:
    return VerbError(message, code="publication_refused")


def verify_staging(staging_fd: int, *, attempt: int, model_digest: str | None) -> tuple[dict[str, Any], dict[str, int]]:
    """The manifest of a complete, intact staging dir and an open fd per listed file."""
    def read(name: str, cap: int) -> bytes:
        fd = safefs.open_file(staging_fd, name, name, max_size=cap)
        try:
            return safefs.read_fd(fd, cap)
        finally:
            os.close(fd)

    try:
        marker = read(jobdir.COMPLETE, 4096).decode(errors="replace").strip()
    except (FileNotFoundError, safefs.UnsafeStorage):
        raise _refused(f"attempt {attempt} has no COMPLETE marker: the trainer did not finish it") from None
    try:
        raw = read(jobdir.MANIFEST, MAX_MANIFEST_BYTES)
        manifest = tenant_json(raw, jobdir.MANIFEST)
        if not isinstance(manifest, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:
        raise _refused(f"attempt {attempt}: unreadable manifest ({type(e).__name__})") from e
    if marker and marker != f"manifest sha256:{hashlib.sha256(raw).hexdigest()}":
        raise _refused(f"attempt {attempt}: COMPLETE does not match the manifest")
    if manifest.get("attempt") != attempt:
        raise _refused(f"staging belongs to attempt {manifest.get('attempt')}, not the current "
                       f"attempt {attempt}: a stale attempt is never published")
    if model_digest and (manifest.get("base_model") or {}).get("digest") != model_digest:
        raise _refused("the adapter was trained on another base model digest")
    files = manifest.get("files") or {}
    if not isinstance(files, dict):
        raise _refused("the manifest's file list is invalid")
    for name in (*ADAPTER_FILES, jobdir.EVAL):
        if name not in files:
            raise _refused(f"the manifest lacks {name}")
    opened: dict[str, int] = {}
    try:
        for name, digest in files.items():
            if not isinstance(name, str) or "/" in name or name.startswith(".") or len(name) > 128:
                raise _refused(f"manifest names an invalid file: {name!r}")
            try:
                fd = safefs.open_file(staging_fd, name, name)
            except (FileNotFoundError, safefs.UnsafeStorage):
                raise _refused(f"manifest names a missing or invalid file: {name!r}") from None
            opened[name] = fd
            if f"sha256:{_sha256_fd(fd)[1]}" != digest:
                raise _refused(f"{name} does not match its sha256 in the manifest")
        return manifest, opened
    except BaseException:
        for fd in opened.values():
            os.close(fd)
        raise


def metrics_csv(lines: bytes) -> bytes:
    """metrics.jsonl → CSV (step, loss, lr, tokens_per_s, elapsed_s, tokens)."""
    import csv

    out = io.StringIO()
    cols = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "tokens"]
    w = csv.writer(out)
    w.writerow(cols)
    for line in lines.splitlines():
        try:
            row = tenant_json(line, "a metrics line")
        except ValueError:
            continue
        if isinstance(row, dict):
            w.writerow([row.get(c, "") if isinstance(row.get(c, ""), int | float | str) else ""
                        for c in cols])
    return out.getvalue().encode()


def _create(dir_fd: int, name: str) -> int:
    return os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                   dir_fd=dir_fd)


@verb
def publish_build(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Verify the attempt's staging and build the results in a hidden artifacts/.pub-* dir.
    Returns its name, each result's (bytes, sha256) and the evaluation (for the eval gate).

    ``checkpoint_steps`` (the gateway's record of the job's checkpoints) also become results:
    each complete one still on disk is packed as ``checkpoint-step-<n>.tar``, laid out as the
    final adapter tar (its tensors renamed as peft names them); ``checkpoints`` lists the steps
    packed, ``skipped_checkpoints`` the others with why (pruned, incomplete, not a safetensors file)."""
    job_id, attempt = args.get("job_id", ""), args.get("attempt")
    if not isinstance(attempt, int):
        raise VerbError("invalid attempt")
    raw_steps = args.get("checkpoint_steps") or []
    if not isinstance(raw_steps, list) or len(raw_steps) > layout.MAX_CHECKPOINTS:
        raise VerbError("invalid checkpoint steps")
    for n in raw_steps:
        layout.checkpoint(job_id, n)      # LayoutError for a step that is not one
    steps = sorted(set(raw_steps))
    try:
        sfd = safefs.open_dir(ctx.root_fd, layout.staging(job_id, attempt))
    except (FileNotFoundError, safefs.UnsafeStorage, NotADirectoryError):
        raise _refused(f"attempt {attempt} has no staging directory") from None
    try:
        manifest, opened = verify_staging(sfd, attempt=attempt, model_digest=args.get("model_digest"))
        try:
            return _build(ctx, job_id, sfd, opened, reported(manifest), steps)
        finally:
            for fd in opened.values():
                os.close(fd)
    finally:
        os.close(sfd)


REPORTED_VERSIONS = ("python", "slurm-finetune", "torch", "transformers", "peft", "bitsandbytes", "safetensors")


def reported(manifest: dict[str, Any]) -> dict[str, Any]:
    """What the gateway keeps of a (tenant-written) manifest for the model's lineage: known keys
    only, each of its type and bounded (strings of at most 100 characters), else left out."""
    def text(v: Any) -> str | None:
        return v if isinstance(v, str) and len(v) <= 100 and v.isprintable() else None

    def count(v: Any) -> int | None:
        return v if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**53 else None

    raw = manifest.get("versions")
    versions: dict[str, Any] = raw if isinstance(raw, dict) else {}
    raw = manifest.get("files")
    files: dict[Any, Any] = raw if isinstance(raw, dict) else {}
    seconds = manifest.get("train_seconds")
    return {
        "spec_hash": text(manifest.get("spec_hash")),
        "steps": count(manifest.get("steps")), "best_step": count(manifest.get("best_step")),
        "world_size": count(manifest.get("world_size")),
        "fsdp": manifest.get("fsdp") if isinstance(manifest.get("fsdp"), bool) else None,
        "train_seconds": float(seconds) if isinstance(seconds, int | float) and not isinstance(seconds, bool)
        and 0 <= seconds < 1e9 else None,
        "versions": {k: text(versions.get(k)) for k in REPORTED_VERSIONS},
        "files": {k: v for k, v in files.items() if text(k) and text(v)},
    }


def _build(ctx: Ctx, job_id: str, sfd: int, opened: dict[str, int], manifest: dict[str, Any],
           steps: list[int]) -> Reply:
    try:
        evaluation = tenant_json(safefs.read_fd(opened[jobdir.EVAL], MAX_EVAL_BYTES), jobdir.EVAL)
        os.lseek(opened[jobdir.EVAL], 0, os.SEEK_SET)
    except ValueError:
        raise _refused("eval.json is not JSON") from None
    try:
        mfd = safefs.open_file(sfd, jobdir.METRICS, jobdir.METRICS, max_size=MAX_METRICS_BYTES)
        try:
            metrics = safefs.read_fd(mfd, MAX_METRICS_BYTES)
        finally:
            os.close(mfd)
    except (FileNotFoundError, safefs.UnsafeStorage):
        metrics = b""
    with _build_dir(ctx, job_id) as (name, out):
        _write_adapter_tar(out, "adapter.tar", job_id, opened)
        for fname, data in ((jobdir.EVAL, safefs.read_fd(opened[jobdir.EVAL], MAX_EVAL_BYTES)),
                            ("metrics.csv", metrics_csv(metrics))):
            fd = _create(out, fname)
            try:
                safefs.write_all(fd, data)
            finally:
                os.close(fd)
        checkpoints, skipped = _pack_checkpoints(ctx, job_id, out, opened, steps)
        results = _hashed(out, layout.RESULT_NAMES + tuple(layout.checkpoint_result(n) for n in checkpoints))
        return Reply({"name": name, "results": results, "evaluation": evaluation, "manifest": manifest,
                      "checkpoints": checkpoints, "skipped_checkpoints": skipped})


@contextmanager
def _build_dir(ctx: Ctx, job_id: str) -> Iterator[tuple[str, int]]:
    """A fresh hidden ``artifacts/.pub-<job id>-<hex>`` dir: (its name, an fd of it). On leaving, its
    contents and the artifacts dir are fsynced; on an error it is removed (``publish_commit`` renames
    one that was built)."""
    art = safefs.open_dir(ctx.root_fd, (layout.ARTIFACTS,), create=True)
    name = f".pub-{job_id}-{secrets.token_hex(4)}"
    try:
        os.mkdir(name, 0o700, dir_fd=art)
        out = safefs.open_dir(art, (name,))
    except BaseException:
        os.close(art)
        raise
    try:
        yield name, out
        os.fsync(out)
        os.fsync(art)
    except BaseException:
        safefs.remove(art, name)
        raise
    finally:
        os.close(out)
        os.close(art)


def _hashed(out: int, names: tuple[str, ...] | list[str]) -> dict[str, list[Any]]:
    """Each built result of ``names`` in ``out``, fsynced: name → [bytes, sha256]."""
    results = {}
    for fname in names:
        fd = os.open(fname, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=out)
        try:
            os.fsync(fd)
            results[fname] = list(_sha256_fd(fd))
        finally:
            os.close(fd)
    return results


def peft_header(fd: int) -> tuple[bytes, int, int]:
    """The header of the checkpoint adapter ``fd`` (a safetensors file of trainable parameters by
    module name) rewritten with peft's names (``….lora_A.default.weight`` → ``….lora_A.weight``, as
    ``save_pretrained`` writes), and where its tensor data starts and how long it is. Every entry
    is checked (dtype, shape, offsets within the file); ValueError says what is wrong."""
    size = os.fstat(fd).st_size
    os.lseek(fd, 0, os.SEEK_SET)
    head = safefs.read_fd(fd, 8)
    if len(head) != 8:
        raise ValueError("shorter than a safetensors header")
    n = int.from_bytes(head, "little")
    if not 2 <= n <= min(MAX_SAFETENSORS_HEADER, size - 8):
        raise ValueError("invalid header length")
    header = tenant_json(safefs.read_fd(fd, n), "the header")
    if not isinstance(header, dict):
        raise ValueError("the header is not an object")
    data = size - 8 - n
    out: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        if not (isinstance(key, str) and 0 < len(key) <= 300 and key.isascii() and key.isprintable()
                and isinstance(entry, dict) and set(entry) == {"dtype", "shape", "data_offsets"}
                and isinstance(entry["dtype"], str) and len(entry["dtype"]) <= 8
                and isinstance(entry["shape"], list) and len(entry["shape"]) <= 8
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])
                and isinstance(entry["data_offsets"], list) and len(entry["data_offsets"]) == 2
                and all(isinstance(o, int) and not isinstance(o, bool) for o in entry["data_offsets"])
                and 0 <= entry["data_offsets"][0] <= entry["data_offsets"][1] <= data):
            raise ValueError("an invalid tensor entry")
        name = _PEFT_ADAPTER.sub("", key)
        if name in out:
            raise ValueError("two tensors under one name")
        out[name] = entry
    if len(out) == 1:
        raise ValueError("no tensors")
    raw = json.dumps(out, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, 8 + n, data


_PEFT_ADAPTER = re.compile(r"\.default(?=\.|$)")


class _Concat(io.RawIOBase):
    """``head`` then ``length`` bytes of ``fd`` from ``offset``: a file object for ``tarfile.addfile``."""

    def __init__(self, head: bytes, fd: int, offset: int, length: int):
        self.head, self.fd, self.offset, self.left = head, fd, offset, length

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        """Fill ``b`` as far as the data goes (tarfile takes a short read for the end of the file)."""
        view, n = memoryview(b).cast("B"), 0
        if self.head:
            n = min(len(view), len(self.head))
            view[:n], self.head = self.head[:n], self.head[n:]
        while n < len(view) and self.left > 0:
            chunk = os.pread(self.fd, min(len(view) - n, self.left, 1 << 20), self.offset)
            if not chunk:
                raise ValueError("the checkpoint changed while it was packed")
            view[n:n + len(chunk)] = chunk
            n, self.offset, self.left = n + len(chunk), self.offset + len(chunk), self.left - len(chunk)
        return n


def _pack_checkpoints(ctx: Ctx, job_id: str, out: int, opened: dict[str, int],
                      steps: list[int]) -> tuple[list[int], dict[str, str]]:
    """Pack each complete checkpoint of ``steps`` into ``out`` as ``checkpoint-step-<n>.tar``
    (its adapter under peft's names, the final adapter's config and tokenizer files)."""
    packed, skipped = [], {}
    for step in steps:
        try:
            cfd = safefs.open_dir(ctx.root_fd, layout.checkpoint(job_id, step))
        except (FileNotFoundError, safefs.UnsafeStorage, NotADirectoryError):
            skipped[str(step)] = "not on disk (pruned)"
            continue
        config: int | None = None
        try:
            os.close(safefs.open_file(cfd, jobdir.COMPLETE, jobdir.COMPLETE, max_size=4096))
            afd = safefs.open_file(cfd, jobdir.CKPT_ADAPTER, jobdir.CKPT_ADAPTER, max_size=MAX_ADAPTER_BYTES)
            if jobdir.ADAPTER_CONFIG not in opened:     # no final adapter: the checkpoint's own config
                config = _checkpoint_config(cfd)
        except (FileNotFoundError, safefs.UnsafeStorage):
            skipped[str(step)] = "incomplete"
            continue
        finally:
            os.close(cfd)
        name = layout.checkpoint_result(step)
        files = opened if config is None else {**opened, jobdir.ADAPTER_CONFIG: config}
        try:
            head, offset, length = peft_header(afd)
            _write_adapter_tar(out, name, f"{job_id}-step-{step}", files,
                               ("adapter_model.safetensors", _Concat(head, afd, offset, length), len(head) + length))
            packed.append(step)
        except ValueError as e:
            safefs.remove(out, name)
            skipped[str(step)] = f"not a safetensors adapter: {e}"
        finally:
            os.close(afd)
            if config is not None:
                os.close(config)
    return packed, skipped


def _checkpoint_config(cfd: int) -> int | None:
    """The checkpoint's ``adapter_config.json`` (the trainer writes it since issue 35) as an fd to
    pack, when it is a JSON object of at most MAX_EVAL_BYTES; None when it is absent or not one
    (an older checkpoint: its tar then holds the weights alone, which ``from_checkpoint`` needs)."""
    try:
        fd = safefs.open_file(cfd, jobdir.ADAPTER_CONFIG, jobdir.ADAPTER_CONFIG, max_size=MAX_EVAL_BYTES)
    except (FileNotFoundError, safefs.UnsafeStorage):
        return None
    try:
        ok = isinstance(tenant_json(safefs.read_fd(fd, MAX_EVAL_BYTES), jobdir.ADAPTER_CONFIG), dict)
    except ValueError:
        ok = False
    if not ok:
        os.close(fd)
        return None
    return fd


@verb
def checkpoints_build(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Build the complete ones of ``checkpoint_steps`` of a job that ended without publishing (failed,
    timed out, cancelled) as results in a hidden artifacts/.pub-* dir, as ``publish_build`` packs a
    succeeded job's: ``checkpoint-step-<n>.tar`` (the adapter under peft's names and the checkpoint's
    own ``adapter_config.json``). No staging is read: there is none. Returns the dir's name, each
    result's (bytes, sha256), the steps packed and those skipped with why; refused when none is packed."""
    job_id = args.get("job_id", "")
    raw_steps = args.get("checkpoint_steps") or []
    if not isinstance(raw_steps, list) or not raw_steps or len(raw_steps) > layout.MAX_CHECKPOINTS:
        raise VerbError("invalid checkpoint steps")
    for n in raw_steps:
        layout.checkpoint(job_id, n)      # LayoutError for a step that is not one
    with _build_dir(ctx, job_id) as (name, out):
        checkpoints, skipped = _pack_checkpoints(ctx, job_id, out, {}, sorted(set(raw_steps)))
        if not checkpoints:
            raise _refused("no complete checkpoint: " + "; ".join(f"step {k}: {v}" for k, v in skipped.items()))
        results = _hashed(out, [layout.checkpoint_result(n) for n in checkpoints])
        return Reply({"name": name, "results": results, "checkpoints": checkpoints,
                      "skipped_checkpoints": skipped})


def _write_adapter_tar(out: int, name: str, top: str, opened: dict[str, int],
                       adapter: tuple[str, Any, int] | None = None) -> None:
    """``out/name``: a tar of ``top/<file>`` for the adapter and tokenizer files of ``opened``
    (``adapter``: (name, file object, size) in place of the staging's adapter weights)."""
    tar_fd = _create(out, name)
    with os.fdopen(tar_fd, "wb") as f, tarfile.open(fileobj=f, mode="w") as tar:
        for fname in ADAPTER_FILES + TOKENIZER_FILES:
            info = tarfile.TarInfo(f"{top}/{fname}")
            info.mode, info.mtime = 0o600, int(time.time())
            if adapter is not None and fname == adapter[0]:
                info.size = adapter[2]
                tar.addfile(info, adapter[1])
                continue
            fd = opened.get(fname)
            if fd is None:
                continue
            info.size = os.fstat(fd).st_size
            os.lseek(fd, 0, os.SEEK_SET)
            with os.fdopen(os.dup(fd), "rb") as src:
                tar.addfile(info, src)


@verb
def publish_commit(ctx: Ctx, args: dict[str, Any], fds: list[int]) -> Reply:
    """Rename the built .pub-* dir to artifacts/<art id> (atomically visible)."""
    name = layout.check((args.get("name"),))[0]
    if not layout.PUB_TMP.fullmatch(name):
        raise VerbError("invalid publication handle")
    final = layout.artifact(args.get("art_id", ""))[1]
    art = safefs.open_dir(ctx.root_fd, (layout.ARTIFACTS,))
    try:
        st = os.stat(name, dir_fd=art, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise VerbError("the publication's build dir was replaced", code="conflict")
        os.rename(name, final, src_dir_fd=art, dst_dir_fd=art)
        os.fsync(art)
    finally:
        os.close(art)
    return Reply()
