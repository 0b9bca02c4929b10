"""Chooses the LLM of each request: the agent's endpoint, the default one, or the offline model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from services.runtime.domain.errors import EndpointNotAllowed, LLMRejected
from services.runtime.domain.llm import Completion, CompletionRequest, Delta
from services.runtime.service_layer.endpoint_guard import EndpointGuard
from services.runtime.service_layer.llm_port import LLM


class ModelRouter(LLM):
    """Routes by `ModelSettings.base_url`: an agent's own endpoint, else the
    runtime's default endpoint, else (none configured) the built-in offline model.

    Args:
        offline: the built-in model.
        endpoint: makes the client of an endpoint URL (called once per URL).
        default_base_url: the runtime's endpoint; empty when there is none.
        guard: checks an agent's own endpoint before every request, since
            the addresses a name resolves to change (checked when set, too);
            None checks nothing (tests of other things).
    """

    def __init__(
        self,
        *,
        offline: LLM,
        endpoint: Callable[[str], LLM],
        default_base_url: str,
        guard: EndpointGuard | None = None,
    ) -> None:
        self._offline = offline
        self._endpoint = endpoint
        self._default = default_base_url
        self._guard = guard
        self._clients: dict[str, LLM] = {}

    def _for(self, url: str) -> LLM:
        if not url:
            return self._offline
        if url not in self._clients:
            self._clients[url] = self._endpoint(url)
        return self._clients[url]

    def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        own = request.settings.base_url
        if own and self._guard is not None:
            return self._checked(own, request)
        return self._for(own or self._default).stream(request)

    async def _checked(self, url: str, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        assert self._guard is not None
        try:
            await self._guard.check(url)
        except EndpointNotAllowed as refused:
            # Not worth a retry: the run fails saying why.
            raise LLMRejected(str(refused)) from None
        async for item in self._for(url).stream(request):
            yield item

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        await self._offline.aclose()
