"""Tool-calling datasets through the real API with the tiny model's real tokenizer (issue 34): the
upload reports tool statistics and counts each line's tokens as the trainer renders it (tools
included), and a job on a base model whose chat template ignores tools is refused at create with
a clear message, while the tool-capable one is accepted. Slurm is replaced by a recording
submitter: this is about what create admits, not about training (``tests/slurm/test_tool_calling.py``
trains one)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.config import Settings
from tests.service.conftest import TENANT_A, Gateway, RecordingSubmitter
from trainer import catalog
from trainer.contract.lines import LineReader
from trainer.data import Conversation, tokenize_conversation
from trainer.toydata import toy_tool_conversations

pytestmark = pytest.mark.service
JOBS = "/v1/fine_tuning/jobs"


@pytest.fixture(scope="module")
def two_models(tiny_catalog: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A catalog with the tiny model twice: ``tiny-chat`` (its tool-capable template) and
    ``tiny-plain``, the same weights with plain ChatML (which ignores tools), registered the way an
    older catalog entry is (no tool check recorded: the gateway asks the tokenizer)."""
    root = tmp_path_factory.mktemp("two-models")
    source = next(iter((tiny_catalog / "tiny-chat").iterdir()))
    assert catalog.add(source, "tiny-chat", root, check=None) is not None
    plain = tmp_path_factory.mktemp("plain") / "m"
    shutil.copytree(source, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    config["chat_template"] = catalog.CHATML_TEMPLATE
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    catalog.add(plain, "tiny-plain", root, check=None)
    return root


@pytest.fixture
def gw_tools(settings: Settings, two_models: Path) -> Iterator[tuple[Gateway, RecordingSubmitter]]:
    g = Gateway(settings.model_copy(update={"default_model": "tiny-chat", "catalog_root": two_models}))
    submitter = RecordingSubmitter()
    g.app.state.submitter = submitter
    yield g, submitter
    g.app.state.engine.dispose()


def _tool_file(gw: Gateway, n: int = 20) -> dict:  # type: ignore[type-arg]
    body = "".join(json.dumps(r) + "\n" for r in toy_tool_conversations(n, seed=4)).encode()
    obj = gw.upload(TENANT_A, body, filename="tools.jsonl").json()
    assert obj["status"] == "processed", obj
    return dict(obj)


def test_upload_reports_tool_statistics_and_counts_tokens_as_the_trainer_renders(
        gw_tools: tuple[Gateway, RecordingSubmitter], two_models: Path) -> None:
    from transformers import AutoTokenizer

    gw, _ = gw_tools
    obj = _tool_file(gw)
    stats = obj["validation"]["stats"]
    assert stats["tools"] == {"lines_with_tools": 20, "lines_with_calls": 20, "tool_calls": 20,
                              "calls_per_line": 1.0, "max_calls_per_line": 1}
    tok = AutoTokenizer.from_pretrained(next(iter((two_models / "tiny-chat").iterdir())))
    lengths = []
    for i, row in enumerate(toy_tool_conversations(20, seed=4), start=1):
        chat = LineReader().read(i, json.dumps(row).encode())
        conv = Conversation(i, chat.conversations()[0], chat.weights, chat.tool_schemas())
        lengths.append(len(tokenize_conversation(tok, conv, "train")))
    assert stats["tokens"]["exact"] is True and stats["tokens"]["total"] == sum(lengths)
    assert stats["tokens"]["max"] == max(lengths) > 300      # the tools' schemas are counted


def test_a_base_whose_template_ignores_tools_is_refused_at_create(
        gw_tools: tuple[Gateway, RecordingSubmitter]) -> None:
    gw, submitter = gw_tools
    file_id = _tool_file(gw)["id"]
    models = {m["id"]: m for m in gw.client.get("/v1/models", headers=gw.auth(TENANT_A)).json()["data"]}
    assert models["tiny-chat"]["capabilities"] == {"tool_calling": None}     # not recorded: asked at create
    r = gw.client.post(JOBS, headers=gw.auth(TENANT_A), json={"model": "tiny-plain", "training_file": file_id})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "model_cannot_call_tools" and err["param"] == "model"
    assert "does not render tools" in err["message"] and "20 line(s)" in err["message"]
    assert not submitter.specs
    ok = gw.client.post(JOBS, headers=gw.auth(TENANT_A), json={"model": "tiny-chat", "training_file": file_id})
    assert ok.status_code == 200, ok.text
    assert len(submitter.specs) == 1


def test_models_add_records_whether_the_template_renders_tools(tiny_catalog: Path, tmp_path: Path) -> None:
    """``models add`` (with its checks) records the probe's answer in the catalog entry."""
    entry = next(e for e in catalog.list_models(tiny_catalog) if e.name == "tiny-chat")
    assert entry.tool_calling is True
