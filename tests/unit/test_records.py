"""Parsers against outputs recorded from the real dev cluster (tests/data)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.slurm import records as rec


def test_squeue_recorded(data_dir: Path) -> None:
    rows = rec.parse_squeue((data_dir / "squeue.txt").read_text())
    assert len(rows) == 18
    by_id = {r.job_id: r for r in rows}
    pending = by_id[16]
    assert (pending.state, pending.pending_reason) == ("PENDING", "QOSMaxGRESPerUser")
    assert pending.start is None and pending.gpus == 1
    weird = by_id[18]       # named "we|ird name" when recorded: names are no longer asked for
    assert weird.account == "beta" and weird.user == "sft-beta" and not rows.skipped
    assert by_id[13].start == datetime(2026, 11, 30, 6, 5, 52, tzinfo=UTC)
    assert by_id[10].state == "FAILED"


def test_squeue_array_tasks_are_addressed_by_array_and_task(data_dir: Path) -> None:
    """Recorded: a held 3-task array whose task 0 was renamed (so it has a job id of its own)."""
    rows = rec.parse_squeue((data_dir / "squeue_array.txt").read_text())
    assert [(r.job_id, r.array_job_id, r.array_task) for r in rows] == [
        (3030, 3029, 0), (3029, 3029, 1), (3029, 3029, 2)]
    assert [r.control_id for r in rows] == ["3029_0", "3029_1", "3029_2"]
    # without --array, squeue prints the tasks still pending together as one record of a range
    pending = rec.parse_squeue((data_dir / "squeue_array_pending.txt").read_text())
    assert [(r.job_id, r.array_job_id, r.array_task) for r in pending] == [(3047, 3046, 0), (3046, 3046, None)]
    assert rec.array_index("1,4-7%2") is None and rec.array_index("12") == 12
    plain = rec.parse_squeue((data_dir / "squeue.txt").read_text())
    assert all(r.array_task is None and r.control_id == str(r.job_id) for r in plain)


def test_sacct_drops_step_rows_and_keeps_arrays(data_dir: Path) -> None:
    text = (data_dir / "sacct_steps_duplicates.txt").read_text()
    assert ".batch" in text and ".extern" in text
    rows = rec.parse_sacct(text)
    assert all("." not in r.job_id for r in rows)
    by_id = {r.job_id: r for r in rows}
    assert by_id["14_0"].job_id_raw == 17 and by_id["14_1"].job_id_raw == 14
    assert by_id["18"].account == "beta"
    done = by_id["13"]
    assert done.gpus == 1 and done.elapsed_s == 4 and done.exit == (0, 0)
    assert done.wait_s == 0.0
    cancelled_before_start = by_id["15"]
    assert cancelled_before_start.state == "CANCELLED" and not cancelled_before_start.ran
    assert cancelled_before_start.wait_s is None and cancelled_before_start.nodes is None
    assert cancelled_before_start.gpus == 1  # from ReqTRES: nothing was allocated


def test_sacct_requeued_runs(data_dir: Path) -> None:
    rows = rec.parse_sacct((data_dir / "sacct_requeued.txt").read_text())
    assert len(rows) == 2, "sacct --duplicates shows the requeued run and the final one"
    assert rows[0].job_id == rows[1].job_id
    assert rows[0].state == "REQUEUED" and rows[1].state == "COMPLETED"


def test_sshare_recorded(data_dir: Path) -> None:
    rows = rec.parse_sshare((data_dir / "sshare.txt").read_text())
    users = {(r.account, r.user): r for r in rows if not r.is_account_row}
    assert ("acme", "sft-acme") in users and ("beta", "sft-beta") in users
    acme = next(r for r in rows if r.account == "acme" and r.is_account_row)
    assert acme.raw_shares == 10


def test_sinfo_reasons_keep_delimiter_in_reason(data_dir: Path) -> None:
    (node,) = rec.parse_sinfo_r((data_dir / "sinfo_reasons.txt").read_text())
    assert node.node == "vm-n2" and node.state == "drained"
    assert node.reason == "scrub failed: gpu 5 | not clean" and node.by_user == "root"


QUEUE_LINE = ["7", "RUNNING", "None", "sft-a", "a", "q", "N/A", "N/A", "n1", "gres:gpu:1", "7", "N/A"]


def test_a_line_with_the_wrong_field_count_is_skipped_alone() -> None:
    rows = rec.parse_squeue("1\x1fRUNNING\n" + "\x1f".join(QUEUE_LINE) + "\n")
    assert [r.job_id for r in rows] == [7]
    assert [str(b) for b in rows.skipped] == ["line 1 (job 1): expected 12 fields, got 2"]


def test_a_bad_value_is_skipped_naming_line_and_field() -> None:
    line = "\x1f".join(["x", *QUEUE_LINE[1:]])
    rows = rec.parse_squeue(line + "\n" + "\x1f".join(QUEUE_LINE))
    assert [r.job_id for r in rows] == [7] and rows.skipped[0].job_id is None
    assert "line 1: field %A: not" not in str(rows.skipped[0]) and "field %A" in str(rows.skipped[0])


def test_recorded_output_with_a_hostile_job_name_parses_whole(data_dir: Path) -> None:
    """Recorded on the dev cluster (tests/data/README.md): the tenant renamed its running job 2 to a
    name that closes its own line and adds a forged RUNNING record of another tenant's job 7. The
    format asks for no name, so the output holds exactly the two real records and nothing else."""
    rows = rec.parse_squeue((data_dir / "squeue_hostile_name.txt").read_text())
    assert sorted(r.job_id for r in rows) == [1, 2, 3] and not rows.skipped
    acct = rec.parse_sacct((data_dir / "sacct_hostile_name.txt").read_text())
    assert sorted(a.job_id_raw for a in acct) == [1, 2, 3] and not acct.skipped


@pytest.mark.parametrize(("tres", "gpus"), [
    ("billing=1,cpu=1,gres/gpu=1,mem=1G,node=1", 1),
    ("cpu=4,gres/gpu:h100=2,gres/gpu=2,node=1", 2),
    ("cpu=4,gres/gpu:a100=1,gres/gpu:h100=2", 3),
    ("cpu=1,mem=1G", 0),
    ("", 0),
])
def test_gpu_count(tres: str, gpus: int) -> None:
    assert rec.gpu_count(tres) == gpus


@pytest.mark.parametrize(("value", "expected"), [
    ("CANCELLED by 0", "CANCELLED"), ("RUNNING", "RUNNING"), ("OUT_OF_MEMORY", "OUT_OF_MEMORY")])
def test_state_word(value: str, expected: str) -> None:
    assert rec.state_word(value) == expected


def test_no_format_asks_for_a_free_text_field() -> None:
    """Job names and comments are the tenant's text: none of the batched formats may print one."""
    free = {"%j", "%k", "%o", "%Z", "%y", "JobName", "Comment", "AdminComment", "WorkDir", "SubmitLine",
            "SystemComment", "Constraints"}
    for fields in (rec.SQUEUE_FIELDS, rec.SACCT_FIELDS, rec.SSHARE_FIELDS):
        assert not {f[0] for f in fields} & free
