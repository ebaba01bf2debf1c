"""The policy trainer on megatron-core: experience pass, DP-wide calibration, frozen-coefficient updates.

One rollout step, identical on a laptop CPU and on a 1,000-GPU cluster:

1. ``plan``: the rollout's samples are split into mini-batches that keep groups whole, and each
   mini-batch is dealt to data-parallel ranks (groups may be split across ranks). Every rank
   holds the whole rollout's metadata, so global normalisers need no communication.
2. ``experience`` (no grad, the sampling snapshot pi_old = pi_theta): one pipeline pass of the
   policy and the frozen reference together (:class:`PolicyWithReference`) gives per token the
   old log-prob, the reference log-prob, the entropy and the exact full-vocabulary conditional
   KL from the fused vocab-parallel op.
3. ``calibrate``: per-response scalars (KL sum, k1 sum) are all-gathered across data-parallel
   ranks (never tokens) and the registered algorithm turns them, with rewards and groups, into
   per-response coefficients; each rank keeps its own rows. They stay frozen for the rollout.
4. ``update``: per mini-batch, megatron-core's forward_backward_func over packed micro-batches
   with the base surrogate, exact token-mean normalisation across micro-batches and DP ranks,
   gradient clipping and one optimizer step.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Union

import torch

from megatron_zcpo.megatron.batch import (
    MicroBatch,
    RolloutSample,
    assign_data_parallel,
    collate,
    collate_packed,
    pack_micro_batches,
    packed_length,
    split_minibatches,
    units_of,
)
from megatron_zcpo.megatron.model import ModelConfig, build_gpt_model, transformer_config
from megatron_zcpo.megatron.pipeline import (
    PolicyWithReference,
    install_hidden_state_head,
    output_weight,
    run_schedule,
)


@dataclass
class ParallelConfig:
    """The ``parallel:`` section: model-parallel layout (DP = world / (TP*PP*CP))."""

    tensor: int = 1
    pipeline: int = 1
    context: int = 1
    sequence_parallel: bool = False
    distributed_optimizer: bool = False

    def validate(self) -> None:
        for key in ("tensor", "pipeline", "context"):
            if getattr(self, key) < 1:
                raise ValueError(f"parallel.{key} must be >= 1, got {getattr(self, key)}")
        if self.sequence_parallel and self.tensor == 1:
            raise ValueError("parallel.sequence_parallel needs parallel.tensor > 1")


@dataclass
class ImportanceSamplingConfig:
    """``train.importance_sampling``: truncated IS against the rollout engine's log-probs.

    Per token w = pi_old / pi_rollout; ``mode`` "truncate" clamps w into [lower, upper], "mask"
    zeroes tokens outside it; a sequence with any token ratio below ``veto`` gets weight 0.
    """

    enabled: bool = False
    upper: float = 5.0
    lower: float = 0.5
    veto: float = 1e-4
    mode: str = "truncate"

    def validate(self) -> None:
        if self.mode not in ("truncate", "mask"):
            raise ValueError(f"train.importance_sampling.mode must be 'truncate' or 'mask', got {self.mode!r}")
        if not 0 <= self.veto <= self.lower <= 1 <= self.upper:
            raise ValueError(
                "train.importance_sampling needs 0 <= veto <= lower <= 1 <= upper, got "
                f"veto={self.veto}, lower={self.lower}, upper={self.upper}"
            )


@dataclass
class OptimizerSettings:
    """``train.optimizer``: AdamW through megatron-core's optimizer, LR schedule per rollout step."""

    lr: float = 1e-6
    min_lr: float = 0.0
    warmup_steps: int = 20
    schedule: str = "constant"  # constant | linear | cosine (decay after warm-up, over train.steps)
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def validate(self) -> None:
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"train.optimizer needs 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"train.optimizer.schedule must be constant|linear|cosine, got {self.schedule!r}")
        if self.warmup_steps < 0:
            raise ValueError(f"train.optimizer.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass
class TrainConfig:
    """The ``train:`` section: steps, batching and numerics of the update."""

    steps: int = 10
    seed: int = 1234
    mini_batches: int = 1
    micro_batch_tokens: int = 4096  # per micro-batch, before the context-parallel split
    packing: str = "thd"  # thd: padding-free packed sequences | padded: right-padded rows
    bf16: bool = False
    kl_chunk_size: int = 1024
    reference_offload: bool = False
    recompute: Optional[str] = None  # None | "selective" | "full"
    selfcheck_tolerance: float = 1e-4  # step-0 policy == reference check; < 0 disables it
    optimizer: OptimizerSettings = field(default_factory=OptimizerSettings)
    importance_sampling: ImportanceSamplingConfig = field(default_factory=ImportanceSamplingConfig)

    def validate(self) -> None:
        for key in ("steps", "mini_batches", "micro_batch_tokens", "kl_chunk_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"train.{key} must be >= 1, got {getattr(self, key)}")
        if self.packing not in ("thd", "padded"):
            raise ValueError(f"train.packing must be 'thd' or 'padded', got {self.packing!r}")
        if self.recompute not in (None, "selective", "full"):
            raise ValueError(f"train.recompute must be null, 'selective' or 'full', got {self.recompute!r}")


def check_context_parallel(parallel: ParallelConfig, train: TrainConfig, algorithm, diagnostics: bool) -> None:
    """Refuse what context parallelism cannot do (each response is spread over the CP ranks).

    ``algorithm``: a built registry Algorithm; ``diagnostics``: whether diagnostics will run.
    Raises ValueError naming the key; a no-op when ``parallel.context == 1``.
    """
    if parallel.context == 1:
        return
    if train.packing != "thd":
        raise ValueError("parallel.context > 1 needs train.packing = 'thd' (sequences are split into "
                         "2*CP load-balanced chunks of a packed micro-batch)")
    if not algorithm.token_separable:
        raise ValueError(
            f"parallel.context > 1 needs a loss that is a sum over tokens; algorithm {algorithm.name!r} "
            f"(algorithm.agg={algorithm.config.agg!r}, algorithm.f1_control={algorithm.config.f1_control!r}) "
            "needs whole responses on one rank (use agg token-mean or seq-mean-token-sum, and no match_masked_norm)")
    if diagnostics:
        raise ValueError("diagnostics need whole responses on one rank: set diagnostics.enabled = false "
                         "with parallel.context > 1")


@dataclass
class RolloutPlan:
    """Which samples this rank trains on: per mini-batch, this DP rank's indices."""

    minibatches: List[List[int]]  # global indices per mini-batch
    mine: List[List[int]]  # this DP rank's share of each mini-batch

    @property
    def my_indices(self) -> List[int]:
        return sorted(i for share in self.mine for i in share)


@dataclass
class TokenStats:
    """Per-response token vectors from the experience pass (last pipeline stage only); with context
    parallelism, of this rank's tokens of the response (``token_index`` says which)."""

    old_logprob: torch.Tensor  # [R] log pi_old(y_t) at the sampling temperature
    ref_logprob: torch.Tensor  # [R] log pi_ref(y_t) at the sampling temperature (k1 = old - ref)
    entropy: torch.Tensor  # [R] entropy of pi_old at the sampling temperature
    kl: torch.Tensor  # [R] conditional KL(pi_old || pi_ref) over the full vocabulary, temperature 1
    token_index: torch.Tensor  # [R] int64 positions in the response (all of them without context parallelism)


class MetricAccumulator:
    """Sums and counts of named metrics, reduced over the whole world in one all-reduce."""

    def __init__(self):
        self.sums: Dict[str, float] = {}
        self.counts: Dict[str, float] = {}
        self.maxima: Dict[str, float] = {}

    def add(self, name: str, total: float, count: float = 1.0) -> None:
        self.sums[name] = self.sums.get(name, 0.0) + float(total)
        self.counts[name] = self.counts.get(name, 0.0) + float(count)

    def add_max(self, name: str, value: float) -> None:
        self.maxima[name] = max(self.maxima.get(name, -math.inf), float(value))

    def reduce(self, contribute: bool) -> Dict[str, float]:
        """Global means (sum of totals / sum of counts) and maxima of every metric any rank added.

        Ranks with ``contribute=False`` add nothing (e.g. TP replicas of the same values). The
        metric names are unioned over ranks first, so ranks may have added different ones.
        """
        import torch.distributed as dist

        local = (sorted(self.sums), sorted(self.maxima)) if contribute else ([], [])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, local)
        names_sum = sorted({n for names, _ in everyone for n in names})
        names_max = sorted({n for _, names in everyone for n in names})
        sums = torch.tensor([[self.sums.get(n, 0.0), self.counts.get(n, 0.0)] for n in names_sum] + [[0.0, 0.0]],
                            dtype=torch.float64)
        maxima = torch.tensor([self.maxima.get(n, -math.inf) for n in names_max] + [-math.inf], dtype=torch.float64)
        if not contribute:
            sums.zero_()
            maxima.fill_(-math.inf)
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        sums, maxima = sums.to(device), maxima.to(device)
        dist.all_reduce(sums)
        dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
        out = {n: (sums[i, 0] / sums[i, 1]).item() if sums[i, 1] > 0 else float("nan") for i, n in enumerate(names_sum)}
        out.update({n: maxima[i].item() for i, n in enumerate(names_max)})
        return out


@dataclass
class LossInputs:
    """One micro-batch's loss inputs; token tensors are right-padded rows [b, T].

    ``logprob`` carries gradients to the policy (current parameters, sampling temperature);
    ``old_logprob``/``ref_logprob`` are from the experience pass; ``mask`` marks trainable
    response tokens; ``coefficients`` [b] are the rollout's frozen ones; ``normalizer`` is the
    global denominator of the mini-batch; ``current_kl`` (differentiable) only when the
    reference ran alongside; ``token_weight`` is the importance-sampling correction or None.
    """

    sample_indices: List[int]
    logprob: torch.Tensor
    old_logprob: torch.Tensor
    ref_logprob: torch.Tensor
    mask: torch.Tensor
    coefficients: torch.Tensor
    normalizer: float
    current_kl: Optional[torch.Tensor]
    token_weight: Optional[torch.Tensor]
    group_ids: torch.Tensor


def importance_weights(old_logprob, rollout_logprob, mask, config: ImportanceSamplingConfig, any_rank=None):
    """Truncated importance-sampling weights pi_old / pi_rollout per token, [N, T] -> [N, T].

    ``mask`` marks response tokens. Sequences with any token ratio below ``config.veto`` get
    weight 0; "truncate" clamps the rest into [lower, upper], "mask" zeroes tokens outside it.
    ``any_rank`` ([N] bool -> [N] bool), when given, ORs the veto over the ranks holding the
    other tokens of the same sequences (context parallelism).
    """
    ratio = torch.exp((old_logprob - rollout_logprob).clamp(max=20.0)) * mask
    vetoed = ((ratio < config.veto) & (mask > 0)).any(dim=-1)
    if any_rank is not None:
        vetoed = any_rank(vetoed)
    vetoed = vetoed.unsqueeze(-1)
    if config.mode == "truncate":
        weight = ratio.clamp(config.lower, config.upper)
    else:
        weight = torch.where((ratio >= config.lower) & (ratio <= config.upper), torch.ones_like(ratio), torch.zeros_like(ratio))
    return torch.where(vetoed, torch.zeros_like(weight), weight) * mask


def _token_stats(hidden, weight, targets, ref_hidden=None, ref_weight=None, *, vocab_size, chunk_size, temperature):
    """Fused vocab-parallel statistics over this rank's shard (see megatron_zcpo.ops).

    Log-probs and entropy at the sampling ``temperature`` (the distribution the rollout drew
    from); the conditional KL between the models themselves (temperature 1).
    """
    from megatron.core import parallel_state as ps

    from megatron_zcpo.ops import fused_token_stats

    return fused_token_stats(
        hidden, weight, targets, ref_hidden, ref_weight,
        group=ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None,
        vocab_size=vocab_size, chunk_size=chunk_size, temperature=temperature, kl_temperature=1.0,
    )


class PolicyTrainer:
    """Policy + frozen reference on megatron-core, trained by a registered RL algorithm.

    Call :func:`megatron_zcpo.setup_megatron` first. ``initial_weights`` (a global state dict, see
    :mod:`megatron_zcpo.megatron.weights`, or a model checkpoint directory, see
    :mod:`megatron_zcpo.megatron.checkpoint`) initialises the policy, and the reference unless
    ``reference_weights`` is given; without either, both start from the same seeded random
    initialisation. ``temperature`` is the rollout's sampling temperature: log-probs are those of
    the distribution the engine sampled from. ``diagnostics`` (see megatron_zcpo.diagnostics) has
    ``due(step) -> bool`` and ``run(trainer, samples, plan, experience, coefficients, stats) ->
    dict``; when due, it runs between calibration and the update, on every rank.
    """

    def __init__(
        self,
        model_config: ModelConfig,
        algorithm_config,
        train: TrainConfig,
        parallel: ParallelConfig,
        *,
        initial_weights: Union[Dict[str, torch.Tensor], str, os.PathLike, None] = None,
        reference_weights: Union[Dict[str, torch.Tensor], str, os.PathLike, None] = None,
        temperature: float = 1.0,
        diagnostics=None,
    ):
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        from megatron_zcpo.algorithms import build_algorithm
        from megatron_zcpo.megatron.checkpoint import load_model_checkpoint
        from megatron_zcpo.megatron.weights import gather_global_state_dict, load_global_state_dict

        if parallel.sequence_parallel and not torch.cuda.is_available():
            raise ValueError("parallel.sequence_parallel needs GPUs with Transformer Engine "
                             "(megatron-core's CPU layer spec has no sequence-parallel norms)")
        self.algorithm = build_algorithm(algorithm_config)
        check_context_parallel(parallel, train, self.algorithm, diagnostics is not None)
        self.model_config = model_config
        self.train_config = train
        self.parallel = parallel
        self.temperature = float(temperature)
        self.step = 0
        self.last_coefficients: Optional[torch.Tensor] = None
        self.diagnostics = diagnostics
        self.reference_is_initial_policy = reference_weights is None
        dtype = torch.bfloat16 if train.bf16 else torch.float32
        self.config = transformer_config(
            model_config, tensor_parallel=parallel.tensor, pipeline_parallel=parallel.pipeline,
            context_parallel=parallel.context, sequence_parallel=parallel.sequence_parallel,
            params_dtype=dtype, recompute=train.recompute,
        )
        policy = build_gpt_model(model_config, self.config)
        reference = build_gpt_model(model_config, self.config)
        if initial_weights is None:
            # Same starting point for both: the reference is the initial policy.
            initial_weights = gather_global_state_dict(policy)
        for model, source in ((policy, initial_weights),
                              (reference, initial_weights if reference_weights is None else reference_weights)):
            if isinstance(source, dict):
                load_global_state_dict(model, source)
            else:  # a model checkpoint directory: each rank reads only its own shard
                load_model_checkpoint(model, source)
        for model in (policy, reference):
            install_hidden_state_head(model)
        if train.bf16:
            # megatron's mixed precision: the whole module in bf16 (norms included), inputs cast on
            # the first stage; the last stage keeps its bf16 hidden states (fp32_output=False): the
            # fused op computes exact fp32 logits from bf16 operands, as the output layer would see.
            from megatron.core.transformer.module import Float16Module

            policy, reference = Float16Module(self.config, policy), Float16Module(self.config, reference)
        self.forward_kwargs = {"fp32_output": False} if train.bf16 else {}
        reference.eval()
        for param in reference.parameters():
            param.requires_grad_(False)
        self.reference = reference
        self.policy = DistributedDataParallel(
            self.config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=parallel.distributed_optimizer),
            policy,
        )
        self.config.finalize_model_grads_func = finalize_model_grads
        self.config.no_sync_func = self.policy.no_sync
        opt = train.optimizer
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam", lr=opt.lr, min_lr=opt.min_lr, weight_decay=opt.weight_decay,
                adam_beta1=opt.adam_beta1, adam_beta2=opt.adam_beta2, adam_eps=opt.adam_eps,
                clip_grad=opt.clip_grad, bf16=train.bf16, params_dtype=dtype,
                use_distributed_optimizer=parallel.distributed_optimizer,
            ),
            [self.policy],
        )
        decay_steps = max(train.steps, opt.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if opt.warmup_steps else opt.lr, max_lr=opt.lr, min_lr=opt.min_lr,
            lr_warmup_steps=opt.warmup_steps, lr_decay_steps=decay_steps,
            lr_decay_style=opt.schedule, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=decay_steps, wd_incr_style="constant",
        )
        self.scheduler.step(0)
        self.is_last_stage = ps.is_pipeline_last_stage()
        self.dp_size = ps.get_data_parallel_world_size()
        self.dp_rank = ps.get_data_parallel_rank()
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        # Only one replica of every value reports metrics (TP ranks compute the same numbers;
        # context-parallel ranks hold disjoint tokens, so they all report).
        self.reports_metrics = self.is_last_stage and ps.get_tensor_model_parallel_rank() == 0
        # Values every rank of a (DP x CP) replica knows whole (coefficients) are counted once.
        self.counts_once = self.dp_rank == 0 and self.cp_rank == 0

    # ----------------------------------------------------------------------------- planning
    def plan(self, samples: Sequence[RolloutSample]) -> RolloutPlan:
        """Split the rollout into group-whole mini-batches and deal them to DP ranks."""
        lengths = [s.sequence_length for s in samples]
        groups = len({s.group_id for s in samples})
        wanted = self.train_config.mini_batches
        # Dynamic sampling can return fewer groups (or samples) than planned: use as many
        # mini-batches as keep every DP rank busy.
        count = max(1, min(wanted, groups, len(samples) // self.dp_size))
        group_ids = [s.group_id for s in samples]
        minibatches = split_minibatches(group_ids, count)
        whole = self.algorithm.needs_whole_groups
        mine = [assign_data_parallel(units_of(mb, group_ids, whole), lengths, self.dp_size)[self.dp_rank]
                for mb in minibatches]
        return RolloutPlan(minibatches=minibatches, mine=mine)

    def _micro_batches(self, samples, indices) -> List[MicroBatch]:
        """This rank's micro-batches of ``indices`` under the token budget, on the model's device.

        Deterministic in (samples, indices): the experience pass and every update see the same
        micro-batches, so per-token statistics line up (on a CP rank: its chunks of each response).
        """
        units = units_of(indices, [s.group_id for s in samples], self.algorithm.needs_whole_groups)
        budget = self.train_config.micro_batch_tokens
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        if self.train_config.packing == "padded":
            lengths = [s.sequence_length for s in samples]
            return [collate(samples, chunk).to(device) for chunk in pack_micro_batches(units, lengths, budget)]
        lengths = [packed_length(s.sequence_length, self.cp_size) for s in samples]
        return [collate_packed(samples, chunk, self.cp_rank, self.cp_size).to(device)
                for chunk in pack_micro_batches(units, lengths, budget, padded=False)]

    # ----------------------------------------------------------------------------- experience
    def _set_reference_device(self, device: str) -> None:
        if self.train_config.reference_offload and torch.cuda.is_available():
            self.reference.to(device)

    @torch.no_grad()
    def experience(self, samples: Sequence[RolloutSample], plan: RolloutPlan) -> Dict[int, TokenStats]:
        """Per-token statistics at the sampling snapshot for this rank's samples.

        Returns {sample index: TokenStats} on the last pipeline stage, {} elsewhere.
        """
        self._set_reference_device("cuda")
        model = PolicyWithReference(self.policy, self.reference)
        hidden_size = self.config.hidden_size
        results: Dict[int, TokenStats] = {}

        def forward_step(mb: MicroBatch, m):
            output = m(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **self.forward_kwargs)

            def loss_func(hidden_pair):
                positions = mb.response_positions
                flat = hidden_pair.reshape(-1, 2 * hidden_size).index_select(0, positions)
                hidden, ref_hidden = flat.split(hidden_size, dim=-1)
                targets = mb.targets.reshape(-1).index_select(0, positions)
                stats = _token_stats(hidden, output_weight(self.policy), targets, ref_hidden, output_weight(self.reference),
                                     vocab_size=self.model_config.vocab_size,
                                     chunk_size=self.train_config.kl_chunk_size, temperature=self.temperature)
                offset = 0
                for index, length in zip(mb.sample_indices, mb.response_lengths):
                    span = slice(offset, offset + length)
                    results[index] = TokenStats(
                        stats.logprob[span].float().cpu(), stats.ref_logprob[span].float().cpu(),
                        stats.entropy[span].float().cpu(), stats.kl[span].float().cpu(),
                        mb.response_token_index[span],
                    )
                    offset += length
                return torch.zeros((), device=hidden_pair.device), {}

            return output, loss_func

        model.eval()
        run_schedule(model, self._micro_batches(samples, plan.my_indices), forward_step, forward_only=True)
        model.train()
        self.reference.eval()
        self._set_reference_device("cpu")
        return results

    # ----------------------------------------------------------------------------- calibration
    def calibrate(self, samples: Sequence[RolloutSample], experience: Dict[int, TokenStats]):
        """Per-response coefficients for the whole rollout, frozen until the next rollout.

        The per-response sums (conditional KL, k1) of every DP rank's samples are all-gathered
        over the data-parallel group (and summed over context-parallel ranks, which each hold a
        piece of every sequence); rewards, groups and lengths are known everywhere. Returns
        (coefficients [N] float32 on the last stage or None elsewhere, ResponseStats or None).
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from megatron_zcpo.algorithms import ResponseStats

        if not self.is_last_stage:
            return None, None
        n = len(samples)
        sums = torch.zeros(n, 2, dtype=torch.float64)
        for index, stats in experience.items():
            sums[index, 0] = stats.kl.double().sum()
            sums[index, 1] = (stats.old_logprob.double() - stats.ref_logprob.double()).sum()
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        sums = sums.to(device)
        # Each sample lives on exactly one DP rank (zeros elsewhere), so a SUM is a gather.
        dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        sums = sums.cpu()
        stats = ResponseStats(
            group_ids=torch.tensor([s.group_id for s in samples], dtype=torch.long),
            rewards=torch.tensor([s.reward for s in samples], dtype=torch.float64),
            lengths=torch.tensor([len(s.response_ids) for s in samples], dtype=torch.float64),
            kl_sum=sums[:, 0],
            k1_sum=sums[:, 1],
        )
        return self.algorithm.coefficients(stats).float(), stats

    # ----------------------------------------------------------------------------- update
    def normalizer(self, samples, indices) -> float:
        """Global denominator of the loss aggregation over one mini-batch (all DP ranks)."""
        counted = [len(samples[i].response_ids) for i in indices if samples[i].trainable]
        if self.algorithm.normalizer_unit == "tokens":
            return float(sum(counted))
        return float(sum(1 for c in counted if c > 0))  # seq-mean modes: sequences with a token

    def _any_over_context_parallel(self, flags: torch.Tensor) -> torch.Tensor:
        """[N] bool ORed over the context-parallel group (identity without CP). Collective over CP."""
        if self.cp_size == 1:
            return flags
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        counts = flags.to(torch.float32)
        dist.all_reduce(counts, group=ps.get_context_parallel_group())
        return counts > 0

    def _rows(self, flat: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        """Flat response-token vector [R_total] -> right-padded rows [b, max(lengths)]."""
        return torch.nn.utils.rnn.pad_sequence(list(flat.split(list(lengths))), batch_first=True)

    def _loss_inputs(self, mb: MicroBatch, hidden_out, samples, experience, coefficients, normalizer,
                     use_reference: bool) -> "LossInputs":
        """The loss inputs of one micro-batch from the last stage's hidden states (policy, or both)."""
        hidden_size = self.config.hidden_size
        vocab_size, chunk = self.model_config.vocab_size, self.train_config.kl_chunk_size
        positions = mb.response_positions
        width = 2 * hidden_size if use_reference else hidden_size
        flat = hidden_out.reshape(-1, width).index_select(0, positions)
        targets = mb.targets.reshape(-1).index_select(0, positions)
        weight = output_weight(self.policy)
        lengths = mb.response_lengths
        current_kl = None
        if use_reference:
            hidden, ref_hidden = flat.split(hidden_size, dim=-1)
            current = _token_stats(hidden, weight, targets, ref_hidden, output_weight(self.reference),
                                   vocab_size=vocab_size, chunk_size=chunk, temperature=self.temperature)
            current_kl = self._rows(current.kl, lengths)
        else:
            current = _token_stats(flat, weight, targets, vocab_size=vocab_size, chunk_size=chunk,
                                   temperature=self.temperature)
        stats = [experience[i] for i in mb.sample_indices]
        device = flat.device  # the experience pass's statistics are kept on the CPU between passes
        old = self._rows(torch.cat([s.old_logprob for s in stats]), lengths).to(device)
        mask = self._rows(torch.cat([torch.full((n,), float(samples[i].trainable))
                                     for i, n in zip(mb.sample_indices, lengths)]), lengths).to(device)
        token_weight = None
        is_config = self.train_config.importance_sampling
        if is_config.enabled and mb.rollout_logprobs is not None and self.algorithm.supports_token_weight:
            rollout = self._rows(mb.rollout_logprobs, lengths).to(device)
            token_weight = importance_weights(old, rollout, mask, is_config, self._any_over_context_parallel)
        return LossInputs(
            sample_indices=list(mb.sample_indices),
            logprob=self._rows(current.logprob, lengths),
            old_logprob=old,
            ref_logprob=self._rows(torch.cat([s.ref_logprob for s in stats]), lengths).to(device),
            mask=mask,
            coefficients=coefficients[mb.sample_indices].to(device),
            normalizer=normalizer,
            current_kl=current_kl,
            token_weight=token_weight,
            group_ids=torch.tensor([samples[i].group_id for i in mb.sample_indices], dtype=torch.long, device=device),
        )

    def algorithm_loss(self, inputs: "LossInputs"):
        """The registered algorithm's loss on one micro-batch's inputs (AlgorithmLoss)."""
        return self.algorithm.loss(
            inputs.logprob, inputs.old_logprob, inputs.mask, inputs.coefficients,
            normalizer=inputs.normalizer, ref_logprob=inputs.ref_logprob, current_kl=inputs.current_kl,
            token_weight=inputs.token_weight,
            group_ids=inputs.group_ids if self.algorithm.needs_whole_groups else None,
        )

    def _backward(self, samples, indices, experience, coefficients, normalizer, loss_fn, *, use_reference: bool):
        """Forward-backward of ``loss_fn(LossInputs) -> (loss, report)`` over this rank's ``indices``.

        Gradients end up in the DDP grad buffers, reduced over data-parallel ranks, as for an
        update; returns the loss-func reports (last pipeline stage).
        """
        model = PolicyWithReference(self.policy, self.reference) if use_reference else self.policy
        micro_batches = self._micro_batches(samples, indices)
        scale = len(micro_batches) * self.dp_size  # undo megatron's 1/num_microbatches and DDP's 1/DP

        def forward_step(mb: MicroBatch, m):
            output = m(mb.tokens, mb.position_ids, None, packed_seq_params=mb.packed_seq_params, **self.forward_kwargs)

            def loss_func(hidden_out):
                inputs = self._loss_inputs(mb, hidden_out, samples, experience, coefficients, normalizer, use_reference)
                loss, report = loss_fn(inputs)
                return loss * scale, report

            return output, loss_func

        self.policy.zero_grad_buffer()
        self.optimizer.zero_grad()
        return run_schedule(model, micro_batches, forward_step, forward_only=False)

    def _diagnostics_hook(self, samples, plan, experience, coefficients, stats, out: Dict[str, float]):
        """A per-mini-batch callback running the diagnostics that need moved ratios (F1) into ``out``."""
        def before_minibatch(index: int) -> None:
            out.update(self.diagnostics.before_minibatch(self, samples, plan, experience, coefficients, stats, index))
        return before_minibatch

    def update(self, samples, plan: RolloutPlan, experience: Dict[int, TokenStats], coefficients,
               metrics: MetricAccumulator, before_minibatch=None):
        """One optimizer step per mini-batch with the frozen ``coefficients``; fills ``metrics``.

        ``before_minibatch(index)``, when given, runs before each mini-batch's backward (the
        diagnostics that need the ratios moved by earlier updates of this rollout).
        """
        use_reference = self.algorithm.needs_current_kl
        grad_norms = []
        if use_reference:
            self._set_reference_device("cuda")

        def loss_fn(inputs: LossInputs):
            result = self.algorithm_loss(inputs)
            # Loss terms are partial sums that add up (over micro-batches and DP ranks) to the
            # mini-batch's value; the other metrics are per-token fractions.
            tokens = float(inputs.mask.sum())
            report = {"loss": (float(result.loss.detach()), 0.0)}
            for name, value in result.metrics.items():
                value = float(value)
                report[name] = (value, 0.0) if name.endswith("loss") else (value * tokens, tokens)
            return result.loss, report

        for index, (minibatch, my_share) in enumerate(zip(plan.minibatches, plan.mine)):
            if before_minibatch is not None:
                before_minibatch(index)
            reports = self._backward(samples, my_share, experience, coefficients, self.normalizer(samples, minibatch),
                                     loss_fn, use_reference=use_reference)
            _, grad_norm, _ = self.optimizer.step()
            grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
            for report in reports:
                for name, (total, count) in report.items():
                    metrics.add(f"update/{name}", total, count)
                    if name.endswith("loss") and self.counts_once:
                        metrics.add(f"update/{name}", 0.0, 1.0 / len(reports))  # mean over mini-batches
        if use_reference:
            self._set_reference_device("cpu")
        for norm in grad_norms:
            metrics.add_max("update/grad_norm_max", norm)
        metrics.add("update/grad_norm", sum(grad_norms), len(grad_norms))
        self.scheduler.step(1)
        self.step += 1
        return grad_norms

    # ----------------------------------------------------------------------------- gradient probes
    def gradient_vector(self, samples, indices, experience, coefficients, normalizer, loss_fn,
                        *, use_reference: bool = False) -> torch.Tensor:
        """This rank's share of the parameter gradient of a custom loss, as one flat fp32 vector.

        ``loss_fn(LossInputs) -> scalar`` is evaluated on every micro-batch of this rank's
        ``indices`` (normalise with ``inputs.normalizer``, the global ``normalizer``). The
        gradient is reduced over data-parallel ranks; the vector holds the parameters this rank
        owns in the model-parallel group (no TP duplicates, no second copy of a tied embedding),
        so :meth:`gradient_dot` of two such vectors is the full-model inner product. The update's
        gradient buffers are zeroed afterwards: probes never reach an optimizer step. Collective.
        """
        from megatron.core import tensor_parallel

        from megatron_zcpo.megatron.pipeline import unwrap

        self._backward(samples, indices, experience, coefficients, normalizer,
                       lambda inputs: (loss_fn(inputs), {}), use_reference=use_reference)
        self.policy.finish_grad_sync()
        pieces = []
        gpt = unwrap(self.policy)
        tied_copy = gpt.share_embeddings_and_output_weights and not gpt.pre_process
        for name, param in gpt.named_parameters():
            if not tensor_parallel.param_is_not_tensor_parallel_duplicate(param):
                continue
            if tied_copy and name == "output_layer.weight":
                continue
            grad = getattr(param, "main_grad", None)
            pieces.append((grad if grad is not None else torch.zeros_like(param)).detach().float().reshape(-1).clone())
        self.policy.zero_grad_buffer()
        self.optimizer.zero_grad()
        return torch.cat(pieces) if pieces else torch.zeros(0)

    @staticmethod
    def gradient_dot(a: torch.Tensor, b: torch.Tensor) -> float:
        """Full-model inner product of two :meth:`gradient_vector` results (all-reduced over TP x PP)."""
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        value = (a.double() * b.double()).sum().reshape(1)
        if torch.cuda.is_available():
            value = value.cuda()
        dist.all_reduce(value, group=ps.get_model_parallel_group())
        return float(value)

    # ----------------------------------------------------------------------------- one step
    def train_step(self, samples: Sequence[RolloutSample]) -> Dict[str, float]:
        """Experience -> calibration -> updates on one rollout; returns global metrics (every rank).

        The rollout's frozen coefficients stay available as ``last_coefficients`` ([N] on the last
        pipeline stage, None elsewhere).
        """
        from megatron_zcpo.algorithms.metrics import coefficient_metrics

        if not samples:
            raise ValueError("train_step needs at least one sample")
        metrics = MetricAccumulator()
        timings = {}
        started = time.perf_counter()
        plan = self.plan(samples)
        experience = self.experience(samples, plan)
        timings["time/experience"] = time.perf_counter() - started
        selfcheck = self._selfcheck(experience) if self.step == 0 and self.reference_is_initial_policy else {}

        started = time.perf_counter()
        coefficients, stats = self.calibrate(samples, experience)
        self.last_coefficients = coefficients
        if self.is_last_stage:
            self._experience_metrics(samples, experience, metrics)
            if self.counts_once:  # coefficients are identical on every DP and CP rank: count once
                for name, value in coefficient_metrics(stats, coefficients, self.algorithm.config).items():
                    metrics.add(f"coef/{name}", value, 1.0)
        timings["time/calibrate"] = time.perf_counter() - started

        diagnostics = {}
        due = self.diagnostics is not None and self.diagnostics.due(self.step)
        if due:
            started = time.perf_counter()
            diagnostics = self.diagnostics.run(self, samples, plan, experience, coefficients, stats)
            timings["time/diagnostics"] = time.perf_counter() - started

        started = time.perf_counter()
        self.update(samples, plan, experience, coefficients, metrics,
                    before_minibatch=self._diagnostics_hook(samples, plan, experience, coefficients, stats,
                                                            diagnostics) if due else None)
        timings["time/update"] = time.perf_counter() - started
        out = metrics.reduce(contribute=self.reports_metrics)
        out.update(selfcheck)
        out.update(diagnostics)
        out.update(timings)
        out["train/lr"] = self.optimizer.param_groups[0]["lr"]
        out["train/step"] = self.step
        trained_tokens = sum(len(s.response_ids) + len(s.prompt_ids) for s in samples)
        out["train/tokens_per_s"] = trained_tokens / max(timings["time/experience"] + timings["time/update"], 1e-9)
        return out

    def _selfcheck(self, experience: Dict[int, TokenStats]) -> Dict[str, float]:
        """Step-0 check (as slime does): policy == reference must give KL 0 and equal log-probs.

        Raises RuntimeError with the measured values when either exceeds
        ``train.selfcheck_tolerance`` (a negative tolerance disables the check).
        """
        import torch.distributed as dist

        worst = torch.zeros(2, dtype=torch.float64)
        for stats in experience.values():
            if stats.kl.numel():
                worst[0] = max(worst[0], stats.kl.abs().max().double())
                worst[1] = max(worst[1], (stats.old_logprob - stats.ref_logprob).abs().max().double())
        if torch.cuda.is_available():
            worst = worst.cuda()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        kl_max, gap_max = worst.tolist()
        tolerance = self.train_config.selfcheck_tolerance
        if tolerance >= 0 and (kl_max > tolerance or gap_max > tolerance):
            raise RuntimeError(
                f"step-0 self-check failed: with policy == reference the conditional KL should be 0 and the "
                f"log-probs equal, but max KL = {kl_max:.3e} and max |logprob - ref_logprob| = {gap_max:.3e} "
                f"(train.selfcheck_tolerance = {tolerance}); the two models do not compute the same thing"
            )
        return {"selfcheck/kl_max": kl_max, "selfcheck/logprob_gap_max": gap_max}

    def _experience_metrics(self, samples, experience: Dict[int, TokenStats], metrics: MetricAccumulator) -> None:
        """Token-level KL / entropy / k3 and the trainer-vs-rollout log-prob gap of this rank."""
        if not self.reports_metrics:
            return
        from megatron_zcpo.algorithms import kl_penalty

        for index, stats in experience.items():
            n = stats.kl.numel()
            if n == 0:
                continue
            metrics.add("experience/kl", stats.kl.sum(), n)
            metrics.add_max("experience/kl_max", stats.kl.max())
            metrics.add("experience/k3", kl_penalty(stats.old_logprob, stats.ref_logprob, "k3").sum(), n)
            metrics.add("experience/entropy", stats.entropy.sum(), n)
            gap = (stats.old_logprob - stats.ref_logprob).abs()
            metrics.add("experience/logprob_ref_gap", gap.sum(), n)
            metrics.add_max("experience/logprob_ref_gap_max", gap.max())
            rollout = samples[index].rollout_logprobs
            if rollout is not None and len(rollout) == len(samples[index].response_ids):
                rollout = torch.tensor(rollout, dtype=torch.float32)[stats.token_index]
                gap = (stats.old_logprob - rollout).abs()
                metrics.add("rollout/logprob_diff", gap.sum(), n)
                metrics.add_max("rollout/logprob_diff_max", gap.max())

    # ----------------------------------------------------------------------------- weights & state
    def global_state_dict(self) -> Dict[str, torch.Tensor]:
        """The whole policy as a global state dict (gathered over TP and PP; every rank)."""
        from megatron_zcpo.megatron.weights import gather_full_state_dict

        return gather_full_state_dict(self.policy)

    def save(self, root, extra_state: Optional[Dict[str, Any]] = None, keep_last: int = 2):
        """Checkpoint policy, optimizer, scheduler and ``extra_state`` (the loop's) under ``root``.

        Atomic and collective (see :mod:`megatron_zcpo.megatron.checkpoint`); returns its path.
        """
        from megatron_zcpo.megatron.checkpoint import save_checkpoint

        state = {"trainer_step": self.step, "scheduler": self.scheduler.state_dict(), **(extra_state or {})}
        return save_checkpoint(root, self.step, self.policy, self.optimizer, state, keep_last=keep_last)

    def load(self, path) -> Dict[str, Any]:
        """Resume from a checkpoint written by :meth:`save` (any TP/PP/DP layout); returns its state.

        A checkpoint of another model architecture is refused with the differing fields named.
        """
        from megatron_zcpo.megatron.checkpoint import load_checkpoint

        state = load_checkpoint(path, self.policy, self.optimizer)
        self.step = int(state["trainer_step"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state
