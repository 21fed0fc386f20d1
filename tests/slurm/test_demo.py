"""The README's main job as a newcomer meets it: `finetune demo` from a fresh login shell (no PATH
set by anyone: the set-up's /usr/local/bin link), on the real SmolLM2-135M-Instruct; then the
commands the demo prints, as printed, in another fresh login shell; and `finetune` for a tenant's
unix user. Slow (~5 min on 2 cores): the model is really fine-tuned."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer.demodata import follows_format

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def login_shell(script: str, *, user: str | None = None, cwd: Path | str = "/",
                timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``script`` in a fresh ``bash -l`` with an empty environment (as a new SSH login gets it)."""
    home = "/root" if user is None else "/"
    argv = ["/usr/bin/env", "-i", f"HOME={home}", "TERM=dumb", "/bin/bash", "-l", "-c", script]
    if user is not None:
        argv = ["runuser", "-u", user, "--", *argv]
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def demo(cluster: None) -> Iterator[tuple[subprocess.CompletedProcess[str], Path]]:
    if not Path("/usr/local/bin/finetune").exists():
        pytest.skip("the set-up's /usr/local/bin/finetune link is missing: run scripts/bootstrap.sh")
    work = Path(f"/var/tmp/sft-demo-test-{os.getpid()}")
    work.mkdir()
    yield login_shell("OMP_NUM_THREADS=2 finetune demo", cwd=work, timeout=1500), work
    shutil.rmtree(work, ignore_errors=True)


Demo = tuple[subprocess.CompletedProcess[str], Path]


def test_finetune_is_on_path_for_root_and_for_a_tenant_user(demo: Demo) -> None:
    for user in (None, "sft-demo"):
        r = login_shell("command -v finetune && finetune --version", user=user)
        assert r.returncode == 0, f"as {user or 'root'}: {r.stdout}{r.stderr}"
        assert r.stdout.splitlines()[0] == "/usr/local/bin/finetune" and "version" in r.stdout
    # README examples a sysadmin types next, as printed
    r = login_shell("finetune dev-cluster status && finetune admin tenant list && finetune models list")
    assert r.returncode == 0 and "demo" in r.stdout and "smollm2-135m-instruct" in r.stdout, r.stdout + r.stderr


def test_demo_teaches_smollm2_a_format_the_base_model_does_not_follow(demo: Demo) -> None:
    r, work = demo
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    out = r.stdout
    assert "smollm2-135m-instruct" in out and "succeeded" in out
    loss = re.search(r"eval loss ([\d.]+) -> ([\d.]+)", out)
    acc = re.search(r"token accuracy ([\d.]+) -> ([\d.]+)", out)
    assert loss and float(loss[2]) < float(loss[1]), out
    assert acc and float(acc[2]) > float(acc[1]), out
    assert re.search(r"done in \d+s", out)
    samples = json.loads((work / "demo-output" / "samples.json").read_text())
    assert not any(follows_format(s["base"]) for s in samples), samples
    assert sum(follows_format(s["fine_tuned"]) for s in samples) >= len(samples) - 1, samples
    # known-harmless library noise stays off the screen
    for noise in ("gemm_4bit_forward", "FutureWarning", "Loading weights", "DeprecationWarning", "it/s]"):
        assert noise not in out + r.stderr, noise


def test_the_printed_next_commands_work_as_printed(demo: Demo) -> None:
    """As root, the two printed lines verbatim; while that gateway serves, the tenant's unix user
    lists its jobs too, from its own fresh login shell, with the demo tenant's token."""
    r, work = demo
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.rstrip().endswith("next, try:"))
    serve, listing = (line.strip() for line in lines[at + 1:at + 3])
    assert serve.endswith("&") and listing == "finetune jobs list"
    saved = json.loads(Path("/root/.config/slurm-finetune/credentials.json").read_text())
    tenant = (f"runuser -u sft-demo -- /usr/bin/env -i HOME=/ SFT_API_URL={saved['url']} "
              f"SFT_API_TOKEN={saved['token']} /bin/bash -l -c '{listing}'")
    script = (f"{serve}\npid=$!\nfor i in $(seq 60); do {listing} && ok=1 && break; sleep 1; done\n"
              f"{tenant} || ok=0\nkill $pid; wait $pid; [ \"$ok\" = 1 ]")
    got = login_shell(script, cwd=work, timeout=180)
    assert got.returncode == 0, got.stdout + got.stderr
    assert got.stdout.count("succeeded") >= 2 and "ftjob-" in got.stdout
