"""Webhooks: a tenant's endpoints, the outbox of job events and their signed delivery.

A tenant admin registers an http(s) URL (``register``); the gateway answers with the endpoint's
secret, once. When a job succeeds, fails or is cancelled, ``enqueue`` adds one delivery per
endpoint in the same transaction as the transition (an outbox: no event is lost to a crash, none
is sent for a transition that rolled back). ``deliver_due`` (run by the reconciler's process)
POSTs each due one, signed the Standard Webhooks way (``webhook-id``, ``webhook-timestamp``,
``webhook-signature: v1,<base64 HMAC-SHA256 of id.timestamp.body>``, which OpenAI's SDK
verifies), with OpenAI's event body (``{"object": "event", "type":
"fine_tuning.job.succeeded", "data": {"id": ...}}``); a non-2xx answer or no answer is retried
after ``webhook_retry_base_s`` x 2^(n-1), up to ``webhook_max_attempts``. The log of deliveries
is the tenant's to read.

URLs (``check_url``), at registration and again before every delivery (DNS may change):
http or https, no credentials; every address the host resolves to must be public
(``netguard.refusal``'s deny list: loopback, private, link-local, CGNAT, NAT64, site-local,
multicast, reserved, documentation, ...) unless the host is in the site's
``webhook_allowed_hosts``. A delivery resolves the host once (``dial_addresses``) and connects to
exactly the addresses it checked (``netguard.PinnedTransport``, keeping the URL's Host, SNI and
certificate name), so a name that answers a public address to the check and 127.0.0.1 next
reaches nothing internal. A refusal names the host, never what it resolved to (that would map
the site's internal DNS for a tenant); the site's log has the address. Redirects are not followed.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import secrets
import time
from datetime import timedelta
from typing import Any

import httpx
from sqlmodel import Session, col, select

from gateway.access import audit
from gateway.access.tokens import Principal, actor
from gateway.config import Settings
from gateway.errors import NotFound, ServiceError
from gateway.models import FineTuningJob, Tenant, WebhookDelivery, WebhookEndpoint, utcnow
from gateway.services import netguard
from gateway.state import DeliveryState, JobState

log = logging.getLogger(__name__)

EVENTS = {JobState.SUCCEEDED: "fine_tuning.job.succeeded", JobState.FAILED: "fine_tuning.job.failed",
          JobState.CANCELLED: "fine_tuning.job.cancelled"}
MAX_ENDPOINTS = 10       # per tenant


def _target(url: str) -> tuple[str, int]:
    """(host, port) of an http(s) URL without credentials; ServiceError (400, ``url``) otherwise."""
    target = netguard.http_target(url)
    if target is None:
        raise ServiceError("url must be http(s)://host[:port]/path, without credentials", param="url")
    return target[1], target[2]


def _checked(host: str, port: int) -> list[netguard.IPAddress]:
    try:
        return netguard.public_addresses(host, port)
    except netguard.NotPublic as e:
        log.warning("webhook url refused: %s", e)      # the address, for the site only
        raise ServiceError(f"url: {host} is not a public address; this site sends webhooks only to hosts "
                           "whose every address is public, unless its administrator allows the host",
                           param="url") from None


def check_url(url: str, settings: Settings) -> str:
    """``url`` if the gateway may POST to it (see the module doc); ServiceError (400, ``url``) otherwise."""
    host, port = _target(url)
    if host not in settings.webhook_allowed_hosts:
        _checked(host, port)
    return url


def dial_addresses(url: str, settings: Settings) -> list[netguard.IPAddress]:
    """The addresses a delivery to ``url`` connects to, resolved once: each checked public, or
    unchecked for a host in ``webhook_allowed_hosts``; ServiceError (``url``) when there are none
    the gateway may use."""
    host, port = _target(url)
    if host not in settings.webhook_allowed_hosts:
        return _checked(host, port)
    try:
        return netguard.resolve(host, port)
    except netguard.NotPublic:
        raise ServiceError(f"url: {host} does not resolve", param="url") from None


def register(*, session: Session, settings: Settings, principal: Principal, url: str) -> WebhookEndpoint:
    """Add an endpoint for the caller's tenant (its admin; audited); its ``secret`` is shown only now."""
    assert principal.tenant_id is not None
    check_url(url, settings)
    live = session.exec(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == principal.tenant_id,
                                                      col(WebhookEndpoint.deleted_at).is_(None))).all()
    if len(live) >= MAX_ENDPOINTS:
        raise ServiceError(f"your tenant has {len(live)} webhook endpoints, the most it may have", param="url")
    row = WebhookEndpoint(tenant_id=principal.tenant_id, url=url,
                          secret="whsec_" + base64.b64encode(secrets.token_bytes(24)).decode())
    session.add(row)
    session.flush()
    audit.append(session, at=utcnow(), actor=actor(principal),
                 action="webhook.register", outcome=audit.ALLOWED, tenant=principal.tenant_name,
                 resource=f"webhook:{row.id}", reason=f"url {url[:200]}")
    session.commit()
    return row


def endpoints(*, session: Session, principal: Principal) -> list[WebhookEndpoint]:
    """The caller's tenant's live endpoints, oldest first."""
    return list(session.exec(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == principal.tenant_id,
                                                           col(WebhookEndpoint.deleted_at).is_(None))
                             .order_by(col(WebhookEndpoint.created_at))))


def _own(session: Session, principal: Principal, endpoint_id: str) -> WebhookEndpoint:
    row = session.get(WebhookEndpoint, endpoint_id)
    if row is None or row.tenant_id != principal.tenant_id or row.deleted_at is not None:
        raise NotFound(f"no such webhook endpoint: {endpoint_id}", param="webhook_id")
    return row


def remove(*, session: Session, principal: Principal, endpoint_id: str) -> None:
    """Delete the endpoint (its pending deliveries are dropped; audited); NotFound for another tenant's."""
    row = _own(session, principal, endpoint_id)
    row.deleted_at = utcnow()
    session.add(row)
    for d in session.exec(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == row.id,
                                                        WebhookDelivery.status == DeliveryState.PENDING)):
        d.status, d.last_error = DeliveryState.FAILED, "the endpoint was deleted"
        session.add(d)
    audit.append(session, at=utcnow(), actor=actor(principal),
                 action="webhook.delete", outcome=audit.ALLOWED, tenant=principal.tenant_name,
                 resource=f"webhook:{row.id}")
    session.commit()


def deliveries(*, session: Session, principal: Principal, endpoint_id: str, limit: int = 50) -> list[WebhookDelivery]:
    """The endpoint's deliveries, newest first; NotFound for another tenant's endpoint."""
    row = _own(session, principal, endpoint_id)
    return list(session.exec(select(WebhookDelivery).where(WebhookDelivery.endpoint_id == row.id)
                             .order_by(col(WebhookDelivery.created_at).desc()).limit(limit)))


def enqueue(session: Session, job: FineTuningJob, state: JobState) -> None:
    """In the caller's transaction: one delivery of ``state``'s event per live endpoint of the job's tenant."""
    event = EVENTS.get(state)
    if event is None:
        return
    for ep in session.exec(select(WebhookEndpoint).where(WebhookEndpoint.tenant_id == job.tenant_id,
                                                         col(WebhookEndpoint.deleted_at).is_(None))):
        row = WebhookDelivery(endpoint_id=ep.id, tenant_id=job.tenant_id, event_type=event, job_id=job.id,
                              body="")
        row.body = json.dumps({"id": "evt_" + row.id.removeprefix("msg-"), "object": "event",
                               "created_at": int(time.time()), "type": event, "data": {"id": job.id}},
                              separators=(",", ":"))
        session.add(row)


def sign(secret: str, msg_id: str, timestamp: int, body: str) -> str:
    """The ``webhook-signature`` value: ``v1,`` and the base64 HMAC-SHA256 of ``id.timestamp.body``."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def deliver_due(engine: Any, settings: Settings, limit: int = 20) -> int:
    """POST the due deliveries (oldest first, at most ``limit``); returns how many were delivered."""
    done = 0
    with Session(engine) as s:
        due = list(s.exec(select(WebhookDelivery).where(WebhookDelivery.status == DeliveryState.PENDING,
                                                        col(WebhookDelivery.next_at) <= utcnow())
                          .order_by(col(WebhookDelivery.next_at)).limit(limit)))
        for d in due:
            ep = s.get(WebhookEndpoint, d.endpoint_id)
            tenant = s.get(Tenant, d.tenant_id)
            if ep is None or ep.deleted_at is not None or tenant is None:
                d.status, d.last_error = DeliveryState.FAILED, "the endpoint was deleted"
                s.add(d)
                s.commit()
                continue
            ts = int(time.time())
            d.attempts += 1
            try:
                transport = netguard.PinnedTransport(dial_addresses(ep.url, settings))
                with httpx.Client(transport=transport, timeout=settings.webhook_timeout_s, follow_redirects=False,
                                  trust_env=False) as client:
                    r = client.post(ep.url, content=d.body.encode(),
                                    headers={"content-type": "application/json", "webhook-id": d.id,
                                             "webhook-timestamp": str(ts),
                                             "webhook-signature": sign(ep.secret, d.id, ts, d.body),
                                             "user-agent": "slurm-finetune-webhooks"})
                d.last_status, d.last_error = r.status_code, None if r.is_success else f"HTTP {r.status_code}"
                ok = r.is_success
            except (httpx.HTTPError, ServiceError) as e:
                d.last_status, d.last_error, ok = None, f"{type(e).__name__}: {str(e)[:200]}", False
            if ok:
                d.status, d.delivered_at = DeliveryState.DELIVERED, utcnow()
                done += 1
            elif d.attempts >= settings.webhook_max_attempts:
                d.status = DeliveryState.FAILED
            else:
                d.next_at = utcnow() + timedelta(seconds=settings.webhook_retry_base_s * 2 ** (d.attempts - 1))
            s.add(d)
            s.commit()
            log.info("webhook %s (%s of %s) attempt %d: %s", d.id, d.event_type, d.job_id, d.attempts,
                     d.status if ok else d.last_error)
    return done
