"""Embedded rollout engine: sampling filters, log-probs vs teacher forcing and vs megatron-core, seeds, stops."""

import copy
import time

import pytest
import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.rollout.embedded import (
    EmbeddedEngine,
    build_hf_causal_lm,
    filter_top_k_top_p,
    left_pad,
    sample_next_tokens,
)
from megatron_zcpo.rollout.engine import RolloutError, RolloutInterrupted, SamplingParams
from megatron_zcpo.testing import run_distributed

MODEL = ModelConfig(
    vocab_size=1000,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=96,
)


def _random_prompts(count, low=3, high=17, seed=1, vocab=MODEL.vocab_size):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]


@pytest.fixture(scope="module")
def policy():
    """A Hugging Face model with random weights (larger than HF's init, so distributions are peaked)."""
    torch.manual_seed(3)
    model = build_hf_causal_lm(MODEL)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.08)
    return model


@pytest.fixture(scope="module")
def engine(policy):
    eng = EmbeddedEngine(MODEL, seed=0)
    eng.update_weights(policy.named_parameters(), version=4)
    yield eng
    eng.shutdown()


def test_filter_top_k_top_p_matches_float64_reference():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 40, generator=gen, dtype=torch.float64) * 2, dim=-1)
    for top_k, top_p in [(5, 1.0), (-1, 0.7), (7, 0.5), (1, 1.0), (-1, 1.0)]:
        got = filter_top_k_top_p(probs, top_k, top_p)
        for row in range(probs.shape[0]):
            order = probs[row].argsort(descending=True).tolist()
            keep, mass = set(), 0.0
            for rank, token in enumerate(order):
                if (top_k <= 0 or rank < top_k) and (rank == 0 or mass <= top_p):
                    keep.add(token)
                mass += probs[row, token].item()
            expected = torch.tensor(
                [probs[row, v].item() if v in keep else 0.0 for v in range(40)], dtype=torch.float64
            )
            torch.testing.assert_close(got[row], expected, rtol=0, atol=0)


def test_sampling_follows_the_filtered_distribution_and_reports_unfiltered_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=gen) * 2
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.9)
    draws = 20000
    tokens, logprobs = sample_next_tokens(logits.expand(draws, -1), params, torch.Generator().manual_seed(1))
    reference = torch.log_softmax(logits.double() / 0.8, dim=-1)[0]
    torch.testing.assert_close(logprobs.double(), reference[tokens], atol=1e-6, rtol=0)
    kept = filter_top_k_top_p(reference.exp()[None], 6, 0.9)[0]
    expected = kept / kept.sum()
    observed = torch.bincount(tokens, minlength=12).double() / draws
    assert set(tokens.unique().tolist()) == set(expected.nonzero().flatten().tolist())
    # 4.5 standard errors of a binomial frequency: fails on a wrong distribution, not by chance.
    tolerance = 4.5 * torch.sqrt(expected * (1 - expected) / draws) + 1e-12
    assert torch.all((observed - expected).abs() <= tolerance), (observed, expected)


def test_greedy_takes_the_argmax_with_raw_logprobs():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))
    tokens, logprobs = sample_next_tokens(logits, SamplingParams(temperature=0.0), torch.Generator())
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(
        logprobs.double(), torch.log_softmax(logits.double(), -1).gather(-1, tokens[:, None])[:, 0]
    )


def test_left_pad_layout():
    ids, mask, pos = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert pos.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_logprobs_equal_teacher_forced_forward(engine, policy):
    prompts = _random_prompts(5)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=12, seed=11)
    results = engine.generate(prompts, params, n=3)
    reference = copy.deepcopy(policy).double()
    assert [len(r) for r in results] == [3] * 5
    for prompt, samples in zip(prompts, results):
        for completion in samples:
            assert completion.prompt_ids == prompt and completion.weight_version == 4
            sequence = torch.tensor([prompt + completion.output_ids])
            with torch.no_grad():
                logits = reference(input_ids=sequence).logits[0, len(prompt) - 1 : -1]
            expected = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, torch.tensor(completion.output_ids)[:, None])[
                :, 0
            ]
            torch.testing.assert_close(
                torch.tensor(completion.output_logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0
            )


def test_seeded_sampling_is_reproducible(engine):
    prompts = _random_prompts(4, seed=5)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=123)
    first = engine.generate(prompts, params, n=2)
    again = engine.generate(prompts, params, n=2)
    other = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=10, seed=124), n=2)
    outputs = lambda results: [c.output_ids for samples in results for c in samples]  # noqa: E731
    assert outputs(first) == outputs(again)
    assert [c.output_logprobs for s in first for c in s] == [c.output_logprobs for s in again for c in s]
    assert outputs(first) != outputs(other)
    # The n samples of one prompt differ from one another (they are independent draws).
    assert first[0][0].output_ids != first[0][1].output_ids


def test_stop_tokens_and_length_limits(engine):
    stop = tuple(range(0, MODEL.vocab_size, 3))  # a third of the vocabulary: most rows stop early
    params = SamplingParams(temperature=1.0, max_new_tokens=8, stop_token_ids=stop, seed=2)
    results = engine.generate(_random_prompts(12, seed=7), params)
    reasons = set()
    for [completion] in results:
        reasons.add(completion.finish_reason)
        inside = [t in stop for t in completion.output_ids]
        if completion.finish_reason == "stop":
            assert inside[-1] and not any(inside[:-1])
            assert len(completion.output_ids) <= 8
        else:
            assert completion.finish_reason == "length" and completion.truncated
            assert len(completion.output_ids) == 8 and not any(inside)
    assert reasons == {"stop", "length"}
    # The context (96 positions) caps a long prompt's response below max_new_tokens.
    long_prompt = _random_prompts(1, low=90, high=91, seed=3)
    [[capped]] = engine.generate(long_prompt, SamplingParams(temperature=1.0, max_new_tokens=20, seed=1))
    assert len(capped.output_ids) == 96 - 90 and capped.finish_reason == "length"
    with pytest.raises(ValueError, match="prompt 0 has 96 tokens"):
        engine.generate(_random_prompts(1, low=96, high=97), params)


def test_an_interrupt_stops_generation_before_the_next_decode_step_until_cleared(engine, monkeypatch):
    """interrupt_generation() (the recipe's stop watcher, another thread) lands between two decode steps:
    generate() raises before the next one, and at once until clear_interrupt(); then it samples exactly
    what an uninterrupted call samples (the interrupted call left nothing behind)."""
    prompts = _random_prompts(3, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=17)  # no stop tokens: 40 decode steps
    uninterrupted = engine.generate(prompts, params, n=2)
    decode_step, steps = engine._decode_step, []

    def interrupted_at_the_third(*args):
        steps.append(len(steps))
        if len(steps) == 3:
            engine.interrupt_generation()
        return decode_step(*args)

    monkeypatch.setattr(engine, "_decode_step", interrupted_at_the_third)
    with pytest.raises(RolloutInterrupted):
        engine.generate(prompts, params, n=2)
    assert len(steps) == 3  # the third step ran (it was under way); no fourth
    with pytest.raises(RolloutInterrupted):  # refused at once while the interrupt stands
        engine.generate(prompts, params, n=2)
    assert len(steps) == 3
    engine.clear_interrupt()
    monkeypatch.setattr(engine, "_decode_step", decode_step)
    again = engine.generate(prompts, params, n=2)
    assert [c.output_ids for s in again for c in s] == [c.output_ids for s in uninterrupted for c in s]


def test_batch_size_does_not_change_greedy_results(policy):
    prompts = _random_prompts(7, seed=9)
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    outputs = []
    for max_batch_size in (2, 64):
        with EmbeddedEngine(MODEL, max_batch_size=max_batch_size) as eng:
            eng.update_weights(policy.named_parameters(), version=0)
            outputs.append(eng.generate(prompts, params))
    for [a], [b] in zip(*outputs):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(a.output_logprobs, b.output_logprobs, atol=1e-5, rtol=0)


def test_weight_errors_name_the_tensor(policy):
    eng = EmbeddedEngine(MODEL)
    with pytest.raises(RolloutError, match="has not received weights"):
        eng.generate([[1, 2]], SamplingParams())
    with pytest.raises(KeyError, match="model.layers.9.mlp.up_proj.weight"):
        eng.update_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))], 1)
    with pytest.raises(ValueError, match="model.norm.weight.*shape"):
        eng.update_weights([("model.norm.weight", torch.zeros(3))], 1)
    partial = [(n, p) for n, p in policy.named_parameters() if "layers.1." not in n]
    eng.update_weights(partial, 1)
    with pytest.raises(RolloutError, match="model.layers.1"):
        eng.generate([[1, 2]], SamplingParams())
    eng.update_weights(policy.named_parameters(), 2)
    with pytest.raises(ValueError, match="prompt 1 has token ids"):
        eng.generate([[1], [5, MODEL.vocab_size]], SamplingParams())
    eng.shutdown()
    with pytest.raises(RolloutError, match="shut down"):
        eng.generate([[1, 2]], SamplingParams())


def test_batched_sampling_speed(engine):
    """A batch of 64 prompts x 32 new tokens on the tiny model (target: well under a few seconds).

    Asserted on the CPU time of one thread: the CI machine's two cores are shared, so wall time
    (and the CPU time of threads spinning on one another) measures the neighbours as much as
    the engine.
    """
    prompts = _random_prompts(64, seed=4)
    params = SamplingParams(temperature=1.0, max_new_tokens=32, seed=0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine.generate(prompts, params)  # warm-up: first-call allocations
        wall, cpu = time.perf_counter(), time.process_time()
        results = engine.generate(prompts, params)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        torch.set_num_threads(threads)
    print(f"embedded engine: 64 prompts x 32 new tokens in {wall:.3f}s wall, {cpu:.3f}s CPU (1 thread)")
    assert sum(len(c.output_ids) for [c] in results) == 64 * 32
    assert cpu < 3.0


def _megatron_logprob_check(rank, world, model_configs, temperature):
    """For each config: push a megatron-core GPTModel's weights through the converter into the
    embedded engine and compare the engine's sampling log-probs with the GPTModel's
    teacher-forced ones. Returns the worst absolute difference per config."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_tensors
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict

    setup_megatron(seed=21)
    worst = []
    for model_config in model_configs:
        model = build_gpt_model(model_config, transformer_config(model_config)).eval()
        with torch.no_grad():
            for param in model.parameters():  # peakier than the default init: a sharper check
                param.normal_(0.0, 0.08)
        weights = gather_full_state_dict(model)
        engine = EmbeddedEngine(model_config)
        engine.update_weights(
            ((h, t) for n, w in weights.items() for h, t in megatron_to_hf_tensors(n, w, model_config)), 1
        )
        prompts = _random_prompts(3, seed=8, vocab=model_config.vocab_size)
        results = engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=10, seed=3), n=2)
        gap = 0.0
        for prompt, samples in zip(prompts, results):
            for completion in samples:
                sequence = torch.tensor([prompt + completion.output_ids])
                with torch.no_grad():
                    logits = model(sequence, torch.arange(sequence.shape[1])[None], None)
                logits = logits[
                    0, len(prompt) - 1 : -1, : model_config.vocab_size
                ].double()  # drop Megatron's vocab padding
                targets = torch.tensor(completion.output_ids)[:, None]
                expected = torch.log_softmax(logits / temperature, -1).gather(-1, targets)[:, 0]
                gap = max(
                    gap, (expected - torch.tensor(completion.output_logprobs, dtype=torch.float64)).abs().max().item()
                )
        worst.append(gap)
    return worst


def test_logprobs_equal_megatron_gpt_model():
    """The engine's log-probs are the trainer's: Qwen2 with tied embeddings, Llama without, Qwen3
    (q/k norms, head_dim 32 != hidden/heads) with and without."""
    families = (("qwen2", True, None), ("llama", False, None), ("qwen3", True, 32), ("qwen3", False, 32))
    configs = [
        ModelConfig(
            family=family,
            vocab_size=300,
            hidden_size=64,
            intermediate_size=128,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=tied,
            head_dim=head_dim,
            max_position_embeddings=64,
        )
        for family, tied, head_dim in families
    ]
    [worst] = run_distributed(_megatron_logprob_check, 1, configs, 0.9)
    print(
        "max |engine - GPTModel| log-prob: "
        + ", ".join(f"{family}{'-tied' if tied else ''} {gap:.2e}" for (family, tied, _), gap in zip(families, worst))
    )
    assert max(worst) < 1e-5
