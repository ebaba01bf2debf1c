"""The mock server and router behave like SGLang 0.5.3.post3 and sglang-router 0.2.0 where a run depends on
it, and the client checks the servers at start-up: API key, context length, seeds, load format, one weight
update at a time, the router's timeout; a lost request costs its prompt's group, not the call."""

import threading
import time

import pytest

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, required_context_length
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.rollout.weight_sync import init_custom_process_group
from megatron_zcpo.testing.mock_router import MockSGLangRouter
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.utils.runtime import free_port
from tests.rollout.sglang.test_sglang_api import _http
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config


def _until(condition, what, timeout=60.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_api_key_guards_every_endpoint_but_health_and_a_wrong_key_stops_the_start(monkeypatch):
    with MockSGLangServer(ScriptedEngine(), api_key="s3cret") as server:
        for method, path, body in (
            ("GET", "/get_server_info", None),
            ("GET", "/get_model_info", None),
            ("POST", "/generate", {"input_ids": [1]}),
            ("POST", "/flush_cache", None),
            ("POST", "/abort_request", {"abort_all": True}),
            ("GET", "/no_such_path", None),
        ):
            assert _http(method, server.url + path, body)[0] == 401, path
        assert _http("GET", server.url + "/health_generate", None)[0] == 200  # SGLang exempts /health*
        with SGLangEngine(_config(server.url, api_key="wrong")) as engine:
            with pytest.raises(
                RolloutError,
                match=f"{server.url} refused the API key \\(HTTP 401\\): set "
                "rollout.sglang.client.api_key \\(or the environment variable "
                "ZCPO_SGLANG_API_KEY\\)",
            ):
                engine.check_servers(8, 4)
        monkeypatch.setenv("ZCPO_SGLANG_API_KEY", "s3cret")  # the default of rollout.sglang.client.api_key
        with SGLangEngine(_config(server.url)) as engine:
            assert [fact.url for fact in engine.check_servers(8, 4)] == [server.url]
            assert engine.generate([[1, 2]], SamplingParams(max_new_tokens=2))[0][0].output_ids == [3, 4]


def test_context_length_refuses_what_does_not_fit_and_the_start_up_check_names_both_numbers():
    with MockSGLangServer(ScriptedEngine(), context_length=400) as server:
        body = {"input_ids": list(range(300)), "sampling_params": {"max_new_tokens": 100}}
        status, payload = _http("POST", server.url + "/generate", body)
        assert status == 400 and b"maximum context length of 400 tokens" in payload  # 300 + 100 >= 400
        with SGLangEngine(_config(server.url)) as engine:
            # 300 + 99 passes SGLang's check but the scheduler cuts the response to 98 tokens
            [[cut]] = engine.generate([list(range(1, 301))], SamplingParams(max_new_tokens=99))
            assert len(cut.output_ids) == 98 == 400 - 2 - 300
            with pytest.raises(
                RolloutError,
                match=r"serves at most 398 prompt \+ new tokens, but data.max_prompt_length "
                r"\+ rollout.max_new_tokens = 300 \+ 99 = 399.*--context-length >= 401",
            ):
                engine.check_servers(300, 99)
            engine.check_servers(300, 98)
    # what the launchers pass: a prompt of exactly max_prompt_length gets all max_new_tokens
    with (
        MockSGLangServer(ScriptedEngine(), context_length=required_context_length(300, 99)) as server,
        SGLangEngine(_config(server.url)) as engine,
    ):
        engine.check_servers(300, 99)
        assert len(engine.generate([list(range(1, 301))], SamplingParams(max_new_tokens=99))[0][0].output_ids) == 99


@pytest.mark.parametrize(
    "deterministic,sampling_seeds,problem",
    [
        (False, True, "sampling_seeds is true but .* was not launched with --enable-deterministic-inference"),
        (True, False, "runs with --enable-deterministic-inference but rollout.sglang.client.sampling_seeds is false"),
        (True, True, None),
    ],
)
def test_seeds_need_deterministic_servers(deterministic, sampling_seeds, problem):
    with (
        MockSGLangServer(ScriptedEngine(), deterministic_inference=deterministic) as server,
        SGLangEngine(_config(server.url, sampling_seeds=sampling_seeds)) as engine,
    ):
        if problem:
            with pytest.raises(RolloutError, match=problem):
                engine.check_servers(8, 4)
        else:
            engine.check_servers(8, 4)


def test_flattened_buckets_are_refused_by_a_server_without_the_load_format():
    with (
        MockSGLangServer(ScriptedEngine()) as pinned,
        SGLangEngine(_config(pinned.url, flattened_buckets=True)) as engine,
    ):
        with pytest.raises(
            RolloutError, match="flattened_buckets is true but .* runs SGLang '0.5.3.post3'.*from 0.5.6 on"
        ):
            engine.check_servers(8, 4)
    with (
        MockSGLangServer(ScriptedEngine(), release=NEWEST_CHECKED_RELEASE) as newest,
        SGLangEngine(_config(newest.url, flattened_buckets=True)) as engine,
    ):
        engine.check_servers(8, 4)


def _join_as_trainer(ports, go):
    """The trainer's end (rank 0) of groups A then B, each once the test says go (another process: one
    group name is registered once per process)."""
    import torch.distributed as dist

    for name in ("A", "B"):
        go[name].wait()
        dist.destroy_process_group(init_custom_process_group("gloo", "127.0.0.1", ports[name], 0, 2, name))


def test_weight_updates_are_served_one_at_a_time():
    """Group A's first request blocks the server (its members have not all joined); group B's waits
    behind it and starts only once A's is done, as in SGLang."""
    import multiprocessing

    ports = {"A": free_port(), "B": free_port()}
    init = "/init_weights_update_group"
    context = multiprocessing.get_context("spawn")
    go = {"A": context.Event(), "B": context.Event()}
    trainer = context.Process(target=_join_as_trainer, args=(ports, go), daemon=True)
    trainer.start()
    with MockSGLangServer(ScriptedEngine()) as server:

        def request(group):
            body = {
                "master_address": "127.0.0.1",
                "master_port": ports[group],
                "rank_offset": 1,
                "world_size": 2,
                "group_name": group,
                "backend": "gloo",
            }
            threading.Thread(target=_http, args=("POST", server.url + init, body), daemon=True).start()

        request("A")
        _until(lambda: ("start", init, "A") in server.weight_updates, "group A's request to start")
        request("B")
        _until(lambda: server.events.count((init, "ok")) == 2, "group B's request to arrive")
        assert server.weight_updates == [("start", init, "A")]  # B waits behind A
        go["A"].set()
        _until(lambda: ("start", init, "B") in server.weight_updates, "group B's request to start")
        go["B"].set()
        _until(lambda: len(server.weight_updates) == 4, "group B's request to end")
        assert server.weight_updates == [
            ("start", init, "A"),
            ("end", init, "A"),
            ("start", init, "B"),
            ("end", init, "B"),
        ]
        assert server.update_overlaps == [("B", "A")]
    trainer.join(timeout=60)
    assert trainer.exitcode == 0


def _post(url, body, key=None):
    """(status, body) of a JSON POST with an optional bearer key."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_router_cuts_requests_at_its_timeout_and_retries_them_without_abort():
    with (
        MockSGLangServer(ScriptedEngine(), generate_delay_s=60.0, api_key="k") as slow,
        MockSGLangRouter([slow.url], request_timeout_secs=0.2, api_key="k", max_attempts=2) as router,
    ):
        assert _post(router.url + "/generate", {"input_ids": [1]})[0] == 401
        assert _http("GET", router.url + "/readiness", None)[0] == 200  # a public route
        assert _http("GET", router.url + "/health_generate", None)[0] == 503  # 0.2.0's own answer, always
        status, payload = _post(router.url + "/generate", {"input_ids": [1]}, key="k")
        assert status == 500 and b"Request failed" in payload
        assert router.events[-1] == ("/generate", "500 after 2 attempts")
        _until(lambda: slow.events.count(("/generate", "ok")) == 2, "both attempts to reach the worker")
        assert not slow.aborted_rids  # the cut requests still run on the worker
    # so the client, which aborts and retries, must give up first
    with pytest.raises(
        ValueError, match=r"router_timeout_s=1800 must exceed rollout.sglang.client.request_timeout_s=3600"
    ):
        _config("http://a:1", router_url="http://r:2", request_timeout_s=3600.0).validate()


def test_through_the_router_a_lost_request_costs_its_prompt_not_the_call():
    with (
        MockSGLangServer(ScriptedEngine()) as server,
        MockSGLangServer(ScriptedEngine(), faults={"/generate": ["503", "503"]}) as failing_router,
    ):
        config = _config(
            server.url, router_url=failing_router.url, max_retries=0, max_concurrency=1, max_rejected_fraction=0.5
        )
        with SGLangEngine(config) as engine:
            groups = engine.generate([[1], [2], [3], [4]], SamplingParams(max_new_tokens=2))
            assert groups[0][0].finish_reason == "abort" and "request 0 lost" in groups[0][0].info["rejected"]
            assert [g[0].output_ids for g in groups[1:]] == [[3, 4], [4, 5], [5, 6]] and engine.rejected_samples == 1
