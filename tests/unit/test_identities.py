"""Reserved identities: the registry of the unix users `tenant add` made, the rules the broker and
`tenant add` apply to an account, and `tenant add` refusing any account it did not make."""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.slurm.runner import CommandResult
from gateway.storage import broker, identities
from gateway.storage import onboarding as admin_mod
from gateway.storage.identities import Entry
from gateway.storage.onboarding import IdentityRefused, TenantAdmin

ME = os.geteuid()
STORAGE = Path("/srv/sft-unit")


def account(name: str, uid: int, gid: int | None = None, home: str | None = None,
            login_shell: str = "/bin/bash") -> pwd.struct_passwd:
    tenant = name.removeprefix("sft-")
    return pwd.struct_passwd((name, "x", uid, uid if gid is None else gid, "",
                              home if home is not None else f"{STORAGE}/tenants/{tenant}", login_shell))


# ------------------------------------------------------------------ the file
def test_parse_skips_what_does_not_parse_and_render_reads_back() -> None:
    text = ("# comment\n\nsft-a 990 990\nsft-b 991\nSFT-C 1 1\nsft-d -1 3\nsft-e 992 992 x\n"
            "sft-f ９ 9\nsft-a 993 993\n")
    assert identities.parse(text) == {"sft-a": Entry("sft-a", 993, 993)}
    entries = [Entry("sft-x", 980, 981), Entry("sft-y", 982, 982)]
    assert list(identities.parse(identities.render(entries)).values()) == entries


def test_record_writes_atomically_0644_and_replaces_a_name(tmp_path: Path) -> None:
    reg = tmp_path / "lib" / "tenant-users"
    assert identities.read(reg, owner=ME) == {}                       # nothing recorded yet
    identities.record(Entry("sft-a", 990, 990), reg, owner=ME)
    identities.record(Entry("sft-b", 991, 991), reg, owner=ME)
    identities.record(Entry("sft-a", 995, 995), reg, owner=ME)
    assert identities.read(reg, owner=ME) == {"sft-b": Entry("sft-b", 991, 991), "sft-a": Entry("sft-a", 995, 995)}
    st = reg.stat()
    assert stat.S_IMODE(st.st_mode) == 0o644 and st.st_uid == ME
    assert sorted(p.name for p in reg.parent.iterdir()) == ["tenant-users"]      # no temp file left
    assert reg.read_text().splitlines()[-2:] == ["sft-b 991 991", "sft-a 995 995"]


def test_an_unsafe_registry_is_refused(tmp_path: Path) -> None:
    reg = tmp_path / "tenant-users"
    identities.record(Entry("sft-a", 990, 990), reg, owner=ME)
    with pytest.raises(identities.RegistryError, match="owned by uid"):
        identities.read(reg, owner=ME + 1)                              # not the owner's file
    os.chmod(reg, 0o664)
    with pytest.raises(identities.RegistryError, match="writable only by its owner"):
        identities.read(reg, owner=ME)
    with pytest.raises(identities.RegistryError, match="writable only by its owner"):
        identities.record(Entry("sft-b", 991, 991), reg, owner=ME)       # nor written over
    reg.unlink()
    (tmp_path / "elsewhere").write_text("sft-gateway 999 999\n")
    reg.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(identities.RegistryError, match="a link"):
        identities.read(reg, owner=ME)
    reg.unlink()
    os.chmod(tmp_path, 0o777)
    try:
        with pytest.raises(identities.RegistryError, match="no one else may write"):
            identities.read(reg, owner=ME)
    finally:
        os.chmod(tmp_path, 0o700)


# ----------------------------------------------------------------- the rules
REGISTRY = {"sft-acme": Entry("sft-acme", 990, 990),
            "sft-gateway": Entry("sft-gateway", 999, 995)}          # even a registry that holds it


def refusal(pw: pwd.struct_passwd, group: str | None = None) -> str | None:
    tenant = pw.pw_name.removeprefix("sft-")
    return identities.refusal(pw, REGISTRY, home=STORAGE / "tenants" / tenant,
                              group=pw.pw_name if group is None else group,
                              reserved_uids={0, 999}, reserved_gids={0, 995})


@pytest.mark.parametrize("pw,why", [
    (account("sft-acme", 0, 990), "root's"),
    (account("sft-acme", 990, 0), "root's"),
    (account("sft-gateway", 999, 995, home="/nonexistent"), "service identity"),
    (account("sft-acme", 999, 995), "service identity"),            # the service user's uid ...
    (account("sft-acme", 990, 995), "service identity"),            # ... or its gid
    (account("sft-acme", 42, 42), "static system range"),
    (account("sft-acme", 991, 991), "was replaced"),
    (account("sft-other", 980, home="/home/sft-other"), "did not make it: it is not in"),
])
def test_refused_what_is_not_a_tenant_account(pw: pwd.struct_passwd, why: str) -> None:
    assert why in (refusal(pw) or "")


def test_a_recorded_account_or_one_an_earlier_version_made_is_accepted() -> None:
    assert refusal(account("sft-acme", 990)) is None
    assert refusal(account("sft-acme", 990, home="/elsewhere", login_shell="/bin/sh"), group="x") is None
    assert refusal(account("sft-old", 960)) is None                  # not recorded, but exactly ours


@pytest.mark.parametrize("pw,group,why", [
    (account("sft-old", 960, home="/home/sft-old"), "sft-old", "not the tenant root"),
    (account("sft-old", 960, login_shell="/usr/sbin/nologin"), "sft-old", "shell"),
    (account("sft-old", 960), "users", "primary group"),
    (account("sft-old", 1000), "sft-old", "not a system uid"),
])
def test_an_account_that_does_not_look_like_ours_is_no_legacy_one(pw: pwd.struct_passwd, group: str,
                                                                   why: str) -> None:
    assert why in (refusal(pw, group) or "")


def test_broker_tenant_identity_replies_forbidden(monkeypatch: pytest.MonkeyPatch) -> None:
    users = {"sft-gateway": account("sft-gateway", 999, 995, home="/nonexistent"),
             "sft-acme": account("sft-acme", 990), "sft-collide": account("sft-collide", 980, home="/home/x")}
    monkeypatch.setattr(broker.pwd, "getpwnam", lambda n: users[n])
    monkeypatch.setattr(broker.grp, "getgrgid", lambda g: grp.struct_group((f"g{g}", "x", g, [])))
    monkeypatch.setattr(identities, "read", lambda: REGISTRY)
    monkeypatch.setattr(broker, "RESERVED_UIDS", {0, 999})
    monkeypatch.setattr(broker, "RESERVED_GIDS", {0, 995})
    for tenant, why in (("gateway", "refusing tenant gateway: .*service identity"),
                        ("collide", "refusing tenant collide: .*did not make it")):
        with pytest.raises(broker.BrokerError, match=why) as e:
            broker.tenant_identity(tenant, STORAGE)
        assert e.value.code == "forbidden"
    assert broker.tenant_identity("acme", STORAGE).pw_uid == 990
    with pytest.raises(broker.BrokerError) as e:
        broker.tenant_identity("nobody", STORAGE)
    assert e.value.code == "no_unix_user"


# ------------------------------------------------------------- tenant add
class Accounts:
    """A host's accounts (pwd/grp stand-ins) and a runner whose groupadd/useradd change them."""

    def __init__(self) -> None:
        self.users: dict[str, pwd.struct_passwd] = {"sft-gateway": account("sft-gateway", 999, 995,
                                                                           home="/nonexistent")}
        self.groups: dict[str, grp.struct_group] = {"sft-gateway": grp.struct_group(("sft-gateway", "x", 995, []))}
        self.calls: list[tuple[str, ...]] = []
        self.next_id = 980
        self.pwd = SimpleNamespace(getpwnam=self._user, getpwall=lambda: list(self.users.values()),
                                   struct_passwd=pwd.struct_passwd)
        self.grp = SimpleNamespace(getgrnam=lambda n: self._get(self.groups, n), struct_group=grp.struct_group,
                                   getgrgid=lambda g: self._get({x.gr_gid: x for x in self.groups.values()}, g))

    @staticmethod
    def _get(d: dict[Any, Any], key: object) -> Any:
        if key not in d:
            raise KeyError(key)
        return d[key]

    def _user(self, name: str) -> pwd.struct_passwd:
        return self._get(self.users, name)  # type: ignore[no-any-return]

    def run(self, argv: Sequence[str], *, timeout: float = 60.0, input: str | None = None,
            env: object = None) -> CommandResult:
        argv = tuple(argv)
        self.calls.append(argv)
        out = ""
        if argv[0] == "groupadd":
            self.groups[argv[-1]] = grp.struct_group((argv[-1], "x", self.next_id, []))
            self.next_id += 1
        elif argv[0] == "useradd":
            name, home = argv[-1], argv[argv.index("--home-dir") + 1]
            self.users[name] = pwd.struct_passwd((name, "x", self.next_id, self.groups[name].gr_gid, "", home,
                                                  argv[argv.index("--shell") + 1]))
            self.next_id += 1
        elif argv[:5] == ("sacctmgr", "--noheader", "--parsable2", "show", "qos"):
            out = "ft-small\n"
        return CommandResult(argv, 0, out, "", 0.0)


@pytest.fixture
def host(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> tuple[Accounts, TenantAdmin]:
    acc = Accounts()
    monkeypatch.setattr(admin_mod, "pwd", acc.pwd)
    monkeypatch.setattr(admin_mod, "grp", acc.grp)
    reg = tmp_path / "tenant-users"
    real_read, real_record = identities.read, identities.record
    monkeypatch.setattr(identities, "read", lambda path=reg: real_read(path, owner=ME))
    monkeypatch.setattr(identities, "record", lambda e, path=reg: real_record(e, path, owner=ME))
    return acc, TenantAdmin(acc, storage_root=STORAGE, registry=reg)  # type: ignore[arg-type]


def ensure(adm: TenantAdmin, name: str, notices: list[str] | None = None) -> tuple[int, int]:
    return adm._ensure_unix_user(name, f"sft-{name}", STORAGE / "tenants" / name,
                                 notices.append if notices is not None else None)


def test_tenant_add_gateway_is_refused_before_any_command(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    with pytest.raises(IdentityRefused, match="sft-gateway, the gateway's own service user") as e:
        adm.add_tenant("gateway", shares=1, qos=["ft-small"])
    assert "Choose another tenant name" in str(e.value)
    assert [c for c in acc.calls if c[0] != "sacctmgr" or "show" not in c] == []   # nothing made
    assert identities.read() == {}


def test_a_new_tenant_user_is_made_and_recorded_and_again_changes_nothing(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    uid, gid = ensure(adm, "acme")
    assert [c[0] for c in acc.calls] == ["groupadd", "useradd"]
    assert identities.read() == {"sft-acme": Entry("sft-acme", uid, gid)}
    acc.calls.clear()
    assert ensure(adm, "acme") == (uid, gid)                    # idempotent: recorded, same ids
    assert acc.calls == []


def test_an_existing_account_we_did_not_make_is_refused(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    acc.users["sft-collide"] = account("sft-collide", 970, home="/home/sft-collide", login_shell="/bin/sh")
    with pytest.raises(IdentityRefused, match="sft-collide .* exists but slurm-finetune did not make "
                                              "it.*home is /home/sft-collide") as e:
        ensure(adm, "collide")
    assert "never adopts" in str(e.value)
    assert acc.calls == [] and identities.read() == {}


def test_an_account_with_the_service_users_uid_is_refused(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    acc.users["sft-alias"] = account("sft-alias", 999, 995)          # an alias of sft-gateway
    with pytest.raises(IdentityRefused, match="service identity"):
        ensure(adm, "alias")
    identities.record(Entry("sft-alias", 999, 995))                 # even if someone recorded it
    with pytest.raises(IdentityRefused, match="service identity"):
        ensure(adm, "alias")


def test_a_legacy_account_is_recorded_with_a_notice(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    acc.groups["sft-old"] = grp.struct_group(("sft-old", "x", 960, []))
    acc.users["sft-old"] = account("sft-old", 960)
    notices: list[str] = []
    assert ensure(adm, "old", notices) == (960, 960)
    assert identities.read() == {"sft-old": Entry("sft-old", 960, 960)}
    assert len(notices) == 1 and "earlier version" in notices[0] and "sft-old" in notices[0]
    assert ensure(adm, "old", notices) == (960, 960) and len(notices) == 1      # recorded: no notice again


def test_a_recorded_account_that_was_replaced_is_refused(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    ensure(adm, "acme")
    acc.users["sft-acme"] = account("sft-acme", 977)
    with pytest.raises(IdentityRefused, match="was replaced"):
        ensure(adm, "acme")


def test_a_group_in_use_is_not_adopted(host: tuple[Accounts, TenantAdmin]) -> None:
    acc, adm = host
    acc.groups["sft-busy"] = grp.struct_group(("sft-busy", "x", 950, ["alice"]))
    with pytest.raises(IdentityRefused, match="group sft-busy"):
        ensure(adm, "busy")
    acc.groups["sft-left"] = grp.struct_group(("sft-left", "x", 951, []))   # an interrupted run's group
    assert ensure(adm, "left")[1] == 951
    assert [c[0] for c in acc.calls] == ["useradd"]
