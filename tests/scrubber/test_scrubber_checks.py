"""Pure parts of the scrubber: parsing /proc and cgroups, deciding whose a process is,
judging observations, fault injection, settings."""

from __future__ import annotations

import pwd
import signal
from pathlib import Path

import pytest

from scrubber import checks, gpu, procs
from scrubber.checks import Status
from scrubber.config import ScrubConfig, ScrubConfigError, load_config
from scrubber.files import DirState, Removed
from scrubber.jobenv import JobEnvError, job_context, parse_gpu_list


def proc(pid: int, uid: int, cgroup: str = "/", state: str = "S", stepd: int | None = None) -> procs.Proc:
    """A process whose /proc/<pid>/cgroup is cgroup v1 with ``cgroup`` as its freezer path,
    or exactly ``cgroup`` when that is already file text (``N:...:path`` lines)."""
    text = cgroup if ":" in cgroup else f"12:pids:/\n6:freezer:{cgroup}\n0::/\n"
    return procs.Proc(pid, 1, uid, state, "x", text, stepd)


def v2(path: str) -> str:
    return f"0::{path}\n"


STEPD_7 = proc(10, 0, "/slurm_n2/uid_500/job_7", stepd=7)
STEPD_8_N1 = proc(11, 0, "/slurm_n1/uid_500/job_8", stepd=8)


# ----------------------------------------------------------------- /proc parsing
def test_parse_stat_survives_spaces_and_parens_in_comm() -> None:
    assert procs.parse_stat("42 (evil) (name Z 1) S 17 42 42 0") == ("S", 17)


def test_parse_start_reads_field_22_after_a_hostile_comm() -> None:
    stat = ("4242 (a) b) S 1 4242 4242 0 -1 4194560 171 0 0 0 3 1 0 0 20 0 1 0 987654 "
            "10166272 805 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0")
    assert procs.parse_start(stat) == 987654 and procs.parse_stat(stat) == ("S", 1)


# Real-looking /proc/<pid>/cgroup contents.
V1_JOB_82 = """12:rdma:/
11:cpuset:/slurm_vm-n2/uid_991/job_82/step_batch
10:blkio:/system.slice/slurmd.service
9:pids:/system.slice/slurmd.service
8:memory:/slurm_vm-n2/uid_991/job_82/step_batch/task_0
7:devices:/slurm_vm-n2/uid_991/job_82/step_batch
6:freezer:/slurm_vm-n2/uid_991/job_82/step_batch
5:cpu,cpuacct:/system.slice/slurmd.service
4:net_cls,net_prio:/
3:perf_event:/
2:hugetlb:/
1:name=systemd:/system.slice/slurmd.service
0::/system.slice/slurmd.service
"""
CONTAINER_HOST = """9:name=systemd:/
8:pids:/
7:blkio:/
6:freezer:/
5:devices:/
4:memory:/process_api/1aeb225b9c7ae6cbb3bcaa6ed2577f18
3:cpuset:/
2:cpuacct:/
1:cpu:/
0::/
"""


@pytest.mark.parametrize(("text", "expected"), [
    pytest.param(V1_JOB_82, procs.Where(True, "vm-n2", 82, 991), id="v1-multiple-slurmd-all-controllers"),
    pytest.param("12:pids:/\n10:devices:/slurm/uid_2101171/job_280678/step_interactive/task_0\n"
                 "6:freezer:/\n1:name=systemd:/user.slice/user-2101171.slice/session-7.scope\n",
                 procs.Where(True, None, 280678, 2101171), id="v1-one-slurmd-devices-line-only"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/job_82/step_0\n8:memory:/slurm_vm-n2\n",
                 procs.Where(True, "vm-n2", 82, 991), id="v1-job-beats-node-level"),
    pytest.param("6:freezer:/slurm_vm-n2\n0::/\n", procs.Where(True, "vm-n2", None), id="v1-node-cgroup"),
    pytest.param("6:freezer:/slurm/system\n", procs.Where(True, None, None), id="v1-slurmd-system"),
    pytest.param(v2("/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0"),
                 procs.Where(True, None, 42), id="v2-batch-task"),
    pytest.param(v2("/system.slice/slurmstepd.scope/job_42/step_batch/user/task_special"),
                 procs.Where(True, None, 42), id="v2-task-special"),
    pytest.param(v2("/system.slice/slurmstepd.scope/job_42/step_extern/slurm"),
                 procs.Where(True, None, 42), id="v2-stepd"),
    pytest.param(v2("/system.slice/vm-n1_slurmstepd.scope/job_8/step_0/user/task_3"),
                 procs.Where(True, "vm-n1", 8), id="v2-multiple-slurmd"),
    pytest.param(v2("/system.slice/slurmstepd.scope/system"), procs.Where(True, None, None),
                 id="v2-stepd-infrastructure"),
    pytest.param(v2("/user.slice/user-1000.slice/session-3.scope"), procs.NOT_SLURM, id="v2-login"),
    pytest.param(v2("/system.slice/slurmd.service"), procs.NOT_SLURM, id="v2-slurmd-itself"),
    pytest.param(v2("/init.scope"), procs.NOT_SLURM, id="v2-init"),
    pytest.param(CONTAINER_HOST, procs.NOT_SLURM, id="v1-container-no-slurm"),
])
def test_cgroup_where_knows_v1_and_v2_layouts(text: str, expected: procs.Where) -> None:
    assert procs.cgroup_where(text) == expected


@pytest.mark.parametrize("text", [
    pytest.param(v2("/job_42/step_batch/user/task_0"), id="v2-cgroup-namespace-no-scope"),
    pytest.param(v2("/system.slice/slurmstepd.scope/job_x42/step_0"), id="v2-bad-job-id"),
    pytest.param(v2("/system.slice/slurmstepd.scope/step_0/user"), id="v2-no-job-level"),
    pytest.param("6:freezer:/slurm/job_42/step_0\n", id="v1-no-uid-level"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/weird\n", id="v1-unknown-below-uid"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/job_41/step_0\n8:memory:/slurm_vm-n2/uid_991/job_42\n",
                 id="v1-lines-name-two-jobs"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/job_42\n0::/system.slice/slurmstepd.scope/job_41/step_0\n",
                 id="v1-and-v2-disagree"),
    pytest.param("6:freezer:/slurm/uid_991/job_42\n0::/system.slice/slurmstepd.scope/job_41/step_0\n",
                 id="v1-and-v2-disagree-on-the-job-only"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/job_42\n8:memory:/slurm_vm-n2/uid_992/job_42\n",
                 id="v1-lines-name-two-uids"),
    pytest.param("6:freezer:/slurm_vm-n2/uid_991/job_42\n8:memory:/slurm_vm-n1\n", id="v1-lines-name-two-nodes"),
    pytest.param("", id="empty-file"),
    pytest.param("garbage without lines\n", id="no-cgroup-line"),
])
def test_unknown_cgroup_layouts_are_flagged_not_guessed(text: str) -> None:
    w = procs.cgroup_where(text)
    assert w.unknown and w.job is None


@pytest.mark.parametrize(("cg", "expected"), [
    ("/slurm_vm-n2/uid_991/job_82/step_batch", procs.Where(True, "vm-n2", 82, 991)),
    ("/slurm/uid_5/job_1", procs.Where(True, None, 1, 5)),
    ("/slurm_vm-n2", procs.Where(True, "vm-n2", None)),
    ("/user.slice", procs.Where(False, None, None)),
])
def test_where_reads_node_uid_and_job_from_the_cgroup(cg: str, expected: procs.Where) -> None:
    assert procs.where(cg) == expected


def test_stepd_job_from_cmdline() -> None:
    assert procs.stepd_job(b"slurmstepd: [84.extern]\0") == 84
    assert procs.stepd_job(b"sleep\x00100") is None


# ------------------------------------------------------------ whose is a process
def test_epilog_kills_own_job_escaped_and_stale_but_spares_other_live_jobs() -> None:
    ps = [STEPD_7, STEPD_8_N1,
          proc(20, 500, "/slurm_n2/uid_500/job_9/step_batch"),  # the ending job
          proc(21, 500, "/"),  # escaped / ssh'd in
          proc(22, 500, "/slurm_n2/uid_500/job_5/step_0"),  # a job that has ended
          proc(23, 500, "/slurm_n2/uid_500/job_7/step_0"),  # its other live job here
          proc(24, 500, "/slurm_n1/uid_500/job_8/step_0"),  # live job on the other node
          proc(25, 500, "/", state="Z"),  # already dead
          proc(26, 501, "/")]  # another user
    live = procs.live_jobs(ps)
    targets = procs.kill_targets(ps, uid=500, node="n2", job_id=9, live=live)
    assert [p.pid for p in targets] == [20, 21, 22]


def test_prolog_leftovers_are_tenant_processes_of_no_live_job_on_this_node() -> None:
    ps = [STEPD_7, proc(30, 500, "/slurm_n2/uid_500/job_7/step_0"),
          proc(31, 600, "/"), proc(32, 600, "/slurm_n2"), proc(33, 600, "/slurm_n1"),
          proc(34, 700, "/"), proc(35, 600, "/slurm_n2/uid_600/job_4/step_0")]
    found = procs.leftovers(ps, tenant_uids={500, 600}, node="n2", job_id=9, live=procs.live_jobs(ps))
    assert [p.pid for p in found] == [31, 32, 35]


def test_v2_epilog_of_job_41_spares_job_42_of_the_same_user() -> None:
    scope = "/system.slice/slurmstepd.scope"
    ps = [proc(10, 0, v2(f"{scope}/job_42/step_batch/slurm"), stepd=42),
          proc(11, 0, v2(f"{scope}/job_42/step_extern/slurm"), stepd=42),
          proc(20, 500, v2(f"{scope}/job_42/step_batch/user/task_0")),  # job 42's trainer
          proc(21, 500, v2(f"{scope}/job_41/step_batch/user/task_0")),  # job 41's leftover
          proc(22, 500, v2("/user.slice/user-500.slice/session-9.scope")),  # escaped
          proc(23, 500, v2(f"{scope}/job_40/step_0/user/task_1")),  # an ended job's
          proc(24, 500, v2("/system.slice/vm-n1_slurmstepd.scope/job_7/step_0/user/task_0"))]  # n1, ended
    live = procs.live_jobs(ps)
    assert live[42].uid == 500  # v2 has no uid level: the job's processes tell
    targets = procs.kill_targets(ps, uid=500, node="vm-n2", job_id=41, live=live)
    assert [p.pid for p in targets] == [21, 22, 23, 24]
    assert procs.undecided(ps, {500}) == []


def test_unknown_cgroup_layout_fails_closed_in_epilog_and_prolog() -> None:
    odd = proc(30, 500, v2("/job_43/step_0/user/task_0"))
    ps = [STEPD_7, odd, proc(31, 500, "/")]
    live = procs.live_jobs(ps)
    assert procs.owner(odd, node="n2", job_id=9, live=live) is procs.Owner.UNKNOWN
    assert [p.pid for p in procs.kill_targets(ps, uid=500, node="n2", job_id=9, live=live)] == [31]
    undecided = procs.undecided(ps, {500})
    assert undecided == [odd]
    v = checks.judge_kill([], [], undecided)
    assert v.status is Status.FAIL and "neither killed nor spared" in v.message
    assert "/job_43/step_0" in v.message and v.figures["undecided"] == ["30:x:uid=500"]
    assert procs.leftovers(ps, tenant_uids={500}, node="n2", job_id=9, live=live) == [ps[2]]
    p = checks.judge_leftovers([ps[2]], undecided)
    assert p.status is Status.FAIL and "cannot place" in p.message


def test_tmp_files_need_to_know_whose_live_jobs_these_are() -> None:
    scope = "/system.slice/slurmstepd.scope"
    ps = [proc(10, 0, v2(f"{scope}/job_43/step_extern/slurm"), stepd=43)]  # no user process yet
    live = procs.live_jobs(ps)
    assert live[43].uid is None
    v = checks.judge_other_jobs(live, 500, 41, "/tmp")
    assert v is not None and v.status is Status.FAIL and "[43]" in v.message
    ps.append(proc(20, 500, v2(f"{scope}/job_43/step_0/user/task_0")))
    v = checks.judge_other_jobs(procs.live_jobs(ps), 500, 41, "/tmp")
    assert v is not None and v.status is Status.SKIPPED and "[43]" in v.message
    ps[1] = proc(20, 600, v2(f"{scope}/job_43/step_0/user/task_0"))
    assert checks.judge_other_jobs(procs.live_jobs(ps), 500, 41, "/tmp") is None  # 600's job: go on
    assert checks.judge_other_jobs(procs.live_jobs([STEPD_7]), 500, 41, "/tmp").status is Status.SKIPPED  # type: ignore[union-attr]


class FakeHandle:
    """A process that reacts to signals as told; records what it received."""

    def __init__(self, p: procs.Proc, alive: set[int], sent: list[tuple[int, int]],
                 ignores_term: bool = False, unkillable: bool = False) -> None:
        self.proc, self.alive, self.sent = p, alive, sent
        self.ignores_term, self.unkillable, self.closed = ignores_term, unkillable, False

    def send(self, sig: int) -> bool:
        if self.proc.pid not in self.alive:
            return False
        self.sent.append((self.proc.pid, sig))
        if not self.unkillable and (sig == signal.SIGKILL or not self.ignores_term):
            self.alive.discard(self.proc.pid)
        return True

    def gone(self) -> bool:
        return self.proc.pid not in self.alive

    def close(self) -> None:
        self.closed = True


def test_terminate_escalates_to_kill_for_term_ignoring_processes() -> None:
    sent: list[tuple[int, int]] = []
    alive = {1, 2}
    handles: dict[int, FakeHandle] = {}

    def opener(p: procs.Proc) -> FakeHandle:
        handles[p.pid] = FakeHandle(p, alive, sent, ignores_term=p.pid == 2)
        return handles[p.pid]

    res = procs.terminate([proc(1, 5), proc(2, 5)], grace_s=0.05, wait_s=0.05, open_fn=opener,
                          poll_s=0.01)
    assert res.needed_kill == (2,) and res.survivors == () and len(res.killed) == 2
    assert (2, signal.SIGKILL) in sent and (1, signal.SIGKILL) not in sent
    assert all(h.closed for h in handles.values())


def test_terminate_reports_unkillable_and_never_signals_what_it_could_not_verify() -> None:
    sent: list[tuple[int, int]] = []
    alive = {3}
    res = procs.terminate([proc(3, 5), proc(4, 5)], grace_s=0.01, wait_s=0.01, poll_s=0.005,
                          open_fn=lambda p: FakeHandle(p, alive, sent, unkillable=True) if p.pid == 3 else None)
    assert [p.pid for p in res.survivors] == [3] and [p.pid for p in res.not_signalled] == [4]
    assert {pid for pid, _ in sent} == {3}
    v = checks.judge_kill([res], list(res.survivors))
    assert v.status is Status.FAIL and v.figures["not_signalled"] == 1


# ----------------------------------------------------------------------- judges
def test_scratch_judge_wants_job_user_and_0700() -> None:
    assert checks.judge_scratch_created(DirState(True, True, 5, 5, 0o700), 5).status is Status.OK
    assert checks.judge_scratch_created(DirState(True, True, 5, 5, 0o755), 5).status is Status.FAIL
    assert checks.judge_scratch_created(DirState(True, True, 0, 0, 0o700), 5).status is Status.FAIL
    assert checks.judge_scratch_created(DirState(True, False, 5, 5, 0o700), 5).status is Status.FAIL
    assert checks.judge_scratch_created(DirState(False), 5, "EACCES").status is Status.FAIL


def test_removal_judge_fails_on_leftovers_or_errors_and_never_names_files() -> None:
    good = checks.judge_removed(Removed(files=3, dirs=1, bytes=10), 0, "scratch")
    assert good.status is Status.OK and good.figures["bytes_removed"] == 10
    assert checks.judge_removed(Removed(files=3), 1, "scratch").status is Status.FAIL
    bad = checks.judge_removed(Removed(errors=1, first_error="x: Permission denied"), 0, "scratch")
    assert bad.status is Status.FAIL


def test_gpu_judges_skip_without_driver_never_pass() -> None:
    assert checks.judge_gpu_processes(None, [4], {}, {5}, 1) == checks.skipped("no driver")
    assert checks.judge_gpu_memory(None, [4], 0) == checks.skipped("no driver")
    assert checks.judge_gpu_memory(None, [], 0).message == "the job has no GPU"


def test_gpu_judges_with_nvml() -> None:
    clean = {4: gpu.GpuInfo(4, "GPU-a", 80 << 30, 0, ())}
    busy = {4: gpu.GpuInfo(4, "GPU-a", 80 << 30, 1 << 30, (77,))}
    assert checks.judge_gpu_memory(clean, [4], 0).status is Status.OK
    assert checks.judge_gpu_memory(busy, [4], 0).status is Status.FAIL
    assert checks.judge_gpu_memory(clean, [4, 5], 0).status is Status.FAIL  # NVML misses one
    assert checks.judge_gpu_processes(busy, [4], {77: 600}, {5}, 1).status is Status.FAIL
    assert checks.judge_gpu_processes(busy, [4], {77: 5}, {5}, 1).status is Status.OK
    assert checks.judge_gpu_processes(busy, [4], {77: None}, {5}, 1).status is Status.FAIL
    assert checks.judge_gpu_processes(busy, [4], {}, set(), 77).status is Status.OK  # the wiper


def test_wipe_judge() -> None:
    r = gpu.WipeResult("GPU-a", 80 << 30, 79 << 30, 79 << 30, 0, 0.5)
    v = checks.judge_wipe([r], 1)
    assert v.status is Status.OK and v.figures["gpu_bytes_wiped"] == 79 << 30
    assert v.figures["gpu_wipe_fraction"] == 1.0 and "100.00% of the memory that was free" in v.message
    assert checks.judge_wipe([gpu.WipeResult("GPU-a", 1, 1, 1, 1, 0.1)], 1).status is Status.FAIL
    assert checks.judge_wipe([r], 2).status is Status.FAIL


@pytest.mark.parametrize(("free", "wiped", "passes"), [
    (10_000, 9_890, False),  # 98.9 %
    (10_000, 9_899, False),  # 98.99 %
    (10_000, 9_900, True),  # 99 %
    (10_000, 10_000, True),
    (79 << 30, ((79 << 30) * 99 + 99) // 100, True),  # the first byte count reaching 99 %
    (79 << 30, ((79 << 30) * 99 + 99) // 100 - 1, False),
    (80 << 30, 4 << 30, False),  # 5 % of a GPU
    (0, 0, False),  # nothing free: another process holds the GPU, nothing was wiped
])
def test_wipe_judge_wants_99_percent_of_the_free_memory(free: int, wiped: int, passes: bool) -> None:
    r = gpu.WipeResult("GPU-a", 80 << 30, free, wiped, 0, 0.5)
    v = checks.judge_wipe([r], 1)
    assert (v.status is Status.OK) is passes, v
    assert v.figures["gpu_bytes_free"] == free and v.figures["gpu_wipe_fraction"] == round(r.fraction, 6)
    if not passes:
        assert "covered too little" in v.message and "need 99%" in v.message


def test_wipe_judge_reports_the_fraction_rounded_down_and_judges_each_gpu() -> None:
    short = gpu.WipeResult("GPU-b", 200_000, 100_000, 98_999, 0, 0.1)  # 98.999 %: not "99.00%"
    v = checks.judge_wipe([gpu.WipeResult("GPU-a", 100, 100, 100, 0, 0.1), short], 2)
    assert v.status is Status.FAIL and "{'GPU-b': '98.99%'}" in v.message
    assert v.figures["gpu_wipe_fraction"] == 0.98999  # the worst GPU
    assert checks.judge_wipe([gpu.WipeResult("GPU-a", 1, 1000, 5, 0, 0.1)], 1).message.count("0.50%") == 1


def test_device_holders_judge() -> None:
    holders = {"/dev/nvidia4": [(10, 0), (11, 5)]}
    assert checks.judge_device_holders(holders, {0, 5}).status is Status.OK
    assert checks.judge_device_holders(holders, {0}).status is Status.FAIL
    assert checks.judge_device_holders({}, {0}).status is Status.SKIPPED


# ---------------------------------------------------------------- gres / gpus
def test_gres_conf_maps_job_gpu_indices_to_device_files() -> None:
    conf = ("# comment\nAutoDetect=off\nNodeName=vm-n1 Name=gpu File=/dev/nvidia[0-3]\n"
            "NodeName=vm-n2 Name=gpu File=/dev/nvidia[4-7]\n")
    assert gpu.job_gpu_files(conf, "vm-n2", (0, 2)) == ["/dev/nvidia4", "/dev/nvidia6"]
    assert gpu.job_gpu_files("", "n", (1,)) == ["/dev/nvidia1"]
    assert gpu.expand_hostlist("gpu[01-02,5]") == ["gpu01", "gpu02", "gpu5"]
    assert gpu.node_gpu_files("NodeName=a[1-2] Name=gpu File=/dev/nvidia0\n", "a2") == ["/dev/nvidia0"]


# ------------------------------------------------------------ env and settings
def test_job_context_from_slurm_env() -> None:
    ctx = job_context({"SLURM_JOB_ID": "12", "SLURM_JOB_UID": "0", "SLURM_JOB_GPUS": "2,0",
                       "SLURMD_NODENAME": "vm-n2"})
    assert (ctx.job_id, ctx.user, ctx.node, ctx.gpus) == (12, "root", "vm-n2", (0, 2))
    with pytest.raises(JobEnvError, match="SLURM_JOB_ID"):
        job_context({"SLURM_JOB_UID": "0"})
    assert parse_gpu_list("") == () and parse_gpu_list("(null)") == ()


def test_config_rejects_unknown_keys_with_the_valid_list(tmp_path: Path) -> None:
    p = tmp_path / "scrubber.toml"
    p.write_text('fail_stpe = "scratch"\n')
    with pytest.raises(ScrubConfigError, match="unknown key.*fail_stpe.*valid keys: .*fail_step"):
        load_config(p)
    p.write_text("kill_grace_s = -1\n")
    with pytest.raises(ScrubConfigError, match="kill_grace_s"):
        load_config(p)


def test_service_users_are_not_tenants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def user(name: str, uid: int) -> pwd.struct_passwd:
        return pwd.struct_passwd((name, "x", uid, uid, "", "/", "/bin/false"))

    users = [user("root", 0), user("sft-gateway", 999), user("sft-t-a", 987), user("alice", 1000)]
    monkeypatch.setattr(checks.pwd, "getpwall", lambda: users)
    assert checks._tenant_uids("sft-", 5) == {999, 987, 5}
    assert checks._tenant_uids("sft-", 5, ("sft-gateway",)) == {987, 5}  # the gateway's own user
    assert ScrubConfig().service_users == ("sft-gateway",)
    p = tmp_path / "scrubber.toml"
    p.write_text('service_users = ["sft-gw", "sft-ops"]\n')
    assert load_config(p).service_users == ("sft-gw", "sft-ops")
    p.write_text('service_users = "sft-gw"\n')
    with pytest.raises(ScrubConfigError, match="service_users"):
        load_config(p)


def test_config_layers_and_fault_injection_scope(tmp_path: Path) -> None:
    p = tmp_path / "scrubber.toml"
    p.write_text('fail_step = "scratch"\nfail_node = "vm-n2"\ntmp_dirs = ["/tmp"]\n'
                 'scratch_root = "/x"\n')
    cfg = load_config(p, {"scratch_root": "/y", "log_dir": None})
    assert cfg.scratch_root == Path("/y") and cfg.tmp_dirs == (Path("/tmp"),)
    assert cfg.fails_on_purpose("scratch", "vm-n2", "anyone")
    assert not cfg.fails_on_purpose("scratch", "vm-n1", "anyone")
    assert not cfg.fails_on_purpose("tmp_files", "vm-n2", "anyone")
    assert load_config(tmp_path / "absent.toml") == ScrubConfig()


def test_the_storage_brokers_children_are_not_leftovers() -> None:
    """On a host that is gateway and compute node at once, the broker's per-request children run as
    the tenant (and may run sbatch as it): found by their root broker ancestor, never by name."""
    from scrubber import procs as P

    v1 = "4:freezer:/\n"
    tenant = 5001
    ps = [P.Proc(1, 0, 0, "S", "init", v1),
          P.Proc(10, 1, 0, "S", "python", v1, broker=True),          # the root broker daemon
          P.Proc(11, 10, tenant, "S", "python", v1),                  # its child, now the tenant
          P.Proc(12, 11, tenant, "S", "sbatch", v1),                  # sbatch run by that child
          P.Proc(20, 1, tenant, "S", "python", v1),                   # a real leftover (orphan)
          P.Proc(30, 1, tenant, "S", "python", v1, broker=True),      # a tenant naming itself "broker"
          P.Proc(31, 30, tenant, "S", "sleep", v1)]                   # ... and its child
    assert P.broker_helpers(ps) == {11, 12}
    found = P.leftovers(ps, tenant_uids={tenant}, node="n1", job_id=7, live={})
    assert sorted(p.pid for p in found) == [20, 30, 31]
    targets = P.kill_targets(ps, uid=tenant, node="n1", job_id=7, live={})
    assert sorted(p.pid for p in targets) == [20, 30, 31]
