"""The reward worker pool's chunked dispatch: per-call timeouts, deaths and errors inside a chunk, order (also from
two threads at once), interruption."""

import signal
import threading
import time

import pytest

from megatron_zcpo.rewards.pool import RewardWorkerPool

SCRIPTED = "tests.rewards.scripted_rewards:scripted_reward"


def _calls(responses):
    return [(response, "a", {"uid": f"q{i}"}) for i, response in enumerate(responses)]


@pytest.fixture
def one_worker():
    """One worker, so 40 calls go out in chunks of ceil(40 / 4) = 10, 8, ... (the first chunk is calls 0-9)."""
    with RewardWorkerPool(SCRIPTED, num_workers=1, timeout_s=1.0) as pool:
        yield pool


@pytest.mark.parametrize("failing, status", [("hang", "timeout"), ("exit", "died")])
def test_a_call_that_hangs_or_kills_its_worker_mid_chunk_fails_alone(one_worker, failing, status):
    responses = ["pid"] * 40
    responses[4] = failing  # inside the first chunk (calls 0-9), with calls after it in the same chunk
    start = time.monotonic()
    outcomes = one_worker.map(_calls(responses))
    assert outcomes[4].status == status, outcomes[4]
    assert [outcome.status for i, outcome in enumerate(outcomes) if i != 4] == ["ok"] * 39
    first_worker, replacement = {outcomes[i].value for i in range(4)}, {outcomes[i].value for i in range(5, 40)}
    # the calls before it kept the first worker's answers; the rest of its chunk ran again on the replacement
    assert len(first_worker) == 1 and len(replacement) == 1 and first_worker != replacement
    assert one_worker.restarts == 1
    assert time.monotonic() - start < 1.0 + 10.0
    # the replacement keeps working
    assert [outcome.value for outcome in one_worker.map(_calls(["a", "b"]))] == [1.0, 0.0]


def test_each_call_of_a_chunk_has_its_own_timeout():
    with RewardWorkerPool(SCRIPTED, num_workers=1, timeout_s=0.6) as pool:
        # chunks of 4, 3, 3, ... calls of 0.2 s: a chunk takes longer than the timeout, no call does
        outcomes = pool.map(_calls(["sleep:0.2"] * 16))
        assert [outcome.status for outcome in outcomes] == ["ok"] * 16 and pool.restarts == 0


def test_errors_and_non_numbers_inside_a_chunk_fail_only_their_call(one_worker):
    responses = ["pid"] * 40
    responses[2], responses[6] = "crash", "text"
    outcomes = one_worker.map(_calls(responses))
    assert outcomes[2].status == "error" and "scripted crash for q2" in outcomes[2].error
    assert outcomes[6].status == "invalid" and "not a number" in outcomes[6].error
    others = [outcome for i, outcome in enumerate(outcomes) if i not in (2, 6)]
    assert [outcome.status for outcome in others] == ["ok"] * 38
    assert len({outcome.value for outcome in others}) == 1 and one_worker.restarts == 0  # the chunk went on


def test_many_calls_on_two_workers_return_in_input_order():
    with RewardWorkerPool(SCRIPTED, num_workers=2, timeout_s=10.0) as pool:
        for num_calls in (1, 7, 517):
            outcomes = pool.map(_calls([f"echo:{i}" for i in range(num_calls)]))
            assert [outcome.value for outcome in outcomes] == [float(i) for i in range(num_calls)]
            assert {outcome.status for outcome in outcomes} == {"ok"}
        # two threads at once (an asynchronous rollout's producer beside an evaluation): each gets its own
        threads, results = [], {}
        for offset in (0, 1000):
            calls = _calls([f"echo:{offset + i}" for i in range(300)])
            threads.append(threading.Thread(target=lambda o=offset, c=calls: results.__setitem__(o, pool.map(c))))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        for offset, outcomes in results.items():
            assert [outcome.value for outcome in outcomes] == [float(offset + i) for i in range(300)]


def _interrupt_after(seconds):
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)


def test_a_map_interrupted_mid_chunk_leaves_a_busy_worker_that_is_replaced_or_killed():
    previous = signal.getsignal(signal.SIGALRM)
    pool = RewardWorkerPool(SCRIPTED, num_workers=1, timeout_s=60.0)
    try:
        _interrupt_after(2.0)
        with pytest.raises(KeyboardInterrupt):
            pool.map(_calls(["a"] * 4 + ["hang"] + ["a"] * 35))  # the first chunk is calls 0-9
        assert list(pool._workers[0].unanswered) == list(range(4, 10))
        # the interrupted chunk's late answers must not leak into the next map: its worker is replaced
        assert [outcome.value for outcome in pool.map(_calls(["a", "b", "a"]))] == [1.0, 0.0, 1.0]
        assert pool.restarts == 1
        _interrupt_after(2.0)
        with pytest.raises(KeyboardInterrupt):
            pool.map(_calls(["hang"] * 8))
        busy = pool._workers[0].process
        start = time.monotonic()
        pool.close()  # kills the busy worker instead of waiting for it
        assert time.monotonic() - start < 5.0 and not busy.is_alive()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        pool.close()
