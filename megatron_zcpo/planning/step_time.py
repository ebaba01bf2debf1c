"""Predicted time of one RL step: generation, training and the transitions between them, for
disaggregated servers (sequential or overlapped) and for colocated ones (training and SGLang on the
same GPUs).

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig` (no process group, no GPU),
like :mod:`megatron_zcpo.planning.planner`. One set of constants, each calibrated on a published
measurement (benchmarks/RESULTS.md holds the calibration table, tests/planning/test_calibration.py
holds the model to it). Term by term:

* generation (:func:`~megatron_zcpo.planning.decode_rate.generation_time`): decode and prefill on
  the roofline of :mod:`~megatron_zcpo.planning.decode_rate` at the batch a server holds (its KV pool,
  bounded by the requests in flight on it), at the efficiency calibrated on SGLang's published
  offline throughput; the step waits for its longest response, ``max_response_tokens`` decode
  steps: those beyond the bulk's run at a small batch, at the efficiency of SGLang's published
  online TPOT. A given per-GPU rate (``Cluster.decode_tokens_per_s_per_gpu``, measured on your
  servers) replaces the bulk.
* training: FLOPs / (training GPUs x peak FLOP/s x :data:`TRAINING_MFU`). Per token a forward costs
  2 x parameters (embedding excluded, output layer included; a mixture-of-experts model's *active*
  parameters) + causal attention 4 x layers x heads x head_dim x (sequence / 2); the experience
  pass (log-probs) is two forwards (policy and reference), the update a forward and a backward
  (3 forwards; a LoRA policy's frozen base computes no weight gradients: 2), full recompute one
  forward more. ``TRAINING_MFU`` = 0.35 is not fitted: with it
  NeMo-RL's dense rows (Qwen3-32B, Llama-3.1-8B, v0.4 and v0.5) come out within 0.84-1.10x of their
  published steps; mixture-of-experts models train at ``MOE_TRAINING_MFU`` (benchmarks/RESULTS.md
  lists their rows, and the Qwen3-30B-A3B ones this does not hold). Under
  expert parallelism each MoE layer adds its token all-to-alls on the busiest rank
  (:mod:`megatron_zcpo.planning.moe_costs`, ``expert_imbalance`` times the mean) in the two
  experience forwards and the update's passes, over NVLink within a node, InfiniBand across nodes
  (nominal bandwidths, not calibrated: no published all-to-all time of these shapes was found).
* transitions (:mod:`megatron_zcpo.planning.transitions`): the NCCL push (per pipeline stage and
  expert rank concurrently, or funnelled through rank 0), the colocated CUDA IPC push and the
  colocated offload / onload of the training state.
  A LoRA adapter pushed alone (``adapter_push_bytes``) is costed as a push of its bytes (the fixed
  part dominates; not calibrated on a published adapter refit).
* step: disaggregated sequential = generation + training + push; overlapped (one step
  off-policy) = max(generation, training) + push; asynchronous (``rollout.mode=async``, staleness
  k) = max(bulk, training, tail / (k + 1)) + push: the engine decodes all the time at its full
  batch (the bulk), training overlaps it, and the longest response no longer holds a step: it
  continues across pushes and only has to finish within the k + 1 steps it may take before it is
  too stale; colocated = generation on all GPUs + training + offload / onload + IPC push (nothing
  overlaps: the same GPUs do both).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from megatron_zcpo.megatron.model import ModelConfig
from megatron_zcpo.planning.decode_rate import H100_80GB_BYTES, generation_time
from megatron_zcpo.planning.flops import H100_BF16_DENSE_FLOPS, forward_flops_per_token
from megatron_zcpo.planning.lora_costs import BACKWARD_FORWARDS, FROZEN_BACKWARD_FORWARDS
from megatron_zcpo.planning.moe_costs import (
    DEFAULT_EXPERT_IMBALANCE,
    all_to_all_bytes_per_token_layer,
    expert_parameters_per_gpu,
)
from megatron_zcpo.planning.transitions import ipc_push_s, nccl_push_s, offload_onload_s

INFINIBAND_NDR_BYTES_S = 50e9  # one 400 Gb/s NDR port per GPU
NVLINK4_BYTES_S = 450e9  # H100 SXM NVLink 4: 900 GB/s in both directions together
TRAINING_MFU = 0.35  # held against NeMo-RL's published steps (module docstring)
# Mixture-of-experts models (module docstring): fitted on megatron-core's published Qwen3-235B-A22B
# pre-training step (planning/calibration.py), the all-to-alls of that step counted apart.
MOE_TRAINING_MFU = 0.222


def training_mfu(model: ModelConfig) -> float:
    """The MFU ``model`` trains at: :data:`MOE_TRAINING_MFU` with routed experts, else :data:`TRAINING_MFU`."""
    return MOE_TRAINING_MFU if model.is_moe else TRAINING_MFU


PLACEMENTS = ("disaggregated", "colocated")
ROLLOUT_MODES = {"sync": "sequential", "overlap": "overlapped", "async": "asynchronous"}  # rollout.mode -> StepTime


@dataclass(frozen=True)
class StepLoad:
    """What one RL step generates and trains on.

    ``generated_sequences``: responses generated (prompts x G x dynamic sampling's over-sampling);
    ``trained_sequences``: those trained on; ``prompt_tokens`` / ``response_tokens``: mean lengths;
    ``max_response_tokens``: the longest response (``rollout.max_new_tokens``; None: the mean, no tail).
    """

    generated_sequences: float
    trained_sequences: float
    prompt_tokens: float
    response_tokens: float
    max_response_tokens: Optional[float] = None

    @property
    def longest_response(self) -> float:
        """The longest response's tokens (the mean when not given)."""
        return self.max_response_tokens or self.response_tokens

    def validate(self, prefix: str = "load") -> None:
        """Raise ``ValueError`` naming the offending key on a non-positive value."""
        for key, value in asdict(self).items():
            if value is not None and not value > 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {value}")
        if self.longest_response < self.response_tokens:
            raise ValueError(
                f"{prefix}.max_response_tokens={self.max_response_tokens} is below the mean "
                f"{prefix}.response_tokens={self.response_tokens}"
            )


@dataclass(frozen=True)
class Cluster:
    """The hardware side: GPUs of training and of the SGLang servers (``rollout_gpus`` is ignored
    when ``placement`` is "colocated": the servers run on the training GPUs), GPUs per server and
    their ``mem_fraction_static``, a measured decode rate per GPU (None: modelled), MFU, peak
    FLOP/s, the inter-node link per GPU and NVLink, GPUs per node, memory per GPU (bytes), the
    client's cap on requests in flight over all servers (None: every sample at once), the servers'
    DP-attention groups (``rollout_dp_attention``, SGLang's ``--dp-size``; 1: plain TP)."""

    train_gpus: int
    rollout_gpus: int
    decode_tokens_per_s_per_gpu: Optional[float] = None
    mfu: Optional[float] = None  # None: the model's (training_mfu)
    peak_flops: float = H100_BF16_DENSE_FLOPS
    link_bytes_per_s: float = INFINIBAND_NDR_BYTES_S
    node_link_bytes_per_s: float = NVLINK4_BYTES_S
    gpus_per_node: int = 8
    placement: str = "disaggregated"
    rollout_tp: int = 4
    mem_fraction: float = 0.85
    gpu_memory_bytes: float = H100_80GB_BYTES
    max_in_flight: Optional[int] = None
    rollout_dp_attention: int = 1

    @property
    def generation_gpus(self) -> int:
        """GPUs that generate: the servers' own, or every training GPU when colocated."""
        return self.train_gpus if self.placement == "colocated" else self.rollout_gpus

    @property
    def total_gpus(self) -> int:
        """GPUs of the run."""
        return self.train_gpus if self.placement == "colocated" else self.train_gpus + self.rollout_gpus

    def validate(self, prefix: str = "cluster") -> None:
        """Raise ``ValueError`` naming the offending key on a bad value."""
        if self.placement not in PLACEMENTS:
            raise ValueError(f"{prefix}.placement={self.placement!r}: choose one of {PLACEMENTS}")
        for key, value in asdict(self).items():
            if key != "placement" and value is not None and not value > 0:
                raise ValueError(f"{prefix}.{key} must be positive, got {value}")
        if self.mfu is not None and self.mfu > 1:
            raise ValueError(f"{prefix}.mfu must be at most 1, got {self.mfu}")
        if self.generation_gpus < self.rollout_tp:
            raise ValueError(
                f"{prefix}: {self.generation_gpus} generating GPUs hold no server of rollout_tp={self.rollout_tp} GPUs"
            )


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


def all_to_all_s(
    model: ModelConfig,
    load: StepLoad,
    cluster: Cluster,
    expert_parallel: int,
    recompute: str,
    imbalance: float = DEFAULT_EXPERT_IMBALANCE,
) -> float:
    """Seconds of a step's MoE token all-to-alls on the busiest training GPU (module docstring); 0 without EP."""
    per_token_layer = all_to_all_bytes_per_token_layer(model, expert_parallel, imbalance)
    if per_token_layer == 0:
        return 0.0
    passes = 2 + 2 + (1 if recompute == "full" else 0)  # experience (policy, reference) + update fwd/bwd
    tokens_per_gpu = load.trained_sequences * (load.prompt_tokens + load.response_tokens) / cluster.train_gpus
    bandwidth = cluster.node_link_bytes_per_s if expert_parallel <= cluster.gpus_per_node else cluster.link_bytes_per_s
    return passes * tokens_per_gpu * sum(model.moe_layer_pattern) * per_token_layer / bandwidth


@dataclass
class StepTime:
    """Seconds per term and per mode; ``idle_share_*``: fraction of all GPUs' time spent waiting
    (disaggregated modes). ``rollout_s`` is the generation (``bulk_s``: its tokens at the full batch's
    throughput, ``tail_s``: its longest response); ``asynchronous_s`` the asynchronous step at ``max_staleness``;
    ``push_per_stage_s`` / ``push_funnel_s`` the NCCL push; ``colocated_s`` the colocated step,
    of which ``offload_s`` and ``ipc_push_s``; ``predicted_s`` the step of the chosen mode and
    ``tokens_per_s_per_gpu`` the trained tokens per second per GPU of the run it implies."""

    rollout_s: float
    bulk_s: float
    tail_s: float
    train_s: float  # all-to-all included
    all_to_all_s: float
    push_funnel_s: float
    push_per_stage_s: float
    sequential_s: float
    overlapped_s: float
    asynchronous_s: float
    max_staleness: int
    offload_s: float
    ipc_push_s: float
    colocated_s: float
    idle_share_sequential: float
    idle_share_overlapped: float
    idle_share_asynchronous: float
    mode: str
    predicted_s: float
    tokens_per_s_per_gpu: float

    def step_s(self, rollout_mode: str) -> float:
        """The predicted disaggregated step time of ``rollout_mode`` (sync | overlap | async; per-stage push)."""
        return getattr(self, f"{ROLLOUT_MODES[rollout_mode]}_s")

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
    rollout_mode: str = "sync",
    max_staleness: int = 1,
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE,
    offloaded_bytes_per_gpu: float = 0.0,
    frozen_base: bool = False,
    adapter_push_bytes: Optional[float] = None,
) -> StepTime:
    """Seconds of one step's terms and modes (module docstring). ``rollout_mode``: the disaggregated
    mode chosen, sync | overlap | async (ignored when colocated), ``max_staleness`` its k (async);
    ``offloaded_bytes_per_gpu``: the training state a colocated GPU moves to the host and back
    (parameters, gradients, optimizer, reference); ``frozen_base``: a LoRA policy (no weight
    gradients of the base); ``adapter_push_bytes``: a LoRA adapter pushed alone, through rank 0,
    instead of the weights."""
    if rollout_mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout_mode must be one of {tuple(ROLLOUT_MODES)}, got {rollout_mode!r}")
    if max_staleness < 1:
        raise ValueError(f"max_staleness must be >= 1, got {max_staleness}")
    load.validate()
    cluster.validate()
    generation = generation_time(
        model,
        load.generated_sequences,
        load.prompt_tokens,
        load.response_tokens,
        load.longest_response,
        cluster.generation_gpus,
        cluster.rollout_tp,
        mem_fraction=cluster.mem_fraction,
        gpu_memory_bytes=cluster.gpu_memory_bytes,
        decode_tokens_per_s_per_gpu=cluster.decode_tokens_per_s_per_gpu,
        max_in_flight=cluster.max_in_flight,
        dp_attention=cluster.rollout_dp_attention,
        gpus_per_node=cluster.gpus_per_node,
    )
    rollout = generation.seconds
    sequence = load.prompt_tokens + load.response_tokens
    backward = FROZEN_BACKWARD_FORWARDS if frozen_base else BACKWARD_FORWARDS
    forwards = 2 + 1 + backward + (1 if recompute == "full" else 0)
    flops = load.trained_sequences * sequence * forward_flops_per_token(model, sequence) * forwards
    exchange = all_to_all_s(model, load, cluster, expert_parallel, recompute, expert_imbalance)
    train = flops / (cluster.train_gpus * cluster.peak_flops * (cluster.mfu or training_mfu(model))) + exchange
    funnel = nccl_push_s(2 * model.num_parameters if adapter_push_bytes is None else adapter_push_bytes)
    stage_bytes = push_bytes_per_stage(model, pipeline_parallel, expert_parallel)
    per_stage = nccl_push_s(stage_bytes if adapter_push_bytes is None else adapter_push_bytes)
    sequential = rollout + train + per_stage
    overlapped = max(rollout, train) + per_stage
    asynchronous = max(generation.bulk_s, train, generation.tail_s / (max_staleness + 1)) + per_stage
    offload = offload_onload_s(offloaded_bytes_per_gpu)
    ipc = ipc_push_s(2 * model.num_parameters)
    colocated = rollout + train + offload + ipc
    modes = {"sequential": sequential, "overlapped": overlapped, "asynchronous": asynchronous}
    mode = "colocated" if cluster.placement == "colocated" else ROLLOUT_MODES[rollout_mode]
    predicted = colocated if mode == "colocated" else modes[mode]
    return StepTime(
        rollout_s=rollout,
        bulk_s=generation.bulk_s,
        tail_s=generation.tail_s,
        train_s=train,
        all_to_all_s=exchange,
        push_funnel_s=funnel,
        push_per_stage_s=per_stage,
        sequential_s=sequential,
        overlapped_s=overlapped,
        asynchronous_s=asynchronous,
        max_staleness=max_staleness,
        offload_s=offload,
        ipc_push_s=ipc,
        colocated_s=colocated,
        idle_share_sequential=_idle_share(sequential, rollout, train, cluster),
        idle_share_overlapped=_idle_share(overlapped, rollout, train, cluster),
        idle_share_asynchronous=_idle_share(asynchronous, generation.bulk_s, train, cluster),
        mode=mode,
        predicted_s=predicted,
        tokens_per_s_per_gpu=load.trained_sequences * sequence / (predicted * cluster.total_gpus),
    )


def format_seconds(value: float) -> str:
    """A predicted duration with the digits it needs: ``13,556 s``, ``2.4 s``, ``35.1 ms``, ``480 us``."""
    if value >= 100:
        return f"{value:,.0f} s"
    if value >= 1:
        return f"{value:.1f} s"
    return f"{value * 1e3:.3g} ms" if value >= 1e-3 else f"{value * 1e6:.3g} us"
