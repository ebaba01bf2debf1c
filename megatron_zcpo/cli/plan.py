"""``zcpo plan``: per-GPU memory of a run config's layout, the smallest layout that fits, and the
predicted step time of the chosen rollout mode; works before any weight or data is downloaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

from megatron_zcpo.recipe.config import RunConfig
from megatron_zcpo.utils.config_loader import apply_overrides, from_dict, load_yaml, validate_tree

# Sections the planner reads; the others (model sources, data files, rewards, eval, logging) may
# point at things not downloaded yet.
PLANNED_SECTIONS = ("parallel", "train", "rollout", "algorithm")


def load_plan_config(path: str, overrides=()) -> RunConfig:
    """The run config of ``path`` + overrides, validating only :data:`PLANNED_SECTIONS`."""
    config = from_dict(RunConfig, apply_overrides(load_yaml(path), overrides))
    for section in PLANNED_SECTIONS:
        validate_tree(getattr(config, section), section)
    return config


def model_config_of(config: RunConfig, model_config: Optional[str] = None, preset: Optional[str] = None):
    """The architecture to plan: ``model_config`` (a config.json file or its directory), else
    ``preset`` (see megatron_zcpo.convert.presets), else model.architecture, else what model.path
    holds (a Megatron checkpoint, or a Hugging Face directory: config.json alone is enough)."""
    from megatron_zcpo.convert import presets

    if model_config is not None:
        return presets.model_config_from_json(model_config)
    if preset is not None:
        return presets.preset_model_config(preset)
    if config.model.architecture is not None:
        return config.model.architecture
    path = config.model.path
    if path is None or not Path(path).exists():
        raise ValueError(
            f"model.path={path!r} does not exist: give the architecture with --model-config PATH "
            f"(the model's config.json, a few KB) or --preset NAME (one of {presets.preset_names()})")
    from megatron_zcpo.convert.checkpoint import model_config_at

    return model_config_at(path)


def plan_inputs(config: RunConfig, gpus: int):
    """(Layout, Workload) of ``config`` on ``gpus`` GPUs (DP = gpus / (TP*PP*CP))."""
    from megatron_zcpo.megatron.memory_model import Layout, Workload

    parallel = config.parallel
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    if gpus % model_parallel:
        raise ValueError(f"--gpus {gpus} is not a multiple of TP*PP*CP = {model_parallel}")
    layout = Layout(tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline,
                    context_parallel=parallel.context, data_parallel=gpus // model_parallel,
                    sequence_parallel=parallel.sequence_parallel,
                    distributed_optimizer=parallel.distributed_optimizer,
                    recompute=config.train.recompute or "none",
                    expert_parallel=parallel.expert, expert_tensor_parallel=parallel.expert_tensor)
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    # The trainer gives a sequence longer than the token budget a micro-batch of its own.
    workload = Workload(micro_batch_tokens=max(config.train.micro_batch_tokens, longest),
                        max_sequence_length=longest,
                        kl_chunk_tokens=config.train.kl_chunk_size,
                        reference="offloaded" if config.train.reference_offload else "resident")
    return layout, workload


def step_load_of(config: RunConfig, response_fraction: float, prompt_fraction: float):
    """The :class:`StepLoad` of ``config``: mean lengths as fractions of the caps; dynamic
    sampling's over-sampling factor multiplies what is generated when tied groups are dropped."""
    from megatron_zcpo.megatron.step_time import StepLoad

    rollout = config.rollout
    trained = rollout.prompts_per_step * rollout.samples_per_prompt
    sampling = rollout.dynamic_sampling
    oversample = sampling.oversample_factor if sampling.drop_tied_groups else 1.0
    return StepLoad(generated_sequences=trained * oversample, trained_sequences=trained,
                    prompt_tokens=prompt_fraction * config.data.max_prompt_length,
                    response_tokens=response_fraction * rollout.max_new_tokens)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="per-GPU memory and step time of a config; smallest fitting layout",
                                   description=__doc__)
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tensor=4")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for training (default: TP*PP*CP)")
    parser.add_argument("--gpu-memory", type=float, default=None,
                        help="GiB per GPU, training and rollout (default: H100 80GB)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model-config", default=None, help="the model's Hugging Face config.json (or its directory)")
    source.add_argument("--preset", default=None,
                        help="a named architecture, e.g. Qwen2.5-32B, Llama-3.3-70B, Qwen3-30B-A3B, Qwen3-235B-A22B")
    timing = parser.add_argument_group("step time (see megatron_zcpo/megatron/step_time.py)")
    timing.add_argument("--rollout-gpus", type=int, default=None, help="GPUs of the SGLang servers (default: --gpus)")
    timing.add_argument("--decode-tokens-per-s", type=float, default=None,
                        help="generated tokens per second per rollout GPU (measure yours; default: the "
                             "roofline of megatron_zcpo/megatron/decode_rate.py, calibrated on SGLang's "
                             "published Llama-3.1-70B 4x H100 throughput)")
    timing.add_argument("--rollout-tp", type=int, default=None,
                        help="GPUs per SGLang server for the modelled decode rate (default: "
                             "rollout.sglang.launch.tp_size when the config launches the servers, else 4 "
                             "up to 40B parameters and 8 above)")
    timing.add_argument("--mfu", type=float, default=0.35, help="model FLOPs utilisation of training")
    timing.add_argument("--response-fraction", type=float, default=0.5,
                        help="mean response length as a fraction of rollout.max_new_tokens")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


# Up to this size a model's bf16 weights leave most of 4 H100s to the KV cache; above, servers use a node.
SMALL_SERVER_MAX_PARAMETERS = 40e9


def rollout_server_of(config: RunConfig, model, rollout_tp: Optional[int] = None):
    """(GPUs per SGLang server, its mem_fraction_static): ``rollout_tp`` when given, else the
    config's ``rollout.sglang.launch`` values when it launches the servers, else 4 GPUs up to
    :data:`SMALL_SERVER_MAX_PARAMETERS` and 8 above, with the launcher's default memory fraction."""
    from megatron_zcpo.rollout.sglang_server import SGLangServerConfig

    launch = config.rollout.sglang.launch
    if rollout_tp is None and launch is not None:
        rollout_tp = launch.get("tp_size", SGLangServerConfig.tp_size)
    elif rollout_tp is None:
        rollout_tp = 4 if model.num_parameters <= SMALL_SERVER_MAX_PARAMETERS else 8
    if rollout_tp < 1:
        raise ValueError(f"--rollout-tp must be at least 1, got {rollout_tp}")
    return rollout_tp, (launch or {}).get("mem_fraction_static", SGLangServerConfig.mem_fraction_static)


def decode_rate_of(args, config: RunConfig, model, load, hardware):
    """(generated tokens/s per rollout GPU, a phrase saying where it comes from): the given
    ``--decode-tokens-per-s``, else the calibrated roofline for ``load``'s mean lengths."""
    from megatron_zcpo.megatron.decode_rate import decode_tokens_per_s_per_gpu

    if args.decode_tokens_per_s is not None:
        return args.decode_tokens_per_s, "given (--decode-tokens-per-s)"
    rollout_tp, mem_fraction = rollout_server_of(config, model, args.rollout_tp)
    rate = decode_tokens_per_s_per_gpu(model, load.prompt_tokens, load.response_tokens, rollout_tp,
                                       mem_fraction=mem_fraction, gpu_memory_bytes=hardware.gpu_memory_gib * 2**30)
    return rate, (f"modelled for TP{rollout_tp} servers (mem_fraction_static {mem_fraction}) from SGLang's "
                  f"published Llama-3.1-70B 4x H100 throughput, see megatron_zcpo/megatron/decode_rate.py")


def _step_time(args, config: RunConfig, model, layout, gpus: int, hardware):
    from megatron_zcpo.megatron.step_time import Cluster, predict_step_time

    load = step_load_of(config, args.response_fraction, prompt_fraction=0.5)
    rate, source = decode_rate_of(args, config, model, load, hardware)
    cluster = Cluster(train_gpus=gpus, rollout_gpus=args.rollout_gpus or gpus,
                      decode_tokens_per_s_per_gpu=rate, mfu=args.mfu)
    timing = predict_step_time(model, load, cluster, pipeline_parallel=layout.pipeline_parallel,
                               recompute=layout.recompute, expert_parallel=layout.expert_parallel)
    return timing, rate, source


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.megatron.memory_model import Hardware
    from megatron_zcpo.megatron.planner import plan_memory, render_plan, suggest_layout

    try:
        config = load_plan_config(args.config, args.overrides)
        model = model_config_of(config, args.model_config, args.preset)
        parallel = config.parallel
        gpus = args.gpus or parallel.tensor * parallel.pipeline * parallel.context
        hardware = Hardware() if args.gpu_memory is None else Hardware(gpu_memory_gib=args.gpu_memory)
        layout, workload = plan_inputs(config, gpus)
        plan = plan_memory(model, layout, workload, hardware)
        timing, decode_rate, decode_source = _step_time(args, config, model, layout, gpus, hardware)
    except (ValueError, KeyError, FileNotFoundError) as error:
        raise SystemExit(f"zcpo plan: {error}") from None
    best = suggest_layout(model, workload, gpus, hardware=hardware, base=layout) if args.gpus else None
    overlap = config.rollout.overlap
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "suggested": best.to_dict() if best else None,
                          "rollout_mode": "overlapped" if overlap else "sequential",
                          "step_time": timing.to_dict(), "decode_tokens_per_s_per_gpu": decode_rate,
                          "decode_source": decode_source}, indent=2))
        return 0 if plan.fits else 1
    active = (f" ({model.num_active_parameters / 1e6:,.1f}M active: {model.num_experts} experts, "
              f"{model.num_experts_per_tok} per token)" if model.is_moe else "")
    print(f"{model.num_parameters / 1e6:,.1f}M parameters{active}, {layout.describe()}, "
          f"micro-batch {workload.micro_batch_tokens} tokens, sequences up to {workload.max_sequence_length}")
    print(render_plan(plan))
    if args.gpus:
        print("smallest fitting layout on", gpus, "GPUs:",
              best.layout.describe() + f" ({best.total_bytes / 2**30:.1f} GiB)" if best else "none fits")
    mode = (f"overlapped (rollout.overlap=true, max_staleness {config.rollout.max_staleness})" if overlap
            else "sequential, on-policy (rollout.overlap=false)")
    other = "overlapped" if not overlap else "sequential"
    print(f"rollout mode: {mode}; predicted step {timing.step_s(overlap):,.0f} s "
          f"(rollout {timing.rollout_s:,.0f} s, training {timing.train_s:,.0f} s, weight push "
          f"{timing.push_per_stage_s:,.1f} s per stage vs {timing.push_funnel_s:,.1f} s through rank 0); "
          f"{other}: {timing.step_s(not overlap):,.0f} s")
    if model.is_moe:
        print(f"expert all-to-all: {timing.all_to_all_s:,.0f} s of the training time at EP{layout.expert_parallel}")
    print(f"decode rate: {decode_rate:,.0f} generated tokens/s per rollout GPU, {decode_source}")
    return 0 if plan.fits else 1
