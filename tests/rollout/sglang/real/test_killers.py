"""The requests that kill a real SGLang server (its scheduler raises: the request gets no answer, later ones find
nothing listening) kill the mock server alike, release by release. Each real one needs a server of its own
(they run after the release's other tests: the shared server, then spares started meanwhile).

| request | 0.5.3.post3 | 0.5.23 |
| --- | --- | --- |
| /resume_memory_occupation of a tag not released | dies (KeyError) | dies (the same code) |
| /release_memory_occupation while a request runs | 200: the request stops, the server serves on | dies (asserts an idle server) |
| /update_weights_from_tensor of tensors shared by file descriptor | dies (AuthenticationError) | dies |

0.5.23's resume of a tag not released runs the same line as 0.5.3.post3's (``offload_tags.remove(tag)``) and was
seen to kill it (2026-12-05); it is not started again here for the suite's time.
"""

import base64
import io
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


def send(url, key, killer, release, running=None):
    """(status of the killing request, status of a /flush_cache after it); ``running``: a request in flight."""
    if killer == "resume_unreleased":
        answer = call(url, "/resume_memory_occupation", {"tags": ["kv_cache"]}, key=key, timeout=60)
    elif killer == "release_while_running":
        answer = call(url, "/release_memory_occupation", {}, key=key, timeout=60)
    else:
        if release != PINNED_RELEASE:
            assert call(url, "/begin_weight_update", {}, key=key)[0] == 200  # 0.5.23 takes tensors in a session
        body = {"serialized_named_tensors": [descriptor_blob()], "load_format": "flattened_bucket"}
        answer = call(url, "/update_weights_from_tensor", body, key=key, timeout=60)
    return answer[0], call(url, "/flush_cache", {}, key=key, timeout=60)[0]


KILLERS = [
    (PINNED_RELEASE, "resume_unreleased"),
    (PINNED_RELEASE, "tensor_by_descriptor"),
    ("0.5.23", "release_while_running"),
    ("0.5.23", "tensor_by_descriptor"),
]


@pytest.mark.kills_server
@pytest.mark.parametrize("release,killer", KILLERS, indirect=["release"])
def test_a_killing_request_kills_the_real_server_and_the_mock(shared_servers, release, killer):
    server = shared_servers.victim(release)
    running = None
    if killer == "release_while_running":
        running = StreamingGenerate(server.url, server.api_key, [2, 2])
        running.start()
        running.wait_running()
    try:
        real = send(server.url, server.api_key, killer, release)
        assert real == ("closed", "closed") and not server.alive(), server.log_tail()
    finally:
        server.stop()
    with MockSGLangServer(ScriptedEngine(), release=release) as mock:
        if running is not None:
            mock.running_rids.add("running")
        assert send(mock.url, None, killer, release) == real
        assert mock.crashed


def test_a_release_while_a_request_runs_stops_it_on_the_pinned_release(real_server, release):
    """0.5.3.post3 survives it: the release answers, the running request stops, generation goes on."""
    if release != PINNED_RELEASE:
        pytest.skip("kills 0.5.23 (test_a_killing_request_kills_the_real_server_and_the_mock)")
    running = StreamingGenerate(real_server.url, real_server.api_key, [2, 2])
    running.start()
    running.wait_running()
    real = call(real_server.url, "/release_memory_occupation", {}, key=real_server.api_key)
    running.join(120)
    assert real == (200, None) and running.chunks[-1]["meta_info"]["finish_reason"] is None  # cut off
    assert call(real_server.url, "/resume_memory_occupation", {}, key=real_server.api_key) == (200, None)
    with MockSGLangServer(ScriptedEngine(), release=release) as mock:
        mock.running_rids.add("running")
        assert call(mock.url, "/release_memory_occupation", {}) == real and not mock.running_rids
        assert call(mock.url, "/resume_memory_occupation", {}) == real
