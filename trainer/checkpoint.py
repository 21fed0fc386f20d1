"""Atomic, durable directories: checkpoints and the final staging dir.

A checkpoint is written into a temporary directory next to its final place;
every file is fsynced, a ``COMPLETE`` marker is written last, the directory is
fsynced, renamed with ``os.replace`` and the parent fsynced. Readers trust
only directories holding ``COMPLETE``; the newest complete step wins.
Torch-free: callers hand in bytes.
"""

from __future__ import annotations

import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from trainer.contract import jobdir
from trainer.contract.errors import CheckpointError

TMP_PREFIX = ".tmp-"
TRASH_PREFIX = ".trash-"


def fsync_dir(path: str | Path) -> None:
    """fsync a directory so the names it holds are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: str | Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to a new file at ``path`` and fsync it (not atomic by itself)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, data: bytes, mode: int = 0o600) -> None:
    """Replace the file at ``path`` atomically: temp file, fsync, rename, fsync dir."""
    path = Path(path)
    tmp = path.with_name(f"{TMP_PREFIX}{path.name}.{os.getpid()}")
    write_durable(tmp, data, mode)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_complete_dir(final: str | Path, files: Mapping[str, bytes], mode: int = 0o600) -> Path:
    """Write ``files`` (name -> bytes) as directory ``final`` atomically, ``COMPLETE`` last.

    Returns the final path. Raises:
        CheckpointError: ``final`` already exists or a file name is not plain.
    """
    final = Path(final)
    if final.exists():
        raise CheckpointError(f"{final} already exists")
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(mode=0o700)
    try:
        for name, data in files.items():
            if "/" in name or name in {"", ".", "..", jobdir.COMPLETE}:
                raise CheckpointError(f"invalid file name {name!r} in {final.name}")
            write_durable(tmp / name, data, mode)
        write_durable(tmp / jobdir.COMPLETE, b"", mode)
        fsync_dir(tmp)
    except BaseException:
        # e.g. ENOSPC: free the space at once (the failure event must still fit), never leave half a dir
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return final


def step_dir(checkpoints: str | Path, step: int) -> Path:
    """Return the path of the checkpoint of ``step``."""
    return Path(checkpoints) / jobdir.step_dir_name(step)


def complete_steps(checkpoints: str | Path) -> list[int]:
    """Return the steps that have a complete checkpoint, ascending."""
    root = Path(checkpoints)
    if not root.is_dir():
        return []
    steps = []
    for entry in root.iterdir():
        match = jobdir.STEP_DIR.match(entry.name)
        if match and (entry / jobdir.COMPLETE).is_file():
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_complete(checkpoints: str | Path) -> Path | None:
    """Return the newest complete checkpoint directory, or None."""
    steps = complete_steps(checkpoints)
    return step_dir(checkpoints, steps[-1]) if steps else None


def remove_dir(path: Path) -> None:
    """Remove a directory: rename it out of sight first (atomic), then delete it."""
    trash = path.with_name(f"{TRASH_PREFIX}{path.name}.{os.getpid()}")
    os.replace(path, trash)
    fsync_dir(path.parent)
    shutil.rmtree(trash, ignore_errors=True)


def prune(checkpoints: str | Path, keep: int, also_keep: Iterable[int] = ()) -> list[int]:
    """Delete all complete checkpoints but the newest ``keep`` and those of ``also_keep`` (the best
    eval's step); return the steps removed."""
    return prune_measured(checkpoints, keep, also_keep)[0]


def prune_measured(checkpoints: str | Path, keep: int, also_keep: Iterable[int] = ()) -> tuple[list[int], int]:
    """``prune``, and the bytes it freed (the removed directories' regular files): (steps, bytes)."""
    steps = complete_steps(checkpoints)
    kept = set(steps[-keep:] if keep > 0 else []) | set(also_keep)
    doomed = [s for s in steps if s not in kept]
    freed = 0
    for step in doomed:
        freed += dir_bytes(step_dir(checkpoints, step))
        remove_dir(step_dir(checkpoints, step))
    return doomed, freed


def dir_bytes(path: str | Path) -> int:
    """The bytes of the regular files under ``path`` (links not followed, a file linked twice counted once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def clean_leftovers(directory: str | Path) -> list[str]:
    """Remove temp/trash entries and incomplete step dirs left by a killed writer.

    Returns the names removed. Only one trainer runs per job, so anything
    half-written belongs to a dead process.
    """
    root = Path(directory)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        stale = entry.name.startswith((TMP_PREFIX, TRASH_PREFIX))
        broken = bool(jobdir.STEP_DIR.match(entry.name)) and not (entry / jobdir.COMPLETE).is_file()
        if stale or broken:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry.name)
    return removed
