"""Portal sessions in the database: the rows behind the portal's signed cookies.

The portal (``gateway/portal/session.py``) signs and checks cookies; the rows they name are
written here, like every other database write of a front end. Imports models only.
"""

from __future__ import annotations

from datetime import datetime, timedelta

import sqlalchemy as sa
from sqlmodel import Session, col

from gateway.models import PortalSession


def record_session(session: Session, *, id_hash: str, token_id: int, now: datetime, ttl_s: int) -> None:
    """Add a session row (pruning expired ones on the way) and commit, so the session exists
    before the browser follows the sign-in redirect (possibly to another worker)."""
    session.execute(sa.delete(PortalSession).where(col(PortalSession.expires_at) < now))
    session.add(PortalSession(id_hash=id_hash, token_id=token_id, created_at=now,
                              expires_at=now + timedelta(seconds=ttl_s)))
    session.commit()


def end_session(session: Session, *, id_hash: str) -> None:
    """Delete a session row: its cookie is refused from now on."""
    session.execute(sa.delete(PortalSession).where(col(PortalSession.id_hash) == id_hash))
    session.commit()
