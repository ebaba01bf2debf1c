"""The SGLang engine's memory-saver requests (colocated placement): release and resume.

Mixed into :class:`megatron_zcpo.rollout.sglang.client.SGLangEngine` (its ``_http``, ``config``,
``flush_cache`` and ``_check_open``); the protocol per release is in :mod:`megatron_zcpo.rollout.sglang.api`
(``MEMORY_SAVER_ENDPOINTS``), the phases that call it in :mod:`megatron_zcpo.rollout.placement`.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple


class MemorySaverClient:
    """``/release_memory_occupation`` and ``/resume_memory_occupation`` on every server in rotation (a
    server that fails after its retries leaves it); pause and continue are
    :class:`~megatron_zcpo.rollout.sglang.partial.PausableGeneration`'s."""

    _memory_tags: Optional[Tuple[str, ...]]

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
        """``/release_memory_occupation`` on every server in rotation, once their caches are flushed
        (a release must find the server idle: the flush aborts requests whose abort was lost)."""
        self._check_open()
        self.flush_cache()
        self._memory_call("/release_memory_occupation", tags)

    def resume_memory(self, tags: Optional[Sequence[str]] = None) -> None:
        """``/resume_memory_occupation`` on every server in rotation (a 5xx is retried)."""
        self._check_open()
        self._memory_call("/resume_memory_occupation", tags)

    def _memory_call(self, path: str, tags: Optional[Sequence[str]]) -> None:
        # explicit tags: a release that knows more (cuda_graph) must not release what we never resume
        body = {"tags": list(tags if tags is not None else self.memory_tags())}
        self._http.run(self._http.on_servers_in_rotation("POST", path, body, timeout=self.config.update_timeout_s))
