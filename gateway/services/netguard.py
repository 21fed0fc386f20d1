"""Outbound HTTP to a host a tenant names (webhooks): resolve once, check every address, dial those.

Checking a name and then letting the HTTP client resolve it again lets the name's DNS server
answer a public address to the check and 127.0.0.1 to the client (DNS rebinding). So
``public_addresses`` resolves once and refuses the name unless every address it got is public by
an explicit deny list (``refusal``), not only ``ipaddress``'s ``is_global``, which on Python 3.11
passes NAT64 (``64:ff9b::7f00:1``), IPv4-compatible (``::a00:1``) and site-local (``fec0::/10``)
addresses; ``PinnedTransport``
then connects to exactly those addresses while the request keeps the URL's host: its ``Host``
header and, for https, the TLS server name (SNI) and the certificate checked against it.
"""

from __future__ import annotations

import ipaddress
import socket
import ssl
from collections.abc import Iterable, Sequence
from urllib.parse import SplitResult, urlsplit

import httpcore
import httpx

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_DIALED = 4          # addresses tried per connection, in the resolver's order

_V4 = [("0.0.0.0/8", "this-network"), ("10.0.0.0/8", "private"), ("100.64.0.0/10", "shared (CGNAT)"),
       ("127.0.0.0/8", "loopback"), ("169.254.0.0/16", "link-local"), ("172.16.0.0/12", "private"),
       ("192.0.0.0/24", "IETF protocol"), ("192.0.2.0/24", "documentation"), ("192.88.99.0/24", "6to4 relay"),
       ("192.168.0.0/16", "private"), ("198.18.0.0/15", "benchmarking"), ("198.51.100.0/24", "documentation"),
       ("203.0.113.0/24", "documentation"), ("224.0.0.0/4", "multicast"), ("255.255.255.255/32", "broadcast"),
       ("240.0.0.0/4", "reserved")]
# IPv4-mapped (::ffff:0:0/96) and 6to4 (2002::/16) are judged by the IPv4 address they carry.
_V6 = [("::/128", "unspecified"), ("::1/128", "loopback"), ("::/96", "IPv4-compatible"),
       ("::ffff:0:0:0/96", "IPv4-translated"), ("64:ff9b::/96", "NAT64"), ("64:ff9b:1::/48", "NAT64 local-use"),
       ("100::/64", "discard"), ("2001::/23", "IETF protocol"), ("2001:db8::/32", "documentation"),
       ("3fff::/20", "documentation"), ("5f00::/16", "SRv6"), ("fc00::/7", "unique-local"),
       ("fe80::/10", "link-local"), ("fec0::/10", "site-local"), ("ff00::/8", "multicast")]
DENIED: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, str]] = \
    [(ipaddress.ip_network(net), kind) for net, kind in _V4 + _V6]
_GLOBAL_UNICAST_V6 = ipaddress.IPv6Network("2000::/3")


class NotPublic(Exception):
    """The host does not resolve, or one of its addresses is not public. The text names the
    address: it is for the site's log, never for the tenant."""


def http_target(url: str) -> tuple[SplitResult, str, int] | None:
    """(the split URL, host, port) of an http(s) URL with a host, a valid port and no credentials in it;
    None for any other: what an outbound call to a tenant-given URL (webhook, tracking server) accepts."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password or not port:
        return None
    return parts, parts.hostname, port


def refusal(addr: IPAddress) -> str | None:
    """None when ``addr`` is a public unicast address; else what it is ("loopback", "NAT64", ...)."""
    if isinstance(addr, ipaddress.IPv6Address):
        embedded = addr.ipv4_mapped or addr.sixtofour
        if embedded is not None:
            kind = refusal(embedded)
            return None if kind is None else f"{kind} (embedded in IPv6)"
    for net, kind in DENIED:
        if addr in net:
            return kind
    if isinstance(addr, ipaddress.IPv6Address) and addr not in _GLOBAL_UNICAST_V6:
        return "reserved"
    return None if addr.is_global else "non-public"


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to, in the resolver's order, once each (IPv4-mapped ones as
    IPv4: that is where a connection goes); NotPublic when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as e:
        raise NotPublic(f"{host} does not resolve ({e})") from None
    found: list[IPAddress] = []
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]))
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        if addr not in found:
            found.append(addr)
    if not found:
        raise NotPublic(f"{host} resolves to no address")
    return found


def public_addresses(host: str, port: int) -> list[IPAddress]:
    """``resolve(host, port)`` when every address is public (``refusal``); NotPublic otherwise."""
    addrs = resolve(host, port)
    for addr in addrs:
        kind = refusal(addr)
        if kind is not None:
            raise NotPublic(f"{host} resolves to {addr}, a {kind} address")
    return addrs


class _PinnedBackend(httpcore.SyncBackend):
    """Dials the given addresses whatever host httpcore asks for (the port is the URL's)."""

    def __init__(self, addresses: Sequence[IPAddress]):
        self.addresses = [str(a) for a in addresses[:MAX_DIALED]]

    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None) -> httpcore.NetworkStream:
        error: Exception = httpcore.ConnectError("no address to connect to")
        for addr in self.addresses:
            try:
                return super().connect_tcp(addr, port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as e:
                error = e
        raise error


class PinnedTransport(httpx.HTTPTransport):
    """An httpx transport that connects only to ``addresses`` (already checked by the caller) for
    every request; the URL's host still names the server in ``Host``, SNI and certificate checks.
    Never through a proxy; ValueError without an address."""

    def __init__(self, addresses: Sequence[IPAddress], *, verify: ssl.SSLContext | bool = True):
        if not addresses:
            raise ValueError("PinnedTransport needs at least one address")
        super().__init__(verify=verify, trust_env=False)
        # httpx builds its pool from public httpcore parts but takes no network backend: swap
        # the pool for one that has ours. Fail closed if httpx no longer keeps it where we look.
        if not isinstance(getattr(self, "_pool", None), httpcore.ConnectionPool):
            raise RuntimeError("httpx.HTTPTransport keeps no _pool: PinnedTransport needs updating")
        # trust_env here only means SSL_CERT_FILE / SSL_CERT_DIR, as for httpx.post before.
        ctx = verify if isinstance(verify, ssl.SSLContext) else httpx.create_ssl_context(verify=verify)
        self.backend = _PinnedBackend(addresses)
        self._pool = httpcore.ConnectionPool(ssl_context=ctx, max_connections=4, retries=0,
                                             network_backend=self.backend)
