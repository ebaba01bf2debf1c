"""A published figure the step-time model is held against (:class:`PublishedRun`), in our config's
terms; the rows are :data:`megatron_zcpo.planning.calibration.PUBLISHED_RUNS` (dense) and
:data:`megatron_zcpo.planning.calibration_moe.MOE_RUNS` (mixture of experts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_zcpo.planning.memory_model import Layout

NEMO_RL_V05 = "NeMo-RL v0.5 performance summary (H100, BF16, Megatron)"
NEMO_RL_V04 = "NeMo-RL v0.4 performance summary (H100, BF16, Megatron)"


@dataclass(frozen=True)
class PublishedRun:
    """One published figure and the settings that reproduce it in our terms.

    ``kind``: "step" (seconds per RL step), "push" (a disaggregated NCCL weight push), "refit"
    (a colocated push), "train" (a pre-training step: ``samples`` sequences of ``max_sequence``
    tokens on ``gpus`` GPUs with ``layout``'s expert parallelism) or "decode" (one decode step of a
    serving benchmark: ``samples`` sequences at ``mean_sequence`` tokens of context on a server of
    ``generation_tp`` GPUs with ``dp_attention`` groups and ``weight_bytes`` per parameter,
    ``two_batch_overlap``: SGLang's overlap of the collectives with the other half batch). For
    steps: GPUs (``rollout_gpus`` 0: colocated), generation TP, training layout, samples, mean
    sequence and its cap; ``fitted``: the row a constant was fitted on; ``known_out``: why the
    prediction falls outside the band."""

    name: str
    source: str
    preset: str
    kind: str
    published_s: float
    gpus: int = 0
    rollout_gpus: int = 0
    generation_tp: int = 1
    layout: Optional[Layout] = None
    samples: int = 0
    mean_sequence: float = 0.0
    max_sequence: int = 0
    overlap: bool = False
    mem_fraction: float = 0.6  # NeMo-RL's vLLM gpu_memory_utilization in its GRPO recipes
    fitted: str = ""
    known_out: str = ""
    published_tokens_per_s_per_gpu: Optional[float] = None
    dp_attention: int = 1
    weight_bytes: float = 2.0
    two_batch_overlap: bool = False


def nemo_run(
    name: str, preset: str, seconds: float, tokens_s: float, gpus: int, tp: int, layout: Layout, mean: float, **kw
) -> PublishedRun:
    return PublishedRun(
        published_tokens_per_s_per_gpu=tokens_s,
        name=name,
        source=kw.pop("source", NEMO_RL_V05),
        preset=preset,
        kind="step",
        published_s=seconds,
        gpus=gpus,
        generation_tp=tp,
        layout=layout,
        mean_sequence=mean,
        **{"samples": 2048, "max_sequence": 4096, **kw},
    )
