"""FSDP shards for real: 2 ranks (gloo on the CPU) of :mod:`fsdp_probe` on an 8-layer tiny Llama.

After a training forward and after a no-grad eval each rank holds at most its 1/N share of the
decoder layers' parameters plus one layer (the layer being gathered, or the one prefetched).
Layers sharded without a root stayed whole after any forward (FSDP2 never reshards a root), so
this failed on that wrapping (rank residency = the whole decoder, 8 of 8 layers). Rank 1 zeroes
its own copy of everything before sharding, so the losses also show that sharding broadcast
rank 0's bits, 4-bit quant states included.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from fsdp_probe import deep_tiny
from test_trainer_distributed import _free_port
from trainer_testlib import REPO, Tiny, trainer_env

pytestmark = pytest.mark.train

LAYERS = 8
RANKS = 2
PROBE = Path(__file__).with_name("fsdp_probe.py")


def run_probe(model_dir: Path, tmp: Path, pythonpath: str | None = None) -> list[dict[str, Any]]:
    """Run the probe on :data:`RANKS` local ranks; return each rank's figures."""
    port = str(_free_port())
    procs = []
    for rank in range(RANKS):
        env = trainer_env(extra={"RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "SFT_DIST_TIMEOUT_S": "60",
                                 **({"PYTHONPATH": pythonpath} if pythonpath else {})})
        log = open(tmp / f"probe{rank}.log", "wb")  # noqa: SIM115 - closed with the process
        procs.append(subprocess.Popen([sys.executable, str(PROBE), str(model_dir), str(tmp)],
                                      cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait(timeout=240) for p in procs]
    logs = "\n".join((tmp / f"probe{r}.log").read_text()[-3000:] for r in range(RANKS))
    assert codes == [0] * RANKS, logs
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(RANKS)]


@pytest.fixture(scope="module")
def figures(tiny: Tiny, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("fsdp-residency")
    model = deep_tiny(tiny.path, tmp / "model", LAYERS)
    t0 = time.monotonic()
    out = run_probe(model, tmp)
    print(f"\nFSDP residency probe, {RANKS} ranks x {LAYERS} layers: {time.monotonic() - t0:.1f} s")
    return out


def test_each_rank_holds_its_share_plus_one_layer_after_forward_and_after_eval(
    figures: list[dict[str, Any]],
) -> None:
    for rank in figures:
        whole, largest = rank["after_shard"]["whole"], rank["after_shard"]["largest"]
        bound = -(-whole // RANKS) + largest
        held = {when: rank[when]["resident"] for when in ("after_shard", "after_forward", "after_backward",
                                                           "after_eval")}
        print(f"rank {rank['rank']}: decoder layers {whole} B, largest {largest} B, bound {bound} B; held {held}")
        assert held["after_forward"] <= bound and held["after_eval"] <= bound, (held, bound)
        assert held["after_backward"] <= bound and held["after_shard"] <= bound, (held, bound)
        assert held["after_eval"] < whole * 0.75  # a real share, not the whole decoder kept


def test_sharding_broadcasts_rank_0s_weights_and_quant_states(figures: list[dict[str, Any]]) -> None:
    """Rank 1 zeroed its own load: its sharded losses are still rank 0's unsharded one."""
    reference = figures[0]["whole_loss"]
    for rank in figures:
        assert rank["train_loss"] == pytest.approx(reference, rel=1e-5), rank
        assert rank["eval_loss"] == pytest.approx(reference, rel=1e-5), rank
    assert figures[1]["whole_loss"] == pytest.approx(reference, rel=1e-6)  # the same load before zeroing
