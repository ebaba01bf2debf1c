"""SGLang's HTTP API table (rollout/sglang/api.py): the mock refuses what SGLang refuses, the client speaks both releases."""

import json
import os
import socket
import urllib.error
import urllib.request

import pytest

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE, check_request
from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.utils import network
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config, _named_tensors

GROUP = {
    "master_address": "127.0.0.1",
    "master_port": 1,
    "rank_offset": 1,
    "world_size": 2,
    "group_name": "g",
    "backend": "gloo",
}


def _http(method, url, body):
    """(status code, body bytes) of one request with an optional JSON body, errors included."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


@pytest.mark.parametrize(
    "method,path,body,status,named",
    [
        ("GET", "/model_info", None, 404, "/model_info"),  # only in newer releases
        ("GET", "/no_such_endpoint", None, 404, "/no_such_endpoint"),
        ("GET", "/generate", None, 405, "GET /generate"),
        (
            "POST",
            "/init_weights_update_group",
            {k: v for k, v in GROUP.items() if k != "master_port"},
            400,
            "missing: master_port",
        ),
        ("POST", "/init_weights_update_group", {**GROUP, "master_port": "29500"}, 400, "wrong type: master_port"),
        ("POST", "/init_weights_update_group", {**GROUP, "master_addr": "h"}, 400, "unknown: master_addr"),
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2, "3"]]},
            400,
            "wrong type: shapes",
        ),
        (
            "POST",
            "/update_weights_from_distributed",
            {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "weight_version": 3},
            400,
            "wrong type: weight_version",
        ),
        (
            "POST",
            "/generate",
            {"input_ids": [1], "sampling_params": {"top_k": 0.5}},
            400,
            "wrong type: sampling_params.top_k",
        ),
        ("POST", "/update_weights_from_disk", {"weight_version": "1"}, 400, "missing: model_path"),
    ],
)
def test_mock_refuses_like_sglang(method, path, body, status, named):
    assert check_request(method, path, body)[0] == status
    with MockSGLangServer(ScriptedEngine()) as server:
        status_code, payload = _http(method, server.url + path, body)
        assert status_code == status
        if status == 400:  # SGLang's validation error (FastAPI's 422, answered as 400)
            assert named in json.loads(payload)["message"]
        assert server.events == [(path, str(status))]


@pytest.mark.parametrize(
    "release,sampling,status,answer",
    [
        (PINNED_RELEASE, {"seed": 3}, 500, "Internal Server Error"),  # its SamplingParams raises a TypeError
        (NEWEST_CHECKED_RELEASE, {"seed": 3}, 400, "unknown field `seed`"),  # its JSON contract
        (PINNED_RELEASE, {"sampling_seed": None}, 400, "sampling_seed should not be None"),
        (NEWEST_CHECKED_RELEASE, {"sampling_seed": None}, 200, "output_ids"),  # the default seed
    ],
)
def test_mock_answers_sampling_params_as_each_release(release, sampling, status, answer):
    with MockSGLangServer(ScriptedEngine(), release=release) as server:
        status_code, payload = _http("POST", server.url + "/generate", {"input_ids": [1], "sampling_params": sampling})
    assert status_code == status and answer in payload.decode()


def test_releases_differ_where_sglang_moved_endpoints():
    assert check_request("GET", "/get_weight_version", None, PINNED_RELEASE) is None
    assert check_request("GET", "/get_weight_version", None, NEWEST_CHECKED_RELEASE)[0] == 404
    for path in ("/model_info", "/server_info"):
        assert check_request("GET", path, None, PINNED_RELEASE)[0] == 404
        assert check_request("GET", path, None, NEWEST_CHECKED_RELEASE) is None
    for path in ("/get_model_info", "/get_server_info", "/health_generate"):
        assert check_request("GET", path, None, PINNED_RELEASE) is None
        assert check_request("GET", path, None, NEWEST_CHECKED_RELEASE) is None


@pytest.mark.parametrize("release", [PINNED_RELEASE, NEWEST_CHECKED_RELEASE])
def test_client_speaks_both_releases_without_a_refused_request(release, tmp_path):
    backend = ScriptedEngine()
    with (
        MockSGLangServer(backend, release=release) as server,
        SGLangEngine(_config(server.url, weight_sync="disk", weight_dir=str(tmp_path))) as engine,
    ):
        engine.wait_until_healthy(timeout_s=10, poll_s=0.05)
        assert engine.weight_version() == -1  # SGLang's initial "default"
        engine.update_weights(_named_tensors(0), version=4)
        assert engine.weight_version() == 4
        assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=3, seed=5))[0][0].weight_version == 4
        engine.abort_all()
        refused = [event for event in server.events if event[1] not in ("ok",)]
        assert refused == []
        # The weight version is read where both releases serve it.
        assert ("/get_model_info", "ok") in server.events and ("/get_weight_version", "ok") not in server.events
    assert os.path.isdir(tmp_path / "weights-v4")


def test_weight_push_refuses_a_loopback_master_for_remote_servers_before_any_request(monkeypatch):
    """The Debian /etc/hosts case: this host's name is 127.0.1.1 and the route says loopback too."""

    def getaddrinfo(host, port, *args, **kwargs):
        assert host == "gpu-node-7", host  # nothing else is resolved, nothing is connected to
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.1.0.7", port))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    monkeypatch.setattr(network, "route_source_address", lambda family, ip, port: "127.0.1.1")
    config = SGLangEngineConfig(server_urls=["http://gpu-node-7:30000"], group_backend="gloo", max_retries=0)
    with SGLangEngine(config) as engine:
        with pytest.raises(RolloutError, match=r"127\.0\.1\.1.*loopback.*rollout\.sglang\.client\.master_address"):
            engine.update_weights(_named_tensors(), version=1)
