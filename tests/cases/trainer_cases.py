"""Shared tiny trainer runs for the trainer tests (module-level so spawned ranks can import them)."""

import random

import torch

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.training.rollout_step import RolloutStep

MODEL = ModelConfig(
    family="qwen2",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
# Qwen3: per-head q/k norms (their gradients are split over TP ranks by heads), head_dim != hidden/heads.
QWEN3 = ModelConfig(
    family="qwen3",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    tie_word_embeddings=True,
)
# Qwen3-MoE: 4 experts of 32, top-2, renormalised (megatron's MoE layers, SequentialMLP experts on CPUs).
QWEN3_MOE = ModelConfig(
    family="qwen3_moe",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
)
# DeepSeek-V3's architecture in small: multi-latent attention with a query latent and YaRN, layer 0
# dense, 8 experts in 4 groups (2 eligible, top-4), a shared expert, the sigmoid router with its
# correction bias scaled by 2.5 (megatron's MLA and MoE layers; SequentialMLP experts on CPUs).
DEEPSEEK = ModelConfig(
    family="deepseek_v3",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    tie_word_embeddings=False,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    rope_scaling={
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 64,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    num_experts=8,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    router_score_function="sigmoid",
    router_expert_bias=True,
    router_num_groups=4,
    router_group_topk=2,
)


def rollout(num_groups=5, group_sizes=(3, 4, 2, 5, 4), seed=0, vocab=MODEL.vocab_size):
    """A synthetic rollout: groups of unequal size, varied lengths, mixed rewards, one truncated."""
    from megatron_zcpo.training.batch import RolloutSample

    rng = random.Random(seed)
    samples = []
    for group in range(num_groups):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(2, 6))]
        for member in range(group_sizes[group % len(group_sizes)]):
            response = [rng.randrange(vocab) for _ in range(rng.randint(1, 9))]
            reward = 1.0 if rng.random() < 0.5 else -1.0
            if group == 2:
                reward = 1.0  # an all-tied group: gated out
            samples.append(
                RolloutSample(
                    prompt, response, group_id=100 + group, reward=reward, trainable=not (group == 1 and member == 0)
                )
            )
    return samples


def weights(seed, model=MODEL):
    """Global weights of a seeded single-process ``model`` (run inside a 1-rank group)."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict

    setup_megatron(seed=seed)
    return gather_full_state_dict(build_gpt_model(model, transformer_config(model)))


def deepseek_weights(seed):
    """:func:`weights` of :data:`DEEPSEEK` with routers whose choices are well apart (larger router
    weights and a random correction bias), so float noise of another layout does not flip a tie."""
    state = weights(seed, DEEPSEEK)
    generator = torch.Generator().manual_seed(seed)
    for name in state:
        if name.endswith("mlp.router.weight"):
            state[name] = 25 * state[name]
        elif name.endswith("mlp.router.expert_bias"):
            state[name] = 0.2 * torch.randn(state[name].shape, generator=generator)
    return state


def policy_and_reference(rank, world):
    """Distinct policy and reference weights, so drifts (and ZCPO's K) are non-zero."""
    return weights(21), weights(22)


def make_trainer(
    tp,
    pp,
    policy,
    reference,
    algorithm="zcpo",
    mini_batches=2,
    micro_batch_tokens=24,
    distributed_optimizer=False,
    cp=1,
    packing="thd",
    importance_sampling=False,
    model=MODEL,
    sequence_parallel=False,
    ep=1,
    etp=None,
    train_overrides=None,
    first_stage_layers=None,
    lora=None,
    **algorithm_overrides,
):
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import (
        ImportanceSamplingConfig,
        OptimizerSettings,
        ParallelConfig,
        TrainConfig,
    )
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(
        tensor_parallel=tp,
        pipeline_parallel=pp,
        context_parallel=cp,
        seed=9,
        expert_parallel=ep,
        expert_tensor_parallel=etp,
    )
    train = TrainConfig(
        steps=4,
        mini_batches=mini_batches,
        micro_batch_tokens=micro_batch_tokens,
        packing=packing,
        optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0, adam_eps=1e-6, weight_decay=0.0),
        importance_sampling=ImportanceSamplingConfig(enabled=bool(importance_sampling), **(importance_sampling or {})),
        **(train_overrides or {}),
    )
    return PolicyTrainer(
        model,
        AlgorithmConfig(name=algorithm, **algorithm_overrides),
        train,
        ParallelConfig(
            tensor=tp,
            pipeline=pp,
            context=cp,
            distributed_optimizer=distributed_optimizer,
            sequence_parallel=sequence_parallel,
            expert=ep,
            expert_tensor=etp,
            first_stage_layers=first_stage_layers,
        ),
        initial_weights=policy,
        reference_weights=reference,
        lora=lora,
    )


def with_rollout_logprobs(samples, seed=3):
    """The samples with engine log-probs in [-12, -1] (the tiny model's are near -5.3): ratios from
    about 0.01 (vetoed at veto=0.05) to past the upper threshold."""
    rng = random.Random(seed)
    for sample in samples:
        sample.rollout_logprobs = [rng.uniform(-12.0, -1.0) for _ in sample.response_ids]
    return samples


def one_update(
    rank,
    world,
    tp,
    pp,
    policy,
    reference,
    algorithm="zcpo",
    distributed_optimizer=False,
    cp=1,
    packing="thd",
    importance_sampling=False,
    sequence_parallel=False,
    model=MODEL,
    ep=1,
    etp=None,
    first_stage_layers=None,
):
    """Coefficients, metrics and the updated global weights after one rollout step."""
    trainer = make_trainer(
        tp,
        pp,
        policy,
        reference,
        algorithm,
        distributed_optimizer=distributed_optimizer,
        cp=cp,
        packing=packing,
        importance_sampling=importance_sampling,
        sequence_parallel=sequence_parallel,
        model=model,
        ep=ep,
        etp=etp,
        first_stage_layers=first_stage_layers,
    )
    samples = rollout()
    if importance_sampling:
        samples = with_rollout_logprobs(samples)
    plan = trainer.assign_minibatches(samples)
    metrics = trainer.train_step(samples)
    return {
        "coefficients": trainer.last_coefficients,
        "metrics": metrics,
        "params": trainer.global_state_dict(),
        "my_samples": plan.my_indices,
        "groups_of_mine": sorted({samples[i].group_id for i in plan.my_indices}),
    }


def probe_norm(rank, world, tp, pp, policy, reference, model=MODEL):
    """||grad|| of the first mini-batch's loss through gradient_vector, and the update's own norm."""
    trainer = make_trainer(tp, pp, policy, reference, model=model)
    samples = rollout()
    plan = trainer.assign_minibatches(samples)
    experience = trainer.experience(samples, plan)
    coefficients, stats = trainer.calibrate(samples, experience)
    step = RolloutStep(samples, plan, experience, coefficients, stats)
    normalizer = trainer.normalizer(samples, plan.minibatches[0])
    vector = trainer.gradient_vector(step, plan.mine[0], normalizer, lambda inputs: trainer.algorithm_loss(inputs).loss)
    probed = trainer.gradient_dot(vector, vector) ** 0.5
    from megatron_zcpo.training.metrics import MetricAccumulator

    grad_norms = trainer.update(step, MetricAccumulator())
    return probed, grad_norms[0]


def selfcheck(rank, world, tp, pp, policy, reference):
    """Step-0 self-check: passes with policy == reference, raises when they differ."""
    trainer = make_trainer(tp, pp, policy, None)
    metrics = trainer.train_step(rollout())
    broken = make_trainer(tp, pp, policy, reference)
    broken.reference_is_initial_policy = True  # pretend: the reference should equal the policy
    try:
        broken.train_step(rollout())
    except RuntimeError as error:
        return metrics, str(error)
    return metrics, None


def bf16_steps(rank, world, tp):
    """Two bf16 steps with the distributed optimizer (Float16 optimizer, fp32 main params)."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    setup_megatron(tensor_parallel=tp, seed=1)
    trainer = PolicyTrainer(
        MODEL,
        AlgorithmConfig(name="zcpo"),
        TrainConfig(bf16=True, optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0)),
        ParallelConfig(tensor=tp, distributed_optimizer=True),
    )
    dtypes = {p.dtype for p in trainer.policy.parameters()}
    return dtypes, [trainer.train_step(rollout(seed=seed)) for seed in (0, 1)]


def build(rank, world, tp, pp, policy, reference, **options):
    """Only construct the trainer (start-up validation); returns nothing."""
    make_trainer(tp, pp, policy, reference, **options)


def behaviour_token_weights(rank, world, modes):
    """The importance weights the update's loss receives when each response's tokens came from two weight
    versions: behaviour log-probs set to the trainer's own minus log 3 on a response's first half and plus
    log 4 on its second (per-token ratios 3 and 1/4). Returns {mode: [(weights the loss got [T], the
    trainer's old log-probs [T], the behaviour log-probs [T])]} per trainable sample of the first mini-batch,
    and under "calibration" (ZCPO's coefficients [N] of those samples with the two-version behaviour, the same
    samples' coefficients on-policy, their group ids [N])."""
    import dataclasses
    import math

    import torch

    policy, reference = weights(21), weights(22)
    results = {}
    for mode in modes:
        trainer = make_trainer(1, 1, policy, reference, importance_sampling={"mode": mode})
        samples = rollout()
        step = trainer.start_step(samples)
        experience = trainer.experience(samples, step.assignment)
        for index, sample in enumerate(samples):
            old = experience[index].old_logprob.double()
            half = len(sample.response_ids) // 2
            shift = torch.tensor([math.log(3)] * half + [-math.log(4)] * (len(old) - half), dtype=torch.float64)
            sample.rollout_logprobs = (old - shift).float().tolist()
        step.experience = experience
        step.coefficients, step.stats = trainer.calibrate(samples, experience)
        on_policy = [dataclasses.replace(sample, rollout_logprobs=None) for sample in samples]
        results["calibration"] = (
            step.coefficients,
            trainer.calibrate(on_policy, experience)[0],
            torch.tensor([sample.group_id for sample in samples]),
        )
        seen = {}

        def capture(inputs, seen=seen, trainer=trainer):
            for row, index in enumerate(inputs.sample_indices):
                seen[index] = (inputs.token_weight[row].clone(), inputs.old_logprob[row].clone())
            return trainer.algorithm_loss(inputs).loss

        first = step.assignment.mine[0]
        trainer.gradient_vector(step, first, trainer.normalizer(samples, step.assignment.minibatches[0]), capture)
        results[mode] = [
            (
                seen[i][0][: len(samples[i].response_ids)],
                seen[i][1][: len(samples[i].response_ids)],
                torch.tensor(samples[i].rollout_logprobs),
            )
            for i in first
            if samples[i].trainable
        ]
    return results
