"""A tool-calling fine-tune on the real cluster through the official openai client (issue 34).

The tenant uploads 160 OpenAI tool-calling lines (``trainer.toydata.toy_tool_conversations``: the
user asks for weather or a word, the assistant calls the function that serves it, the tool answers,
the assistant reports), validated with the base model's tokenizer; the job trains the calls and the
answers, not the tool results. Then the published adapter is downloaded and the base model and base
+ adapter greedy-decode 24 held-out requests (words no training line asked about) with the tools
given to the template: a reply counts when it calls a declared function with JSON arguments that
hold the schema's required keys (``toydata.parse_tool_call``, read as vLLM's Hermes parser reads
the ``<tool_call>`` form the template renders). Before and after are printed and compared.
"""

from __future__ import annotations

import io
import json
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.slurm.livegateway import STORAGE, LiveGateway, ensure_tiny_model, terminal
from trainer.toydata import TOY_TOOLS, parse_tool_call, toy_tool_conversations, toy_tool_prompt, write_jsonl

pytestmark = pytest.mark.slurm
A = "t-tools"
MODEL = "tiny-tools"     # today's tiny build (its template renders tools), whatever an older catalog holds
HELD_OUT = 24
HP = {"n_epochs": 2, "batch_size_tokens": 1024, "max_seq_len": 1024, "learning_rate_multiplier": 50,
      "checkpoint_every_steps": 100}


@pytest.fixture(scope="module")
def gw(cluster: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    ensure_tiny_model(MODEL)
    g = LiveGateway(tmp_path_factory.mktemp("tools"), (A,))
    yield g
    g.stop()


def _upload(gw: LiveGateway, path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        r = gw.api("POST", f"/v1/files?model={MODEL}", A, data={"purpose": "fine-tune"}, files={"file": (path.name, f)})
    assert r.status_code == 200 and r.json()["status"] == "processed", r.text
    return dict(r.json())


def _call_rate(model: Any, tok: Any, prompts: list[str]) -> list[dict[str, Any] | None]:
    import torch

    calls = []
    for prompt in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], tools=TOY_TOOLS,
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=96, do_sample=False, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        calls.append(parse_tool_call(tok.decode(out[0][ids["input_ids"].shape[1]:]), TOY_TOOLS))
    return calls


def test_tool_calling_job_teaches_the_model_to_call_the_declared_functions(
        gw: LiveGateway, tmp_path: Path) -> None:
    from openai import OpenAI
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer import catalog

    train = _upload(gw, write_jsonl(tmp_path / "tools.jsonl", toy_tool_conversations(160, seed=11)))
    val = _upload(gw, write_jsonl(tmp_path / "tools-val.jsonl", toy_tool_conversations(24, seed=12)))
    print(f"\ntool-calling upload: {json.dumps(train['validation']['stats']['tools'])}, "
          f"tokens p50 {train['validation']['stats']['tokens']['p50']}")
    assert train["validation"]["stats"]["tools"]["tool_calls"] == 160
    client = OpenAI(base_url=gw.url + "/v1", api_key=gw.tokens[A], max_retries=0)
    job = client.fine_tuning.jobs.create(model=MODEL, training_file=train["id"], validation_file=val["id"],
                                         suffix="tools", hyperparameters=HP)  # type: ignore[arg-type]
    done = gw.wait(A, job.id, terminal, 480)
    assert done["status"] == "succeeded", done["error"]
    assert client.fine_tuning.jobs.retrieve(job.id).fine_tuned_model == done["fine_tuned_model"]

    adapter_tar = next(fid for fid in done["result_files"]
                       if gw.api("GET", f"/v1/files/{fid}", A).json()["filename"].endswith("adapter.tar"))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    with tarfile.open(fileobj=io.BytesIO(gw.api("GET", f"/v1/files/{adapter_tar}/content", A).content)) as tar:
        for member in tar.getmembers():      # the regular files, by their base names (no paths from the tar)
            data = tar.extractfile(member) if member.isfile() else None
            if data is not None:
                (adapter / Path(member.name).name).write_bytes(data.read())
    entry = next(e for e in catalog.list_models(STORAGE / "models") if e.name == MODEL)
    base_dir = STORAGE / "models" / entry.path
    tok = AutoTokenizer.from_pretrained(base_dir)
    rng = random.Random(99)
    held = [toy_tool_prompt(rng) for _ in range(HELD_OUT)]
    base = AutoModelForCausalLM.from_pretrained(base_dir)       # sampled unquantized, as the demo samples
    before = _call_rate(base, tok, [p for p, _, _ in held])
    after = _call_rate(PeftModel.from_pretrained(base, str(adapter)), tok,
                       [p for p, _, _ in held])
    valid = [sum(c is not None for c in calls) for calls in (before, after)]
    right = sum(1 for c, (_, function, _) in zip(after, held, strict=True) if c and c["name"] == function)
    exact = sum(1 for c, (_, _, args) in zip(after, held, strict=True) if c and c["arguments"] == args)
    print(f"valid calls to a declared function on {HELD_OUT} held-out requests: base {valid[0]}, fine-tuned "
          f"{valid[1]} ({right} to the function the request needs, {exact} with the asked word as argument)")
    assert valid[0] == 0
    assert valid[1] >= HELD_OUT * 2 // 3 and right >= HELD_OUT * 2 // 3
