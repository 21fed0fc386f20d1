"""The scrubber's file handling, its runtime (report, exit code, fault injection), the
gateway's reading of its reports, and the rendered wrappers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gateway.devcluster.cluster import DevClusterConfig, render_configs, render_wrappers
from gateway.slurm.scrubreports import ScrubReportError, latest_reports, read_report
from scrubber import checks, files, runtime
from scrubber.checks import Scrub, Status, Step, Verdict, ok
from scrubber.config import ScrubConfig, ScrubConfigError
from scrubber.jobenv import JobContext

ME = os.getuid()
JOB = JobContext(job_id=42, uid=ME, gid=os.getgid(), user="tenant", node="vm-n2", gpus=())


# ------------------------------------------------------------------------- files
def test_remove_path_counts_and_never_follows_symlinks(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("precious")
    tree = tmp_path / "job-1"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_bytes(b"x" * 1000)
    (tree / "g").write_bytes(b"y" * 24)
    (tree / "link").symlink_to(outside)
    os.chmod(tree / "a", 0o500)  # a tenant may make its dirs unwritable
    removed = files.remove_path(tree, ME)
    assert not tree.exists() and (outside / "keep").read_text() == "precious"
    assert (removed.files, removed.dirs, removed.bytes, removed.errors) == (3, 3, 1024, 0)  # link: 0 bytes
    assert files.remove_path(tree, ME) == files.Removed()  # already gone: nothing to do


def test_owned_entries_finds_top_most_paths_of_a_uid(tmp_path: Path) -> None:
    (tmp_path / "mine" / "deep").mkdir(parents=True)
    found = files.owned_entries(tmp_path, ME)
    st = os.lstat(tmp_path / "mine")
    assert found == [files.Found(("mine",), ((st.st_dev, st.st_ino),))]  # names from the top, never a path
    assert files.owned_entries(tmp_path, 123456) == []
    assert files.owned_entries(tmp_path / "absent", ME) == []


@pytest.mark.skipif(ME != 0, reason="chown needs root")
def test_make_scratch_is_0700_for_the_job_user_and_root_is_0711(tmp_path: Path) -> None:
    path = files.make_scratch(tmp_path / "scratch", 7, 65534, 65534)
    st = files.dir_state(path)
    assert (st.uid, st.mode) == (65534, 0o700)
    assert files.dir_state(tmp_path / "scratch").mode == 0o711
    (tmp_path / "scratch" / "job-8").symlink_to(tmp_path)
    with pytest.raises(OSError):
        files.make_scratch(tmp_path / "scratch", 8, 65534, 65534)


# ------------------------------------------------------------------------ runtime
def cfg(tmp_path: Path, **kw: object) -> ScrubConfig:
    """Everything under tmp_path, with an empty /proc: these tests never touch real processes."""
    (tmp_path / "proc").mkdir(exist_ok=True)
    return ScrubConfig(scratch_root=tmp_path / "scratch", report_dir=tmp_path / "reports",
                       log_dir=tmp_path / "log", gres_conf=tmp_path / "none",
                       proc_root=tmp_path / "proc", **kw)  # type: ignore[arg-type]


def boom(s: Scrub) -> ok:  # type: ignore[valid-type]
    raise RuntimeError("disk on fire")


def test_a_raising_step_fails_without_stopping_the_runtime(tmp_path: Path) -> None:
    scrub = Scrub.make(cfg(tmp_path), JOB)
    r = runtime.run_step(Step("scratch", boom), scrub)
    assert r.status is Status.FAIL and "RuntimeError: disk on fire" in r.message


def test_fail_step_overrides_the_verdict_but_the_step_still_runs(tmp_path: Path) -> None:
    ran: list[int] = []

    def fine(s: Scrub) -> Verdict:
        ran.append(1)
        return ok("fine")

    scrub = Scrub.make(cfg(tmp_path, fail_step="scratch", fail_node="vm-n2"), JOB)
    r = runtime.run_step(Step("scratch", fine), scrub)
    assert ran == [1] and r.status is Status.FAIL and "failed on purpose" in r.message
    other = Scrub.make(cfg(tmp_path, fail_step="scratch", fail_node="vm-n1"), JOB)
    assert runtime.run_step(Step("scratch", lambda s: ok("fine")), other).status is Status.OK


def test_unknown_fail_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ScrubConfigError, match="names no step"):
        runtime.run("prolog", cfg(tmp_path, fail_step="nope"), JOB)


@pytest.mark.skipif(ME != 0, reason="the prolog chowns the scratch dir: needs root")
def test_prolog_run_writes_report_log_and_exit_code(tmp_path: Path) -> None:
    lines: list[str] = []
    assert runtime.run("prolog", cfg(tmp_path), JOB, echo=lines.append) == 0
    report = json.loads((tmp_path / "reports" / "vm-n2" / "42-prolog.json").read_text())
    assert report["outcome"] == "ok" and [s["name"] for s in report["steps"]][0] == "scratch"
    assert (tmp_path / "scratch" / "job-42").is_dir()
    log = (tmp_path / "log" / "scrubber.log").read_text()
    assert "prolog job=42 node=vm-n2" in log and "step=gpu_memory status=skipped" in log
    assert runtime.run("prolog", cfg(tmp_path, fail_step="gpu_memory"), JOB, echo=lines.append) == 1
    assert any("gpu_memory failed" in line for line in lines)
    assert [p.name for p in (tmp_path / "reports" / "vm-n2").iterdir()] == ["42-prolog.json"]


def fake_proc(proc_root: Path, pid: int, uid: int, cgroup: str, comm: str = "trainer") -> None:
    """One process as /proc shows it (stat, status, comm, cgroup, cmdline)."""
    d = proc_root / str(pid)
    d.mkdir(parents=True)
    (d / "stat").write_text(f"{pid} ({comm}) S 1 {pid} {pid} 0 -1 4194560 171 0 0 0 3 1 0 0 20 0 1 0 "
                            "987654 10166272 805 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0\n")
    (d / "status").write_text(f"Name:\t{comm}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (d / "comm").write_text(comm + "\n")
    (d / "cgroup").write_text(cgroup)
    (d / "cmdline").write_bytes(comm.encode() + b"\0")


def test_epilog_fails_closed_on_a_cgroup_layout_it_does_not_know(tmp_path: Path) -> None:
    """A job-user process in an unknown cgroup layout is neither killed nor spared: the kill
    step fails, the report says why, the exit code drains the node. (The fake pid is never
    signalled: it is no target.)"""
    c = cfg(tmp_path, tmp_dirs=(tmp_path / "tmp",))
    fake_proc(c.proc_root, 4_000_001, 59_981, "0::/job_43/step_0/user/task_0\n")
    job = JobContext(job_id=41, uid=59_981, gid=59_981, user="sft-a", node="vm-n2", gpus=())
    lines: list[str] = []
    assert runtime.run("epilog", c, job, echo=lines.append) == 1
    report = json.loads((tmp_path / "reports" / "vm-n2" / "41-epilog.json").read_text())
    assert report["failed_steps"] == ["kill_processes"], report
    kill = next(s for s in report["steps"] if s["name"] == "kill_processes")
    assert "cannot place" in kill["message"] and "/job_43/step_0" in kill["message"], kill
    assert kill["figures"]["undecided"] == ["4000001:trainer:uid=59981"] and kill["figures"]["processes_killed"] == 0
    assert any("kill_processes failed" in line for line in lines)


def test_gateway_reads_what_the_scrubber_writes(tmp_path: Path) -> None:
    c = cfg(tmp_path, fail_step="scratch")
    runtime.run("prolog", c, JOB, echo=lambda _: None)
    r = read_report(tmp_path / "reports" / "vm-n2" / "42-prolog.json")
    assert (r.kind, r.job_id, r.node, r.ok, r.failed_steps) == ("prolog", 42, "vm-n2", False, ("scratch",))
    assert "FAILED (scratch: failed on purpose" in r.summary()
    (tmp_path / "reports" / "vm-n2" / "junk.json").write_text("[]")
    assert [x.job_id for x in latest_reports(tmp_path / "reports")["vm-n2"]] == [42]
    with pytest.raises(ScrubReportError, match="junk.json"):
        read_report(tmp_path / "reports" / "vm-n2" / "junk.json")


# ------------------------------------------------------------------- templates
def test_wrappers_exec_the_runtime_scrubber_with_rendered_paths() -> None:
    w = render_wrappers(DevClusterConfig(host="h", runtime_prefix=Path("/opt/x")))
    for kind in ("prolog", "epilog"):
        last = w[f"{kind}.sh"].strip().splitlines()[-1]
        assert last.startswith(f"exec /opt/x/venv/bin/python -I -m scrubber {kind} ")
        assert "--scratch-root /var/lib/slurm-finetune/scratch" in last
        assert "--report-dir /var/lib/slurm-finetune/scrub" in last
    assert 'echo "export SFT_SCRATCH=/var/lib/slurm-finetune/scratch/job-${SLURM_JOB_ID}"' \
        in w["task_prolog.sh"]


def test_slurm_conf_has_task_prolog_and_job_container() -> None:
    confs = render_configs(DevClusterConfig(host="h"), "pw")
    lines = confs["slurm.conf"].splitlines()
    assert "TaskProlog=/opt/slurm-finetune/libexec/task_prolog.sh" in lines
    assert "JobContainerType=job_container/tmpfs" in lines
    jc = confs["job_container.conf"]
    assert jc.startswith("# slurm-finetune dev cluster")
    assert "NodeName=h-n2 BasePath=/var/lib/slurm-finetune/jobtmp/h-n2" in jc.splitlines()


# ---------------------------------------------------------------- wipe logic (CPU)
class _FakeCuda:
    """Just enough of torch.cuda over CPU tensors: a device of ``capacity`` bytes whose fresh
    allocations hold the previous owner's bytes (0xAB)."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, torch: object, capacity: int) -> None:
        import weakref

        self.torch, self.capacity, self.used, self._weakref = torch, capacity, 0, weakref

    def alloc(self, size: int) -> object:
        if self.used + size > self.capacity:
            raise self.OutOfMemoryError("out of memory")
        t = self.torch.full((size,), 0xAB, dtype=self.torch.uint8)  # type: ignore[attr-defined]
        self.used += size
        self._weakref.finalize(t, self._free, size)
        return t

    def _free(self, size: int) -> None:
        self.used -= size

    def mem_get_info(self, _: int) -> tuple[int, int]:
        return self.capacity - self.used, self.capacity

    def synchronize(self, *_: object) -> None: ...
    def empty_cache(self) -> None: ...

    def get_device_properties(self, _: int) -> object:
        return type("P", (), {"total_memory": self.capacity, "uuid": "GPU-fake"})()


def test_wipe_takes_all_memory_in_shrinking_chunks_and_verifies_zero() -> None:
    real = pytest.importorskip("torch")
    from scrubber import gpu

    cuda = _FakeCuda(real, capacity=(37 << 20) + (3 << 20))
    fake = type("FakeTorch", (), {"uint8": real.uint8, "cuda": cuda,
                                  "device": staticmethod(lambda *a: "cpu"),
                                  "empty": staticmethod(lambda n, dtype, device: cuda.alloc(n))})
    r = gpu.wipe_gpu(fake, 0, chunk_bytes=16 << 20, min_chunk_bytes=1 << 20)
    assert (r.wiped_bytes, r.nonzero_chunks, r.total_bytes, r.free_bytes) == (40 << 20, 0, 40 << 20, 40 << 20)
    assert cuda.used == 0, "the wipe must give all memory back"
    assert checks.judge_wipe([r], 1).status is Status.OK
    cuda.used = 3 << 20  # another process holds 3 MiB: free is what is left, and all of it is wiped
    r = gpu.wipe_gpu(fake, 0, chunk_bytes=16 << 20, min_chunk_bytes=1 << 20)
    assert (r.free_bytes, r.wiped_bytes) == (37 << 20, 37 << 20)
    cuda.used = 0
    dirty = gpu.fill(fake, 0, 0xAB, chunk_bytes=16 << 20, min_chunk_bytes=1 << 20)
    assert [t.numel() >> 20 for t in dirty] == [16, 16, 8]
    assert gpu.count_nonzero_chunks(fake, dirty) == 3


def test_a_wipe_that_takes_only_part_of_the_free_memory_fails() -> None:
    real = pytest.importorskip("torch")
    from scrubber import gpu

    cuda = _FakeCuda(real, capacity=40 << 20)
    fake = type("FakeTorch", (), {"uint8": real.uint8, "cuda": cuda,
                                  "device": staticmethod(lambda *a: "cpu"),
                                  "empty": staticmethod(lambda n, dtype, device: cuda.alloc(n))})
    r = gpu.wipe_gpu(fake, 0, chunk_bytes=16 << 20, min_chunk_bytes=16 << 20)  # cannot take the last 8 MiB
    assert (r.free_bytes, r.wiped_bytes, r.nonzero_chunks) == (40 << 20, 32 << 20, 0)
    v = checks.judge_wipe([r], 1)
    assert v.status is Status.FAIL and "'GPU-fake': '80.00%'" in v.message and v.figures["gpu_wipe_fraction"] == 0.8
