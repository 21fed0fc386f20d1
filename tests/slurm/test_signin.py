"""Issue 31: people sign in with the cluster's identity, and every job names who submitted it.

Ordinary unix users and a unix group are made here; the tenant is bound to the group
(``finetune admin tenant people``). Members run the real `finetune` CLI as themselves
(``runuser``) against a real gateway process on the dev cluster: ``finetune login`` proves
them with the host's munged (no token typed), then upload, create, follow, cancel and download.
A second munged with another key makes the foreign credential.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.slurm.livegateway import FAST_HP, MODEL, LiveGateway, chat_file

pytestmark = pytest.mark.slurm
TENANT = "t-people"
FINETUNE = "/opt/slurm-finetune/venv/bin/finetune"
PYTHON = "/opt/slurm-finetune/venv/bin/python"
TAG = secrets.token_hex(3)
GROUP = f"sftg{TAG}"
MEMBERSHIP_TTL_S = 5.0   # this gateway's membership_ttl_s (SFT_MEMBERSHIP_TTL_S)
ALICE, BOB, CAROL = f"sfta{TAG}", f"sftb{TAG}", f"sftc{TAG}"    # alice and bob in GROUP, carol not
HOMES = Path("/var/tmp") / f"sft-people-{TAG}"


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def people() -> Iterator[dict[str, Path]]:
    if os.geteuid() != 0 or shutil.which("munge") is None:
        pytest.skip("needs root (useradd) and munge")
    HOMES.mkdir(mode=0o755)
    _sh("groupadd", GROUP)
    homes = {}
    try:
        for user in (ALICE, BOB, CAROL):
            home = HOMES / user
            _sh("useradd", "-M", "-d", str(home), "-s", "/bin/sh", *(["-G", GROUP] if user != CAROL else []), user)
            home.mkdir(mode=0o700)
            shutil.chown(home, user, user)
            chat_file(home / "data.jsonl", 24, seed=3)
            shutil.chown(home / "data.jsonl", user, user)
            homes[user] = home
        yield homes
    finally:
        for user in (ALICE, BOB, CAROL):
            subprocess.run(["pkill", "-u", user], capture_output=True)
            subprocess.run(["userdel", user], capture_output=True)
        subprocess.run(["groupdel", GROUP], capture_output=True)
        shutil.rmtree(HOMES, ignore_errors=True)


@pytest.fixture(scope="module")
def gw(cluster: None, people: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateway]:
    # groups re-read at most MEMBERSHIP_TTL_S old (the default is 30 s: a test need not wait that long)
    g = LiveGateway(tmp_path_factory.mktemp("signin"), (TENANT,), SFT_MEMBERSHIP_TTL_S=str(MEMBERSHIP_TTL_S))
    done = _admin(g, "admin", "tenant", "people", TENANT, "--group", GROUP)
    assert done.returncode == 0 and GROUP in done.stdout, done.stderr
    yield g
    g.stop()


def _admin(gw: LiveGateway, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([FINETUNE, *args], env=gw.env, capture_output=True, text=True, timeout=120, cwd="/")


def as_user(user: str, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI run by ``user``: a clean environment (no SFT_* variable, no token), its own home."""
    home = HOMES / user
    env = ["env", "-i", f"HOME={home}", "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"]
    return subprocess.run(["runuser", "-u", user, "--", *env, *args], capture_output=True, text=True,
                          timeout=300, cwd=home, input=stdin)


def cli(user: str, *args: str) -> str:
    done = as_user(user, FINETUNE, *args)
    assert done.returncode == 0, f"finetune {' '.join(args)} as {user}: {done.stderr}"
    return done.stdout


def saved_token(user: str) -> str:
    path = HOMES / user / ".config" / "slurm-finetune" / "credentials.json"
    assert path.stat().st_mode & 0o777 == 0o600
    return str(json.loads(path.read_text())["token"])


def credential(user: str, url: str, *, ttl: int = 60, socket: str | None = None) -> str:
    """A sign-in credential made by ``user`` the way `finetune login` makes one (optionally for
    another URL, another lifetime, or from another munged)."""
    code = ("import sys; from gateway.access import munge; "
            f"print(munge.encode(munge.login_payload({url!r}), ttl={ttl}, socket={socket!r}))")
    done = as_user(user, PYTHON, "-c", code)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def sign_in(gw: LiveGateway, cred: str) -> httpx.Response:
    return httpx.post(gw.url + "/v1/auth/munge", json={"credential": cred}, timeout=30)


def me(gw: LiveGateway, token: str) -> httpx.Response:
    return httpx.get(gw.url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30)


def _job_id(out: str) -> str:
    return str(json.loads(out)["id"])


def test_members_sign_in_with_munge_and_work_with_no_token_typed(gw: LiveGateway, tmp_path: Path) -> None:
    out = cli(ALICE, "login", "--url", gw.url)
    assert f"as {ALICE} (member of {TENANT}) via munge" in out, out
    alice = saved_token(ALICE)
    who = me(gw, alice).json()
    assert (who["person"], who["tenant"], who["via"], who["role"]) == (ALICE, TENANT, "munge", "member")
    assert who["expires_at"] and 11.9 * 3600 < who["expires_at"] - time.time() <= 12 * 3600
    cli(BOB, "login", "--url", gw.url)

    refused = as_user(CAROL, FINETUNE, "login", "--url", gw.url)
    assert refused.returncode != 0 and f"{CAROL} is in no tenant's group" in refused.stderr, refused.stderr
    assert not (HOMES / CAROL / ".config").exists()

    hp = ["--model", MODEL, "--epochs", "1", "--batch-size-tokens", str(FAST_HP["batch_size_tokens"]),
          "--max-seq-len", str(FAST_HP["max_seq_len"])]
    files = {u: json.loads(cli(u, "files", "upload", "data.jsonl", "--json"))["id"] for u in (ALICE, BOB)}
    jobs = {u: _job_id(cli(u, "jobs", "create", "--training-file", files[u], *hp, "--json")) for u in (ALICE, BOB)}
    extra = _job_id(cli(ALICE, "jobs", "create", "--training-file", files[ALICE], *hp, "--json"))
    cli(ALICE, "jobs", "cancel", extra, "--wait")
    for user in (ALICE, BOB):
        final = json.loads(cli(user, "jobs", "follow", jobs[user], "--json").strip().splitlines()[-1])
        assert final["status"] == "succeeded", final
        assert final["created_by"] == user
    out = cli(ALICE, "artifacts", "download", jobs[ALICE], "-o", "results", "--json")
    assert any((HOMES / ALICE / "results").iterdir()), out

    shown = json.loads(cli(ALICE, "jobs", "show", extra, "--json"))
    assert (shown["status"], shown["created_by"]) == ("cancelled", ALICE)
    assert json.loads(cli(ALICE, "files", "show", files[ALICE], "--json"))["created_by"] == ALICE
    entries = json.loads(cli(ALICE, "audit", "list", "--json"))["data"]
    signed = [e for e in entries if e["action"] == "token.create" and e["actor"] == f"{ALICE} via munge"]
    assert signed, [(e["action"], e["actor"]) for e in entries]
    tokens = json.loads(cli(ALICE, "tokens", "list", "--json"))["data"]
    assert any(t["kind"] == "personal" and t["name"] == f"{ALICE} via munge" for t in tokens)

    # the usage report by person: the gateway's record of who submitted each Slurm job, joined with sacct
    report = _admin(gw, "admin", "report", "usage", "--by", "person", "--account", TENANT, "--start", "-1h",
                    "--format", "json")
    assert report.returncode == 0, report.stderr
    rows = {r["key"]: r for r in json.loads(report.stdout)["rows"]}
    print("\nusage by person (GPU-s):", {k: r["gpu_seconds"] for k, r in rows.items()})
    for user in (ALICE, BOB):
        sid = json.loads(cli(user, "jobs", "show", jobs[user], "--json"))["slurm_job_id"]
        assert user in rows, rows
        sacct = _sacct_gpu_seconds(sid)
        print(f"{user}: job {sid} sacct {sacct:.0f} GPU-s")
        assert sacct > 0
    extra_sid = json.loads(cli(ALICE, "jobs", "show", extra, "--json"))["slurm_job_id"]
    want = _sacct_gpu_seconds(json.loads(cli(ALICE, "jobs", "show", jobs[ALICE], "--json"))["slurm_job_id"]) + \
        (_sacct_gpu_seconds(extra_sid) if extra_sid else 0)
    assert abs(rows[ALICE]["gpu_seconds"] - want) <= 2, (rows[ALICE], want)
    sid = json.loads(cli(BOB, "jobs", "show", jobs[BOB], "--json"))["slurm_job_id"]
    assert abs(rows[BOB]["gpu_seconds"] - _sacct_gpu_seconds(sid)) <= 2, rows[BOB]


def _sacct_gpu_seconds(slurm_id: int) -> float:
    """GPU-seconds of one job from sacct itself (its allocation times its elapsed time)."""
    out = subprocess.run(["sacct", "-j", str(slurm_id), "-X", "-n", "-P", "--duplicates", "-o",
                          "ElapsedRaw,AllocTRES"], capture_output=True, text=True, timeout=30).stdout
    total = 0.0
    for line in out.splitlines():
        elapsed, tres = line.split("|", 1)
        gpus = next((int(x.split("=")[1]) for x in tres.split(",") if x.startswith("gres/gpu=")), 0)
        total += gpus * int(elapsed or 0)
    return total


def test_a_replayed_expired_foreign_or_misbound_credential_is_refused(gw: LiveGateway, tmp_path: Path) -> None:
    cred = credential(ALICE, gw.url)
    assert sign_in(gw, cred).status_code == 200
    replay = sign_in(gw, cred)
    assert replay.status_code == 401 and "replayed" in replay.json()["error"]["message"], replay.text

    short = credential(ALICE, gw.url, ttl=1)
    time.sleep(2.5)
    expired = sign_in(gw, short)
    assert expired.status_code == 401 and "expired" in expired.json()["error"]["message"], expired.text

    elsewhere = sign_in(gw, credential(ALICE, "http://gateway.example.org:8000"))
    assert elsewhere.status_code == 401, elsewhere.text
    assert "bound to 'http://gateway.example.org:8000', not to this gateway" in elsewhere.json()["error"]["message"]

    foreign = _other_munged(tmp_path)
    try:
        other = sign_in(gw, credential(ALICE, gw.url, socket=str(foreign / "sock")))
    finally:
        subprocess.run(["runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={foreign / 'sock'}",
                        "--stop"], capture_output=True, timeout=30)
    assert other.status_code == 401 and "another key" in other.json()["error"]["message"], other.text
    for r in (replay, expired, elsewhere, other):
        print(f"\nrefused {r.status_code}: {r.json()['error']['message']}")

    bogus = as_user(CAROL, FINETUNE, "login", "--url", gw.url, "--token-stdin", stdin="sft_not-a-real-token\n")
    assert bogus.returncode != 0 and "refused this token" in bogus.stderr and "nothing was saved" in bogus.stderr
    assert not (HOMES / CAROL / ".config").exists()


def _other_munged(tmp_path: Path) -> Path:
    """A second munged on its own socket with another key: another cluster, as far as MUNGE goes."""
    d = Path("/var/tmp") / f"sft-munge-{TAG}"
    d.mkdir(mode=0o700, exist_ok=True)
    (d / "key").write_bytes(secrets.token_bytes(128))
    os.chmod(d / "key", 0o600)
    shutil.chown(d, "munge", "munge")
    shutil.chown(d / "key", "munge", "munge")
    os.chmod(d, 0o755)              # the user's client reaches the socket inside
    _sh("runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force", f"--socket={d / 'sock'}",
        f"--key-file={d / 'key'}", f"--pid-file={d / 'pid'}", f"--seed-file={d / 'seed'}", f"--log-file={d / 'log'}")
    return d


def test_a_member_removed_from_the_group_loses_access_within_the_stated_bound(gw: LiveGateway) -> None:
    """The bound: the gateway's membership_ttl_s plus its token cache (2 s); a minute at the defaults."""
    r = sign_in(gw, credential(BOB, gw.url))
    assert r.status_code == 200, r.text
    token = r.json()["token"]
    assert me(gw, token).status_code == 200
    _sh("gpasswd", "-d", BOB, GROUP)
    removed = time.monotonic()
    bound = MEMBERSHIP_TTL_S + 2.0 + 3.0        # the TTL, the token cache, polls and a loaded machine
    while me(gw, token).status_code == 200:
        assert time.monotonic() - removed < bound, f"still signed in {bound} s after leaving the group"
        time.sleep(0.25)
    print(f"\n{BOB} removed from {GROUP}: access ended after {time.monotonic() - removed:.1f} s "
          f"(membership_ttl_s {MEMBERSHIP_TTL_S:g}, bound {bound:g} s)")
    again = sign_in(gw, credential(BOB, gw.url))
    assert again.status_code == 403 and "no tenant's group" in again.json()["error"]["message"]
