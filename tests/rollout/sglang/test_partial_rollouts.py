"""Partial rollouts through the SGLang client against the mock server's continuous batching: a response
paused across a push continues token for token (abort and re-issue on 0.5.3.post3, retract on 0.5.23),
each token with its version, and a server lost while paused is survived."""

import pytest

from megatron_zcpo.rollout.engine import SamplingParams
from megatron_zcpo.rollout.sglang.client import SGLangEngine
from megatron_zcpo.testing.mock_server import MockSGLangServer
from tests.rollout.sglang.test_sglang_client import _config
from tests.rollout.test_embedded import _random_prompts
from tests.rollout.test_embedded_async import GREEDY, _engine, _pause_after, two_policies  # noqa: F401 - fixture


class RecordingBackend:
    """The embedded engine, recording the input ids of every request it is asked for."""

    def __init__(self, engine):
        self.engine, self.inputs = engine, []

    def submit(self, prompt, params, n=1):
        self.inputs.append(list(prompt))
        return self.engine.submit(prompt, params, n)

    def __getattr__(self, name):
        return getattr(self.engine, name)


def _push(client, weights, version):
    client.pause_generation()
    client.update_weights(iter(weights.items()), version)
    client.continue_generation()


@pytest.mark.parametrize(
    "release, pause_mode, expected_mode",
    [("0.5.3.post3", "auto", "abort"), ("0.5.23", "auto", "retract"), ("0.5.23", "abort", "abort")],
)
def test_a_response_paused_across_a_push_continues_token_for_token(
    tmp_path, two_policies, release, pause_mode, expected_mode
):
    old, new = two_policies
    backend = RecordingBackend(_engine(old))
    reached = _pause_after(backend.engine, 5)
    prompt = _random_prompts(1, seed=8)[0]
    params = SamplingParams(**GREEDY)
    with (
        MockSGLangServer(backend, release=release, continuous=True) as server,
        SGLangEngine(
            _config(server.url, weight_sync="disk", weight_dir=str(tmp_path), pause_mode=pause_mode)
        ) as client,
    ):
        client.update_weights(iter(old.items()), 0)
        future = client.submit(prompt, params, n=1)
        assert reached.wait(60)
        _push(client, new, 1)
        [sample] = future.result(timeout=120)
        assert server.pause_modes == [expected_mode]
    split = sample.output_versions.index(1)
    assert split == 6 and sample.output_versions == [0] * split + [1] * (len(sample.output_ids) - split)
    if expected_mode == "abort":  # the client sent it again: prompt + the tokens it had, never re-tokenised
        assert backend.inputs == [prompt, prompt + sample.output_ids[:split]]
    else:  # the server held it and continued it itself
        assert backend.inputs == [prompt]
    reference = _engine(new, version=1)
    continued = SamplingParams(temperature=0.0, max_new_tokens=GREEDY["max_new_tokens"] - split)
    [[fresh]] = reference.generate([prompt + sample.output_ids[:split]], continued)
    assert sample.output_ids[split:] == fresh.output_ids and sample.finish_reason == fresh.finish_reason
    assert max(abs(a - b) for a, b in zip(sample.output_logprobs[split:], fresh.output_logprobs)) < 1e-5
    reference.shutdown()
    backend.engine.shutdown()


@pytest.mark.parametrize("pause_mode", ["abort", "retract"])
def test_a_server_lost_while_paused_is_survived(tmp_path, two_policies, pause_mode):
    """The server holding a partial response dies during the push: "abort" continues the response on the
    other server from the tokens it had; "retract" loses those tokens (they were on the dead server) and
    the request starts again on the other one. Either way the sample completes, at the new version."""
    old, new = two_policies
    dying, surviving = RecordingBackend(_engine(old)), RecordingBackend(_engine(old))
    reached = _pause_after(dying.engine, 5)
    prompt = _random_prompts(1, seed=8)[0]
    a = MockSGLangServer(dying, release="0.5.23", continuous=True)
    b = MockSGLangServer(surviving, release="0.5.23", continuous=True)
    a.start(), b.start()
    config = _config(
        a.url,
        server_urls=[a.url, b.url],
        weight_sync="disk",
        weight_dir=str(tmp_path),
        pause_mode=pause_mode,
        max_retries=1,
        request_timeout_s=5.0,
    )
    with SGLangEngine(config) as client:
        client.update_weights(iter(old.items()), 0)
        future = client.submit(prompt, SamplingParams(**GREEDY), n=1)  # request 0 goes to a
        assert reached.wait(60)
        client.pause_generation()
        a.stop()
        client.update_weights(iter(new.items()), 1)  # a fails it and leaves the rotation
        client.continue_generation()
        [sample] = future.result(timeout=120)
        assert list(client._http.pool.lost) == [a.url]
    b.stop()
    if pause_mode == "abort":
        assert sample.output_versions[:6] == [0] * 6 and set(sample.output_versions[6:]) == {1}
        assert surviving.inputs == [prompt + sample.output_ids[:6]]
    else:
        assert set(sample.output_versions) == {1} and surviving.inputs == [prompt]
    for backend in (dying, surviving):
        backend.engine.shutdown()
