"""The client's whole protocol against the real SGLang 0.5.3.post3 and 0.5.23 on a CPU: version and start-up
check, /generate with log-probs and the token ids the trainer trains on, n > 1, stop ids, abort, retries on
the real error bodies, the API key, the context length, pause and continue."""

import logging
import threading
import time

import pytest

from megatron_zcpo.rollout.engine import RolloutError, SamplingParams
from megatron_zcpo.rollout.sglang import client as sglang_client
from tests.rollout.sglang.real.raw import StreamingGenerate, call

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=6)
PROMPTS = [[5, 6, 7], [20, 30, 40, 50]]


def test_the_start_up_check_reads_the_release_and_the_launch(real_server, release):
    with real_server.engine() as engine:
        [facts] = engine.check_servers(max_prompt_length=100, max_new_tokens=20)
        assert (facts.version, facts.tp_size, facts.skip_tokenizer_init) == (release, 1, True)
        assert facts.served_tokens == 128 - 2  # --context-length 128: prompt + new tokens <= context - 2
        with pytest.raises(RolloutError, match=r"serves at most 126 prompt \+ new tokens.*--context-length >= 129"):
            engine.check_servers(max_prompt_length=100, max_new_tokens=27)
    with real_server.engine(api_key="not-the-key") as engine:
        with pytest.raises(RolloutError, match="refused the API key"):
            engine.check_servers(8, 4)
    assert call(real_server.url, "/get_model_info")[0] == 401  # no key
    assert call(real_server.url, "/health_generate")[0] == 200  # /health* needs none


def test_generate_returns_the_sampled_ids_and_their_log_probs(real_server):
    """What the trainer trains on: output_ids are the sampled tokens alone (0.5.3.post3 put prompt tokens in
    front of them with its tokenizer loaded), one log-prob each; n samples per prompt; greedy repeats."""
    with real_server.engine(max_concurrency=1, vocab_size=300) as engine:
        groups = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=5), n=2)
        greedy = [c.output_ids for [c] in engine.generate(PROMPTS, GREEDY)]
        assert [c.output_ids for [c] in engine.generate(PROMPTS, GREEDY)] == greedy
    assert [len(group) for group in groups] == [2, 2]
    for prompt, group in zip(PROMPTS, groups):
        for completion in group:
            assert completion.prompt_ids == prompt and completion.finish_reason in ("length", "stop")
            assert 1 <= len(completion.output_ids) == len(completion.output_logprobs) <= 5
            assert all(lp <= 0.0 for lp in completion.output_logprobs)
    status, answer = call(
        real_server.url,
        "/generate",
        {"input_ids": PROMPTS[1], "sampling_params": {"temperature": 0.0, "max_new_tokens": 6}, "return_logprob": True},
        key=real_server.api_key,
    )
    assert status == 200
    assert answer["output_ids"] == [entry[1] for entry in answer["meta_info"]["output_token_logprobs"]]
    assert answer["output_ids"] == greedy[1] and answer["meta_info"]["completion_tokens"] == 6


def test_a_stop_id_ends_the_response_at_it(real_server):
    with real_server.engine() as engine:
        [[free]] = engine.generate([PROMPTS[1]], GREEDY)
        stop = free.output_ids[2]
        [[stopped]] = engine.generate(
            [PROMPTS[1]], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=(stop,))
        )
    assert stopped.output_ids == free.output_ids[: free.output_ids.index(stop) + 1]
    assert stopped.finish_reason == "stop"


def test_abort_ends_running_requests_with_what_they_generated(real_server):
    with real_server.engine() as engine:
        results = []
        worker = threading.Thread(
            target=lambda: results.append(
                engine.generate([[9, 9]], SamplingParams(temperature=0.0, max_new_tokens=110))
            )
        )
        worker.start()
        probe = StreamingGenerate(real_server.url, real_server.api_key, [8, 8])
        probe.start()
        probe.wait_running()  # the client's request, sent first, runs too
        engine.abort_all()
        worker.join(120)
    assert probe.final["meta_info"]["finish_reason"]["type"] == "abort"
    [[[aborted]]] = results
    assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 110


def test_refusals_are_not_retried_and_server_errors_are(real_server, release, monkeypatch, caplog):
    """A prompt over the context length: 400 with the server's message, one attempt, a rejected sample. An
    unknown sampling key: 0.5.23's JSON contract refuses it (400, no retry: a rejected sample); 0.5.3.post3
    answers 500, which the client retries as a server failure and then takes the server out of rotation."""
    with real_server.engine(max_retries=1, backoff_s=0.01) as engine:
        with pytest.raises(RolloutError, match=r"HTTP 400.*maximum context length of 128 tokens"):
            engine.generate([list(range(1, 101))], SamplingParams(temperature=0.0, max_new_tokens=30))
        bogus = sglang_client.sglang_sampling_params
        monkeypatch.setattr(sglang_client, "sglang_sampling_params", lambda *a: {**bogus(*a), "bogus": 1})
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="megatron_zcpo.rollout.sglang.http"):
            with pytest.raises(RolloutError) as refused:
                engine.generate([PROMPTS[0]], GREEDY)
    retried = [record for record in caplog.records if "retry 1/1" in record.getMessage()]
    if release == "0.5.3.post3":
        assert "0 of 1 SGLang servers remain" in str(refused.value) and "HTTP 500: Internal Server Error" in str(
            refused.value
        )
        assert len(retried) == 1
    else:
        assert "1 of 1 samples rejected" in str(refused.value) and "unknown field `bogus`" in str(refused.value)
        assert not retried


def test_pause_aborts_what_runs_and_holds_what_arrives_until_continue(real_server):
    """The "abort" pause (0.5.3.post3's only one; 0.5.23's "retract", the client's choice there, is held by
    test_partial_rollouts.py)."""
    with real_server.engine(pause_mode="abort") as engine:
        running = StreamingGenerate(real_server.url, real_server.api_key, [7, 7])
        running.start()
        running.wait_running()
        engine.pause_generation()
        assert running.final["meta_info"]["finish_reason"]["type"] == "abort"
        held = []
        worker = threading.Thread(target=lambda: held.append(engine.generate([PROMPTS[0]], GREEDY)))
        worker.start()
        time.sleep(2.0)  # an answer takes well under a second
        assert worker.is_alive() and not held  # held, not refused
        engine.continue_generation()
        worker.join(120)
    [[[answered]]] = held
    assert answered.finish_reason in ("length", "stop") and answered.output_ids
