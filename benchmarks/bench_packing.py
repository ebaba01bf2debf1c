"""Benchmark micro-batch layouts of the trainer: padding-free THD packing vs right-padded rows.

One rollout with RL-like lengths (prompts of 32-160 tokens, long-tailed responses up to
``--max-response`` tokens) through the real PolicyTrainer: the experience pass (policy +
reference, fused token statistics) and the update (forward + backward + optimizer step) under
the same token budget per micro-batch. Layouts:
  padded   rows sorted by length and right-padded to the longest in the micro-batch (length
           bucketing: what trainers without a varlen attention kernel do; the naive way).
  thd      the sequences concatenated into one row with megatron-core PackedSeqParams, as
           verl (use_remove_padding) and slime pack them for flash-attention varlen kernels.
Each layout runs in a fresh process, one thread; time is wall time of the phase, memory the
peak rise of the resident set during it (see bench_token_stats._measure). "pad" is the share of
the model's input tokens that are padding.

    python benchmarks/bench_packing.py
    python benchmarks/bench_packing.py --samples 128 --max-response 1024 --budget 4096
"""

from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_token_stats import _measure

from megatron_zcpo.testing import run_distributed


def make_rollout(samples: int, max_response: int, vocab: int, seed: int = 0):
    """Groups of 8 responses; response lengths log-normal (median max/8), clipped to ``max_response``."""
    from megatron_zcpo.training.batch import RolloutSample

    rng = random.Random(seed)
    rollout = []
    for index in range(samples):
        if index % 8 == 0:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 160))]
        length = max(1, min(max_response, int(rng.lognormvariate(0.0, 0.9) * max_response / 8)))
        rollout.append(
            RolloutSample(
                prompt,
                [rng.randrange(vocab) for _ in range(length)],
                group_id=index // 8,
                reward=1.0 if rng.random() < 0.5 else -1.0,
            )
        )
    return rollout


def case(rank, world, packing, samples, max_response, budget, hidden, layers):
    """(experience seconds, MiB), (update seconds, MiB), padding share, micro-batch count."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import ModelConfig
    from megatron_zcpo.training.batch import collate_micro_batches
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.metrics import MetricAccumulator
    from megatron_zcpo.training.rollout_step import RolloutStep
    from megatron_zcpo.training.trainer import PolicyTrainer

    model = ModelConfig(
        family="qwen2",
        vocab_size=8192,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    setup_megatron(seed=1)
    trainer = PolicyTrainer(
        model,
        AlgorithmConfig(name="zcpo"),
        TrainConfig(
            micro_batch_tokens=budget,
            packing=packing,
            selfcheck_tolerance=-1,
            optimizer=OptimizerSettings(warmup_steps=0),
        ),
        ParallelConfig(),
    )
    rollout = make_rollout(samples, max_response, model.vocab_size)
    plan = trainer.assign_minibatches(rollout)
    micro_batches = collate_micro_batches(rollout, plan.my_indices, trainer.micro_batch_layout)
    fed = sum(mb.tokens.numel() for mb in micro_batches)
    real = sum(s.sequence_length for s in rollout)
    experience = {}

    def run_experience():
        experience.update(trainer.experience(rollout, plan))

    exp_time, _, exp_mem = _measure(run_experience)
    coefficients, stats = trainer.calibrate(rollout, experience)
    step = RolloutStep(rollout, plan, experience, coefficients, stats)
    upd_time, _, upd_mem = _measure(lambda: trainer.update(step, MetricAccumulator()))
    return (exp_time, exp_mem), (upd_time, upd_mem), 1.0 - real / fed, len(micro_batches), real


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--max-response", type=int, default=768)
    parser.add_argument("--budget", type=int, default=4096, help="train.micro_batch_tokens")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    results = {}
    for packing in ("padded", "thd"):
        results[packing] = run_distributed(
            case, 1, packing, args.samples, args.max_response, args.budget, args.hidden, args.layers, timeout=3600
        )[0]
    tokens = results["thd"][4]
    print(
        f"{args.samples} samples, {tokens} real tokens, budget {args.budget} tokens per micro-batch, "
        f"hidden {args.hidden}, {args.layers} layers, 1 process / 1 thread"
    )
    print(
        f"{'layout':8} {'micro-batches':>13} {'pad':>6} {'experience s':>13} {'MiB':>7} {'update s':>9} {'MiB':>7} "
        f"{'tokens/s':>9}"
    )
    for packing, ((exp_s, exp_mb), (upd_s, upd_mb), pad, count, real) in results.items():
        print(
            f"{packing:8} {count:13d} {pad:6.1%} {exp_s:13.2f} {exp_mb:7.0f} {upd_s:9.2f} {upd_mb:7.0f} "
            f"{real / (exp_s + upd_s):9.0f}"
        )
    (pe, _), (pu, _), *_ = results["padded"]
    (te, _), (tu, _), *_ = results["thd"]
    print(f"thd vs padded: experience {pe / te:.2f}x, update {pu / tu:.2f}x faster")


if __name__ == "__main__":
    main()
