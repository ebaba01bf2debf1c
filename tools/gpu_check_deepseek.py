"""GPU check of the DeepSeek-V3 path: multi-latent attention and DeepSeekMoE on Transformer Engine's spec, one GPU.

    python tools/gpu_check_deepseek.py [--out DIR]   (exit 0: all ok; 1: a check failed; 3: no GPU, the CPU parts ran)

Two tiny random models built with transformers' own ``DeepseekV3ForCausalLM``, both with layer 0
dense and DeepSeekMoE after it (shared experts, the sigmoid router with its correction bias):
"dsv3-yarn-groups" (``q_lora_rank``, YaRN with its softmax-scale correction, 8 experts in 4 groups of which
2 are eligible, top-4, fp32 weights) and "moonlight-bf16" (one query projection, plain RoPE, 4 experts,
top-2, two shared experts, bf16 weights). For each, one row per check:

1. convert: our converter writes the checkpoint; its keys of the fused norms are those of megatron's
   TE spec (``linear_q_up_proj.layer_norm_weight`` ..., local_spec.te_checkpoint_keys), so it loads there;
2. TE spec: the model our code builds (``build_gpt_model``: megatron's TE decoder-block spec where
   TE is installed) has TE's fused-norm MLA up-projections, fused dense ``linear_fc1`` and
   grouped-GEMM experts (GPU with TE only);
3. logits: Megatron's (fp32 weights, the converted checkpoint loaded) against transformers' (fp32,
   CPU), max abs difference <= :data:`LOGIT_TOLERANCE`;
4. export: the weight push's stream (global names through weights.py's TE name mapping, Hugging
   Face names) equals the Hugging Face tensors bit for bit, and so does the Hugging Face model
   converted back from megatron-core's own checkpoint of that model (as a trainer saves it);
5. train: one ZCPO step (bf16 on a GPU) with ``train.moe.expert_bias_update_rate`` 0: a finite loss,
   the router weights moved, every correction bias bit for bit the converted one and float32.

Without a GPU every row runs on the CPU with the local spec except 2, and the last line says what
was skipped. Expected to take about 2 minutes on one GPU (not yet run on one; 13 s on the 2-core CPU VM).
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
from megatron_zcpo.testing.tiny_deepseek import ARCHITECTURES, make_hf_model

# fp32 weights on both sides; the GPU's GEMMs (TF32 where TE allows it) sum in another order: the
# bound of tools/gpu_check.py's --verify (the CPU gives < 1e-4, tests/convert/test_convert_deepseek.py).
LOGIT_TOLERANCE = 2e-2
SKIPPED = "no GPU: skipped the Transformer Engine spec (fused-norm MLA, grouped-GEMM experts) and bf16 training"
CASES = ARCHITECTURES  # name -> (DeepseekV3Config fields, stored dtype)
# What megatron-core 0.16.1's TE spec builds (gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec
# with multi_latent_attention, get_gpt_decoder_block_spec): module (in layer 0 or layer 1) -> class name.
TE_MODULES = {
    "decoder.layers.1.self_attention.linear_q_up_proj": "TELayerNormColumnParallelLinear",
    "decoder.layers.1.self_attention.linear_q_proj": "TEColumnParallelLinear",
    "decoder.layers.1.self_attention.linear_kv_up_proj": "TELayerNormColumnParallelLinear",
    "decoder.layers.0.mlp.linear_fc1": "TELayerNormColumnParallelLinear",
    "decoder.layers.1.mlp.experts": "TEGroupedMLP",
}


def hf_tensors(directory: Path) -> dict:
    from megatron_zcpo.convert.hf_checkpoint import SafetensorsCheckpoint

    with SafetensorsCheckpoint(directory) as checkpoint:
        return {name: checkpoint.tensor(name) for name in checkpoint.names()}


def differing(actual: dict, expected: dict) -> list:
    """Names missing, extra, or not equal bit for bit (dtype included)."""
    names = sorted(set(actual) ^ set(expected))
    for name in sorted(set(actual) & set(expected)):
        a, e = actual[name].cpu(), expected[name]
        if a.dtype != e.dtype or not torch.equal(a.view(torch.uint8), e.view(torch.uint8)):
            names.append(name)
    return names


def fused_norm_keys(model) -> list:
    """The checkpoint keys megatron's TE spec gives the norms it fuses (local_spec.te_checkpoint_keys)."""
    keys = []
    for layer, moe in enumerate(model.moe_layer_pattern):
        prefix = f"decoder.layers.{layer}."
        if model.q_lora_rank:
            keys.append(prefix + "self_attention.linear_q_up_proj.layer_norm_weight")
        keys.append(prefix + "self_attention.linear_kv_up_proj.layer_norm_weight")
        keys.append(prefix + ("pre_mlp_layernorm.weight" if moe else "mlp.linear_fc1.layer_norm_weight"))
    return keys


def te_spec_row(case: str, gpt, on_te: bool) -> tuple:
    built = {name: type(module).__name__ for name, module in gpt.named_modules() if name in TE_MODULES}
    wrong = {name: built[name] for name in built if built[name] != TE_MODULES[name]}
    detail = f"{len(built) - len(wrong)} of {len(built)} modules as TE's spec builds them" + (
        f"; not: {wrong}" if wrong else ""
    )
    return (f"[{case}] TE spec modules", on_te and len(built) >= 4 and not wrong, detail)


def synthetic_rollout(vocab_size: int) -> list:
    """4 prompts x 4 responses of random tokens, mixed rewards in every group."""
    from megatron_zcpo.training.batch import RolloutSample

    generator = torch.Generator().manual_seed(5)

    def tokens(count):
        return torch.randint(0, vocab_size, (count,), generator=generator).tolist()

    return [
        RolloutSample(tokens(3 + group), tokens(4 + member), group, reward=float(member % 2))
        for group in range(4)
        for member in range(4)
    ]


def train_row(case: str, model, checkpoint: Path, hf: dict, on_gpu: bool) -> tuple:
    from megatron_zcpo.algorithms import AlgorithmConfig
    from megatron_zcpo.training.config import MoETraining, OptimizerSettings, ParallelConfig, TrainConfig
    from megatron_zcpo.training.trainer import PolicyTrainer

    train = TrainConfig(
        steps=1,
        mini_batches=1,
        micro_batch_tokens=64,
        bf16=on_gpu,
        optimizer=OptimizerSettings(lr=1e-2, warmup_steps=0),  # a visible move of bf16 router weights of ~0.5
        moe=MoETraining(expert_bias_update_rate=0.0),  # the default: frozen during RL
    )
    trainer = PolicyTrainer(
        model, AlgorithmConfig(name="zcpo"), train, ParallelConfig(), initial_weights=str(checkpoint)
    )
    before = trainer.global_state_dict()
    loss = trainer.train_step(synthetic_rollout(model.vocab_size))["update/loss"]
    after = trainer.global_state_dict()
    moe_layers = [i for i, moe in enumerate(model.moe_layer_pattern) if moe]
    router = f"decoder.layers.{moe_layers[0]}.mlp.router.weight"
    moved = float((after[router].float() - before[router].float()).abs().max())
    biases = [f"decoder.layers.{i}.mlp.router.expert_bias" for i in moe_layers]
    frozen = [
        after[name].dtype == torch.float32
        and torch.equal(after[name].cpu(), hf[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
        for i, name in zip(moe_layers, biases)
    ]
    ok = bool(torch.isfinite(torch.tensor(loss))) and moved > 0 and all(frozen)
    precision = "bf16" if on_gpu else "fp32"
    detail = (
        f"{precision}, loss {loss:.4f}, router moved {moved:.2e}, biases frozen float32: {sum(frozen)}/{len(biases)}"
    )
    return (f"[{case}] train step, bias rate 0", ok, detail)


def check_case(case: str, out: Path, seed: int, on_gpu: bool, on_te: bool) -> list:
    from megatron.core import dist_checkpointing

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, write_model_config
    from megatron_zcpo.convert.checkpoint import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_zcpo.convert.mapping import megatron_to_hf_stream
    from megatron_zcpo.convert.verify import hf_logits, megatron_logits
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import expert_biases_kept_in_float32, iter_global_tensors

    fields, dtype = CASES[case]
    root = out / case
    make_hf_model(root / "hf", fields, dtype, seed)
    hf = hf_tensors(root / "hf")
    model = convert_hf_to_megatron(root / "hf", root / "megatron")
    stored = dist_checkpointing.load_tensors_metadata(str(root / "megatron"))
    absent = [key for key in fused_norm_keys(model) if key not in stored]
    rows = [
        (f"[{case}] convert: TE spec's fused-norm keys", not absent, f"missing {absent}" if absent else "all there")
    ]

    gpt = build_gpt_model(model, transformer_config(model))
    load_model_checkpoint(gpt, root / "megatron")
    if on_gpu:
        rows.append(te_spec_row(case, gpt, on_te))
    tokens = torch.randint(0, model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    reference = hf_logits(root / "hf", tokens)
    difference = float((megatron_logits(gpt, tokens).cpu() - reference).abs().max())
    spec = "TE spec" if on_te else "local spec"
    rows.append(
        (
            f"[{case}] logits vs transformers ({spec})",
            difference <= LOGIT_TOLERANCE and float(reference.abs().max()) > 0.1,
            f"max abs {difference:.2e} (<= {LOGIT_TOLERANCE:g})",
        )
    )

    pushed = {name: t.to(hf[name].dtype) for name, t in megatron_to_hf_stream(iter_global_tensors(gpt), model)}
    with expert_biases_kept_in_float32(gpt):  # what a trainer in the stored precision checkpoints
        gpt.to(dtype)
    saved = root / "saved_by_megatron"
    saved.mkdir()
    write_model_config(saved, model)
    dist_checkpointing.save({"model": gpt.sharded_state_dict()}, str(saved))
    convert_megatron_to_hf(saved, root / "hf_back", hf_files=root / "hf")
    wrong = {"push": differing(pushed, hf), "checkpoint": differing(hf_tensors(root / "hf_back"), hf)}
    rows.append(
        (
            f"[{case}] export to HF bit for bit",
            not any(wrong.values()),
            f"{len(hf)} tensors; differing: push {wrong['push'][:3]}, checkpoint {wrong['checkpoint'][:3]}",
        )
    )
    del gpt
    rows.append(train_row(case, model, root / "megatron", hf, on_gpu))
    return rows


def run(out: Path) -> list:
    """The checks as (name, ok, detail) rows."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import have_transformer_engine
    from megatron_zcpo.utils.devices import has_cuda

    setup_megatron()
    on_gpu, on_te = has_cuda(), have_transformer_engine()
    rows = []
    if on_gpu and not on_te:
        rows.append(("Transformer Engine", False, "not installed: the TE spec cannot be checked"))
    for seed, case in enumerate(CASES):
        rows += check_case(case, out, seed, on_gpu, on_te)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args(argv)
    from megatron_zcpo.utils.devices import has_cuda

    with tempfile.TemporaryDirectory() as scratch:
        rows = run(Path(args.out or scratch))
    return report(rows, has_cuda(), SKIPPED)


if __name__ == "__main__":  # (dist_checkpointing's writer re-imports __main__ in a spawned process)
    sys.exit(main())
