"""Which SGLang servers are in rotation: lost servers leave it, returning ones rejoin only once re-synced."""

from __future__ import annotations

import logging
from typing import Dict, List, Sequence

from megatron_zcpo.rollout.engine import RolloutError

logger = logging.getLogger(__name__)


class ServersLostError(RolloutError):
    """Fewer than ``rollout.sglang.client.min_healthy`` servers remain in rotation; names the lost ones."""


class ServerPool:
    """The servers of a client, each in rotation or out of it (with the reason).

    A server whose request failed its retries is taken out (:meth:`take_out`): it gets no more
    requests, weight pushes, cache flushes or version checks. The run continues while at least
    ``min_healthy`` servers remain, else :class:`ServersLostError` names the lost ones. The
    client brings a returning server back (:meth:`bring_back`) only at a weight push, which then
    includes it, so it never serves stale weights.
    """

    def __init__(self, urls: Sequence[str], min_healthy: int = 1):
        self.urls = list(urls)
        self.min_healthy = min_healthy
        self.lost: Dict[str, str] = {}  # url -> why it left the rotation

    def in_rotation(self) -> List[str]:
        """The servers that take requests, in configuration order."""
        return [url for url in self.urls if url not in self.lost]

    def pick(self, index: int) -> str:
        """Round-robin: the in-rotation server for request ``index``."""
        rotation = self.in_rotation()
        if not rotation:
            self.check()
        return rotation[index % len(rotation)]

    def take_out(self, url: str, reason: str) -> None:
        """Take ``url`` out of rotation for ``reason``; raises :class:`ServersLostError` below ``min_healthy``."""
        if url in self.urls and url not in self.lost:
            self.lost[url] = reason
            logger.warning(
                "SGLang server %s taken out of rotation (%s); %d of %d remain",
                url,
                reason,
                len(self.in_rotation()),
                len(self.urls),
            )
        self.check()

    def bring_back(self, url: str) -> None:
        """Put ``url`` back into rotation (after it was health-checked and re-synced)."""
        if self.lost.pop(url, None) is not None:
            logger.warning("SGLang server %s is back in rotation", url)

    def follow(self, rotation: Sequence[str], reason: str) -> None:
        """Make exactly ``rotation`` (another client's) the servers in rotation; the others leave it for ``reason``."""
        self.lost = {url: self.lost.get(url, reason) for url in self.urls if url not in rotation}

    def check(self) -> None:
        """Raise :class:`ServersLostError` naming the lost servers when fewer than ``min_healthy`` remain."""
        remaining = len(self.in_rotation())
        if remaining < self.min_healthy:
            lost = "; ".join(f"{url} ({reason})" for url, reason in self.lost.items())
            raise ServersLostError(
                f"only {remaining} of {len(self.urls)} SGLang servers remain, fewer than "
                f"rollout.sglang.client.min_healthy = {self.min_healthy}; lost: {lost}"
            )
