"""Token counting with a catalog base model's own tokenizer and chat template."""

from __future__ import annotations

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
        """An upper bound on the example's tokens from its content bytes; None when this tokenizer has none."""
        if self._overhead is None:
            return None
        o = self._overhead
        return 8 + sum(len(m["content"].encode()) + o[m["role"]] for m in messages)

    def count(self, conversations: Sequence[list[dict[str, Any]]]) -> list[tuple[int, int]]:
        """(total tokens, assistant content tokens) per conversation, each batch tokenized at once."""
        convs = [[{"role": m["role"], "content": m["content"]} for m in c] for c in conversations]
        texts = self.tok.apply_chat_template(convs, tokenize=False)
        backend = self.tok.backend_tokenizer
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # no offsets: faster
        totals = [len(e.ids) for e in encode(list(texts), add_special_tokens=False)]
        owners, contents = [], []
        for i, c in enumerate(convs):
            for m in c:
                if m["role"] == "assistant":
                    owners.append(i)
                    contents.append(m["content"])
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
