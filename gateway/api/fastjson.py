"""A JSON response encoded by msgspec, for the hot read routes.

Returning a Response skips FastAPI's jsonable_encoder walk over the body, the larger
part of a metadata request's cost; the bodies are plain JSON values already.
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

_ENCODE = msgspec.json.Encoder().encode


class FastJSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        """``content`` encoded by msgspec (no jsonable_encoder pass)."""
        return _ENCODE(content)
