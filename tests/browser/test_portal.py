"""The portal in a real Chromium against a real gateway and the real dev cluster.

A tenant signs in, uploads a dataset, starts a job, watches it succeed with its loss
chart filling in and downloads the adapter; cancels a running job and sees the stop and
the node cleanup confirmed; sees a bad dataset's line-numbered errors. Another tenant
gets 404 on those URLs; a form without its CSRF token is refused; admin pages render.
"""

from __future__ import annotations

import re
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.browser.conftest import ROOT, TENANT_A, TENANT_B, Portal

pytestmark = pytest.mark.browser
DATASETS = ROOT / "tests" / "data" / "datasets"


def chat_file(path: Path, n: int, seed: int) -> Path:
    from tests.slurm.livegateway import chat_file as write

    return write(path, n, seed=seed)


def upload(portal: Portal, path: Path) -> str:
    """Upload through the page's form (XHR with a progress bar); the file id of the report page."""
    page = portal.page
    portal.goto("/portal/datasets")
    page.get_by_label("File").set_input_files(str(path))
    page.get_by_role("button", name="Upload").click()
    page.wait_for_url(re.compile(r".*/portal/datasets/file-[0-9a-f]+$"))
    return page.url.rsplit("/", 1)[-1]


def create_job(portal: Portal, file_id: str, *, epochs: int, expect_qos: str = "ft-small") -> str:
    page = portal.page
    portal.goto(f"/portal/jobs/new?training_file={file_id}")
    page.get_by_label("Epochs").fill(str(epochs))
    page.get_by_label("Learning rate").fill("0.002")
    page.get_by_label("LoRA rank").fill("8")
    page.get_by_text("Advanced").click()
    page.get_by_label("Tokens per batch").fill("512")
    page.get_by_label("Max sequence length").fill("256")
    page.get_by_label("Checkpoint every N steps").fill("3")
    # the estimate follows the form before anything is submitted
    page.wait_for_function("document.getElementById('est-qos').textContent.trim() !== '–'")
    assert page.locator("#est-qos").inner_text() == expect_qos
    assert int(page.locator("#est-tokens").inner_text().replace(",", "").replace("\u202f", "")) > 0
    # and says when it would start (the create API's dry run: an idle cluster starts it now)
    page.wait_for_function("document.getElementById('est-start').textContent.trim() !== '–'")
    assert page.locator("#est-start").inner_text() == "now"
    return page.url


def submit_job(portal: Portal) -> str:
    portal.page.get_by_role("button", name="Start fine-tuning").click()
    portal.page.wait_for_url(re.compile(r".*/portal/jobs/ftjob-[0-9a-f]+$"))
    return portal.page.url.rsplit("/", 1)[-1]


def wait_status(portal: Portal, status: str, timeout_s: float) -> None:
    portal.page.locator("#job-status", has_text=status).wait_for(timeout=timeout_s * 1000)


def test_sign_in_upload_train_download(browser: Any, gateway: Any, state: dict[str, Any], tmp_path: Path) -> None:
    t0 = time.monotonic()
    anon = Portal(browser, gateway.url, None)
    anon.goto("/")
    assert anon.page.url.endswith("/portal/login")
    anon.page.get_by_label("API token").fill("sft_not-a-token")
    anon.page.get_by_role("button", name="Sign in").click()
    assert "not valid" in anon.page.get_by_role("alert").inner_text()
    anon.shot("01-login-error")
    anon.close()

    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    file_id = upload(a, chat_file(tmp_path / "toy-chats.jsonl", 80, seed=1))
    page = a.page
    assert "ready for training" in page.locator("h1").inner_text()
    assert page.locator(".stats dd").first.inner_text() == "80"          # lines
    a.shot("03-dataset-report")
    a.goto("/portal/datasets")
    assert page.get_by_role("link", name="toy-chats.jsonl").count() >= 1
    a.shot("02-datasets")

    create_job(a, file_id, epochs=1)
    a.shot("04-new-job")
    job_id = submit_job(a)
    state.update(job=job_id, file=file_id)
    points = page.locator("#loss-chart")
    wait_status(a, "running", 90)
    a.shot("05-job-running")
    wait_status(a, "succeeded", 180)
    # the chart filled in from the live endpoint while the job ran
    page.wait_for_function("+document.getElementById('loss-chart').dataset.points > 0")
    assert int(points.get_attribute("data-points") or 0) > 0
    assert page.locator("#loss-svg polyline.train").count() == 1
    evals = page.locator("#loss-svg circle.eval").count()
    assert evals >= 1
    if evals <= 2:     # before and after: two measurements, drawn as two dots, no line that reads as a trend
        assert page.locator("#loss-svg polyline.eval").count() == 0
    page.locator("#job-cleanup", has_text="confirmed").wait_for(timeout=60_000)
    assert page.get_by_role("heading", name="Checkpoints").is_visible()
    assert page.locator("time").first.get_attribute("title", timeout=1000)   # localized by the script
    a.shot("06-job-succeeded")

    with page.expect_download() as dl:
        page.get_by_role("link", name=f"{job_id}-adapter.tar").click()
    saved = tmp_path / "adapter.tar"
    dl.value.save_as(saved)
    with tarfile.open(saved) as tar:
        names = tar.getnames()
    assert any(n.endswith("adapter_model.safetensors") for n in names), names

    a.goto("/portal/jobs")
    assert page.locator("tr", has_text=job_id).locator(".badge.ok", has_text="succeeded").is_visible()
    a.shot("07-jobs")
    assert not a.console_errors, a.console_errors
    a.close()
    print(f"train flow: {time.monotonic() - t0:.1f}s")


def test_cancel_running_job(browser: Any, gateway: Any, tmp_path: Path) -> None:
    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    file_id = upload(a, chat_file(tmp_path / "long.jsonl", 400, seed=2))
    create_job(a, file_id, epochs=5)
    submit_job(a)
    wait_status(a, "running", 90)
    a.page.locator("#job-phase", has_text="training").wait_for(timeout=90_000)
    a.page.get_by_role("link", name="Cancel job…").click()
    assert a.page.get_by_role("heading", name="Cancel this job?").is_visible()
    a.shot("08-cancel-confirm")
    a.page.get_by_role("button", name="Yes, cancel the job").click()
    wait_status(a, "cancelled", 60)
    a.page.locator("#job-cleanup", has_text="confirmed").wait_for(timeout=60_000)
    assert a.page.get_by_role("link", name="Cancel job…").count() == 0
    a.shot("09-job-cancelled")
    a.close()


def test_dpo_job_from_a_preference_file(browser: Any, gateway: Any, tmp_path: Path) -> None:
    """A preference file is shown as one; the new-job form preselects DPO for it; the job trains and its
    page shows the method and the held-out preference accuracy and reward margin, before -> after."""
    from trainer.toydata import toy_preferences, write_jsonl

    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    file_id = upload(a, write_jsonl(tmp_path / "pairs.jsonl", toy_preferences(120, seed=4)))
    page = a.page
    assert page.locator("#dataset-format").inner_text() == "preference pairs (DPO)"
    assert page.locator("#pref-chosen").inner_text() != "– / –"
    a.shot("11-preference-dataset")
    a.goto(f"/portal/jobs/new?training_file={file_id}")
    assert page.get_by_label("Method").input_value() == "dpo"
    page.get_by_label("DPO beta").fill("0.1")
    page.get_by_label("Epochs").fill("2")
    page.get_by_label("Learning rate").fill("0.01")
    page.get_by_label("LoRA rank").fill("8")
    page.get_by_text("Advanced").click()
    page.get_by_label("Tokens per batch").fill("768")
    page.get_by_label("Max sequence length").fill("256")
    page.get_by_label("Checkpoint every N steps").fill("4")
    page.wait_for_function("document.getElementById('est-start').textContent.trim() !== '–'")
    assert page.locator("#est-start").inner_text() == "now"   # the dry run took the file as DPO's
    a.shot("12-new-dpo-job")
    submit_job(a)
    wait_status(a, "succeeded", 240)
    assert page.locator("#job-method").inner_text() == "DPO (beta 0.1)"
    shown = page.locator("#job-preference").inner_text()
    before, after = (part.split(" / ") for part in shown.split(" → "))
    print(f"\nportal DPO job: preference accuracy / reward margin {shown}")
    assert before == ["0.50", "0.000"] and float(after[0]) > 0.8 and float(after[1]) > 0.5
    a.shot("13-dpo-job-succeeded")
    a.close()


def test_bad_dataset_shows_line_numbered_errors(browser: Any, gateway: Any) -> None:
    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    upload(a, DATASETS / "bad_role.jsonl")
    page = a.page
    assert "not usable" in page.locator("h1").inner_text()
    first = page.locator(".errors .issues li").first
    assert first.locator(".line").inner_text() == "line 7"
    assert first.locator(".kind").inner_text() == "bad_role"
    assert page.get_by_role("link", name="Fine-tune with this dataset").count() == 0
    a.shot("10-dataset-errors")
    a.close()


def test_other_tenant_gets_404_and_csrf_is_enforced(browser: Any, gateway: Any, state: dict[str, Any]) -> None:
    assert state, "needs the job and file of the first test"
    b = Portal(browser, gateway.url, gateway.tokens[TENANT_B])
    for path in (f"/portal/jobs/{state['job']}", f"/portal/jobs/{state['job']}/live",
                 f"/portal/jobs/{state['job']}/cancel", f"/portal/datasets/{state['file']}",
                 f"/portal/files/{state['file']}/download"):
        assert b.goto(path).status == 404, path
    b.goto(f"/portal/jobs/{state['job']}")
    assert "no such fine-tuning job" in b.page.get_by_role("alert").inner_text().lower()
    b.shot("11-not-found")
    resp = b.context.request.post(f"{gateway.url}/portal/jobs/{state['job']}/cancel", form={"csrf": ""},
                                  max_redirects=0)
    assert resp.status in (403, 404)
    # a real form, posted without its token, is refused
    b.goto("/portal/datasets")
    b.page.evaluate("document.querySelector('form.signout input[name=csrf]').remove()")
    with b.page.expect_response(lambda r: r.url.endswith("/portal/logout")) as posted:
        b.page.get_by_role("button", name="Sign out").click()
    assert posted.value.status == 403
    assert "security token" in b.page.get_by_role("alert").inner_text()
    b.shot("12-csrf-refused")
    # tenant A's own session: a cancel without the token is refused too
    a = Portal(browser, gateway.url, gateway.tokens[TENANT_A])
    resp = a.context.request.post(f"{gateway.url}/portal/jobs/{state['job']}/cancel", form={},
                                  max_redirects=0)
    assert resp.status == 403
    a.close()
    # and the admin pages are not for tenants
    assert b.goto("/portal/admin").status == 403
    b.close()


def test_admin_pages(browser: Any, gateway: Any) -> None:
    s = Portal(browser, gateway.url, gateway.tokens["sysadmin"])
    page = s.page
    assert page.get_by_role("heading", name="Nodes and scrubs").is_visible()
    s.shot("13-admin-nodes")
    s.goto("/portal/admin/usage?start=-1d")
    assert page.locator("td", has_text=TENANT_A).first.is_visible()
    assert page.locator("img[alt^='Stacked bars']").is_visible()
    s.shot("14-admin-usage")
    s.goto("/portal/admin/tenants")
    assert page.locator("td", has_text=TENANT_B).first.is_visible()
    assert page.locator("td", has_text="ft-small").first.is_visible()
    s.shot("15-admin-tenants")
    assert s.goto("/portal/jobs").status == 403          # no tenant: tenant pages refuse
    s.page.get_by_role("button", name="Sign out").click()
    assert "signed out" in page.get_by_role("status").inner_text()
    assert s.goto("/portal/admin").url.endswith("/portal/login?next=/portal/admin")
    s.close()


def test_the_new_job_form_preselects_the_training_file_and_shows_beta_only_for_dpo(
        browser: Any, gateway: Any, tmp_path: Path) -> None:
    """Issue 35: the form preselected the newest file (the validation file, uploaded last), showed the DPO
    beta field for supervised jobs and cut the Method dropdown off."""
    a = Portal(browser, gateway.url, gateway.tokens[TENANT_B])
    a.console_errors.clear()     # what signing in as this tenant logged (another test's 404 checks) is not this page's
    train = upload(a, chat_file(tmp_path / "big-train.jsonl", 60, seed=7))
    upload(a, chat_file(tmp_path / "small-val.jsonl", 12, seed=8))          # the newest file
    a.goto("/portal/jobs/new")
    page = a.page
    assert page.get_by_label("Training file").input_value() == train
    assert page.get_by_label("Method").input_value() == "supervised"
    assert not page.get_by_label("DPO beta").is_visible()
    fits = page.eval_on_selector("#method", "e => e.scrollWidth <= e.clientWidth + 1 && e.clientWidth >= 180")
    assert fits, "the Method dropdown shows its whole choice"
    a.shot("14-new-job-supervised")
    page.get_by_label("Method").select_option("dpo")
    assert page.get_by_label("DPO beta").is_visible()
    a.shot("15-new-job-dpo-beta")
    assert not a.console_errors, a.console_errors
    a.close()
