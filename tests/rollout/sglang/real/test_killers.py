"""The requests that kill a real SGLang server (its scheduler raises: the request gets no answer, later ones find
nothing listening) kill the mock server alike, release by release. Each real one needs a server of its own
(they run after the release's other tests: the shared server, then spares started meanwhile).

| request | 0.5.3.post3 | 0.5.23 |
| --- | --- | --- |
| /resume_memory_occupation of a tag not released | dies (KeyError) | dies (the same code) |
| /release_memory_occupation while a request runs | 200: the request stops, the server serves on | dies (asserts an idle server) |
| /update_weights_from_tensor of tensors shared by file descriptor | dies (AuthenticationError) | dies |

Every killer is held against each release it kills (a server per kill); 0.5.3.post3's release while running is
held by the test after them (it survives). One more 0.5.23 server is stopped by the launcher instead: SIGINT stops
it (``SGLangLauncher.stop``; SIGTERM is blocked in servers a Slurm job starts).
"""

import base64
import io
import signal
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch

from megatron_zcpo.rollout.sglang.api import PINNED_RELEASE
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.real.raw import StreamingGenerate, call
from tests.rollout.sglang.test_sglang_client import ScriptedEngine


def descriptor_blob() -> str:
    """One flattened bucket pickled under torch's default sharing strategy: its storage travels as a descriptor."""
    flat = torch.zeros(4)
    bucket = {"flattened_tensor": flat, "metadata": []}
    buffer = io.BytesIO()
    ForkingPickler(buffer).dump(bucket)
    return base64.b64encode(buffer.getvalue()).decode()


def send(url, key, killer, release):
    """The answer to the killing request: (status, body), ("closed", ...) when the connection ends without one
    or ("timeout", ...) when none came within a minute."""
    if killer == "resume_unreleased":
        path, body = "/resume_memory_occupation", {"tags": ["kv_cache"]}
    elif killer == "release_while_running":
        path, body = "/release_memory_occupation", {}
    else:
        if release != PINNED_RELEASE:
            assert call(url, "/begin_weight_update", {}, key=key)[0] == 200  # 0.5.23 takes tensors in a session
        path, body = (
            "/update_weights_from_tensor",
            {"serialized_named_tensors": [descriptor_blob()], "load_format": "flattened_bucket"},
        )
    try:
        return call(url, path, body, key=key, timeout=60)
    except TimeoutError as err:
        return "timeout", repr(err)


def dead(server, timeout: float = 120.0) -> bool:
    """Whether the server stops listening within ``timeout`` (SGLang ends its processes 5 s after the
    scheduler died; its crash diagnostics may keep the last one a while longer: the test stops it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if call(server.url, "/get_model_info", key=server.api_key, timeout=10)[0] == "closed":
                return True
        except TimeoutError:  # accepted but not answered: dying
            pass
        time.sleep(1.0)
    return False


KILLERS = [
    (PINNED_RELEASE, "resume_unreleased"),
    (PINNED_RELEASE, "tensor_by_descriptor"),
    ("0.5.23", "resume_unreleased"),
    ("0.5.23", "tensor_by_descriptor"),
    ("0.5.23", "release_while_running"),
    ("0.5.23", "launcher_stop"),
]


@pytest.mark.kills_server
@pytest.mark.parametrize("release,killer", KILLERS, indirect=["release"])
def test_a_killing_request_kills_the_real_server_and_the_mock(shared_servers, release, killer):
    """No answer (0.5.23's release hangs until the server is gone), then nothing listens; "launcher_stop": the
    launcher's SIGINT stops the server within its grace time (not SIGKILLed), nothing listens."""
    server = shared_servers.victim(release)
    if killer == "launcher_stop":
        start = time.monotonic()
        server.stop()  # SIGINT, SIGKILL after 10 s
        codes = [process.returncode for process in server.launcher.processes.values()]
        assert -signal.SIGKILL not in codes and time.monotonic() - start < 10, (codes, server.log_tail())
        assert call(server.url, "/get_model_info", key=server.api_key)[0] == "closed"
        return
    try:
        if killer == "release_while_running":
            running = StreamingGenerate(server.url, server.api_key, [2, 2])
            running.start()
            running.wait_running()
        real = send(server.url, server.api_key, killer, release)
        assert real[0] in ("closed", "timeout") and dead(server), (real, server.log_tail())
    finally:
        server.stop()
    with MockSGLangServer(ScriptedEngine(), release=release) as mock:
        if killer == "release_while_running":
            mock.running_rids.add("running")
        assert send(mock.url, None, killer, release)[0] == "closed" and mock.crashed
        assert call(mock.url, "/flush_cache", {})[0] == "closed"


def test_a_release_while_a_request_runs_is_answered_by_the_pinned_release(real_server, release):
    """0.5.3.post3 survives it: the release answers and generation goes on once resumed (the running request
    ran on to its end in one try, stopped unfinished in another; the mock lets it run)."""
    if release != PINNED_RELEASE:
        pytest.skip("kills 0.5.23 (test_a_killing_request_kills_the_real_server_and_the_mock)")
    running = StreamingGenerate(real_server.url, real_server.api_key, [2, 2])
    running.start()
    running.wait_running()
    try:
        real = call(real_server.url, "/release_memory_occupation", {}, key=real_server.api_key)
    finally:
        resumed = call(real_server.url, "/resume_memory_occupation", {}, key=real_server.api_key)
    running.join(120)
    assert real == resumed == (200, None) and real_server.alive()
    with MockSGLangServer(ScriptedEngine(), release=release) as mock:
        mock.running_rids.add("running")
        assert call(mock.url, "/release_memory_occupation", {}) == real and mock.running_rids == {"running"}
        assert call(mock.url, "/resume_memory_occupation", {}) == resumed
