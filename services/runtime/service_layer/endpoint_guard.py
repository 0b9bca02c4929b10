"""Checks an agent's model endpoint when it is set and again before each connection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from services.runtime.domain.endpoints import AllowedHosts, endpoint_of
from services.runtime.domain.errors import EndpointNotAllowed, EndpointRefused

# host, port -> the addresses the name resolves to (raises OSError if it does not).
Resolve = Callable[[str, int], Awaitable[list[str]]]


class EndpointGuard:
    """`AllowedHosts` plus name resolution: a name is judged by the addresses it has now."""

    def __init__(self, allowed: AllowedHosts, resolve: Resolve) -> None:
        self._allowed = allowed
        self._resolve = resolve

    async def check(self, url: str) -> None:
        """Raises EndpointNotAllowed if `url` may not be an agent's model endpoint now."""
        try:
            endpoint = endpoint_of(url)
            self._allowed.check_host(endpoint)
            if endpoint.literal is not None:
                addresses = [endpoint.host]
            else:
                try:
                    addresses = await self._resolve(endpoint.host, endpoint.port)
                except OSError:
                    raise EndpointRefused(
                        f"model.base_url host {endpoint.host} cannot be resolved now"
                    ) from None
            self._allowed.check_addresses(endpoint, addresses)
        except EndpointRefused as refused:
            raise EndpointNotAllowed(str(refused)) from None
