"""Which addresses a webhook may reach (``netguard.refusal``'s deny list), and what a refused URL
tells the tenant: the host, never the address it resolved to."""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

import pytest

from gateway.config import Settings
from gateway.errors import ServiceError
from gateway.services import netguard, webhooks

pytestmark = pytest.mark.unit

DENIED = {
    "0.0.0.0": "this-network", "0.1.2.3": "this-network", "10.0.0.1": "private", "10.255.255.255": "private",
    "100.64.0.1": "shared (CGNAT)", "100.127.255.254": "shared (CGNAT)", "127.0.0.1": "loopback",
    "127.255.0.9": "loopback", "169.254.169.254": "link-local", "172.16.0.1": "private", "172.31.255.1": "private",
    "192.0.0.1": "IETF protocol", "192.0.0.170": "IETF protocol", "192.0.2.5": "documentation",
    "192.88.99.1": "6to4 relay", "192.168.1.1": "private", "198.18.0.1": "benchmarking",
    "198.19.255.255": "benchmarking", "198.51.100.7": "documentation", "203.0.113.9": "documentation",
    "224.0.0.251": "multicast", "239.255.255.250": "multicast", "240.0.0.1": "reserved",
    "255.255.255.254": "reserved", "255.255.255.255": "broadcast",
    "::": "unspecified", "::1": "loopback", "::a00:1": "IPv4-compatible", "::7f00:1": "IPv4-compatible",
    "::8.8.8.8": "IPv4-compatible", "::ffff:127.0.0.1": "loopback (embedded in IPv6)",
    "::ffff:10.0.0.1": "private (embedded in IPv6)", "::ffff:169.254.169.254": "link-local (embedded in IPv6)",
    "::ffff:0:7f00:1": "IPv4-translated", "64:ff9b::7f00:1": "NAT64", "64:ff9b::808:808": "NAT64",
    "64:ff9b:1::a00:1": "NAT64 local-use", "100::1": "discard", "2001::1": "IETF protocol",
    "2001:0:4136:e378::1": "IETF protocol", "2001:db8::1": "documentation", "2001:db8:ffff::1": "documentation",
    "2002:7f00:1::1": "loopback (embedded in IPv6)", "2002:a00:1::": "private (embedded in IPv6)",
    "3fff::1": "documentation", "5f00::1": "SRv6", "fc00::1": "unique-local", "fd12:3456::1": "unique-local",
    "fe80::1": "link-local", "fe80::1%eth0": "link-local", "febf::1": "link-local", "fec0::1": "site-local",
    "feff::1": "site-local", "ff02::1": "multicast", "ff0e::1": "multicast", "4000::1": "reserved",
    "e000::1": "reserved", "1::1": "reserved",
}
PUBLIC = ["8.8.8.8", "1.1.1.1", "93.184.215.14", "11.0.0.1", "100.63.255.255", "100.128.0.1", "126.255.255.255",
          "128.0.0.1", "172.15.255.255", "172.32.0.1", "192.0.1.1", "192.169.0.1", "198.17.255.255",
          "198.20.0.1", "223.255.255.254", "2606:4700:4700::1111", "2001:4860:4860::8888", "2a00:1450:4001::1",
          "2620:fe::fe", "::ffff:8.8.8.8", "2002:808:808::1"]


@pytest.mark.parametrize(("addr", "kind"), sorted(DENIED.items()))
def test_every_non_public_range_is_refused_by_name(addr: str, kind: str) -> None:
    assert netguard.refusal(ipaddress.ip_address(addr)) == kind


@pytest.mark.parametrize("addr", PUBLIC)
def test_public_unicast_addresses_pass(addr: str) -> None:
    assert netguard.refusal(ipaddress.ip_address(addr)) is None


def test_the_ranges_python_calls_global_are_refused_all_the_same() -> None:
    """The holes in ``is_global`` (Python 3.11) this list exists for."""
    for addr in ("64:ff9b::7f00:1", "::a00:1", "fec0::1"):
        ip = ipaddress.ip_address(addr)
        assert netguard.refusal(ip) is not None, addr


def _fake_dns(monkeypatch: pytest.MonkeyPatch, answers: dict[str, list[str]]) -> None:
    def getaddrinfo(host: str, port: int, *args: Any, **kw: Any) -> list[tuple[Any, ...]]:
        if host not in answers:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (a, port, 0, 0) if ":" in a else (a, port)) for a in answers[host]]

    monkeypatch.setattr(netguard.socket, "getaddrinfo", getaddrinfo)


@pytest.mark.parametrize(("url", "host"), [("http://mixed.example/h", "mixed.example"),
                                         ("http://inside.example/h", "inside.example"),
                                         ("https://nat64.example/h", "nat64.example"),
                                         ("http://no-such.example/h", "no-such.example"),
                                         ("http://[::ffff:127.0.0.1]:8080/h", "::ffff:127.0.0.1"),
                                         ("http://[64:ff9b::a00:1]/h", "64:ff9b::a00:1"),
                                         ("http://[fec0::1]/h", "fec0::1"), ("http://100.64.0.1/h", "100.64.0.1")])
def test_a_refusal_names_the_host_never_the_address(monkeypatch: pytest.MonkeyPatch, url: str, host: str) -> None:
    """Also one message whether the name does not resolve or resolves inside: no map of internal DNS."""
    _fake_dns(monkeypatch, {"mixed.example": ["93.184.215.14", "10.1.2.3"], "inside.example": ["192.168.7.7"],
                            "nat64.example": ["64:ff9b::c0a8:707"]})
    with pytest.raises(ServiceError) as e:
        webhooks.check_url(url, Settings())
    assert e.value.param == "url"
    assert f"{host} is not a public address" in str(e.value)
    for leaked in ("10.1.2.3", "192.168.7.7", "c0a8:707", "93.184.215.14"):
        assert leaked not in str(e.value)


def test_delivery_dials_only_the_checked_addresses(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"hooks.example": ["93.184.215.14", "::ffff:8.8.8.8", "93.184.215.14"]})
    got = webhooks.dial_addresses("https://hooks.example/h", Settings())
    assert got == [ipaddress.ip_address("93.184.215.14"), ipaddress.ip_address("8.8.8.8")]   # mapped: as IPv4
    assert netguard.PinnedTransport(got).backend.addresses == ["93.184.215.14", "8.8.8.8"]


def test_the_site_allow_list_still_lets_a_listed_host_through(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_dns(monkeypatch, {"hooks.internal": ["10.9.8.7"]})
    allowed = Settings(webhook_allowed_hosts=["hooks.internal"])
    assert webhooks.check_url("http://hooks.internal:8080/h", allowed) == "http://hooks.internal:8080/h"
    assert webhooks.dial_addresses("http://hooks.internal:8080/h", allowed) == [ipaddress.ip_address("10.9.8.7")]
    with pytest.raises(ServiceError, match="hooks.internal is not a public address"):
        webhooks.dial_addresses("http://hooks.internal:8080/h", Settings())


@pytest.mark.parametrize("url", ["ftp://example.org/h", "https://u:p@example.org/h", "http:///h",
                                 "http://example.org:99999/h", "http://example.org:x/h"])
def test_odd_urls_are_refused_before_any_lookup(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    _fake_dns(monkeypatch, {})
    with pytest.raises(ServiceError, match="url must be http"):
        webhooks.check_url(url, Settings())
