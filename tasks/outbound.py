"""Outbound URLs Sluice is asked to call (tenant callbacks, vendor base URLs): validated and pinned.

One function decides whether a URL may be called and to which address: the host is normalised
(Unicode compatibility forms, IDNA, a trailing dot, the numeric forms a C resolver accepts such as
`127.1`, `2130706433`, `0x7f000001`, `0177.0.0.1`), resolved once, and refused if any address it
resolves to is loopback, private, link-local, shared (CGNAT, 100.64/10), multicast, reserved or
unspecified, including IPv4-mapped and -compatible IPv6 forms of those. A name that does not
resolve is refused. The caller then connects to the address that was checked, never resolving
the name again (no DNS rebinding between the check and the call).
"""

from __future__ import annotations

import ipaddress
import socket
import unicodedata
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from tasks.errors import InvalidRequest

SHARED = ipaddress.ip_network("100.64.0.0/10")
MAX_URL = 2000


class OutboundRefused(InvalidRequest):
    """This URL may not be called."""

    code = "invalid_request"


@dataclass(frozen=True)
class Pinned:
    """A URL and the one address it is called at."""

    url: str
    scheme: str
    host: str
    port: int
    address: str

    @property
    def address_url(self) -> str:
        """The URL with the checked address in place of the name (the name goes in Host and SNI)."""
        parts = urlsplit(self.url)
        netloc = f"[{self.address}]" if ":" in self.address else self.address
        return urlunsplit((parts.scheme, f"{netloc}:{self.port}", parts.path or "/", parts.query, ""))


def normalise_host(raw: str) -> str:
    host = unicodedata.normalize("NFKC", raw).strip().lower().rstrip(".")
    if not host:
        raise OutboundRefused("The URL has no host.")
    if host.startswith("[") and host.endswith("]"):
        return host[1:-1]
    try:
        host = host.encode("idna").decode("ascii")
    except UnicodeError:
        raise OutboundRefused("The URL's host is not a valid name.") from None
    numeric = _numeric_ipv4(host)
    return numeric or host


def _numeric_ipv4(host: str) -> str | None:
    """`127.1`, `2130706433`, `0x7f000001`, `0177.0.0.1`: the forms inet_aton accepts, as dotted quad."""
    if not all(part and (part.isdigit() or part.lower().startswith("0x")) for part in host.split(".")):
        return None
    try:
        return socket.inet_ntoa(socket.inet_aton(host))
    except OSError:
        return None


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address):
        # An IPv4 address carried in IPv6 (mapped, compatible, 6to4) is judged as that address.
        embedded = ip.ipv4_mapped or _ipv4_compatible(ip) or ip.sixtofour
        if embedded is not None:
            return is_public(str(embedded))
    if ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved or ip.is_unspecified:
        return False
    if isinstance(ip, ipaddress.IPv4Address) and ip in SHARED:
        return False
    return ip.is_global


def _ipv4_compatible(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    value = int(ip)
    if value >> 32 == 0 and value > 1:
        return ipaddress.IPv4Address(value & 0xFFFFFFFF)
    return None


def outbound_pin(url: str, *, allow_private: bool, what: str = "the URL") -> Pinned:
    """Check `url` and the address it will be called at; OutboundRefused says why not."""
    if not isinstance(url, str) or len(url) > MAX_URL:
        raise OutboundRefused(f"{what} is too long ({MAX_URL} characters at most).")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise OutboundRefused(f"{what} must be an http:// or https:// URL with a host.")
    if parts.username or parts.password:
        raise OutboundRefused(f"{what} must not carry credentials.")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise OutboundRefused(f"{what} has an invalid port.") from None
    host = normalise_host(parts.hostname)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError, OSError):
        raise OutboundRefused(f"{what}'s host {host!r} does not resolve.") from None
    addresses = sorted({info[4][0] for info in infos})
    if not addresses:
        raise OutboundRefused(f"{what}'s host {host!r} does not resolve.")
    if not allow_private:
        blocked = [a for a in addresses if not is_public(a)]
        if blocked:
            raise OutboundRefused(f"{what} points at a private, loopback or reserved address ({blocked[0]}); "
                                  "only public addresses are called.")
    return Pinned(url=url, scheme=parts.scheme, host=host, port=port, address=addresses[0])
