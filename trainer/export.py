"""Export a published adapter for serving: a vLLM/LoRAX adapter directory, or a merged model.

Two shapes (``finetune artifacts export JOB_ID --format vllm|merged``):

* :func:`vllm_adapter`: the LoRA as vLLM's ``--lora-modules NAME=DIR`` and LoRAX load it:
  ``adapter_model.safetensors`` as published, ``adapter_config.json`` naming the catalog base
  model, and the tokenizer files with the chat template cleaned of training-only tags.
  :func:`vllm_problems` applies the checks vLLM's LoRA loader makes (``PEFTHelper`` and the
  weight-name parser in ``vllm/lora``), without vLLM: vLLM is not installed here, so these
  checks are all that ran, never vLLM itself.
* :func:`merged_model`: the base model with the adapter merged in, loadable by plain
  transformers (no bitsandbytes, no peft, no quantization_config). The base is loaded
  exactly as training loaded it (4-bit NF4, :func:`trainer.model.load_base_model`) and its
  4-bit weights are dequantized: the adapter was trained against those values, not the
  original full-precision weights, so merging into them reproduces training-time outputs.

Chat templates: our catalog templates mark assistant text with HF's ``{% generation %}``
(for the loss mask), a tag only transformers' renderer knows (another Jinja, such as the
minijinja LoRAX renders with, refuses it), so exports carry the template without it,
rendering the same text (:func:`strip_generation_tags`, checked on probe conversations at
export).

Every export is written into a temp directory next to the output and renamed into place,
so a reader never sees half an export. Torch and the Hugging Face stack are imported inside
the functions; the vLLM export and its checks need neither (safetensors headers are JSON).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainer.checkpoint import fsync_dir
from trainer.contract import jobdir
from trainer.contract.errors import ExportError
from trainer.model import load_base_model

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = jobdir.ADAPTER_CONFIG
CHAT_TEMPLATE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_FILES = ("tokenizer.json", TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE,
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json")
"""Tokenizer files an export carries when the adapter directory has them (the published tar
holds the first four)."""

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for ``--max-lora-rank`` (``MaxLoRARanks`` in vllm/config/lora.py;
its default is 16). Releases before 2024 accepted only 8, 16, 32 and 64."""

DEFAULT_MAX_LORA_RANK = 64
"""The ``--max-lora-rank`` checked against when none is given: the largest value every vLLM
release with LoRA support accepts (vLLM's own default, 16, is below many QLoRA ranks)."""

DTYPES = ("bfloat16", "float16", "float32")
"""The dtypes a merged model can be saved in."""

_GENERATION_TAG = re.compile(r"\{%([-+]?)\s*(generation|endgeneration)\s*([-+]?)%\}")

# Conversations the cleaned template must render exactly as the original does.
_PROBES: tuple[tuple[list[dict[str, str]], bool], ...] = (
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}], False),
    ([{"role": "system", "content": "s"}, {"role": "user", "content": "a"},
      {"role": "assistant", "content": " b\n"}, {"role": "user", "content": "c"}], True),
)


# ----------------------------------------------------------------- chat templates


def strip_generation_tags(template: str) -> str:
    """Return ``template`` without ``{% generation %}``/``{% endgeneration %}`` tags (any of
    the ``-``/``+`` whitespace-control variants), rendering the same text.

    A tag between two non-whitespace characters (the usual ``...%}{% generation %}{{ ...``)
    is deleted: with nothing to strip or trim around it, its whitespace control and
    transformers' ``trim_blocks``/``lstrip_blocks`` have no effect, and deleting it changes
    none of its neighbours' either. A tag touching whitespace becomes the neutral block
    ``{% if true %}``/``{% endif %}`` with the same ``-``/``+`` marks, which the Jinja lexer
    treats exactly like the tag it replaces, so the whitespace it stripped stays stripped.
    (``generation`` renders its body unchanged; only a ``{% set %}`` inside it, scoped to
    the tag, would now be visible after it.) A ``generation`` and its ``endgeneration`` are
    deleted or replaced together, so the blocks stay balanced.
    """
    tags = list(_GENERATION_TAG.finditer(template))
    delete = [_touches_no_whitespace(template, m) for m in tags]
    opened: list[int] = []
    for i, m in enumerate(tags):        # a pair is deleted only when both of its tags can be
        if m.group(2) == "generation":
            opened.append(i)
        elif opened:
            j = opened.pop()
            delete[i] = delete[j] = delete[i] and delete[j]
        else:
            delete[i] = False
    for j in opened:
        delete[j] = False
    out, pos = [], 0
    for m, gone in zip(tags, delete, strict=True):
        out.append(template[pos:m.start()])
        if not gone:
            left, kind, right = m.groups()
            out.append(f"{{%{left} {'if true' if kind == 'generation' else 'endif'} {right}%}}")
        pos = m.end()
    out.append(template[pos:])
    return "".join(out)


def _touches_no_whitespace(template: str, tag: re.Match[str]) -> bool:
    """Whether the characters either side of ``tag`` are not whitespace (the template's ends count as not)."""
    before = template[tag.start() - 1] if tag.start() else ""
    after = template[tag.end()] if tag.end() < len(template) else ""
    return not (before.isspace() or after.isspace())


def has_generation_tags(template: str) -> bool:
    """Whether ``template`` holds a ``{% generation %}`` or ``{% endgeneration %}`` tag."""
    return _GENERATION_TAG.search(template) is not None


def render_chat(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = False,
                **variables: Any) -> str:
    """Render a chat template as transformers does (sandboxed Jinja, ``trim_blocks``,
    ``lstrip_blocks``, ``loopcontrols``, ``{% generation %}`` rendering its body), with jinja2 only.

    Raises:
        jinja2.TemplateError: the template does not compile or refuses the conversation.
    """
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, loopcontrols])
    env.filters["tojson"] = lambda x, indent=None, **_: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **variables)


def _check_same_rendering(original: str, cleaned: str, where: str) -> None:
    """Render the probe conversations with both templates; raise when any renders differently.

    A probe the original template refuses (one that wants other roles) is skipped.
    """
    import jinja2

    for messages, prompt in _PROBES:
        try:
            expected = render_chat(original, messages, prompt)
        except jinja2.TemplateError:
            continue
        try:
            got = render_chat(cleaned, messages, prompt)
        except jinja2.TemplateError as e:
            raise ExportError(f"{where}: the chat template without generation tags fails ({e})") from e
        if got != expected:
            raise ExportError(f"{where}: the chat template renders differently without its generation tags; "
                              "export refused (report this template to the operators)")


def _clean_template(template: str, where: str) -> str:
    cleaned = strip_generation_tags(template)
    if cleaned != template:
        _check_same_rendering(template, cleaned, where)
    return cleaned


def _clean_tokenizer_config(config: dict[str, Any], where: str) -> dict[str, Any]:
    """The tokenizer config with its ``chat_template`` (a string, or a list of named templates)
    cleaned, and transformers 5's class name ``TokenizersBackend`` replaced by
    ``PreTrainedTokenizerFast``: transformers 4 (which a serving stack may pin) knows only the
    latter, and transformers 5 loads it as the same tokenizer."""
    config = dict(config)
    template = config.get("chat_template")
    if isinstance(template, str):
        config["chat_template"] = _clean_template(template, where)
    elif isinstance(template, list):
        config["chat_template"] = [
            {**t, "template": _clean_template(t["template"], f"{where} ({t.get('name')})")}
            if isinstance(t, dict) and isinstance(t.get("template"), str) else t
            for t in template
        ]
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
    return config


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """Copy the tokenizer files of ``source`` into ``target``, chat templates cleaned of
    generation tags; return the names copied.

    Raises:
        ExportError: a file is unreadable or not what its name says, or a cleaned template
            would render differently.
    """
    copied = []
    for name in TOKENIZER_FILES:
        src = source / name
        if not src.is_file():
            continue
        try:
            if name == CHAT_TEMPLATE:
                text = _clean_template(src.read_text(encoding="utf-8"), str(src))
                (target / name).write_text(text, encoding="utf-8")
            elif name == TOKENIZER_CONFIG:
                config = _clean_tokenizer_config(_read_json(src), str(src))
                (target / name).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                           encoding="utf-8")
            else:
                shutil.copyfile(src, target / name)
        except (OSError, UnicodeDecodeError) as e:
            raise ExportError(f"{src}: cannot copy ({e})") from e
        copied.append(name)
    return copied


# ----------------------------------------------------------------- writing


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not readable JSON ({e})") from e
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not a JSON object")
    return data


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(directory)


@contextlib.contextmanager
def _staged(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temp directory next to ``out``; when the block ends without error, it becomes ``out``.

    Raises:
        ExportError: ``out`` is a file, or a non-empty directory and ``force`` is false, or
            writing fails (an OSError in the block included: disk full, no permission).
    """
    out = Path(out)
    if out.is_file() or out.is_symlink():
        raise ExportError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"{out} exists and is not empty: choose another output directory or pass --force")
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o755)
        yield tmp
        _fsync_tree(tmp)
        if out.is_dir() and any(out.iterdir()):   # --force: move the old one aside, then rename the new one in
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)   # over an empty directory, or a new name
        fsync_dir(out.parent)
    except OSError as e:
        raise ExportError(f"cannot write {out}: {e.strerror or e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _require_adapter(adapter_dir: Path) -> None:
    for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
        if not (adapter_dir / name).is_file():
            raise ExportError(f"{adapter_dir} has no {name}: not a published adapter directory "
                              "(`finetune artifacts download JOB_ID --extract` unpacks one)")


# ----------------------------------------------------------------- vLLM / LoRAX


def vllm_adapter(adapter_dir: Path, base_name: str, out: Path, force: bool = False) -> Path:
    """Write the adapter as vLLM (``--lora-modules NAME=DIR``) and LoRAX load it; return ``out``.

    ``out`` holds ``adapter_model.safetensors`` (copied as published), ``adapter_config.json``
    (the adapter's, with ``base_model_name_or_path`` set to the catalog name ``base_name`` and
    ``inference_mode`` true) and the adapter directory's tokenizer files, chat templates
    without generation tags (:func:`copy_tokenizer`). Written atomically; an existing
    non-empty ``out`` is replaced only with ``force``. Check the result with :func:`vllm_problems`.

    Raises:
        ExportError: ``adapter_dir`` lacks the adapter files, ``out`` exists, or a template
            would render differently once cleaned.
    """
    adapter_dir = Path(adapter_dir)
    _require_adapter(adapter_dir)
    config = {**_read_json(adapter_dir / ADAPTER_CONFIG), "base_model_name_or_path": base_name,
              "inference_mode": True}
    with _staged(Path(out), force) as tmp:
        shutil.copyfile(adapter_dir / ADAPTER_WEIGHTS, tmp / ADAPTER_WEIGHTS)
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        copy_tokenizer(adapter_dir, tmp)
    return Path(out)


def vllm_rank(r: int) -> int | None:
    """The smallest ``--max-lora-rank`` vLLM accepts that serves rank ``r``; None past 512."""
    return next((v for v in VLLM_MAX_LORA_RANKS if v >= r), None)


def vllm_problems(adapter_dir: Path, max_lora_rank: int = DEFAULT_MAX_LORA_RANK) -> list[str]:
    """What would stop vLLM's LoRA loader from serving ``adapter_dir``, as readable messages (empty: OK).

    The checks vLLM makes (``PEFTHelper.from_local_dir``/``validate_legal`` and
    ``parse_fine_tuned_lora_name`` in ``vllm/lora``): ``adapter_config.json`` is JSON with
    ``peft_type`` "LORA", an integer ``r`` of at most ``max_lora_rank`` (vLLM's
    ``--max-lora-rank``: one of :data:`VLLM_MAX_LORA_RANKS`, 1 to 512, its default 16; here
    :data:`DEFAULT_MAX_LORA_RANK`), ``lora_alpha``, non-empty ``target_modules``, ``bias``
    "none", no ``modules_to_save`` (vLLM does not load them) and no DoRA; and
    ``adapter_model.safetensors`` holds only ``...lora_A.weight``/``...lora_B.weight`` tensors
    (or ``lora_embedding_A/B``), in pairs, shaped ``(r, in)`` and ``(out, r)``. vLLM is not
    installed here: this reads the files only; vLLM itself never ran on them.

    Raises:
        ValueError: ``max_lora_rank`` is not a value vLLM accepts.
    """
    if max_lora_rank not in VLLM_MAX_LORA_RANKS:
        raise ValueError(f"max_lora_rank {max_lora_rank}: vLLM accepts only "
                         f"{', '.join(map(str, VLLM_MAX_LORA_RANKS))}")
    adapter_dir = Path(adapter_dir)
    try:
        config = _read_json(adapter_dir / ADAPTER_CONFIG)
    except ExportError as e:
        problems, r = [str(e)], None
    else:
        problems, r = _config_problems(config, max_lora_rank)
    return problems + _weight_problems(adapter_dir / ADAPTER_WEIGHTS, r)


def _config_problems(config: dict[str, Any], max_lora_rank: int) -> tuple[list[str], int | None]:
    """(problems, r when it is a usable integer) of one adapter_config.json."""
    problems = []
    if config.get("peft_type") != "LORA":
        problems.append(f"peft_type is {config.get('peft_type')!r}: vLLM serves LoRA adapters only "
                        '(peft_type "LORA")')
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        problems.append(f"r is {r!r}: vLLM needs the LoRA rank as a positive integer")
        r = None
    elif r > max_lora_rank:
        fits = vllm_rank(r)
        problems.append(f"LoRA rank r={r} is greater than --max-lora-rank {max_lora_rank}: "
                        + (f"start vLLM with --max-lora-rank {fits}" if fits else
                           f"vLLM serves ranks up to {VLLM_MAX_LORA_RANKS[-1]}; export --format merged"))
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        problems.append(f"lora_alpha is {alpha!r}: vLLM needs it (a number) to scale the adapter")
    if not config.get("target_modules"):
        problems.append("target_modules is empty: vLLM needs the modules the adapter applies to")
    if config.get("bias", "none") != "none":
        problems.append(f"bias is {config['bias']!r}: vLLM refuses adapter biases (\"Adapter bias cannot be "
                        'used without bias_enabled"); it needs bias "none"')
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save is {config['modules_to_save']!r}: vLLM does not load them "
                        "(\"vLLM only supports modules_to_save being None\"); export --format merged")
    if config.get("use_dora"):
        problems.append("use_dora is true: vLLM does not support DoRA; export --format merged")
    return problems, r


def safetensors_header(path: Path) -> dict[str, Any]:
    """The tensor table of a safetensors file (name -> dtype, shape, offsets), read without torch.

    Raises:
        ExportError: the file is missing, unreadable or not safetensors.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ExportError(f"{path} is not a safetensors file (shorter than 8 bytes)")
            (size,) = struct.unpack("<Q", head)
            if size > 100 << 20:
                raise ExportError(f"{path} is not a safetensors file (header of {size} bytes)")
            header = json.loads(f.read(size))
    except FileNotFoundError:
        raise ExportError(f"{path.name} is missing: vLLM loads the LoRA weights from it") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{path} is not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise ExportError(f"{path} is not a safetensors file (its header is not a table)")
    return {k: v for k, v in header.items() if k != "__metadata__"}


def _lora_part(name: str) -> tuple[str, str] | None:
    """(module, "A" or "B") of a tensor name vLLM's parser accepts, else None."""
    for suffix, part in ((".lora_A.weight", "A"), (".lora_B.weight", "B"),
                         (".lora_embedding_A", "A"), (".lora_embedding_B", "B")):
        if name.endswith(suffix):
            return name.removesuffix(suffix), part
    return None


def _weight_problems(path: Path, r: int | None) -> list[str]:
    """Problems of the adapter's tensors: names vLLM parses, A/B pairs, shapes consistent with ``r``."""
    try:
        tensors = safetensors_header(path)
    except ExportError as e:
        return [str(e)]
    if not tensors:
        return [f"{path.name} holds no tensors"]
    problems: list[str] = []
    parts: dict[str, dict[str, str]] = {}
    unparsed = [n for n in tensors if _lora_part(n) is None]
    if unparsed:
        problems.append(f"{path.name}: {len(unparsed)} tensor(s) vLLM cannot load (\"is unsupported LoRA "
                        f"weight\"; it loads ...lora_A.weight / ...lora_B.weight only), e.g. {unparsed[:3]}")
    for name, info in tensors.items():
        found = _lora_part(name)
        if found is None:
            continue
        parts.setdefault(found[0], {})[found[1]] = name
        shape = info.get("shape") if isinstance(info, dict) else None
        rank = (shape[0] if found[1] == "A" else shape[-1]) if isinstance(shape, list) and len(shape) == 2 else None
        if rank is None:
            problems.append(f"{name} has shape {shape}: a LoRA weight is a matrix")
        elif r is not None and rank != r:
            problems.append(f"{name} has shape {shape}: rank {rank}, but adapter_config.json says r={r} "
                            "(rank_pattern is not supported by these checks)")
    for module, got in sorted(parts.items()):
        if set(got) != {"A", "B"}:
            have = next(iter(got))
            problems.append(f"{module} has lora_{have} but no lora_{'B' if have == 'A' else 'A'}")
    return problems


# ----------------------------------------------------------------- merged


def _torch_dtype(name: str) -> Any:
    import torch  # lazy: torch

    if name not in DTYPES:
        raise ExportError(f"dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return getattr(torch, name)


def dequantize_linear4bit(model: Any) -> int:
    """Replace every bitsandbytes ``Linear4bit`` of ``model`` by a float32 ``nn.Linear`` holding
    its dequantized weight (``bitsandbytes.functional.dequantize_4bit`` with the layer's
    ``quant_state``), and drop the model's quantization config. Returns the layers replaced.

    float32 holds the dequantized values exactly (NF4 code x absmax, computed in float32 on
    the CPU); a narrower dtype is applied once, after the merge.
    """
    import bitsandbytes as bnb  # lazy: bitsandbytes
    import torch  # lazy: torch

    replaced = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        packed = module.weight          # bnb's Params4bit: the packed 4-bit data and its quant_state
        weight = bnb.functional.dequantize_4bit(packed.data, packed.quant_state)  # type: ignore[attr-defined]
        plain = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                                device="meta")
        plain.weight = torch.nn.Parameter(weight.to(torch.float32), requires_grad=False)
        if module.bias is not None:
            plain.bias = torch.nn.Parameter(module.bias.data.to(torch.float32), requires_grad=False)
        model.set_submodule(name, plain)
        replaced += 1
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)   # hf_quantizer, config.quantization_config, is_quantized
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return replaced


def merged_model(base_path: Path, adapter_dir: Path, out: Path, dtype: str = "bfloat16",
                 force: bool = False) -> Path:
    """Write the base model with the adapter merged in, as plain transformers loads it; return ``out``.

    The base is loaded as training loaded it (:func:`trainer.model.load_base_model`: 4-bit
    NF4 on the CPU), its 4-bit layers dequantized (:func:`dequantize_linear4bit`), the
    adapter applied with peft and merged (``merge_and_unload``) in float32, then the model
    is cast to ``dtype`` (one rounding) and saved as safetensors with no quantization_config,
    beside the tokenizer files (of the adapter directory, else of the base; chat templates
    without generation tags). Peak memory is about 4 bytes per parameter plus the 4-bit copy.
    (A job trained on CUDA computed with these NF4 values rounded to bfloat16; a bfloat16
    export rounds the merged weights once, to the same precision.)
    Written atomically; an existing non-empty ``out`` is replaced only with ``force``.

    Raises:
        ExportError: missing adapter files, an unknown ``dtype``, ``out`` exists, or the
            saved config still names a quantization.
    """
    from peft import PeftModel  # lazy: peft


    adapter_dir, base_path = Path(adapter_dir), Path(base_path)
    _require_adapter(adapter_dir)
    target = _torch_dtype(dtype)
    model = load_base_model(base_path, "cpu")
    if not dequantize_linear4bit(model):
        raise ExportError(f"{base_path}: no 4-bit layer after loading in 4-bit; nothing matches training")
    merged = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    merged = merged.to(target)
    merged.config.dtype = target
    tokenizer_source = adapter_dir if (adapter_dir / TOKENIZER_CONFIG).is_file() else base_path
    with _staged(Path(out), force) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        if "quantization_config" in _read_json(tmp / "config.json"):
            raise ExportError("the merged model's config.json still carries a quantization_config")
        copy_tokenizer(tokenizer_source, tmp)
    return Path(out)
