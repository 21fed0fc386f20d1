"""Epilog time for a job that leaves 1 GB in its scratch dir: our scrub vs ``shutil.rmtree``.

Local, side by side (same tree shape, same disk, written and synced before each timing):

- ``rmtree``: ``shutil.rmtree`` of the scratch dir: what ``rm -rf`` in a shell epilog does,
  and nothing else (no count, no verification, no processes, no /tmp);
- ``scrub scratch``: our scratch step alone (fd-based removal that counts, then verifies);
- ``scrub epilog``: the whole epilog in-process (kill scan of /proc, GPU steps, scratch,
  the user's files in /tmp and /dev/shm), for an otherwise idle job user.

``--cluster``: also run a real job on the dev cluster as tenant t-scrub-a that leaves 1 GB
in ``$SFT_SCRATCH``, and print the epilog's own timing from its scrub report.

    python bench/scrub.py [--gb 1] [--shape big|many|both] [--repeat 2] [--cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scrubber import checks, files, runtime  # noqa: E402
from scrubber.config import ScrubConfig  # noqa: E402
from scrubber.jobenv import JobContext  # noqa: E402

BENCH_UID = 59_999  # owns nothing on this host but the trees we make
MB = 1 << 20


def make_tree(path: Path, total: int, shape: str) -> None:
    """``big``: 4 checkpoint-like shards; ``many``: 1 MiB files in 32 dirs."""
    path.mkdir(parents=True)
    block = os.urandom(MB)
    sizes = [total // 4] * 4 if shape == "big" else [MB] * (total // MB)
    for i, size in enumerate(sizes):
        d = path if shape == "big" else path / f"d{i % 32}"
        d.mkdir(exist_ok=True)
        with open(d / f"f{i}", "wb") as f:
            for _ in range(size // MB):
                f.write(block)
    for root, dirs, names in os.walk(path):
        for n in dirs + names:
            os.lchown(os.path.join(root, n), BENCH_UID, BENCH_UID)
    os.lchown(path, BENCH_UID, BENCH_UID)
    os.sync()


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_epilog(cfg: ScrubConfig, job: JobContext) -> dict:
    runtime.run("epilog", cfg, job, echo=lambda _: None)
    return json.loads(runtime.report_path(cfg.report_dir, job.node, job.job_id, "epilog").read_text())


def local(total: int, shape: str, repeat: int) -> dict[str, list[float]]:
    work = Path(tempfile.mkdtemp(prefix="scrub-bench-", dir="/var/tmp"))
    cfg = ScrubConfig(scratch_root=work / "scratch", report_dir=work / "reports", log_dir=work / "log")
    job = JobContext(job_id=1, uid=BENCH_UID, gid=BENCH_UID, user="bench", node="bench", gpus=())
    scratch = cfg.scratch_root / "job-1"
    times: dict[str, list[float]] = {"rmtree": [], "scrub scratch": [], "scrub epilog": []}
    try:
        for _ in range(repeat):
            make_tree(scratch, total, shape)
            times["rmtree"].append(timed(lambda: shutil.rmtree(scratch)))
            make_tree(scratch, total, shape)
            verdict = checks.step_remove_scratch(checks.Scrub.make(cfg, job))
            assert verdict.status is checks.Status.OK and verdict.figures["bytes_removed"] == total, verdict
            make_tree(scratch, total, shape)
            times["scrub scratch"].append(timed(lambda: checks.step_remove_scratch(checks.Scrub.make(cfg, job))))
            make_tree(scratch, total, shape)
            report = run_epilog(cfg, job)
            assert report["outcome"] == "ok" and not files.dir_state(scratch).exists, report
            times["scrub epilog"].append(report["seconds"])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return times


def cluster(total: int) -> dict | None:
    """One real job leaving ``total`` bytes in its scratch; returns its epilog report."""
    from gateway.devcluster.cluster import DevClusterConfig, short_hostname
    from gateway.slurm import LocalRunner

    dev = DevClusterConfig(host=short_hostname())
    node = f"{dev.host}-n2"
    runner = LocalRunner()
    if runner.run(["scontrol", "ping"], timeout=10).returncode != 0:
        print("cluster: slurmctld not answering; skipped")
        return None
    out = dev.storage_root / "tenants" / "t-scrub-a"
    script = f"#!/bin/bash\nhead -c {total} /dev/urandom > \"$SFT_SCRATCH/blob\"\nsync\n"
    res = runner.run(["sbatch", "--parsable", "--uid=sft-t-scrub-a", "--gid=sft-t-scrub-a",
                      "--account=t-scrub-a", "--qos=ft-standard", "--gres=gpu:1", f"--nodelist={node}",
                      "--mem=512", "--time=5", f"--output={out}/bench-%j.out", f"--chdir={out}"],
                     input=script, timeout=30)
    if res.returncode != 0:
        print(f"cluster: sbatch failed ({res.stderr.strip()}); create tenant t-scrub-a first")
        return None
    jid = int(res.stdout.strip().split(";")[0])
    path = dev.report_dir / node / f"{jid}-epilog.json"
    deadline = time.monotonic() + 180
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    return json.loads(path.read_text()) if path.exists() else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--shape", choices=("big", "many", "both"), default="both")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--cluster", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench/scrub.py needs root (it chowns trees to a tenant-like uid)")
        return 2
    total = int(args.gb * 1024) * MB
    print(f"epilog cost of {total / 1e9:.2f} GB left in scratch (median of {args.repeat}, seconds)")
    print(f"{'shape':<22} {'rmtree (peer)':>14} {'scrub scratch':>14} {'scrub epilog':>13} {'ratio':>7}")
    for shape in (("big", "many") if args.shape == "both" else (args.shape,)):
        t = {k: statistics.median(v) for k, v in local(total, shape, args.repeat).items()}
        label = "4 x 256 MiB" if shape == "big" else f"{total // MB} x 1 MiB"
        print(f"{label:<22} {t['rmtree']:>14.3f} {t['scrub scratch']:>14.3f} {t['scrub epilog']:>13.3f} "
              f"{t['scrub scratch'] / t['rmtree']:>6.2f}x")
    print("ratio: scrub scratch / rmtree (the price of counting and verifying); goal: epilog <= 2 s")
    if args.cluster:
        report = cluster(total)
        if report:
            scratch = next(s for s in report["steps"] if s["name"] == "scratch")
            print(f"cluster job {report['job_id']} on {report['node']}: epilog {report['seconds']:.3f} s "
                  f"(scratch step {scratch['seconds']:.3f} s, {scratch['figures']['bytes_removed']} bytes), "
                  f"outcome {report['outcome']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
