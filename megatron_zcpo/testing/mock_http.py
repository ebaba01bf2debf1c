"""The lifecycle the mock SGLang server and router share: one aiohttp app in a background thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Optional


class BackgroundHTTPServer:
    """Serve every request of ``host:port`` (0: any free port) with ``self._dispatch(request)``
    (a coroutine subclasses define) on an event loop of its own thread; ``_close()`` (a coroutine)
    runs on that loop when it stops."""

    thread_name = "mock-http"

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._started = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> str:
        """Start serving; returns the base URL."""
        self._thread = threading.Thread(target=self._serve, name=self.thread_name, daemon=True)
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise RuntimeError(f"{self.thread_name} did not start within 30s")
        return self.url

    def stop(self) -> None:
        """Stop serving (requests still pending, e.g. hanging ones, are cancelled)."""
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _dispatch(self, request):
        raise NotImplementedError

    async def _close(self) -> None:
        """Subclasses' clean-up on the loop (open client sessions)."""

    def _serve(self) -> None:
        from aiohttp import web

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        app = web.Application(client_max_size=2**30)
        app.router.add_route("*", "/{path:.*}", self._dispatch)
        runner = web.AppRunner(app, shutdown_timeout=0.5)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, self.host, self.port)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.run_until_complete(self._close())
        leftovers = asyncio.all_tasks(self._loop)  # e.g. "hang" handlers
        for task in leftovers:
            task.cancel()
        self._loop.run_until_complete(asyncio.gather(*leftovers, return_exceptions=True))
        self._loop.close()
