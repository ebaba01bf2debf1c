"""``zcpo plan``: per-GPU memory of a run config's layout, the smallest layout that fits, the
predicted step time of the chosen rollout mode and every timeout against the durations it bounds;
works before any weight or data is downloaded."""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Optional

from megatron_zcpo.recipe.config import RunConfig, read_rollout_mode
from megatron_zcpo.recipe.layout_checks import layout_problems, plan_inputs, run_architecture
from megatron_zcpo.utils.config_loader import apply_overrides, from_dict, load_yaml, validate_tree

# Sections the planner reads; the others (model sources, data files, rewards, eval, logging) may
# point at things not downloaded yet.
PLANNED_SECTIONS = ("parallel", "train", "rollout", "algorithm")


def load_plan_config(path: str, overrides=()) -> RunConfig:
    """The run config of ``path`` + overrides, validating only :data:`PLANNED_SECTIONS`."""
    config = from_dict(RunConfig, read_rollout_mode(apply_overrides(load_yaml(path), overrides)))
    for section in PLANNED_SECTIONS:
        validate_tree(getattr(config, section), section)
    if config.model.lora is not None:  # model.lora changes what is planned; the model's paths need not exist
        validate_tree(config.model.lora, "model.lora")
    return config


def model_config_of(config: RunConfig, model_config: Optional[str] = None, preset: Optional[str] = None):
    """The architecture to plan: ``model_config`` (a config.json file or its directory), else
    ``preset`` (see megatron_zcpo.convert.presets), else the config's own
    (:func:`~megatron_zcpo.recipe.layout_checks.run_architecture`: model.architecture, what
    model.path holds, or model.preset)."""
    from megatron_zcpo.convert import presets

    if model_config is not None:
        return presets.model_config_from_json(model_config)
    if preset is not None:
        return presets.preset_model_config(preset)
    return run_architecture(config)


def step_load_of(config: RunConfig, response_fraction: float, prompt_fraction: float):
    """The :class:`StepLoad` of ``config``: mean lengths as fractions of the caps; dynamic
    sampling's over-sampling factor multiplies what is generated when tied groups are dropped."""
    from megatron_zcpo.planning.step_time import StepLoad

    rollout = config.rollout
    trained = rollout.prompts_per_step * rollout.samples_per_prompt
    sampling = rollout.dynamic_sampling
    oversample = sampling.oversample_factor if sampling.drop_tied_groups else 1.0
    return StepLoad(
        generated_sequences=trained * oversample,
        trained_sequences=trained,
        prompt_tokens=prompt_fraction * config.data.max_prompt_length,
        response_tokens=response_fraction * rollout.max_new_tokens,
        max_response_tokens=rollout.max_new_tokens,
    )


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "plan", help="per-GPU memory and step time of a config; smallest fitting layout", description=__doc__
    )
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tensor=4")
    parser.add_argument(
        "--gpus",
        type=int,
        default=None,
        help="GPUs for training (default: the fewest, TP*PP*CP times the data-parallel size, on which the layout fits)",
    )
    parser.add_argument(
        "--gpu-memory", type=float, default=None, help="GiB per GPU, training and rollout (default: H100 80GB)"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model-config", default=None, help="the model's Hugging Face config.json (or its directory)")
    source.add_argument(
        "--preset",
        default=None,
        help="a named architecture, e.g. Qwen2.5-32B, Qwen3-32B, Llama-3.1-8B, Llama-3.3-70B, Qwen3-30B-A3B, "
        "Qwen3-235B-A22B (megatron_zcpo/convert/presets.py)",
    )
    timing = parser.add_argument_group("step time (see megatron_zcpo/planning/step_time.py)")
    timing.add_argument("--rollout-gpus", type=int, default=None, help="GPUs of the SGLang servers (default: --gpus)")
    timing.add_argument(
        "--decode-tokens-per-s",
        type=float,
        default=None,
        help="generated tokens per second per rollout GPU (measure yours; default: the "
        "roofline of megatron_zcpo/planning/decode_rate.py, calibrated on SGLang's "
        "published Llama-3.1-70B 4x H100 throughput)",
    )
    timing.add_argument(
        "--rollout-tp",
        type=int,
        default=None,
        help="GPUs per SGLang server for the modelled decode rate (default: "
        "rollout.sglang.launch.tp_size when the config launches the servers, else 4 "
        "up to 40B parameters and 8 above)",
    )
    timing.add_argument(
        "--rollout-dp-attention",
        type=int,
        default=None,
        help="DP-attention groups per SGLang server (--dp-size with --enable-dp-attention; default: "
        "rollout.sglang.launch.dp_attention when the config launches the servers, else 1)",
    )
    timing.add_argument(
        "--mfu",
        type=float,
        default=None,
        help="model FLOPs utilisation of training (default: the calibrated 0.35, 0.22 for mixture-of-experts models)",
    )
    parser.add_argument(
        "--expert-imbalance",
        type=float,
        default=None,
        help="the busiest expert-parallel rank's routed tokens over the mean (default 1.3, see "
        "megatron_zcpo/planning/moe_costs.py)",
    )
    timing.add_argument(
        "--response-fraction",
        type=float,
        default=0.5,
        help="mean response length as a fraction of rollout.max_new_tokens",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


# Up to this size a model's bf16 weights leave most of 4 H100s to the KV cache; above, servers use a node.
SMALL_SERVER_MAX_PARAMETERS = 40e9


def rollout_server_of(config: RunConfig, model, rollout_tp: Optional[int] = None, rollout_gpus: int = 0):
    """(GPUs per SGLang server, its mem_fraction_static): ``rollout_tp`` when given, else the
    config's ``rollout.sglang.launch`` values when it launches the servers, else 4 GPUs up to
    :data:`SMALL_SERVER_MAX_PARAMETERS` and 8 above (at most the largest power of two of the
    ``rollout_gpus`` there are, when known), or more where the bf16 weights need them (servers
    spanning nodes: :func:`~megatron_zcpo.planning.decode_rate.smallest_server_tp`), with the
    launcher's default memory fraction."""
    from megatron_zcpo.planning.decode_rate import smallest_server_tp
    from megatron_zcpo.rollout.sglang.server import SGLangServerConfig

    launch = config.rollout.sglang.launch
    mem_fraction = (launch or {}).get("mem_fraction_static", SGLangServerConfig.mem_fraction_static)
    if rollout_tp is None and launch is not None:
        rollout_tp = launch.get("tp_size", SGLangServerConfig.tp_size)
    elif rollout_tp is None:
        rollout_tp = 4 if model.num_parameters <= SMALL_SERVER_MAX_PARAMETERS else 8
        if rollout_gpus > 0:  # a guess: a server that fits the GPUs there are (a tiny model on 2 GPUs)
            rollout_tp = min(rollout_tp, 1 << (rollout_gpus.bit_length() - 1))
        rollout_tp = smallest_server_tp(model, mem_fraction, at_least=rollout_tp)
    if rollout_tp < 1:
        raise ValueError(f"--rollout-tp must be at least 1, got {rollout_tp}")
    return rollout_tp, mem_fraction


def rollout_dp_attention_of(args, config: RunConfig) -> int:
    """The SGLang servers' DP-attention groups: ``--rollout-dp-attention``, else the config's
    ``rollout.sglang.launch.dp_attention``, else 1 (plain tensor parallelism)."""
    if getattr(args, "rollout_dp_attention", None) is not None:
        return args.rollout_dp_attention
    return int((config.rollout.sglang.launch or {}).get("dp_attention", 1))


def decode_rate_of(args, config: RunConfig, model, load, hardware, rollout_gpus: int):
    """(generated tokens/s per rollout GPU, a phrase saying where it comes from): the given
    ``--decode-tokens-per-s``, else the calibrated roofline for ``load``'s mean lengths, each server
    decoding at most the requests in flight on it (``rollout_gpus`` split into servers)."""
    from megatron_zcpo.planning.decode_rate import decode_tokens_per_s_per_gpu
    from megatron_zcpo.recipe.timeouts import in_flight_per_server

    if args.decode_tokens_per_s is not None:
        return args.decode_tokens_per_s, "given (--decode-tokens-per-s)"
    rollout_tp, mem_fraction = rollout_server_of(config, model, args.rollout_tp, rollout_gpus)
    rate = decode_tokens_per_s_per_gpu(
        model,
        load.prompt_tokens,
        load.response_tokens,
        rollout_tp,
        mem_fraction=mem_fraction,
        gpu_memory_bytes=hardware.gpu_memory_gib * 2**30,
        max_batch=in_flight_per_server(config, max(1, rollout_gpus // rollout_tp)),
        dp_attention=rollout_dp_attention_of(args, config),
    )
    return rate, (
        f"modelled for TP{rollout_tp} servers (mem_fraction_static {mem_fraction}) from SGLang's "
        f"published Llama-3.1-70B 4x H100 throughput, see megatron_zcpo/planning/decode_rate.py"
    )


def _step_time(args, config: RunConfig, model, plan, gpus: int, hardware):
    """(StepTime, decode tokens/s per GPU, its source) of the config's placement and mode; a
    colocated GPU offloads its parameters, gradients, optimizer state and reference."""
    from megatron_zcpo.planning.step_time import Cluster, predict_step_time
    from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig

    layout = plan.layout
    load = step_load_of(config, args.response_fraction, prompt_fraction=0.5)
    rate, source = decode_rate_of(args, config, model, load, hardware, args.rollout_gpus or gpus)
    rollout_tp, mem_fraction = rollout_server_of(config, model, args.rollout_tp, args.rollout_gpus or gpus)
    colocated = config.rollout.placement == "colocated"
    cluster = Cluster(
        train_gpus=gpus,
        rollout_gpus=args.rollout_gpus or gpus,
        decode_tokens_per_s_per_gpu=args.decode_tokens_per_s,
        mfu=args.mfu,
        placement=config.rollout.placement,
        rollout_tp=rollout_tp,
        mem_fraction=mem_fraction,
        gpu_memory_bytes=hardware.gpu_memory_gib * 2**30,
        max_in_flight=config.rollout.sglang.client.get("max_concurrency", SGLangEngineConfig.max_concurrency),
        rollout_dp_attention=rollout_dp_attention_of(args, config),
    )
    offloaded = ("parameters", "gradients", "optimizer_states", "reference_model")
    lora = config.model.lora
    adapter_bytes = None
    if lora is not None and lora.push == "adapter":  # the adapter alone, bf16
        from megatron_zcpo.planning.lora_costs import lora_parameters

        adapter_bytes = 2 * lora_parameters(model, lora.rank, lora.targets)
    timing = predict_step_time(
        model,
        load,
        cluster,
        pipeline_parallel=layout.pipeline_parallel,
        recompute=layout.recompute,
        expert_parallel=layout.expert_parallel,
        rollout_mode=config.rollout.mode,
        max_staleness=max(1, config.rollout.max_staleness),
        expert_imbalance=plan.workload.expert_imbalance,
        offloaded_bytes_per_gpu=sum(plan.components[key] for key in offloaded) if colocated else 0.0,
        frozen_base=lora is not None,
        adapter_push_bytes=adapter_bytes,
    )
    return timing, rate, source


def colocated_memory_of(args, config: RunConfig, model, plan):
    """The colocated GPU's two phases (:mod:`megatron_zcpo.planning.colocated`), None when disaggregated."""
    if config.rollout.placement != "colocated":
        return None
    from megatron_zcpo.planning.colocated import ColocatedMemory
    from megatron_zcpo.rollout.sglang.config import SGLangEngineConfig

    _, mem_fraction = rollout_server_of(config, model, args.rollout_tp)
    bucket = config.rollout.sglang.client.get("bucket_bytes", SGLangEngineConfig.bucket_bytes)
    return ColocatedMemory(plan=plan, mem_fraction=mem_fraction, bucket_bytes=bucket)


def timeout_checks_of(args, config: RunConfig, model, gpus: int, hardware):
    """The timeout chain of ``config`` (megatron_zcpo/recipe/timeouts.py) on the planned servers:
    ``--rollout-gpus`` (default ``gpus``) split into servers of the planned tensor parallelism, with
    ``--decode-tokens-per-s`` when given (else modelled per server)."""
    from megatron_zcpo.recipe.timeouts import RolloutServers, timeout_checks

    rollout_tp, mem_fraction = rollout_server_of(config, model, args.rollout_tp, args.rollout_gpus or gpus)
    servers = RolloutServers(
        count=max(1, (args.rollout_gpus or gpus) // rollout_tp),
        tp_size=rollout_tp,
        mem_fraction=mem_fraction,
        decode_tokens_per_s_per_gpu=args.decode_tokens_per_s,
        gpu_memory_bytes=hardware.gpu_memory_gib * 2**30,
        dp_attention=rollout_dp_attention_of(args, config),
    )
    return timeout_checks(config, model, servers)


# `zcpo plan` without --gpus looks for the fewest GPUs (data-parallel replicas) up to this many.
MAX_SEARCHED_DATA_PARALLEL = 256


def smallest_world(config: RunConfig) -> int:
    """The fewest GPUs of one replica of the config's layout: TP*PP*CP, times the data-parallel size
    that lets expert parallelism (EP*ETP) divide a stage's TP*CP*DP ranks (1 without experts)."""
    import math

    parallel = config.parallel
    stage = parallel.tensor * parallel.context
    experts = parallel.expert * (parallel.expert_tensor or parallel.tensor)
    return parallel.tensor * parallel.pipeline * parallel.context * (experts // math.gcd(experts, stage))


def plan_inputs_of(config: RunConfig, gpus: int, expert_imbalance: Optional[float] = None):
    """:func:`plan_inputs` with ``--expert-imbalance`` applied when given."""
    layout, workload = plan_inputs(config, gpus)
    if expert_imbalance is not None:
        workload = dataclasses.replace(workload, expert_imbalance=expert_imbalance)
    return layout, workload


def fewest_gpus(config: RunConfig, model, hardware, expert_imbalance: Optional[float] = None) -> tuple:
    """(GPUs, data-parallel size) of the fewest replicas of the config's layout that fit; the smallest
    world (:func:`smallest_world`) when none up to :data:`MAX_SEARCHED_DATA_PARALLEL` does (the
    distributed optimizer is what shards with DP)."""
    from megatron_zcpo.planning.planner import plan_memory

    parallel = config.parallel
    replica = parallel.tensor * parallel.pipeline * parallel.context
    step = smallest_world(config) // replica
    largest = MAX_SEARCHED_DATA_PARALLEL if parallel.distributed_optimizer else step
    for data_parallel in range(step, largest + 1, step):
        if plan_memory(model, *plan_inputs_of(config, replica * data_parallel, expert_imbalance), hardware).fits:
            return replica * data_parallel, data_parallel
    return replica * step, step


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.planning.memory_model import Hardware
    from megatron_zcpo.planning.planner import format_count as count
    from megatron_zcpo.planning.planner import plan_memory, render_plan, suggest_layout

    try:
        config = load_plan_config(args.config, args.overrides)
        model = model_config_of(config, args.model_config, args.preset)
        hardware = Hardware() if args.gpu_memory is None else Hardware(gpu_memory_gib=args.gpu_memory)
        problems = layout_problems(config, model, args.gpus or smallest_world(config), world_source="GPUs (--gpus)")
        if problems:
            raise ValueError("the layout would be refused:\n  " + "\n  ".join(problems))
        imbalance = args.expert_imbalance
        gpus, data_parallel = (args.gpus, None) if args.gpus else fewest_gpus(config, model, hardware, imbalance)
        layout, workload = plan_inputs_of(config, gpus, imbalance)
        plan = plan_memory(model, layout, workload, hardware)
        timing, decode_rate, decode_source = _step_time(args, config, model, plan, gpus, hardware)
        colocated = colocated_memory_of(args, config, model, plan)
        timeouts = timeout_checks_of(args, config, model, gpus, hardware)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise SystemExit(f"zcpo plan: {error}") from None
    best = suggest_layout(model, workload, gpus, hardware=hardware, base=layout) if args.gpus else None
    rollout_mode = config.rollout.mode
    # The rollout's durations scale with the cluster: without --gpus (or --rollout-gpus) its size is a
    # guess (the fewest GPUs that fit), so a short timeout is reported but does not fail the plan.
    cluster_given = bool(args.gpus or args.rollout_gpus)
    timeouts_ok = not any(check.refused for check in timeouts) or not cluster_given
    memory_ok = plan.verdict != "does not fit" and (colocated is None or colocated.verdict != "does not fit")
    if args.json:
        print(
            json.dumps(
                {
                    "plan": plan.to_dict(),
                    "suggested": best.to_dict() if best else None,
                    "rollout_mode": timing.mode,
                    "placement": config.rollout.placement,
                    "tokens_per_s_per_gpu": timing.tokens_per_s_per_gpu,
                    "step_time": timing.to_dict(),
                    "decode_tokens_per_s_per_gpu": decode_rate,
                    "decode_source": decode_source,
                    "timeouts": [{**vars(check), "ok": check.ok, "refused": check.refused} for check in timeouts],
                    "timeouts_checked_for_rollout_gpus": args.rollout_gpus or gpus,
                    "cluster_given": cluster_given,
                    "colocated_memory": colocated.to_dict() if colocated else None,
                },
                indent=2,
            )
        )
        return 0 if memory_ok and timeouts_ok else 1
    active = (
        f" ({count(model.num_active_parameters)} active: {model.num_experts} experts, "
        f"{model.num_experts_per_tok} per token)"
        if model.is_moe
        else ""
    )
    print(
        f"{count(model.num_parameters)} parameters{active}, {layout.describe()}, "
        f"micro-batch {workload.micro_batch_tokens} tokens, sequences up to {workload.max_sequence_length}"
    )
    if data_parallel and data_parallel > 1:
        print(f"(no --gpus: planned on {gpus} GPUs, the fewest on which this layout fits: DP{data_parallel})")
    if config.model.lora is not None:
        from megatron_zcpo.planning.lora_costs import lora_parameters

        lora = config.model.lora
        print(
            f"LoRA rank {lora.rank} on {', '.join(lora.targets)}: {count(lora_parameters(model, lora.rank, lora.targets))} "
            f"adapter parameters trained, the base frozen (no gradients or optimizer state), no reference weights "
            f"(the base with the adapters off); push: {lora.push}"
        )
    print(render_plan(plan))
    if colocated is not None:
        print(
            f"colocated (rollout.placement=colocated): training {colocated.training_bytes / 2**30:.2f} GiB beside the "
            f"released engine, generation {colocated.generation_bytes / 2**30:.2f} GiB (engine pool "
            f"mem_fraction_static {colocated.mem_fraction}); {colocated.verdict}"
        )
        for problem in colocated.problems():
            print(f"  {problem}")
    if args.gpus:
        print(
            "smallest fitting layout on",
            gpus,
            "GPUs:",
            best.layout.describe() + f" ({best.total_bytes / 2**30:.1f} GiB)" if best else "none fits",
        )
    from megatron_zcpo.planning.step_time import format_seconds as duration

    if timing.mode == "colocated":
        ignored = (
            f" (rollout.mode={rollout_mode} ignored: the same GPUs generate and train)"
            if rollout_mode != "sync"
            else ""
        )
        print(
            f"rollout mode: colocated (rollout.placement=colocated){ignored}; predicted step "
            f"{duration(timing.predicted_s)} (generation on all {gpus} GPUs {duration(timing.rollout_s)}, of which "
            f"the longest response {duration(timing.tail_s)}; training {duration(timing.train_s)}; offload/onload "
            f"{duration(timing.offload_s)}; IPC weight push {duration(timing.ipc_push_s)}); disaggregated on "
            f"{gpus} + {args.rollout_gpus or gpus} GPUs: sequential {duration(timing.sequential_s)}, overlapped "
            f"{duration(timing.overlapped_s)}, asynchronous {duration(timing.asynchronous_s)}"
        )
    else:
        described = {
            "sync": "sequential, on-policy (rollout.mode=sync)",
            "overlap": f"overlapped (rollout.mode=overlap, max_staleness {config.rollout.max_staleness})",
            "async": f"asynchronous (rollout.mode=async, max_staleness {config.rollout.max_staleness})",
        }
        others = (
            f"sequential {duration(timing.sequential_s)}, overlapped {duration(timing.overlapped_s)}, asynchronous "
            f"{duration(timing.asynchronous_s)} (k = {timing.max_staleness}): the last two "
            f"{timing.sequential_s / timing.overlapped_s:.2f}x and {timing.sequential_s / timing.asynchronous_s:.2f}x "
            "as fast as sequential"
        )
        print(
            f"rollout mode: {described[rollout_mode]}; predicted step {duration(timing.predicted_s)} "
            f"(rollout {duration(timing.rollout_s)}: all tokens at the full batch {duration(timing.bulk_s)}, the "
            f"longest response {duration(timing.tail_s)}; training {duration(timing.train_s)}; weight push "
            f"{duration(timing.push_per_stage_s)} per stage vs {duration(timing.push_funnel_s)} through rank 0); "
            f"{others}"
        )
    print(f"throughput: {timing.tokens_per_s_per_gpu:,.0f} trained tokens/s per GPU ({timing.mode})")
    if model.is_moe:
        print(f"expert all-to-all: {duration(timing.all_to_all_s)} of the training time at EP{layout.expert_parallel}")
    print(f"decode rate: {decode_rate:,.0f} generated tokens/s per rollout GPU, {decode_source}")
    from megatron_zcpo.recipe.timeouts import render_timeout_checks

    print(render_timeout_checks(timeouts))
    if not cluster_given:
        print(
            f"(timeouts checked for {gpus} rollout GPUs, a guess: give --gpus N and --rollout-gpus N of your cluster "
            "to check them for it; only then does a short timeout fail the plan)"
        )
    return 0 if memory_ok and timeouts_ok else 1
