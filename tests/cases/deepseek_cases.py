"""Training runs of the tiny DeepSeek-V3 (module-level so spawned ranks can import them): one process
for the reference step, routing replay and the correction bias; layouts; an EP2 run saved and resumed."""

import torch

from tests.cases import routing_cases, trainer_cases

MODEL = trainer_cases.DEEPSEEK
NOISE = 0.5  # added to the routers between the experience pass and the update (routing_cases.RouterNoise)
BIAS = "decoder.layers.{}.mlp.router.expert_bias"


def _step(trainer, seed=0):
    """One step's metrics, coefficients and global weights (trainer_cases.one_update's result)."""
    metrics = trainer.train_step(trainer_cases.rollout(seed=seed))
    return {"coefficients": trainer.last_coefficients, "metrics": metrics, "params": trainer.global_state_dict()}


def in_one_process(rank, world, bias_rate):
    """The policy and reference weights every layout starts from, the single-process reference step
    (ZCPO, exact KL), then in the same process: R2 with routers perturbed before the update, R3
    replaying R2's routing with every third token's experts moved, and a step whose correction bias
    follows DeepSeek's aux-free rule at ``bias_rate``."""
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.megatron.weights import iter_global_tensors
    from megatron_zcpo.training.config import MoETraining

    weights = trainer_cases.deepseek_weights(21), trainer_cases.deepseek_weights(22)
    trainer = trainer_cases.make_trainer(1, 1, *weights, model=MODEL)
    # the Hugging Face names in the order the weight push sends them (megatron-core's parameter order)
    push_order = [
        (name, tuple(t.shape)) for name, t in megatron_to_hf_stream(iter_global_tensors(trainer.policy), MODEL)
    ]
    reference = _step(trainer)
    replayed = {}
    for mode in ("experience", "rollout"):
        trainer = trainer_cases.make_trainer(1, 1, *weights, model=MODEL, train_overrides={"routing_replay": mode})
        trainer.diagnostics = routing_cases.RouterNoise(NOISE)
        samples = trainer_cases.rollout()
        if mode == "rollout":  # the engine's routing: R2's record, scrambled on a known share of tokens,
            # in SGLang's layout (every layer's slots, zeros for the dense layer 0)
            for index, routing in replayed["experience"]["routing"].items():
                routing = routing.clone()
                flip = torch.arange(routing.shape[0]) % 3 == 0
                routing[flip] = (routing[flip] + 1) % MODEL.num_experts
                dense = torch.zeros(routing.shape[0], MODEL.num_experts_per_tok, dtype=routing.dtype)
                samples[index].routed_experts = torch.cat([dense, routing], dim=1)
        metrics = trainer.train_step(samples)
        step = trainer.routing.step
        routing = {i: r.reshape(r.shape[0], -1).long() for i, r in (step.reference or step.engine).items()}
        replayed[mode] = {"metrics": metrics, "routing": routing, "engine": [s.routed_experts for s in samples]}
    balancing = trainer_cases.make_trainer(
        1, 1, *weights, model=MODEL, train_overrides={"moe": MoETraining(expert_bias_update_rate=bias_rate)}
    )
    balanced = _step(balancing)
    return {
        "weights": weights,
        "reference": reference,
        "replayed": replayed,
        "balanced": balanced,
        "push_order": push_order,
    }


def four_ranks(rank, world, weights, root, bias_rate):
    """On 4 ranks, one after another: a step at TP2 with sequence parallelism x PP2 (1 + 2 layers) x
    EP2 (ETP1, the experts over the TP ranks), the correction bias frozen; then at EP2 x DP4
    (distributed optimizer) with the bias moved by DeepSeek's aux-free rule at ``bias_rate`` (each
    rank counts its own tokens' experts; megatron-core sums the counts over TP x DP x CP) step 1 (its
    result), a checkpoint, step 2 (its loss and weights), and a fresh trainer that resumes the
    checkpoint and runs step 2 again."""
    from megatron_zcpo.checkpoint.io import find_latest
    from megatron_zcpo.training.config import MoETraining

    layout = _step(
        trainer_cases.make_trainer(
            2, 2, *weights, model=MODEL, ep=2, etp=1, sequence_parallel=True, first_stage_layers=1
        )
    )
    balancing = {"moe": MoETraining(expert_bias_update_rate=bias_rate)}
    trainer = trainer_cases.make_trainer(
        1, 1, *weights, model=MODEL, ep=2, distributed_optimizer=True, train_overrides=balancing
    )
    first = _step(trainer, seed=0)
    trainer.save(root, {"loop": {"next_seed": 1}}, keep_last=1)
    second = trainer.train_step(trainer_cases.rollout(seed=1))["update/loss"]
    uninterrupted = {"loss": second, "params": trainer.global_state_dict()}
    del trainer
    resumed = trainer_cases.make_trainer(
        1, 1, *weights, model=MODEL, ep=2, distributed_optimizer=True, train_overrides=balancing
    )
    state = resumed.load(find_latest(root))
    loss = resumed.train_step(trainer_cases.rollout(seed=state["loop"]["next_seed"]))["update/loss"]
    return {
        "layout": layout,
        "first": first,
        "uninterrupted": uninterrupted,
        "resumed": {"loss": loss, "params": resumed.global_state_dict(), "step": resumed.step},
    }
