"""The usage report on sacct output recorded from the real dev cluster (tests/data/accounting)."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from accounting.gateway_facts import Cancellation, GatewayFacts, ScrubFailure
from accounting.render import usage_text
from accounting.usage import charged_pieces, final_runs, percentile, tres_count, usage_report
from accounting.window import AccountingError, Window
from gateway.slurm import records as rec
from tests.accounting.conftest import ACCT_DATA, LIVE_AT, RECORDED_AT, sacct

HOUR = Window(datetime(2026, 11, 30, 6, 0, tzinfo=UTC), datetime(2026, 11, 30, 7, 0, tzinfo=UTC))


def _rows(report):  # type: ignore[no-untyped-def]
    return {r.key: r for r in report.rows}


def test_gpu_seconds_are_gpus_times_elapsed_per_tenant() -> None:
    rows = _rows(usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT))
    # t-acct-a: 90 + requeued run 1 + array tasks 2+3+2 + job 93's two runs 3+5
    assert rows["t-acct-a"].gpu_seconds == 106
    # t-acct-b: 2 GPUs x 3 s + 1 + 20 + 20; the job cancelled while pending adds nothing
    assert rows["t-acct-b"].gpu_seconds == 2 * 3 + 1 + 20 + 20
    assert rows["t-acct-b"].cpu_seconds == 3 + 1 + 20 + 20  # 1 CPU each


def test_each_job_counted_once_in_final_state_and_requeues_counted() -> None:
    report = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    a, b = _rows(report)["t-acct-a"], _rows(report)["t-acct-b"]
    # 6 jobs: 84, 85 (only its REQUEUED run is in sacct), three array tasks, 93 (requeued, then done)
    assert a.jobs == 6 and a.states == {"COMPLETED": 5, "REQUEUED": 1}
    assert a.requeues == 2
    assert b.states == {"CANCELLED": 1, "COMPLETED": 4}
    assert report.total.jobs == 11


def test_array_tasks_are_separate_jobs() -> None:
    rows = sacct("sacct_final.txt")
    tasks = [r for r in final_runs(rows) if r.job_id.startswith("88_")]
    assert sorted(r.job_id for r in tasks) == ["88_0", "88_1", "88_2"]
    assert len({r.job_id_raw for r in tasks}) == 3


def test_queue_wait_excludes_jobs_that_never_started() -> None:
    rows = _rows(usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT))
    b = rows["t-acct-b"]
    # 83: 0 s, 89: 1 s, 94: 0 s, 95: 21 s (QOSMaxGRESPerUser); 96 was cancelled while pending
    assert b.waits == 4
    assert b.wait_p50_s == 0.5 and b.wait_p95_s == pytest.approx(18.0)
    # the requeued job's rerun waited for its BeginTime: Submit 06:20:16 -> Start 06:20:27
    assert rows["t-acct-a"].waits == 7 and rows["t-acct-a"].wait_p95_s == pytest.approx(9.5)


def test_running_jobs_count_up_to_now_and_pending_ones_not_at_all() -> None:
    report = usage_report(sacct("sacct_live.txt"), HOUR, now=LIVE_AT)
    rows = _rows(report)
    # 84 RUNNING since 06:19:13 -> 65 s at 06:20:18 (sacct printed ElapsedRaw=65 then)
    assert rows["t-acct-a"].gpu_seconds == 65 + 1 + 2 + 3 + 2 + 3
    # 94 RUNNING since 06:20:12 -> 6 s; 95 PENDING and 96 CANCELLED before start: nothing
    assert rows["t-acct-b"].gpu_seconds == 2 * 3 + 1 + 6
    assert rows["t-acct-b"].states == {"CANCELLED": 1, "COMPLETED": 2, "PENDING": 1, "RUNNING": 1}
    assert rows["t-acct-b"].run_p50_s == 2.0  # only finished runs (3 s, 1 s) have a run time


def test_job_spanning_the_window_start_is_prorated() -> None:
    window = Window(datetime(2026, 11, 30, 6, 20, tzinfo=UTC), HOUR.end)
    rows = _rows(usage_report(sacct("sacct_final.txt"), window, now=RECORDED_AT))
    # 84 ran 06:19:13-06:20:43: 43 of its 90 s fall in the window; 94, 95, 93's runs are inside
    assert rows["t-acct-a"].gpu_seconds == 43 + 3 + 5
    assert rows["t-acct-b"].gpu_seconds == 20 + 20


def test_midnight_crossing_jobs_split_between_days() -> None:
    # sacct_midnight.txt: real rows whose timestamps were moved across midnight by hand.
    rows = sacct("sacct_midnight.txt")
    window = Window(datetime(2026, 11, 28, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
    by_day = _rows(usage_report(rows, window, by="day", now=RECORDED_AT))
    assert by_day["2026-11-28"].gpu_seconds == 2 * 3600          # 94: 22:00 -> midnight
    assert by_day["2026-11-29"].gpu_seconds == 86400 + 47 + 2 * 1  # 94 all day, 84 47 s, 83 1 s x 2 GPUs
    assert by_day["2026-11-30"].gpu_seconds == 3600 + 43 + 2 * 2
    by_tenant = usage_report(rows, window, now=RECORDED_AT)
    assert by_tenant.gpu_hours_by_tenant_day["t-acct-a"] == {
        "2026-11-29": pytest.approx(47 / 3600), "2026-11-30": pytest.approx(43 / 3600)}
    assert by_tenant.total.gpu_seconds == sum(r.gpu_seconds for r in by_day.values())


def test_one_day_window_takes_only_its_part() -> None:
    rows = sacct("sacct_midnight.txt")
    day = Window(datetime(2026, 11, 30, tzinfo=UTC), datetime(2026, 12, 1, tzinfo=UTC))
    assert usage_report(rows, day, now=RECORDED_AT).total.gpu_seconds == 3600 + 43 + 4


def test_group_by_user_and_qos_keep_names_with_the_pipe() -> None:
    by_qos = _rows(usage_report(sacct("sacct_final.txt"), HOUR, by="qos", now=RECORDED_AT))
    assert set(by_qos) == {"ft-small", "ft-standard"}
    assert by_qos["ft-small"].gpu_seconds == 1 + 20 + 20  # 89 ("we|ird name,x"), 94, 95
    by_user = _rows(usage_report(sacct("sacct_final.txt"), HOUR, by="user", now=RECORDED_AT))
    assert set(by_user) == {"sft-t-acct-a", "sft-t-acct-b"}
    assert [r.account for r in sacct("sacct_final.txt") if r.job_id == "89"] == ["t-acct-b"]


def test_job_name_with_the_sacct_delimiter() -> None:
    # recorded from a real `sbatch -J $'unit\x1fsep'`, re-cut to today's format, which asks for no name
    rows = rec.parse_sacct((ACCT_DATA / "sacct_unitsep_name.txt").read_text())
    assert rows[0].account == "t-acct-b" and not rows.skipped


def test_a_record_that_does_not_parse_is_flagged_and_the_rest_reported() -> None:
    text = (ACCT_DATA / "sacct_final.txt").read_text()
    broken = "4242\x1f4242\x1fsft-t-acct-a\x1fonly-four-fields\n"
    rows = rec.parse_sacct(broken + text)
    report = usage_report(rows, HOUR, now=RECORDED_AT)
    assert _rows(report) == _rows(usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT))
    assert report.skipped == ("line 1 (job 4242): expected 17 fields, got 4",)
    assert "flagged: a sacct record skipped, not counted: line 1 (job 4242)" in usage_text(report, "table")
    assert json.loads(usage_text(report, "json"))["skipped_records"] == list(report.skipped)


def test_old_recording_with_step_rows() -> None:
    text = (ACCT_DATA.parent / "sacct_steps_duplicates.txt").read_text()
    window = Window(datetime(2026, 11, 30, 6, tzinfo=UTC), HOUR.end)
    rows = _rows(usage_report(rec.parse_sacct(text), window, now=RECORDED_AT))
    assert rows["beta"].gpu_seconds == 4 and rows["beta"].jobs == 1
    # job 7 and job 15 were cancelled before they started: counted as jobs, never as waits
    assert rows["acme"].states["CANCELLED"] >= 2
    assert rows["acme"].waits == rows["acme"].jobs - 2


def test_unknown_grouping_lists_the_valid_ones() -> None:
    with pytest.raises(AccountingError, match="valid: tenant, user, person, qos, day"):
        usage_report([], HOUR, by="project")


def test_gateway_facts_missing_is_not_available_not_zero() -> None:
    report = usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT)
    assert report.total.cancellations is None and report.total.scrub_failures is None
    assert report.note and "not available" in report.note


def test_gateway_facts_when_present() -> None:
    t = datetime(2026, 11, 30, 6, 20, 12, tzinfo=UTC)
    facts = GatewayFacts(
        cancellations=(Cancellation(96, "t-acct-b", t, t.replace(second=17)),
                       Cancellation(999, "t-acct-a", t, None)),
        scrub_failures=(ScrubFailure(94, "t-acct-b", "vm-n1", t, "gpu not clean"),))
    rows = _rows(usage_report(sacct("sacct_final.txt"), HOUR, now=RECORDED_AT, facts=facts))
    assert rows["t-acct-b"].cancellations == 1 and rows["t-acct-b"].cancel_stop_p50_s == 5
    assert rows["t-acct-b"].scrub_failures == 1
    assert rows["t-acct-a"].cancellations == 1 and rows["t-acct-a"].cancel_stop_p50_s is None


def test_a_report_limited_to_an_account_holds_no_other_tenants_facts() -> None:
    """Issue 35: ``--account t-acct-a`` once listed t-acct-b's row, made of t-acct-b's cancellations and
    scrub failures (the gateway DB holds every tenant's); sacct rows were filtered, the facts were not."""
    t = datetime(2026, 11, 30, 6, 20, 12, tzinfo=UTC)
    facts = GatewayFacts(
        cancellations=(Cancellation(96, "t-acct-b", t, t.replace(second=17)), Cancellation(999, "t-acct-a", t, None)),
        scrub_failures=(ScrubFailure(94, "t-acct-b", "vm-n1", t, "gpu not clean"),))
    only_a = [r for r in sacct("sacct_final.txt") if r.account == "t-acct-a"]
    report = usage_report(only_a, HOUR, now=RECORDED_AT, facts=facts, accounts=["t-acct-a"])
    assert set(_rows(report)) == {"t-acct-a"}
    assert report.total.cancellations == 1 and report.total.scrub_failures == 0


def test_facts_without_an_sacct_row_group_by_what_the_gateway_knows() -> None:
    """Issue 35: ``--by user`` and ``--by qos`` once put a cancellation whose job has no sacct row here
    (cancelled before Slurm recorded it, or outside sacct's window) in an ``(unknown)`` row; the
    gateway knows its tenant (so its unix user) and the QOS it submitted it under."""
    t = datetime(2026, 11, 30, 6, 20, 12, tzinfo=UTC)
    facts = GatewayFacts(cancellations=(Cancellation(999, "t-acct-a", t, None, "ft-small"),))
    by_user = _rows(usage_report(sacct("sacct_final.txt"), HOUR, by="user", now=RECORDED_AT, facts=facts))
    by_qos = _rows(usage_report(sacct("sacct_final.txt"), HOUR, by="qos", now=RECORDED_AT, facts=facts))
    assert "(unknown)" not in by_user and by_user["sft-t-acct-a"].cancellations == 1
    assert "(unknown)" not in by_qos and by_qos["ft-small"].cancellations == 1


def test_helpers() -> None:
    assert tres_count("billing=1,cpu=4,gres/gpu=2,mem=1G", "cpu") == 4
    assert tres_count("", "cpu") == 0
    assert percentile([], 50) is None
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([5], 95) == 5
    never = next(r for r in sacct("sacct_final.txt") if r.job_id == "96")
    assert charged_pieces(never, HOUR, RECORDED_AT) == []


def test_gateway_facts_are_read_from_the_gateway_database(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from datetime import timedelta

    from sqlmodel import Session

    from accounting.gateway_facts import load_gateway_facts
    from gateway.db import make_engine, migrate
    from gateway.models import DataFile, FineTuningJob, Tenant

    url = f"sqlite:///{tmp_path / 'gw.db'}"
    assert load_gateway_facts(url, HOUR) is None            # no database: "not available", none created
    assert not (tmp_path / "gw.db").exists()
    engine = make_engine(url)
    migrate(engine)
    t = HOUR.start + timedelta(minutes=5)
    with Session(engine) as s:
        tenant = Tenant(name="t-acct-b", unix_user="sft-t-acct-b")
        s.add(tenant)
        s.flush()
        f = DataFile(tenant_id=tenant.id, filename="d.jsonl", purpose="fine-tune", bytes=1, sha256="0" * 64,
                     status="processed")
        s.add(f)
        s.flush()
        common = {"tenant_id": tenant.id, "training_file": f.id, "model": "tiny-chat"}
        s.add(FineTuningJob(**common, slurm_job_id=96, cancel_requested_at=t,
                            stop_confirmed_at=t + timedelta(seconds=5)))
        s.add(FineTuningJob(**common, slurm_job_id=97, cancel_requested_at=t, stop_confirmed_at=None))
        s.add(FineTuningJob(**common, slurm_job_id=98, cancel_requested_at=HOUR.end + timedelta(hours=1)))
        s.add(FineTuningJob(**common, slurm_job_id=94, cleanup="failed", finished_at=t, progress={"node": "vm-n1"}))
        s.add(FineTuningJob(**common, slurm_job_id=95, cleanup="confirmed", finished_at=t))
        s.commit()
    engine.dispose()
    facts = load_gateway_facts(url, HOUR)
    assert facts is not None
    assert sorted((c.job_id, c.stop_latency_s) for c in facts.cancellations) == [(96, 5.0), (97, None)]
    assert [(f.job_id, f.node, f.tenant) for f in facts.scrub_failures] == [(94, "vm-n1", "t-acct-b")]
