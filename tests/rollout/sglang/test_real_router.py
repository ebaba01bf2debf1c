"""The client through the real sglang-router binaries (the Dockerfile's 0.2.0 and the newest, 0.3.2) on CPU.

Each release is pip-installed once into the test cache (:mod:`megatron_zcpo.testing.real_sglang`) and
run in front of mock SGLang servers; without a registry the tests skip, naming the package.
"""

import pytest
import torch

from megatron_zcpo.rollout.engine import Completion, RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang.api import NEWEST_CHECKED_RELEASE
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.testing.mock_server import MockSGLangServer
from megatron_zcpo.testing.real_sglang import ROUTER_RELEASES, PackageUnavailable, RealRouter, router_package
from megatron_zcpo.utils.runtime import free_port
from tests.rollout.sglang.test_sglang_client import ScriptedEngine, _config

KEY = "router-test-key"


@pytest.fixture(scope="module", params=ROUTER_RELEASES)
def router_release(request):
    try:
        router_package(request.param)
    except PackageUnavailable as error:
        pytest.skip(f"sglang-router {request.param} could not be installed: {error}")
    return request.param


class RoutedExpertsEngine(ScriptedEngine):
    """ScriptedEngine whose completions carry routed experts (2 layers x top-1: the token ids)."""

    def generate(self, prompts, params, n=1):
        groups = super().generate(prompts, params, n)
        return [
            [
                Completion(c.prompt_ids, c.output_ids, c.output_logprobs, c.finish_reason, routed_experts=routed)
                for c in group
                for routed in [torch.tensor(c.prompt_ids + c.output_ids[:-1]).repeat_interleave(2).view(-1, 2)]
            ]
            for group in groups
        ]


def test_health_wait_key_check_and_rollout_through_the_router(router_release):
    """The start-up path of a job: wait for servers and router, check the key, generate through it.
    Router 0.2.0 answers its own /health_generate with 503 (the wait used to time out); 0.3.2 has
    no /list_workers (the key check used to pass without checking)."""
    with (
        MockSGLangServer(ScriptedEngine(), api_key=KEY) as first,
        MockSGLangServer(ScriptedEngine(), api_key=KEY) as second,
        RealRouter(router_release, [first.url, second.url], free_port(), api_key=KEY) as router,
    ):
        urls = dict(server_urls=[first.url, second.url], router_url=router.url)
        with SGLangEngine(_config(first.url, **urls, api_key="not-the-key")) as wrong:
            with pytest.raises(RolloutError, match=f"{router.url} refused the API key"):
                wrong.check_servers(8, 4)
        with SGLangEngine(_config(first.url, **urls, api_key=KEY)) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)  # returns once healthy; 60 s for a loaded CI machine
            engine.check_servers(8, 4)
            groups = engine.generate([[5, 6], [7, 8]], SamplingParams(max_new_tokens=3), n=2)
        assert [c.output_ids for c in groups[0]] == [[7, 8, 9]] * 2
        assert all(url.startswith(router.url) for group in groups for c in group for url in [c.info["server"]])
        served = [path for server in (first, second) for path, detail in server.events if detail == "ok"]
        assert served.count("/generate") == 4  # the mock's schema check took the router's rebuilt bodies


def test_routing_replay_requests_bypass_the_router(router_release):
    """Both routers drop return_routed_experts from the bodies they forward: with routing replay the
    client sends /generate to the servers directly and gets the experts back."""
    backend = RoutedExpertsEngine()
    with (
        MockSGLangServer(backend, release=NEWEST_CHECKED_RELEASE) as server,
        RealRouter(router_release, [server.url], free_port()) as router,
    ):
        config = _config(server.url, router_url=router.url, return_routed_experts=True)
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)  # returns once healthy; 60 s for a loaded CI machine
            [[completion]] = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert completion.routed_experts is not None and completion.routed_experts.shape == (4, 2)
        assert completion.info["server"] == server.url


def test_the_job_scripts_health_wait_passes_through_the_router(router_release):
    """examples/common/zcpo_job.sh's wait_for_health, run by bash with the real curl, against the
    router and its server (it polled the router's /health_generate: 503 on 0.2.0 until the timeout)."""
    import json
    import shutil
    import subprocess
    from pathlib import Path

    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    script = Path(__file__).parents[3] / "examples" / "common" / "zcpo_job.sh"
    with (
        MockSGLangServer(ScriptedEngine()) as server,
        RealRouter(router_release, [server.url], free_port()) as router,
    ):
        done = subprocess.run(
            [
                "bash",
                "-c",
                f'source <(sed -n "/^wait_for_health()/,/^}}/p" {script}); log() {{ echo "$*"; }}; '
                'die() { echo "$*"; exit 1; }; SGLANG_STARTUP_TIMEOUT=3 wait_for_health "$0" "$1"',
                json.dumps([server.url]),
                router.url,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0 and "2 endpoints healthy" in done.stdout, done.stdout + done.stderr


def test_requests_naming_the_lora_adapter_keep_it_through_the_router(router_release, tmp_path):
    """model.lora.push=adapter names the current adapter in every /generate (lora_path): both routers
    forward the field, so the request runs on the adapter, not on the base."""
    from megatron_zcpo.convert.peft import peft_adapter_config
    from tests.rollout.sglang.test_sglang_lora import LORA, MODULES, _adapter

    with (
        MockSGLangServer(ScriptedEngine(), enable_lora=True, max_lora_rank=8, lora_target_modules=MODULES) as server,
        RealRouter(router_release, [server.url], free_port()) as router,
    ):
        config = _config(server.url, router_url=router.url, weight_dir=str(tmp_path))
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
            engine.update_adapter(_adapter(1).items(), peft_adapter_config(LORA), version=4)
            [[completion]] = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3))
        assert completion.info["server"] == router.url and completion.weight_version == 4
        assert server.lora_requests == list(server.loaded_adapters) and server.lora_requests[0].endswith("-v4")


def test_the_routers_worker_checks_never_generate_on_a_released_server(router_release):
    """sglang-router checks its workers every --health-check-interval-secs; at its default endpoint, SGLang's
    /health, each check generates a token: on a colocated server whose memory is released for training
    that is an illegal memory access (the double dies), and behind a long weight push it blocks until
    the router drops the worker. The launcher's line checks a path that never generates."""
    import time

    from megatron_zcpo.rollout.sglang.api import ROUTER_HEALTH_CHECK_PATH

    with (
        MockSGLangServer(ScriptedEngine(), memory_saver=True, api_key=KEY) as server,
        RealRouter(router_release, [server.url], free_port(), api_key=KEY, health_check_interval_s=1),
    ):
        with SGLangEngine(_config(server.url, api_key=KEY)) as engine:
            engine.release_memory(None)  # the train phase: released, not paused
        time.sleep(3)
        checks = [path for path, _ in server.events if path == ROUTER_HEALTH_CHECK_PATH]
        assert server.crashed is None and len(checks) >= 2, server.events
