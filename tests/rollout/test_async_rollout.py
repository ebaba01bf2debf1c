"""The asynchronous rollout producer on the embedded engine: per-token staleness never above k, every drawn
prompt trained once, dropped (counted) or outstanding, across a checkpoint and a resume; drop or correct."""

import time

import torch

from megatron_zcpo.data.dataset import PromptDataset
from megatron_zcpo.data.records import PromptRecord
from megatron_zcpo.rewards.scorer import RewardBatch
from megatron_zcpo.rollout.async_rollout import AsyncRollout
from megatron_zcpo.rollout.dynamic_sampling import DynamicSamplingConfig
from megatron_zcpo.rollout.engine import SamplingParams
from tests.rollout.test_embedded import MODEL, _random_prompts
from tests.rollout.test_embedded_async import _engine, two_policies  # noqa: F401 - the fixture is used by name

G, B = 4, 3
# A quarter of the vocabulary stops a response: lengths are geometric, up to the 40-token cap (a long tail).
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=tuple(range(0, MODEL.vocab_size, 4)))


def _dataset():
    records = [
        PromptRecord(uid=f"p{i}", messages=[], answer="", prompt_ids=ids)
        for i, ids in enumerate(_random_prompts(300, seed=21))
    ]
    return PromptDataset(records, seed=5)


def _score(records, completions):
    """+1 for a response of odd length, -1 otherwise: groups often split, sometimes tie."""
    reward = torch.tensor([[1.0 if len(c.output_ids) % 2 else -1.0 for c in group] for group in completions])
    truncated = torch.tensor([[c.finish_reason == "length" for c in group] for group in completions])
    valid = torch.tensor([[c.finish_reason != "abort" for c in group] for group in completions])
    zeros = torch.zeros_like(reward)
    return RewardBatch(reward, reward.clone(), zeros, truncated, torch.zeros_like(valid), valid, valid.clone())


def _producer(engine, dataset, on_stale="drop", max_staleness=1, version=0):
    return AsyncRollout(
        engine,
        dataset,
        _score,
        PARAMS,
        samples_per_prompt=G,
        prompts_per_step=B,
        max_staleness=max_staleness,
        on_stale=on_stale,
        dynamic_sampling=DynamicSamplingConfig(),
        seed=3,
        version=version,
    )


def _push(engine, rollout, weights, version):
    engine.pause_generation()
    engine.update_weights(weights.items(), version)
    engine.continue_generation()
    rollout.on_push(version)


def _run(rollout, engine, weights, steps, trained, check):
    for step in steps:
        taken = rollout.take(step)
        for group in taken.completions:
            for completion in group:
                assert all(step - v <= rollout.max_staleness for v in completion.token_versions), completion
        check(taken.metrics, rollout)
        # admission: a group admitted at version v may be trained up to step v + k, so taken + outstanding
        # never exceeds (v + k + 1) x B
        outstanding = taken.metrics["async/groups_in_flight"] + taken.metrics["async/groups_ready"]
        assert taken.metrics["async/taken_total"] + outstanding <= (step + rollout.max_staleness + 1) * B
        trained.extend(record.uid for record in taken.records)
        _push(engine, rollout, weights[(step + 1) % 2], step + 1)


def _accounted(metrics, rollout):
    counts = {name: metrics[f"async/{name}_total"] for name in ("admitted", "taken", "dropped_tied", "dropped_invalid")}
    outstanding = metrics["async/groups_in_flight"] + metrics["async/groups_ready"]
    dropped = counts["dropped_tied"] + counts["dropped_invalid"] + metrics["async/dropped_stale_total"]
    assert counts["admitted"] == counts["taken"] + dropped + outstanding, metrics


def test_staleness_is_bounded_and_every_prompt_is_accounted_for_across_a_resume(two_policies):
    weights = two_policies
    engine, dataset = _engine(weights[0]), _dataset()
    rollout = _producer(engine, dataset)
    rollout.start()
    first, trained = [], []
    _run(rollout, engine, weights, range(4), first, _accounted)
    state = rollout.state()  # checkpointed after step 3's push (the trainer resumes at step 4)
    _run(rollout, engine, weights, range(4, 7), trained, _accounted)  # the uninterrupted run goes on
    rollout.close()
    engine.shutdown()
    assert len(set(first + trained)) == len(first + trained) == 7 * B

    # The resumed run: a fresh engine, dataset and producer from the state.
    engine, dataset = _engine(weights[0], version=4), _dataset()
    resumed_rollout = _producer(engine, dataset, version=4)
    resumed_rollout.start(state)
    resumed = []
    _run(resumed_rollout, engine, weights, range(4, 7), resumed, _accounted)
    final = resumed_rollout.state()
    resumed_rollout.close()
    engine.shutdown()
    assert len(set(first + resumed)) == len(first + resumed) == 7 * B  # no prompt trained twice
    drawn = PromptDataset(_dataset().records, seed=5).next_batch(final["next_serial"])
    assert set(first + resumed) <= {r.uid for r in drawn}  # drawn in stream order: none skipped
    assert final["counts"]["admitted"] == final["next_serial"]
    assert resumed_rollout.counts["taken"] == 7 * B


def test_stale_groups_are_dropped_and_counted_or_corrected(two_policies):
    """Three pushes while groups sit ready: "drop" drops every group they left more than k = 1 behind
    and trains fresher ones; "correct" trains the stale ones."""
    weights = two_policies
    for on_stale in ("drop", "correct"):
        engine, dataset = _engine(weights[0]), _dataset()
        rollout = _producer(engine, dataset, on_stale=on_stale)
        rollout.start()
        rollout.take(0)  # the first groups, while the next ones are generated at version 0
        while len(rollout.ready) < B:  # the next step's groups, all generated at version 0
            time.sleep(0.02)
        for version in (1, 2, 3):
            _push(engine, rollout, weights[version % 2], version)
        taken = rollout.take(3)
        lags = [3 - v for group in taken.completions for c in group for v in c.token_versions]
        if on_stale == "drop":
            assert max(lags) <= 1 and taken.metrics["async/dropped_stale_total"] >= B
        else:
            assert max(lags) == 3 and taken.metrics["async/dropped_stale_total"] == 0
            assert taken.metrics["rollout/staleness_max"] == 3.0
        rollout.close()
        engine.shutdown()
