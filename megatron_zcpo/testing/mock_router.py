"""A local stand-in for sglang-router 0.2.0 in front of SGLang servers (tests, CPU smoke runs).

It behaves like the pinned router where a run depends on it (see
:mod:`megatron_zcpo.rollout.sglang.api`): ``/generate`` goes to one worker after another (round
robin) and is cut after ``request_timeout_secs`` (``--request-timeout-secs``, default 1,800 s),
answering 500; a retryable answer (500, 503, ...) is retried on the next worker, up to 5
attempts in all, without aborting the cut request on its worker. With ``api_key`` (``--api-key``)
``/generate`` and the admin routes (``/list_workers``, ``/workers``, ``/flush_cache``) need it (401
otherwise), the public routes (server and model info, proxied to the first worker) do not, and
every request to a worker carries it. Its own routes answer as 0.2.0's do: ``/health`` 200,
``/readiness`` 200 with the worker count, ``/health_generate`` 503 "No routers with healthy
workers available" (without asking a worker). The real routers run in the tests too
(:mod:`megatron_zcpo.testing.real_sglang`); this stand-in adds timeouts and fault counts.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from typing import List, Optional

from megatron_zcpo.rollout.sglang.api import (
    ROUTER_DEFAULT_REQUEST_TIMEOUT_S,
    ROUTER_MAX_ATTEMPTS,
    ROUTER_PUBLIC_PATHS,
    ROUTER_RETRYABLE_STATUSES,
    needs_api_key,
)
from megatron_zcpo.testing.mock_http import BackgroundHTTPServer

_ADMIN = {"/list_workers": ("GET",), "/workers": ("GET",), "/flush_cache": ("POST",)}


class MockSGLangRouter(BackgroundHTTPServer):
    """Route to ``worker_urls`` from ``host:port`` (0: any free port) in a background thread.

    ``events`` records (path, detail) of every request: "ok", "401", "404", or for /generate the
    status answered after ``attempts`` tries ("500 after 5 attempts").
    """

    thread_name = "mock-sglang-router"

    def __init__(
        self,
        worker_urls: List[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        request_timeout_secs: float = ROUTER_DEFAULT_REQUEST_TIMEOUT_S,
        api_key: Optional[str] = None,
        max_attempts: int = ROUTER_MAX_ATTEMPTS,
    ):
        if not worker_urls:
            raise ValueError("the router needs at least one worker URL")
        super().__init__(host, port)
        self.worker_urls = list(worker_urls)
        self.request_timeout_secs, self.api_key, self.max_attempts = request_timeout_secs, api_key, max_attempts
        self.events: List[tuple] = []
        self._next = itertools.cycle(range(len(self.worker_urls)))
        self._session = None  # opened on the loop by the first forwarded request

    async def _close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _worker_headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    async def _dispatch(self, request):
        from aiohttp import web

        path = request.path
        if (
            self.api_key is not None
            and needs_api_key(request.method, path, router=True)
            and request.headers.get("Authorization") != f"Bearer {self.api_key}"
        ):
            self.events.append((path, "401"))
            return web.Response(status=401)
        if path == "/generate" and request.method == "POST":
            return await self._generate(await request.read())
        if path in ("/health", "/liveness") and request.method == "GET":
            return web.Response(status=200, text="OK")
        if path == "/readiness" and request.method == "GET":
            workers = len(self.worker_urls)
            return web.json_response({"status": "ready", "healthy_workers": workers, "total_workers": workers})
        if path == "/health_generate" and request.method == "GET":  # 0.2.0 answers it itself, always
            return web.Response(status=503, text="No routers with healthy workers available")
        if path in ROUTER_PUBLIC_PATHS and request.method == "GET":
            self.events.append((path, "ok"))
            return await self._forward("GET", self.worker_urls[0] + path, None, timeout=self.request_timeout_secs)
        if request.method in _ADMIN.get(path, ()):
            self.events.append((path, "ok"))
            if path == "/list_workers":
                return web.json_response({"urls": self.worker_urls})
            if path == "/workers":
                return web.json_response({"workers": [{"url": url, "is_healthy": True} for url in self.worker_urls]})
            answers = [
                await self._forward("POST", url + path, None, timeout=self.request_timeout_secs)
                for url in self.worker_urls
            ]
            return web.json_response({"flushed": [a.status == 200 for a in answers]})
        self.events.append((path, "404"))
        return web.Response(status=404, text="Not Found")

    async def _generate(self, body: bytes):
        """Forward to the next worker; on a retryable answer (a cut included) to the one after."""
        answer = None
        for attempt in range(1, self.max_attempts + 1):
            url = self.worker_urls[next(self._next)]
            answer = await self._forward("POST", url + "/generate", body, timeout=self.request_timeout_secs)
            if answer.status not in ROUTER_RETRYABLE_STATUSES:
                break
            await asyncio.sleep(0.05 * 2 ** (attempt - 1))
        self.events.append(("/generate", "ok" if answer.status == 200 else f"{answer.status} after {attempt} attempts"))
        return answer

    async def _forward(self, method: str, url: str, body: Optional[bytes], timeout: float):
        """The worker's answer to one request, or 500 "Request failed" when it is cut or fails."""
        import aiohttp
        from aiohttp import web

        headers = {**self._worker_headers(), **({"Content-Type": "application/json"} if body else {})}
        if self._session is None:
            self._session = aiohttp.ClientSession()
        try:
            async with self._session.request(
                method, url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as answer:
                return web.Response(status=answer.status, body=await answer.read(), content_type=answer.content_type)
        except (TimeoutError, aiohttp.ClientError) as error:
            return web.Response(status=500, text=f"Request failed: {error!r}")


def main(argv: Optional[List[str]] = None) -> None:
    """``python -m megatron_zcpo.testing.mock_router --worker-urls URL ... [--request-timeout-secs S]
    [--api-key KEY]``: a CPU stand-in for ``sglang_router.launch_router`` (its other arguments are
    accepted and ignored) until terminated."""
    import argparse
    import signal

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=29000)
    parser.add_argument("--worker-urls", nargs="+", required=True)
    parser.add_argument("--request-timeout-secs", type=float, default=ROUTER_DEFAULT_REQUEST_TIMEOUT_S)
    parser.add_argument("--api-key", default=None)
    args, _ = parser.parse_known_args(argv)
    router = MockSGLangRouter(
        args.worker_urls,
        host=args.host,
        port=args.port,
        request_timeout_secs=args.request_timeout_secs,
        api_key=args.api_key,
    )
    router.start()
    stopped = threading.Event()
    for stop_signal in (signal.SIGTERM, signal.SIGINT):  # as SGLang (uvicorn) and the router stop on either
        signal.signal(stop_signal, lambda *_: stopped.set())
    stopped.wait()
    router.stop()


if __name__ == "__main__":
    main()
