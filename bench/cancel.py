"""Cancel latency of a training job, through the real gateway on the real dev cluster (root).

Each run creates a job that trains for minutes (tiny-chat, many epochs), waits until it
is ``running`` in phase ``training`` with at least one optimizer step done, then POSTs
cancel and measures, from that POST:

- ``answer``:    the cancel request's own latency (the job reads ``cancelling``);
- ``gone``:      until Slurm reports the job no longer active (squeue/sacct);
- ``no procs``:  until no process of the tenant's unix user is left on this host;
- ``cancelled``: until the API shows ``cancelled`` (the reconciler saw Slurm confirm).

Peer: the platform's cancel deadline (SFT_CANCEL_DEADLINE_S, default 20 s), after which
it escalates to SIGKILL; p99 of ``cancelled`` should stay well inside it. At the end every
job must have no result files, and the epilog's cleanup confirmation is waited for.

    /opt/slurm-finetune/venv/bin/python bench/cancel.py [--runs 10] [--reconcile-interval 1]

Runtime: about 15-20 s per run (model load and tokenizing dominate), ~3 minutes for 10.
"""

from __future__ import annotations

import argparse
import os
import pwd
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.gateway import READ_TENANT, Api, Server, onboard, pct  # noqa: E402
from gateway.config import Settings  # noqa: E402
from gateway.slurm import LocalRunner, SlurmClient  # noqa: E402
from gateway.storage.layout import unix_user_for  # noqa: E402

TENANT = READ_TENANT
LONG_HP = {"n_epochs": 40, "batch_size_tokens": 512, "max_seq_len": 256, "checkpoint_every_steps": 1000}


@dataclass
class Sample:
    answer: float
    gone: float
    procs: float
    cancelled: float
    stop_confirmed: bool


def user_processes(uid: int) -> int:
    """How many processes on this host run as ``uid`` (read from /proc, no command run)."""
    n = 0
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            for line in (d / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    n += int(line.split()[1]) == uid
                    break
        except OSError:
            continue
    return n


def wait_until(pred, timeout: float, poll: float = 0.05) -> float:  # type: ignore[no-untyped-def]
    """Seconds until ``pred()`` holds, measured from the call; NaN after ``timeout``."""
    t0 = time.perf_counter()
    while not pred():
        if time.perf_counter() - t0 > timeout:
            return float("nan")
        time.sleep(poll)
    return time.perf_counter() - t0


def one_run(api: Api, client: SlurmClient, file_id: str, uid: int) -> tuple[str, Sample]:
    job = api.create(file_id, LONG_HP)
    api.wait(job["id"], lambda j: j["status"] == "running" and j["phase"] == "training"
             and (j["progress"] or {}).get("step", 0) >= 1, timeout=180, poll=0.2)
    sid = int(job["slurm_job_id"])
    marks: dict[str, float] = {}

    def watch(name: str, pred, timeout: float = 120) -> None:  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        left = wait_until(pred, timeout)
        marks[name] = start - marks["t0"] + left

    marks["t0"] = time.perf_counter()
    res = api.cancel(job["id"])
    marks["answer"] = time.perf_counter() - marks["t0"]
    assert res["status"] in ("cancelling", "cancelled"), res
    threads = [threading.Thread(target=watch, args=a) for a in (
        ("gone", lambda: not client.states([sid])[sid].active),
        ("procs", lambda: user_processes(uid) == 0),
        ("cancelled", lambda: api.job(job["id"])["status"] == "cancelled"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    final = api.job(job["id"])
    assert final["status"] == "cancelled" and not final["result_files"], final
    return job["id"], Sample(marks["answer"], marks["gone"], marks["procs"], marks["cancelled"],
                             final["stop_confirmed"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--reconcile-interval", type=float, default=1.0)
    args = ap.parse_args()
    if os.geteuid() != 0 or LocalRunner().run(["scontrol", "ping"], timeout=10).returncode != 0:
        raise SystemExit("bench: needs root and the dev cluster (`finetune dev-cluster up`)")
    workdir = Path(tempfile.mkdtemp(prefix="sft-bench-cancel-"))
    os.chmod(workdir, 0o755)
    db = f"sqlite:///{workdir / 'gw.db'}"
    token = onboard(db, [TENANT])[TENANT]
    uid = pwd.getpwnam(unix_user_for(TENANT)).pw_uid
    if user_processes(uid):
        raise SystemExit(f"bench: {unix_user_for(TENANT)} already runs processes; wait for its jobs to end")
    server = Server(workdir, db, SFT_RECONCILE_INTERVAL_S=str(args.reconcile_interval))
    deadline = Settings().cancel_deadline_s
    samples: list[Sample] = []
    ids: list[str] = []
    try:
        api = Api(server.url, token)
        file_id = api.upload(workdir)
        client = SlurmClient(LocalRunner())
        for i in range(args.runs):
            jid, s = one_run(api, client, file_id, uid)
            ids.append(jid)
            samples.append(s)
            print(f"run {i + 1:>2}: answer {1000 * s.answer:6.1f} ms  gone {s.gone:5.2f}s  "
                  f"no procs {s.procs:5.2f}s  cancelled {s.cancelled:5.2f}s", flush=True)
        cleaned = wait_until(lambda: all(api.job(j)["cleanup"] == "confirmed" for j in ids), 60, poll=1)
    finally:
        server.stop()
    print(f"\n== cancel latency over {len(samples)} runs (reconcile interval {args.reconcile_interval}s, "
          f"cancel deadline {deadline:.0f}s)")
    for name in ("answer", "gone", "procs", "cancelled"):
        v = [getattr(s, name) for s in samples]
        print(f"{name:<10} p50 {pct(v, .5):6.2f}s  p99 {pct(v, .99):6.2f}s  max {max(v):6.2f}s  "
              f"mean {statistics.mean(v):6.2f}s")
    worst = max(s.cancelled for s in samples)
    print(f"p99 cancelled / deadline: {pct([s.cancelled for s in samples], .99) / deadline:.2f} "
          f"(worst {worst:.2f}s of {deadline:.0f}s); no artifacts: all; stop confirmed: "
          f"{sum(s.stop_confirmed for s in samples)}/{len(samples)}; cleanup confirmed by the epilog: "
          f"{'all' if cleaned == cleaned else 'NOT all within 60 s'}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
