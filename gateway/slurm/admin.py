"""Cluster-side administration: QOS tiers and tenant onboarding.

Everything here is idempotent: running ``add`` twice changes nothing the second
time, and a partially onboarded tenant is completed by running it again.
"""

from __future__ import annotations

import grp
import pwd
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gateway.slurm.policy import QOS_SHOW_FORMAT, QosChange, QosRow, QosTier, diff_qos, parse_qos_show
from gateway.slurm.records import gpu_count
from gateway.slurm.runner import CommandResult, Runner, SlurmCommandError
from gateway.slurm.validate import validate_qos_name, validate_tenant_name
from gateway.storage import identities
from gateway.storage.layout import tenant_root, unix_user_for

ORGANIZATION = "slurm-finetune"
_QUIET_NOOPS = ("Nothing new added", "Nothing modified", "Nothing to modify")
_UNIX_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
OPERATOR_LEVELS = ("Operator", "Administrator")


@dataclass(frozen=True)
class Tenant:
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


def _valid_unix_user(user: str) -> str:
    if not isinstance(user, str) or not _UNIX_USER.fullmatch(user):
        raise ValueError(f"not a unix user name: {user!r}")
    return user


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


class Admin:
    """sacctmgr / useradd operations for QOS tiers and tenants. ``service_user``: the gateway's own
    unix user, never a tenant's; ``registry``: the record of the users ``add_tenant`` made
    (``gateway.storage.identities``)."""

    def __init__(self, runner: Runner, *, storage_root: Path, parent_account: str = "finetune",
                 service_user: str = "sft-gateway", registry: Path = identities.TENANT_USERS):
        self.runner = runner
        self.storage_root = storage_root
        self.parent = validate_tenant_name(parent_account)
        self.service_user = service_user
        self.registry = registry

    def _sacctmgr(self, *args: str) -> CommandResult:
        res = self.runner.run(["sacctmgr", "--immediate", *args], timeout=60)
        if res.returncode != 0 and any(s in res.stdout + res.stderr for s in _QUIET_NOOPS):
            return res
        return res.check()

    def _show(self, *args: str) -> list[list[str]]:
        out = self.runner.run(["sacctmgr", "--noheader", "--parsable2", "show", *args],
                              timeout=60).check().stdout
        return [line.split("|") for line in out.splitlines() if line.strip()]

    # ----------------------------------------------------------------- QOS
    def existing_qos(self) -> set[str]:
        """The names of every QOS the cluster has."""
        return {row[0] for row in self._show("qos", "format=Name")}

    def show_qos(self) -> list[QosRow]:
        """Every QOS on the cluster, typed, with the fields the policy manages."""
        out = self.runner.run(["sacctmgr", "--noheader", "--parsable2", "show", "qos",
                               "format=" + QOS_SHOW_FORMAT], timeout=60).check().stdout
        return parse_qos_show(out)

    def plan_qos(self, tiers: dict[str, QosTier]) -> list[QosChange]:
        """What ``apply_qos`` would change (a dry run): [] when the cluster matches."""
        return diff_qos(tiers, self.show_qos())

    def apply_qos_changes(self, changes: list[QosChange]) -> None:
        """Send exactly these changes to sacctmgr (only the differing fields of a modify)."""
        for c in changes:
            if c.action == "add":
                self._sacctmgr("add", "qos", c.name, *c.settings)
            else:
                self._sacctmgr("modify", "qos", "where", f"name={c.name}", "set", *c.settings)

    def apply_qos(self, tiers: dict[str, QosTier]) -> list[str]:
        """Make the cluster's QOS match ``tiers``, changing only what differs.

        Returns the names that were created.
        """
        changes = self.plan_qos(tiers)
        self.apply_qos_changes(changes)
        return [c.name for c in changes if c.action == "add"]

    # ------------------------------------------------------------- tenants
    def ensure_parent_account(self) -> None:
        """Create the parent account that every tenant account sits under, unless it exists."""
        if not self._show("account", self.parent, "format=Account"):
            self._sacctmgr("add", "account", self.parent, f"Organization={ORGANIZATION}",
                           "Description=slurm-finetune tenants")

    # ------------------------------------------------------- the gateway
    def admin_level(self, user: str) -> str | None:
        """The Slurm AdminLevel of ``user`` (None, Operator, Administrator); None when Slurm has no such user."""
        rows = self._show("user", _valid_unix_user(user), "format=User,AdminLevel")
        return next((r[1] for r in rows if len(r) == 2 and r[0] == user), None)

    def ensure_operator(self, user: str = "sft-gateway") -> bool:
        """Make the gateway's service user a Slurm Operator (idempotent; returns whether anything changed).

        With ``PrivateData=jobs,usage,users,accounts`` a regular user sees only its own jobs and
        usage; an Operator still sees every tenant's jobs (squeue, sacct), usage (sshare) and
        associations, and may cancel, hold and requeue any job: what the reconciler needs. The user
        gets an association under the parent account (sacctmgr wants one); an Administrator is left
        as it is.
        """
        level = self.admin_level(user)
        if level in OPERATOR_LEVELS:
            return False
        if level is None:
            self.ensure_parent_account()
            self._sacctmgr("add", "user", user, f"Account={self.parent}", f"DefaultAccount={self.parent}",
                           "AdminLevel=Operator")
        else:
            self._sacctmgr("modify", "user", "where", f"name={user}", "set", "AdminLevel=Operator")
        return True

    def add_tenant(self, name: str, *, shares: int, qos: Sequence[str],
                   notify: Callable[[str], None] | None = None) -> Tenant:
        """Onboard (or update) a tenant: unix user/group, Slurm account + user, storage.

        Raises InvalidNameError for a bad name or QOS before any command runs,
        SlurmCommandError (with sacctmgr's text) for an unknown QOS, IdentityRefused (before any
        account or storage exists) when its unix user would be the service user or an account
        this project did not make (``_ensure_unix_user``). ``notify`` gets notices (an account an
        earlier version made, recorded now).
        """
        validate_tenant_name(name)
        qos = [validate_qos_name(q) for q in qos]
        if not qos:
            raise ValueError("at least one QOS tier is required")
        if not isinstance(shares, int) or not 1 <= shares <= 1_000_000:
            raise ValueError(f"shares must be an integer in 1..1000000, got {shares!r}")
        missing = set(qos) - self.existing_qos()
        if missing:
            raise SlurmCommandError(["sacctmgr"], 1, f"unknown QOS {sorted(missing)}: "
                                    "apply the QOS policy first (finetune dev-cluster up)")
        user = unix_user_for(name)
        uid, gid = self._ensure_unix_user(name, user, tenant_root(self.storage_root, name), notify)
        self.ensure_parent_account()
        settings = [f"Fairshare={shares}", "QOS=" + ",".join(qos), f"DefaultQOS={qos[0]}"]
        if self._show("account", name, "format=Account"):
            self._sacctmgr("modify", "account", "where", f"name={name}", "set", *settings)
        else:
            self._sacctmgr("add", "account", name, f"Parent={self.parent}",
                           f"Organization={ORGANIZATION}", "Description=slurm-finetune tenant",
                           *settings)
        if not self._show("association", "where", f"account={name}", f"user={user}",
                          "format=User"):
            self._sacctmgr("add", "user", user, f"Account={name}", f"DefaultAccount={name}")
        self._ensure_storage(name, uid, gid)
        return self.get_tenant(name)

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

    def _ensure_storage(self, name: str, uid: int, gid: int) -> None:
        from gateway.storage import create_tenant_root

        create_tenant_root(self.storage_root, name, uid, gid)   # tenants/ 0711: not listable

    def list_tenants(self) -> list[Tenant]:
        """Every tenant: the accounts directly under the parent account (their account rows, not user rows)."""
        rows = self._show("association", "format=Account,User,ParentName,Fairshare,QOS,DefaultQOS")
        return [self._tenant_from_row(r) for r in rows
                if len(r) == 6 and r[1] == "" and r[2] == self.parent]

    def get_tenant(self, name: str) -> Tenant:
        """The tenant ``name``; KeyError when no account of that name is under the parent."""
        for t in self.list_tenants():
            if t.name == name:
                return t
        raise KeyError(f"no tenant {name!r}")

    def _tenant_from_row(self, row: list[str]) -> Tenant:
        account, _, _, shares, qos, default_qos = row
        user = unix_user_for(account)
        try:
            pw: pwd.struct_passwd | None = pwd.getpwnam(user)
        except KeyError:
            pw = None
        storage = tenant_root(self.storage_root, account)
        try:
            st = storage.stat()
            storage_ok = pw is not None and st.st_uid == pw.pw_uid and (st.st_mode & 0o777) == 0o700
        except FileNotFoundError:
            storage_ok = False
        return Tenant(
            name=account, unix_user=user, uid=pw.pw_uid if pw else None,
            shares=int(shares) if shares.isdigit() else None,
            qos=tuple(q for q in qos.split(",") if q), default_qos=default_qos or None,
            storage=storage, storage_ok=storage_ok,
        )

    # ------------------------------------------------------- tenant limits
    def modify_tenant(self, name: str, *, shares: int | None = None,
                      qos: Sequence[str] | None = None, gpu_limit: int | None = None) -> Tenant:
        """Change a tenant's Fairshare shares, allowed QOS (the first is the default) or
        GPU limit (``GrpTRES=gres/gpu=N`` on its account; ``-1`` removes the limit).

        Only the given settings change. Raises KeyError for an unknown tenant,
        ValueError for an out-of-range value, SlurmCommandError for an unknown QOS.
        """
        validate_tenant_name(name)
        settings: list[str] = []
        if shares is not None:
            if isinstance(shares, bool) or not 1 <= shares <= 1_000_000:
                raise ValueError(f"shares must be an integer in 1..1000000, got {shares!r}")
            settings.append(f"Fairshare={shares}")
        if qos is not None:
            qos = [validate_qos_name(q) for q in qos]
            if not qos:
                raise ValueError("at least one QOS tier is required")
            missing = set(qos) - self.existing_qos()
            if missing:
                raise SlurmCommandError(["sacctmgr"], 1, f"unknown QOS {sorted(missing)}: "
                                        "apply the QOS policy first (finetune admin qos apply)")
            settings += ["QOS=" + ",".join(qos), f"DefaultQOS={qos[0]}"]
        if gpu_limit is not None:
            if isinstance(gpu_limit, bool) or gpu_limit < -1:
                raise ValueError(f"gpu limit must be >= 0 (or -1 to remove it), got {gpu_limit!r}")
            settings.append(f"GrpTRES=gres/gpu={gpu_limit}")
        if not settings:
            raise ValueError("nothing to modify: give --shares, --qos or --gpu-limit")
        self.get_tenant(name)  # KeyError before any change
        # The user association inherits QOS and shares from the account (seen on 22.05),
        # so setting them on the account alone keeps that inheritance intact.
        self._sacctmgr("modify", "account", "where", f"name={name}", "set", *settings)
        return self.get_tenant(name)

    def tenant_gpu_limit(self, name: str) -> int | None:
        """The tenant account's GrpTRES GPU limit; None when it has none."""
        rows = self._show("association", "where", f"account={validate_tenant_name(name)}",
                          "format=User,GrpTRES")
        for row in rows:
            if len(row) == 2 and row[0] == "" and "gres/gpu" in row[1]:
                return gpu_count(row[1])
        return None
