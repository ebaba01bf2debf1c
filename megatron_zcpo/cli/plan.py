"""``zcpo plan``: per-GPU memory of a run config's layout, and the smallest layout that fits."""

from __future__ import annotations

import argparse
import json

from megatron_zcpo.recipe.config import RunConfig, load_run_config


def model_config_of(config: RunConfig):
    """The architecture of the run: model.architecture, or read from model.path (HF or Megatron)."""
    if config.model.architecture is not None:
        return config.model.architecture
    from megatron_zcpo.convert.checkpoint import model_config_at

    return model_config_at(config.model.path)


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
                    recompute=config.train.recompute or "none")
    longest = config.data.max_prompt_length + config.rollout.max_new_tokens
    # The trainer gives a sequence longer than the token budget a micro-batch of its own.
    workload = Workload(micro_batch_tokens=max(config.train.micro_batch_tokens, longest),
                        max_sequence_length=longest,
                        kl_chunk_tokens=config.train.kl_chunk_size,
                        reference="offloaded" if config.train.reference_offload else "resident")
    return layout, workload


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="per-GPU memory of a config's layout; smallest fitting layout",
                                   description=__doc__)
    parser.add_argument("config", help="run config (YAML)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.tensor=4")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs for training (default: TP*PP*CP)")
    parser.add_argument("--gpu-memory", type=float, default=None, help="GiB per GPU (default: H100 80GB)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatron_zcpo.megatron.memory_model import Hardware
    from megatron_zcpo.megatron.planner import plan_memory, render_plan, suggest_layout

    config = load_run_config(args.config, args.overrides)
    model = model_config_of(config)
    parallel = config.parallel
    gpus = args.gpus or parallel.tensor * parallel.pipeline * parallel.context
    hardware = Hardware() if args.gpu_memory is None else Hardware(gpu_memory_gib=args.gpu_memory)
    layout, workload = plan_inputs(config, gpus)
    try:
        plan = plan_memory(model, layout, workload, hardware)
    except ValueError as error:
        raise SystemExit(f"zcpo plan: {error}") from None
    best = suggest_layout(model, workload, gpus, hardware=hardware, base=layout) if args.gpus else None
    if args.json:
        print(json.dumps({"plan": plan.to_dict(), "suggested": best.to_dict() if best else None}, indent=2))
    else:
        print(f"{model.num_parameters / 1e6:,.1f}M parameters, {layout.describe()}, "
              f"micro-batch {workload.micro_batch_tokens} tokens, sequences up to {workload.max_sequence_length}")
        print(render_plan(plan))
        if args.gpus:
            print("smallest fitting layout on", gpus, "GPUs:",
                  best.layout.describe() + f" ({best.total_bytes / 2**30:.1f} GiB)" if best else "none fits")
    return 0 if plan.fits else 1
