"""Publication of a finished attempt: the gateway's side of it.

The staging dir of the job's current attempt must carry COMPLETE, its manifest must
match the attempt and every file's sha256, and the eval gate must pass. Verifying
and packaging happen inside tenant storage, as the tenant (storage verb
``publish_build``, which builds the results in a hidden ``.pub-*`` dir); then, in
one transaction guarded by the job row's version, the gateway adds the file rows,
marks the job succeeded and has the dir renamed into place (``publish_commit``). If
the transaction loses (a cancel came first), the dir is removed: no partial
artifact is ever visible. What the broker returns was computed from tenant-written
bytes, so it is checked here before it reaches the database.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.storage.layout import MAX_CHECKPOINTS, RESULT_NAMES, LayoutError, checkpoint_result

_SHA = re.compile(r"^[0-9a-f]{64}$")


class PublishError(Exception):
    """The attempt cannot be published; the message says why (shown to the tenant)."""


def _loss(evaluation: dict[str, Any], when: str) -> Any:
    v = evaluation.get(when)
    return v.get("loss") if isinstance(v, dict) else None


def eval_gate(evaluation: dict[str, Any], mode: str, tolerance: float) -> str | None:
    """None if the adapter may be published, else why not."""
    if mode == "off":
        return None
    before, after = _loss(evaluation, "before"), _loss(evaluation, "after")
    if not isinstance(before, int | float) or not isinstance(after, int | float):
        return "the evaluation has no before/after loss"
    if after > before * (1 + tolerance):
        return (f"eval gate: final eval loss {after:.4f} is worse than the base model's {before:.4f}; "
                "the adapter was not published (lower the learning rate or add data)")
    return None


def check_results(results: Any, checkpoints: Any = (), *, main: bool = True) -> dict[str, tuple[int, str]]:
    """The broker's ``{name: [bytes, sha256]}`` for exactly the result files (``main``: a succeeded
    job's; without, a job that ended unpublished has its checkpoints only) and the adapters of
    ``checkpoints`` (the steps it says it packed), checked."""
    if not isinstance(checkpoints, list | tuple) or len(checkpoints) > MAX_CHECKPOINTS:
        raise PublishError("the published checkpoints are invalid")
    try:
        names = list(RESULT_NAMES if main else ()) + [checkpoint_result(n) for n in checkpoints]
    except LayoutError:
        raise PublishError("the published checkpoints are invalid") from None
    if not isinstance(results, dict) or set(results) != set(names):
        raise PublishError("the published results are incomplete")
    out = {}
    for name in names:
        v = results[name]
        if not (isinstance(v, list) and len(v) == 2 and isinstance(v[0], int) and v[0] >= 0
                and isinstance(v[1], str) and _SHA.fullmatch(v[1])):
            raise PublishError(f"invalid result record for {name}")
        out[name] = (v[0], v[1])
    return out
