"""Tiny LoRA trainer runs shared by the LoRA tests (module-level so spawned ranks can import them).

One spawn per world size runs every case it is given (:func:`run_cases`), so the layouts, the
reference pass, the recompute fix, the resume and the pushes share their process start-ups.
"""

import dataclasses
import random

import torch

from megatron_zcpo.megatron.lora import LoraConfig
from megatron_zcpo.megatron.model import ModelConfig
from tests.cases import trainer_cases

# Three layers: PP2 splits them unevenly (2 + 1).
MODEL = ModelConfig(
    family="qwen2",
    vocab_size=200,
    hidden_size=64,
    intermediate_size=128,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)
MOE = trainer_cases.QWEN3_MOE
LORA = LoraConfig(rank=4, alpha=8.0)


def weights(rank, world, model=MODEL):
    """(base weights, adapters with B != 0) of ``model``: the adapters of a seeded single-process
    policy, B drawn at random (so every adapter gets gradients and the reference differs)."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.lora import apply_lora
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict

    setup_megatron(seed=31)
    gpt = build_gpt_model(model, transformer_config(model))
    base = gather_full_state_dict(gpt)
    apply_lora(gpt, LORA, seed=5)
    adapters = gather_full_state_dict(gpt, part="adapters")
    generator = torch.Generator().manual_seed(7)
    for name, tensor in adapters.items():
        if name.endswith("lora_b"):
            adapters[name] = torch.randn(tensor.shape, generator=generator) * 0.05
    return base, adapters


def make(base, adapters=None, model=MODEL, lora=LORA, tp=1, pp=1, cp=1, sp=False, distopt=False, **options):
    """A LoRA trainer on ``base`` at the given layout, its adapters set to ``adapters`` when given."""
    from megatron_zcpo.megatron.weights import load_global_state_dict

    trainer = trainer_cases.make_trainer(
        tp,
        pp,
        base,
        None,
        cp=cp,
        sequence_parallel=sp,
        distributed_optimizer=distopt,
        model=model,
        lora=lora,
        **options,
    )
    if adapters is not None:
        load_global_state_dict(trainer.policy, adapters, adapters=True)
        trainer.reference_is_initial_policy = False  # B != 0: the step-0 self-check does not apply
    return trainer


def adapter_gradients(trainer, samples):
    """The global gradients of the adapters for the first mini-batch's loss (reduced over DP, not stepped)."""
    from megatron_zcpo.megatron.weights import gather_full_state_dict
    from megatron_zcpo.training.rollout_step import RolloutStep
    from megatron_zcpo.training.update import forward_backward

    plan = trainer.assign_minibatches(samples)
    experience = trainer.experience(samples, plan)
    coefficients, stats = trainer.calibrate(samples, experience)
    step = RolloutStep(samples, plan, experience, coefficients, stats)
    normalizer = trainer.normalizer(samples, plan.minibatches[0])
    update = trainer.policy_update()
    forward_backward(
        update,
        step,
        plan.mine[0],
        normalizer,
        lambda inputs: (trainer.algorithm_loss(inputs).loss, {}),
        use_reference=trainer.algorithm.needs_current_kl,
    )
    trainer.policy.finish_grad_sync()
    saved = {}
    for name, param in trainer.policy.named_parameters():
        if param.requires_grad:
            saved[name] = param.data.clone()
            param.data.copy_(param.main_grad)
    grads = gather_full_state_dict(trainer.policy, part="adapters")
    for name, param in trainer.policy.named_parameters():
        if name in saved:
            param.data.copy_(saved[name])
    trainer.policy.zero_grad_buffer()
    return grads


def layout_step(base, adapters, model=MODEL, gradients=True, **layout):
    """One LoRA rollout step at ``layout``: the adapters' gradients (first mini-batch, before any step),
    the step's metrics, the adapters after it and the merged weights a push sends."""
    trainer = make(base, adapters, model=model, **layout)
    samples = trainer_cases.rollout()
    grads = adapter_gradients(trainer, samples) if gradients else None
    metrics = trainer.train_step(samples)
    return {
        "grads": grads,
        "metrics": metrics,
        "adapters": trainer.global_state_dict(part="adapters"),
        "merged": trainer.global_state_dict(merged=True),
        "frozen": all(not p.requires_grad for n, p in trainer.policy.named_parameters() if "_lora." not in n),
        "ddp_parameters": sum(b.numel_unpadded for b in trainer.policy.buffers),
        "optimized_parameters": sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]),
    }


def step_zero(base):
    """A fresh LoRA policy (B = 0): the step-0 self-check's values and the experience's KL."""
    trainer = make(base)
    metrics = trainer.train_step(trainer_cases.rollout())
    return {name: metrics[name] for name in ("selfcheck/kl_max", "selfcheck/logprob_gap_max", "experience/kl")}


def reference_against_base(base, adapters):
    """(policy log-probs, reference log-probs) of a LoRA policy with B != 0, and the log-probs of the base
    model itself (a full-weight trainer on ``base``), per sample."""
    samples = trainer_cases.rollout()
    lora = make(base, adapters)
    plan = lora.assign_minibatches(samples)
    experience = lora.experience(samples, plan)
    plain = trainer_cases.make_trainer(1, 1, base, None, model=MODEL)
    base_experience = plain.experience(samples, plain.assign_minibatches(samples))
    return {
        i: (stats.old_logprob, stats.ref_logprob, base_experience[i].old_logprob) for i, stats in experience.items()
    }


def recompute_gradients(base, adapters):
    """The adapters' gradients with full recompute (the frozen base's embedding output needs no grad)."""
    trainer = make(base, adapters, train_overrides={"recompute": "full"})
    return adapter_gradients(trainer, trainer_cases.rollout())


def resume(base, adapters, directory):
    """Three steps straight, and two steps + save + a fresh trainer that resumes and takes the third:
    (metrics, adapters) of both third steps, and what the checkpoint's weights/ hold."""
    from megatron.core import dist_checkpointing

    lora = dataclasses.replace(LORA, dropout=0.1)  # the resumed run must draw the same dropout masks
    straight = make(base, adapters, lora=lora)
    for seed in (0, 1):
        straight.train_step(trainer_cases.rollout(seed=seed))
    path = straight.save(directory)
    saved = straight.global_state_dict(part="adapters")
    third = straight.train_step(trainer_cases.rollout(seed=2))
    resumed = make(base, lora=lora)
    resumed.load(path)
    again = resumed.train_step(trainer_cases.rollout(seed=2))
    stored = sorted(dist_checkpointing.load_tensors_metadata(str(path / "weights")))
    return {
        "straight": (third, straight.global_state_dict(part="adapters")),
        "resumed": (again, resumed.global_state_dict(part="adapters")),
        "stored": stored,
        "checkpoint": str(path),
        "saved": saved,
    }


def load_elsewhere(base, checkpoint, **layout):
    """The adapters of a LoRA checkpoint loaded at another layout (megatron-core reshards them)."""
    trainer = make(base, lora=dataclasses.replace(LORA, dropout=0.1), **layout)
    trainer.load(checkpoint)
    return trainer.global_state_dict(part="adapters")


def push_capture(base, adapters, push="merged", **layout):
    """What rank 0's engine receives from a push of the LoRA policy (merged weights, or the adapter)."""
    from megatron_zcpo.recipe.weight_push import push_weights

    trainer = make(base, adapters, lora=dataclasses.replace(LORA, push=push), **layout)
    engine = CapturingEngine()
    sent = push_weights(trainer, engine, version=3)
    return {"received": engine.received, "bytes": sent, "config": engine.config}


class CapturingEngine:
    """An engine that keeps what a push gives it."""

    def __init__(self):
        self.received, self.config = {}, None

    def update_weights(self, named_tensors, version):
        self.received = {name: tensor.detach().cpu().clone() for name, tensor in named_tensors}

    def update_adapter(self, named_tensors, config, version):
        self.received = {name: tensor.detach().cpu().clone() for name, tensor in named_tensors}
        self.config = config


def logits(base, adapters, tokens):
    """The LoRA policy's logits [T, V] (true vocabulary) on one sequence ``tokens``, single process."""
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.lora import apply_lora
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import load_global_state_dict

    setup_megatron(seed=1)
    gpt = build_gpt_model(MODEL, transformer_config(MODEL))
    load_global_state_dict(gpt, base)
    apply_lora(gpt, LORA, seed=1)
    load_global_state_dict(gpt, adapters, adapters=True)
    ids = torch.tensor([tokens])
    with torch.no_grad():
        out = gpt(ids, torch.arange(len(tokens)).unsqueeze(0), None)
    return out[0, :, : MODEL.vocab_size].float()


def exports(base, checkpoint, directory):
    """A LoRA checkpoint merged into its base written as a Hugging Face folder, and exported as a PEFT
    folder (what tools/convert_megatron_to_hf.py does): their paths."""
    from pathlib import Path

    from megatron_zcpo.convert import hf_checkpoint, mapping
    from megatron_zcpo.convert.lora_export import export_peft, merge_into_hf

    hf_base = Path(directory) / "hf_base"
    hf_checkpoint.write_safetensors_shards(hf_base, mapping.megatron_to_hf_stream(base.items(), MODEL))
    hf_checkpoint.write_hf_config(hf_base, mapping.hf_config_from_model_config(MODEL))
    merge_into_hf(checkpoint, Path(directory) / "merged", base=hf_base)
    export_peft(checkpoint, Path(directory) / "peft")
    return {"hf_base": str(hf_base), "merged": str(Path(directory) / "merged"), "peft": str(Path(directory) / "peft")}


def single_process(rank, world, directory):
    """The weights, then every single-process case (one spawn): {"weights", "moe_weights", case: result}."""
    base, adapters = weights(rank, world)
    moe_base, moe_adapters = weights(rank, world, MOE)
    pair = dict(base=base, adapters=adapters)
    cases = [
        ("tp1", "layout_step", pair),
        ("moe", "layout_step", dict(base=moe_base, adapters=moe_adapters, model=MOE)),
        ("step_zero", "step_zero", dict(base=base)),
        ("reference", "reference_against_base", pair),
        ("recompute", "recompute_gradients", pair),
        ("resume", "resume", dict(pair, directory=directory)),
        ("adapter_push", "push_capture", dict(pair, push="adapter")),
        ("logits", "logits", dict(pair, tokens=[3, 17, 42, 99, 5, 150, 7])),
    ]
    results = run_cases(rank, world, cases)
    results["exports"] = exports(base, results["resume"]["checkpoint"], directory)
    results.update(weights=(base, adapters), moe_weights=(moe_base, moe_adapters))
    return results


def run_cases(rank, world, cases):
    """Run each (name, function name, kwargs) of ``cases`` in this rank; {name: result}."""
    import sys

    module = sys.modules[__name__]
    random.seed(0)
    return {name: getattr(module, function)(**kwargs) for name, function, kwargs in cases}
