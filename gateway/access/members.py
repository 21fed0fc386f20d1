"""Who belongs to a tenant: the members of its unix group as NSS reports them, and explicit members.

A tenant bound to a group (``finetune admin tenant add NAME --group G --admin-group A``) has as
members the users whose groups (``getgrouplist``: the primary group and every supplementary one,
from local files here, from sssd/LDAP on a site, nothing to change) include G, and as admins
those whose groups include A. Sites without groups add members one by one (``TenantMember``).

A user's groups are read at sign-in and again, at most ``GROUPS.ttl_s`` old (the setting
``membership_ttl_s``, default ``MEMBERSHIP_TTL_S``; ``create_app`` sets it), whenever one of their
personal tokens is used (``gateway.access.tokens.authenticate``): a user removed from G loses access
within that bound plus the API's principal cache (2 s), well under a minute by default.
"""

from __future__ import annotations

import grp
import os
import pwd
import threading
import time

from sqlmodel import Session, col, select

from gateway.models import Role, Tenant, TenantMember

MEMBERSHIP_TTL_S = 30.0


class _GroupCache:
    """A user's group ids for ``ttl_s`` seconds (NSS lookups go to sssd/LDAP on a site)."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._data: dict[str, tuple[float, frozenset[int]]] = {}
        self._lock = threading.Lock()

    def gids(self, username: str) -> frozenset[int]:
        hit = self._data.get(username)
        if hit is not None and time.monotonic() - hit[0] <= self.ttl_s:
            return hit[1]
        try:
            pw = pwd.getpwnam(username)
            found = frozenset(os.getgrouplist(username, pw.pw_gid))
        except (KeyError, OSError):
            found = frozenset()
        with self._lock:
            if len(self._data) > 10_000:
                self._data.clear()
            self._data[username] = (time.monotonic(), found)
        return found

    def forget(self, username: str | None = None) -> None:
        with self._lock:
            if username is None:
                self._data.clear()
            else:
                self._data.pop(username, None)


GROUPS = _GroupCache(MEMBERSHIP_TTL_S)


def group_gid(name: str | None) -> int | None:
    """The gid of the unix group ``name`` (None: no such group, or no name)."""
    if not name:
        return None
    try:
        return grp.getgrnam(name).gr_gid
    except KeyError:
        return None


def explicit_member(session: Session, tenant: Tenant, username: str) -> TenantMember | None:
    """``username``'s explicit membership row in ``tenant``, if any."""
    return session.exec(select(TenantMember).where(TenantMember.tenant_id == tenant.id,
                                                   TenantMember.username == username)).first()


def role_in(session: Session, tenant: Tenant, username: str, *, fresh: bool = False) -> Role | None:
    """The role ``username`` holds in ``tenant`` now (tenant_admin, member), or None: not a member.
    ``fresh`` reads the user's groups from NSS instead of the cache (a sign-in)."""
    if fresh:
        GROUPS.forget(username)
    gids = GROUPS.gids(username)
    admin_gid, member_gid = group_gid(tenant.admin_group), group_gid(tenant.unix_group)
    row = explicit_member(session, tenant, username)
    if (admin_gid is not None and admin_gid in gids) or (row is not None and row.admin):
        return Role.TENANT_ADMIN
    if (member_gid is not None and member_gid in gids) or row is not None:
        return Role.MEMBER
    return None


def tenants_of(session: Session, username: str) -> dict[str, Role]:
    """Every tenant ``username`` belongs to now, by name, with their role there (read fresh)."""
    GROUPS.forget(username)
    tenants = session.exec(select(Tenant).order_by(col(Tenant.name))).all()
    return {t.name: role for t in tenants if (role := role_in(session, t, username)) is not None}
