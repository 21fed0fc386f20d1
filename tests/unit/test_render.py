"""The sbatch renderer: golden file, quoting, refusal of unsafe values."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gateway.slurm.render import JobScript, RenderError, format_time_limit, render_array, render_sbatch

GOLDEN = Path(__file__).parent.parent / "data" / "golden" / "finetune.sbatch"


def job(**kw: object) -> JobScript:
    base: dict[str, object] = dict(
        job_name="ft-job-42", account="acme", qos="ft-standard",
        job_dir="/srv/slurm-finetune/tenants/acme/jobs/ftjob-42",
        command=("/opt/slurm-finetune/venv/bin/python", "-m", "trainer", "run",
                 "/srv/slurm-finetune/tenants/acme/jobs/ftjob-42/spec.json"),
        gpus=1, cpus=2, mem_mb=8192, time_limit_min=95, grace_s=90,
        env={"HF_HUB_OFFLINE": "1", "SFT_NOTE": "it's $(here)"},
    )
    base.update(kw)
    return JobScript(**base)  # type: ignore[arg-type]


def test_golden_file() -> None:
    text = render_sbatch(job())
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_directives_in_fixed_order() -> None:
    lines = [ln.split("=")[0] for ln in render_sbatch(job(partition="gpu")).splitlines()
             if ln.startswith("#SBATCH")]
    assert lines == ["#SBATCH --job-name", "#SBATCH --account", "#SBATCH --qos",
                     "#SBATCH --partition", "#SBATCH --gres", "#SBATCH --nodes",
                     "#SBATCH --ntasks", "#SBATCH --cpus-per-task", "#SBATCH --mem",
                     "#SBATCH --time", "#SBATCH --signal", "#SBATCH --requeue",
                     "#SBATCH --chdir", "#SBATCH --output", "#SBATCH --open-mode"]


def test_shell_values_are_quoted() -> None:
    text = render_sbatch(job(command=("/bin/echo", "a b; rm -rf /", "$(id)")))
    assert "/bin/echo 'a b; rm -rf /' '$(id)' &" in text
    assert "export SFT_NOTE=''\"'\"'s $(here)'" not in text  # shlex quoting, below
    assert "export SFT_NOTE='it'\"'\"'s $(here)'" in text


@pytest.mark.parametrize(("field", "value"), [
    ("account", "acme --uid=0"), ("account", "acme\n#SBATCH --uid=0"), ("qos", "ft;id"),
    ("job_name", "a b"), ("job_dir", "/srv/x y"), ("partition", "gpu\nx"),
])
def test_unsafe_directive_values_refused(field: str, value: str) -> None:
    with pytest.raises(RenderError, match=field):
        render_sbatch(job(**{field: value}))


@pytest.mark.parametrize(("field", "value"), [
    ("gpus", 0), ("cpus", -1), ("time_limit_min", 0), ("mem_mb", "4G")])
def test_out_of_range_numbers_refused(field: str, value: object) -> None:
    with pytest.raises(RenderError, match=field):
        render_sbatch(job(**{field: value}))


def test_relative_job_dir_and_bad_env_name_refused() -> None:
    with pytest.raises(RenderError, match="absolute"):
        render_sbatch(job(job_dir="jobs/x"))
    with pytest.raises(RenderError, match="environment variable"):
        render_sbatch(job(env={"A;B": "x"}))


@pytest.mark.parametrize(("minutes", "text"), [(1, "0-00:01:00"), (95, "0-01:35:00"),
                                                (1440, "1-00:00:00"), (4321, "3-00:01:00")])
def test_time_limit_format(minutes: int, text: str) -> None:
    assert format_time_limit(minutes) == text


GANG_GOLDEN = GOLDEN.with_name("finetune-gang.sbatch")


def test_gang_golden_file() -> None:
    # 2 nodes x 2 GPUs: one srun step, one task (trainer rank) per GPU, the ranks meet on the first node
    text = render_sbatch(job(gpus=2, nodes=2, mem_mb=16384))
    if os.environ.get("UPDATE_GOLDEN"):
        GANG_GOLDEN.write_text(text)
    assert text == GANG_GOLDEN.read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2\n" in text and "#SBATCH --gres=gpu:2\n" in text
    assert ("srun --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=2 --cpus-per-task=2 --export=ALL "
            "/opt/slurm-finetune/venv/bin/python -m trainer run") in text
    assert "#SBATCH --ntasks=1" not in text


def test_rendered_scripts_are_valid_bash(tmp_path: Path) -> None:
    import subprocess

    for i, script in enumerate([job(), job(gpus=4, nodes=1), job(gpus=1, nodes=3)]):
        path = tmp_path / f"{i}.sbatch"
        path.write_text(render_sbatch(script))
        done = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(("gpus", "nodes"), [(0, 1), (1, 0), (65, 1)])
def test_gang_sizes_out_of_range_refused(gpus: int, nodes: int) -> None:
    with pytest.raises(RenderError):
        render_sbatch(job(gpus=gpus, nodes=nodes))


ARRAY_GOLDEN = GOLDEN.with_name("finetune-array.sbatch")


def _task(i: int, **kw: object) -> JobScript:
    jid = f"ftjob-{i:024x}"
    fields: dict[str, object] = {
        "job_name": jid, "job_dir": f"/srv/slurm-finetune/tenants/acme/jobs/{jid}",
        "command": ("/opt/slurm-finetune/venv/bin/python", "-m", "trainer", "run",
                    f"/srv/slurm-finetune/tenants/acme/jobs/{jid}/spec.json")}
    return job(**{**fields, **kw})


def test_array_golden_file(tmp_path: Path) -> None:
    import subprocess

    tasks = [_task(0, time_limit_min=30), _task(1, time_limit_min=95)]
    text = render_array(tasks, name="ftsweep-1")
    if os.environ.get("UPDATE_GOLDEN"):
        ARRAY_GOLDEN.write_text(text)
    assert text == ARRAY_GOLDEN.read_text()
    assert "#SBATCH --array=0-1\n#SBATCH --hold\n" in text and "#SBATCH --time=0-01:35:00\n" in text  # the longest
    assert "#SBATCH --output=/dev/null\n" in text and 'exec >>"slurm-$SLURM_JOB_ID.out" 2>&1' in text
    (tmp_path / "a.sbatch").write_text(text)
    assert subprocess.run(["bash", "-n", str(tmp_path / "a.sbatch")]).returncode == 0


def test_each_array_task_runs_its_own_jobs_script(tmp_path: Path) -> None:
    """Run the array script as Slurm would run task 1, with bash in place of the trainer's python."""
    import subprocess

    out = tmp_path / "ran"
    tasks = [_task(i, job_dir=str(tmp_path / f"ftjob-{i:024x}"), job_name=f"ftjob-{i:024x}",
                   command=("/bin/sh", "-c", f'echo "$HOME {i}" > {out}')) for i in range(3)]
    for t in tasks:
        Path(t.job_dir).mkdir()
    script = tmp_path / "a.sbatch"
    script.write_text(render_array(tasks, name="ftsweep-1"))
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "1"}
    assert subprocess.run(["bash", str(script)], env=env, timeout=30).returncode == 0
    assert out.read_text() == f"{tasks[1].job_dir} 1\n"
    assert (Path(tasks[1].job_dir) / "slurm-7.out").is_file()          # its output, in its own directory
    env["SLURM_ARRAY_TASK_ID"] = "9"
    assert subprocess.run(["bash", str(script)], env=env, capture_output=True, timeout=30).returncode == 1


@pytest.mark.parametrize("tasks,why", [
    ([], "1 to 64 tasks"),
    ([_task(0), _task(1, qos="ft-small")], "agree on qos"),
    ([_task(0), _task(1, gpus=2)], "agree on gpus"),
    ([_task(0), _task(1, job_dir="/srv/elsewhere/ftjob-000000000000000000000001")], "sibling"),
    ([_task(0, job_name="ftjob-other")], "named after it"),
])
def test_an_array_of_unlike_jobs_is_refused(tasks: list[JobScript], why: str) -> None:
    with pytest.raises(RenderError, match=why):
        render_array(tasks, name="ftsweep-1")


def test_the_script_kills_a_slow_trainer_itself_before_the_gateways_deadline() -> None:
    """Issue 35: the gateway's KILL to the batch step made a slow cancel FAILED 0:9 in sacct; the script now
    kills its trainer itself after cancel_grace_s (under the gateway's deadline) and records CANCELLED."""
    from gateway.config import Settings
    from gateway.jobs.submission import CANCEL_MARGIN_S, cancel_grace_s

    assert cancel_grace_s(Settings(cancel_deadline_s=20)) == 20 - CANCEL_MARGIN_S
    assert cancel_grace_s(Settings(cancel_deadline_s=2)) == 1
    text = render_sbatch(job(cancel_grace_s=7))
    assert "readonly CANCEL_GRACE_S=7" in text
    watchdog = text[text.index("cancel_now() {"):text.index("trap 'cancel_now")]
    assert 'sleep "$CANCEL_GRACE_S"' in watchdog and 'kill -KILL "$1"' in watchdog
    after = text[text.index('if [ "$cancelled" = 1 ]; then'):]
    assert after.index('kill "$watchdog"') < after.index('scancel "$self_id"')
