"""The epilog against a hostile tenant: names swapped between scan and removal, foreign
entries inside the tenant's tree, pids recycled between the scan and the signal.

The file tests run as root (chown, a second uid): a forked child drops to that uid
(``os.setresuid``) and does the swap with a directory fd root opened for it, as a
tenant's process on the node would. The process tests use real child processes.
"""

from __future__ import annotations

import os
import pwd
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from scrubber import checks, files, procs
from scrubber.checks import Scrub, Status
from scrubber.config import ScrubConfig
from scrubber.jobenv import JobContext

ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="chown and a second uid need root")
A, B = 59_981, 59_982  # the job user (tenant A), and a second uid working against root
Snapshot = dict[str, tuple[int, int, int, bytes | None]]


# ----------------------------------------------------------------------- helpers
@pytest.fixture(scope="module", autouse=True)
def unused_uids() -> None:
    for uid in (A, B):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            continue
        pytest.skip(f"uid {uid} exists on this host: the test needs throwaway uids")


def as_uid(uid: int, fn: Callable[[], None]) -> None:
    """Run ``fn`` in a forked child that is nothing but ``uid`` (no root, no groups)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            fn()
            code = 0
        except BaseException:  # noqa: B036 - report anything, then leave the child
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the uid {uid} child failed"


def make(path: Path, uid: int, mode: int, content: bytes | None = None) -> Path:
    """A dir (content None) or file at ``path`` owned by uid:uid with ``mode``."""
    if content is None:
        path.mkdir()
    else:
        path.write_bytes(content)
    os.lchown(path, uid, uid)
    os.chmod(path, mode)
    return path


def snapshot(top: Path) -> Snapshot:
    """Every entry under ``top`` (and top): owner, group, mode, file contents."""
    out: Snapshot = {}
    for root, dirs, names in os.walk(top):
        for n in ["", *dirs, *names]:
            p = Path(root, n)
            st = os.lstat(p)
            data = p.read_bytes() if p.is_file() and not p.is_symlink() else None
            out[str(p.relative_to(top))] = (st.st_uid, st.st_gid, st.st_mode, data)
    return out


@pytest.fixture
def world(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    """``top`` (a /tmp: root 1777) holding B's dirs with A's tree inside, and a ``victim``
    outside it that holds an A-owned tree too (so an owner check alone would not save it)."""
    top = make(tmp_path / "tmp", 0, 0o1777)
    make(top / "bdir", B, 0o755)
    make(top / "bdir" / "sub", B, 0o755)
    adata = make(top / "bdir" / "sub" / "adata", A, 0o700)
    make(adata / "f", A, 0o600, b"tenant A's file")
    make(adata / "d", A, 0o700)
    make(adata / "d" / "g", A, 0o600, b"tenant A's other file")
    victim = make(tmp_path / "victim", 0, 0o755)
    make(victim / "sub", 0, 0o750)
    vdata = make(victim / "sub" / "adata", A, 0o750)  # e.g. the tenant's datasets on storage
    make(vdata / "f", A, 0o640, b"precious A")
    make(vdata / "r", 0, 0o600, b"precious root")
    make(vdata / "d", A, 0o700)
    make(vdata / "d" / "g", A, 0o600, b"precious A too")
    make(victim / "bfile", B, 0o644, b"B's own")
    yield top, victim


def scrub_for(tmp_path: Path, top: Path) -> Scrub:
    (tmp_path / "proc").mkdir(exist_ok=True)  # no processes: no other job of A's
    cfg = ScrubConfig(scratch_root=tmp_path / "scratch", report_dir=tmp_path / "reports",
                      log_dir=tmp_path / "log", gres_conf=tmp_path / "none",
                      proc_root=tmp_path / "proc", tmp_dirs=(top,))
    return Scrub.make(cfg, JobContext(job_id=41, uid=A, gid=A, user="sft-a", node="vm-n2", gpus=()))


# ------------------------------------------------------------------ the swap race
def _swap(kind: str, victim: Path) -> Callable[[int], None]:
    """What B does in the window, given root's fd of top."""
    def grandparent(top_fd: int) -> None:  # top/bdir -> symlink to the victim
        os.rename("bdir", "bdir.old", src_dir_fd=top_fd, dst_dir_fd=top_fd)
        os.symlink(str(victim), "bdir", dir_fd=top_fd)

    def parent(top_fd: int) -> None:  # top/bdir/sub -> symlink to victim/sub
        bfd = os.open("bdir", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top_fd)
        os.rename("sub", "sub.old", src_dir_fd=bfd, dst_dir_fd=bfd)
        os.symlink(str(victim / "sub"), "sub", dir_fd=bfd)

    def parent_dir(top_fd: int) -> None:  # top/bdir/sub -> a new real dir of B's, same names
        bfd = os.open("bdir", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top_fd)
        os.rename("sub", "sub.old", src_dir_fd=bfd, dst_dir_fd=bfd)
        os.mkdir("sub", 0o755, dir_fd=bfd)
        sfd = os.open("sub", os.O_RDONLY | os.O_DIRECTORY, dir_fd=bfd)
        os.mkdir("adata", 0o755, dir_fd=sfd)
        fd = os.open("adata/f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=sfd)
        os.write(fd, b"B's decoy")
        os.close(fd)

    def entry(top_fd: int) -> None:  # A's entry itself -> symlink to victim/sub/adata
        sfd = os.open("bdir/sub", os.O_RDONLY | os.O_DIRECTORY, dir_fd=top_fd)
        os.rename("adata", "adata.old", src_dir_fd=sfd, dst_dir_fd=sfd)
        os.symlink(str(victim / "sub" / "adata"), "adata", dir_fd=sfd)

    return {"grandparent": grandparent, "parent": parent, "parent_dir": parent_dir, "entry": entry}[kind]


@needs_root
@pytest.mark.parametrize("kind", ["grandparent", "parent", "parent_dir", "entry"])
def test_a_swap_between_scan_and_removal_never_redirects_root_outside(
        tmp_path: Path, world: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    top, victim = world
    before = snapshot(victim)
    swapped: list[list[tuple[str, ...]]] = []

    def in_the_window(at: Path, found: list[files.Found]) -> None:
        assert at == top
        swapped.append([f.names for f in found])
        fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
        try:
            as_uid(B, lambda: _swap(kind, victim)(fd))
        finally:
            os.close(fd)

    monkeypatch.setattr(files, "_between_scan_and_remove", in_the_window)
    v = checks.step_remove_tmp_files(scrub_for(tmp_path, top))

    assert swapped == [[("bdir", "sub", "adata")]], "the hook ran once, after a scan that found A's tree"
    assert snapshot(victim) == before, "root changed something outside the tree"
    assert v.status is Status.FAIL and "changed since the scan" in v.message, v
    assert v.figures["files_removed"] == 0 and v.figures["dirs_removed"] == 0
    if kind == "parent_dir":
        assert (top / "bdir" / "sub" / "adata" / "f").read_bytes() == b"B's decoy"
    old = {"grandparent": top / "bdir.old" / "sub" / "adata", "parent": top / "bdir" / "sub.old" / "adata",
           "parent_dir": top / "bdir" / "sub.old" / "adata", "entry": top / "bdir" / "sub" / "adata.old"}[kind]
    assert (old / "d" / "g").read_bytes() == b"tenant A's other file"  # moved, not touched: left, counted
    assert "1 entries left" in v.message


@needs_root
def test_without_interference_the_users_entries_in_foreign_dirs_go(tmp_path: Path,
                                                                   world: tuple[Path, Path]) -> None:
    top, victim = world
    make(top / "afile", A, 0o644, b"x" * 100)
    (top / "alink").symlink_to(victim)
    os.lchown(top / "alink", A, A)
    make(top / "bfile", B, 0o600, b"B's")
    before = snapshot(victim)
    v = checks.step_remove_tmp_files(scrub_for(tmp_path, top))
    assert v.status is Status.OK, v
    assert (v.figures["files_removed"], v.figures["dirs_removed"], v.figures["foreign_left"]) == (4, 2, 0)
    assert sorted(p.name for p in top.iterdir()) == ["bdir", "bfile"]
    assert list((top / "bdir" / "sub").iterdir()) == []  # B's dirs stay, A's tree went
    assert snapshot(victim) == before


@needs_root
def test_foreign_entries_inside_the_users_tree_are_left_alone(tmp_path: Path) -> None:
    top = make(tmp_path / "tmp", 0, 0o1777)
    adir = make(top / "adir", A, 0o777)  # A let others write into its dir
    make(adir / "mine", A, 0o600, b"A's")
    make(adir / "sub", A, 0o777)
    make(adir / "sub" / "also-mine", A, 0o600, b"A's")

    fd = os.open(adir, os.O_RDONLY | os.O_DIRECTORY)  # root's, for B (tmp_path is root's 0700)

    def b_writes() -> None:
        os.write(os.open("theirs", os.O_WRONLY | os.O_CREAT, 0o640, dir_fd=fd), b"B's file")
        os.mkdir("sub/bdir", 0o700, dir_fd=fd)
        os.write(os.open("sub/bdir/deep", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd), b"B's deep")

    try:
        as_uid(B, b_writes)
    finally:
        os.close(fd)
    before = {k: v for k, v in snapshot(adir).items() if k.startswith(("theirs", "sub/bdir"))}
    assert len(before) == 3
    removed = files.remove_owned(top, A)
    assert (removed.files, removed.dirs, removed.foreign, removed.errors) == (2, 0, 2, 0)
    after = snapshot(adir)
    assert {k: v for k, v in after.items() if k in before} == before, "a foreign entry was touched"
    assert sorted(after) == [".", "sub", "sub/bdir", "sub/bdir/deep", "theirs"]
    left = len(files.owned_entries(top, A))
    v = checks.judge_removed(removed, left, str(top))
    assert v.status is Status.FAIL and v.figures["foreign_left"] == 2 and "2 entries of other users" in v.message


@needs_root
def test_scratch_removal_checks_the_owner_too(tmp_path: Path) -> None:
    root = make(tmp_path / "scratch", 0, 0o711)
    job = make(root / "job-7", A, 0o700)
    make(job / "ckpt", A, 0o600, b"w" * 10)
    make(job / "planted", B, 0o600, b"B's")
    removed = files.remove_path(job, A)
    assert (removed.files, removed.foreign, removed.errors) == (1, 1, 0)
    assert (job / "planted").read_bytes() == b"B's" and not (job / "ckpt").exists()
    assert files.remove_path(job / "planted", A).foreign == 1


# -------------------------------------------------------------------- pid reuse
def _child(code: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)  # noqa: S603
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


IGNORES_TERM = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('ready', flush=True); time.sleep(120)")
SLEEPS = "import time; print('ready', flush=True); time.sleep(120)"


def _forbid_kill(monkeypatch: pytest.MonkeyPatch) -> None:
    def kill(pid: int, sig: int) -> None:
        raise AssertionError(f"os.kill({pid}, {sig}): a signal by pid, not by pidfd")

    monkeypatch.setattr(os, "kill", kill)


def test_terminate_signals_a_real_process_through_its_pidfd(monkeypatch: pytest.MonkeyPatch) -> None:
    child = _child(IGNORES_TERM)
    try:
        seen = procs.read_proc(Path("/proc"), child.pid)
        assert seen is not None and seen.start > 0
        _forbid_kill(monkeypatch)
        res = procs.terminate([seen], grace_s=0.3, wait_s=10)
        monkeypatch.undo()
        assert res.needed_kill == (child.pid,) and res.killed == (seen,) and res.survivors == ()
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("field", ["start", "uid", "cgroup"])
def test_a_pid_that_is_not_the_scanned_process_is_never_signalled(
        monkeypatch: pytest.MonkeyPatch, field: str) -> None:
    child = _child(SLEEPS)
    try:
        seen = procs.read_proc(Path("/proc"), child.pid)
        assert seen is not None
        # What the scan saw at this pid was another process (it has since exited and the pid
        # was reused): an older start time, another uid, or another job's cgroup.
        stale = {"start": replace(seen, start=seen.start - 1), "uid": replace(seen, uid=seen.uid + 1),
                 "cgroup": replace(seen, cgroup="6:freezer:/slurm/uid_5/job_40\n")}[field]
        assert procs.open_pidfd(stale) is None and procs.open_pidfd(seen) is not None
        _forbid_kill(monkeypatch)
        res = procs.terminate([stale], grace_s=0.05, wait_s=0.05)
        monkeypatch.undo()
        assert res.not_signalled == (stale,) and res.killed == () and res.needed_kill == ()
        time.sleep(0.1)
        assert child.poll() is None, "the process now at that pid was signalled"
    finally:
        child.kill()
        child.wait()


def _reuse_pid(pid: int, tries: int = 50) -> subprocess.Popen[str] | None:
    """A new child that gets ``pid`` (via ns_last_pid: root in this pid namespace), or None."""
    for _ in range(tries):
        try:
            Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        except OSError:
            return None
        p = subprocess.Popen([sys.executable, "-c", SLEEPS], stdout=subprocess.PIPE, text=True)  # noqa: S603
        if p.pid == pid:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
            return p
        p.kill()
        p.wait()
    return None


@needs_root
def test_a_really_recycled_pid_is_never_signalled(monkeypatch: pytest.MonkeyPatch) -> None:
    first = _child(SLEEPS)
    seen = procs.read_proc(Path("/proc"), first.pid)
    assert seen is not None
    pinned = procs.open_pidfd(seen)
    assert pinned is not None
    first.kill()
    first.wait()  # reaped: its pid is free
    time.sleep(0.05)  # the newcomer starts at a later clock tick
    newcomer = _reuse_pid(seen.pid)
    if newcomer is None:
        pinned.close()
        pytest.skip("could not get the pid reused (ns_last_pid not writable, or a busy host)")
    try:
        now = procs.read_proc(Path("/proc"), seen.pid)
        assert now is not None and now.start != seen.start  # same pid, same uid: another process
        _forbid_kill(monkeypatch)
        assert pinned.gone() and pinned.send(signal.SIGTERM) is False  # the pidfd holds the dead one
        res = procs.terminate([seen], grace_s=0.05, wait_s=0.05)
        monkeypatch.undo()
        assert res.not_signalled == (seen,) and res.killed == ()
        time.sleep(0.1)
        assert newcomer.poll() is None, "the newcomer at the recycled pid was signalled"
    finally:
        pinned.close()
        newcomer.kill()
        newcomer.wait()
