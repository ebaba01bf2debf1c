"""The per-GPU memory model behind the planner: layouts, workloads, hardware and each component's bytes.

Pure arithmetic on a :class:`~megatron_zcpo.megatron.model.ModelConfig`, a :class:`Layout`, a
:class:`Workload` and a :class:`Hardware`; it starts no process group and needs no GPU. The
planner (:mod:`megatron_zcpo.planning.planner`) adds up these components and searches layouts.

What is modelled, for the most loaded pipeline stage (first and last stage are both evaluated):

* Weights and optimizer (mixed-precision Adam, megatron-core DDP + optimizer): bf16 parameters in
  the DDP param buffer (2 B), fp32 gradients in the DDP grad buffer (4 B, ``grad_reduce_in_fp32``,
  Megatron's default for bf16), fp32 main parameters (4 B) and Adam's two moments (8 B): 18 bytes
  per parameter. The distributed optimizer shards only the main parameters and moments over the
  data-parallel x context-parallel group (megatron-core builds it on ``intra_dp_cp_group``); the
  param and grad buffers stay whole on every rank: 6 + 12/(DP*CP) bytes per parameter (the table
  in megatron-core's "Distributed Optimizer" guide).
* Activations per transformer layer: Korthikanti et al. 2022, "Reducing Activation Recomputation in
  Large Transformer Models" (arXiv:2205.05198), Sec. 4, re-derived tensor by tensor for this
  architecture (see :func:`layer_activation_bytes`), times the layers a 1F1B / interleaved schedule
  keeps in flight on the stage (see :func:`layers_in_flight`).
* Logits and KL (:func:`token_stats_bytes`), by the backend the run selects
  (``train.token_stats_backend``; ``auto`` is the Triton kernels on a GPU): the torch backend holds
  six fp32 tiles of ``[chunk_tokens, 2**25 / chunk_tokens]`` columns of the V_pad/TP shard; the
  Triton kernels an fp32 ``[chunk_tokens, V_pad/TP]`` logit buffer (two with the reference) and,
  in the update, float16 ``[tokens, V_pad/TP]`` caches (two when the update runs the reference)
  kept for the backward, which writes a bf16 ``[tokens, V_pad/TP]`` logit gradient. Besides: the
  gathered final hidden states of the micro-batch and a few fp32 vectors per token.
* Reference model: a bf16 copy of the stage's parameters, resident, offloaded to CPU between
  experience passes, or absent (methods without a reference, and LoRA, whose reference is the base
  with the adapters off: "adapters_off", no weights of its own, its hidden states and logits counted).
* LoRA (``Workload.lora_rank`` > 0): the frozen base holds its bf16 parameters only (no gradient
  buffer, no optimizer state); the adapters (:func:`lora_layer_parameters` per layer: A replicated
  and B split over TP for the column-parallel linears, the other way round for the row-parallel
  ones) hold bf16 parameters, fp32 gradients and Adam's state like any trained parameter. Their
  activations are [tokens, r] per adapted linear, noise beside a layer's; the inputs their A needs
  are the ones a trained base saves anyway (counted below).
* Mixture-of-experts models: each GPU holds its expert-parallel rank's experts (their optimizer
  state sharded over the experts' replicas) and keeps its share of the routed tokens' expert
  activations (:mod:`megatron_zcpo.planning.moe_costs`).
* Overhead: the named reserve for what is not modelled tensor by tensor, a fraction of the GPU
  (``Hardware.headroom_fraction``, 10%): the CUDA context, NCCL buffers, the transient buckets of
  the weight push to the rollout servers and allocator fragmentation. Headroom policy
  (:attr:`~megatron_zcpo.planning.planner.MemoryPlan.verdict`): a plan "fits" when its total,
  reserve included, leaves a further margin (``Hardware.margin_fraction``, 2% of the GPU, 1.6 GiB
  on an H100) for the model's own error (checked against hand counts, not a measured peak) and
  routing beyond the imbalance factor; it is "tight" when it does not, and "does not fit" only
  when the modelled tensors alone, reserve aside, exceed the GPU.

Two phases are evaluated per stage and the larger one is reported: ``train`` (forward and backward
of a mini-batch) and ``experience`` (no-grad forward of policy and reference to get log-probs and
the conditional KL).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from megatron_zcpo.megatron.model import ModelConfig, padded_vocab_size, pipeline_stage_layers
from megatron_zcpo.planning.lora_costs import LORA_LINEARS, lora_layer_parameters
from megatron_zcpo.planning.moe_costs import (
    DEFAULT_EXPERT_IMBALANCE,
    expert_parameters_per_gpu,
    moe_layer_share,
    moe_mlp_activation_bytes_per_token,
    non_expert_mlp_parameters,
)

GIB = 2**30
# nvidia-smi reports 81,559 MiB on an H100 SXM 80GB: the capacity the allocator can see.
H100_80GB_GIB = 81559 / 1024

RECOMPUTE_CHOICES = ("none", "selective", "full")
REFERENCE_CHOICES = ("resident", "offloaded", "none", "adapters_off")
TOKEN_STATS_BACKENDS = ("auto", "torch", "triton")  # train.token_stats_backend; auto = triton on a GPU
COMPONENTS = ("parameters", "gradients", "optimizer_states", "activations", "logits_kl", "reference_model", "overhead")

BYTES_BF16 = 2
BYTES_FP32 = 4
ADAM_MOMENTS = 2
# The torch backend of megatron_zcpo.ops.token_stats works in tiles of [chunk tokens, at most
# TORCH_TILE_ELEMENTS / chunk columns] of this rank's vocabulary shard (ops/token_stats_kernels.py,
# _GPU_TILE) and keeps six fp32 buffers of that size (policy and reference logits and the
# element-wise temporaries), in forward and in backward.
KL_FP32_BLOCKS = 6
TORCH_TILE_ELEMENTS = 2**25
# The Triton backend (ops/token_stats_triton.py) caches, when a gradient is wanted, the policy's
# probabilities and (with the reference) the log-ratio as float16 [tokens, V_local] each.
TRITON_CACHE_BYTES = 2
# fp32 values kept per token of the micro-batch by those ops: log-prob, entropy, reference
# log-prob, KL, both maxima, S, S_r, B, G, sum e^u u, target logits (policy and reference).
PER_TOKEN_FP32_VECTORS = 13


def divisors(n: int) -> List[int]:
    """Positive divisors of ``n``, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    """A megatron-core parallel layout of the training job.

    ``data_parallel`` counts model replicas, so the job uses TP * PP * CP * DP GPUs.
    ``virtual_pipeline``: model chunks per pipeline rank (interleaved 1F1B), None for plain 1F1B.
    ``recompute``: "none", "selective" (megatron-core's default ``core_attn`` module) or "full"
    (uniform, one layer per checkpoint). Mixture-of-experts models: ``expert_parallel`` (EP) x
    ``expert_tensor_parallel`` (ETP) ranks, carved out of each stage's TP * CP * DP ranks, share the
    experts (megatron-core's expert groups); they add no GPUs. ``first_stage_layers`` /
    ``last_stage_layers``: uneven pipeline stages (``parallel.first_stage_layers`` / ``last_stage_layers``,
    :func:`~megatron_zcpo.megatron.model.pipeline_stage_layers`), None: layers split evenly.
    """

    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    context_parallel: int = 1
    data_parallel: int = 1
    virtual_pipeline: Optional[int] = None
    sequence_parallel: bool = True
    distributed_optimizer: bool = True
    recompute: str = "selective"
    expert_parallel: int = 1
    expert_tensor_parallel: Optional[int] = None  # None: as tensor_parallel
    first_stage_layers: Optional[int] = None
    last_stage_layers: Optional[int] = None

    @property
    def uneven(self) -> bool:
        """Whether the first or last pipeline stage has a layer count of its own."""
        return self.first_stage_layers is not None or self.last_stage_layers is not None

    def stage_layers(self, model: ModelConfig) -> List[int]:
        """Transformer layers of each pipeline stage (ValueError when they do not split: :meth:`validate`)."""
        return pipeline_stage_layers(
            model.num_layers, self.pipeline_parallel, self.first_stage_layers, self.last_stage_layers
        )

    @property
    def expert_tensor(self) -> int:
        """Expert tensor parallelism (ETP; TP when unset)."""
        return self.expert_tensor_parallel or self.tensor_parallel

    @property
    def expert_data_parallel(self) -> int:
        """Replicas of each expert: the TP * CP * DP ranks of a stage over ETP * EP."""
        return (
            self.tensor_parallel
            * self.context_parallel
            * self.data_parallel
            // (self.expert_tensor * self.expert_parallel)
        )

    @property
    def model_parallel_size(self) -> int:
        """GPUs holding one model replica: TP * PP * CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def num_gpus(self) -> int:
        """GPUs of the training job: TP * PP * CP * DP."""
        return self.model_parallel_size * self.data_parallel

    def validate(self, model: ModelConfig, prefix: str = "layout") -> None:
        """Raise ``ValueError`` naming the offending key when ``model`` cannot use this layout."""
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel", "data_parallel"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{prefix}.{key} must be at least 1, got {getattr(self, key)}")
        if self.recompute not in RECOMPUTE_CHOICES:
            raise ValueError(f"{prefix}.recompute={self.recompute!r}: choose one of {RECOMPUTE_CHOICES}")
        tp = self.tensor_parallel
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            if getattr(model, key) % tp:
                raise ValueError(f"{prefix}.tensor_parallel={tp} must divide model.{key}={getattr(model, key)}")
        self._validate_experts(model, prefix)
        chunks = self.pipeline_parallel
        if self.virtual_pipeline is not None:
            if self.virtual_pipeline < 1:
                raise ValueError(f"{prefix}.virtual_pipeline must be at least 1, got {self.virtual_pipeline}")
            if self.pipeline_parallel < 2:
                raise ValueError(
                    f"{prefix}.virtual_pipeline={self.virtual_pipeline} needs "
                    f"{prefix}.pipeline_parallel >= 2, got {self.pipeline_parallel}"
                )
            chunks *= self.virtual_pipeline
        if self.uneven or self.virtual_pipeline is None:
            keys = (f"{prefix}.pipeline_parallel", f"{prefix}.first_stage_layers", f"{prefix}.last_stage_layers")
            layers = pipeline_stage_layers(
                model.num_layers, self.pipeline_parallel, self.first_stage_layers, self.last_stage_layers, keys
            )
            if any(count % (self.virtual_pipeline or 1) for count in layers):
                raise ValueError(
                    f"{prefix}.virtual_pipeline={self.virtual_pipeline} must divide every stage's layers {layers}"
                )
        elif model.num_layers % chunks:
            raise ValueError(
                f"{prefix}.pipeline_parallel={self.pipeline_parallel} x virtual_pipeline="
                f"{self.virtual_pipeline} must divide model.num_layers={model.num_layers}"
            )

    def _validate_experts(self, model: ModelConfig, prefix: str) -> None:
        if not model.is_moe:
            if self.expert_parallel != 1:
                raise ValueError(
                    f"{prefix}.expert_parallel={self.expert_parallel}: the {model.family} model has no experts"
                )
            return
        if self.expert_parallel < 1 or model.num_experts % self.expert_parallel:
            raise ValueError(
                f"{prefix}.expert_parallel={self.expert_parallel} must divide model.num_experts={model.num_experts}"
            )
        if self.expert_tensor < 1 or model.moe_intermediate_size % self.expert_tensor:
            raise ValueError(
                f"{prefix}.expert_tensor_parallel={self.expert_tensor} must divide "
                f"model.moe_intermediate_size={model.moe_intermediate_size}"
            )
        stage_ranks = self.tensor_parallel * self.context_parallel * self.data_parallel
        if stage_ranks % (self.expert_tensor * self.expert_parallel):
            raise ValueError(
                f"{prefix}: expert_parallel x expert_tensor_parallel = {self.expert_parallel} x "
                f"{self.expert_tensor} must divide a stage's TP x CP x DP = {stage_ranks} ranks"
            )

    def describe(self) -> str:
        """Short human-readable form, e.g. ``TP8 PP2 CP1 DP4 SP distopt recompute=full`` (``EP8`` for MoE)."""
        stages = f"(first {self.first_stage_layers}, last {self.last_stage_layers} layers)" if self.uneven else ""
        parts = [f"TP{self.tensor_parallel}", f"PP{self.pipeline_parallel}{stages}"]
        if self.virtual_pipeline:
            parts.append(f"VPP{self.virtual_pipeline}")
        parts += [f"CP{self.context_parallel}", f"DP{self.data_parallel}"]
        if self.expert_parallel > 1 or self.expert_tensor != self.tensor_parallel:
            parts.append(
                f"EP{self.expert_parallel}"
                + (f" ETP{self.expert_tensor}" if self.expert_tensor != self.tensor_parallel else "")
            )
        if self.sequence_parallel and self.tensor_parallel > 1:
            parts.append("SP")
        parts.append("distopt" if self.distributed_optimizer else "no-distopt")
        parts.append(f"recompute={self.recompute}")
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """What one training rank processes.

    ``micro_batch_tokens``: tokens packed into one micro-batch of one model replica (before the
    context-parallel split); it must hold the longest sequence, ``max_sequence_length`` (prompt +
    response). ``kl_chunk_tokens``: tokens per chunk of the vocab-parallel log-prob / KL ops.
    ``num_microbatches``: micro-batches per optimizer step and pipeline; None plans for the worst
    case (at least as many as the pipeline keeps in flight). ``reference``: "resident" on the GPU,
    "offloaded" to CPU outside the experience pass, "none", or "adapters_off" (a LoRA policy's:
    its forward runs, it holds no weights). ``lora_rank`` / ``lora_targets``: LoRA adapters of
    that rank on those megatron-core linears, the base frozen (0: every weight trained).
    ``token_stats_backend``: the
    token statistics' kernels, "auto" (Triton on a GPU), "torch" or "triton";
    ``update_reference``: the update runs the reference beside the policy (a differentiable
    conditional KL in the loss, ``algorithm.kl_loss=full``). ``expert_imbalance``: the busiest
    expert-parallel rank's routed tokens over the mean (mixture-of-experts models under EP > 1,
    :data:`~megatron_zcpo.planning.moe_costs.DEFAULT_EXPERT_IMBALANCE`).
    """

    micro_batch_tokens: int
    max_sequence_length: int
    kl_chunk_tokens: int = 4096
    num_microbatches: Optional[int] = None
    reference: str = "resident"
    token_stats_backend: str = "auto"
    update_reference: bool = False
    expert_imbalance: float = DEFAULT_EXPERT_IMBALANCE
    lora_rank: int = 0
    lora_targets: Tuple[str, ...] = ()

    @property
    def token_stats_kernels(self) -> str:
        """The token statistics' backend on the planned GPUs: "torch" or "triton" (what ``auto`` selects)."""
        return "torch" if self.token_stats_backend == "torch" else "triton"

    def validate(self, prefix: str = "workload") -> None:
        """Raise ``ValueError`` naming the offending key on a bad value."""
        for key in ("micro_batch_tokens", "max_sequence_length", "kl_chunk_tokens"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{prefix}.{key} must be positive, got {getattr(self, key)}")
        if self.micro_batch_tokens < self.max_sequence_length:
            raise ValueError(
                f"{prefix}.micro_batch_tokens={self.micro_batch_tokens} must be at least "
                f"{prefix}.max_sequence_length={self.max_sequence_length} "
                "(a micro-batch holds whole sequences)"
            )
        if not self.expert_imbalance >= 1:
            raise ValueError(
                f"{prefix}.expert_imbalance must be at least 1 (the busiest rank over the mean), got "
                f"{self.expert_imbalance}"
            )
        if self.num_microbatches is not None and self.num_microbatches < 1:
            raise ValueError(f"{prefix}.num_microbatches must be positive, got {self.num_microbatches}")
        if self.reference not in REFERENCE_CHOICES:
            raise ValueError(f"{prefix}.reference={self.reference!r}: choose one of {REFERENCE_CHOICES}")
        if self.lora_rank < 0 or bool(self.lora_rank) != bool(self.lora_targets):
            raise ValueError(
                f"{prefix}.lora_rank={self.lora_rank} and lora_targets={self.lora_targets}: both or neither"
            )
        unknown = sorted(set(self.lora_targets) - set(LORA_LINEARS))
        if unknown:
            raise ValueError(f"{prefix}.lora_targets {unknown}: choose from {LORA_LINEARS}")
        if self.token_stats_backend not in TOKEN_STATS_BACKENDS:
            raise ValueError(
                f"{prefix}.token_stats_backend={self.token_stats_backend!r}: choose one of {TOKEN_STATS_BACKENDS}"
            )


@dataclass(frozen=True)
class Hardware:
    """The GPUs: usable memory per GPU (GiB), the reserve for what is not modelled (the
    ``overhead`` row), the margin a fitting plan leaves besides (module docstring), GPUs per node."""

    gpu_memory_gib: float = H100_80GB_GIB
    headroom_fraction: float = 0.10
    gpus_per_node: int = 8
    margin_fraction: float = 0.02

    def validate(self, prefix: str = "hardware") -> None:
        """Raise ``ValueError`` naming the offending key on a bad value."""
        if self.gpu_memory_gib <= 0:
            raise ValueError(f"{prefix}.gpu_memory_gib must be positive, got {self.gpu_memory_gib}")
        if not 0.0 <= self.headroom_fraction < 1.0:
            raise ValueError(f"{prefix}.headroom_fraction must be in [0, 1), got {self.headroom_fraction}")
        if not 0.0 <= self.margin_fraction < 1.0 - self.headroom_fraction:
            raise ValueError(
                f"{prefix}.margin_fraction must be in [0, 1 - headroom_fraction), got {self.margin_fraction}"
            )
        if self.gpus_per_node < 1:
            raise ValueError(f"{prefix}.gpus_per_node must be at least 1, got {self.gpus_per_node}")


def bytes_per_parameter(distributed_optimizer: bool, optimizer_shards: int = 1) -> Dict[str, float]:
    """Bytes per parameter of bf16 mixed-precision Adam, by component.

    ``parameters`` 2 (bf16), ``gradients`` 4 (fp32 grad buffer), ``optimizer_states`` 12 (fp32 main
    parameter + two Adam moments), divided by ``optimizer_shards`` (= DP * CP) under the distributed
    optimizer: 18 in all without sharding, 6 + 12/d with it.
    """
    optimizer: float = BYTES_FP32 * (1 + ADAM_MOMENTS)
    if distributed_optimizer:
        optimizer = optimizer / optimizer_shards
    return {"parameters": BYTES_BF16, "gradients": BYTES_FP32, "optimizer_states": optimizer}


def layer_parameters(model: ModelConfig, tensor_parallel: int = 1) -> int:
    """Parameters of one transformer layer held by one tensor-parallel rank, routed experts aside
    (:func:`~megatron_zcpo.planning.moe_costs.expert_parameters_per_gpu`).

    QKV (with Qwen2's bias), output projection and the SwiGLU MLP are split over TP; the two RMSNorm
    weights, and Qwen3's per-head q/k RMSNorms (``head_dim`` each), are replicated on every TP rank.
    Widths use ``head_dim`` (megatron's kv_channels), not hidden / heads. Multi-latent attention
    (DeepSeek-V3): its up- and output projections split over TP, its latent down-projections and
    norms whole on every rank (:func:`~megatron_zcpo.megatron.deepseek.mla_parameter_split`). Mixture-of-experts models:
    the MLP is the layers' average of dense MLPs and routers (+ shared experts), see
    :func:`~megatron_zcpo.planning.moe_costs.non_expert_mlp_parameters`.
    """
    h = model.hidden_size
    if model.is_mla:
        from megatron_zcpo.megatron.deepseek import mla_parameter_split

        split, replicated = mla_parameter_split(model)
        replicated += 2 * h
    else:
        q = model.num_attention_heads * model.kv_channels
        kv = 2 * model.num_key_value_heads * model.kv_channels
        split = h * (q + kv) + q * h + ((q + kv) if model.qkv_bias else 0)
        replicated = 2 * h + (2 * model.kv_channels if model.qk_layernorm else 0)
    if model.is_moe:
        return int(split // tensor_parallel + replicated + non_expert_mlp_parameters(model, tensor_parallel))
    return (split + 3 * h * model.intermediate_size) // tensor_parallel + replicated


# The stages the planner evaluates: the first and the last, and with uneven stages a middle one
# (its layer count may be the largest; of the middle stages the second holds the most in flight).
STAGES = ("first", "middle", "last")


def stage_rank(layout: Layout, stage: str) -> int:
    """The pipeline rank evaluated for ``stage`` ("first", "middle" or "last")."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: choose one of {STAGES}")
    return {"first": 0, "middle": min(1, layout.pipeline_parallel - 1), "last": layout.pipeline_parallel - 1}[stage]


def stage_layer_count(model: ModelConfig, layout: Layout, stage: str) -> int:
    """Transformer layers of one GPU of ``stage`` (all its virtual chunks)."""
    return layout.stage_layers(model)[stage_rank(layout, stage)]


def stage_parameters(model: ModelConfig, layout: Layout, stage: str) -> int:
    """Parameters held by one GPU of pipeline stage ``stage`` ("first", "middle" or "last").

    Each pipeline rank holds its stage's layers (num_layers / PP, or the uneven stages' counts;
    over all its virtual chunks). The first stage
    adds the word embedding, the last the final norm and the output layer; with tied embeddings
    and PP > 1 the last stage keeps its own copy of the embedding as output weight (megatron-core
    keeps the two in sync by an all-reduce of their gradients). With PP = 1 the single stage holds
    everything, the tied weight once. Vocabulary rows are Megatron's padded ones.
    """
    tp, pp = layout.tensor_parallel, layout.pipeline_parallel
    vocab_rows = padded_vocab_size(model.vocab_size, tp, model.make_vocab_size_divisible_by)
    vocab_shard = vocab_rows * model.hidden_size // tp
    layers = stage_layer_count(model, layout, stage)
    count = layers * layer_parameters(model, tp) + stage_expert_parameters(model, layout, stage)
    holds_embedding = stage == "first" or pp == 1
    holds_output = stage == "last" or pp == 1
    if holds_embedding:
        count += vocab_shard
    if holds_output:
        count += model.hidden_size  # final norm
        if not (model.tie_word_embeddings and holds_embedding):
            count += vocab_shard
    return count


def stage_expert_parameters(model: ModelConfig, layout: Layout, stage: str = "first") -> int:
    """Routed-expert parameters one GPU of pipeline stage ``stage`` holds (0 for a dense model)."""
    layers = stage_layer_count(model, layout, stage)
    return int(expert_parameters_per_gpu(model, layers, layout.expert_parallel, layout.expert_tensor))


def layer_activation_bytes(
    tokens: float,
    *,
    hidden_size: int,
    query_width: int,
    kv_width: int,
    ffn_hidden_size: int,
    num_heads: int,
    attention_span: float = 0.0,
    gated_mlp: bool = True,
    dropout: bool = False,
    flash_attention: bool = True,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
    recompute: str = "none",
) -> float:
    """Bytes one transformer layer keeps from its forward pass until its backward pass.

    ``tokens``: tokens of the micro-batch on this rank (s*b, already divided by CP).
    ``query_width`` = heads * head_dim; ``kv_width`` = 2 * kv_heads * head_dim (K and V together).
    ``attention_span``: keys per query whose probabilities are stored when attention is not flash
    (s in Korthikanti's 5as^2b).

    Tensor by tensor (16-bit activations, 2 bytes; masks 1 byte):

    * hidden-sized, replicated over TP unless sequence parallel: each norm's input and its output
      (the input of QKV / FC1): 2 x (2h + 2h) = 8h; with dropout the two 1-byte masks: 2h.
    * split over TP: Q, K, V after RoPE, 2(q + kv); the attention output, the input of the output
      projection, 2q; the MLP: SwiGLU keeps FC1's output (2 x ffn wide) for its backward and its
      own output (ffn wide) as FC2's input, 6 ffn; a GeLU MLP keeps 2 ffn + 2 ffn.
    * attention probabilities, only without flash attention and without selective recompute:
      2 bytes per head and key (softmax output), plus a 1-byte mask and a 2-byte dropout output
      with dropout: a * span * (2 [+ 3]). Flash attention keeps instead one fp32 log-sum-exp per
      head and token: 4a.

    With GPT's choices (q = h, kv = 2h, GeLU ffn = 4h, dropout, no flash) this is exactly the
    paper's sbh(34 + 5as/h); with TP and no SP sbh(10 + 24/t + 5as/(ht)); with TP + SP everything
    is divided by t. ``recompute="selective"`` drops the attention probabilities (megatron-core
    recomputes ``core_attn``), the paper's sbh * 34/t. ``recompute="full"`` keeps only the layer
    input, 2sbh (/t with SP); the transient cost of recomputing one layer in the backward is added
    by the caller. For Qwen2/Llama (GQA, SwiGLU, no dropout, flash): sbh(8 + (4q + 2kv + 6 ffn +
    4a)/h) divided by t with SP.
    """
    if recompute not in RECOMPUTE_CHOICES:
        raise ValueError(f"recompute={recompute!r}: choose one of {RECOMPUTE_CHOICES}")
    tp = tensor_parallel
    hidden_divisor = tp if sequence_parallel else 1
    if recompute == "full":
        return tokens * BYTES_BF16 * hidden_size / hidden_divisor
    hidden_bytes = 4 * BYTES_BF16 * hidden_size + (2 * hidden_size if dropout else 0)
    mlp_bytes = (3 if gated_mlp else 2) * BYTES_BF16 * ffn_hidden_size
    split_bytes: float = BYTES_BF16 * (2 * query_width + kv_width) + mlp_bytes
    if flash_attention:
        split_bytes += BYTES_FP32 * num_heads
    elif recompute == "none":
        split_bytes += num_heads * attention_span * (BYTES_BF16 + (3 if dropout else 0))
    return tokens * (hidden_bytes / hidden_divisor + split_bytes / tp)


def model_layer_activation_bytes(
    model: ModelConfig, layout: Layout, tokens: float, recompute: str, expert_imbalance: float = 1.0
) -> float:
    """:func:`layer_activation_bytes` for ``model`` (GQA, SwiGLU, no dropout, flash attention); for a
    mixture-of-experts model the layers' average, MoE layers with their experts' activations
    (:func:`~megatron_zcpo.planning.moe_costs.moe_mlp_activation_bytes_per_token`, over the TP ranks
    whose tokens sequence parallelism splits) on the busiest expert-parallel rank, which receives
    ``expert_imbalance`` times the mean (1 without expert parallelism: every rank holds every expert)."""

    heads = model.num_attention_heads
    # multi-latent attention keeps K and V after the up-projection, per head head_dim + v_head_dim wide
    kv_width = (
        heads * (model.kv_channels + model.value_head_dim)
        if model.is_mla
        else 2 * model.num_key_value_heads * model.kv_channels
    )

    def layer(ffn_hidden_size: int) -> float:
        return layer_activation_bytes(
            tokens,
            hidden_size=model.hidden_size,
            query_width=heads * model.kv_channels,
            kv_width=kv_width,
            ffn_hidden_size=ffn_hidden_size,
            num_heads=model.num_attention_heads,
            tensor_parallel=layout.tensor_parallel,
            sequence_parallel=layout.sequence_parallel,
            recompute=recompute,
        )

    latents = 0.0  # multi-latent attention: the query and key/value latents and their norms' outputs
    if model.is_mla and recompute != "full":
        width = 2 * (model.q_lora_rank or 0) + 2 * model.kv_lora_rank + model.qk_rope_head_dim
        latents = tokens * BYTES_BF16 * width / (layout.tensor_parallel if layout.sequence_parallel else 1)
    if not model.is_moe:
        return layer(model.intermediate_size) + latents
    share = moe_layer_share(model)
    moe = layer(model.shared_expert_intermediate_size)
    if recompute != "full":
        imbalance = expert_imbalance if layout.expert_parallel > 1 else 1.0
        moe += tokens * moe_mlp_activation_bytes_per_token(model, imbalance) / layout.tensor_parallel
    return (1 - share) * layer(model.intermediate_size) + share * moe + latents


def layers_in_flight(
    num_layers: int,
    pipeline_parallel: int,
    pipeline_rank: int,
    virtual_pipeline: Optional[int] = None,
    num_microbatches: Optional[int] = None,
    stage_layers: Optional[float] = None,
) -> float:
    """Transformer layers whose activations pipeline rank ``pipeline_rank`` holds at its peak
    (``stage_layers``: the rank's layers when the stages are uneven; None: num_layers / PP).

    megatron-core's schedules (``get_pp_rank_microbatches``) run W warm-up forwards before the
    first backward, so W + 1 (model chunk, micro-batch) pairs are in flight: W = PP - rank - 1 for
    1F1B, W = 2(PP - rank - 1) + (VPP - 1) * PP for the interleaved schedule; never more than the
    number of pairs, num_microbatches * VPP. Each pair holds num_layers / (PP * VPP) layers. On the
    first rank this is num_layers for 1F1B and num_layers * (1 + (PP - 1)/(PP * VPP)) interleaved,
    Korthikanti et al.'s Sec. 4.2.3 factor.
    """
    chunks = virtual_pipeline or 1
    if pipeline_parallel == 1:
        in_flight = 1
    elif virtual_pipeline is None:
        in_flight = pipeline_parallel - pipeline_rank
    else:
        in_flight = 2 * (pipeline_parallel - pipeline_rank - 1) + (chunks - 1) * pipeline_parallel + 1
    if num_microbatches is not None:
        in_flight = min(in_flight, num_microbatches * chunks)
    if stage_layers is None:
        stage_layers = num_layers / pipeline_parallel
    return in_flight * stage_layers / chunks


def token_stats_bytes(
    backend: str,
    *,
    tokens: float,
    chunk_tokens: int,
    vocab_columns: int,
    hidden_size: int,
    with_reference: bool,
    gradient: bool,
    operand_bytes: int = BYTES_BF16,
) -> Dict[str, float]:
    """Bytes the token statistics' op holds besides its inputs and per-token vectors, by part.

    ``backend``: "torch" or "triton"; ``tokens`` scored in one call (a micro-batch's on this rank),
    ``chunk_tokens`` per chunk (``train.kl_chunk_size``), ``vocab_columns`` of this rank's shard;
    ``with_reference``: the reference's logits too; ``gradient``: forward and backward (the
    update) rather than a no-grad forward; ``operand_bytes``: the output layer's dtype (bf16).

    Returns {"saved": kept from the forward until the backward, "forward": the forward's working
    buffers, "backward": the backward's}; the op's peak is saved + max(forward, backward).
    torch: six fp32 tiles in either pass, and the backward's fp32 weight-gradient accumulator
    [V_local, H]. triton: the fp32 logits of a chunk (and the reference's); with a gradient, the
    float16 caches [tokens, V_local] (two with the reference) and in the backward the logit gradient
    [tokens, V_local] and the weight gradient [V_local, H], both in the operands' dtype.
    """
    chunk = min(chunk_tokens, tokens)
    if backend == "torch":
        tile = KL_FP32_BLOCKS * chunk * min(vocab_columns, max(1, TORCH_TILE_ELEMENTS // chunk_tokens)) * BYTES_FP32
        weight_grad = vocab_columns * hidden_size * BYTES_FP32
        return {"saved": 0.0, "forward": tile, "backward": tile + weight_grad if gradient else 0.0}
    if backend != "triton":
        raise ValueError(f"backend={backend!r}: choose 'torch' or 'triton'")
    models = 2 if with_reference else 1
    saved = models * tokens * vocab_columns * TRITON_CACHE_BYTES if gradient else 0.0
    backward = (tokens + hidden_size) * vocab_columns * operand_bytes if gradient else 0.0
    return {"saved": saved, "forward": models * chunk * vocab_columns * BYTES_FP32, "backward": backward}


def _logits_kl_bytes(model: ModelConfig, layout: Layout, workload: Workload, tokens: float, phase: str) -> float:
    """The token statistics on the last stage: the op's buffers (:func:`token_stats_bytes`), hidden states, vectors.

    The output layer is column-parallel over the vocabulary, so every TP rank needs the final hidden
    states of all the micro-batch's tokens (gathered, bf16). Training also holds their fp32
    gradient; the experience pass (when there is a reference) and an update that runs the
    reference hold the reference's hidden states too.
    """
    vocab_shard = (
        padded_vocab_size(model.vocab_size, layout.tensor_parallel, model.make_vocab_size_divisible_by)
        // layout.tensor_parallel
    )
    train = phase == "train"
    with_reference = workload.update_reference if train else workload.reference != "none"
    parts = token_stats_bytes(
        workload.token_stats_kernels,
        tokens=tokens,
        chunk_tokens=workload.kl_chunk_tokens,
        vocab_columns=vocab_shard,
        hidden_size=model.hidden_size,
        with_reference=with_reference,
        gradient=train,
    )
    op_peak = parts["saved"] + max(parts["forward"], parts["backward"])
    hidden_per_token = BYTES_BF16 * (2 if with_reference else 1) + (BYTES_FP32 if train else 0)
    per_token = hidden_per_token * model.hidden_size + PER_TOKEN_FP32_VECTORS * BYTES_FP32
    return op_peak + tokens * per_token


def stage_phase_components(
    model: ModelConfig, layout: Layout, workload: Workload, hardware: Hardware, stage: str, phase: str
) -> Dict[str, float]:
    """Bytes per component on one GPU of ``stage`` ("first"/"middle"/"last") in ``phase`` ("train"/"experience")."""
    params = stage_parameters(model, layout, stage)
    experts = stage_expert_parameters(model, layout, stage)
    per_param = bytes_per_parameter(layout.distributed_optimizer, layout.data_parallel * layout.context_parallel)
    if workload.lora_rank:  # the frozen base: bf16 weights alone; the adapters: as any trained parameter
        adapters = stage_layer_count(model, layout, stage) * lora_layer_parameters(
            model, workload.lora_rank, workload.lora_targets, layout.tensor_parallel
        )
        components = {key: adapters * value for key, value in per_param.items()}
        components["parameters"] += params * BYTES_BF16
    else:
        # The distributed optimizer shards the experts' state over their own replicas (expert DP).
        per_expert = bytes_per_parameter(layout.distributed_optimizer, layout.expert_data_parallel)
        components = {key: (params - experts) * value + experts * per_expert[key] for key, value in per_param.items()}
    tokens = workload.micro_batch_tokens / layout.context_parallel
    pp = layout.pipeline_parallel
    holds_output = stage == "last" or pp == 1
    imbalance = workload.expert_imbalance
    one_layer_working_set = model_layer_activation_bytes(model, layout, tokens, "none", imbalance)
    if phase == "train":
        rank = stage_rank(layout, stage)
        in_flight = layers_in_flight(
            model.num_layers,
            pp,
            rank,
            layout.virtual_pipeline,
            workload.num_microbatches,
            stage_layers=layout.stage_layers(model)[rank],
        )
        activations = in_flight * model_layer_activation_bytes(model, layout, tokens, layout.recompute, imbalance)
        # The backward of a layer briefly holds the gradients of its intermediates, about one
        # layer's activations; full recompute first rebuilds those activations too.
        activations += one_layer_working_set * (2 if layout.recompute == "full" else 1)
        if holds_output:  # the final norm's input and output
            hidden_divisor = layout.tensor_parallel if layout.sequence_parallel else 1
            activations += tokens * 2 * BYTES_BF16 * model.hidden_size / hidden_divisor
        reference_on_gpu = workload.reference == "resident"
    else:
        activations = one_layer_working_set  # no-grad forward: one layer's tensors at a time
        reference_on_gpu = workload.reference in ("resident", "offloaded")
    components["activations"] = activations
    components["logits_kl"] = _logits_kl_bytes(model, layout, workload, tokens, phase) if holds_output else 0.0
    components["reference_model"] = params * BYTES_BF16 if reference_on_gpu else 0.0
    components["overhead"] = hardware.headroom_fraction * hardware.gpu_memory_gib * GIB
    return components
