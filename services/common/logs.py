"""Process-wide logging set-up."""

from __future__ import annotations

import logging
import sys

LOG_LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR"}


def configure_logging(level: str) -> None:
    """Sends logs to stderr as one line per record."""
    logging.basicConfig(
        level=level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        force=True,
    )
