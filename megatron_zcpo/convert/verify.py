"""Check a converted checkpoint: its logits in Megatron at some TP/PP against Hugging Face transformers."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional

import torch

from megatron_zcpo.megatron.model import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
SAMPLE_TEXT = (
    "The quick brown fox jumps over the lazy dog. Question: what is 12 * 12? "
    "Answer: 144, because twelve dozens make a gross."
)


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
    was_training = model.training
    model.eval()  # megatron's MoE layer refuses TP without SP in training mode only
    batch, seq_length = tokens.shape
    positions = torch.arange(seq_length, device=device).unsqueeze(0).expand(batch, -1)

    def forward_step(data_iterator, stage):
        return stage(tokens, positions, None), None  # no loss function: the schedule keeps the output

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([None]),
        model=[model],
        num_microbatches=1,
        seq_length=seq_length,
        micro_batch_size=batch,
        forward_only=True,
    )
    model.train(was_training)
    if not ps.is_pipeline_last_stage():
        return None
    logits = gather_from_tensor_model_parallel_region(outputs[0])
    return logits[..., : unwrap(model).zcpo_model_config.vocab_size].float().cpu()


def _checkpoint_logits_on_rank(
    rank,
    world_size,
    ckpt_dir,
    tensor_parallel,
    pipeline_parallel,
    sequence_parallel,
    tokens,
    expert_parallel=1,
    expert_tensor_parallel=None,
    **stage_layers,
):
    from megatron.core import parallel_state as ps

    from megatron_zcpo.checkpoint.io import load_model_checkpoint, read_model_config
    from megatron_zcpo.megatron.initialize import setup_megatron
    from megatron_zcpo.megatron.model import build_gpt_model, transformer_config

    setup_megatron(
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
        expert_parallel=expert_parallel,
        expert_tensor_parallel=expert_tensor_parallel,
    )
    model_config = read_model_config(ckpt_dir)
    model = build_gpt_model(
        model_config,
        transformer_config(
            model_config,
            tensor_parallel=tensor_parallel,
            pipeline_parallel=pipeline_parallel,
            sequence_parallel=sequence_parallel,
            expert_parallel=expert_parallel,
            expert_tensor_parallel=expert_tensor_parallel,
            **stage_layers,
        ),
    )
    load_model_checkpoint(model, ckpt_dir)
    logits = megatron_logits(model, tokens)
    first_replica = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return logits if first_replica else None


def layout_world_size(
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
) -> int:
    """Processes a model needs at this layout: PP x lcm(TP, ETP x EP) (data parallelism fills the
    expert grid: EP x ETP ranks split the TP x DP ranks of a stage)."""
    return pipeline_parallel * math.lcm(tensor_parallel, (expert_tensor_parallel or tensor_parallel) * expert_parallel)


def checkpoint_logits(
    ckpt_dir: str | os.PathLike,
    tokens: torch.Tensor,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sequence_parallel: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> torch.Tensor:
    """Logits ``[B, T, V]`` (fp32) of a converted checkpoint loaded in Megatron at the given
    TP/PP/EP/ETP (and sequence parallelism: T must then be a multiple of TP; uneven pipeline stages:
    ``first_stage_layers`` / ``last_stage_layers``).

    Runs :func:`layout_world_size` local processes (gloo on CPU, NCCL on GPUs).
    """
    from megatron_zcpo.utils.spawn import run_distributed

    if sequence_parallel and tokens.shape[1] % tensor_parallel:
        raise ValueError(
            f"sequence parallelism needs a sequence length that is a multiple of TP={tensor_parallel}, "
            f"got {tokens.shape[1]}"
        )
    world = layout_world_size(tensor_parallel, pipeline_parallel, expert_parallel, expert_tensor_parallel)
    results = run_distributed(
        _checkpoint_logits_on_rank,
        world,
        str(ckpt_dir),
        tensor_parallel,
        pipeline_parallel,
        sequence_parallel,
        tokens,
        expert_parallel,
        expert_tensor_parallel,
        timeout=3600,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    return next(logits for logits in results if logits is not None)


def max_logit_difference(
    ckpt_dir: str | os.PathLike,
    hf_dir: str | os.PathLike,
    tokens: torch.Tensor,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    sequence_parallel: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: Optional[int] = None,
    **stage_layers: Optional[int],
) -> float:
    """Max abs difference between the checkpoint's Megatron logits and the Hugging Face model's for
    ``tokens`` (``stage_layers``: :func:`checkpoint_logits`'s uneven-stage keywords)."""
    megatron = checkpoint_logits(
        ckpt_dir,
        tokens,
        tensor_parallel,
        pipeline_parallel,
        sequence_parallel,
        expert_parallel,
        expert_tensor_parallel,
        **stage_layers,
    )
    return (megatron - hf_logits(hf_dir, tokens)).abs().max().item()


# ----------------------------------------------------------------------------- the trainer's start-up check

STARTUP_CHECK_MAX_PARAMETERS = 8e9  # train.verify_against_hf=null: rank 0 holds an fp32 copy (32 GB)


def has_hf_weights(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a Hugging Face model directory with safetensors weights."""
    return Path(path).is_dir() and any(Path(path).glob("*.safetensors"))


def startup_check_due(setting: Optional[bool], model_path: Optional[str], model: ModelConfig) -> bool:
    """``train.verify_against_hf``: True/False as set; None (default) means on when ``model_path``
    holds Hugging Face weights and the model has at most 8B parameters. Raises ValueError when
    True but there are no Hugging Face weights to compare with."""
    has_weights = model_path is not None and has_hf_weights(model_path)
    if setting and not has_weights:
        raise ValueError(
            f"train.verify_against_hf=true needs model.path to be a Hugging Face directory with "
            f"safetensors weights, got {model_path!r}"
        )
    if setting is None:
        return has_weights and model.num_parameters <= STARTUP_CHECK_MAX_PARAMETERS
    return bool(setting)


def policy_logprob_gap(trainer, hf_dir: str | os.PathLike, seq_length: int = 16) -> float:
    """Max |log-prob difference| between the trainer's policy and transformers on a few tokens.

    ``trainer``: a :class:`~megatron_zcpo.training.trainer.PolicyTrainer`. Its own experience pass
    scores :func:`sample_tokens` rows (one per data-parallel rank, at least 2; the first token is
    the prompt), so the check runs at the run's TP/PP/CP/DP, sequence parallelism, layer spec,
    packing and fused log-prob op; rank 0 scores the same tokens with the Hugging Face model in
    fp32 at the trainer's temperature. Collective over all ranks; every rank returns the gap.
    """
    import torch.distributed as dist

    from megatron_zcpo.training.batch import RolloutSample

    model = trainer.model_config
    rows = max(2, trainer.dp_size)
    tokens = torch.cat(
        [
            sample_tokens(hf_dir, model, seq_length),
            torch.randint(0, model.vocab_size, (rows - 2, seq_length), generator=torch.Generator().manual_seed(1)),
        ]
    )
    samples = [
        RolloutSample(row[:1].tolist(), row[1:].tolist(), group_id=i, reward=0.0) for i, row in enumerate(tokens)
    ]
    experience = trainer.experience(samples, trainer.assign_minibatches(samples))
    mine = [(index, stats.token_index, stats.old_logprob) for index, stats in experience.items()]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    gap = [0.0]
    if dist.get_rank() == 0:
        reference = (hf_logits(hf_dir, tokens)[:, :-1] / trainer.temperature).log_softmax(-1)
        reference = reference.gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)  # [rows, T-1]
        gap[0] = max(
            float((logprob - reference[index, token_index]).abs().max())
            for entries in everyone
            for index, token_index, logprob in entries
        )
    dist.broadcast_object_list(gap, src=0)
    return gap[0]


def logprob_tolerance(tolerance: Optional[float], bf16: bool) -> float:
    """Max |log-prob difference| accepted between the trainer and a Hugging Face model of the same
    weights: ``tolerance`` (``train.verify_tolerance``) when set, else 1e-3 in fp32 and 0.5 in bf16
    (8 mantissa bits per rounding, accumulated over every layer of a large model)."""
    if tolerance is not None:
        return tolerance
    return 0.5 if bf16 else 1e-3


def check_policy_against_hf(trainer, hf_dir: str | os.PathLike, tolerance: Optional[float] = None) -> float:
    """Raise RuntimeError, naming the max difference and the layout, when :func:`policy_logprob_gap`
    exceeds ``tolerance`` (None: 1e-3 in fp32, 0.5 in bf16); returns the gap. Collective."""
    from megatron_zcpo.megatron.model import have_transformer_engine

    tolerance = logprob_tolerance(tolerance, trainer.train_config.bf16)
    gap = policy_logprob_gap(trainer, hf_dir)
    if gap > tolerance:
        parallel = trainer.parallel
        raise RuntimeError(
            f"start-up check against transformers failed: max |log-prob difference| = {gap:.3e} > "
            f"train.verify_tolerance = {tolerance:g} at TP={parallel.tensor} PP={parallel.pipeline} "
            f"CP={parallel.context} SP={parallel.sequence_parallel} with the "
            f"{'Transformer Engine' if have_transformer_engine() else 'local'} layer spec: the loaded weights do "
            f"not compute the model in {hf_dir} (a scrambled fused QKV or SwiGLU layout?)"
        )
    return gap
