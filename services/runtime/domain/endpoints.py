"""Which model endpoints an agent may be pointed at (against SSRF).

An agent's `model.base_url` makes the runtime send the agent's context (the
text of its groups) to that URL. So it may name only a host the operator
listed in `RUNTIME_LLM_ALLOWED_HOSTS` (`host` for any port, `host:port`
for one; IPv6 as `[::1]` or `[::1]:8080`), and a host that is (or resolves
to) a loopback, private, link-local, unique-local, unspecified or other
non-public address is refused unless that address is listed too: a listed
public name cannot be turned, through DNS, toward the internal network.
The host of the runtime's own `OPENAI_BASE_URL` is always allowed, with
whatever addresses it has (the operator chose it).

Pure: resolving names is the caller's business (`EndpointGuard`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.runtime.domain.errors import EndpointRefused

SETTING = "RUNTIME_LLM_ALLOWED_HOSTS"
_DEFAULT_PORTS = {"http": 80, "https": 443}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where a URL points: its scheme, host (lower case, IPv6 without brackets) and port."""

    scheme: str
    host: str
    port: int

    @property
    def literal(self) -> IPAddress | None:
        """The host as an IP address, if it is one."""
        return _address(self.host)


@dataclass(frozen=True, slots=True)
class _Entry:
    host: str
    port: int | None  # None: any port

    def matches(self, host: str, port: int) -> bool:
        return self.host == host and (self.port is None or self.port == port)


def endpoint_of(url: str) -> Endpoint:
    """The endpoint of an http(s) URL.

    Raises:
        EndpointRefused: not an http(s) URL with a host and a valid port.
    """
    shown = url[:100]
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise EndpointRefused(f"model.base_url is not a valid URL: {shown!r}") from None
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS:
        raise EndpointRefused(f"model.base_url must be an http(s) URL, got {shown!r}")
    if parts.username is not None or parts.password is not None:
        raise EndpointRefused("model.base_url must not hold credentials (user:password@)")
    host = (parts.hostname or "").rstrip(".").lower()
    if not host:
        raise EndpointRefused(f"model.base_url names no host: {shown!r}")
    literal = _address(host)
    if literal is not None:
        host = str(literal)
    return Endpoint(scheme=scheme, host=host, port=port if port is not None else _DEFAULT_PORTS[scheme])


def _address(text: str) -> IPAddress | None:
    try:
        found = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(found, ipaddress.IPv6Address) and found.ipv4_mapped is not None:
        return found.ipv4_mapped
    return found


def is_public(address: IPAddress) -> bool:
    """False for loopback, private, link-local, unique-local, unspecified,
    shared, reserved, documentation and multicast addresses."""
    return address.is_global and not address.is_multicast


class AllowedHosts:
    """The hosts agents' model endpoints may name.

    Args:
        entries: `host`, `host:port`, `[v6]`, `[v6]:port` or a bare IPv6 address.
        trusted_url: the runtime's own endpoint (`OPENAI_BASE_URL`), allowed
            whatever its addresses; empty for none.

    Raises:
        ValueError: malformed entries (all of them named).
    """

    def __init__(self, entries: Iterable[str] = (), *, trusted_url: str = "") -> None:
        parsed: list[_Entry] = []
        bad: list[str] = []
        for raw in entries:
            text = raw.strip()
            if not text:
                continue
            entry = _entry(text)
            if entry is None:
                bad.append(text[:100])
            else:
                parsed.append(entry)
        if bad:
            raise ValueError(f"{SETTING}: expected host or host:port entries, got {bad}")
        self._entries = tuple(parsed)
        self._trusted: Endpoint | None = None
        if trusted_url:
            try:
                self._trusted = endpoint_of(trusted_url)
            except EndpointRefused:
                self._trusted = None

    @classmethod
    def parse(cls, text: str, *, trusted_url: str = "") -> AllowedHosts:
        """From the comma-separated setting."""
        return cls(text.split(","), trusted_url=trusted_url)

    def _trusts(self, endpoint: Endpoint) -> bool:
        return self._trusted is not None and self._trusted.host == endpoint.host

    def _listed(self, host: str, port: int) -> bool:
        return any(entry.matches(host, port) for entry in self._entries)

    def check_host(self, endpoint: Endpoint) -> None:
        """Refuses a host that is neither listed nor the runtime's own endpoint's.

        A literal address that is not public is refused unless listed, with
        a message saying so.
        """
        if self._trusts(endpoint) or self._listed(endpoint.host, endpoint.port):
            return
        literal = endpoint.literal
        if literal is not None and not is_public(literal):
            raise EndpointRefused(
                f"model.base_url points at {endpoint.host}, a loopback, private or otherwise"
                f" internal address; it is allowed only if listed in {SETTING}"
            )
        raise EndpointRefused(
            f"model.base_url host {endpoint.host}:{endpoint.port} is not in {SETTING};"
            " ask an operator to list it"
        )

    def check_addresses(self, endpoint: Endpoint, addresses: Iterable[str]) -> None:
        """Refuses a (listed) host that resolves to a non-public address that is not listed itself."""
        if self._trusts(endpoint):
            return
        for text in addresses:
            address = _address(text)
            if address is None or is_public(address):
                continue
            if self._listed(str(address), endpoint.port):
                continue
            raise EndpointRefused(
                f"model.base_url host {endpoint.host} resolves to {address}, a loopback, private or"
                f" otherwise internal address; list that address in {SETTING} to allow it"
            )


def _entry(text: str) -> _Entry | None:
    host, port_text = text, ""
    if text.startswith("["):
        inside, bracket, rest = text[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            return None
        host, port_text = inside, rest[1:]
        if _address(host) is None:
            return None
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1 and _address(text) is None:
        return None
    host = host.rstrip(".").lower()
    literal = _address(host)
    if literal is not None:
        host = str(literal)
    if not host or any(c in host for c in "/@ ?#"):
        return None
    if port_text == "" and text.endswith(":"):
        return None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        return _Entry(host, int(port_text))
    return _Entry(host, None)
