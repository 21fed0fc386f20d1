"""The capacity run's short version (bench/capacity.py): a compressed day on simulated nodes through
the real gateway, asserting the control plane's invariants at concurrency.

8 simulated nodes x 8 GPUs beside the dev cluster's two (``dev-cluster up --sim-nodes 8``), 8 tenants
of uneven demand, bursts, gang jobs over half the nodes, cancels (some while queued) and a node lost
mid-day, every job through the official openai client, with a read mix beside it. Then: no job lost,
duplicated in Slurm or left non-final; every job that ran has its nodes' cleanup confirmed; the
cancelled ones are cancelled and the others succeeded; and no tenant starved in the minutes with a
queue (each got a good part of its fair share of what it asked for). Runs last in the slurm tier (the
name), and puts the dev cluster back to its two nodes afterwards.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.capacity import PARTITION, day_ours, figures, make_plan, run, speedup_for, training_file
from gateway.devcluster.cluster import DevCluster, DevClusterConfig, short_hostname

pytestmark = pytest.mark.slurm
NODES = 8


@pytest.fixture(scope="module")
def sim_nodes(cluster: None) -> Iterator[None]:
    DevCluster(DevClusterConfig(host=short_hostname(), sim_nodes=NODES), echo=lambda _: None).up()
    deadline = time.monotonic() + 60
    while True:        # `up` takes a node that is not yet responding ("idle*") as usable
        states = run(["sinfo", "-h", "-N", "-p", PARTITION, "-o", "%N %T"]).stdout.split("\n")
        if len([s for s in states if s.endswith(" idle")]) == NODES:
            break
        assert time.monotonic() < deadline, states
        time.sleep(0.5)
    yield
    DevCluster(echo=lambda _: None).up()


def test_a_short_day_at_concurrency_loses_nothing_and_cleans_up_every_node(sim_nodes: None) -> None:
    plan = make_plan(120, 60, NODES, 8, load=1.1, host=short_hostname(), seed=2)
    workdir = Path("/var/tmp/sft-capacity-test")
    workdir.mkdir(exist_ok=True)
    speedup = speedup_for(plan, training_file(workdir).stat().st_size)
    result = day_ours(plan, workdir, speedup=speedup, mix_rate=20, drain_s=300, echo=lambda _: None)
    f = figures(plan, result)
    summary = json.dumps({k: v for k, v in f.items() if k != "fairness"} | {"fairness": f["fairness"]})
    assert f["jobs"] == len(plan.jobs), summary
    assert (f["lost"], f["duplicated"], f["not_final"], f["cleanup_unconfirmed"]) == (0, 0, 0, 0), summary
    refused = [o.error for o in result.outcomes.values() if o.error and not o.error.startswith("cancel")]
    assert not refused, refused[:3]
    planned_cancels = {j.key for j in plan.jobs if j.cancel_after is not None}
    for key, o in result.outcomes.items():      # a cancel that came after the end leaves it succeeded
        assert o.status == "succeeded" or (o.status == "cancelled" and key in planned_cancels), (key, o)
    assert f["statuses"].get("cancelled", 0) >= len(planned_cancels) // 2, summary
    # the lost node's jobs went back to the queue and ran again elsewhere: every one of them succeeded
    # in the minutes with a queue, no tenant starved: each got at least 35 % of its max-min fair share of
    # what it asked for (a waiting gang left out: it waits for whole nodes, which no share gives it
    # sooner). Not more: Slurm recomputes the fair-share factor once per PriorityCalcPeriod (1 minute,
    # its least), so this 60-s day runs in the order of submission and QOS, and the lowest share
    # measured over 4 runs was 0.48 to 0.89 (0.697 in CI, with a 0.7 bound that failed it). The
    # fair-share figure that fairshare itself decides is bench/capacity.py's, over a day of hours.
    assert f["fairness"]["contended_slices"] > 0 and f["fairness"]["min_single_node"] >= 0.35, summary
    assert result.extra["mix"]["errors"] == 0 and result.extra["ingest_lag_s"]["n"] > 0, result.extra
