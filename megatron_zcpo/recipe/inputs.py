"""A run's inputs: its tokenizer, the model's architecture and initial weights, and the held-out prompts."""

from __future__ import annotations

import dataclasses

from megatron_zcpo.recipe.config import RunConfig


def load_tokenizer(config: RunConfig):
    """The HF tokenizer of ``model.tokenizer``, else of ``model.path``'s Hugging Face files (a
    converted checkpoint's ``hf/``, a training step's or run directory's: the tokenizer of the run
    that saved it, :func:`megatron_zcpo.convert.checkpoint.hf_files_of`)."""
    from transformers import AutoTokenizer

    from megatron_zcpo.convert.checkpoint import hf_files_of, megatron_checkpoint_dir

    path = config.model.tokenizer
    if path is None:
        checkpoint = megatron_checkpoint_dir(config.model.path)
        path = str((hf_files_of(checkpoint) if checkpoint is not None else None) or config.model.path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=config.model.trust_remote_code)


def resolve_model(path: str):
    """(ModelConfig, initial weights) from a Megatron model checkpoint (its directory: each rank
    loads its own shard) or an HF directory (a global state dict, converted in memory)."""
    from megatron_zcpo.convert.checkpoint import megatron_checkpoint_dir, model_config_at
    from megatron_zcpo.convert.fp8 import open_hf_weights
    from megatron_zcpo.convert.hf_checkpoint import read_hf_config
    from megatron_zcpo.convert.mapping import hf_to_megatron_tensors

    model_config, checkpoint = model_config_at(path), megatron_checkpoint_dir(path)
    if checkpoint is not None:
        return model_config, str(checkpoint)
    # Blockwise-FP8 weights (DeepSeek-V3 as released) as bf16; multi-token-prediction layers unread.
    with open_hf_weights(path, read_hf_config(path)) as weights:
        return model_config, dict(hf_to_megatron_tensors(weights.tensor, model_config))


def eval_records(config: RunConfig, tokenizer):
    """Held-out prompts: ``eval.data``, else the training task drawn with ``eval.seed``."""
    from megatron_zcpo.data.dataset import load_records, tokenize_records

    data = config.eval.data
    if data is None:
        if not config.data.task:
            return []  # file-based training data needs an explicit eval.data
        data = dataclasses.replace(config.data, seed=config.eval.seed, task_size=config.eval.num_prompts)
    records = load_records(data.validate())[: config.eval.num_prompts]
    return tokenize_records(records, tokenizer, data.max_prompt_length, data.chat_template, data.enable_thinking)
