"""Diagnostics runs on the tiny trainer for the diagnostics tests (module-level so spawned ranks can import them)."""

import dataclasses
import math

import torch

from megatron_zcpo.training.rollout_step import RolloutStep
from tests.cases import trainer_cases

SMALL = dict(enabled=True, every=1, groups=4, tokens_per_group=2, cancellation_tokens=6, seed=3)


def diagnostics(**overrides):
    from megatron_zcpo.diagnostics import DiagnosticsConfig, KLDiagnostics

    return KLDiagnostics(DiagnosticsConfig(**{**SMALL, **overrides}))


def diagnosed(trainer, samples, **overrides):
    """(metrics of run(), experience, coefficients, stats) of one rollout, as the trainer hook would see them."""
    plan = trainer.assign_minibatches(samples)
    experience = trainer.experience(samples, plan)
    coefficients, stats = trainer.calibrate(samples, experience)
    step = RolloutStep(samples, plan, experience, coefficients, stats)
    metrics = diagnostics(**overrides).run(trainer.policy_update(), step)
    return metrics, plan, experience, coefficients, stats


def hook_metrics(rank, world, tp, pp, policy, reference):
    """Per algorithm, the diag/ metrics of one train_step through PolicyTrainer(diagnostics=...): the
    families run between calibration and the update, F1 before the step's last mini-batch."""
    out = {}
    for algorithm in ("zcpo", "grpo"):
        trainer = trainer_cases.make_trainer(tp, pp, policy, reference, algorithm)
        trainer.diagnostics = diagnostics()
        samples = trainer_cases.rollout()
        metrics = trainer.train_step(samples)
        out[algorithm] = {k: v for k, v in metrics.items() if k.startswith("diag/")}
        # the diagnostics' gradient passes must leave the update exactly as it is without them
        plain = trainer_cases.make_trainer(tp, pp, policy, reference, algorithm)
        plain.train_step(samples)
        diagnosed_params, plain_params = trainer.global_state_dict(), plain.global_state_dict()
        out[f"{algorithm}_update_change"] = max(
            float((diagnosed_params[name] - value).abs().max()) for name, value in plain_params.items()
        )
    return out


def mirrored_groups(policy, reference):
    """F2's exact cancellation: groups of two identical responses (same prompt, same tokens) with
    opposite rewards, so with equal weights and opposite coefficients their reward gradients cancel."""
    from megatron_zcpo.training.batch import RolloutSample

    samples = []
    for group, (prompt, response) in enumerate((([5, 6, 7], [11, 12, 13, 14, 15]), ([8, 9], [21, 22, 23, 24]))):
        for reward in (1.0, -1.0):
            samples.append(RolloutSample(prompt, response, group_id=group, reward=reward))
    out = {}
    for algorithm in ("zcpo", "grpo"):
        trainer = trainer_cases.make_trainer(1, 1, policy, reference, algorithm, mini_batches=1)
        out[algorithm] = diagnosed(
            trainer, samples, cancellation_tokens=100, tokens_per_group=100, families=["grad_share", "f2", "f5"]
        )[0]
    return out


def single_token_groups(policy, reference):
    """F7's construction: every response is one sampled token after its group's shared prompt, so the
    conditional KL is the same for the whole group while k1 = old - ref differs with the token."""
    from megatron_zcpo.training.batch import RolloutSample

    samples = []
    for group, (prompt, tokens, rewards) in enumerate(
        (
            ([3, 4, 5], [10, 40, 70, 90], [1.0, 0.0, 0.0, 1.0]),
            ([6, 7], [15, 55, 95], [0.0, 1.0, 0.0]),
            ([8, 9], [20, 60], [1.0, 1.0]),
        )
    ):
        for token, reward in zip(tokens, rewards):
            samples.append(RolloutSample(prompt, [token], group_id=group, reward=reward))
    trainer = trainer_cases.make_trainer(1, 1, policy, reference, "zcpo", mini_batches=1, beta=2.0)
    metrics, _, experience, _, _ = diagnosed(trainer, samples, families=["f7"])
    return {
        "metrics": metrics,
        "samples": samples,
        "kl": torch.stack([experience[i].kl[0] for i in range(len(samples))]),
        "k1": torch.stack([experience[i].old_logprob[0] - experience[i].ref_logprob[0] for i in range(len(samples))]),
    }


def clipped_last_minibatch(policy, reference):
    """F1 with known closed gates: in the last mini-batch, the old log-probs of every positive-coefficient
    response move by -log 2 (ratio 2 > 1 + clip_high: clipped high) and of the first negative one by
    +log 2 (ratio 1/2 < 1 - clip_low: clipped low); every other token keeps ratio 1 (gate open)."""

    out = {}
    for name, algorithm, overrides in (
        ("zcpo", "zcpo", {}),
        ("grpo", "grpo", {}),
        ("grpo_f1b", "grpo", {"f1_control": "mask_clipped"}),
    ):
        trainer = trainer_cases.make_trainer(1, 1, policy, reference, algorithm, **overrides)
        samples = trainer_cases.rollout()
        plan = trainer.assign_minibatches(samples)
        experience = trainer.experience(samples, plan)
        coefficients, stats = trainer.calibrate(samples, experience)
        last = len(plan.minibatches) - 1
        trainable = [i for i in plan.minibatches[last] if samples[i].trainable]
        negative = [i for i in trainable if coefficients[i] < 0]
        closed = [i for i in trainable if coefficients[i] > 0] + negative[:1]
        shifted = dict(experience)
        for index in closed:
            token = experience[index]
            sign = float(torch.sign(coefficients[index]))
            shifted[index] = dataclasses.replace(token, old_logprob=token.old_logprob - sign * math.log(2.0))
        hook = diagnostics(families=["f1"])
        step = RolloutStep(samples, plan, shifted, coefficients, stats)
        out[name] = {
            "metrics": hook.before_minibatch(trainer.policy_update(), step, last),
            "first": hook.before_minibatch(trainer.policy_update(), step, 0),
            "closed_tokens": sum(len(samples[i].response_ids) for i in closed),
            "trainable_tokens": sum(len(samples[i].response_ids) for i in trainable),
        }
    return out


def tied_groups(policy, reference):
    """F3 on the tiny rollout (one group of five has identical rewards) for the gated and ungated ZCPO and the
    vanilla paths with and without a KL loss."""
    out = {}
    for name, algorithm, overrides in (
        ("zcpo", "zcpo", {}),
        ("zcpo_ungated", "zcpo", {"gate": False}),
        ("grpo", "grpo", {}),
        ("dapo", "dapo", {}),
    ):
        trainer = trainer_cases.make_trainer(1, 1, policy, reference, algorithm, **overrides)
        out[name] = diagnosed(trainer, trainer_cases.rollout(), families=["f3", "f4"])[0]
    return out


def closed_forms(rank, world, policy, reference):
    """The single-process closed-form cases above, in one spawned process."""
    return {
        case.__name__: case(policy, reference)
        for case in (mirrored_groups, single_token_groups, clipped_last_minibatch, tied_groups)
    }
