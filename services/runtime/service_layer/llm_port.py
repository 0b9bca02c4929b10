"""The LLM port: a streaming chat completion."""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator

from services.runtime.domain.llm import Completion, CompletionRequest, Delta


class LLM(abc.ABC):
    """Streams one chat completion.

    `stream` yields deltas as they arrive and ends with exactly one
    `Completion` (the assembled message, finish reason and usage). It raises
    `LLMUnavailable` when the endpoint keeps failing after retries and
    `LLMRejected` when it refuses the request. Cancelling the consumer
    cancels the request.
    """

    @abc.abstractmethod
    def stream(self, request: CompletionRequest) -> AsyncIterator[Delta | Completion]: ...

    async def aclose(self) -> None:  # noqa: B027 - optional hook, a no-op by default
        """Releases connections. Idempotent."""
