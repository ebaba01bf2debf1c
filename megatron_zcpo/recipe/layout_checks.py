"""What a rank would refuse about a run's layout, found before any rank starts: one check for
``zcpo train``, ``zcpo train --dry-run`` and ``zcpo plan``.

megatron-core refuses a layout only once every rank has imported it and built its model (a
``tensor_model_parallel_size`` that does not divide the attention heads, say), and the trainer
finds a mini-batch too small for the data-parallel ranks only at its first step. These checks
use the model's architecture (its config file, or a preset) and the config alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

from megatron_zcpo.megatron.model import ModelConfig, pipeline_stage_layers
from megatron_zcpo.recipe.config import RunConfig

# What model.preset must agree on with model.path: the shapes the plan and the layout depend on
# (an Instruct release may differ from its base in context length or RoPE base, and still plan alike).
PRESET_SHAPE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "qk_layernorm",
)


def run_architecture(config: RunConfig) -> ModelConfig:
    """The architecture ``config`` trains: ``model.architecture``, else what ``model.path`` holds
    (whose shapes, :data:`PRESET_SHAPE_FIELDS`, must match ``model.preset`` when both are given),
    else ``model.preset``.

    Reads config files only (a few KB). Raises ``ValueError`` naming the key.
    """
    from megatron_zcpo.convert.presets import preset_model_config, preset_names

    source = config.model
    if source.architecture is not None:
        return source.architecture
    preset = preset_model_config(source.preset) if source.preset else None
    if source.path is not None and Path(source.path).exists():
        from megatron_zcpo.convert.checkpoint import model_config_at

        stored = model_config_at(source.path)
        differing = [
            f"{field} {getattr(stored, field)!r} (preset {getattr(preset, field)!r})"
            for field in PRESET_SHAPE_FIELDS
            if preset is not None and getattr(stored, field) != getattr(preset, field)
        ]
        if differing:
            raise ValueError(
                f"model.preset={source.preset!r} does not describe model.path={source.path!r}, which has "
                f"{', '.join(differing)}: correct model.preset or remove it"
            )
        return stored
    if preset is not None:
        return preset
    raise ValueError(
        f"model.path={source.path!r} does not exist: name its architecture with model.preset (one of "
        f"{preset_names()}), or give zcpo plan --model-config PATH (the model's config.json) or --preset NAME"
    )


def plan_inputs(config: RunConfig, gpus: int):
    """(Layout, Workload) of the memory planner for ``config`` on ``gpus`` GPUs (DP = gpus / (TP*PP*CP)).

    Raises ``ValueError`` when ``gpus`` is not a multiple of TP*PP*CP."""
    from megatron_zcpo.algorithms import build_algorithm
    from megatron_zcpo.planning.memory_model import Layout, Workload

    parallel = config.parallel
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    if gpus % model_parallel:
        raise ValueError(f"--gpus {gpus} is not a multiple of TP*PP*CP = {model_parallel}")
    layout = Layout(
        tensor_parallel=parallel.tensor,
        pipeline_parallel=parallel.pipeline,
        context_parallel=parallel.context,
        data_parallel=gpus // model_parallel,
        sequence_parallel=parallel.sequence_parallel,
        distributed_optimizer=parallel.distributed_optimizer,
        recompute=config.train.recompute or "none",
        expert_parallel=parallel.expert,
        expert_tensor_parallel=parallel.expert_tensor,
        first_stage_layers=parallel.first_stage_layers,
        last_stage_layers=parallel.last_stage_layers,
    )
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    # The trainer gives a sequence longer than the token budget a micro-batch of its own.
    lora = config.model.lora
    workload = Workload(
        micro_batch_tokens=max(config.train.micro_batch_tokens, longest),
        max_sequence_length=longest,
        kl_chunk_tokens=config.train.kl_chunk_size,
        # A LoRA run's reference is its base with the adapters off: no weights of its own.
        reference="adapters_off" if lora else "offloaded" if config.train.reference_offload else "resident",
        token_stats_backend=config.train.token_stats_backend,
        update_reference=build_algorithm(config.algorithm).needs_current_kl,
        lora_rank=lora.rank if lora else 0,
        lora_targets=tuple(lora.targets) if lora else (),
    )
    return layout, workload


def _divisors_of_all(*values: int) -> List[int]:
    return [d for d in range(1, min(values) + 1) if all(v % d == 0 for v in values)]


def layout_problems(
    config: RunConfig,
    model: ModelConfig,
    world_size: int,
    *,
    world_source: str = "processes",
    tokenizer_size: Optional[int] = None,
    gpu_memory_gib: Optional[float] = None,
) -> List[str]:
    """Everything a rank would refuse about ``config`` on ``world_size`` processes, each naming its key.

    ``world_source``: how the user sets ``world_size`` (named in the message). ``tokenizer_size``:
    checked against the model's vocabulary when given. ``gpu_memory_gib``: when given, the memory
    planner's peak per GPU (megatron_zcpo/planning/planner.py, what ``zcpo plan`` prints) must fit.
    Returns [] when the layout is fine.
    """
    parallel, problems = config.parallel, []
    tp, pp, cp = parallel.tensor, parallel.pipeline, parallel.context
    if world_size % (tp * pp * cp):
        problems.append(
            f"parallel: TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp} must divide the {world_size} {world_source}"
        )
    if cp > 1 and model.is_mla:
        problems.append(
            f"parallel.context={cp}: context parallelism is not supported with multi-latent attention "
            f"(the {model.family} model); use parallel.context=1"
        )
    split = ("num_attention_heads", "num_key_value_heads", "intermediate_size")  # heads, query groups, MLP width
    undivided = [f"{field}={getattr(model, field)}" for field in split if getattr(model, field) % tp]
    if undivided:
        valid = _divisors_of_all(*(getattr(model, field) for field in split))
        problems.append(
            f"parallel.tensor={tp} must divide the model's {' and '.join(undivided)} "
            f"(parallel.tensor may be {', '.join(map(str, valid[:8]))})"
        )
    try:
        pipeline_stage_layers(model.num_layers, pp, parallel.first_stage_layers, parallel.last_stage_layers)
    except ValueError as error:
        problems.append(
            f"{error} (even stages: parallel.pipeline may be "
            f"{', '.join(map(str, _divisors_of_all(model.num_layers)[:8]))})"
        )
    problems += _expert_problems(config, model)
    problems += _sequence_problems(config, model)
    if tokenizer_size is not None and tokenizer_size > model.vocab_size:
        problems.append(
            f"model.tokenizer: the tokenizer has {tokenizer_size} tokens but the model's vocabulary is "
            f"{model.vocab_size} (a tokenizer of another model?)"
        )
    problems += _batch_problems(config, max(1, world_size // (tp * pp * cp)))
    if gpu_memory_gib is not None and not problems:
        problems += _memory_problems(config, model, world_size, gpu_memory_gib)
    return problems


def _expert_problems(config: RunConfig, model: ModelConfig) -> List[str]:
    """What megatron's MoE layer and the trainer refuse about ``parallel.expert`` / ``expert_tensor`` on
    ``model`` (the routing settings are checked at start-up, :mod:`megatron_zcpo.recipe.preflight`)."""
    parallel = config.parallel
    expert_tensor = parallel.expert_tensor or parallel.tensor
    if not model.is_moe:
        if parallel.expert != 1 or expert_tensor != parallel.tensor:
            return [
                f"parallel.expert={parallel.expert}, parallel.expert_tensor={parallel.expert_tensor}: "
                f"the {model.family} model has no experts"
            ]
        return []
    problems = []
    if model.num_experts % parallel.expert:
        problems.append(f"parallel.expert={parallel.expert} must divide the model's num_experts={model.num_experts}")
    if model.moe_intermediate_size % expert_tensor:
        problems.append(
            f"parallel.expert_tensor={expert_tensor} must divide the model's "
            f"moe_intermediate_size={model.moe_intermediate_size}"
        )
    if parallel.tensor > 1 and not parallel.sequence_parallel:
        problems.append(
            f"parallel.tensor={parallel.tensor} with a mixture-of-experts model needs "
            "parallel.sequence_parallel=true (megatron-core's MoE layer refuses TP without it)"
        )
    return problems


def _sequence_problems(config: RunConfig, model: ModelConfig) -> List[str]:
    """The longest sequence (prompt and response) must fit the model's positions."""
    from megatron_zcpo.recipe.timeouts import longest_new_tokens

    prompt, new_tokens = config.data.max_prompt_length, longest_new_tokens(config)
    if prompt + new_tokens <= model.max_position_embeddings:
        return []
    return [
        f"data.max_prompt_length={prompt} + rollout.max_new_tokens (or eval.max_new_tokens) {new_tokens} = "
        f"{prompt + new_tokens} tokens is longer than the model's max_position_embeddings="
        f"{model.max_position_embeddings}"
    ]


def _batch_problems(config: RunConfig, data_parallel: int) -> List[str]:
    """Mini-batches keep groups whole, and each one must give every data-parallel rank a response
    (a whole group, for algorithms that need one per micro-batch)."""
    from megatron_zcpo.algorithms import build_algorithm

    rollout, mini_batches = config.rollout, config.train.mini_batches
    problems = []
    if mini_batches > rollout.prompts_per_step:
        problems.append(
            f"train.mini_batches={mini_batches} is more than the rollout's rollout.prompts_per_step="
            f"{rollout.prompts_per_step} groups, and mini-batches keep groups whole"
        )
    whole_groups = build_algorithm(config.algorithm).needs_whole_groups
    units = rollout.prompts_per_step * (1 if whole_groups else rollout.samples_per_prompt)
    per_mini_batch = units // max(1, min(mini_batches, rollout.prompts_per_step))
    if per_mini_batch < data_parallel:
        unit = "groups" if whole_groups else "responses"
        problems.append(
            f"each of the train.mini_batches={mini_batches} mini-batches holds {per_mini_batch} {unit} "
            f"(rollout.prompts_per_step={rollout.prompts_per_step} x rollout.samples_per_prompt="
            f"{rollout.samples_per_prompt}) but the {data_parallel} data-parallel ranks need one each: "
            "lower train.mini_batches or raise rollout.prompts_per_step"
        )
    return problems


def _memory_problems(config: RunConfig, model: ModelConfig, world_size: int, gpu_memory_gib: float) -> List[str]:
    from megatron_zcpo.planning.memory_model import GIB, Hardware
    from megatron_zcpo.planning.planner import plan_memory

    layout, workload = plan_inputs(config, world_size)
    plan = plan_memory(model, layout, workload, Hardware(gpu_memory_gib=gpu_memory_gib))
    # The estimate refuses only where it is sure: a tight plan (its reserve or margin eaten) may still run.
    if plan.verdict == "tight":
        import logging

        logging.getLogger(__name__).warning(
            "memory is tight at %s (%.1f of %.1f GiB): %s; `zcpo plan CONFIG --gpus %d` shows the breakdown",
            layout.describe(),
            plan.total_bytes / GIB,
            plan.capacity_bytes / GIB,
            plan.tight_reason(),
            world_size,
        )
    if plan.verdict != "does not fit":
        return []
    return [
        f"memory: the planner puts {plan.total_bytes / GIB:.1f} GiB on the most loaded GPU ({plan.stage} stage, "
        f"{plan.phase} phase) of {plan.capacity_bytes / GIB:.1f} GiB at {layout.describe()}: `zcpo plan CONFIG "
        f"--gpus {world_size}` shows the breakdown and the smallest layout that fits (--skip-memory-check starts "
        "anyway)"
    ]
