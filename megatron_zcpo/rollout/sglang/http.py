"""HTTP to a set of SGLang servers: one asyncio session in a loop thread, retries with backoff, fan-out.

The engine (:mod:`megatron_zcpo.rollout.sglang.client`) and the weight transports
(:mod:`megatron_zcpo.rollout.sglang.update_weight`) talk to the servers through one :class:`SGLangHTTP`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import aiohttp

from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.server_pool import ServerPool

logger = logging.getLogger(__name__)


class SGLangHTTPError(RolloutError):
    """An SGLang server answered a request with a 4xx status (not retried)."""

    def __init__(self, method: str, url: str, status: int, body: str):
        super().__init__(f"{method} {url} -> HTTP {status}: {body[:500]}")
        self.status = status


class _ServerError(Exception):
    """A 5xx answer: retried like a dropped connection."""


# asyncio.TimeoutError is TimeoutError from Python 3.11 on; aiohttp raises the former.
RETRYABLE = (
    _ServerError,
    TimeoutError,
    asyncio.TimeoutError,
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
)


class _LoopThread:
    """An asyncio loop in a daemon thread, so synchronous callers can run coroutines on it.

    A caller interrupted while waiting (KeyboardInterrupt, timeout) cancels its coroutine, whose
    cleanup (aborting requests) then runs on the loop.
    """

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def run(self, coroutine):
        future = self.submit(coroutine)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()


class SGLangHTTP:
    """Requests to the servers of ``config`` (an SGLangEngineConfig) from synchronous code.

    ``run(coroutine)`` / ``submit(coroutine)`` execute on the loop thread; the coroutines below
    (``request``, ``on_all_servers``, ...) are meant to run there. Fan-outs go to the servers in
    rotation (``pool``, a :class:`ServerPool` with ``config.min_healthy``).
    """

    def __init__(self, config):
        self.config = config
        self.pool = ServerPool(config.server_urls, config.min_healthy)
        self._loop = _LoopThread("sglang-client")
        self._session = None

    def run(self, coroutine):
        """Run ``coroutine`` on the loop thread and return its result (blocking)."""
        return self._loop.run(coroutine)

    def submit(self, coroutine) -> concurrent.futures.Future:
        """Start ``coroutine`` on the loop thread; returns its future."""
        return self._loop.submit(coroutine)

    def call_soon(self, callback) -> None:
        """Run ``callback()`` on the loop thread soon (from any thread)."""
        self._loop.loop.call_soon_threadsafe(callback)

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread."""
        if self._session is not None:
            self._loop.run(self._session.close())
        self._loop.close()

    async def _get_session(self):
        """The shared aiohttp session, opened on first use (on the loop thread)."""
        if self._session is None:
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency + 8, force_close=False)
            # Servers and router launched with --api-key answer 401 to a request without it.
            key = getattr(self.config, "api_key", None)
            headers = {"Authorization": f"Bearer {key}"} if key else None
            self._session = aiohttp.ClientSession(connector=connector, headers=headers)
        return self._session

    async def request_once(self, method: str, url: str, payload, timeout: float):
        """One request, no retry: the decoded JSON (or text) answer; 4xx raises SGLangHTTPError."""
        session = await self._get_session()
        client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=self.config.connect_timeout_s)
        async with session.request(method, url, json=payload, timeout=client_timeout) as response:
            body = await response.read()
            text = body.decode("utf-8", errors="replace")
            if response.status >= 500:
                raise _ServerError(f"HTTP {response.status}: {text[:300]}")
            if response.status >= 400:
                raise SGLangHTTPError(method, url, response.status, text)
            if response.content_type == "application/json":
                return await response.json()
            return text

    async def request(
        self,
        method: str,
        url: str,
        payload=None,
        *,
        timeout: Optional[float] = None,
        retry: bool = True,
        before_retry: Optional[Callable[[], Any]] = None,
    ):
        """One request with retries on connection errors, timeouts and 5xx; raises ``RolloutError``."""
        attempts = 1 + (self.config.max_retries if retry else 0)
        last_error: BaseException = RolloutError("no attempt made")
        for attempt in range(attempts):
            try:
                return await self.request_once(method, url, payload, timeout or self.config.request_timeout_s)
            except RETRYABLE as err:
                last_error = err
                if attempt + 1 == attempts:
                    break
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2**attempt)
                delay *= 0.5 + random.random() / 2  # jitter: retries from many requests do not align
                logger.warning(
                    "%s %s failed (%r); retry %d/%d in %.2fs", method, url, err, attempt + 1, attempts - 1, delay
                )
                if before_retry is not None:
                    await before_retry()
                await asyncio.sleep(delay)
        raise RolloutError(f"{method} {url} failed after {attempts} attempt(s): {last_error!r}") from last_error

    async def on_all_servers(
        self, method: str, path: str, payload=None, *, payloads: Optional[Sequence] = None, **kwargs
    ) -> List[Any]:
        """The same request (or server i gets ``payloads[i]``) on every server in rotation, concurrently."""
        urls = self.pool.in_rotation()
        payloads = payloads if payloads is not None else [payload] * len(urls)
        return await asyncio.gather(
            *(self.request(method, url + path, body, **kwargs) for url, body in zip(urls, payloads))
        )

    async def get_first_served(self, url: str, paths: Sequence[str]) -> Any:
        """``GET`` on ``url`` the first of ``paths`` it serves (a 404 moves to the next path).

        For endpoints SGLang renamed between releases (see :mod:`megatron_zcpo.rollout.sglang.api`):
        the pinned release's name first, then the newer one.
        """
        for path in paths[:-1]:
            try:
                return await self.request("GET", url + path)
            except SGLangHTTPError as err:
                if err.status != 404:
                    raise
        return await self.request("GET", url + paths[-1])

    async def get_from_all_servers(self, paths: Sequence[str]) -> List[Any]:
        """:meth:`get_first_served` on every server in rotation."""
        return await asyncio.gather(*(self.get_first_served(url, paths) for url in self.pool.in_rotation()))

    async def on_servers_in_rotation(self, method: str, path: str, payload=None, **kwargs) -> Dict[str, Any]:
        """{url: answer} of the same request on every server in rotation; a server that fails it
        after its retries (not a 4xx answer) is taken out of rotation instead of failing the call
        (:class:`ServersLostError` when too few remain)."""
        urls = self.pool.in_rotation()
        answers = await asyncio.gather(
            *(self.request(method, url + path, payload, **kwargs) for url in urls), return_exceptions=True
        )
        for url, answer in zip(urls, answers):
            if isinstance(answer, SGLangHTTPError) or not isinstance(answer, Exception):
                continue
            if isinstance(answer, RolloutError):
                self.pool.take_out(url, f"{method} {path} failed: {answer}")
        for answer in answers:
            if isinstance(answer, BaseException) and not (
                isinstance(answer, RolloutError) and not isinstance(answer, SGLangHTTPError)
            ):
                raise answer
        return {url: answer for url, answer in zip(urls, answers) if not isinstance(answer, BaseException)}

    async def abort_quietly(self, rid: str) -> None:
        """Best effort: tell every server to drop request ``rid`` (it runs on one of them)."""

        async def abort(url):
            try:
                await self.request_once("POST", url + "/abort_request", {"rid": rid}, timeout=5.0)
            except Exception as err:
                logger.debug("abort of %s on %s failed: %r", rid, url, err)

        await asyncio.gather(*(abort(url) for url in self.pool.in_rotation()))
