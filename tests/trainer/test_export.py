"""Exports for serving, on a real trained adapter (the session's reference run on the tiny Llama).

merged: plain transformers (no bitsandbytes, no peft) loads the export, and its logits equal
those of the 4-bit base + adapter that training used: float32 within 1e-5 relative, bfloat16
within 3e-2 (bf16 storage and compute; the measured numbers are at REL_TOLERANCE). vllm: the
export passes vLLM's loader checks, each refusal is named, the chat template keeps rendering
the same text without its generation tags, and PEFT loads the export to the same logits.
vLLM is not installed here: only its loader's checks ran, never vLLM.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from trainer_testlib import Reference, Tiny

from trainer.catalog import CHATML_TEMPLATE

pytestmark = pytest.mark.train

CONVERSATION = [
    {"role": "system", "content": "You count things."},
    {"role": "user", "content": "The apple and the river count 12."},
    {"role": "assistant", "content": "The stone and the cloud count 7."},
    {"role": "user", "content": "The green tree and the blue house?"},
]
TAG = re.compile(r"\{%[-+]?\s*(end)?generation\b")
# Measured on the CPU (the reference run: tiny Llama, r=8, 2 epochs; rel = max |diff| / max |reference
# logit|, over every position of CONVERSATION): float32 max |diff| 7.3e-6, rel 9.5e-7; bfloat16 max |diff|
# 8.1e-2, rel 1.05e-2 (bf16 weights computed in float32: 5.4e-2, rel 7.0e-3; argmax equal at 99% of
# positions). bf16 keeps 8 bits of mantissa (2^-8 = 3.9e-3): the bound is about 8 of those.
REL_TOLERANCE = {"float32": 1e-5, "bfloat16": 3e-2}


def _prompt_ids(staging: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(staging)
    return tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, return_tensors="pt",
                                         return_dict=True)["input_ids"]


def _logits(model: Any, ids: Any) -> Any:
    import torch

    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.fixture(scope="module")
def trained(tiny: Tiny, reference: Reference) -> dict[str, Any]:
    """Prompt ids and the logits of the 4-bit base + adapter, as training computed them."""
    from peft import PeftModel

    from trainer.model import load_base_model

    assert reference.rc == 0, reference.log.read_text()[-3000:]
    ids = _prompt_ids(reference.staging)
    model = PeftModel.from_pretrained(load_base_model(tiny.path, "cpu"), str(reference.staging))
    return {"ids": ids, "logits": _logits(model, ids), "base": _logits(load_base_model(tiny.path, "cpu"), ids)}


def _diff(got: Any, want: Any) -> tuple[float, float]:
    d = float((got - want).abs().max())
    return d, d / float(want.abs().max())


# ----------------------------------------------------------------- merged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_model_matches_the_4bit_base_plus_adapter(dtype: str, tiny: Tiny, reference: Reference,
                                                         trained: dict[str, Any], tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.export import merged_model

    out = merged_model(tiny.path, reference.staging, tmp_path / "merged", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == dtype
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]        # no temp dir left beside it

    model = AutoModelForCausalLM.from_pretrained(out)                 # plain transformers, no bitsandbytes
    assert model.dtype == getattr(torch, dtype)
    linears = [m for m in model.modules() if "Linear" in type(m).__name__]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)
    got = _logits(model, trained["ids"])
    abs_diff, rel_diff = _diff(got, trained["logits"])
    _, rel_base = _diff(trained["base"], trained["logits"])            # what the adapter changes
    upcast = _diff(_logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32), trained["ids"]),
                   trained["logits"])
    same_top = float((got.argmax(-1) == trained["logits"].argmax(-1)).float().mean())
    print(f"merged {dtype}: max |diff| {abs_diff:.2e}, rel {rel_diff:.2e} (weights alone, computed in "
          f"float32: {upcast[0]:.2e}, rel {upcast[1]:.2e}); same argmax at {same_top:.0%} of positions; "
          f"the adapter itself moves the logits by rel {rel_base:.2e}")
    assert rel_diff < REL_TOLERANCE[dtype], (abs_diff, rel_diff)
    assert rel_base > 10 * REL_TOLERANCE[dtype]        # the bound tells a merged adapter from none

    tokenizer = AutoTokenizer.from_pretrained(out)
    original = AutoTokenizer.from_pretrained(reference.staging)
    assert tokenizer.apply_chat_template(CONVERSATION, tokenize=False) == \
        original.apply_chat_template(CONVERSATION, tokenize=False)
    assert not TAG.search((out / "chat_template.jinja").read_text())


def test_merged_model_refuses_an_existing_output(tiny: Tiny, reference: Reference, tmp_path: Path) -> None:
    from trainer.contract.errors import ExportError
    from trainer.export import merged_model

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty"):
        merged_model(tiny.path, reference.staging, tmp_path / "taken", dtype="float32")
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"
    with pytest.raises(ExportError, match="dtype 'int8'"):
        merged_model(tiny.path, reference.staging, tmp_path / "other", dtype="int8")


# ----------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def exported(tiny: Tiny, reference: Reference, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.export import vllm_adapter

    assert reference.rc == 0
    return vllm_adapter(reference.staging, tiny.name, tmp_path_factory.mktemp("vllm") / "adapter")


def test_vllm_export_passes_the_loader_checks(exported: Path, tiny: Tiny, reference: Reference) -> None:
    from trainer.export import vllm_problems

    assert vllm_problems(exported) == []
    assert vllm_problems(exported, max_lora_rank=8) == []     # r=8 fits vLLM's smallest rank above 1
    config = json.loads((exported / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny.name and config["inference_mode"] is True
    original = json.loads((reference.staging / "adapter_config.json").read_text())
    assert {k: v for k, v in config.items() if k != "base_model_name_or_path"} == \
        {k: v for k, v in original.items() if k != "base_model_name_or_path"}
    assert (exported / "adapter_model.safetensors").read_bytes() == \
        (reference.staging / "adapter_model.safetensors").read_bytes()
    assert sorted(p.name for p in exported.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "chat_template.jinja", "tokenizer.json",
        "tokenizer_config.json"]


def test_vllm_export_loads_with_peft_to_the_same_logits(exported: Path, tiny: Tiny,
                                                        trained: dict[str, Any]) -> None:
    """LoRAX and PEFT read the same directory: it is still the adapter that was trained."""
    from peft import PeftModel

    from trainer.model import load_base_model

    model = PeftModel.from_pretrained(load_base_model(tiny.path, "cpu"), str(exported))
    assert _diff(_logits(model, trained["ids"]), trained["logits"])[0] == 0.0


def test_vllm_export_chat_template_renders_the_same_without_generation_tags(exported: Path,
                                                                            reference: Reference) -> None:
    from transformers import AutoTokenizer

    assert TAG.search((reference.staging / "chat_template.jinja").read_text())   # the tags were there
    assert not TAG.search((exported / "chat_template.jinja").read_text())
    before, after = AutoTokenizer.from_pretrained(reference.staging), AutoTokenizer.from_pretrained(exported)
    for messages, prompt in ((CONVERSATION, True), (CONVERSATION[:3], False)):
        want = before.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert after.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt) == want
        assert after.apply_chat_template(messages, add_generation_prompt=prompt) == \
            before.apply_chat_template(messages, add_generation_prompt=prompt)
    # transformers 5's class name is written as the one transformers 4 knows too; same tokenizer
    assert json.loads((exported / "tokenizer_config.json").read_text())["tokenizer_class"] == \
        "PreTrainedTokenizerFast"
    assert after("The apple river <|im_end|>")["input_ids"] == before("The apple river <|im_end|>")["input_ids"]


def test_vllm_export_refuses_an_existing_output_unless_forced(exported: Path, reference: Reference,
                                                              tmp_path: Path) -> None:
    from trainer.contract.errors import ExportError
    from trainer.export import vllm_adapter

    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("x")
    with pytest.raises(ExportError, match="not empty"):
        vllm_adapter(reference.staging, "tiny", out)
    vllm_adapter(reference.staging, "tiny", out, force=True)
    assert not (out / "old.txt").exists() and (out / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _broken(exported: Path, tmp_path: Path, **config: Any) -> Path:
    copy = tmp_path / "adapter"
    shutil.copytree(exported, copy)
    data = json.loads((copy / "adapter_config.json").read_text())
    data.update(config)
    (copy / "adapter_config.json").write_text(json.dumps(data))
    return copy


@pytest.mark.parametrize(("change", "expected"), [
    ({"r": 128}, "LoRA rank r=128 is greater than --max-lora-rank 64: start vLLM with --max-lora-rank 128"),
    ({"peft_type": "IA3"}, "peft_type is 'IA3': vLLM serves LoRA adapters only"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save is ['lm_head']: vLLM does not load them"),
    ({"use_dora": True}, "use_dora is true: vLLM does not support DoRA"),
    ({"bias": "all"}, "bias is 'all': vLLM refuses adapter biases"),
    ({"target_modules": []}, "target_modules is empty"),
])
def test_vllm_problems_name_each_refusal(change: dict[str, Any], expected: str, exported: Path,
                                         tmp_path: Path) -> None:
    from trainer.export import vllm_problems

    problems = vllm_problems(_broken(exported, tmp_path, **change), max_lora_rank=64)
    assert any(p.startswith(expected) for p in problems), problems


def test_vllm_problems_check_the_weights(exported: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    from trainer.export import vllm_problems

    missing = _broken(exported, tmp_path)
    (missing / "adapter_model.safetensors").unlink()
    assert vllm_problems(missing) == ["adapter_model.safetensors is missing: vLLM loads the LoRA weights from it"]

    extra = tmp_path / "extra"
    shutil.copytree(exported, extra)
    tensors = load_file(extra / "adapter_model.safetensors")
    a_name = next(n for n in tensors if n.endswith("lora_A.weight"))
    tensors["base_model.model.lm_head.weight"] = torch.zeros(4, 4)     # what modules_to_save would add
    tensors[a_name] = torch.zeros(4, tensors[a_name].shape[1])          # rank 4 against r=8
    del tensors[a_name.replace("lora_A", "lora_B")]
    save_file(tensors, extra / "adapter_model.safetensors")
    problems = vllm_problems(extra)
    assert any("1 tensor(s) vLLM cannot load" in p and "lm_head.weight" in p for p in problems), problems
    assert any(p.startswith(f"{a_name} has shape [4, ") and "r=8" in p for p in problems), problems
    assert any(p.endswith("has lora_A but no lora_B") for p in problems), problems

    with pytest.raises(ValueError, match="vLLM accepts only 1, 8, 16"):
        vllm_problems(exported, max_lora_rank=48)
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    assert vllm_problems(no_config)[0].endswith("adapter_config.json is missing")


# ----------------------------------------------------------------- chat templates

_BODY = "{% for m in messages %}<{{ m['role'] }}>{X}{{ m['content'] }}{Y}</>\n{% endfor %}"
_TAGS = [("{% generation %}", "{% endgeneration %}"), ("{%- generation -%}", "{%- endgeneration -%}"),
         ("{%- generation %}", "{% endgeneration -%}"), ("{%+ generation +%}", "{%+ endgeneration +%}"),
         ("{%generation%}", "{%endgeneration%}")]
_SPACES = [("", ""), ("  ", "\n"), ("\n  ", "  \n"), ("\n", "\n   ")]
TEMPLATES = [_BODY.replace("{X}", pre + a + post).replace("{Y}", post + b + pre)
             for a, b in _TAGS for pre, post in _SPACES] + \
            ["{% for m in messages %}\n  " + a + "\n  {{ m['content'] }}\n  " + b + "\n{% endfor %}" + pre + "x"
             for a, b in _TAGS for pre, _ in _SPACES] + \
            [CHATML_TEMPLATE, CHATML_TEMPLATE.replace("{% generation %}", "{%- generation -%}\n  "),  # one tag of a
             CHATML_TEMPLATE.replace("{% endgeneration %}", "\n{% endgeneration %}  ")]        # pair touches spaces


@pytest.mark.parametrize("template", TEMPLATES)
def test_generation_tags_are_removed_and_the_text_rendered_stays_the_same(template: str) -> None:
    """Whatever the whitespace control around the tags (where deleting them naively would
    change the text), transformers renders the cleaned template exactly as the original."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from trainer.export import render_chat, strip_generation_tags

    cleaned = strip_generation_tags(template)
    assert not TAG.search(cleaned)
    messages = [*CONVERSATION, {"role": "assistant", "content": " ok \n"}]
    for prompt in (False, True):
        want = render_jinja_template([messages], chat_template=template, add_generation_prompt=prompt)[0][0]
        assert render_jinja_template([messages], chat_template=cleaned, add_generation_prompt=prompt)[0][0] == want
        assert render_chat(template, messages, prompt) == want        # the export's own check renders alike


def test_a_template_inside_tokenizer_config_is_cleaned_too(reference: Reference, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from trainer.export import copy_tokenizer

    source, target = tmp_path / "source", tmp_path / "target"
    source.mkdir()
    target.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(reference.staging / name, source / name)
    marked = CHATML_TEMPLATE.replace("{% generation %}", "{%- generation -%}\n  ")
    config = json.loads((source / "tokenizer_config.json").read_text())
    (source / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": marked}))
    assert copy_tokenizer(source, target) == ["tokenizer.json", "tokenizer_config.json"]
    cleaned = json.loads((target / "tokenizer_config.json").read_text())["chat_template"]
    assert not TAG.search(cleaned) and "generation" in marked
    before, after = AutoTokenizer.from_pretrained(source), AutoTokenizer.from_pretrained(target)
    assert after.apply_chat_template(CONVERSATION[:3], tokenize=False) == \
        before.apply_chat_template(CONVERSATION[:3], tokenize=False)
