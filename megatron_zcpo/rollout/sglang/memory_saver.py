"""The SGLang engine's memory-saver requests (colocated placement): release and resume.

Mixed into :class:`megatron_zcpo.rollout.sglang.client.SGLangEngine` (its ``_http``, ``config``,
``flush_cache``, ``_health`` and ``_check_open``); the protocol per release is in
:mod:`megatron_zcpo.rollout.sglang.api` (``MEMORY_SAVER_ENDPOINTS``), the phases that call it in
:mod:`megatron_zcpo.rollout.placement`.

A server out of rotation still holds memory on the trainer's GPUs, so every memory request also goes,
best effort, to the lost servers, with only the tags each is known to hold or to have released
(0.5.23 dies on a resume of a tag it did not release). A lost server is health-checked for its
return only where it can generate (:meth:`MemorySaverClient.check_returning_servers`, after the
generate phase resumed everything): a ``/health_generate`` while generation is paused waits
SGLang's 20 s and answers 503 (``http_server.py:HEALTH_CHECK_TIMEOUT``), and one on released
memory runs a token there. The next push, which re-syncs it, brings it back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Dict, List, Optional, Sequence, Set, Tuple

from megatron_zcpo.rollout.engine import RolloutError

logger = logging.getLogger(__name__)
RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"


class MemorySaverClient:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` on every server in rotation (a
    server that fails after its retries leaves it), and best effort on the lost ones; pause and continue
    are :class:`~megatron_zcpo.rollout.sglang.partial.PausableGeneration`'s (``paused``: this client
    paused generation)."""

    _memory_tags: Optional[Tuple[str, ...]]
    _released: Dict[str, Set[str]]  # url -> the tags it released (as far as it answered)
    _returning: Set[str]  # lost servers that generated again after the phases resumed them
    paused: bool

    def memory_tags(self) -> Tuple[str, ...]:
        """The memory-saver tags the servers' release knows (:func:`~megatron_zcpo.rollout.sglang.api.memory_tags`);
        none when a server runs without ``--enable-memory-saver`` (its releases would free nothing)."""
        from megatron_zcpo.rollout.sglang.api import SERVER_INFO_PATHS, memory_tags

        if self._memory_tags is None:
            infos = self._http.run(self._http.get_from_all_servers(SERVER_INFO_PATHS))
            if not all(info.get("enable_memory_saver") for info in infos):
                return ()
            self._memory_tags = min((memory_tags(str(info.get("version", ""))) for info in infos), key=len)
        return self._memory_tags

    def release_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/release_memory_occupation`` on every server, once their caches are flushed (a release must
        find the server idle: the flush aborts requests whose abort was lost)."""
        self._check_open()
        self.flush_cache()
        self._memory_call(RELEASE, tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/resume_memory_occupation`` on every server (a 5xx is retried)."""
        self._check_open()
        self._memory_call(RESUME, tags)

    def _memory_call(self, path: str, tags: Optional[Sequence[str]]) -> None:
        # explicit tags: a release that knows more (cuda_graph) must not release what we never resume
        chosen = list(tags if tags is not None else self.memory_tags())
        answered = self._http.run(
            self._http.on_servers_in_rotation("POST", path, {"tags": chosen}, timeout=self.config.update_timeout_s)
        )
        for url in answered:
            self._book(url, path, chosen)
        self._http.run(self._on_lost_servers(path, chosen))

    def _book(self, url: str, path: str, tags: Sequence[str]) -> None:
        released = self._released.setdefault(url, set())
        if path == RELEASE:
            released.update(tags)
        else:
            released.difference_update(tags)

    async def _on_lost_servers(self, path: str, tags: List[str]) -> None:
        """``path`` on each lost server, with the tags it still holds (release) or released (resume)."""

        async def call(url):
            released = self._released.get(url, set())
            mine = [tag for tag in tags if (tag in released) == (path == RESUME)]
            if not mine:
                return
            try:
                if path == RELEASE:  # a release must find it idle
                    await self._http.request(
                        "POST",
                        url + "/abort_request",
                        {"abort_all": True},
                        retry=False,
                        timeout=self.config.connect_timeout_s,
                    )
                await self._http.request(
                    "POST", url + path, {"tags": mine}, retry=False, timeout=self.config.update_timeout_s
                )
            except RolloutError as err:
                self._returning.discard(url)  # it no longer follows the phases
                logger.warning("lost SGLang server %s did not take %s %s: %s", url, path, mine, err)
                return
            self._book(url, path, mine)

        await asyncio.gather(*(call(url) for url in list(self._http.pool.lost)))

    def check_returning_servers(self) -> List[str]:
        """In the generate phase (everything resumed, generation continued): the lost servers whose memory
        followed the phases and that generate again (``/health_generate``); the next push brings them back."""
        self._check_open()
        if any(self._released.get(url) for url in self._http.pool.in_rotation()) or self.paused:
            raise RolloutError("lost servers are health-checked in the generate phase (every tag resumed, not paused)")
        candidates = [url for url in self._http.pool.lost if not self._released.get(url)]
        for url, healthy in zip(candidates, self._http.run(self._health(candidates))):
            if healthy:
                self._returning.add(url)
        return sorted(self._returning)
