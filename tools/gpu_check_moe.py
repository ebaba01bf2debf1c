"""GPU check of the mixture-of-experts path: conversion, logits, training with routing replay R2 and R3, on one GPU.

    python tools/gpu_check_moe.py [--out DIR]        (exit 0: all ok; 1: a check failed; 3: no GPU, ran on the CPU)

A random tiny Qwen3-MoE (2 layers, 4 experts, top-2) built with transformers is converted to a
Megatron checkpoint; its Megatron logits (Transformer Engine's grouped-GEMM experts where TE is
installed, megatron's SequentialMLP otherwise) are compared with transformers' in fp32 on the CPU;
the embedded engine samples on the device and records the experts it routed each token to; one
training step with ``train.routing_replay=experience`` (R2) and one with ``rollout`` (R3, the
engine's experts) run, and the routing metrics are checked: the update passes use exactly the
replayed experts, and engine and trainer (same weights) route nearly every token alike.
One table at the end. Expert parallelism > 1 needs several GPUs and is tested on CPUs (gloo).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a checkout: the package beside it
    sys.path.insert(0, str(ROOT))

from megatron_zcpo.testing.gpu_checks import report

LOGIT_TOLERANCE = 2e-2  # fp32 weights; GPU GEMMs sum in another order (tools/gpu_check.py's --verify tolerance)
ENGINE_MISMATCH_LIMIT = 0.05  # tokens routed differently by transformers and megatron-core at fp32


def make_tiny_qwen3_moe(directory: Path) -> None:
    """A random Qwen3-MoE in Hugging Face format, with well separated router logits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            vocab_size=300,
            hidden_size=64,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        )
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.5 if name.endswith("mlp.gate.weight") else 0.05
            param.copy_(1.0 + 0.1 * torch.randn_like(param) if "norm" in name else scale * torch.randn_like(param))
    model.save_pretrained(directory)


def run(out: Path) -> list:
    """The checks as (name, ok, detail) rows."""
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.checkpoint.io import load_model_checkpoint
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron
    from megatron_zcpo.convert.verify import hf_logits, megatron_logits
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, have_transformer_engine, transformer_config
    from megatron_zcpo.rollout.embedded import EmbeddedEngine
    from megatron_zcpo.rollout.engine import SamplingParams
    from megatron_zcpo.training.batch import RolloutSample
    from megatron_zcpo.training.config import OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer
    from megatron_zcpo.utils.devices import compute_device

    rows = []
    setup_megatron()
    make_tiny_qwen3_moe(out / "hf")
    model = convert_hf_to_megatron(out / "hf", out / "megatron")
    gpt = build_gpt_model(model, transformer_config(model))
    load_model_checkpoint(gpt, out / "megatron")
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    difference = float((megatron_logits(gpt, tokens) - hf_logits(out / "hf", tokens)).abs().max())
    spec = "TE grouped experts" if have_transformer_engine() else "SequentialMLP experts"
    rows.append((f"logits vs transformers ({spec})", difference <= LOGIT_TOLERANCE, f"max abs {difference:.2e}"))
    del gpt

    engine = EmbeddedEngine(model, seed=1, device=compute_device(), record_routed_experts=True)
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

    with SafetensorsCheckpoint(out / "hf") as checkpoint:
        engine.update_weights(((name, checkpoint.tensor(name)) for name in checkpoint.names()), version=0)
    prompts = [[5, 17, 42], [7, 7, 120, 3, 9], [11, 2], [250, 1, 8, 8]]
    completions = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3), n=4)
    samples = [
        RolloutSample(c.prompt_ids, c.output_ids, group, reward=float(i % 2), routed_experts=c.routed_experts)
        for group, row in enumerate(completions)
        for i, c in enumerate(row)
    ]
    rows.append(
        (
            "embedded engine records routed experts",
            all(s.routed_experts.shape == (s.sequence_length, 2 * 2) for s in samples),
            f"{len(samples)} samples",
        )
    )
    for mode in ("experience", "rollout"):
        train = TrainConfig(
            steps=2,
            mini_batches=2,
            micro_batch_tokens=64,
            routing_replay=mode,
            optimizer=OptimizerSettings(lr=1e-3, warmup_steps=0),
        )
        trainer = PolicyTrainer(
            model, AlgorithmConfig(name="zcpo"), train, ParallelConfig(), initial_weights=str(out / "megatron")
        )
        metrics = trainer.train_step(samples)
        ok = metrics["routing/update_pair_mismatch"] == 0.0 and torch.isfinite(torch.tensor(metrics["update/loss"]))
        mismatch = metrics.get("routing/rollout_token_mismatch", float("nan"))
        rows.append(
            (
                f"train step, routing_replay={mode}",
                bool(ok),
                f"update mismatch {metrics['routing/update_pair_mismatch']}, router drift "
                f"{metrics.get('routing/update_router_drift', float('nan')):.3f}, loss {metrics['update/loss']:.4f}",
            )
        )
        rows.append(
            (
                f"engine vs trainer routing ({mode} run)",
                mismatch <= ENGINE_MISMATCH_LIMIT,
                f"{mismatch:.4f} of tokens differ in some layer",
            )
        )
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from megatron_zcpo.utils.devices import has_cuda

    with tempfile.TemporaryDirectory() as scratch:
        rows = run(Path(args.out or scratch))
    return report(rows, has_cuda(), "no GPU: ran on the CPU")


if __name__ == "__main__":  # (dist_checkpointing's writer re-imports __main__ in a spawned process)
    sys.exit(main())
