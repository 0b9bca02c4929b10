"""Chooses the LLM of each request: the agent's endpoint, the default one, or the offline model."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from services.runtime.domain.llm import Completion, CompletionRequest, Delta
from services.runtime.service_layer.llm_port import LLM


class ModelRouter(LLM):
    """Routes by `ModelSettings.base_url`: an agent's own endpoint, else the
    runtime's default endpoint, else (none configured) the built-in offline model.

    Args:
        offline: the built-in model.
        endpoint: makes the client of an endpoint URL (called once per URL).
        default_base_url: the runtime's endpoint; empty when there is none.
    """

    def __init__(self, *, offline: LLM, endpoint: Callable[[str], LLM], default_base_url: str) -> None:
        self._offline = offline
        self._endpoint = endpoint
        self._default = default_base_url
        self._clients: dict[str, LLM] = {}

    def _for(self, request: CompletionRequest) -> LLM:
        url = request.settings.base_url or self._default
        if not url:
            return self._offline
        if url not in self._clients:
            self._clients[url] = self._endpoint(url)
        return self._clients[url]

    def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]:
        return self._for(request).stream(request)

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        await self._offline.aclose()
