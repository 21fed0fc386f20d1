"""Local mode, as its user meets it: an ordinary unix user whose PATH holds the runtime venv and
nothing else (no sbatch, no squeue: a Slurm call would fail), `finetune serve --local`, and the
tenant CLI: upload -> job -> follow -> cancel one job -> another succeeds -> download ->
PeftModel.from_pretrained loads the adapter. As root the test runs everything as the unix user
``ftlocal`` (created here); as any other user, as that user."""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from trainer.toydata import toy_conversations, toy_preferences, write_jsonl

pytestmark = pytest.mark.local

VENV_BIN = Path(sys.executable).parent
USER = "ftlocal"


class LocalUser:
    """Runs commands as the local-mode user, in a clean environment: HOME, PATH=venv only."""

    def __init__(self, home: Path):
        self.home = home
        self.env = {"HOME": str(home), "PATH": str(VENV_BIN), "OMP_NUM_THREADS": "1", "LANG": "C.UTF-8"}
        self.prefix = ["runuser", "-u", USER, "--"] if os.geteuid() == 0 else []

    def argv(self, *args: str) -> list[str]:
        return [*self.prefix, "/usr/bin/env", "-i", *(f"{k}={v}" for k, v in self.env.items()), *args]

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*args), cwd=self.home, capture_output=True, text=True, timeout=timeout)

    def ok(self, *args: str, timeout: float = 300) -> str:
        r = self.run(*args, timeout=timeout)
        assert r.returncode == 0, f"{args}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
        return r.stdout

    def json(self, *args: str) -> dict:  # type: ignore[type-arg]
        return json.loads(self.ok(*args, "--json"))


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalUser]:
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(USER)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                           check=True)
        home = Path(f"/var/tmp/sft-local-test-{os.getpid()}")   # pytest's tmp is under root's 0700 home
        home.mkdir(mode=0o700)
        shutil.chown(home, USER, USER)
    else:
        home = tmp_path_factory.mktemp("local-home")
    yield LocalUser(home)
    subprocess.run(["pkill", "-u", USER if os.geteuid() == 0 else str(os.getuid()), "-f", str(home)], check=False)
    shutil.rmtree(home, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gateway(user: LocalUser) -> Iterator[tuple[str, Path]]:
    data = user.home / "data"
    user.ok("finetune", "models", "make-tiny", str(user.home / "tiny"), "--register", "tiny-chat",
            "--root", str(data / "models"))
    port = _free_port()
    log = open(user.home / "serve.log", "w")   # noqa: SIM115 - lives as long as the server
    proc = subprocess.Popen(user.argv("finetune", "serve", "--local", "--data-dir", str(data), "--port", str(port)),
                            cwd=user.home, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        try:
            if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the local gateway did not start:\n" + (user.home / "serve.log").read_text())
    yield url, data
    proc.terminate()
    proc.wait(20)
    log.close()


def _trainer_pids(marker: str, word: bytes = b"trainer") -> list[int]:
    """The processes whose command line holds ``word`` and ``marker`` (a job id, a data dir)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if word in cmd and marker.encode() in cmd:
            pids.append(int(proc.name))
    return pids


def test_no_slurm_on_the_users_path(user: LocalUser) -> None:
    for binary in ("sbatch", "squeue", "sacct", "scancel", "scontrol"):
        assert shutil.which(binary, path=user.env["PATH"]) is None
    assert user.ok("finetune", "--version").startswith("finetune")


def test_serve_local_says_what_is_off_and_saves_the_tenants_token(user: LocalUser,
                                                                   gateway: tuple[str, Path]) -> None:
    log = (user.home / "serve.log").read_text()
    assert "LOCAL MODE" in log and "isolation" in log and "OFF" in log
    saved = json.loads((user.home / ".config/slurm-finetune/credentials.json").read_text())
    assert saved["url"] == gateway[0] and saved["token"].startswith("sft_")
    assert oct((user.home / ".config/slurm-finetune/credentials.json").stat().st_mode & 0o777) == "0o600"


def test_upload_job_cancel_another_succeeds_download_and_load(user: LocalUser, gateway: tuple[str, Path]) -> None:
    url, data = gateway
    train = write_jsonl(user.home / "train.jsonl", toy_conversations(200, seed=3))
    os.chmod(train, 0o644)
    fid = user.json("finetune", "files", "upload", str(train))["id"]

    # a long job, cancelled while it trains
    long = user.json("finetune", "jobs", "create", "--training-file", fid, "--model", "tiny-chat",
                     "--epochs", "60")
    assert long["qos"] == "local" and long["slurm_job_id"] == 1
    deadline = time.monotonic() + 180
    while (user.json("finetune", "jobs", "show", long["id"]).get("progress") or {}).get("step", 0) < 1:
        assert time.monotonic() < deadline, "the long job never reached step 1"
        time.sleep(1)
    assert _trainer_pids(long["id"]), "no trainer process while the job trains"
    cancelled = user.json("finetune", "jobs", "cancel", long["id"], "--wait")
    assert cancelled["status"] == "cancelled" and cancelled["stop_confirmed"]
    assert _trainer_pids(long["id"]) == []
    events = " ".join(e["message"] for e in httpx.get(
        f"{url}/v1/fine_tuning/jobs/{long['id']}/events?limit=100",
        headers={"Authorization": "Bearer " + json.loads(
            (user.home / ".config/slurm-finetune/credentials.json").read_text())["token"]}).json()["data"])
    assert "Trainer stopped by SIGTERM" in events

    # another job runs to the end; follow prints its progress and exits 0
    short = user.json("finetune", "jobs", "create", "--training-file", fid, "--model", "tiny-chat",
                      "--epochs", "2", "--learning-rate-multiplier", "25", "--batch-size-tokens", "1024",
                      "--max-seq-len", "256")
    followed = user.ok("finetune", "jobs", "follow", short["id"], timeout=600)
    assert "succeeded" in followed and "Step " in followed
    shown = user.json("finetune", "jobs", "show", short["id"])
    assert shown["status"] == "succeeded" and shown["cleanup"] == "off"
    log = data / "storage/tenants/local/jobs" / short["id"] / f"local-{short['slurm_job_id']}.out"
    assert log.stat().st_size > 0                     # the trainer's own output: the job's log file

    user.ok("finetune", "artifacts", "download", short["id"], "--extract")
    adapter = user.home / short["id"] / "adapter"
    base = json.loads(user.ok("finetune", "models", "list", "--root", str(data / "models"), "--json"))[0]["path"]
    loaded = user.ok("python", "-c", (
        "import sys, torch; from peft import PeftModel; from transformers import AutoModelForCausalLM\n"
        f"m = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(adapter)!r})\n"
        "b = [p for n, p in m.named_parameters() if 'lora_B' in n]\n"
        "print(len(b), max(float(p.abs().max()) for p in b))"))
    n, biggest = loaded.split()
    assert int(n) > 0 and float(biggest) > 0        # LoRA B starts at zero: these were trained


def test_a_dpo_job_in_local_mode(user: LocalUser, gateway: tuple[str, Path]) -> None:
    """Preference tuning needs nothing of Slurm: upload pairs, --method dpo, follow to succeeded."""
    pairs = write_jsonl(user.home / "pairs.jsonl", toy_preferences(120, seed=5))
    os.chmod(pairs, 0o644)
    up = user.json("finetune", "files", "upload", str(pairs))
    assert up["validation"]["stats"]["format"] == "preference"
    job = user.json("finetune", "jobs", "create", "--training-file", up["id"], "--model", "tiny-chat",
                    "--method", "dpo", "--beta", "0.1", "--epochs", "2", "--learning-rate-multiplier", "50",
                    "--batch-size-tokens", "768", "--max-seq-len", "256")
    assert job["method"]["type"] == "dpo"
    assert "succeeded" in user.ok("finetune", "jobs", "follow", job["id"], timeout=600)
    evals = {e["when"]: e for e in user.json("finetune", "jobs", "show", job["id"])["progress"]["evals"]}
    print(f"\nlocal DPO: held-out reward accuracy {evals['before']['reward_accuracy']} -> "
          f"{evals['after']['reward_accuracy']}, margin {evals['after']['reward_margin']:.3f}")
    assert evals["before"]["reward_accuracy"] == 0.5 and evals["after"]["reward_accuracy"] > 0.8


def test_demo_local_tiny_runs_end_to_end_and_its_next_commands_work(user: LocalUser) -> None:
    data = user.home / "demo-data"
    r = user.run("finetune", "demo", "--local", "--tiny", "--data-dir", str(data), timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "LOCAL MODE" in r.stderr
    assert "succeeded" in r.stdout and "node cleanup: off" in r.stdout
    for noise in ("gemm_4bit_forward", "FutureWarning", "it/s]"):
        assert noise not in r.stdout + r.stderr, noise
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.rstrip().endswith("next, try:"))
    serve, listing = (line.strip() for line in lines[at + 1:at + 3])
    assert serve == f"finetune serve --local --data-dir {data} &" and listing == "finetune jobs list"
    # as printed (the demo's saved login survives the gateway's start: the database has tenants)
    script = (f"{serve}\npid=$!\nfor i in {{1..60}}; do {listing} && ok=1 && break; read -rt 1 <> <(:); done\n"
              "kill $pid; wait $pid; [ \"$ok\" = 1 ]")
    got = user.run("/bin/bash", "-c", script, timeout=180)
    assert got.returncode == 0 and "succeeded" in got.stdout and "tiny-chat" in got.stdout, got.stdout + got.stderr


class Slowdown(threading.Thread):
    """A busy machine for one job: every ``period`` seconds the trainer processes whose command line
    names ``marker`` run ``run_s`` and are stopped (SIGSTOP) for the rest, so that a step that takes
    0.2 s alone takes about 3 s (the trainer cannot tell this from a machine shared with other work)."""

    def __init__(self, marker: str, run_s: float = 0.2, period: float = 3.0):
        super().__init__(daemon=True)
        self.marker, self.run_s, self.period = marker, run_s, period
        self.done = threading.Event()

    def _pids(self) -> list[int]:
        return _trainer_pids(self.marker, b"-m\0trainer")

    def _signal(self, pids: list[int], sig: int) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def run(self) -> None:
        while not self.done.is_set():
            pids = self._pids()
            self.done.wait(self.run_s)
            self._signal(pids, signal.SIGSTOP)
            self.done.wait(self.period - self.run_s)
            self._signal(pids, signal.SIGCONT)


def test_demo_local_on_a_slow_machine_times_out_and_its_printed_continuation_succeeds(user: LocalUser) -> None:
    """Issue 35's must-show: the tiny demo with a 2-minute limit on a machine slowed to ~3 s a step
    times out; it prints the next steps with the command that continues from the newest checkpoint
    (published although the job failed), and that command, as printed, gives a job that succeeds."""
    data = user.home / "slow-demo-data"
    slow = Slowdown(str(data))
    proc = subprocess.Popen(user.argv("finetune", "demo", "--local", "--tiny", "--time", "2", "--data-dir", str(data)),
                            cwd=user.home, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    seen: list[tuple[float, int]] = []      # (when the demo printed it, step) while slowed
    try:
        assert proc.stdout is not None
        for line in proc.stdout:       # the machine gets busy once the job trains
            lines.append(line)
            if (m := re.search(r"training  step (\d+)/", line)) is not None:
                seen.append((time.monotonic(), int(m[1])))
                if not slow.is_alive():
                    slow.start()
        proc.wait(600)
    finally:
        proc.kill()
        slow.done.set()
        if slow.is_alive():
            slow.join()
    out, err = "".join(lines), proc.stderr.read() if proc.stderr else ""
    assert proc.returncode == 1 and "[6/7] FAILED: failed" in out and "time limit" in out, out + err
    job_id = re.search(r"job (ftjob-[0-9a-f]{24}) -> local job", out)[1]   # type: ignore[index]
    (t0, s0), (t1, s1) = seen[1], seen[-1]
    per_step = (t1 - t0) / max(1, s1 - s0)
    print(f"\nslowed demo: {per_step:.1f} s a step (0.2 s alone), stopped at step {s1} of 53 by its 2-minute "
          f"limit: {next(line for line in lines if 'FAILED' in line).strip()}")
    assert per_step >= 2 and 1 <= s1 < 53, out      # a busy CI machine starts it later: fewer steps
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.rstrip().endswith("next, try:"))
    serve = lines[at + 1].strip()
    cont = next(line.split("#")[0].strip() for line in lines[at:] if "--from-checkpoint" in line)
    assert cont.startswith("finetune jobs create") and f"--from-checkpoint {job_id}" in cont, out
    # as printed: the gateway, then the continuation, followed to its end
    script = (f"{serve}\npid=$!\nfor i in {{1..60}}; do finetune jobs list >/dev/null && break; read -rt 1 <> <(:); "
              f"done\nnew=$({cont} --json | python -c 'import json,sys; print(json.load(sys.stdin)[\"id\"])') "
              "&& finetune jobs follow $new && finetune jobs show $new --json > continued.json "
              f"&& finetune jobs checkpoints {job_id} --json > parent-checkpoints.json "
              f"&& finetune jobs show {job_id} > parent-show.txt\n"
              "rc=$?; kill $pid; wait $pid; exit $rc")
    got = user.run("/bin/bash", "-c", script, timeout=400)
    assert got.returncode == 0 and "succeeded" in got.stdout, got.stdout + got.stderr
    continued = json.loads((user.home / "continued.json").read_text())
    parent = json.loads((user.home / "parent-checkpoints.json").read_text())["data"]
    newest = max(c["step_number"] for c in parent if c["adapter_file"])
    shown = (user.home / "parent-show.txt").read_text()      # `jobs show` of the failed job says how to go on
    assert "continue from:" in shown and f"--from-checkpoint {job_id}" in shown, shown
    assert continued["status"] == "succeeded" and continued["model"] == f"ft:tiny-chat:{job_id}:ckpt-step-{newest}"
    assert continued["fine_tuned_model"].startswith("ft:tiny-chat:")
    print(f"continued from {continued['model']}: {continued['status']}, eval loss "
          f"{continued['progress']['evals'][0]['loss']:.3f} -> {continued['progress']['evals'][-1]['loss']:.3f}")


@pytest.mark.skipif(os.geteuid() != 0, reason="checks the refusal to run as root")
def test_local_mode_refuses_root(tmp_path: Path) -> None:
    r = subprocess.run([str(VENV_BIN / "finetune"), "serve", "--local", "--data-dir", str(tmp_path / "d")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "refusing to run it as root" in r.stderr
    assert not (tmp_path / "d").exists()
