"""Convert a Hugging Face Qwen2/Qwen2.5, Qwen3 (dense) or Llama checkpoint into a Megatron dist checkpoint (loads at any TP/PP).

    python tools/convert_hf_to_megatron.py --hf-dir DIR --out DIR [--tp N] [--pp N] [--sequence-parallel] [--verify]

Streams the safetensors shards one tensor at a time; needs no GPU and no target parallelism.
--tp/--pp name the layout the checkpoint is meant for (checked against the architecture);
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
    parser.add_argument("--tp", type=int, default=1, help="tensor parallelism to check and verify at")
    parser.add_argument("--pp", type=int, default=1, help="pipeline parallelism to check and verify at")
    parser.add_argument("--sequence-parallel", action="store_true", help="verify with sequence parallelism (TP > 1)")
    parser.add_argument("--verify", action="store_true", help="compare logits with transformers after converting")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="max abs logit difference --verify accepts")
    parser.add_argument("--seq-length", type=int, default=32, help="tokens per sample sequence for --verify")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_zcpo.convert.checkpoint import check_parallel_layout, convert_hf_to_megatron
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import model_config_from_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    check_parallel_layout(model_config_from_hf(read_hf_config(args.hf_dir)), args.tp, args.pp)
    setup_megatron()
    model = convert_hf_to_megatron(args.hf_dir, args.out)
    print(f"wrote {args.out}: {model.family}, {model.num_layers} layers, hidden {model.hidden_size}, "
          f"vocab {model.vocab_size}, {model.num_parameters / 1e6:.1f}M parameters", flush=True)
    if not args.verify:
        return 0
    from megatron_zcpo.convert.verify import max_logit_difference, sample_tokens

    tokens = sample_tokens(args.hf_dir, model, args.seq_length)
    difference = max_logit_difference(args.out, args.hf_dir, tokens, args.tp, args.pp, args.sequence_parallel)
    verdict = "ok" if difference <= args.tolerance else f"FAILED: above tolerance {args.tolerance:g}"
    print(f"verify at TP={args.tp} PP={args.pp} SP={args.sequence_parallel} on {tuple(tokens.shape)} tokens: {verdict}")
    print(f"max abs logit difference: {difference:.3e}", flush=True)
    return 0 if difference <= args.tolerance else 1


if __name__ == "__main__":  # dist_checkpointing's writer re-imports __main__ in a spawned process
    sys.exit(main())
