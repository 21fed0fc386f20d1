"""FSDP residency on the two dev nodes: one rank of ``tests/trainer/fsdp_probe.py`` on vm-n1 and one on
vm-n2 (one srun step, rank and size from srun's SLURM_* names, gloo at the head node's NodeAddr, as
the batch script finds it). After a training forward and after a no-grad eval each rank holds at
most its half of the decoder layers' parameters plus one layer, and rank 1 (which zeroed its own
load) computes rank 0's losses. The probe runs the checkout's trainer (PYTHONPATH), not the
installed copy: it tests the sharding code, not a deployment.

The dev cluster's nodes are two slurmd on one host: this is a real two-node Slurm step, not
two machines' network.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "trainer" / "fsdp_probe.py"
NODES = ("vm-n1", "vm-n2")
LAYERS = 8


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory both nodes' steps see (the cluster gives each job its own /tmp)."""
    path = Path(tempfile.mkdtemp(prefix="fsdp-residency-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _head_addr(node: str) -> str:
    out = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, check=True).stdout
    return next(w.split("=", 1)[1] for w in out.split() if w.startswith("NodeAddr="))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_node_fsdp_ranks_hold_their_share_after_forward_and_after_eval(cluster: None, shared_dir: Path) -> None:
    from tests.trainer.fsdp_probe import deep_tiny
    from trainer.catalog import make_tiny

    model = deep_tiny(make_tiny(shared_dir / "tiny"), shared_dir / "model", LAYERS)
    env = (f"ALL,MASTER_ADDR={_head_addr(NODES[0])},MASTER_PORT={_free_port()},PYTHONPATH={REPO},"
           "OMP_NUM_THREADS=1,SFT_DIST_TIMEOUT_S=60,PYTHONUNBUFFERED=1")
    argv = ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", f"--nodelist={','.join(NODES)}",
            "--time=5", "--kill-on-bad-exit=1", f"--chdir={REPO}", f"--export={env}",
            sys.executable, str(PROBE), str(model), str(shared_dir)]
    t0 = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False)
    seconds = time.monotonic() - t0
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    ranks = [json.loads((shared_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["node"] for r in ranks] == list(NODES)  # one rank on each node
    reference = ranks[0]["whole_loss"]
    for rank in ranks:
        whole, largest = rank["after_shard"]["whole"], rank["after_shard"]["largest"]
        bound = -(-whole // 2) + largest
        held = {when: rank[when]["resident"] for when in ("after_forward", "after_eval")}
        print(f"\n{rank['node']} rank {rank['rank']}: decoder {whole} B, bound {bound} B, held {held}")
        assert held["after_forward"] <= bound and held["after_eval"] <= bound, (held, bound)
        assert rank["train_loss"] == pytest.approx(reference, rel=1e-5)
        assert rank["eval_loss"] == pytest.approx(reference, rel=1e-5)
    print(f"2-node srun residency probe: {seconds:.1f} s")
