"""The one runtime of the prolog/epilog: run the steps, log, write the report, map to an exit code.

Every step runs even after one failed (the epilog cleans as much as it can);
any failure makes the exit code 1, which Slurm turns into a drained node (and,
for the prolog, a requeued job). The report is written atomically before exit.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from scrubber.checks import PLANS, STEP_NAMES, Scrub, Status, Step, Verdict, fail
from scrubber.config import ScrubConfig, ScrubConfigError
from scrubber.jobenv import JobContext

SCHEMA = 1
TOTALS = ("files_removed", "bytes_removed", "processes_killed", "gpu_bytes_wiped")


@dataclass(frozen=True)
class StepResult:
    name: str
    status: Status
    message: str
    seconds: float
    figures: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        """The step's entry in the report's ``steps`` list (seconds rounded to 0.1 ms)."""
        return {"name": self.name, "status": self.status.value, "message": self.message,
                "seconds": round(self.seconds, 4), "figures": self.figures}


def run_step(step: Step, scrub: Scrub) -> StepResult:
    """Run one step; an unexpected exception is a failure naming its type, never a crash."""
    t0 = time.perf_counter()
    try:
        v = step.run(scrub)
    except Exception as e:  # noqa: BLE001 - one broken step must not skip the others
        v = fail(f"step raised {type(e).__name__}: {e}")
    cfg, job = scrub.cfg, scrub.job
    if cfg.fails_on_purpose(step.name, job.node, job.user):
        v = Verdict(Status.FAIL, f"failed on purpose (fail_step in {cfg.source}); "
                                 f"the step itself said: {v.status.value}: {v.message}", v.figures)
    return StepResult(step.name, v.status, v.message, time.perf_counter() - t0, dict(v.figures))


def outcome(results: Sequence[StepResult]) -> Status:
    """FAIL when any step failed, else OK (skipped steps count as passing)."""
    return Status.FAIL if any(r.status is Status.FAIL for r in results) else Status.OK


def build_report(kind: str, scrub: Scrub, results: Sequence[StepResult], started: datetime,
                 seconds: float) -> dict[str, Any]:
    """The scrub report (pure): what each step did, totals, and the outcome."""
    job = scrub.job
    totals = {k: sum(int(r.figures.get(k, 0)) for r in results) for k in TOTALS}
    failed = [r.name for r in results if r.status is Status.FAIL]
    return {
        "schema": SCHEMA, "kind": kind, "job_id": job.job_id, "node": job.node,
        "user": job.user, "uid": job.uid, "gpus": list(job.gpus), "gpu_devices": list(scrub.gpu_files),
        "started": started.isoformat(), "seconds": round(seconds, 4),
        "outcome": outcome(results).value, "failed_steps": failed, "totals": totals,
        "steps": [r.as_dict() for r in results], "config": scrub.cfg.source,
    }


def report_path(report_dir: Path, node: str, job_id: int, kind: str) -> Path:
    """Where the report goes: ``<report_dir>/<node>/<job_id>-<kind>.json``."""
    return report_dir / node / f"{job_id}-{kind}.json"


def write_atomic(path: Path, text: str) -> None:
    """tmp in the same dir, fsync, os.replace, fsync the dir (STYLE #8)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def log_line(kind: str, job: JobContext, r: StepResult) -> str:
    """One log line per step: status and the step's own message (counts, pids, never contents)."""
    return (f"{datetime.now(UTC).isoformat(timespec='milliseconds')} {kind} job={job.job_id} "
            f"node={job.node} user={job.user} step={r.name} status={r.status.value} "
            f"t={r.seconds:.3f}s {r.message}")


def append_log(log_dir: Path, lines: Sequence[str]) -> None:
    """Append ``lines`` to ``<log_dir>/scrubber.log``; an OSError is swallowed (the report still tells)."""
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with open(log_dir / "scrubber.log", "a") as f:
            f.write("".join(line + "\n" for line in lines))
    except OSError:
        pass  # the report and the exit code still tell; logging must not fail the scrub


def check_plan_config(cfg: ScrubConfig) -> None:
    """Raise ScrubConfigError when ``fail_step`` names no step of any plan."""
    if cfg.fail_step and cfg.fail_step not in STEP_NAMES:
        raise ScrubConfigError(f"{cfg.source}: fail_step = {cfg.fail_step!r} names no step; "
                               f"steps: {', '.join(STEP_NAMES)}")


def run(kind: str, cfg: ScrubConfig, job: JobContext, *, echo: Any = print) -> int:
    """Run the ``kind`` plan for ``job``; write log and report. Returns the exit code for Slurm."""
    check_plan_config(cfg)
    started = datetime.now(UTC)
    t0 = time.perf_counter()
    scrub = Scrub.make(cfg, job)
    results = [run_step(step, scrub) for step in PLANS[kind]]
    report = build_report(kind, scrub, results, started, time.perf_counter() - t0)
    append_log(cfg.log_dir, [log_line(kind, job, r) for r in results])
    path = report_path(cfg.report_dir, job.node, job.job_id, kind)
    try:
        write_atomic(path, json.dumps(report, indent=1) + "\n")
    except OSError as e:
        echo(f"scrubber {kind}: cannot write report {path}: {e}")
        return 1
    if report["outcome"] != Status.OK.value:
        # slurmd logs a failing prolog/epilog's output: say what failed and where to look.
        for r in results:
            if r.status is Status.FAIL:
                echo(f"scrubber {kind} job {job.job_id}: {r.name} failed: {r.message}")
        echo(f"scrubber {kind}: report {path}")
        return 1
    return 0
