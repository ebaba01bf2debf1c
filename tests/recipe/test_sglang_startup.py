"""Rank 0's start-up with SGLang (recipe/rollout.py make_engine): the servers and every timeout are checked
before anything long starts, and each refusal names the key or launch flag to change."""

import dataclasses
import logging

import pytest

from megatron_zcpo.recipe.config import build_run_config
from megatron_zcpo.recipe.rollout import make_engine
from megatron_zcpo.recipe.timeouts import (
    RolloutServers,
    check_timeouts,
    predicted_durations,
    rank0_wait_timeout_s,
    timeout_checks,
)
from megatron_zcpo.rollout.engine import RolloutError
from megatron_zcpo.rollout.sglang.api import required_context_length
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.cli.test_examples import QWEN25_32B, run_config
from tests.rollout.sglang.test_sglang_client import ScriptedEngine
from tests.rollout.sglang.test_sglang_server import TINY, write_tiny_checkpoint


def _run(model_dir, url, **client):
    return build_run_config(
        {
            "model": {"path": str(model_dir)},
            "rollout": {"engine": "sglang", "max_new_tokens": 8, "sglang": {"server_urls": [url], "client": client}},
            "data": {"task": "basic_arithmetic", "max_prompt_length": 16},
            "logging": {"run_dir": str(model_dir / "run")},
        }
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf")
    write_tiny_checkpoint(str(directory))
    return directory


def test_attaching_checks_the_servers_key_context_and_seeds(model_dir):
    right = required_context_length(16, 8)
    with MockSGLangServer(ScriptedEngine(), api_key="job-key", context_length=right) as server:
        with pytest.raises(RolloutError, match="refused the API key.*rollout.sglang.client.api_key"):
            make_engine(_run(model_dir, server.url, api_key="stale-key"), TINY, None)
        make_engine(_run(model_dir, server.url, api_key="job-key"), TINY, None).shutdown()
        with pytest.raises(RolloutError, match="sampling_seeds is true but .* --enable-deterministic-inference"):
            make_engine(_run(model_dir, server.url, api_key="job-key", sampling_seeds=True), TINY, None)
    # the old launch: --context-length = max_prompt_length + max_new_tokens refuses a full-length prompt
    with MockSGLangServer(ScriptedEngine(), context_length=16 + 8) as server:
        with pytest.raises(RolloutError, match=r"16 \+ 8 = 24.*--context-length >= 26"):
            make_engine(_run(model_dir, server.url), TINY, None)


def test_short_timeouts_stop_the_start_naming_the_key(model_dir):
    with MockSGLangServer(ScriptedEngine()) as server:
        with pytest.raises(
            ValueError,
            match=r"rollout.sglang.client.rollout_timeout_s = 60 s does not outlast a "
            r"request's 4 attempts \(.*predicted 3,600 s\): raise "
            r"rollout.sglang.client.rollout_timeout_s above 3,600",
        ):
            make_engine(_run(model_dir, server.url, request_timeout_s=900, rollout_timeout_s=60), TINY, None)


def test_the_32b_examples_first_round_outlasts_the_old_rollout_timeout(tmp_path):
    """Dynamic sampling's first round (ceil(512 x 1.5) x 16 = 12,288 samples) is predicted at ~6,920 s on
    the example's 8 TP4 servers: 6,000 s is refused, the shipped 21,600 s is not."""
    servers = RolloutServers(count=8, tp_size=4)
    old = run_config("qwen2.5-32b-zcpo", tmp_path, ["rollout.sglang.client.rollout_timeout_s=6000"])
    [failed] = [
        check for check in timeout_checks(old, QWEN25_32B, servers) if not check.ok and "first round" in check.bounds
    ]
    assert failed.key == "rollout.sglang.client.rollout_timeout_s" and 6800 < failed.predicted_s < 7050
    shipped = run_config("qwen2.5-32b-zcpo", tmp_path)
    assert all(check.ok for check in timeout_checks(shipped, QWEN25_32B, servers))
    # the ranks that wait for rank 0 wait longer than its longest stretch: rollouts of several rounds
    assert rank0_wait_timeout_s(shipped) > 8 * 2 * 21600 > shipped.parallel.collective_timeout_s


# A tiny model with Qwen's vocabulary: 9.8M parameters, whose KV cache would hold millions of sequences.
TINY_QWEN_VOCAB = dataclasses.replace(TINY, hidden_size=64, intermediate_size=128, num_layers=2, vocab_size=151936)


def test_a_tiny_models_short_requests_start_with_a_short_request_timeout(model_dir):
    """8-token responses with request_timeout_s=3: a server decodes the requests in flight on it (the
    round's 64 samples), not the millions of sequences its KV cache would hold, so one request takes
    milliseconds (it was predicted at 77 s and refused)."""
    config = _run(model_dir, "http://unset", request_timeout_s=3)
    assert predicted_durations(config, TINY_QWEN_VOCAB, RolloutServers(count=1, tp_size=1))["request"] < 0.1
    with MockSGLangServer(ScriptedEngine(), context_length=required_context_length(16, 8)) as server:
        make_engine(_run(model_dir, server.url, request_timeout_s=3), TINY_QWEN_VOCAB, None).shutdown()


def test_unsure_predictions_warn_with_the_key_and_sure_ones_refuse(tmp_path, caplog):
    """The 32B example's first round (~6,920 s) against rollout_timeout_s=6000: refused on the planned
    H100s; on servers of unknown hardware (start-up: SGLang does not report its GPU type) or for a
    tiny model it warns naming the key, and the run starts."""
    keys = ["rollout.sglang.client.rollout_timeout_s=6000", "rollout.sglang.client.request_timeout_s=1400"]
    short = run_config("qwen2.5-32b-zcpo", tmp_path, keys)
    with pytest.raises(ValueError, match="rollout.sglang.client.rollout_timeout_s = 6,000 s does not outlast"):
        check_timeouts(short, QWEN25_32B, RolloutServers(count=8, tp_size=4))
    unknown = RolloutServers(count=8, tp_size=4, known_hardware=False)
    with caplog.at_level(logging.WARNING, logger="megatron_zcpo.recipe.timeouts"):
        checks = check_timeouts(short, QWEN25_32B, unknown)
    failed = [check for check in checks if not check.ok]
    assert any("first round" in check.bounds for check in failed) and not any(check.refused for check in failed)
    assert "raise rollout.sglang.client.rollout_timeout_s above" in caplog.text and "warning only" in caplog.text
    tiny = run_config("qwen2.5-32b-zcpo", tmp_path, ["rollout.sglang.client.request_timeout_s=0.000001"])
    assert [check.key for check in check_timeouts(tiny, TINY, RolloutServers(count=8, tp_size=4)) if not check.ok] == [
        "rollout.sglang.client.request_timeout_s"
    ]


def test_at_start_up_a_predicted_duration_warns_and_the_run_starts(model_dir, caplog):
    """SGLang does not report its GPU type: a 32B model's 4,096-token request, predicted at minutes on
    an H100, against request_timeout_s=5 is a warning naming the key, not a refusal."""
    config = _run(model_dir, "http://unset", request_timeout_s=5)
    config.rollout.max_new_tokens = 4096
    with MockSGLangServer(ScriptedEngine(), context_length=required_context_length(16, 4096)) as server:
        config.rollout.sglang.server_urls = [server.url]
        with caplog.at_level(logging.WARNING, logger="megatron_zcpo.recipe.timeouts"):
            make_engine(config, QWEN25_32B, None).shutdown()
    assert "raise rollout.sglang.client.request_timeout_s above" in caplog.text


def test_the_push_is_predicted_as_measured_not_at_one_links_speed(tmp_path):
    """Qwen2.5-32B's push: verl measured 14-18 s (2 + 2 nodes); one 400 Gb/s link alone would say 1.3 s."""
    shipped = run_config("qwen2.5-32b-zcpo", tmp_path)
    push = predicted_durations(shipped, QWEN25_32B, RolloutServers(count=8, tp_size=4))["push"]
    assert 14 <= push <= 18
