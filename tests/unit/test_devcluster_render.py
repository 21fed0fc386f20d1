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
