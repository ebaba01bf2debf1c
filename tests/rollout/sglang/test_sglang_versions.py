"""Each SGLang release's protocol: weight-update sessions from 0.5.21, int32 seeds in 0.5.3.post3."""

import time

import pytest
import torch

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE, PINNED_RELEASE, SEED_LIMIT
from megatron_zcpo.rollout.sglang.client import SGLangEngine, SGLangEngineConfig, request_seed
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.utils.runtime import free_port
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

SESSION = ("/begin_weight_update", "/end_weight_update")


def _tensors(version):
    return [(f"w{i}", torch.full((50, 50), float(version + i))) for i in range(4)]


def _push_to_each_release(rank, world, ports):
    """Rank 0 pushes twice (versions 3 and 4, 10 kB buckets) by gloo broadcast to a 0.5.3.post3 server
    (rank 1) and a 0.5.23 server (rank 2) in one group; each server rank returns what it logged."""
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    if rank == 0:
        config = SGLangEngineConfig(server_urls=urls, group_backend="gloo", bucket_bytes=10_000, group_timeout_s=60)
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
            for version in (3, 4):
                engine.update_weights(_tensors(version), version=version)
            return engine.served_weight_versions()
    backend = ScriptedEngine()
    release = (PINNED_RELEASE, NEWEST_CHECKED_RELEASE)[rank - 1]
    with MockSGLangServer(backend, port=ports[rank - 1], release=release) as server:
        deadline = time.monotonic() + 90
        while ("/destroy_weights_update_group", "ok") not in server.events and time.monotonic() < deadline:
            time.sleep(0.05)
        return {
            "events": [path for path, detail in server.events if detail == "ok"],
            "refused": [event for event in server.events if event[1] != "ok"],
            "updates": [path for kind, path, _ in server.weight_updates if kind != "end"],
            "received": backend.received,
        }


def test_distributed_push_opens_a_session_on_servers_that_need_one():
    """0.5.23 (sessions since 0.5.21) gets begin .. buckets .. end around each push; 0.5.3.post3 gets
    neither (it has no such endpoints); both serve the pushed tensors."""
    served, pinned, newest = run_distributed(_push_to_each_release, 3, [free_port(), free_port()], timeout=180)
    assert set(served.values()) == {4}
    assert pinned["refused"] == [] and newest["refused"] == []
    assert not set(SESSION) & set(pinned["events"])
    buckets = [p for p in newest["updates"] if p == "/update_weights_from_distributed"]
    assert len(buckets) == pinned["updates"].count("/update_weights_from_distributed") > 2  # two pushes
    sessions = [p for p in newest["updates"] if p in SESSION or p == "/update_weights_from_distributed"]
    half = len(sessions) // 2  # two pushes, each: begin, its buckets, end
    for push in (sessions[:half], sessions[half:]):
        assert push[0] == SESSION[0] and push[-1] == SESSION[1] and SESSION[0] not in push[1:-1]
    for state in (pinned, newest):
        assert all(torch.equal(state["received"][name], t) for name, t in _tensors(4))


def test_newest_mock_refuses_a_bucket_outside_a_session():
    """What 0.5.21+ answers (read from its weight_updater.py): the client must open the session."""
    import json
    import urllib.error
    import urllib.request

    def post(url, body):
        request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    bucket = {"names": ["w"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"}
    with MockSGLangServer(ScriptedEngine(), release=NEWEST_CHECKED_RELEASE) as server:
        status, body = post(server.url + "/update_weights_from_distributed", bucket)
        assert status == 400 and "between begin_weight_update() and end_weight_update()" in body["message"]
        assert post(server.url + "/end_weight_update", {})[0] == 400
        assert post(server.url + "/begin_weight_update", {})[0] == 200
        assert post(server.url + "/begin_weight_update", {})[0] == 400  # one session at a time
        assert post(server.url + "/end_weight_update", {})[0] == 200
    with MockSGLangServer(ScriptedEngine()) as pinned:
        assert post(pinned.url + "/begin_weight_update", {})[0] == 404


def test_request_seeds_stay_below_int32_and_wrap():
    assert request_seed(5, 3) == 8
    assert request_seed(SEED_LIMIT - 1, 0) == SEED_LIMIT - 1
    assert request_seed(SEED_LIMIT - 1, 1) == 0
    assert request_seed(2**40, 7) == (2**40 + 7) % SEED_LIMIT


def test_a_round_seed_near_2_31_does_not_crash_a_pinned_server():
    """A round seed just below 2**31 (round_seed's range) plus the sample index crossed int32:
    0.5.3.post3's scheduler crashed on the packed seed and the server died."""
    backend = ScriptedEngine()
    params = SamplingParams(max_new_tokens=3, seed=SEED_LIMIT - 2)
    with (
        MockSGLangServer(backend, deterministic_inference=True) as server,
        SGLangEngine(_config(server.url, sampling_seeds=True, max_retries=0)) as engine,
    ):
        groups = engine.generate([[1, 2, 3]], params, n=4)
        assert server.crashed is None
        assert all(not c.info.get("rejected") and c.output_ids for c in groups[0])
    assert sorted(backend.seeds) == sorted([SEED_LIMIT - 2, SEED_LIMIT - 1, 0, 1])


def test_pinned_mock_crashes_on_a_seed_beyond_int32():
    import http.client
    import json
    import urllib.request

    body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2, "sampling_seed": SEED_LIMIT}}
    with MockSGLangServer(ScriptedEngine(), deterministic_inference=True) as server:
        request = urllib.request.Request(
            server.url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises((OSError, http.client.HTTPException)):
            urllib.request.urlopen(request, timeout=10)
        assert "int32" in server.crashed


def test_one_version_policy_setup_extra_docker_pins_and_docs_agree():
    """setup.py's sglang extra is the tested range, the image pins its newest pair, docs/SGLANG.md names both ends."""
    import re
    from pathlib import Path

    from megatron_zcpo.rollout.sglang.api import ROUTER_RELEASES

    root = Path(__file__).parents[3]
    setup = (root / "setup.py").read_text()
    assert f'"sglang>={PINNED_RELEASE},<={NEWEST_CHECKED_RELEASE}"' in setup
    assert f'"sglang-router>={ROUTER_RELEASES[0]},<={ROUTER_RELEASES[-1]}"' in setup
    docker = (root / "Dockerfile").read_text()
    assert re.search(r"^ARG SGLANG_VERSION=(\S+)", docker, re.M).group(1) == NEWEST_CHECKED_RELEASE
    assert re.search(r"^ARG SGLANG_ROUTER_VERSION=(\S+)", docker, re.M).group(1) == ROUTER_RELEASES[-1]
    table = (root / "docs" / "SGLANG.md").read_text()
    assert all(release in table for release in (PINNED_RELEASE, NEWEST_CHECKED_RELEASE, *ROUTER_RELEASES))


def test_start_up_check_refuses_routing_replay_on_a_server_without_routed_experts(caplog):
    with (
        MockSGLangServer(ScriptedEngine()) as pinned,
        SGLangEngine(_config(pinned.url, return_routed_experts=True)) as engine,
    ):
        with pytest.raises(RolloutError, match="return_routed_experts is true .* runs SGLang '0.5.3.post3'.*0.5.7"):
            engine.check_servers(8, 4)
    with (
        MockSGLangServer(ScriptedEngine(), release=NEWEST_CHECKED_RELEASE) as newest,
        SGLangEngine(_config(newest.url, return_routed_experts=True)) as engine,
    ):
        engine.check_servers(8, 4)
    assert "outside the tested range" not in caplog.text


def test_a_server_outside_the_tested_range_is_named_in_a_warning():
    from megatron_zcpo.rollout.sglang.server_checks import ServerFacts, untested_version

    def facts(version):
        return ServerFacts("http://s:1", 1, version, None, False, None)

    assert untested_version(facts(PINNED_RELEASE)) is None and untested_version(facts("0.5.23.post1")) is None
    assert "0.5.24" in untested_version(facts("0.5.24")) and "0.5.2" in untested_version(facts("0.5.2"))


@pytest.mark.parametrize("release", [PINNED_RELEASE, NEWEST_CHECKED_RELEASE])
def test_a_server_with_its_tokenizer_puts_prompt_tokens_in_front_before_0_5_4_post3(release):
    """Launched without --skip-tokenizer-init, 0.5.3.post3 answers output_ids behind up to 5 prompt tokens
    (the real one: tests/rollout/sglang/real/test_doubles.py): the start-up check refuses it naming the
    flag, and its answers would all be rejected. 0.5.23 answers the generated tokens alone."""
    with MockSGLangServer(ScriptedEngine(), release=release, skip_tokenizer_init=False) as server:
        with SGLangEngine(_config(server.url, max_rejected_fraction=1.0)) as engine:
            [[completion]] = engine.generate([[1, 2, 3, 4, 5, 6, 7]], SamplingParams(max_new_tokens=3))
            if release == PINNED_RELEASE:
                with pytest.raises(RolloutError, match="0.5.3.post3.* with its tokenizer.*--skip-tokenizer-init"):
                    engine.check_servers(8, 4)
                assert completion.output_ids == [] and "3 log-probs for 8 tokens" in completion.info["rejected"]
            else:
                engine.check_servers(8, 4)
                assert completion.output_ids == [8, 9, 10]
