"""Weight-update sessions (SGLang >= 0.5.21): ``/begin_weight_update`` before a push, ``/end_weight_update`` after it.

Read from 0.5.21's and 0.5.23's ``weight_updater.py``: ``/update_weights_from_distributed`` and
``/update_weights_from_tensor`` outside a session are refused, a second ``begin`` while one is open
and an ``end`` without one are refused, and ``end`` finalises quantised weights. Older servers have
neither endpoint, so only the servers whose version needs a session get the two requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Dict, Iterator, List, Sequence

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.api import WEIGHT_UPDATE_SESSIONS_SINCE, release_at_least


def session_members(urls: Sequence[str], server_infos: Sequence[Dict[str, Any]]) -> List[str]:
    """The servers of ``urls`` (their ``/get_server_info`` answers in ``server_infos``) that need a session."""
    return [
        url
        for url, info in zip(urls, server_infos)
        if release_at_least(str(info.get("version", "")), WEIGHT_UPDATE_SESSIONS_SINCE)
    ]


def _post_to_members(http, members: Sequence[str], path: str, timeout: float) -> None:
    """POST ``path`` to every member at once; raise RolloutError naming each that failed."""
    if not members:
        return

    async def on_members():
        return await asyncio.gather(
            *(http.request("POST", url + path, {}, retry=False, timeout=timeout) for url in members),
            return_exceptions=True,
        )

    failed = [
        f"{url}: {answer}" for url, answer in zip(members, http.run(on_members())) if isinstance(answer, BaseException)
    ]
    if failed:
        raise RolloutError(f"{path} failed on " + "; ".join(failed))


@contextlib.contextmanager
def weight_update_session(http, members: Sequence[str], timeout: float) -> Iterator[None]:
    """Hold a weight-update session open on ``members`` for the body of the ``with``; on a failure
    inside it the session is still closed (best effort: a next ``begin`` would be refused)."""
    _post_to_members(http, members, "/begin_weight_update", timeout)
    try:
        yield
    except BaseException:
        with contextlib.suppress(RolloutError):
            _post_to_members(http, members, "/end_weight_update", timeout)
        raise
    _post_to_members(http, members, "/end_weight_update", timeout)
