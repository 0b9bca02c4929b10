"""LLM adapters: OpenAI-compatible endpoints and the built-in offline model."""

from services.runtime.adapters.llm.offline import OfflineModel
from services.runtime.adapters.llm.openai_provider import OpenAIProvider

__all__ = ["OfflineModel", "OpenAIProvider"]
