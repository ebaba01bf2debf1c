"""Convert a Hugging Face Qwen2/Qwen2.5, Qwen3, Llama, Qwen3-MoE, Qwen2-MoE or DeepSeek-V3 checkpoint into a Megatron dist checkpoint (loads at any TP/PP/EP).

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out DIR [--overwrite] [--tp N] [--pp N]
        [--first-stage-layers N] [--last-stage-layers N] [--ep N] [--etp N] [--sequence-parallel] [--verify]
        [--mtp drop|keep]

Streams the safetensors shards one tensor at a time; needs no GPU and no target parallelism.
--tp/--pp (and --ep/--etp: expert and expert-tensor parallelism of mixture-of-experts models) name
the layout the checkpoint is meant for (checked against the architecture: experts must split evenly;
--first-stage-layers/--last-stage-layers give uneven pipeline stages, e.g. 94 layers at --pp 8);
--out is written whole into a fresh directory and renamed into place (a non-empty --out is refused
unless --overwrite); DeepSeek-V3's blockwise-FP8 weights are dequantised to bf16, and its
multi-token-prediction layers must be dropped or kept (--mtp; kept ones are carried through unchanged);
--verify loads the result in Megatron at that layout (with the layer spec a run uses: Transformer
Engine's where it is installed, and sequence parallelism with --sequence-parallel), runs sample text through it and through
Hugging Face transformers, and prints the max abs logit difference last (exit 1 above --tolerance).
"""

import argparse
import sys


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-dir", required=True, help="Hugging Face model directory (config.json, *.safetensors)")
    parser.add_argument("--out", required=True, help="output Megatron checkpoint directory")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once converted")
    parser.add_argument(
        "--mtp",
        choices=("drop", "keep"),
        default=None,
        help="DeepSeek-V3's multi-token-prediction layers: drop them, or keep them unchanged beside the model",
    )
    add_layout_arguments(parser)
    return parser.parse_args(argv)


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """--tp/--pp/--ep/--etp (the layout to check and verify at) and the --verify options, shared
    with tools/convert_megatron_to_hf.py."""
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism to check and verify at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallelism to check and verify at")
    parser.add_argument(
        "--first-stage-layers", type=int, default=None, help="layers of the first pipeline stage (uneven stages)"
    )
    parser.add_argument(
        "--last-stage-layers", type=int, default=None, help="layers of the last pipeline stage (uneven stages)"
    )
    parser.add_argument("--ep", type=int, default=1, help="expert parallelism to check and verify at (MoE models)")
    parser.add_argument("--etp", type=int, default=None, help="expert tensor parallelism (MoE models; default: --tp)")
    parser.add_argument("--sequence-parallel", action="store_true", help="verify with sequence parallelism (TP > 1)")
    parser.add_argument("--verify", action="store_true", help="compare logits with transformers after converting")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max abs logit difference --verify accepts")
    parser.add_argument("--seq-length", type=int, default=32, help="tokens per sample sequence for --verify")


def stage_layers(args) -> dict:
    """--first-stage-layers / --last-stage-layers as keywords of check_parallel_layout and the verify."""
    return {"first_stage_layers": args.first_stage_layers, "last_stage_layers": args.last_stage_layers}


def verify_layout(args, ckpt_dir, hf_dir, model) -> int:
    """--verify: the checkpoint's logits at the requested layout against transformers on ``hf_dir``;
    prints the max abs difference last and returns the exit code."""
    from megatron_zcpo.convert.verify import max_logit_difference, sample_tokens

    tokens = sample_tokens(hf_dir, model, args.seq_length)
    difference = max_logit_difference(
        ckpt_dir, hf_dir, tokens, args.tp, args.pp, args.sequence_parallel, args.ep, args.etp, **stage_layers(args)
    )
    verdict = "ok" if difference <= args.tolerance else f"FAILED: above tolerance {args.tolerance:g}"
    experts = f" EP={args.ep} ETP={args.etp or args.tp}" if model.is_moe else ""
    print(
        f"verify at TP={args.tp} PP={args.pp}{experts} SP={args.sequence_parallel} on {tuple(tokens.shape)} "
        f"tokens: {verdict}"
    )
    print(f"max abs logit difference: {difference:.3e}", flush=True)
    return 0 if difference <= args.tolerance else 1


def describe(model) -> str:
    """One line on the converted model (active parameters too for MoE)."""
    line = (
        f"{model.family}, {model.num_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size}, "
        f"{model.num_parameters / 1e6:.1f}M parameters"
    )
    if model.is_moe:
        line += f" ({model.num_active_parameters / 1e6:.1f}M active, {model.num_experts} experts, top-{model.num_experts_per_tok})"
    return line


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_zcpo.convert.checkpoint import check_parallel_layout, convert_hf_to_megatron
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    check_parallel_layout(
        model_config_from_hf(read_hf_config(args.hf_dir)), args.tp, args.pp, args.ep, args.etp, **stage_layers(args)
    )
    setup_megatron()
    model = convert_hf_to_megatron(args.hf_dir, args.out, overwrite=args.overwrite, mtp=args.mtp)
    print(f"wrote {args.out}: {describe(model)}", flush=True)
    return verify_layout(args, args.out, args.hf_dir, model) if args.verify else 0


if __name__ == "__main__":  # dist_checkpointing's writer re-imports __main__ in a spawned process
    sys.exit(main())
