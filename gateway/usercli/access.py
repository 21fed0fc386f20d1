"""Who may do what: `login` (save the URL and token), the `tokens` group (list, mint, revoke,
rotate your tenant's tokens, claim an operator-minted admin token with its one-time code),
support staff's access requests (`staff`), a tenant admin's decisions on them (`access`)
and the tenant's audit trail (`audit`)."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import click
import httpx

from gateway.config import get_settings
from gateway.usercli.client import (
    Unreachable,
    _credentials_path,
    _echo_json,
    _raise_for_status,
    _when,
    call,
    connection,
    save_credentials,
    saved_url,
)


@click.command("login")
@click.option("--url", help="Gateway base URL, e.g. http://127.0.0.1:8000 (default: SFT_API_URL, or the "
              "URL saved by the last login)")
@click.option("--tenant", help="The tenant to sign in to, when you belong to several.")
@click.option("--token", "token", is_flag=False, flag_value="", default=None, metavar="[TOKEN]",
              help="Sign in with an API token instead of MUNGE: alone, it is read from a prompt (a value "
                   "on the command line lands in your shell history).")
@click.option("--token-stdin", is_flag=True, help="Read the API token from standard input.")
def login(url: str | None, tenant: str | None, token: str | None, token_stdin: bool) -> None:
    """Sign in and save a token (file mode 0600).

    On a cluster host (one that runs munged) no token is needed: your unix account is proved with
    MUNGE, and the gateway gives you a personal token for your tenant (12 h by default). With an
    API token (--token, --token-stdin or SFT_API_TOKEN), it is checked with the gateway
    before anything is saved.
    """
    url = (url or get_settings().api_url or saved_url() or "").rstrip("/")
    if not url:
        raise click.UsageError("which gateway? give --url URL (e.g. http://127.0.0.1:8000) or set SFT_API_URL")
    if token_stdin:
        token = sys.stdin.readline().strip()
    elif token == "":
        token = str(click.prompt("API token", hide_input=True)).strip()
    elif token is not None:
        click.echo("note: a token given on the command line is in your shell history; next time use "
                   "`--token` alone (a prompt) or `--token-stdin`", err=True)
    elif get_settings().api_token:
        token = get_settings().api_token
    if token is not None:
        me = _check(url, token)
        path = save_credentials(url, token)
        click.echo(f"signed in to {url} as {me['actor']}; saved in {path}")
        return
    done = _munge_sign_in(url, tenant)
    path = save_credentials(url, done["token"])
    until = f", until {_when(done.get('expires_at'))}" if done.get("expires_at") else ""
    click.echo(f"signed in to {url} as {done['person']} ({done['role']} of {done['tenant']}) via munge{until}; "
               f"token saved in {path}")


def _check(url: str, token: str) -> dict[str, Any]:
    """Who ``token`` is at ``url`` (GET /v1/me); ClickException, nothing saved, when it is refused."""
    try:
        r = httpx.get(url + "/v1/me", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach the gateway at {url}: {e}") from e
    if r.status_code == 401:
        raise click.ClickException("the gateway refused this token (unknown, expired or revoked): nothing was saved")
    _raise_for_status(r)
    return dict(r.json())


def _munge_sign_in(url: str, tenant: str | None) -> dict[str, Any]:
    """A personal token from the gateway for the unix user running this, proved with MUNGE."""
    from gateway.access import munge  # lazy: ctypes and libmunge only for a MUNGE sign-in

    try:
        credential = munge.encode(munge.login_payload(url, tenant))
    except munge.MungeError as e:
        raise click.ClickException(f"cannot sign in with MUNGE here: {e}. On a cluster login node `finetune login` "
                                   "needs no token; elsewhere sign in with an API token: `finetune login --token`"
                                   ) from None
    try:
        r = httpx.post(url + "/v1/auth/munge", json={"credential": credential, "tenant": tenant}, timeout=30)
    except httpx.HTTPError as e:
        raise Unreachable(f"cannot reach the gateway at {url}: {e}") from e
    _raise_for_status(r)
    return dict(r.json())


def _request_line(r: dict[str, Any]) -> str:
    expires = f"  until {_when(r['expires_at'])}" if r.get("expires_at") else ""
    return (f"{r['id']}  {r['state']:<8} {r.get('tenant') or '-':<12} {r['resource']:<40} "
            f"{r['duration_s'] // 60} min{expires}  {r['reason'][:60]}")


@click.group("staff")
def staff() -> None:
    """Support staff: ask a tenant for time-bounded access to one resource (staff/sysadmin tokens)."""


@staff.command("request")
@click.option("--tenant", required=True, help="The tenant that owns the resource.")
@click.option("--resource", required=True, metavar="job:ID|file:ID", help="Exactly one job or file.")
@click.option("--reason", required=True, help="Why you need it; the tenant's admin reads this.")
@click.option("--duration", default="2h", show_default=True,
              help="How long the grant lasts once approved (30m, 2h, 1d).")
@click.option("--json", "as_json", is_flag=True)
def staff_request(tenant: str, resource: str, reason: str, duration: str, as_json: bool) -> None:
    """Ask for access; it stays pending until the tenant's admin approves or denies it."""
    obj = call("POST", "/v1/staff/access-requests",
               json={"tenant": tenant, "resource": resource, "reason": reason, "duration": duration}).json()
    if as_json:
        _echo_json(obj)
        return
    click.echo(f"{obj['id']}: {obj['state']}; the admin of {tenant} approves it with "
               f"`finetune access approve {obj['id']}`")


def _print_requests(path: str, as_json: bool) -> None:
    page = call("GET", path).json()
    data = page["data"]
    if as_json:
        _echo_json(page)
        return
    for r in data:
        click.echo(_request_line(r))


@staff.command("list")
@click.option("--json", "as_json", is_flag=True)
def staff_list(as_json: bool) -> None:
    """Your access requests and their state now (pending, active, expired, denied, revoked)."""
    _print_requests("/v1/staff/access-requests", as_json)


@click.group("access")
def access() -> None:
    """Staff access requests for your tenant's resources (approve/deny/revoke: tenant admins)."""


@access.command("list")
@click.option("--json", "as_json", is_flag=True)
def access_list(as_json: bool) -> None:
    """Every access request for your resources, newest first."""
    _print_requests("/v1/access-requests", as_json)


def _decide(request_id: str, action: str, as_json: bool) -> None:
    obj = call("POST", f"/v1/access-requests/{request_id}/{action}").json()
    if as_json:
        _echo_json(obj)
    else:
        click.echo(_request_line(obj))


@access.command("approve")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_approve(request_id: str, as_json: bool) -> None:
    """Approve: the requester may read exactly that resource for the requested duration."""
    _decide(request_id, "approve", as_json)


@access.command("deny")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_deny(request_id: str, as_json: bool) -> None:
    """Deny a pending request."""
    _decide(request_id, "deny", as_json)


@access.command("revoke")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
def access_revoke(request_id: str, as_json: bool) -> None:
    """End an active grant now."""
    _decide(request_id, "revoke", as_json)


@click.group("audit")
def audit() -> None:
    """The audit trail of your tenant's resources."""


@audit.command("list")
@click.option("--limit", type=click.IntRange(1, 1000), default=50, show_default=True)
@click.option("--before", type=click.IntRange(1, 2**31 - 1), help="Entries older than this sequence number.")
@click.option("--json", "as_json", is_flag=True)
def audit_list(limit: int, before: int | None, as_json: bool) -> None:
    """Requests, decisions and reads by staff on your resources, newest first."""
    params: dict[str, Any] = {"limit": limit, **({"after": before} if before else {})}
    page = call("GET", "/v1/audit", params=params).json()
    data = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    for e in data:
        actor = e.get("actor") or f"{e['actor_role']}#{e['actor_token_id'] or '-'}"   # none: the local admin CLI
        click.echo(f"{e['seq']:>6}  {e['at'][:19]}Z  {actor:<28} {e['action']:<18} "
                   f"{e['resource'] or '-':<40} {e['outcome']:<7} {e['reason']}")


# ----------------------------------------------------------------------- tokens
def _token_line(t: dict[str, Any]) -> str:
    state = f"revoked {_when(t['revoked_at'])} by {t.get('revoked_by') or '?'}" if t.get("revoked_at") else "active"
    if not t.get("revoked_at") and t.get("expires_at"):
        state = f"until {_when(t['expires_at'])}"
    decides = "  decides access" if t.get("decides_access") else ""
    kind = t.get("kind", "service")
    return (f"#{t['id']:<5} {t['role']:<13} {kind:<8} {t['name'] or '-':<20} {t['prefix']}…  "
            f"created {_when(t['created_at'])}  "
            f"minted by {t['minted_by']}{' (operator)' if t.get('minted_by_operator') else ''}  {state}{decides}")


@click.group("tokens")
def tokens() -> None:
    """Your tenant's API tokens: who minted each, rotate yours (admins: create, revoke)."""


@tokens.command("list")
@click.option("--json", "as_json", is_flag=True)
def tokens_list(as_json: bool) -> None:
    """Every token of your tenant (revoked ones too) and who minted or revoked it; use is not tracked."""
    page = call("GET", "/v1/tokens").json()
    data = page["data"]
    if as_json:
        _echo_json(page)   # the API's list object (object, data, has_more): one shape for every list
        return
    for t in data:
        click.echo(_token_line(t))


def _show_new(obj: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _echo_json(obj)
        return
    click.echo(f"token #{obj['id']} ({obj['role']}), shown once: {obj['token']}")
    if obj["role"] == "tenant_admin" and not obj.get("decides_access"):
        click.echo("  it cannot decide staff access requests (operator-minted): claim it with its one-time code "
                   "(`finetune tokens claim --code-file CLAIM-CODE-<token id>` at your storage root), or ask one "
                   "of your tenant's own admins (`finetune tokens list`) to mint you one")


@tokens.command("create")
@click.option("--role", type=click.Choice(["member", "tenant_admin"]), default="member", show_default=True)
@click.option("--name", default="", help="A label shown in listings.")
@click.option("--json", "as_json", is_flag=True)
def tokens_create(role: str, name: str, as_json: bool) -> None:
    """Mint a token for your tenant (tenant admins); it is shown once."""
    _show_new(call("POST", "/v1/tokens", json={"role": role, "name": name}).json(), as_json)


@tokens.command("revoke")
@click.argument("token_id", type=click.IntRange(1, 2**31 - 1))
@click.option("--json", "as_json", is_flag=True)
def tokens_revoke(token_id: int, as_json: bool) -> None:
    """Revoke one of your tenant's tokens (tenant admins)."""
    obj = call("POST", f"/v1/tokens/{token_id}/revoke").json()
    _echo_json(obj) if as_json else click.echo(_token_line(obj))


def _replace_saved(url: str, old: str, obj: dict[str, Any], as_json: bool) -> None:
    """Put the new token ``obj`` where `finetune login` saved ``old`` (not SFT_API_TOKEN), and print it."""
    path, saved = _credentials_path(), False
    if not get_settings().api_token:
        try:
            if json.loads(path.read_text()).get("token") == old:
                tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    json.dump({"url": url, "token": obj["token"]}, f)
                os.replace(tmp, path)
                saved = True
        except (OSError, ValueError, AttributeError) as e:
            click.echo(f"could not update {path} ({e}): keep the new token printed below", err=True)
    if as_json:
        _echo_json({**obj, "saved_to": str(path) if saved else None})
        return
    _show_new(obj, as_json=False)
    click.echo(f"  token #{obj['minted_by_token_id']} is revoked; "
               + (f"saved the new one in {path}" if saved else "put the new one where you keep your token"))


@tokens.command("rotate")
@click.option("--json", "as_json", is_flag=True)
def tokens_rotate(as_json: bool) -> None:
    """Replace your token with a new secret and revoke the old one (a copy anyone kept stops working).

    Its provenance stays: a token an operator minted stays operator-minted (claim it with
    `finetune tokens claim`). The saved credentials of `finetune login` are updated; a token
    in SFT_API_TOKEN is not.
    """
    url, old = connection()
    _replace_saved(url, old, call("POST", "/v1/tokens/rotate").json(), as_json)


CLAIM_CODE = re.compile(r"sftclaim_[A-Za-z0-9_-]{40,60}")


def _read_code(code: str | None, code_file: str | None) -> str:
    if (code is None) == (code_file is None):
        raise click.UsageError("give the claim code, or --code-file with the file that holds it")
    if code is not None:
        return code.strip()
    try:
        text = Path(code_file or "").read_text(errors="replace")
    except OSError as e:
        raise click.ClickException(f"cannot read {code_file}: {e.strerror or e}") from None
    found = CLAIM_CODE.findall(text)
    if len(found) != 1:
        raise click.ClickException(f"{code_file} holds {len(found)} claim codes (sftclaim_...), not one")
    return str(found[0])


@tokens.command("claim")
@click.argument("code", required=False)
@click.option("--code-file", type=click.Path(dir_okay=False), help="The file holding the code, e.g. the "
              "CLAIM-CODE-<token id> your sysadmin's mint wrote at your storage root (keeps it out of shell history).")
@click.option("--json", "as_json", is_flag=True)
def tokens_claim(code: str | None, code_file: str | None, as_json: bool) -> None:
    """Make the tenant_admin token your sysadmin minted your tenant's own, with its one-time claim code.

    The code is in your tenant's storage, readable only by your unix user; the operator never saw
    it. The token is replaced by a new secret only you see (it decides staff access requests) and
    the old one is revoked; the saved credentials of `finetune login` are updated. Works once,
    within 7 days of the mint.
    """
    claim = _read_code(code, code_file)
    url, old = connection()
    _replace_saved(url, old, call("POST", "/v1/tokens/claim", json={"code": claim}).json(), as_json)
