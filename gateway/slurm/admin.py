"""Cluster-side administration: QOS tiers, the parent account, tenants' Slurm accounts.

Only sacctmgr command lines live here (and the one squeue that says whether an account still
has jobs, before it is removed); onboarding a whole tenant (its unix user and group, its storage
root, then its account through ``Admin.ensure_account``) and deleting one (``remove_account``) is
``gateway.storage.onboarding``, a layer above. Everything is idempotent: running it
twice changes nothing the second time.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.slurm.policy import QOS_SHOW_FORMAT, QosChange, QosRow, QosTier, diff_qos, parse_qos_show
from gateway.slurm.records import gpu_count
from gateway.slurm.runner import CommandResult, Runner, SlurmCommandError
from gateway.slurm.validate import validate_qos_name, validate_tenant_name

ORGANIZATION = "slurm-finetune"
_QUIET_NOOPS = ("Nothing new added", "Nothing modified", "Nothing to modify")
_UNIX_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
OPERATOR_LEVELS = ("Operator", "Administrator")


@dataclass(frozen=True)
class Account:
    """A tenant's Slurm account under the parent account: its shares and QOS tiers."""
    name: str
    shares: int | None
    qos: tuple[str, ...]
    default_qos: str | None


def _valid_unix_user(user: str) -> str:
    if not isinstance(user, str) or not _UNIX_USER.fullmatch(user):
        raise ValueError(f"not a unix user name: {user!r}")
    return user


class Admin:
    """sacctmgr operations for QOS tiers, the gateway's Operator level and tenants' accounts."""

    def __init__(self, runner: Runner, *, parent_account: str = "finetune"):
        self.runner = runner
        self.parent = validate_tenant_name(parent_account)

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

    def check_tenant(self, name: str, *, shares: int, qos: Sequence[str]) -> list[str]:
        """The validated QOS list for a tenant account, checked before anything is made.

        Raises InvalidNameError for a bad name or QOS, ValueError for no QOS or shares out of
        range, SlurmCommandError (as sacctmgr would say it) for a QOS the cluster lacks.
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
        return qos

    def ensure_account(self, name: str, *, user: str, shares: int, qos: Sequence[str]) -> None:
        """Make (or update) account ``name`` under the parent with ``shares`` and ``qos`` (the
        first is the default), and unix user ``user``'s association in it; ``check_tenant`` first."""
        self.ensure_parent_account()
        settings = [f"Fairshare={shares}", "QOS=" + ",".join(qos), f"DefaultQOS={qos[0]}"]
        if self._show("account", name, "format=Account"):
            self._sacctmgr("modify", "account", "where", f"name={name}", "set", *settings)
        else:
            self._sacctmgr("add", "account", name, f"Parent={self.parent}",
                           f"Organization={ORGANIZATION}", "Description=slurm-finetune tenant",
                           *settings)
        if not self._show("association", "where", f"account={name}", f"user={_valid_unix_user(user)}",
                          "format=User"):
            self._sacctmgr("add", "user", user, f"Account={name}", f"DefaultAccount={name}")

    def list_accounts(self) -> list[Account]:
        """Every tenant account: those directly under the parent account (account rows, not user rows)."""
        rows = self._show("association", "format=Account,User,ParentName,Fairshare,QOS,DefaultQOS")
        return [Account(name=r[0], shares=int(r[3]) if r[3].isdigit() else None,
                        qos=tuple(q for q in r[4].split(",") if q), default_qos=r[5] or None)
                for r in rows if len(r) == 6 and r[1] == "" and r[2] == self.parent]

    def get_account(self, name: str) -> Account:
        """The tenant account ``name``; KeyError when no account of that name is under the parent."""
        for a in self.list_accounts():
            if a.name == name:
                return a
        raise KeyError(f"no tenant {name!r}")

    # ------------------------------------------------------- tenant removal
    def account_jobs(self, name: str) -> list[str]:
        """The ids of every job Slurm still holds under account ``name`` (pending, running, suspended,
        completing), in ONE squeue call; [] when none (or no such account)."""
        res = self.runner.run(["squeue", "--noheader", f"--account={validate_tenant_name(name)}", "--format=%i"],
                              timeout=60).check()
        return [line.strip() for line in res.stdout.splitlines() if line.strip()]

    def account_exists(self, name: str) -> bool:
        """Whether Slurm has an account ``name`` (under any parent; deleted ones do not count)."""
        return bool(self._show("account", validate_tenant_name(name), "format=Account"))

    def remove_account(self, name: str, *, user: str) -> bool:
        """Remove tenant account ``name`` and its associations, then the Slurm user ``user`` once no
        association of it is left (a tenant's unix user belongs to its own account only). Returns
        whether the account existed; running it again changes nothing. Slurm keeps its accounting
        records of past jobs (marked deleted with the account). Raises ValueError, before any change,
        for an account that is not under the parent account; SlurmCommandError with sacctmgr's text
        (e.g. ``Job(s) active``: cancel them first)."""
        validate_tenant_name(name)
        _valid_unix_user(user)
        existed = self.account_exists(name)
        if existed:
            if name not in {a.name for a in self.list_accounts()}:
                raise ValueError(f"Slurm account {name!r} is not under {self.parent!r}: not a tenant's account, "
                                 "left alone")
            self._remove("account", "where", f"name={name}")
        if self._show("user", user, "format=User") and not self._show("association", "where", f"user={user}",
                                                                      "format=Account"):
            self._remove("user", "where", f"name={user}")
        return existed

    def _remove(self, *args: str) -> None:
        res = self.runner.run(["sacctmgr", "--immediate", "remove", *args], timeout=60)
        if res.returncode != 0 and "Nothing deleted" in res.stdout + res.stderr:
            return
        res.check()

    # ------------------------------------------------------- tenant limits
    def modify_tenant(self, name: str, *, shares: int | None = None,
                      qos: Sequence[str] | None = None, gpu_limit: int | None = None) -> Account:
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
        self.get_account(name)  # KeyError before any change
        # The user association inherits QOS and shares from the account (seen on 22.05),
        # so setting them on the account alone keeps that inheritance intact.
        self._sacctmgr("modify", "account", "where", f"name={name}", "set", *settings)
        return self.get_account(name)

    def tenant_gpu_limit(self, name: str) -> int | None:
        """The tenant account's GrpTRES GPU limit; None when it has none."""
        rows = self._show("association", "where", f"account={validate_tenant_name(name)}",
                          "format=User,GrpTRES")
        for row in rows:
            if len(row) == 2 and row[0] == "" and "gres/gpu" in row[1]:
                return gpu_count(row[1])
        return None
