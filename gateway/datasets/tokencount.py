"""Token counting with a catalog base model's own tokenizer and chat template."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


# Normalizers that never make text longer in bytes (so tokens <= bytes + prefixes holds).
_SAFE_NORMALIZERS = ("NFC", "Lowercase", "Strip", "Prepend", "Replace", "Sequence", "StripAccents")


class HFTokenCounter:
    """Counts tokens in batches with a Hugging Face fast tokenizer (no torch needed).

    ``bound`` gives a proven upper bound without tokenizing: every token of a
    byte-level BPE or byte-fallback tokenizer covers at least one byte of text, or is
    one of the template's markers. The per-role marker cost is measured once from the
    model's own chat template with empty contents; 2 tokens per message of slack cover
    prefix-space tokens. Tokenizers whose normalizer may lengthen text get no bound
    (every example is then counted exactly).
    """

    def __init__(self, model_dir: Path, name: str):
        from transformers import AutoTokenizer  # lazy: the tokenizer library, only when a model's file is validated

        self.name = name
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self._overhead = self._calibrate()

    def _exact(self, conv: list[dict[str, Any]]) -> int:
        text = self.tok.apply_chat_template(conv, tokenize=False)
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def _calibrate(self) -> dict[str, int] | None:
        norm = self.tok.backend_tokenizer.normalizer
        if norm is not None and not all(n in _SAFE_NORMALIZERS for n in _names(norm)):
            log.info("%s: normalizer %r may lengthen text: exact token counts only", self.name, norm)
            return None
        try:
            base = self._exact([{"role": "user", "content": ""}])
            over = {"user": base,
                    "assistant": self._exact([{"role": "user", "content": ""},
                                              {"role": "assistant", "content": ""}]) - base,
                    "system": self._exact([{"role": "system", "content": ""},
                                           {"role": "user", "content": ""}]) - base}
        except Exception as e:  # a template that refuses these shapes: no bound
            log.info("%s: chat template not calibratable (%s): exact token counts only", self.name, e)
            return None
        return {role: max(0, n) + 2 for role, n in over.items()}

    def bound(self, messages: list[dict[str, Any]]) -> int | None:
        """An upper bound on the example's tokens from its content bytes; None when this tokenizer has
        none, or the example calls tools (its calls and tool turns are counted exactly)."""
        if self._overhead is None:
            return None
        o = self._overhead
        if any(m["role"] not in o or "tool_calls" in m for m in messages):
            return None
        return 8 + sum(len(m["content"].encode()) + o[m["role"]] for m in messages)

    def count(self, conversations: Sequence[list[dict[str, Any]]],
              tools: Sequence[list[dict[str, Any]] | None] | None = None) -> list[tuple[int, int]]:
        """(total tokens, assistant tokens) per conversation (``tools``: each one's function schemas,
        or None); those without tools are rendered in one batch, each with tools alone (the
        template takes one ``tools=`` per call). An assistant's tokens are its content's and its
        calls' (name and arguments as JSON)."""
        convs = list(conversations)
        schemas = list(tools) if tools is not None else [None] * len(convs)
        plain = [i for i, t in enumerate(schemas) if not t]
        texts: list[str] = [""] * len(convs)
        if plain:
            for i, text in zip(plain, self.tok.apply_chat_template([convs[i] for i in plain], tokenize=False),
                               strict=True):
                texts[i] = text
        for i, t in enumerate(schemas):
            if t:
                texts[i] = str(self.tok.apply_chat_template(convs[i], tools=list(t), tokenize=False))
        backend = self.tok.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets: faster
        totals = [len(e.ids) for e in encode(texts, add_special_tokens=False)]
        owners, contents = [], []
        for i, c in enumerate(convs):
            for m in c:
                if m["role"] == "assistant":
                    owners.append(i)
                    contents.append(m["content"] + "".join(
                        json.dumps({"name": call["function"]["name"], "arguments": call["function"]["arguments"]})
                        for call in m.get("tool_calls", ())))
        assistant = [0] * len(convs)
        if contents:
            for i, e in zip(owners, encode(contents, add_special_tokens=False), strict=True):
                assistant[i] += len(e.ids)
        return list(zip(totals, assistant, strict=True))


def _names(normalizer: Any) -> list[str]:
    """Class names of a (possibly nested Sequence) normalizer, from its repr."""
    return re.findall(r"([A-Za-z]+)\(", repr(normalizer))


@lru_cache(maxsize=8)
def _load(model_dir: str, name: str) -> HFTokenCounter:
    return HFTokenCounter(Path(model_dir), name)


def counter_for(models_root: Path, name: str | None) -> HFTokenCounter | None:
    """The counter of catalog model ``name``; None when there is no such model or no
    tokenizer library (the report then says token checks were skipped)."""
    if not name:
        return None
    try:
        from trainer import catalog  # lazy: the trainer side (catalog), read per validated upload

        entry = next((e for e in catalog.list_models(models_root) if e.name == name), None)
        if entry is None:
            return None
        return _load(str(models_root / entry.path), name)
    except ImportError as e:
        log.warning("token counting unavailable: %s", e)
        return None
