"""SGLang client against a local server speaking SGLang v0.5.3's schema: generate, faults, weight pushes."""

import asyncio
import os
import threading
import time

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.engine import Completion, RolloutEngine, RolloutError, RolloutInterrupted, SamplingParams
from megatron_zcpo.rollout.sglang.client import (
    SGLangEngine,
    SGLangEngineConfig,
    completion_from_sglang,
    sglang_sampling_params,
)
from megatron_zcpo.testing import run_distributed
from megatron_zcpo.testing.mock_server import MockSGLangServer


class ScriptedEngine(RolloutEngine):
    """A backend whose answers are a known function of the request: output token k of a prompt
    is (last prompt token + k + 1) mod 97 with log-prob -(k+1)/10; records pushed tensors."""

    def __init__(self):
        self.seeds, self.received, self.version = [], {}, -1

    def generate(self, prompts, params, n=1):
        self.seeds.append(params.seed)
        results = []
        for prompt in prompts:
            out = [(prompt[-1] + k + 1) % 97 for k in range(params.max_new_tokens)]
            stop = [i for i, t in enumerate(out) if t in params.stop_token_ids]
            out = out[: stop[0] + 1] if stop else out
            logprobs = [-(k + 1) / 10 for k in range(len(out))]
            results.append([Completion(list(prompt), out, logprobs, "stop" if stop else "length")] * n)
        return results

    def update_weights(self, named_hf_tensors, version):
        for name, tensor in named_hf_tensors:
            self.received[name] = tensor.clone()
        self.version = version

    def weight_version(self):
        return self.version

    def shutdown(self):
        pass


def _config(url, **overrides):
    defaults = dict(
        server_urls=[url],
        max_retries=3,
        backoff_s=0.01,
        backoff_max_s=0.05,
        request_timeout_s=10.0,
        connect_timeout_s=2.0,
        max_concurrency=8,
    )
    defaults.update(overrides)
    return SGLangEngineConfig(**defaults)


def _expected_output(prompt, max_new_tokens):
    return [(prompt[-1] + k + 1) % 97 for k in range(max_new_tokens)]


def test_request_and_response_follow_the_schema():
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=0, max_new_tokens=5, stop_token_ids=(2,))
    assert sglang_sampling_params(params, seed=9) == {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": -1,
        "max_new_tokens": 5,
        "stop_token_ids": [2],
        "skip_special_tokens": False,
        "no_stop_trim": True,
        "sampling_seed": 9,
    }
    answer = {
        "text": "",
        "output_ids": [5, 2],
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "stop", "matched": 2},
            "weight_version": "3",
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 2, None]],
        },
    }
    completion = completion_from_sglang([1, 4], answer)
    assert (completion.output_ids, completion.output_logprobs, completion.finish_reason, completion.weight_version) == (
        [5, 2],
        [-0.5, -1.5],
        "stop",
        3,
    )
    answer["meta_info"]["output_token_logprobs"][1][1] = 7  # rejected, not raised (tests/test_engine_output_checks.py)
    rejected = completion_from_sglang([1, 4], answer, server="http://s1")
    assert (rejected.finish_reason, rejected.output_ids, rejected.info["rejected"]) == (
        "abort",
        [],
        "server http://s1, request r1: output_ids has token 2 at position 1 but output_token_logprobs has 7",
    )
    with pytest.raises(RolloutError, match="missing 'meta_info'"):
        completion_from_sglang([1], {"output_ids": []})


def test_generate_n_samples_with_seeds():
    backend = ScriptedEngine()
    with (
        MockSGLangServer(backend, deterministic_inference=True) as server,
        SGLangEngine(_config(server.url, sampling_seeds=True)) as engine,
    ):
        engine.wait_until_healthy(timeout_s=10)
        prompts = [[3, 10], [4, 50, 95], [7]]
        results = engine.generate(prompts, SamplingParams(max_new_tokens=4, stop_token_ids=(52,), seed=100), n=2)
        assert [len(r) for r in results] == [2, 2, 2]
        for prompt, samples in zip(prompts, results):
            expected = _expected_output(prompt, 4)
            if 52 in expected:
                expected = expected[: expected.index(52) + 1]
            for completion in samples:
                assert completion.prompt_ids == prompt and completion.output_ids == expected
                assert completion.output_logprobs == [-(k + 1) / 10 for k in range(len(expected))]
                assert completion.finish_reason == ("stop" if expected[-1] == 52 else "length")
                assert completion.weight_version == -1  # the server's initial version "default"
        assert sorted(backend.seeds) == list(range(100, 106))  # seed + i*n + j, one request each
    with MockSGLangServer(backend) as server, SGLangEngine(_config(server.url)) as engine:
        engine.generate([[1]], SamplingParams(max_new_tokens=1, seed=100))
        assert backend.seeds[-1] is None  # not forwarded unless the servers sample with seeds
    # SGLang 0.5.3.post3 ignores per-request seeds without --enable-deterministic-inference ...
    with MockSGLangServer(backend) as server, SGLangEngine(_config(server.url, sampling_seeds=True)) as engine:
        engine.generate([[1]], SamplingParams(max_new_tokens=1, seed=100))
        assert backend.seeds[-1] is None
    # ... and with it, a request without one samples with seed 42: a prompt's G samples would be identical.
    with MockSGLangServer(backend, deterministic_inference=True) as server, SGLangEngine(_config(server.url)) as engine:
        engine.generate([[1]], SamplingParams(max_new_tokens=1, seed=100), n=2)
        assert backend.seeds[-2:] == [42, 42]


def test_retries_dropped_connections_and_503():
    faults = {"/generate": ["drop", "503", "drop"]}
    with MockSGLangServer(ScriptedEngine(), faults=faults) as server, SGLangEngine(_config(server.url)) as engine:
        [[completion]] = engine.generate([[1, 2]], SamplingParams(max_new_tokens=3))
        assert completion.output_ids == _expected_output([1, 2], 3)
        assert [e for e in server.events if e[0] == "/generate"] == [
            ("/generate", "drop"),
            ("/generate", "503"),
            ("/generate", "drop"),
            ("/generate", "ok"),
        ]


def test_hanging_request_times_out_is_aborted_and_retried():
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/generate": ["hang"]}) as server,
        SGLangEngine(_config(server.url, request_timeout_s=0.5)) as engine,
    ):
        start = time.monotonic()
        [[completion]] = engine.generate([[8]], SamplingParams(max_new_tokens=2))
        assert completion.output_ids == _expected_output([8], 2)
        assert 0.5 <= time.monotonic() - start < 5
        # the timed-out attempt was aborted on the server before the retry (with a fresh rid)
        assert len(server.aborted_rids) == 1 and completion.info["rid"] not in server.aborted_rids


def test_an_interrupt_aborts_the_requests_in_flight_on_the_server_at_once(monkeypatch):
    """interrupt_generation() from another thread (the recipe's stop watcher) ends a generate() whose
    requests hang on the server: each running one is aborted there before the call raises
    RolloutInterrupted (within a second; the process may exit right after), the queued one never sent;
    calls are refused until clear_interrupt()."""
    with (
        MockSGLangServer(ScriptedEngine(), faults={"/generate": ["hang", "hang"]}) as server,
        SGLangEngine(_config(server.url, max_concurrency=2)) as engine,
    ):
        interrupted_at, answered_aborts = [], []
        abort = engine._http.abort_quietly

        async def slow_abort(rid):  # an abort answered late: the call still waits for it
            await asyncio.sleep(0.3)
            await abort(rid)
            answered_aborts.append(rid)

        monkeypatch.setattr(engine._http, "abort_quietly", slow_abort)

        def interrupt_once_both_run():
            while sum(path == "/generate" for path, _ in list(server.events)) < 2:
                time.sleep(0.01)
            time.sleep(0.2)
            interrupted_at.append(time.monotonic())
            engine.interrupt_generation()

        threading.Thread(target=interrupt_once_both_run, daemon=True).start()
        with pytest.raises(RolloutInterrupted):
            engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2))
        assert time.monotonic() - interrupted_at[0] < 1.0
        assert len(answered_aborts) == 2 and server.aborted_rids == set(answered_aborts)  # both running ones
        assert [e for e in server.events if e[0] == "/generate"] == [("/generate", "hang")] * 2
        with pytest.raises(RolloutInterrupted):
            engine.generate([[4]], SamplingParams(max_new_tokens=2))
        engine.clear_interrupt()
        [[completion]] = engine.generate([[4]], SamplingParams(max_new_tokens=2))
        assert completion.output_ids == _expected_output([4], 2)


def test_failure_after_retries_aborts_the_whole_call():
    faults = {"/generate": ["503", "503"]}
    with (
        MockSGLangServer(ScriptedEngine(), faults=faults) as server,
        SGLangEngine(_config(server.url, max_retries=1, max_concurrency=1)) as engine,
    ):
        with pytest.raises(RolloutError, match=r"/generate failed after 2 attempt\(s\).*503"):
            engine.generate([[1], [2], [3]], SamplingParams(max_new_tokens=2))
        # the failing request was aborted; the queued ones were cancelled before reaching the server
        assert len([e for e in server.events if e[0] == "/generate"]) == 2
        assert len(server.aborted_rids) == 2  # one abort before the retry, one after giving up
        # the server left the rotation: no request reaches it before a weight push re-syncs it
        with pytest.raises(RolloutError, match=r"only 0 of 1 SGLang servers remain.*min_healthy = 1"):
            engine.generate([[5]], SamplingParams(max_new_tokens=1))


def test_health_wait_reports_unready_servers():
    with MockSGLangServer(ScriptedEngine(), faults={"/health_generate": ["503"] * 100}) as server:
        with SGLangEngine(_config(server.url)) as engine:
            with pytest.raises(RolloutError, match=f"{server.url}.*not healthy"):
                engine.wait_until_healthy(timeout_s=0.3, poll_s=0.05)
            with pytest.raises(RolloutError, match="exited before"):
                engine.wait_until_healthy(timeout_s=5, poll_s=0.05, is_alive=lambda: False)


def _named_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        ("model.embed_tokens.weight", torch.randn(50, 8, generator=gen)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(16, 8, generator=gen).to(torch.bfloat16)),
        ("model.norm.weight", torch.randn(8, generator=gen)),
    ]


def test_disk_push_loads_exact_tensors_and_checks_the_version(tmp_path):
    backend = ScriptedEngine()
    with (
        MockSGLangServer(backend) as server,
        SGLangEngine(_config(server.url, weight_sync="disk", weight_dir=str(tmp_path))) as engine,
    ):
        engine.update_weights(_named_tensors(0), version=5)
        assert engine.weight_version() == 5 and backend.version == 5
        for name, tensor in _named_tensors(0):
            assert backend.received[name].dtype == tensor.dtype and torch.equal(backend.received[name], tensor)
        first_dir = os.path.join(tmp_path, "weights-v5")
        assert os.path.isdir(first_dir)
        engine.update_weights(_named_tensors(1), version=6)
        assert not os.path.exists(first_dir)  # the previous version's files are removed
        assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0][0].weight_version == 6
        assert [e for e in server.events if e[0] == "/flush_cache"] == [("/flush_cache", "ok")] * 2


def test_refused_or_unconfirmed_push_raises(tmp_path):
    class RefusingEngine(ScriptedEngine):
        def update_weights(self, named_hf_tensors, version):
            raise KeyError("model.bogus.weight")

    with (
        MockSGLangServer(RefusingEngine()) as server,
        SGLangEngine(_config(server.url, weight_sync="disk", weight_dir=str(tmp_path))) as engine,
    ):
        with pytest.raises(RolloutError, match="HTTP 400.*model.bogus.weight"):
            engine.update_weights(_named_tensors(), version=1)
        assert len([e for e in server.events if e[0] == "/update_weights_from_disk"]) == 1  # 4xx: no retry


def test_config_errors_name_the_key():
    with pytest.raises(ValueError, match="rollout.sglang.weight_dir"):
        SGLangEngineConfig(server_urls=["http://x"], weight_sync="disk").validate()
    with pytest.raises(ValueError, match="rollout.sglang.weight_sync"):
        SGLangEngineConfig(server_urls=["http://x"], weight_sync="nfs").validate()
    with pytest.raises(ValueError, match="rollout.sglang.server_urls"):
        SGLangEngineConfig(server_urls=[]).validate()


MODEL = ModelConfig(
    family="qwen2",
    vocab_size=300,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _distributed_push(rank, world, port, model_config):
    """TP=2 trainer ranks stream the converted weights; rank 0 pushes them by broadcast to a mock
    SGLang server that rank 1 hosts. Rank 1 returns what the server received and the converter's
    output for the same model (gathered the non-streaming way)."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_tensors
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict
    from megatron_zcpo.rollout.weight_sync import iter_hf_weights

    setup_megatron(tensor_parallel=2, seed=13)
    model = build_gpt_model(model_config, transformer_config(model_config, tensor_parallel=2))
    expected = {
        h: t for n, w in gather_full_state_dict(model).items() for h, t in megatron_to_hf_tensors(n, w, model_config)
    }
    if rank == 0:
        # No master_address: the route to the (local) server gives it.
        config = SGLangEngineConfig(
            server_urls=[f"http://127.0.0.1:{port}"], group_backend="gloo", bucket_bytes=40_000, group_timeout_s=120
        )
        with SGLangEngine(config) as engine:
            engine.wait_until_healthy(timeout_s=60, poll_s=0.1)
            engine.update_weights(iter_hf_weights(model, model_config), version=7)
            served = engine.weight_version()
        return {"served": served}
    backend = ScriptedEngine()
    server = MockSGLangServer(backend, port=port)
    server.start()
    for _ in iter_hf_weights(model, model_config):  # this TP rank's part of the collective gathers
        pass
    deadline = time.monotonic() + 120
    while ("/destroy_weights_update_group", "ok") not in server.events and time.monotonic() < deadline:
        time.sleep(0.05)
    server.stop()
    buckets = sum(1 for e in server.events if e[0] == "/update_weights_from_distributed")
    return {"received": backend.received, "expected": expected, "version": backend.version, "buckets": buckets}


def test_distributed_push_delivers_exactly_the_converted_tensors():
    from megatron_zcpo.utils.runtime import free_port

    trainer, server = run_distributed(_distributed_push, 2, free_port(), MODEL, timeout=240)
    assert trainer["served"] == 7 and server["version"] == 7
    assert server["buckets"] > 1  # the 40 kB buckets split the model
    assert sorted(server["received"]) == sorted(server["expected"])
    for name, tensor in server["expected"].items():
        got = server["received"][name]
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name
