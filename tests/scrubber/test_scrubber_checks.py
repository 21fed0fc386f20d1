"""Pure parts of the scrubber: parsing /proc and cgroups, deciding whose a process is,
judging observations, fault injection, settings."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from scrubber import checks, gpu, procs
from scrubber.checks import Status
from scrubber.config import ScrubConfig, ScrubConfigError, load_config
from scrubber.files import DirState, Removed
from scrubber.jobenv import JobEnvError, job_context, parse_gpu_list


def proc(pid: int, uid: int, cgroup: str = "/", state: str = "S", stepd: int | None = None) -> procs.Proc:
    return procs.Proc(pid, 1, uid, state, "x", cgroup, stepd)


STEPD_7 = proc(10, 0, "/slurm_n2/uid_500/job_7", stepd=7)
STEPD_8_N1 = proc(11, 0, "/slurm_n1/uid_500/job_8", stepd=8)


# ----------------------------------------------------------------- /proc parsing
def test_parse_stat_survives_spaces_and_parens_in_comm() -> None:
    assert procs.parse_stat("42 (evil) (name Z 1) S 17 42 42 0") == ("S", 17)


def test_parse_cgroup_prefers_freezer_then_unified() -> None:
    v1 = "9:name=systemd:/\n6:freezer:/slurm_n2/uid_5/job_9/step_batch\n0::/\n"
    assert procs.parse_cgroup(v1) == "/slurm_n2/uid_5/job_9/step_batch"
    assert procs.parse_cgroup("0::/system.slice/slurmstepd.scope/job_3/step_0\n") \
        == "/system.slice/slurmstepd.scope/job_3/step_0"


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


def test_terminate_escalates_to_kill_for_term_ignoring_processes() -> None:
    sent: list[tuple[int, int]] = []
    alive = {1, 2}

    def fake_kill(pid: int, sig: int) -> None:
        sent.append((pid, sig))
        if sig == signal.SIGKILL or pid == 1:  # pid 2 ignores TERM
            alive.discard(pid)

    res = procs.terminate([proc(1, 5), proc(2, 5)], grace_s=0.05, wait_s=0.05,
                          signal_fn=fake_kill, is_gone=lambda p: p not in alive, poll_s=0.01)
    assert res.needed_kill == (2,) and res.survivors == () and len(res.killed) == 2
    assert (2, signal.SIGKILL) in sent and (1, signal.SIGKILL) not in sent


def test_terminate_reports_unkillable() -> None:
    res = procs.terminate([proc(3, 5)], grace_s=0.01, wait_s=0.01, signal_fn=lambda p, s: None,
                          is_gone=lambda p: False, poll_s=0.005)
    assert [p.pid for p in res.survivors] == [3]
    assert checks.judge_kill([res], list(res.survivors)).status is Status.FAIL


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
    r = gpu.WipeResult("GPU-a", 80 << 30, 79 << 30, 0, 0.5)
    v = checks.judge_wipe([r], 1)
    assert v.status is Status.OK and v.figures["gpu_bytes_wiped"] == 79 << 30
    assert checks.judge_wipe([gpu.WipeResult("GPU-a", 1, 1, 1, 0.1)], 1).status is Status.FAIL
    assert checks.judge_wipe([r], 2).status is Status.FAIL


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
