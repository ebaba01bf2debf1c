"""GPU check of LoRA's GPU-only path: Transformer Engine's fused-norm linears under adapters, in bf16 on CUDA.

    python tools/gpu_check_lora.py [--dry-run]

On one GPU, a random tiny Qwen2 is built at TP1 in bf16 twice, with the Transformer Engine layer spec
(``linear_qkv`` and ``linear_fc1`` fuse the pre-norm, so the adapter normalises their input itself:
megatron_zcpo/megatron/lora.py) and with megatron-core's local spec, holding the same base weights and
the same adapters (B != 0). Checks, one line each, then exit 0 (all passed), 1 (one failed) or 3
(no GPU: nothing runs; ``--dry-run`` runs every check on the CPU with the local spec on both sides):

1. the TE policy's logits equal the local one's (bf16 tolerance) and differ from the base's;
2. the TE policy with its adapters off gives the TE base model's logits exactly (the reference pass);
3. with full recompute every adapter gets a nonzero gradient and no base parameter one;
4. the merged weights (W + (alpha/r) B A in fp32, cast to bf16) loaded into the plain TE model give
   the adapted logits (bf16 tolerance): what a merged push hands SGLang.
"""

from __future__ import annotations

import argparse
import sys

import torch

EXIT_OK, EXIT_FAILED, EXIT_NO_GPU = 0, 1, 3
BF16_LOGIT_TOLERANCE = 0.1  # logits of O(1..10) in bf16 (8 mantissa bits), two kernels' rounding


def _model(family_spec: bool, base, adapters, lora, recompute=None):
    from megatron_zcpo.megatron.lora import apply_lora
    from megatron_zcpo.megatron.model import ModelConfig, build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import load_global_state_dict

    model = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_attention_heads=4)
    config = transformer_config(model, params_dtype=torch.float32, recompute=recompute)
    gpt = build_gpt_model(model, config, use_te=family_spec)
    load_global_state_dict(gpt, base)
    if lora is not None:
        apply_lora(gpt, lora, seed=1)
        load_global_state_dict(gpt, adapters, adapters=True)
    return gpt.to(torch.bfloat16)


def _logits(gpt, tokens):
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0)
    return gpt(tokens, positions, None).float()


def run_checks(use_te: bool, device: str) -> list:
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.lora import LoraConfig, adapters_disabled, lora_adapters
    from megatron_zcpo.megatron.model import ModelConfig, build_gpt_model, transformer_config
    from megatron_zcpo.megatron.weights import gather_full_state_dict

    setup_megatron(seed=3)
    lora = LoraConfig(rank=8, alpha=16.0)
    model = ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_attention_heads=4)
    seed_model = build_gpt_model(model, transformer_config(model), use_te=False)
    base = gather_full_state_dict(seed_model)
    from megatron_zcpo.megatron.lora import apply_lora

    apply_lora(seed_model, lora, seed=1)
    generator = torch.Generator().manual_seed(0)
    adapters = {
        name: (torch.randn(t.shape, generator=generator) * 0.05 if name.endswith("lora_b") else t)
        for name, t in gather_full_state_dict(seed_model, part="adapters").items()
    }
    tokens = torch.randint(0, 512, (1, 32), generator=generator).to(device)
    rows = []
    te, local = _model(use_te, base, adapters, lora), _model(False, base, adapters, lora)
    plain = _model(use_te, base, None, None)
    with torch.no_grad():
        adapted, reference, base_logits = _logits(te, tokens), _logits(local, tokens), _logits(plain, tokens)
        with adapters_disabled(te):
            off = _logits(te, tokens)
    gap, moved = float((adapted - reference).abs().max()), float((adapted - base_logits).abs().max())
    rows.append(
        ("TE LoRA logits == local spec's", gap <= BF16_LOGIT_TOLERANCE < moved, f"{gap:.3g} (moved {moved:.3g})")
    )
    exact = float((off - base_logits).abs().max())
    rows.append(("adapters off == the base model", exact == 0.0, f"{exact:.3g}"))
    recomputed = _model(use_te, base, adapters, lora, recompute="full")
    _logits(recomputed, tokens).float().pow(2).mean().backward()
    grads = [
        float(p.grad.abs().sum()) if p.grad is not None else 0.0
        for a in lora_adapters(recomputed)
        for p in a.parameters()
    ]
    base_grads = [n for n, p in recomputed.named_parameters() if "_lora." not in n and p.grad is not None]
    rows.append(
        (
            "full recompute: adapter grads",
            min(grads) > 0 and not base_grads,
            f"min {min(grads):.3g}, base {len(base_grads)}",
        )
    )
    merged = gather_full_state_dict(te, merged=True)
    pushed = _model(use_te, merged, None, None)
    with torch.no_grad():
        gap = float((_logits(pushed, tokens) - adapted).abs().max())
    rows.append(("merged weights == adapted logits", gap <= BF16_LOGIT_TOLERANCE, f"{gap:.3g}"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run every check on the CPU, local spec on both sides")
    args = parser.parse_args(argv)
    from megatron_zcpo.megatron.model import have_transformer_engine
    from megatron_zcpo.utils.devices import has_cuda

    if not has_cuda() and not args.dry_run:
        print("no GPU: skipped every LoRA GPU check (--dry-run runs them on the CPU)")
        return EXIT_NO_GPU
    use_te = has_cuda() and have_transformer_engine()
    rows = run_checks(use_te, "cuda" if has_cuda() else "cpu")
    spec = "Transformer Engine" if use_te else "local (no Transformer Engine here)"
    print(f"layer spec under test: {spec}")
    for name, passed, measured in rows:
        print(f"{'ok    ' if passed else 'FAILED'} {name}: {measured}")
    return EXIT_OK if all(passed for _, passed, _ in rows) else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
