"""Check a converted checkpoint: its logits in Megatron at some TP/PP against Hugging Face transformers."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import torch

from megatron_zcpo.megatron.model import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SAMPLE_TEXT = ("The quick brown fox jumps over the lazy dog. Question: what is 12 * 12? "
               "Answer: 144, because twelve dozens make a gross.")


def sample_tokens(hf_dir: str | os.PathLike, model: ModelConfig, seq_length: int = 32) -> torch.Tensor:
    """Token ids ``[2, seq_length]`` to compare logits on.

    Row 0 is :data:`SAMPLE_TEXT` through the model's tokenizer when ``hf_dir`` has one (cut or
    repeated to ``seq_length``); row 1, and row 0 without a tokenizer, are fixed pseudo-random
    ids below ``model.vocab_size``.
    """
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (2, seq_length), generator=generator)
    if not any((Path(hf_dir) / name).is_file() for name in TOKENIZER_FILES):
        return tokens
    from transformers import AutoTokenizer

    text_ids = AutoTokenizer.from_pretrained(str(hf_dir))(SAMPLE_TEXT)["input_ids"]
    if text_ids:
        text = torch.tensor(text_ids, dtype=torch.long).repeat(seq_length // len(text_ids) + 1)
        tokens[0] = text[:seq_length].clamp(max=model.vocab_size - 1)
    return tokens


@torch.no_grad()
def hf_logits(hf_dir: str | os.PathLike, tokens: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, T, V]`` (fp32, true vocabulary) of the Hugging Face model in ``hf_dir`` for ``tokens`` ``[B, T]``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), attn_implementation="eager").float().eval()
    return model(input_ids=tokens).logits.float()


@torch.no_grad()
def megatron_logits(model, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """Logits ``[B, T, V]`` (true vocabulary) of a GPTModel stage for ``tokens`` ``[B, T]``.

    Runs megatron-core's pipeline schedule (forward only, one micro-batch) and gathers the
    vocabulary shards across tensor-parallel ranks. Returns the logits on the last pipeline
    stage and ``None`` on the others. Collective over the model-parallel group.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megatron_zcpo.utils.runtime import unwrap

    device = next(model.parameters()).device
    tokens = tokens.to(device)
    batch, seq_length = tokens.shape
    positions = torch.arange(seq_length, device=device).unsqueeze(0).expand(batch, -1)

    def forward_step(data_iterator, stage):
        return stage(tokens, positions, None), None  # no loss function: the schedule keeps the output

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter([None]), model=[model], num_microbatches=1,
        seq_length=seq_length, micro_batch_size=batch, forward_only=True,
    )
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(outputs[0])
    return logits[..., : unwrap(model).zcpo_model_config.vocab_size].float().cpu()


def _checkpoint_logits_on_rank(rank, world_size, ckpt_dir, tensor_parallel, pipeline_parallel, tokens):
    from megatron.core import parallel_state as ps

    from megatron_zcpo.megatron.checkpoint import load_model_checkpoint, read_model_config
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    setup_megatron(tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel)
    model_config = read_model_config(ckpt_dir)
    model = build_gpt_model(model_config, transformer_config(
        model_config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel))
    load_model_checkpoint(model, ckpt_dir)
    logits = megatron_logits(model, tokens)
    return logits if ps.get_tensor_model_parallel_rank() == 0 else None


def checkpoint_logits(ckpt_dir: str | os.PathLike, tokens: torch.Tensor, tensor_parallel: int = 1,
                      pipeline_parallel: int = 1) -> torch.Tensor:
    """Logits ``[B, T, V]`` (fp32) of a converted checkpoint loaded in Megatron at the given TP/PP.

    Runs ``tensor_parallel * pipeline_parallel`` local processes (gloo on CPU, NCCL on GPUs).
    """
    from megatron_zcpo.utils.spawn import run_distributed

    results = run_distributed(_checkpoint_logits_on_rank, tensor_parallel * pipeline_parallel,
                              str(ckpt_dir), tensor_parallel, pipeline_parallel, tokens, timeout=3600)
    return next(logits for logits in results if logits is not None)


def max_logit_difference(ckpt_dir: str | os.PathLike, hf_dir: str | os.PathLike, tokens: torch.Tensor,
                         tensor_parallel: int = 1, pipeline_parallel: int = 1) -> float:
    """Max abs difference between the checkpoint's Megatron logits and the Hugging Face model's for ``tokens``."""
    megatron = checkpoint_logits(ckpt_dir, tokens, tensor_parallel, pipeline_parallel)
    return (megatron - hf_logits(hf_dir, tokens)).abs().max().item()
