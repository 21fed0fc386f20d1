"""What the privilege boundary costs: storage broker verbs vs the root gateway's path opens.

Peer: what the gateway did before issue 13 — a root process opening tenant files by path
(``open(path)``), which is the fastest possible and the insecure baseline. Ours: the same
work through the storage broker (connect, fork, become the tenant, no-follow open beneath the
tenant root, fd back over SCM_RIGHTS). Same files, warm-up excluded, 5 alternating repeats,
medians. Run as root on the dev cluster host (tenant ``bench-st`` is onboarded here).

    /opt/slurm-finetune/venv/bin/python bench/storage.py [--calls 200] [--jobs 100]
"""

from __future__ import annotations

import argparse
import os
import pwd
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.config import Settings  # noqa: E402
from gateway.models import new_id  # noqa: E402
from gateway.storage import Storage, create_tenant_root, layout  # noqa: E402

TENANT = "bench-st"
STORAGE = Path("/srv/slurm-finetune")


def onboard() -> pwd.struct_passwd:
    user = f"sft-{TENANT}"
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--home-dir",
                        str(layout.tenant_root(STORAGE, TENANT)), "--shell", "/usr/sbin/nologin", user], check=True)
        pw = pwd.getpwnam(user)
    create_tenant_root(STORAGE, TENANT, pw.pw_uid, pw.pw_gid)
    return pw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root (it onboards a bench tenant)")
    pw = onboard()
    root = layout.tenant_root(STORAGE, TENANT)
    store = Storage(STORAGE, Settings().broker_socket, "sft-gateway").tenant(TENANT)
    sha = "ab" * 32
    data = b'{"messages": []}\n' * 64
    (root / "datasets").mkdir(exist_ok=True)
    ds = root / "datasets" / f"{sha}.jsonl"
    ds.write_bytes(data)
    jobs = [new_id("ftjob") for _ in range(a.jobs)]
    for j in jobs:
        (root / "jobs" / j).mkdir(parents=True, exist_ok=True)
        (root / "jobs" / j / "events.jsonl").write_bytes(b'{"type": "metrics", "step": 1}\n' * 4)
    for p in [root / "datasets", ds, root / "jobs", *(root / "jobs").rglob("*")]:
        os.lchown(p, pw.pw_uid, pw.pw_gid)

    def peer_open() -> None:
        with open(ds, "rb") as f:
            f.read()

    def ours_open() -> None:
        with os.fdopen(store.open(layout.dataset(sha), len(data)), "rb") as f:
            f.read()

    def peer_events() -> None:
        for j in jobs:
            with open(root / "jobs" / j / "events.jsonl", "rb") as f:
                f.read(4 << 20)

    def ours_events() -> None:
        store.read_events({j: 0 for j in jobs})

    def timed(fn, n: int) -> float:  # type: ignore[no-untyped-def]
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t0) / n

    for fn in (peer_open, ours_open, peer_events, ours_events):   # warm-up, excluded
        fn()
    # same work, same result: the bytes each side reads are identical
    with os.fdopen(store.open(layout.dataset(sha), len(data)), "rb") as f:
        assert f.read() == ds.read_bytes()
    assert store.read_events({j: 0 for j in jobs}) == {j: (root / "jobs" / j / "events.jsonl").read_bytes()
                                                       for j in jobs}
    res: dict[str, list[float]] = {k: [] for k in ("peer_open", "ours_open", "peer_events", "ours_events")}
    for _ in range(a.repeats):        # alternating
        res["peer_open"].append(timed(peer_open, a.calls))
        res["ours_open"].append(timed(ours_open, a.calls))
        res["peer_events"].append(timed(peer_events, 20))
        res["ours_events"].append(timed(ours_events, 20))
    med = {k: statistics.median(v) for k, v in res.items()}
    print("peer: a root process opening tenant files by path (the gateway before issue 13; insecure)")
    print("ours: storage broker verb (fork, become the tenant, no-follow open, fd/bytes back)")
    print(f"open one dataset file ({len(data)} B), median of {a.repeats}x{a.calls}: "
          f"peer {med['peer_open'] * 1e6:.0f} us, ours {med['ours_open'] * 1e3:.2f} ms "
          f"-> x{med['ours_open'] / med['peer_open']:.0f} slower per download start")
    print(f"read events.jsonl of {a.jobs} jobs (one reconcile cycle, one tenant), median of {a.repeats}x20: "
          f"peer {med['peer_events'] * 1e3:.2f} ms, ours {med['ours_events'] * 1e3:.2f} ms "
          f"-> x{med['ours_events'] / med['peer_events']:.1f}")


if __name__ == "__main__":
    main()
