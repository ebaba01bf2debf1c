"""Raw HTTP to a server (real or mock) for the tests of this folder: one request, and a streaming /generate
whose first chunks prove that the scheduler runs it."""

import json
import threading
import urllib.error
import urllib.request
from typing import Any, Dict, List, Optional, Tuple


def call(
    url: str,
    path: str,
    body: Any = None,
    *,
    key: Optional[str] = None,
    method: Optional[str] = None,
    timeout: float = 120.0,
) -> Tuple[Any, Any]:
    """(status, decoded JSON or text) of one request; status "closed" when the connection ends without an
    answer or is refused (a dead server)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(
        url + path, data=data, headers=headers, method=method or ("POST" if data else "GET")
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, payload = answer.status, answer.read()
    except urllib.error.HTTPError as err:
        status, payload = err.code, err.read()
    except (ConnectionError, urllib.error.URLError) as err:
        if isinstance(err, urllib.error.URLError) and not isinstance(err.reason, ConnectionError):
            raise
        return "closed", repr(err)
    text = payload.decode("utf-8", errors="replace")
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


class StreamingGenerate(threading.Thread):
    """A streaming ``/generate`` of ``max_new_tokens`` greedy tokens after ``prompt``; :meth:`wait_running`
    returns once ``chunks`` chunks arrived (the request is in the scheduler's running batch); ``final`` is
    the last chunk (its ``meta_info.finish_reason`` says how it ended)."""

    def __init__(self, url: str, key: Optional[str], prompt: List[int], max_new_tokens: int = 100):
        super().__init__(daemon=True)
        self.url, self.key = url, key
        self.body = {
            "input_ids": prompt,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            "stream": True,
        }
        self.chunks: List[Dict[str, Any]] = []
        self._arrived = threading.Condition()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {self.key}"} if self.key else {})}
        request = urllib.request.Request(self.url + "/generate", json.dumps(self.body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                for line in answer:
                    line = line.strip()
                    if line.startswith(b"data:") and line != b"data: [DONE]":
                        with self._arrived:
                            self.chunks.append(json.loads(line[5:]))
                            self._arrived.notify_all()
        except BaseException as err:  # reported by the test that waits
            self.error = err
        finally:
            with self._arrived:
                self._arrived.notify_all()

    def wait_running(self, chunks: int = 2, timeout: float = 300.0) -> None:
        with self._arrived:
            self._arrived.wait_for(lambda: len(self.chunks) >= chunks or not self.is_alive(), timeout)
        assert len(self.chunks) >= chunks, f"the streaming request did not run: {self.error!r}"

    @property
    def final(self) -> Dict[str, Any]:
        self.join(600)
        assert self.chunks, f"no chunk: {self.error!r}"
        return self.chunks[-1]
