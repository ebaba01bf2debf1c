"""Convert a Megatron dist checkpoint (converted or trained, any TP/PP/EP) into a Hugging Face model directory.

    python tools/convert_megatron_to_hf.py --ckpt DIR --out DIR [--overwrite] [--dtype bfloat16]
        [--max-shard-gb 2] [--hf-files DIR] [--verify [--tp N] [--pp N] [--ep N] [--etp N]]

--ckpt is a converted checkpoint (the directory holding the torch_dist files and model_config.json),
a training step (<run_dir>/checkpoints/step_XXXXXXXX or its weights/), a checkpoint directory or a
run directory (its newest complete step). Streams one tensor at a time into sharded safetensors with
model.safetensors.index.json, writes config.json and copies the tokenizer and generation config:
those stored with a converted checkpoint, for a training step those of the run's model.tokenizer /
model.path (its config.yaml), or of --hf-files. --out is written whole into a fresh directory and
renamed into place: a non-empty --out is refused unless --overwrite. --verify then loads the checkpoint
in Megatron at --tp/--pp/--ep/--etp and compares its logits with transformers on the written
directory (the max abs difference is printed last; exit 1 above --tolerance). DeepSeek-V3-class
models come back in bf16 without quantization_config (their FP8 weights were dequantised on the way
in), with the multi-token-prediction layers the way in kept (--mtp keep) and none when it dropped them.

A LoRA run's step (model.lora: its weights/ holds the adapters and lora.json) is merged into its base:
each adapted weight becomes W + (alpha/r) B A, computed in fp32 and cast to the stored dtype, the rest
is the base's; --base DIR is the base (default: the path the run recorded, checked by fingerprint).
--peft writes the adapters alone as a Hugging Face PEFT folder instead (adapter_config.json +
adapter_model.safetensors, for PEFT's PeftModel.from_pretrained or SGLang's /load_lora_adapter).
"""

import argparse
import sys

from convert_hf_to_megatron import (
    add_layout_arguments,
    describe,
    stage_layers,
    verify_layout,
)  # tools/ is the script's directory

DTYPES = ("bfloat16", "float16", "float32")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--ckpt",
        required=True,
        help="a converted checkpoint (with model_config.json), a training step, a checkpoint or run directory",
    )
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--dtype", choices=DTYPES, default=None, help="cast weights (default: as stored)")
    parser.add_argument("--max-shard-gb", type=float, default=2.0, help="safetensors shard size (GiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out once converted")
    parser.add_argument(
        "--hf-files",
        default=None,
        help="Hugging Face directory whose config.json and tokenizer files go with the weights "
        "(default: the checkpoint's hf/, or the training run's model.tokenizer / model.path)",
    )
    parser.add_argument(
        "--base", default=None, help="LoRA steps: the base to merge into (default: the run's recorded model.path)"
    )
    parser.add_argument("--peft", action="store_true", help="LoRA steps: write the adapters as a PEFT folder")
    add_layout_arguments(parser)
    return parser.parse_args(argv)


def convert_lora(args, found) -> int:
    """A LoRA step: its adapters merged into the base (or, with --peft, as a PEFT folder)."""
    import torch

    from megatron_zcpo.convert.lora_export import export_peft, merge_into_hf
    from megatron_zcpo.megatron.initialize import setup_megatron

    if args.verify:
        raise SystemExit("--verify: a LoRA step holds adapters only; verify the merged folder by converting it back")
    setup_megatron()
    weights, record = found
    try:
        if args.peft:
            model, written = export_peft(weights, args.out, overwrite=args.overwrite)
            print(f"wrote the PEFT adapter {args.out} ({written / 2**20:.1f} MiB) of {weights}: {describe(model)}")
            return 0
        model = merge_into_hf(
            weights,
            args.out,
            base=args.base,
            dtype=getattr(torch, args.dtype) if args.dtype else None,
            max_shard_bytes=int(args.max_shard_gb * 2**30),
            overwrite=args.overwrite,
            hf_files=args.hf_files,
        )
    except (FileNotFoundError, ValueError) as error:
        raise SystemExit(f"--ckpt {args.ckpt}: {error}") from None
    print(f"wrote {args.out}: the adapters of {weights} (rank {record['config']['rank']}) merged into their base")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from megatron_zcpo.checkpoint.io import read_model_config
    from megatron_zcpo.convert.checkpoint import (
        check_parallel_layout,
        convert_megatron_to_hf,
        hf_files_of,
        require_megatron_checkpoint,
    )
    from megatron_zcpo.convert.lora_export import lora_checkpoint
    from megatron_zcpo.megatron.initialize import setup_megatron

    try:
        ckpt = require_megatron_checkpoint(args.ckpt)
    except FileNotFoundError as error:
        raise SystemExit(f"--ckpt: {error}") from None
    found = lora_checkpoint(ckpt)
    if found is not None:
        return convert_lora(args, found)
    if args.peft or args.base:
        raise SystemExit(f"--peft / --base: {ckpt} holds a whole model, not LoRA adapters")
    check_parallel_layout(read_model_config(ckpt), args.tp, args.pp, args.ep, args.etp, **stage_layers(args))
    hf_files = args.hf_files or hf_files_of(ckpt)
    setup_megatron()
    model = convert_megatron_to_hf(
        ckpt,
        args.out,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        max_shard_bytes=int(args.max_shard_gb * 2**30),
        overwrite=args.overwrite,
        hf_files=hf_files,
    )
    tokenizer = f"tokenizer and config from {hf_files}" if hf_files else "no tokenizer files found: pass --hf-files DIR"
    print(f"wrote {args.out} from {ckpt}: {describe(model)}; {tokenizer}", flush=True)
    return verify_layout(args, ckpt, args.out, model) if args.verify else 0


if __name__ == "__main__":  # dist_checkpointing re-imports __main__ in a spawned process
    sys.exit(main())
