"""Dataset validation throughput: ours vs a straightforward reference checker.

The peer (``reference_check``) is written in the style of the OpenAI cookbook's
"data preparation and analysis for chat model fine-tuning": load every line with
json.loads into a list, loop over examples for format errors, then count tokens
message by message (``tokenizer.encode`` per message; the cookbook uses tiktoken,
which needs a download, so both sides use the same catalog model's tokenizer).

Ours streams the file in 1 MiB blocks through ``gateway.datasets.validation`` (bounded
memory, line-numbered errors) and counts tokens in batches with the chat template.

    python bench/validate.py [--mb 200] [--token-mb 20]

Prints MB/s for each and the ratios: medians of ``--repeats`` (3) alternating runs of each side
after one warm-up run of each (not counted). Runs on one core (OMP/RAYON threads = 1).
"""

from __future__ import annotations

import os
import sys

# bench/trainer.py would shadow the trainer package: import from the repository root.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
         "november oscar papa quebec romeo sierra tango uniform victor whiskey xray").split()


def make_file(path: Path, mb: int, seed: int = 0) -> int:
    rng = random.Random(seed)
    target = mb * 1024 * 1024
    size = 0
    with open(path, "w") as f:
        while size < target:
            lines = []
            for _ in range(1000):
                msgs = []
                if rng.random() < 0.3:
                    msgs.append({"role": "system", "content": "You are a helpful assistant."})
                for _ in range(rng.randint(1, 3)):
                    msgs.append({"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(5, 40)))})
                    msgs.append({"role": "assistant",
                                 "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 80)))})
                lines.append(json.dumps({"messages": msgs}))
            chunk = "\n".join(lines) + "\n"
            f.write(chunk)
            size += len(chunk)
    return size


def reference_check(path: Path, tokenizer: Any | None) -> dict[str, Any]:
    """Cookbook-style: load all, check formats, then count tokens per message."""
    with open(path, encoding="utf-8") as f:
        dataset = [json.loads(line) for line in f]
    format_errors: dict[str, int] = defaultdict(int)
    for ex in dataset:
        if not isinstance(ex, dict):
            format_errors["data_type"] += 1
            continue
        messages = ex.get("messages", None)
        if not messages:
            format_errors["missing_messages_list"] += 1
            continue
        for message in messages:
            if "role" not in message or "content" not in message:
                format_errors["message_missing_key"] += 1
            if any(k not in ("role", "content", "name", "weight") for k in message):
                format_errors["message_unrecognized_key"] += 1
            if message.get("role", None) not in ("system", "user", "assistant"):
                format_errors["unrecognized_role"] += 1
            content = message.get("content", None)
            if not content or not isinstance(content, str):
                format_errors["missing_content"] += 1
        if not any(message.get("role", None) == "assistant" for message in messages):
            format_errors["example_missing_assistant_message"] += 1
    lengths, assistant = [], []
    if tokenizer is not None:
        for ex in dataset:
            n = 3
            for message in ex["messages"]:
                n += 3 + len(tokenizer.encode(message["content"], add_special_tokens=False))
            lengths.append(n)
            assistant.append(sum(len(tokenizer.encode(m["content"], add_special_tokens=False))
                                 for m in ex["messages"] if m["role"] == "assistant"))
    return {"examples": len(dataset), "errors": dict(format_errors), "tokens": sum(lengths)}


def ours(path: Path, counter: Any | None) -> dict[str, Any]:
    from gateway.datasets.validation import validate_stream

    def blocks():  # type: ignore[no-untyped-def]
        with open(path, "rb") as f:
            while b := f.read(1 << 20):
                yield b

    return validate_stream(blocks(), counter=counter, max_seq_len=1 << 20)


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    t = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200, help="file size without token counting")
    ap.add_argument("--token-mb", type=int, default=20, help="file size with token counting")
    ap.add_argument("--repeats", type=int, default=3, help="alternating timed runs of each side (after a warm-up)")
    args = ap.parse_args()
    from gateway.datasets.tokencount import HFTokenCounter
    from trainer import catalog

    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        model = catalog.make_tiny(tmpd / "tiny")
        counter = HFTokenCounter(model, "tiny-chat")
        for label, mb, with_tokens in (("format checks only", args.mb, False),
                                       ("with token counting", args.token_mb, True)):
            path = tmpd / f"data-{mb}.jsonl"
            size = make_file(path, mb)
            refs: list[float] = []
            ourss: list[float] = []
            for i in range(args.repeats + 1):   # run 0 is the warm-up of each side
                t_ref, ref = timed(reference_check, path, counter.tok if with_tokens else None)
                t_ours, rep = timed(ours, path, counter if with_tokens else None)
                assert rep["stats"]["examples"] == ref["examples"] and rep["ok"]
                if i:
                    refs.append(t_ref)
                    ourss.append(t_ours)
            t_ref, t_ours = statistics.median(refs), statistics.median(ourss)
            mbs = size / 1024 / 1024
            print(f"{label:<22} {mbs:7.1f} MB  {rep['stats']['examples']:>8} examples")
            print(f"  reference (cookbook style): {t_ref:7.2f} s  {mbs / t_ref:8.1f} MB/s")
            print(f"  slurm-finetune validator:   {t_ours:7.2f} s  {mbs / t_ours:8.1f} MB/s")
            print(f"  ratio ours/reference:       {t_ref / t_ours:7.2f}x  (medians of {args.repeats})")


if __name__ == "__main__":
    main()
