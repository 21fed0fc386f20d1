"""Dev-cluster config rendering: pure, hostname-driven, every required setting present."""

from __future__ import annotations

from gateway.devcluster.cluster import DevClusterConfig, render_configs


def test_configs_follow_the_hostname() -> None:
    confs = render_configs(DevClusterConfig(host="login7"), "pw")
    slurm = confs["slurm.conf"]
    assert "SlurmctldHost=login7" in slurm
    assert "NodeName=login7-n1 NodeHostname=login7 NodeAddr=127.0.0.1 Port=17001" in slurm
    assert "NodeName=login7-n2 NodeHostname=login7 NodeAddr=127.0.0.1 Port=17002" in slurm
    assert "NodeName=login7-n2 Name=gpu File=/dev/nvidia[4-7]" in confs["gres.conf"]
    assert "StoragePass=pw" in confs["slurmdbd.conf"]
    assert all(text.startswith("# slurm-finetune dev cluster") for text in confs.values())


def test_required_settings() -> None:
    slurm = render_configs(DevClusterConfig(host="h"), "pw")["slurm.conf"]
    for line in ("PriorityType=priority/multifactor",
                 "AccountingStorageEnforce=associations,limits,qos,safe",
                 "AccountingStorageTRES=gres/gpu", "ProctrackType=proctrack/cgroup",
                 "TaskPlugin=task/cgroup", "PrologFlags=Alloc,Contain",
                 "Prolog=/opt/slurm-finetune/libexec/prolog.sh",
                 "Epilog=/opt/slurm-finetune/libexec/epilog.sh", "SlurmdParameters=config_overrides"):
        assert line in slurm.splitlines()
    cgroup = render_configs(DevClusterConfig(host="h"), "pw")["cgroup.conf"]
    assert "ConstrainDevices=yes" in cgroup and "ConstrainRAMSpace=yes" in cgroup


def test_simulated_nodes_get_a_partition_of_their_own_and_fake_gpus_after_the_real_ones() -> None:
    plain = render_configs(DevClusterConfig(host="h"), "pw")
    confs = render_configs(DevClusterConfig(host="h", sim_nodes=3, sim_gpus_per_node=8), "pw")
    slurm, gres = confs["slurm.conf"], confs["gres.conf"]
    assert "PartitionName=gpu Nodes=h-n1,h-n2 Default=YES MaxTime=INFINITE State=UP" in slurm.splitlines()
    assert "PartitionName=sim Nodes=h-s1,h-s2,h-s3 Default=NO MaxTime=INFINITE State=UP" in slurm.splitlines()
    assert "NodeName=h-s3 NodeHostname=h NodeAddr=127.0.0.1 Port=17005 CPUs=16 RealMemory=66560 Gres=gpu:8" \
        " State=UNKNOWN" in slurm
    assert "NodeName=h-s1 Name=gpu File=/dev/nvidia[8-15]" in gres       # after the real nodes' 0-7
    assert "NodeName=h-s3 Name=gpu File=/dev/nvidia[24-31]" in gres
    assert "NodeName=h-s2 BasePath=/var/lib/slurm-finetune/jobtmp/h-s2" in confs["job_container.conf"]
    assert "sim" not in plain["slurm.conf"] and "h-s1" not in plain["gres.conf"]   # none unless asked
    assert DevClusterConfig(host="h", sim_nodes=2).all_names() == ("h-n1", "h-n2", "h-s1", "h-s2")
