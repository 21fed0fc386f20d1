"""Scrub reports (written by the scrubber's prolog/epilog on each node) as typed records.

The scrubber writes one JSON report per job, node and kind, atomically, under
``<report dir>/<node>/<job id>-<prolog|epilog>.json``. This module only reads
them; it shares no code with ``scrubber/`` (which runs on compute nodes).
On a multi-host cluster the report dir should be on storage the gateway can
read (or be collected there).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

DEFAULT_REPORT_DIR = Path("/var/lib/slurm-finetune/scrub")
KINDS = ("prolog", "epilog")


class ScrubReportError(ValueError):
    """A report file is unreadable or not a scrub report; the message names the file."""


@dataclass(frozen=True)
class ScrubStep:
    name: str
    status: str  # ok | fail | skipped
    message: str
    seconds: float


@dataclass(frozen=True)
class ScrubReport:
    path: Path
    kind: str
    job_id: int
    node: str
    user: str
    started: datetime
    seconds: float
    outcome: str  # ok | fail
    failed_steps: tuple[str, ...]
    files_removed: int
    bytes_removed: int
    processes_killed: int
    gpu_bytes_wiped: int
    steps: tuple[ScrubStep, ...]

    @property
    def ok(self) -> bool:
        """Whether the scrub passed (outcome ``ok``)."""
        return self.outcome == "ok"

    def summary(self) -> str:
        """One line: outcome, what failed or what was cleaned, how long it took."""
        if not self.ok:
            why = "; ".join(f"{s.name}: {s.message}" for s in self.steps if s.status == "fail")
            return f"{self.kind} job {self.job_id} FAILED ({why})"
        skipped = [f"{s.name} ({s.message})" for s in self.steps if s.status == "skipped"]
        return (f"{self.kind} job {self.job_id} ok in {self.seconds:.2f}s: {self.files_removed} files, "
                f"{self.bytes_removed} bytes removed, {self.processes_killed} processes killed, "
                f"{self.gpu_bytes_wiped} GPU bytes wiped"
                + (f"; skipped: {', '.join(skipped)}" if skipped else ""))


def parse_report(data: dict[str, Any], path: Path) -> ScrubReport:
    """A report dict → ScrubReport. Raises ScrubReportError naming the file and the field."""
    try:
        totals = data["totals"]
        return ScrubReport(
            path=path, kind=str(data["kind"]), job_id=int(data["job_id"]), node=str(data["node"]),
            user=str(data["user"]), started=datetime.fromisoformat(data["started"]),
            seconds=float(data["seconds"]), outcome=str(data["outcome"]),
            failed_steps=tuple(data.get("failed_steps", ())),
            files_removed=int(totals["files_removed"]), bytes_removed=int(totals["bytes_removed"]),
            processes_killed=int(totals["processes_killed"]),
            gpu_bytes_wiped=int(totals["gpu_bytes_wiped"]),
            steps=tuple(ScrubStep(str(s["name"]), str(s["status"]), str(s["message"]),
                                  float(s["seconds"])) for s in data["steps"]),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ScrubReportError(f"{path}: not a scrub report ({type(e).__name__}: {e})") from e


def read_report(path: Path) -> ScrubReport:
    """Read one report file. Raises ScrubReportError."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ScrubReportError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise ScrubReportError(f"{path}: not a JSON object")
    return parse_report(data, path)


def report_path(report_dir: Path, node: str, job_id: int, kind: str) -> Path:
    """Where the scrubber writes a report: ``<report_dir>/<node>/<job_id>-<kind>.json``."""
    return report_dir / node / f"{int(job_id)}-{kind}.json"


def _report_files(node_dir: Path) -> list[Path]:
    # Temp files of an in-progress write start with "."; only complete reports count.
    return [p for p in node_dir.glob("*.json") if not p.name.startswith(".")]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def latest_reports(report_dir: Path = DEFAULT_REPORT_DIR, *, per_node: int = 3) -> dict[str, list[ScrubReport]]:
    """Node → its newest ``per_node`` reports (newest first). Unreadable files are skipped."""
    out: dict[str, list[ScrubReport]] = {}
    if not report_dir.is_dir():
        return out
    for node_dir in sorted(p for p in report_dir.iterdir() if p.is_dir()):
        files = sorted(_report_files(node_dir), key=_mtime, reverse=True)
        reports = []
        for path in files[: per_node * 4]:
            try:
                reports.append(read_report(path))
            except ScrubReportError:
                continue
        reports.sort(key=lambda r: r.started, reverse=True)
        out[node_dir.name] = reports[:per_node]
    return out


def last_failure(reports: list[ScrubReport]) -> ScrubReport | None:
    """The first failed report of ``reports`` (newest first from ``latest_reports``); None if all passed."""
    return next((r for r in reports if not r.ok), None)
