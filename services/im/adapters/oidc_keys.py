"""The OpenID Connect provider's keys over HTTP (`ProviderKeys`)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from services.common.oidc import ProviderClient, ProviderError
from services.im.domain.errors import ProviderUnavailable
from services.im.service_layer.auth_ports import ProviderKeys

logger = logging.getLogger(__name__)


class HttpProviderKeys(ProviderKeys):
    """Fetches the JWKS named by the provider's discovery document.

    Args:
        client: the provider's HTTP client (owned by the caller, who closes it).
    """

    def __init__(self, client: ProviderClient) -> None:
        self._client = client

    async def fetch(self) -> Mapping[str, Any]:
        try:
            return await self._client.jwks()
        except ProviderError as error:
            logger.warning("OpenID provider keys: %s", error)
            raise ProviderUnavailable(f"{error}; try again later") from None
