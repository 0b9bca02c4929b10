"""Fixtures the integration tests share."""

from tests.integration.replicas import replicas

__all__ = ["replicas"]
