"""Predicted time of one RL step on a disaggregated cluster: rollout, training and weight push,
with and without overlapped rollouts, with the weight push funnelled through rank 0 or per stage.

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig` (no process group, no GPU),
like :mod:`megatron_zcpo.planning.planner`. The model, term by term:

* rollout: generated tokens / (decode tokens/s per rollout GPU x rollout GPUs). The per-GPU figure
  is an input: measure it on your servers, or take the roofline of
  :mod:`megatron_zcpo.planning.decode_rate`, calibrated on SGLang's published throughput. It hides
  the long-tail effect of the longest response.
* training: FLOPs / (training GPUs x peak FLOP/s x MFU). Per token a forward costs 2 x parameters
  (embedding excluded, output layer included; a mixture-of-experts model's *active* parameters:
  the ``top-k`` experts a token runs through) + causal attention 4 x layers x heads x head_dim x
  (sequence / 2); the experience pass is two forwards (policy and reference), the update a forward
  and a backward (3 forwards), full recompute one forward more. Under expert parallelism each MoE
  layer adds its token all-to-alls (:mod:`megatron_zcpo.planning.moe_costs`): in the two experience
  forwards, and forward and backward of the update (and the recomputed forward), over the
  all-to-all bandwidth (NVLink within a node, InfiniBand when EP spans nodes), not overlapped.
* weight push: bf16 bytes of the model / link bandwidth. Funnelled, every byte leaves through global
  rank 0's link; per share, each pipeline stage's lead sends its stage's dense share and each
  expert-parallel rank's lead its experts, concurrently, so the time is that of the largest share.
* step: sequential = rollout + training + push. Overlapped (one step off-policy): the engine
  generates step k+1 while the trainer trains on step k, so a step takes max(rollout, training)
  and the push, between two generations, stalls both sides: max(rollout, training) + push.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.moe_costs import all_to_all_bytes_per_token_layer, expert_parameters_per_gpu

H100_BF16_DENSE_FLOPS = 989e12  # NVIDIA H100 SXM datasheet, dense BF16 tensor-core peak
INFINIBAND_NDR_BYTES_S = 50e9  # one 400 Gb/s NDR port per GPU
NVLINK4_BYTES_S = 450e9  # H100 SXM NVLink 4: 900 GB/s in both directions together


@dataclass(frozen=True)
class StepLoad:
    """What one RL step generates and trains on.

    ``generated_sequences``: responses generated (prompts x G x dynamic sampling's over-sampling);
    ``trained_sequences``: those trained on; ``prompt_tokens`` / ``response_tokens``: mean lengths.
    """

    generated_sequences: float
    trained_sequences: float
    prompt_tokens: float
    response_tokens: float

    def validate(self, prefix: str = "load") -> None:
        """Raise ``ValueError`` naming the offending key on a non-positive value."""
        for key, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {value}")


@dataclass(frozen=True)
class Cluster:
    """The hardware side: GPUs per job, decode speed, MFU, peak FLOP/s, the inter-node link per GPU
    and the intra-node one (NVLink), GPUs per node."""

    train_gpus: int
    rollout_gpus: int
    decode_tokens_per_s_per_gpu: float
    mfu: float = 0.35
    peak_flops: float = H100_BF16_DENSE_FLOPS
    link_bytes_per_s: float = INFINIBAND_NDR_BYTES_S
    node_link_bytes_per_s: float = NVLINK4_BYTES_S
    gpus_per_node: int = 8

    def validate(self, prefix: str = "cluster") -> None:
        """Raise ``ValueError`` naming the offending key on a bad value."""
        for key, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {value}")
        if self.mfu > 1:
            raise ValueError(f"{prefix}.mfu must be at most 1, got {self.mfu}")


def forward_flops_per_token(model: ModelConfig, sequence_length: float) -> float:
    """FLOPs of one forward pass per token of a causal sequence of ``sequence_length`` tokens."""
    dense = model.num_active_parameters - model.vocab_size * model.hidden_size  # the embedding is a lookup
    if model.tie_word_embeddings:
        dense += model.vocab_size * model.hidden_size  # the tied weight still runs as output layer
    attention = 4 * model.num_layers * model.num_attention_heads * model.kv_channels * sequence_length / 2
    return 2 * dense + attention


def push_bytes_per_stage(model: ModelConfig, pipeline_parallel: int, expert_parallel: int = 1) -> float:
    """bf16 bytes the most loaded sender pushes: a stage's lead its dense share (layers split
    evenly; embedding on the first stage, output layer on the last; a tied embedding is sent once)
    and its expert-parallel rank's experts; every other expert-parallel rank's lead its own experts."""
    experts = 2 * expert_parameters_per_gpu(model, model.num_layers, 1, 1)
    model_bytes = 2 * model.num_parameters - experts
    expert_share = experts / (pipeline_parallel * expert_parallel)
    if pipeline_parallel == 1:
        return model_bytes + expert_share
    vocab_bytes = 2 * model.vocab_size * model.hidden_size
    outer = model_bytes - vocab_bytes * (1 if model.tie_word_embeddings else 2)
    return outer / pipeline_parallel + vocab_bytes + expert_share


def all_to_all_s(model: ModelConfig, load: StepLoad, cluster: Cluster, expert_parallel: int, recompute: str) -> float:
    """Seconds of a step's MoE token all-to-alls per training GPU (module docstring); 0 without EP."""
    per_token_layer = all_to_all_bytes_per_token_layer(model, expert_parallel)
    if per_token_layer == 0:
        return 0.0
    passes = 2 + 2 + (1 if recompute == "full" else 0)  # experience (policy, reference) + update fwd/bwd
    tokens_per_gpu = load.trained_sequences * (load.prompt_tokens + load.response_tokens) / cluster.train_gpus
    bandwidth = cluster.node_link_bytes_per_s if expert_parallel <= cluster.gpus_per_node else cluster.link_bytes_per_s
    return passes * tokens_per_gpu * sum(model.moe_layer_pattern) * per_token_layer / bandwidth


@dataclass
class StepTime:
    """Seconds per term and per mode; ``idle_share_*``: fraction of all GPUs' time spent waiting."""

    rollout_s: float
    train_s: float  # all-to-all included
    all_to_all_s: float
    push_funnel_s: float
    push_per_stage_s: float
    sequential_s: float
    overlapped_s: float
    idle_share_sequential: float
    idle_share_overlapped: float

    def step_s(self, overlap: bool) -> float:
        """The predicted step time of the chosen mode (per-stage push)."""
        return self.overlapped_s if overlap else self.sequential_s

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return asdict(self)


def _idle_share(step_s: float, rollout_s: float, train_s: float, cluster: Cluster) -> float:
    busy = rollout_s * cluster.rollout_gpus + train_s * cluster.train_gpus
    return 1.0 - busy / (step_s * (cluster.rollout_gpus + cluster.train_gpus))


def predict_step_time(
    model: ModelConfig,
    load: StepLoad,
    cluster: Cluster,
    *,
    pipeline_parallel: int = 1,
    recompute: str = "none",
    expert_parallel: int = 1,
) -> StepTime:
    """Seconds of one step's rollout, training and push, sequential and overlapped (see module doc)."""
    load.validate()
    cluster.validate()
    rollout = (
        load.generated_sequences * load.response_tokens / (cluster.decode_tokens_per_s_per_gpu * cluster.rollout_gpus)
    )
    sequence = load.prompt_tokens + load.response_tokens
    forwards = 2 + 3 + (1 if recompute == "full" else 0)
    flops = load.trained_sequences * sequence * forward_flops_per_token(model, sequence) * forwards
    exchange = all_to_all_s(model, load, cluster, expert_parallel, recompute)
    train = flops / (cluster.train_gpus * cluster.peak_flops * cluster.mfu) + exchange
    funnel = 2 * model.num_parameters / cluster.link_bytes_per_s
    per_stage = push_bytes_per_stage(model, pipeline_parallel, expert_parallel) / cluster.link_bytes_per_s
    sequential = rollout + train + per_stage
    overlapped = max(rollout, train) + per_stage
    return StepTime(
        rollout_s=rollout,
        train_s=train,
        all_to_all_s=exchange,
        push_funnel_s=funnel,
        push_per_stage_s=per_stage,
        sequential_s=sequential,
        overlapped_s=overlapped,
        idle_share_sequential=_idle_share(sequential, rollout, train, cluster),
        idle_share_overlapped=_idle_share(overlapped, rollout, train, cluster),
    )


def format_seconds(value: float) -> str:
    """A predicted duration with the digits it needs: ``13,556 s``, ``2.4 s``, ``35.1 ms``, ``480 us``."""
    if value >= 100:
        return f"{value:,.0f} s"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} us"
