"""Token counting with a catalog base model's own tokenizer and chat template."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class HFTokenCounter:
    """Counts tokens in batches with a Hugging Face fast tokenizer (no torch needed)."""

    def __init__(self, model_dir: Path, name: str):
        from transformers import AutoTokenizer

        self.name = name
        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

    def count(self, conversations: Sequence[list[dict[str, Any]]]) -> list[tuple[int, int]]:
        convs = [[{"role": m["role"], "content": m["content"]} for m in c] for c in conversations]
        texts = self.tok.apply_chat_template(convs, tokenize=False)
        totals = [len(ids) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]
        owners, contents = [], []
        for i, c in enumerate(convs):
            for m in c:
                if m["role"] == "assistant":
                    owners.append(i)
                    contents.append(m["content"])
        assistant = [0] * len(convs)
        if contents:
            for i, ids in zip(owners, self.tok(contents, add_special_tokens=False)["input_ids"],
                              strict=True):
                assistant[i] += len(ids)
        return list(zip(totals, assistant, strict=True))


@lru_cache(maxsize=8)
def _load(model_dir: str, name: str) -> HFTokenCounter:
    return HFTokenCounter(Path(model_dir), name)


def counter_for(models_root: Path, name: str | None) -> HFTokenCounter | None:
    """The counter of catalog model ``name``; None when there is no such model or no
    tokenizer library (the report then says token checks were skipped)."""
    if not name:
        return None
    try:
        from trainer import catalog

        entry = next((e for e in catalog.list_models(models_root) if e.name == name), None)
        if entry is None:
            return None
        return _load(str(models_root / entry.path), name)
    except ImportError as e:
        log.warning("token counting unavailable: %s", e)
        return None
