"""Onboarding a tenant: its unix user and group, its Slurm account, its storage root.

``TenantAdmin`` is the Slurm ``Admin`` (gateway.slurm.admin: every sacctmgr command line)
plus what a tenant is outside Slurm: a unix user this project made (recorded in
``gateway.storage.identities``) that owns the tenant root (``gateway.storage.layout``).
It sits in gateway.storage, above gateway.slurm, so the Slurm adapter imports no storage.
Everything is idempotent: running ``add_tenant`` twice changes nothing the second time,
and a partially onboarded tenant is completed by running it again. Deletion's parts are here too
(``unix_user``, ``node_leftovers``, ``remove_unix_user``; the account: ``Admin.remove_account``);
``gateway.services.tenantdelete`` puts them in order.
"""

from __future__ import annotations

import grp
import os
import pwd
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.slurm import jobcontainer
from gateway.slurm.admin import Account, Admin
from gateway.slurm.runner import Runner
from gateway.storage import create_tenant_root, erase, identities, quota, safefs
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


@dataclass(frozen=True)
class UnixUser:
    """A tenant's unix user as its deletion sees it: ``ours`` when the registry holds it with these
    ids (only then is it removed); ``note`` says why it is left alone otherwise."""
    name: str
    uid: int | None
    gid: int | None
    exists: bool
    ours: bool
    note: str = ""


@dataclass(frozen=True)
class NodePlaces:
    """Where a job leaves files on a node outside its tenant's storage: the scrubber's scratch root,
    job_container's BasePaths (a job's private /tmp), and the shared temp dirs its epilog clears."""
    scratch_root: Path
    job_tmp_bases: tuple[Path, ...]
    tmp_dirs: tuple[Path, ...]


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
        # ids a deleted tenant's user had are never handed out again (``identities.retired_path``): its
        # Slurm job records and any file it left somewhere still carry them
        retired = identities.read(identities.retired_path(self.registry))
        avoid = {i for e in retired.values() for i in (e.uid, e.gid)}
        uids = {p.pw_uid for p in pwd.getpwall()} if avoid else set()
        if gr is None:
            pick = ["--gid", str(identities.free_system_id(avoid | uids | {g.gr_gid for g in grp.getgrall()}))] \
                if avoid else []
            self.runner.run(["groupadd", "--system", *pick, user]).check()
        elif gr.gr_mem or gr.gr_gid in reserved_gids or gr.gr_gid <= identities.STATIC_UID_MAX \
                or any(p.pw_gid == gr.gr_gid for p in pwd.getpwall()):
            raise IdentityRefused(
                f"refusing tenant {name!r}: group {user} (gid {gr.gr_gid}) already exists and is in use "
                "(it has members, is an account's primary group or a reserved gid): `tenant add` never "
                f"adopts a group it did not create. Choose another tenant name, or remove {user}.")
        pick = []
        if avoid:
            gid = grp.getgrnam(user).gr_gid
            pick = ["--uid", str(gid if gid not in uids | avoid else identities.free_system_id(uids | avoid))]
        self.runner.run(["useradd", "--system", *pick, "--gid", user, "--home-dir", str(home),
                         "--no-create-home", "--shell", identities.TENANT_SHELL, user]).check()
        pw = pwd.getpwnam(user)
        identities.record(identities.Entry(user, pw.pw_uid, pw.pw_gid), self.registry)
        return pw.pw_uid, pw.pw_gid

    # ------------------------------------------------- deleting a tenant
    def unix_user(self, name: str) -> UnixUser:
        """Tenant ``name``'s unix user as deletion sees it: whether it exists and whether this project
        made it (the registry holds it with its current uid and gid), which alone lets deletion remove
        it. RegistryError when the registry is unsafe to trust."""
        user = unix_user_for(name)
        pw, entry = _getpw(user), identities.read(self.registry).get(user)
        if pw is None:
            return UnixUser(user, entry.uid if entry else None, entry.gid if entry else None, exists=False,
                            ours=entry is not None, note="no such unix user")
        ours = entry is not None and (entry.uid, entry.gid) == (pw.pw_uid, pw.pw_gid) and pw.pw_uid != 0
        note = "" if ours else (f"not made by slurm-finetune (not in {self.registry} with uid {pw.pw_uid}): "
                                "left as it is")
        return UnixUser(user, pw.pw_uid, pw.pw_gid, exists=True, ours=ours, note=note)

    def node_leftovers(self, user: UnixUser, slurm_job_ids: Sequence[int], places: NodePlaces) -> list[Path]:
        """What the tenant's jobs may have left on this host outside its storage root: each job's
        scratch dir (``<scratch_root>/job-<id>``, the scrubber's) and private /tmp (``<BasePath>/<id>``,
        job_container's) that still exist, and every entry directly in the scratch root and the shared
        temp dirs owned by the tenant's uid (what the epilog removes after a job)."""
        found: list[Path] = []
        for sid in sorted(set(slurm_job_ids)):
            found += [p for p in (places.scratch_root / f"job-{int(sid)}",
                                  *(jobcontainer.job_tmp_dir(b, int(sid)) for b in places.job_tmp_bases))
                      if os.path.lexists(p)]
        if user.uid is not None and user.uid != 0:
            for top in (places.scratch_root, *places.tmp_dirs):
                found += erase.owned_entries(top, user.uid)
        return sorted(set(found))

    def remove_unix_user(self, name: str) -> UnixUser:
        """Remove tenant ``name``'s unix user and its group, only when this project made it
        (``unix_user``), and move its registry line to the retired list (its ids are never given to
        another tenant). Returns what it found; a user that is not ours is left as it is. Raises
        SlurmCommandError with userdel's text (e.g. the user still runs processes)."""
        found = self.unix_user(name)
        if not found.ours:
            return found
        if found.exists:
            self.runner.run(["userdel", found.name]).check()
            try:
                gr = grp.getgrnam(found.name)
            except KeyError:
                gr = None
            if gr is not None and gr.gr_gid == found.gid and not gr.gr_mem:
                self.runner.run(["groupdel", found.name]).check()
        if found.uid is not None and found.gid is not None:
            identities.retire(identities.Entry(found.name, found.uid, found.gid), self.registry)
        identities.forget(found.name, self.registry)
        return found

