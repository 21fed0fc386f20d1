"""Publication of a finished attempt: verify, package, and make it visible at once.

The staging dir of the job's current attempt must carry COMPLETE, its manifest must
match the attempt and every file's sha256, and the eval gate must pass. Result files
are built in a hidden temp dir; then, in one transaction guarded by the job row's
version, the dir is renamed into place, the file rows are added and the job becomes
succeeded. If the transaction loses (a cancel came first), the dir is removed: no
partial or unowned artifact is ever visible.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import secrets
import shutil
import tarfile
from pathlib import Path
from typing import Any

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")


class PublishError(Exception):
    """The attempt cannot be published; the message says why (shown to the tenant)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def verify_staging(staging: Path, *, attempt: int, model_digest: str | None) -> dict[str, Any]:
    """Return the manifest of a complete, intact staging dir; raise PublishError otherwise."""
    complete = staging / "COMPLETE"
    if not complete.is_file():
        raise PublishError(f"attempt {attempt} has no COMPLETE marker: the trainer did not finish it")
    manifest_path = staging / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise PublishError(f"attempt {attempt}: unreadable manifest ({type(e).__name__})") from e
    marker = complete.read_text().strip()
    if marker and marker != f"manifest sha256:{_sha256(manifest_path)}":
        raise PublishError(f"attempt {attempt}: COMPLETE does not match the manifest")
    if manifest.get("attempt") != attempt:
        raise PublishError(f"staging belongs to attempt {manifest.get('attempt')}, not the current "
                           f"attempt {attempt}: a stale attempt is never published")
    if model_digest and (manifest.get("base_model") or {}).get("digest") != model_digest:
        raise PublishError("the adapter was trained on another base model digest")
    for name, digest in (manifest.get("files") or {}).items():
        path = staging / name
        if "/" in name or name.startswith(".") or not path.is_file():
            raise PublishError(f"manifest names a missing or invalid file: {name!r}")
        if f"sha256:{_sha256(path)}" != digest:
            raise PublishError(f"{name} does not match its sha256 in the manifest")
    for name in ADAPTER_FILES + ("eval.json",):
        if name not in (manifest.get("files") or {}):
            raise PublishError(f"the manifest lacks {name}")
    return manifest


def eval_gate(evaluation: dict[str, Any], mode: str, tolerance: float) -> str | None:
    """None if the adapter may be published, else why not."""
    if mode == "off":
        return None
    before = (evaluation.get("before") or {}).get("loss")
    after = (evaluation.get("after") or {}).get("loss")
    if before is None or after is None:
        return "the evaluation has no before/after loss"
    if after > before * (1 + tolerance):
        return (f"eval gate: final eval loss {after:.4f} is worse than the base model's {before:.4f}; "
                "the adapter was not published (lower the learning rate or add data)")
    return None


def metrics_csv(metrics_jsonl: Path) -> bytes:
    """metrics.jsonl → CSV (step, loss, lr, tokens_per_s, elapsed_s, tokens)."""
    out = io.StringIO()
    cols = ["step", "loss", "lr", "tokens_per_s", "elapsed_s", "tokens"]
    w = csv.writer(out)
    w.writerow(cols)
    if metrics_jsonl.exists():
        for line in metrics_jsonl.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            w.writerow([row.get(c, "") for c in cols])
    return out.getvalue().encode()


def build_results(staging: Path, out: Path, job_id: str) -> dict[str, tuple[int, str]]:
    """Write adapter tar, eval.json and metrics CSV into ``out``; name → (bytes, sha256)."""
    out.mkdir(mode=0o700)
    with tarfile.open(out / "adapter.tar", "w") as tar:
        for name in ADAPTER_FILES + TOKENIZER_FILES:
            if (staging / name).is_file():
                tar.add(staging / name, arcname=f"{job_id}/{name}")
    shutil.copyfile(staging / "eval.json", out / "eval.json")
    (out / "metrics.csv").write_bytes(metrics_csv(staging / "metrics.jsonl"))
    results = {}
    for name in ("adapter.tar", "eval.json", "metrics.csv"):
        path = out / name
        os.chmod(path, 0o600)
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        results[name] = (path.stat().st_size, _sha256(path))
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return results


def temp_dir(artifacts_root: Path, job_id: str) -> Path:
    artifacts_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    return artifacts_root / f".pub-{job_id}-{secrets.token_hex(4)}"



def stale_temp_dirs(artifacts_root: Path, *, now: float, min_age_s: float) -> list[Path]:
    """Hidden ``.pub-*`` build dirs of publications a crash cut short, untouched for
    ``min_age_s`` (one in flight elsewhere is younger). Never visible through the API; only
    space. Published ``art-*`` dirs are never touched here: a DB restored from an older
    backup must not turn newer results into garbage."""
    if not artifacts_root.is_dir():
        return []
    out = []
    for entry in artifacts_root.iterdir():
        if not entry.name.startswith(".pub-"):
            continue
        try:
            age = now - entry.lstat().st_mtime
        except FileNotFoundError:
            continue
        if age >= min_age_s:
            out.append(entry)
    return out
