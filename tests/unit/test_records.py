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
    weird = by_id[18]
    assert weird.name == "we|ird name" and weird.account == "beta" and weird.user == "sft-beta"
    assert by_id[13].start == datetime(2026, 11, 30, 6, 5, 52, tzinfo=UTC)
    assert by_id[10].state == "FAILED"


def test_squeue_array_tasks_are_addressed_by_array_and_task(data_dir: Path) -> None:
    """Recorded: a held 3-task array whose task 0 was renamed (so it has a job id of its own)."""
    rows = rec.parse_squeue((data_dir / "squeue_array.txt").read_text())
    assert [(r.job_id, r.array_job_id, r.array_task, r.name) for r in rows] == [
        (3030, 3029, 0, "ftjob-task0"), (3029, 3029, 1, "sweep-x"), (3029, 3029, 2, "sweep-x")]
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
    assert by_id["18"].name == "we|ird name"
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


def test_field_count_mismatch_raises() -> None:
    with pytest.raises(rec.SlurmParseError, match="expected 13 fields, got 2"):
        rec.parse_squeue("1\x1fRUNNING\n")


def test_bad_value_names_line_and_field() -> None:
    line = "\x1f".join(["x", "RUNNING", "None", "u", "a", "q", "N/A", "N/A", "", "n", "gres:gpu:1", "x", "N/A"])
    with pytest.raises(rec.SlurmParseError, match="line 1, field %A"):
        rec.parse_squeue(line)


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


def test_delimiter_inside_a_job_name_is_joined_back() -> None:
    fields = ["42", "42", "a\x1fb\x1fc", "u", "acct", "q", "COMPLETED", "0:0", "None",
              "2026-11-30T06:05:52", "2026-11-30T06:05:52", "2026-11-30T06:05:52", "2026-11-30T06:05:56",
              "4", "cpu=1,gres/gpu=1", "cpu=1,gres/gpu=1", "n1", "00:05:00"]
    (row,) = rec.parse_sacct("\x1f".join(fields))
    assert row.name == "a\x1fb\x1fc" and row.account == "acct" and row.gpus == 1
    qfields = ["7", "RUNNING", "None", "u", "a", "q", "N/A", "N/A", "", "x\x1fy", "gres:gpu:1", "7", "N/A"]
    (q,) = rec.parse_squeue("\x1f".join(qfields))
    assert q.name == "x\x1fy" and q.gpus == 1
