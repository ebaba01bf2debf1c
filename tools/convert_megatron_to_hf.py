"""Convert a Megatron dist checkpoint (converted or trained, any TP/PP/EP) into a Hugging Face model directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--dtype bfloat16] [--max-shard-gb 2]
        [--verify [--tp N] [--pp N] [--ep N] [--etp N]]

--ckpt is the directory holding the torch_dist files and model_config.json. Streams one tensor at
a time into sharded safetensors with model.safetensors.index.json, writes config.json and copies
the tokenizer and generation config stored with the checkpoint. --verify then loads the checkpoint
in Megatron at --tp/--pp/--ep/--etp and compares its logits with transformers on the written
directory (the max abs difference is printed last; exit 1 above --tolerance).
"""

import argparse
import sys

from convert_hf_to_megatron import add_layout_arguments, describe, verify_layout  # tools/ is the script's directory

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ckpt", required=True, help="Megatron checkpoint directory (with model_config.json)")
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights (default: as stored)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (GiB)")
    add_layout_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_zcpo.checkpoint.io import read_model_config
    from megatron_zcpo.convert.checkpoint import check_parallel_layout, convert_megatron_to_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    check_parallel_layout(read_model_config(args.ckpt), args.tp, args.pp, args.ep, args.etp)
    setup_megatron()
    model = convert_megatron_to_hf(
        args.ckpt,
        args.out,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
    )
    print(f"wrote {args.out}: {describe(model)}", flush=True)
    return verify_layout(args, args.ckpt, args.out, model) if args.verify else 0


if __name__ == "__main__":  # dist_checkpointing re-imports __main__ in a spawned process
    sys.exit(main())
