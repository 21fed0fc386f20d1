"""Onboarding a tenant: its unix user and group, its Slurm account, its storage root.

``TenantAdmin`` is the Slurm ``Admin`` (gateway.slurm.admin: every sacctmgr command line)
plus what a tenant is outside Slurm: a unix user this project made (recorded in
``gateway.storage.identities``) that owns the tenant root (``gateway.storage.layout``).
It sits in gateway.storage, above gateway.slurm, so the Slurm adapter imports no storage.
Everything is idempotent: running ``add_tenant`` twice changes nothing the second time,
and a partially onboarded tenant is completed by running it again.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.slurm.admin import Account, Admin
from gateway.slurm.runner import Runner
from gateway.storage import create_tenant_root, identities, quota, safefs
from gateway.storage.layout import tenant_root, unix_user_for


@dataclass(frozen=True)
class Tenant:
    """A tenant as the sysadmin sees it: Slurm account, unix user, storage root and its state."""
    name: str
    unix_user: str
    uid: int | None
    shares: int | None
    qos: tuple[str, ...]
    default_qos: str | None
    storage: Path
    storage_ok: bool


class IdentityRefused(ValueError):
    """A tenant whose unix user would be an account slurm-finetune did not make (or a reserved one)."""


def _getpw(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(user)
    except KeyError:
        return None


def _group_name(gid: int) -> str | None:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return None


class TenantAdmin(Admin):
    """Slurm administration plus tenants' unix users and storage roots. ``service_user``: the
    gateway's own unix user, never a tenant's; ``registry``: the record of the users
    ``add_tenant`` made (``gateway.storage.identities``)."""

    def __init__(self, runner: Runner, *, storage_root: Path, parent_account: str = "finetune",
                 service_user: str = "sft-gateway", registry: Path = identities.TENANT_USERS):
        super().__init__(runner, parent_account=parent_account)
        self.storage_root = storage_root
        self.service_user = service_user
        self.registry = registry

    def add_tenant(self, name: str, *, shares: int, qos: Sequence[str],
                   notify: Callable[[str], None] | None = None) -> Tenant:
        """Onboard (or update) a tenant: unix user/group, Slurm account + user, storage.

        Raises InvalidNameError for a bad name or QOS before any command runs,
        SlurmCommandError (with sacctmgr's text) for an unknown QOS, IdentityRefused (before any
        account or storage exists) when its unix user would be the service user or an account
        this project did not make (``_ensure_unix_user``). ``notify`` gets notices (an account an
        earlier version made, recorded now).
        """
        checked = self.check_tenant(name, shares=shares, qos=qos)
        user = unix_user_for(name)
        uid, gid = self._ensure_unix_user(name, user, tenant_root(self.storage_root, name), notify)
        self.ensure_account(name, user=user, shares=shares, qos=checked)
        create_tenant_root(self.storage_root, name, uid, gid)   # tenants/ 0711: not listable
        return self.get_tenant(name)

    def set_quota(self, name: str, limit_bytes: int | None) -> quota.Usage:
        """Limit tenant ``name``'s storage to ``limit_bytes`` (None: no limit) in the filesystem, and
        return its usage after. Root only. QuotaError when its root is not a subvolume on btrfs with
        quotas on (the message says why); FileNotFoundError when it has no storage root."""
        fd = os.open(tenant_root(self.storage_root, name), safefs.DIR_FLAGS)
        try:
            quota.set_limit(fd, limit_bytes)
            return quota.usage(fd)
        finally:
            os.close(fd)

    def storage_usage(self, name: str) -> quota.Usage:
        """Tenant ``name``'s storage usage and limit as the filesystem has them (root)."""
        fd = os.open(tenant_root(self.storage_root, name), safefs.DIR_FLAGS)
        try:
            return quota.usage(fd)
        finally:
            os.close(fd)

    def list_tenants(self) -> list[Tenant]:
        """Every tenant: the accounts under the parent account, with their unix user and storage state."""
        return [self._tenant(a) for a in self.list_accounts()]

    def get_tenant(self, name: str) -> Tenant:
        """The tenant ``name``; KeyError when no account of that name is under the parent."""
        return self._tenant(self.get_account(name))

    def _tenant(self, account: Account) -> Tenant:
        user = unix_user_for(account.name)
        pw = _getpw(user)
        storage = tenant_root(self.storage_root, account.name)
        try:
            st = storage.stat()
            storage_ok = pw is not None and st.st_uid == pw.pw_uid and (st.st_mode & 0o777) == 0o700
        except FileNotFoundError:
            storage_ok = False
        return Tenant(name=account.name, unix_user=user, uid=pw.pw_uid if pw else None, shares=account.shares,
                      qos=account.qos, default_qos=account.default_qos, storage=storage, storage_ok=storage_ok)

    # ------------------------------------------------- tenants' unix users
    def _reserved_ids(self) -> tuple[set[int], set[int]]:
        """(uids, gids) no tenant may have: root's and the service user's."""
        service = _getpw(self.service_user)
        return {0} | ({service.pw_uid} if service else set()), {0} | ({service.pw_gid} if service else set())

    def _ensure_unix_user(self, name: str, user: str, home: Path,
                          notify: Callable[[str], None] | None = None) -> tuple[int, int]:
        """(uid, gid) of tenant ``name``'s unix user ``user``: made (useradd) and recorded in the
        registry when missing; when it exists, only one the registry holds (idempotent) or, once, one
        an earlier version made (``identities.legacy_mismatch``: recorded, with a notice). Raises
        IdentityRefused before anything changes for the service user or any other existing account."""
        if user == self.service_user:
            raise IdentityRefused(
                f"refusing tenant {name!r}: its unix user would be {user}, the gateway's own service user "
                "(it owns the database and the audit key and may talk to the storage broker), and the "
                "tenant's jobs and files would run as it. Choose another tenant name.")
        registry = identities.read(self.registry)
        uids, gids = self._reserved_ids()
        pw = _getpw(user)
        if pw is None:
            return self._create_unix_user(name, user, home, gids)
        why = identities.refusal(pw, registry, home=home, group=_group_name(pw.pw_gid), reserved_uids=uids,
                                 reserved_gids=gids, where=self.registry)
        if why is not None:
            raise IdentityRefused(
                f"refusing tenant {name!r}: {why}. `tenant add` never adopts an account it did not create "
                "(the tenant's jobs and files would run as it). Choose another tenant name, or remove "
                f"or rename {user} if nothing uses it.")
        if user not in registry:
            identities.record(identities.Entry(user, pw.pw_uid, pw.pw_gid), self.registry)
            if notify:
                notify(f"notice: unix user {user} (uid {pw.pw_uid}) was made by an earlier version of "
                       f"slurm-finetune (home {home}): recorded it in {self.registry}")
        return pw.pw_uid, pw.pw_gid

    def _create_unix_user(self, name: str, user: str, home: Path, reserved_gids: set[int]) -> tuple[int, int]:
        """groupadd (unless a group of ours is left from an interrupted run), useradd, record."""
        try:
            gr: grp.struct_group | None = grp.getgrnam(user)
        except KeyError:
            gr = None
        if gr is None:
            self.runner.run(["groupadd", "--system", user]).check()
        elif gr.gr_mem or gr.gr_gid in reserved_gids or gr.gr_gid <= identities.STATIC_UID_MAX \
                or any(p.pw_gid == gr.gr_gid for p in pwd.getpwall()):
            raise IdentityRefused(
                f"refusing tenant {name!r}: group {user} (gid {gr.gr_gid}) already exists and is in use "
                "(it has members, is an account's primary group or a reserved gid): `tenant add` never "
                f"adopts a group it did not create. Choose another tenant name, or remove {user}.")
        self.runner.run(["useradd", "--system", "--gid", user, "--home-dir", str(home),
                         "--no-create-home", "--shell", identities.TENANT_SHELL, user]).check()
        pw = pwd.getpwnam(user)
        identities.record(identities.Entry(user, pw.pw_uid, pw.pw_gid), self.registry)
        return pw.pw_uid, pw.pw_gid

