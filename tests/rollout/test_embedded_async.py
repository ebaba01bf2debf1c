"""The embedded engine's asynchronous requests: batched like generate(), held across a weight push and
continued token for token from what they had, every token with its version and behaviour log-prob."""

import functools
import threading

import pytest
import torch

from megatron_zcpo.rollout.embedded import EmbeddedEngine, build_hf_causal_lm
from tests.rollout.test_embedded import MODEL, _random_prompts

GREEDY = dict(temperature=0.0, max_new_tokens=24)


@functools.cache  # built once per process, whichever module's fixture asks first
def _weights(seed):
    torch.manual_seed(seed)
    model = build_hf_causal_lm(MODEL)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    return dict(model.named_parameters())


@pytest.fixture(scope="module")
def two_policies():
    return _weights(3), _weights(4)


def _engine(weights, version=0, **kwargs):
    engine = EmbeddedEngine(MODEL, **kwargs)
    engine.update_weights(weights.items(), version=version)
    return engine


def _pause_after(engine, steps, release=None):
    """Make ``engine``'s scheduler stop at decode step ``steps`` until a pause (or abort) is asked, or
    ``release`` is set: returns the event set once it got there (a pause then takes effect right after
    that step's token)."""
    reached, original, calls = threading.Event(), engine._decode_step, [0]
    release = release or threading.Event()

    def decode_step(*args):
        calls[0] += 1
        if calls[0] == steps:
            reached.set()
            while not (engine._async._interrupt.is_set() or release.wait(0.01)):
                pass
        return original(*args)

    engine._decode_step = decode_step
    return reached


def test_async_requests_equal_generate_without_pauses(two_policies):
    from megatron_zcpo.rollout.engine import SamplingParams

    policy, _ = two_policies
    engine = _engine(policy)
    prompts = _random_prompts(6, seed=2)
    params = SamplingParams(**GREEDY)
    expected = engine.generate(prompts, params, n=2)
    futures = [engine.submit(prompt, params, n=2) for prompt in prompts]
    for future, samples in zip(futures, expected):
        for got, want in zip(future.result(timeout=60), samples):
            assert got.output_ids == want.output_ids and got.finish_reason == want.finish_reason
            assert got.output_versions == [0] * len(got.output_ids)
            torch.testing.assert_close(got.output_logprobs, want.output_logprobs, atol=1e-5, rtol=0)
    engine.shutdown()


def test_a_response_paused_across_a_push_continues_token_for_token(two_policies):
    """Before the pause: what the old weights produce; after: what the new weights produce from the prompt
    and those tokens (a fresh request with prompt + prefix); versions and behaviour log-probs per token."""
    from megatron_zcpo.rollout.engine import SamplingParams

    old, new = two_policies
    engine = _engine(old)
    params = SamplingParams(**GREEDY)
    prompt = _random_prompts(1, seed=8)[0]
    reached = _pause_after(engine, 5)
    future = engine.submit(prompt, params, n=2)
    assert reached.wait(60)
    engine.pause_generation()
    engine.update_weights(new.items(), version=1)
    engine.continue_generation()
    samples = future.result(timeout=60)
    engine.shutdown()

    before_engine, after_engine = _engine(old), _engine(new, version=1)
    [[uninterrupted, _]] = before_engine.generate([prompt], params, n=2)
    for sample in samples:
        split = sample.output_versions.index(1)
        assert split == 6 and sample.output_versions == [0] * split + [1] * (len(sample.output_ids) - split)
        assert sample.output_ids[:split] == uninterrupted.output_ids[:split]
        torch.testing.assert_close(
            sample.output_logprobs[:split], uninterrupted.output_logprobs[:split], atol=1e-5, rtol=0
        )
        continued = SamplingParams(temperature=0.0, max_new_tokens=GREEDY["max_new_tokens"] - split)
        [[fresh]] = after_engine.generate([prompt + sample.output_ids[:split]], continued)
        assert sample.output_ids[split:] == fresh.output_ids and sample.finish_reason == fresh.finish_reason
        torch.testing.assert_close(sample.output_logprobs[split:], fresh.output_logprobs, atol=1e-5, rtol=0)
        assert sample.output_ids[split:] != uninterrupted.output_ids[split:]  # the new weights made a difference
    before_engine.shutdown()
    after_engine.shutdown()


def test_abort_ends_requests_with_the_tokens_they_have(two_policies):
    from megatron_zcpo.rollout.engine import SamplingParams

    engine = _engine(two_policies[0])
    reached = _pause_after(engine, 3)
    future = engine.submit(_random_prompts(1, seed=4)[0], SamplingParams(**GREEDY), n=3)
    assert reached.wait(60)
    assert engine.abort_requests() == 1
    samples = future.result(timeout=60)
    assert [s.finish_reason for s in samples] == ["abort"] * 3 and all(len(s.output_ids) == 4 for s in samples)
    engine.shutdown()


def test_new_requests_join_once_half_the_batch_has_finished(two_policies):
    """Rows that stop early leave the batch when new requests wait: the late request starts before the
    long rows finish, and every result still equals generate()'s."""
    from megatron_zcpo.rollout.engine import SamplingParams

    engine = _engine(two_policies[0])
    stop = tuple(range(0, MODEL.vocab_size, 3))  # most rows stop within a few tokens
    params = SamplingParams(temperature=0.0, max_new_tokens=40, stop_token_ids=stop)
    prompts = _random_prompts(8, seed=11)
    expected = engine.generate(prompts, params)
    release = threading.Event()
    reached = _pause_after(engine, 2, release)
    futures = [engine.submit(prompt, params) for prompt in prompts[:6]]
    assert reached.wait(60)
    futures += [engine.submit(prompt, params) for prompt in prompts[6:]]
    release.set()  # the first batch goes on, and stops for the waiting requests once half of it is done
    for future, [want] in zip(futures, expected):
        [got] = future.result(timeout=60)
        assert got.output_ids == want.output_ids
    assert engine._async.batches >= 2
    engine.shutdown()
